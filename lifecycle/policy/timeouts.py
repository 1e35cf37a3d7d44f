"""The timeout chain: every timeout that bounds a job, in the order they must fire, and the orderings that cannot work.

A job is bounded by several clocks kept by different layers: the watchdog's deadline per phase, the process-group
(collective) timeout that torch's own watchdog applies to every NCCL/gloo op, the store and rendezvous, the
preemption grace, teardown's hard deadline, the launcher's kill grace and the scheduler's signal lead (SLURM
``--signal=B:TERM@lead``, Kubernetes ``terminationGracePeriodSeconds``). Set independently they contradict each other
(torchtitan#2899: a collective timeout shorter than the watchdog's deadline reports a bare timeout instead of the
culprit; a signal lead shorter than a save kills the save). Here they are derived from each other where lifecycle sets
them, and checked where they come from outside: :func:`issues` refuses what cannot work (exit 2, naming the keys),
:func:`chain` is what ``lifecycle explain`` prints.

Pure Python: no torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lifecycle.errors import PolicyIssue

if TYPE_CHECKING:
    from collections.abc import Mapping

    from lifecycle.policy.schema import Policy

ENV_SIGNAL_LEAD = "LIFECYCLE_SIGNAL_LEAD_S"
"""The scheduler's signal lead in seconds, set by the launch script (the shipped sbatch example sets it from its own
``--signal``); ``checkpoint.signal_lead_s`` in the policy wins."""
WATCHED = ("init", "warmup", "step", "checkpoint")
"""The deadlines the process-group timeout must outlast: the watchdog names the culprit before torch's own timeout
(in a trainer's own loop also ``eval`` and ``setup``: :data:`OWN_LOOP`)."""
OWN_LOOP = ("eval", "setup")


def collective_slack_s(policy: Policy) -> float:
    """What the watchdog needs after a deadline passes to report and take the job down: two polls, the peers'
    grace and 30 s for the reports and dumps."""
    return 4 * policy.watchdog.poll_interval_s + 30.0


def collective_timeout_s(policy: Policy, *, own_loop: bool = False) -> float:
    """The timeout of the process groups lifecycle creates (``init_process_group``, the model-parallel groups): the
    longest watchdog deadline plus :func:`collective_slack_s`, so that torch's timeout never fires before the
    watchdog has named the culprit."""
    dl = policy.watchdog.deadlines
    names = (*WATCHED, *(OWN_LOOP if own_loop else ()))
    return max(dl.static(name) for name in names) + collective_slack_s(policy)


def signal_lead_s(policy: Policy, env: Mapping[str, str] | None = None) -> tuple[float | None, str | None]:
    """The scheduler's signal lead and where it comes from (None when nobody said)."""
    if policy.checkpoint.signal_lead_s is not None:
        return float(policy.checkpoint.signal_lead_s), "checkpoint.signal_lead_s"
    lead = _env_lead((os.environ if env is None else env).get(ENV_SIGNAL_LEAD, ""))
    return (lead, ENV_SIGNAL_LEAD) if lead is not None else (None, None)


def _env_lead(raw: str) -> float | None:
    """The signal lead the environment gives: seconds > 0 and finite, else None (:func:`issues` refuses it)."""
    try:
        value = float(raw.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


@dataclass(frozen=True)
class Link:
    """One timeout of the chain: its name, seconds, where it comes from and what it bounds."""

    name: str
    seconds: float | None
    source: str
    bounds: str


def chain(policy: Policy, env: Mapping[str, str] | None = None) -> list[Link]:
    """Every timeout that bounds the job, inner first (what ``lifecycle explain`` prints)."""
    dl, ck, td = policy.watchdog.deadlines, policy.checkpoint, policy.teardown
    lead, lead_src = signal_lead_s(policy, env)
    links = [Link(f"deadline {name}", dl.static(name), f"watchdog.deadlines.{name}" + (" (auto: its ceiling)" if
                                                                                       getattr(dl, name) == "auto"
                                                                                       else ""),
                  _BOUNDS[name]) for name in ("warmup", "step", "eval", "checkpoint", "setup", "init", "teardown")]
    links += [
        Link("silent peer", policy.watchdog.heartbeat_stale_s, "watchdog.heartbeat_stale_s",
             "a peer whose heartbeat stopped is named unresponsive"),
        Link("collective timeout", collective_timeout_s(policy), "derived: the longest deadline (init, warmup, step, "
             "checkpoint; and eval, setup under attach) + "
             f"{collective_slack_s(policy):g}s", "torch's own timeout of every op on lifecycle's process groups (and "
             "the rendezvous store)"),
        Link("preemption grace", ck.grace_s, "checkpoint.grace_s", "from a preemption signal to the save landed"),
        Link("teardown", td.deadline_s, "teardown.deadline_s", "the whole teardown; then the process exits (5)"),
        Link("launcher kill grace", ck.grace_s + td.deadline_s, "derived: checkpoint.grace_s + teardown.deadline_s",
             "how long `lifecycle run` waits for its ranks after SIGTERM/Ctrl-C"),
        Link("scheduler signal lead", lead, lead_src or "not given (checkpoint.signal_lead_s or "
             f"{ENV_SIGNAL_LEAD})", "from the scheduler's signal to its kill"),
    ]
    return links


_BOUNDS = {"warmup": "each warmup op", "step": "one train step", "eval": "a trainer's own phase (attach)",
           "checkpoint": "one save and its commit", "setup": "a trainer's set-up until its first step (attach)",
           "init": "rendezvous, process groups, policy check", "teardown": "each teardown collective"}


def issues(policy: Policy, env: Mapping[str, str] | None = None, *, last_save_s: float | None = None
           ) -> list[PolicyIssue]:
    """The orderings that cannot work, each naming the keys to change. ``last_save_s``: how long the run's last
    save took (its summary), when known."""
    ck, td = policy.checkpoint, policy.teardown
    out: list[PolicyIssue] = []
    raw = (os.environ if env is None else env).get(ENV_SIGNAL_LEAD)
    if raw is not None and raw.strip() and _env_lead(raw) is None:
        out.append(PolicyIssue(
            ENV_SIGNAL_LEAD, "(environment) is not a number of seconds > 0: unset it, or set it to the seconds from "
            "the scheduler's signal to its kill (the sbatch example sets it from its own --signal)", raw[:80]))
    lead, source = signal_lead_s(policy, env)
    needed = ck.grace_s + td.deadline_s
    if ck.on_signal and lead is not None and lead < needed:
        out.append(PolicyIssue(
            "checkpoint.signal_lead_s" if source == "checkpoint.signal_lead_s" else "checkpoint.grace_s",
            f"the scheduler kills the job {lead:g}s after its signal ({source}), but a preemption needs up to "
            f"checkpoint.grace_s + teardown.deadline_s = {ck.grace_s:g} + {td.deadline_s:g} = {needed:g}s to save and "
            f"leave: ask the scheduler for a longer lead (SLURM --signal=B:TERM@{int(needed) + 30}, Kubernetes "
            f"terminationGracePeriodSeconds) or lower checkpoint.grace_s / teardown.deadline_s", has_value=False))
    if ck.on_signal and last_save_s is not None and ck.grace_s < last_save_s:
        out.append(PolicyIssue(
            "checkpoint.grace_s", f"is shorter than this run's last save took ({last_save_s:.1f}s, its summary.json): "
            f"a preemption's save would be killed; raise it above {last_save_s * 1.5:.0f}s", ck.grace_s))
    return out


FITTED = ("warmup", "step", "checkpoint", "eval")
"""The deadlines that bound a trainer's collectives (what :func:`adopted_issue` holds against its group timeout)."""


def fit_to_group_timeout(policy: Policy, group_timeout_s: float) -> tuple[Policy, dict[str, tuple[float, float]]]:
    """``policy`` with every deadline of :data:`FITTED` that nobody set (no policy file, preset or override names it)
    lowered to end :func:`collective_slack_s` before a trainer's process-group timeout (``lifecycle.attach`` into a
    trainer that kept torch's default: gloo 30 min, NCCL 10 min), so the watchdog names the culprit before torch's own
    timeout fires; and what moved (name -> (before, after)). A deadline that was set stays: a contradiction it makes is
    :func:`adopted_issue`'s to say. Nothing moves when the timeout leaves no room for the slack."""
    dl = policy.watchdog.deadlines
    room = group_timeout_s - collective_slack_s(policy)
    if room <= 0:
        return policy, {}
    moved = {name: (dl.static(name), room) for name in FITTED
             if name not in dl.model_fields_set and dl.static(name) > room}
    if not moved:
        return policy, {}
    deadlines = dl.model_copy(update={name: after for name, (_, after) in moved.items()})
    watchdog = policy.watchdog.model_copy(update={"deadlines": deadlines})
    return policy.model_copy(update={"watchdog": watchdog}), moved


def adopted_issue(policy: Policy, group_timeout_s: float) -> str | None:
    """A trainer's own process group (``lifecycle.attach``) whose timeout ends a collective before the watchdog's
    deadline can name the culprit: what to change, or None."""
    dl = policy.watchdog.deadlines
    longest = max(dl.static(name) for name in FITTED)
    if group_timeout_s >= longest + collective_slack_s(policy):
        return None
    return (f"the trainer's process-group timeout is {group_timeout_s:g}s, shorter than the longest watchdog deadline "
            f"that bounds its collectives ({longest:g}s) plus {collective_slack_s(policy):g}s to report: torch's own "
            f"timeout fires first and no culprit is named; raise init_process_group(timeout=...) above "
            f"{longest + collective_slack_s(policy):g}s or lower watchdog.deadlines.step/checkpoint/eval")
