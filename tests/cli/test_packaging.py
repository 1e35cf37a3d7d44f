"""The wheel: it carries conf/ (an installed lifecycle finds its presets without the source tree), and pip
installs it beside a GPU user's torch without replacing that torch."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import ROOT
from tests.lockfile import LOCK, pins

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This project's wheel, built once for the module."""
    wheels = tmp_path_factory.mktemp("wheels")
    had_build = (ROOT / "build").exists()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True, timeout=100, cwd=wheels)
    if not had_build:  # pip builds in the source tree; leave it as it was
        shutil.rmtree(ROOT / "build", ignore_errors=True)
    return next(wheels.glob("megatron_lifecycle-*.whl"))


@pytest.mark.timeout(120)
def test_wheel_ships_the_presets(tmp_path: Path, wheel: Path) -> None:
    target = tmp_path / "site"
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


# What pip finds on an index, as metadata-only stand-in wheels. A CUDA torch newer than any installed one,
# with the CUDA libraries it pulls in: what pip downloads when it decides to replace the user's torch.
NVIDIA = [f"nvidia-{lib}-cu12" for lib in ("cublas", "cudnn", "nccl", "cuda-runtime")]
CUDA_TORCH = ("torch", "2.14.0", [f"{name}==12.8.0" for name in NVIDIA])
# megatron-core's own requirements (its metadata): 0.15.3 and later need torch>=2.6.0; 0.15.2 names none.
MEGATRON_CORE = {"0.16.1": ["torch>=2.6.0", "numpy", "packaging>=24.2"],
                 "0.15.2": ["torch", "numpy<2.0.0", "packaging>=24.2"]}


def _metadata(name: str, version: str, requires: list[str]) -> str:
    return "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)])


def _standin_wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    """A wheel with metadata only: all pip's resolver reads."""
    stem = f"{canonicalize_name(name).replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{stem}.dist-info/METADATA", _metadata(name, version, requires))
        whl.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                     "Tag: py3-none-any\n")
        whl.writestr(f"{stem}.dist-info/RECORD", "")


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --find-links folder: the CUDA torch, two megatron-core releases, and every other dependency of this
    project and of megatron-core at its locked version (numpy also below 2, for megatron-core 0.15.2)."""
    folder = tmp_path_factory.mktemp("index")
    wheels = [CUDA_TORCH, *((name, "12.8.0", []) for name in NVIDIA), ("numpy", "1.26.4", []),
              *(("megatron-core", version, reqs) for version, reqs in MEGATRON_CORE.items())]
    locked = pins(LOCK.read_text())
    needed = {Requirement(r).name for r in [*PROJECT["dependencies"], *MEGATRON_CORE["0.16.1"]]}
    needed -= {"torch", "megatron-core"}
    wheels += [(name, str(locked[canonicalize_name(name)]), []) for name in needed]
    for name, version, requires in wheels:
        _standin_wheel(folder, name, version, requires)
    return folder


def _pip_plan(tmp: Path, wheel: Path, index: Path, torch: str, *,
              held: bool) -> subprocess.CompletedProcess[str]:
    """What `pip install WHEEL` would do in an environment that holds only a GPU user's torch (metadata only),
    offline: the stand-in index is all it sees. ``held``: a constraint pins that torch, as NVIDIA's containers
    do with /etc/pip/constraint.txt (PIP_CONSTRAINT) and as docs/install.md tells a user to."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(tmp / "env")
    info = next((tmp / "env" / "lib").glob("python3*/site-packages")) / f"torch-{torch}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(_metadata("torch", torch, []))
    (tmp / "torch.txt").write_text(f"torch=={torch}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check",
           "--python", str(tmp / "env" / "bin" / "python")]
    offline = ["--no-index", "--find-links", str(index)]
    return subprocess.run([*pip, "install", "--dry-run", "--report", "plan.json", *offline,
                           *(["-c", str(tmp / "torch.txt")] * held), str(wheel)],
                          capture_output=True, text=True, timeout=60, env=env, cwd=tmp)


