"""The commit protocol: save, agree off the default group, digest, commit in two phases, prune.

Layout and invariants are those of :mod:`lifecycle.checkpoint.ckptdir`: a save is written to ``iter_NNNNNNN.tmp/``;
once every rank's files are durable (agreed over the TCPStore, or a dedicated gloo group — never the default/NCCL
group), the ranks hash their shares of the files, global rank 0 finalizes the metadata, records the manifest, renames
the folder to ``iter_NNNNNNN/`` and then replaces the tracker atomically. A crash at any moment leaves the previous
checkpoint and tracker intact. Pruning counts complete checkpoints only and never deletes the tracker's or the one
this run resumed from. :class:`TrainerSave` is the same protocol around a trainer's own save (``job.checkpoint``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import lifecycle.rundir as rundir
from lifecycle.checkpoint import binding, ckptdir
from lifecycle.context import PendingSave
from lifecycle.errors import CheckpointError, PhaseError
from lifecycle.phases.base import Action, GroupView, barrier_actions, deadline_text, sequence_check
from lifecycle.phases.points import run_points

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lifecycle.context import RunContext
    from lifecycle.jsontypes import JsonDict
    from lifecycle.policy.schema import Policy

log = logging.getLogger(__name__)


ASYNC_COMMIT = "async_commit"
"""The reason that asks the checkpoint phase to commit the pending async save (at the next step boundary)."""


def plan(policy: Policy, view: GroupView | None = None) -> list[Action]:
    """The checkpoint phase's actions (:func:`save`, then :func:`finish_pending` at once or, async, at the next
    step boundary)."""
    ck = policy.checkpoint
    if policy.train.steps == 0 or not (ck.every_steps or ck.at_end or ck.on_signal):
        return []
    dl = policy.deadline("checkpoint")
    when = [f"every {ck.every_steps} steps" if ck.every_steps else "", "at end" if ck.at_end else "",
            f"on {'/'.join(ck.signals)}" if ck.on_signal else ""]
    digest = ([Action("barrier:ckpt_written", "world", dl, "via store; every rank's files are written (rank 0 "
                      "finalized) before any rank hashes them", when="world size > 1"),
               Action("digest", None, dl, "each rank hashes its share of the files (sha256)"),
               Action("barrier:ckpt_digested", "world", dl, "via store; the digests reach rank 0",
                      when="world size > 1")]
              if ck.verify == "digest" else [])
    replicas = ([Action("replica_check", None, dl, "per-tensor digests all-gathered over each data-parallel replica "
                        "group the kind names (megatron: dp_cp, edp); the odd ranks fail",
                        when="check_replicas, replica groups of 2+ ranks")] if ck.check_replicas else [])
    return [
        *replicas,
        *barrier_actions(policy, "before_checkpoint", dl),
        Action("barrier:ckpt_prepare", "world", dl, "via store; rank 0 cleared the .tmp folder"),
        Action("save", "world", dl, f"deadline {deadline_text(policy, 'checkpoint')}; {'async' if ck.async_ else 'sync'}"
               f", {'fully parallel' if ck.fully_parallel else 'plain'}; {', '.join(w for w in when if w)}"),
        Action("commit", None, dl, f"every rank's writes agreed over the {ck.coordination}"
               f"{'; at the next step boundary' if ck.async_ else ''}"),
        *digest,
        Action("barrier:ckpt_committed", "world", dl, f"via store; rank 0 wrote the manifest, renamed .tmp -> "
               f"iter_N, the trackers, keep_last={ck.keep_last}"),
        *barrier_actions(policy, "after_checkpoint", dl),
        *sequence_check(policy, "checkpoint -> train"),
    ]


def _all_ranks(ctx: RunContext) -> list[int]:
    return list(range(ctx.world_size))


def save(ctx: RunContext, reason: str) -> None:
    """Save at the current step (``reason`` ASYNC_COMMIT: only commit the pending async save). Every rank calls it
    at the same step boundary, in the checkpoint phase."""
    from lifecycle.distributed.barrier import store_barrier

    if ctx.progress.pending_save is not None:
        finish_pending(ctx)
    if reason == ASYNC_COMMIT:
        return
    deadline = ctx.deadline("checkpoint")
    if ctx.policy.checkpoint.check_finite:
        from lifecycle.recovery.state_check import live_nonfinite, refuse_nonfinite

        refuse_nonfinite(ctx, live_nonfinite(ctx.require_step_handler()), ctx.step, "persistent")
    if ctx.policy.checkpoint.check_replicas:
        from lifecycle.recovery.state_check import check_replicas

        check_replicas(ctx, ctx.require_step_handler(), ctx.step, "persistent")
    run_points(ctx, "before_checkpoint", deadline)
    root = Path(ctx.policy.checkpoint.dir)
    final = root / ckptdir.iter_name(ctx.step)
    tmp = root / (final.name + ".tmp")
    ctx.drills.fire("checkpoint", step=ctx.step, op="save")
    key = ctx.ops.next_key("ckpt/prepare")
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
            handle = ctx.require_step_handler().begin_save(ctx, tmp)
            extra["host_copy"] = getattr(handle, "host_copy", None)
            extra["async_strategy"] = getattr(handle, "async_strategy", None)
        ctx.deadlines.observe("checkpoint", time.monotonic() - t0)
        ctx.progress.pending_save = PendingSave(handle, ctx.step, tmp, final, reason, loss=ctx.progress.last_loss)
        if not ctx.policy.checkpoint.async_:
            finish_pending(ctx)


def finish_pending(ctx: RunContext) -> None:
    """Wait for every rank's writes, then commit on rank 0. Every rank calls it at the same point."""
    from lifecycle.distributed.barrier import store_barrier

    pending, ctx.progress.pending_save = ctx.progress.pending_save, None
    if pending is None:
        return
    deadline = ctx.deadline("checkpoint")
    key = ctx.ops.next_key(f"ckpt/{pending.step}")
    ctx.drills.fire("checkpoint", step=pending.step, op="commit")
    t0 = time.monotonic()
    with ctx.events.span("commit", step=pending.step, path=str(pending.final)) as extra:
        _agree(ctx, pending, key, deadline)
        if ctx.policy.checkpoint.verify == "digest" and ctx.world_size > 1:
            # Over the store only rank 0 waits for every rank's writes: the others return once theirs are
            # published. A rank's share holds other ranks' files: none lists or hashes before every rank's are written.
            with ctx.events.span("barrier:ckpt_written", group="world", via="store"):
                store_barrier(ctx.require_store(), f"{key}/written", ctx.rank, _all_ranks(ctx), deadline,
                              phase="checkpoint", group="world")
        ctx.deadlines.observe("checkpoint", time.monotonic() - t0)  # the wait for every rank's writes: the long part
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
    ctx.progress.saved.append(str(pending.final))
    run_points(ctx, "after_checkpoint", deadline)


