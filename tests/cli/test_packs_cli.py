"""Policy packs end to end: the example pack installed with pip into a temporary target (never into the
shared environment), put on a subprocess's PYTHONPATH, and used by name: policies, validate, explain, diff,
run. Plus hand-built packs in tmp that target another schema version or fail to import."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, install_team_pack, run_cli

OLD_MSG = ("pack old (old-acme-pack 0.3.0): unusable pack (it ships preset/future.yaml, which this policy asks "
           "for): targets lifecycle policy schema version 2, but this lifecycle (0.2.0) reads schema version 1")


@pytest.fixture(scope="module")
def pack_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/team_pack installed into a folder of its own (see tests.helpers.install_team_pack)."""
    site = install_team_pack(tmp_path_factory.mktemp("pack"))
    assert (site / "acme_lifecycle_policies" / "preset" / "acme_moe_large.yaml").is_file()
    return site


def _env(*paths: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(str(p) for p in paths)}


def _fake_dist(site: Path, dist: str, version: str, module: str, init: str, presets: dict[str, str]) -> None:
    """An installed distribution as importlib.metadata sees it: a package and a dist-info with entry points."""
    pkg = site / module
    (pkg / "preset").mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    for name, text in presets.items():
        (pkg / "preset" / f"{name}.yaml").write_text(text)
    info = site / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[lifecycle.policy_packs]\n{module.split('_')[0]} = {module}\n")


