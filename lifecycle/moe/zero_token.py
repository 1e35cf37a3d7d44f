"""The zero-token guard: keep a MoE rank whose local experts receive no tokens in step with its peers.

Why: the router may send no token at all to the experts of one expert-parallel rank. Experts that skip
their GEMMs on empty input (TransformerEngine's grouped GEMM, custom kernels) then leave every expert
parameter out of the autograd graph: their gradients stay ``None``, the per-parameter hooks that an
overlapped DDP uses to launch its expert-data-parallel reductions never fire on that rank, and its peers
wait in that reduction until the job is killed.

:func:`install_zero_token_guard` puts hooks on every experts module of a model, i.e. every module that
Megatron calls as ``experts(hidden, tokens_per_expert, probs)``. When the rank's dispatched ``hidden``
is empty (then ``tokens_per_expert`` sums to zero) the action decides:

- ``dummy_forward``: the experts run on one zero token per local expert with routing probability zero,
  and the extra output rows are sliced off. The output is unchanged (still empty) but every expert
  parameter is used, so its gradient is zeros instead of None, and whatever the experts do internally
  (expert-tensor-parallel collectives) happens as on the peers.
- ``error``: raise :class:`~lifecycle.errors.PhaseError` naming rank, layer and step.
- ``warn``: log once per layer and count.
- ``off``: nothing is installed.

Counts are per forward call: with activation recompute of the MoE layer a zero-token forward that is
re-run in the backward pass counts twice.

The module imports torch only; megatron is found by duck typing, never imported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lifecycle.errors import PhaseError, UsageError

logger = logging.getLogger(__name__)

ACTIONS = ("dummy_forward", "error", "warn", "off")
"""The values of ``moe.zero_token.action``."""

EXPERTS_CLASS_NAMES = frozenset({"SequentialMLP", "GroupedMLP", "TEGroupedMLP"})
"""Megatron-Core experts classes (subclasses match too), recognised by name so megatron is not imported."""

OnEvent = Callable[[str, "int | None", int], None]
"""``on_event(layer, step, count)``: called at every zero-token forward; ``count`` is the layer's total so far."""

_HIDDEN_NAMES = ("permuted_local_hidden_states", "hidden_states", "hidden")
_TPE_NAMES = ("tokens_per_expert",)
_PROBS_NAMES = ("permuted_probs", "probs")


