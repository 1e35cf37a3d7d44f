"""What a step handler (``train.kind``) implements, and what its ``begin_save`` returns.

Third-party kinds implement :class:`StepHandler` (structural typing: no base class to inherit). The
train and checkpoint phases call its methods in the same order on every rank; the docstrings say which
calls are collective and on which group.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

    from lifecycle.context import RunContext


class SaveHandle(Protocol):
    """One rank's part of one checkpoint save, returned by :meth:`StepHandler.begin_save`."""

    write_s: float | None
    """Seconds this rank spent writing (None until the writes finished)."""

    def wait_local(self, timeout_s: float) -> object:
        """Wait until this rank's files are written and durable. No collective."""
        ...

    def finalize_via_store(self, store: Store, key: str, timeout_s: float) -> None:
        """Publish this rank's write results under ``key``; global rank 0 waits for every rank's and writes the
        completion marker (``metadata.json``) last. Every rank calls it with the same ``key``; no process group."""
        ...

    def finalize_over_group(self, group: ProcessGroup, timeout_s: float) -> None:
        """The same over ``group`` (spanning every rank, e.g. a dedicated gloo group): collective on ``group``."""
        ...


class StepHandler(Protocol):
    """A ``train.kind``. The factory registered for the kind is called with the validated options model."""

    def setup(self, ctx: RunContext) -> None:
        """Build the model and optimizer. Collective on the default group for the built-in kinds: every rank
        calls it once, after init and warmup."""
        ...

    def step(self, ctx: RunContext, step: int) -> dict[str, float]:
        """Run train step ``step`` (1-based) and return its metrics (``loss`` at least). Collective on every
        group the model uses (data-parallel gradient reduction, expert all-to-all ...): every rank calls it
        for the same steps, in the same order."""
        ...

    def begin_save(self, ctx: RunContext, ckpt_dir: Path) -> SaveHandle:
        """Start saving the state of step ``ctx.step`` into ``ckpt_dir`` (a ``.tmp`` folder the phase commits
        later). Every rank calls it at the same step boundary; collectives here (planning) happen before any
        write, on the default group for the built-in kinds."""
        ...

    def load(self, ctx: RunContext, ckpt_dir: Path) -> int:
        """Restore the state saved in ``ckpt_dir`` and return its step. Every rank calls it (collective on the
        default group for the megatron kind); raise on a missing or unreadable file."""
        ...

    def close(self) -> None:
        """Release the model; local, safe twice."""
        ...
