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


NVRX_ENV = "LIFECYCLE_TEST_NVRX"
"""A folder holding nvidia-resiliency-ext 0.6+ (``make test-py312`` unpacks it there: requirements/nvrx-py312.txt);
the tests of ``checkpoint.async_strategy=nvrx`` put it on their jobs' path, the rest of the suite runs without it."""


def nvrx_missing() -> str | None:
    """Why the nvrx tests cannot run here (None when they can)."""
    from lifecycle.policy import installed

    mc = installed.megatron_version()
    if mc is None or mc[:2] < installed.ASYNC_STRATEGY_FROM:
        return f"megatron-core {installed.version(installed.MEGATRON)} has no async_strategy (0.17+): nothing to test"
    folder = os.environ.get(NVRX_ENV, "")
    if not folder or not (Path(folder) / "nvidia_resiliency_ext").is_dir():
        return f"{NVRX_ENV} names no folder with nvidia-resiliency-ext (make test-py312 sets it)"
    return None


def nvrx_env() -> dict[str, str]:
    """The environment of a job that sees nvidia-resiliency-ext (:data:`NVRX_ENV`'s folder on PYTHONPATH)."""
    path = [os.environ[NVRX_ENV], *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path)}
