"""What a step handler (``train.kind``) implements, what its ``begin_save`` returns, and what it sees of the run.

Third-party kinds implement :class:`StepHandler` (structural typing: no base class to inherit). The
train and checkpoint phases call its methods in the same order on every rank; the docstrings say which
calls are collective and on which group. A handler receives a :class:`StepContext`: the rank, the policy, the
model-parallel groups, the deadlines and the way to record what it does — not the engine's whole state.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

    from lifecycle.distributed.parallel import ParallelState
    from lifecycle.jsontypes import JsonDict
    from lifecycle.policy.schema import Policy


class StepContext(Protocol):
    """What a step handler sees of the run (read-only but for what it records)."""

    @property
    def rank(self) -> int:
        """This process's global rank."""
        ...

    @property
    def world_size(self) -> int: ...

    @property
    def step(self) -> int:
        """The last completed train step (the one being saved in ``begin_save``)."""
        ...

    @property
    def attempt(self) -> int:
        """The attempt of the run (1: the first launch; each restart or re-run is the next), agreed at init."""
        ...

    @property
    def policy(self) -> Policy:
        """The validated policy (the kind's options are ``policy.train.options``)."""
        ...

    @property
    def parallel(self) -> ParallelState:
        """The model-parallel groups (``get_group(name)``)."""
        ...

    def deadline(self, phase: str) -> float:
        """The deadline in seconds of ``phase`` now (``train``: one step, learned when ``auto``)."""
        ...

    def span(self, name: str, **fields: object) -> AbstractContextManager[JsonDict]:
        """Record a begin/end span on this rank's events (a collective on ``group=...`` is watched as one)."""
        ...

    def instant(self, name: str, **fields: object) -> None:
        """Record one instant event."""
        ...

    def count_op(self, group: str) -> None:
        """Count one collective issued on ``group`` (the ranks compare these counts at phase boundaries)."""
        ...


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

    def setup(self, ctx: StepContext) -> None:
        """Build the model and optimizer. Collective on the default group for the built-in kinds: every rank
        calls it once, after init and warmup."""
        ...

    def step(self, ctx: StepContext, step: int) -> dict[str, float]:
        """Run train step ``step`` (1-based) and return its metrics (``loss`` at least). Collective on every
        group the model uses (data-parallel gradient reduction, expert all-to-all ...): every rank calls it
        for the same steps, in the same order."""
        ...

    def begin_save(self, ctx: StepContext, ckpt_dir: Path) -> SaveHandle:
        """Start saving the state of step ``ctx.step`` into ``ckpt_dir`` (a ``.tmp`` folder the phase commits
        later). Every rank calls it at the same step boundary; collectives here (planning) happen before any
        write, on the default group for the built-in kinds."""
        ...

    def load(self, ctx: StepContext, ckpt_dir: Path) -> int:
        """Restore the state saved in ``ckpt_dir`` and return its step. Every rank calls it (collective on the
        default group for the megatron kind); raise on a missing or unreadable file."""
        ...

    def close(self) -> None:
        """Release the model; local, safe twice."""
        ...