def _agree(ctx: RunContext, pending: PendingSave, key: str, deadline: float) -> None:
    if ctx.policy.checkpoint.coordination == "gloo":
        pending.handle.finalize_over_group(_gloo_group(ctx), deadline)
    else:
        pending.handle.finalize_via_store(ctx.require_store(), key, deadline)


def _gloo_group(ctx: RunContext) -> ProcessGroup:
    """A dedicated gloo group over every rank for checkpoint coordination (created at first use,
    at the same save on every rank, with the checkpoint deadline as its timeout)."""
    if ctx.comms.ckpt_group is None:
        import datetime

        import torch.distributed as dist

        ctx.comms.ckpt_group = dist.new_group(backend="gloo",
                                        timeout=datetime.timedelta(seconds=ctx.deadline("checkpoint")))
    return ctx.comms.ckpt_group


def digest_shares(ctx: RunContext, folder: Path, key: str, deadline: float) -> dict[str, str] | None:
    """``checkpoint.verify: digest``: every rank hashes its share of ``folder``'s files (every rank calls it, once
    every write is durable) and hands the digests to rank 0 through the store; rank 0 gets them all (the files its
    own listing holds that no rank hashed, it hashes itself), the other ranks None. Bounded by a store barrier
    that names the ranks that did not hand theirs in. The caller makes sure every rank's files are written (the
    ``barrier:ckpt_written`` of both commit paths)."""
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