@pytest.fixture(scope="module")
def bad_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two unusable packs: ``old`` targets schema 2, ``broken`` raises on import."""
    site = tmp_path_factory.mktemp("bad_packs")
    _fake_dist(site, "old-acme-pack", "0.3.0", "old_acme_pack", "LIFECYCLE_SCHEMA_VERSION = 2\n",
               {"future": "# @package _global_\ndescription: from the future\nnew_section: {x: 1}\n"})
    _fake_dist(site, "broken-pack", "2.0", "broken_pack", "raise RuntimeError('boom')\n",
               {"broken": "# @package _global_\ndescription: never loads\n"})
    return site


def test_policies_lists_pack_presets_kinds_and_the_pack(pack_site: Path) -> None:
    proc = run_cli("policies", env=_env(pack_site))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    line = next(x for x in out.splitlines() if x.strip().startswith("acme_moe_large"))
    assert "pack acme (acme-lifecycle-policies 1.0.0)" in line and "ACME house MoE-large" in line
    assert any(x.split()[:2] == ["moe_large", "built-in"] for x in out.splitlines())
    assert "acme_synthetic  package acme-lifecycle-policies" in out
    assert "acme  acme-lifecycle-policies 1.0.0  schema 1" in out


def test_policies_json_and_user_dir_shadows_the_pack(pack_site: Path, tmp_path: Path) -> None:
    (tmp_path / "preset").mkdir()
    (tmp_path / "preset" / "acme_moe_large.yaml").write_text("# @package _global_\n# My own variant.\n"
                                                           "defaults: [moe, _self_]\n")
    proc = run_cli("policies", "--json", "--config-dir", str(tmp_path), env=_env(pack_site))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    mine = [c for c in info["configs"] if c["choose"] == "preset=acme_moe_large"]
    assert [(c["origin"], c["shadowed_by"]) for c in mine] == [
        ("user dir", None), ("pack acme (acme-lifecycle-policies 1.0.0)", "user dir")]
    assert mine[0]["description"] == "My own variant."


def test_validate_pack_preset_by_name_with_overrides(pack_site: Path) -> None:
    proc = run_cli("validate", "preset=acme_moe_large", "checkpoint.keep_last=7", "parallelism.ep=8",
                   env=_env(pack_site))
    assert proc.returncode == 0, proc.stderr
    assert "tp=2" in proc.stdout and "ep=8" in proc.stdout and "checkpoint every 50" in proc.stdout
    proc = run_cli("validate", "preset=acme_smoke", "train.options.lr_warmup_steps=-1", env=_env(pack_site))
    assert proc.returncode == 2 and "train.options.lr_warmup_steps: Input should be greater than or equal to 0" \
        in proc.stderr


def test_validate_with_pack_installed_stays_torch_free(pack_site: Path) -> None:
    code = ("import sys; from lifecycle.cli import main; rc = main(['validate', 'preset=acme_smoke']); "
            "assert rc == 0; bad = [m for m in ('torch', 'megatron') if m in sys.modules]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, **_env(pack_site)})
    assert proc.returncode == 0, proc.stderr


def test_explain_names_the_file_of_each_value(pack_site: Path) -> None:
    proc = run_cli("explain", "preset=acme_moe_large", "checkpoint.keep_last=7", env=_env(pack_site))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()

    def keys_of(header: str) -> str:
        i = lines.index(f"  {header}")
        return " ".join(x.strip() for x in itertools.takewhile(lambda x: x.startswith("      "), lines[i + 1:]))

    pack_keys = keys_of("pack acme (acme-lifecycle-policies 1.0.0) preset/acme_moe_large.yaml")
    assert "checkpoint.every_steps" in pack_keys and "watchdog.deadlines.checkpoint" in pack_keys
    assert "checkpoint.keep_last" not in pack_keys  # the command line set it last
    assert "parallelism.{tp,pp,cp,ep,etp,dist_opt_instances}" in keys_of("built-in preset/moe_large.yaml")
    assert keys_of("command line") == "checkpoint.keep_last"
    proc = run_cli("explain", "--json", "preset=acme_moe_large", env=_env(pack_site))
    src = json.loads(proc.stdout)["sources"]
    assert src["checkpoint.keep_last"]["source"] == "pack acme (acme-lifecycle-policies 1.0.0)"
    assert src["checkpoint.keep_last"]["path"].startswith(str(pack_site))
    assert src["checkpoint.async"]["file"] == "preset/moe_large.yaml" and src["run.seed"]["file"] == "config.yaml"
    assert src["train.options.lr"]["source"] == "default"


def test_diff_house_variant_against_the_built_in(pack_site: Path) -> None:
    proc = run_cli("diff", "preset=moe_large", "preset=acme_moe_large checkpoint.keep_last=9", env=_env(pack_site))
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout
    for line in ("checkpoint.every_steps: 10 -> 50", "checkpoint.keep_last: 3 -> 9",
                 "watchdog.deadlines.checkpoint: 1200.0 -> 1800.0", 'run.name: "lifecycle" -> "acme-moe"'):
        assert f"  {line}\n" in out
    assert "parallelism" not in out and out.rstrip().endswith("8 keys differ")


def test_diff_same_policy_exit_0_common_overrides_and_json(pack_site: Path) -> None:
    proc = run_cli("diff", "preset=acme_moe_large", "preset=acme_moe_large", "run.id=ci", env=_env(pack_site))
    assert proc.returncode == 0 and "no differences" in proc.stdout
    proc = run_cli("diff", "--json", "", "train.kind=synthetic ~train.options", env=_env(pack_site))
    assert proc.returncode == 1, proc.stderr
    changes = {c["path"]: c for c in json.loads(proc.stdout)["changes"]}
    assert changes["train.kind"]["b"] == "synthetic" and changes["train.options.num_layers"]["absent"] == ["b"]


def test_diff_bad_side_exits_2_naming_the_side() -> None:
    proc = run_cli("diff", "preset=moe", "preset=moe checkpoint.keep_last=-1")
    assert proc.returncode == 2 and "B: 'preset=moe checkpoint.keep_last=-1'" in proc.stderr
    assert "checkpoint.keep_last: Input should be greater than or equal to 0 (got -1)" in proc.stderr


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_run_uses_the_pack_handler_kind(pack_site: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli("run", "--nproc", "2", "preset=acme_smoke", "train.steps=3", f"run.dir={run_dir}",
                   env=_env(pack_site), timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [json.loads(line) for line in (run_dir / "events" / "rank_0.jsonl").read_text().splitlines()]
    lrs = [e["lr"] for e in steps if e.get("name") == "step" and "lr" in e]
    assert lrs == pytest.approx([0.05 / 3, 0.1 / 3, 0.05])  # the pack's linear warm-up ran


def test_incompatible_pack_clear_error_only_when_used(pack_site: Path, bad_site: Path) -> None:
    env = _env(pack_site, bad_site)
    proc = run_cli("validate", "preset=future", env=env)
    assert proc.returncode == 2 and OLD_MSG in proc.stderr and "Traceback" not in proc.stderr
    assert "install a release of old-acme-pack that targets schema 1, or a lifecycle that reads schema 2" \
        in proc.stderr
    proc = run_cli("validate", "preset=broken", env=env)
    assert proc.returncode == 2 and "pack broken (broken-pack 2.0): unusable pack" in proc.stderr
    assert "cannot import package 'broken_pack': RuntimeError: boom" in proc.stderr
    for args in (["validate"], ["validate", "preset=acme_moe_large"]):  # other policies are unaffected
        proc = run_cli(*args, env=env)
        assert proc.returncode == 0 and not proc.stderr, proc.stderr


def test_policies_lists_unusable_packs_and_exits_2(pack_site: Path, bad_site: Path) -> None:
    proc = run_cli("policies", env=_env(pack_site, bad_site))
    assert proc.returncode == 2
    assert "acme_moe_large" in proc.stdout and "future" not in proc.stdout
    assert "old     old-acme-pack 0.3.0            UNUSABLE: targets lifecycle policy schema version 2" \
        in proc.stdout
    assert "error: pack old (old-acme-pack 0.3.0): targets lifecycle policy schema version 2" in proc.stderr
    assert "error: pack broken (broken-pack 2.0): cannot import package 'broken_pack'" in proc.stderr
