"""Save and load the tiny GPT-MoE with megatron-core ``dist_checkpointing`` (torch_dist format).

Why not ``dist_checkpointing.save()`` as is: after the local writes it runs a ``gather_object`` of the
write results and a ``broadcast`` of the failure flag on the **default group**
(``save_state_dict_async_finalize``) and then a default-group ``barrier`` (``metadata_finalize_fn``);
``AsyncCallsQueue.maybe_finalize_async_calls`` adds an ``all_reduce`` on the default group per
finalized call (and one per check unless ``no_dist``). A rank that writes slowly turns all of these into
a silent hang of the whole job. Here the save is split so that no collective runs after the writes:

1. :func:`begin_save` (every rank of the default group, same order): with ``overlap_param_gather`` first
   finishes the parameter all-gather of the last update (on each distributed-optimizer instance's dp group),
   then builds the sharded state dict and
   calls ``dist_checkpointing.save(..., async_sharded_save=True)``, which only *plans*. Collectives, all
   before any tensor is written: ``all_gather_object`` on the default group (sharding validation),
   ``broadcast_object_list`` on the default group (common-state consistency check), with
   ``fully_parallel`` an ``all_gather_object`` on the dp(+cp) group (save distribution) and a second
   default-group ``all_gather_object`` (validation of the distribution), and ``gather_object`` to rank
   0 on the default group (the local save plans; rank 0 builds the global metadata). Global rank 0
   also writes ``common.pt`` here. Then this rank writes its shard files (``__<rank>_<i>.distcp``,
   fsynced) — in the calling thread, or with ``async_=True`` in a background thread on a snapshot.
2. :meth:`SaveHandle.wait_local` (each rank alone, no collective): waits for this rank's files.
3. Finalization: global rank 0 (the planning coordinator, the only holder of the global metadata) needs
   every rank's write results, then writes ``.metadata`` and ``metadata.json`` (the completion marker).
   The exchange is the caller's choice: :meth:`SaveHandle.finalize_via_store` (a c10d store: no process
   group at all; rank 0 names the ranks that never published), :meth:`SaveHandle.finalize_over_group`
   (one ``gather_object`` on a group of the caller's choosing, e.g. a dedicated gloo group with its own
   timeout), or :meth:`SaveHandle.finalize` on rank 0 with results gathered by other means. The
   checkpoint is loadable only once ``metadata.json`` exists: ranks that load it next must wait for
   rank 0's finalize (``finalize_via_store(..., wait_complete=True)``, or a barrier of their choice).

Loading (:func:`load`) uses megatron's torch_dist load strategy (optionally fully parallel); every rank
of the default group must call it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from lifecycle.backends.megatron import async_saves
from lifecycle.backends.megatron.cpu_compat import apply_cpu_compat
from lifecycle.backends.megatron.logs import quiet
from lifecycle.backends.megatron.save_handle import BACKEND, VERSION, SaveHandle
from lifecycle.backends.megatron.schedule import finish_param_sync
from lifecycle.backends.megatron.state import TrainState
from lifecycle.errors import PhaseError

__all__ = ["SaveHandle", "begin_save", "load", "sharded_state"]

logger = logging.getLogger(__name__)

_PHASE = "checkpoint"
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
"""How the distributed optimizer shards its checkpoint. megatron-core 0.16.1's own default,
``fully_sharded_model_space``, fails ("ShardedTensor.flattened_range is not supported");
``fully_reshardable`` gathers every bucket on dp rank 0 at each save."""


def _model_state(state: TrainState) -> dict[str, Any]:
    """The model's sharded state dict: ``model``, or ``model0``, ``model1`` ... per virtual stage (Megatron-LM's
    keys). The tensors' checkpoint keys name global layer numbers, whatever the chunking."""
    if len(state.chunks) == 1:
        return {"model": state.gpt.sharded_state_dict()}
    return {f"model{i}": gpt.sharded_state_dict() for i, gpt in enumerate(state.gpts)}


