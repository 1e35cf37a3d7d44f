"""Peak memory and time of `lifecycle timeline` on a run of 10^6 events: the streaming command against the
in-memory build (``timeline.load`` + ``build_trace`` + ``write_trace``, what the command did before), both measured
in this run, each in a fresh process (peak RSS from ``getrusage``).

    python bench/timeline_memory.py [--events 1000000] [--ranks 4]

The events are what a long job writes: per step a ``step`` span with its loss and compute time, a gradient
all-reduce span inside it, and every 50 steps a scalar; phases around them, a commit every 500 steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = {
    "in-memory": """
from pathlib import Path
from lifecycle.obs import gantt, timeline
run = Path(RUN)
events = timeline.load(run)
timeline.write_trace(timeline.build_trace(events), run / "mem.json")
if PNG:
    gantt.plot(events, run / "mem.png")
""",
    "streaming": """
from lifecycle.obs import timeline
timeline.main(RUN, out=RUN + "/stream.json", png=RUN + "/stream.png", no_png=not PNG)
""",
}


def _write_run(run: Path, n_events: int, ranks: int) -> None:
    per_rank = n_events // ranks
    (run / "events").mkdir(parents=True)
    for rank in range(ranks):
        t = 1_700_000_000_000_000
        base = {"rank": rank, "local_rank": rank, "host": "node0", "phase": "train"}
        lines = [json.dumps({**base, "t": t, "kind": "instant", "name": "attempt", "attempt": 1}),
                 json.dumps({**base, "t": t, "kind": "begin", "name": "phase:train"})]
        step = 0
        while len(lines) < per_rank - 1:
            step += 1
            t += 1000
            lines.append(json.dumps({**base, "t": t, "kind": "begin", "name": "step", "step": step}))
            lines.append(json.dumps({**base, "t": t + 100, "kind": "begin", "name": "ddp:all_reduce",
                                     "group": "dp", "bytes": 1 << 20}))
            lines.append(json.dumps({**base, "t": t + 600, "kind": "end", "name": "ddp:all_reduce", "group": "dp",
                                     "dur_us": 500}))
            lines.append(json.dumps({**base, "t": t + 900, "kind": "end", "name": "step", "step": step,
                                     "loss": 1.0 / step, "compute_s": 0.0009, "dur_us": 900}))
            if step % 50 == 0:
                lines.append(json.dumps({**base, "t": t + 950, "kind": "scalar", "name": "mem_gib", "value": 1.5}))
            if step % 500 == 0:
                lines.append(json.dumps({**base, "t": t + 960, "kind": "begin", "name": "commit", "step": step}))
                lines.append(json.dumps({**base, "t": t + 990, "kind": "end", "name": "commit", "step": step,
                                         "dur_us": 30}))
        lines.append(json.dumps({**base, "t": t + 2000, "kind": "end", "name": "phase:train", "dur_us": 1}))
        (run / "events" / f"rank_{rank}.jsonl").write_text("\n".join(lines) + "\n")


def _measure(name: str, run: Path, png: bool) -> dict[str, float]:
    code = _CHILD[name].replace("RUN", repr(str(run))).replace("PNG", repr(png))
    probe = code + "\nimport resource, sys\nprint('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    wall = time.perf_counter() - t0
    rss_kib = int(next(line for line in out.stdout.splitlines() if line.startswith("MAXRSS")).split()[1])
    return {"peak_mb": rss_kib / 1024, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--png", action="store_true", help="draw the Gantt chart too (needs matplotlib)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        _write_run(run, args.events, args.ranks)
        size = sum(p.stat().st_size for p in (run / "events").iterdir())
        print(f"{args.events} events over {args.ranks} ranks, {size / 2**20:.0f} MiB of event files, png={args.png}")
        res = {name: _measure(name, run, args.png) for name in ("in-memory", "streaming")}
        base, new = res["in-memory"], res["streaming"]
        for name, r in res.items():
            print(f"{name:10s} peak {r['peak_mb']:7.0f} MB   wall {r['wall_s']:6.1f} s")
        print(f"streaming / in-memory: peak memory {new['peak_mb'] / base['peak_mb']:.3f}, "
              f"time {new['wall_s'] / base['wall_s']:.3f}")


if __name__ == "__main__":
    main()
