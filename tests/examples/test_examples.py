"""Every example runs as users run it (subprocesses with hard timeouts)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lifecycle import rundir
from lifecycle.obs.events import read_events
from tests.distributed.runs import FAST, SYNTHETIC
from tests.helpers import ROOT, run_cli

EXAMPLES = ROOT / "examples"


def _torchrun_example(tmp_path: Path, *overrides: str, restarts: int = 0) -> subprocess.CompletedProcess[str]:
    """examples/torchrun.sh with 2 ranks, the synthetic kind, a free rendezvous port and a run id of its own."""
    from tests._dist import free_port

    venv_bin = Path(os.sys.executable).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{venv_bin}:{os.environ['PATH']}",
           "RDZV_PORT": str(free_port()), "RUN_ID": f"example-{os.getpid()}-{tmp_path.name}",
           "MAX_RESTARTS": str(restarts)}
    return subprocess.run(["bash", str(EXAMPLES / "torchrun.sh"), "2", *SYNTHETIC, *FAST, *overrides],
                          capture_output=True, text=True, timeout=110, env=env, cwd=tmp_path)


def test_house_policy_validates_and_explains() -> None:
    args = ("--config-dir", str(EXAMPLES / "policies"), "--config-name", "house")
    proc = run_cli("validate", *args)
    assert proc.returncode == 0 and "checkpoint every 5" in proc.stdout, proc.stderr
    proc = run_cli("explain", "--world-size", "4", *args)
    assert proc.returncode == 0 and "warm:all_to_all" in proc.stdout and "barrier:every_10_steps" in proc.stdout


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_torchrun_example_runs_each_rank(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _torchrun_example(tmp_path, f"run.dir={run_dir}", "train.steps=3", "checkpoint.every_steps=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = read_events(run_dir)
    assert sorted(events) == [0, 1]
    for evs in events.values():
        assert [e for e in evs if e["name"] == "exit"][0]["exit_code"] == 0
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000003"


@pytest.mark.distributed
@pytest.mark.timeout(170)
def test_torchrun_ranks_agree_on_the_attempt_when_a_node_lost_its_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _torchrun_example(tmp_path, f"run.dir={run_dir}", "train.steps=2", "checkpoint.every_steps=0")
    assert first.returncode == 0, first.stdout + first.stderr
    # Rank 1 runs on a replaced node: its local files of attempt 1 are gone, so it counts this as attempt 1.
    (run_dir / "events" / "rank_1.jsonl").unlink()
    again = _torchrun_example(tmp_path, f"run.dir={run_dir}", "train.steps=3", "checkpoint.every_steps=0")
    out = again.stdout + again.stderr
    assert again.returncode == 0, out
    assert "the ranks counted different attempts (rank 1: 1): all continue as attempt 2" in out, out[-3000:]
    assert "attempt 2: resumed from step 2" in out, out[-3000:]
    agreed = [e for e in read_events(run_dir)[1] if e["name"] == "attempt"]
    assert [(e["attempt"], e.get("counted")) for e in agreed] == [(1, None), (2, 1)]
    # The next attempt counts on from the agreed number on every rank, without a warning.
    third = _torchrun_example(tmp_path, f"run.dir={run_dir}", "train.steps=4", "checkpoint.every_steps=0")
    out = third.stdout + third.stderr
    assert third.returncode == 0 and "counted different attempts" not in out, out[-3000:]
    for evs in read_events(run_dir).values():
        assert [e["attempt"] for e in evs if e["name"] == "attempt"] == [3]
    assert (run_dir / rundir.ATTEMPT).read_text().strip() == "3"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_torchrun_summary_names_the_failed_ranks_cause_and_code(tmp_path: Path) -> None:
    proc = _torchrun_example(tmp_path, f"run.dir={tmp_path / 'run'}", "train.steps=4",
                             "+faults=[{at: train, step: 2, ranks: [1], action: raise}]")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # torchrun's own code for any failed worker
    # ... but its summary shows the rank's cause and lifecycle's exit code, from TORCHELASTIC_ERROR_FILE
    assert "lifecycle: DrillError on rank 1 in phase train -> exit code 4" in out, out[-3000:]
    assert "error_file: <N/A>" not in out.split("Root Cause")[-1]


@pytest.mark.distributed
@pytest.mark.timeout(170)
def test_torchrun_restarts_are_attempts_that_resume_and_stop_when_they_make_no_progress(tmp_path: Path) -> None:
    # A crash in attempt 1 only: torchrun restarts the ranks, they count attempt 2, resume and finish.
    run_dir = tmp_path / "a"
    proc = _torchrun_example(tmp_path, f"run.dir={run_dir}", "train.steps=6", "checkpoint.every_steps=2",
                             "+faults=[{at: train, step: 3, ranks: [1], action: crash, attempts: [1]}]", restarts=1)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "attempt 2: resumed from step 2" in out, out[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000006"
    # A crash in every attempt before any checkpoint: the third attempt refuses at init, on every rank, with the
    # no-progress code (torchrun then has no restart left and ends with its own code, naming ours).
    stuck = _torchrun_example(tmp_path, f"run.dir={tmp_path / 'b'}", "train.steps=6", "checkpoint.every_steps=5",
                              "restart.max_no_progress=2", "+faults=[{at: train, step: 3, ranks: [1], action: crash}]",
                              restarts=2)
    out = stuck.stdout + stuck.stderr
    assert stuck.returncode != 0 and "2 attempts in a row failed before committing a checkpoint at all" in out, \
        out[-3000:]
    assert "NoProgress on rank 0 in phase init -> exit code 6" in out, out[-3000:]
    assert "step 1" not in (tmp_path / "b" / "events" / "rank_0.jsonl").read_text()


def test_slurm_script_is_valid_bash() -> None:
    proc = subprocess.run(["bash", "-n", str(EXAMPLES / "slurm.sbatch")], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0, proc.stderr
