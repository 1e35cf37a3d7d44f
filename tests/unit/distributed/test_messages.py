"""The job's messages by group and size (what ``warmup.sizes: job`` warms), from the policy alone."""

from __future__ import annotations

from typing import Any

from lifecycle.distributed.messages import FP32, job_messages
from lifecycle.machine.plan import build_plan
from lifecycle.policy.load import validate


def _by(policy: dict[str, Any]) -> dict[tuple[str, str], int]:
    return {(m.group, m.op): m.nbytes for m in job_messages(validate(policy))}


def test_the_synthetic_kind_reduces_one_gradient_bucket_over_dp() -> None:
    got = _by({"train": {"kind": "synthetic", "options": {"hidden": 32}}})
    assert got == {("dp", "all_reduce"): (32 * 32 + 2 * 32 + 1) * FP32}


def test_megatron_messages_follow_the_layout_and_grow_with_the_model() -> None:
    moe = {"train": {"kind": "megatron_gpt"}, "parallelism": {"ep": 2}}
    base = _by(moe)
    assert set(base) == {("dp_cp", "all_reduce"), ("edp", "all_reduce"), ("ep", "all_to_all")}
    wider = _by({**moe, "train": {"kind": "megatron_gpt", "options": {"hidden": 128}}})
    assert all(wider[k] > base[k] for k in base)
    full = _by({"train": {"kind": "megatron_gpt", "options": {"num_experts": 0, "use_distributed_optimizer": True,
                                                              "num_layers": 4, "num_microbatches": 2}},
                "parallelism": {"tp": 2, "pp": 2}, "moe": {"zero_token": {"action": "off"}}})
    assert set(full) == {("dp_cp", "all_reduce"), ("dp_cp", "all_gather"), ("pp", "p2p"), ("tp", "all_reduce")}
    assert full[("pp", "p2p")] == 4 * 32 * 64 * FP32  # micro_batch x seq_len x hidden, fp32


def test_the_plan_warms_the_job_sizes_only_when_asked() -> None:
    def sized(sizes: list[str]) -> list[tuple[str, int]]:
        p = validate({"train": {"kind": "synthetic"}, "warmup": {"sizes": sizes, "groups": ["dp"]}})
        return [(a.op, a.nbytes) for a in build_plan(p).phases["warmup"] if a.op.startswith("warm:")]

    assert sized(["tiny"]) == [("warm:barrier", 0), ("warm:all_reduce", 0)]
    assert sized(["tiny", "job"]) == [("warm:barrier", 0), ("warm:all_reduce", 0), ("warm:all_reduce", 4356)]
    assert sized(["job"]) == [("warm:all_reduce", 4356)]
