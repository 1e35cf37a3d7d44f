"""Megatron's pipeline schedule, distributed optimizer and overlapped reduce on 8 gloo ranks, as large MoE jobs train.

Layout tp2 pp2 ep2 vpp2 (dp2, edp2): two model chunks per rank (4 layers, one per virtual stage), the
interleaved 1F1B schedule over 2 micro-batches, the distributed optimizer with ``overlap_grad_reduce`` and
``overlap_param_gather``. One spawn of 8 ranks trains, saves (sync and async, through the split save),
loads into fresh models and trains on.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from lifecycle.policy import installed
from tests._dist import init_gloo, run_ranks, shared_store
from tests.distributed.test_megatron_train_ckpt import _clone, _diff

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.distributed, pytest.mark.megatron]
WORLD = 8
OPTIONS = {"num_layers": 4, "num_microbatches": 2, "use_distributed_optimizer": True, "overlap_grad_reduce": True,
           "overlap_param_gather": True}


def _optimizer_tensors(optimizer: Any) -> list[Any]:
    """Every tensor the (chained, distributed) optimizer steps with: its main-parameter shards and their state."""
    out = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                out.append(param.detach().clone())
                out.extend(_clone(v) for _, v in sorted(sub.optimizer.state.get(param, {}).items()))
    return out


def _full_state(state: Any) -> dict[str, Any]:
    from lifecycle.backends.megatron.schedule import finish_param_sync

    finish_param_sync(state)  # overlap_param_gather: the last update is gathered in the next forward
    return {"model": [_clone(gpt.state_dict()) for gpt in state.gpts],
            "optimizer": _optimizer_tensors(state.optimizer)}


def _train(state: Any, steps: int) -> list[float]:
    from megatron.core import parallel_state as ps

    from lifecycle.backends.megatron import model as m

    dp_rank = ps.get_data_parallel_rank()
    return [m.train_step(state, m.step_batches(state.spec, state.step, dp_rank)) for _ in range(steps)]


def _pipeline_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    import warnings

    warnings.simplefilter("ignore")  # megatron warns about apex/TE on every rank
    init_gloo(rank, world)
    from megatron.core import parallel_state as ps

    from lifecycle.backends.megatron import checkpoint as ck
    from lifecycle.backends.megatron import model as m
    from lifecycle.backends.megatron import parallel
    from lifecycle.policy.options import MegatronGPTOptions

    parallel.initialize(tp=2, pp=2, ep=2, vpp=2, timeout_s=60)
    store = shared_store("pipeline/")
    spec = m.ModelSpec(MegatronGPTOptions(**OPTIONS))
    state = m.build(spec)
    out: dict[str, Any] = {"chunks": [(g.pre_process, g.post_process) for g in state.gpts],
                           "experts": sum(".experts." in n for g in state.gpts for n, _ in g.named_parameters()),
                           "stage": ps.get_pipeline_model_parallel_rank()}
    out["losses"] = _train(state, 6)
    ck.begin_save(state, f"{root}/sync").finalize_via_store(store, "sync", 30, wait_complete=True)
    at_6 = _full_state(state)
    handle = ck.begin_save(state, f"{root}/async", async_=True, fully_parallel=True)
    out["after"] = _train(state, 2)  # steps 7 and 8 run while this rank's shards are written
    handle.finalize_via_store(store, "async", 30, wait_complete=True)
    for name in ("sync", "async"):
        fresh = m.build(spec)
        out[f"fresh_differs_{name}"] = bool(_diff(at_6["model"], _full_state(fresh)["model"]))
        out[f"step_{name}"] = ck.load(fresh, f"{root}/{name}")
        out[f"diff_{name}"] = _diff(at_6, _full_state(fresh))
        out[f"resumed_{name}"] = _train(fresh, 2)
    out["files"] = sorted(os.listdir(f"{root}/sync"))
    parallel.destroy()
    return out


@pytest.mark.timeout(150)
def test_interleaved_pipeline_with_distributed_optimizer_trains_saves_and_resumes_exactly(tmp_path: Any) -> None:
    results = run_ranks(_pipeline_rank, WORLD, 140, str(tmp_path))
    losses = results[0]["losses"]
    assert all(r["losses"] == losses for r in results), "the loss is computed on the last stage, reported everywhere"
    assert losses[-1] < losses[0] - 0.5, losses
    first, last = [r for r in results if r["stage"] == 0], [r for r in results if r["stage"] == 1]
    # vpp=2: the first chunk of stage 0 embeds, the last chunk of the last stage computes the loss.
    assert {tuple(map(tuple, r["chunks"])) for r in first} == {((True, False), (False, False))}
    assert {tuple(map(tuple, r["chunks"])) for r in last} == {((False, False), (False, True))}
    assert all(r["experts"] >= 4 for r in results)
    for rank, r in enumerate(results):
        for name in ("sync", "async"):
            assert r[f"fresh_differs_{name}"], rank
            assert r[f"step_{name}"] == 6, rank
            assert r[f"diff_{name}"] == [], (rank, name, r[f"diff_{name}"][:5])
            assert r[f"resumed_{name}"] == r["after"], (rank, name, "resume must equal the uninterrupted run")
    assert {"metadata.json", ".metadata"} <= set(results[0]["files"])
    # megatron-core 0.19 keeps the common state in the shards; older ones in rank 0's common.pt
    assert ("common.pt" in results[0]["files"]) == (installed.megatron_version()[:2] < (0, 19))
