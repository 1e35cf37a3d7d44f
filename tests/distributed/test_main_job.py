"""The main job (the default policy) end to end, resume, preemption and a crash mid-save — real Megatron GPT-MoE
on 4 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.runs import FAST, lifecycle_run

pytestmark = pytest.mark.distributed


def _losses(run) -> dict[int, float]:  # type: ignore[no-untyped-def]
    return {e["step"]: e["loss"] for e in run.events()[0] if e["name"] == "step" and e["kind"] == "end"}


@pytest.mark.timeout(120)
def test_default_job_trains_saves_and_exits_0(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 4)
    assert run.code == 0, run.output
    s = run.summary()
    assert s["exit_code"] == 0 and set(s["exit_code_per_rank"].values()) == {0}
    assert s["loss"]["steps"] == 20 and s["loss"]["last"] < 0.6 * s["loss"]["first"]
    ck = run.run_dir / "checkpoints"
    assert (ck / "latest").read_text().strip() == "iter_0000020"
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000010", "iter_0000020", "latest"]
    assert (ck / "iter_0000020" / "metadata.json").is_file()
    for phase in ("init", "warmup", "train", "checkpoint", "teardown"):
        assert phase in s["phases"] and f"  {phase}" in run.proc.stdout
    assert "loss" in run.proc.stdout and "iter_0000020" in run.proc.stdout
    # the run also leaves the merged trace and the Gantt picture (matplotlib is in the dev extra)
    trace = json.loads((run.run_dir / "trace.json").read_text())
    assert {e["tid"] for e in trace["traceEvents"] if e.get("ph") == "X"} == {0, 1, 2, 3}
    assert (run.run_dir / "timeline.png").stat().st_size > 1000


@pytest.mark.timeout(120)
def test_resume_continues_the_loss_curve(tmp_path: Path) -> None:
    ck = tmp_path / "ckpt"
    full = lifecycle_run(tmp_path / "a", 4, *FAST, "train.steps=12", "checkpoint.every_steps=0", "checkpoint.at_end=false")
    assert full.code == 0, full.output
    # Five saves: from the third on, megatron-core reuses the cached save plan and global metadata.
    first = lifecycle_run(tmp_path / "b", 4, *FAST, "train.steps=10", "checkpoint.every_steps=2",
                          f"checkpoint.dir={ck}")
    assert first.code == 0, first.output
    resumed = lifecycle_run(tmp_path / "c", 4, *FAST, "train.steps=12", f"checkpoint.dir={ck}")
    assert resumed.code == 0, resumed.output
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000010", "iter_0000012", "latest"]
    assert "resumed from step 10" in resumed.proc.stdout
    a, c = _losses(full), _losses(resumed)
    assert sorted(c) == [11, 12]
    assert c[11] == pytest.approx(a[11], rel=1e-6) and c[12] == pytest.approx(a[12], rel=1e-6)


@pytest.mark.timeout(120)
def test_sigterm_to_one_rank_saves_the_same_step_everywhere(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 4, *FAST, "checkpoint.every_steps=0",
                        "+faults=[{at: train, step: 5, ranks: [2], action: signal}]")
    assert run.code == 0, run.output
    assert "preempted at step 5, saved" in run.proc.stdout
    ck = run.run_dir / "checkpoints"
    assert (ck / "latest").read_text().strip() == "iter_0000005"
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000005", "latest"]
    for rank, evs in run.events().items():
        steps = [e["step"] for e in evs if e["name"] == "step" and e["kind"] == "end"]
        assert max(steps) == 5, rank


@pytest.mark.timeout(120)
def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ck = tmp_path / "ckpt"
    run = lifecycle_run(tmp_path / "a", 4, *FAST, "train.steps=12", "checkpoint.every_steps=6",
                        f"checkpoint.dir={ck}", "+faults=[{at: checkpoint, step: 12, ranks: [1], action: crash, op: commit}]")
    assert run.code != 0 and "rank 1 failed first" in run.output, run.output
    assert (ck / "latest").read_text().strip() == "iter_0000006"
    assert not (ck / "iter_0000012").exists()
    again = lifecycle_run(tmp_path / "b", 4, *FAST, "train.steps=7", f"checkpoint.dir={ck}")
    assert again.code == 0, again.output
    assert "resumed from step 6" in again.proc.stdout
