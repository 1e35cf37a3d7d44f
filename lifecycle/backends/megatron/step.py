"""``train.kind: megatron_gpt`` — a real megatron-core GPTModel (MoE when num_experts > 0), trained with
Megatron's DDP and optimizer, checkpointed with ``dist_checkpointing`` (torch_dist), guarded against
zero-token MoE ranks by :mod:`lifecycle.moe`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lifecycle.context import RunContext

log = logging.getLogger(__name__)


class MegatronGPTStep:
    """The built-in step handler over :mod:`lifecycle.backends.megatron.model`."""

    def __init__(self, options: Any) -> None:
        self.o = options
        self.state: Any = None
        self.guard: Any = None
        self.dp_rank = 0

    def setup(self, ctx: RunContext) -> None:
        """Collective on the default group (the optimizer aligns parameter groups with all_gather_object)."""
        from megatron.core import parallel_state as ps

        from lifecycle.backends.megatron.model import ModelSpec, build

        o = self.o
        self.state = build(ModelSpec(o, seed=ctx.policy.run.seed))
        self.dp_rank = ps.get_data_parallel_rank()
        action = ctx.policy.moe.zero_token.action
        if action != "off" and o.num_experts:
            from lifecycle.moe import install_zero_token_guard

            def on_event(layer: str, step: int | None, total: int) -> None:
                ctx.events.instant("zero_token", layer=layer, step=step, count=1, total=total, action=action)

            self.guard = install_zero_token_guard(self.state.gpt, action, rank=ctx.rank, on_event=on_event)

    def step(self, ctx: RunContext, step: int) -> dict[str, float]:
        """Collective on every group the model uses (MoE all-to-all, dp/edp gradient reduction, loss)."""
        from lifecycle.backends.megatron.model import synthetic_batch, train_step

        if self.guard is not None:
            self.guard.step = step
        batch = synthetic_batch(self.state.spec, step, self.dp_rank)
        loss = train_step(self.state, batch)
        ctx.op_counts["step"] += 1
        return {"loss": loss}

    def begin_save(self, ctx: RunContext, ckpt_dir: Path) -> Any:
        """Collective on the default group (planning); the writes follow on this rank only."""
        from lifecycle.backends.megatron import checkpoint

        self.state.step = ctx.step
        ck = ctx.policy.checkpoint
        return checkpoint.begin_save(self.state, str(ckpt_dir), fully_parallel=ck.fully_parallel, async_=ck.async_)

    def load(self, ctx: RunContext, ckpt_dir: Path) -> int:
        """Collective on the default group."""
        from lifecycle.backends.megatron import checkpoint

        if not (ckpt_dir / "metadata.json").is_file():
            raise FileNotFoundError(f"{ckpt_dir}/metadata.json is missing (not a complete checkpoint)")
        return int(checkpoint.load(self.state, str(ckpt_dir)))

    def close(self) -> None:
        if self.guard is not None:
            self.guard.remove()
            self.guard = None
        self.state = None
