"""summary.json and the printed summary at the end of `lifecycle run`, built from the per-rank events.

A failed run gets one too: spans cut by a dead rank count up to its last event (and the rank is listed in
``cut_ranks``), and the launcher's verdict gives the exit status of ranks that wrote no exit event.
"""

from __future__ import annotations

import json
import signal
import statistics
from pathlib import Path
from typing import Any

from lifecycle.obs.events import PER_STEP_OPS, read_events
from lifecycle.obs.spans import Span, phase_of, rank_spans, valid_events
from lifecycle.policy.base import PHASES
from lifecycle.rundir import ATTEMPTS_DIR, HANG_REPORT, SUMMARY, earlier_attempts, safeio

HANG_KEYS = ("cause", "detail", "origin", "culprits", "dead", "group", "report")


def stats(values: dict[int, float]) -> dict[str, Any]:
    """min/median/max over ranks (seconds) and the slowest rank (the lowest one on a tie)."""
    slowest = min(values, key=lambda r: (-values[r], r))
    return {"min_s": round(min(values.values()), 6), "median_s": round(statistics.median(values.values()), 6),
            "max_s": round(max(values.values()), 6), "slowest_rank": slowest, "ranks": len(values)}


def _per_rank(spans: dict[int, list[Span]], key: Any) -> tuple[dict[str, dict[int, float]], dict[str, set[int]]]:
    """Seconds per (key(span), rank) for the spans where key is not None, and the ranks with a cut span."""
    times: dict[str, dict[int, float]] = {}
    cut: dict[str, set[int]] = {}
    for rank, ss in spans.items():
        for s in ss:
            k = key(s)
            if k is None:
                continue
            times.setdefault(k, {})[rank] = times.get(k, {}).get(rank, 0.0) + s.dur_us / 1e6
            if s.cut:
                cut.setdefault(k, set()).add(rank)
    return times, cut


def phase_times(spans: dict[int, list[Span]]) -> dict[str, dict[str, Any]]:
    """Per phase: stats over ranks of the time each rank spent in it (a re-entered phase adds up)."""
    times, cut = _per_rank(spans, phase_of)
    order = [p for p in PHASES if p in times] + sorted(set(times) - set(PHASES))
    return {p: {**stats(times[p]), **({"cut_ranks": sorted(cut[p])} if p in cut else {})} for p in order}


def warmup_per_group(spans: dict[int, list[Span]]) -> dict[str, dict[str, Any]]:
    """Per group name: stats over ranks of the time spent warming it, and the ops issued on it."""
    def key(s: Span) -> str | None:
        return str(s.begin.get("group", "?")) if s.name.startswith("warm:") else None

    times, _ = _per_rank(spans, key)
    ops: dict[str, set[str]] = {}
    for ss in spans.values():
        for s in ss:
            if s.name.startswith("warm:"):
                ops.setdefault(str(s.begin.get("group", "?")), set()).add(s.name.split(":", 1)[1])
    return {g: {**stats(t), "ops": sorted(ops[g])} for g, t in sorted(times.items())}


def checkpoints(spans: dict[int, list[Span]]) -> list[dict[str, Any]]:
    """Per saved step: the slowest rank's save, rank 0's commit (the rename + tracker), whether it committed."""
    saves: dict[Any, dict[int, Span]] = {}
    commits: dict[Any, dict[int, Span]] = {}
    for rank, ss in spans.items():
        for s in ss:
            if s.name in ("save", "commit"):
                (saves if s.name == "save" else commits).setdefault(s.begin.get("step"), {})[rank] = s
    out = []
    for step in sorted(set(saves) | set(commits), key=lambda x: (x is None, x)):
        save, commit = saves.get(step, {}), commits.get(step, {})
        first = next(iter(save.values()), None) or next(iter(commit.values()))
        c0 = commit.get(0) or next(iter(commit.values()), None)
        entry: dict[str, Any] = {"step": step, "path": first.fields.get("path"), "reason": first.fields.get("reason")}
        if save:
            st = stats({r: s.dur_us / 1e6 for r, s in save.items()})
            entry.update(save_s=st["max_s"], save_slowest_rank=st["slowest_rank"])
        if c0 is not None:
            entry.update(commit_s=round(c0.dur_us / 1e6, 6), write_s=c0.fields.get("write_s"),
                         commit_s_max=round(max(s.dur_us for s in commit.values()) / 1e6, 6))
        entry["committed"] = bool(commit) and all(not s.cut and s.fields.get("outcome") == "ok"
                                                  for s in commit.values())
        out.append(entry)
    return out


