"""A tiny real Megatron-Core GPT-MoE: build it, feed it a learnable synthetic batch, train it.

Everything here is megatron-core's own machinery, not a stand-in: ``GPTModel`` with the local layer spec
(``SequentialMLP`` experts, no TransformerEngine), wrapped in megatron-core's
``DistributedDataParallel`` (gradients go to ``param.main_grad`` buffers and are reduced over the dp group,
expert gradients over the expert-dp group) and stepped by ``get_megatron_optimizer`` (a
``ChainedOptimizer`` of one fp32 Adam for dense and one for expert parameters; a plain torch optimizer
would never step because DDP leaves ``param.grad`` None).

The caller initializes the default group and ``parallel_state`` first; :func:`build` reads the sizes
from there. Only pp=1 is supported (the training step has no pipeline schedule).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lifecycle.backends.megatron.cpu_compat import apply_cpu_compat
from lifecycle.errors import UsageError
from lifecycle.handlers.options import MegatronGPTOptions
from lifecycle.policy.sections import RunConfig

logger = logging.getLogger(__name__)
DEFAULT_SEED = RunConfig().seed


@dataclass(frozen=True)
class ModelSpec:
    """The model options of ``train.kind: megatron_gpt`` plus what the run adds (the seed) and two fixed
    training constants. The options' defaults train in seconds on CPU."""

    options: MegatronGPTOptions = field(default_factory=MegatronGPTOptions)
    seed: int = DEFAULT_SEED
    """Drives the weights *and* the synthetic data stream (the policy's run.seed)."""
    clip_grad: float = 1.0
    aux_loss_coeff: float = 1e-2


@dataclass
class TrainState:
    """What :func:`build` returns and :func:`train_step` advances. ``step`` counts finished steps."""

    spec: ModelSpec
    model: Any  # megatron.core.distributed.DistributedDataParallel wrapping a GPTModel
    optimizer: Any  # megatron.core.optimizer.MegatronOptimizer (a ChainedOptimizer)
    config: Any  # megatron.core.transformer.TransformerConfig
    step: int = 0
    sizes: dict[str, int] = field(default_factory=dict)
    save_strategies: dict[tuple[bool, int], tuple[Any, Any]] = field(default_factory=dict)
    """Cached (base, wrapped) save strategies by (fully_parallel, thread_count): see checkpoint.begin_save."""

    @property
    def gpt(self) -> Any:
        """The unwrapped ``GPTModel``."""
        return self.model.module


def parallel_sizes() -> dict[str, int]:
    """The current ``parallel_state`` sizes (tp, pp, ep, etp, dp, edp). Issues no collective."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "edp": ps.get_expert_data_parallel_world_size(),
    }


def transformer_config(spec: ModelSpec, sizes: dict[str, int]) -> Any:
    """A ``TransformerConfig`` for ``spec`` with the given parallel sizes (fp32, no dropout, CPU)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=spec.options.num_layers, hidden_size=spec.options.hidden, ffn_hidden_size=spec.options.ffn_hidden,
        num_attention_heads=spec.options.heads, num_moe_experts=spec.options.num_experts,
        moe_ffn_hidden_size=spec.options.ffn_hidden, moe_router_topk=spec.options.topk,
        moe_token_dispatcher_type=spec.options.dispatcher, moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss" if spec.aux_loss_coeff else "none",
        moe_aux_loss_coeff=spec.aux_loss_coeff,
        tensor_model_parallel_size=sizes["tp"], pipeline_model_parallel_size=sizes["pp"],
        expert_model_parallel_size=sizes["ep"], expert_tensor_parallel_size=sizes["etp"],
        # Megatron requires sequence parallelism when tp > 1 is combined with expert parallelism.
        sequence_parallel=sizes["tp"] > 1,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=False, fp16=False,
        params_dtype=torch.float32, use_cpu_initialization=False, perform_initialization=True,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, bias_dropout_fusion=False,
        # Expert biases hit an in-place add on an autograd view at etp=1 (megatron 0.16.1 mlp.py).
        add_bias_linear=False,
    )


