"""The distributed optimizer in `lifecycle run`: preset=moe_large (two instances, overlapped reduce and gather)
on 8 ranks, and a resume at another data-parallel size."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from lifecycle.distributed.layout import build_layout
from tests.distributed.runs import FAST, Run, lifecycle_run

pytestmark = pytest.mark.distributed


def _losses(run: Run) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in run.events()[0] if e["name"] == "step" and e["kind"] == "end"}


@pytest.mark.timeout(150)
def test_moe_large_reduces_gradients_over_inter_dist_opt_every_step(tmp_path: Path) -> None:
    # preset=moe_large: tp2 ep4 etp1, 2 distributed-optimizer instances (each expert-dp group [r, r+4] is
    # split in two: the inter-instance group carries the all-reduce of every gradient bucket).
    run = lifecycle_run(tmp_path, 8, "preset=moe_large", *FAST, "train.steps=4", "checkpoint.every_steps=2", timeout=140)
    assert run.code == 0, run.output
    layout = build_layout(8, tp=2, ep=4, etp=1, dist_opt_instances=2)
    for rank, events in run.events().items():
        inter = [e for e in events if e["name"] == "grad_reduce" and e["kind"] == "begin"
                 and "inter_dist_opt" in e["group"].split("=")]
        # One all-reduce per bucket group per step: the dense and the expert gradient buffer.
        assert Counter(e["step"] for e in inter) == {1: 2, 2: 2, 3: 2, 4: 2}, (rank, inter)
        assert {tuple(e["ranks"]) for e in inter} == {tuple(layout.ranks_of("inter_dist_opt", rank) or [])}
        gathers = [e for e in events if e["name"] == "param_gather" and e["kind"] == "begin"]
        # overlap_param_gather: an update is gathered in the next step's forward, or by the save that follows it.
        assert {(e["phase"], e["step"]) for e in gathers} == {("train", 1), ("train", 2), ("checkpoint", 2),
                                                              ("train", 4), ("checkpoint", 4)}, rank
    s = run.summary()
    assert s["loss"]["last"] < s["loss"]["first"] - 0.5
    ck = run.run_dir / "checkpoints"
    assert (ck / "latest").read_text().strip() == "iter_0000004"
    assert (ck / "iter_0000002" / "metadata.json").is_file()


@pytest.mark.megatron
@pytest.mark.timeout(150)
def test_resume_at_another_data_parallel_size_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    # dp4 x 1 micro-batch and dp2 x 2 micro-batches see the same global batch of each step (see
    # model.step_batches); the distributed optimizer's dp_reshardable checkpoint loads at either size.
    common = [*FAST, "train.options.use_distributed_optimizer=true", "checkpoint.every_steps=0"]
    ck = tmp_path / "ckpt"
    full = lifecycle_run(tmp_path / "a", 4, *common, "train.steps=4", "checkpoint.at_end=false")
    assert full.code == 0, full.output
    first = lifecycle_run(tmp_path / "b", 4, *common, "train.steps=2", f"checkpoint.dir={ck}")
    assert first.code == 0, first.output
    resumed = lifecycle_run(tmp_path / "c", 2, *common, "train.steps=4", "train.options.num_microbatches=2",
                            f"checkpoint.dir={ck}")
    assert resumed.code == 0, resumed.output
    assert "resumed from step 2" in resumed.proc.stdout
    assert "was saved at world size 4, this run has 2" in resumed.log(0)
    a, c = _losses(full), _losses(resumed)
    assert sorted(c) == [3, 4]
    assert c[3] == pytest.approx(a[3], rel=1e-5) and c[4] == pytest.approx(a[4], rel=1e-5), (a, c)
