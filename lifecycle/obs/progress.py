"""Rank 0's progress for long phases (train steps, a checkpoint save); every other rank stays quiet.

On a terminal it is a one-line carriage-return bar that is erased when the phase ends, so it never lands
in a log. When stdout is not a terminal (a log file, ``lifecycle run``'s per-rank logs, SLURM) it prints
one plain line every ``every`` units instead (by default ~10 lines per phase) and the last one. No
dependency: a few escape codes and ``print``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

CLEAR = "\r\x1b[K"  # carriage return + erase to the end of the line
_REDRAW_S = 0.1  # a bar redrawn more often is only noise on a slow terminal


def _fmt(info: dict[str, Any]) -> str:
    return "".join(f" {k}={v:.4g}" if isinstance(v, float) else f" {k}={v}" for k, v in info.items() if v is not None)


class Progress:
    """Progress of one long phase: ``update(done)`` after each unit, ``close()`` at the end (safe twice).

    ``enabled=False`` (every rank but 0) makes every call a no-op.
    """

    def __init__(self, label: str, total: int | None, *, enabled: bool = True, start: int = 0,
                 unit: str = "step", every: int | None = None, stream: TextIO | None = None,
                 width: int = 28) -> None:
        self.label, self.total, self.enabled, self.unit, self.width = label, total, enabled, unit, width
        self.stream = stream if stream is not None else sys.stdout
        self.tty = enabled and _isatty(self.stream)
        self.every = every or max(1, (total - start) // 10 if total else 1)
        self.start, self.done = start, start
        self._t0 = time.monotonic()
        self._printed, self._drawn_at, self._open = start, 0.0, False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, done: int, **info: Any) -> None:
        """``done`` units finished (absolute, e.g. the step number); ``info`` (loss=...) is shown after."""
        if not self.enabled:
            return
        self.done = done
        last = self.total is not None and done >= self.total
        if self.tty:
            now = time.monotonic()
            if last or now - self._drawn_at >= _REDRAW_S:
                self._write(CLEAR + self._bar() + _fmt(info))
                self._drawn_at, self._open = now, True
        elif last or done - self._printed >= self.every:
            self._write(f"{self._line()}{_fmt(info)}\n")
            self._printed = done

    def close(self) -> None:
        """Erase the bar (terminal); nothing is printed on a non-terminal beyond the update lines."""
        if self.tty and self._open:
            self._write(CLEAR)
            self._open = False

    def _rate(self) -> tuple[float, float | None]:
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        rate = (self.done - self.start) / elapsed
        left = (self.total - self.done) / rate if self.total is not None and rate > 0 else None
        return rate, left

    def _line(self) -> str:
        rate, left = self._rate()
        of = f"/{self.total} ({100 * self.done // max(self.total, 1)}%)" if self.total is not None else ""
        eta = f" eta {left:.0f}s" if left is not None and self.done != self.total else ""
        return f"[rank 0] {self.label} {self.unit} {self.done}{of} {rate:.3g} {self.unit}/s{eta}"

    def _bar(self) -> str:
        if self.total is None:
            return self._line()
        filled = self.width * min(self.done, self.total) // max(self.total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        rate, left = self._rate()
        eta = f" eta {left:.0f}s" if left is not None and self.done < self.total else ""
        return f"{self.label} |{bar}| {self.done}/{self.total} {rate:.3g} {self.unit}/s{eta}"

    def _write(self, text: str) -> None:
        _emit(self.stream, text)


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def for_rank(rank: int, label: str, total: int | None, **kwargs: Any) -> Progress:
    """A :class:`Progress` that shows on rank 0 only."""
    return Progress(label, total, enabled=rank == 0, **kwargs)


@contextmanager
def activity(rank: int, label: str, *, stream: TextIO | None = None) -> Iterator[None]:
    """One long operation on rank 0 (a checkpoint save): ``label ...`` while it runs, then its duration.

    On a terminal the line is erased at the end; otherwise a start and an end line are printed, so a log
    shows what rank 0 was doing if it never finishes.
    """
    if rank != 0:
        yield
        return
    out = stream if stream is not None else sys.stdout
    tty = _isatty(out)
    t0 = time.monotonic()
    _emit(out, f"{CLEAR}{label} ..." if tty else f"[rank 0] {label} ...\n")
    ok = False
    try:
        yield
        ok = True
    finally:
        took = time.monotonic() - t0
        _emit(out, CLEAR if tty else f"[rank 0] {label} {'done' if ok else 'FAILED'} in {took:.2f}s\n")


def _emit(stream: TextIO, text: str) -> None:
    try:  # a closed console must not fail training
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):
        pass
