"""Per-rank checkpoint files (``rank_<R>.pt`` and rank 0's ``metadata.json``): the save handle of the synthetic kind
and of a watched plain module (``job.watch``), with the same two-phase commit as the megatron kind's torch_dist."""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lifecycle.errors import HangError, PhaseError


class LocalFilesSave:
    """This rank's ``rank_<R>.pt`` plus rank 0's ``metadata.json``; the SaveHandle protocol."""

    def __init__(self, path: Path, rank: int, world: int, state: dict[str, Any], async_: bool) -> None:
        self.path, self.rank, self.world = path, rank, world
        self.write_s: float | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        path.mkdir(parents=True, exist_ok=True)
        if async_:
            self._thread = threading.Thread(target=self._write, args=(state,), daemon=True)
            self._thread.start()
        else:
            self._write(state)

    def _write(self, state: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            target = self.path / f"rank_{self.rank}.pt"
            with open(target, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException as exc:  # noqa: BLE001 - re-raised in wait_local
            self._error = exc
        self.write_s = time.perf_counter() - t0

    def wait_local(self, timeout_s: float) -> list[Any]:
        """This rank's file is durable. No collective."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise HangError(f"rank {self.rank}: checkpoint write to {self.path} not done after {timeout_s}s",
                                missing=[self.rank], phase="checkpoint", rank=self.rank, deadline_s=timeout_s)
        if self._error is not None:
            raise PhaseError(f"rank {self.rank}: checkpoint write failed: {self._error}", phase="checkpoint",
                             rank=self.rank) from self._error  # a full disk behind it is named as such
        return [self.rank]

    def finalize_via_store(self, store: Any, key: str, timeout_s: float) -> None:
        """Every rank publishes; rank 0 waits for all (naming the missing) and writes metadata.json."""
        from lifecycle.distributed.barrier import missing_keys

        deadline = time.monotonic() + timeout_s
        store.set(f"{key}/{self.rank}", pickle.dumps(self.wait_local(timeout_s)))
        if self.rank != 0:
            return
        missing = missing_keys(store, [f"{key}/{r}" for r in range(self.world)], deadline - time.monotonic())
        if missing:
            raise HangError(f"checkpoint {self.path}: ranks {missing} did not finish writing within "
                            f"{timeout_s:g}s", missing=missing, phase="checkpoint", rank=0, group="store",
                            deadline_s=timeout_s)
        self._metadata()

    def finalize_over_group(self, group: Any, timeout_s: float) -> None:
        """One gather_object on ``group`` (spanning every rank) to rank 0, which writes metadata.json."""
        mine = self.wait_local(timeout_s)
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, out, dst=0, group=group)
        if self.rank == 0:
            self._metadata()

    def _metadata(self) -> None:
        (self.path / "metadata.json").write_text(json.dumps({"format": "lifecycle-synthetic", "world": self.world}))