def _learned(ctx: RunContext, folder: Path, sha256: dict[str, str] | None) -> None:
    """Rank 0: the watchdog's learned state into the folder being committed (digested with the rest)."""
    from lifecycle.checkpoint import learned

    if learned.write(ctx, folder) and sha256 is not None:
        sha256[learned.NAME] = ckptdir.digest(folder / learned.NAME)


def _commit(ctx: RunContext, pending: PendingSave, sha256: dict[str, str] | None) -> None:
    """Rank 0: manifest, rename into place, tracker, prune. Each step keeps the tracker's invariant."""
    _fence(ctx, pending.step)
    root = pending.final.parent
    _learned(ctx, pending.tmp, sha256)
    ckptdir.write_manifest(pending.tmp, sha256, step=pending.step, layout=_layout(ctx),
                           options=binding.options(ctx.policy, own_loop=ctx.own_loop), loss=pending.loss)
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
    protect = {ckptdir.iter_name(ctx.progress.resumed_from)} if ctx.progress.resumed_from is not None else set()
    pruned = ckptdir.prune(root, ctx.policy.checkpoint.keep_last, protect)
    log.info("checkpoint step %d committed: %s%s", pending.step, pending.final,
             f" (pruned {[p.name for p in pruned]})" if pruned else "")


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
        if ctx.progress.pending_save is not None:
            finish_pending(ctx)
        self.machine.enter("checkpoint")
        ctx.progress.step = self.step
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
        key = ctx.ops.next_key(f"ckpt/trainer/{self.step}")
        ctx.drills.fire("checkpoint", step=self.step, op="commit")
        with ctx.events.span("commit", step=self.step, path=str(path or "")):
            with ctx.events.span("barrier:ckpt_written", group="world", via="store"):
                store_barrier(ctx.require_store(), key, ctx.rank, _all_ranks(ctx), self.deadline,
                              phase="checkpoint", group="world")
            ctx.deadlines.observe("checkpoint", time.monotonic() - self._t0)
            sha256 = digest_shares(ctx, path, key, self.deadline) if path is not None else None
            if path is not None and ctx.rank == 0:
                _fence(ctx, self.step)
                if path.is_dir():
                    _learned(ctx, path, sha256)
                _commit_folder(path, self.step, sha256, _layout(ctx))
                from lifecycle.rundir.restarts import record_checkpoint_dir

                record_checkpoint_dir(ctx.run_dir, path.parent)
            with ctx.events.span("barrier:ckpt_committed", group="world", via="store"):
                store_barrier(ctx.require_store(), f"{key}/committed", ctx.rank, _all_ranks(ctx), self.deadline,
                              phase="checkpoint", group="world")
        if path is not None:
            ctx.progress.saved.append(str(path))
        run_points(ctx, "after_checkpoint", self.deadline)
        self.machine.enter("train")


class Phases(Protocol):
    def enter(self, phase: str) -> None: ...


def _layout(ctx: RunContext) -> JsonDict:
    return binding.layout(ctx.policy, ctx.world_size, own_loop=ctx.own_loop)


def _commit_folder(path: Path, step: int, sha256: dict[str, str] | None, layout: JsonDict) -> None:
    """Rank 0, once every rank's writes are done: the manifest, fsync, then the trackers (atomically)."""
    if not path.is_dir():
        raise CheckpointError(f"job.checkpoint({step}): the trainer's save left no folder at {path}; nothing to "
                              f"commit (the trackers still name the last committed checkpoint)", path=str(path),
                              phase="checkpoint", rank=0)
    ckptdir.write_manifest(path, sha256, step=step, layout=layout)
    ckptdir.fsync_dir(path)
    ckptdir.write_tracker(path.parent, step)
    log.info("checkpoint step %d committed (the trainer's save): %s", step, path)
