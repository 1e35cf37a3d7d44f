"""The zero-token guard's actions on one process, with small torch experts modules.

Megatron's own experts need process groups (see tests/distributed/test_zero_token.py for the real
thing); here the experts follow the same call contract, ``experts(hidden, tokens_per_expert, probs)
-> (output, bias)``, and skip their GEMMs on empty input like TEGroupedMLP.
"""

from __future__ import annotations

import logging

import pytest
import torch

from lifecycle.errors import PhaseError, UsageError
from lifecycle.moe import ACTIONS, find_experts_modules, install_zero_token_guard

H, E = 4, 2  # hidden size, local experts


class SkippingExperts(torch.nn.Module):
    """Per-expert linear layers; no GEMM at all when no token arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.local_experts = torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(E))

    def forward(self, hidden, tokens_per_expert, probs):  # type: ignore[no-untyped-def]
        if hidden.shape[0] == 0:
            return hidden * probs.unsqueeze(-1), None
        chunks = torch.split(hidden, tokens_per_expert.tolist())
        weights = torch.split(probs, tokens_per_expert.tolist())
        out = [lin(x) * p.unsqueeze(-1) for lin, x, p in zip(self.local_experts, chunks, weights, strict=True)]
        return torch.cat(out), None


class SequentialMLP(SkippingExperts):
    """Carries a megatron experts class name: found without a MoE layer around it."""


class TinyMoE(torch.nn.Module):
    """Looks like a megatron MoELayer to the guard: router, token_dispatcher, experts."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(H, E)
        self.token_dispatcher = object()
        self.experts = SkippingExperts()


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([TinyMoE(), TinyMoE()])


def _empty() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.zeros(0, H, requires_grad=True), torch.zeros(E, dtype=torch.long), torch.zeros(0)


def _busy() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3, H, generator=gen), torch.tensor([2, 1]), torch.rand(3, generator=gen)


def _backward(experts: torch.nn.Module, *args: object) -> tuple[torch.Tensor, object]:
    out, bias = experts(*args)
    (out.sum() + 1.0).backward() if out.requires_grad else None
    return out, bias


def test_finds_experts_of_moe_layers_and_by_class_name_and_strips_ddp_prefixes() -> None:
    wrapped = torch.nn.Module()
    wrapped.module = Model()
    wrapped.extra = SequentialMLP()
    names = [n for n, _ in find_experts_modules(wrapped)]
    assert names == ["layers.0.experts", "layers.1.experts", "extra"]
    chunks = [n for n, _ in find_experts_modules([Model(), Model()])]
    assert chunks[0] == "0.layers.0.experts" and chunks[-1] == "1.layers.1.experts"


def test_dummy_forward_keeps_every_expert_parameter_in_autograd() -> None:
    model = Model()
    guard = install_zero_token_guard(model, "dummy_forward", rank=3)
    hidden, tpe, probs = _empty()
    out, bias = _backward(model.layers[0].experts, hidden, tpe, probs)
    assert out.shape == (0, H) and bias is None
    grads = [p.grad for p in model.layers[0].experts.parameters()]
    assert all(g is not None and not g.any() for g in grads)
    assert hidden.grad is not None and hidden.grad.shape == (0, H)
    assert guard.counts == {"layers.0.experts": 1, "layers.1.experts": 0} and guard.total == 1
    guard.remove()


def test_dummy_forward_leaves_busy_ranks_untouched_and_handles_kwargs_and_numpy() -> None:
    experts = SequentialMLP()
    expected, _ = experts(*_busy())
    guard = install_zero_token_guard(experts, "dummy_forward")
    got, _ = experts(*_busy())
    assert torch.equal(got, expected) and guard.total == 0
    hidden, tpe, probs = _empty()
    seen: list[object] = []  # registered after the guard: sees the dummy tokens
    experts.register_forward_pre_hook(lambda m, a, k: seen.append((k["tokens_per_expert"], k["probs"].shape)),
                                      with_kwargs=True)
    out, _ = experts(hidden, tokens_per_expert=tpe.numpy(), probs=probs)
    assert out.shape == (0, H) and guard.total == 1
    assert list(seen[0][0]) == [1, 1] and seen[0][1] == (E,)  # type: ignore[index]
    guard.remove()


def test_without_guard_or_after_remove_the_skipping_experts_have_no_grads() -> None:
    model = Model()
    guard = install_zero_token_guard(model, "dummy_forward")
    guard.remove()
    guard.remove()  # safe twice
    experts = model.layers[0].experts
    assert not experts._forward_pre_hooks and not experts._forward_hooks
    _backward(experts, *_empty())
    assert all(p.grad is None for p in experts.parameters())


def test_error_names_rank_layer_and_step_and_reports_the_event() -> None:
    events: list[tuple[str, int | None, int]] = []
    model = Model()
    guard = install_zero_token_guard(model, "error", rank=1, on_event=lambda *e: events.append(e))
    guard.set_step(7)
    with pytest.raises(PhaseError, match=r"rank 1: MoE layer layers\.1\.experts .* at step 7") as err:
        model.layers[1].experts(*_empty())
    assert err.value.rank == 1 and err.value.phase == "train"
    assert events == [("layers.1.experts", 7, 1)]
    model.layers[1].experts(*_busy())  # tokens: no error
    guard.remove()


def test_warn_logs_once_per_layer_and_counts_every_time(caplog: pytest.LogCaptureFixture) -> None:
    events: list[tuple[str, int | None, int]] = []
    model = Model()
    guard = install_zero_token_guard(model, "warn", rank=0, on_event=lambda *e: events.append(e))
    with caplog.at_level(logging.WARNING, logger="lifecycle.moe.zero_token"):
        for step in range(3):
            guard.step = step
            _backward(model.layers[0].experts, *_empty())
    assert guard.counts["layers.0.experts"] == 3
    assert [e[2] for e in events] == [1, 2, 3] and [e[1] for e in events] == [0, 1, 2]
    assert len(caplog.records) == 1 and "layers.0.experts" in caplog.text and "step 0" in caplog.text
    assert all(p.grad is None for p in model.layers[0].experts.parameters())  # warn changes nothing
    guard.remove()


def test_off_installs_nothing_and_unknown_actions_are_refused() -> None:
    model = Model()
    guard = install_zero_token_guard(model, "off")
    assert guard.counts == {} and guard.layers == []
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert set(ACTIONS) == {"dummy_forward", "error", "warn", "off"}
    with pytest.raises(UsageError, match="unknown zero-token action 'skip'; available: dummy_forward"):
        install_zero_token_guard(model, "skip")
