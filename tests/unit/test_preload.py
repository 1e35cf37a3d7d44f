"""The preload process ranks are forked from (lifecycle.launch.preload): a real process, real forks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lifecycle.launch import preload
from lifecycle.launch.parent import ENV_LAUNCHER_PID

pytestmark = [pytest.mark.timeout(60), pytest.mark.megatron]  # the preload imports megatron-core


def _zygote(tmp_path: Path, modules: tuple[str, ...] = ("json",)) -> preload.Zygote:
    return preload.Zygote(tmp_path, modules, {"PYTHONUNBUFFERED": "1"}, ENV_LAUNCHER_PID)


def test_a_forked_module_runs_as_main_with_its_own_log_argv_environment_and_exit_code(tmp_path: Path) -> None:
    z = _zygote(tmp_path)
    try:
        assert z.wait_ready(30) is None
        missing = tmp_path / "missing.json"
        ok = z.fork(0, ["python", "-m", "json.tool", "--help"], {**os.environ, "MARK": "0"}, tmp_path / "r0.log")
        bad = z.fork(1, ["python", "-m", "json.tool", str(missing)], dict(os.environ), tmp_path / "r1.log")
        assert ok.wait(30) == 0 and bad.wait(30) != 0
        assert ok.pid != bad.pid and ok.poll() == 0
        assert "usage:" in (tmp_path / "r0.log").read_text()
        assert "missing.json" in (tmp_path / "r1.log").read_text()  # stderr goes to the rank's log too
    finally:
        z.close()
    assert z.proc.returncode == 0  # it left once its ranks had


def test_a_module_that_does_not_import_is_a_reason_not_a_hang(tmp_path: Path) -> None:
    z = _zygote(tmp_path, ("json", "no_such_module_for_lifecycle"))
    why = z.wait_ready(30)
    assert why is not None and "no_such_module_for_lifecycle" in why
    assert z.proc.poll() is not None


def test_only_python_dash_m_is_forked_and_the_switch_turns_it_off() -> None:
    assert preload.enabled({}) and not preload.enabled({preload.ENV_PRELOAD: "0"})
    assert "megatron.core" in preload.modules_for(True) and "megatron.core" not in preload.modules_for(False)



def test_a_forked_rank_is_named_after_its_rank(tmp_path: Path) -> None:
    z = _zygote(tmp_path)
    try:
        assert z.wait_ready(30) is None
        probe = "print('comm=' + open('/proc/self/comm').read().strip())"
        rank = z.fork(3, ["python", "-m", "timeit", "-n1", "-r1", probe], dict(os.environ), tmp_path / "r3.log")
        assert rank.wait(30) == 0
    finally:
        z.close()
    assert "comm=lifecycle-rank3" in (tmp_path / "r3.log").read_text()


def test_a_rank_dies_with_a_killed_preload_process_and_reads_as_killed(tmp_path: Path) -> None:
    import signal

    z = _zygote(tmp_path)
    try:
        assert z.wait_ready(30) is None
        sleeper = ["python", "-m", "timeit", "-n1", "-r1", "import time; time.sleep(60)"]
        rank = z.fork(0, sleeper, dict(os.environ), tmp_path / "r0.log")
        assert rank.poll() is None
        os.kill(z.proc.pid, signal.SIGKILL)  # from outside: the preload process itself
        assert rank.wait(20) == -signal.SIGKILL  # the parent-death signal took the rank down with it
        for _ in range(100):  # reaped by init: gone within moments
            if not os.path.exists(f"/proc/{rank.pid}"):
                break
            import time

            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{rank.pid}")
    finally:
        z.close(kill=True)


def test_a_pool_forks_every_launch_of_a_job_from_one_preload_process_and_replaces_a_dead_one(tmp_path: Path) -> None:
    """The attempts of one ``lifecycle run`` (here: launches through one pool) fork from the same preload process: the
    second launch imports nothing again; the same rank numbers get their own exit codes each launch (no status of
    the launch before is taken for theirs); a preload process killed between launches is replaced."""
    import signal

    from lifecycle.launch.local import PreloadPool, launch_local

    probe = "import os; print('parent=%d' % os.getppid(), flush=True); os._exit(int(os.environ['RANK']) + {code})"
    pool = PreloadPool()
    parents = []
    try:
        for n, code in enumerate((0, 3, 5)):
            run_dir = tmp_path / f"launch{n}"
            argv = ["python", "-m", "timeit", "-n1", "-r1", probe.format(code=code)]
            result = launch_local(argv, 2, run_dir, preload=("json",), pool=pool, kill_grace_s=0.5)
            first = result.first_failure
            assert first is not None and result.per_rank[first] == first + code, result
            logs = [(run_dir / "logs" / f"rank_{r}.log").read_text() for r in range(2)]
            parents.append({line for log in logs for line in log.split() if line.startswith("parent=")})
            if n == 1:
                assert parents[0] == parents[1] and len(parents[0]) == 1, parents  # one preload process, reused
                os.kill(int(next(iter(parents[1])).split("=")[1]), signal.SIGKILL)
        assert len(parents[2]) == 1 and parents[2] != parents[1], parents  # the dead one was replaced
    finally:
        pool.close()


def test_a_preload_process_started_early_imports_what_the_launch_adds_and_forks_from_the_same_process(
        tmp_path: Path) -> None:
    """``lifecycle run`` starts the preload process with torch's modules before it has composed the policy, then the
    launch asks for more (megatron-core's): the same process imports them and forks the ranks, which find them
    imported; a launch asking for other modules than those it started with gets a new process."""
    from lifecycle.launch.local import PreloadPool, launch_local

    probe = ("import os, sys; print('parent=%d csv=%s' % (os.getppid(), 'csv' in sys.modules), flush=True); "
             "os._exit(0)")
    argv = ["python", "-m", "timeit", "-n1", "-r1", probe]
    pool = PreloadPool()
    try:
        pool.prestart(tmp_path, ("json",))
        early = pool.take(argv, tmp_path, ("json",), None)
        assert early is not None
        pid = early.proc.pid
        result = launch_local(argv, 2, tmp_path / "a", preload=("json", "csv"), pool=pool, kill_grace_s=0.5)
        assert result.exit_code == 0, result
        logs = " ".join((tmp_path / "a" / "logs" / f"rank_{r}.log").read_text() for r in range(2))
        assert logs.count(f"parent={pid} csv=True") == 2, logs  # forked from the early process, csv imported there
        other = pool.take(argv, tmp_path, ("csv",), None)  # not an extension of what it holds: a new process
        assert other is not None and other.proc.pid != pid
    finally:
        pool.close(kill=True)


def test_ready_means_every_import_asked_for_not_the_first_one(tmp_path: Path) -> None:
    """The launch asks for more modules while the early imports still run: the "ready" of those early imports does not
    answer for the later ones (the launcher's wait, and its timeout, cover both)."""
    (tmp_path / "slow_first.py").write_text("import time\ntime.sleep(0.5)\n")
    done = tmp_path / "second.done"
    (tmp_path / "slow_second.py").write_text(
        f"import pathlib, time\ntime.sleep(0.5)\npathlib.Path({str(done)!r}).touch()\n")
    z = preload.Zygote(tmp_path, ("slow_first",), {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tmp_path)},
                       ENV_LAUNCHER_PID)
    try:
        z.extend(("slow_second",))  # asked for while slow_first still imports
        assert z.wait_ready(30) is None
        assert done.exists()  # the second import had finished when the wait returned
    finally:
        z.close()
