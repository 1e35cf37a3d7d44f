"""The zero_tokens drill: which ranks are starved at which step, and where it fires (pure, no processes)."""

from __future__ import annotations

import logging

import pytest

from lifecycle.distributed.faults import Drills, starved_ranks, zero_token_drills
from lifecycle.policy.schema import FaultDrill


def _drill(**kw: object) -> FaultDrill:
    return FaultDrill.model_validate({"at": "train", "action": "zero_tokens", **kw})


def test_from_a_step_on_or_at_listed_steps() -> None:
    faults = [_drill(ranks=[1], step=3), _drill(ranks=[2, 5], steps=[2, 4]),
              FaultDrill.model_validate({"at": "train", "ranks": [0], "action": "crash", "step": 2})]
    assert [starved_ranks(faults, s) for s in range(1, 6)] == [[], [2, 5], [1], [1, 2, 5], [1]]
    assert len(zero_token_drills(faults)) == 2


def test_fires_once_on_its_ranks_at_its_first_step_and_never_asks_to_skip(caplog: pytest.LogCaptureFixture) -> None:
    fired: list[FaultDrill] = []
    faults = [_drill(ranks=[1], steps=[4, 6])]
    assert not Drills(faults, 0, on_fire=fired.append).fire("train", step=4)
    drills = Drills(faults, 1, on_fire=fired.append)
    with caplog.at_level(logging.WARNING):
        assert [drills.fire("train", step=s) for s in (3, 4, 5, 6)] == [False] * 4
    assert fired == faults
    assert "FAULT DRILL: zero_tokens on rank 1 at phase train step 4" in caplog.text


@pytest.mark.parametrize("kw,match", [
    ({"at": "warmup", "step": None, "steps": [2]}, "zero_tokens drill is at: train"),
    ({"step": None}, "with either step"),
    ({"step": 2, "steps": [3]}, "with either step"),
    ({"action": "crash", "step": None, "steps": [3]}, "steps applies to zero_tokens drills only"),
    ({"action": "hold_memory", "step": None, "steps": None}, "hold_memory drill is at: warmup, with mib"),
    ({"at": "warmup", "action": "hold_memory", "step": None, "steps": None}, "hold_memory drill is at: warmup"),
    ({"action": "crash", "step": 2, "steps": None, "mib": 4}, "mib applies to hold_memory drills only"),
])
def test_bad_drills_name_the_rule(kw: dict[str, object], match: str) -> None:
    data = {"at": "train", "ranks": [1], "action": "zero_tokens", "step": 3, **kw}
    with pytest.raises(ValueError, match=match):
        FaultDrill.model_validate(data)
