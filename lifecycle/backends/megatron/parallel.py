"""Megatron-Core ``parallel_state``: create, look up and destroy the model-parallel groups.

The only module of lifecycle that calls ``megatron.core.parallel_state``. Getters differ between
megatron-core versions (renamed, new keyword arguments) and several *assert* instead of returning None
when the calling rank has no such group (the inter distributed-optimizer group unless instances > 1,
the position-embedding group off the first pipeline stage, the embedding group on middle stages, the
gloo twins when they were not created). :func:`get_group` turns all of those into None.
"""

from __future__ import annotations

import inspect
import logging
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lifecycle.distributed.layout import DEFAULT_ORDER, build_layout, check_name
from lifecycle.errors import PhaseError, UsageError
from lifecycle.policy import installed
from lifecycle.policy.groupnames import GROUP_NAMES

if TYPE_CHECKING:
    from lifecycle.policy.sections import ParallelismConfig

logger = logging.getLogger(__name__)

# name -> getters to try in turn: (function name, keyword arguments). Later entries are older APIs.
_GETTERS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "dp": [("get_data_parallel_group", {})],
    "dp_cp": [("get_data_parallel_group", {"with_context_parallel": True})],
    "tp": [("get_tensor_model_parallel_group", {})],
    "pp": [("get_pipeline_model_parallel_group", {})],
    "cp": [("get_context_parallel_group", {})],
    "mp": [("get_model_parallel_group", {})],
    "tp_cp": [("get_tensor_and_context_parallel_group", {})],
    "tp_dp": [("get_tensor_and_data_parallel_group", {})],
    "tp_dp_cp": [("get_tensor_and_data_parallel_group", {"with_context_parallel": True})],
    "embd": [("get_embedding_group", {})],
    "pos_embd": [("get_position_embedding_group", {})],
    "ep": [("get_expert_model_parallel_group", {})],
    "etp": [("get_expert_tensor_parallel_group", {})],
    "edp": [("get_expert_data_parallel_group", {}), ("get_data_modulo_expert_parallel_group", {})],
    "tp_ep": [("get_expert_tensor_and_model_parallel_group", {}),
              ("get_tensor_and_expert_parallel_group", {})],
    "tp_ep_pp": [("get_expert_tensor_model_pipeline_parallel_group", {})],
    "tp_ep_pp_egtp": [("get_expert_tensor_model_pipeline_parallel_group", {"with_egtp_remat": True})],  # 0.19+
    "intra_edp": [("get_expert_data_parallel_group", {"partial_expert_data_parallel": True})],
    "intra_dist_opt": [("get_intra_distributed_optimizer_instance_group", {})],
    "inter_dist_opt": [("get_inter_distributed_optimizer_instance_group", {})],
    "intra_dp_cp": [("get_data_parallel_group", {"with_context_parallel": True, "partial_data_parallel": True})],
    "dp_gloo": [("get_data_parallel_group_gloo", {})],
    "dp_cp_gloo": [("get_data_parallel_group_gloo", {"with_context_parallel": True})],
    "edp_gloo": [("get_expert_data_parallel_group_gloo", {})],
}
assert set(_GETTERS) | {"world"} == set(GROUP_NAMES), "every symbolic group name needs a getter"

_NEUTRAL: dict[str, tuple[object, ...]] = {
    "virtual_pipeline_model_parallel_size": (None,), "context_parallel_size": (1,),
    "expert_model_parallel_size": (1,), "num_distributed_optimizer_instances": (1,),
    "order": (DEFAULT_ORDER,),
}


def _ps() -> ModuleType:
    # Imported on first use: megatron.core takes seconds to import.
    try:
        from megatron.core import parallel_state
    except (AssertionError, AttributeError) as exc:  # 0.18+ refuse an old nvidia-resiliency-ext at import
        why = installed.nvrx_conflict()
        if why is None:
            raise
        raise UsageError(why) from exc
    return parallel_state


