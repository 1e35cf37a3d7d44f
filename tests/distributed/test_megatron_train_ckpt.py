"""Train and checkpoint a real megatron-core GPT-MoE on 4 gloo ranks.

Layout tp2 ep2 etp1 (dp2, edp2) unless a test says otherwise. Each test spawns 4 ranks that build the
model once. Timings (build, step, save, load) are printed with ``pytest -s``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

from lifecycle.policy import installed
from tests._dist import init_gloo, run_ranks, shared_store
from tests.helpers import NVRX_ENV, nvrx_missing

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.distributed, pytest.mark.megatron]
WORLD, TP, EP, ETP = 4, 2, 2, 1
DEADLINE_S = 100.0


def _setup(tp: int = TP, ep: int = EP, etp: int = ETP) -> Any:
    import warnings

    warnings.simplefilter("ignore")  # megatron warns about apex/TE on every rank
    from megatron.core import parallel_state as ps

    from lifecycle.backends.megatron.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    return ps


def _train(state: Any, steps: int) -> list[float]:
    from megatron.core import parallel_state as ps

    from lifecycle.backends.megatron import model as m

    dp_rank = ps.get_data_parallel_rank()
    return [m.train_step(state, m.synthetic_batch(state.spec, state.step, dp_rank))
            for _ in range(steps)]


def _clone(tree: Any) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v) for v in tree)
    return tree


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two nested states differ (tensors compared exactly)."""
    import torch

    if isinstance(a, torch.Tensor):
        ok = isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
        return [] if ok else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [f"{path} (keys)"]
        return [p for k in a for p in _diff(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{path} (len)"]
        return [p for i, (x, y) in enumerate(zip(a, b, strict=True)) for p in _diff(x, y, f"{path}/{i}")]
    return [] if a == b else [path]


def _full_state(state: Any) -> dict[str, Any]:
    return {"model": _clone(state.gpt.state_dict()), "optimizer": _clone(state.optimizer.state_dict())}


# ------------------------------------------------------------------------------------------ training


def _train_rank(rank: int, world: int, etp: int) -> dict[str, Any]:
    init_gloo(rank, world)
    ps = _setup(etp=etp)
    from lifecycle.backends.megatron import model as m
    from lifecycle.errors import UsageError
    from lifecycle.policy.options import MegatronGPTOptions

    t0 = time.perf_counter()
    state = m.build(m.ModelSpec())
    build_s = time.perf_counter() - t0
    before = {n: p.detach().clone() for n, p in state.gpt.named_parameters()}
    not_replicated = _not_replicated(state)
    t0 = time.perf_counter()
    losses = _train(state, 20)
    step_s = (time.perf_counter() - t0) / 20
    unchanged = [n for n, p in state.gpt.named_parameters() if _equal(before[n], p)]
    experts = [n for n in before if ".experts." in n]
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        m.build(m.ModelSpec(MegatronGPTOptions(num_layers=3)))
        pp_error = ""
    except UsageError as err:
        pp_error = str(err)
    ps.destroy_model_parallel()
    return {"losses": losses, "unchanged": unchanged, "experts": experts, "build_s": build_s,
            "step_s": step_s, "pp_error": pp_error, "not_replicated": not_replicated}


def _not_replicated(state: Any) -> list[str]:
    """Parameters that differ from the first rank of their dp (or, for experts, expert-dp) group."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    bad = []
    for name, param in state.gpt.named_parameters():
        group = ps.get_expert_data_parallel_group() if ".experts." in name else ps.get_data_parallel_group()
        ref = param.detach().clone()
        dist.broadcast(ref, src=dist.get_process_group_ranks(group)[0], group=group)
        if not torch.equal(ref, param.detach()):
            bad.append(name)
    return bad


def _equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("etp", [1, 2], ids=["etp1", "etp2"])
def test_loss_falls_and_every_parameter_steps(etp: int) -> None:
    results = run_ranks(_train_rank, WORLD, DEADLINE_S, etp)
    losses = results[0]["losses"]
    assert all(r["losses"] == losses for r in results), "the dp-averaged loss must agree on all ranks"
    assert losses[-1] < losses[0] - 1.5, losses
    for r in results:
        assert len(r["experts"]) >= 4  # 2 local experts x 2 layers, fc1 + fc2 each
        assert r["unchanged"] == [], "every parameter, experts included, must be updated"
        assert r["not_replicated"] == [], "build() must seed identical dp/expert-dp replicas"
        assert "num_layers=3 must be divisible by pp*vpp = 2" in r["pp_error"]
    print(f"\nbuild {results[0]['build_s']:.3f}s, step {results[0]['step_s'] * 1e3:.1f}ms, "
          f"losses {losses[0]:.3f} -> {losses[-1]:.3f}")


# ------------------------------------------------------------------------------ checkpoint + resume


def _save_resume_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    init_gloo(rank, world)
    _setup()
    import torch.distributed as dist

    from lifecycle.backends.megatron import checkpoint as ck
    from lifecycle.backends.megatron import model as m

    store = shared_store("ckpt/")
    ckpt_group = dist.new_group(backend="gloo")
    spec = m.ModelSpec()
    state = m.build(spec)
    _train(state, 10)
    at_10 = _full_state(state)
    timings: dict[str, float] = {}

    # B: synchronous, plain strategy, finalized over a dedicated gloo group. It is complete before A
    # is: rank 0 finalizes B first, and everyone waits for A.
    t0 = time.perf_counter()
    handle = ck.begin_save(state, f"{root}/b", fully_parallel=False, async_=False)
    handle.finalize_over_group(ckpt_group, timeout_s=30)
    timings["save_sync_s"] = time.perf_counter() - t0
    # A: asynchronous, fully parallel; training step 11 runs while the writer thread writes.
    t0 = time.perf_counter()
    handle = ck.begin_save(state, f"{root}/a", fully_parallel=True, async_=True)
    timings["begin_async_s"] = time.perf_counter() - t0
    loss_11 = _train(state, 1)[0]
    # Loading needs metadata.json, which rank 0 writes last: everyone waits for it via the store.
    handle.finalize_via_store(store, "save-a", timeout_s=30, wait_complete=True)
    timings["async_plan_s"], timings["async_write_s"] = handle.plan_s, handle.write_s or 0.0

    fresh = m.build(spec)  # same seed: same data stream; its weights are the step-0 ones
    different_before = bool(_diff(at_10["model"], _full_state(fresh)["model"]))
    t0 = time.perf_counter()
    step_a = ck.load(fresh, f"{root}/a")
    timings["load_s"] = time.perf_counter() - t0
    diff_a = _diff(at_10, _full_state(fresh))
    resumed_11 = _train(fresh, 1)[0]
    t0 = time.perf_counter()
    step_b = ck.load(fresh, f"{root}/b", fully_parallel=True)
    timings["load_fully_parallel_s"] = time.perf_counter() - t0
    diff_b = _diff(at_10, _full_state(fresh))
    dist.barrier()
    return {"different_before": different_before, "steps": (step_a, step_b), "diff_a": diff_a,
            "diff_b": diff_b, "loss_11": loss_11, "resumed_11": resumed_11, "timings": timings,
            "files": sorted(os.listdir(f"{root}/a"))}


@pytest.mark.timeout(120)
def test_save_load_resume_is_exact(tmp_path: Any) -> None:
    results = run_ranks(_save_resume_rank, WORLD, DEADLINE_S, str(tmp_path))
    for r in results:
        assert r["different_before"], "the fresh model must start from other (step-0) weights"
        assert r["steps"] == (10, 10)
        assert r["diff_a"] == [] and r["diff_b"] == [], "every model and optimizer tensor restored"
        assert r["resumed_11"] == r["loss_11"], "step 11 after resume equals the uninterrupted run"
    files = results[0]["files"]
    assert {"metadata.json", ".metadata"} <= set(files)
    # megatron-core 0.19 keeps the common state in the shards (a ShardedObject); older ones in rank 0's common.pt
    assert ("common.pt" in files) == (installed.megatron_version()[:2] < (0, 19)), files
    assert sum(f.endswith(".distcp") for f in files) >= 1
    print("\n" + ", ".join(f"{k} {v:.3f}s" for k, v in results[0]["timings"].items()))


# ------------------------------------------------------------- no default-group collective after writes


def _finalize_off_default_group_rank(rank: int, world: int, root: str, strategy: str) -> dict[str, Any]:
    if strategy == "nvrx":  # megatron-core imports NVRx's modules when a save asks for them
        sys.path.insert(0, os.environ[NVRX_ENV])
    init_gloo(rank, world)
    _setup()
    import torch.distributed as dist

    from lifecycle.backends.megatron import checkpoint as ck
    from lifecycle.backends.megatron import model as m
    from lifecycle.errors import HangError

    store = shared_store("ckpt/")
    state = m.build(m.ModelSpec())
    _train(state, 1)
    out: dict[str, Any] = {}
    # Rank 3 publishes 3 s late: ranks 1 and 2 must not wait for it, rank 0 must.
    handle = ck.begin_save(state, f"{root}/late", fully_parallel=True, async_=True, async_strategy=strategy)
    out["strategy"] = handle.async_strategy
    if rank == 3:
        time.sleep(3.0)
    t0 = time.monotonic()
    handle.finalize_via_store(store, "late", timeout_s=30)
    out["late_s"] = time.monotonic() - t0
    out["late_complete"] = os.path.exists(f"{root}/late/metadata.json")
    # Rank 3 never publishes: rank 0 names it after its deadline, the checkpoint stays incomplete.
    handle = ck.begin_save(state, f"{root}/never", fully_parallel=False, async_=True, async_strategy=strategy)
    out["missing"] = None
    if rank == 3:
        handle.wait_local(30)
    else:
        try:
            handle.finalize_via_store(store, "never", timeout_s=1.5)
        except HangError as err:
            out["missing"] = err.missing
    out["never_complete"] = os.path.exists(f"{root}/never/metadata.json")
    dist.barrier()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["mcore", "nvrx"])
def test_finalize_issues_no_default_group_collective(tmp_path: Any, strategy: str) -> None:
    """Whichever async save plans it (megatron-core's or NVRx's), no default-group collective follows the writes:
    megatron's finalize (gather + broadcast + barrier, and AsyncCallsQueue's all_reduce) is replaced by the store."""
    if strategy == "nvrx" and nvrx_missing():
        pytest.skip(nvrx_missing())
    results = run_ranks(_finalize_off_default_group_rank, WORLD, DEADLINE_S, str(tmp_path), strategy)
    assert {r["strategy"] for r in results} == {strategy}
    assert results[1]["late_s"] < 1.5 and results[2]["late_s"] < 1.5, results
    assert results[0]["late_s"] > 2.0, results
    assert results[0]["late_complete"]
    assert results[0]["missing"] == [3]
    assert [r["missing"] for r in results[1:]] == [None, None, None]
    assert not results[0]["never_complete"]
