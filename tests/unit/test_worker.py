"""One rank end to end in this process (world 1, real gloo and store, the watchdog thread): the worker,
the runner's in-rank path and the watchdog, without starting a process."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifecycle import rundir
from lifecycle.errors import UsageError
from lifecycle.machine.session import rank_env, run_rank
from lifecycle.obs.events import read_events
from lifecycle.policy.load import validate, write_resolved
from tests._dist import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The launcher's environment for rank 0 of 1; the signal handlers the worker installs are restored after."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in handlers.items():
        signal.signal(s, h)


def _policy(tmp_path: Path, **extra: object) -> Path:
    data: dict[str, object] = {
        "run": {"dir": str(tmp_path / "run"), "id": "unit"}, "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "train": {"kind": "synthetic", "steps": 3, "options": {"hidden": 8}},
        "watchdog": {"poll_interval_s": 0.05, "deadlines": {"init": 20, "step": 10}}, **extra}
    run_dir = tmp_path / "run"
    write_resolved(validate(data), run_dir)
    return run_dir


def test_rank_env_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(UsageError, match="RANK and WORLD_SIZE must be set"):
        rank_env()


def test_one_rank_runs_the_whole_lifecycle_from_the_run_directory(one_rank: None, tmp_path: Path) -> None:
    run_dir = _policy(tmp_path)
    assert run_rank(run_dir) == 0
    events = read_events(run_dir)[0]
    exit_event = [e for e in events if e["name"] == "exit"][-1]
    assert exit_event["exit_code"] == 0 and exit_event["step"] == 3
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000003"


def test_a_preemption_signal_saves_and_exits_0(one_rank: None, tmp_path: Path) -> None:
    run_dir = _policy(tmp_path, train={"kind": "synthetic", "steps": 50, "options": {"step_sleep_s": 0.01}},
                      faults=[{"at": "train", "step": 5, "ranks": [0], "action": "signal"}])
    assert run_rank(run_dir) == 0
    stop = [e for e in read_events(run_dir)[0] if e["name"] == "exit"][-1]["stop_step"]
    assert stop is not None and 5 <= stop < 50
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"iter_{stop:07d}"


def test_the_watchdog_reports_a_slow_step_past_its_deadline(one_rank: None, tmp_path: Path) -> None:
    run_dir = _policy(tmp_path, train={"kind": "synthetic", "steps": 1, "options": {"step_sleep_s": 1.5}},
                      watchdog={"action": "report", "poll_interval_s": 0.05,
                                "deadlines": {"init": 20, "step": 0.3}})
    assert run_rank(run_dir) == 0  # report only: the step finishes and the run ends cleanly
    report = json.loads((run_dir / rundir.HANG_REPORT).read_text())
    assert report["cause"] == "hang" and report["phase"] == "train" and report["origin_rank"] == 0
    assert report["waits"]["0"]["op"] == "step" and report["waits"]["0"]["step"] == 1
    assert any(e["name"] == "hang_report" for e in read_events(run_dir)[0])


def test_the_worker_entry_point_refuses_a_missing_run_directory(tmp_path: Path) -> None:
    from lifecycle.launch.worker import main

    os.environ.update(RANK="0", WORLD_SIZE="1")
    assert main([str(tmp_path / "nowhere")]) == 2


def test_a_forked_ranks_start_up_counts_from_its_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank forked from the preload process inherited imports made before it existed: goodput's start-up begins
    where the launcher began the launch; anything unusable there falls back to the process's own age."""
    import time

    from lifecycle import rundir
    from lifecycle.machine.session import process_age_s, start_up_s

    before = (process_age_s() or 0.0) + 100  # a launch that began before this process (the test's own may be old)
    monkeypatch.setenv(rundir.ENV_LAUNCHED, f"{time.time() - before:.3f}")
    assert before - 1 < (start_up_s() or 0) < before + 10
    for junk in ("", "soon", f"{time.time() + 50:.3f}", f"{time.time() - 7200:.3f}"):
        monkeypatch.setenv(rundir.ENV_LAUNCHED, junk)
        age = process_age_s()
        assert start_up_s() == pytest.approx(age, abs=0.05), junk


def test_a_rank_that_crashes_in_native_code_leaves_every_threads_python_stack_and_dies_of_the_signal() -> None:
    """worker.main's crash_stacks: the stack goes to the rank's stderr (its log), the signal still ends the process."""
    import subprocess
    import sys

    code = ("import os, signal, threading, time\n"
            "from lifecycle.launch.worker import crash_stacks\n"
            "crash_stacks()\n"
            "threading.Thread(target=time.sleep, args=(60,), name='other', daemon=True).start()\n"
            "def deep():\n"
            "    os.kill(os.getpid(), signal.SIGSEGV)\n"
            "deep()\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr)
    assert "Fatal Python error: Segmentation fault" in proc.stderr, proc.stderr
    assert 'line 6 in deep' in proc.stderr and proc.stderr.count("hread 0x") >= 2, proc.stderr
