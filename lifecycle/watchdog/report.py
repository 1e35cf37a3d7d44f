"""Where a watchdog report goes: stderr of every rank, ``hang_report.json``, the events, the stacks.

Every rank prints its own view (what it waits for, who is stuck) as one block of ``[rank N]`` lines on
stderr, which the launchers put in the rank's log. The lowest rank that is not dead writes the full
diagnosis (every rank's last record) to ``run_dir/hang_report.json``. On NCCL the report also points
at (and, where torch allows, writes) the Flight Recorder dump of this rank.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import lifecycle.rundir as rundir
from lifecycle.jsontypes import JsonDict
from lifecycle.rundir import HANG_REPORT, local_report_name, newer_attempt, safeio
from lifecycle.watchdog import diagnosis

if TYPE_CHECKING:
    from lifecycle.watchdog.run import WatchedRun

log = logging.getLogger(__name__)


def reporter(d: diagnosis.Diagnosis, world: int) -> int:
    """The rank that writes ``hang_report.json``: rank 0, or the lowest rank not known to be dead."""
    return min((r for r in range(world) if r not in d.dead), default=0)


def publish(ctx: WatchedRun, d: diagnosis.Diagnosis, *, dump_stacks: bool) -> None:
    """Print the report on this rank, record a ``hang_report`` event, write the JSON on the reporter (the first
    report of the attempt only)."""
    path = Path(ctx.run_dir) / HANG_REPORT
    writer = reporter(d, ctx.world_size)
    extra = [f"  full report: {path}" + ("" if writer == ctx.rank else f" (written by rank {writer})")]
    fr = flight_recorder(ctx)
    if fr:
        extra.append(f"  NCCL flight recorder: {fr}")
    # The first report of an attempt is the one nearest the cause: a later one (a frozen rank thawed by the
    # launcher's shutdown sees its peers gone) never replaces it.
    newer = newer_attempt(ctx.run_dir, ctx.attempt)
    if newer is not None:  # a rank of a replaced attempt, still alive: the new attempt's report is not its to write
        extra[0] = f"  full report: not written (attempt {newer} of this run has started; this rank is of {ctx.attempt})"
    elif writer == ctx.rank:
        data = {**d.to_json(), "reporter": ctx.rank, "world_size": ctx.world_size, "attempt": ctx.attempt,
                "flight_recorder": fr}
        # A report left by an earlier attempt that nobody archived (a per-node run dir) does not count.
        written = _write_json(path, data, first_only=True) or (_attempt_of(path) != ctx.attempt
                                                              and _write_json(path, data))
        if not written and path.exists():
            extra[0] = f"  full report: {path} (an earlier report of this attempt; this rank's view is above)"
    print(diagnosis.render(d, ctx.rank, extra=extra), file=sys.stderr, flush=True)
    idle = _stalled_s(d, ctx.rank)
    ctx.events.instant("hang_report", cause=d.cause, detail=d.detail[:500], origin=d.origin,
                       culprits=d.culprits[:64], dead=sorted(d.dead)[:64], report=str(path),
                       **({"idle_s": round(float(idle), 3)} if isinstance(idle, int | float) else {}))
    ctx.events.flush()
    if dump_stacks:
        dump_stacks_of(ctx)


def publish_local(ctx: WatchedRun, d: diagnosis.Diagnosis) -> None:
    """This rank cannot reach its peers: print its own view, write ``hang_report.<rank>.json`` beside the run's
    files, record the event, dump the stacks."""
    path = Path(ctx.run_dir) / local_report_name(ctx.rank)
    _write_json(path, {**d.to_json(), "reporter": ctx.rank, "world_size": ctx.world_size, "local": True})
    print(diagnosis.render(d, ctx.rank, extra=[f"  report: {path}"]), file=sys.stderr, flush=True)
    ctx.events.instant("hang_report", cause=d.cause, detail=d.detail[:500], origin=d.origin, culprits=[],
                       report=str(path))
    ctx.events.flush()
    dump_stacks_of(ctx)


def dump_stacks_of(ctx: WatchedRun) -> None:
    """Every Python thread's stack (faulthandler) into ``logs/rank_<R>.stacks.txt``, one line on stderr naming
    it: the console (rank 0's log is tailed there, every rank's under torchrun) keeps the report readable. When
    that file cannot be written, the stacks go to stderr."""
    path = rundir.stacks_file(Path(ctx.run_dir), ctx.rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(safeio.open_append(path), "a") as f:  # a FIFO there: an error, not a hang
            f.write(f"--- rank {ctx.rank}, {time.strftime('%Y-%m-%dT%H:%M:%S%z')}: Python stacks of every thread\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        print(f"[rank {ctx.rank}]   Python stacks of every thread: {path}", file=sys.stderr, flush=True)
        return
    except (OSError, ValueError, AttributeError, safeio.RunDirError):
        pass
    print(f"[rank {ctx.rank}] Python stacks of every thread (faulthandler):", file=sys.stderr, flush=True)
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (OSError, ValueError, AttributeError):  # stderr without a file descriptor
        pass


def _stalled_s(d: diagnosis.Diagnosis, rank: int) -> float | None:
    """How long before the report the failure's origin (else this rank) had made no progress — where detection began:
    its record's idle time plus the record's age (a frozen rank's record stops)."""
    for who in (d.origin, rank):
        rec = d.records.get(who) if who is not None else None
        if isinstance(rec, dict) and isinstance(rec.get("idle_s"), int | float):
            t = rec.get("t")
            age = max(d.now - float(t), 0.0) if isinstance(t, int | float) and d.now else 0.0
            return float(rec["idle_s"]) + age
    return None


def publish_usage(ctx: WatchedRun, d: diagnosis.Diagnosis) -> None:
    """A configuration error: one line on stderr and an event (the error itself says what to fix)."""
    where = "this rank" if d.origin == ctx.rank else f"rank {d.origin}" if d.origin is not None else "a rank"
    print(f"[rank {ctx.rank}] lifecycle: stopping in phase {d.phase}: {where} hit a configuration error: "
          f"{d.detail[:300]}", file=sys.stderr, flush=True)
    ctx.events.instant("hang_report", cause=d.cause, detail=d.detail[:500], origin=d.origin, culprits=d.culprits)
    ctx.events.flush()


def _attempt_of(path: Path) -> int | None:
    data = safeio.try_json(path, limit=1 << 22)
    value = data.get("attempt") if isinstance(data, dict) else None
    return value if isinstance(value, int) else None


def _write_json(path: Path, data: JsonDict, *, first_only: bool = False) -> bool:
    """Write ``path`` atomically (a reader never sees half a report), never over anything but a regular file; with
    ``first_only``, only when nothing is there yet. Returns whether it was written."""
    text = json.dumps(data, indent=1, default=str).encode()
    try:
        if first_only:
            return safeio.write_new(path, text)
        safeio.write_bytes(path, text)
        return True
    except (OSError, safeio.RunDirError) as exc:
        log.warning("cannot write %s: %s", path, exc)
        return False


def flight_recorder(ctx: WatchedRun) -> str | None:
    """NCCL only: this rank's Flight Recorder dump path (dumped now when torch can), else None."""
    if not ctx.policy.distributed.flight_recorder.enabled or "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    try:
        if not dist.is_initialized() or "nccl" not in str(dist.get_backend()).lower():
            return None
    except Exception:  # noqa: BLE001 - half-initialized groups
        return None
    base = (os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
            or "/tmp/nccl_trace_rank_")
    target = f"{base}{ctx.rank}"
    try:
        import torch._C._distributed_c10d as c10d_c

        # torch < 2.10: _dump_nccl_trace; later: _dump_fr_trace (the Flight Recorder is not NCCL-only there)
        dump = getattr(c10d_c, "_dump_nccl_trace", None) or getattr(c10d_c, "_dump_fr_trace", None)
        if dump is not None:
            safeio.write_bytes(target, dump())
    except Exception as exc:  # noqa: BLE001 - the automatic dump on timeout still happens
        log.debug("flight recorder dump failed: %s", exc)
    return target + " (TORCH_NCCL_DUMP_ON_TIMEOUT also dumps there on an NCCL timeout)"