def _last(evs: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((e for e in reversed(evs) if e.get("name") == name), None)


def _how(code: int) -> str:
    if code >= 0:
        return f"exit {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def exit_status(events: dict[int, list[dict[str, Any]]], launch: Any | None) -> dict[int, dict[str, Any]]:
    """Per rank: exit code, how it ended (exit N, signal, killed by the launcher), last phase, its error."""
    per_rank = dict(getattr(launch, "per_rank", None) or {})
    killed = set(getattr(launch, "killed", ()) or ())
    out = {}
    for r in sorted(set(events) | set(per_rank)):
        evs = events.get(r, [])
        ev, fail, popen = _last(evs, "exit"), _last(evs, "failure"), per_rank.get(r)
        code = ev.get("exit_code") if ev else (popen if popen is None or popen >= 0 else 128 - popen)
        how = (f"killed by the launcher {'at once (asked again)' if getattr(launch, 'aborted', False) else 'after the grace period'}"
               if r in killed
               else _how(popen) if popen is not None else f"exit {code}" if ev else "no exit event")
        out[r] = {"exit_code": code, "how": how, "last_phase": evs[-1].get("phase") if evs else None,
                  "error": (fail or {}).get("error")}
    return out


def _instants(events: dict[int, list[dict[str, Any]]], match: Any, keep: tuple[str, ...]) -> list[dict[str, Any]]:
    found = [e for evs in events.values() for e in evs if e.get("kind") == "instant" and match(e["name"])]
    return [{"rank": e.get("rank"), "phase": e.get("phase"), **{k: e[k] for k in keep if k in e}}
            for e in sorted(found, key=lambda e: e["t"])]


def zero_tokens(events: dict[int, list[dict[str, Any]]]) -> dict[int, int]:
    """Zero-token events per rank: ``zero_token`` instants (``count`` each, default 1) or scalars (value)."""
    out: dict[int, int] = {}
    for r, evs in events.items():
        n = 0
        for e in evs:
            if e["name"] == "zero_token" and e["kind"] in ("instant", "scalar"):
                v = e.get("count", 1) if e["kind"] == "instant" else e.get("value", 0)
                n += int(v) if isinstance(v, int | float) else 1
        if n:
            out[r] = n
    return out


def _deadlines(events: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """The adaptive deadlines as rank 0 last agreed them (``auto`` ones only), by ``watchdog.deadlines`` key: seconds
    and how. Run directories written before the keys were the one name say ``deadline_phase`` (``train`` for step)."""
    out: dict[str, Any] = {}
    for e in events.get(0, []):
        if e.get("name") == "deadline" and e.get("kind") == "instant":
            old = str(e.get("deadline_phase"))
            key = str(e.get("deadline") or {"train": "step"}.get(old, old))
            out[key] = {"seconds": e.get("seconds"), "how": e.get("how"), "changes": out.get(key, {}).get("changes", 0) + 1}
    return out


def comm_memory(events: dict[int, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """What warming the communicators cost (``comm_memory`` events): the largest rank total, and per group the
    largest measured cost over ranks beside the model's estimate."""
    last = {r: e for r, evs in events.items() if (e := _last(evs, "comm_memory"))}
    if not last:
        return None
    worst = max(last, key=lambda r: (int(last[r].get("total_bytes", 0)), -r))
    groups: dict[str, dict[str, Any]] = {}
    for e in last.values():
        for g, v in (e.get("groups") or {}).items():
            cur = groups.setdefault(g, {"measured_max_bytes": 0, "estimate_bytes": v.get("estimate_bytes")})
            cur["measured_max_bytes"] = max(cur["measured_max_bytes"], int(v.get("measured_bytes") or 0))
    return {"source": last[worst].get("source"), "max_total_bytes": int(last[worst].get("total_bytes", 0)),
            "max_total_rank": worst, "groups": groups}


def _first_step_t(events_file: Path) -> float | None:
    """Wall time (seconds) of the first step's end in a rank's events file (read line by line, up to it)."""
    try:
        with safeio.open_regular(events_file) as f:
            for raw in f:
                try:
                    e = json.loads(raw)
                except (ValueError, RecursionError):
                    continue
                if isinstance(e, dict) and e.get("name") == "step" and e.get("kind") == "end":
                    return float(e["t"]) / 1e6
    except (OSError, safeio.RunDirError, KeyError, TypeError, ValueError):
        return None
    return None


def _with_restart_times(run_dir: Path, earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each earlier attempt with ``restart_s``: from its failure (its first end record in the restart ledger) to
    the first step of the attempt after it, when both are known."""
    from lifecycle.rundir import events_file, restarts

    ended = {a.number: a.ended_at for a in restarts.read(run_dir)}
    numbers = [int(a["attempt"]) for a in earlier]
    for info in earlier:
        n = int(info["attempt"])
        nxt = n + 1
        folder = Path(run_dir) / ATTEMPTS_DIR / str(nxt) if nxt in numbers else Path(run_dir)
        first = _first_step_t(events_file(folder, 0))
        if ended.get(n) is not None and first is not None and info.get("exit_code") not in (None, 0):
            info["restart_s"] = round(first - float(ended[n] or 0.0), 3)
    return earlier


_STAGES = {"phase:init": "init_s", "phase:warmup": "warmup_s", "resume": "load_s", "memory_restore": "load_s",
           "step": "first_step_s"}
"""The spans after a restart in place whose duration is a stage of it (the first of each)."""


def current_attempt(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A rank's events from the start of its last attempt in this process (after its last restart in place)."""
    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        if e["name"] == "attempt" and e.get("in_process"):
            return events[i:]
    return events


def in_process_restarts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's restarts in place (``restart_in_process`` events), each with the seconds from its failure to the next
    attempt's first step (``restart_s``) and its stages: report, destroy and agree, then the next attempt's init, warmup,
    checkpoint load and first step."""
    out: list[dict[str, Any]] = []
    for i, e in enumerate(events):
        if e["name"] != "restart_in_process":
            continue
        info = {k: e.get(k) for k in ("failed_attempt", "exit_code", "error", "cause", "culprits", "failed_phase",
                                      "last_step", "resumed_from", "pid")}
        stages: dict[str, float] = {k: e.get(k) or 0.0 for k in ("report_s", "destroy_s", "agree_s")}
        for f in events[i + 1:]:
            if f["name"] == "restart_in_process":
                break
            if f["kind"] == "end" and f["name"] in _STAGES:
                stages.setdefault(_STAGES[f["name"]], round(float(f.get("dur_us") or 0) / 1e6, 4))
                if f["name"] == "step":
                    if isinstance(e.get("failed_at"), int | float):
                        info["restart_s"] = round(float(f["t"]) / 1e6 - float(e["failed_at"]), 3)
                    break
        info["stages"] = stages
        out.append(info)
    return out


def _in_process_earlier(restarts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The attempts that restarted in place, as lines of ``earlier_attempts``."""
    out = []
    for r in restarts:
        who = r.get("culprits") or []
        out.append({"attempt": r.get("failed_attempt"), "mode": "in_process", "exit_code": r.get("exit_code"),
                    "outcome": f"restarted in place after {r.get('error')}", "resumed_from": r.get("resumed_from"),
                    "last_step": r.get("last_step"), "restart_s": r.get("restart_s"), "stages": r.get("stages"),
                    "blame": {"ranks": who, "cause": r.get("cause"), "phase": r.get("failed_phase"),
                              "source": "events"}})
    return out


def _earlier(run_dir: Path, restarts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every earlier attempt, oldest first: relaunched ones from ``attempts/<N>/`` (with ``restart_s``), and those
    that restarted in place, from the summaries there and from this attempt's events."""
    relaunched = _with_restart_times(run_dir, earlier_attempts(run_dir))
    in_place: dict[int, dict[str, Any]] = {}
    for a in relaunched:
        a.setdefault("mode", "relaunch")
        before = a.pop("in_process_restarts", None)  # restarts in place within that attempt's processes
        if isinstance(before, list):
            in_place.update({int(i["attempt"]): i for i in _in_process_earlier([r for r in before
                                                                                if isinstance(r, dict)])
                             if isinstance(i.get("attempt"), int)})
    in_place.update({int(i["attempt"]): i for i in _in_process_earlier(restarts) if isinstance(i["attempt"], int)})
    merged = {int(a["attempt"]): a for a in relaunched if int(a["attempt"]) not in in_place or a.get("exit_code")
              is not None}
    merged.update({n: i for n, i in in_place.items() if n not in merged})
    return [merged[n] for n in sorted(merged)]


def build(run_dir: Path, launch: Any | None = None, *, goodput: bool = True) -> dict[str, Any]:
    """Aggregate a run directory's events into the summary (a failed run gets one too): the last attempt's, with the
    attempts that restarted in place in the same processes before it (``in_process_restarts``). ``goodput``: with the
    run's goodput over every attempt (it reads them all: the launcher adds it with :func:`add_goodput` once no other
    attempt follows, not on the way to a relaunch)."""
    every = {r: valid_events(evs) for r, evs in read_events(run_dir, skip=PER_STEP_OPS).items()}
    restarted = in_process_restarts(every.get(0, []))
    events = {r: current_attempt(evs) for r, evs in every.items()}
    spans = {r: rank_spans(r, evs, valid=True) for r, evs in events.items()}
    status = exit_status(events, launch)
    rank0 = events.get(0, [])
    losses = [e["loss"] for e in rank0 if e["name"] == "step" and e["kind"] == "end" and "loss" in e]
    warm = warmup_per_group(spans)
    exit0 = _last(rank0, "exit") or {}
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "ranks": len(status),
        "hosts": {r: evs[0].get("host") for r, evs in events.items() if evs and evs[0].get("host")},
        "phases": phase_times(spans),
        "warmup_per_group": warm,
        "warmup_s_per_group": {g: w["max_s"] for g, w in warm.items()},
        "loss": {"first": losses[0], "last": losses[-1], "steps": len(losses)} if losses else None,
        "checkpoints": checkpoints(spans),
        "zero_token_events": zero_tokens(events),
        "exit_code_per_rank": {r: s["exit_code"] for r, s in status.items()},
        "exit_status_per_rank": status,
        "failures": _instants(events, lambda n: n == "failure", ("error", "message", "exit_code")),
        "fault_drills": _instants(events, lambda n: n == "fault_drill", ("action", "at", "drill_step")),
        "stragglers": _instants(events, lambda n: n == "straggler", ("straggler_rank", "ratio", "compute_s",
                                                                      "median_s", "window", "at_step", "recovered",
                                                                      "line")),
        "deadlines": _deadlines(events),
        "hang_reports": _instants(events, lambda n: "hang" in n, HANG_KEYS),
        "hang_report_file": str(Path(run_dir) / HANG_REPORT) if (Path(run_dir) / HANG_REPORT).is_file() else None,
        "resumed_from": exit0.get("resumed_from"),
        "stop_step": exit0.get("stop_step"),
        "stop_signal": exit0.get("stop_signal"),
        "train_steps": exit0.get("train_steps"),
        "last_step": exit0.get("step"),
        "attempt": int((_last(rank0, "attempt") or {}).get("attempt", 1)),  # the agreed one, when the ranks differed
        "nccl_env": (_last(rank0, "nccl_env") or {}).get("env"),
        "nccl_env_differs_on_ranks": sorted(r for r, evs in events.items()
                                            if (_last(evs, "nccl_env") or {}).get("env")
                                            != (_last(rank0, "nccl_env") or {}).get("env")) or None,
        "earlier_attempts": _earlier(run_dir, restarted),
        "in_process_restarts": restarted or None,
        "comm_memory": comm_memory(events),
        "unwarmed_groups": {r: e["unwarmed"] for r, evs in events.items()
                            if (e := _last(evs, "groups_used")) and e.get("unwarmed")} or None,
    }
    if launch is not None:
        summary.update(exit_code=launch.exit_code, outcome=launch.describe(), wall_s=round(launch.wall_s, 2),
                       first_failure=launch.first_failure, failed_phase=launch.phase)
    summary["unfinished"] = unfinished(summary)  # a stop signal saved it before its last step: it resumes when run again
    if goodput:
        add_goodput(run_dir, summary)
    summary["blame"] = blame(run_dir, summary)
    b = summary["blame"]
    if launch is not None and b and b.get("source") != "launcher" and b.get("ranks") \
            and b["ranks"] != [launch.first_failure]:
        # One verdict for the outcome line, the timeline's title and a restart: the watchdog's, not the first rank
        # to leave (under a hang that is usually a healthy rank that reported it).
        from lifecycle.distributed.ranks import fmt_ranks

        who = f"rank{'s' if len(b['ranks']) > 1 else ''} {fmt_ranks(b['ranks'])}"
        what = {"hang": "hung", "sequence": "diverged (collective sequence)", "dead": "died", "failed": "failed",
                "unresponsive": "unresponsive", "lost": "lost the store"}.get(str(b.get("cause")), str(b.get("cause")))
        summary["outcome"] = (f"{who} {what} in phase {b.get('phase')} (the watchdog's verdict); "
                              + launch.describe().replace("failed first", "exited first"))
    return summary


def blame(run_dir: Path, s: dict[str, Any]) -> dict[str, Any] | None:
    """Who the run's failure is on, one answer for the outcome line, the summary and the hang report.

    The watchdog's diagnosis (``hang_report.json``: the ranks others waited for, the dead, the one that failed
    first by the alarm) wins over the launcher's "first rank to exit": under a hang the first rank to leave is
    usually a healthy one that reported it. A configuration error is on nobody's rank.
    """
    report = Path(run_dir) / HANG_REPORT
    data = safeio.try_json(report, limit=1 << 24)
    if isinstance(data, dict) and data.get("cause") not in (None, "usage"):
        return {"ranks": [int(r) for r in data.get("culprits") or []], "cause": data.get("cause"),
                "phase": data.get("phase"), "source": HANG_REPORT, "detail": str(data.get("detail", ""))[:300]}
    reports = [h for h in s.get("hang_reports") or [] if h.get("cause") not in (None, "usage")]
    if reports:
        h = reports[0]
        return {"ranks": [int(r) for r in h.get("culprits") or []], "cause": h.get("cause"), "phase": h.get("phase"),
                "source": "events", "detail": str(h.get("detail", ""))[:300]}
    if s.get("first_failure") is not None:
        return {"ranks": [s["first_failure"]], "cause": "failed", "phase": s.get("failed_phase"),
                "source": "launcher", "detail": s.get("outcome", "")}
    return None


def verdict(s: dict[str, Any], *, rank_failed: int = 4) -> tuple[int, str]:
    """The run's exit code and one line, from its ranks' exit events alone (torchrun exits 1 for any failed worker:
    this is the code a scheduler should act on, :data:`lifecycle.errors.EXIT_RULES`). The blamed ranks' code first;
    a rank that left no exit event (killed) counts as failed."""
    codes = {int(r): c for r, c in (s.get("exit_code_per_rank") or {}).items()}
    if not codes:
        return 2, "no rank of this run left an event: not a lifecycle run directory, or it never started"
    failed = {r: (c if isinstance(c, int) else rank_failed) for r, c in codes.items() if c != 0}
    if not failed:
        left = unfinished(s)
        return 0, f"all {len(codes)} ranks exited 0" + (f"; preempted at step {s['stop_step']}, saved ({left})"
                                                          if left else "")
    b = s.get("blame") or {}
    blamed = [r for r in b.get("ranks") or [] if r in failed]
    rank = blamed[0] if blamed else min(failed)
    why = f" ({b.get('cause')} in phase {b.get('phase')})" if b.get("cause") else ""
    return failed[rank], f"exit {failed[rank]}: rank {rank}{why}; ranks not exiting 0: {sorted(failed)}"


def unfinished(s: dict[str, Any]) -> str | None:
    """Why a run whose ranks all exited 0 is not finished: a stop signal saved it before its last step (a preemption:
    it resumes when started again). None when it ran to its end, failed, or says nothing of it."""
    stop, total = s.get("stop_step"), s.get("train_steps")
    if not isinstance(stop, int) or (isinstance(total, int) and stop >= total):
        return None
    sig = f"{s['stop_signal']}, " if s.get("stop_signal") else ""
    of = f"step {stop} of {total}" if isinstance(total, int) else f"step {stop}"
    return f"{sig}{of}: unfinished, running it again resumes from that save"


def write(run_dir: Path, summary: dict[str, Any]) -> Path:
    path = Path(run_dir) / SUMMARY
    safeio.write_text(path, json.dumps(summary, indent=1, default=str))  # a FIFO there: refused, never opened
    return path


def render(s: dict[str, Any]) -> str:
    """The printed summary (a few lines whatever the world size)."""
    from lifecycle.obs.render import render as _render

    return _render(s)


def add_goodput(run_dir: Path, summary: dict[str, Any]) -> None:
    """``summary["goodput"]``: the run's goodput over every attempt (lifecycle.obs.goodput); ``{"error": ...}`` where
    its files cannot be read (the render then prints no goodput line)."""
    from lifecycle.errors import LifecycleError
    from lifecycle.obs import goodput

    try:
        g = goodput.account(Path(run_dir))
    except (OSError, ValueError, TypeError, KeyError, LifecycleError) as exc:  # a run directory someone edited
        summary["goodput"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        return
    summary["goodput"] = {**g.to_json(), "line": g.line()}
