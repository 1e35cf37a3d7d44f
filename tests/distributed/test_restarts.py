"""Restarts without a human (`restart.max_restarts`): the next attempt resumes with what the first one learned, and
attempts that make no progress stop the restarts — real gloo ranks, the synthetic kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.runs import FAST, SYNTHETIC, lifecycle_run

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(150)
def test_a_crash_in_attempt_1_restarts_resumes_with_the_learned_deadline_and_finishes(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 4, *SYNTHETIC, *FAST, "train.steps=12", "checkpoint.every_steps=5",
                        "restart.max_restarts=2", "watchdog.deadlines.step=auto",
                        "watchdog.adaptive.calibration_steps=3",
                        "+faults=[{at: train, step: 7, ranks: [2], action: crash, attempts: [1]}]")
    assert run.code == 0, run.output
    assert "restart  attempt 1 failed (exit 4): ranks 2 (dead in phase train); restart 1 of 2" in run.output
    assert "attempt 2: resumed from step 5" in run.output
    summary = run.summary()
    assert summary["attempt"] == 2 and summary["exit_code"] == 0 and summary["loss"]["steps"] == 7
    [first] = summary["earlier_attempts"]
    # rank 0's last finished step: 6, or 5 when the launcher's shutdown after rank 2's death reached it inside step
    # 6's boundary (its all-reduce done, the step not yet counted)
    assert first["exit_code"] == 4 and first["blame"]["ranks"] == [2] and first["last_step"] in (5, 6), first
    assert 0 < first["restart_s"] < 60, first  # failure -> the next attempt's first step
    # Attempt 2 starts from the deadline attempt 1 learned and saved with checkpoint 5, not the 600 s ceiling.
    for rank, events in run.events().items():
        first_step = next(i for i, e in enumerate(events) if e["name"] == "step")
        restored = [e for e in events[:first_step] if e["name"] == "deadline"]
        assert [e["source"] for e in restored] == ["checkpoint"], (rank, restored)
        assert restored[0]["seconds"] < 600 and "restored from iter_0000005 (learned in attempt 1)" in \
            restored[0]["how"], restored
    assert (run.run_dir / "checkpoints" / "iter_0000010" / "lifecycle_learned.json").is_file()
    # resumed from 5: step 6 ran twice (and 7, when rank 0 got that far before the launcher's shutdown reached it)
    _assert_goodput(summary["goodput"], attempts=2, lost_at_least=1)
    assert summary["goodput"]["steps"]["productive"] == 12 and "goodput  " in run.output


def _assert_goodput(g: dict, attempts: int, lost_at_least: int) -> None:  # type: ignore[type-arg]
    """A real run's goodput: every bucket >= 0, summing to the wall time; 12 or 10 steps survive; the lost ones."""
    buckets = g["buckets_s"]
    assert all(v >= 0 for v in buckets.values()) and abs(sum(buckets.values()) - g["wall_s"]) < 0.01, g
    assert g["attempts"] == attempts and g["failures"] >= 1 and g["steps"]["lost"] >= lost_at_least, g
    assert buckets["productive"] > 0 and buckets["lost"] > 0 and buckets["startup"] > 0, g
    assert 0 < g["goodput"] < 1 and g["goodput"] == pytest.approx(buckets["productive"] / g["wall_s"], abs=1e-3)


@pytest.mark.timeout(150)
def test_attempts_that_never_commit_a_newer_checkpoint_stop_the_restarts_with_the_no_progress_code(
        tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 2, *SYNTHETIC, *FAST, "train.steps=12", "checkpoint.every_steps=5",
                        "restart.max_restarts=5", "restart.max_no_progress=2",
                        "+faults=[{at: train, step: 3, ranks: [1], action: crash}]")
    assert run.code == 6, run.output
    assert ("2 attempts in a row failed before committing a checkpoint at all; not restarting "
            "(restart.max_no_progress=2") in run.output, run.output
    assert run.summary()["attempt"] == 2  # the third attempt was refused before any rank started
    # The same command run again by hand is refused too (torchrun's and SLURM's restarts: tests/examples).
    again = lifecycle_run(tmp_path, 2, *SYNTHETIC, *FAST, "train.steps=12", "checkpoint.every_steps=5",
                          "restart.max_restarts=5", "restart.max_no_progress=2",
                          "+faults=[{at: train, step: 3, ranks: [1], action: crash}]")
    assert again.code == 6 and "not restarting" in again.output, again.output
    # Another policy (here: the drill gone) is a fresh start for the count: it runs, and finishes.
    fixed = lifecycle_run(tmp_path, 2, *SYNTHETIC, *FAST, "train.steps=12", "checkpoint.every_steps=5",
                          "restart.max_restarts=5", "restart.max_no_progress=2")
    assert fixed.code == 0, fixed.output


