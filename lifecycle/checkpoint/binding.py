"""What a committed checkpoint is bound to: the step it holds and the layout it was written with.

Both are recorded in the folder's ``manifest.json`` at commit (format 3) and checked at resume before anything is
loaded: a folder whose manifest names another step holds another save's files (damage, see
:func:`lifecycle.checkpoint.ckptdir.problem`), and a checkpoint written at another world size or parallel layout is
**not** damage — the step handler either loads it resharded (:meth:`reshard` on the handler says whether it can) or
the resume is refused with exit 2 naming the change. Nothing is ever set aside for a layout change.

Pure Python: no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lifecycle.jsontypes import JsonDict
from lifecycle.policy.base import MAX_STEP

__all__ = ["MAX_STEP", "changes", "describe", "layout", "options"]

if TYPE_CHECKING:
    from lifecycle.policy.schema import Policy

LAYOUT_KEYS = ("world_size", "tp", "pp", "cp", "ep", "etp", "vpp", "dp", "dist_opt_instances")
"""The numbers of a layout; ``kind`` (the train kind, or ``own_loop``) is compared too."""
MODEL_PARALLEL = ("tp", "pp", "cp", "ep", "etp", "vpp")
"""What splits a model's tensors or layers; ``dp`` and ``world_size`` only replicate (or shard optimizer state)."""


def layout(policy: Policy, world_size: int, *, own_loop: bool = False) -> JsonDict:
    """The layout a rank of this run writes and loads with (every rank computes the same)."""
    par = policy.parallelism
    split = par.tp * par.pp * par.cp
    return {"world_size": world_size, "tp": par.tp, "pp": par.pp, "cp": par.cp, "ep": par.ep,
            "etp": par.expert_tp, "vpp": par.vpp, "dp": world_size // split if split else None,
            "dist_opt_instances": par.dist_opt_instances, "kind": "own_loop" if own_loop else policy.train.kind}


def options(policy: Policy, *, own_loop: bool = False) -> JsonDict | None:
    """The train kind's options a checkpoint is written with (None in a trainer's own loop: lifecycle does not
    build that model)."""
    if own_loop:
        return None
    opts = policy.train.options
    dumped = opts.model_dump(mode="json") if hasattr(opts, "model_dump") else None
    return dumped if isinstance(dumped, dict) else None


def option_changes(saved: JsonDict | None, now: JsonDict | None) -> list[str]:
    """``['train.options.hidden 64 -> 128']``: the options that differ (none when either side records none)."""
    if not isinstance(saved, dict) or not isinstance(now, dict):
        return []
    return [f"train.options.{k} {_shown(saved.get(k))} -> {_shown(now.get(k))}" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)]


def changes(saved: JsonDict, now: JsonDict) -> list[str]:
    """``['world_size 2 -> 4', 'dp 2 -> 4']``: what differs between the layout a checkpoint was written with and
    this run's (keys the checkpoint does not record are not compared)."""
    out = []
    for key in (*LAYOUT_KEYS, "kind"):
        if key in saved and saved.get(key) != now.get(key):
            out.append(f"{key} {_shown(saved.get(key))} -> {_shown(now.get(key))}")
    return out


def changed_keys(saved: JsonDict, now: JsonDict) -> set[str]:
    return {key for key in (*LAYOUT_KEYS, "kind") if key in saved and saved.get(key) != now.get(key)}


def _shown(value: object) -> str:
    return "unset" if value is None else str(value)


def describe(layout_: JsonDict) -> str:
    """``world size 4 (tp=1 pp=1 cp=1 ep=2 dp=4)`` for messages."""
    parts = " ".join(f"{k}={layout_.get(k)}" for k in ("tp", "pp", "cp", "ep", "dp") if k in layout_)
    return f"world size {layout_.get('world_size')} ({parts})"


def per_rank_files(saved: JsonDict, now: JsonDict) -> str | None:
    """The rule of per-rank files each rank loads its own of (a trainer's plain torch modules): only at the same
    world size."""
    if saved.get("world_size") != now.get("world_size"):
        return (f"its per-rank files (rank_<R>.pt) were written by {saved.get('world_size')} ranks and each rank "
                f"loads its own")
    return None


def dp_replicas(saved: JsonDict, now: JsonDict) -> str | None:
    """The rule of a model replicated on every rank (the synthetic kind): any layout loads (a replica each)."""
    return None


def torch_dist(saved: JsonDict, now: JsonDict, *, distributed_optimizer: bool) -> str | None:
    """The rule of megatron-core's torch_dist checkpoints. The model's tensors are saved with their global shape
    and offsets, so they load at another tensor, expert or data-parallel size (measured: ep 2 -> 4, tp 1 -> 2,
    dp 2 -> 4 load with matching losses). The distributed optimizer's state (``dp_reshardable``) loads at another
    data-parallel size only. A change of pipeline or virtual-pipeline stages, of context parallelism or of
    distributed-optimizer instances is not resharded here."""
    moved = changed_keys(saved, now)
    fixed = moved & {"pp", "vpp", "cp", "dist_opt_instances"}
    if fixed:
        return f"{', '.join(sorted(fixed))} changed, which this kind's torch_dist checkpoints are not resharded across"
    if distributed_optimizer and moved & {"tp", "ep", "etp"}:
        return ("the distributed optimizer's state (dp_reshardable) loads at another data-parallel size only, with "
                "the same tp/ep/etp")
    return None