def initialize(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None,
               vpp: int | None = None, dist_opt_instances: int = 1, timeout_s: float = 1800.0,
               *, order: str = DEFAULT_ORDER) -> None:
    """Create every model-parallel group with ``parallel_state.initialize_model_parallel``.

    All ranks of the default group must call it, with the same arguments (it creates groups with
    ``new_group``, a collective on the default group). The sizes are checked first with
    :func:`lifecycle.distributed.layout.build_layout`, so a bad layout is a UsageError, not an assertion.
    """
    if not dist.is_initialized():
        raise UsageError("initialize the default process group before the model-parallel groups")
    if is_initialized():
        raise PhaseError("megatron parallel_state is already initialized; call destroy() first")
    if vpp is not None and pp <= 1:
        raise UsageError(f"virtual pipeline size {vpp} needs pp > 1 (got pp={pp})")
    build_layout(dist.get_world_size(), tp, pp, cp, ep, etp, dist_opt_instances, order)
    wanted: dict[str, Any] = {
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp, "context_parallel_size": cp,
        "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp,
        "num_distributed_optimizer_instances": dist_opt_instances,
        # Megatron only feeds this to timedelta(minutes=...), which takes a float.
        "distributed_timeout_minutes": timeout_s / 60.0, "order": order,
    }
    fn = _ps().initialize_model_parallel
    accepted = inspect.signature(fn).parameters
    # An older megatron-core may lack a keyword; that only matters if we needed a non-default value
    # (a missing timeout keyword just leaves torch's default).
    neutral = {**_NEUTRAL, "expert_tensor_parallel_size": (None, tp)}
    unsupported = {k: v for k, v in wanted.items()
                   if k not in accepted and k in neutral and v not in neutral[k]}
    if unsupported:
        raise UsageError(f"this megatron-core's initialize_model_parallel does not take {unsupported}")
    logger.info("initializing megatron parallel state: tp=%s pp=%s cp=%s ep=%s etp=%s vpp=%s "
                "instances=%s", tp, pp, cp, ep, etp, vpp, dist_opt_instances)
    fn(**{k: v for k, v in wanted.items() if k in accepted})


def is_initialized() -> bool:
    """Whether megatron's model-parallel groups exist in this process."""
    try:
        return bool(_ps().model_parallel_is_initialized())
    except ImportError:
        return False


def destroy() -> None:
    """Forget megatron's groups (``destroy_model_parallel``); safe to call twice or uninitialized.

    Local only, no collective. Megatron destroys just its gloo groups here; the other communicators
    stay alive until ``torch.distributed.destroy_process_group()``.
    """
    try:
        ps = _ps()
    except ImportError:
        return
    ps.destroy_model_parallel()


def get_group(name: str) -> Any | None:
    """The ProcessGroup this rank has for the symbolic ``name``, or None when it has none.

    ``world`` is the default group. Local only, no collective.
    """
    check_name(name)
    if not dist.is_initialized():
        return None
    if name == "world":
        return dist.group.WORLD
    try:
        ps = _ps()
    except ImportError:
        return None
    for fn_name, kwargs in _GETTERS[name]:
        fn = getattr(ps, fn_name, None)
        if fn is None:
            continue
        try:
            group = fn(**kwargs)
        except TypeError:  # an older signature without this keyword: try the next getter
            continue
        except (AssertionError, RuntimeError, KeyError):  # "not initialized" / not a member
            return None
        # A rank in several pipeline groups (custom embedding layouts) gets a list: no single answer.
        return group if isinstance(group, dist.ProcessGroup) else None
    return None


class MegatronParallel:
    """:class:`lifecycle.distributed.parallel.ParallelState` over megatron-core's ``parallel_state``."""

    def load(self) -> None:
        _ps()

    def initialize(self, par: ParallelismConfig, timeout_s: float) -> None:
        """Collective on the default group (see :func:`initialize`)."""
        if not is_initialized():
            initialize(par.tp, par.pp, par.cp, par.ep, par.etp, par.vpp, par.dist_opt_instances, timeout_s,
                       order=par.order)

    def is_initialized(self) -> bool:
        return "megatron.core" in sys.modules and is_initialized()

    def get_group(self, name: str) -> Any | None:
        # Never the first import of megatron (seconds; the watchdog's listener may call this mid-step).
        if name != "world" and "megatron.core" not in sys.modules:
            return None
        return get_group(name)

    def destroy(self) -> None:
        if "megatron.core" in sys.modules:
            destroy()


def live_layout() -> dict[str, int]:
    """The sizes of the groups megatron's ``parallel_state`` holds now, by the policy's ``parallelism`` keys
    (tp, pp, cp, ep, etp, vpp, dist_opt_instances). Local, no collective."""
    ps = _ps()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    try:
        part = ps.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True)
        instances = ps.get_data_parallel_world_size(with_context_parallel=True) // part if part else 1
    except (TypeError, AssertionError, RuntimeError):  # an older signature
        instances = 1
    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "etp": ps.get_expert_tensor_parallel_world_size(), "vpp": int(vpp) if vpp else 1,
            "dist_opt_instances": instances}
