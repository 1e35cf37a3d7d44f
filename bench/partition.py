"""Multi-node partition: time from the fault to the last rank's exit on each side, against the bound.

    sudo OMP_NUM_THREADS=1 .venv/bin/python bench/partition.py [--reps 3]

Two nodes (network namespaces + veth), `torchrun --nnodes 2 --nproc-per-node 2` on each, the synthetic kind
with `watchdog.deadlines.step=5` and `heartbeat_stale_s=5` (tests/multinode/cluster.py). Faults, each after the
first committed checkpoint: the link cut (`ip link set ... down` on node B) and the store's host killed
(SIGKILL to torchrun's agent on node A). The bound every rank must meet: step deadline + heartbeat_stale_s +
10 s = 20 s. Needs root.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.multinode.cluster import TwoNodes, why_not_available  # noqa: E402

BOUND_S = 5.0 + 5.0 + 10.0


def one(fault: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp, TwoNodes(Path(tmp)) as c:
        c.start("train.steps=400")
        if not c.wait_for(Path(tmp) / "ckpt" / "latest", 120):
            raise RuntimeError("no checkpoint committed:\n" + c.nodes[0].output()[-2000:])
        time.sleep(1.0)
        t = c.cut() if fault == "cut" else c.kill_agent(c.nodes[0])
        gone = c.wait_ranks_gone(BOUND_S + 40)
        return {("A" if n.index == 0 else "B"): (gone[n.name] - t) if gone[n.name] else float("inf")
                for n in c.nodes}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    why = why_not_available()
    if why:
        sys.exit(f"bench/partition.py: {why}")
    print(f"bound: every rank gone within {BOUND_S:g}s of the fault")
    print(f"{'fault':<12} {'rep':>3} {'node A (s)':>11} {'node B (s)':>11}")
    for fault in ("cut", "store-kill"):
        worst = []
        for rep in range(args.reps):
            got = one(fault)
            worst.append(max(got.values()))
            print(f"{fault:<12} {rep:>3} {got['A']:>11.1f} {got['B']:>11.1f}", flush=True)
        print(f"{fault:<12} max {max(worst):.1f}s, median {statistics.median(worst):.1f}s "
              f"({'within' if max(worst) <= BOUND_S else 'OVER'} the {BOUND_S:g}s bound)", flush=True)


if __name__ == "__main__":
    main()
