"""The run's node-exclusion list: hosts the verdicts blamed for what a node may be at fault for, across attempts."""

from __future__ import annotations

import json
from pathlib import Path

from lifecycle.recovery import exclusions

HOSTS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}


def _summary(attempt: int, cause: str, ranks: list[int]) -> dict[str, object]:
    return {"attempt": attempt, "hosts": HOSTS, "blame": {"cause": cause, "ranks": ranks, "phase": "train"}}


def test_blamed_hosts_accumulate_across_attempts_once_per_attempt(tmp_path: Path) -> None:
    assert exclusions.record(tmp_path, _summary(1, "failed", [2])) == []  # the code's fault, not the node's
    assert not (tmp_path / exclusions.HOSTLIST).exists()
    assert exclusions.record(tmp_path, _summary(1, "hang", [2, 3])) == ["node-b"]
    assert exclusions.record(tmp_path, _summary(1, "hang", [2, 3])) == ["node-b"]  # the same attempt: counted once
    exclusions.record(tmp_path, _summary(2, "dead", [0]))
    exclusions.record(tmp_path, _summary(3, "lost", [3]))
    data = json.loads((tmp_path / exclusions.FILE).read_text())
    assert data["counts"] == {"node-b": 2, "node-a": 1} and data["exclude"] == ["node-b", "node-a"]
    assert (tmp_path / exclusions.HOSTLIST).read_text() == "node-b,node-a\n"  # for sbatch --exclude
    (tmp_path / exclusions.FILE).write_text("{ junk")  # not ours any more: starts over, never fails
    assert exclusions.record(tmp_path, _summary(4, "unresponsive", [1])) == ["node-a"]
