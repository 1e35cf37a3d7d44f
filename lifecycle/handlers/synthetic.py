"""``train.kind: synthetic`` — a small torch MLP trained data-parallel, no megatron model.

Fast enough for drills and benchmarks: one bucketed gradient all-reduce over the dp group per step
(with the step deadline), plain SGD, per-rank checkpoint files with the same two-phase protocol as the
megatron kind.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lifecycle.errors import HangError, PhaseError
from lifecycle.handlers.protocols import StepContext


class LocalFilesSave:
    """This rank's ``rank_<R>.pt`` plus rank 0's ``metadata.json``; the SaveHandle protocol."""

    def __init__(self, path: Path, rank: int, world: int, state: dict[str, Any], async_: bool) -> None:
        self.path, self.rank, self.world = path, rank, world
        self.write_s: float | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        path.mkdir(parents=True, exist_ok=True)
        if async_:
            self._thread = threading.Thread(target=self._write, args=(state,), daemon=True)
            self._thread.start()
        else:
            self._write(state)

    def _write(self, state: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            target = self.path / f"rank_{self.rank}.pt"
            with open(target, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException as exc:  # noqa: BLE001 - re-raised in wait_local
            self._error = exc
        self.write_s = time.perf_counter() - t0

    def wait_local(self, timeout_s: float) -> list[Any]:
        """This rank's file is durable. No collective."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise HangError(f"rank {self.rank}: checkpoint write to {self.path} not done after {timeout_s}s",
                                missing=[self.rank], phase="checkpoint", rank=self.rank, deadline_s=timeout_s)
        if self._error is not None:
            raise PhaseError(f"rank {self.rank}: checkpoint write failed: {self._error}", phase="checkpoint",
                             rank=self.rank)
        return [self.rank]

    def finalize_via_store(self, store: Any, key: str, timeout_s: float) -> None:
        """Every rank publishes; rank 0 waits for all (naming the missing) and writes metadata.json."""
        from lifecycle.distributed.barrier import missing_keys

        deadline = time.monotonic() + timeout_s
        store.set(f"{key}/{self.rank}", pickle.dumps(self.wait_local(timeout_s)))
        if self.rank != 0:
            return
        missing = missing_keys(store, [f"{key}/{r}" for r in range(self.world)], deadline - time.monotonic())
        if missing:
            raise HangError(f"checkpoint {self.path}: ranks {missing} did not finish writing within "
                            f"{timeout_s:g}s", missing=missing, phase="checkpoint", rank=0, group="store",
                            deadline_s=timeout_s)
        self._metadata()

    def finalize_over_group(self, group: Any, timeout_s: float) -> None:
        """One gather_object on ``group`` (spanning every rank) to rank 0, which writes metadata.json."""
        mine = self.wait_local(timeout_s)
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, out, dst=0, group=group)
        if self.rank == 0:
            self._metadata()

    def _metadata(self) -> None:
        (self.path / "metadata.json").write_text(json.dumps({"format": "lifecycle-synthetic", "world": self.world}))


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
                wait_s = wait_works([work], "all_reduce(grads)", "dp", self.ranks, ctx.deadline("train"),
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

    def begin_save(self, ctx: StepContext, ckpt_dir: Path) -> LocalFilesSave:
        assert self.model is not None
        state = {"model": {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()},
                 "step": ctx.step}
        return LocalFilesSave(ckpt_dir, ctx.rank, ctx.world_size, state, ctx.policy.checkpoint.async_)

    def load(self, ctx: StepContext, ckpt_dir: Path) -> int:
        assert self.model is not None
        if not (ckpt_dir / "metadata.json").is_file():
            raise PhaseError(f"{ckpt_dir} has no metadata.json (not a committed checkpoint)", phase="train",
                             rank=ctx.rank)
        state = torch.load(ckpt_dir / f"rank_{ctx.rank}.pt", weights_only=True, map_location=self.device)
        self.model.load_state_dict(state["model"])
        return int(state["step"])

    def close(self) -> None:
        self.model = None
