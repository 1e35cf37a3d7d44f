"""Options models of the built-in handler kinds (pure pydantic: imported when a policy is validated)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from lifecycle.policy.base import Section


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

    @model_validator(mode="after")
    def _shape(self) -> MegatronGPTOptions:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.num_experts and self.topk > self.num_experts:
            raise ValueError(f"topk={self.topk} must be <= num_experts={self.num_experts}")
        return self


class SyntheticOptions(Section):
    """A small torch MLP whose gradients are all-reduced over the data-parallel group every step."""

    hidden: PositiveInt = 32
    """Width of the MLP."""
    batch: PositiveInt = 8
    """Samples per rank and step."""
    lr: PositiveFloat = 0.05
    """SGD learning rate."""
    step_sleep_s: float = Field(0.0, ge=0)
    """Extra time per step (simulates compute in drills and benchmarks)."""
