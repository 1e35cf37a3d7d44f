"""The `lifecycle` command: validate | explain | schema | policies | diff | run | timeline | verdict | diagnose | goodput.

User errors (bad policy, overrides, files, world size) print ``key.path: message (got VALUE)`` lines
and exit 2 — never a traceback; values are cut to ~200 characters and errors to a bounded number of
lines. ``validate``, ``explain``, ``schema``, ``policies`` and ``diff`` import neither torch nor megatron.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from lifecycle import rundir
from lifecycle.distributed.layout import MAX_WORLD_SIZE
from lifecycle.errors import ExitCode, LifecycleError, PolicyError, exit_code
from lifecycle.obs.logconfig import reader_may_leave, setup_logging

log = logging.getLogger("lifecycle")

MAX_ERROR_LINES = 60
MAX_LINE = 600


class Parser(argparse.ArgumentParser):
    """argparse, with its error messages cut: ``invalid int value: '<100,000 digits>'`` stays short."""

    def error(self, message: str) -> NoReturn:
        if len(message) > MAX_LINE:
            message = f"{message[:MAX_LINE]}... ({len(message)} characters in all)"
        super().error(message)


def _int_in(low: int, high: int, hint: str) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]; the error says the range and why."""

    def parse(text: str) -> int:
        try:
            value = int(text) if len(text) <= 24 else None
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}{hint} (got {shown!r})")
        return value

    return parse


def _policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config-dir", "-d", help="folder with your policy YAML (searched before the built-ins)")
    p.add_argument("--config-name", "-n", default="config", help="policy file name without .yaml")
    p.add_argument("overrides", nargs="*", help="Hydra overrides: key=value, +key=value, ~key, group=option")


