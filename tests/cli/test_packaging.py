"""The wheel carries conf/: an installed lifecycle finds its presets without the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT


@pytest.mark.timeout(120)
def test_wheel_ships_the_presets(tmp_path: Path) -> None:
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    had_build = (ROOT / "build").exists()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True, timeout=100, cwd=tmp_path)
    if not had_build:  # pip builds in the source tree; leave it as it was
        shutil.rmtree(ROOT / "build", ignore_errors=True)
    wheel = next(wheels.glob("megatron_lifecycle-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=100)
    code = ("import lifecycle, sys; from lifecycle.policy.load import load; from lifecycle.policy.roots import builtin_conf_dir; "
            "print(lifecycle.__file__); print(builtin_conf_dir()); print(load(['preset=moe_large']).policy.description)")
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    module, conf, description = proc.stdout.strip().splitlines()
    assert module.startswith(str(target)) and conf == str(target / "lifecycle" / "conf")
    assert "house MoE at scale" in description


def test_the_example_pack_requires_this_projects_own_distribution() -> None:
    import tomllib
    from packaging.requirements import Requirement

    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pack = tomllib.loads((ROOT / "examples" / "team_pack" / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in pack["dependencies"]]
    mine = [r for r in reqs if r.name == ours["name"]]
    assert ours["name"] == "megatron-lifecycle" and len(mine) == 1, reqs
    assert mine[0].specifier.contains(ours["version"]), (mine[0], ours["version"])
    assert not [r for r in reqs if r.name == "lifecycle"], "`lifecycle` on the package index is another project"
