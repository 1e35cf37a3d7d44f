"""NCCL and CUDA paths (skipped without a GPU): world-1 NCCL with eager init, warmup, the Flight Recorder env and
its dump when the watchdog fires, the memory-headroom check, the megatron kind on CUDA with an async save.

Run on a GPU machine: ``OMP_NUM_THREADS=1 pytest -q tests/gpu`` (bench/RESULTS.md, "GPU").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.distributed.runs import FAST, lifecycle_run

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# World 1 on one GPU: the megatron kind without expert parallelism (ep=2 would need two ranks).
GPU = ["distributed.backend=nccl", "parallelism.ep=1", "train.options.num_experts=4", "train.steps=4",
       "checkpoint.every_steps=2", "warmup.ops=[barrier,all_reduce,all_gather]"]


def _events(run_dir: Path) -> list[dict]:  # type: ignore[type-arg]
    path = run_dir / "events" / "rank_0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(180)
def test_nccl_eager_init_warmup_and_training_on_cuda(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 1, *FAST, *GPU, timeout=170)
    assert run.code == 0, run.output
    events = _events(run.run_dir)
    init = next(e for e in events if e["name"] == "init_process_group" and e["kind"] == "begin")
    assert init["backend"] == "nccl"
    warm = {e["name"] for e in events if e["name"].startswith("warm:") and e["kind"] == "end" and not e.get("bytes")}
    assert warm == {"warm:barrier", "warm:all_reduce", "warm:all_gather"}, warm
    # warmup.sizes [tiny, job]: the job's messages at their size, on CUDA tensors over NCCL, before step 1
    from lifecycle.distributed.messages import job_messages
    from lifecycle.policy.load import read_resolved

    planned = {(m.op, m.nbytes) for m in job_messages(read_resolved(run.run_dir / "policy.resolved.yaml"))}
    sized = {(e["name"].split(":")[1], e["bytes"]) for e in events
             if e["name"].startswith("warm:") and e["kind"] == "begin" and e.get("bytes")}
    assert planned and planned <= sized, (planned, sized)
    assert [e["env"] for e in events if e["name"] == "nccl_env"] == [{"NCCL_RUNTIME_CONNECT": "0"}]
    assert all(e.get("outcome") == "ok" for e in events if e["name"].startswith("warm:") and e["kind"] == "end")
    free = [e for e in events if e["name"].startswith("warm:") and e["kind"] == "end" and "mem_free_before" in e]
    assert free and all(e["mem_free_before"] > 0 for e in free)  # measured on the GPU around each op
    losses = [e["loss"] for e in events if e["name"] == "step" and e["kind"] == "end"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert (run.run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000004"


@pytest.mark.timeout(180)
def test_a_stall_is_reported_with_a_flight_recorder_dump(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 1, *FAST, *GPU, "watchdog.deadlines.step=8",
                        "+faults=[{at: train, step: 3, ranks: [0], action: stall}]", timeout=170)
    assert run.code == 3, run.output
    report = json.loads((run.run_dir / "hang_report.json").read_text())
    assert report["cause"] == "hang" and report["flight_recorder"]
    dump = Path(report["flight_recorder"].split(" ")[0])
    assert dump.is_file() and dump.stat().st_size > 0, report["flight_recorder"]


@pytest.mark.timeout(180)
def test_memory_headroom_fails_fast_at_warmup(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 1, *FAST, *GPU, "distributed.memory_headroom_gib=100000", timeout=170)
    assert run.code == 4, run.output
    assert re.search(r"GiB free on this GPU after warming group \S+; the policy asks for 100000 GiB headroom",
                     run.log(0)), run.log(0)[-3000:]


@pytest.mark.timeout(180)
def test_async_save_on_cuda_resumes_to_the_same_losses(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    full = lifecycle_run(tmp_path / "a", 1, *FAST, *GPU, "train.steps=6", "checkpoint.every_steps=0",
                         "checkpoint.at_end=false", timeout=170)
    assert full.code == 0, full.output
    first = lifecycle_run(tmp_path / "b", 1, *FAST, *GPU, "train.steps=4", "checkpoint.async=true",
                          f"checkpoint.dir={ck}", timeout=170)
    assert first.code == 0, first.output
    resumed = lifecycle_run(tmp_path / "c", 1, *FAST, *GPU, "train.steps=6", f"checkpoint.dir={ck}", timeout=170)
    assert resumed.code == 0 and "resumed from step 4" in resumed.proc.stdout, resumed.output
    saves = [e for e in _events(first.run_dir) if e["name"] == "save" and e["kind"] == "end"]
    # megatron-core's writer: device -> page-locked host buffers staged by lifecycle; NVRx's (auto picks it on 0.17+
    # where NVRx is installed): its own preload copies the GPU tensors
    assert saves and all(e.get("host_copy") == ("nvrx" if e.get("async_strategy") == "nvrx" else "pinned")
                         for e in saves), saves
    a = {e["step"]: e["loss"] for e in _events(full.run_dir) if e["name"] == "step" and e["kind"] == "end"}
    c = {e["step"]: e["loss"] for e in _events(resumed.run_dir) if e["name"] == "step" and e["kind"] == "end"}
    assert sorted(c) == [5, 6]
    for step in (5, 6):
        assert c[step] == pytest.approx(a[step], rel=1e-4)


@pytest.mark.timeout(240)
def test_the_own_megatron_loop_adopts_lifecycle_on_nccl_and_resumes(tmp_path: Path) -> None:
    """examples/own_loop at world 1 on the GPU: the trainer's own NCCL group and megatron groups are adopted,
    warmed, the model checkpointed from CUDA and resumed by a second launch."""
    import subprocess

    from tests.examples.test_own_loop import _cmd, _env

    def launch(steps: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(_cmd(1, ["--ep", "1", "--steps", str(steps)],
                                   [f"run.dir={tmp_path / 'run'}", "checkpoint.every_steps=2"]),
                              capture_output=True, text=True, timeout=110, env=_env(), cwd=tmp_path)

    first = launch(4)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-4000:]
    events = _events(tmp_path / "run")
    init = next(e for e in events if e["name"] == "init_process_group" and e["kind"] == "begin")
    assert init["backend"] == "nccl"
    assert any(e["name"] == "warm:all_reduce" and e.get("mem_free_before") for e in events)
    again = launch(6)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-4000:]
    assert "resumed from step 4" in again.stdout
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "iter_0000006"
