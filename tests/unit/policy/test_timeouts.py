"""The timeout chain (lifecycle.policy.timeouts): derived where lifecycle sets the clocks, refused where they come
from outside and cannot work (the orderings of torchtitan#2899: a collective timeout that fires before the watchdog
names the culprit, a scheduler signal lead shorter than the save and exit it must cover)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.errors import PolicyError
from lifecycle.policy import timeouts
from lifecycle.policy.load import validate

SECONDS = st.floats(min_value=1.0, max_value=100_000.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(init=SECONDS, warmup=SECONDS, step=SECONDS, checkpoint=SECONDS, poll=st.floats(0.05, 30.0))
def test_the_collective_timeout_outlasts_every_watchdog_deadline(init: float, warmup: float, step: float,
                                                                 checkpoint: float, poll: float) -> None:
    p = validate({"watchdog": {"poll_interval_s": poll, "deadlines": {
        "init": init, "warmup": warmup, "step": step, "checkpoint": checkpoint}}, "checkpoint": {"grace_s": 1e6}})
    t = timeouts.collective_timeout_s(p)
    assert all(t >= p.watchdog.deadlines.static(n) + 30 for n in timeouts.WATCHED)
    own = timeouts.collective_timeout_s(p, own_loop=True)
    assert own >= t and own > p.watchdog.deadlines.static("eval")
    assert timeouts.adopted_issue(p, own) is None and timeouts.adopted_issue(p, step - 1.0) is not None


def test_a_scheduler_lead_shorter_than_the_save_and_exit_is_refused_naming_the_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PolicyError, match=r"checkpoint.signal_lead_s: the scheduler kills the job 90s after its "
                                          r"signal \(checkpoint.signal_lead_s\), but a preemption needs up to "
                                          r"checkpoint.grace_s \+ teardown.deadline_s = 120 \+ 60 = 180s"):
        validate({"checkpoint": {"signal_lead_s": 90}})
    validate({"checkpoint": {"signal_lead_s": 90, "grace_s": 20}, "teardown": {"deadline_s": 40}})  # 60 <= 90
    validate({"checkpoint": {"signal_lead_s": 90, "on_signal": False}})  # no preemption save to cover
    monkeypatch.setenv(timeouts.ENV_SIGNAL_LEAD, "120")  # SLURM --signal=B:TERM@120, from the sbatch script
    with pytest.raises(PolicyError, match=r"checkpoint.grace_s: the scheduler kills the job 120s after its signal "
                                          r"\(LIFECYCLE_SIGNAL_LEAD_S\).*--signal=B:TERM@210"):
        validate({})


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "nan", "inf", "1e999", "12s"])
def test_a_signal_lead_in_the_environment_that_is_no_seconds_is_refused_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(timeouts.ENV_SIGNAL_LEAD, raw)
    with pytest.raises(PolicyError, match=rf"LIFECYCLE_SIGNAL_LEAD_S: \(environment\) is not a number of seconds > 0"
                                          rf".*\(got '{raw}'\)"):
        validate({"checkpoint": {"grace_s": 20}, "teardown": {"deadline_s": 40}})
    monkeypatch.setenv(timeouts.ENV_SIGNAL_LEAD, " ")  # set but empty: nobody said
    validate({})


def test_a_grace_shorter_than_the_runs_last_save_is_refused_before_launch(tmp_path: Path) -> None:
    from lifecycle.machine.rankdir import preflight

    run = tmp_path / "run"
    run.mkdir()
    policy = validate({"run": {"dir": str(run)}, "train": {"kind": "synthetic", "options": None},
                       "parallelism": {"ep": 1}, "moe": {"zero_token": {"action": "off"}},
                       "checkpoint": {"grace_s": 30}})
    preflight(policy, 2)  # no save known yet
    (run / "summary.json").write_text(json.dumps({"checkpoints": [
        {"step": 10, "committed": True, "save_s": 40.0, "commit_s": 5.0, "commit_s_max": 9.0}]}))
    with pytest.raises(PolicyError, match=r"checkpoint.grace_s: is shorter than this run's last save took \(49.0s"):
        preflight(policy, 2)


def test_explain_prints_the_chain() -> None:
    from lifecycle.machine.explain import explain, render
    from lifecycle.policy.load import load

    info = explain(load(["checkpoint.signal_lead_s=600"]), None, 0)
    names = [t["name"] for t in info["timeouts"]]
    assert names.index("deadline step") < names.index("collective timeout") < names.index("scheduler signal lead")
    text = render(info)
    assert "collective timeout" in text and re.search(r"scheduler signal lead +600s  checkpoint.signal_lead_s", text)


@settings(max_examples=80, deadline=None)
@given(timeout=st.floats(min_value=1.0, max_value=20_000.0, allow_nan=False),
       given_keys=st.sets(st.sampled_from(timeouts.FITTED)), value=SECONDS)
def test_deadlines_nobody_set_fit_under_a_trainers_timeout_and_set_ones_never_move(
        timeout: float, given_keys: set[str], value: float) -> None:
    p = validate({"watchdog": {"deadlines": {k: value for k in given_keys}}, "checkpoint": {"grace_s": 1e6}},
                 own_loop=True)
    fitted, moved = timeouts.fit_to_group_timeout(p, timeout)
    room = timeout - timeouts.collective_slack_s(p)
    before, after = p.watchdog.deadlines, fitted.watchdog.deadlines
    for name in timeouts.FITTED:
        if name in given_keys or room <= 0:
            assert after.static(name) == before.static(name) and name not in moved
        else:
            assert after.static(name) == min(before.static(name), room)
            assert (name in moved) == (before.static(name) > room)
    if room > 0 and all(before.static(k) <= room for k in given_keys):
        assert timeouts.adopted_issue(fitted, timeout) is None  # nothing set contradicts it: no warning
    elif given_keys and room > 0:
        assert timeouts.adopted_issue(fitted, timeout) is not None  # an explicit contradiction is still said
    assert fitted.watchdog.deadlines.init == before.init and fitted.checkpoint == p.checkpoint


def test_torch_default_timeouts_fit_the_default_policy_under_attach() -> None:
    """gloo's default 30 minutes and NCCL's 10: the preset's own deadlines fit; eval (1800 s, set by nobody) moves."""
    from lifecycle.policy.load import load

    p = load([], own_loop=True).policy
    for group_timeout in (1800.0, 600.0):
        fitted, moved = timeouts.fit_to_group_timeout(p, group_timeout)
        assert timeouts.adopted_issue(p, group_timeout) is not None
        assert timeouts.adopted_issue(fitted, group_timeout) is None
        assert set(moved) == {"eval"} and moved["eval"] == (1800.0, group_timeout - 34.0)
