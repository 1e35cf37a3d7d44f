"""``train.kind: megatron_gpt`` — a real megatron-core GPTModel (MoE when num_experts > 0), one chunk per virtual
pipeline stage, trained with Megatron's schedule, DDP and (distributed) optimizer, checkpointed with
``dist_checkpointing`` (torch_dist), guarded against zero-token MoE ranks by :mod:`lifecycle.moe`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lifecycle.handlers.protocols import StepContext

log = logging.getLogger(__name__)


class TorchDistCheckpoints:
    """Save and load ``self.state`` (a :class:`~lifecycle.backends.megatron.state.TrainState`) in torch_dist format:
    the checkpoint half of the built-in kind and of a trainer's watched megatron model."""

    state: Any

    def begin_save(self, ctx: StepContext, ckpt_dir: Path) -> Any:
        """Collective on the default group (planning; first the parameter all-gather on each
        distributed-optimizer instance's dp group with ``overlap_param_gather``); the writes follow on this
        rank only."""
        from lifecycle.backends.megatron import checkpoint

        self.state.step = ctx.step
        ck = ctx.policy.checkpoint
        return checkpoint.begin_save(self.state, str(ckpt_dir), fully_parallel=ck.fully_parallel, async_=ck.async_,
                                     async_strategy=ck.async_strategy)

    def load(self, ctx: StepContext, ckpt_dir: Path) -> int:
        """Collective on the default group."""
        from lifecycle.backends.megatron import checkpoint

        if not (ckpt_dir / "metadata.json").is_file():
            raise FileNotFoundError(f"{ckpt_dir}/metadata.json is missing (not a complete checkpoint)")
        return int(checkpoint.load(self.state, str(ckpt_dir)))

    def memory_state(self, ctx: StepContext) -> dict[str, Any]:
        """This rank's own tensors as CPU copies, for the memory tier. Local."""
        from lifecycle.backends.megatron import checkpoint

        return checkpoint.local_state(self.state, ctx.step)

    def replicas(self, ctx: StepContext) -> list[tuple[str, list[tuple[str, Any]]]]:
        """The weights the data-parallel replicas hold alike: the dense ones over dp_cp, the experts' over edp
        (megatron marks them ``allreduce=False``). None while ``overlap_param_gather`` leaves each replica's
        updated shard to the next forward's all-gather (they differ at a boundary by design). Local."""
        return self._replicas(None)

    def replicas_in(self, ctx: StepContext, copy: dict[str, Any]) -> list[tuple[str, list[tuple[str, Any]]]]:
        """:meth:`replicas` as a memory copy (:meth:`memory_state`) holds them: each chunk's ``state_dict`` names
        its parameters as ``named_parameters`` does (KeyError where it does not). Local."""
        return self._replicas(copy["models"])

    def _replicas(self, models: list[dict[str, Any]] | None) -> list[tuple[str, list[tuple[str, Any]]]]:
        if self.state.overlap_param_gather:
            return []
        dense: list[tuple[str, Any]] = []
        experts: list[tuple[str, Any]] = []
        for i, gpt in enumerate(self.state.gpts):
            for name, param in gpt.named_parameters():
                value = param if models is None else models[i][name]
                (dense if getattr(param, "allreduce", True) else experts).append((f"chunk{i}.{name}", value))
        return [("dp_cp", dense), ("edp", experts)]

    def load_memory_state(self, ctx: StepContext, state: dict[str, Any]) -> int:
        """Restore what :meth:`memory_state` took; the step. Local."""
        from lifecycle.backends.megatron import checkpoint

        return checkpoint.load_local_state(self.state, state)

    def reshard(self, saved: dict[str, Any], now: dict[str, Any]) -> str | None:
        """What this model's torch_dist checkpoints load at (:func:`lifecycle.checkpoint.binding.torch_dist`)."""
        from lifecycle.checkpoint.binding import torch_dist

        return torch_dist(saved, now, distributed_optimizer=_distributed(self.state.optimizer))


def _distributed(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or one it chains) is megatron's distributed optimizer."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any("Distributed" in type(p).__name__ for p in parts)


