"""What a checkpoint is bound to (lifecycle.checkpoint.binding): the layout changes each checkpoint format loads at."""

from __future__ import annotations

import pytest

from lifecycle.checkpoint import binding
from lifecycle.policy.load import validate

BASE = {"world_size": 4, "tp": 1, "pp": 1, "cp": 1, "ep": 2, "etp": 1, "vpp": None, "dp": 4, "dist_opt_instances": 1,
        "kind": "megatron_gpt"}


def _moved(**change: object) -> dict[str, object]:
    return {**BASE, **change}


@pytest.mark.parametrize(("now", "plain", "dist_opt", "per_rank"), [
    (_moved(), None, None, None),
    (_moved(world_size=8, dp=8), None, None, "were written by 4 ranks"),
    (_moved(ep=4), None, "loads at another data-parallel size only", None),
    (_moved(tp=2, etp=2, dp=2), None, "loads at another data-parallel size only", None),
    (_moved(pp=2, dp=2), "pp changed", "pp changed", None),
    (_moved(vpp=2), "vpp changed", "vpp changed", None),
    (_moved(world_size=8, cp=2), "cp changed", "cp changed", "were written by 4 ranks"),
])
def test_each_format_names_the_layout_changes_it_cannot_load_at(now: dict[str, object], plain: str | None,
                                                                  dist_opt: str | None, per_rank: str | None) -> None:
    for got, want in ((binding.torch_dist(BASE, now, distributed_optimizer=False), plain),
                      (binding.torch_dist(BASE, now, distributed_optimizer=True), dist_opt),
                      (binding.per_rank_files(BASE, now), per_rank)):
        assert (got is None) == (want is None) and (want is None or want in str(got)), (now, got, want)
    assert binding.dp_replicas(BASE, now) is None


def test_a_layout_is_what_every_rank_computes_and_changes_name_each_key() -> None:
    policy = validate({"parallelism": {"tp": 2, "ep": 2}, "train": {"options": {"heads": 4}}})
    now = binding.layout(policy, 8)
    assert now == {"world_size": 8, "tp": 2, "pp": 1, "cp": 1, "ep": 2, "etp": 2, "vpp": None, "dp": 4,
                   "dist_opt_instances": 1, "kind": "megatron_gpt"}
    assert binding.layout(policy, 8, own_loop=True)["kind"] == "own_loop"
    assert binding.changes(BASE, now) == ["world_size 4 -> 8", "tp 1 -> 2", "etp 1 -> 2"]
    assert binding.changes({"world_size": 4}, now) == ["world_size 4 -> 8"]  # unrecorded keys are not compared
    assert binding.describe(now) == "world size 8 (tp=2 pp=1 cp=1 ep=2 dp=4)"
    saved = binding.options(policy)
    assert saved is not None and binding.option_changes(saved, {**saved, "hidden": 128}) == [
        "train.options.hidden 64 -> 128"]
    assert binding.option_changes(None, saved) == [] and binding.options(policy, own_loop=True) is None