class ZeroTokenGuard:
    """Handle returned by :func:`install_zero_token_guard`.

    ``counts`` maps each guarded layer (experts module name, DDP's ``module.`` prefixes removed) to the
    number of forwards in which this rank's experts received no token; ``total`` sums them. Set ``step``
    before each training step so messages and events name it. ``remove()`` uninstalls (safe twice).
    """

    def __init__(self, action: str, *, rank: int | None = None, on_event: OnEvent | None = None) -> None:
        self.action = action
        self.rank = rank
        self.step: int | None = None
        self.counts: dict[str, int] = {}
        self._on_event = on_event
        self._handles: list[Any] = []
        # id(module) -> per call (rows to keep, rows given to the experts), or None if untouched
        self._calls: dict[int, list[tuple[int, int] | None]] = {}

    @property
    def layers(self) -> list[str]:
        """Names of the guarded experts modules, in model order."""
        return list(self.counts)

    @property
    def total(self) -> int:
        """Zero-token forwards over all layers."""
        return sum(self.counts.values())

    def set_step(self, step: int | None) -> None:
        """Name the current training step in messages and events."""
        self.step = step

    def remove(self) -> None:
        """Uninstall every hook. Counts stay readable. Safe to call twice."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._calls.clear()

    def __enter__(self) -> ZeroTokenGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _install(self, name: str, module: torch.nn.Module) -> None:
        self.counts[name] = 0
        self._calls[id(module)] = []
        # The forward hook is prepended so every other forward hook sees the real (sliced) output;
        # pre-hooks registered before the guard see the real arguments. Each pre-hook call pushes
        # one entry and the forward hook pops the top one: calls may nest but never interleave, and
        # an entry left by a forward that raised stays below the live ones.
        self._handles.append(module.register_forward_pre_hook(
            lambda mod, args, kwargs: self._before(name, mod, args, kwargs), with_kwargs=True))
        self._handles.append(module.register_forward_hook(
            lambda mod, args, output: self._after(mod, output), prepend=True))

    def _before(self, name: str, module: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        stack = self._calls.setdefault(id(module), [])
        hidden, tpe, probs = _experts_args(args, kwargs)
        # The dispatched hidden has sum(tokens_per_expert) rows: checking its shape avoids a
        # device-to-host sync of tokens_per_expert.
        if hidden is None or tpe is None or probs is None or hidden.shape[0] != 0:
            stack.append(None)
            return None
        self._record(name)
        if self.action != "dummy_forward":
            stack.append(None)
            return None
        new = _with_dummy_tokens(hidden, tpe, probs)
        stack.append((0, int(new[0].shape[0])))
        return _replace_args(args, kwargs, new)

    def _after(self, module: torch.nn.Module, output: Any) -> Any:
        stack = self._calls.get(id(module))
        rows = stack.pop() if stack else None
        if rows is None:
            return None
        if isinstance(output, tuple):  # megatron returns (output, mlp_bias)
            return tuple(_keep_rows(o, *rows) for o in output)
        return _keep_rows(output, *rows)

    def _record(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
        count = self.counts[name]
        if self._on_event is not None:
            self._on_event(name, self.step, count)
        rank = _rank() if self.rank is None else self.rank
        step = "?" if self.step is None else self.step
        if self.action == "error":
            raise PhaseError(
                f"rank {rank}: MoE layer {name} received no tokens at step {step} "
                "(moe.zero_token.action=error). Its experts would drop out of autograd and the next "
                "expert gradient reduction could hang; set moe.zero_token.action=dummy_forward to keep "
                "the rank in step.", phase="train", rank=rank, group="ep")
        if count == 1:
            level = logging.WARNING if self.action == "warn" else logging.INFO
            what = "nothing done" if self.action == "warn" else "ran the experts on dummy tokens"
            logger.log(level, "rank %s: MoE layer %s received no tokens at step %s; %s "
                       "(logged once per layer, counted every time)", rank, name, step, what)


def install_zero_token_guard(model: torch.nn.Module | Iterable[torch.nn.Module], action: str, *,
                             rank: int | None = None, on_event: OnEvent | None = None) -> ZeroTokenGuard:
    """Guard every MoE experts module of ``model`` (a module or a list of model chunks).

    ``action`` is one of :data:`ACTIONS`; ``off`` installs nothing. ``rank`` is named in messages
    (default: the global rank when torch.distributed is initialized). ``on_event(layer, step, count)``
    is called at every zero-token forward with the layer's running count. Issues no collective; the
    ``dummy_forward`` action makes a zero-token rank issue the same collectives as its peers.
    Raises :class:`UsageError` for an unknown action.
    """
    if action not in ACTIONS:
        raise UsageError(f"unknown zero-token action {action!r}; available: {', '.join(ACTIONS)}")
    guard = ZeroTokenGuard(action, rank=rank, on_event=on_event)
    if action == "off":
        return guard
    for name, module in find_experts_modules(model):
        guard._install(name, module)
    if not guard.counts:
        logger.info("zero-token guard (%s): the model has no MoE experts module; nothing guarded", action)
    return guard


def find_experts_modules(model: torch.nn.Module | Iterable[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every experts module: a known experts class or the ``experts`` of a MoE layer.

    A MoE layer is recognised by its ``router``, ``token_dispatcher`` and ``experts`` attributes.
    """
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    found: dict[int, tuple[str, torch.nn.Module]] = {}
    for i, chunk in enumerate(chunks):
        prefix = f"{i}." if len(chunks) > 1 else ""
        for name, module in chunk.named_modules():
            experts = getattr(module, "experts", None)
            if _is_moe_layer(module) and isinstance(experts, torch.nn.Module):
                found.setdefault(id(experts), (prefix + _join(name, "experts"), experts))
            elif any(c.__name__ in EXPERTS_CLASS_NAMES for c in type(module).__mro__):
                found.setdefault(id(module), (prefix + _strip_wrappers(name), module))
    return list(found.values())


def _is_moe_layer(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("router", "token_dispatcher", "experts"))


def _join(name: str, child: str) -> str:
    return _strip_wrappers(f"{name}.{child}" if name else child)


def _strip_wrappers(name: str) -> str:
    # DDP and Float16Module wrap the model as ``.module``: layer names read the same either way.
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def _experts_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(hidden, tokens_per_expert, probs) from positional or keyword arguments; None where absent."""
    def pick(index: int, names: tuple[str, ...]) -> Any:
        if len(args) > index:
            return args[index]
        return next((kwargs[n] for n in names if n in kwargs), None)

    return pick(0, _HIDDEN_NAMES), pick(1, _TPE_NAMES), pick(2, _PROBS_NAMES)


def _replace_args(args: tuple[Any, ...], kwargs: dict[str, Any],
                  new: tuple[Any, Any, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args_out, kwargs_out = list(args), dict(kwargs)
    for index, names, value in zip(range(3), (_HIDDEN_NAMES, _TPE_NAMES, _PROBS_NAMES), new, strict=True):
        if len(args_out) > index:
            args_out[index] = value
        else:
            kwargs_out[next(n for n in names if n in kwargs_out)] = value
    return tuple(args_out), kwargs_out


def _with_dummy_tokens(hidden: torch.Tensor, tokens_per_expert: Any,
                       probs: torch.Tensor) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """Append one zero token with zero probability per local expert.

    ``hidden`` stays in the graph (concatenated, not replaced): its gradient, empty, must still flow
    back through the dispatcher's all-to-all, whose backward is a collective the peers issue too.
    ``tokens_per_expert`` keeps its type (tensor, or numpy on CPU) and device.
    """
    n = int(tokens_per_expert.shape[0])
    dummy_hidden = hidden.new_zeros((n, *hidden.shape[1:]))
    dummy_probs = probs.new_zeros((n, *probs.shape[1:]))
    return (torch.cat([hidden, dummy_hidden]), tokens_per_expert * 0 + 1,
            torch.cat([probs, dummy_probs]))


def _keep_rows(value: Any, keep: int, given: int) -> Any:
    """The first ``keep`` rows of a per-token tensor (``given`` rows); anything else (a None or
    per-expert bias) unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == given:
        return value.narrow(0, 0, keep)
    return value
