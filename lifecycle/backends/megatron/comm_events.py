"""Spans and op counts for the collectives Megatron's DDP and distributed optimizer issue inside a step.

A training step is one ``step`` span to the watchdog; the gradient reductions and parameter gathers inside
it run on the dp, expert-dp, intra-instance and inter-instance (``inter_dist_opt``) groups. Each of those is
issued by a DDP bucket group inside ``torch.distributed._coalescing_manager(group, ...)`` (megatron-core
0.16.1 ``param_and_grad_buffer``): the reduce-scatter (or all-reduce) inside one distributed-optimizer
instance, the all-reduce across instances, the parameter all-gather. :func:`install` wraps that manager, as
imported by ``param_and_grad_buffer``, so each such op becomes a ``grad_reduce`` or ``param_gather`` span on
its group's symbolic label (with the member ranks) and one count in ``ctx.ops``. The watchdog then
names the group and the ranks that never joined when a step hangs in one (a zero-token rank that skipped
its expert bucket), and the collective-sequence check compares these counts too.

Synchronous ops (``dist_opt_instances`` > 1 runs them synchronously, from the backward hooks with
``overlap_grad_reduce``) are inside their span; an asynchronous op's span covers its launch, and its wait
belongs to the step. The patch is process-wide and inert when no recorder is set (:func:`set_recorder`).
The step's own loss report (an all-reduce over dp, a broadcast over pp) gets the same spans through
:func:`collective` (``loss_all_reduce``, ``loss_broadcast``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

Span = Callable[..., contextlib.AbstractContextManager[Any]]

_local = threading.local()


class Recorder:
    """Where the spans and counts of one run go. ``labels`` maps ``id(ProcessGroup)`` to (label, ranks)."""

    def __init__(self, span: Span, count: Callable[[str], None], labels: dict[int, tuple[str, list[int]]]) -> None:
        self.span = span
        self.count = count
        self.labels = labels

    def where(self, group: Any) -> tuple[str, list[int]]:
        found = self.labels.get(id(group))
        if found is not None:
            return found
        ranks = list(dist.get_process_group_ranks(group))
        return f"pg{ranks}", ranks


_recorder: Recorder | None = None


def set_recorder(recorder: Recorder | None) -> None:
    """Route the spans of every later DDP collective to ``recorder`` (None: stop recording)."""
    global _recorder
    _recorder = recorder


@contextlib.contextmanager
def _op(name: str) -> Iterator[None]:
    previous = getattr(_local, "op", None)
    _local.op = name
    try:
        yield
    finally:
        _local.op = previous


def _named(method: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _op(name):
            return method(self, *args, **kwargs)

    return wrapper


def install() -> bool:
    """Wrap megatron's DDP coalescing manager and name its ops (idempotent). False if this megatron-core
    has no such hook (then nothing is recorded). Local, no collective."""
    try:
        from megatron.core.distributed import param_and_grad_buffer as pgb
    except ImportError:
        return False
    manager = getattr(pgb, "_coalescing_manager", None)
    group_cls = getattr(pgb, "_ParamAndGradBucketGroup", None)
    if manager is None or group_cls is None:
        return False
    if getattr(manager, "_lifecycle", False):
        return True

    @contextlib.contextmanager
    def recorded(group: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        rec = _recorder
        if rec is None or group is None:
            with manager(group, *args, **kwargs) as cm:
                yield cm
            return
        label, ranks = rec.where(group)
        with rec.span(getattr(_local, "op", None) or "ddp_collective", group=label, ranks=ranks), \
                manager(group, *args, **kwargs) as cm:
            yield cm
        rec.count(label)

    recorded._lifecycle = True  # type: ignore[attr-defined]
    pgb._coalescing_manager = recorded
    for method, name in (("start_grad_sync", "grad_reduce"), ("start_param_sync", "param_gather")):
        if hasattr(group_cls, method):
            setattr(group_cls, method, _named(getattr(group_cls, method), name))
    return True


@contextlib.contextmanager
def collective(name: str, group: Any) -> Iterator[None]:
    """A span (and one count) for a collective the step code issues itself on ``group`` (the loss report), so a
    rank stuck there is named with its group and op like a DDP bucket. Inert without a recorder."""
    rec = _recorder
    if rec is None or group is None:
        yield
        return
    label, ranks = rec.where(group)
    with rec.span(name, group=label, ranks=ranks):
        yield
    rec.count(label)


def group_labels(get_group: Callable[[str], Any], names: list[str],
                 extra: dict[str, Any] | None = None) -> dict[int, tuple[str, list[int]]]:
    """``id(ProcessGroup)`` -> (every symbolic name of it joined with '=', its ranks), for this rank. Local.

    ``extra`` names megatron groups that have no symbolic name (used only where no symbolic name has the
    same object).
    """
    by_id: dict[int, tuple[list[str], Any]] = {}
    for name in names:
        pg = get_group(name)
        if pg is not None:
            by_id.setdefault(id(pg), ([], pg))[0].append(name)
    for name, pg in (extra or {}).items():
        if pg is not None and id(pg) not in by_id:
            by_id[id(pg)] = ([name], pg)
    return {key: ("=".join(found), list(dist.get_process_group_ranks(pg))) for key, (found, pg) in by_id.items()}
