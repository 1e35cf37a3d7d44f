"""examples/slurm.sbatch end to end on a real SLURM: a clean job, a usage error, a failure that is requeued and
resumes, the same failure with no progress until exit 6, a time limit (signal, save, requeue, resume) whose
requeued run is then stopped with `scancel --batch --signal=INT` (save, exit 0, no requeue), a preemption that
signals the tasks (save, unfinished, requeue, resume), a real preemption by a job of a higher partition (SLURM's default:
SIGTERM to the tasks; then with the user-signal setting: --signal to the batch shell); without requeue
(REQUEUE=0), a `--dependency=afternotok` chain of two jobs with one run id.

Every job is submitted at once by one fixture (the node oversubscribes the cores), so the tests' wall time is about
that of the longest job, the time limit (`--time=1` is the shortest SLURM has; slurmctld looks at time limits every
30 s). 2 tasks, gloo, the synthetic kind.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.distributed.runs import FAST, SYNTHETIC
from tests.helpers import ROOT
from tests.slurm.cluster import Slurm

pytestmark = pytest.mark.slurm

SCRIPT = ROOT / "examples" / "slurm.sbatch"
BASE = [*SYNTHETIC, *FAST, "checkpoint.grace_s=20"]
PREEMPT_STEPS = 100000  # the two real preemptions' jobs: unfinished whenever they are preempted
LEAD_S = 40  # >= checkpoint.grace_s + teardown.deadline_s (20 + 15): validate refuses a shorter lead
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
NOISE = ("frame #", "socket.cpp", "[c10d]", "retry", "Traceback")  # C++ traces, a store's connect retries


@dataclass
class Jobs:
    slurm: Slurm
    dir: Path
    ids: dict[str, int]
    held_since: dict[str, float] = field(default_factory=dict)

    def out(self, name: str) -> str:
        path = self.dir / f"slurm-{self.ids[name]}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def run_dir(self, name: str) -> Path:
        return self.dir / "runs" / f"lifecycle-{'chain' if name.startswith('chain') else self.ids[name]}"

    def wait(self, name: str, until: str = "ended", timeout_s: float = 120) -> dict[str, str]:
        """Poll the job until it ended (or its output shows ``until``), releasing every requeued job meanwhile."""
        job_id, deadline = self.ids[name], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.release_requeued()
            job = self.slurm.job(job_id)
            if until != "ended" and re.search(until, self.out(name)):
                return job
            if job.get("JobState") in ENDED:
                assert until == "ended", f"job {name} ({job_id}) ended before {until}: {job}\n{self.out(name)}"
                return job
            time.sleep(0.5)
        raise AssertionError(f"job {name} ({job_id}) not {until} within {timeout_s:.0f}s: {self.slurm.job(job_id)}\n"
                             f"{self.out(name)[-3000:]}")

    def release_requeued(self) -> None:
        """SLURM holds a requeued job ~120 s (its BeginTime) before it may start again: start it now, but not in the
        second its previous run's credential was revoked (slurmd would refuse the new run: "Job credential revoked",
        exit 1), so 2 s after it is first seen held. A longer time limit too, so that the time-limit job's second run
        is stopped by the test's scancel, not by its limit (longer than the example's signal lead of 5 minutes)."""
        held = self.slurm.tool("squeue", "-h", "-t", "PD", "-o", "%i %r", check=False).stdout.split("\n")
        now = time.monotonic()
        for job_id in [line.split()[0] for line in held if line.endswith("BeginTime")]:
            if now - self.held_since.setdefault(job_id, now) >= 2.0:
                self.slurm.tool("scontrol", "update", f"JobId={job_id}", "StartTime=now", "TimeLimit=30", check=False)
                del self.held_since[job_id]


@pytest.fixture(scope="module")
def jobs(slurm: Slurm, tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    work = tmp_path_factory.mktemp("slurm-jobs")
    # `lifecycle` and a python3 with torch (the store the batch shell hosts) are those of the Python running the tests
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}

    def submit(*overrides: str, sbatch: tuple[str, ...] = (), **extra: str) -> int:
        return slurm.sbatch(SCRIPT, *overrides, env={**env, **extra}, cwd=work, sbatch=(
            "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", f"--output={work}/slurm-%j.out", *sbatch))

    slow = ["train.steps=2000", "+train.options.step_sleep_s=0.05", "checkpoint.every_steps=1000"]
    ids = {  # the longest first
        "time_limit": submit(*BASE, *slow, sbatch=("--time=1", f"--signal=B:TERM@{LEAD_S}"),
                             LIFECYCLE_SIGNAL_LEAD_S=str(LEAD_S)),
        # never finished by itself: on a loaded machine the tests before its own took longer than its 1,200 steps
        # once, and the test's signal found the job gone; it stops when its test says so
        "preempted": submit(*BASE, f"train.steps={PREEMPT_STEPS}", "+train.options.step_sleep_s=0.05",
                            "checkpoint.every_steps=100"),
        "clean": submit(*BASE, "train.steps=6", "checkpoint.every_steps=3"),
        "failure": submit(*BASE, "train.steps=6", "checkpoint.every_steps=2",
                          "+faults=[{at: train, ranks: [1], action: crash, step: 3, attempts: [1]}]"),
        "no_progress": submit(*BASE, "train.steps=6", "restart.max_no_progress=2",
                              "+faults=[{at: train, ranks: [1], action: crash, step: 1}]"),
        "usage": submit(*BASE, "train.stepz=6"),
    }
    # A real preemption: each in partition `low` holding a resource that a job in `high` will take (cluster.py)
    # (never finished: their tests run last; the test stops each with INT once preempted and resumed)
    for name, gres in (("preempt_tasks", "lowa"), ("preempt_shell", "lowb")):
        ids[name] = submit(*BASE, f"train.steps={PREEMPT_STEPS}", "+train.options.step_sleep_s=0.05",
                           "checkpoint.every_steps=100", sbatch=("--partition=low", f"--gres={gres}:1"))
    # Where the job cannot requeue itself (REQUEUE=0, no scontrol in a container): a chain of jobs with one run id.
    crash = [*BASE, "run.id=chain", "train.steps=6", "checkpoint.every_steps=2",
             "+faults=[{at: train, ranks: [1], action: crash, step: 3, attempts: [1]}]"]
    ids["chain_1"] = submit(*crash, REQUEUE="0")
    ids["chain_2"] = submit(*crash, REQUEUE="0", sbatch=(f"--dependency=afternotok:{ids['chain_1']}",
                                                         "--kill-on-invalid-dep=yes"))
    return Jobs(slurm, work, ids)


def _state(job: dict[str, str]) -> tuple[str, str, int]:
    return job["JobState"], job["ExitCode"], int(job["Restarts"])


def _quiet(out: str) -> None:
    noisy = [line for line in out.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, noisy[:10]


@pytest.mark.timeout(180)  # the first test: also installs SLURM when missing (100 s at most) and starts it
def test_a_clean_job_commits_in_the_jobs_run_directory_and_exits_0(jobs: Jobs) -> None:
    job = jobs.wait("clean")
    out, run_dir, job_id = jobs.out("clean"), jobs.run_dir("clean"), jobs.ids["clean"]
    assert _state(job) == ("COMPLETED", "0:0", 0), out
    assert f"lifecycle: job {job_id}, run 1 on" in out
    assert f"checkpoint step 6 committed: runs/lifecycle-{job_id}/checkpoints/iter_0000006" in out
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000006"
    assert f"id: '{job_id}'" in (run_dir / "policy.resolved.yaml").read_text()  # SLURM_JOB_ID is the run id
    _quiet(out)


@pytest.mark.timeout(60)
def test_a_usage_error_ends_the_job_with_2_and_is_not_requeued(jobs: Jobs) -> None:
    job = jobs.wait("usage")
    out = jobs.out("usage")
    assert _state(job) == ("FAILED", "2:0", 0), out
    assert "train.stepz: unknown key; did you mean train.steps" in out
    assert "requeue" not in out


@pytest.mark.timeout(150)
def test_a_failed_rank_is_requeued_and_the_next_run_resumes_from_the_last_commit(jobs: Jobs) -> None:
    job = jobs.wait("failure")
    out = jobs.out("failure")
    assert _state(job) == ("COMPLETED", "0:0", 1), out
    assert f"lifecycle: exit 4; requeueing job {jobs.ids['failure']}" in out
    assert "exit 4: rank 1 (dead in phase train)" in out  # `lifecycle verdict`: the ranks' code, not srun's
    assert "attempt 2: resumed from step 2" in out
    assert "checkpoint step 6 committed" in out


@pytest.mark.timeout(150)
def test_the_same_failure_with_no_progress_stops_at_6_without_a_further_requeue(jobs: Jobs) -> None:
    job = jobs.wait("no_progress")
    out = jobs.out("no_progress")
    assert _state(job) == ("FAILED", "6:0", 2), out  # two runs failed; the third refuses to start
    assert out.count("lifecycle: exit 4; requeueing") == 2
    assert "2 attempts in a row failed before committing a checkpoint at all; not restarting" in out
    assert "exit 6" in out.split(", run 3 on")[-1]


@pytest.mark.timeout(170)
def test_a_time_limit_saves_requeues_and_resumes_then_a_preemption_saves_and_ends_0(jobs: Jobs) -> None:
    job_id = jobs.ids["time_limit"]
    jobs.wait("time_limit", until=r"run 2 on .*\n(.*\n)*\[rank 0\] train step", timeout_s=150)
    jobs.slurm.tool("scancel", "--batch", "--signal=INT", str(job_id))
    job = jobs.wait("time_limit", timeout_s=60)
    out = jobs.out("time_limit")
    assert _state(job) == ("COMPLETED", "0:0", 1), out
    first, second = out.split(f"lifecycle: job {job_id}, run 2 on")
    assert f"the time limit comes; requeueing job {job_id}" in first
    assert "DUE TO TIME LIMIT" not in out  # the ranks saved and left before the limit: nothing was killed
    # slurmctld looks at time limits every 30 s: the signal may come while the ranks still start (a loaded machine),
    # and then they stop before training with nothing to save; else they save, and the next run resumes there
    saves = re.findall(r"\[rank 0\] WARNING lifecycle.phases.train: preempted at step (\d+), saved", first)
    if saves:
        [saved] = saves
        assert f"attempt 2: resumed from step {saved} " in second
    else:  # stopped while starting (the launcher's line) or after its set-up, before step 1 (the ranks')
        assert "a stop before training; leaving now (exit 0)" in first or \
            "preemption signal before training: stopping without a checkpoint" in first, first[-3000:]
        saved = "0"
    [stopped] = re.findall(r"\[rank 0\] WARNING lifecycle.phases.train: preempted at step (\d+), saved", second)
    assert int(stopped) > int(saved)
    assert (jobs.run_dir("time_limit") / "checkpoints" / "latest").read_text().strip() == f"iter_{int(stopped):07d}"
    assert "requeue" not in second
    _quiet(out)


@pytest.mark.timeout(170)
def test_a_preemption_that_signals_the_tasks_requeues_the_unfinished_run_and_it_resumes(jobs: Jobs) -> None:
    # SLURM's preemption (PreemptMode=REQUEUE) signals the job's tasks, not the batch shell: `scancel --signal=TERM`
    # does the same. The ranks save and exit 0 before their last step; the job must not end COMPLETED there.
    job_id = jobs.ids["preempted"]
    jobs.wait("preempted", until=r"checkpoint step \d+ committed", timeout_s=150)  # training (and committing) now
    jobs.slurm.tool("scancel", "--signal=TERM", str(job_id))
    jobs.wait("preempted", until=r"run 2 on .*\n(.*\n)*attempt 2: resumed from step", timeout_s=120)
    jobs.slurm.tool("scancel", "--batch", "--signal=INT", str(job_id))
    job = jobs.wait("preempted", timeout_s=60)
    out = jobs.out("preempted")
    assert _state(job) == ("COMPLETED", "0:0", 1), out
    first, second = out.split(f"lifecycle: job {job_id}, run 2 on")
    [saved] = re.findall(r"\[rank 0\] WARNING lifecycle.phases.train: preempted at step (\d+), saved", first)
    assert f"preempted at step {saved}, saved (SIGTERM, step {saved} of {PREEMPT_STEPS}: unfinished" in first, \
        first[-3000:]
    assert f"the job was preempted (its ranks saved before the last step); requeueing job {job_id}" in first
    assert f"attempt 2: resumed from step {saved} " in second, second[-3000:]
    assert "requeue" not in second
    _quiet(out)


def _preempted(jobs: Jobs, name: str, gres: str) -> tuple[dict[str, str], str, str, str]:
    """Let the job train, have a job in partition `high` take its resource, wait for the requeued run to train,
    stop it (INT to the batch shell); the job's state, the first run's and the second run's output, the step saved."""
    job_id = jobs.ids[name]
    jobs.wait(name, until=r"checkpoint step \d+ committed", timeout_s=150)  # training (and committing) now
    jobs.slurm.tool("sbatch", "--parsable", "--partition=high", f"--gres={gres}:1", "--ntasks=1", "--output=/dev/null",
                    "--wrap", "sleep 1")
    jobs.wait(name, until=r"run 2 on .*\n(.*\n)*attempt 2: resumed from step", timeout_s=120)
    jobs.slurm.tool("scancel", "--batch", "--signal=INT", str(job_id))
    job = jobs.wait(name, timeout_s=60)
    out = jobs.out(name)
    assert _state(job) == ("COMPLETED", "0:0", 1), out
    first, second = out.split(f"lifecycle: job {job_id}, run 2 on")
    [saved] = re.findall(r"\[rank 0\] WARNING lifecycle.phases.train: preempted at step (\d+), saved", first)
    assert f"attempt 2: resumed from step {saved} " in second, second[-3000:]
    assert "requeue" not in second  # stopped by INT: while it starts or once it trains, it ends 0
    _quiet(out)
    return job, first, second, saved