def build(spec: ModelSpec) -> TrainState:
    """Build model, DDP wrapper and optimizer on this rank, seeded from ``spec.seed``.

    Collective: every rank of the default group must call it; ``get_megatron_optimizer`` runs two
    ``all_gather_object`` on the default group (it aligns the dense and expert param groups across
    ranks). Nothing touches the dp/ep/edp groups. ``parallel_state`` must be initialized. Raises
    :class:`UsageError` for pp > 1.
    """
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    apply_cpu_compat()
    sizes = parallel_sizes()
    if sizes["pp"] != 1:
        raise UsageError(f"the megatron backend trains with pp=1 only (got pp={sizes['pp']}); "
                         "set pipeline_model_parallel_size=1")
    # Same CPU seed everywhere for non-parallel weights; the tracker seeds tp/ep-sharded ones per rank.
    torch.manual_seed(spec.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(spec.seed)
    config = transformer_config(spec, sizes)
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.options.num_experts, moe_grouped_gemm=False)
    gpt = GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=spec.options.vocab,
                   max_sequence_length=spec.options.seq_len, position_embedding_type="learned_absolute")
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    # No broadcast_params(): the seeding above already gives identical dp/edp replicas (checked), and
    # a broadcast would touch the dp and expert-dp groups at build time, hiding their lazy first use.
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)
    opt_config = OptimizerConfig(optimizer="adam", lr=spec.options.lr, weight_decay=0.0, bf16=False, fp16=False,
                                 params_dtype=torch.float32, clip_grad=spec.clip_grad,
                                 use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(opt_config, [model])
    return TrainState(spec=spec, model=model, optimizer=optimizer, config=config, sizes=sizes)


def synthetic_batch(spec: ModelSpec, step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """A deterministic batch for (seed, step, dp_rank): each row counts up by one modulo ``vocab``.

    The next token is always ``(token + 1) % vocab``, a pattern the model learns in a few steps. Ranks
    of one tp group must pass the same dp_rank (they need identical inputs).
    """
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + step * 1009 + dp_rank)
    start = torch.randint(0, spec.options.vocab, (spec.options.micro_batch, 1), generator=gen)
    offsets = torch.arange(spec.options.seq_len + 1).unsqueeze(0)
    seq = (start + offsets) % spec.options.vocab
    position_ids = torch.arange(spec.options.seq_len).unsqueeze(0).expand(spec.options.micro_batch, -1)
    return {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous(),
            "position_ids": position_ids.contiguous()}


def _forward_backward(state: TrainState, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    per_token = state.model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss = per_token.float().mean()
    loss.backward()
    clear_aux_losses_tracker()  # the tracker accumulates per step; nobody reads it here
    return loss.detach()


def train_step(state: TrainState, batch: dict[str, torch.Tensor]) -> float:
    """One training step: zero grads, forward, backward, reduce grads, optimizer step.

    Collective: every rank of the default group must call it with its own batch. Inside, in order:
    forward/backward collectives on the tp group (sequence-parallel gather/reduce-scatter,
    vocab-parallel cross entropy) and the ep group (``all_to_all_single`` of token counts and tokens,
    or all-gathers with the allgather dispatcher; the expert-tp group when etp > 1); then
    ``finalize_model_grads``: gradient all-reduce on the dp group (dense) and the expert-dp group
    (experts), layer-norm grads on the tp group; the grad-norm all-reduces of the optimizer on the
    model-parallel groups; last, the loss all-reduce on the dp group. Returns the dp-averaged loss,
    identical on every rank.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    state.model.zero_grad_buffer()
    state.optimizer.zero_grad()
    loss = _forward_backward(state, batch)
    finalize_model_grads([state.model])
    ok, _grad_norm, _ = state.optimizer.step()
    if not ok:
        logger.warning("optimizer step %d skipped (non-finite gradients)", state.step)
    dp_group = ps.get_data_parallel_group()
    dist.all_reduce(loss, group=dp_group)
    state.step += 1
    return float(loss.item()) / dist.get_world_size(dp_group)
