"""The zero-token guard on a real megatron-core MoELayer, 2 gloo ranks, EP=2 (alltoall dispatcher).

The router is biased so that every token of both ranks goes to experts 0 and 1 (EP rank 0): the experts
of EP rank 1 receive nothing. Those experts are a ``SequentialMLP`` subclass that, like TEGroupedMLP's
grouped GEMM, skips its GEMMs on empty input. The gradient sync stands in for an overlapped DDP: a
post-accumulate-grad hook per expert parameter launches an async all-reduce, then every rank waits for
all of them with a short deadline. In this world-2 layout the EP group plays the part of the
expert-data-parallel group (the two ranks' expert parameters have the same shapes); the sync runs on
its own gloo group with a 2 s timeout, so a divergence fails fast and leaves megatron's groups alone.
"""

from __future__ import annotations

import datetime
import functools
import time
from typing import Any

import pytest

from tests._dist import init_gloo, run_ranks

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.distributed, pytest.mark.megatron]
WORLD, EP = 2, 2
DEADLINE_S = 90.0
SYNC_TIMEOUT_S = 2.0
ZERO_RANK = 1  # the EP rank whose experts (2 and 3) get no token


def _setup(rank: int) -> Any:
    import warnings

    warnings.simplefilter("ignore")  # megatron warns about apex/TE on every rank
    from megatron.core import parallel_state as ps

    from lifecycle.backends.megatron.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    init_gloo(rank, WORLD)
    ps.initialize_model_parallel(expert_model_parallel_size=EP)
    return ps


def _skipping_experts_class() -> type:
    from megatron.core.transformer.moe.experts import SequentialMLP

    class SkippingSequentialMLP(SequentialMLP):
        """SequentialMLP that, like TEGroupedMLP's grouped GEMM, does no GEMM when it has no token."""

        def forward(self, hidden: Any, tokens_per_expert: Any, probs: Any) -> Any:
            if int(tokens_per_expert.sum()) == 0:
                # Like TEGroupedMLP, the probs still scale the (empty) activations outside the GEMMs,
                # so hidden and probs stay in the graph and the dispatcher's all-to-all backwards run.
                return hidden * probs.unsqueeze(-1), None
            return super().forward(hidden, tokens_per_expert, probs)

    return SkippingSequentialMLP


def _build_layer(experts_cls: type, seed: int = 1234) -> Any:
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    from lifecycle.backends.megatron.experts import with_experts
    from lifecycle.backends.megatron.model import parallel_sizes, transformer_config
    from lifecycle.backends.megatron.state import ModelSpec
    from lifecycle.policy.options import MegatronGPTOptions

    spec = ModelSpec(MegatronGPTOptions(num_layers=1, hidden=16, ffn_hidden=32, heads=2, num_experts=4, topk=2),
                     aux_loss_coeff=0.0)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    moe_spec = get_moe_module_spec(use_te=False, num_experts=spec.options.num_experts, moe_grouped_gemm=False)
    moe_spec = with_experts(moe_spec, experts_cls)
    config = transformer_config(spec, parallel_sizes())
    # megatron-core 0.19's MoE spec is a functools.partial the transformer layer calls; older ones a ModuleSpec
    layer = moe_spec(config=config) if isinstance(moe_spec, functools.partial) else build_module(moe_spec, config=config)
    with torch.no_grad():  # experts 0 and 1 win every token: inputs are positive, see _inputs
        weight = layer.router.weight
        weight[:2] = 0.5 + 0.1 * torch.rand(2, weight.shape[1], generator=torch.Generator().manual_seed(7))
        weight[2:] = -0.5
    return layer


def _inputs(rank: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    return torch.rand(8, 2, 16, generator=gen).requires_grad_(True)  # [seq, batch, hidden]


def _grad_sync(layer: Any, group: Any) -> list[Any]:
    """Per expert parameter, an async all-reduce of its gradient as soon as it is accumulated."""
    import torch.distributed as dist

    works: list[Any] = []

    def hook(param: Any) -> None:
        works.append(dist.all_reduce(param.grad.detach().clone(), group=group, async_op=True))

    for param in layer.experts.parameters():
        param.register_post_accumulate_grad_hook(hook)
    return works


def _wait_all(works: list[Any]) -> str | None:
    """None if every reduction completed within the deadline, else the first error."""
    for work in works:
        try:
            work.wait(datetime.timedelta(seconds=SYNC_TIMEOUT_S + 1))
        except RuntimeError as err:
            return str(err).splitlines()[0][:200]
    return None


def _step(layer: Any, x: Any, sync_group: Any, action: str | None = None) -> dict[str, Any]:
    """Forward, backward and expert-grad sync of one MoE layer (guarded by ``action`` unless None)."""
    from lifecycle.moe import install_zero_token_guard

    seen: list[int] = []
    # Registered before the guard, so it runs first and sees the real dispatch (DESIGN: args[1]).
    layer.experts.register_forward_pre_hook(lambda mod, args: seen.append(int(args[1].sum())))
    events: list[tuple[str, int | None, int]] = []
    guard = None
    if action is not None:
        guard = install_zero_token_guard(layer, action, on_event=lambda *e: events.append(e))
        guard.step = 5
    works = _grad_sync(layer, sync_group)
    output, _bias = layer(x)
    loss = output.pow(2).mean()
    loss.backward()
    t0 = time.monotonic()
    error = _wait_all(works)
    grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in layer.named_parameters()}
    if guard is not None:
        guard.remove()
    return {"tokens": seen, "events": events, "counts": dict(guard.counts) if guard else None, "loss": loss.detach(), "grads": grads, "x_grad": x.grad.detach().clone(),
            "issued": len(works), "expected": sum(1 for _ in layer.experts.parameters()),
            "sync_error": error, "sync_s": time.monotonic() - t0}


