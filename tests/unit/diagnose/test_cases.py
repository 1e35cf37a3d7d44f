"""The verdict on real evidence made here (tests/data/diagnose/make.py): jobs that do not use lifecycle, plain
torch.distributed and plain megatron-core loops under torchrun on gloo, with and without Flight Recorder dumps,
each with one injected fault whose culprit ``expected.json`` names. Every case is named right, or left undecided
with what is missing; none is ever wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lifecycle.diagnose import diagnose

CASES = Path(__file__).resolve().parents[2] / "data" / "diagnose" / "cases"
NAMES = sorted(p.name for p in CASES.iterdir() if (p / "expected.json").is_file())
# What the evidence of each case decides (the rest must be undecided, with what is missing): every dump-backed
# case, every crash and kill the launcher saw, the rendezvous the store named.
DECIDED = {
    "plain_stall_before_fr": "never entered", "plain_stall_inside_fr": "never entered",
    "plain_kill_fr": "crashed", "plain_kill": "crashed", "plain_raise_fr": "crashed", "plain_raise": "crashed",
    "plain_other_group_first_fr": "diverged", "plain_no_rendezvous": "rendezvous",
    "plain_no_rendezvous_fr": "rendezvous", "plain_stall_save_fr": "never entered",
    "megatron_stall_inside_fr": "never entered", "megatron_stall_before_fr": "never entered",
    "megatron_raise": "crashed", "ray_raise": "crashed",
}
# A skipped dp all-reduce at tp2 x dp2: ranks 1 and 3 wait for each other and only their own order conflicts (the
# others share no reordered group with them): diverged, the culprit among the two suspects, neither named
CYCLES = {"plain_skip_fr", "megatron_skip_fr"}


def _expected(name: str) -> dict[str, object]:
    data: dict[str, object] = json.loads((CASES / name / "expected.json").read_text())
    return data


@pytest.mark.parametrize("name", NAMES)
def test_the_verdict_names_the_culprit_or_says_what_is_missing(name: str) -> None:
    out = diagnose([str(CASES / name)]).as_json()
    expected = _expected(name)
    if name in DECIDED:
        assert out["culprits"] == expected["culprits"], out
        assert out["cause"] == DECIDED[name], out
        assert out["evidence"], out
    else:
        assert out["culprits"] == [], out
        assert out["missing"], out
    if name in CYCLES:
        assert out["cause"] == "diverged" and set(expected["culprits"]) <= set(out["suspects"]), out
    group = out["group"]
    if group and group["ranks"] and out["culprits"]:
        assert set(out["culprits"]) <= set(group["ranks"]) or out["cause"] == "crashed", out


def test_the_score_none_wrong_and_most_named() -> None:
    wrong, named = [], 0
    for name in NAMES:
        out = diagnose([str(CASES / name)]).as_json()
        if out["culprits"] and out["culprits"] != _expected(name)["culprits"]:
            wrong.append(name)
        named += bool(out["culprits"])
    assert wrong == []
    assert named == len(DECIDED) and len(NAMES) >= 22


def test_stages_groups_and_dimensions_of_the_decided_cases() -> None:
    save = diagnose([str(CASES / "plain_stall_save_fr")]).as_json()
    assert save["stage"] == "checkpoint" and save["group"]["desc"] == "default_pg"
    assert any(k["key"] == "checkpoint.coordination" for k in save["prevent"])
    init = diagnose([str(CASES / "plain_no_rendezvous")]).as_json()
    assert init["stage"] == "init" and any(k["key"] == "watchdog.deadlines.init" for k in init["prevent"])
    meg = diagnose([str(CASES / "megatron_stall_inside_fr")]).as_json()
    assert meg["dimension"] == "dp" and meg["group"]["desc"] == "DATA_PARALLEL_GROUP" and meg["op"] == "all_reduce"
    skip = diagnose([str(CASES / "plain_skip_fr")]).as_json()
    assert any(k["key"] == "watchdog.sequence_check" for k in skip["prevent"])


def test_dumps_alone_and_logs_alone_of_one_job() -> None:
    case = CASES / "plain_stall_before_fr"
    dumps_only = diagnose([str(case / "fr")]).as_json()
    assert dumps_only["culprits"] == [1] and dumps_only["group"]["desc"] == "tp"
    assert all("file name" in d["rank_from"] for d in dumps_only["inputs"]["dumps"].values())
    logs_only = diagnose([str(case / "logs"), str(case / "console.txt")]).as_json()
    assert logs_only["culprits"] == [] and any("Flight Recorder" in m for m in logs_only["missing"])


def test_the_same_inputs_give_the_same_verdict() -> None:
    case = str(CASES / "plain_other_group_first_fr")
    assert diagnose([case]).as_json() == diagnose([case, case]).as_json()


@pytest.mark.parametrize(("desc", "dim"), [
    ("EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", "tp_ep_pp"),
    # megatron-core 0.19's groups: the expert optimizer's copy of tp_ep_pp, and the one-rank GTP groups (no dimension)
    ("EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP", "tp_ep_pp_egtp"),
    ("GTP_WEIGHT_REMAT_GROUP", None), ("EXPERT_GTP_WEIGHT_REMAT_GROUP", None),
    ("DATA_PARALLEL_GROUP_WITH_CP_AG", "dp_cp"), ("EXPERT_DATA_PARALLEL_GROUP_GLOO", "edp"),
])
def test_megatron_group_descriptions_map_to_their_dimension(desc: str, dim: str | None) -> None:
    from lifecycle.diagnose.prevent import EXPERT, dimension

    assert dimension(desc, None, None) == dim
    assert dim is None or (dim in EXPERT) == desc.startswith("EXPERT")
