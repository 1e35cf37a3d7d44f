"""Options of the megatron kind for large MoE training, the moe_large preset and the tp-pp-dp rank order."""

from __future__ import annotations

import pytest

from lifecycle.errors import PolicyError
from lifecycle.policy import load as L


def test_moe_large_trains_like_a_large_moe_job() -> None:
    p = L.load(["preset=moe_large"]).policy
    o = p.train.options
    assert o.use_distributed_optimizer and o.overlap_grad_reduce and o.overlap_param_gather
    assert p.parallelism.dist_opt_instances == 2 and o.num_microbatches == 2


def test_the_default_job_keeps_the_plain_optimizer() -> None:
    o = L.load([]).policy.train.options
    assert not (o.use_distributed_optimizer or o.overlap_grad_reduce or o.overlap_param_gather or o.experts_skip_empty)
    assert o.num_microbatches == 1


def test_overlap_param_gather_needs_the_distributed_optimizer() -> None:
    with pytest.raises(PolicyError, match="overlap_param_gather needs use_distributed_optimizer=true"):
        L.load(["train.options.overlap_param_gather=true"])


def test_tp_pp_dp_order_is_accepted_and_others_are_not() -> None:
    assert L.load(["parallelism.order=tp-cp-ep-pp-dp"]).policy.parallelism.order == "tp-cp-ep-pp-dp"
    with pytest.raises(PolicyError, match="parallelism.order"):
        L.load(["parallelism.order=pp-dp-tp"])


def test_zero_tokens_drill_loads() -> None:
    p = L.load(["+faults=[{at: train, ranks: [1], action: zero_tokens, step: 3}]"]).policy
    assert p.faults[0].action == "zero_tokens" and p.faults[0].step == 3
