"""The messages a job will send on each group, by size: what ``warmup.sizes: [.., job]`` warms so that every
algorithm and protocol path a communicator needs is connected before step 1 (NCCL picks them by message size).

Pure Python, from the policy alone (``explain`` shows them; no model is built): per kind, the gradient bucket of the
data-parallel reduction (all-reduce, and the parameter all-gather of the distributed optimizer), the expert
gradients over expert-dp, one activation between pipeline stages and on the tensor-parallel all-reduce, the token
dispatcher's all-to-all over ep. Sizes in bytes of fp32 (4 bytes an element: the CPU kinds' dtype, and megatron's
``grad_reduce_in_fp32``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lifecycle.policy import installed
from lifecycle.policy.groupnames import GROUP_NAMES

if TYPE_CHECKING:
    from lifecycle.policy.schema import Policy

FP32 = 4
BUCKET_FLOOR = 40_000_000
"""megatron-core DDP's bucket size floor in elements (``max(40M, 1M x dp size)`` when buckets are used): the
estimate takes the floor."""


@dataclass(frozen=True)
class Message:
    group: str
    """The symbolic group the job sends it on."""
    op: str
    """all_reduce, all_gather, all_to_all or p2p."""
    nbytes: int
    what: str


def job_messages(policy: Policy) -> list[Message]:
    """The job's messages by group (largest per group and op), for the policy's train kind."""
    kind, o = policy.train.kind, policy.train.options
    if policy.train.steps == 0 or o is None:
        return []
    if kind == "synthetic":
        h = int(getattr(o, "hidden", 32))
        grads = h * h + h + h + 1  # Linear(h, h) + Linear(h, 1), one flat bucket
        return [Message("dp", "all_reduce", grads * FP32, "gradient all-reduce (one bucket)")]
    if kind != "megatron_gpt":
        return []
    return _megatron(policy)


def _megatron(policy: Policy) -> list[Message]:
    o, par = policy.train.options, policy.parallelism
    h, ffn, layers = int(o.hidden), int(o.ffn_hidden), int(o.num_layers)
    vocab, seq, mb = int(o.vocab), int(o.seq_len), int(o.micro_batch)
    experts, topk = int(o.num_experts), int(o.topk)
    tp, pp, ep, cp, etp = par.tp, par.pp, par.ep, par.cp, par.expert_tp
    per_stage = max(layers // pp, 1)
    # Dense parameters of one rank: embedding (first stage; the output layer shares it), attention (QKV + proj),
    # layer norms, and the dense MLP when the model has no experts (+ the router when it has).
    attention = 4 * h * h // tp + 4 * h
    dense_mlp = 2 * h * ffn // tp + ffn // tp + h if experts == 0 else h * experts
    dense = vocab * h // tp + per_stage * (attention + dense_mlp + 4 * h)
    bucket = min(dense, BUCKET_FLOOR)  # one bucket unless the model is larger than megatron's bucket
    out = [Message("dp_cp", "all_reduce", bucket * FP32, "dense gradient bucket (DDP)")]
    if getattr(o, "use_distributed_optimizer", False):
        out.append(Message("dp_cp", "all_gather", bucket * FP32, "updated parameters (distributed optimizer)"))
    if experts:
        local = max(experts // ep, 1) * per_stage * (2 * h * ffn // etp)
        out.append(Message("edp", "all_reduce", min(local, BUCKET_FLOOR) * FP32, "expert gradient bucket"))
        tokens = mb * seq // cp // tp
        out.append(Message("ep", "all_to_all", max(tokens * topk * h * FP32, FP32 * ep), "token dispatch"))
    activation = mb * (seq // cp) * h * FP32
    if pp > 1:
        out.append(Message("pp", "p2p", activation, "one activation between stages"))
    if tp > 1:
        out.append(Message("tp", "all_reduce", activation, "tensor-parallel activation all-reduce"))
    return out


def used_groups(policy: Policy, world_size: int | None = None, *, own_loop: bool = False) -> list[str] | None:
    """The groups the job's collectives use (``warmup.groups: used``), or None when the train kind's are not known
    (a trainer's own loop, a plugin kind: warm them all). Always ``world`` (lifecycle's stop flag, barriers and
    checkpoints) and ``dp`` (the reported loss). For ``megatron_gpt`` the rules below match what the first step of
    a real run used (``groups_used`` events; tests/distributed/test_groups_used.py holds them against it): the
    tensor-parallel layers' all-reduce (on ``tp`` even at size 1), the dense gradients on ``dp_cp`` and their norm
    on ``mp`` — with the distributed optimizer the instance's ``intra_dp_cp`` and ``intra_dist_opt`` (and
    ``inter_dist_opt`` between instances) —, ``pp`` between stages, ``tp_cp``/``cp`` when larger than one, and the
    experts' ``ep`` all-to-all, ``tp_ep`` permutation gather, ``etp``, their gradients on ``edp`` (``intra_edp``
    with the distributed optimizer) and norm on ``tp_ep_pp`` (``tp_ep_pp_egtp`` from megatron-core 0.19). ``world_size`` (when known) drops an expert-dp group
    of one rank, which megatron never reduces over."""
    kind, o = policy.train.kind, policy.train.options
    if own_loop:
        return None  # lifecycle.attach(): the trainer's collectives, not the kind's
    if kind == "synthetic":
        return ["world", "dp"]  # GROUP_NAMES order
    if kind != "megatron_gpt" or o is None:
        return None
    par = policy.parallelism
    used = {"world", "dp", "tp"}
    dist_opt = bool(getattr(o, "use_distributed_optimizer", False))
    if dist_opt:
        used |= {"intra_dp_cp", "intra_dist_opt"} | ({"inter_dist_opt"} if par.dist_opt_instances > 1 else set())
    else:
        used |= {"dp_cp", "mp"}
    if par.pp > 1:
        used.add("pp")
    if par.tp * par.cp > 1:
        used.add("tp_cp")
    if par.cp > 1:
        used.add("cp")
    if int(o.num_experts):
        used.add("tp_ep")
        if par.ep > 1:
            used.add("ep")
        if par.expert_tp > 1:
            used.add("etp")
        edp = world_size // (par.expert_tp * par.ep * par.pp) if world_size else None
        if edp is None or edp > 1:
            used.add("intra_edp" if dist_opt else "edp")
        if par.ep > 1 and not dist_opt:  # megatron-core 0.19+ takes its own copy of the group for it
            used.add("tp_ep_pp_egtp" if installed.gtp_groups() else "tp_ep_pp")
    return [n for n in GROUP_NAMES if n in used]


def requested_groups(policy: Policy, world_size: int | None = None, *, own_loop: bool = False) -> list[str]:
    """The warmup group names in the canonical order (that order is the same on every rank). ``used``: the groups
    the job's collectives use (:func:`used_groups`; all when the train kind's are not known, and in a trainer's own
    loop: ``own_loop``)."""
    groups = policy.warmup.groups
    if groups == "used":
        wanted = used_groups(policy, world_size, own_loop=own_loop) or list(GROUP_NAMES)
    else:
        wanted = list(GROUP_NAMES) if groups == "all" else list(groups)
    return [n for n in GROUP_NAMES if n in wanted]
