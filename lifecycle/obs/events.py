"""Per-rank JSONL events: one JSON object per line in ``<run_dir>/events/rank_<R>.jsonl``.

Schema (documented in docs/timeline.md): ``t`` (µs since the Unix epoch: one clock base for every rank of a
run), ``rank``, ``local_rank``, ``host``, ``phase``, ``kind`` (``begin`` | ``end`` | ``instant`` |
``scalar``), ``name``, and optionally ``group``, ``step``, ``dur_us`` (on ``end``), ``outcome`` and any
extra fields (bytes, memory, zero-token counts, exit code...). Lines are buffered in memory and written
by the caller's thread only at flush points, so a write never sits inside a collective; ``close()`` is
called on every exit path (the failure path and ``atexit`` included) and is safe twice.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lifecycle import rundir
from lifecycle.rundir import safeio

_ENCODE = json.JSONEncoder(default=str).encode
"""One encoder for every event: ``json.dumps(..., default=str)`` builds a new one per call (on the training thread)."""


PER_STEP_OPS = ("grad_reduce", "loss_all_reduce", "stop_flag")
"""The collectives every step records (three quarters of a long attempt's events): readers that need none of them
(the summary) or only their ends (goodput) leave those lines unparsed."""


def now_us() -> int:
    return time.time_ns() // 1000


class EventLog:
    """Buffered JSONL writer for one rank."""

    def __init__(self, run_dir: Path, rank: int, local_rank: int = 0, *, flush_every: int = 256) -> None:
        self.path = rundir.events_file(Path(run_dir), rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.local_rank, self.host = rank, local_rank, socket.gethostname()
        self.phase = "init"
        self.step: int | None = None
        self.last_t = now_us()
        """When the last event was emitted (µs, like ``t``): read by other threads to tell a quiet rank."""
        self._buf: list[str] = []
        self._lock = threading.Lock()
        self._flush_every = flush_every
        # Opened non-blocking first: a FIFO or device left under this name is an error naming it, not a hang.
        self._file: Any = os.fdopen(safeio.open_append(self.path), "a", buffering=1 << 16)
        self.listeners: list[Any] = []
        """Callables given every event dict as it is emitted (the watchdog listens here); keep them O(1)."""
        self.on_close: list[Any] = []
        """Callables run once by ``close()`` before the file closes (sinks flush here); errors are ignored."""
        atexit.register(self.close)
        if os.environ.get("LIFECYCLE_SINKS"):  # optional sinks (tensorboard...), see lifecycle.obs.sinks
            from lifecycle.obs import sinks

            sinks.attach(self, sinks.from_env())

    def emit(self, kind: str, name: str, **fields: Any) -> dict[str, Any]:
        """Record one event; ``phase`` and ``step`` default to the current ones."""
        event = {"t": now_us(), "rank": self.rank, "local_rank": self.local_rank, "host": self.host,
                 "phase": fields.pop("phase", self.phase), "kind": kind, "name": name}
        if self.step is not None and "step" not in fields:
            event["step"] = self.step
        event.update({k: v for k, v in fields.items() if v is not None})
        self.last_t = event["t"]
        for listener in self.listeners:
            listener(event)
        line = _ENCODE(event)
        with self._lock:
            self._buf.append(line)
            if len(self._buf) >= self._flush_every:
                self._write_locked()
        return event

    def instant(self, name: str, **fields: Any) -> None:
        self.emit("instant", name, **fields)

    def scalar(self, name: str, value: float, **fields: Any) -> None:
        self.emit("scalar", name, value=value, **fields)

    @contextmanager
    def span(self, name: str, **fields: Any) -> Iterator[dict[str, Any]]:
        """A begin/end pair; the yielded dict's entries are added to the end event."""
        begin = self.emit("begin", name, **fields)
        extra: dict[str, Any] = {}
        outcome = "ok"
        try:
            yield extra
        except BaseException as exc:
            outcome = f"error: {type(exc).__name__}"
            raise
        finally:
            self.emit("end", name, dur_us=now_us() - begin["t"], outcome=outcome, **{**fields, **extra})

    def flush(self) -> None:
        with self._lock:
            self._write_locked()

    def _write_locked(self) -> None:
        if self._file is None or not self._buf:
            return
        self._file.write("\n".join(self._buf) + "\n")
        self._buf.clear()
        self._file.flush()

    def close(self) -> None:
        """Flush and close; safe twice and after a partial init."""
        hooks, self.on_close = list(getattr(self, "on_close", [])), []
        for hook in hooks:  # outside the lock: a hook may still emit
            try:
                hook()
            except Exception:  # noqa: BLE001 - closing runs on the failure path too: never raise here
                pass
        with self._lock:
            if getattr(self, "_file", None) is None:
                return
            self._write_locked()
            try:
                os.fsync(self._file.fileno())
            except OSError:
                pass
            self._file.close()
            self._file = None


def read_events(run_dir: Path, problems: list[str] | None = None, *,
                skip: tuple[str, ...] = ()) -> dict[int, list[dict[str, Any]]]:
    """All ranks' events of a run, by rank. Never raises on bad content.

    A line that is not a JSON object (a torn last line, binary junk, invalid UTF-8, a number of 5,000
    digits) is skipped, and so is a ``rank_<R>.jsonl`` that is not a regular file or whose R is not a
    rank. When ``problems`` is given, one line per file with skipped content is appended to it. ``skip``: event
    names left unread (a line that names one is not parsed: a reader that needs none of the per-step collectives
    reads a tenth of the lines).
    """
    out: dict[int, list[dict[str, Any]]] = {}
    needles = tuple(f'"name": {json.dumps(n)}'.encode() for n in skip)
    for rank, path in rank_files(run_dir, problems):
        events, bad = _read_lines(path, problems, needles)
        if bad:
            _note(problems, f"{path.name}: {bad} malformed line{'s' if bad > 1 else ''} skipped")
        out[rank] = events
    return out


def _rank_of(path: Path) -> int | None:
    digits = path.stem.removeprefix("rank_")
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 10 else None


def _read_lines(path: Path, problems: list[str] | None,
                needles: tuple[bytes, ...] = ()) -> tuple[list[dict[str, Any]], int]:
    bad = [0]
    events = list(iter_file(path, problems, bad, needles))
    return events, bad[0]


def iter_file(path: Path, problems: list[str] | None = None, bad: list[int] | None = None,
              needles: tuple[bytes, ...] = ()) -> Iterator[dict[str, Any]]:
    """The JSON objects of one event file, one line at a time (memory: one line). Lines that are not one are
    counted in ``bad[0]``; a file that cannot be read (a FIFO, a read error) is noted in ``problems``. A line that
    holds one of ``needles`` (``"name": "<event name>"`` as the event log writes it) is left unparsed, unless no
    event follows it (a rank cut inside such a span: its last moment is still read)."""
    held: bytes | None = None  # the last line left unparsed since the last event
    try:
        with safeio.open_regular(path) as f:  # a FIFO named like an event file would block a plain open()
            for raw in f:
                if needles and any(n in raw for n in needles):
                    held = raw
                    continue
                event = _parse(raw)
                if isinstance(event, dict):
                    held = None
                    yield event
                elif raw.strip() and bad is not None:
                    bad[0] += 1
        if held is not None and isinstance(event := _parse(held), dict):
            yield event
    except safeio.RunDirError as exc:
        _note(problems, f"{path.name}: skipped: {str(exc).split(': ', 1)[-1].split(';')[0]}")
    except OSError as exc:
        _note(problems, f"{path.name}: cannot read ({exc.strerror or exc}); the rest of the file skipped")


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None


def rank_files(run_dir: Path, problems: list[str] | None = None) -> list[tuple[int, Path]]:
    """``(rank, path)`` of every ``events/rank_<R>.jsonl`` that is a regular file named by a rank, in rank order;
    the others noted in ``problems``."""
    folder = Path(run_dir) / rundir.EVENTS_DIR
    try:
        paths = sorted(folder.glob(rundir.RANK_EVENTS))
    except OSError as exc:
        _note(problems, f"{folder}: cannot list ({exc.strerror or exc}); no events read")
        return []
    out = []
    for path in paths:
        rank = _rank_of(path)
        if rank is None or not path.is_file():
            _note(problems, f"{path.name}: {'not a rank number' if rank is None else 'not a regular file'}; "
                  "skipped")
            continue
        out.append((rank, path))
    return sorted(out)


def _note(problems: list[str] | None, text: str) -> None:
    if problems is not None:
        problems.append(text)
