"""Policy -> the ordered actions of every phase, as each phase states them (its ``plan`` beside its ``run``).

The plan is pure data, identical on every rank for the same policy and layout, and printable by
``lifecycle explain`` without torch. Each phase issues its collectives in this order on every rank (warmup
executes its plan directly); a test holds a real run's events against it, action by action.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lifecycle.jsontypes import JsonDict
from lifecycle.phases.base import Action, GroupView, WarmTarget
from lifecycle.policy.schema import Policy

__all__ = ["Action", "Plan", "WarmTarget", "build_plan"]


@dataclass
class Plan:
    phases: dict[str, list[Action]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, list[JsonDict]]:
        return {phase: [a.as_dict() for a in actions] for phase, actions in self.phases.items()}


def build_plan(policy: Policy, view: GroupView | None = None) -> Plan:
    """The ordered actions of every phase; ``view`` expands warmup groups for one rank's layout."""
    from lifecycle.phases import checkpoint
    from lifecycle.phases.init import InitPhase
    from lifecycle.phases.teardown import TeardownPhase
    from lifecycle.phases.train import TrainPhase
    from lifecycle.phases.warmup import WarmupPhase

    return Plan({
        "init": InitPhase.plan(policy, view),
        "warmup": WarmupPhase.plan(policy, view),
        "train": TrainPhase.plan(policy, view),
        "checkpoint": checkpoint.plan(policy, view),
        "teardown": TeardownPhase.plan(policy, view),
    })
