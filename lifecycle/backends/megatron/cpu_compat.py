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
- ``tensor_parallel.mappings._gather_along_first_dim`` with ``output_split_sizes`` (the alltoall
  dispatcher's token gather over the expert-tp group when etp > 1) calls ``all_gather`` with unequal
  tensors, which gloo rejects ("ProcessGroupGloo::allgather: invalid tensor size"); the replacement
  pads every shard to the largest, gathers, and trims. Equal splits keep the original.
- ``optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups`` sorts parameters by
  ``param.type() == 'torch.cuda.FloatTensor'`` and raises TypeError for anything else; while it runs (once, when
  the optimizer is built) ``Tensor.type()`` answers the CUDA name of a CPU float tensor.
- Hard-coded ``device="cuda"`` allocations (optimizer scale, grad-norm buffers, checkpoint validation
  all-reduce, ...) and ``Tensor.cuda()``: a torch-function mode, entered on the calling thread for the
  life of the process, rewrites a CUDA ``device=`` argument to CPU; ``Tensor.cuda`` returns the tensor
  itself. Megatron spreads these over many
  modules; one rewrite is smaller and safer than patching each call site.

The megatron-core patches live in :mod:`._cpu_megatron_patches`. With the layer applied, megatron's
``FullyParallelLoadStrategyWrapper`` (which calls ``.cuda()``) works on CPU too.

A persistent async-save worker is a fresh interpreter: it must call :func:`apply_cpu_compat` at start-up
too. Threads share the patches, except the torch-function mode, which is thread-local in torch; the
checkpoint backend therefore enters :func:`cuda_to_cpu_mode` in its writer thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lifecycle.backends.megatron import _cpu_megatron_patches as megatron_patches

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
        _without_transformer_engine()
        return False
    with _lock:
        if _applied:
            return True
        _patch_torch_cuda()
        _applied.extend(megatron_patches.apply())
        _patch_cuda_allocations()
        logger.debug("megatron CPU compatibility patches: %s", ", ".join(_applied))
    return True


def _without_transformer_engine() -> None:
    """On a GPU without Transformer Engine megatron-core 0.16.1's MoE code names ``te_general_gemm`` without
    importing it (NameError at the first expert forward); the same one-line fix as on CPU. Idempotent."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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
