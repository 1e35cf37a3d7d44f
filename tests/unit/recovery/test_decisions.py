"""The launcher's restart decisions, on generated sequences of attempts: the budget is spent by relaunches and
in-place restarts alike, a final code never restarts, the memory copies outlive the launcher only after a failure."""

from __future__ import annotations

import random

import pytest

from lifecycle.errors import ExitCode
from lifecycle.policy.load import validate
from lifecycle.recovery import decisions

pytestmark = pytest.mark.in_process


def _policy(max_restarts: int, memory_every: int = 0):  # noqa: ANN202 - a Policy
    return validate({"restart": {"max_restarts": max_restarts},
                     "checkpoint": {"memory": {"every_steps": memory_every}}})


def test_final_codes_never_restart_and_failures_do() -> None:
    policy = _policy(3)
    no_progress = policy.teardown.exit_codes.no_progress
    assert all(decisions.final(c, policy) for c in (0, ExitCode.USAGE, no_progress))
    assert not any(decisions.final(c, policy) for c in (1, 3, 4, 5, policy.teardown.exit_codes.rank_failed))


def test_generated_attempts_never_spend_more_than_the_budget() -> None:
    """Whatever mix of relaunches and in-place restarts: the number of further attempts the launcher starts plus the
    ranks' restarts in place never exceeds ``max_restarts``, and the line counts every restart spent."""
    rng = random.Random(43)
    for _ in range(500):
        total = rng.randint(0, 6)
        budget = decisions.Budget.of(_policy(total))
        attempt, relaunches, in_place, lines, spent = 1, 0, 0, [], []
        while True:
            last = rng.choice((0, 0, 1, 2))  # restarts in place inside this attempt
            reached = attempt + last
            in_place += last
            budget.spend_in_place(attempt, reached)
            if budget.spent:
                break
            lines.append(budget.spend_relaunch())
            relaunches += 1
            spent.append(relaunches + in_place)
            attempt = reached + 1
        assert relaunches + in_place >= total  # the run stopped only once the budget was spent
        assert relaunches + in_place - last <= total  # and every attempt it started was within the budget
        assert lines == spent  # "restart N of M" counts the restarts in place too


def test_the_restart_line_names_the_blamed_ranks_and_the_resume_source() -> None:
    info = {"attempt": 2, "blame": {"ranks": [1, 2, 3], "cause": "hang", "phase": "train"}}
    line = decisions.restart_line(_policy(4), info, 5, 1)
    assert "attempt 2 failed (exit 5): ranks 1-3 (hang in phase train); restart 1 of 4" in line
    assert line.endswith("the last committed checkpoint")
    memory = decisions.restart_line(_policy(4, memory_every=10), {"attempt": 1, "outcome": "rank 0 died"}, 4, 2)
    assert "rank 0 died; restart 2 of 4" in memory and "memory copies" in memory


@pytest.mark.parametrize(("code", "kept"), [(None, False), (0, False), (ExitCode.USAGE, False), (6, False),
                                            (4, True), (5, True), (1, True)])
def test_memory_copies_outlive_the_launcher_only_after_a_failure(code: int | None, kept: bool) -> None:
    assert decisions.keep_copies(_policy(2, memory_every=10), code) is kept
    assert decisions.keep_copies(_policy(2), code) is False  # no memory tier: nothing to keep
