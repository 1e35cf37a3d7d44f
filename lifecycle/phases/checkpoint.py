"""Checkpoint: save, agree off the default group, commit in two phases, prune; resume at start.

Layout under ``checkpoint.dir``: a save is written to ``iter_NNNNNNN.tmp/``; once every rank's files
are durable (agreed over the TCPStore, or a dedicated gloo group — never the default/NCCL group),
global rank 0 finalizes the metadata, renames it to ``iter_NNNNNNN/`` and then replaces the tracker
``latest`` atomically (write + fsync + rename). A crash at any moment leaves the previous checkpoint
and tracker intact; ``keep_last`` prunes committed checkpoints only.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lifecycle.errors import PhaseError
from lifecycle.phases.points import run_points

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lifecycle.context import RunContext
    from lifecycle.handlers.protocols import SaveHandle, StepHandler

log = logging.getLogger(__name__)
TRACKER = "latest"


@dataclass
class PendingSave:
    handle: SaveHandle
    step: int
    tmp: Path
    final: Path
    reason: str


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tracker(root: Path, name: str) -> None:
    """Point ``latest`` at ``name`` atomically: write a temp file, fsync it, rename over, fsync the dir."""
    tmp = root / f".{TRACKER}.tmp"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / TRACKER)
    _fsync_dir(root)


def committed(root: Path) -> list[Path]:
    """Committed checkpoints, oldest first (``.tmp`` leftovers are not committed)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` committed checkpoints (0 keeps all)."""
    done = committed(root)
    doomed = done[:-keep_last] if keep_last else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _all_ranks(ctx: RunContext) -> list[int]:
    return list(range(ctx.world_size))


def _handler(ctx: RunContext) -> StepHandler:
    if ctx.step_handler is None:
        raise PhaseError("no step handler: checkpoints need train.steps > 0", phase="checkpoint", rank=ctx.rank)
    return ctx.step_handler


def save(ctx: RunContext, reason: str) -> None:
    """Save at the current step. Every rank calls it at the same step boundary."""
    from lifecycle.distributed.barrier import store_barrier

    if ctx.pending_save is not None:
        finish_pending(ctx)
    deadline = ctx.deadline("checkpoint")
    run_points(ctx, "before_checkpoint", deadline)
    root = Path(ctx.policy.checkpoint.dir)
    final = root / iter_name(ctx.step)
    tmp = root / (final.name + ".tmp")
    ctx.drills.fire("checkpoint", step=ctx.step, op="save")
    key = ctx.next_key("ckpt/prepare")
    if ctx.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a torn save from an earlier, crashed run
    # Nobody writes into tmp/ before rank 0 has cleared it.
    with ctx.events.span("barrier:ckpt_prepare", group="world", via="store"):
        store_barrier(ctx.require_store(), key, ctx.rank, _all_ranks(ctx), deadline, phase="checkpoint",
                      group="world")
    from lifecycle.obs import progress

    with progress.activity(ctx.rank, f"checkpoint step {ctx.step} ({reason})"):
        with ctx.events.span("save", step=ctx.step, reason=reason, path=str(final)):
            handle = _handler(ctx).begin_save(ctx, tmp)
        ctx.pending_save = PendingSave(handle, ctx.step, tmp, final, reason)
        if not ctx.policy.checkpoint.async_:
            finish_pending(ctx)


def finish_pending(ctx: RunContext) -> None:
    """Wait for every rank's writes, then commit on rank 0. Every rank calls it at the same point."""
    from lifecycle.distributed.barrier import store_barrier

    pending, ctx.pending_save = ctx.pending_save, None
    if pending is None:
        return
    deadline = ctx.deadline("checkpoint")
    key = ctx.next_key(f"ckpt/{pending.step}")
    ctx.drills.fire("checkpoint", step=pending.step, op="commit")
    with ctx.events.span("commit", step=pending.step, path=str(pending.final)) as extra:
        _agree(ctx, pending, key, deadline)
        if ctx.rank == 0:
            _commit(ctx, pending)
        # Every rank learns that the commit happened (or names rank 0 if it did not).
        with ctx.events.span("barrier:ckpt_committed", group="world", via="store"):
            store_barrier(ctx.require_store(), f"{key}/committed", ctx.rank, _all_ranks(ctx), deadline,
                          phase="checkpoint", group="world")
        extra["write_s"] = pending.handle.write_s
    ctx.saved.append(str(pending.final))
    run_points(ctx, "after_checkpoint", deadline)


def _agree(ctx: RunContext, pending: PendingSave, key: str, deadline: float) -> None:
    if ctx.policy.checkpoint.coordination == "gloo":
        pending.handle.finalize_over_group(_gloo_group(ctx), deadline)
    else:
        pending.handle.finalize_via_store(ctx.require_store(), key, deadline)


def _gloo_group(ctx: RunContext) -> ProcessGroup:
    """A dedicated gloo group over every rank for checkpoint coordination (created at first use,
    at the same save on every rank, with the checkpoint deadline as its timeout)."""
    if ctx.ckpt_group is None:
        import datetime

        import torch.distributed as dist

        ctx.ckpt_group = dist.new_group(backend="gloo",
                                        timeout=datetime.timedelta(seconds=ctx.deadline("checkpoint")))
    return ctx.ckpt_group


def _commit(ctx: RunContext, pending: PendingSave) -> None:
    root = pending.final.parent
    _fsync_dir(pending.tmp)
    if pending.final.exists():  # the same step saved again (resume then save): replace it
        shutil.rmtree(pending.final)
    os.replace(pending.tmp, pending.final)
    _fsync_dir(root)
    write_tracker(root, pending.final.name)
    pruned = prune(root, ctx.policy.checkpoint.keep_last)
    log.info("checkpoint step %d committed: %s%s", pending.step, pending.final,
             f" (pruned {[p.name for p in pruned]})" if pruned else "")


def _candidates(root: Path) -> list[Path]:
    tracker = root / TRACKER
    if not tracker.is_file():
        return []
    name = tracker.read_text().strip()
    older = [p for p in committed(root) if p.name < name][::-1]
    return [root / name, *older]


def resume(ctx: RunContext) -> None:
    """Load the tracker's checkpoint (every rank, collective inside the step handler's load)."""
    ck = ctx.policy.checkpoint
    root = Path(ck.dir)
    candidates = _candidates(root)
    if not candidates:
        if ck.resume == "required":
            raise PhaseError(f"checkpoint.resume=required but {root / TRACKER} does not exist; start "
                             f"without resume or point checkpoint.dir at a run", phase="train", rank=ctx.rank)
        return
    for i, path in enumerate(candidates):
        try:
            with ctx.events.span("resume", path=str(path)):
                ctx.step = int(_handler(ctx).load(ctx, path))
        except Exception as exc:
            if ck.on_corrupt == "fallback" and i + 1 < len(candidates):
                log.warning("checkpoint %s is unusable (%s); falling back to %s", path, exc, candidates[i + 1])
                continue
            raise PhaseError(f"cannot resume from checkpoint {path}: {exc}; fix or remove it, or set "
                             f"checkpoint.on_corrupt=fallback", phase="train", rank=ctx.rank) from exc
        ctx.resumed_from = ctx.step
        if ctx.rank == 0:
            print(f"resumed from step {ctx.step} ({path})", flush=True)
        return
