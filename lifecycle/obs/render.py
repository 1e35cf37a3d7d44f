"""The printed form of summary.json: a few lines whatever the world size (ranks are folded into ranges)."""

from __future__ import annotations

from typing import Any

from lifecycle.distributed.ranks import fmt_ranks


def _phases(s: dict[str, Any]) -> list[str]:
    lines = []
    for phase, t in s["phases"].items():
        line = (f"  {phase:<11} min {t['min_s']:>8.3f}s  median {t['median_s']:>8.3f}s  max {t['max_s']:>8.3f}s"
                f"  (slowest rank {t['slowest_rank']})")
        if t.get("cut_ranks"):
            line += f"  cut on ranks {fmt_ranks(t['cut_ranks'])}"
        lines.append(line)
    return lines


def _warmup(s: dict[str, Any]) -> list[str]:
    warm = s.get("warmup_per_group") or {}
    if not warm:
        return []
    slow = sorted(warm.items(), key=lambda kv: -kv[1]["max_s"])[:4]
    return ["warmup   " + ", ".join(f"{g} {w['max_s']:.3f}s (rank {w['slowest_rank']})" for g, w in slow)
            + (f" ... {len(warm)} groups" if len(warm) > len(slow) else "")]


def _checkpoints(s: dict[str, Any]) -> list[str]:
    lines = []
    for c in s["checkpoints"]:
        if not c.get("committed"):
            lines.append(f"NOT saved step {c['step']}: {c['path']} (the commit did not complete)")
            continue
        save = f"save {c['save_s']:.3f}s on rank {c['save_slowest_rank']}, " if "save_s" in c else ""
        commit = f"commit {c['commit_s']:.3f}s" if "commit_s" in c else "commit on rank 0 not recorded"
        lines.append(f"saved    step {c['step']}: {c['path']} ({save}{commit})")
    return lines


def _exits(s: dict[str, Any]) -> list[str]:
    by_how: dict[str, list[Any]] = {}
    for r, st in (s.get("exit_status_per_rank") or {}).items():
        by_how.setdefault(st["how"], []).append(r)
    if set(by_how) <= {"exit 0"}:
        return []
    return ["exits    " + "; ".join(f"{how}: ranks {fmt_ranks(rs)}" for how, rs in sorted(by_how.items()))]


def _failures(s: dict[str, Any]) -> list[str]:
    """The drills that fired, and the first rank's error (the launcher's first failure when it recorded one)."""
    lines = [f"drill    {d.get('action')} on rank {d['rank']} in {d['phase']}"
             + (f" step {d['drill_step']}" if d.get("drill_step") is not None else "")
             for d in (s.get("fault_drills") or [])[:3]]
    failures = s.get("failures") or []
    first = [f for f in failures if f["rank"] == s.get("first_failure")] or failures
    if first:
        f = first[0]
        cause = s.get("first_failure")
        after = f" (after rank {cause} failed)" if cause is not None and cause != f["rank"] else ""
        lines.append(f"error    rank {f['rank']} in {f['phase']}{after}: {f.get('error')}: "
                     f"{str(f.get('message'))[:200]}")
    return lines


def render(s: dict[str, Any]) -> str:
    attempt = s.get("attempt") or 1
    lines = [f"run      {s['run_dir']} ({s['ranks']} ranks" + (f", attempt {attempt})" if attempt > 1 else ")")]
    for a in s.get("earlier_attempts") or []:
        stages = a.get("stages") if isinstance(a.get("stages"), dict) else {}
        lines.append(f"earlier  attempt {a['attempt']}: {a.get('outcome') or '?'}"
                     + (f" -> exit {a['exit_code']}" if a.get("exit_code") is not None else "")
                     + (f", resumed from step {a['resumed_from']}" if a.get("resumed_from") is not None else "")
                     + (f", last step {a['last_step']}" if a.get("last_step") is not None else "")
                     + (f"; next attempt's first step {a['restart_s']:.1f}s after the failure"
                        if a.get("restart_s") is not None else "")
                     + (" (" + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.2f}s" for k, v in stages.items()
                                         if isinstance(v, int | float)) + ")" if stages else ""))
    if "outcome" in s:
        lines.append(f"outcome  {s['outcome']} -> exit {s['exit_code']} in {s['wall_s']}s")
    g = s.get("goodput")
    if isinstance(g, dict) and g.get("line") and g.get("goodput") is not None:
        lines.append(f"goodput  {g['line']}")
    b = s.get("blame")
    if b and b.get("source") != "launcher" and b.get("ranks"):
        lines.append(f"blame    ranks {fmt_ranks(b['ranks'])} ({b['cause']} in phase {b['phase']}, from {b['source']})")
    lines += _phases(s) + _warmup(s)
    if s["loss"]:
        loss = s["loss"]
        lines.append(f"loss     {loss['first']:.4f} -> {loss['last']:.4f} over {loss['steps']} steps")
    if s.get("resumed_from") is not None:
        lines.append(f"resumed  from step {s['resumed_from']}")
    if s.get("stop_step") is not None:
        left = s.get("unfinished")
        lines.append(f"stopped  preempted at step {s['stop_step']}, saved" + (f" ({left})" if left else ""))
    lines += _checkpoints(s)
    if s["zero_token_events"]:
        zt = s["zero_token_events"]
        lines.append(f"zero-token events: {sum(zt.values())} on ranks {fmt_ranks(zt)}")
    for phase, d in (s.get("deadlines") or {}).items():
        lines.append(f"deadline {phase}: {d.get('how')}")
    for st in s.get("stragglers") or []:
        lines.append(f"straggler {st.get('line')}" + (f" (at step {st['at_step']})" if st.get("at_step") else ""))
    lines += _failures(s)
    if s.get("hang_reports"):
        h = s["hang_reports"][0]
        culprits = f" culprits {fmt_ranks(h['culprits'])}" if h.get("culprits") else ""
        lines.append(f"hang     reported by {len(s['hang_reports'])} rank(s): {h.get('cause')}{culprits}"
                     + (f"; see {s['hang_report_file']}" if s.get("hang_report_file") else ""))
    return "\n".join(lines + _exits(s))
