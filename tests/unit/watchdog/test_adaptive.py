"""Adaptive deadlines and straggler detection, pure: what a rank proposes, what every rank agrees on, who is named."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.watchdog.adaptive import AdaptiveDeadline, quantile
from lifecycle.watchdog.straggler import ComputeWindow, StragglerDetector


@dataclass
class Cfg:
    factor: float = 4.0
    quantile: float = 0.99
    window: int = 50
    floor_s: float = 0.5
    span_floor_s: float = 2.0
    calibration_steps: int = 20


def test_static_until_calibrated_then_factor_times_the_quantile_clamped() -> None:
    d = AdaptiveDeadline("step", 600.0, Cfg())
    for _ in range(19):
        d.observe(0.8)
    assert not d.calibrated() and d.proposal() == 0.0 and d.effective() == 600.0
    assert "static until 1 more observation" in d.derivation().text
    d.observe(0.8)
    assert d.proposal() == pytest.approx(3.2)
    d.agree(d.proposal())
    assert d.effective() == pytest.approx(3.2)
    text = d.derivation().text
    assert text.startswith("deadline 3.2s = max over ranks of clamp(4 × p99") and "0.8s over the last 20 steps" in text


def test_the_agreed_value_is_clamped_between_the_floor_and_the_static_ceiling() -> None:
    d = AdaptiveDeadline("step", 10.0, Cfg(floor_s=2.0, calibration_steps=1))
    d.observe(0.01)
    assert d.proposal() == 2.0
    d.agree(0.001)
    assert d.effective() == 2.0
    d.agree(99.0)
    assert d.effective() == 10.0
    d.agree(0.0)  # nobody calibrated yet
    assert d.effective() == 10.0
    # checkpoint and eval spans have their own floor: storage varies more than a step
    for name in ("checkpoint", "eval"):
        span = AdaptiveDeadline(name, 60.0, Cfg(floor_s=0.5, span_floor_s=5.0, calibration_steps=1))
        span.observe(0.01)
        assert span.proposal() == 5.0
        span.agree(0.2)
        assert span.effective() == 5.0



def test_the_first_step_after_a_resume_runs_static_and_is_not_a_sample() -> None:
    d = AdaptiveDeadline("step", 600.0, Cfg(calibration_steps=1))
    d.observe(1.0)
    d.agree(d.proposal())
    d.after_resume()
    assert d.effective() == 600.0
    d.agree(4.0)  # the boundary before the first step after resume: still static
    assert d.effective() == 600.0
    d.observe(30.0)  # the cold first step is not a sample
    d.agree(d.proposal())
    assert d.effective() == pytest.approx(4.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.001, 100.0), min_size=1, max_size=60), st.floats(0.0, 1.0))
def test_quantile_is_within_the_samples_and_monotone_in_q(values: list[float], q: float) -> None:
    got = quantile(values, q)
    assert min(values) <= got <= max(values)
    assert quantile(values, 0.0) <= got <= quantile(values, 1.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.floats(0.001, 50.0), min_size=25, max_size=40), min_size=1, max_size=8))
def test_every_rank_agrees_on_one_value_no_lower_than_its_own_proposal(per_rank: list[list[float]]) -> None:
    ranks = [AdaptiveDeadline("step", 600.0, Cfg()) for _ in per_rank]
    for d, samples in zip(ranks, per_rank, strict=True):
        for s in samples:
            d.observe(s)
    agreed = max(d.proposal() for d in ranks)  # what the all-reduce(MAX) hands every rank
    for d in ranks:
        own = d.proposal()
        d.agree(agreed)
        assert d.effective() >= own and d.effective() == ranks[0].effective()
        assert Cfg().floor_s <= d.effective() <= 600.0


def test_a_slow_rank_is_named_once_and_its_recovery_too() -> None:
    det = StragglerDetector(Cfg(factor=2.0, window=10))
    windows = {r: ComputeWindow(10) for r in range(4)}
    for _ in range(10):
        for r, w in windows.items():
            w.add(0.05 if r != 3 else 0.2)
    records = {r: {"state": "running", "step": 10, **w.fields()} for r, w in windows.items()}
    found = det.check(records)
    assert [(f.rank, round(f.ratio, 1)) for f in found] == [(3, 4.0)]
    assert "rank 3 is 4.0× slower than the median over the last 10 steps" in found[0].line()
    assert det.check(records) == []  # named once
    for _ in range(10):
        windows[3].add(0.05)
    records[3] = {"state": "running", "step": 20, **windows[3].fields()}
    back = det.check(records)
    assert [f.rank for f in back] == [3] and back[0].recovered


def test_a_rank_is_judged_only_over_a_full_window() -> None:
    det = StragglerDetector(Cfg(factor=2.0, window=10))
    records = {0: {"state": "running", "compute_s": 0.05, "compute_n": 10},
               1: {"state": "running", "compute_s": 0.9, "compute_n": 3},
               2: {"state": "running", "compute_s": 0.05, "compute_n": 10}}
    assert det.check(records) == []


def test_what_was_learned_survives_a_restart_clamped_to_this_policy() -> None:
    from types import SimpleNamespace

    from lifecycle.watchdog.adaptive import AdaptiveDeadline

    cfg = SimpleNamespace(factor=4.0, quantile=0.99, window=5, floor_s=5.0, span_floor_s=5.0, calibration_steps=3)
    old = AdaptiveDeadline("step", 600.0, cfg)  # type: ignore[arg-type]
    for x in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        old.observe(x)
    old.agree(old.proposal())
    saved = old.state()
    assert saved["samples"] == [2.0, 3.0, 4.0, 5.0, 6.0] and saved["seen"] == 6 and saved["agreed"] == old.effective()
    new = AdaptiveDeadline("step", 600.0, cfg)  # type: ignore[arg-type]
    new.after_resume()
    assert new.restore(saved, "iter_0000005 (learned in attempt 1)")
    assert new.effective() == old.effective() and new.calibrated()
    assert "restored from iter_0000005" in new.derivation().text
    # a lower ceiling in this policy caps the restored value; junk is refused and changes nothing
    capped = AdaptiveDeadline("step", 10.0, cfg)  # type: ignore[arg-type]
    assert capped.restore(saved, "x") and capped.effective() == 10.0
    fresh = AdaptiveDeadline("step", 600.0, cfg)  # type: ignore[arg-type]
    assert not fresh.restore({"samples": "no", "seen": 1, "agreed": None}, "x") and fresh.effective() == 600.0
