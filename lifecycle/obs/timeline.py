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
import sys
from pathlib import Path
from typing import Any

from lifecycle.errors import ExitCode, UsageError
from lifecycle.obs.events import read_events
from lifecycle.obs.spans import COMMON_KEYS, Span, rank_spans, valid_events

CUT_NOTE = "no end event: the rank died or was killed inside this span; closed at its last event"
_CATEGORIES = (("phase:", "phase"), ("warm:", "collective"), ("barrier:", "barrier"), ("teardown:", "teardown"))
_NAMED = {"init_process_group": "collective", "initialize_model_parallel": "collective",
          "check_policy_hash": "collective", "setup": "train", "step": "train", "save": "checkpoint",
          "commit": "checkpoint", "resume": "checkpoint", "failure": "failure", "teardown_deadline": "failure",
          "fault_drill": "fault", "exit": "exit", "zero_token": "moe"}


def load(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Every rank's well-formed events; a clear :class:`UsageError` when the directory holds none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a directory; give the run directory of `lifecycle run` "
                         f"(its run.dir, e.g. runs/<name>-<id>)")
    events = {r: valid_events(evs) for r, evs in read_events(run_dir).items()}
    events = {r: evs for r, evs in events.items() if evs}
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
    value = e.get("value") if e["kind"] == "scalar" else e.get("loss") if e["name"] == "step" else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        # One counter per rank and name: viewers read a series missing from a sample as 0.
        name = f"{e['name'] if e['kind'] == 'scalar' else 'loss'} (rank {rank})"
        return [{"ph": "C", "name": name, "pid": pid, "tid": rank, "ts": ts, "args": {"value": value}}]
    return []


def write_trace(trace: dict[str, Any], path: Path) -> Path:
    """Write the trace as JSON (gzip-compressed when the name ends in ``.gz``; Perfetto opens both)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(trace, separators=(",", ":"), default=str).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def _run_meta(run_dir: Path) -> dict[str, Any]:
    """The launcher's verdict from summary.json, when the run wrote one."""
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    keep = ("outcome", "exit_code", "first_failure", "failed_phase", "wall_s")
    return {k: s[k] for k in keep if k in s} if isinstance(s, dict) else {}


def main(run_dir: str | Path, out: str | Path | None = None, png: str | Path | None = None,
         *, no_png: bool = False) -> int:
    """Write ``RUN_DIR/trace.json`` (or ``out``) and ``RUN_DIR/timeline.png`` (or ``png``); return the exit code."""
    from lifecycle.obs import gantt

    run_dir = Path(run_dir)
    events = load(run_dir)
    meta = {"run_dir": str(run_dir.resolve()), **_run_meta(run_dir)}
    trace = build_trace(events, meta)
    path = write_trace(trace, Path(out) if out else run_dir / "trace.json")
    n = sum(1 for e in trace["traceEvents"] if e["ph"] != "M")
    print(f"trace    {path} ({n} events, {len(events)} ranks): open it in https://ui.perfetto.dev "
          f"or chrome://tracing")
    if no_png:
        return ExitCode.OK
    if not gantt.available():
        print("png      skipped: matplotlib is not installed (pip install 'lifecycle[plot]'); the trace was "
              "written", file=sys.stderr)
        return ExitCode.OK
    picture = gantt.plot(events, Path(png) if png else run_dir / "timeline.png", title=_title(run_dir, meta))
    print(f"png      {picture}")
    return ExitCode.OK


def _title(run_dir: Path, meta: dict[str, Any]) -> str:
    outcome = meta.get("outcome")
    return f"{run_dir.resolve().name}" + (f": {outcome}" if outcome else "")
