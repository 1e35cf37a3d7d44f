"""``train.kind: synthetic`` — a small torch MLP trained data-parallel, no megatron model.

Fast enough for drills and benchmarks: one bucketed gradient all-reduce over the dp group per step
(with the step deadline), plain SGD, per-rank checkpoint files with the same two-phase protocol as the
megatron kind.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lifecycle.checkpoint.local_files import LocalFilesSave
from lifecycle.errors import PhaseError
from lifecycle.handlers.protocols import StepContext


def _saved_world(ckpt_dir: Path) -> int:
    """The world size that wrote ``ckpt_dir`` (its ``metadata.json``)."""
    import json

    from lifecycle.rundir import safeio

    meta = safeio.read_json(ckpt_dir / "metadata.json", limit=1 << 16)
    world = meta.get("world") if isinstance(meta, dict) else None
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"{ckpt_dir / 'metadata.json'} names no world size ({json.dumps(meta)[:80]})")
    return world


class SyntheticStep:
    """A 2-layer MLP regression; the loss falls steadily from the seed's initial weights."""

    def __init__(self, options: Any) -> None:
        self.o = options
        self.model: torch.nn.Module | None = None
        self.group: Any = None
        self.dp_rank = 0
        self.device = torch.device("cpu")

    def setup(self, ctx: StepContext) -> None:
        """Local: builds the model on this rank's device (the current GPU on NCCL, else the CPU)."""
        from lifecycle.distributed.collectives import device_for
        from lifecycle.distributed.groups import group_ranks

        torch.manual_seed(ctx.policy.run.seed)
        h = self.o.hidden
        found = group_ranks(ctx.parallel, "dp")
        self.group, ranks = found if found else (None, [ctx.rank])
        self.ranks = ranks
        self.dp_rank = ranks.index(ctx.rank)
        self.device = device_for(self.group)
        self.model = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.Tanh(), torch.nn.Linear(h, 1)).to(self.device)

    def _batch(self, ctx: StepContext, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(ctx.policy.run.seed * 100003 + step * 101 + self.dp_rank)
        x = torch.randn(self.o.batch, self.o.hidden, generator=g).to(self.device)
        return x, x[:, :1] * 0.5 - x[:, 1:2] * 0.25

    def step(self, ctx: StepContext, step: int) -> dict[str, float]:
        """Collective on the dp group (one all_reduce of the gradients and the loss, with the step deadline).

        Returns ``loss`` and ``wait_s`` (the time spent waiting in that all_reduce, which is not compute)."""
        from lifecycle.distributed.collectives import wait_works

        assert self.model is not None
        x, y = self._batch(ctx, step)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.model.zero_grad()
        loss.backward()
        params = [p for p in self.model.parameters()]
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None] + [loss.detach().reshape(1)])
        if self.o.step_sleep_s:
            time.sleep(self.o.step_sleep_s)  # "compute" before the reduction, as a real step has
        jitter = self.o.step_jitter_s
        if jitter:
            time.sleep(jitter * random.Random(ctx.policy.run.seed * 7919 + step * 31 + ctx.rank).random())
        wait_s = 0.0
        if self.group is not None and len(self.ranks) > 1:
            # its own slice in the timeline, and where the watchdog sees a rank wait inside the step
            with ctx.span("grad_all_reduce", group="dp", size=len(self.ranks)):
                work = dist.all_reduce(flat, group=self.group, async_op=True)
                wait_s = wait_works([work], "all_reduce(grads)", "dp", self.ranks, ctx.deadline("step"),
                                    time.monotonic())
            ctx.count_op("dp")
            flat /= len(self.ranks)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                p -= self.o.lr * flat[offset:offset + n].view_as(p)
                offset += n
        return {"loss": float(flat[-1]), "wait_s": wait_s}

    def replicas(self, ctx: StepContext) -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
        """The weights every rank of the dp group holds alike (its gradients are all-reduced there). Local."""
        assert self.model is not None
        return [("dp", list(self.model.named_parameters()))]

    def replicas_in(self, ctx: StepContext, copy: dict[str, Any]) -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
        """:meth:`replicas` as a memory copy (:meth:`memory_state`) holds them. Local."""
        assert self.model is not None
        return [("dp", [(name, copy["model"][name]) for name, _ in self.model.named_parameters()])]

    def memory_state(self, ctx: StepContext) -> dict[str, Any]:
        """This rank's state (the model; the data comes from the step number) as CPU copies. Local."""
        assert self.model is not None
        return {"model": {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()},
                "step": ctx.step}

    def load_memory_state(self, ctx: StepContext, state: dict[str, Any]) -> int:
        """Restore what :meth:`memory_state` took; the step. Local."""
        assert self.model is not None
        self.model.load_state_dict(state["model"])
        return int(state["step"])

    def begin_save(self, ctx: StepContext, ckpt_dir: Path) -> LocalFilesSave:
        return LocalFilesSave(ckpt_dir, ctx.rank, ctx.world_size, self.memory_state(ctx), ctx.policy.checkpoint.async_)

    def load(self, ctx: StepContext, ckpt_dir: Path) -> int:
        assert self.model is not None
        if not (ckpt_dir / "metadata.json").is_file():
            raise PhaseError(f"{ckpt_dir} has no metadata.json (not a committed checkpoint)", phase="train",
                             rank=ctx.rank)
        written_by = _saved_world(ckpt_dir)
        # Every rank holds the same replica (the gradients are all-reduced over dp): at another world size each rank
        # loads one of the replicas that were written.
        state = torch.load(ckpt_dir / f"rank_{ctx.rank % written_by}.pt", weights_only=True, map_location=self.device)
        self.model.load_state_dict(state["model"])
        return int(state["step"])

    @staticmethod
    def reshard(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
        """Loads at any layout: the model is a replica on every rank (see :meth:`load`)."""
        from lifecycle.checkpoint.binding import dp_replicas

        return dp_replicas(saved, now)

    def rebuild(self, ctx: StepContext) -> None:
        """The model as :meth:`setup` builds it (from ``run.seed``): a resume that loaded and then rejected a
        checkpoint starts fresh from it. Local."""
        self.close()
        self.setup(ctx)

    def close(self) -> None:
        self.model = None
