"""Options models of the built-in handler kinds (pure pydantic: imported when a policy is validated)."""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from lifecycle.policy.base import Section


class ModelSize(NamedTuple):
    """The floats a kind's model puts on one rank, as a lower estimate (fp32 weights and one micro-batch's
    activations): what ``lifecycle validate`` compares with what a rank can allocate. An options model offers it
    with a ``model_size()`` method (a pack's kind may too)."""

    whole: int
    """Held whole by every rank."""
    split: int = 0
    """Split over the tensor- and pipeline-parallel ranks (tp x pp)."""
    expert: int = 0
    """Expert weights, split over ep x etp x pp."""


class MegatronGPTOptions(Section):
    """A tiny megatron-core GPTModel; MoE when num_experts > 0."""

    num_layers: PositiveInt = 2
    """Transformer layers."""
    hidden: PositiveInt = 64
    """Hidden size."""
    ffn_hidden: PositiveInt = 128
    """FFN hidden size (per expert for MoE layers)."""
    heads: PositiveInt = 4
    """Attention heads."""
    vocab: PositiveInt = 128
    """Vocabulary size of the synthetic tokens."""
    seq_len: PositiveInt = 32
    """Sequence length."""
    micro_batch: PositiveInt = 4
    """Micro-batch size per data-parallel rank."""
    num_experts: int = Field(4, ge=0)
    """Routed experts per MoE layer; 0 builds a dense model."""
    topk: PositiveInt = 2
    """Experts each token is routed to."""
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """MoE token dispatcher."""
    lr: PositiveFloat = 3e-3
    """Adam learning rate."""
    num_microbatches: PositiveInt = 1
    """Micro-batches per step and data-parallel rank, run by Megatron's schedule (pipelined when pp > 1;
    the interleaved schedule with parallelism.vpp needs at least pp of them)."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer: optimizer state sharded over the data-parallel ranks (of one instance
    when parallelism.dist_opt_instances > 1), gradients reduce-scattered, parameters all-gathered."""
    overlap_grad_reduce: bool = False
    """Launch each gradient bucket's reduction from the backward hooks, as soon as its gradients are ready."""
    overlap_param_gather: bool = False
    """Distributed optimizer only: all-gather updated parameters bucket by bucket in the next forward."""
    experts_skip_empty: bool = False
    """Local experts skip their GEMMs on empty input, as TEGroupedMLP and grouped-GEMM kernels do: a rank that
    receives no token then leaves its expert parameters out of autograd (see moe.zero_token)."""

    def model_size(self) -> ModelSize:
        """Embeddings, attention, router and dense MLP (split) and the experts, plus one micro-batch's logits and
        layer outputs; biases, norms and the optimizer's state left out."""
        h, layers, experts = self.hidden, self.num_layers, self.num_experts
        mlp = h * experts if experts else 2 * h * self.ffn_hidden
        tokens = self.micro_batch * self.seq_len
        split = (self.vocab + self.seq_len) * h + layers * (4 * h * h + mlp) + tokens * (self.vocab + layers * h)
        return ModelSize(0, split, layers * experts * 2 * h * self.ffn_hidden)

    @model_validator(mode="after")
    def _shape(self) -> MegatronGPTOptions:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.num_experts and self.topk > self.num_experts:
            raise ValueError(f"topk={self.topk} must be <= num_experts={self.num_experts}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("overlap_param_gather needs use_distributed_optimizer=true (only the distributed "
                             "optimizer gathers parameters)")
        return self


class SyntheticOptions(Section):
    """A small torch MLP whose gradients are all-reduced over the data-parallel group every step."""

    hidden: PositiveInt = 32
    """Width of the MLP."""
    batch: PositiveInt = 8
    """Samples per rank and step."""
    lr: PositiveFloat = 0.05
    """SGD learning rate."""
    step_sleep_s: float = Field(0.0, ge=0, le=3600, allow_inf_nan=False)
    """Extra time per step (simulates compute in drills and benchmarks)."""
    step_jitter_s: float = Field(0.0, ge=0, le=3600, allow_inf_nan=False)
    """Random extra time per step, uniform in [0, step_jitter_s), seeded by run.seed, step and rank (soaks)."""

    def model_size(self) -> ModelSize:
        """The MLP's two layers and one batch's input, hidden and output activations, on every rank."""
        h = self.hidden
        return ModelSize(h * h + 2 * h + 1 + 3 * self.batch * h)
