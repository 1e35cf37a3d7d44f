"""The engine on real gloo ranks and real Megatron groups: warmup, barriers, failure paths, teardown."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.runs import FAST, SYNTHETIC, lifecycle_run

pytestmark = pytest.mark.distributed
ALL_OPS = "warmup.ops=[barrier,all_reduce,all_gather,all_to_all,p2p]"


def _warm_sequence(events: list[dict]) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    return [(e["name"], e["group"]) for e in events if e["kind"] == "end" and e["name"].startswith("warm:")]


def _shared_order_agrees(events: dict[int, list[dict]]) -> None:  # type: ignore[type-arg]
    """Any two ranks issue the ops on the groups they share in the same order (no cross-wait)."""
    seqs = {r: [(e["name"], tuple(e["ranks"])) for e in evs if e["kind"] == "end" and e["name"].startswith("warm:")]
            for r, evs in events.items()}
    for a in seqs:
        for b in seqs:
            on_a = [x for x in seqs[a] if b in x[1]]
            on_b = [x for x in seqs[b] if a in x[1]]
            assert on_a == on_b, (a, b, on_a, on_b)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc,layout", [
    (2, ["parallelism.tp=2", "parallelism.ep=1"]),
    (4, ["parallelism.tp=2", "parallelism.ep=2", "parallelism.etp=1"]),
    (4, ["parallelism.ep=2", "parallelism.dist_opt_instances=2"]),
    pytest.param(8, ["parallelism.tp=2", "parallelism.pp=2", "parallelism.ep=2"], marks=pytest.mark.slow),  # scale
])
def test_every_group_warmed_once_in_the_same_order(tmp_path: Path, nproc: int, layout: list[str]) -> None:
    run = lifecycle_run(tmp_path, nproc, "train.steps=0", ALL_OPS, *layout, *FAST)
    assert run.code == 0, run.output
    events = run.events()
    assert sorted(events) == list(range(nproc))
    _shared_order_agrees(events)
    for rank, evs in events.items():
        seq = _warm_sequence(evs)
        groups = [g for _, g in seq]
        # every distinct communicator once per op, all five ops
        assert len(seq) == len(set(seq)) and len(seq) == 5 * len(set(groups)), (rank, seq)
        phases = [e["name"] for e in evs if e["kind"] == "begin" and e["name"].startswith("phase:")]
        assert phases == ["phase:init", "phase:warmup", "phase:train", "phase:teardown"]
    if "parallelism.dist_opt_instances=2" in layout:
        assert any("inter_dist_opt" in g for _, g in _warm_sequence(events[0]))


@pytest.mark.timeout(120)
def test_raise_in_warmup_takes_every_rank_to_the_failure_path(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 4, "train.steps=0", *FAST,
                        "+faults=[{at: warmup, ranks: [1], action: raise, op: all_reduce}]")
    assert run.code == 4, run.output
    assert "rank 1 failed first (exit 4) in phase warmup" in run.output
    assert run.wall_s < 60
    events = run.events()
    failed = [e for e in events[1] if e["name"] == "teardown:failure"]
    assert failed, "rank 1 did not take the failure path"


@pytest.mark.timeout(120)
def test_late_rank_at_barrier_point_is_named(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 4, "train.steps=0", *FAST, "barriers.after_init=[{group: world, timeout_s: 3}]",
                        "+faults=[{at: init, ranks: [3], action: stall, op: barrier}]")
    assert run.code == 3, run.output
    for rank in (0, 1, 2):
        log = run.log(rank)
        assert "ranks [3] did not arrive" in log, log
    assert run.wall_s < 60


@pytest.mark.timeout(120)
def test_hang_in_teardown_exits_with_code_5(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 2, "train.steps=0", *FAST, "watchdog.deadlines.teardown=3", "teardown.deadline_s=4",
                        "+faults=[{at: teardown, ranks: [1], action: stall, op: destroy_process_group}]")
    assert run.code == 5, run.output
    assert "hard deadline of 4s while in step 'destroy_process_group'" in run.log(1)
    assert run.wall_s < 60


@pytest.mark.timeout(120)
def test_synthetic_train_with_checkpoints(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 2, *SYNTHETIC, *FAST, "train.steps=6", "checkpoint.every_steps=3")
    assert run.code == 0, run.output
    ck = run.run_dir / "checkpoints"
    assert (ck / "latest").read_text().strip() == "iter_0000006"
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000003", "iter_0000006", "latest",
                                                   "latest_checkpointed_iteration.txt"]
    s = run.summary()
    assert s["exit_code"] == 0 and [c["step"] for c in s["checkpoints"]] == [3, 6]


_NO_MEGATRON = """
import sys
from pathlib import Path
from lifecycle.policy.load import validate, write_resolved
from lifecycle.machine.session import run_rank
run_dir = Path(sys.argv[1])
write_resolved(validate({"run": {"dir": str(run_dir), "id": "t"}, "train": {"kind": "synthetic", "steps": 4},
                         "checkpoint": {"every_steps": 2}, "moe": {"zero_token": {"action": "off"}},
                         "watchdog": {"poll_interval_s": 0.1}}), run_dir)
code = run_rank(run_dir)
print("megatron modules:", sorted(m for m in sys.modules if m.startswith("megatron"))[:5], "exit", code)
"""


@pytest.mark.timeout(60)
def test_the_synthetic_kind_never_imports_megatron(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from tests._dist import free_port
    from tests.helpers import ROOT

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "-c", _NO_MEGATRON, str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=50, env=env, cwd=ROOT)
    assert "megatron modules: [] exit 0" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "iter_0000004"
