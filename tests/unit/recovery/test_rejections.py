"""The states rejected after a restore (lifecycle.recovery.rejections): recorded and read back, and a hostile or
damaged file counts as empty (never a hang, never a traceback)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lifecycle.recovery import rejections


def test_recorded_states_are_read_back_by_tier_and_lineage(tmp_path: Path) -> None:
    rejections.add(tmp_path, "persistent", "iter_0000040", "step 41: loss nan")
    rejections.add(tmp_path, "memory", rejections.memory_key(7, 30), "step 31: loss inf")
    rejections.add(tmp_path, "memory", rejections.memory_key(7, 50), "x")
    rejections.add(tmp_path, "memory", rejections.memory_key(8, 60), "another lineage")
    assert rejections.read(tmp_path)["persistent"] == {"iter_0000040": "step 41: loss nan"}
    assert rejections.memory_steps(tmp_path, 7) == [50, 30] and rejections.memory_steps(tmp_path, 9) == []
    with pytest.raises(ValueError, match="not a checkpoint tier"):
        rejections.add(tmp_path, "disk", "x", "y")


@pytest.mark.parametrize("content", ["", "not json", "[1, 2]", '{"persistent": [1], "memory": "x"}', "[" * 100_000,
                                     json.dumps({"memory": {"7:abc": "x", "7:-1": "y"}})])
def test_a_damaged_file_counts_as_empty(tmp_path: Path, content: str) -> None:
    (tmp_path / rejections.NAME).write_text(content)
    assert rejections.read(tmp_path)["persistent"] == {} and rejections.memory_steps(tmp_path, 7) == []


def test_a_fifo_or_an_oversized_file_is_not_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / rejections.NAME)  # opening it for reading would block forever
    assert rejections.read(tmp_path) == {"persistent": {}, "memory": {}}
    big = tmp_path / "big"
    big.mkdir()
    (big / rejections.NAME).write_bytes(b" " * (2 << 20))
    assert rejections.read(big) == {"persistent": {}, "memory": {}}
