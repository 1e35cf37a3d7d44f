"""The main job (the default policy) end to end, resume, preemption and a crash mid-save — real Megatron GPT-MoE
on 4 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.runs import FAST, lifecycle_run
from tests.helpers import nvrx_env, nvrx_missing

pytestmark = pytest.mark.distributed


def _losses(run) -> dict[int, float]:  # type: ignore[no-untyped-def]
    return {e["step"]: e["loss"] for e in run.events()[0] if e["name"] == "step" and e["kind"] == "end"}


@pytest.mark.megatron
@pytest.mark.timeout(120)
def test_default_job_trains_saves_and_exits_0(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 4, timeline=None)  # the embedded default, its picture included
    assert run.code == 0, run.output
    s = run.summary()
    assert s["exit_code"] == 0 and set(s["exit_code_per_rank"].values()) == {0}
    assert s["loss"]["steps"] == 20 and s["loss"]["last"] < 0.6 * s["loss"]["first"]
    ck = run.run_dir / "checkpoints"
    assert (ck / "latest").read_text().strip() == "iter_0000020"
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000010", "iter_0000020", "latest",
                                                   "latest_checkpointed_iteration.txt"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "20"  # Megatron-LM's tracker
    assert (ck / "iter_0000020" / "metadata.json").is_file()
    for phase in ("init", "warmup", "train", "checkpoint", "teardown"):
        assert phase in s["phases"] and f"  {phase}" in run.proc.stdout
    assert "loss" in run.proc.stdout and "iter_0000020" in run.proc.stdout
    # the run also leaves the merged trace and the Gantt picture (matplotlib is in the dev extra)
    trace = json.loads((run.run_dir / "trace.json").read_text())
    assert {e["tid"] for e in trace["traceEvents"] if e.get("ph") == "X"} == {0, 1, 2, 3}
    assert (run.run_dir / "timeline.png").stat().st_size > 1000
    # the step's own loss all-reduce is a span on its group (a rank stuck there is named with group and op)
    for rank, events in run.events().items():
        loss = [e for e in events if e["name"] == "loss_all_reduce" and e["kind"] == "end"]
        assert [e["step"] for e in loss] == list(range(1, 21)), rank
        assert {(e["group"], tuple(e["ranks"])) for e in loss} == {("dp", (0, 1, 2, 3))}, (rank, loss[0])
    # warmup.sizes [tiny, job] (the default): before step 1, the gradient bucket went over the dense data-parallel
    # communicator and the expert gradients over expert-dp, the token all-to-all over ep, at the planned sizes
    from lifecycle.distributed.messages import job_messages
    from lifecycle.policy.load import read_resolved

    planned = {(m.group, m.op): m.nbytes for m in job_messages(read_resolved(run.run_dir / "policy.resolved.yaml"))}
    assert {("dp_cp", "all_reduce"), ("edp", "all_reduce"), ("ep", "all_to_all")} <= set(planned)
    for rank, events in run.events().items():
        first_step = next(e["t"] for e in events if e["name"] == "step")
        sized = [e for e in events if e["name"].startswith("warm:") and e["kind"] == "begin" and e.get("bytes")]
        got = {(g, e["name"].split(":")[1]): e["bytes"] for e in sized for g in e["group"].split("=")}
        for (group, op), nbytes in planned.items():
            assert got.get((group, op)) == nbytes, (rank, group, op, got)
        assert all(e["t"] < first_step for e in sized), rank


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of 12 steps without a save (the resume tests' reference)."""
    full = lifecycle_run(tmp_path_factory.mktemp("full"), 4, *FAST, "train.steps=12", "checkpoint.every_steps=0",
                         "checkpoint.at_end=false")
    assert full.code == 0, full.output
    return _losses(full)


