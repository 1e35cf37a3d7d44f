"""Which stages the warmup's pipeline p2p talks to (pure)."""

from __future__ import annotations

import pytest

from lifecycle.distributed.collectives import pipeline_neighbours


@pytest.mark.parametrize("interleaved,expected", [
    (False, [(None, 4), (0, 8), (4, 12), (8, None)]),  # 1F1B: a chain
    (True, [(12, 4), (0, 8), (4, 12), (8, 0)]),  # interleaved: the last stage feeds the first's next chunk
])
def test_chain_or_ring_in_stage_order(interleaved: bool, expected: list[tuple[int | None, int | None]]) -> None:
    ranks = [0, 4, 8, 12]  # a pp group of tp-cp-ep-dp-pp with 4 ranks per stage
    assert [pipeline_neighbours(ranks, r, interleaved=interleaved) for r in ranks] == expected


def test_two_stages_interleaved_talk_both_ways_to_one_peer() -> None:
    assert pipeline_neighbours([3, 7], 7, interleaved=True) == (3, 3)
    assert pipeline_neighbours([3], 3, interleaved=True) == (3, 3)  # one stage: _exchange skips itself