# The torch of NVIDIA's PyTorch containers 25.01 and 25.03.
NGC_25_01, NGC_25_03 = "2.6.0a0+ecf3bae40a.nv25.01", "2.7.0a0+7c8ec84dab.nv25.03"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("torch", "held", "core", "new_torch"), [
    pytest.param("2.6.0", False, "0.16.1", None, id="2.6.0"),
    pytest.param("2.13.0+cu130", False, "0.16.1", None, id="2.13.0+cu130"),
    pytest.param(NGC_25_03, False, "0.16.1", None, id="container-2.7.0a0"),
    # A pre-release of 2.6.0 that megatron-core 0.15.3+ refuses (2.6.0a0 is below their 2.6.0). Held by a
    # constraint, pip refuses the install: megatron-core 0.15.2 would take it, but this project's floor is the oldest
    # tested megatron-core, 0.16.1; not held, megatron-core 0.16.1 has it replaced.
    pytest.param(NGC_25_01, True, None, None, id="container-2.6.0a0-held"),
    pytest.param(NGC_25_01, False, "0.16.1", "2.14.0", id="container-2.6.0a0-not-held"),
    pytest.param("2.5.1+cu124", False, "0.16.1", "2.14.0", id="2.5.1-unsupported"),
])
def test_what_pip_plans_beside_a_gpu_torch(tmp_path: Path, wheel: Path, index: Path, torch: str, held: bool,
                                          core: str | None, new_torch: str | None) -> None:
    """A supported torch stays (no torch, no nvidia-* in the plan); an unsupported one is replaced, or, held, refused."""
    proc = _pip_plan(tmp_path, wheel, index, torch, held=held)
    if core is None:
        assert proc.returncode != 0 and "ResolutionImpossible" in proc.stderr, proc.stdout
        assert "megatron-core 0.16.1 depends on torch>=2.6.0" in proc.stdout, proc.stdout
        assert "megatron_core-0.15.2" not in proc.stdout, "pip never looks below the project's megatron-core floor"
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "plan.json").read_text())
    plan = {item["metadata"]["name"]: item["metadata"]["version"] for item in report["install"]}
    assert plan["megatron-lifecycle"] == PROJECT["version"] and plan["megatron-core"] == core, plan
    assert plan.get("torch") == new_torch, plan
    assert sorted(n for n in plan if n.startswith("nvidia-")) == (sorted(NVIDIA) if new_torch else []), plan


@pytest.mark.timeout(60)
def test_pip_refuses_an_unsupported_torch_it_must_keep(tmp_path: Path, wheel: Path, index: Path) -> None:
    """Held, torch 2.5.1 is refused by this project's own floor (megatron-core 0.15.2 would have taken it)."""
    proc = _pip_plan(tmp_path, wheel, index, "2.5.1+cu124", held=True)
    ours = next(r for r in PROJECT["dependencies"] if Requirement(r).name == "torch")
    assert proc.returncode != 0 and "ResolutionImpossible" in proc.stderr, proc.stdout
    assert f"megatron-lifecycle {PROJECT['version']} depends on {ours}" in proc.stdout, proc.stdout


# Direct dependencies lifecycle never imports, and the megatron-core module that needs each one.
UNIMPORTED = {"einops": "megatron/core/parallel_state.py"}


def _imported_distributions() -> set[str]:
    """The distributions whose top-level modules lifecycle imports (anywhere, lazily too)."""
    tops: set[str] = set()
    for path in (ROOT / "lifecycle").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                tops.add(node.module.split(".")[0])
    by_module = importlib.metadata.packages_distributions()
    return {canonicalize_name(d) for top in tops for d in by_module.get(top, [])}


def test_every_direct_dependency_is_imported_or_needed_by_megatron_core() -> None:
    """A dependency nothing imports is dropped (numpy comes with megatron-core); einops stays while
    megatron-core imports it for distributed-optimizer instances > 1 and declares it only in its extras."""
    imported = _imported_distributions()
    declared = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    assert declared - imported == set(UNIMPORTED)
    core = importlib.metadata.distribution("megatron-core")
    plain = {canonicalize_name(Requirement(r).name) for r in core.requires or [] if not Requirement(r).marker}
    for name, module in UNIMPORTED.items():
        assert name not in plain, f"megatron-core requires {name} now: drop it from pyproject.toml"
        source = Path(str(core.locate_file(module))).read_text()
        assert f"import {name}" in source, f"{module} no longer imports {name}: drop it from pyproject.toml"
