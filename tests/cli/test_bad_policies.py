"""A corpus of bad policies: each exits 2, names the key path, and prints no traceback.

Hostile inputs of issue 11 are part of it (alias and interpolation bombs, deep nesting, binary and
non-UTF-8 files, huge integers, non-finite deadlines, Hydra settings); ``test_hostile.py`` adds the ones
that need a generated file or folder and measures time and memory.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import run_cli

BAD = Path(__file__).parent / "bad_policies"

FILES = {
    "typo_section": "warmpu: unknown key",
    "typo_key": "checkpoint.every_step: unknown key",
    "wrong_type": "train.steps: Input should be a valid integer",
    "negative_steps": "train.steps: Input should be greater than or equal to 0 (got -1)",
    "unknown_group": "warmup.groups: unknown group 'expert_dp'",
    "unknown_op": "warmup.ops.1: Input should be 'barrier'",
    "unknown_kind": "train.kind: unknown train handler kind; available names: megatron_gpt, synthetic",
    "target": "train.options._target_: a policy never names code",
    "deadline_zero": "watchdog.deadlines.checkpoint: Input should be greater than 0",
    "teardown_short": "teardown.deadline_s: must be >= watchdog.deadlines.teardown (30.0)",
    "ep_too_big": "parallelism.ep: must divide train.options.num_experts (4); pick ep in [1, 2, 4] (got 8)",
    "zero_token_bad": "moe.zero_token.action: Input should be 'dummy_forward'",
    "barrier_group": "barriers.after_init.0.group: unknown group 'inter_dist_optim'; did you mean 'inter_dist_opt'?",
    "fault_step_phase": "faults.0: step applies to train and checkpoint drills only, not at=warmup",
    "fault_action": "faults.0.action: Input should be 'stall'",
    "missing_value": "run.name: value is missing",
    "bad_interp": "checkpoint.dir: interpolation failed",
    "exit_codes": "teardown.exit_codes: exit codes hang, rank_failed, teardown_deadline, no_progress must be "
                  "distinct",
    "schema_version": "schema_version: this lifecycle reads schema version 1",
    "bad_yaml": "bad_yaml.yaml:3:1: not valid YAML",
    "alias_bomb": "alias_bomb.yaml:6:20: the policy files expand to more than 5000 values",
    "too_many_values": "too_many_values.yaml:3:",
    # 10,000 levels: refused with the file and line named, by our guard or (PyYAML >= 6.0.4) by the parser first
    "deep_nesting": re.compile(r"deep_nesting\.yaml:2:\d+: (nested deeper than 32 levels|not valid YAML: "
                               r"exceeded maximum nesting depth)"),
    # 40 levels: only our guard refuses this (MAX_DEPTH stays tested whatever the parser does)
    "deep_nesting_guard": "deep_nesting_guard.yaml:2:45: nested deeper than 32 levels; a policy is a few levels "
                          "deep: flatten the file",
    "binary": "binary.yaml:1: not UTF-8: byte 0x89 at byte offset 0 cannot be decoded",
    "not_utf8": "not_utf8.yaml:3: not UTF-8: byte 0xE9 at byte offset 79",
    "huge_int": "huge_int.yaml:2:16: an integer of 5000 digits",
    "interpolation_bomb": "resolving the interpolations here needs",
    "deadline_inf": "watchdog.deadlines.init: Input should be a finite number (inf and nan are refused)",
    "timeout_nan": "barriers.after_init.0.timeout_s: Input should be a finite number",
    "hydra_section": "hydra: in ",
    "sexagesimal": "sexagesimal.yaml:2:19: '1:0' is a base-60 number in YAML 1.1 (the parser would read 60)",
}

OVERRIDES = {
    "override_syntax": (["a=b=c"], "a: bad override syntax"),
    "override_typo": (["train.options.hiden=3"], "train.options.hiden: Could not override"),
    "override_type": (["watchdog.deadlines.init=abc"], "watchdog.deadlines.init: Input should be a valid number"),
    "override_preset": (["preset=nope"], "preset: unknown option of config group preset; its options are: dense, moe, "
                                         "moe_large"),
    "override_target": (["+_target_=os.system"], "_target_: a policy never names code"),
    "override_env": (["run.name=${oc.env:LIFECYCLE_TEST_UNSET_VAR}"], "run.name: interpolation failed"),
    "switch_kind": (["train.kind=synthetic"], "train.options.num_layers: not an option of train kind 'synthetic'"),
    "missing_dir": (["--config-dir", "/nonexistent/dir"], "--config-dir: is not a directory"),
    "missing_file": (["--config-name", "nope"], "config not found: Cannot find primary config 'nope'"),
    "group_number": (["checkpoint=5"], "checkpoint: a config group takes the name of one of its options: async, "
                     "off; to use none, leave it out (or ~checkpoint) (got 5)"),
    "group_null": (["preset=null"], "preset: a config group takes the name of one of its options: dense, moe, "
                   "moe_large"),
    "huge_int_override": (["train.steps=" + "9" * 100_000], "<overrides>: the overrides are longer than 4096 "
                          "characters together"),
    "long_key": ([".".join(["a"] * 1000) + "=1"], "the key has 1000 parts"),
    "deep_override": (["+x=" + "[" * 40 + "]" * 40], "x: the value nests 40 brackets deep; the limit is 32"),
    "hydra_override": (["hydra.job.chdir=true"], "hydra.job.chdir: policies configure lifecycle, not Hydra"),
    "hydra_searchpath": (["hydra.searchpath=[file:///etc]"], "hydra.searchpath: policies configure lifecycle"),
    "inf_deadline": (["watchdog.deadlines.step=inf"], "watchdog.deadlines.step: Input should be a finite number"),
    "nan_grace": (["checkpoint.grace_s=nan"], "checkpoint.grace_s: Input should be a finite number"),
    "huge_deadline": (["teardown.deadline_s=1e300"], "teardown.deadline_s: Input should be less than or equal to "
                      "1000000000"),
    "bool_as_int": (["parallelism.tp=true"], "parallelism.tp: Input should be an integer, not a boolean (got True)"),
    "bool_as_optional_int": (["parallelism.etp=false"], "parallelism.etp: Input should be an integer, not a boolean"),
    "seed_2**63": (["run.seed=9223372036854775808"], "run.seed: Input should be less than or equal to 4294967295"),
    "required_absent_group": (["warmup.required=[inter_dist_opt]"], "warmup.required: names inter_dist_opt, which "
                              "megatron creates only with parallelism.dist_opt_instances > 1"),
    "config_name_escape": (["--config-name", "../../etc/passwd"], "--config-name: must be a file name in the "
                           "config dir"),
}


def _check(proc, expected: str | re.Pattern[str]) -> None:  # type: ignore[no-untyped-def]
    assert proc.returncode == 2, proc.stderr + proc.stdout
    if isinstance(expected, re.Pattern):
        assert expected.search(proc.stderr), proc.stderr
    else:
        assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", sorted(FILES))
def test_bad_policy_file(name: str) -> None:
    _check(run_cli("validate", "--config-dir", str(BAD), "--config-name", name), FILES[name])


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_bad_override(name: str) -> None:
    args, expected = OVERRIDES[name]
    _check(run_cli("validate", *args), expected)


def test_corpus_is_complete() -> None:
    assert sorted(p.stem for p in BAD.glob("*.yaml")) == sorted(FILES)
    assert len(FILES) + len(OVERRIDES) >= 15


@pytest.mark.parametrize(("value", "expected"), [
    ("abc", "LIFECYCLE_MAX_POLICY_BYTES: must be a positive number of bytes"),
    ("0", "LIFECYCLE_MAX_POLICY_BYTES: must be a positive number of bytes"),
    (str(10**30), "LIFECYCLE_MAX_POLICY_BYTES: is larger than 10^12 bytes"),
])
def test_a_bad_size_limit_is_named(value: str, expected: str) -> None:
    _check(run_cli("validate", env={"LIFECYCLE_MAX_POLICY_BYTES": value}), expected)
