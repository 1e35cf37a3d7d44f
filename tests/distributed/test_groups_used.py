"""`warmup.groups: used` against what the first step of a real run used, and what warming each communicator cost:
real Megatron GPT-MoE (and the synthetic kind) on gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.runs import FAST, SYNTHETIC, lifecycle_run

pytestmark = pytest.mark.distributed
ONE_STEP = ["train.steps=1", "checkpoint.every_steps=0", "checkpoint.at_end=false"]


def _names(labels: Any) -> set[str]:
    return {n for label in labels for n in label.split("=") if n != "..."}


@pytest.mark.megatron
@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", [
    ["parallelism.ep=2"],
    # the dense distributed optimizer reduces in its instance's dp_cp group (intra_dp_cp), not in dp_cp
    ["parallelism.ep=2", "parallelism.dist_opt_instances=2", "train.options.use_distributed_optimizer=true"],
], ids=["moe-ep2", "dist-opt-2-instances"])
def test_used_warms_exactly_the_groups_the_first_step_uses(tmp_path: Path, layout: list[str]) -> None:
    from lifecycle.distributed.messages import used_groups
    from lifecycle.policy.load import read_resolved

    run = lifecycle_run(tmp_path, 4, *FAST, *ONE_STEP, *layout, "warmup.groups=used")
    assert run.code == 0, run.output
    planned = set(used_groups(read_resolved(run.run_dir / "policy.resolved.yaml"), 4) or [])
    for rank, events in run.events().items():
        used = next(e for e in events if e["name"] == "groups_used")
        assert used["step"] == 1 and used["unwarmed"] == [], (rank, used)
        warmed = {e["group"] for e in events if e["name"].startswith("warm:") and e["kind"] == "end"}
        # every communicator the step used was warmed, and warmup warmed nothing else but the default group
        assert _names(used["groups"]) & planned <= _names(warmed), (rank, used["groups"], warmed)
        assert _names(warmed) - {"world"} <= _names(used["groups"]), (rank, used["groups"], warmed)
    summary = run.summary()
    assert summary["unwarmed_groups"] is None
    cost = summary["comm_memory"]
    assert cost["source"] == "rss" and cost["max_total_bytes"] > 0
    assert _names(cost["groups"]) == planned
    assert all(g["estimate_bytes"] is not None and g["measured_max_bytes"] >= 0 for g in cost["groups"].values())
    # the gloo model against what this machine measured: the same order of magnitude for the rank's total
    estimate = sum(int(g["estimate_bytes"]) for g in cost["groups"].values())
    assert 0.1 < cost["max_total_bytes"] / estimate < 10, (cost["max_total_bytes"], estimate)
    # the timeline's counter: the rank's communicator memory as each group is warmed
    assert any(e["name"] == "comm_memory_mib" and e["kind"] == "scalar" for e in run.events()[0])


@pytest.mark.timeout(120)
def test_a_group_the_step_used_unwarmed_is_named_and_one_past_the_budget_stops_warmup(tmp_path: Path) -> None:
    lone = lifecycle_run(tmp_path / "a", 2, *FAST, *SYNTHETIC, "train.steps=2", "checkpoint.every_steps=0",
                         "warmup.groups=[tp]")
    assert lone.code == 0, lone.output
    assert "step 1 used communicator(s) that warmup did not warm: dp=dp_cp=tp_dp=..." in lone.output, lone.output
    assert set(lone.summary()["unwarmed_groups"]) == {"0", "1"}
    # The estimate (a few hundred KiB here) passes the launcher's check; rank 1's dp communicator then takes 64 MiB
    # more (the drill), and warmup stops there, naming it, before any step.
    held = lifecycle_run(tmp_path / "b", 2, *FAST, *SYNTHETIC, "train.steps=2", "distributed.comm_memory_budget_gib=0.03",
                         "+faults=[{at: warmup, ranks: [1], action: hold_memory, mib: 64, group: dp}]")
    assert held.code == 4, held.output
    assert "warming group dp=dp_cp=tp_dp=... took this rank's communicator memory to 6" in held.output, held.output
    assert "over distributed.comm_memory_budget_gib=0.03" in held.output
    assert not any(e["name"] == "step" for evs in held.events().values() for e in evs)
