"""Resume: load the newest usable checkpoint, the same on every rank, or say why not.

Every rank tries the same candidates in the same order and the ranks agree after each attempt (the digest check of
their shares first, then the load, then the step each loaded), so a checkpoint that fails on one rank is rejected on
all of them and no rank is left in a collective its peers skipped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lifecycle.checkpoint import binding, ckptdir
from lifecycle.errors import CheckpointError, NoProgress, Shutdown
from lifecycle.recovery import rejections

if TYPE_CHECKING:
    from lifecycle.context import RunContext

log = logging.getLogger(__name__)


def _is_interrupt(exc: BaseException) -> bool:
    return isinstance(exc, KeyboardInterrupt | SystemExit | Shutdown)


def _try_load(ctx: RunContext, path: Path) -> str | None:
    """Load ``path`` on this rank; the reason it failed, or None. torch's CheckpointException derives from
    BaseException: everything but an interrupt is a load failure here. A failed load leaves ``ctx.step`` as it was."""
    before = ctx.step
    try:
        with ctx.events.span("resume", path=str(path), deadline="checkpoint"):  # a load, not a step
            loaded = int(ctx.require_step_handler().load(ctx, path))
            if not 0 <= loaded <= binding.MAX_STEP:
                raise ValueError(f"the files hold step {loaded}, which no run reaches (forged or corrupted)")
            ctx.progress.step = loaded
    except BaseException as exc:  # noqa: BLE001 - see the docstring
        if _is_interrupt(exc):
            raise
        ctx.progress.step = before
        return _reason(exc)
    return None


@dataclass
class Tried:
    """One candidate tried on every rank: this rank's reason it is unusable (None: usable here), the ranks on which
    it is not, the step every rank loaded, and whether the ranks ran the load (their state may have changed)."""

    reason: str | None
    failed: list[int]
    steps: dict[int, int]
    loaded: bool


def _verify_then_load(ctx: RunContext, path: Path) -> Tried:
    """With ``checkpoint.verify: digest`` every rank first checks its share of the files and the ranks agree on the
    outcome before any of them starts the load: the load is collective (torch_dist), so a rank that skipped it
    would leave the others in a mismatched collective."""
    if ctx.policy.checkpoint.verify == "digest":
        with ctx.events.span("verify", path=str(path), deadline="checkpoint"):
            changed = ckptdir.changed(path, ctx.rank, ctx.world_size)
        failed, steps = _agree_loaded(ctx, changed is not None)
        if failed:
            why = changed or f"files changed since the commit (found by ranks {failed}; see their logs)"
            return Tried(why, failed, steps, loaded=False)
    local = _try_load(ctx, path)
    failed, steps = _agree_loaded(ctx, local is not None)
    return Tried(local, failed, steps, loaded=True)


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
    ctx.ops.count("world")
    rows = [t.cpu().tolist() for t in out]
    return [r for r, row in enumerate(rows) if int(row[0])], {r: int(row[1]) for r, row in enumerate(rows)}


def _same_step(ctx: RunContext, path: Path, steps: dict[int, int]) -> str | None:
    """Every rank loaded the step ``path`` is named for, or why not: ranks that loaded different steps are a
    CheckpointError (exit 2) on every rank naming who loaded what (resuming them would diverge and hang at the next
    commit); every rank at another step than the folder's name is a damaged checkpoint (its files belong to another
    save), the reason returned."""
    expected = ckptdir.step_of(path.name)
    if len(set(steps.values())) > 1:
        by_step: dict[int, list[int]] = {}
        for rank, step in sorted(steps.items()):
            by_step.setdefault(step, []).append(rank)
        shown = "; ".join(f"step {s}: ranks {r}" for s, r in sorted(by_step.items()))
        raise CheckpointError(f"checkpoint {path} (step {expected}) loads different steps on different ranks "
                              f"({shown}): some rank's files belong to another save; remove or restore the checkpoint "
                              f"before resuming", path=str(path), phase="train", rank=ctx.rank)
    loaded = next(iter(steps.values()), expected)
    if loaded != expected:
        return f"its files hold step {loaded}, not step {expected} (they belong to another save)"
    return None


def _layout_change(ctx: RunContext, path: Path) -> list[str]:
    """What differs between what ``path`` was written with (its manifest: the layout, the kind's options) and this
    run: [] when nothing does (or the manifest predates the record). A layout change the step handler cannot load
    resharded is a CheckpointError (exit 2) naming it: another world size, layout or model is never damage, and
    nothing is set aside for it. Local: every rank reads the same manifest and decides the same."""
    bound = ckptdir.read_binding(path)
    now = binding.layout(ctx.policy, ctx.world_size, own_loop=ctx.own_loop)
    saved = bound.layout or {}
    moved = binding.changes(saved, now)
    options = binding.option_changes(bound.options, binding.options(ctx.policy, own_loop=ctx.own_loop))
    if not moved:
        return options
    if "kind" in binding.changed_keys(saved, now):
        why: str | None = f"it holds the state of train.kind {saved.get('kind')}, not {now.get('kind')}"
    else:
        rule = getattr(ctx.require_step_handler(), "reshard", None)
        why = rule(saved, now) if callable(rule) else "this train kind does not load a checkpoint at another layout"
    if why:
        raise CheckpointError(f"cannot resume from checkpoint {path}: it was written at {binding.describe(saved)}, this "
                              f"run is {binding.describe(now)} ({', '.join(moved)}), and {why}. {_NOT_DAMAGE}",
                              path=str(path), phase="train", rank=ctx.rank)
    if ctx.rank == 0:
        print(f"resuming {path.name} resharded: {', '.join(moved)}", flush=True)
    return moved + options


_NOT_DAMAGE = ("A change of layout or model is not damage: nothing was set aside. Run with what it was written with, "
               "or start a new run (another run.dir or checkpoint.dir)")


def resume_tiers(ctx: RunContext) -> bool:
    """Every rank, after the step handler's setup: the memory tier's start (``checkpoint.memory``) and its copies
    when they are newer than the last commit, else the persistent tier (:func:`resume`) unless ``resume: never``.
    Whether a step was resumed."""
    from lifecycle.recovery.memory import tier

    memory, touched = tier(ctx), False
    if memory is not None:
        tracked = memory.start(ctx)
        if ctx.policy.checkpoint.resume != "never":
            restored = memory.restore(ctx, tracked)
            if restored:
                return True
            touched = restored is False
    if ctx.policy.checkpoint.resume == "never":
        return False
    resume(ctx, touched=touched)
    return ctx.progress.resumed_from is not None


def resume(ctx: RunContext, *, touched: bool = False) -> None:
    """Load the newest usable checkpoint. Every rank calls it and tries the same candidates in the same order.

    ``on_corrupt: error``: a tracker or checkpoint that cannot be used is a :class:`CheckpointError` (exit 2)
    naming the path and the reason. ``fallback``: older complete checkpoints are tried newest first, each
    rejection logged; rank 0 then sets the rejected ones aside and points the tracker at the one loaded. Either
    way every rank ends on the same step, loaded from a folder whose files hold that step, or every rank starts
    fresh; a checkpoint of another layout is loaded resharded or refused (:func:`_layout_change`), never set aside.
    ``touched``: a memory-tier load ran and failed (the model must be rebuilt if nothing loads here).
    """
    ck = ctx.policy.checkpoint
    root = Path(ck.dir)
    found = ckptdir.candidates(root)
    tracker = found.tracker
    fallback = ck.on_corrupt == "fallback"
    _refuse_unusable_head(ctx, root, found, fallback)
    rejected = dict(found.rejected)
    for name, reason in rejected.items():
        log.warning("checkpoint %s is unusable: %s", name, reason)
    refused = rejections.read(root)["persistent"]
    for path in found.paths:
        if path.name in refused:  # once: the commit before it is tried, whatever checkpoint.on_corrupt says
            log.warning("checkpoint %s is not used: rejected after an earlier restore (%s); trying an older one",
                        path, refused[path.name])
    start = ctx.step
    for path in (p for p in found.paths if p.name not in refused):
        moved = _layout_change(ctx, path)
        tried = _verify_then_load(ctx, path)
        touched = touched or tried.loaded
        why = tried.reason or (f"failed to load on ranks {tried.failed} (see their logs)" if tried.failed else
                               _same_step(ctx, path, tried.steps))
        if why is None:
            _loaded(ctx, root, path, tracker, rejected)
            return
        ctx.progress.step = start
        if moved and tried.loaded:
            raise CheckpointError(f"cannot resume from checkpoint {path} with what changed since it was written "
                                  f"({', '.join(moved)}): {why}. {_NOT_DAMAGE}", path=str(path), phase="train",
                                  rank=ctx.rank)
        if not fallback:
            raise CheckpointError(f"cannot resume from checkpoint {path}: {why}; fix or remove it, or set "
                                  f"checkpoint.on_corrupt=fallback", path=str(path), phase="train", rank=ctx.rank)
        log.warning("checkpoint %s is unusable (%s); trying an older one", path, why)
        rejected[str(path)] = why
    if any(p.name in refused for p in found.paths):
        # never silently from step 0 because the restored states failed their first step: someone must look
        raise NoProgress(f"every checkpoint in {root} this run could resume from was rejected after a restore or "
                         f"cannot be used ({', '.join(sorted(refused))} in {root / rejections.NAME}): not starting "
                         f"over from step 0; find what made the first step after the restore fail (its logs), then "
                         f"remove the entry from that file to try it again", phase="train", rank=ctx.rank)
    _start_fresh(ctx, root, tracker, rejected, touched)


def _refuse_unusable_head(ctx: RunContext, root: Path, found: ckptdir.Candidates, fallback: bool) -> None:
    """Without ``on_corrupt: fallback``: a tracker that cannot be used, checkpoints without a tracker, or a tracked
    checkpoint that is not complete are a CheckpointError (exit 2) naming it."""
    if fallback:
        return
    tracker = found.tracker
    if tracker.error is not None:
        raise CheckpointError(f"cannot resume: the tracker {tracker.path} {tracker.error}; fix or remove it, or "
                              f"set checkpoint.on_corrupt=fallback to load the newest complete checkpoint",
                              path=str(tracker.path), phase="train", rank=ctx.rank)
    if tracker.name is None and found.paths:
        raise CheckpointError(f"cannot resume: {root} holds checkpoints ({found.paths[0].name} ...) but no tracker "
                              f"({ckptdir.TRACKER}); set checkpoint.on_corrupt=fallback to load the newest complete "
                              f"one, or checkpoint.resume=never to start over", path=str(root), phase="train",
                              rank=ctx.rank)
    head = str(root / tracker.name) if tracker.name else None
    if head is not None and head in found.rejected:
        raise CheckpointError(f"cannot resume from checkpoint {head}: {found.rejected[head]}; fix or remove it, or "
                              f"set checkpoint.on_corrupt=fallback", path=head, phase="train", rank=ctx.rank)


def _start_fresh(ctx: RunContext, root: Path, tracker: ckptdir.Tracker, rejected: dict[str, str],
                 touched: bool) -> None:
    """No candidate loaded on every rank: start from step 0 on every rank, with the state the run starts with (a
    load that ran and was then rejected may have changed some rank's weights: the step handler rebuilds them), or
    refuse with ``resume: required``."""
    ck = ctx.policy.checkpoint
    if ck.resume == "required":
        detail = f"; rejected: {rejected}" if rejected else ""
        raise CheckpointError(f"checkpoint.resume=required but {root} holds no usable checkpoint{detail}; start "
                              f"with checkpoint.resume=auto or point checkpoint.dir at a run", path=str(root),
                              phase="train", rank=ctx.rank)
    if touched:
        rebuild = getattr(ctx.require_step_handler(), "rebuild", None)
        if not callable(rebuild):
            raise CheckpointError(f"no checkpoint in {root} loads on every rank, and the model was partly loaded "
                                  f"from the rejected ones ({', '.join(Path(p).name for p in rejected)}): it cannot "
                                  f"start fresh from that state; restore a checkpoint or start a new run (another "
                                  f"checkpoint.dir)", path=str(root), phase="train", rank=ctx.rank)
        log.warning("the model was partly loaded from rejected checkpoints: rebuilding it from run.seed")
        rebuild(ctx)
    if rejected or tracker.present:
        log.warning("no usable checkpoint in %s: starting from step 0", root)
        if ctx.rank == 0:
            _set_aside(root, rejected, keep=None)
            ckptdir.drop_tracker(root, "it names no usable checkpoint")


def _loaded(ctx: RunContext, root: Path, path: Path, tracker: ckptdir.Tracker, rejected: dict[str, str]) -> None:
    ctx.progress.resumed_from = ctx.step
    ctx.progress.resumed_tier = "persistent"
    ctx.progress.restored = ("persistent", path.name, ckptdir.read_binding(path).loss)
    if ctx.rank == 0:
        _set_aside(root, rejected, keep=path)
        if tracker.name != path.name or tracker.error is not None:
            ckptdir.write_tracker(root, ctx.progress.resumed_from)  # the tracker must name what is there and loads
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
