"""What is installed that a policy depends on: megatron-core and nvidia-resiliency-ext read from package metadata.

The packages are stand-ins (a ``*.dist-info`` folder with the version, on a temporary ``sys.path`` entry in front):
what the rules read is the metadata pip writes, never an import.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifecycle.errors import PolicyError
from lifecycle.policy import installed
from lifecycle.policy.load import load


def _dist(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder in front of sys.path for stand-in distributions; the version cache is cleared around the test."""
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    installed.version.cache_clear()
    yield tmp_path
    installed.version.cache_clear()


def test_versions_parse_as_release_numbers() -> None:
    assert installed.parse("0.19.2") == (0, 19, 2)
    assert installed.parse("0.16.0rc0.dev131974") == (0, 16, 0)
    assert installed.parse("2.6.0a0+ecf3bae40a.nv25.1") == (2, 6, 0)
    assert installed.parse("unknown") == ()


def test_nvrx_needs_the_package(site: Path) -> None:
    if installed.version(installed.NVRX) is not None:
        pytest.skip("nvidia-resiliency-ext is installed in this environment")
    (issue,) = installed.issues("nvrx")
    assert issue.path == "checkpoint.async_strategy" and "nvidia-resiliency-ext, which is not installed" in issue.message
    assert "checkpoint.async_strategy=auto" in issue.message
    assert installed.issues("auto") == [] and installed.issues("mcore") == []


def test_nvrx_needs_a_megatron_core_that_takes_it_and_a_version_it_imports(site: Path) -> None:
    _dist(site, "megatron-core", "0.16.1")
    _dist(site, "nvidia-resiliency-ext", "0.7.0")
    (issue,) = installed.issues("nvrx")
    assert "megatron-core 0.16.1 saves with its own async code only" in issue.message
    old = site / "old"
    old.mkdir()
    sys.path.insert(0, str(old))
    _dist(old, "megatron-core", "0.19.2")
    _dist(old, "nvidia-resiliency-ext", "0.4.1")
    installed.version.cache_clear()
    (issue,) = installed.issues("nvrx")
    assert "nvidia-resiliency-ext >= 0.6.0 (megatron-core's minimum), found 0.4.1" in issue.message


def test_an_old_nvrx_beside_megatron_core_018_is_named_with_both_versions(site: Path) -> None:
    _dist(site, "megatron-core", "0.19.2")
    _dist(site, "nvidia-resiliency-ext", "0.4.1")
    why = installed.nvrx_conflict()
    assert why is not None and "megatron-core 0.19.2 cannot be imported beside nvidia-resiliency-ext 0.4.1" in why
    assert "pip uninstall nvidia-resiliency-ext" in why


@pytest.mark.parametrize(("megatron", "nvrx"), [("0.17.1", "0.4.1"), ("0.19.2", "0.6.0"), ("0.16.1", "0.4.1")])
def test_no_conflict_where_megatron_core_imports(site: Path, megatron: str, nvrx: str) -> None:
    _dist(site, "megatron-core", megatron)
    _dist(site, "nvidia-resiliency-ext", nvrx)
    assert installed.nvrx_conflict() is None


def test_the_layout_follows_the_installed_megatron_core(site: Path) -> None:
    from lifecycle.distributed.layout import build_layout

    _dist(site, "megatron-core", "0.18.2")
    assert not installed.gtp_groups() and not build_layout(4, ep=2).exists("tp_ep_pp_egtp")
    newer = site / "newer"
    newer.mkdir()
    sys.path.insert(0, str(newer))
    _dist(newer, "megatron-core", "0.19.0")
    installed.version.cache_clear()
    assert installed.gtp_groups() and build_layout(4, ep=2).ranks_of("tp_ep_pp_egtp", 1) == [0, 1]


def test_validate_refuses_nvrx_without_the_package_naming_key_and_package() -> None:
    if installed.version(installed.NVRX) is not None:
        pytest.skip("nvidia-resiliency-ext is installed in this environment")
    with pytest.raises(PolicyError, match=r"checkpoint.async_strategy: nvrx needs nvidia-resiliency-ext"):
        load(["checkpoint.async_strategy=nvrx"])
    assert load(["checkpoint.async_strategy=mcore"]).policy.checkpoint.async_strategy == "mcore"
