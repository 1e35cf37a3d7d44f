"""A tiny real Megatron-Core GPT-MoE: build it, feed it a learnable synthetic batch, train it.

Everything here is megatron-core's own machinery, not a stand-in: ``GPTModel`` with the local layer spec
(``SequentialMLP`` experts, no TransformerEngine), one model chunk per virtual pipeline stage (each with its
own ``pre_process``/``post_process``), every chunk wrapped in megatron-core's ``DistributedDataParallel``
(gradients go to ``param.main_grad`` buffers and are reduced over the dp group, expert gradients over the
expert-dp group; with ``overlap_grad_reduce`` from the backward hooks, bucket by bucket), stepped by
``get_megatron_optimizer`` (a ``ChainedOptimizer`` of one fp32 Adam for dense and one for expert
parameters, or of two ``DistributedOptimizer`` s with ``use_distributed_optimizer``; a plain torch
optimizer would never step because DDP leaves ``param.grad`` None), and driven by Megatron's own
schedule (:mod:`.schedule`: ``get_forward_backward_func``).

The caller initializes the default group and ``parallel_state`` first; :func:`build` reads the sizes
from there.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lifecycle.backends.megatron.cpu_compat import apply_cpu_compat
from lifecycle.backends.megatron.state import ModelSpec, TrainState
from lifecycle.errors import UsageError
from lifecycle.policy.options import MegatronGPTOptions

logger = logging.getLogger(__name__)

__all__ = ["build", "parallel_sizes", "step_batches", "synthetic_batch", "train_step",
           "transformer_config"]


def parallel_sizes() -> dict[str, int]:
    """The current ``parallel_state`` sizes (tp, pp, vpp, ep, etp, dp, edp, instances). No collective."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": int(vpp) if vpp else 1,
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "edp": ps.get_expert_data_parallel_world_size(),
        "instances": _instances(ps),
    }


def _instances(ps: Any) -> int:
    """Distributed-optimizer instances: megatron keeps no getter, so dp(+cp) size over one instance's part."""
    try:
        part = ps.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True)
    except (TypeError, AssertionError, RuntimeError):  # an older signature, or not initialized
        return 1
    return ps.get_data_parallel_world_size(with_context_parallel=True) // part if part else 1


def transformer_config(spec: ModelSpec, sizes: dict[str, int]) -> Any:
    """A ``TransformerConfig`` for ``spec`` with the given parallel sizes (fp32, no dropout, CPU)."""
    from megatron.core.transformer import TransformerConfig

    o = spec.options
    vpp = sizes.get("vpp", 1)
    return TransformerConfig(
        num_layers=o.num_layers, hidden_size=o.hidden, ffn_hidden_size=o.ffn_hidden,
        num_attention_heads=o.heads, num_moe_experts=o.num_experts or None,  # megatron rejects 0 for dense
        moe_ffn_hidden_size=o.ffn_hidden if o.num_experts else None, moe_router_topk=o.topk,
        moe_token_dispatcher_type=o.dispatcher, moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss" if spec.aux_loss_coeff else "none",
        moe_aux_loss_coeff=spec.aux_loss_coeff,
        tensor_model_parallel_size=sizes["tp"], pipeline_model_parallel_size=sizes["pp"],
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        expert_model_parallel_size=sizes["ep"], expert_tensor_parallel_size=sizes["etp"],
        # Megatron requires sequence parallelism when tp > 1 is combined with expert parallelism.
        sequence_parallel=sizes["tp"] > 1,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=False, fp16=False,
        params_dtype=torch.float32, use_cpu_initialization=False, perform_initialization=True,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, bias_dropout_fusion=False,
        # Expert biases hit an in-place add on an autograd view at etp=1 (megatron 0.16.1 mlp.py).
        add_bias_linear=False,
    )


def _check_shape(o: MegatronGPTOptions, sizes: dict[str, int]) -> None:
    stages = sizes["pp"] * sizes["vpp"]
    if o.num_layers % stages:
        raise UsageError(f"train.options.num_layers={o.num_layers} must be divisible by pp*vpp = {stages} "
                         f"(one block of layers per virtual pipeline stage)")
    if sizes["vpp"] > 1 and o.num_microbatches < sizes["pp"]:
        raise UsageError(f"the interleaved schedule (vpp={sizes['vpp']}) needs train.options.num_microbatches "
                         f">= pp = {sizes['pp']}, got {o.num_microbatches}")


