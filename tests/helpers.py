"""Small helpers shared by the tests (subprocess runs of the CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m lifecycle ARGS`` as a subprocess with a hard timeout."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "lifecycle", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd or ROOT)


def install_team_pack(tmp: Path) -> Path:
    """``pip install --no-deps --target`` of examples/team_pack (built from a copy: the tree stays clean); the site
    folder to put on PYTHONPATH."""
    import shutil

    src = shutil.copytree(ROOT / "examples" / "team_pack", tmp / "src",
                          ignore=shutil.ignore_patterns("build", "*.egg-info"))
    site = tmp / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--no-cache-dir", "--disable-pip-version-check", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def fill_up(folder: Path) -> None:
    """Write zeros into ``folder/filler`` until its file system is full (a small tmpfs the test mounted)."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError:
        pass
    finally:
        os.close(fd)
