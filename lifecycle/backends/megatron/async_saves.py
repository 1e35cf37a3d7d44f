"""Whose async save plans and writes a megatron-core checkpoint: megatron-core's own or nvidia-resiliency-ext's.

megatron-core 0.17 and later take ``dist_checkpointing.save(..., async_strategy=...)``: ``"mcore"`` (its own
``FileSystemWriterAsync`` and planner, deprecated in 0.19) or ``"nvrx"`` (the same pieces from
``nvidia_resiliency_ext.checkpointing.async_ckpt``, with a metadata cache of its own) — and default to ``"nvrx"``, so a
plain save fails at the first checkpoint where the package is missing (``ModuleNotFoundError: A compatible
nvidia-resiliency-ext installation is required``). 0.16 and older have only their own and no such argument.

:func:`resolve` turns ``checkpoint.async_strategy`` into what this megatron-core takes: ``auto`` is ``nvrx`` when the
save's default asks for it and megatron-core finds a compatible package, else ``mcore``; None for a megatron-core
without the argument. Either way lifecycle keeps its own split save (:mod:`.checkpoint`): the strategy plans and
its writer writes the shard files, and no collective follows the writes (no ``AsyncCallsQueue``, no finalize
all-reduce). :func:`write_bucket` writes one bucket with either writer class; :func:`plain_results_queue` keeps
either writer from spawning a multiprocessing ``Manager`` for results that lifecycle collects itself.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import queue
from collections.abc import Iterator
from typing import Any

from lifecycle.errors import UsageError
from lifecycle.policy import installed

logger = logging.getLogger(__name__)

_WRITER_MODULES = {"mcore": "megatron.core.dist_checkpointing.strategies.filesystem_async",
                   "nvrx": "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"}


@functools.cache
def save_default() -> str | None:
    """The ``async_strategy`` default of this megatron-core's ``dist_checkpointing.save``; None when it has none."""
    from megatron.core import dist_checkpointing

    param = inspect.signature(dist_checkpointing.save).parameters.get("async_strategy")
    return None if param is None else str(param.default)


@functools.cache
def nvrx_unusable() -> str | None:
    """Why megatron-core cannot plan with nvidia-resiliency-ext here (None when it can): a version megatron-core 0.18+
    accepts (:data:`~lifecycle.policy.installed.NVRX_MIN`, held for 0.17 too: its API is the one megatron-core calls),
    then megatron-core's own import of NVRx's async modules."""
    have = installed.version(installed.NVRX)
    if have is not None and installed.parse(have) < installed.NVRX_MIN:
        return f"{installed.NVRX} {have} is older than {installed.fmt(installed.NVRX_MIN)}"
    try:
        from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

        get_async_strategy("nvrx")
    except (ImportError, AssertionError, AttributeError, TypeError) as exc:
        return (f"{installed.NVRX} {have} is not usable by megatron-core {installed.version(installed.MEGATRON)} "
                f"({type(exc).__name__}: {exc})" if have else f"{installed.NVRX} is not installed")
    return None


def resolve(requested: str) -> str | None:
    """What to pass as ``async_strategy`` for ``checkpoint.async_strategy = requested`` (None: pass nothing).

    Raises :class:`UsageError` for ``nvrx`` where it cannot work (``validate`` refuses it earlier from the packages'
    metadata; this is the check against what imports)."""
    default = save_default()
    if default is None:
        if requested == "nvrx":
            raise UsageError(f"checkpoint.async_strategy=nvrx: megatron-core {installed.version(installed.MEGATRON)} "
                             "saves with its own async code only; set checkpoint.async_strategy=auto or mcore")
        return None
    if requested == "mcore":
        return "mcore"
    why = nvrx_unusable()
    if requested == "nvrx" and why is not None:
        raise UsageError(f"checkpoint.async_strategy=nvrx: {why}; install a compatible {installed.NVRX} or set "
                         "checkpoint.async_strategy=auto")
    if requested == "nvrx" or (default == "nvrx" and why is None):
        return "nvrx"
    return "mcore"


def explain(chosen: str | None) -> str:
    """One line: which async save plans the checkpoints, and why (for the log and the checkpoint event)."""
    mc = installed.version(installed.MEGATRON)
    if chosen is None:
        return f"megatron-core {mc}: its own async save (it has no other)"
    if chosen == "nvrx":
        return f"megatron-core {mc}: {installed.NVRX} {installed.version(installed.NVRX)}'s async save"
    why = nvrx_unusable() if save_default() == "nvrx" else None
    return f"megatron-core {mc}: its own async save (mcore)" + (f"; nvrx not used: {why}" if why else "")


@contextlib.contextmanager
def plain_results_queue(chosen: str | None) -> Iterator[None]:
    """While a save plans: the writer's module-level results queue is a plain ``queue.Queue``.

    Both writers' ``prepare_write_data`` otherwise create a ``multiprocessing`` Manager (a fresh interpreter per
    rank) for the results of their own write processes; lifecycle writes in this process and collects the results
    itself. Restored after, so megatron's or NVRx's own async machinery still gets its Manager if used."""
    module = importlib.import_module(_WRITER_MODULES["nvrx" if chosen == "nvrx" else "mcore"])
    if getattr(module, "_results_queue", 0) is not None:
        yield
        return
    setattr(module, "_results_queue", queue.Queue())  # noqa: B010 - a module global of the writer's
    try:
        yield
    finally:
        setattr(module, "_results_queue", None)  # noqa: B010


def write_bucket(writer: Any, index: int, bucket: Any, results: Any, count: Any) -> None:
    """Write one bucket (one shard file, fsynced) with ``writer``'s class; its results go to ``results``.

    megatron-core's ``write_preloaded_data(transforms, index, bucket, results, count, use_fsync)``;
    nvidia-resiliency-ext's takes the writer's ``open_file`` second (and ``use_msc``)."""
    cls = type(writer)
    transforms = [writer.transforms] if hasattr(writer, "transforms") else []
    if "open_file" in inspect.signature(cls.write_preloaded_data).parameters:
        cls.write_preloaded_data(transforms, writer.open_file, index, bucket, results, count, True,
                                 use_msc=getattr(writer, "use_msc", False))
    else:
        cls.write_preloaded_data(transforms, index, bucket, results, count, True)
