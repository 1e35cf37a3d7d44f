"""summary.json and the printed summary at the end of `lifecycle run`, built from the per-rank events."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from lifecycle.obs.events import read_events

PHASES = ("init", "warmup", "train", "checkpoint", "teardown")


def _phase_times(events: dict[int, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    per_phase: dict[str, dict[int, float]] = {}
    for rank, evs in events.items():
        for e in evs:
            if e.get("kind") == "end" and str(e.get("name", "")).startswith("phase:"):
                phase = e["name"].split(":", 1)[1]
                per_phase.setdefault(phase, {})
                per_phase[phase][rank] = per_phase[phase].get(rank, 0.0) + e.get("dur_us", 0) / 1e6
    out = {}
    for phase in PHASES:
        times = per_phase.get(phase)
        if not times:
            continue
        slowest = max(times, key=lambda r: times[r])
        out[phase] = {"min_s": round(min(times.values()), 4), "median_s": round(statistics.median(times.values()), 4),
                      "max_s": round(max(times.values()), 4), "slowest_rank": slowest}
    return out


def _last(evs: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for e in reversed(evs):
        if e.get("name") == name:
            return e
    return None


def build(run_dir: Path, launch: Any | None = None) -> dict[str, Any]:
    """Aggregate a run directory's events into the summary (a failed run gets one too)."""
    events = read_events(run_dir)
    exits = {r: _last(evs, "exit") for r, evs in events.items()}
    rank0 = events.get(0, [])
    losses = [e["loss"] for e in rank0 if e.get("name") == "step" and e.get("kind") == "end" and "loss" in e]
    warm: dict[str, float] = {}
    for e in rank0:
        if e.get("kind") == "end" and str(e.get("name", "")).startswith("warm:"):
            warm[e.get("group", "?")] = round(warm.get(e.get("group", "?"), 0.0) + e.get("dur_us", 0) / 1e6, 4)
    ckpts = [{"step": e.get("step"), "path": e.get("path"), "commit_s": round(e.get("dur_us", 0) / 1e6, 4),
              "write_s": e.get("write_s")}
             for e in rank0 if e.get("name") == "commit" and e.get("kind") == "end"]
    zero = {r: sum(e.get("count", 0) for e in evs if e.get("name") == "zero_token") for r, evs in events.items()}
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "ranks": len(events),
        "phases": _phase_times(events),
        "warmup_s_per_group": warm,
        "loss": {"first": losses[0], "last": losses[-1], "steps": len(losses)} if losses else None,
        "checkpoints": ckpts,
        "zero_token_events": {r: n for r, n in zero.items() if n},
        "exit_code_per_rank": {r: (e or {}).get("exit_code") for r, e in exits.items()},
        "resumed_from": (exits.get(0) or {}).get("resumed_from"),
        "stop_step": (exits.get(0) or {}).get("stop_step"),
    }
    if launch is not None:
        summary.update(exit_code=launch.exit_code, outcome=launch.describe(), wall_s=round(launch.wall_s, 2),
                       first_failure=launch.first_failure, failed_phase=launch.phase)
    return summary


def write(run_dir: Path, summary: dict[str, Any]) -> Path:
    path = run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=1, default=str))
    return path


def render(s: dict[str, Any]) -> str:
    lines = [f"run      {s['run_dir']} ({s['ranks']} ranks)"]
    if "outcome" in s:
        lines.append(f"outcome  {s['outcome']} -> exit {s['exit_code']} in {s['wall_s']}s")
    for phase, t in s["phases"].items():
        lines.append(f"  {phase:<11} min {t['min_s']:>8.3f}s  median {t['median_s']:>8.3f}s  max {t['max_s']:>8.3f}s"
                     f"  (slowest rank {t['slowest_rank']})")
    if s["loss"]:
        loss = s["loss"]
        lines.append(f"loss     {loss['first']:.4f} -> {loss['last']:.4f} over {loss['steps']} steps")
    if s.get("resumed_from") is not None:
        lines.append(f"resumed  from step {s['resumed_from']}")
    if s.get("stop_step") is not None:
        lines.append(f"stopped  preempted at step {s['stop_step']}, saved")
    for c in s["checkpoints"]:
        lines.append(f"saved    step {c['step']}: {c['path']} (commit {c['commit_s']}s)")
    if s["zero_token_events"]:
        lines.append(f"zero-token events per rank: {s['zero_token_events']}")
    return "\n".join(lines)
