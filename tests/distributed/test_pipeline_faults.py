"""Fault drills on a real megatron pipeline (pp4 on 4 gloo ranks): a middle stage crashes or stalls mid-step.

The other stages are then blocked in the schedule's send/recv with their neighbours (or, further away, in
the loss broadcast); every rank must still leave by itself within the deadline plus a few seconds, with a
report that names the dead or stuck stage.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.runs import lifecycle_run
from tests.distributed.test_fault_matrix import DEADLINE, _assert_exits, _assert_no_rank_left, _assert_reports

pytestmark = pytest.mark.distributed
PIPELINE = ["parallelism.pp=4", "parallelism.ep=1", "train.options.num_experts=0", "moe.zero_token.action=off",
            "train.options.num_layers=4", "train.options.num_microbatches=4", "warmup.ops=[barrier,all_reduce,p2p]",
            "train.steps=4", "checkpoint.every_steps=2", "watchdog.deadlines.init=60",
            f"watchdog.deadlines.warmup={DEADLINE}", f"watchdog.deadlines.step={DEADLINE}",
            f"watchdog.deadlines.checkpoint={DEADLINE}", f"watchdog.deadlines.teardown={DEADLINE}",
            "teardown.deadline_s=5", "watchdog.poll_interval_s=0.25"]
CODE = {"crash": 4, "stall": 3}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault", ["crash", "stall"])
def test_a_middle_stage_failing_mid_step_ends_bounded_and_named(tmp_path: Path, fault: str) -> None:
    culprit = 1  # pipeline stage 1 of 0..3
    run = lifecycle_run(tmp_path, 4, *PIPELINE, f"+faults=[{{at: train, ranks: [{culprit}], action: {fault}, step: 3}}]",
                        timeout=80)
    assert run.code == CODE[fault], run.output
    _assert_no_rank_left(run)
    _assert_exits(run, "train", fault, culprit)
    _assert_reports(run, "train", culprit)
    events = run.events()
    # Warmup exchanged with the real neighbouring stages (a chain: no first-last link without vpp).
    warm = [e for e in events[0] if e["name"] == "warm:p2p" and e["kind"] == "end"]
    assert [e["group"] for e in warm if "pp" in e["group"].split("=")], warm
    latest = run.run_dir / "checkpoints" / "latest"
    assert latest.read_text().strip() == "iter_0000002"
