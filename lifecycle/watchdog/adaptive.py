"""Deadlines that follow what the job does: ``watchdog.deadlines.step: auto`` (and ``checkpoint: auto``).

Until ``calibration_steps`` observations (and for the first step after a resume) the static deadline applies.
Then each rank proposes ``clamp(factor × quantile(recent window), floor, ceiling)`` where the ceiling is the
static default, and every rank uses the **maximum** of the proposals, agreed at a step boundary inside the
all-reduce the train loop already makes (the stop flag): no extra collective. What is measured is what the
deadline bounds: the watchdog's deadline is the longest stretch without a begin/end event, so the samples are the
durations of ``step`` spans (train) and of the spans of a checkpoint (save, commit, its barriers) — a step
that includes a checkpoint commit or a barrier point is measured as those spans, not as a slow step.

Pure Python; thread-safe (the training thread observes and agrees, the watchdog thread reads).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol


class AdaptiveSettings(Protocol):
    @property
    def factor(self) -> float: ...
    @property
    def quantile(self) -> float: ...
    @property
    def window(self) -> int: ...
    @property
    def floor_s(self) -> float: ...
    @property
    def span_floor_s(self) -> float: ...
    @property
    def calibration_steps(self) -> int: ...


def floor_of(cfg: AdaptiveSettings, name: str) -> float:
    """The lower clamp of deadline ``name``: ``floor_s`` for steps, ``span_floor_s`` for checkpoint and eval spans."""
    return cfg.floor_s if name == "step" else cfg.span_floor_s


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True)
class Derivation:
    """How an effective deadline came about, for events, reports and ``explain``."""

    seconds: float
    text: str
    adaptive: bool


class AdaptiveDeadline:
    """One deadline (``step``, ``checkpoint`` or a trainer's ``eval``: its ``watchdog.deadlines`` key), adaptive after
    calibration."""

    def __init__(self, name: str, static_s: float, cfg: AdaptiveSettings) -> None:
        self.name = name
        self.static_s = static_s
        self.cfg = cfg
        self._samples: deque[float] = deque(maxlen=cfg.window)
        self._seen = 0
        self._agreed: float | None = None
        self._agreed_text = ""
        self._skip_next = False
        self._restored = ""
        self._lock = threading.Lock()

    @property
    def floor_s(self) -> float:
        """The lower clamp (:func:`floor_of`)."""
        return floor_of(self.cfg, self.name)

    def observe(self, seconds: float) -> None:
        """One sample (seconds a step or a checkpoint span took). The first one after a resume is skipped."""
        if seconds < 0 or not math.isfinite(seconds):
            return
        with self._lock:
            if self._skip_next:
                self._skip_next = False
                return
            self._samples.append(seconds)
            self._seen += 1

    def calibrated(self) -> bool:
        return self._seen >= self.cfg.calibration_steps and bool(self._samples)

    def proposal(self) -> float:
        """This rank's proposal (seconds; 0 while not calibrated: the max over ranks is then the others')."""
        with self._lock:
            if not self.calibrated():
                return 0.0
            q = quantile(list(self._samples), self.cfg.quantile)
        return min(max(self.cfg.factor * q, self.floor_s), self.static_s)

    def agree(self, agreed_s: float) -> None:
        """Every rank calls it with the same value: the maximum of the proposals (0: stay static)."""
        with self._lock:
            if agreed_s <= 0 or self._skip_next:
                self._agreed = None
                return
            self._agreed = min(max(agreed_s, self.floor_s), self.static_s)
            n = len(self._samples)
            q = quantile(list(self._samples), self.cfg.quantile) if n else 0.0
            self._agreed_text = (f"{self._agreed:.3g}s = max over ranks of clamp({self.cfg.factor:g} × "
                                 f"p{self.cfg.quantile * 100:g}, {self.floor_s:g}s, {self.static_s:g}s); "
                                 f"this rank: p{self.cfg.quantile * 100:g} {q:.3g}s over the last {n} "
                                 f"{ {'step': 'steps', 'checkpoint': 'checkpoint spans'}.get(self.name, self.name + ' spans')}")

    def after_resume(self) -> None:
        """The first step after a resume runs with the static deadline (caches are cold, state reloads)."""
        with self._lock:
            self._skip_next = True
            self._agreed = None

    def state(self) -> dict[str, float | int | list[float] | None]:
        """What was learned (the recent window, the observations seen, the agreed value): saved with each
        committed checkpoint, so the next attempt starts from it (:meth:`restore`)."""
        with self._lock:
            return {"samples": [round(x, 6) for x in self._samples], "seen": self._seen, "agreed": self._agreed,
                    "static_s": self.static_s}

    def restore(self, state: dict[str, object], source: str) -> bool:
        """Continue from a saved :meth:`state` (every rank loads the same one): the window, the count and the
        agreed deadline, clamped to this policy's floor and ceiling; it applies from the next step on. False (and
        nothing changes) when the state is not usable."""
        samples, seen, agreed = state.get("samples"), state.get("seen"), state.get("agreed")
        if not isinstance(samples, list) or not isinstance(seen, int) or not (
                agreed is None or isinstance(agreed, int | float)):
            return False
        values = [float(x) for x in samples if isinstance(x, int | float) and math.isfinite(x) and x >= 0]
        with self._lock:
            self._samples.clear()
            self._samples.extend(values[-(self._samples.maxlen or len(values)):])
            self._seen = max(seen, len(self._samples))
            self._agreed = None if agreed is None else min(max(float(agreed), self.floor_s), self.static_s)
            self._restored = source
            if self._agreed is not None:
                self._agreed_text = f"{self._agreed:.3g}s, restored from {source}"
        return True

    def effective(self) -> float:
        with self._lock:
            return self._agreed if self._agreed is not None else self.static_s

    def derivation(self) -> Derivation:
        with self._lock:
            if self._agreed is not None:
                return Derivation(self._agreed, f"deadline {self._agreed_text}", True)
            left = max(self.cfg.calibration_steps - self._seen, 0)
            why = f"static until {left} more observation(s)" if left else "static (first step after a resume)"
            return Derivation(self.static_s, f"deadline {self.static_s:g}s ({why}; auto after "
                                             f"{self.cfg.calibration_steps} steps)", False)
