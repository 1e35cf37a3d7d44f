"""Resume: load the newest usable checkpoint, the same on every rank, or say why not.

Every rank tries the same candidates in the same order and the ranks agree after each attempt (the digest check of
their shares first, then the load, then the step each loaded), so a checkpoint that fails on one rank is rejected on
all of them and no rank is left in a collective its peers skipped.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from lifecycle.checkpoint import ckptdir
from lifecycle.checkpoint.commit import step_handler
from lifecycle.errors import CheckpointError, Shutdown

if TYPE_CHECKING:
    from lifecycle.context import RunContext

log = logging.getLogger(__name__)


def _is_interrupt(exc: BaseException) -> bool:
    return isinstance(exc, KeyboardInterrupt | SystemExit | Shutdown)


def _try_load(ctx: RunContext, path: Path) -> str | None:
    """Load ``path`` on this rank; the reason it failed, or None. torch's CheckpointException derives from
    BaseException: everything but an interrupt is a load failure here."""
    try:
        with ctx.events.span("resume", path=str(path)):
            ctx.step = int(step_handler(ctx).load(ctx, path))
    except BaseException as exc:  # noqa: BLE001 - see the docstring
        if _is_interrupt(exc):
            raise
        return _reason(exc)
    return None


def _verify_then_load(ctx: RunContext, path: Path) -> tuple[str | None, list[int], dict[int, int]]:
    """This rank's reason the checkpoint is unusable (or None), the ranks on which it is, and the step every rank
    loaded. With ``checkpoint.verify: digest`` every rank first checks its share of the files and the ranks agree on
    the outcome before any of them starts the load: the load is collective (torch_dist), so a rank that skipped it
    would leave the others in a mismatched collective."""
    if ctx.policy.checkpoint.verify == "digest":
        with ctx.events.span("verify", path=str(path)):
            changed = ckptdir.changed(path, ctx.rank, ctx.world_size)
        failed, steps = _agree_loaded(ctx, changed is not None)
        if failed:
            return changed or f"files changed since the commit (found by ranks {failed}; see their logs)", failed, steps
    local = _try_load(ctx, path)
    failed, steps = _agree_loaded(ctx, local is not None)
    return local, failed, steps


def _reason(exc: BaseException) -> str:
    """One line: torch's CheckpointException carries each rank's exception (and its traceback as text)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items())[:4]:
            inner = getattr(wrapped, "exception", wrapped)
            parts.append(f"rank {rank}: {type(inner).__name__}: {' '.join(str(inner).split())[:160]}")
        return "; ".join(parts)
    text = " ".join(str(exc).split("Traceback (most recent call last)")[0].split())
    return f"{type(exc).__name__}: {text[:300]}"


def _agree_loaded(ctx: RunContext, failed: bool) -> tuple[list[int], dict[int, int]]:
    """The ranks on which the load failed, and the step every rank loaded (every rank calls it after each attempt:
    all_gather on the default group, bounded by the checkpoint deadline)."""
    import torch
    import torch.distributed as dist

    from lifecycle.distributed.collectives import device_for, wait_works

    if ctx.world_size == 1 or not dist.is_initialized():
        return ([ctx.rank] if failed else []), {ctx.rank: ctx.step}
    mine = torch.tensor([1 if failed else 0, -1 if failed else ctx.step], dtype=torch.int64, device=device_for())
    out = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    work = dist.all_gather(out, mine, async_op=True)
    wait_works([work], "all_gather(resume ok)", "world", list(range(ctx.world_size)), ctx.deadline("checkpoint"),
               time.monotonic())
    ctx.op_counts["world"] += 1
    rows = [t.cpu().tolist() for t in out]
    return [r for r, row in enumerate(rows) if int(row[0])], {r: int(row[1]) for r, row in enumerate(rows)}


def _same_step(ctx: RunContext, path: Path, steps: dict[int, int]) -> None:
    """Every rank loaded the same step from ``path``, or a CheckpointError (exit 2) on every rank naming who loaded
    what: resuming ranks at different steps would diverge and hang at the next commit."""
    if len(set(steps.values())) <= 1:
        return
    expected = ckptdir.step_of(path.name)
    by_step: dict[int, list[int]] = {}
    for rank, step in sorted(steps.items()):
        by_step.setdefault(step, []).append(rank)
    shown = "; ".join(f"step {s}: ranks {r}" for s, r in sorted(by_step.items()))
    raise CheckpointError(f"checkpoint {path} (step {expected}) loads different steps on different ranks ({shown}): "
                          f"some rank's files belong to another save; remove or restore the checkpoint before "
                          f"resuming", path=str(path), phase="train", rank=ctx.rank)


