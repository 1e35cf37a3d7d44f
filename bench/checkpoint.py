"""Checkpoint cost: policy-driven save vs megatron-core's own `dist_checkpointing.save`, and async blocking time.

    OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint.py [--reps 3]

World 4 on gloo (ep=2), a megatron-core GPT-MoE of about 18 M parameters (4 layers, hidden 256, 8 experts,
Adam state included), after one training step. In the same run, in rotating order, each repetition times
(max over ranks, after a barrier):
- raw: `dist_checkpointing.save(sharded_state, dir)` as megatron-core ships it (torch_dist, sync; its own
  default-group barrier at the end) — the baseline;
- policy: lifecycle's checkpoint phase (`checkpoint.async=false`): plan + write to iter_N.tmp, agree over the
  TCPStore, finalize on rank 0, rename, tracker, prune;
- async blocking: the same with `checkpoint.async=true`: time until training may continue (the commit is
  done afterwards and not counted).
Goals (issue 4): policy/raw <= 1.05; async blocking / sync policy save <= 0.20.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests._dist import init_gloo, run_ranks  # noqa: E402

SPEC = {"num_layers": 4, "hidden": 256, "ffn_hidden": 1024, "heads": 8, "num_experts": 8, "topk": 2}


def _ctx(rank: int, world: int, root: Path, async_: bool, handler: object) -> object:
    from lifecycle.backends.megatron.parallel import MegatronParallel
    from lifecycle.context import RunContext
    from lifecycle.distributed.barrier import get_store
    from lifecycle.distributed.faults import Drills
    from lifecycle.obs.events import EventLog
    from lifecycle.policy.load import validate

    policy = validate({"checkpoint": {"dir": str(root / ("async" if async_ else "sync")), "async": async_,
                                      "keep_last": 0}, "parallelism": {"ep": 2}, "train": {"options": SPEC}})
    ctx = RunContext.of(policy, root / "run", rank, world, rank, EventLog(root / "run", rank), Drills([], rank),
                        MegatronParallel())
    ctx.comms.store = get_store()
    ctx.step_handler = handler
    return ctx


def _timed(fn: object) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def _rank(rank: int, world: int, root: str, reps: int) -> dict[str, list[float]]:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from lifecycle.backends.megatron import checkpoint, parallel
    from lifecycle.backends.megatron.model import synthetic_batch, train_step
    from lifecycle.backends.megatron.step import MegatronGPTStep
    from lifecycle.phases import checkpoint as phase
    from lifecycle.policy.options import MegatronGPTOptions

    init_gloo(rank, world, timeout_s=300)
    parallel.initialize(ep=2)
    base = Path(root)
    handler = MegatronGPTStep(MegatronGPTOptions(**SPEC))
    sync_ctx = _ctx(rank, world, base, False, handler)
    async_ctx = _ctx(rank, world, base, True, handler)
    handler.setup(sync_ctx)  # type: ignore[arg-type]
    train_step(handler.state, synthetic_batch(handler.state.spec, 1, parallel.get_group("dp").rank()))
    out: dict[str, list[float]] = {"raw": [], "policy": [], "async_blocking": []}
    for i in range(reps):
        raw_dir = base / f"raw_{i}"
        raw_dir.mkdir(parents=True, exist_ok=True)
        sync_ctx.progress.step = async_ctx.progress.step = i + 1  # type: ignore[attr-defined]

        def raw(d: Path = raw_dir) -> None:
            dist_checkpointing.save(checkpoint.sharded_state(handler.state), str(d))

        def policy() -> None:
            phase.save(sync_ctx, "bench")  # type: ignore[arg-type]

        def async_blocking() -> None:
            phase.save(async_ctx, "bench")  # type: ignore[arg-type]

        cases = [("raw", raw), ("policy", policy), ("async_blocking", async_blocking)]
        for name, fn in cases[i % 3:] + cases[:i % 3]:  # rotate: no save always follows the same one
            out[name].append(_timed(fn))
            if name == "async_blocking":
                phase.finish_pending(async_ctx)  # type: ignore[arg-type]
        dist.barrier()
        if rank == 0:
            shutil.rmtree(raw_dir, ignore_errors=True)
    parallel.destroy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # Not daemonic: megatron-core's own writer starts a multiprocessing Manager.
        results = run_ranks(_rank, 4, 900, tmp, args.reps, daemon=False)
    worst = {k: [max(r[k][i] for r in results) for i in range(args.reps)] for k in results[0]}
    med = {k: statistics.median(v) for k, v in worst.items()}
    print(f"| save (world 4, ~18M params + Adam, {args.reps} reps, max over ranks) | median (s) | all (s) |")
    print("|---|---|---|")
    names = {"raw": "baseline: megatron-core dist_checkpointing.save",
             "policy": "lifecycle checkpoint phase, sync (two-phase commit)",
             "async_blocking": "lifecycle checkpoint phase, async: blocking part"}
    for k, v in worst.items():
        print(f"| {names[k]} | {med[k]:.3f} | {', '.join(f'{x:.3f}' for x in v)} |")
    print(f"\npolicy / raw = {med['policy'] / med['raw']:.3f} (goal <= 1.05)")
    print(f"async blocking / sync policy save = {med['async_blocking'] / med['policy']:.3f} (goal <= 0.20)")


if __name__ == "__main__":
    main()