@pytest.mark.timeout(150)
@pytest.mark.megatron  # the memory tier's copies of megatron-core's model and optimizer: on both stacks
def test_a_raise_restarts_in_place_in_the_same_processes_and_resumes_from_the_memory_copies(tmp_path: Path) -> None:
    # Real Megatron (MoE, ep 2): rank 2 raises at step 7 while rank 0 computes (a slow step):
    # rank 2's peers leave their collectives, rank 0 at its watchdog's word; all re-create their groups and resume
    # from the memory tier's copies of step 4 (nothing committed yet), and steps 5 and 6 come out as they did.
    shm = tmp_path / "shm"
    shm.mkdir()
    run = lifecycle_run(tmp_path, 4, *FAST, "train.steps=10", "checkpoint.every_steps=10", "restart.max_restarts=1",
                        "checkpoint.memory.every_steps=4", f"checkpoint.memory.dir={shm}", "restart.mode=in_process",
                        "+faults=[{at: train, step: 7, ranks: [2], action: raise, attempts: [1]}, "
                        "{at: train, step: 7, ranks: [0], action: slow, seconds: 4, attempts: [1]}]", timeout=140)
    assert run.code == 0, run.output
    assert ("restart  attempt 1 failed (exit 4): ranks 2 (failed in phase train); in-process restart 1 of 1"
            in run.output), run.output
    assert "attempt 2: resumed from step 4 (memory copies; last committed checkpoint: none)" in run.output
    assert not (run.run_dir / "attempts" / "1" / "events").exists()  # no relaunch: the same files go on
    summary = run.summary()
    assert summary["attempt"] == 2 and summary["loss"]["steps"] == 6 and summary["blame"] is None
    [first] = summary["earlier_attempts"]
    assert first["mode"] == "in_process" and first["blame"]["ranks"] == [2] and first["last_step"] == 6
    assert set(first["stages"]) == {"report_s", "destroy_s", "agree_s", "init_s", "warmup_s", "load_s", "first_step_s"}
    assert 0 < first["restart_s"] < 30, first
    for rank, events in run.events().items():
        attempts = [e for e in events if e["name"] == "attempt"]
        assert [a["attempt"] for a in attempts] == [1, 2] and len({a["pid"] for a in attempts}) == 1, rank
        assert [e["exit_code"] for e in events if e["name"] == "exit"] == [0], rank
        # Nothing of the failed attempt's model is alive when the next one is built (58 modules were, before
        # Megatron DDP's gradient-accumulator hooks were removed at release).
        [restart] = [e for e in events if e["name"] == "restart_in_process"]
        assert restart["left_alive_modules"] == 0 and restart["left_alive_param_bytes"] == 0, restart
        losses: dict[int, list[float]] = {}
        for e in events:
            if e["name"] == "step" and e["kind"] == "end" and "loss" in e:
                losses.setdefault(e["step"], []).append(e["loss"])
        assert losses[5][0] == losses[5][1] and losses[6][0] == losses[6][1], losses  # restored bit for bit
    assert "connection(s) of this rank's process groups shut down" in run.log(0)  # its watchdog took it out
    ledger = [json.loads(line) for line in (run.run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r.get("exit_code")) for r in ledger if "exit_code" in r][:2] == [(1, 4), (2, 0)]
    g = summary["goodput"]  # one process, one events file: the in-place restart's lost steps and restore counted
    _assert_goodput(g, attempts=1, lost_at_least=2)
    assert g["steps"]["productive"] == 10 and g["buckets_s"]["restore"] > 0, g


@pytest.mark.timeout(150)
def test_a_dead_rank_cannot_restart_in_place_and_falls_back_to_a_relaunch(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 4, *SYNTHETIC, *FAST, "train.steps=10", "checkpoint.every_steps=5",
                        "restart.max_restarts=2", "restart.mode=in_process",
                        "+faults=[{at: train, step: 7, ranks: [2], action: crash, attempts: [1]}]")
    assert run.code == 0, run.output
    assert "restart in place not possible (" in run.output and "leaving for a relaunch" in run.output, run.output
    assert "restart  attempt 1 failed (exit 4): ranks 2 (dead in phase train); restart 1 of 2" in run.output
    assert (run.run_dir / "attempts" / "1" / "events").is_dir()
    [first] = run.summary()["earlier_attempts"]
    assert first["mode"] == "relaunch" and first["exit_code"] == 4
