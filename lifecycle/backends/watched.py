"""Checkpoints of a trainer's own torch modules (``job.watch`` of a model that is not megatron's): every rank
writes its ``rank_<R>.pt`` (model and optimizer state dicts, the step) with the same two-phase commit as the
built-in kinds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lifecycle.checkpoint.local_files import LocalFilesSave
from lifecycle.errors import PhaseError
from lifecycle.handlers.protocols import StepContext


class WatchedModules:
    """The save/load half of a step handler over a list of modules and an optional torch optimizer."""

    def __init__(self, chunks: list[torch.nn.Module], optimizer: Any) -> None:
        self.chunks = chunks
        self.optimizer = optimizer

    def setup(self, ctx: StepContext) -> None:
        """Nothing to build: the trainer built its model."""

    def step(self, ctx: StepContext, step: int) -> dict[str, float]:
        raise RuntimeError("a watched model is stepped by the trainer's own loop")

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {f"model{i}": c.state_dict() for i, c in enumerate(self.chunks)}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def begin_save(self, ctx: StepContext, ckpt_dir: Path) -> LocalFilesSave:
        """This rank's files only (no collective)."""
        state = torch.utils._pytree.tree_map(  # a snapshot: training may go on while an async save writes
            lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, self._state())
        state["step"] = ctx.step
        return LocalFilesSave(ckpt_dir, ctx.rank, ctx.world_size, state, ctx.policy.checkpoint.async_)

    def memory_state(self, ctx: StepContext) -> dict[str, Any]:
        """This rank's state as CPU copies, for the memory tier. Local."""
        state = torch.utils._pytree.tree_map(
            lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, self._state())
        state["step"] = ctx.step
        return state

    def load_memory_state(self, ctx: StepContext, state: dict[str, Any]) -> int:
        """Restore what :meth:`memory_state` took; the step. Local."""
        self._restore(state)
        return int(state["step"])

    def _restore(self, state: dict[str, Any]) -> None:
        for i, chunk in enumerate(self.chunks):
            chunk.load_state_dict(state[f"model{i}"])
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])

    def load(self, ctx: StepContext, ckpt_dir: Path) -> int:
        if not (ckpt_dir / "metadata.json").is_file():
            raise PhaseError(f"{ckpt_dir} has no metadata.json (not a committed checkpoint)", phase="train",
                             rank=ctx.rank)
        state = torch.load(ckpt_dir / f"rank_{ctx.rank}.pt", weights_only=True, map_location="cpu")
        self._restore(state)
        return int(state["step"])

    @staticmethod
    def reshard(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
        """Each rank loads its own ``rank_<R>.pt``: the same world size only."""
        from lifecycle.checkpoint.binding import per_rank_files

        return per_rank_files(saved, now)

    def close(self) -> None:
        self.chunks = []
