"""Checkpoint: save, agree off the default group, commit in two phases, prune; resume at start.

Layout and invariants are those of :mod:`lifecycle.ckptdir`: a save is written to ``iter_NNNNNNN.tmp/``; once
every rank's files are durable (agreed over the TCPStore, or a dedicated gloo group — never the default/NCCL
group), global rank 0 finalizes the metadata, records the manifest, renames the folder to ``iter_NNNNNNN/``
and then replaces the tracker atomically. A crash at any moment leaves the previous checkpoint and tracker
intact. Pruning counts complete checkpoints only and never deletes the tracker's or the one this run resumed
from. At resume every rank tries the same candidates in the same order and agrees after each attempt, so a
checkpoint that fails on one rank is rejected on all of them.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from lifecycle import ckptdir, rundir
from lifecycle.errors import CheckpointError, PhaseError
from lifecycle.phases.points import run_points

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lifecycle.context import RunContext
    from lifecycle.handlers.protocols import SaveHandle, StepHandler

log = logging.getLogger(__name__)


@dataclass
class PendingSave:
    handle: SaveHandle
    step: int
    tmp: Path
    final: Path
    reason: str


ASYNC_COMMIT = "async_commit"
"""The reason that asks the checkpoint phase to commit the pending async save (at the next step boundary)."""


def _all_ranks(ctx: RunContext) -> list[int]:
    return list(range(ctx.world_size))


def _handler(ctx: RunContext) -> StepHandler:
    if ctx.step_handler is None:
        raise PhaseError("no step handler: checkpoints need train.steps > 0", phase="checkpoint", rank=ctx.rank)
    return ctx.step_handler


def save(ctx: RunContext, reason: str) -> None:
    """Save at the current step (``reason`` ASYNC_COMMIT: only commit the pending async save). Every rank calls it
    at the same step boundary, in the checkpoint phase."""
    from lifecycle.distributed.barrier import store_barrier

    if ctx.pending_save is not None:
        finish_pending(ctx)
    if reason == ASYNC_COMMIT:
        return
    deadline = ctx.deadline("checkpoint")
    run_points(ctx, "before_checkpoint", deadline)
    root = Path(ctx.policy.checkpoint.dir)
    final = root / ckptdir.iter_name(ctx.step)
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
        t0 = time.monotonic()
        with ctx.events.span("save", step=ctx.step, reason=reason, path=str(final)) as extra:
            handle = _handler(ctx).begin_save(ctx, tmp)
            extra["host_copy"] = getattr(handle, "host_copy", None)
        ctx.observe("checkpoint", time.monotonic() - t0)
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
    t0 = time.monotonic()
    with ctx.events.span("commit", step=pending.step, path=str(pending.final)) as extra:
        _agree(ctx, pending, key, deadline)
        ctx.observe("checkpoint", time.monotonic() - t0)  # the wait for every rank's writes: the long part
        sha256 = digest_shares(ctx, pending.tmp, key, deadline)
        if ctx.rank == 0:
            try:
                _commit(ctx, pending, sha256)
            except OSError as exc:  # a full disk: the previous checkpoint and its tracker are still in place
                raise PhaseError(f"checkpoint step {pending.step}: committing {pending.final} failed "
                                 f"({exc.strerror or exc}); the last committed checkpoint stays the tracker's: free "
                                 f"space in {pending.final.parent} or point checkpoint.dir elsewhere",
                                 phase="checkpoint", rank=0) from exc
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


def digest_shares(ctx: RunContext, folder: Path, key: str, deadline: float) -> dict[str, str] | None:
    """``checkpoint.verify: digest``: every rank hashes its share of ``folder``'s files (every rank calls it, once
    every write is durable) and hands the digests to rank 0 through the store; rank 0 gets them all (the files its
    own listing holds that no rank hashed, it hashes itself), the other ranks None. Bounded by a store barrier
    that names the ranks that did not hand theirs in."""
    import json

    from lifecycle.distributed.barrier import store_barrier

    if ctx.policy.checkpoint.verify != "digest":
        return None
    names = list(ckptdir.listing(folder)) if folder.is_dir() else []
    with ctx.events.span("digest", path=str(folder)) as extra:
        mine = ckptdir.digests(folder, ckptdir.share(names, ctx.rank, ctx.world_size))
        extra["files"] = len(mine)
        if ctx.world_size == 1:
            return mine
        store = ctx.require_store()
        if ctx.rank != 0:
            store.set(f"{key}/sha256/{ctx.rank}", json.dumps(mine))
        with ctx.events.span("barrier:ckpt_digested", group="world", via="store"):
            store_barrier(store, f"{key}/digested", ctx.rank, _all_ranks(ctx), deadline, phase="checkpoint",
                          group="world")
        if ctx.rank != 0:
            return None
        for r in range(1, ctx.world_size):
            mine.update(json.loads(store.get(f"{key}/sha256/{r}")))
            store.delete_key(f"{key}/sha256/{r}")
        mine.update(ckptdir.digests(folder, [n for n in names if n not in mine]))
        return mine


def _fence(ctx: RunContext, step: int) -> None:
    """Rank 0 of an attempt that a newer one replaced (still alive under torchrun/SLURM) must not commit."""
    newer = rundir.newer_attempt(ctx.run_dir, ctx.attempt)
    if newer is not None:
        raise PhaseError(f"checkpoint step {step}: attempt {newer} of this run has started in {ctx.run_dir}; this "
                         f"rank belongs to attempt {ctx.attempt} and stops without committing (the new attempt owns "
                         f"the trackers)", phase="checkpoint", rank=ctx.rank)


def _commit(ctx: RunContext, pending: PendingSave, sha256: dict[str, str] | None) -> None:
    """Rank 0: manifest, rename into place, tracker, prune. Each step keeps the tracker's invariant."""
    _fence(ctx, pending.step)
    root = pending.final.parent
    ckptdir.write_manifest(pending.tmp, sha256)
    ckptdir.fsync_dir(pending.tmp)
    tracked = ckptdir.read_tracker(root).name
    if pending.final.exists():
        if pending.final.name == tracked and ckptdir.problem(pending.final) is None:
            # The same step, already committed (a resume at the last step): keep it, drop the copy.
            shutil.rmtree(pending.tmp)
            log.info("checkpoint step %d is already committed: %s", pending.step, pending.final)
            return
        ckptdir.set_aside(pending.final, "an older folder of the same step, never committed", kind="stale")
    os.replace(pending.tmp, pending.final)
    ckptdir.fsync_dir(root)
    ckptdir.write_tracker(root, pending.step)
    protect = {ckptdir.iter_name(ctx.resumed_from)} if ctx.resumed_from is not None else set()
    pruned = ckptdir.prune(root, ctx.policy.checkpoint.keep_last, protect)
    log.info("checkpoint step %d committed: %s%s", pending.step, pending.final,
             f" (pruned {[p.name for p in pruned]})" if pruned else "")


