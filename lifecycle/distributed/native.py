"""The model-parallel groups made with ``torch.distributed`` alone, from lifecycle's own layout.

:class:`NativeParallel` implements :class:`lifecycle.distributed.parallel.ParallelState` without megatron-core:
it creates every group of :func:`lifecycle.distributed.layout.build_layout` (the same ranks, by the same rules,
as megatron-core's ``initialize_model_parallel``: ``tests/distributed/test_layout_vs_megatron.py`` compares them
on live ranks) with ``new_group``. Kinds that train no megatron model (the built-in ``synthetic``) use it, so a
drill or a soak starts without importing megatron (seconds per rank).

Unlike megatron-core it creates one process group per distinct rank set (``tp`` and ``tp_cp`` with cp = 1 are one
object; a gloo twin is its group itself when the default backend is gloo): fewer communicators, the same
memberships for every name.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING

from lifecycle.distributed.layout import build_layout, check_name
from lifecycle.errors import PhaseError, UsageError
from lifecycle.policy.groupnames import GROUP_NAMES

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lifecycle.policy.sections import ParallelismConfig

log = logging.getLogger(__name__)
TWINS = ("dp_gloo", "dp_cp_gloo", "edp_gloo")


class NativeParallel:
    """ParallelState over ``torch.distributed.new_group`` and :mod:`lifecycle.distributed.layout`."""

    def __init__(self) -> None:
        self._mine: dict[str, ProcessGroup] | None = None

    def load(self) -> None:
        """Nothing to import beyond torch.distributed."""
        import torch.distributed  # noqa: F401

    def initialize(self, par: ParallelismConfig, timeout_s: float) -> None:
        """Create every group of the layout. Collective on the default group: every rank calls it, with the
        same policy, and creates every group in the same order (``new_group`` requires it)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise UsageError("initialize the default process group before the model-parallel groups")
        if self._mine is not None:
            raise PhaseError("the model-parallel groups already exist; call destroy() first")
        if par.vpp is not None and par.pp <= 1:
            raise UsageError(f"virtual pipeline size {par.vpp} needs pp > 1 (got pp={par.pp})")
        rank, world = dist.get_rank(), dist.get_world_size()
        layout = build_layout(world, par.tp, par.pp, par.cp, par.ep, par.etp, par.dist_opt_instances, par.order)
        default = str(dist.get_backend()).lower()
        timeout = datetime.timedelta(seconds=timeout_s)
        made: dict[tuple[str, tuple[int, ...]], ProcessGroup] = {}
        mine: dict[str, ProcessGroup] = {}
        for name in GROUP_NAMES:
            if name == "world":
                continue
            backend = "gloo" if name in TWINS and default != "gloo" else ""
            for ranks in layout.groups(name):
                key = (backend, tuple(ranks))
                if key not in made:
                    made[key] = dist.new_group(list(ranks), timeout=timeout, backend=backend or None)
                if rank in key[1]:
                    mine[name] = made[key]
        log.info("model-parallel groups (torch.distributed, no megatron): tp=%s pp=%s cp=%s ep=%s etp=%s "
                 "instances=%s order=%s, %d distinct groups", par.tp, par.pp, par.cp, par.ep, par.etp,
                 par.dist_opt_instances, par.order, len(made))
        self._mine = mine

    def is_initialized(self) -> bool:
        return self._mine is not None

    def get_group(self, name: str) -> ProcessGroup | None:
        """This rank's group for ``name`` (``world``: the default group), or None. Local, no collective."""
        import torch.distributed as dist

        check_name(name)
        if not dist.is_initialized():
            return None
        if name == "world":
            return dist.group.WORLD
        return None if self._mine is None else self._mine.get(name)

    def destroy(self) -> None:
        """Forget the groups (they live until ``destroy_process_group``, as megatron's non-gloo groups do).
        Local, no collective; safe twice."""
        self._mine = None
