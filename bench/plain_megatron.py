"""The usual Megatron setup, without lifecycle: contender (c) of bench/goodput.py.

Run by ``torchrun --max-restarts R --nproc-per-node 4 bench/plain_megatron.py ...``. The same megatron-core model,
optimizer and data stream as lifecycle's default job (built by the same code, lifecycle.backends.megatron.model, so
the contenders train the same thing) on a plain ``torch.distributed`` gloo group with Megatron's default
``distributed_timeout_minutes`` (10); ``dist_checkpointing.save`` (synchronous, Megatron's default) every K steps into
``iter_NNNNNNN`` with Megatron-LM's tracker file written by rank 0 after a barrier; each start resumes from the
tracker's checkpoint. None of lifecycle's machinery runs: no warmup, no watchdog, no commit protocol, no restarts of
its own (torchrun restarts the workers; a scheduler's requeue is the bench relaunching torchrun).

Rank 0 appends one JSON line per step (attempt, step, start, end, loss) to ``--progress``; every rank writes its pid
to ``<progress>.pid.<rank>`` so the bench can kill or freeze it. ``--raise a:s:r,...`` raises a RuntimeError on rank r
at step s of attempt a (the attempt: ``BENCH_ATTEMPT_BASE`` + torchrun's restart count + 1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--raise", dest="raises", default="")
    a = p.parse_args()
    timeout = datetime.timedelta(minutes=10)  # Megatron's distributed_timeout_minutes default
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # Each restart's group under its own prefix of torchrun's store: with plain env:// the restarted workers read the
    # dead round's gloo addresses from the same keys and every restart fails ("Gloo connectFullMesh failed ...
    # Connection refused"), measured here with torch 2.13 and --standalone.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"bench/attempt_{restart}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    rank = dist.get_rank()
    attempt = int(os.environ.get("BENCH_ATTEMPT_BASE", "0")) + restart + 1
    Path(f"{a.progress}.pid.{rank}").write_text(str(os.getpid()))
    raises = {(int(x), int(y), int(z)) for x, y, z in (t.split(":") for t in a.raises.split(",") if t)}

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from lifecycle.backends.megatron import checkpoint
    from lifecycle.backends.megatron.cpu_compat import apply_cpu_compat
    from lifecycle.backends.megatron.model import build, step_batches, train_step
    from lifecycle.backends.megatron.state import ModelSpec
    from lifecycle.policy.options import MegatronGPTOptions

    apply_cpu_compat()  # megatron-core on a CPU (what any CPU run of it needs; see DESIGN)
    ps.initialize_model_parallel(expert_model_parallel_size=2, distributed_timeout_minutes=10)
    options = MegatronGPTOptions(num_layers=2, hidden=64, num_experts=4, topk=2, dispatcher="alltoall")
    state = build(ModelSpec(options, seed=1234))
    root = Path(a.ckpt)
    tracker = root / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        it = int(tracker.read_text().strip())
        checkpoint.load(state, str(root / f"iter_{it:07d}"))
    dp_rank = ps.get_data_parallel_rank()
    out = open(a.progress, "a", buffering=1) if rank == 0 else None  # noqa: SIM115 - the process's lifetime
    for step in range(state.step + 1, a.steps + 1):
        if (attempt, step, rank) in raises:
            raise RuntimeError(f"bench: raise on rank {rank} at step {step} of attempt {attempt}")
        t0 = time.time()
        loss = train_step(state, step_batches(state.spec, step, dp_rank))
        state.step = step
        if out is not None:
            out.write(json.dumps({"a": attempt, "step": step, "t0": t0, "t1": time.time(), "loss": loss}) + "\n")
        if step % a.save_every == 0 or step == a.steps:
            folder = root / f"iter_{step:07d}"
            if rank == 0:  # a save of this step torn by an earlier attempt: megatron refuses a non-empty folder
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
            dist.barrier()
            dist_checkpointing.save(checkpoint.sharded_state(state), str(folder))
            dist.barrier()
            if rank == 0:
                tmp = tracker.with_suffix(".tmp")
                tmp.write_text(str(step))
                os.replace(tmp, tracker)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
