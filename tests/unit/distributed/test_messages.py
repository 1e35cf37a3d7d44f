"""The job's messages by group and size (what ``warmup.sizes: job`` warms), from the policy alone."""

from __future__ import annotations

from typing import Any

from lifecycle.distributed.messages import FP32, job_messages
from lifecycle.machine.plan import build_plan
from lifecycle.policy import installed
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


def test_used_groups_follow_the_kind_and_the_layout() -> None:
    from lifecycle.distributed.messages import requested_groups, used_groups
    from lifecycle.policy.groupnames import GROUP_NAMES

    def used(policy: dict[str, Any], world: int | None = None) -> list[str]:
        got = used_groups(validate(policy), world)
        assert got is not None and got == [n for n in GROUP_NAMES if n in got]  # the canonical order
        return sorted(got)

    assert used({"train": {"kind": "synthetic"}}) == ["dp", "world"]
    moe = {"train": {"kind": "megatron_gpt"}, "parallelism": {"ep": 2}}
    norm = "tp_ep_pp_egtp" if installed.gtp_groups() else "tp_ep_pp"  # megatron-core 0.19+ norms over its own group
    assert used(moe, 4) == sorted(["world", "dp", "tp", "dp_cp", "mp", "tp_ep", "ep", "edp", norm])
    # the distributed optimizer reduces in its instance's groups; an expert dp of one rank is never reduced over
    dist_opt = {"train": {"kind": "megatron_gpt", "options": {"use_distributed_optimizer": True}},
                "parallelism": {"ep": 2, "dist_opt_instances": 2}}
    assert used(dist_opt, 4) == sorted(["world", "dp", "tp", "intra_dp_cp", "intra_dist_opt", "inter_dist_opt",
                                        "tp_ep", "ep", "intra_edp"])
    pipeline = {"train": {"kind": "megatron_gpt"}, "parallelism": {"tp": 2, "pp": 2, "ep": 1}}
    assert used(pipeline, 4) == sorted(["world", "dp", "tp", "dp_cp", "mp", "pp", "tp_cp", "tp_ep", "etp"])
    # warmup.groups: used asks exactly those, in the canonical order; all names when the kind's are not known
    asked = validate({**moe, "warmup": {"groups": "used"}})
    assert requested_groups(asked, 4) == [n for n in GROUP_NAMES if n in used(moe, 4)]
    # a plugin kind (installed by a package): its collectives are unknown, so every group is warmed
    own = asked.model_copy(update={"train": asked.train.model_copy(update={"kind": "plugin_kind"})})
    assert used_groups(own) is None and requested_groups(own) == list(GROUP_NAMES)
    # a trainer's own loop (lifecycle.attach) issues its own collectives, whatever the policy's kind
    assert used_groups(asked, 4, own_loop=True) is None
    assert requested_groups(asked, 4, own_loop=True) == list(GROUP_NAMES)
