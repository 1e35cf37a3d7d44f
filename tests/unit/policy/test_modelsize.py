"""Model sizes no rank can allocate are refused at validate, naming the key, the estimate and the bound."""

from __future__ import annotations

import pytest

from lifecycle.errors import PolicyError
from lifecycle.policy import modelsize
from lifecycle.policy.load import load
from lifecycle.policy.options import MegatronGPTOptions, SyntheticOptions
from lifecycle.policy.sections import ParallelismConfig

SYNTHETIC = ["train.kind=synthetic", "~train.options", "moe.zero_token.action=off", "parallelism.ep=1"]


@pytest.mark.parametrize(("overrides", "key", "estimate"), [
    (["train.options.hidden=1000000000"], "train.options.hidden", "2.9e+07 TiB"),
    (["train.options.vocab=10000000000"], "train.options.vocab", "7.0 TiB"),
    ([*SYNTHETIC, "train.options.hidden=1000000000"], "train.options.hidden", "3.6e+06 TiB"),
    ([*SYNTHETIC, "train.options.batch=100000000000"], "train.options.batch", "34.9 TiB"),
])
def test_a_model_no_rank_can_allocate_is_refused(overrides: list[str], key: str, estimate: str) -> None:
    with pytest.raises(PolicyError) as exc:
        load(overrides)
    [issue] = [i for i in exc.value.issues if i.path == key]
    assert f"the model would take about {estimate} on each rank (a lower estimate: fp32 weights and one " \
           "micro-batch's activations" in issue.message
    assert "more than one rank can allocate: " in issue.message and "(the larger of 1.0 TiB and this machine's " \
           "memory)" in issue.message


def test_a_large_model_split_over_many_ranks_passes() -> None:
    llama70b = ["preset=moe_large", "train.options.num_experts=0", "parallelism.ep=1", "moe.zero_token.action=off",
                "train.options.hidden=8192", "train.options.num_layers=80", "train.options.ffn_hidden=28672",
                "train.options.heads=64", "train.options.vocab=128000", "train.options.seq_len=8192",
                "parallelism.tp=8", "parallelism.pp=8"]
    options = load(llama70b).policy.train.options
    assert 0.1 < modelsize.rank_bytes(options, ParallelismConfig(tp=8, pp=8)) / 2**30 < 10  # type: ignore[operator]
    assert load([*llama70b[:-2], "parallelism.tp=1", "parallelism.pp=1"]).policy  # 250+ GiB on one rank: may fit


def test_the_estimate_splits_what_the_kind_splits() -> None:
    moe = MegatronGPTOptions(num_experts=8)
    whole = modelsize.rank_bytes(moe, ParallelismConfig())
    assert whole == 4 * (moe.model_size().split + moe.model_size().expert)
    assert modelsize.rank_bytes(moe, ParallelismConfig(ep=8)) == 4 * (moe.model_size().split
                                                                     + moe.model_size().expert // 8)
    synthetic = SyntheticOptions()
    assert modelsize.rank_bytes(synthetic, ParallelismConfig(tp=8)) == 4 * synthetic.model_size().whole
    assert modelsize.rank_bytes(None, ParallelismConfig()) is None
