"""The megatron-core half of the CPU compatibility layer (see :mod:`.cpu_compat` for the why).

Private: only :func:`lifecycle.backends.megatron.cpu_compat.apply_cpu_compat` calls :func:`apply`.
Each patch looks its target up with ``getattr``/``hasattr`` and skips what this megatron-core lacks.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

_labels: list[str] = []  # what the current apply() installed


def apply() -> list[str]:
    """Install every megatron-core patch that applies to this version; return their labels."""
    _labels.clear()
    _patch_rng_tracker()
    _patch_moe()
    _patch_grad_clip()
    _patch_torch_norm()
    _patch_uneven_gather()
    _patch_distrib_optimizer()
    return list(_labels)


def _set(owner: Any, name: str, value: Any, label: str) -> None:
    """Replace ``owner.name`` if it exists (other versions may lack it) and record the patch."""
    if hasattr(owner, name):
        setattr(owner, name, value)
        _labels.append(label)


def note(label: str) -> None:
    _labels.append(label)


def _patch_rng_tracker() -> None:
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:
        return
    base = getattr(mrandom, "CudaRNGStatesTracker", None)
    if base is None or getattr(base, "_lifecycle_cpu", False):
        return

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Megatron's RNG tracker with CPU generator states (see the module docstring)."""

        _lifecycle_cpu = True

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            # Unlike the CUDA original, no "CPU RNG state changed" warning: here it always changes.
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            prev_name = getattr(self, "_current_state_name", "default-rng")
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)
                self._current_state_name = prev_name

    _set(mrandom, "CudaRNGStatesTracker", CpuRNGStatesTracker, "megatron RNG tracker -> CPU generator")
    _set(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state(),
         "megatron _get_cuda_rng_state -> CPU")
    _set(mrandom, "_set_cuda_rng_state", lambda new_state, *a, **k: torch.set_rng_state(new_state),
         "megatron _set_cuda_rng_state -> CPU")
    # A tracker created before the patch is of the CUDA class: drop it so the next get makes a CPU one.
    if hasattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED"):
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


# ---------------------------------------------------------------------------------------------- MoE


def _to_cpu_maybe_numpy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            return tensor.numpy()
    return tensor


def _patch_moe() -> None:
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        note("moe_utils.te_general_gemm = None")
    _set(token_dispatcher, "maybe_move_tensor_to_cpu", _to_cpu_maybe_numpy,
         "token_dispatcher.maybe_move_tensor_to_cpu -> numpy on CPU")


# ---------------------------------------------------------------------------------------- grad clip


def _clip_grad_by_total_norm_cpu(parameters: Any, max_norm: float, total_norm: float,
                                 use_decoupled_grad: bool = False) -> None:
    """megatron's ``clip_grad_by_total_norm_fp32`` without its ``torch.cuda.FloatTensor`` assert."""
    if torch.is_tensor(parameters):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _patch_grad_clip() -> None:
    try:
        from megatron.core.optimizer import clip_grads
        from megatron.core.optimizer import optimizer as moptimizer
    except ImportError:
        return
    for module in (clip_grads, moptimizer):
        _set(module, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_cpu,
             f"{module.__name__}.clip_grad_by_total_norm_fp32 -> CPU")


# ---------------------------------------------------------------------------------------------- norm


def _without_sequence_parallel(config: Any) -> Any:
    clone = copy.copy(config)
    clone.sequence_parallel = False
    return clone


def _patch_torch_norm() -> None:
    try:
        from megatron.core.transformer import torch_norm
    except ImportError:
        return
    cls = getattr(torch_norm, "WrappedTorchNorm", None)
    if cls is None or getattr(cls, "_lifecycle_cpu", False):
        return
    orig_new = cls.__new__

    def __new__(klass: Any, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        if not getattr(config, "sequence_parallel", False):
            return orig_new(klass, config, hidden_size, *args, **kwargs)
        # A layer norm is per token, so it is correct on a sequence shard; its weight gradients
        # differ per tp rank and finalize_model_grads all-reduces those marked sequence_parallel.
        norm = orig_new(klass, _without_sequence_parallel(config), hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    cls.__new__ = __new__
    cls._lifecycle_cpu = True
    note("WrappedTorchNorm accepts sequence_parallel")


# ------------------------------------------------------------------------------------ uneven gather


def _patch_uneven_gather() -> None:
    try:
        from megatron.core.tensor_parallel import mappings
    except ImportError:
        return
    orig = getattr(mappings, "_gather_along_first_dim", None)
    if orig is None or getattr(orig, "_lifecycle_cpu", False):
        return

    def _gather_along_first_dim(input_: Any, group: Any, output_split_sizes: Any = None,
                                use_global_buffer: bool = False) -> Any:
        if output_split_sizes is None or group.size() == 1:
            return orig(input_, group, output_split_sizes, use_global_buffer)
        # gloo's all_gather needs equal sizes: pad every shard to the largest, gather, trim.
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        chunks = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(chunks, padded, group=group)
        return torch.cat([c[:n] for c, n in zip(chunks, sizes, strict=True)], dim=0)

    _gather_along_first_dim._lifecycle_cpu = True  # type: ignore[attr-defined]
    _set(mappings, "_gather_along_first_dim", _gather_along_first_dim,
         "mappings._gather_along_first_dim pads uneven splits (gloo)")


# ---------------------------------------------------------------------------------- distributed optimizer

_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    """``Tensor.type()`` (no argument) answers the CUDA name of a CPU float tensor, for the block's duration."""
    assert "type" not in torch.Tensor.__dict__, "Tensor.type is already overridden"
    orig = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs:
            name = orig(self)
            return _CUDA_TYPE_NAMES.get(name, name)
        return orig(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        del torch.Tensor.type  # the C method of TensorBase shows through again


def _patch_distrib_optimizer() -> None:
    try:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    except ImportError:
        return
    build = DistributedOptimizer.__dict__.get("_build_model_and_main_param_groups")
    if not isinstance(build, classmethod) or getattr(build.__func__, "_lifecycle_cpu", False):
        return
    func = build.__func__

    def _build_model_and_main_param_groups(cls: Any, *args: Any, **kwargs: Any) -> Any:
        # Sorts parameters by ``param.type() == 'torch.cuda.FloatTensor'`` (else TypeError): at build time
        # only, CPU tensors answer their CUDA names.
        with _cuda_type_names():
            return func(cls, *args, **kwargs)

    _build_model_and_main_param_groups._lifecycle_cpu = True  # type: ignore[attr-defined]
    DistributedOptimizer._build_model_and_main_param_groups = classmethod(_build_model_and_main_param_groups)
    note("DistributedOptimizer._build_model_and_main_param_groups sees CPU params as torch.cuda types")
