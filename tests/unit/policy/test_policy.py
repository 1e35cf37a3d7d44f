"""Schema and loading: defaults, presets, overrides, derived paths, errors with key paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from lifecycle.errors import PolicyError
from lifecycle.policy import load as L
from lifecycle.policy.checks import world_issues
from lifecycle.policy.kinds import is_schema_path
from lifecycle.policy.schema import Policy


def test_default_policy_is_the_moe_job() -> None:
    p = L.load([]).policy
    assert (p.parallelism.ep, p.train.steps, p.checkpoint.every_steps) == (2, 20, 10)
    assert p.train.options.num_experts == 4 and p.moe.zero_token.action == "dummy_forward"
    assert p.checkpoint.dir == f"{p.run.dir}/checkpoints"


@pytest.mark.parametrize("preset", ["dense", "moe", "moe_large"])
def test_presets_validate(preset: str) -> None:
    assert L.load([f"preset={preset}"]).policy.description


def test_moe_large_is_the_house_policy() -> None:
    p = L.load(["preset=moe_large"]).policy
    assert {"all_reduce", "all_to_all", "p2p"} <= set(p.warmup.ops) and p.warmup.groups == "all"
    assert "inter_dist_opt" in [b.group for b in p.barriers.after_init]
    assert p.checkpoint.fully_parallel and p.checkpoint.coordination == "store"
    assert p.moe.zero_token.action == "dummy_forward"


def test_schema_default_keys_override_without_plus() -> None:
    p = L.load(["checkpoint.async=true", "train.options.lr=0.5", "watchdog.deadlines.step=7"]).policy
    assert p.checkpoint.async_ and p.train.options.lr == 0.5 and p.watchdog.deadlines.step == 7


def test_group_options_and_delete() -> None:
    p = L.load(["warmup=full", "checkpoint=off", "~barriers"]).policy
    assert p.warmup.ops == ["barrier", "all_reduce", "all_gather", "all_to_all", "p2p"]
    assert p.checkpoint.resume == "never" and p.barriers.after_init == []


def test_env_interpolation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIFECYCLE_RUN_ID", "job42")
    p = L.load([]).policy
    assert p.run.id == "job42" and p.run.dir.endswith("lifecycle-job42")


def test_user_config_dir_composes_presets(tmp_path: Path) -> None:
    (tmp_path / "house.yaml").write_text("defaults: [_self_, preset: dense]\nrun: {name: house}\n"
                                         "train: {steps: 3}\n")
    loaded = L.load(["train.steps=4"], config_dir=tmp_path, config_name="house")
    # _self_ comes first: the preset overrides the file's train.steps, the command line overrides both.
    assert loaded.policy.train.steps == 4 and loaded.policy.run.name == "house"
    assert loaded.policy.checkpoint.dir == f"runs/house-{loaded.policy.run.id}/checkpoints"


def test_frozen_and_forbid() -> None:
    p = Policy()
    with pytest.raises(ValidationError, match="frozen"):
        p.run.seed = 3  # type: ignore[misc]
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Policy.model_validate({"runn": {}})


def test_errors_list_every_problem_with_paths() -> None:
    with pytest.raises(PolicyError) as info:
        L.validate({"train": {"steps": -1}, "warmup": {"ops": ["nope"]}, "checkpoint": {"keep_last": "x"}})
    paths = sorted(i.path for i in info.value.issues)
    assert paths == ["checkpoint.keep_last", "train.steps", "warmup.ops.0"]


def test_cross_field_rules() -> None:
    with pytest.raises(PolicyError, match=r"parallelism.ep: must divide train.options.num_experts \(4\)"):
        L.validate({"parallelism": {"ep": 3}})
    with pytest.raises(PolicyError, match="moe.zero_token.action: the model has no experts"):
        L.validate({"train": {"options": {"num_experts": 0}}, "moe": {"zero_token": {"action": "warn"}}})
    with pytest.raises(PolicyError, match=r"faults.0.step: is after the last train step \(20\)"):
        L.validate({"faults": [{"at": "train", "step": 50, "ranks": [0], "action": "crash"}]})


def test_world_size_rules() -> None:
    p = L.validate({"parallelism": {"tp": 2, "ep": 4}, "faults": [{"at": "init", "ranks": [9], "action": "raise"}]})
    msgs = [str(i) for i in world_issues(p, 6)]
    assert any("not divisible by tp*pp*cp = 2*1*1 = 2" not in m and "etp*ep*pp" in m for m in msgs)
    assert any("faults.0.ranks: ranks [9] do not exist at world size 6" in m for m in msgs)
    assert world_issues(p, 8) == [i for i in world_issues(p, 8) if "faults" in i.path]


def test_target_anywhere_is_refused() -> None:
    with pytest.raises(PolicyError, match="warmup._target_: a policy never names code"):
        L.validate({"warmup": {"_target_": "os.system"}})


def test_schema_paths() -> None:
    assert is_schema_path("checkpoint.async") and is_schema_path("train.options.hidden")
    assert is_schema_path("watchdog.deadlines.init")
    assert not is_schema_path("checkpoint.asink") and not is_schema_path("train.options.hiden")


def test_resolved_round_trip_and_hash(tmp_path: Path) -> None:
    p = L.load(["preset=moe_large", "checkpoint.async=true"]).policy
    path = L.write_resolved(p, tmp_path)
    again = L.read_resolved(path)
    assert again == p and L.sha256(again) == L.sha256(p)
    assert (tmp_path / "policy.sha256").read_text().strip() == L.sha256(p)
    assert L.sha256(L.load(["run.seed=1"]).policy) != L.sha256(L.load([]).policy)


def test_read_resolved_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "policy.resolved.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(PolicyError, match="policy.resolved.yaml: is not a mapping"):
        L.read_resolved(bad)


def test_the_schema_validates_data_and_the_kind_is_resolved_against_what_is_installed_at_load() -> None:
    import ast
    from pathlib import Path

    from lifecycle.errors import PolicyError
    from lifecycle.policy import schema
    from lifecycle.policy.load import validate

    # As data, a kind no one installed and its options are fine: the schema reads no registry, no entry point.
    data = {"train": {"kind": "megatron_gtp", "options": {"hidden": 32}}}
    assert Policy.model_validate(data).train.options == {"hidden": 32}
    tree = ast.parse(Path(schema.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.startswith("lifecycle.handlers")}, imported
    # The explicit step at load: the same did-you-mean, and the kind's options model applied.
    with pytest.raises(PolicyError) as err:
        validate(data)
    assert err.value.issues[0].path == "train.kind" and "megatron_gpt" in err.value.issues[0].message
    resolved = validate({"train": {"kind": "megatron_gpt", "options": {"hidden": 32}}})
    assert resolved.train.options.hidden == 32 and resolved.train.options.heads == 4
