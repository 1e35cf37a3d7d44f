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
import io
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifecycle import rundir
from lifecycle.errors import ExitCode, UsageError
from lifecycle.obs.events import iter_file, rank_files, read_events
from lifecycle.obs.spans import COMMON_KEYS, Span, is_valid, iter_spans, valid_events
from lifecycle.rundir import safeio

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
        out.extend(sorted(_body(rank, pid, t0, valid_events(evs)), key=lambda x: (x["ts"], -x.get("dur", 0))))
    other = {"t0_us_since_epoch": t0, "ranks": len(events), "hosts": hosts, **(meta or {})}
    return {"traceEvents": out, "displayTimeUnit": "ms", "metadata": other}


def _body(rank: int, pid: int, t0: int, events: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """One rank's trace events from a stream of its well-formed events: a complete event per span as it closes, the
    instants and counters as they come (memory: the open spans and the points since the last close)."""
    pending: list[dict[str, Any]] = []

    def feed() -> Iterator[dict[str, Any]]:
        for e in events:
            pending.extend(_points(e, pid, t0))
            yield e

    for span in iter_spans(rank, feed()):
        yield from pending
        pending.clear()
        yield _complete(span, pid, t0)
    yield from pending


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
    s = safeio.try_json(run_dir / rundir.SUMMARY, limit=1 << 24)
    keep = ("outcome", "exit_code", "first_failure", "failed_phase", "wall_s")
    return {k: s[k] for k in keep if k in s} if isinstance(s, dict) else {}


@dataclass
class _Head:
    """What the first pass learns of one rank's event file."""

    path: Path
    first: dict[str, Any]
    t_min: int
    t_max: int
    steps: int = 0


def scan(run_dir: Path, problems: list[str] | None = None) -> dict[int, _Head]:
    """First pass over the event files, one line in memory at a time: each rank's first event, time range and step
    count; skipped lines, events and files noted in ``problems``. A clear :class:`UsageError` when there is none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a directory; give the run directory of `lifecycle run` "
                         f"(its run.dir, e.g. runs/<name>-<id>)")
    heads: dict[int, _Head] = {}
    for rank, path in rank_files(run_dir, problems):
        bad, malformed, head = [0], 0, None
        for e in iter_file(path, problems, bad):
            if not is_valid(e):
                malformed += 1
            elif head is None:
                head = _Head(path, e, e["t"], e["t"])
            else:
                head.t_min, head.t_max = min(head.t_min, e["t"]), max(head.t_max, e["t"])
                head.steps += e["name"] == "step" and e["kind"] == "begin"
        if bad[0] and problems is not None:
            problems.append(f"{path.name}: {bad[0]} malformed line{'s' if bad[0] > 1 else ''} skipped")
        if malformed and problems is not None:
            problems.append(f"rank_{rank}.jsonl: {malformed} malformed event{'s' if malformed > 1 else ''} skipped "
                            "(a wrong type of t, kind, name, host, rank or dur_us)")
        if head is not None:
            heads[rank] = head
    if not heads:
        raise UsageError(f"no events in {run_dir / 'events'} (expected rank_<R>.jsonl files written by "
                         f"`lifecycle run`); is {run_dir} a run directory?")
    return heads


def _stream(head: _Head) -> Iterator[dict[str, Any]]:
    return (e for e in iter_file(head.path) if is_valid(e))


def write_streaming(heads: dict[int, _Head], path: Path, meta: dict[str, Any]
                    ) -> tuple[int, dict[int, list[dict[str, Any]]]]:
    """Second pass: write the trace of :func:`build_trace` rank by rank as the events stream by (spans in the
    order they close; viewers sort), and keep the few events the Gantt chart draws (phases, commits, resumes,
    markers, every k-th step). Returns (trace events written, the Gantt's events by rank)."""
    from lifecycle.obs import gantt

    t0 = min(h.t_min for h in heads.values())
    hosts = sorted({h.first.get("host", "?") for h in heads.values()})
    pids = {h: i for i, h in enumerate(hosts)}
    drawn: dict[int, list[dict[str, Any]]] = {}
    n = 0
    with safeio.replacing(path) as raw:
        binary = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if path.suffix == ".gz" else raw
        with binary, io.TextIOWrapper(binary, encoding="utf-8") as f:
            f.write('{"traceEvents":[')
            sep = ""
            for host, pid in pids.items():
                for m in (_meta("process_name", pid, None, name=host),
                          _meta("process_sort_index", pid, None, sort_index=pid)):
                    f.write(sep + json.dumps(m, separators=(",", ":")))
                    sep = ","
            for rank, head in sorted(heads.items()):
                pid = pids[head.first.get("host", "?")]
                label = f"rank {rank}" + (f" (local {head.first['local_rank']})" if "local_rank" in head.first else "")
                for m in (_meta("thread_name", pid, rank, name=label),
                          _meta("thread_sort_index", pid, rank, sort_index=rank)):
                    f.write(sep + json.dumps(m, separators=(",", ":")))
                keep = _Drawn(head, gantt, drawn.setdefault(rank, []))
                for x in _body(rank, pid, t0, keep.filter(_stream(head))):
                    f.write("," + json.dumps(x, separators=(",", ":"), default=str))
                    n += 1
                keep.close()
            other = {"t0_us_since_epoch": t0, "ranks": len(heads), "hosts": hosts, **meta}
            f.write('],"displayTimeUnit":"ms","metadata":' + json.dumps(other, default=str) + "}")
    return n, drawn


class _Drawn:
    """Collects, as a rank's events stream by, the ones the Gantt chart needs: phase and commit/resume spans, the
    marker instants, init_process_group, about 2 x MAX_TICKS step spans, and the rank's first and last moments."""

    def __init__(self, head: _Head, gantt: Any, into: list[dict[str, Any]]) -> None:
        self.head, self.gantt, self.into = head, gantt, into
        self.every = max(1, head.steps // (2 * gantt.MAX_TICKS))
        self.seen_steps, self.in_step = 0, False
        into.append({"t": head.t_min, "kind": "instant", "name": "first event"})

    def filter(self, events: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for e in events:
            self._keep(e)
            yield e

    def _keep(self, e: dict[str, Any]) -> None:
        name, kind = e["name"], e["kind"]
        if name == "step" and kind in ("begin", "end"):
            if kind == "begin":
                self.in_step = self.seen_steps % self.every == 0
                self.seen_steps += 1
            if self.in_step:
                self.into.append(e)
        elif (name.startswith("phase:") or name in self.gantt.SPAN_MARKERS or name == "init_process_group"
              or (kind == "instant" and self.gantt._marker(name) is not None)):
            self.into.append(e)

    def close(self) -> None:
        self.into.append({"t": self.head.t_max, "kind": "instant", "name": "last event"})


def main(run_dir: str | Path, out: str | Path | None = None, png: str | Path | None = None,
         *, no_png: bool = False) -> int:
    """Write ``RUN_DIR/trace.json`` (or ``out``) and ``RUN_DIR/timeline.png`` (or ``png``); return the exit code.

    Two streaming passes over the event files: memory stays bounded by one rank's open spans and the Gantt's few
    events, not by the number of events (bench/timeline_memory.py)."""
    from lifecycle.obs import gantt

    run_dir = Path(run_dir)
    problems: list[str] = []
    heads = scan(run_dir, problems)
    trace_path = output_path(Path(out) if out else run_dir / rundir.TRACE, "--out", run_dir)
    png_path = None if no_png else output_path(Path(png) if png else run_dir / rundir.TIMELINE_PNG, "--png", run_dir)
    _report(problems)
    meta = {"run_dir": str(run_dir.resolve()), **_run_meta(run_dir)}
    written: list[tuple[int, dict[int, list[dict[str, Any]]]]] = []

    def write() -> Path:
        written.append(write_streaming(heads, trace_path, meta))
        return trace_path

    path = _writing(trace_path, "--out", write)
    n, events = written[0]
    print(f"trace    {path} ({n} events, {len(heads)} ranks): open it in https://ui.perfetto.dev "
          f"or chrome://tracing")
    if png_path is None:
        return ExitCode.OK
    if not gantt.available():
        print("png      skipped: matplotlib is not installed (pip install 'megatron-lifecycle[plot]'); the trace was "
              "written", file=sys.stderr)
        return ExitCode.OK
    picture = _writing(png_path, "--png", lambda: gantt.plot(events, png_path, title=_title(run_dir, meta),
                                                              shading=_shading(run_dir)))
    print(f"png      {picture}")
    return ExitCode.OK


def _shading(run_dir: Path) -> list[tuple[int, int, str]] | None:
    """Goodput's pieces of the run for the picture (None when they cannot be had: the picture goes without)."""
    from lifecycle.obs import goodput

    try:
        return goodput.account(run_dir).segments
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logging.getLogger(__name__).debug("no goodput shading: %s", exc)
        return None


def _managed(path: Path, run_dir: Path | None) -> str | None:
    """The run directory file or folder ``path`` would overwrite, or None."""
    if run_dir is None:
        return None
    try:
        rel = path.resolve().relative_to(run_dir.resolve())
    except (ValueError, OSError, RuntimeError):
        return None
    return rel.parts[0] if rel.parts and rel.parts[0] in rundir.OWN else None


_SYSTEM = (Path("/dev"), Path("/proc"), Path("/sys"))


def output_path(path: Path, flag: str, run_dir: Path | None = None) -> Path:
    """``path`` if a file can be written there (its folder is created); else a UsageError naming ``flag``. A file the
    run directory keeps (events, summary, policy, checkpoints ...), a device, FIFO or socket, and anything under
    /dev, /proc or /sys are refused: the trace replaces only a regular file (or a symbolic link, not its target)."""
    try:
        if path.is_dir():
            raise UsageError(f"{flag} {path}: is a directory; give a file name, e.g. {path / 'trace.json'}")
        blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise UsageError(f"{flag} {path}: {blocker} is a file, not a folder; choose another place")
        _check_kind(path, flag)
        own = _managed(path, run_dir)
        if own is not None:
            raise UsageError(f"{flag} {path}: would overwrite the run's own {own}; write the trace elsewhere (the "
                             f"default is {run_dir}/trace.json)")
        path.parent.mkdir(parents=True, exist_ok=True)
        system = next((s for s in _SYSTEM if s == path.parent.resolve() or s in path.parent.resolve().parents), None)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create its folder ({exc.strerror or exc}); choose a writable "
                         "place") from None
    if system is not None:
        raise UsageError(f"{flag} {path}: lies under {system}, a system folder; write it to a file elsewhere")
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable; choose a writable place")
    return path


def _check_kind(path: Path, flag: str) -> None:
    """A device, FIFO or socket at ``path`` is refused (UsageError naming ``flag``), never replaced nor opened."""
    try:
        safeio.check_writable(path, hint="give the name of a regular file")
    except UsageError as exc:
        raise UsageError(f"{flag} {exc}") from None


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


END_OF_JOB_TIMELINE_BYTES = 32 << 20
"""Event files larger than this in all (about 150,000 events) are not drawn at the end of a job: the picture must
not delay the exit code by more than a few seconds. ``lifecycle timeline RUN_DIR`` draws them on demand."""


END_OF_JOB_DRAW_S = 120.0
"""How long the launcher waits for the end of a job's trace and picture (:class:`Drawing`) before it leaves without
them (a few seconds at :data:`END_OF_JOB_TIMELINE_BYTES`)."""


def _drawn_at_the_end(run_dir: Path, what: str) -> bool:
    """Whether the end of a job draws (``run.timeline`` not ``off``, the event files not too large: said)."""
    if what == "off":
        return False
    try:
        size = sum(p.stat().st_size for p in (run_dir / rundir.EVENTS_DIR).glob(rundir.RANK_EVENTS) if p.is_file())
    except OSError:
        size = 0
    if size > END_OF_JOB_TIMELINE_BYTES:
        print(f"trace    skipped at the end of the job: {size >> 20} MiB of events; draw it with `lifecycle "
              f"timeline {run_dir}`", flush=True)
        return False
    return True


class Drawing:
    """The end of a job's trace and picture, drawn by a child process (``lifecycle timeline``) while the launcher
    reads the run's goodput: the two reads of the event files share the cores the ranks left instead of running one
    after the other. Its lines are printed when it is done (after the summary, as before); it never changes the
    run's exit code."""

    def __init__(self, run_dir: Path, what: str) -> None:
        import subprocess

        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lifecycle", "timeline", str(run_dir), *([] if what == "png" else ["--no-png"])],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def finish(self, stopped: Callable[[], bool] = lambda: False, limit_s: float = END_OF_JOB_DRAW_S) -> None:
        """Wait for it (at most ``limit_s``, and not past a stop the launcher received: ``stopped()``), then print
        what it said; a drawing cut short is killed and named, with the command that draws it."""
        import subprocess
        import time

        deadline = time.monotonic() + limit_s
        while True:
            try:
                out, err = self.proc.communicate(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                if stopped() or time.monotonic() > deadline:
                    self.proc.kill()
                    self.proc.communicate()
                    for tmp in self.run_dir.glob(f".*.{self.proc.pid}.tmp"):  # what it was writing (safeio.replacing)
                        tmp.unlink(missing_ok=True)
                    why = "a stop signal came" if stopped() else f"not done in {limit_s:.0f}s"
                    print(f"trace    not drawn ({why}): draw it with `lifecycle timeline {self.run_dir}`", flush=True)
                    return
        sys.stdout.write(out.decode(errors="replace"))
        sys.stdout.flush()
        if err:
            sys.stderr.write(err.decode(errors="replace"))
            sys.stderr.flush()
        if self.proc.returncode:
            print(f"trace    not written (exit {self.proc.returncode}): `lifecycle timeline {self.run_dir}` says why",
                  flush=True)


def start_end_of_job(run_dir: Path, what: str = "png") -> Drawing | None:
    """:func:`end_of_job` in a child process (:class:`Drawing`), or None where nothing is drawn."""
    if not _drawn_at_the_end(run_dir, what):
        return None
    try:
        return Drawing(run_dir, what)
    except OSError as exc:  # no process to spare: drawn here, after the goodput read
        logging.getLogger(__name__).warning("timeline drawn in the launcher: %s", exc)
        end_of_job(run_dir, what)
        return None


def end_of_job(run_dir: Path, what: str = "png") -> None:
    """The merged trace and, with ``what="png"`` (``run.timeline``), the PNG when matplotlib is installed; nothing
    with ``off``. Never changes the run's exit code."""
    if not _drawn_at_the_end(run_dir, what):
        return
    try:
        main(run_dir, no_png=what != "png")
    except Exception as exc:  # noqa: BLE001 - a picture must not fail a finished run
        logging.getLogger(__name__).warning("timeline not written: %s", exc)
