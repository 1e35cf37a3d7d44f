"""Let megatron-core's MoE GPT, DDP, optimizer and dist_checkpointing run on a CPU-only torch.

Megatron-Core assumes a GPU in many small places. On a machine without CUDA (``torch.cuda.is_available()``
is False) :func:`apply_cpu_compat` installs the patches below, once per process; with CUDA present it does
nothing. Every patch is guarded with ``hasattr`` so a megatron-core version that lacks the patched symbol is
left alone instead of broken. Measured on torch 2.13.0+cpu with megatron-core 0.16.1.

Patches on ``torch.cuda`` (process-wide; CPU-only torch raises "Torch not compiled with CUDA enabled"):

- ``current_device`` -> ``torch.device("cpu")``: Megatron passes it as ``device=`` when it allocates
  parameters, buffers and all-to-all outputs.
- ``synchronize``, ``Stream``, ``Event``, ``current_stream``, ``default_stream``, ``stream``,
  ``set_stream`` -> no-op stand-ins: on CPU every op is synchronous, so ordering is already guaranteed.
  The MoE alltoall dispatcher creates a side ``Stream`` for its device-to-host copies and waits on an
  ``Event``; DDP and the checkpoint code synchronize.
- ``nvtx.range_push/range_pop`` -> no-ops (CPU torch raises "NVTX functions not installed").

Patches on megatron-core:

- RNG: ``tensor_parallel.random.CudaRNGStatesTracker`` is replaced by a subclass whose states are CPU
  generator states (``torch.get_rng_state``). The stock tracker reads and seeds the CUDA generator, which
  CPU torch cannot do; weights created with ``use_cpu_initialization=False`` are drawn inside
  ``tracker.fork()``, so this keeps Megatron's per-(tp, ep, etp)-rank seeding intact.
  ``_get_cuda_rng_state/_set_cuda_rng_state`` are redirected to the CPU generator too (activation
  recompute saves and restores them).
- ``transformer.moe.moe_utils.te_general_gemm = None``: 0.16.1 imports it only when TransformerEngine is
  installed but the router reads it unconditionally (``NameError`` without TE).
- ``transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu``: the stock function converts split sizes
  to numpy only for CUDA tensors; on CPU they stay tensors and ``sum(output_splits)`` yields a tensor that
  ``new_empty(size=[...])`` rejects. The replacement also returns numpy for CPU tensors when asked.
- ``optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (and its import in ``optimizer.optimizer``):
  asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``; the replacement scales the same gradients
  with ``torch._foreach_mul_`` (grad-norm computation itself is untouched).
- ``transformer.torch_norm.WrappedTorchNorm`` (the norm of the local spec when neither TE nor apex is
  installed, i.e. always on CPU) asserts ``not sequence_parallel``, but MoE training with tp > 1
  requires sequence parallelism. A layer norm is per token, so the patch builds it anyway and marks its
  parameters ``sequence_parallel`` so that ``finalize_model_grads`` all-reduces their grads over tp.
- Hard-coded ``device="cuda"`` allocations (optimizer scale, grad-norm buffers, checkpoint validation
  all-reduce, ...) and ``Tensor.cuda()``: a process-wide torch-function mode rewrites a CUDA device
  argument to CPU, and ``Tensor.cuda`` returns the tensor itself. Megatron spreads these over many
  modules; one rewrite is smaller and safer than patching each call site.

A persistent async-save worker is a fresh interpreter: it must call :func:`apply_cpu_compat` at start-up
too. Threads share the patches, except the torch-function mode, which is thread-local in torch; the
checkpoint backend therefore enters :func:`cuda_to_cpu_mode` in its writer thread.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_applied: list[str] = []  # names of the patches installed in this process, in order


def is_applied() -> bool:
    """Whether :func:`apply_cpu_compat` patched this process."""
    return bool(_applied)


def applied_patches() -> list[str]:
    """The patches installed in this process (empty when CUDA is present or nothing was applied)."""
    return list(_applied)


def apply_cpu_compat() -> bool:
    """Install the CPU patches if CUDA is absent. Idempotent and thread-safe.

    Returns True if this process is patched (now or by an earlier call), False when CUDA is available
    and nothing was touched. Call it from the thread that will run the model (the ``device="cuda"``
    rewrite is thread-local, see :func:`cuda_to_cpu_mode`). Issues no collective.
    """
    if torch.cuda.is_available():
        return False
    with _lock:
        if _applied:
            return True
        _patch_torch_cuda()
        _patch_rng_tracker()
        _patch_moe()
        _patch_grad_clip()
        _patch_torch_norm()
        _patch_uneven_gather()
        _patch_cuda_allocations()
        logger.debug("megatron CPU compatibility patches: %s", ", ".join(_applied))
    return True


# ---------------------------------------------------------------------------------------- torch.cuda


class _NullEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is complete when the call returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: every method is a no-op on a synchronous device."""

    device = torch.device("cpu")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _NullStream()


def _set(owner: Any, name: str, value: Any, label: str) -> None:
    """Replace ``owner.name`` if it exists (other versions may lack it) and record the patch."""
    if hasattr(owner, name):
        setattr(owner, name, value)
        _applied.append(label)


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    _set(cuda, "current_device", lambda: torch.device("cpu"), "torch.cuda.current_device")
    _set(cuda, "synchronize", lambda device=None: None, "torch.cuda.synchronize")
    _set(cuda, "Stream", _NullStream, "torch.cuda.Stream")
    _set(cuda, "Event", _NullEvent, "torch.cuda.Event")
    _set(cuda, "current_stream", lambda device=None: _DEFAULT_STREAM, "torch.cuda.current_stream")
    _set(cuda, "default_stream", lambda device=None: _DEFAULT_STREAM, "torch.cuda.default_stream")
    _set(cuda, "stream", lambda stream=None: contextlib.nullcontext(), "torch.cuda.stream")
    _set(cuda, "set_stream", lambda stream=None: None, "torch.cuda.set_stream")
    if hasattr(cuda, "nvtx"):
        _set(cuda.nvtx, "range_push", lambda msg=None: None, "torch.cuda.nvtx.range_push")
        _set(cuda.nvtx, "range_pop", lambda: None, "torch.cuda.nvtx.range_pop")


# ---------------------------------------------------------------------------------------------- RNG


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
        _applied.append("moe_utils.te_general_gemm = None")
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
    _applied.append("WrappedTorchNorm accepts sequence_parallel")


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


# ------------------------------------------------------------------------------- device="cuda" calls


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device="cuda"`` (and ``torch.device("cuda", i)``) arguments to CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return func(*args, **kwargs)


_mode: _CudaToCpuMode | None = None


def cuda_to_cpu_mode() -> contextlib.AbstractContextManager[Any]:
    """Context that rewrites CUDA device arguments to CPU in the calling thread (for worker threads)."""
    if not is_applied():
        return contextlib.nullcontext()
    return _CudaToCpuMode()


def _patch_cuda_allocations() -> None:
    global _mode
    _set(torch.Tensor, "cuda", lambda self, *a, **k: self, "Tensor.cuda -> identity")
    _mode = _CudaToCpuMode()
    _mode.__enter__()  # stays on the main thread's mode stack for the life of the process
    _applied.append("device='cuda' -> cpu (torch function mode)")
