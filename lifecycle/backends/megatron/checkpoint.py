"""Save and load the tiny GPT-MoE with megatron-core ``dist_checkpointing`` (torch_dist format).

Why not ``dist_checkpointing.save()`` as is: after the local writes it runs a ``gather_object`` of the
write results and a ``broadcast`` of the failure flag on the **default group**
(``save_state_dict_async_finalize``) and then a default-group ``barrier`` (``metadata_finalize_fn``);
``AsyncCallsQueue.maybe_finalize_async_calls`` adds an ``all_reduce`` on the default group per
finalized call (and one per check unless ``no_dist``). A rank that writes slowly turns all of these into
a silent hang of the whole job. Here the save is split so that no collective runs after the writes:

1. :func:`begin_save` (every rank of the default group, same order): builds the sharded state dict and
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
   timeout), or :meth:`SaveHandle.finalize` on rank 0 with results gathered by other means.

Loading (:func:`load`) uses megatron's torch_dist load strategy (optionally fully parallel); every rank
of the default group must call it.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lifecycle.backends.megatron.cpu_compat import apply_cpu_compat, cuda_to_cpu_mode
from lifecycle.backends.megatron.model import TrainState
from lifecycle.errors import HangError, PhaseError

logger = logging.getLogger(__name__)

BACKEND, VERSION = "torch_dist", 1
_PHASE = "checkpoint"


def sharded_state(state: TrainState, *, is_loading: bool = False) -> dict[str, Any]:
    """Model + optimizer sharded state dicts, the step, and this rank's RNG states.

    Issues no collective. The RNG entry is one ``ShardedObject`` per global rank, so a checkpoint
    with it loads only at the same world size and layout (Megatron does the same).
    """
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing import ShardedObject

    model_sd = state.gpt.sharded_state_dict()
    rng = {"cpu": torch.get_rng_state(),
           "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return {
        "model": model_sd,
        "optimizer": state.optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
        "step": state.step,
        "rng_state": ShardedObject("rng_state", rng, (dist.get_world_size(),), (dist.get_rank(),),
                                   replica_id=0),
    }


def load(state: TrainState, ckpt_dir: str, *, fully_parallel: bool = False) -> int:
    """Restore model, optimizer, RNG and step from ``ckpt_dir``; return the step.

    Collective: every rank of the default group must call it. Default group: ``all_gather_object``
    (sharding validation) and torch DCP's load planning (gather + scatter of plans). With
    ``fully_parallel`` each shard is read once per dp(+cp) group and exchanged over it
    (``all_gather_object`` + broadcasts on the dp group); that wrapper calls ``.cuda()``, which the
    CPU compatibility layer makes work.
    """
    from megatron.core import dist_checkpointing, tensor_parallel
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
    loaded = dist_checkpointing.load(sharded_state(state, is_loading=True), ckpt_dir,
                                     sharded_strategy=strategy)
    state.gpt.load_state_dict(loaded["model"], strict=True)
    state.optimizer.load_state_dict(loaded["optimizer"])
    rng = loaded["rng_state"]
    torch.set_rng_state(rng["cpu"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    state.step = int(loaded["step"])
    return state.step


def _capturing_strategy(thread_count: int) -> Any:
    """megatron's torch_dist save strategy, remembering (writer, global metadata) for our finalize."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if not hasattr(TorchDistSaveShardedStrategy, "_get_save_and_finalize_callbacks"):
        raise PhaseError("this megatron-core has no TorchDistSaveShardedStrategy."
                         "_get_save_and_finalize_callbacks; the split save needs it", phase=_PHASE)

    class CapturingStrategy(TorchDistSaveShardedStrategy):  # type: ignore[misc, valid-type]
        captured: tuple[Any, Any, Any] | None = None

        def _get_save_and_finalize_callbacks(self, writer: Any, save_state_dict_ret: Any) -> Any:
            self.captured = tuple(save_state_dict_ret)  # (writer, global_metadata, dist_wrapper)
            return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)

    return CapturingStrategy(BACKEND, VERSION, thread_count=thread_count)


def _skip_results_manager() -> None:
    # FileSystemWriterAsync.prepare_write_data spawns a multiprocessing Manager (a fresh interpreter
    # per rank) for its result queue. We collect results ourselves, so a plain queue stands in.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", 0) is None:
        filesystem_async._results_queue = queue.Queue()


def _write_buckets(writer: Any, buckets: Sequence[Any]) -> list[Any]:
    """Write this rank's buckets with megatron's per-file writer (fsync on); return WriteResults."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    transforms = [writer.transforms] if hasattr(writer, "transforms") else []
    results: queue.SimpleQueue[Any] = queue.SimpleQueue()
    count: queue.Queue[int] = queue.Queue()
    out: list[Any] = []
    with cuda_to_cpu_mode():
        for i, bucket in enumerate(buckets):
            count.put(i)
            FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, results, count, True)
            _, res = results.get()
            if isinstance(res, BaseException):
                raise PhaseError(f"rank {dist.get_rank()}: writing {bucket[0]} failed: {res}",
                                 phase=_PHASE, rank=dist.get_rank()) from res
            out.extend(res)
    return out


def _snapshot(buckets: Sequence[Any]) -> list[Any]:
    # On CPU the "device-to-host preload" is a no-op, so training would mutate what a background
    # writer is still writing (optimizer moments are not cloned by megatron): copy them now.
    return [(name, key, (bytes_data, [(item, t.detach().clone()) for item, t in tensors]))
            for name, key, (bytes_data, tensors) in buckets]


def begin_save(state: TrainState, ckpt_dir: str, *, fully_parallel: bool = False,
               async_: bool = False, thread_count: int = 1) -> SaveHandle:
    """Plan the save and start writing this rank's shard files.

    Collective: every rank of the default group must call it, in the same order; its collectives
    (listed in the module docstring) all happen before this returns and before any shard is written.
    With ``async_`` the writes run in a background thread on a snapshot, and training may continue.
    ``thread_count`` is the number of shard files per rank.
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    apply_cpu_compat()
    _skip_results_manager()
    os.makedirs(ckpt_dir, exist_ok=True)  # every rank: no barrier needed, exist_ok is race-free
    t0 = time.perf_counter()
    base = _capturing_strategy(thread_count)
    strategy = base
    if fully_parallel:
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        strategy = FullyParallelSaveStrategyWrapper(base, dp_cp, do_cache_distribution=False)
    request = dist_checkpointing.save(sharded_state(state), ckpt_dir, sharded_strategy=strategy,
                                      async_sharded_save=True, validate_access_integrity=True)
    writer, global_metadata, _ = base.captured
    buckets = list(writer.write_buckets or []) if request.async_fn is not None else []
    handle = SaveHandle(ckpt_dir, writer, global_metadata, step=state.step)
    handle.plan_s = time.perf_counter() - t0
    handle._start(_snapshot(buckets) if async_ else buckets, async_)
    return handle