@pytest.mark.timeout(170)
def test_a_real_preemption_signals_the_tasks_and_the_unfinished_run_is_requeued_and_resumes(jobs: Jobs) -> None:
    # slurm.conf's default: SIGTERM to the tasks, within GraceTime; the ranks save and exit 0, and so would the job
    # (COMPLETED, never requeued) but for the run's verdict: unfinished
    _, first, _, saved = _preempted(jobs, "preempt_tasks", "lowa")
    assert f"preempted at step {saved}, saved (SIGTERM, step {saved} of {PREEMPT_STEPS}: unfinished" in first, first[-3000:]
    assert f"the job was preempted (its ranks saved before the last step); requeueing job {jobs.ids['preempt_tasks']}" \
        in first


@pytest.mark.timeout(170)
def test_a_real_preemption_with_the_user_signal_setting_signals_the_shell_and_is_requeued_as_one(jobs: Jobs) -> None:
    # send_user_signal (its name by SLURM version): the batch shell gets the job's --signal=B:TERM, as at a time limit;
    # the ranks get SIGUSR1 from it, save, and the job is requeued saying why: a preemption, not the time limit
    line = jobs.slurm.send_user_signal_at_preemption()
    _, first, _, saved = _preempted(jobs, "preempt_shell", "lowb")
    assert "[rank 1] WARNING lifecycle.machine.session: SIGUSR1 received: will save and stop" in first, (line, first)
    assert f"the job was preempted (SLURM sent this shell its --signal); requeueing job {jobs.ids['preempt_shell']}" \
        in first, first[-3000:]
    assert "the time limit comes" not in first


@pytest.mark.timeout(150)
def test_without_requeue_a_dependency_chain_resumes_the_same_run(jobs: Jobs) -> None:
    first, second = jobs.wait("chain_1"), jobs.wait("chain_2")
    out_1, out_2 = jobs.out("chain_1"), jobs.out("chain_2")
    assert _state(first) == ("FAILED", "4:0", 0), out_1
    assert "exit 4; job" in out_1 and "not requeued (REQUEUE=0" in out_1
    assert _state(second) == ("COMPLETED", "0:0", 0), out_2  # started because the first failed (afternotok)
    assert "attempt 2: resumed from step 2" in out_2 and "checkpoint step 6 committed: runs/lifecycle-chain/" in out_2
