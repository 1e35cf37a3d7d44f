"""What `lifecycle explain --world-size N --rank R` prints equals the groups real megatron-core builds (and, through
``test_layout_vs_megatron._check``, so do lifecycle's layout and the groups it makes with torch.distributed alone)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from lifecycle.machine.explain import explain
from lifecycle.policy.load import load
from tests.distributed.test_layout_vs_megatron import _check
from tests.helpers import run_cli

pytestmark = [pytest.mark.distributed, pytest.mark.megatron]

LAYOUTS = [
    (8, {"tp": 2, "pp": 2, "ep": 2}),
    (4, {"tp": 2, "ep": 2, "etp": 1}),
    # Megatron-LM's --use-tp-pp-dp-mapping, with two distributed-optimizer instances.
    (8, {"tp": 2, "pp": 2, "ep": 2, "etp": 1, "dist_opt_instances": 2, "order": "tp-cp-ep-pp-dp"}),
]


def _tp2_pp2_ep2(real: list[dict[str, Any]]) -> None:
    assert real[5]["got"]["pos_embd"] is None  # last stage: the getter asserts, we say None
    assert real[1]["got"]["pos_embd"] == [1]
    assert all(r["got"]["inter_dist_opt"] is None for r in real)


def _tp2_ep2_etp1(real: list[dict[str, Any]]) -> None:
    assert real[0]["got"]["etp"] == [0]
    assert real[0]["got"]["tp_ep"] == [0, 1]


def _instances(real: list[dict[str, Any]]) -> None:
    assert all(r["got"]["inter_dist_opt"] is not None and len(r["got"]["inter_dist_opt"]) == 2 for r in real)


# Facts about the live groups of each layout, beyond "explain and the torch-made groups equal them".
_LIVE_FACTS: dict[tuple[int, tuple[tuple[str, Any], ...]], Callable[[list[dict[str, Any]]], None]] = {
    (world, tuple(sorted(sizes.items()))): check
    for (world, sizes), check in zip(LAYOUTS, (_tp2_pp2_ep2, _tp2_ep2_etp1, _instances), strict=True)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,sizes", [
    # world 8 tp2-pp2-ep2: a scale run (make test-slow); tests/distributed/test_engine.py warms it too
    pytest.param(*LAYOUTS[0], id="tp2-pp2-ep2", marks=pytest.mark.slow),
    pytest.param(*LAYOUTS[1], id="tp2-ep2-etp1"),
    pytest.param(*LAYOUTS[2], id="tp-pp-dp-order-2-instances"),
])
def test_explain_layout_equals_real_groups(world: int, sizes: dict[str, int]) -> None:
    real = _check(world, sizes)
    overrides = [f"parallelism.{k}={v}" for k, v in sizes.items()]
    loaded = load(overrides)
    for rank in range(world):
        layout = explain(loaded, world, rank)["layout"]
        expected = {name: ranks for name, ranks in real[rank]["got"].items() if ranks}
        assert layout["groups"] == expected, f"rank {rank}"
        # One communicator per process-group object the live rank holds (gloo twins apart).
        assert layout["communicators_per_rank"] == real[rank]["communicators"], f"rank {rank}"
    _LIVE_FACTS[world, tuple(sorted(sizes.items()))](real)
    # and the CLI prints the same for one rank
    proc = run_cli("explain", "--json", "--world-size", str(world), "--rank", "1", *overrides)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["layout"]["groups"] == {n: r for n, r in real[1]["got"].items() if r}


def test_explain_16384_ranks_is_fast() -> None:
    proc = run_cli("explain", "--json", "--world-size", "16384", "--rank", "9999", "preset=moe_large",
                   "parallelism.tp=8", "train.options.heads=8", "parallelism.ep=8", timeout=30)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["layout"]["groups"]["tp"] == list(range(9992, 10000))
    assert info["layout"]["communicators_per_rank"] >= 7


def test_explain_world_size_errors_name_the_rule() -> None:
    proc = run_cli("explain", "--world-size", "6", "parallelism.tp=4")
    assert proc.returncode == 2 and "world size 6 is not divisible by tp*pp*cp" in proc.stderr