@pytest.mark.megatron
@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["auto", "nvrx"])
def test_resume_continues_the_loss_curve(tmp_path: Path, strategy: str, uninterrupted: dict[int, float]) -> None:
    """checkpoint.async_strategy: auto without nvidia-resiliency-ext (what pip gives most users) is megatron-core's
    own async save; nvrx is NVRx's planner, writer and metadata cache. Either resumes to the same losses."""
    env: dict[str, str] = {}
    if strategy == "nvrx":
        if nvrx_missing():
            pytest.skip(nvrx_missing())
        env = nvrx_env()
    ck = tmp_path / "ckpt"
    # Five saves: from the third on, megatron-core reuses the cached save plan and global metadata.
    first = lifecycle_run(tmp_path / "b", 4, *FAST, "train.steps=10", "checkpoint.every_steps=2",
                          f"checkpoint.dir={ck}", f"checkpoint.async_strategy={strategy}", env=env)
    assert first.code == 0, first.output
    # Peers start writing before rank 0 enters megatron's save (cached plans): no false "corrupted" warning.
    assert "Overwriting old incomplete" not in first.output + first.log(0)
    assert "async save is deprecated" not in first.output + first.log(0)
    saves = [e for e in first.events()[0] if e["name"] == "save" and e["kind"] == "end"]
    assert [e["async_strategy"] for e in saves] == ["mcore" if strategy == "auto" else "nvrx"] * 5
    resumed = lifecycle_run(tmp_path / "c", 4, *FAST, "train.steps=12", f"checkpoint.dir={ck}",
                            f"checkpoint.async_strategy={strategy}", env=env)
    assert resumed.code == 0, resumed.output
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000010", "iter_0000012", "latest",
                                                   "latest_checkpointed_iteration.txt"]
    assert "resumed from step 10" in resumed.proc.stdout
    a, c = uninterrupted, _losses(resumed)
    assert sorted(c) == [11, 12]
    assert c[11] == pytest.approx(a[11], rel=1e-6) and c[12] == pytest.approx(a[12], rel=1e-6)


@pytest.mark.timeout(120)
def test_sigterm_to_one_rank_saves_the_same_step_everywhere(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 4, *FAST, "checkpoint.every_steps=0",
                        "+faults=[{at: train, step: 5, ranks: [2], action: signal}]")
    assert run.code == 0, run.output
    # The flag issued after step 5 (the signal arrived in it) is reduced during step 6 and read after it.
    assert "preempted at step 6, saved" in run.proc.stdout
    ck = run.run_dir / "checkpoints"
    assert (ck / "latest").read_text().strip() == "iter_0000006"
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000006", "latest", "latest_checkpointed_iteration.txt"]
    for rank, evs in run.events().items():
        steps = [e["step"] for e in evs if e["name"] == "step" and e["kind"] == "end"]
        assert max(steps) == 6, rank


@pytest.mark.timeout(120)
def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ck = tmp_path / "ckpt"
    run = lifecycle_run(tmp_path / "a", 4, *FAST, "train.steps=12", "checkpoint.every_steps=6",
                        f"checkpoint.dir={ck}", "+faults=[{at: checkpoint, step: 12, ranks: [1], action: crash, op: commit}]")
    assert run.code != 0 and "rank 1 failed first" in run.output, run.output
    assert (ck / "latest").read_text().strip() == "iter_0000006"
    assert not (ck / "iter_0000012").exists()
    again = lifecycle_run(tmp_path / "b", 4, *FAST, "train.steps=7", f"checkpoint.dir={ck}")
    assert again.code == 0, again.output
    assert "resumed from step 6" in again.proc.stdout


def _scribble(folder: Path) -> Path:
    """Overwrite the middle of the largest shard with zeros (same size: only a real load can notice)."""
    shard = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 4: len(data) // 2] = bytes(len(data) // 2 - len(data) // 4)
    shard.write_bytes(bytes(data))
    return shard


@pytest.mark.timeout(170)
def test_corrupt_checkpoints_exit_2_or_fall_back_and_pruning_never_deletes_committed_work(tmp_path: Path) -> None:
    ck = tmp_path / "ckpt"
    first = lifecycle_run(tmp_path / "a", 2, *FAST, "train.steps=10", "checkpoint.every_steps=5",
                          "checkpoint.keep_last=0", f"checkpoint.dir={ck}")
    assert first.code == 0, first.output
    shard = _scribble(ck / "iter_0000010")
    # on_corrupt=error: every rank fails the same load (torch's CheckpointException is a BaseException), exit 2,
    # the message names the checkpoint; nothing in the folder changes.
    strict = lifecycle_run(tmp_path / "b", 2, *FAST, "train.steps=12", f"checkpoint.dir={ck}")
    assert strict.code == 2, strict.output
    assert f"cannot resume from checkpoint {ck / 'iter_0000010'}" in strict.output
    assert "Traceback" not in strict.output
    assert (ck / "latest").read_text().strip() == "iter_0000010" and shard.exists()
    # fallback + keep_last=1: resume from 5, set 10 aside, commit 10 and 15; 5 is kept (resumed from).
    again = lifecycle_run(tmp_path / "c", 2, *FAST, "train.steps=15", "checkpoint.every_steps=5",
                          "checkpoint.keep_last=1", "checkpoint.on_corrupt=fallback", f"checkpoint.dir={ck}")
    assert again.code == 0, again.output
    assert "resumed from step 5" in again.proc.stdout
    names = sorted(p.name for p in ck.iterdir())
    assert [n for n in names if n.startswith("iter_") and "." not in n] == ["iter_0000005", "iter_0000015"], names
    assert any(n.startswith("iter_0000010.corrupt-") for n in names), names
    assert (ck / "latest").read_text().strip() == "iter_0000015"
    # a truncated shard is found from the manifest before any rank starts
    newest = max((ck / "iter_0000015").glob("*.distcp"), key=lambda p: p.stat().st_size)
    newest.write_bytes(newest.read_bytes()[:100])
    refused = lifecycle_run(tmp_path / "d", 2, *FAST, "train.steps=20", f"checkpoint.dir={ck}")
    assert refused.code == 2 and f"{newest.name} has 100 bytes" in refused.output, refused.output
    assert "Traceback" not in refused.output and not (tmp_path / "d" / "run" / "events").exists()


