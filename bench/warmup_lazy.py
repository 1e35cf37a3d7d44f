"""What warmup buys: first-collective cost on lazily connected gloo groups, with and without warmup.

    OMP_NUM_THREADS=1 .venv/bin/python bench/warmup_lazy.py

World 4 on gloo with TORCH_GLOO_LAZY_INIT=1 (the CPU analogue of NCCL's lazy communicators) and a
Megatron layout tp2 ep2 etp1. "cold": the first all_reduce on each group after init pays the connection
set-up; "warm": lifecycle's warmup (barrier + all_reduce on every group) ran first, then the same two
all_reduces are timed. Reported: median over groups and ranks of first/second all_reduce time.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests._dist import init_gloo, run_ranks  # noqa: E402


def _rank(rank: int, world: int, warm: bool) -> dict[str, tuple[float, float]]:
    import torch
    import torch.distributed as dist

    from lifecycle.backends.megatron import parallel
    from lifecycle.distributed import collectives, groups

    init_gloo(rank, world)
    parallel.initialize(tp=2, ep=2, etp=1)
    resolved = groups.resolve(parallel.MegatronParallel(), "all")
    if warm:
        for g in resolved:
            for op in ("barrier", "all_reduce"):
                collectives.OPS[op](g.pg, g.ranks, 60, group_name=g.label)
    out = {}
    for g in resolved:
        times = []
        for _ in range(2):
            t = torch.ones(1)
            t0 = time.perf_counter()
            dist.all_reduce(t, group=g.pg)
            times.append(time.perf_counter() - t0)
        out[g.label] = (times[0], times[1])
    parallel.destroy()
    return out


def main() -> None:
    env = {"TORCH_GLOO_LAZY_INIT": "1"}
    rows = []
    for warm in (False, True):
        results = run_ranks(_rank, 4, 300, warm, env=env)
        firsts = [v[0] for r in results for v in r.values()]
        ratios = [v[0] / v[1] for r in results for v in r.values()]
        seconds = [v[1] for r in results for v in r.values()]
        per_rank = [sum(v[0] for v in r.values()) for r in results]
        per_rank_2nd = [sum(v[1] for v in r.values()) for r in results]
        rows.append((warm, len(results[0]), statistics.median(firsts) * 1e3, max(firsts) * 1e3,
                     statistics.median(seconds) * 1e3, statistics.median(ratios),
                     max(per_rank) * 1e3, max(per_rank_2nd) * 1e3))
    print("| mode | groups/rank | 1st all_reduce median / max (ms) | 2nd median (ms) | 1st/2nd median | "
          "sum over groups 1st / 2nd, slowest rank (ms) |")
    print("|---|---|---|---|---|---|")
    for warm, n, first_ms, first_max, second_ms, ratio, sum1, sum2 in rows:
        print(f"| {'after warmup' if warm else 'no warmup (cold)'} | {n} | {first_ms:.3f} / {first_max:.3f} | "
              f"{second_ms:.3f} | {ratio:.1f}x | {sum1:.1f} / {sum2:.1f} = {sum1 / sum2:.1f}x |")


if __name__ == "__main__":
    main()