class SaveHandle:
    """One rank's part of one checkpoint save. See the module docstring for the protocol."""

    def __init__(self, ckpt_dir: str, writer: Any, global_metadata: Any, *, step: int) -> None:
        self.ckpt_dir = ckpt_dir
        self.step = step
        self.rank = dist.get_rank()
        self.plan_s = 0.0
        self.write_s: float | None = None
        self._writer = writer
        self._global_metadata = global_metadata  # only on global rank 0
        self._results: list[Any] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _start(self, buckets: list[Any], async_: bool) -> None:
        if async_:
            self._thread = threading.Thread(target=self._write, args=(buckets,), daemon=True,
                                            name=f"lifecycle-ckpt-writer-{self.rank}")
            self._thread.start()
        else:
            self._write(buckets)
            if self._error is not None:
                raise self._error

    def _write(self, buckets: list[Any]) -> None:
        t0 = time.perf_counter()
        try:
            self._results = _write_buckets(self._writer, buckets)
        except BaseException as err:  # noqa: BLE001 - re-raised by wait_local on the caller's thread
            self._error = err
        self.write_s = time.perf_counter() - t0

    @property
    def done(self) -> bool:
        """Whether this rank's writes finished (successfully or not). Never blocks."""
        return self._thread is None or not self._thread.is_alive()

    def wait_local(self, timeout_s: float) -> list[Any]:
        """Wait until this rank's shard files are written and fsynced; return its WriteResults.

        No collective. Raises :class:`HangError` after ``timeout_s`` (the writer keeps running; call
        again to keep waiting) and :class:`PhaseError` if the write failed.
        """
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise HangError(f"rank {self.rank}: local checkpoint write to {self.ckpt_dir} not "
                                f"finished after {timeout_s}s", missing=[self.rank], phase=_PHASE,
                                rank=self.rank, deadline_s=timeout_s)
        if self._error is not None:
            if isinstance(self._error, PhaseError):
                raise self._error
            raise PhaseError(f"rank {self.rank}: checkpoint write failed: {self._error}",
                             phase=_PHASE, rank=self.rank) from self._error
        assert self._results is not None
        return self._results

    def finalize(self, all_results: Sequence[list[Any]]) -> None:
        """Write ``.metadata`` and ``metadata.json`` from every rank's write results (rank order).

        Only global rank 0 may call it (it alone holds the global metadata). Issues no collective.
        ``metadata.json`` is written last: its presence marks the checkpoint complete.
        """
        from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

        if self.rank != 0 or self._global_metadata is None:
            raise PhaseError(f"rank {self.rank}: only global rank 0 can finalize a checkpoint",
                             phase=_PHASE, rank=self.rank)
        self._writer.finish(self._global_metadata, list(all_results))
        save_config(CheckpointingConfig(BACKEND, VERSION), self.ckpt_dir)
        logger.info("checkpoint step %d complete: %s", self.step, self.ckpt_dir)

    def finalize_over_group(self, group: Any, timeout_s: float) -> None:
        """Gather write results to global rank 0 over ``group`` and finalize there.

        Collective: every rank of ``group`` must call it; ``group`` must span all ranks (e.g. a
        dedicated gloo group, whose own timeout then bounds the wait). One ``gather_object`` on
        ``group`` to global rank 0; nothing on the default group.
        """
        if dist.get_world_size(group) != dist.get_world_size():
            raise PhaseError("finalize_over_group needs a group that spans every rank",
                             phase=_PHASE, rank=self.rank)
        mine = self.wait_local(timeout_s)
        gathered: list[Any] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=group)
        if self.rank == 0:
            assert gathered is not None
            self.finalize(gathered)

    def finalize_via_store(self, store: Any, key: str, timeout_s: float, poll_s: float = 0.05) -> None:
        """Publish this rank's write results in ``store``; rank 0 collects them all and finalizes.

        Every rank must call it, with the same ``key`` (unique per save). No process-group collective:
        ranks other than 0 return once published. Rank 0 raises :class:`HangError` naming the ranks
        whose results did not arrive within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        mine = self.wait_local(timeout_s)
        store.set(f"{key}/{self.rank}", pickle.dumps(mine))
        if self.rank != 0:
            return
        keys = [f"{key}/{r}" for r in range(dist.get_world_size())]
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                raise HangError(f"checkpoint {self.ckpt_dir}: ranks {missing} did not finish writing "
                                f"within {timeout_s}s", missing=missing, phase=_PHASE, rank=0,
                                group="store", deadline_s=timeout_s)
            time.sleep(poll_s)
        self.finalize([pickle.loads(store.get(k)) for k in keys])
