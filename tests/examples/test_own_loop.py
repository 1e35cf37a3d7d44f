"""examples/own_loop/megatron_core_loop.py under torchrun (gloo, real megatron-core GPT-MoE, EP=2): the trainer
owns its loop and adopts lifecycle with ``attach``/``watch``/``steps``.

The whole loop, its resume, the groups it warms and a hang in the trainer's own step run at world 4; a SIGTERM sent
to one rank's process, the trainer's own save and a wrong layout at world 2,
where each rank still has a peer in every group that matters (its expert-parallel partner, the data-parallel group)
at half the start-up (each torchrun rank imports megatron-core itself).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lifecycle.obs.events import read_events
from tests._dist import free_port
from tests.helpers import ROOT

pytestmark = [pytest.mark.distributed]
EXAMPLE = ROOT / "examples" / "own_loop" / "megatron_core_loop.py"


def _cmd(nproc: int, args: list[str], overrides: list[str], torchrun: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id",
            f"own-{os.getpid()}-{time.monotonic_ns()}", *torchrun, str(EXAMPLE), *args, "--", *overrides]


def _env(notes: Path | None = None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            **({"LIFECYCLE_EXAMPLE_NOTES": str(notes)} if notes is not None else {})}


def _run(tmp_path: Path, args: list[str], *overrides: str, nproc: int = 4, timeout: float = 100,
         torchrun: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cmd(nproc, args, [f"run.dir={tmp_path / 'run'}", "run.timeline=trace", *overrides], torchrun),
                          capture_output=True, text=True, timeout=timeout, env=_env(tmp_path / "notes"), cwd=tmp_path)


def _notes(tmp_path: Path, what: str) -> list[int]:
    """The ranks that left the example's mark ``what`` (its finally, atexit, own SIGTERM handler, own destroy)."""
    return sorted(int(p.name.rsplit("_", 1)[1]) for p in (tmp_path / "notes").glob(f"{what}.rank_*"))


def _exits(run_dir: Path) -> dict[int, int]:
    return {r: [e for e in evs if e["name"] == "exit"][-1]["exit_code"] for r, evs in read_events(run_dir).items()}


@pytest.mark.timeout(170)
def test_the_own_loop_warms_saves_commits_and_a_rerun_resumes(tmp_path: Path) -> None:
    """Also the shape of Megatron-LM's pretrain(): 3.5 s of set-up after attach and 3.5 s of evaluation between
    steps (job.phase) under a 3 s step deadline are no hang; the trainer destroys its own group after close."""
    run = tmp_path / "run"
    shm = tmp_path / "shm"
    shm.mkdir()
    proc = _run(tmp_path, ["--steps", "4", "--setup-s", "3.5", "--eval-every", "3", "--eval-s", "3.5"],
                "checkpoint.every_steps=2", "watchdog.deadlines.step=3", "checkpoint.memory.every_steps=1",
                f"checkpoint.memory.dir={shm}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert _exits(run) == {0: 0, 1: 0, 2: 0, 3: 0}
    assert not (run / "hang_report.json").exists() and "HANG" not in proc.stderr
    assert _notes(tmp_path, "destroyed") == [0, 1, 2, 3]  # lifecycle left the trainer's default group to it
    evals = [e for e in read_events(run)[2] if e["name"] == "eval" and e["kind"] == "end"]
    assert [e["step"] for e in evals] == [3] and all(e["dur_us"] > 3.2e6 for e in evals), evals
    setup = next(e for e in read_events(run)[0] if e["name"] == "setup" and e["kind"] == "end")
    assert setup["deadline"] == "setup" and setup["dur_us"] > 3.2e6
    warmed = {e["group"] for e in read_events(run)[1] if e["name"] == "warm:all_reduce" and e["kind"] == "end"}
    assert {"ep", "edp=intra_edp", "dp", "world"} <= warmed, warmed
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "iter_0000004"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (ckpt / "iter_0000002" / "manifest.json").is_file() and (ckpt / "iter_0000004" / "metadata.json").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["loss"]["steps"] == 4 and summary["loss"]["last"] < summary["loss"]["first"]
    assert [c["step"] for c in summary["checkpoints"] if c["committed"]] == [2, 4]
    spans = {e["name"] for e in read_events(run)[0] if e["kind"] == "end"}
    assert {"grad_reduce", "step", "watch", "setup", "commit"} <= spans, spans  # DDP buckets traced as spans
    # the memory tier in the trainer's loop: a copy at every step on every rank, exchanged with its buddy, each
    # saved state checked (finite, replicas alike on dp_cp and edp), the copies removed when the run finished
    copies = {r: sorted(e["step"] for e in evs if e["name"] == "memory_saved"
                  and e.get("error") is None and e["held"] > 0) for r, evs in read_events(run).items()}
    assert copies == {r: [1, 2, 3, 4] for r in range(4)}, copies
    checked = {e["group"] for e in read_events(run)[3] if e["name"] == "replica_check" and e["kind"] == "end"}
    assert checked == {"dp_cp", "edp"}, checked
    assert list(shm.iterdir()) == []
    last_loss = summary["loss"]["last"]

    again = _run(tmp_path, ["--steps", "6"], "checkpoint.every_steps=2")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-4000:]
    assert "attempt 2: resumed from step 4" in again.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["attempt"] == 2 and summary["resumed_from"] == 4 and summary["last_step"] == 6
    assert summary["loss"]["steps"] == 2 and summary["loss"]["first"] < last_loss + 0.5  # the trained model, resumed
    assert (run / "attempts" / "1" / "summary.json").is_file()
    assert (ckpt / "latest").read_text().strip() == "iter_0000006"