@pytest.mark.timeout(170)
def test_running_the_same_command_again_continues_the_run(tmp_path: Path) -> None:
    args = (*FAST, "train.steps=8", "checkpoint.every_steps=4", "+faults=[{at: train, step: 6, ranks: [1], "
            "action: crash}]")
    first = lifecycle_run(tmp_path, 2, *args)
    assert first.code == 4 and "rank 1 failed first" in first.output, first.output
    second = lifecycle_run(tmp_path, 2, *FAST, "train.steps=8", "checkpoint.every_steps=4")
    assert second.code == 0, second.output
    assert "attempt 2: resumed from step 4" in second.proc.stdout
    run_dir = tmp_path / "run"
    assert (run_dir / "attempts" / "1" / "events" / "rank_1.jsonl").is_file()
    assert (run_dir / "attempts" / "1" / "summary.json").is_file()
    s = second.summary()
    assert s["attempt"] == 2 and s["exit_code"] == 0 and s["resumed_from"] == 4
    assert s["earlier_attempts"][0]["attempt"] == 1 and s["earlier_attempts"][0]["exit_code"] == 4
    steps = [e["step"] for e in second.events()[0] if e["name"] == "step" and e["kind"] == "end"]
    assert steps == [5, 6, 7, 8]
    assert "earlier  attempt 1" in second.proc.stdout
    never = lifecycle_run(tmp_path, 2, *FAST, "checkpoint.resume=never")
    assert never.code == 2 and "already holds a run" in never.output


def _save_with_megatron_cores_own_save(rank: int, world: int, ckpt_dir: str) -> list[float]:
    """Train the default model 6 steps on 2 ranks and save it as a megatron-core user would: the model only."""
    import warnings

    warnings.simplefilter("ignore")
    from megatron.core import dist_checkpointing

    from lifecycle.backends.megatron import model as m
    from lifecycle.backends.megatron import parallel
    from lifecycle.policy.load import load
    from tests._dist import init_gloo

    init_gloo(rank, world)
    policy = load([]).policy  # the default policy: the model `lifecycle run` builds
    par = policy.parallelism
    parallel.initialize(par.tp, par.pp, par.cp, par.ep, par.etp, par.vpp, par.dist_opt_instances, 60)
    state = m.build(m.ModelSpec(policy.train.options, seed=policy.run.seed))
    from megatron.core import parallel_state as ps

    losses = [m.train_step(state, m.step_batches(state.spec, step, ps.get_data_parallel_rank()))
              for step in range(1, 7)]
    dist_checkpointing.save({"model": state.gpt.sharded_state_dict()}, ckpt_dir)
    parallel.destroy()
    return losses


@pytest.mark.megatron
@pytest.mark.timeout(170)
def test_a_checkpoint_saved_by_megatron_cores_own_save_resumes(tmp_path: Path) -> None:
    from tests._dist import run_ranks

    ck = tmp_path / "ck"
    (ck / "iter_0000006").mkdir(parents=True)
    # megatron-core's own save starts a multiprocessing Manager: the ranks must be allowed children
    losses = run_ranks(_save_with_megatron_cores_own_save, 2, 120, str(ck / "iter_0000006"), daemon=False)[0]
    (ck / "latest_checkpointed_iteration.txt").write_text("6\n")  # Megatron-LM's tracker, nothing else
    run = lifecycle_run(tmp_path / "a", 2, *FAST, "train.steps=8", f"checkpoint.dir={ck}")
    assert run.code == 0, run.output
    assert "resumed from step 6" in run.proc.stdout
    resumed = _losses(run)
    assert sorted(resumed) == [7, 8]
    # the trained weights were loaded: the loss goes on from where the 6 saved steps left it
    assert resumed[7] < 0.95 * losses[0] and abs(resumed[7] - losses[-1]) < 0.25 * losses[-1], (losses, resumed)
    assert "has no optimizer state (saved outside lifecycle)" in run.log(0)