def _without_guard(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    _setup(rank)
    # At world 2 with EP=2 the EP group is both ranks.
    sync_group = dist.new_group(list(range(WORLD)), timeout=datetime.timedelta(seconds=SYNC_TIMEOUT_S))
    out = _step(_build_layer(_skipping_experts_class()), _inputs(rank), sync_group)
    # Keep the zero-token rank alive until its peer's sync has failed: a peer that exits early would
    # close the connections and turn the timeout into a "connection closed" error.
    dist.barrier()
    expert_grads = {n: g for n, g in out["grads"].items() if n.startswith("experts.")}
    return {"tokens": out["tokens"], "none_expert_grads": sorted(n for n, g in expert_grads.items() if g is None),
            "n_expert_params": len(expert_grads), "issued": out["issued"], "expected": out["expected"],
            "sync_error": out["sync_error"], "sync_s": out["sync_s"]}


def _with_guard(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    _setup(rank)
    sync_group = dist.new_group(list(range(WORLD)), timeout=datetime.timedelta(seconds=SYNC_TIMEOUT_S))
    reference_layer = _build_layer(_skipping_experts_class().__mro__[1])  # the stock SequentialMLP
    ref = _step(reference_layer, _inputs(rank), sync_group)
    guarded_layer = _build_layer(_skipping_experts_class())
    guarded_layer.load_state_dict(reference_layer.state_dict())
    got = _step(guarded_layer, _inputs(rank), sync_group, "dummy_forward")
    mismatched = [n for n, g in got["grads"].items()
                  if g is None or not torch.allclose(g, ref["grads"][n], rtol=1e-6, atol=1e-7)]
    expert_grads = {n: g for n, g in got["grads"].items() if n.startswith("experts.")}
    return {"tokens": got["tokens"], "ref_tokens": ref["tokens"], "events": got["events"],
            "counts": got["counts"],
            "expert_grads_zero": all(g is not None and not g.any() for g in expert_grads.values()),
            "n_expert_params": len(expert_grads), "issued": got["issued"], "expected": got["expected"],
            "sync_error": got["sync_error"], "ref_sync_error": ref["sync_error"],
            "loss_equal": bool(torch.allclose(got["loss"], ref["loss"], rtol=1e-6, atol=1e-7)),
            "loss": float(got["loss"]), "ref_loss": float(ref["loss"]), "mismatched_grads": mismatched,
            "x_grad_equal": bool(torch.allclose(got["x_grad"], ref["x_grad"], rtol=1e-6, atol=1e-7))}


@pytest.mark.timeout(120)
def test_zero_token_rank_without_guard_has_no_expert_grads_and_its_grad_sync_diverges() -> None:
    results = run_ranks(_without_guard, WORLD, DEADLINE_S)
    busy, idle = results[1 - ZERO_RANK], results[ZERO_RANK]
    assert idle["tokens"] == [0] and busy["tokens"][0] > 0, results
    assert len(idle["none_expert_grads"]) == idle["n_expert_params"] > 0, idle
    assert busy["none_expert_grads"] == [], busy
    # The zero-token rank launches none of the reductions its peer launches: the peer times out.
    assert idle["issued"] == 0 and busy["issued"] == busy["expected"], results
    assert busy["sync_error"] is not None and busy["sync_s"] < SYNC_TIMEOUT_S + 2, busy


@pytest.mark.timeout(120)
def test_dummy_forward_gives_zero_grads_a_complete_sync_and_the_reference_numbers() -> None:
    results = run_ranks(_with_guard, WORLD, DEADLINE_S)
    for rank, r in enumerate(results):
        assert r["sync_error"] is None and r["ref_sync_error"] is None, (rank, r)
        assert r["issued"] == r["expected"] > 0, (rank, r)
        assert r["loss_equal"], (rank, r["loss"], r["ref_loss"])
        assert r["mismatched_grads"] == [] and r["x_grad_equal"], (rank, r)
    idle = results[ZERO_RANK]
    assert idle["tokens"] == [0] == idle["ref_tokens"], idle
    assert idle["expert_grads_zero"] and idle["n_expert_params"] > 0, idle
    assert idle["counts"] == {"experts": 1} and idle["events"] == [("experts", 5, 1)], idle
    assert results[1 - ZERO_RANK]["counts"] == {"experts": 0}, results
