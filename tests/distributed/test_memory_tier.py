"""The in-memory checkpoint tier on real gloo ranks (the synthetic kind, world 4): a relaunch resumes from the newest
step every rank holds — a rank whose copy is lost or damaged gets its buddy's — the losses go on exactly as in an
uninterrupted run, and a non-finite state or diverged replicas are never saved to either tier. The megatron kind's copies restored in place:
tests/distributed/test_restarts.py. Three launches (about 10 s)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.runs import FAST, SYNTHETIC, Run, lifecycle_run

pytestmark = pytest.mark.distributed

STEPS = ["train.steps=10", "checkpoint.every_steps=10", "checkpoint.memory.every_steps=2"]


def _losses(run: Run) -> dict[int, float]:
    """Rank 0's loss of every step of the run's last attempt."""
    return {e["step"]: e["loss"] for e in run.events()[0] if e["name"] == "step" and e["kind"] == "end"
            and "loss" in e}


def _copies(base: Path) -> dict[str, list[str]]:
    return {f"{d.parent.name}/{d.name}": sorted(p.name for p in d.iterdir())
            for d in sorted(base.glob("*/rank_*"))}


@pytest.mark.timeout(170)
def test_lost_damaged_and_non_finite_states_resume_from_the_newest_good_step_and_train_on_unchanged(
        tmp_path: Path) -> None:
    def run(folder: str, *extra: str) -> Run:
        shm = tmp_path / folder / "shm"
        shm.mkdir(parents=True, exist_ok=True)
        return lifecycle_run(tmp_path / folder, 4, *SYNTHETIC, *FAST, *STEPS, f"checkpoint.memory.dir={shm}", *extra)

    # Attempt 1 dies after step 10 (rank 2, kill -9, as it takes its copy; no commit yet): step 8's stay. Its
    # steps 9 and 10 ran uninterrupted: the losses every resumed run must reach.
    crashed = run("lost", "checkpoint.every_steps=0", "restart.max_restarts=0",
                  "+faults=[{at: checkpoint, step: 10, op: memory, ranks: [2], action: crash}]")
    assert crashed.code == 4, crashed.output
    expected = {s: v for s, v in _losses(crashed).items() if s > 8}
    assert sorted(expected) == [9, 10], expected
    [base] = (tmp_path / "lost" / "shm").iterdir()
    assert f"memory   copies kept in {base}" in crashed.output
    copies = _copies(base)  # step 10's copies never completed on every rank: nobody dropped step 8's
    assert copies["own/rank_2"] == ["step_8.bin", "step_8.json"], copies
    assert len(copies) == 8 and all({"step_8.bin", "step_8.json"} <= set(names) for names in copies.values()), copies
    # Then rank 1's node loses its memory, one byte of rank 3's copy flips, and a forged newer copy appears.
    for p in (base / "own" / "rank_1").iterdir():
        p.unlink()
    blob = base / "own" / "rank_3" / "step_8.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    record = json.loads((base / "own" / "rank_0" / "step_8.json").read_text())
    (base / "own" / "rank_0" / "step_10.bin").write_bytes(b"forged")
    (base / "own" / "rank_0" / "step_10.json").write_text(json.dumps({**record, "step": 10, "size": 6}))
    resumed = run("lost", "checkpoint.every_steps=0")  # the same command again, the drill gone
    assert resumed.code == 0, resumed.output
    assert "attempt 2: resumed from step 8 (memory copies; last committed checkpoint: none)" in resumed.output
    restores = {r: [e for e in events if e["name"] == "memory_restore" and e["kind"] == "end"]
                for r, events in resumed.events().items()}
    moved = sorted(r for r, [e] in restores.items() if e["moved"])
    assert moved == [1, 3], restores  # from their buddies, ranks 2 and 0
    assert all(e["everywhere"] and not e["failed"] for [e] in restores.values()), restores
    assert "does not match its record" in resumed.log(3) and "step_10 not used" in resumed.log(0)
    assert _losses(resumed) == expected  # bit for bit
    goodput: dict[str, Any] = resumed.summary()["goodput"]
    assert goodput["steps"] == {"productive": 10, "lost": 2}, goodput  # steps 9 and 10, computed twice
    assert not base.exists()  # a finished run leaves no copies

    # Attempt 1: rank 2's weights move by 1e-3 at step 5 (finite, a silently diverged replica): the copy of step 6
    # is refused by the replica check, naming rank 2 and the tensor; attempt 2 resumes from step 4's copies. There a
    # NaN written into rank 1's weights at step 9: the persistent save of step 10 is refused, naming the tensor;
    # attempt 3 resumes from step 8's copies. There a NaN again at step 9 (its first step after the restore, as if the
    # restored state were bad): the restore check rejects step 8's copies; attempt 4 skips them and, with nothing
    # committed, trains from step 0 to the losses of the uninterrupted steps.
    poisoned = run("nan", "restart.max_restarts=3", "restart.max_no_progress=4",
                   "+faults=[{at: train, step: 5, ranks: [2], action: perturb_weights, attempts: [1]}, "
                   "{at: train, step: 9, ranks: [1], action: nan_weights, attempts: [2, 3]}]")
    assert poisoned.code == 0, poisoned.output
    assert "the data-parallel replicas on group dp disagree at step 6: ranks [2] differ from ranks [0, 1, 3] in " \
           "0.weight" in poisoned.output, poisoned.output
    assert "attempt 2: resumed from step 4 (memory copies" in poisoned.output
    assert "the state of step 10 holds" in poisoned.output and "not saved to the persistent tier" in poisoned.output
    assert "attempt 3: resumed from step 8 (memory copies" in poisoned.output

    def checks(attempt: int) -> list[dict[str, Any]]:
        folder = tmp_path / "nan" / "run" / "attempts" / str(attempt) / "events"
        return [json.loads(line) for f in sorted(folder.glob("rank_*.jsonl")) for line in f.read_text().splitlines()
                if '"state_check"' in line]

    # compared off the training thread: rank 2 fails at the next step boundary; a peer that reached one by then says
    # it too (the others are already waiting for rank 2 in the step's all-reduce)
    diverged = checks(1)
    assert 2 in {c["rank"] for c in diverged} and all(
        c["check"] == "replicas" and c["tier"] == "memory" and c["step"] == 6 and c["ranks"] == [2]
        and c["agree"] == [0, 1, 3] for c in diverged), diverged
    nan = checks(2)
    assert nan and all(c["tier"] == "persistent" and c["step"] == 10 and c["nonfinite"] > 0 for c in nan)
    restores = checks(3)  # every rank: the losses are all-reduced, rank 1's NaN among them
    assert len(restores) == 4 and all(c["check"] == "restore" and c["tier"] == "memory" and c["step"] == 9
                                      for c in restores), restores
    assert "the first step after restoring the memory tier's copies of step 8 gave loss nan" in poisoned.output
    rejected = json.loads((tmp_path / "nan" / "run" / "checkpoints" / ".restore-rejected.json").read_text())
    assert [k.split(":")[1] for k in rejected["memory"]] == ["8"] and rejected["persistent"] == {}, rejected
    assert "memory copies of steps [8] not used: rejected after an earlier restore" in poisoned.log(0)
    assert "attempt 4: resumed" not in poisoned.output
    assert {k: v for k, v in _losses(poisoned).items() if k > 8} == expected  # from step 0, bit for bit
