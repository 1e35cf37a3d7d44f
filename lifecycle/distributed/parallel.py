"""The narrow interface between lifecycle and a model-parallel backend (Megatron's ``parallel_state``).

``distributed/`` and ``phases/`` depend on :class:`ParallelState` only; ``lifecycle/backends/megatron``
implements it, and the worker picks the implementation. :class:`WorldOnly` is the trivial one (every
symbolic name but ``world`` is absent): for runs without model parallelism and for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lifecycle.policy.sections import ParallelismConfig


class ParallelState(Protocol):
    """Create, look up and destroy the model-parallel groups of this process."""

    def load(self) -> None:
        """Import the backend (seconds on a cold start: init does it before the rendezvous). Local."""
        ...

    def initialize(self, par: ParallelismConfig, timeout_s: float) -> None:
        """Create every group of the layout. Collective on the default group: every rank calls it."""
        ...

    def is_initialized(self) -> bool:
        """Whether the groups exist in this process. Local."""
        ...

    def get_group(self, name: str) -> ProcessGroup | None:
        """This rank's process group for the symbolic ``name`` (``world`` is the default group), or None
        when this rank has none. Local, no collective, never imports a heavy module on the way."""
        ...

    def destroy(self) -> None:
        """Forget the groups; safe twice and uninitialized. Local, no collective."""
        ...


class WorldOnly:
    """A ParallelState with no model parallelism: ``world`` is the only group."""

    def load(self) -> None:
        return None

    def initialize(self, par: ParallelismConfig, timeout_s: float) -> None:
        return None

    def is_initialized(self) -> bool:
        return True

    def get_group(self, name: str) -> ProcessGroup | None:
        import torch.distributed as dist

        return dist.group.WORLD if name == "world" and dist.is_initialized() else None

    def destroy(self) -> None:
        return None