def _chunks(spec: ModelSpec, config: Any, sizes: dict[str, int]) -> list[Any]:
    """One GPTModel per virtual pipeline stage of this rank, each knowing whether it is first/last."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from lifecycle.backends.megatron.experts import skip_empty_experts, with_experts
    from lifecycle.backends.megatron.logs import quiet

    o = spec.options
    layer_spec = get_gpt_layer_local_spec(num_experts=o.num_experts or None, moe_grouped_gemm=False)
    if o.experts_skip_empty and o.num_experts:
        layer_spec = with_experts(layer_spec, skip_empty_experts())
    vpp = sizes["vpp"] if sizes["vpp"] > 1 else None
    out = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        # 0.19 logs "GPTModel IS DEPRECATED" (HybridModel is its successor): the built-in kind's model, not the user's
        with quiet("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"):
            out.append(GPTModel(
                config=config, transformer_layer_spec=layer_spec, vocab_size=o.vocab, max_sequence_length=o.seq_len,
                position_embedding_type="learned_absolute", vp_stage=vp_stage,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)))
    return out


def build(spec: ModelSpec) -> TrainState:
    """Build the model chunks, their DDP wrappers and the optimizer on this rank, seeded from ``spec.seed``.

    Collective: every rank of the default group must call it; ``get_megatron_optimizer`` runs two
    ``all_gather_object`` on the default group (it aligns the dense and expert param groups across
    ranks). Nothing touches the dp/ep/edp/pp groups. ``parallel_state`` must be initialized. Raises
    :class:`UsageError` for a model that does not split into the pipeline's stages.
    """
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from lifecycle.backends.megatron.logs import quiet
    from lifecycle.backends.megatron.schedule import wire_schedule

    apply_cpu_compat()
    o = spec.options
    sizes = parallel_sizes()
    _check_shape(o, sizes)
    # Same CPU seed everywhere for non-parallel weights; the tracker seeds tp/ep-sharded ones per rank.
    torch.manual_seed(spec.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(spec.seed)
    config = transformer_config(spec, sizes)
    gpts = _chunks(spec, config, sizes)
    if torch.cuda.is_available():  # as Megatron-LM's get_model: some submodules (position embeddings) start on CPU
        gpts = [gpt.cuda(torch.cuda.current_device()) for gpt in gpts]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=o.overlap_grad_reduce,
        overlap_param_gather=o.overlap_param_gather, use_distributed_optimizer=o.use_distributed_optimizer,
        # The instance groups exist either way (warmup and barriers use them); only the distributed optimizer
        # reduces over them.
        num_distributed_optimizer_instances=sizes["instances"] if o.use_distributed_optimizer else 1,
        # As Megatron-LM: with a pipeline, every stage launches its param all-gathers from the schedule.
        align_param_gather=o.overlap_param_gather and sizes["pp"] > 1)
    # No broadcast_params(): the seeding above already gives identical dp/edp replicas (checked), and
    # a broadcast would touch the dp and expert-dp groups at build time, hiding their lazy first use.
    # Chunks after the first keep one bucket each (Megatron-LM's disable_bucketing).
    # 0.19 asks callers to pass a precomputed full_param_layout with the distributed optimizer and computes the same
    # one itself when none is given (what this does); its log line about it is not the user's to act on.
    with quiet("megatron.core.distributed.distributed_data_parallel", "full_param_layout not provided"):
        chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt, disable_bucketing=i > 0)
                  for i, gpt in enumerate(gpts)]
    opt_config = OptimizerConfig(optimizer="adam", lr=o.lr, weight_decay=0.0, bf16=False, fp16=False,
                                 params_dtype=torch.float32, clip_grad=spec.clip_grad,
                                 use_distributed_optimizer=o.use_distributed_optimizer,
                                 overlap_param_gather=o.overlap_param_gather)
    optimizer = get_megatron_optimizer(opt_config, chunks)
    wire_schedule(config, chunks, ddp_config)
    return TrainState(spec=spec, chunks=chunks, optimizer=optimizer, config=config, sizes=sizes)


def synthetic_batch(spec: ModelSpec, step: int, index: int) -> dict[str, torch.Tensor]:
    """Micro-batch ``index`` of step ``step`` (for ``seed``): each row counts up by one modulo ``vocab``.

    The next token is always ``(token + 1) % vocab``, a pattern the model learns in a few steps. ``index``
    numbers the micro-batches of the whole step across data-parallel ranks (see :func:`step_batches`), so
    the global batch of a step does not depend on how it is split. Ranks of one tp group (and of one
    pipeline) must ask for the same micro-batches (they need identical inputs).
    """
    o = spec.options
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + step * 1009 + index)
    start = torch.randint(0, o.vocab, (o.micro_batch, 1), generator=gen)
    offsets = torch.arange(o.seq_len + 1).unsqueeze(0)
    seq = (start + offsets) % o.vocab
    position_ids = torch.arange(o.seq_len).unsqueeze(0).expand(o.micro_batch, -1)
    # On a GPU the model lives on the current device: the batch goes there (generated on the CPU, so the same
    # seed gives the same tokens on every machine).
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return {"tokens": seq[:, :-1].contiguous().to(device), "labels": seq[:, 1:].contiguous().to(device),
            "position_ids": position_ids.contiguous().to(device)}


def step_batches(spec: ModelSpec, step: int, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """The ``options.num_microbatches`` micro-batches of data-parallel rank ``dp_rank`` at ``step``: global
    micro-batches ``dp_rank * n .. dp_rank * n + n - 1``. A step's global batch is therefore the same at dp
    size d with n micro-batches and at dp size d/2 with 2n (resume at another data-parallel size)."""
    n = spec.options.num_microbatches
    return [synthetic_batch(spec, step, dp_rank * n + i) for i in range(n)]


def train_step(state: TrainState, batch: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]) -> float:
    """One training step over one micro-batch or a list of them (see :func:`.schedule.train_step`)."""
    from lifecycle.backends.megatron.schedule import train_step as run

    return run(state, [batch] if isinstance(batch, dict) else batch)
