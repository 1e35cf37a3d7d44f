"""Which communicators a piece of code really uses: every collective and point-to-point call of any caller.

torch.distributed's Python functions (and megatron-core's module-level aliases of them, bound at import) all end
in a method of the ``ProcessGroup`` object (``allreduce``, ``all_gather_single``, ``reduce_scatter_single``,
``all_to_all_single``, ``send``/``recv`` inside ``batch_isend_irecv``, ...). :func:`trace` wraps those methods on
the class for the duration of a ``with`` block and records (group, method) pairs, whichever path issued them, so
lifecycle can check after the first step that warmup connected every communicator the step used
(``unwarmed_group``) and a test can derive ``warmup.groups: used`` from a real run.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

METHODS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
           "all_gather_single", "all_gather_single_coalesced", "_allgather_base", "reduce_scatter",
           "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
           "_reduce_scatter_base", "alltoall", "alltoall_base", "all_to_all_single", "broadcast", "reduce", "gather",
           "scatter", "barrier", "monitored_barrier", "send", "recv", "recv_anysource")
"""The ProcessGroup methods that move data between ranks (what connects a communicator)."""

_lock = threading.Lock()


class Trace:
    """(id of the ProcessGroup, method) pairs seen, with one ProcessGroup object per id."""

    def __init__(self) -> None:
        self.calls: dict[int, set[str]] = {}
        self.groups: dict[int, ProcessGroup] = {}

    def record(self, pg: ProcessGroup, method: str) -> None:
        self.calls.setdefault(id(pg), set()).add(method)
        self.groups.setdefault(id(pg), pg)


@contextmanager
def trace() -> Iterator[Trace]:
    """Record every data-moving ProcessGroup call in the block (any thread). Not re-entrant: a nested trace
    raises RuntimeError rather than lose the outer one's calls."""
    from torch.distributed import ProcessGroup as PG

    if not _lock.acquire(blocking=False):
        raise RuntimeError("a ProcessGroup trace is already active")
    seen = Trace()
    originals: dict[str, object] = {}
    try:
        for name in METHODS:
            raw = PG.__dict__.get(name)  # the class's own descriptor: restored as it was
            if raw is None:
                continue
            originals[name] = raw
            setattr(PG, name, _wrap(getattr(PG, name), name, seen))
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(PG, name, fn)
        _lock.release()


class _Method(Protocol):
    def __call__(self, pg: ProcessGroup, /, *args: object, **kwargs: object) -> object: ...


def _wrap(fn: _Method, name: str, seen: Trace) -> _Method:
    def method(self: ProcessGroup, /, *args: object, **kwargs: object) -> object:
        seen.record(self, name)
        return fn(self, *args, **kwargs)

    method.__name__ = name
    return method
