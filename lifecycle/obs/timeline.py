"""`lifecycle timeline RUN_DIR`: every rank's events merged into one Chrome trace-event / Perfetto JSON file,
plus a PNG Gantt chart of the phases per rank (with the optional ``plot`` extra, i.e. matplotlib).

Trace layout: one process per host (``pid`` = the host's index, named after the host; 0 on one machine)
and one track per rank (``tid`` = the global rank). Phases and spans (collectives, barriers, steps,
save/commit, teardown steps) are complete events (``"ph": "X"``) that nest per track; barrier releases,
fault drills, failures, hang reports and exits are instants (``"ph": "i"``); scalars and the step loss are
counters. Timestamps are µs since the earliest event of the run. Open the file in https://ui.perfetto.dev
or chrome://tracing.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lifecycle import safeio
from lifecycle.errors import ExitCode, UsageError
from lifecycle.obs.events import read_events
from lifecycle.obs.spans import COMMON_KEYS, Span, rank_spans, valid_events

CUT_NOTE = "no end event: the rank died or was killed inside this span; closed at its last event"
_CATEGORIES = (("phase:", "phase"), ("warm:", "collective"), ("barrier:", "barrier"), ("teardown:", "teardown"))
_NAMED = {"init_process_group": "collective", "initialize_model_parallel": "collective",
          "check_policy_hash": "collective", "setup": "train", "step": "train", "save": "checkpoint",
          "commit": "checkpoint", "resume": "checkpoint", "failure": "failure", "teardown_deadline": "failure",
          "fault_drill": "fault", "exit": "exit", "zero_token": "moe"}


def load(run_dir: Path, problems: list[str] | None = None) -> dict[int, list[dict[str, Any]]]:
    """Every rank's well-formed events; a clear :class:`UsageError` when the directory holds none.

    Malformed lines, events and files are skipped; ``problems`` (when given) gets one line for each.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a directory; give the run directory of `lifecycle run` "
                         f"(its run.dir, e.g. runs/<name>-<id>)")
    events: dict[int, list[dict[str, Any]]] = {}
    for rank, evs in read_events(run_dir, problems).items():
        good = valid_events(evs)
        if len(good) < len(evs) and problems is not None:
            n = len(evs) - len(good)
            problems.append(f"rank_{rank}.jsonl: {n} malformed event{'s' if n > 1 else ''} skipped (a wrong "
                            "type of t, kind, name, host, rank or dur_us)")
        if good:
            events[rank] = good
    if not events:
        raise UsageError(f"no events in {run_dir / 'events'} (expected rank_<R>.jsonl files written by "
                         f"`lifecycle run`); is {run_dir} a run directory?")
    return events


def category(name: str) -> str:
    """The trace category of a span or instant name (phase, collective, barrier, checkpoint, ...)."""
    if "hang" in name:
        return "hang"
    for prefix, cat in _CATEGORIES:
        if name.startswith(prefix):
            return cat
    return _NAMED.get(name, "event")


def build_trace(events: dict[int, list[dict[str, Any]]], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Chrome trace-event JSON object for a run's events (by rank)."""
    t0 = min(e["t"] for evs in events.values() for e in evs)
    hosts = sorted({evs[0].get("host", "?") for evs in events.values()})
    pids = {h: i for i, h in enumerate(hosts)}
    out: list[dict[str, Any]] = []
    for host, pid in pids.items():
        out.append(_meta("process_name", pid, None, name=host))
        out.append(_meta("process_sort_index", pid, None, sort_index=pid))
    for rank, evs in sorted(events.items()):
        pid = pids[evs[0].get("host", "?")]
        label = f"rank {rank}" + (f" (local {evs[0]['local_rank']})" if "local_rank" in evs[0] else "")
        out.append(_meta("thread_name", pid, rank, name=label))
        out.append(_meta("thread_sort_index", pid, rank, sort_index=rank))
        body = [_complete(s, pid, t0) for s in rank_spans(rank, evs)]
        body += [x for e in evs for x in _points(e, pid, t0)]
        out.extend(sorted(body, key=lambda x: (x["ts"], -x.get("dur", 0))))
    other = {"t0_us_since_epoch": t0, "ranks": len(events), "hosts": hosts, **(meta or {})}
    return {"traceEvents": out, "displayTimeUnit": "ms", "metadata": other}


def _meta(kind: str, pid: int, tid: int | None, **args: Any) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "M", "name": kind, "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def _args(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, str | int | float | bool | list | dict) or v is None else str(v)
            for k, v in fields.items()}


def _complete(span: Span, pid: int, t0: int) -> dict[str, Any]:
    args = _args({"phase": span.begin.get("phase"), **span.fields})
    name = span.name
    if name == "step" and isinstance(span.begin.get("step"), int):
        name = f"step {span.begin['step']}"  # one slice per step, findable by number
    if span.cut:
        args["cut"] = CUT_NOTE
        name += " (cut)"
    return {"ph": "X", "name": name, "cat": category(span.name), "pid": pid, "tid": span.rank,
            "ts": span.start_us - t0, "dur": span.dur_us, "args": args}


