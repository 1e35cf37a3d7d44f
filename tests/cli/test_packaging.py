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
    wheel = next(wheels.glob("lifecycle-*.whl"))
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
