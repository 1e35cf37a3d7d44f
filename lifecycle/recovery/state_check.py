"""Checked states: a state holding a NaN or inf is never saved to either checkpoint tier.

Before a save (``checkpoint.check_finite``) the rank checks every floating tensor of its state — the memory tier's
copy, or the live parameters and optimizer state before a persistent save — and a non-finite one fails the run on
that rank (exit ``rank_failed``) naming the tensor: its peers learn it from the watchdog, and the next attempt resumes
from the newest good state (a memory copy or a commit), never from the bad one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lifecycle.errors import BadState

if TYPE_CHECKING:
    import torch

    from lifecycle.context import RunContext
    from lifecycle.distributed.agree import Agreements

log = logging.getLogger(__name__)


def first_nonfinite(state: object, prefix: str = "") -> tuple[str, int] | None:
    """The first floating tensor in ``state`` (nested dicts, lists, tuples) holding a NaN or inf, and how many."""
    return _first(list(_tensors(state, prefix)))


def _first(named: list[tuple[str, torch.Tensor]]) -> tuple[str, int] | None:
    """One fused check per dtype and device (a few ops, not one per tensor); the names only when it finds one."""
    import torch

    floats = [(n, t.detach()) for n, t in named if (t.is_floating_point() or t.is_complex()) and t.numel()]
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for _, t in floats:
        groups.setdefault((t.dtype, t.device), []).append(t.reshape(-1))
    if all(bool(torch.isfinite(torch.cat(ts)).all()) for ts in groups.values()):
        return None
    for name, t in floats:
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            return name, bad
    return None


def _tensors(state: object, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    import torch

    if isinstance(state, torch.Tensor):
        yield prefix or "tensor", state
        return
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list | tuple) else ()
    for key, value in items:
        yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))


def live_nonfinite(handler: object) -> tuple[str, int] | None:
    """The first non-finite tensor of a step handler's live state: its modules' parameters and buffers (the built-in
    kinds' and a watched trainer's), then its optimizer's state."""
    import torch

    state = getattr(handler, "state", None)
    modules = [getattr(handler, "model", None), *(getattr(handler, "chunks", None) or []),
               *(getattr(state, "chunks", None) or [])]
    named: list[tuple[str, torch.Tensor]] = []
    for i, module in enumerate(m for m in modules if isinstance(m, torch.nn.Module)):
        named += [(f"model{i}.{name}", t) for name, t in [*module.named_parameters(), *module.named_buffers()]]
    optimizer = getattr(handler, "optimizer", None) or getattr(state, "optimizer", None)
    for k, sub in enumerate(getattr(optimizer, "chained_optimizers", None) or [optimizer]):
        inner = getattr(sub, "optimizer", sub)
        named += list(_tensors(list(getattr(inner, "state", {}).values()), f"optimizer{k}.state"))
    return _first(named)


def refuse_nonfinite(ctx: RunContext, found: tuple[str, int] | None, step: int, tier: str) -> None:
    """A :class:`~lifecycle.errors.BadState` on this rank naming ``found`` (the tensor, its non-finite count), recorded as a
    ``state_check`` event; nothing when ``found`` is None."""
    if found is None:
        return
    name, bad = found
    ctx.events.instant("state_check", step=step, tier=tier, tensor=name, nonfinite=bad)
    raise BadState(f"rank {ctx.rank}: the state of step {step} holds {bad} non-finite value(s) in {name}: not "
                          f"saved to the {tier} tier; the next attempt resumes from the last good state",
                          phase=ctx.events.phase, rank=ctx.rank)


# ---- data-parallel replicas ---------------------------------------------------------------------------------------
_CHUNK = 1 << 22  # words per piece of a digest: bounds the int64 temporaries (32 MiB) whatever the tensor's size


