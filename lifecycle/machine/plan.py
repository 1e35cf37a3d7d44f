"""Policy -> the ordered actions of every phase.

The plan is pure data, identical on every rank for the same policy and layout, and printable by
``lifecycle explain`` without torch. The orchestrator executes it in this order on every rank, so
collectives are issued in the same sequence everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from lifecycle.distributed.names import GROUP_NAMES
from lifecycle.jsontypes import JsonDict
from lifecycle.policy.schema import Policy


@dataclass(frozen=True)
class Action:
    """One step of a phase: an op on a group with a deadline."""

    op: str
    group: str | None = None
    deadline_s: float | None = None
    detail: str = ""
    names: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()

    def as_dict(self) -> JsonDict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()
                if v not in (None, "", ())}


@dataclass(frozen=True)
class WarmTarget:
    """A distinct communicator to warm, with every symbolic name it answers to."""

    names: tuple[str, ...]
    ranks: tuple[int, ...] = ()


class GroupView(Protocol):
    """Which requested groups exist for this rank, de-duplicated by communicator, in a fixed order."""

    def warm_targets(self, requested: Sequence[str]) -> list[WarmTarget]: ...


@dataclass
class Plan:
    phases: dict[str, list[Action]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, list[JsonDict]]:
        return {phase: [a.as_dict() for a in actions] for phase, actions in self.phases.items()}


def requested_groups(policy: Policy) -> list[str]:
    """The warmup group names in the canonical order (that order is the same on every rank)."""
    groups = policy.warmup.groups
    wanted = list(GROUP_NAMES) if groups == "all" else list(groups)
    return [n for n in GROUP_NAMES if n in wanted]


def _barriers(policy: Policy, point: str, deadline: float) -> list[Action]:
    points = getattr(policy.barriers, point)
    return [Action(f"barrier:{point}", b.group, b.timeout_s or deadline, f"via {b.via}, if missing {b.if_missing}")
            for b in points]


def _init(policy: Policy) -> list[Action]:
    dl = policy.deadline("init")
    par = policy.parallelism
    layout = f"tp={par.tp} pp={par.pp} cp={par.cp} ep={par.ep} etp={par.expert_tp} vpp={par.vpp} " \
             f"dist_opt_instances={par.dist_opt_instances}"
    return [
        Action("init_process_group", "world", dl, f"backend={policy.distributed.backend}, env://"),
        Action("initialize_model_parallel", "world", dl, layout),
        Action("check_policy_hash", "world", dl, "all_gather of the resolved policy's sha256"),
        *_barriers(policy, "after_init", dl),
    ]


def _warmup(policy: Policy, view: GroupView | None) -> list[Action]:
    if not policy.warmup.enabled:
        return []
    dl = policy.warmup.deadline_s or policy.deadline("warmup")
    names = requested_groups(policy)
    targets = view.warm_targets(names) if view else [WarmTarget((n,)) for n in names]
    ops = policy.warmup.ops
    pairs = ([(t, op) for t in targets for op in ops] if policy.warmup.order == "group_major"
             else [(t, op) for op in ops for t in targets])
    actions = [Action(f"warm:{op}", t.names[0], dl, names=t.names, ranks=t.ranks) for t, op in pairs]
    return actions + _barriers(policy, "after_warmup", policy.deadline("warmup"))


def _deadline_text(policy: Policy, phase: str) -> str:
    """``600s``, or for an auto deadline ``auto after 20 steps: 4 x p99 over 200, in [5s, 600s]``."""
    static = policy.deadline(phase)
    if not policy.is_auto(phase):
        return f"{static:g}s"
    a = policy.watchdog.adaptive
    return (f"auto after {a.calibration_steps} {'steps' if phase == 'train' else 'checkpoint spans'}: "
            f"{a.factor:g} x p{a.quantile * 100:g} over the last {a.window}, in [{a.floor_s:g}s, {static:g}s], "
            f"max over ranks; {static:g}s until then")


def _train(policy: Policy) -> list[Action]:
    if policy.train.steps == 0:
        return []
    ck, dl = policy.checkpoint, policy.deadline("train")
    actions = []
    if ck.resume != "never":
        actions.append(Action("resume", "world", policy.deadline("checkpoint"), f"resume={ck.resume}"))
    actions.append(Action("steps", "world", dl, f"{policy.train.kind} x {policy.train.steps}, "
                                                f"deadline {_deadline_text(policy, 'train')} per step"))
    every = policy.barriers.every_n_steps
    if every is not None:
        actions.append(Action(f"barrier:every_{every.n}_steps", every.group, every.timeout_s or dl))
    auto = policy.is_auto("train") or policy.is_auto("checkpoint")
    if ck.on_signal or auto:
        carries = " and ".join(w for w in ("the preemption flag" if ck.on_signal else "",
                                           "the auto deadlines" if auto else "") if w)
        cadence = "every step" if ck.signal_check_every == 1 else f"every {ck.signal_check_every} steps"
        how = ("issued at a step's end, read at the next one's (overlapped; save steps and the last step at once)"
               if ck.signal_overlap else "read at once")
        actions.append(Action("stop_flag", "world", dl, f"max all-reduce of {carries}, {cadence}, {how}"))
    if policy.moe.zero_token.action != "off":
        actions.append(Action("zero_token_guard", "ep", None, policy.moe.zero_token.action))
    return actions


def _checkpoint(policy: Policy) -> list[Action]:
    ck = policy.checkpoint
    if policy.train.steps == 0 or not (ck.every_steps or ck.at_end or ck.on_signal):
        return []
    dl = policy.deadline("checkpoint")
    when = [f"every {ck.every_steps} steps" if ck.every_steps else "", "at end" if ck.at_end else "",
            f"on {'/'.join(ck.signals)}" if ck.on_signal else ""]
    return [
        *_barriers(policy, "before_checkpoint", dl),
        Action("save", "world", dl, f"deadline {_deadline_text(policy, 'checkpoint')}; "
               f"torch_dist, {'async' if ck.async_ else 'sync'}, "
               f"{'fully parallel' if ck.fully_parallel else 'plain'}; {', '.join(w for w in when if w)}"),
        Action("commit", None, dl, f"agree over the {ck.coordination}; rename .tmp -> iter_N, tracker, "
               f"keep_last={ck.keep_last}"),
        *_barriers(policy, "after_checkpoint", dl),
    ]


def _teardown(policy: Policy) -> list[Action]:
    dl = policy.deadline("teardown")
    actions = []
    for step in policy.teardown.success:
        if step == "barrier":
            actions.extend(_barriers(policy, "before_teardown", dl))
        else:
            actions.append(Action(step, None, dl))
    actions.append(Action("hard_deadline", None, policy.teardown.deadline_s,
                          f"os._exit({policy.teardown.exit_codes.teardown_deadline}) when passed; "
                          f"failure path: {policy.teardown.failure}"))
    return actions


def build_plan(policy: Policy, view: GroupView | None = None) -> Plan:
    """The ordered actions of every phase; ``view`` expands warmup groups for one rank's layout."""
    return Plan({
        "init": _init(policy),
        "warmup": _warmup(policy, view),
        "train": _train(policy),
        "checkpoint": _checkpoint(policy),
        "teardown": _teardown(policy),
    })
