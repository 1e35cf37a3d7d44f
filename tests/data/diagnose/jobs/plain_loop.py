"""A plain torch.distributed training loop (no lifecycle) with one injected fault, run under torchrun on gloo.

It stands for a foreign job: tensor-parallel pairs (``group_desc`` "tp"), data-parallel groups ("dp"), a loss
all-reduce on the default group, a torch.distributed.checkpoint save at ``CKPT_STEP``. The fault comes from the
environment (``FAULT``, ``FAULT_RANK``, ``FAULT_STEP``); ``FR_DIR`` makes every rank write its Flight Recorder dump
(``TORCH_FR_BUFFER_SIZE`` enables the recorder, which records gloo collectives since torch 2.9) when it fails or
is terminated, as a job author would have to on gloo (torch dumps by itself only on NCCL).

Faults: stall_before (sleeps before the step's first collective), stall_inside (after the tp all-reduce),
kill (SIGKILL itself), raise, skip (skips the dp all-reduce: a divergence), other_group_first (the loss
all-reduce on the default group before the tp one),
no_rendezvous (sleeps before init_process_group), stall_save (sleeps inside the checkpoint's write), exit
(``sys.exit(7)``: no traceback), stall_pipe (the faulty rank of stage 1 sleeps before its receive). ``PIPE=1`` makes
two pipeline stages (ranks [0, W/2) and [W/2, W)): each step a stage-0 rank sends its activation to its stage-1
counterpart and receives the gradient back (blocking send/recv on the default group). ``DUMP_ON_TERM=0`` keeps the
SIGTERM handler from dumping (most real jobs dump, if at all, only in their exception handler).
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
CKPT_STEP = int(os.environ.get("CKPT_STEP", "3"))
PIPE = os.environ.get("PIPE") == "1"
DUMP_ON_TERM = os.environ.get("DUMP_ON_TERM", "1") == "1"
TIMEOUT_S = float(os.environ.get("COLL_TIMEOUT_S", "4"))
RANK = int(os.environ["RANK"])


def dump_fr(reason: str) -> None:
    folder = os.environ.get("FR_DIR")
    if not folder:
        return
    import torch._C._distributed_c10d as c10d

    as_json = os.environ.get("FR_JSON") == "1"
    data = c10d._dump_fr_trace_json() if as_json else c10d._dump_fr_trace()
    path = os.path.join(folder, f"fr_trace_rank_{RANK}" + (".json" if as_json else ""))
    with open(path, "wb") as f:
        f.write(data)
    print(f"flight recorder dump ({reason}) -> {path}", file=sys.stderr, flush=True)


def on_term(signum: int, frame: object) -> None:
    if DUMP_ON_TERM:
        dump_fr("SIGTERM")
    os._exit(143)


def faulty(kind: str, step: int) -> bool:
    return FAULT == kind and RANK == FAULT_RANK and step == FAULT_STEP


def stall(step: int) -> None:
    print(f"step {step}: stalling (injected)", flush=True)
    time.sleep(600)


def timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=TIMEOUT_S)


def groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    world = dist.get_world_size()
    tp = dp = None
    for k in range(world // TP):
        g = dist.new_group(list(range(k * TP, (k + 1) * TP)), timeout=timeout(), group_desc="tp")
        tp = g if RANK // TP == k else tp
    for k in range(TP):
        g = dist.new_group(list(range(k, world, TP)), timeout=timeout(), group_desc="dp")
        dp = g if RANK % TP == k else dp
    assert tp is not None and dp is not None
    return tp, dp


class SlowWriter:
    """A FileSystemWriter whose write stalls on the faulty rank: a stall inside the checkpoint save."""

    @staticmethod
    def make(path: str):  # noqa: ANN205 - torch types
        from torch.distributed.checkpoint import FileSystemWriter

        class Writer(FileSystemWriter):
            def write_data(self, plan, planner):  # noqa: ANN001, ANN202
                if FAULT == "stall_save" and RANK == FAULT_RANK:
                    stall(CKPT_STEP)
                return super().write_data(plan, planner)

        return Writer(path)


def save(step: int, weights: torch.Tensor) -> None:
    import torch.distributed.checkpoint as dcp

    folder = os.path.join(os.environ.get("CKPT_DIR", "/tmp/plain_loop_ckpt"), f"step_{step}")
    print(f"step {step}: saving checkpoint to {folder}", flush=True)
    dcp.save({"w": weights}, storage_writer=SlowWriter.make(folder))


def step_once(step: int, tp: dist.ProcessGroup, dp: dist.ProcessGroup, w: torch.Tensor) -> None:
    if faulty("stall_before", step):
        stall(step)
    if faulty("raise", step):
        raise ValueError(f"bad batch at step {step} (injected)")
    if faulty("kill", step):
        os.kill(os.getpid(), signal.SIGKILL)
    if faulty("exit", step):
        print(f"step {step}: exiting with 7 (injected)", flush=True)
        sys.exit(7)
    grad = torch.ones(16) * (RANK + 1)
    loss = torch.tensor([float(step)])
    if faulty("other_group_first", step):  # the loss all-reduce on the default group before the tp one
        dist.all_reduce(loss)
    dist.all_reduce(grad, group=tp)
    if faulty("stall_inside", step):
        stall(step)
    if PIPE:
        pipe(step, grad)
    if not faulty("skip", step):
        dist.all_reduce(grad, group=dp)
    if not faulty("other_group_first", step):
        dist.all_reduce(loss)
    w += grad * 1e-3
    print(f"step {step}: loss {loss.item():.1f}", flush=True)


def pipe(step: int, grad: torch.Tensor) -> None:
    """Stage 0 sends its activation to its stage-1 counterpart and receives the gradient back."""
    half = dist.get_world_size() // 2
    act = torch.ones(8) * step
    if RANK < half:
        dist.send(act, RANK + half)
        dist.recv(act, RANK + half)
    else:
        if faulty("stall_pipe", step):
            stall(step)
        dist.recv(act, RANK - half)
        dist.send(act, RANK - half)


def main() -> None:
    signal.signal(signal.SIGTERM, on_term)
    if FAULT == "no_rendezvous" and RANK == FAULT_RANK:
        stall(0)
    dist.init_process_group("gloo", timeout=timeout())
    tp, dp = groups()
    w = torch.zeros(16)
    try:
        for step in range(1, STEPS + 1):
            step_once(step, tp, dp, w)
            if step == CKPT_STEP:
                save(step, w)
        dist.barrier()
    except BaseException as exc:
        dump_fr(type(exc).__name__)
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
