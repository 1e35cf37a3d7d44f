"""Two pieces of the MoE layer that the zero-token drill needs, inside the real megatron-core model.

- :func:`skip_empty_experts`: a ``SequentialMLP`` that does no GEMM when its rank received no token, as
  ``TEGroupedMLP`` and grouped-GEMM kernels do (megatron's ``SequentialMLP`` on CPU runs empty GEMMs, which
  keep the expert parameters in autograd; these do not). ``train.options.experts_skip_empty``.
- :class:`ZeroTokenRouting`: makes the routers of an expert-parallel group send no token to the local
  experts of chosen ranks (the ``zero_tokens`` fault drill), by masking those experts' router logits.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from lifecycle.errors import UsageError

logger = logging.getLogger(__name__)

_MASKED = -1.0e9
"""Logit of a masked expert: exp() of it underflows to exactly 0 in fp32, and it stays finite."""


@functools.cache
def skip_empty_experts() -> type:
    """megatron's ``SequentialMLP`` that skips its GEMMs on empty input (built on first use: imports megatron)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    class SkipEmptySequentialMLP(SequentialMLP):  # type: ignore[misc, valid-type]
        """``SequentialMLP`` that, like TEGroupedMLP's grouped GEMM, does no GEMM when it has no token."""

        def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: Any,
                    permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
            if permuted_local_hidden_states.shape[0] == 0:
                # The probs still scale the (empty) activations outside the GEMMs, so hidden and probs stay
                # in the graph (the dispatcher's all-to-all backward runs); the expert weights do not.
                return permuted_local_hidden_states * permuted_probs.unsqueeze(-1), None
            out: tuple[torch.Tensor, None] = super().forward(permuted_local_hidden_states, tokens_per_expert,
                                                             permuted_probs)
            return out

    return SkipEmptySequentialMLP


def with_experts(spec: Any, experts_cls: type) -> Any:
    """``spec`` — a transformer layer's spec, or the MoE layer's own — with ``experts_cls`` as its experts module.

    megatron-core describes the MoE layer in several ways: up to 0.16 a ``ModuleSpec`` whose ``submodules.experts`` is
    a ``ModuleSpec`` (its module replaced in place); in 0.17 and 0.18 the experts are a ``functools.partial`` of
    ``SequentialMLP`` inside that ``ModuleSpec``; from 0.19 the MoE layer itself is ``functools.partial(MoELayer,
    submodules=MoESubmodules(experts=functools.partial(SequentialMLP, submodules=...)))``. A partial is replaced by a
    new one with the same arguments. Anything else is a :class:`~lifecycle.errors.UsageError` that says what was
    found. Returns the spec to build (the same object for a layer spec).
    """
    layer = getattr(spec, "submodules", None)
    if layer is not None and hasattr(layer, "mlp"):  # a transformer layer: its MLP is the MoE layer
        layer.mlp = with_experts(layer.mlp, experts_cls)
        return spec
    if isinstance(spec, functools.partial):
        subs: Any = spec.keywords.get("submodules")
        if getattr(subs, "experts", None) is not None:
            experts = _experts_with(subs.experts, experts_cls)
            return functools.partial(spec.func, *spec.args,
                                     **{**spec.keywords, "submodules": dataclasses.replace(subs, experts=experts)})
    elif layer is not None and getattr(layer, "experts", None) is not None:
        layer.experts = _experts_with(layer.experts, experts_cls)
        return spec
    raise UsageError(f"this megatron-core's MoE layer spec has no experts module to replace (found "
                     f"{type(spec).__name__}: {str(spec)[:120]}); train.options.experts_skip_empty needs "
                     f"megatron-core's local MoE spec (SequentialMLP experts)")


def _experts_with(experts: Any, experts_cls: type) -> Any:
    """The experts' spec built as ``experts_cls``: a new partial with the same arguments, or the ModuleSpec's module
    replaced."""
    if isinstance(experts, functools.partial):
        return functools.partial(experts_cls, *experts.args, **experts.keywords)
    if not hasattr(experts, "module"):
        raise UsageError(f"the MoE experts spec {type(experts).__name__} has no module to replace")
    experts.module = experts_cls
    return experts


def _routers(chunks: list[Any]) -> list[Any]:
    """Every MoE router of the model chunks (unwrapped or DDP-wrapped), in model order."""
    out = []
    for chunk in chunks:
        for module in chunk.modules():
            router = getattr(module, "router", None)
            if router is not None and hasattr(module, "token_dispatcher") and hasattr(router, "routing"):
                out.append(router)
    return out


class ZeroTokenRouting:
    """Masks, in this rank's routers, the experts of the starved ranks of this rank's expert-parallel group.

    Tokens reach a rank's local experts only from the routers of its expert-parallel group, so every member
    of that group must mask them (each computes the same mask from the policy); ranks of other groups route
    normally, so the starved rank's expert-data-parallel peers still train their copies of those experts.
    Set :attr:`starved` (global ranks) before each step; an empty list routes normally. ``remove()`` restores
    the routers (safe twice).
    """

    def __init__(self, chunks: list[Any], ep_ranks: list[int], num_experts: int, topk: int) -> None:
        self.ep_ranks = list(ep_ranks)
        self.local = num_experts // len(self.ep_ranks)
        self.num_experts = num_experts
        self.topk = topk
        self.starved: list[int] = []
        self._routers = _routers(chunks)
        for router in self._routers:
            router.routing = self._wrap(router.routing)

    def masked_experts(self) -> list[int]:
        """The global expert indices no token may go to now."""
        out: list[int] = []
        for rank in self.starved:
            if rank in self.ep_ranks:
                first = self.ep_ranks.index(rank) * self.local
                out.extend(range(first, first + self.local))
        if out and self.num_experts - len(out) < self.topk:
            from lifecycle.errors import UsageError

            raise UsageError(f"zero_tokens drill: masking experts {out} leaves fewer than topk={self.topk} "
                             f"of {self.num_experts} experts")
        return out

    def _wrap(self, routing: Callable[..., Any]) -> Callable[..., Any]:
        def masked_routing(logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            experts = self.masked_experts()
            if experts:
                mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
                mask[experts] = True
                logits = logits.masked_fill(mask, _MASKED)
            return routing(logits, *args, **kwargs)

        masked_routing._lifecycle_original = routing  # type: ignore[attr-defined]
        return masked_routing

    def remove(self) -> None:
        for router in self._routers:
            original = getattr(router.routing, "_lifecycle_original", None)
            if original is not None:
                # The instance attribute shadowed the bound method: deleting it restores the class's.
                del router.routing
        self._routers = []
