"""The locked environment: every package pinned and hashed, and the lock still satisfies pyproject's ranges.

An edit of pyproject.toml that the lock no longer meets (a new dependency, a raised floor) fails here until
``make lock`` is run; what a fresh machine installs is then what CI tested.
"""

from __future__ import annotations

import importlib.metadata
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.helpers import ROOT
from tests.lockfile import LOCK, LOCK_PY312, LOCKS, diff, hashed, lock_for, pins, unmet

TEXT = LOCK.read_text()
EACH_LOCK = pytest.mark.parametrize("lock", [LOCKS[v] for v in sorted(LOCKS)], ids=lambda p: p.name)


@EACH_LOCK
def test_lock_satisfies_pyproject(lock: Path) -> None:
    command = "make lock" if lock == LOCK else "make lock-py312"
    assert unmet(pins(lock.read_text())) == [], f"{lock} no longer meets pyproject.toml: run `{command}`"


@EACH_LOCK
def test_every_locked_package_is_pinned_and_hashed(lock: Path) -> None:
    counts = hashed(lock.read_text())
    assert len(counts) > 40, "the lock names the whole environment, transitive packages included"
    assert sorted(name for name, n in counts.items() if n == 0) == []
    assert {"pip", "setuptools", "wheel", "pip-tools"} <= set(counts), "the tools that build the env are locked"


def test_torch_is_the_cpu_build_on_disk() -> None:
    torch = pins(TEXT)[canonicalize_name("torch")]
    assert torch.public == "2.13.0" and torch.local == "cpu"
    assert not [n for n in pins(TEXT) if n.startswith("nvidia-")], "a CUDA torch's dependencies are in the lock"


def test_the_python_312_stack_is_the_newest_megatron_core_with_the_same_torch() -> None:
    """The 3.12 lock is what pip gives a new user there: megatron-core 0.17 or later (wheels for Python >= 3.12 only)
    and PyPI's torch 2.13.0, a CUDA build with its nvidia-* libraries (no CPU build for 3.12 is reachable here)."""
    locked = pins(LOCK_PY312.read_text())
    assert locked[canonicalize_name("megatron-core")] >= Version("0.17")
    assert locked[canonicalize_name("megatron-core")] > pins(TEXT)[canonicalize_name("megatron-core")]
    assert locked[canonicalize_name("torch")] == Version("2.13.0")
    assert any(n.startswith("nvidia-") for n in locked)
    assert "nvidia-resiliency-ext" not in locked, "the suite's NVRx lives in a side folder (requirements/nvrx-py312.txt)"


@EACH_LOCK
def test_lock_records_how_it_is_made(lock: Path) -> None:
    command = "make lock" if lock == LOCK else "make lock-py312"
    assert command in lock.read_text().split("\n\n", 1)[0], "the lock's header names the command that rewrites it"
    makefile = (ROOT / "Makefile").read_text()
    assert "--require-hashes --no-deps -r $(LOCK)" in makefile and "pip-sync" in makefile
    assert "--require-hashes --no-deps -r $(LOCK312)" in makefile


def test_pins_unmet_and_diff_read_what_they_should() -> None:
    locked = pins("a==1.0 \\\n    --hash=sha256:00\nb-c==2.0\n# c==9\n")
    assert locked == {"a": Version("1.0"), "b-c": Version("2.0")}
    assert diff(locked, {"a": Version("1.1"), "b-c": Version("2.0"), "d": Version("3")}) == [
        "  a: lock 1.0 -> 1.1", "  d: lock - -> 3"]
    assert any(p.startswith("torch") for p in unmet({"torch": Version("1.0")}))


def test_this_environment_is_the_locked_one() -> None:
    """What `make test` runs in is exactly the lock (an env made by hand may differ: then this says how)."""
    venv = Path(sys.prefix)
    if not (venv / ".lifecycle-installed").exists():
        pytest.skip(f"{venv} is not an environment made by `make test`")
    lock = lock_for(sys.version_info[:2])
    assert lock is not None, f"no lock for Python {sys.version_info[:2]}"
    # Installed distributions only: once setuptools is imported its vendored packages' metadata is on sys.path too.
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    here = {canonicalize_name(d.metadata["Name"]): Version(d.version)
            for d in importlib.metadata.distributions(path=site)
            if canonicalize_name(d.metadata["Name"]) != "megatron-lifecycle"}
    assert diff(pins(lock.read_text()), here) == []