@pytest.mark.timeout(120)
def test_a_rank_frozen_in_the_trainers_step_is_named_and_every_rank_exits_with_the_hang_code(tmp_path: Path) -> None:
    t0 = time.monotonic()
    # world 4: the waiting ranks' open collectives name the frozen one (at world 2 both sit in a step: undecided)
    proc = _run(tmp_path, ["--steps", "6", "--freeze", "2:3", "--eval-every", "1"], "watchdog.deadlines.step=5")
    took = time.monotonic() - t0
    run = tmp_path / "run"
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert set(_exits(run).values()) == {3}, _exits(run)
    report = json.loads((run / "hang_report.json").read_text())
    shown = json.dumps({k: report.get(k) for k in ("detail", "culprits", "waits", "ranks", "dead")})
    assert report["cause"] == "hang" and report["culprits"] == [2], shown  # not its expert-parallel partner
    assert {w["step"] for w in report["waits"].values()} == {3}
    assert "HANG" in proc.stderr and "ranks named: [2]" in proc.stderr
    assert took < 60, took  # start-up (~15 s) + the 5 s deadline + the exit, never the hour the step sleeps


@pytest.mark.timeout(120)
def test_sigterm_to_one_rank_saves_on_every_rank_and_exits_0(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen(_cmd(2, ["--steps", "40", "--step-sleep", "0.3", "--own-sigterm"], [f"run.dir={run}"]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(tmp_path / "notes"),
                            cwd=tmp_path)
    try:
        target = _wait_for_step(run, rank=1, step=2, deadline_s=80)
        os.kill(target, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    stop = [e for e in read_events(run)[0] if e["name"] == "exit"][-1]["stop_step"]
    assert stop is not None and 2 <= stop < 40
    assert _exits(run) == {0: 0, 1: 0}
    assert (run / "checkpoints" / "latest").read_text().strip() == f"iter_{stop:07d}"
    assert f"preempted at step {stop}, saved" in out
    assert _notes(tmp_path, "own_sigterm") == [1]  # the trainer's own handler, chained after lifecycle's


def _wait_for_step(run: Path, *, rank: int, step: int, deadline_s: float) -> int:
    """The pid of ``rank`` once its events show ``step`` done."""
    ends = time.monotonic() + deadline_s
    while time.monotonic() < ends:
        path = run / "events" / f"rank_{rank}.jsonl"
        if path.is_file() and '"name": "stop_flag"' in path.read_text() and any(
                e["name"] == "step" and e["kind"] == "end" and e.get("step", 0) >= step
                for e in read_events(run).get(rank, [])):
            for pid in _pids(EXAMPLE.name):
                if f"RANK={rank}" in _environ(pid):
                    return pid
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never finished step {step}")


def _pids(name: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if name in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _environ(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


@pytest.mark.megatron
@pytest.mark.timeout(120)
def test_the_trainers_own_save_is_wrapped_committed_and_tracked(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _run(tmp_path, ["--steps", "4", "--own-save"], "checkpoint.every_steps=2", nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    own = run / "own_checkpoints"
    assert (own / "latest").read_text().strip() == "iter_0000004"
    assert (own / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert sorted(p.name for p in own.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    assert (own / "iter_0000002" / "manifest.json").is_file()
    assert not (run / "checkpoints" / "latest").exists()  # lifecycle saved nothing of its own
    names = [e["name"] for e in read_events(run)[1] if e["kind"] == "end"]
    assert names.count("barrier:ckpt_written") == 2 and names.count("commit") == 2


@pytest.mark.timeout(120)
def test_a_live_layout_that_is_not_the_policys_fails_on_every_rank_naming_both(tmp_path: Path) -> None:
    # torchrun stops the other ranks at its first look after one failed (every 0.1 s by default): looking every 4 s
    # lets each rank reach its own check (on 2 busy cores one can be a second behind), which is what is tested.
    proc = _run(tmp_path, ["--steps", "2", "--ep", "2"], "parallelism.ep=1", nproc=2,
                torchrun=("--monitor-interval", "4"))
    assert proc.returncode != 0
    err = proc.stderr
    assert err.count("parallelism.ep: the trainer's model-parallel groups have ep=2, the policy 1") == 2, err[-3000:]
    assert "PolicyError" in err


@pytest.mark.timeout(120)
def test_an_error_in_the_trainers_code_goes_to_the_trainer_and_its_peers_leave_in_one_line(tmp_path: Path) -> None:
    """The recipe's explicit close(): rank 1's own code raises at step 2. lifecycle records it and passes it on (rank
    1's finally and atexit run, its traceback is the trainer's), rank 0's broken collective is named as the
    consequence in one line; both leave with the rank-failed code."""
    proc = _run(tmp_path, ["--steps", "4", "--raise-at", "1:2", "--explicit-close"], "watchdog.deadlines.step=20",
                nproc=2)
    run = tmp_path / "run"
    assert proc.returncode != 0
    assert _exits(run) == {0: 4, 1: 4}, _exits(run)
    assert _notes(tmp_path, "finally") == [0, 1] and _notes(tmp_path, "atexit") == [0, 1]
    err = proc.stderr
    assert "RuntimeError: the trainer's own code failed at step 2" in err
    assert "lifecycle: PeerFailed on rank 0: rank 1 failed first (rank 1 raised RuntimeError" in err, err[-4000:]
    assert "[rank0]: Traceback" not in err and "[rank0]: RuntimeError" not in err  # the innocent rank: no traceback
