"""The verdict on real evidence made here (tests/data/diagnose/make.py): jobs that do not use lifecycle, plain
torch.distributed and plain megatron-core loops under torchrun on gloo, with and without Flight Recorder dumps,
each with one injected fault whose culprit ``expected.json`` names. Every case is named right, or left undecided
with what is missing; none is ever wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lifecycle.diagnose import diagnose
from lifecycle.diagnose.report import Layout, layout_of

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
    "megatron_raise": "crashed", "ray_raise": "crashed", "plain_exit_console": "crashed",
    "plain_killed_outside_fr": "never entered",
}
# A skipped dp all-reduce at tp2 x dp2: ranks 1 and 3 wait for each other and only their own order conflicts (the
# others share no reordered group with them): diverged, the culprit among the two suspects, neither named
CYCLES = {"plain_skip_fr", "megatron_skip_fr"}


def _expected(name: str) -> dict[str, object]:
    data: dict[str, object] = json.loads((CASES / name / "expected.json").read_text())
    return data


def _layout(name: str) -> Layout | None:
    """The job's layout as its user gives it (``diagnose -w N -o ...``): gloo's dumps need it to rule out sends
    and receives (gloo records none) and to know each group's members."""
    expected = _expected(name)
    overrides = expected.get("diagnose_overrides")
    if not isinstance(overrides, list):
        return None
    return layout_of([str(o) for o in overrides], None, "config", int(str(expected.get("world_size", 4))))


@pytest.mark.parametrize("name", NAMES)
def test_the_verdict_names_the_culprit_or_says_what_is_missing(name: str) -> None:
    out = diagnose([str(CASES / name)], layout=_layout(name)).as_json()
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
        out = diagnose([str(CASES / name)], layout=_layout(name)).as_json()
        if out["culprits"] and out["culprits"] != _expected(name)["culprits"]:
            wrong.append(name)
        named += bool(out["culprits"])
    assert wrong == []
    assert named == len(DECIDED) and len(NAMES) >= 22


def test_stages_groups_and_dimensions_of_the_decided_cases() -> None:
    save = diagnose([str(CASES / "plain_stall_save_fr")], layout=_layout("plain_stall_save_fr")).as_json()
    assert save["stage"] == "checkpoint" and save["group"]["desc"] == "default_pg"
    assert any(k["key"] == "checkpoint.coordination" for k in save["prevent"])
    init = diagnose([str(CASES / "plain_no_rendezvous")]).as_json()
    assert init["stage"] == "init" and any(k["key"] == "watchdog.deadlines.init" for k in init["prevent"])
    meg = diagnose([str(CASES / "megatron_stall_inside_fr")], layout=_layout("megatron_stall_inside_fr")).as_json()
    assert meg["dimension"] == "dp" and meg["group"]["desc"] == "DATA_PARALLEL_GROUP" and meg["op"] == "all_reduce"
    skip = diagnose([str(CASES / "plain_skip_fr")]).as_json()
    assert any(k["key"] == "watchdog.sequence_check" for k in skip["prevent"])


def test_dumps_alone_and_logs_alone_of_one_job() -> None:
    case = CASES / "plain_stall_before_fr"
    # gloo's dumps record no send or receive: alone, they cannot prove rank 1 waits in none
    dumps_only = diagnose([str(case / "fr")]).as_json()
    assert dumps_only["culprits"] == [] and dumps_only["suspects"] == [1]
    assert any("no point-to-point op" in m for m in dumps_only["missing"])
    assert all("file name" in d["rank_from"] for d in dumps_only["inputs"]["dumps"].values())
    # the job's layout (no pipeline) settles it
    layout = {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "pp": [[0], [1], [2], [3]], "world": [[0, 1, 2, 3]]}
    with_layout = diagnose([str(case / "fr")], layout=layout).as_json()
    assert with_layout["culprits"] == [1] and with_layout["group"]["desc"] == "tp"
    logs_only = diagnose([str(case / "logs"), str(case / "console.txt")]).as_json()
    assert logs_only["culprits"] == [] and any("Flight Recorder" in m for m in logs_only["missing"])


def test_a_job_killed_from_outside_while_hung_is_decided_by_its_dumps_and_its_layout() -> None:
    # world 6 (tp pairs, dp triples), rank 5 stalled before its step, the collective timeout 300 s: torchrun was
    # SIGTERMed from outside after 12 s, every rank dumped on SIGTERM, no rank logged an error
    case = CASES / "plain_killed_outside_fr"
    alone = diagnose([str(case)]).as_json()
    assert alone["culprits"] == [] and alone["suspects"] == [5]  # no log says where the waiting ranks were
    layout = {"tp": [[0, 1], [2, 3], [4, 5]], "dp": [[0, 2, 4], [1, 3, 5]], "pp": [[r] for r in range(6)],
              "world": [list(range(6))]}
    out = diagnose([str(case)], layout=layout).as_json()
    assert out["culprits"] == [5] and out["cause"] == "never entered" and out["group"]["ranks"] == [4, 5]


def test_a_pipeline_on_gloo_never_names_the_rank_blocked_in_its_send() -> None:
    # world 6, two stages: rank 4 (stage 1) stalls before its receive; rank 1 blocks in its send to rank 4, which
    # gloo's dumps do not record, so rank 1 looks past every collective it entered
    case = CASES / "pipe_stall_fr"
    out = diagnose([str(case)]).as_json()
    assert 1 not in out["culprits"] and out["culprits"] in ([], [4]), out
    layout = {"tp": [[r] for r in range(6)], "dp": [list(range(6))], "pp": [[0, 3], [1, 4], [2, 5]],
              "world": [list(range(6))]}
    assert 1 not in diagnose([str(case)], layout=layout).as_json()["culprits"]