def _points(e: dict[str, Any], pid: int, t0: int) -> list[dict[str, Any]]:
    """Instants (instant events, barrier releases), counters (scalars, the step loss) for one event."""
    ts, rank = e["t"] - t0, e.get("rank", 0)
    fields = {"phase": e.get("phase"), **{k: v for k, v in e.items() if k not in COMMON_KEYS}}
    if e["kind"] == "instant" or (e["kind"] == "end" and e["name"].startswith("barrier:")):
        return [{"ph": "i", "s": "t", "name": e["name"], "cat": category(e["name"]), "pid": pid, "tid": rank,
                 "ts": ts, "args": _args(fields)}]
    if e["kind"] == "scalar":
        series = [(e["name"], e.get("value"))]
    elif e["name"] == "step":  # the loss, and the step's compute time (the straggler track), one track per rank
        series = [("loss", e.get("loss")), ("step compute s", e.get("compute_s"))]
    else:
        series = []
    out = []
    for label, value in series:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            # One counter per rank and name: viewers read a series missing from a sample as 0.
            out.append({"ph": "C", "name": f"{label} (rank {rank})", "pid": pid, "tid": rank, "ts": ts,
                        "args": {"value": value}})
    return out


def write_trace(trace: dict[str, Any], path: Path) -> Path:
    """Write the trace as JSON (gzip-compressed when the name ends in ``.gz``; Perfetto opens both)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(trace, separators=(",", ":"), default=str).encode()
    safeio.write_bytes(path, gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def _run_meta(run_dir: Path) -> dict[str, Any]:
    """The launcher's verdict from summary.json, when the run wrote one."""
    s = safeio.try_json(run_dir / "summary.json", limit=1 << 24)
    keep = ("outcome", "exit_code", "first_failure", "failed_phase", "wall_s")
    return {k: s[k] for k in keep if k in s} if isinstance(s, dict) else {}


def main(run_dir: str | Path, out: str | Path | None = None, png: str | Path | None = None,
         *, no_png: bool = False) -> int:
    """Write ``RUN_DIR/trace.json`` (or ``out``) and ``RUN_DIR/timeline.png`` (or ``png``); return the exit code."""
    from lifecycle.obs import gantt

    run_dir = Path(run_dir)
    problems: list[str] = []
    events = load(run_dir, problems)
    trace_path = output_path(Path(out) if out else run_dir / "trace.json", "--out", run_dir)
    png_path = None if no_png else output_path(Path(png) if png else run_dir / "timeline.png", "--png", run_dir)
    _report(problems)
    meta = {"run_dir": str(run_dir.resolve()), **_run_meta(run_dir)}
    trace = build_trace(events, meta)
    path = _writing(trace_path, "--out", lambda: write_trace(trace, trace_path))
    n = sum(1 for e in trace["traceEvents"] if e["ph"] != "M")
    print(f"trace    {path} ({n} events, {len(events)} ranks): open it in https://ui.perfetto.dev "
          f"or chrome://tracing")
    if png_path is None:
        return ExitCode.OK
    if not gantt.available():
        print("png      skipped: matplotlib is not installed (pip install 'megatron-lifecycle[plot]'); the trace was "
              "written", file=sys.stderr)
        return ExitCode.OK
    picture = _writing(png_path, "--png", lambda: gantt.plot(events, png_path, title=_title(run_dir, meta)))
    print(f"png      {picture}")
    return ExitCode.OK


_OWN = ("events", "logs", "attempts", "checkpoints", "summary.json", "policy.resolved.yaml", "policy.sha256",
        "hang_report.json", "overrides.txt", "attempt", ".lock", ".shutdown", ".lifecycle-run")
"""What a run directory holds that the timeline must never overwrite (its own trace.json/timeline.png it may)."""


def _managed(path: Path, run_dir: Path | None) -> str | None:
    """The run directory file or folder ``path`` would overwrite, or None."""
    if run_dir is None:
        return None
    try:
        rel = path.resolve().relative_to(run_dir.resolve())
    except (ValueError, OSError, RuntimeError):
        return None
    return rel.parts[0] if rel.parts and rel.parts[0] in _OWN else None


def output_path(path: Path, flag: str, run_dir: Path | None = None) -> Path:
    """``path`` if a file can be written there (its folder is created); else a UsageError naming ``flag``. A file the
    run directory keeps (events, summary, policy, checkpoints ...) is refused."""
    try:
        if path.is_dir():
            raise UsageError(f"{flag} {path}: is a directory; give a file name, e.g. {path / 'trace.json'}")
        blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise UsageError(f"{flag} {path}: {blocker} is a file, not a folder; choose another place")
        own = _managed(path, run_dir)
        if own is not None:
            raise UsageError(f"{flag} {path}: would overwrite the run's own {own}; write the trace elsewhere (the "
                             f"default is {run_dir}/trace.json)")
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create its folder ({exc.strerror or exc}); choose a writable "
                         "place") from None
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable; choose a writable place")
    return path


def _writing(path: Path, flag: str, write: Callable[[], Path]) -> Path:
    try:
        return write()
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write ({exc.strerror or exc}); choose a writable place"
                         ) from None


def _report(problems: list[str], limit: int = 10) -> None:
    """One stderr line per skipped file or batch of lines, at most ``limit`` of them."""
    for line in problems[:limit]:
        print(f"skipped  {line[:300]}", file=sys.stderr)
    if len(problems) > limit:
        print(f"skipped  ... and {len(problems) - limit} more", file=sys.stderr)


def _title(run_dir: Path, meta: dict[str, Any]) -> str:
    outcome = meta.get("outcome")
    return f"{run_dir.resolve().name}" + (f": {outcome}" if outcome else "")
