"""What the megatron kind builds and advances: the model spec (options, seed, training constants) and the train
state (DDP chunks, optimizer, config, step). Below :mod:`~lifecycle.backends.megatron.model` (which builds it) and
:mod:`~lifecycle.backends.megatron.schedule` (which advances it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lifecycle.policy.options import MegatronGPTOptions
from lifecycle.policy.sections import RunConfig

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
    chunks: list[Any]
    """One megatron ``DistributedDataParallel`` per virtual pipeline stage of this rank (one without vpp)."""
    optimizer: Any  # megatron.core.optimizer.MegatronOptimizer (a ChainedOptimizer)
    config: Any  # megatron.core.transformer.TransformerConfig
    step: int = 0
    grad_norm: float | None = None
    """The global gradient norm of the last step (before clipping)."""
    sizes: dict[str, int] = field(default_factory=dict)
    save_strategies: dict[tuple[bool, int], tuple[Any, Any]] = field(default_factory=dict)
    """Cached (base, wrapped) save strategies by (fully_parallel, thread_count): see checkpoint.begin_save."""

    @property
    def model(self) -> Any:
        """The DDP-wrapped first chunk (the whole model on this rank without vpp)."""
        return self.chunks[0]

    @property
    def gpts(self) -> list[Any]:
        """The unwrapped ``GPTModel`` of every chunk, in virtual-stage order."""
        return [chunk.module for chunk in self.chunks]

    @property
    def gpt(self) -> Any:
        """The unwrapped ``GPTModel`` of the first chunk."""
        return self.chunks[0].module

    @property
    def overlap_param_gather(self) -> bool:
        return bool(self.spec.options.overlap_param_gather)
