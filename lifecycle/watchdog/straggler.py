"""Stragglers: a rank whose step compute time stays above its peers' median by ``factor`` over ``window`` steps.

Each rank keeps the compute time of its last ``window`` steps (the step span minus the time it waited in the
step's collectives — waiting is what the fast ranks do for the slow one) and publishes their median in its
watchdog record, which it publishes anyway: no new store call, no collective. Rank 0's watchdog reads every
record with the one ``multi_get`` it makes per poll for this and names a rank whose median exceeds ``factor`` ×
the median of the others' medians — while the job runs, without stopping it.

Pure Python.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from lifecycle.jsontypes import JsonDict


class StragglerSettings(Protocol):
    @property
    def factor(self) -> float: ...
    @property
    def window(self) -> int: ...


class ComputeWindow:
    """This rank's recent step compute times (training thread writes, watchdog thread reads)."""

    def __init__(self, window: int) -> None:
        self._times: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.window = window

    def add(self, seconds: float) -> None:
        with self._lock:
            self._times.append(max(seconds, 0.0))

    def fields(self) -> JsonDict:
        """``compute_s`` (median over the window) and ``compute_n`` (how many steps it covers)."""
        with self._lock:
            n = len(self._times)
            return {"compute_s": round(statistics.median(self._times), 6) if n else None, "compute_n": n}


@dataclass(frozen=True)
class Finding:
    rank: int
    ratio: float
    compute_s: float
    median_s: float
    window: int
    step: int | None
    recovered: bool = False

    def line(self) -> str:
        if self.recovered:
            return f"rank {self.rank} is no longer a straggler ({self.ratio:.1f}× the median)"
        return (f"rank {self.rank} is {self.ratio:.1f}× slower than the median over the last {self.window} steps "
                f"({self.compute_s * 1e3:.1f} ms vs {self.median_s * 1e3:.1f} ms of step compute)")


class StragglerDetector:
    """Compares the ranks' published compute medians (rank 0's watchdog thread)."""

    def __init__(self, cfg: StragglerSettings) -> None:
        self.cfg = cfg
        self.flagged: set[int] = set()

    def check(self, records: dict[int, JsonDict | None]) -> list[Finding]:
        full = {r: float(rec["compute_s"]) for r, rec in records.items()
                if rec is not None and rec.get("compute_s") is not None
                and int(rec.get("compute_n") or 0) >= self.cfg.window and rec.get("state") == "running"}
        if len(full) < 2:
            return []
        out = []
        for rank, mine in sorted(full.items()):
            others = [v for r, v in full.items() if r != rank]
            median = statistics.median(others)
            ratio = mine / median if median > 0 else float("inf") if mine > 0 else 1.0
            step = (records.get(rank) or {}).get("step")
            if ratio >= self.cfg.factor and rank not in self.flagged:
                self.flagged.add(rank)
                out.append(Finding(rank, ratio, mine, median, self.cfg.window, step))
            elif ratio < self.cfg.factor and rank in self.flagged:
                self.flagged.discard(rank)
                out.append(Finding(rank, ratio, mine, median, self.cfg.window, step, recovered=True))
        return out