def digests(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """``[n, 2]`` int64 on the tensors' device: per tensor, the wrapping sums of its 32-bit words (bytes when its
    size is not a multiple of 4) and of their squares. Any single changed bit moves the first; bit-exact replicas
    give equal rows. Local; one pass over each tensor: small tensors in batches of up to ``_CHUNK`` words (a handful
    of kernels per batch, not per tensor), a large one in pieces of ``_CHUNK``."""
    import torch

    rows: list[torch.Tensor | None] = [None] * len(named)
    batch: list[tuple[int, torch.Tensor]] = []
    size = 0  # words in the batch
    for i, (_, t) in enumerate(named):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
        if words.numel() > _CHUNK:
            rows[i] = _pieces(words)
            continue
        if batch and (batch[0][1].dtype != words.dtype or batch[0][1].device != words.device
                      or size + words.numel() > _CHUNK):
            _batched(batch, rows)
            batch, size = [], 0
        batch.append((i, words))
        size += words.numel()
    if batch:
        _batched(batch, rows)
    if not rows:
        return torch.zeros((0, 2), dtype=torch.int64)
    return torch.stack([r for r in rows if r is not None])


def _pieces(words: torch.Tensor) -> torch.Tensor:
    """``[2]``: the wrapping sums of one large tensor's words and of their squares, ``_CHUNK`` words at a time."""
    import torch

    s1 = torch.zeros((), dtype=torch.int64, device=words.device)
    s2 = torch.zeros((), dtype=torch.int64, device=words.device)
    for piece in words.split(_CHUNK):
        x = piece.to(torch.int64)
        s1 += x.sum()
        s2 += (x * x).sum()
    return torch.stack([s1, s2])


def _batched(batch: list[tuple[int, torch.Tensor]], rows: list[torch.Tensor | None]) -> None:
    """The rows of several small tensors (one dtype and device, ``_CHUNK`` words together) from one concatenation:
    per tensor, differences of the running sums at its bounds (the same wrapping sums as :func:`_pieces`)."""
    import torch

    x = torch.cat([w for _, w in batch]).to(torch.int64)
    zero = torch.zeros(1, dtype=torch.int64, device=x.device)
    both = torch.stack([torch.cat([zero, x.cumsum(0)]), torch.cat([zero, (x * x).cumsum(0)])], dim=1)
    ends = torch.tensor([w.numel() for _, w in batch], dtype=torch.int64).cumsum(0).to(x.device)
    sums = both[ends] - both[torch.cat([zero, ends[:-1]])]
    for (i, _), row in zip(batch, sums, strict=True):
        rows[i] = row


def disagreement(rows: list[list[tuple[int, int]]], ranks: list[int]) -> tuple[int, list[int], list[int]] | None:
    """``(tensor index, the ranks that differ, the others)`` for the first tensor whose digests differ across the
    replicas ``ranks`` (``rows[i]``: rank ``ranks[i]``'s digests); the odd ones are those outside the largest group of
    equal digests, or every rank when no group is larger than the others. None when all agree. Pure."""
    for k in range(len(rows[0]) if rows else 0):
        by: dict[tuple[int, int], list[int]] = {}
        for i, row in enumerate(rows):
            by.setdefault(row[k], []).append(ranks[i])
        if len(by) == 1:
            continue
        sizes = sorted((len(v) for v in by.values()), reverse=True)
        if sizes[0] == sizes[1]:
            return k, sorted(ranks), []
        major = max(by.values(), key=len)
        return k, sorted(r for r in ranks if r not in major), sorted(major)
    return None


def check_replicas(ctx: RunContext, handler: object, step: int, tier: str) -> None:
    """Every data-parallel replica group the handler names (``replicas(ctx)``: ``[(group name, named tensors)]``)
    compares its digests (one all-gather per group, under the checkpoint deadline): ranks whose weights differ from the
    majority (every rank when there is none) fail with :class:`~lifecycle.errors.BadState` naming the group, the
    tensor and the ranks — the others go on and are taken down by that failure, so the state is never saved.
    Collective on each named group (every rank of it calls this at the same boundary); nothing for a handler that
    names none. (The memory tier takes the digests with :func:`replica_rows` and compares them off the training
    thread: :func:`compare_rows`.)"""
    import time

    import torch
    import torch.distributed as dist

    from lifecycle.distributed.collectives import wait_works
    from lifecycle.distributed.groups import group_ranks

    replicas = getattr(handler, "replicas", None)
    if not callable(replicas):
        return
    for name, named in replicas(ctx):
        found = group_ranks(ctx.parallel, name)
        if found is None or len(found[1]) < 2 or not named:
            continue
        pg, ranks = found
        mine = digests(named)
        gathered = [torch.empty_like(mine) for _ in ranks]
        with ctx.events.span("replica_check", group=name, step=step, tensors=len(named)):
            work = dist.all_gather(gathered, mine, group=pg, async_op=True)
            wait_works([work], "all_gather(replica digests)", name, ranks, ctx.deadline("checkpoint"),
                       time.monotonic())
        ctx.count_op(name)
        rows = [[(int(a), int(b)) for a, b in g.cpu().tolist()] for g in gathered]
        odd = disagreement(rows, ranks)
        if odd is not None:
            k, differ, agree = odd
            replica_verdict(ctx, Diverged(name, named[k][0], differ, agree), step, tier)


@dataclass(frozen=True)
class Diverged:
    """Replicas that disagree: the group, the first tensor that differs, the odd ranks and the others."""

    group: str
    tensor: str
    differ: list[int]
    agree: list[int]


def replica_verdict(ctx: RunContext, found: Diverged, step: int, tier: str) -> None:
    """A ``state_check`` event; then a :class:`~lifecycle.errors.BadState` on the odd ranks (the culprits), a warning
    on the others (the save cannot complete without the odd ones)."""
    ctx.events.instant("state_check", step=step, tier=tier, check="replicas", group=found.group, tensor=found.tensor,
                       ranks=found.differ[:64], agree=found.agree[:64])
    who = (f"ranks {found.differ} differ from ranks {found.agree}" if found.agree
           else f"ranks {found.differ} disagree (no majority)")
    if ctx.rank in found.agree:
        log.warning("the data-parallel replicas on group %s disagree at step %d: %s in %s; they fail, so nothing of "
                    "this step is saved", found.group, step, who, found.tensor)
        return
    raise BadState(f"rank {ctx.rank}: the data-parallel replicas on group {found.group} disagree at step {step}: "
                   f"{who} in {found.tensor}; not saved to the {tier} tier; the next attempt resumes from the last good "
                   f"state", phase=ctx.events.phase, rank=ctx.rank)


@dataclass(frozen=True)
class ReplicaRows:
    """One rank's digests of every replica group the handler names, taken at a step boundary on the training thread
    (cheap and local) to be compared later by :func:`compare_rows`. ``payload``: int64 ``[G, c_0 .. c_G-1, rows]``,
    ``c_i`` the number of tensors of group ``i`` (0 where it is skipped: fewer than 2 ranks, no tensor)."""

    groups: list[tuple[str, list[int], list[str]]]
    """(group name, its ranks, the tensor names) in the handler's order."""
    payload: torch.Tensor


def replica_rows(ctx: RunContext, handler: object) -> ReplicaRows | None:
    """This rank's :class:`ReplicaRows`, or None when the handler names no replica group of 2+ ranks."""
    replicas = getattr(handler, "replicas", None)
    if not callable(replicas):
        return None
    return ReplicaPlan.of(ctx, replicas(ctx)).rows()


def replica_plan(ctx: RunContext, handler: object, state: object) -> ReplicaPlan | None:
    """Which tensors of a memory copy ``state`` to digest for each replica group (the handler's ``replicas_in(ctx,
    state)``: its ``replicas`` with the copy's tensors, which hold the same values), so that the digests can be
    taken off the training thread; None when the handler cannot name them in the copy (then :func:`replica_rows`
    digests the live tensors, now)."""
    replicas_in = getattr(handler, "replicas_in", None)
    if not callable(replicas_in):
        return None
    try:
        return ReplicaPlan.of(ctx, replicas_in(ctx, state))
    except (KeyError, IndexError, TypeError):  # a tensor the copy does not hold under that name
        return None


@dataclass
class ReplicaPlan:
    """The replica groups of a handler with their ranks, and the tensors to digest for each (groups of fewer than 2
    ranks keep none)."""

    groups: list[tuple[str, list[int], list[str]]]
    tensors: list[list[tuple[str, torch.Tensor]]]

    @classmethod
    def of(cls, ctx: RunContext, replicas: list[tuple[str, list[tuple[str, torch.Tensor]]]]) -> ReplicaPlan:
        """Local: the groups' ranks from the layout."""
        from lifecycle.distributed.groups import group_ranks

        groups: list[tuple[str, list[int], list[str]]] = []
        tensors: list[list[tuple[str, torch.Tensor]]] = []
        for name, named in replicas:
            found = group_ranks(ctx.parallel, name)
            ranks = list(found[1]) if found is not None and len(found[1]) >= 2 and named else []
            groups.append((name, ranks, [n for n, _ in named] if ranks else []))
            tensors.append(list(named) if ranks else [])
        return cls(groups, tensors)

    def rows(self) -> ReplicaRows | None:
        """The digests (:class:`ReplicaRows`), or None when no group has 2+ ranks. Any thread."""
        import torch

        if not any(ranks for _, ranks, _ in self.groups):
            return None
        rows = [digests(named).cpu().reshape(-1) if named else torch.zeros(0, dtype=torch.int64)
                for named in self.tensors]
        header = torch.tensor([len(self.groups), *(len(names) for _, _, names in self.groups)], dtype=torch.int64)
        return ReplicaRows(self.groups, torch.cat([header, *rows]))


def compare_rows(mine: ReplicaRows, payloads: dict[int, list[int]]) -> list[Diverged]:
    """Every group of ``mine`` whose replicas disagree, from each rank's payload (``payloads[rank]``, as
    :class:`ReplicaRows` lays it out; a rank missing or with another count of tensors differs). Pure."""
    out = []
    for i, (name, ranks, names) in enumerate(mine.groups):
        if not ranks:
            continue
        rows: list[list[tuple[int, int]]] = []
        for r in ranks:
            p = payloads.get(r) or [0]
            counts = p[1:1 + p[0]]
            if i >= len(counts) or counts[i] != len(names):
                rows.append([(-1, r)] * len(names))  # another shape: unlike everyone else's
                continue
            at = 1 + p[0] + 2 * sum(counts[:i])
            flat = p[at:at + 2 * counts[i]]
            rows.append([(flat[2 * k], flat[2 * k + 1]) for k in range(counts[i])])
        odd = disagreement(rows, ranks)
        if odd is not None:
            k, differ, agree = odd
            out.append(Diverged(name, names[k], differ, agree))
    return out


def replica_digests(agree: Agreements, rows: ReplicaRows, what: str, timeout_s: float) -> list[Diverged]:
    """Every replica group of ``rows`` whose digests disagree, through the store: each rank counts its own digest
    of each group (:meth:`~lifecycle.distributed.agree.Agreements.alike`); only a group whose count falls short
    reads its members' digests and compares them (:func:`compare_rows`). Every rank calls it (the agreement's
    barrier is over every rank)."""
    payload = rows.payload.tolist()
    counts = payload[1:1 + payload[0]]
    mine = []
    for i, (name, ranks, _) in enumerate(rows.groups):
        at = 1 + payload[0] + 2 * sum(counts[:i])
        token = json.dumps([counts[i], payload[at:at + 2 * counts[i]]]).encode()
        mine.append((name, ranks, token))
    odd = agree.alike(what, mine, json.dumps(payload).encode(), timeout_s)
    if not odd:
        return []
    narrowed = ReplicaRows([(n, r if n in odd else [], t) for n, r, t in rows.groups], rows.payload)
    return compare_rows(narrowed, {r: json.loads(p) for got in odd.values() for r, p in got.items()})


# ---- the first step after a restore -------------------------------------------------------------------------------
def check_restored(ctx: RunContext, step: int, loss: float | None, restored: tuple[str, str, float | None]) -> None:
    """The first step after a restore (``checkpoint.check_restore``): a non-finite ``loss``, or one above
    ``restore_loss_factor`` x the loss recorded at save, rejects the restored state — recorded in the checkpoint
    folder, so the next attempt falls back to the one before it — and fails this rank with
    :class:`~lifecycle.errors.BadState`. Local (a rank without a loss checks nothing)."""
    import math

    from lifecycle.recovery import rejections

    ck = ctx.policy.checkpoint
    if not ck.check_restore or loss is None:
        return
    tier, key, saved = restored
    factor = ck.restore_loss_factor
    if not math.isfinite(loss):
        why = f"loss {loss}"
    elif factor is not None and saved is not None and saved > 0 and loss > factor * saved:
        why = f"loss {loss:.6g}, more than {factor:g} x the {saved:.6g} recorded at save"
    else:
        return
    what = f"the {tier} tier's {'copies of step ' + key.split(':')[-1] if tier == 'memory' else key}"
    rejections.add(ck.dir, tier, key, f"step {step} after the restore: {why} (rank {ctx.rank}, attempt {ctx.attempt})")
    ctx.events.instant("state_check", step=step, tier=tier, check="restore", restored=key, loss=str(loss),
                       saved=saved)
    raise BadState(f"rank {ctx.rank}: the first step after restoring {what} gave {why}: that state is rejected "
                   f"({Path(ck.dir) / rejections.NAME}); the next attempt falls back to the one before it",
                   phase=ctx.events.phase, rank=ctx.rank)