def _is_interrupt(exc: BaseException) -> bool:
    return isinstance(exc, KeyboardInterrupt | SystemExit) or type(exc).__name__ == "Shutdown"


def _try_load(ctx: RunContext, path: Path) -> str | None:
    """Load ``path`` on this rank; the reason it failed, or None. torch's CheckpointException derives from
    BaseException: everything but an interrupt is a load failure here."""
    try:
        with ctx.events.span("resume", path=str(path)):
            ctx.step = int(_handler(ctx).load(ctx, path))
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


class TrainerSave:
    """The trainer's own save of one step, wrapped by ``job.checkpoint(n, path)``.

    :meth:`begin` (every rank, at the same step): the checkpoint phase, ``before_checkpoint`` points, the save
    span under the checkpoint deadline. The trainer writes. :meth:`commit` (every rank): completion agreed over
    the store, never the default group (late ranks named); with ``path`` rank 0 then records the manifest,
    fsyncs and points the trackers at it (``latest``, Megatron-LM's file), and every rank learns it did.
    """

    def __init__(self, ctx: RunContext, machine: Phases, step: int, path: Path | None) -> None:
        if path is not None and path.name != ckptdir.iter_name(step):
            raise PhaseError(f"job.checkpoint({step}, path={path}): path must be the folder of step {step} named "
                             f"as Megatron-LM names it ({ckptdir.iter_name(step)}), where the trackers will point",
                             phase="checkpoint", rank=ctx.rank)
        self.ctx, self.machine, self.step, self.path = ctx, machine, step, path
        self.deadline = 0.0
        self._t0 = 0.0

    def begin(self) -> None:
        ctx = self.ctx
        if ctx.pending_save is not None:
            finish_pending(ctx)
        self.machine.enter("checkpoint")
        ctx.step = self.step
        self.deadline = ctx.deadline("checkpoint")
        run_points(ctx, "before_checkpoint", self.deadline)
        ctx.drills.fire("checkpoint", step=self.step, op="save")
        ctx.events.emit("begin", "save", step=self.step, reason="trainer", path=str(self.path or ""))
        self._t0 = time.monotonic()

    def commit(self) -> None:
        from lifecycle.distributed.barrier import store_barrier

        ctx, path = self.ctx, self.path
        ctx.events.emit("end", "save", step=self.step, reason="trainer", path=str(path or ""),
                        dur_us=int((time.monotonic() - self._t0) * 1e6), outcome="ok")
        key = ctx.next_key(f"ckpt/trainer/{self.step}")
        ctx.drills.fire("checkpoint", step=self.step, op="commit")
        with ctx.events.span("commit", step=self.step, path=str(path or "")):
            with ctx.events.span("barrier:ckpt_written", group="world", via="store"):
                store_barrier(ctx.require_store(), key, ctx.rank, _all_ranks(ctx), self.deadline,
                              phase="checkpoint", group="world")
            ctx.observe("checkpoint", time.monotonic() - self._t0)
            sha256 = digest_shares(ctx, path, key, self.deadline) if path is not None else None
            if path is not None and ctx.rank == 0:
                _fence(ctx, self.step)
                _commit_folder(path, self.step, sha256)
            with ctx.events.span("barrier:ckpt_committed", group="world", via="store"):
                store_barrier(ctx.require_store(), f"{key}/committed", ctx.rank, _all_ranks(ctx), self.deadline,
                              phase="checkpoint", group="world")
        if path is not None:
            ctx.saved.append(str(path))
        run_points(ctx, "after_checkpoint", self.deadline)
        self.machine.enter("train")


class Phases(Protocol):
    def enter(self, phase: str) -> None: ...


def _commit_folder(path: Path, step: int, sha256: dict[str, str] | None) -> None:
    """Rank 0, once every rank's writes are done: the manifest, fsync, then the trackers (atomically)."""
    if not path.is_dir():
        raise CheckpointError(f"job.checkpoint({step}): the trainer's save left no folder at {path}; nothing to "
                              f"commit (the trackers still name the last committed checkpoint)", path=str(path),
                              phase="checkpoint", rank=0)
    ckptdir.write_manifest(path, sha256)
    ckptdir.fsync_dir(path)
    ckptdir.write_tracker(path.parent, step)
    log.info("checkpoint step %d committed (the trainer's save): %s", step, path)
