"""Optional event sinks, found by name: each sees every event of its rank as it is emitted. None is required.

A sink is a callable taking the event dict (it is added to :attr:`EventLog.listeners`, so it runs in the
emitting thread: keep it cheap) with a ``close()`` that :meth:`EventLog.close` calls on every exit path.
A sink that raises is dropped with one warning; it never fails the rank. Built in: ``tensorboard``
(``torch.utils.tensorboard.SummaryWriter``, needs the ``tensorboard`` package). Choose sinks with
``LIFECYCLE_SINKS=tensorboard[,name...]`` (see :func:`from_env`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from lifecycle.errors import UsageError

log = logging.getLogger(__name__)
ENV = "LIFECYCLE_SINKS"


class Sink(Protocol):
    def __call__(self, event: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


SinkFactory = Callable[[Path, int], Sink]
_REGISTRY: dict[str, SinkFactory] = {}
_REQUIRES: dict[str, tuple[str, ...]] = {}


def register(name: str, factory: SinkFactory, *, replace: bool = False, requires: Sequence[str] = ()) -> None:
    """Make ``factory(run_dir, rank) -> Sink`` available as ``name``; ``requires``: the importable packages it needs
    (pip names alike), checked before any rank starts (:func:`check`)."""
    if name in _REGISTRY and not replace:
        raise ValueError(f"sink '{name}' is already registered; pass replace=True to override it")
    _REGISTRY[name] = factory
    _REQUIRES[name] = tuple(requires)


def check(sink_names: Sequence[str]) -> None:
    """Before any rank starts: every sink is known and its packages are installed (found, not imported), else a
    UsageError (exit 2) naming the sink, the package and the ``pip install`` that fixes it."""
    import importlib.util

    for name in sink_names:
        if name not in _REGISTRY:
            raise UsageError(f"{ENV} names an unknown event sink '{name}'. Available names: "
                             f"{', '.join(names()) or '(none)'}")
        missing = [pkg for pkg in _REQUIRES.get(name, ()) if importlib.util.find_spec(pkg) is None]
        if missing:
            raise UsageError(f"{ENV} names the event sink '{name}', which needs the package {', '.join(missing)}: "
                             f"not installed; pip install {' '.join(missing)} (or remove '{name}' from {ENV})")


def names() -> list[str]:
    return sorted(_REGISTRY)


def create(name: str, run_dir: Path, rank: int) -> Sink:
    """Build the sink ``name`` for one rank; an unknown name lists the available ones."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise UsageError(f"unknown event sink '{name}'. Available names: {', '.join(names()) or '(none)'}")
    return factory(Path(run_dir), rank)


def from_env() -> list[str]:
    """Sink names from ``LIFECYCLE_SINKS`` (comma-separated; empty or unset: none)."""
    return [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]


def attach(events: Any, sink_names: Sequence[str]) -> list[Sink]:
    """Create each named sink for ``events``' rank, listen to its events, close it with the log."""
    sinks = [create(n, Path(events.path).parents[1], events.rank) for n in sink_names]
    for name, sink in zip(sink_names, sinks, strict=True):
        events.listeners.append(_Guarded(name, sink, events))
        events.on_close.append(sink.close)
    return sinks


class _Guarded:
    """Calls the sink; on its first error, logs once and stops listening (a sink never fails a rank)."""

    def __init__(self, name: str, sink: Sink, events: Any) -> None:
        self.name, self.sink, self.events = name, sink, events

    def __call__(self, event: dict[str, Any]) -> None:
        try:
            self.sink(event)
        except Exception as exc:  # noqa: BLE001
            log.warning("event sink '%s' failed (%s: %s); it is switched off", self.name, type(exc).__name__, exc)
            if self in self.events.listeners:
                self.events.listeners.remove(self)


class TensorBoardSink:
    """Step loss and duration, scalar events and phase durations of one rank, under
    ``RUN_DIR/tensorboard/rank_<R>`` (open with ``tensorboard --logdir RUN_DIR/tensorboard``)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError("event sink 'tensorboard' needs the tensorboard package: pip install tensorboard "
                             f"(or remove it from {ENV})") from None
        self.writer: Any = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard" / f"rank_{rank}"))

    def __call__(self, event: dict[str, Any]) -> None:
        e = event
        if self.writer is None:
            return
        step, wall = e.get("step") or 0, e["t"] / 1e6
        if e["kind"] == "scalar" and isinstance(e.get("value"), int | float):
            self.writer.add_scalar(e["name"], e["value"], step, walltime=wall)
        elif e["kind"] == "end" and e["name"] == "step":
            if isinstance(e.get("loss"), int | float):
                self.writer.add_scalar("train/loss", e["loss"], step, walltime=wall)
            self.writer.add_scalar("train/step_s", e.get("dur_us", 0) / 1e6, step, walltime=wall)
        elif e["kind"] == "end" and e["name"].startswith("phase:"):
            self.writer.add_scalar(f"phase_s/{e['name'][6:]}", e.get("dur_us", 0) / 1e6, step, walltime=wall)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


register("tensorboard", TensorBoardSink, requires=("tensorboard",))
