"""checkpoint.signal_check_every: the stop flag is agreed every n steps, so a preemption stops at the next such step;
checkpoint.signal_overlap: the flag is read one step after it is issued (the all-reduce runs during that step); the
launcher gives a preemption the policy's grace, and its ranks die with it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lifecycle.obs.events import read_events
from tests.distributed.runs import FAST, SYNTHETIC, lifecycle_run
from tests.helpers import ROOT

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(90)
def test_a_signal_stops_at_the_next_agreed_step(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 2, *SYNTHETIC, *FAST, "train.steps=12", "checkpoint.every_steps=0",
                        "checkpoint.signal_check_every=4", "checkpoint.signal_overlap=false",
                        "+faults=[{at: train, step: 5, ranks: [1], action: signal}]")
    assert run.code == 0, run.output
    assert "preempted at step 8, saved" in run.proc.stdout, run.output
    assert (run.run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000008"
    for rank, events in run.events().items():
        agreed = [e.get("step") for e in events if e["name"] == "stop_flag" and e["kind"] == "end"]
        assert agreed == [None, 4, 8], (rank, agreed)  # before the first step, then every 4th step


@pytest.mark.timeout(90)
def test_an_overlapped_flag_is_read_one_step_later(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 2, *SYNTHETIC, *FAST, "train.steps=12", "checkpoint.every_steps=0",
                        "checkpoint.signal_check_every=4", "+faults=[{at: train, step: 5, ranks: [1], action: signal}]")
    assert run.code == 0, run.output
    assert "preempted at step 9, saved" in run.proc.stdout, run.output  # issued after step 8, read after 9
    assert (run.run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000009"
    for rank, events in run.events().items():
        flags = [e for e in events if e["name"] == "stop_flag" and e["kind"] == "end"]
        assert [(e.get("step"), e.get("issued_at"), bool(e.get("overlapped"))) for e in flags] == \
            [(None, None, False), (5, 4, True), (9, 8, True)], (rank, flags)


@pytest.mark.timeout(90)
def test_an_auto_cadence_is_agreed_alike_on_every_rank_and_a_signal_stops_at_the_next_agreement(
        tmp_path: Path) -> None:
    """``signal_check_every: auto`` with ~50 ms steps: every step until a step time is known, then about every
    0.5 s (n from the slowest rank's period, the same on both ranks); a signal at step 12 stops at the next one."""
    run = lifecycle_run(tmp_path, 2, *SYNTHETIC, *FAST, "train.steps=60", "checkpoint.every_steps=0",
                        "checkpoint.signal_check_every=auto", "train.options.step_sleep_s=0.05",
                        "+faults=[{at: train, step: 12, ranks: [1], action: signal}]")
    assert run.code == 0, run.output
    seen = {rank: [e.get("step") for e in events if e["name"] == "stop_flag" and e["kind"] == "end"]
            for rank, events in run.events().items()}
    assert len(seen) == 2 and seen[0] == seen[1], seen  # issued and read at the same steps on both ranks
    reads = seen[0]
    assert reads[:3] == [None, 2, 3], reads  # before training; then every step until a period is agreed
    gaps = [b - a for a, b in zip(reads[2:], reads[3:], strict=False)]
    assert gaps and all(2 <= g <= 10 for g in gaps), reads  # 0.5 s of ~50 ms steps: at most 10, never every step
    stop = reads[-1]
    assert stop > 12 and stop - 12 <= gaps[-1] + 1, reads
    assert f"preempted at step {stop}, saved" in run.proc.stdout, run.output
    assert (run.run_dir / "checkpoints" / "latest").read_text().strip() == f"iter_{stop:07d}"


def _start(run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "lifecycle", "run", "--nproc", "2", f"run.dir={run_dir}",
                             *SYNTHETIC, *FAST, "train.steps=400", "train.options.step_sleep_s=0.05",
                             "checkpoint.every_steps=0", "checkpoint.grace_s=10", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def _trained(run_dir: Path, steps: int, proc: subprocess.Popen[str]) -> list[int]:
    """Wait until both ranks began step ``steps``; their pids."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        events = read_events(run_dir)
        began = [max((e.get("step") or 0 for e in evs if e["name"] == "step"), default=0) for evs in events.values()]
        if len(began) == 2 and min(began) >= steps:
            return [next(e["pid"] for e in evs if e["name"] == "attempt") for evs in events.values()]
        time.sleep(0.1)
    raise AssertionError(f"the ranks did not reach step {steps}: {proc.poll()}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(150)
def test_a_launcher_sigterm_waits_for_a_slow_save_and_a_killed_launcher_leaves_no_rank(tmp_path: Path) -> None:
    """The launcher's preemption grace is the policy's (checkpoint.grace_s + teardown.deadline_s), not 3 s: a save
    that takes 5 s lands. A launcher killed with SIGKILL takes its ranks with it: the next launcher gets the
    directory to itself and resumes from the save."""
    from lifecycle.checkpoint import ckptdir

    run_dir = tmp_path / "run"
    slow = "+faults=[{at: checkpoint, ranks: [0, 1], action: slow, seconds: 5, op: save}]"
    proc = _start(run_dir, slow)
    try:
        _trained(run_dir, 3, proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM: the ranks save and stop (up to 25s, checkpoint.grace_s + teardown.deadline_s)" in out, out[-3000:]
    stopped = json.loads((run_dir / "summary.json").read_text())
    saved = stopped["stop_step"]
    assert saved and ckptdir.read_tracker(run_dir / "checkpoints").name == ckptdir.iter_name(saved), out[-3000:]
    # A stopped launcher leaves within its grace: no read of every attempt for the goodput, no picture; it names both
    assert "goodput" not in stopped and not (run_dir / "timeline.png").exists(), out[-3000:]
    assert f"`lifecycle goodput {run_dir}`" in out and f"`lifecycle timeline {run_dir}`" in out, out[-3000:]

    proc = _start(run_dir)
    try:
        pids = _trained(run_dir, saved + 2, proc)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: its ranks are not told
        proc.wait(10)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids):
            assert time.monotonic() < deadline, f"ranks {pids} outlived their launcher"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    final = subprocess.run([sys.executable, "-m", "lifecycle", "run", "--nproc", "2", f"run.dir={run_dir}",
                            *SYNTHETIC, *FAST, f"train.steps={saved + 2}"], capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=60)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    assert f"resumed from step {saved}" in final.stdout
    assert not (run_dir / "hang_report.json").exists() and not list(run_dir.glob("hang_report.*.json"))
