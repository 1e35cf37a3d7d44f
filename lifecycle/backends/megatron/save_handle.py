"""One rank's part of one split checkpoint save: the local writes, then the finalization.

Made by :func:`lifecycle.backends.megatron.checkpoint.begin_save`; the protocol (who calls what, which
collectives run where) is in that module's docstring. Nothing here issues a collective on the default
group.
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from lifecycle.backends.megatron.cpu_compat import cuda_to_cpu_mode
from lifecycle.errors import HangError, PhaseError

logger = logging.getLogger(__name__)

BACKEND, VERSION = "torch_dist", 1
_PHASE = "checkpoint"


def _write_buckets(writer: Any, buckets: Sequence[Any]) -> list[Any]:
    """Write this rank's buckets with the writer's per-file write (megatron-core's or NVRx's; fsync on); return
    WriteResults."""
    from lifecycle.backends.megatron.async_saves import write_bucket

    results: queue.SimpleQueue[Any] = queue.SimpleQueue()
    count: queue.Queue[int] = queue.Queue()
    out: list[Any] = []
    with cuda_to_cpu_mode():
        for i, bucket in enumerate(buckets):
            count.put(i)
            write_bucket(writer, i, bucket, results, count)
            _, res = results.get()
            if isinstance(res, BaseException):
                raise PhaseError(f"rank {dist.get_rank()}: writing {bucket[0]} failed: {res}",
                                 phase=_PHASE, rank=dist.get_rank()) from res
            out.extend(res)
    return out



class SaveHandle:
    """One rank's part of one checkpoint save. See the module docstring for the protocol."""

    def __init__(self, ckpt_dir: str, writer: Any, global_metadata: Any, *, step: int) -> None:
        self.ckpt_dir = ckpt_dir
        self.step = step
        self.rank = dist.get_rank()
        self.plan_s = 0.0
        self.write_s: float | None = None
        self.host_copy = "none"
        """How the shards reached host memory: ``pinned`` (GPU -> page-locked buffers), ``cpu``, or ``nvrx`` (NVRx's
        writer: CPU tensors cloned while planning, GPU tensors copied by its preload)."""
        self.async_strategy = "mcore"
        """Whose planner and writer made this save: ``mcore`` (megatron-core's) or ``nvrx``."""
        self._writer = writer
        self._global_metadata = global_metadata  # only on global rank 0
        self._results: list[Any] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start_writes(self, buckets: list[Any], async_: bool) -> None:
        """Write ``buckets`` now, or in a background thread with ``async_`` (begin_save calls it)."""
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

    def finalize_via_store(self, store: Any, key: str, timeout_s: float, *,
                           wait_complete: bool = False) -> None:
        """Publish this rank's write results in ``store``; rank 0 collects them all and finalizes.

        Every rank must call it, with the same ``key`` (unique per save). No process-group collective.
        Rank 0 raises :class:`HangError` naming the ranks whose results did not arrive within
        ``timeout_s``, then sets ``<key>/done``. Other ranks return once published, unless
        ``wait_complete``: then they wait (same deadline) for ``<key>/done`` — needed before anyone
        loads the checkpoint, since it is complete only when rank 0 has written ``metadata.json``.
        """
        deadline = time.monotonic() + timeout_s
        mine = self.wait_local(timeout_s)
        store.set(f"{key}/{self.rank}", pickle.dumps(mine))
        if self.rank == 0:
            keys = [f"{key}/{r}" for r in range(dist.get_world_size())]
            self._poll(store, keys, deadline, timeout_s)
            self.finalize([pickle.loads(store.get(k)) for k in keys])
            store.set(f"{key}/done", b"1")
        elif wait_complete:
            self._poll(store, [f"{key}/done"], deadline, timeout_s, missing_if_late=[0])

    def _poll(self, store: Any, keys: list[str], deadline: float, timeout_s: float,
              missing_if_late: list[int] | None = None) -> None:
        from lifecycle.distributed.barrier import missing_keys

        missing = missing_keys(store, keys, deadline - time.monotonic())
        if missing:
            missing = missing_if_late or missing
            raise HangError(f"checkpoint {self.ckpt_dir}: ranks {missing} did not finish "
                            f"within {timeout_s}s", missing=missing, phase=_PHASE,
                            rank=self.rank, group="store", deadline_s=timeout_s)
