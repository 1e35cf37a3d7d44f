"""The launcher's restart decisions: whether a failed attempt gets another, what the next one resumes from, and
what happens to the memory tier's copies when the run ends on this node.

``restart.max_restarts`` is one budget for the whole run: each relaunch spends one, and so does each restart the
ranks made in place inside an attempt (the attempt number they reached says how many). A run ends — no further
attempt — on success, a usage error, the no-progress code (:mod:`lifecycle.recovery.progress`), a stop the launcher
was asked for, or a spent budget. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lifecycle.distributed.ranks import fmt_ranks
from lifecycle.errors import ExitCode

if TYPE_CHECKING:
    from lifecycle.jsontypes import JsonDict
    from lifecycle.policy.schema import Policy


def final(code: int, policy: Policy) -> bool:
    """An exit code no restart can change: success, a usage error, the no-progress verdict."""
    return code in (0, ExitCode.USAGE, policy.teardown.exit_codes.no_progress)


@dataclass
class Budget:
    """``restart.max_restarts``, spent by relaunches and by the ranks' restarts in place."""

    total: int
    left: int

    @classmethod
    def of(cls, policy: Policy) -> Budget:
        return cls(policy.restart.max_restarts, policy.restart.max_restarts)

    def spend_in_place(self, started: int, reached: int) -> None:
        """An attempt started as number ``started`` and its ranks restarted in place up to ``reached``."""
        self.left -= max(reached - started, 0)

    def spend_relaunch(self) -> int:
        """One relaunch; the number of restarts spent so far."""
        self.left -= 1
        return self.total - self.left

    @property
    def spent(self) -> bool:
        return self.left <= 0


def restart_line(policy: Policy, info: JsonDict, code: int, done: int) -> str:
    """What the launcher prints before the next attempt: who failed, how many restarts, where it resumes."""
    blame = info.get("blame") or {}
    who = (f"ranks {fmt_ranks(blame['ranks'])} ({blame.get('cause')} in phase {blame.get('phase')})"
           if isinstance(blame, dict) and blame.get("ranks") else str(info.get("outcome", f"exit {code}")))
    source = ("the newest step its memory copies or the last commit hold" if policy.checkpoint.memory.every_steps
              else "the last committed checkpoint")
    return (f"restart  attempt {info.get('attempt')} failed (exit {code}): {who}; restart {done} of "
            f"{policy.restart.max_restarts}: the next attempt resumes from {source}")


def keep_copies(policy: Policy, code: int | None) -> bool:
    """Whether the memory tier's copies on this node outlive the run's launcher: only after a failure (the run's
    next attempt — the same command again, a scheduler's requeue — restores them); a finished, refused or stopped
    run (no progress) frees them."""
    return bool(policy.checkpoint.memory.every_steps) and code is not None and not final(code, policy)
