"""Checkpoints of a trainer's own megatron-core model (``job.watch``): its DDP chunks and megatron optimizer are
saved and loaded exactly as the built-in kind's (:mod:`lifecycle.backends.megatron.checkpoint`)."""

from __future__ import annotations

from typing import Any

from lifecycle.backends.megatron.step import TorchDistCheckpoints
from lifecycle.handlers.protocols import StepContext


class _Chunk:
    """A model chunk that is not wrapped in megatron's DDP, seen as one (``.module``)."""

    def __init__(self, module: Any) -> None:
        self.module = module


def is_megatron(chunks: list[Any], optimizer: Any) -> bool:
    """A megatron model and optimizer: every chunk has a sharded state dict, and so does the optimizer."""
    def unwrapped(c: Any) -> Any:
        return getattr(c, "module", c)

    return optimizer is not None and hasattr(optimizer, "sharded_state_dict") and all(
        hasattr(unwrapped(c), "sharded_state_dict") for c in chunks)


class WatchedMegatron(TorchDistCheckpoints):
    """The save/load half of a step handler over a trainer's model chunks and optimizer (torch_dist format)."""

    def __init__(self, chunks: list[Any], optimizer: Any) -> None:
        from lifecycle.backends.megatron.state import ModelSpec, TrainState
        from lifecycle.policy.options import MegatronGPTOptions

        wrapped = [c if hasattr(c, "module") else _Chunk(c) for c in chunks]
        ddp_config = getattr(wrapped[0], "ddp_config", None)
        overlap = bool(getattr(ddp_config, "overlap_param_gather", False)) and all(
            hasattr(c, "disable_forward_pre_hook") for c in wrapped)
        spec = ModelSpec(options=MegatronGPTOptions(overlap_param_gather=overlap))
        self.state = TrainState(spec=spec, chunks=wrapped, optimizer=optimizer,
                                config=getattr(wrapped[0].module, "config", None))

    def setup(self, ctx: StepContext) -> None:
        """Nothing to build: the trainer built its model."""

    def step(self, ctx: StepContext, step: int) -> dict[str, float]:
        raise RuntimeError("a watched model is stepped by the trainer's own loop")

    def close(self) -> None:
        self.state = None  # type: ignore[assignment]