DIFF_HELP = """Compare two resolved policies (schema defaults included) and print `key.path: A -> B` lines.

Each of A and B is ONE shell argument: an optional config name (a first word without `=`, as
--config-name) and Hydra overrides. Trailing OVERRIDES apply to both sides, before each side's own.
Exit 0 when equal, 1 when they differ, 2 when a side is not a valid policy (like diff(1)).

  lifecycle diff preset=moe preset=moe_large
  lifecycle diff preset=moe_large "preset=moe_large checkpoint.async=false parallelism.ep=8"
  lifecycle diff -d examples/policies house "house parallelism.ep=4" run.id=ci
"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lifecycle", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="validate a policy; exit 0, or 2 with every error")
    p.add_argument("--print", "-p", action="store_true", dest="show",
                   help="print the resolved policy as YAML (every key, schema defaults included)")
    p.add_argument("--world-size", "-w", type=_int_in(1, MAX_WORLD_SIZE, ""),
                   help="also check the plan at this world size: the layout, the open-file limit, the store budget")
    p.add_argument("--ranks-per-node", type=_int_in(1, 1 << 16, ""), default=8, metavar="N",
                   help="ranks per node at that world size (default 8)")
    _policy_args(p)
    p = sub.add_parser("explain", help="print the plan and the group layout of one rank")
    p.add_argument("--world-size", "-w", type=_int_in(1, MAX_WORLD_SIZE, ", the largest world size torch "
                                                      "supports"),
                   help=f"compute the group layout for this world size (1 to {MAX_WORLD_SIZE})")
    p.add_argument("--rank", "-r", type=_int_in(0, MAX_WORLD_SIZE - 1, ""), default=0,
                   help="rank whose groups are shown (default 0; needs --world-size)")
    p.add_argument("--ranks-per-node", type=_int_in(1, 1 << 16, ""), default=8, metavar="N",
                   help="ranks (GPUs) per node, for the communicator memory estimate (default 8)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _policy_args(p)
    sub.add_parser("schema", help="JSON Schema of the policy (for editors)")
    p = sub.add_parser("policies", help="every preset and config, where it comes from (built-in, pack, "
                       "your dir), its description; handler kinds; installed packs")
    p.add_argument("--config-dir", "-d", help="also list the configs in this folder (searched first)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("diff", help="the resolved difference between two policies, by key path; exit 0 when "
                       "equal, 1 when they differ", description=DIFF_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help='policy A: "[CONFIG_NAME] [OVERRIDE ...]" as one argument ("" = default)')
    p.add_argument("b", help="policy B, same form")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _policy_args(p)
    p = sub.add_parser("run", help="run the lifecycle: local ranks, or this rank under torchrun/srun")
    p.add_argument("--nproc", type=int, default=4, help="local ranks to start (ignored under torchrun/srun); at most "
                   "the visible GPUs for nccl, for gloo max(8, 4 x CPUs) and what the memory holds at ~0.5 GiB per "
                   "rank plus the model")
    p.add_argument("--oversubscribe", action="store_true",
                   help="start --nproc ranks even above what this machine runs (see --nproc)")
    _policy_args(p)
    p = sub.add_parser("verdict", help="the exit code a run's ranks ended with, as a scheduler should act on it "
                       "(torchrun exits 1 for any failed worker): prints one line, exits with that code")
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("--unfinished-code", type=_int_in(1, 255, ""), metavar="N",
                   help="exit N instead of 0 when every rank exited 0 but a stop signal saved the run before its last "
                        "step (a preemption: a launch script requeues it; examples/slurm.sbatch uses 75)")
    p = sub.add_parser("goodput", help="where a run's wall time went over all its attempts: productive steps, lost "
                       "work, start-up, checkpoints, restore, detection, teardown, relaunch (docs/goodput.md)")
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("--json", action="store_true", help="machine-readable output (stable keys)")
    p = sub.add_parser("timeline", help="merge a run's per-rank events into a Chrome/Perfetto trace and a PNG")
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("--out", "-o", help="trace file (default RUN_DIR/trace.json; .json.gz compresses)")
    p.add_argument("--png", help="Gantt chart of the phases (default RUN_DIR/timeline.png; needs matplotlib)")
    p.add_argument("--no-png", action="store_true", help="write the trace only")
    p = sub.add_parser("diagnose", help="name the culprit rank, group and op of any failed job from its logs, "
                       "Flight Recorder dumps and error files (offline)")
    p.add_argument("paths", nargs="+", metavar="PATH", help="log files, dumps, error files, folders (any mix)")
    p.add_argument("--json", action="store_true", help="machine-readable output (stable keys)")
    p.add_argument("--world-size", "-w", type=_int_in(1, MAX_WORLD_SIZE, ""),
                   help="with --override/--config-*: map groups to dimensions with this policy's layout")
    p.add_argument("--override", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="a policy override for the layout (repeatable), e.g. -o parallelism.tp=8")
    p.add_argument("--config-dir", "-d", help="folder with your policy YAML (for the layout)")
    p.add_argument("--config-name", "-n", default="config", help="policy file name without .yaml")
    return parser


def _validate(args: argparse.Namespace) -> int:
    from lifecycle.policy.load import load, sha256

    loaded = load(args.overrides, config_dir=args.config_dir, config_name=args.config_name)
    p = loaded.policy
    if args.show:
        import yaml

        from lifecycle.policy.load import to_plain

        print(f"# {loaded.source} (sha256 {sha256(p)[:12]})" + (f" + {' '.join(args.overrides)}"[:300]
                                                                if args.overrides else ""))
        print(yaml.safe_dump(to_plain(p), sort_keys=False), end="")
        return ExitCode.OK
    if args.world_size is not None:
        from lifecycle.machine.cost import limits
        from lifecycle.machine.explain import layout_for

        limits(p, layout_for(loaded, args.world_size), min(args.ranks_per_node, args.world_size))
    print(f"ok: {loaded.source} (sha256 {sha256(p)[:12]}) train={p.train.kind}x{p.train.steps} "
          f"tp={p.parallelism.tp} pp={p.parallelism.pp} ep={p.parallelism.ep} "
          f"warmup={len(p.warmup.ops)} ops checkpoint every {p.checkpoint.every_steps or 'never'}")
    return ExitCode.OK


def _explain(args: argparse.Namespace) -> int:
    from lifecycle.machine.explain import explain, render
    from lifecycle.policy.load import load

    loaded = load(args.overrides, config_dir=args.config_dir, config_name=args.config_name)
    info = explain(loaded, args.world_size, args.rank, args.ranks_per_node)
    print(json.dumps(info, indent=1) if args.json else render(info))
    return ExitCode.OK


def _policies(args: argparse.Namespace) -> int:
    from lifecycle.policy import catalog, registry
    from lifecycle.policy.packs import installed_packs
    from lifecycle.policy.roots import config_roots

    packs = installed_packs()
    entries = catalog.catalog(config_roots(args.config_dir, packs))
    kinds = registry.all_specs("train")
    print(json.dumps(catalog.as_dict(entries, packs, kinds), indent=1) if args.json
          else catalog.render(entries, packs, kinds))
    broken = [p for p in packs if p.error is not None]
    for pack in broken:
        print(f"error: pack {pack.name} ({pack.distribution} {pack.version}): {pack.error}", file=sys.stderr)
    unreadable = [e for e in entries if e.error is not None]
    for entry in unreadable[:MAX_ERROR_LINES]:
        print(_cut(f"error: {entry.error}"), file=sys.stderr)
    if len(unreadable) > MAX_ERROR_LINES:
        print(f"error: ... and {len(unreadable) - MAX_ERROR_LINES} more unreadable files", file=sys.stderr)
    return ExitCode.USAGE if broken or unreadable else ExitCode.OK


def _diff(args: argparse.Namespace) -> int:
    from lifecycle.policy.diff import diff, render

    result = diff(args.a, args.b, args.overrides, config_dir=args.config_dir, config_name=args.config_name)
    print(json.dumps(result.as_dict(), indent=1) if args.json else render(result, args.a, args.b, args.overrides))
    return 1 if result.changes else ExitCode.OK


def _schema(args: argparse.Namespace) -> int:
    from lifecycle.policy.jsonschema import policy_json_schema

    print(json.dumps(policy_json_schema(), indent=1))
    return ExitCode.OK


def _run(args: argparse.Namespace) -> int:
    from lifecycle.launch.runner import run

    return run(args.overrides, nproc=args.nproc, config_dir=args.config_dir, config_name=args.config_name,
               oversubscribe=args.oversubscribe)


def _verdict(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lifecycle.errors import RunDirError
    from lifecycle.obs import summary

    run_dir = Path(args.run_dir)
    if not (run_dir / rundir.EVENTS_DIR).is_dir():
        raise RunDirError(f"{run_dir}: no events/ folder: not a lifecycle run directory", path=str(run_dir))
    from lifecycle.recovery import exclusions

    info = summary.build(run_dir)
    code, line = summary.verdict(info)
    hosts = exclusions.record(run_dir, info) if code else []
    print(f"lifecycle: run {run_dir}: {line}" + (f"; hosts to exclude: {run_dir / exclusions.HOSTLIST}"
                                                  if hosts else ""), flush=True)
    if code == 0 and args.unfinished_code is not None and summary.unfinished(info):
        return int(args.unfinished_code)  # a launch script's cue: requeue it, it is not done
    return code


def _goodput(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lifecycle.errors import RunDirError
    from lifecycle.obs import goodput

    run_dir = Path(args.run_dir)
    if not (run_dir / rundir.EVENTS_DIR).is_dir():
        raise RunDirError(f"{run_dir}: no events/ folder: not a lifecycle run directory", path=str(run_dir))
    g = goodput.account(run_dir)
    if args.json:
        print(json.dumps(g.to_json(), indent=1))
        return ExitCode.OK
    print(f"goodput  {g.line()}")
    for name, seconds in g.buckets.items():
        share = seconds / g.wall_s if g.wall_s > 0 else 0.0
        print(f"  {name:<11} {seconds:9.2f}s  {share:6.1%}")
    return ExitCode.OK


def _timeline(args: argparse.Namespace) -> int:
    from lifecycle.obs.timeline import main as timeline_main

    return timeline_main(args.run_dir, out=args.out, png=args.png, no_png=args.no_png)


def _diagnose(args: argparse.Namespace) -> int:
    from lifecycle.diagnose.report import diagnose, layout_of

    layout = None
    if args.world_size:
        layout = layout_of(args.override, args.config_dir, args.config_name, args.world_size)
    result = diagnose(args.paths, layout=layout)
    print(json.dumps(result.as_json(), indent=1) if args.json else result.render())
    return ExitCode.OK


COMMANDS = {"validate": _validate, "explain": _explain, "schema": _schema, "policies": _policies, "diff": _diff,
            "run": _run, "timeline": _timeline, "verdict": _verdict, "diagnose": _diagnose, "goodput": _goodput}


def _cut(line: str) -> str:
    return line if len(line) <= MAX_LINE else f"{line[:MAX_LINE]}... ({len(line)} characters in all)"


def render_error(exc: LifecycleError) -> str:
    """The error as printed: every value cut to ~200 characters, at most :data:`MAX_ERROR_LINES` lines."""
    from lifecycle.policy.errors import clip_error

    text = str(clip_error(exc)) if isinstance(exc, PolicyError) else str(exc)
    lines = [_cut(line) for line in text.split("\n")]
    if len(lines) > MAX_ERROR_LINES:
        lines = [*lines[:MAX_ERROR_LINES], f"... and {len(lines) - MAX_ERROR_LINES} more lines"]
    return "\n".join(lines)


def _record_for_torchrun(exc: LifecycleError) -> None:
    """Under torchrun an error before the rank starts (bad policy, environment) reaches its summary too."""
    import os

    from lifecycle.rundir.elastic import ENV, record_failure

    if os.environ.get(ENV):
        rank = os.environ.get("RANK", "")
        record_failure(rank=int(rank) if rank.isdigit() else -1, error=type(exc).__name__, message=str(exc),
                       exit_code=exit_code(exc), phase=exc.phase or "before init", group=exc.group)


def _command(args: argparse.Namespace) -> int:
    """The command; a write the file system refused before any rank started (a full or read-only disk) is a
    one-line usage error naming the file, not a traceback."""
    from lifecycle.rundir.safeio import storage_error

    try:
        return COMMANDS[args.command](args)
    except OSError as exc:
        refused = storage_error(exc, {}, before_start=True)
        if refused is None:
            raise
        raise refused from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":  # a stop signal from here on is recorded and honoured, never lost nor fatal
        from lifecycle.machine.stops import record_early

        record_early()
    if args.command in ("run", "timeline"):  # `lifecycle run | head`: the job still runs to its end, with its code
        with reader_may_leave():
            return _main(args)
    return _main(args)


def console() -> NoReturn:
    """The `lifecycle` command (the console script and ``python -m lifecycle``): :func:`main`, then, where the command
    imported torch (`lifecycle run`: its ranks have ended, its files are closed), the process leaves without the
    interpreter's shutdown — half a second of torch's module teardown at the end of every launch, a preemption's
    requeue included — once what it printed is flushed."""
    code = main()
    if "torch" not in sys.modules:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader left (`lifecycle run | head`), or the stream is closed
            pass
    logging.shutdown()
    os._exit(code)


def _main(args: argparse.Namespace) -> int:
    setup_logging(args.verbose)
    try:
        return _command(args)
    except LifecycleError as exc:
        print(f"error: {render_error(exc)}", file=sys.stderr)
        _record_for_torchrun(exc)
        return exit_code(exc)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `lifecycle schema | head`: the reader left, not an error
        sys.stderr.close()
        return ExitCode.OK
