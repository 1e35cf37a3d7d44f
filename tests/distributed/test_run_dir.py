"""The run directory as hostile input: two launchers, a FIFO where lifecycle keeps a file, foreign or nested folders,
a rank that would resume another step than its peers, a broken launcher environment. Each is refused with exit 2
naming the file or key (most before any rank starts); nothing hangs; committed work stays."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.runs import FAST, SYNTHETIC, lifecycle_run
from tests.helpers import ROOT, fill_up, run_cli

pytestmark = [pytest.mark.distributed]
QUICK = [*SYNTHETIC, *FAST, "train.steps=4", "checkpoint.every_steps=2"]


def _refused(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(60)
def test_places_a_run_must_not_take_are_refused_before_launch(tmp_path: Path) -> None:
    t0 = time.monotonic()
    _refused(run_cli("run", "--nproc", "2", *QUICK, "run.dir=/"), "run.dir: is /, a system or home folder itself")
    _refused(run_cli("run", "--nproc", "2", *QUICK, f"run.dir={tmp_path / 'r'}", "checkpoint.dir=${run.dir}/events/c"),
             "checkpoint.dir: lies inside", "/events, which lifecycle moves aside")
    foreign = tmp_path / "foreign"
    (foreign / "events").mkdir(parents=True)
    (foreign / "events" / "rank_0.jsonl").write_text("")
    (foreign / "notes.txt").write_text("mine")
    _refused(run_cli("run", "--nproc", "2", *QUICK, f"run.dir={foreign}"),
             "run.dir: is a non-empty folder lifecycle did not make (events, notes.txt)", "run.adopt_existing=true")
    assert (foreign / "events").is_dir() and not (foreign / "attempts").exists()  # nothing was moved
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    _refused(run_cli("run", "--nproc", "2", *QUICK, f"run.dir={loop / 'x'}"), "run.dir")
    _refused(run_cli("run", "--nproc", "2", *QUICK, f"run.dir={tmp_path / ('d' * 300)}"), "run.dir")
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(60)
def test_a_fifo_as_attempt_counter_or_tracker_is_named_not_waited_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lifecycle-run").write_text("a lifecycle run directory\n")
    (run / "events").mkdir()
    os.mkfifo(run / "attempt")
    _refused(run_cli("run", "--nproc", "2", *QUICK, f"run.dir={run}", timeout=30), "attempt: is a FIFO")
    (run / "attempt").unlink()
    (run / "checkpoints").mkdir(exist_ok=True)
    os.mkfifo(run / "checkpoints" / "latest")
    _refused(run_cli("run", "--nproc", "2", *QUICK, f"run.dir={run}", timeout=30), "latest", "is a FIFO")


@pytest.mark.timeout(120)
def test_a_second_launcher_is_refused_and_the_first_is_undisturbed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "lifecycle", "run", "--nproc", "2", f"run.dir={run}", *SYNTHETIC,
                              *FAST, "train.steps=30", "train.options.step_sleep_s=0.2", "checkpoint.every_steps=10"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ends = time.monotonic() + 60
        while not (run / "events" / "rank_1.jsonl").is_file() and time.monotonic() < ends:
            time.sleep(0.2)
        second = run_cli("run", "--nproc", "2", *QUICK, f"run.dir={run}", timeout=30)
        _refused(second, f"run directory {run} is in use by another launcher (host ", f"pid {first.pid}")
        out, err = first.communicate(timeout=90)
    finally:
        first.kill()
    assert first.returncode == 0, out[-2000:] + err[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["attempt"] == 1 and summary["last_step"] == 30
    assert not (run / "attempts").exists()


@pytest.mark.timeout(60)
def test_fifos_left_where_a_rerun_writes_are_refused_by_name_never_replaced(tmp_path: Path) -> None:
    """A FIFO where a run writes (its summary, a rank's log: a shell redirection would wait on it forever) is refused
    with exit 2 naming it before anything is moved or written; an earlier attempt's summary left as a FIFO in
    attempts/ is read as "no summary" (tests/unit/test_safeio.py)."""
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    (run / ".lifecycle-run").write_text("a lifecycle run directory\n")
    (run / "attempt").write_text("1\n")
    (run / "events" / "rank_0.jsonl").write_text(json.dumps(
        {"t": 10, "rank": 0, "host": "h", "phase": "init", "kind": "instant", "name": "attempt", "attempt": 1}) + "\n")
    for name in ("summary.json", "logs/rank_1.log"):
        (run / name).parent.mkdir(exist_ok=True)
        os.mkfifo(run / name)
        _refused(run_cli("run", "--nproc", "2", *QUICK, f"run.dir={run}", timeout=30),
                 f"{run / name}: is a FIFO, not a regular file; lifecycle writes only regular files", "remove it")
        assert (run / name).is_fifo() and (run / "attempt").read_text() == "1\n" and not (run / "attempts").exists()
        (run / name).unlink()
    proc = run_cli("timeline", str(run), "--out", str(run / "events" / "rank_0.jsonl"))
    _refused(proc, "would overwrite the run's own events")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("verify", ["digest", "size"])
def test_a_rank_whose_files_hold_another_step_stops_every_rank_before_step_1(tmp_path: Path, verify: str) -> None:
    first = lifecycle_run(tmp_path, 2, *QUICK, f"checkpoint.verify={verify}")
    assert first.code == 0, first.output
    ckpt = first.run_dir / "checkpoints"
    manifest = json.loads((ckpt / "iter_0000004" / "manifest.json").read_text())["files"]
    assert isinstance(manifest["rank_1.pt"], dict if verify == "digest" else int), manifest
    # rank 1's shard of the tracked step 4 replaced by its step-2 file: same size, so the manifest's sizes agree
    shutil.copyfile(ckpt / "iter_0000002" / "rank_1.pt", ckpt / "iter_0000004" / "rank_1.pt")
    again = lifecycle_run(tmp_path, 2, *QUICK, "train.steps=6", f"checkpoint.verify={verify}", timeout=60)
    assert again.code == 2, again.output
    if verify == "digest":  # rank 1 checks its share of the files against the digests recorded at commit
        assert re.search(r"iter_0000004: rank_1\.pt does not hold what was committed \(sha256 \w+\.\.\., \w+\.\.\. at "
                         r"commit\)", again.output), again.output
    else:  # sizes agree: the ranks' loaded steps are compared before step 1
        assert "loads different steps on different ranks (step 2: ranks [1]; step 4: ranks [0])" in again.output
    steps = [e for evs in again.events().values() for e in evs if e["name"] == "step"]
    assert steps == []  # no rank trained a step
    assert (ckpt / "latest").read_text().strip() == "iter_0000004" and (ckpt / "iter_0000002").is_dir()


@pytest.mark.timeout(150)
def test_a_resume_at_another_world_is_resharded_on_every_rank_and_another_steps_files_are_refused(
        tmp_path: Path) -> None:
    """A world-size change is not damage: with checkpoint.on_corrupt=fallback (the advice once given for it) every
    rank of the new world loads step 4 and nothing is set aside; a folder holding another step's files (its manifest
    copied along) is refused before any rank starts."""
    import torch

    first = lifecycle_run(tmp_path, 2, *QUICK)
    assert first.code == 0, first.output
    forged = tmp_path / "forged" / "run"
    shutil.copytree(first.run_dir, forged)
    again = lifecycle_run(tmp_path, 3, *QUICK, "train.steps=6", "checkpoint.on_corrupt=fallback", timeout=90)
    assert again.code == 0, again.output
    assert "resuming iter_0000004 resharded: world_size 2 -> 3, dp 2 -> 3" in again.output, again.output
    ckpt = again.run_dir / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["iter_0000004", "iter_0000006"]  # none aside
    resumed = {r: [e.get("step") for e in evs if e["name"] == "step" and e["kind"] == "begin"][:1]
               for r, evs in again.events().items()}
    assert resumed == {0: [5], 1: [5], 2: [5]}, resumed
    # Every rank trained on from the same weights: the dp replicas saved at step 6 are equal.
    saved = [torch.load(ckpt / "iter_0000006" / f"rank_{r}.pt", weights_only=True)["model"] for r in range(3)]
    assert all(torch.equal(saved[0][k], other[k]) for other in saved[1:] for k in saved[0])

    for f in (forged / "checkpoints" / "iter_0000002").iterdir():  # step 2's files, manifest too, as step 4
        shutil.copyfile(f, forged / "checkpoints" / "iter_0000004" / f.name)
    refused = lifecycle_run(forged.parent, 2, *QUICK, "train.steps=6", timeout=60)
    assert refused.code == 2, refused.output
    assert "manifest.json records step 2: the folder holds the files of another save" in refused.output
    assert not (forged / "attempts").exists()  # refused before any rank started


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "value", "needle"), [
    ("MASTER_PORT", "abc", "MASTER_PORT='abc' is not a port number"),
    ("MASTER_PORT", "99999", "MASTER_PORT='99999' is not a port number"),
    ("MASTER_ADDR", "", "MASTER_ADDR is not set"),
])
def test_a_broken_launcher_environment_is_named_at_once(tmp_path: Path, name: str, value: str, needle: str) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           name: value}
    t0 = time.monotonic()
    _refused(run_cli("run", *QUICK, f"run.dir={tmp_path / 'run'}", env=env, timeout=30), needle)
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(60)
def test_a_reader_that_leaves_neither_stops_the_job_nor_changes_its_exit_code(tmp_path: Path) -> None:
    """`lifecycle run ... | head -c 300`: the launcher's stdout breaks while torch's log tailer copies rank 0's log
    to it; the job still runs to its end (summary, trace) and exits with its own code, and nothing is said about the
    pipe."""
    run = tmp_path / "run"
    err = tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "lifecycle", "run", "--nproc", "2", f"run.dir={run}", *QUICK,
                                 "train.steps=6", "+faults=[{at: train, step: 5, ranks: [1], action: raise}]"],
                                stdout=subprocess.PIPE, stderr=stderr, cwd=ROOT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            assert proc.stdout is not None and len(proc.stdout.read(300)) == 300
            proc.stdout.close()  # the reader leaves, as `head -c 300` does
            assert proc.wait(60) == 4
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    said = err.read_text()
    assert "Traceback" not in said and "pipe" not in said.lower() and "log tailer" not in said, said[-3000:]
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 4 and (run / "trace.json").is_file()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("breakage", ["read-only", "full"])
def test_a_checkpoint_folder_broken_mid_run_is_one_line_exit_4_and_the_last_commit_stays(
        tmp_path: Path, breakage: str) -> None:
    """The checkpoint folder is remounted read-only (or fills up) after the first commit: the next save fails on
    every rank with one line naming the folder and why (no traceback, in the launcher's output or a rank's log), the
    job exits 4 and the committed step 2 stays intact and tracked. Before any rank starts, a full folder is exit 2
    (tests/cli/test_hostile.py)."""
    from lifecycle.checkpoint import ckptdir

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    ck = tmp_path / "ck"
    ck.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ck)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode()[:200]}")
    proc: subprocess.Popen[str] | None = None
    try:
        proc = _launch(tmp_path / "run", 30, f"checkpoint.dir={ck}", "train.options.step_sleep_s=0.25")
        deadline = time.monotonic() + 60
        while not (ck / ckptdir.TRACKER).is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if breakage == "full":
            fill_up(ck)
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(ck)], check=True, timeout=10)
        out, _ = proc.communicate(timeout=60)
        what = "a read-only file system: cannot write" if breakage == "read-only" else "a full file system:"
        assert proc.returncode == 4 and f"checkpoint.dir {ck} is on {what}" in out, out[-3000:]
        logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("rank_*.log"))
        assert "Traceback" not in out + logs and f"StorageError: checkpoint.dir {ck}" in logs, out[-3000:]
        assert ckptdir.read_tracker(ck).name == "iter_0000002" and ckptdir.problem(ck / "iter_0000002") is None
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["exit_code"] == 4 and summary["failures"]
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["umount", "-l", str(ck)], capture_output=True, timeout=10)


def _launch(run_dir: Path, steps: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "lifecycle", "run", "--nproc", "2", f"run.dir={run_dir}", *SYNTHETIC,
                             *FAST, f"train.steps={steps}", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def _tracked(run_dir: Path) -> int:
    tracker = run_dir / "checkpoints" / "latest"
    return int(tracker.read_text().split("_")[1]) if tracker.is_file() else 0


def _one_run(run_dir: Path, how: str, steps: int) -> int | None:
    """One attempt: ``ok`` trains to the end, ``crash`` loses rank 1 at a step (exit 4), ``kill`` SIGKILLs the launcher
    and its ranks from outside once the attempt committed a checkpoint (no exit code, no summary). Returns the code."""
    before = _tracked(run_dir)
    if how == "crash":
        proc = _launch(run_dir, steps, f"+faults=[{{at: train, step: {before + 3}, ranks: [1], action: crash}}]")
    elif how == "kill":
        proc = _launch(run_dir, steps, "train.options.step_sleep_s=0.05")
    else:
        proc = _launch(run_dir, steps)
    try:
        if how == "kill":
            deadline = time.monotonic() + 60
            while _tracked(run_dir) <= before and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            return None
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == (0 if how == "ok" else 4), out[-3000:]
        return proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.mark.timeout(170)
def test_any_sequence_of_runs_kills_and_reruns_keeps_committed_work_and_lists_every_attempt(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    from hypothesis import HealthCheck, Phase, example, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=1, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.lists(st.sampled_from(["ok", "crash", "kill"]), min_size=2, max_size=3))
    @example(["crash", "kill"])  # each launch costs seconds: one fixed mix, one drawn (no shrinking)
    def runs(plan: list[str]) -> None:
        run_dir = tmp_path_factory.mktemp("seq") / "run"
        codes: list[int | None] = []
        newest = 0
        for n, how in enumerate([*plan, "ok"], start=1):  # the last re-run always finishes
            codes.append(_one_run(run_dir, how, steps=8 * n))
            tracked = _tracked(run_dir)
            assert tracked >= newest, f"attempt {n} ({how}): the tracker went back from step {newest} to {tracked}"
            newest = tracked
            ckpt = run_dir / "checkpoints"
            # Every committed checkpoint is there or was pruned by keep_last (the newest two, plus the one the last
            # attempt resumed from, which pruning never takes), and what is there is complete.
            kept = sorted(p.name for p in ckpt.iterdir() if re.fullmatch(r"iter_\d{7}", p.name))
            assert kept[-1] == f"iter_{tracked:07d}" and len(kept) <= 3, kept
            from lifecycle.checkpoint import ckptdir

            assert all(ckptdir.problem(ckpt / k) is None for k in kept), kept
        assert codes[-1] == 0 and newest == 8 * (len(plan) + 1)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["attempt"] == len(plan) + 1 and summary["exit_code"] == 0
        earlier = summary["earlier_attempts"]
        assert [a["attempt"] for a in earlier] == list(range(1, len(plan) + 1)), earlier
        for attempt, code in zip(earlier, codes, strict=False):
            if code is None:
                assert attempt["outcome"] == "no summary (the launcher did not finish)", attempt
            else:
                assert attempt["exit_code"] == code, (attempt, codes)
        # goodput over every attempt, killed ones included: the buckets sum to the wall time, each final step once
        g = summary["goodput"]
        assert abs(sum(g["buckets_s"].values()) - g["wall_s"]) < 0.01 and min(g["buckets_s"].values()) >= 0, g
        assert g["steps"]["productive"] == newest and g["attempts"] == len(plan) + 1, (plan, g)

    runs()
