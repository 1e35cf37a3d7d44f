"""In-process restart (``restart.mode: in_process``): recover from a failure in the same processes.

After an exception on a rank (a raise in a step, a collective divergence caught before the collective) every rank
leaves its phase: the failed one at once, the others when a collective with it breaks (its process groups are gone)
or, between collectives, at the next step boundary (their watchdog saw the alarm:
:class:`~lifecycle.errors.RestartRequested`). Each destroys its process groups in the policy's failure order and
meets the others on the store, which needs no process group. When every rank came and none refused, each builds the
next attempt in the same process (:func:`lifecycle.launch.worker.run_rank`): the process groups under a new store
prefix, warmup, the last committed checkpoint, the steps after it. Otherwise — a dead rank, a hang (gloo cannot give
up a blocked collective), a rank that did not come within ``restart.in_process_deadline_s``, the restarts spent —
every rank leaves through the failure path and the launcher's restart (a relaunch) takes over, with a line saying
why.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lifecycle.distributed.ranks import fmt_ranks
from lifecycle.rundir import has_marker

if TYPE_CHECKING:
    from torch.distributed import Store

    from lifecycle.context import RunContext
    from lifecycle.watchdog.run import WatchedRun

log = logging.getLogger(__name__)

PHASES = ("warmup", "train", "checkpoint")
"""Phases a failure is recovered from in place (init has no groups to re-create yet; teardown is leaving)."""
RECOVERABLE = ("failed", "sequence")
"""Causes (the watchdog's) the processes survive: an exception on a rank, a divergence caught before the collective."""
_WHY_NOT: dict[str, str] = {
    "hang": "a hang: a collective that never returns cannot be given up in place (gloo cannot abort it)",
    "unresponsive": "a rank stopped answering (frozen, or cut off by the network)",
    "dead": "a rank died: its process is gone",
    "lost": "the store does not answer: the ranks cannot agree on a restart",
    "usage": "a configuration error: a restart would fail the same way",
    "shutdown": "the launcher is stopping the job",
}
POLL_S = 0.02


@dataclass(frozen=True)
class InProcessRestart:
    """The ranks agreed to restart in place after ``attempt`` failed: what the next attempt is built from."""

    attempt: int
    """The attempt that failed (the next one is ``attempt + 1``)."""
    exit_code: int
    """The code it would have exited with."""
    error: str
    cause: str | None
    culprits: list[int]
    phase: str | None
    step: int
    failed_at: float
    """Wall time of the failure on this rank."""
    report_s: float
    """From the failure to its report (the connections cut, the alarm, the diagnosis of who is where)."""
    destroy_s: float
    agree_s: float
    base: Store
    """The store the next attempt's process groups are created on (under a prefix of their own)."""


def refusal(ctx: WatchedRun, phase: str | None, cause: str) -> str | None:
    """Why a failure of ``cause`` (a watchdog cause, or ``peer`` when no watchdog named one) in ``phase`` cannot be
    recovered in place; None when it can."""
    if ctx.own_loop:
        return "a trainer's own loop (lifecycle.attach) holds its model and data loader: it restarts by relaunch"
    if ctx.progress.restarts_left <= 0:
        return f"the restarts are spent (restart.max_restarts={ctx.policy.restart.max_restarts})"
    if phase not in PHASES:
        return f"it happened in phase {phase or 'init'}, where there is nothing to restart in place"
    if cause in RECOVERABLE or cause == "peer":
        return None
    return _WHY_NOT.get(cause, f"a failure of kind {cause!r}")


def votes_key(ctx: RunContext) -> str:
    """The store key every rank appends its vote to (one per attempt of this run)."""
    return f"lifecycle/inproc/{ctx.policy.run.id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/" \
           f"{ctx.attempt}/votes"


def agree(ctx: RunContext, store: Store, refused: str | None, deadline_s: float) -> str | None:
    """Every rank's vote on the store (no process group): None when every rank came and none refused, else why
    not — the first refusal, the ranks missing at ``deadline_s`` (seconds from now), the launcher stopping the job,
    a store that does not answer. Every rank waits at most ``deadline_s``."""
    key = votes_key(ctx)
    end = time.monotonic() + deadline_s
    try:
        store.append(key, f"{ctx.rank}={'no ' + refused if refused else 'ok'}\n")
        while True:
            votes = _parse(bytes(store.get(key)).decode(errors="replace"))
            refusals = {r: v[3:] for r, v in votes.items() if v != "ok"}
            if refusals:
                first = min(refusals)
                return refused if first == ctx.rank and refused else f"rank {first}: {refusals[first]}"
            if len(votes) >= ctx.world_size:
                return None
            if has_marker(ctx.run_dir):
                return "the launcher is stopping the job (a rank ended)"
            if time.monotonic() > end:
                missing = sorted(set(range(ctx.world_size)) - set(votes))
                return (f"rank{'s' if len(missing) > 1 else ''} {fmt_ranks(missing)} did not come within "
                        f"{ctx.policy.restart.in_process_deadline_s:g}s (restart.in_process_deadline_s): dead, or "
                        f"stuck in a collective that cannot be given up")
            time.sleep(POLL_S)
    except Exception as exc:  # noqa: BLE001 - a store that fails ends the restart in place, not the failure path
        return f"the store does not answer ({type(exc).__name__}: {str(exc)[:200]})"


def _parse(text: str) -> dict[int, str]:
    votes: dict[int, str] = {}
    for line in text.splitlines():
        rank, _, vote = line.partition("=")
        if rank.isdigit():
            votes.setdefault(int(rank), vote)
    return votes
