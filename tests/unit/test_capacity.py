"""`--nproc` against what this machine runs (lifecycle.launch.capacity, hostinfo): refused before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from lifecycle import hostinfo
from lifecycle.errors import UsageError
from lifecycle.launch import capacity
from lifecycle.policy.load import load
from tests.unit.inproc import cli

GIB = 1 << 30
SYNTHETIC = ["train.kind=synthetic", "~train.options", "moe.zero_token.action=off", "parallelism.ep=1"]


def _machine(monkeypatch: pytest.MonkeyPatch, cpus: int, memory_gib: float, gpus: int = 0) -> None:
    monkeypatch.setattr(hostinfo, "cpus", lambda: cpus)
    monkeypatch.setattr(hostinfo, "memory_bytes", lambda: int(memory_gib * GIB))
    monkeypatch.setattr(hostinfo, "visible_gpus", lambda env=None: gpus)


@pytest.mark.parametrize(("cpus", "memory_gib", "bound"), [(2, 24, 8), (16, 256, 64), (16, 3, 5), (1, 1, 1)])
def test_gloo_ranks_are_bounded_by_cpus_and_memory(monkeypatch: pytest.MonkeyPatch, cpus: int, memory_gib: float,
                                                   bound: int) -> None:
    _machine(monkeypatch, cpus, memory_gib)
    policy = load(SYNTHETIC).policy
    assert capacity.nproc_bound(policy)[0] == bound
    capacity.check_nproc(policy, bound)
    with pytest.raises(UsageError, match=rf"--nproc {bound + 1} is more local ranks than this machine runs "
                                         rf"\({bound}\): gloo ranks share the CPUs and the memory: "
                                         rf"max\(8, 4 x {cpus} CPUs\) = {max(8, 4 * cpus)} for the CPUs, .* lower "
                                         r"--nproc, .* or pass --oversubscribe to start them anyway"):
        capacity.check_nproc(policy, bound + 1)
    capacity.check_nproc(policy, 10_000, oversubscribe=True)


def test_nccl_runs_one_rank_per_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 64, 1024, gpus=4)
    policy = load([*SYNTHETIC, "distributed.backend=nccl"]).policy
    capacity.check_nproc(policy, 4)
    with pytest.raises(UsageError, match=r"\(4\): the nccl backend runs one rank per GPU and 4 are visible here"):
        capacity.check_nproc(policy, 8)


def test_visible_gpus_read_cuda_visible_devices_as_cuda_does() -> None:
    assert hostinfo.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2"}) == 3
    assert hostinfo.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8f2a,MIG-1"}) == 2
    assert hostinfo.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == 1
    assert hostinfo.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert hostinfo.cpus() >= 1 and hostinfo.memory_bytes() > GIB


def test_run_refuses_too_many_ranks_before_any_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "run", "--nproc", "10000", f"run.dir={tmp_path / 'run'}", *SYNTHETIC)
    assert code == 2 and "error: --nproc 10000 is more local ranks than this machine runs" in err
    assert not (tmp_path / "run").exists()


def test_run_help_names_the_override(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli(capsys, "run", "--help")
    assert "--oversubscribe" in capsys.readouterr().out
