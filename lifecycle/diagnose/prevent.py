"""What the verdict means for a policy: the dimension of the group, and the lifecycle keys that would have warmed,
caught or bounded the failure.

The dimension comes from the group's description (Megatron names every group: TENSOR_MODEL_PARALLEL_GROUP is tp,
EXPERT_MODEL_PARALLEL_GROUP ep ...; a plain job's own descriptions "tp", "dp" ... count too) or, given a policy
and a world size, from ``explain``'s layout: the layout group with exactly the group's ranks. Pure Python.
"""

from __future__ import annotations

from lifecycle.jsontypes import JsonDict

MEGATRON = (  # most specific first
    ("EXPERT_TENSOR_AND_MODEL", "tp_ep"), ("PIPELINE_PARALLEL_GROUP_WITH_EGTP", "tp_ep_pp_egtp"),
    ("EXPERT_TENSOR_MODEL_PIPELINE", "tp_ep_pp"),
    ("INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "intra_dp_cp"), ("EXPERT_DATA_PARALLEL", "edp"),
    ("EXPERT_TENSOR_PARALLEL", "etp"), ("EXPERT_MODEL_PARALLEL", "ep"),
    ("TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "tp_dp_cp"), ("TENSOR_AND_DATA_PARALLEL", "tp_dp"),
    ("TENSOR_AND_CONTEXT_PARALLEL", "tp_cp"), ("TENSOR_MODEL_PARALLEL", "tp"), ("PIPELINE_MODEL_PARALLEL", "pp"),
    ("DATA_PARALLEL_GROUP_WITH_CP", "dp_cp"), ("DATA_PARALLEL", "dp"), ("CONTEXT_PARALLEL", "cp"),
    ("POSITION_EMBEDDING", "pos_embd"), ("EMBEDDING", "embd"), ("INTRA_DISTRIBUTED_OPTIMIZER", "intra_dist_opt"),
    ("MODEL_PARALLEL", "mp"), ("default_pg", "world"),
)
PLAIN = {"tp", "pp", "dp", "cp", "ep", "etp", "edp", "world", "mp", "dp_cp", "expert", "tensor", "pipeline", "data"}
PLAIN_ALIAS = {"expert": "ep", "tensor": "tp", "pipeline": "pp", "data": "dp"}
EXPERT = {"ep", "edp", "etp", "tp_ep", "tp_ep_pp", "tp_ep_pp_egtp"}


def dimension(desc: str | None, ranks: list[int] | None, layout: dict[str, list[list[int]]] | None) -> str | None:
    """tp / pp / dp / ep / cp / ... for a group, or None when nothing maps it."""
    if desc:
        for key, dim in MEGATRON:
            if key in desc:
                return dim
        if desc.lower() in PLAIN:
            return PLAIN_ALIAS.get(desc.lower(), desc.lower())
    if layout and ranks:
        for name, groups in layout.items():
            if sorted(ranks) in groups:
                return name
    return None


def _key(key: str, value: str, why: str) -> JsonDict:
    return {"key": key, "value": value, "why": why}


def keys(cause: str | None, stage: str | None, dim: str | None) -> list[JsonDict]:
    """The policy keys (and values) that would have warmed, caught or bounded a failure of this kind."""
    out: list[JsonDict] = []
    if cause == "rendezvous" or stage == "init":
        out += [_key("watchdog.deadlines.init", "120", "bounds init and the rendezvous; the rank that never came "
                     "is named on every rank"),
                _key("barriers.after_init", "[{group: world}]", "every rank meets right after init: a missing rank "
                     "fails there, named, before any training collective")]
    if stage in ("warmup", "first step"):
        out += [_key("warmup.groups", "all", "creates and exercises every group before step 1: a rank that cannot "
                     "join one fails in warmup, named, not inside the first step"),
                _key("watchdog.deadlines.warmup", "60", "bounds warmup's collectives")]
    if stage in ("train", "first step") and cause in ("never entered", "entered, not finished", "diverged"):
        out += [_key("watchdog.deadlines.step", "auto", "a step that takes far longer than the steps before it is "
                     "reported in seconds, naming the rank that did not arrive"),
                _key("watchdog.heartbeat_stale_s", "30", "a frozen rank is named as soon as its heartbeat stops")]
    if dim in EXPERT and cause in ("never entered", "diverged"):
        out.append(_key("moe.zero_token.action", "dummy_forward", "a rank whose experts received no tokens still "
                        "runs their collectives, so the expert groups stay in step"))
    if cause == "diverged":
        out.append(_key("watchdog.sequence_check", "true", "the ranks compare their per-group collective counts "
                        "at every phase change and fail naming the ranks whose counts differ"))
    if stage == "checkpoint":
        out += [_key("checkpoint.coordination", "store", "the ranks agree that a save is complete off the default "
                     "group, so no rank sits in an all_reduce while another still writes"),
                _key("watchdog.deadlines.checkpoint", "auto", "bounds one save and its commit")]
    if stage == "exit":
        out += [_key("teardown.success", "[barrier, finalize_async, destroy_model_parallel, destroy_subgroups, "
                     "destroy_process_group]", "groups are torn down in one agreed order"),
                _key("teardown.deadline_s", "60", "an exit that hangs ends by force with its own exit code")]
    if cause == "crashed":
        out += [_key("watchdog.enabled", "true", "every rank learns at once which rank failed and leaves with "
                     "exit code 4, instead of waiting for a collective timeout"),
                _key("restart.max_restarts", "3", "the job restarts from its last committed checkpoint")]
    if cause in ("network link", "entered, not finished"):
        out += [_key("watchdog.heartbeat_stale_s", "30", "a rank cut off from the others is named when its heartbeat "
                     "stops"), _key("restart.max_restarts", "3", "the job restarts from its last committed checkpoint")]
    unique: dict[str, JsonDict] = {}
    for k in out:
        unique.setdefault(k["key"], k)
    return list(unique.values())
