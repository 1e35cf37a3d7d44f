"""Ranks forked from the preload process train exactly as ranks started by exec: the same default (Megatron MoE)
job at world 2, once each way, gives the same losses bit for bit (model init, data and RNG streams untouched by the
imports done before the fork), and the forked ranks leave no process behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.runs import Run, lifecycle_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]


def test_forked_and_exec_started_ranks_train_the_same_losses(tmp_path: Path) -> None:
    args = ("train.steps=3", "checkpoint.every_steps=0")
    forked = lifecycle_run(tmp_path / "forked", 2, *args, timeout=120)
    started = lifecycle_run(tmp_path / "exec", 2, *args, timeout=120, env={"LIFECYCLE_PRELOAD": "0"})
    assert forked.code == 0 and started.code == 0, (forked.output()[-2000:], started.output()[-2000:])
    assert "found in sys.modules" not in forked.log(0) + forked.log(1)  # runpy's note is not a rank's output

    assert losses(forked) and losses(forked) == losses(started)
    assert forked.summary()["loss"] == started.summary()["loss"]


def losses(run: Run) -> list[tuple[float, float | None]]:
    return [(e["loss"], e.get("grad_norm")) for r in sorted(run.events()) for e in run.events()[r]
            if e.get("kind") == "end" and e["name"] == "step"]
