"""A corpus of bad policies: each exits 2, names the key path, and prints no traceback."""

from __future__ import annotations

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
    "exit_codes": "teardown.exit_codes: exit codes hang, rank_failed, teardown_deadline must be distinct",
    "schema_version": "schema_version: this lifecycle reads schema version 1",
    "bad_yaml": "bad_yaml.yaml:3:1: not valid YAML",
}

OVERRIDES = {
    "override_syntax": (["a=b=c"], "a: bad override syntax"),
    "override_typo": (["train.options.hiden=3"], "train.options.hiden: Could not override"),
    "override_type": (["watchdog.deadlines.init=abc"], "watchdog.deadlines.init: Input should be a valid number"),
    "override_preset": (["preset=nope"], "Could not find 'preset/nope'; available: dense, moe, moe_large"),
    "override_target": (["+_target_=os.system"], "_target_: a policy never names code"),
    "override_env": (["run.name=${oc.env:LIFECYCLE_TEST_UNSET_VAR}"], "run.name: interpolation failed"),
    "switch_kind": (["train.kind=synthetic"], "train.options.num_layers: not an option of train kind 'synthetic'"),
    "missing_dir": (["--config-dir", "/nonexistent/dir"], "--config-dir: is not a directory"),
    "missing_file": (["--config-name", "nope"], "config not found: Cannot find primary config 'nope'"),
}


def _check(proc, expected: str) -> None:  # type: ignore[no-untyped-def]
    assert proc.returncode == 2, proc.stderr + proc.stdout
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
