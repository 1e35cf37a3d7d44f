"""launch_local with real rank processes (tiny scripts in workers/): success, a failing rank brings the job
down fast and is named, a SIGSTOPped rank is killed, the store outlives rank 0, SIGTERM to the launcher is
forwarded as a preemption request, and nothing is left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lifecycle.launch.local import launch_local
from lifecycle.rundir import SHUTDOWN_MARKER

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"


def _worker(name: str, *args: object) -> list[str]:
    return [sys.executable, str(WORKERS / name), *map(str, args)]


def _notes(run_dir: Path, name: str) -> dict[int, object]:
    return {int(p.name.split(".rank_")[1][:-5]): json.loads(p.read_text())
            for p in (run_dir / "out").glob(f"{name}.rank_*.json")}


def _last_event_t(run_dir: Path, rank: int) -> float:
    lines = (run_dir / "events" / f"rank_{rank}.jsonl").read_text().splitlines()
    return float(json.loads(lines[-1])["t"])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")  # a zombie is gone too


@pytest.mark.timeout(60)
def test_all_ranks_succeed(tmp_path: Path) -> None:
    res = launch_local(_worker("ok.py"), 3, tmp_path)
    assert (res.exit_code, res.first_failure, res.per_rank) == (0, None, {0: 0, 1: 0, 2: 0})
    assert res.describe() == "all 3 ranks succeeded"
    for r in range(3):  # stdout and stderr of every rank land in one log file
        log = (tmp_path / "logs" / f"rank_{r}.log").read_text()
        assert f"rank {r} stdout sum=3" in log and f"rank {r} stderr line" in log
    envs = _notes(tmp_path, "env")
    assert all(e == {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GROUP_RANK": "0"} for e in envs.values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("others", ["collective", "sleep"])
def test_failing_rank_brings_the_job_down(tmp_path: Path, others: str) -> None:
    res = launch_local(_worker("fail.py", 1, others), 3, tmp_path, kill_grace_s=3.0)
    returned = time.time()
    assert (res.exit_code, res.first_failure, res.how, res.phase) == (4, 1, "exit 4", "warmup")
    assert res.describe() == "rank 1 failed first (exit 4) in phase warmup"
    assert res.killed == ()
    assert returned - _last_event_t(tmp_path, 1) < 3.0  # down within a few seconds of the failure
    assert (tmp_path / SHUTDOWN_MARKER).exists()
    if others == "sleep":  # the marker was there before the SIGTERM: a shutdown, not a preemption
        assert _notes(tmp_path, "sigterm") == {0: {"marker": True}, 2: {"marker": True}}


@pytest.mark.timeout(60)
def test_stopped_rank_is_killed(tmp_path: Path) -> None:
    grace = 2.0
    res = launch_local(_worker("stop.py"), 3, tmp_path, kill_grace_s=grace)
    returned = time.time()
    assert (res.exit_code, res.first_failure, res.how, res.phase) == (4, 2, "exit 4", "train")
    assert res.per_rank[1] == -signal.SIGKILL and res.killed == (1,)
    assert returned - _last_event_t(tmp_path, 2) < grace + 3.0
    assert res.describe() == ("rank 2 failed first (exit 4) in phase train; "
                              "ranks [1] were killed after the grace period")


@pytest.mark.timeout(60)
def test_store_outlives_rank0(tmp_path: Path) -> None:
    res = launch_local(_worker("store_survives.py"), 3, tmp_path)
    assert (res.exit_code, res.per_rank) == (0, {0: 0, 1: 0, 2: 0}), res.describe()
    assert _notes(tmp_path, "store") == {r: {"peers": ["alive", "alive"], "fresh": "x"} for r in (1, 2)}


@pytest.mark.timeout(60)
def test_grandchildren_are_killed(tmp_path: Path) -> None:
    res = launch_local(_worker("orphan.py"), 2, tmp_path)
    assert res.exit_code == 0
    pids = _notes(tmp_path, "grandchild")
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while not all(_gone(int(p)) for p in pids.values()) and time.monotonic() < deadline:  # type: ignore[call-overload]
        time.sleep(0.05)
    assert all(_gone(int(p)) for p in pids.values())  # type: ignore[call-overload]


def _driven(tmp_path: Path, grace: float) -> subprocess.Popen[str]:
    """launch_local of 3 preempt.py ranks (rank 1 ignores SIGTERM) in a driver process, once every rank is ready."""
    cmd = [sys.executable, str(WORKERS / "launch_driver.py"), str(tmp_path), "3", str(grace), "--",
           *_worker("preempt.py", 1)]
    driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "out").exists() or len(_notes(tmp_path, "ready")) < 3:
        assert time.monotonic() < deadline and driver.poll() is None
        time.sleep(0.05)
    return driver


def _result(driver: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    try:
        out, _ = driver.communicate(timeout=timeout)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.timeout(60)
def test_sigterm_to_launcher_is_forwarded_as_preemption(tmp_path: Path) -> None:
    grace = 2.0
    driver = _driven(tmp_path, grace)
    signalled = time.monotonic()
    driver.send_signal(signal.SIGTERM)
    res = _result(driver, grace + 10)
    took = time.monotonic() - signalled
    assert driver.returncode == 128 + signal.SIGTERM == res["exit_code"]
    assert (res["stopped_by"], res["first_failure"], res["killed"]) == ("SIGTERM", None, [1])
    assert res["describe"] == "stopped on SIGTERM, exit 143; ranks [1] were killed after the grace period"
    assert _notes(tmp_path, "sigterm") == {0: {"marker": False}, 2: {"marker": False}}  # a preemption
    assert not (tmp_path / SHUTDOWN_MARKER).exists()
    assert grace - 0.2 < took < grace + 5.0
    assert all(_gone(int(pid)) for pid in _notes(tmp_path, "ready").values())  # type: ignore[call-overload]


@pytest.mark.timeout(60)
def test_ctrl_c_is_a_preemption_with_the_whole_grace_and_a_second_one_stops_at_once(tmp_path: Path) -> None:
    grace = 30.0
    driver = _driven(tmp_path, grace)
    driver.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 10
    while len(_notes(tmp_path, "sigterm")) < 2:  # the ranks got SIGTERM, their preemption signal, not SIGINT
        assert time.monotonic() < deadline and driver.poll() is None
        time.sleep(0.05)
    time.sleep(1.0)
    assert driver.poll() is None  # rank 1 still runs: the launcher waits out the grace, not a fixed 3 s
    again = time.monotonic()
    driver.send_signal(signal.SIGINT)
    res = _result(driver, 10)
    assert time.monotonic() - again < 5.0
    assert (driver.returncode, res["exit_code"], res["stopped_by"], res["killed"]) == (130, 130, "SIGINT", [1])
    assert res["describe"] == ("stopped on SIGINT, exit 130; ranks [1] were killed at once (asked again during the "
                               "grace period)")
    assert _notes(tmp_path, "sigterm") == {0: {"marker": False}, 2: {"marker": False}}


@pytest.mark.timeout(60)
def test_no_rank_outlives_its_launcher(tmp_path: Path) -> None:
    driver = _driven(tmp_path, 2.0)
    driver.kill()  # kill -9: the launcher can do nothing about its ranks
    driver.wait()
    pids = [int(p) for p in _notes(tmp_path, "ready").values()]  # type: ignore[call-overload]
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids)


@pytest.mark.timeout(60)
def test_no_rank_survives_a_launcher_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    import lifecycle.rundir

    def broken(run_dir: Path, rank: int) -> None:
        raise RuntimeError("injected launcher fault")

    monkeypatch.setattr(lifecycle.rundir, "last_event", broken)  # fault injection after the failure
    with pytest.raises(RuntimeError, match="injected launcher fault"):
        launch_local(_worker("fail.py", 1, "sleep"), 3, tmp_path)
    from tests.conftest import session_helpers

    left = [c for c in psutil.Process().children(recursive=True)
            if c not in session_helpers() and c.status() != psutil.STATUS_ZOMBIE]
    assert left == []