def resume(ctx: RunContext) -> None:
    """Load the newest usable checkpoint. Every rank calls it and tries the same candidates in the same order.

    ``on_corrupt: error``: a tracker or checkpoint that cannot be used is a :class:`CheckpointError` (exit 2)
    naming the path and the reason. ``fallback``: older complete checkpoints are tried newest first, each
    rejection logged; rank 0 then sets the rejected ones aside and points the tracker at the one loaded.
    """
    ck = ctx.policy.checkpoint
    root = Path(ck.dir)
    found = ckptdir.candidates(root)
    tracker = found.tracker
    fallback = ck.on_corrupt == "fallback"
    if tracker.error is not None and not fallback:
        raise CheckpointError(f"cannot resume: the tracker {tracker.path} {tracker.error}; fix or remove it, or "
                              f"set checkpoint.on_corrupt=fallback to load the newest complete checkpoint",
                              path=str(tracker.path), phase="train", rank=ctx.rank)
    if tracker.name is None and tracker.error is None and found.paths and not fallback:
        raise CheckpointError(f"cannot resume: {root} holds checkpoints ({found.paths[0].name} ...) but no tracker "
                              f"({ckptdir.TRACKER}); set checkpoint.on_corrupt=fallback to load the newest complete "
                              f"one, or checkpoint.resume=never to start over", path=str(root), phase="train",
                              rank=ctx.rank)
    head = str(root / tracker.name) if tracker.name else None
    if head is not None and head in found.rejected and not fallback:
        raise CheckpointError(f"cannot resume from checkpoint {head}: {found.rejected[head]}; fix or remove it, or "
                              f"set checkpoint.on_corrupt=fallback", path=head, phase="train", rank=ctx.rank)
    rejected = dict(found.rejected)
    for name, reason in rejected.items():
        log.warning("checkpoint %s is unusable: %s", name, reason)
    for path in found.paths:
        local, failed, steps = _verify_then_load(ctx, path)
        if not failed:
            _same_step(ctx, path, steps)
            _loaded(ctx, root, path, tracker, rejected)
            return
        why = local or f"failed to load on ranks {failed} (see their logs)"
        if not fallback:
            raise CheckpointError(f"cannot resume from checkpoint {path}: {why}; fix or remove it, or set "
                                  f"checkpoint.on_corrupt=fallback", path=str(path), phase="train", rank=ctx.rank)
        log.warning("checkpoint %s is unusable (%s); trying an older one", path, why)
        rejected[str(path)] = why
    if ck.resume == "required":
        detail = f"; rejected: {rejected}" if rejected else ""
        raise CheckpointError(f"checkpoint.resume=required but {root} holds no usable checkpoint{detail}; start "
                              f"with checkpoint.resume=auto or point checkpoint.dir at a run", path=str(root),
                              phase="train", rank=ctx.rank)
    if rejected or tracker.present:
        log.warning("no usable checkpoint in %s: starting from step 0", root)
        if ctx.rank == 0:
            _set_aside(root, rejected, keep=None)
            ckptdir.drop_tracker(root, "it names no usable checkpoint")


def _loaded(ctx: RunContext, root: Path, path: Path, tracker: ckptdir.Tracker, rejected: dict[str, str]) -> None:
    ctx.resumed_from = ctx.step
    if ctx.rank == 0:
        _set_aside(root, rejected, keep=path)
        if tracker.name != path.name or tracker.error is not None:
            ckptdir.write_tracker(root, ctx.resumed_from)  # the tracker must name what is there and loads
        ckptdir.set_aside_untracked(root, path.name)
        again = f"attempt {ctx.attempt}: " if ctx.attempt > 1 else ""
        print(f"{again}resumed from step {ctx.step} ({path})", flush=True)


def _set_aside(root: Path, rejected: dict[str, str], keep: Path | None) -> None:
    """Rank 0: rejected checkpoints newer than the one loaded are renamed aside (never deleted)."""
    limit = ckptdir.step_of(keep.name) if keep is not None else -1
    for name, why in rejected.items():
        folder = Path(name)
        step = ckptdir.step_of(folder.name)
        if folder.is_dir() and step is not None and limit is not None and step > limit:
            ckptdir.set_aside(folder, why)