class MegatronGPTStep(TorchDistCheckpoints):
    """The built-in step handler over :mod:`lifecycle.backends.megatron.model`."""

    def __init__(self, options: Any) -> None:
        self.o = options
        self.state: Any = None
        self.guard: Any = None
        self.starve: Any = None
        self.dp_rank = 0

    def setup(self, ctx: StepContext) -> None:
        """Collective on the default group (the optimizer aligns parameter groups with all_gather_object)."""
        from megatron.core import parallel_state as ps

        from lifecycle.backends.megatron.model import build
        from lifecycle.backends.megatron.state import ModelSpec

        o = self.o
        self.state = build(ModelSpec(o, seed=ctx.policy.run.seed))
        self.dp_rank = ps.get_data_parallel_rank()
        record_collectives(ctx)
        action = ctx.policy.moe.zero_token.action
        if action != "off" and o.num_experts:
            from lifecycle.moe import install_zero_token_guard

            def on_event(layer: str, step: int | None, total: int) -> None:
                ctx.instant("zero_token", layer=layer, step=step, count=1, total=total, action=action)

            self.guard = install_zero_token_guard(self.state.gpts, action, rank=ctx.rank, on_event=on_event)
        self._zero_token_drills(ctx)

    def _zero_token_drills(self, ctx: StepContext) -> None:
        from lifecycle.distributed.faults import zero_token_drills

        if not zero_token_drills(ctx.policy.faults, ctx.attempt) or not self.o.num_experts:
            return
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from lifecycle.backends.megatron.experts import ZeroTokenRouting

        ep_ranks = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
        self.starve = ZeroTokenRouting(self.state.gpts, ep_ranks, self.o.num_experts, self.o.topk)

    def step(self, ctx: StepContext, step: int) -> dict[str, float]:
        """Collective on every group the model uses (pp send/recv, MoE all-to-all, dp/edp gradient reduction,
        loss): see :func:`lifecycle.backends.megatron.schedule.train_step`."""
        from lifecycle.backends.megatron.model import step_batches, train_step

        if self.guard is not None:
            self.guard.step = step
        if self.starve is not None:
            from lifecycle.distributed.faults import starved_ranks

            self.starve.starved = starved_ranks(ctx.policy.faults, step, ctx.attempt)
        loss = train_step(self.state, step_batches(self.state.spec, step, self.dp_rank))
        ctx.count_op("step")
        if self.state.grad_norm is None:
            return {"loss": loss}
        return {"loss": loss, "grad_norm": self.state.grad_norm}

    def rebuild(self, ctx: StepContext) -> None:
        """The model and optimizer as :meth:`setup` builds them (from ``run.seed``): a resume that loaded and then
        rejected a checkpoint starts fresh from them. Collective on the default group, as :meth:`setup`."""
        self.close()
        self.setup(ctx)

    def close(self) -> None:
        if self.guard is not None:
            self.guard.remove()
            self.guard = None
        if self.starve is not None:
            self.starve.remove()
            self.starve = None
        if self.state is not None:
            from lifecycle.backends.megatron import comm_events

            comm_events.set_recorder(None)
            release_chunks(self.state.chunks)
        self.state = None


def release_chunks(chunks: list[Any]) -> None:
    """Break what keeps a dropped model alive: Megatron's DDP registers a backward hook on each parameter's
    gradient-accumulator node (``grad_accs``) that holds the DDP module and the parameter; the node lives in C++ as
    long as its parameter does, so the cycle is one the garbage collector cannot see, and an in-process restart would
    build its model beside the old one. The hooks are removed (a handle of the node's own hook dictionary, taken by
    registering a no-op hook, clears it) and the list dropped; the model is not used again."""
    for chunk in chunks:
        accs = getattr(chunk, "grad_accs", None)
        if not isinstance(accs, list):
            continue
        for node in accs:
            try:
                hooks = node.register_hook(_no_hook).hooks_dict_ref()
            except (AttributeError, RuntimeError, TypeError):
                continue
            if hooks is not None:
                hooks.clear()
        accs.clear()


def _no_hook(*_: Any) -> None:
    return None


def record_collectives(ctx: StepContext) -> None:
    """Megatron DDP's bucket collectives become spans on their groups (a hang there names group and ranks)."""
    from lifecycle.backends.megatron import comm_events
    from lifecycle.policy.groupnames import GROUP_NAMES

    if not comm_events.install():
        log.info("this megatron-core has no DDP coalescing hook: gradient reductions are not traced")
        return

    labels = comm_events.group_labels(ctx.parallel.get_group, [n for n in GROUP_NAMES if n != "world"])
    comm_events.set_recorder(comm_events.Recorder(ctx.span, ctx.count_op, labels))
