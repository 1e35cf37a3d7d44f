"""The memory tier's files, its buddies, its choice of step and its pre-launch size check — in one process; the
tier across real ranks is in tests/distributed/test_memory_tier.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lifecycle.errors import PolicyError
from lifecycle.machine.preflight import check_memory_tier
from lifecycle.policy.options import SyntheticOptions
from lifecycle.policy.schema import Policy
from lifecycle.recovery import copies as memory
from lifecycle.recovery.memory import buddy_of, choose, ward_of
from lifecycle.recovery.state_check import first_nonfinite

BOUND = memory.Bound(world=4, layout={"kind": "synthetic", "world_size": 4, "dp": 4}, options={"hidden": 8},
                     lineage=12345)


def test_a_copy_is_read_back_only_whole_unchanged_and_bound_to_this_run(tmp_path: Path) -> None:
    folder = tmp_path / "own" / "rank_1"
    memory.write(folder, 8, 1, b"state-of-step-8", BOUND)
    assert memory.steps(folder) == [8]
    assert memory.usable(folder, 8, 1, BOUND) is None and memory.read(folder, 8) == b"state-of-step-8"
    assert "record names step 8 of rank 1" in str(memory.usable(folder, 8, 2, BOUND))  # another rank's copy
    for other, word in ((memory.Bound(8, BOUND.layout, BOUND.options, BOUND.lineage), "world"),
                        (memory.Bound(4, {**BOUND.layout, "dp": 2}, BOUND.options, BOUND.lineage), "layout"),
                        (memory.Bound(4, BOUND.layout, {"hidden": 16}, BOUND.lineage), "options"),
                        (memory.Bound(4, BOUND.layout, BOUND.options, 999), "run")):
        assert f"belongs to another {word}" in str(memory.usable(folder, 8, 1, other))
    blob = folder / "step_8.bin"
    data = bytearray(blob.read_bytes())
    data[3] ^= 0xFF  # one flipped byte
    blob.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match its record"):
        memory.read(folder, 8)
    blob.write_bytes(b"state-of-step-8 and more")  # grown past its record: refused before it is read whole
    with pytest.raises(ValueError):
        memory.read(folder, 8)
    blob.unlink()
    with pytest.raises(ValueError, match="missing"):
        memory.read(folder, 8)


def test_prune_keeps_the_newest_copies_and_drops_torn_ones(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    for step in (2, 4, 6):
        memory.write(folder, step, 0, f"s{step}".encode(), BOUND)
    (folder / "step_8.bin").write_bytes(b"torn: no record")
    (folder / ".step_9.bin.123.tmp").write_bytes(b"a write cut off")
    assert memory.steps(folder) == [6, 4, 2]  # a blob without its record is no copy
    memory.prune(folder, 2)
    assert sorted(p.name for p in folder.iterdir()) == ["step_4.bin", "step_4.json", "step_6.bin", "step_6.json"]
    memory.drop(folder, 6)
    assert memory.steps(folder) == [4]


def test_records_that_are_not_ours_are_refused_not_trusted(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    memory.write(folder, 4, 0, b"x", BOUND)
    record = folder / "step_4.json"
    for text in ("[]", "{", '{"step": 4, "owner": 0, "size": -1, "sha256": "0"}',
                 '{"step": 4, "owner": 0, "size": 1}', "x" * (2 << 20)):
        record.write_text(text)
        assert memory.usable(folder, 4, 0, BOUND) is not None, text


def test_the_lineage_is_kept_until_a_run_starts_over(tmp_path: Path) -> None:
    first = memory.lineage(tmp_path / "ckpt", new=False)
    assert memory.lineage(tmp_path / "ckpt", new=False) == first
    assert memory.lineage(tmp_path / "ckpt", new=True) != first  # resume: never — every older copy is stale
    (tmp_path / "ckpt" / memory.LINEAGE).write_text("not a number")
    assert 0 < memory.lineage(tmp_path / "ckpt", new=False) <= 1 << 62


def test_two_runs_never_share_a_folder(tmp_path: Path) -> None:
    a = memory.root("/dev/shm", tmp_path / "ckpt")
    assert a == memory.root("/dev/shm", tmp_path / "x" / ".." / "ckpt")  # the same folder, however it is named
    assert a != memory.root("/dev/shm", tmp_path / "other")


@pytest.mark.parametrize("world,per_node", [(2, 2), (4, 4), (8, 4), (16, 8), (12, 4), (6, 1), (3, 3)])
def test_buddies_pair_every_rank_with_one_on_another_node(world: int, per_node: int) -> None:
    buddies = [buddy_of(r, world, per_node) for r in range(world)]
    assert sorted(buddies) == list(range(world))  # each rank holds exactly one other's copies
    for rank, buddy in enumerate(buddies):
        assert buddy != rank and ward_of(buddy, world, per_node) == rank
        if world > per_node:
            assert buddy // per_node != rank // per_node  # a lost node never takes both copies


def test_the_step_restored_is_held_by_every_rank_and_the_newest_such_generated() -> None:
    """1,000 seeded layouts of copies (some lost, some damaged and dropped): the step chosen is held by every rank
    (its own or its buddy's copy), no newer step is, and it is never older than the last commit."""
    rng = random.Random(43)
    for _ in range(1000):
        per_node = rng.choice([1, 2, 4])
        world = per_node * rng.choice([1, 2, 3]) if per_node > 1 else rng.choice([2, 3, 5])
        pair = rng.random() < 0.8
        steps = sorted(rng.sample(range(2, 40, 2), 3))
        owns = [{s for s in steps if rng.random() < 0.7} for _ in range(world)]
        helds = [{s for s in steps if rng.random() < 0.7} if pair else set() for _ in range(world)]
        tracked = rng.choice([-1, 0, 10, 20])
        got = choose(owns, helds, per_node if pair else None, tracked)
        holders = [buddy_of(r, world, per_node) if pair else r for r in range(world)]
        complete = [s for s in steps if s >= max(tracked, 1) and all(
            s in owns[r] or (pair and s in helds[holders[r]]) for r in range(world))]
        assert got == max(complete, default=None), (owns, helds, tracked, got)


def test_a_nan_or_inf_is_found_with_its_name() -> None:
    good = {"model": {"w": torch.ones(3), "steps": torch.arange(3)}, "step": 4}
    assert first_nonfinite(good) is None
    bad = {"model": {"w": torch.ones(3)}, "optimizer": {"state": {0: {"exp_avg": torch.tensor([1.0, float("inf")])}}}}
    assert first_nonfinite(bad) == ("optimizer.state.0.exp_avg", 1)
    assert first_nonfinite([torch.tensor([float("nan")] * 2)]) == ("0", 2)


def test_copies_that_cannot_fit_are_refused_before_launch(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    policy = Policy.model_validate({"train": {"kind": "synthetic", "options": SyntheticOptions(hidden=8)},
                                    "checkpoint": {"memory": {"every_steps": 2, "dir": str(shm)}}})
    check_memory_tier(policy, 4)  # a small model: fits
    huge = Policy.model_validate({"train": {"kind": "synthetic", "options": SyntheticOptions(hidden=120_000)},
                                  "checkpoint": {"memory": {"every_steps": 2, "dir": str(shm), "keep": 2}}})
    with pytest.raises(PolicyError) as err:
        check_memory_tier(huge, 8)
    assert "checkpoint.memory" in str(err.value) and "more than" in str(err.value) and "keep 2" in str(err.value)
    missing = Policy.model_validate({"train": {"kind": "synthetic", "options": {"hidden": 8}},
                                     "checkpoint": {"memory": {"every_steps": 2, "dir": str(tmp_path / "none")}}})
    with pytest.raises(PolicyError, match=r"checkpoint\.memory\.dir"):
        check_memory_tier(missing, 4)


def test_copies_are_written_in_order_on_one_thread_that_outlives_an_error_and_leaves_when_stopped() -> None:
    import threading

    from lifecycle.recovery.memory import _Writer

    writer = _Writer(rank=3)
    seen: list[tuple[int, str]] = []
    release = threading.Event()

    def write(n: int) -> None:
        if n == 0:
            release.wait(10)  # the next copy is handed over while this one runs
        seen.append((n, threading.current_thread().name))
        if n == 1:
            raise RuntimeError("a write that fails")  # recorded by the write itself in the tier

    first = writer.submit(lambda: write(0))
    second, third = writer.submit(lambda: write(1)), writer.submit(lambda: write(2))
    assert first.is_alive() and second.is_alive()
    release.set()
    for copy in (first, second, third):
        copy.join(10)
        assert not copy.is_alive()
    assert seen == [(0, "lifecycle-memory-r3"), (1, "lifecycle-memory-r3"), (2, "lifecycle-memory-r3")]
    writer.stop()
    writer.thread.join(10)
    assert not writer.thread.is_alive()
