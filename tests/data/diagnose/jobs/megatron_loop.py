"""A plain megatron-core loop (no lifecycle) with one injected fault, run under torchrun on gloo.

``parallel_state.initialize_model_parallel`` builds Megatron's groups (their ``group_desc`` names the dimension:
TENSOR_MODEL_PARALLEL_GROUP, DATA_PARALLEL_GROUP, ...); each step all-reduces on the tensor-parallel group, then the
data-parallel group, then the loss on the default group. The fault and the Flight Recorder dumps come from the
environment as in plain_loop.py (FAULT: stall_before, stall_inside, raise, skip).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

FAULT = os.environ.get("FAULT", "none")
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
FAULT_STEP = int(os.environ.get("FAULT_STEP", "2"))
STEPS = int(os.environ.get("STEPS", "4"))
TP = int(os.environ.get("TP", "2"))
TIMEOUT_S = float(os.environ.get("COLL_TIMEOUT_S", "4"))
RANK = int(os.environ["RANK"])


def dump_fr(reason: str) -> None:
    folder = os.environ.get("FR_DIR")
    if not folder:
        return
    import torch._C._distributed_c10d as c10d

    path = os.path.join(folder, f"fr_trace_rank_{RANK}")
    with open(path, "wb") as f:
        f.write(c10d._dump_fr_trace())
    print(f"flight recorder dump ({reason}) -> {path}", file=sys.stderr, flush=True)


def on_term(signum: int, frame: object) -> None:
    dump_fr("SIGTERM")
    os._exit(143)


def faulty(kind: str, step: int) -> bool:
    return FAULT == kind and RANK == FAULT_RANK and step == FAULT_STEP


def step_once(step: int) -> None:
    from megatron.core import parallel_state as mpu

    if faulty("stall_before", step):
        time.sleep(600)
    if faulty("raise", step):
        raise RuntimeError(f"expert router produced NaN at iteration {step} (injected)")
    grad = torch.ones(32)
    dist.all_reduce(grad, group=mpu.get_tensor_model_parallel_group())
    if faulty("stall_inside", step):
        time.sleep(600)
    if not faulty("skip", step):
        dist.all_reduce(grad, group=mpu.get_data_parallel_group())
    loss = torch.tensor([1.0 / step])
    dist.all_reduce(loss)
    print(f" iteration {step:8d}/{STEPS:8d} | lm loss: {loss.item():.6E}", flush=True)


def main() -> None:
    signal.signal(signal.SIGTERM, on_term)
    from megatron.core import parallel_state as mpu

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    mpu.initialize_model_parallel(tensor_model_parallel_size=TP, distributed_timeout_minutes=TIMEOUT_S / 60)
    try:
        for step in range(1, STEPS + 1):
            step_once(step)
        dist.barrier()
    except BaseException as exc:
        dump_fr(type(exc).__name__)
        raise
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
