"""Checked states: a state holding a NaN or inf is never saved to either checkpoint tier.

Before a save (``checkpoint.check_finite``) the rank checks every floating tensor of its state — the memory tier's
copy, or the live parameters and optimizer state before a persistent save — and a non-finite one fails the run on
that rank (exit ``rank_failed``) naming the tensor: its peers learn it from the watchdog, and the next attempt resumes
from the newest good state (a memory copy or a commit), never from the bad one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from lifecycle.errors import BadState

if TYPE_CHECKING:
    import torch

    from lifecycle.context import RunContext

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
