"""The control plane's cost before launch (lifecycle.machine.cost): lifecycle's own sockets flat in the world size,
world-sized groups named with their owner and the key that lowers them, the store's load linear in the world and
held to the budget, and the open-file limit refusals (in process, and as `lifecycle validate -w` prints them)."""

from __future__ import annotations

import pytest

from lifecycle.distributed.layout import build_layout
from lifecycle.errors import PolicyError
from lifecycle.machine.cost import FDS_BEFORE_GROUPS, POLL_CALLS, cost, limits
from lifecycle.policy.load import load
from tests.helpers import run_cli

MEMORY = ["checkpoint.memory.every_steps=10"]


def _cost(world: int, *overrides: str, rank: int = 0) -> dict[str, object]:
    policy = load(["train.kind=synthetic", "~train.options", *overrides]).policy
    return cost(policy, build_layout(world), rank, 8)


def test_lifecycle_s_own_sockets_do_not_grow_with_the_world() -> None:
    own = {w: _cost(w, *MEMORY, "distributed.backend=nccl")["lifecycle_sockets"] for w in (64, 1024, 16384)}
    assert set(own.values()) == {2}, own
    # checkpoint.coordination: gloo is the one of lifecycle's that does, and says which key lowers it
    coord = _cost(1024, "checkpoint.coordination=gloo", "distributed.backend=nccl")
    assert coord["lifecycle_sockets"] == 1023
    [s] = coord["sockets"]  # type: ignore[misc]
    assert s["lower"] == "checkpoint.coordination=store" and s["owner"] == "lifecycle"


def test_the_store_s_load_is_linear_in_the_world_and_a_rank_s_is_flat() -> None:
    a, b = _cost(1024), _cost(16384)
    assert a["store_calls_per_poll"] == b["store_calls_per_poll"] == POLL_CALLS
    assert b["server_calls_per_s"] == pytest.approx(16 * a["server_calls_per_s"], rel=0.01)  # type: ignore[operator]
    # rank 0's full view is spread over world / 64 seconds: its bytes per poll stay flat where it reads it
    assert _cost(1024)["rank0_bytes_per_poll"] == pytest.approx(_cost(512)["rank0_bytes_per_poll"], rel=0.05)
    assert not b["rank0_full_view"]


def test_a_world_over_the_store_budget_is_refused_naming_the_poll_interval_that_fits() -> None:
    policy = load(["train.kind=synthetic", "~train.options", "distributed.backend=nccl"]).policy
    with pytest.raises(PolicyError, match=r"watchdog.store_budget_calls_per_s: at world size 16384 .* 81920 calls/s "
                                          r".* raise watchdog.poll_interval_s to 7\.2 or more"):
        limits(policy, build_layout(16384), 8, nofile=(10**6, "test"))
    fits = load(["train.kind=synthetic", "~train.options", "distributed.backend=nccl",
                 "watchdog.poll_interval_s=7.2"]).policy
    limits(fits, build_layout(16384), 8, nofile=(10**6, "test"))


def test_a_plan_over_the_open_file_limit_is_refused_naming_the_largest_group_and_its_key() -> None:
    policy = load(["train.kind=synthetic", "~train.options", "checkpoint.coordination=gloo",
                   "distributed.backend=nccl"]).policy
    with pytest.raises(PolicyError, match=r"checkpoint.coordination: at world size 2048 a rank would hold about "
                                          rf"{2047 + FDS_BEFORE_GROUPS} open files .* over the open-file limit 1024 "
                                          r"\(where\); the largest is the checkpoint.coordination: gloo \(lifecycle's\): "
                                          r"checkpoint.coordination=store"):
        limits(policy, build_layout(2048), 8, nofile=(1024, "where"))


def test_validate_w_says_it_in_one_line_and_exits_2() -> None:
    proc = run_cli("validate", "-w", "16384", "distributed.backend=nccl")  # the default job: megatron-core's twins
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: invalid policy (world size 16384): 3 error(s)" in proc.stderr, proc.stderr
    assert "watchdog.enabled: at world size 16384 the rendezvous store's server would hold 49152 connections" in proc.stderr
    assert "train.kind: at world size 16384 a rank would hold about" in proc.stderr  # megatron-core's dp_gloo ...
    assert "watchdog.store_budget_calls_per_s: at world size 16384" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("validate", "-w", "64", "checkpoint.memory.every_steps=2", "distributed.backend=nccl")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_cli("explain", "-w", "16384", *MEMORY)
    assert proc.returncode == 0 and "memory tier pairs                     2  lifecycle's" in proc.stdout, proc.stdout