def sharded_state(state: TrainState, *, is_loading: bool = False, with_rng: bool = True) -> dict[str, Any]:
    """Model + optimizer sharded state dicts, the step, the world size and this rank's RNG states.

    Issues no collective. The distributed optimizer's state is saved in megatron-core's ``dp_reshardable``
    format (Megatron-LM's default; see :data:`OPTIM_METADATA`): each rank writes its own shard of every
    gradient bucket, and it loads at another data-parallel size with the same tp/pp/ep layout. The RNG
    entry is one ``ShardedObject`` per global rank (Megatron does the same): it loads at the same world
    size only, and :func:`load` skips it elsewhere (``with_rng=False``).
    """
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing import ShardedObject

    model_sd = _model_state(state)
    out = {**model_sd,
           "optimizer": state.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIM_METADATA),
           "step": state.step, "world_size": dist.get_world_size()}
    if with_rng:
        rng = {"cpu": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
        out["rng_state"] = ShardedObject("rng_state", rng, (dist.get_world_size(),), (dist.get_rank(),),
                                         replica_id=0)
    return out


def load(state: TrainState, ckpt_dir: str, *, fully_parallel: bool = False) -> int:
    """Restore model, optimizer, RNG and step from ``ckpt_dir``; return the step.

    Collective: every rank of the default group must call it, after the save's rank-0 finalize
    (``metadata.json`` must exist). Measured on 0.16.1, all on the default group: ``all_gather_object``
    (sharding validation), ``gather_object`` + ``scatter_object_list`` (torch DCP load plan),
    ``all_gather_object``. With ``fully_parallel`` each shard is read by one rank of the dp(+cp) group
    and sent to the others: add an ``all_gather_object`` and one ``broadcast`` per shard on the dp
    group, and a second default-group plan round. That wrapper calls ``.cuda()``, which the CPU
    compatibility layer makes work. A checkpoint saved at another world size (another data-parallel size)
    loads too, without its per-rank RNG states.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    apply_cpu_compat()
    strategy = None
    if fully_parallel:
        strategy = FullyParallelLoadStrategyWrapper(
            TorchDistLoadShardedStrategy(), ps.get_data_parallel_group(with_context_parallel=True))
    _allocate_optimizer_state(state.optimizer)
    with _load_warnings_off():
        return _load(state, ckpt_dir, strategy)


@contextlib.contextmanager
def _load_warnings_off() -> Iterator[None]:
    """torch's warnings on the APIs megatron-core's load calls (``load_state_dict`` and ``ShardedTensor`` deprecated;
    0.19 reads the common state with ``no_dist=True``: "torch.distributed is disabled ... single process"): not the
    user's to act on, and the ShardedTensor one names lifecycle's CPU layer as its caller."""
    with warnings.catch_warnings():
        for text in ("`load_state_dict` is deprecated", "Please use DTensor instead",
                     "torch.distributed is disabled, unavailable or uninitialized"):
            warnings.filterwarnings("ignore", message=re.escape(text))
        yield


def _load(state: TrainState, ckpt_dir: str, strategy: Any) -> int:
    from megatron.core import dist_checkpointing, tensor_parallel

    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    if not ("step" in common and "world_size" in common):
        return _load_foreign(state, ckpt_dir, common, strategy)
    saved_world = common.get("world_size", dist.get_world_size())
    with_rng = saved_world == dist.get_world_size()
    if not with_rng:
        logger.warning("checkpoint %s was saved at world size %s, this run has %d: loading model and optimizer "
                       "state, not the per-rank RNG states", ckpt_dir, saved_world, dist.get_world_size())
    loaded = dist_checkpointing.load(sharded_state(state, is_loading=True, with_rng=with_rng), ckpt_dir,
                                     sharded_strategy=strategy)
    for key, gpt in zip(_model_state(state), state.gpts, strict=True):
        gpt.load_state_dict(loaded[key], strict=True)
    with torch.no_grad():  # fp32 params: the distributed optimizer's main params are views of the model's
        state.optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(state.optimizer)
    if with_rng:
        rng = loaded["rng_state"]
        torch.set_rng_state(rng["cpu"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    state.step = int(loaded["step"])
    return state.step


def _load_foreign(state: TrainState, ckpt_dir: str, common: dict[str, Any], strategy: Any) -> int:
    """A checkpoint lifecycle did not write: megatron-core's own ``dist_checkpointing.save`` of the same model
    (``{"model": ...}`` or Megatron-LM's ``model0``, ``model1`` ... per virtual stage), maybe with Megatron-LM's
    ``iteration``. The model is loaded; the optimizer only when the checkpoint has one lifecycle can read, else
    it starts fresh (logged); RNG states are not read. The step is ``iteration``, else the folder's
    ``iter_NNNNNNN`` number, else 0. Collective on the default group, as :func:`load`."""
    import re

    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_model_state(state), ckpt_dir, sharded_strategy=strategy)
    for key, gpt in zip(_model_state(state), state.gpts, strict=True):
        gpt.load_state_dict(loaded[key], strict=True)
    if "optimizer" in common:
        try:
            opt = dist_checkpointing.load({"optimizer": state.optimizer.sharded_state_dict(
                _model_state(state), is_loading=True, metadata=OPTIM_METADATA)}, ckpt_dir, sharded_strategy=strategy)
            with torch.no_grad():
                state.optimizer.load_state_dict(opt["optimizer"])
            _restore_adam_steps(state.optimizer)
        except Exception as exc:  # noqa: BLE001 - another optimizer layout: the model is what matters here
            logger.warning("checkpoint %s: its optimizer state does not load here (%s); the optimizer starts "
                           "fresh", ckpt_dir, type(exc).__name__)
    else:
        logger.warning("checkpoint %s has no optimizer state (saved outside lifecycle): loaded the model; the "
                       "optimizer starts fresh", ckpt_dir)
    match = re.search(r"iter_(\d+)", str(ckpt_dir))
    state.step = int(common.get("iteration") or (match.group(1) if match else 0))
    return state.step


def _optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside a megatron optimizer (one per chained instance)."""
    return [getattr(sub, "optimizer", sub) for sub in getattr(optimizer, "chained_optimizers", [optimizer])]


def _cpu(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


def local_state(state: TrainState, step: int) -> dict[str, Any]:
    """This rank's part of the train state as CPU copies — each chunk's ``state_dict`` (its own shards), each
    inner optimizer's state and main parameters (by position: the same build lays them out the same), the RNG
    states and the step — for the memory tier: loaded back by :func:`load_local_state` at the same layout only.
    Local, no collective. Non-tensor extra states (none on CPU) are left out."""
    from megatron.core import tensor_parallel

    models = [{k: _cpu(v) for k, v in gpt.state_dict().items() if torch.is_tensor(v)} for gpt in state.gpts]
    optimizers = []
    for inner in _optimizers(state.optimizer):
        sd = inner.state_dict()
        optimizers.append({
            "state": {i: {k: _cpu(v) for k, v in per.items()} for i, per in sd["state"].items()},
            "param_groups": sd["param_groups"],
            "main": [_cpu(p) for group in inner.param_groups for p in group["params"]]})
    rng = {"cpu": torch.get_rng_state(), "tracker": {k: _cpu(v) for k, v in
                                                      tensor_parallel.get_cuda_rng_tracker().get_states().items()}}
    return {"models": models, "optimizers": optimizers, "rng": rng, "step": step}


def load_local_state(state: TrainState, saved: dict[str, Any]) -> int:
    """Restore what :func:`local_state` took; the step. Local."""
    from megatron.core import tensor_parallel

    if len(saved["models"]) != len(state.gpts) or len(saved["optimizers"]) != len(_optimizers(state.optimizer)):
        raise ValueError("the copy holds another number of model chunks or optimizers")
    for gpt, sd in zip(state.gpts, saved["models"], strict=True):
        missing, unexpected = gpt.load_state_dict(sd, strict=False)
        left = [k for k in missing if not k.endswith("_extra_state")]
        if left or unexpected:
            raise ValueError(f"the copy's model does not match: missing {left[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for inner, sd in zip(_optimizers(state.optimizer), saved["optimizers"], strict=True):
            params = [p for group in inner.param_groups for p in group["params"]]
            if len(params) != len(sd["main"]):
                raise ValueError("the copy's optimizer holds another number of parameters")
            inner.load_state_dict({"state": sd["state"], "param_groups": sd["param_groups"]})
            for param, value in zip(params, sd["main"], strict=True):
                param.copy_(value)
    torch.set_rng_state(saved["rng"]["cpu"])
    tensor_parallel.get_cuda_rng_tracker().set_states(saved["rng"]["tracker"])
    state.step = int(saved["step"])
    return state.step


def _allocate_optimizer_state(optimizer: Any) -> None:
    """Give a never-stepped distributed optimizer its Adam state before a load. Local, no collective.

    Without Apex/TransformerEngine (torch's Adam) megatron-core 0.16.1's ``DistributedOptimizer.state_dict()``
    reads the step from the inner optimizer's per-parameter state and asserts one value, so a fresh
    optimizer (no state yet) cannot even describe what it would load. megatron's own helper steps the inner
    optimizer once on zero gradients (parameters unchanged without weight decay; the load overwrites them
    anyway).
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        init = getattr(sub, "_init_optimizer_states_with_dummy_values", None)
        inner = getattr(sub, "optimizer", None)
        if init is not None and inner is not None and not inner.state:
            init()


def _restore_adam_steps(optimizer: Any) -> None:
    """Set torch Adam's per-parameter ``step`` from the loaded param group's ``step``. Local.

    The distributed optimizer keeps the iteration in its param groups (what it saves); its
    ``dp_reshardable`` load then copies every per-parameter state tensor of the load template over the
    restored state, ``step`` included, which torch's Adam (no Apex/TE) keeps per parameter: without this
    the bias correction would restart from the template's step.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner: Any = getattr(sub, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            if "step" not in group:
                continue
            for param in group["params"]:
                per_param = inner.state.get(param)
                if per_param and torch.is_tensor(per_param.get("step")):
                    per_param["step"] = torch.tensor(float(group["step"]), dtype=per_param["step"].dtype,
                                                     device=per_param["step"].device)


def _capturing_strategy(thread_count: int) -> Any:
    """megatron's torch_dist save strategy, remembering (writer, global metadata) for our finalize."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if not hasattr(TorchDistSaveShardedStrategy, "_get_save_and_finalize_callbacks"):
        raise PhaseError("this megatron-core has no TorchDistSaveShardedStrategy."
                         "_get_save_and_finalize_callbacks; the split save needs it", phase=_PHASE)

    class CapturingStrategy(TorchDistSaveShardedStrategy):  # type: ignore[misc, valid-type]
        captured: tuple[Any, Any, Any] | None = None

        # 0.17+ pass the async strategy's name third
        def _get_save_and_finalize_callbacks(self, writer: Any, save_state_dict_ret: Any, *args: Any) -> Any:
            self.captured = tuple(save_state_dict_ret)  # (writer, global_metadata, dist_wrapper)
            return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret, *args)

    return CapturingStrategy(BACKEND, VERSION, thread_count=thread_count, cached_metadata=True)


def _host_buckets(request: Any, writer: Any, snapshot: bool) -> tuple[list[Any], str]:
    """This rank's write buckets with every tensor on the host, private to the writer if ``snapshot``; and how
    they got there (``pinned``: GPU tensors copied into page-locked host buffers; ``cpu``: already there).

    GPU tensors are copied device-to-host into pinned memory (asynchronous copies, one synchronize), which is
    what lets an async save return to training quickly. A tensor already on the CPU is the live tensor itself,
    which training would mutate under a background writer (megatron clones only non-contiguous views, not
    optimizer moments): with ``snapshot`` those are cloned now.
    """
    if request.async_fn is None:
        return [], "none"
    if not hasattr(writer, "write_buckets"):  # NVRx's writer: its preload builds the buckets, CPU tensors cloned
        return list(request.preload_fn()), "nvrx"  # at planning already, GPU tensors copied to the host here
    if not writer.write_buckets:
        return [], "none"
    live = writer.write_buckets
    on_gpu = any(t.is_cuda for _, _, (_, tensors) in live for _, t in tensors)
    if not on_gpu:
        staged = request.preload_fn() if request.preload_fn is not None else live
        if not snapshot:
            return list(staged), "cpu"
        out = []
        for (name, key, (bytes_data, tensors)), (_, _, (_, originals)) in zip(staged, live, strict=True):
            copied = [(item, t.detach().clone() if t is orig else t)
                      for (item, t), (_, orig) in zip(tensors, originals, strict=True)]
            out.append((name, key, (bytes_data, copied)))
        return out, "cpu"
    out = []
    for name, key, (bytes_data, tensors) in live:
        staged_tensors = []
        for item, t in tensors:
            if t.is_cuda:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t.detach(), non_blocking=True)
            else:
                host = t.detach().clone() if snapshot else t
            staged_tensors.append((item, host))
        out.append((name, key, (bytes_data, staged_tensors)))
    torch.cuda.current_stream().synchronize()  # every copy has landed before the writer reads a buffer
    return out, "pinned"


def begin_save(state: TrainState, ckpt_dir: str, *, fully_parallel: bool = False,
               async_: bool = False, thread_count: int = 1, async_strategy: str = "auto") -> SaveHandle:
    """Plan the save and start writing this rank's shard files.

    Collective: every rank of the default group must call it, in the same order; its collectives
    (listed in the module docstring) all happen before any shard is written. Without ``async_`` this
    rank's files are written and fsynced when it returns; with ``async_`` a background thread writes a
    snapshot, and training may continue at once. ``thread_count`` is the number of files per rank.
    Then call :meth:`SaveHandle.wait_local` and one of the finalize methods. ``async_strategy``
    (``checkpoint.async_strategy``): whose planner and writer, megatron-core's or NVRx's (:mod:`.async_saves`).
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    apply_cpu_compat()
    os.makedirs(ckpt_dir, exist_ok=True)  # every rank: no barrier needed, exist_ok is race-free
    t0 = time.perf_counter()
    # One strategy per model and save layout lives across saves (on the TrainState, so it goes with the
    # model): megatron-core then caches the save plan and the global metadata once two saves agree, and
    # later saves skip the plan exchange. The sharding layout is validated on the first save only (it
    # cannot change while the model lives).
    key = (fully_parallel, thread_count)
    first = key not in state.save_strategies
    if first:
        base = _capturing_strategy(thread_count)
        strategy = base
        if fully_parallel:
            dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
            strategy = FullyParallelSaveStrategyWrapper(base, dp_cp, do_cache_distribution=True)
        state.save_strategies[key] = (base, strategy)
    base, strategy = state.save_strategies[key]
    finish_param_sync(state)  # overlap_param_gather leaves the last update's all-gather to the next forward
    chosen = async_saves.resolve(async_strategy)
    if first and dist.get_rank() == 0:
        logger.info("checkpoint saves: %s", async_saves.explain(chosen))
    extra = {} if chosen is None else {"async_strategy": chosen}
    # megatron-core's "Overwriting old incomplete / corrupted checkpoint..." when rank 0 finds the folder non-empty:
    # our iter_N.tmp is cleared by rank 0 before a barrier, so what it finds there are the shards its peers started
    # writing (cached save plans need no exchange first). 0.19's "MCore's async save is deprecated": the choice is
    # checkpoint.async_strategy's, said once by lifecycle (async_saves.explain).
    with async_saves.plain_results_queue(chosen), \
            quiet("megatron.core.dist_checkpointing.serialization", "Overwriting old incomplete"), \
            quiet("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated"):
        request = dist_checkpointing.save(sharded_state(state), ckpt_dir, sharded_strategy=strategy,
                                          async_sharded_save=True, validate_access_integrity=first, **extra)
    writer, global_metadata, _ = base.captured
    handle = SaveHandle(ckpt_dir, writer, global_metadata, step=state.step)
    handle.plan_s = time.perf_counter() - t0
    handle.async_strategy = chosen or "mcore"
    buckets, handle.host_copy = _host_buckets(request, writer, snapshot=async_)
    handle.start_writes(buckets, async_)
    return handle
