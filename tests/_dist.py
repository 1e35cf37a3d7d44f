"""Run a function on N real gloo ranks, each in its own process, with a hard deadline.

``run_ranks(fn, world_size, timeout_s, *args)`` starts ``world_size`` processes, sets up the
env:// rendezvous (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK), calls ``fn(rank, world_size,
*args)`` in each and returns the list of return values in rank order. The function must be defined at
module level (spawn pickles it by reference) and must init/destroy the process group itself (or use
``init_gloo``). Any exception, non-zero exit or missed deadline fails the caller, and every child is
killed: a hanging test is a failing test.

The processes are forked from one forkserver that imported torch and megatron-core once per test session (as
``lifecycle run`` forks its ranks from a preload process): a rank starts in a fraction of a second instead of
paying ~4 s of imports. Each child takes the caller's environment as of the call, as a spawned one would. On a
machine with an NVIDIA driver, or with ``LIFECYCLE_TEST_SPAWN=1``, they are spawned as before.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_gloo(rank: int, world_size: int, timeout_s: float = 30.0) -> None:
    """Init the default group on gloo from the env set by ``run_ranks``."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )


def shared_store(prefix: str) -> Any:
    """A store every rank of ``run_ranks`` shares, under ``prefix``: the default group's own TCPStore, whose port was
    bound when the group came up. (A port picked before the ranks start and bound only after megatron's groups were
    made can be taken by then: each gloo group opens connections on ephemeral ports.)"""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return dist.PrefixStore(prefix, c10d._get_default_store())


PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
           "megatron.core.models.gpt", "tests._dist"]
"""What the forkserver imports once (each forked rank then has it)."""


def _context() -> Any:
    """The multiprocessing context the ranks start from: the forkserver with :data:`PRELOAD`, or spawn."""
    if os.environ.get("LIFECYCLE_TEST_SPAWN") == "1" or os.path.exists("/proc/driver/nvidia/version"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # used when the server starts (once per session)
    return ctx


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, env: dict[str, str],
           out: Any, args: tuple[Any, ...], parent_env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(parent_env)  # the caller's environment now, not the forkserver's from when it started
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    try:
        import torch

        torch.set_num_threads(1)
        result = fn(rank, world_size, *args)
        out.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, traceback.format_exc()))
        # put() hands the item to a feeder thread; flush it, or os._exit drops the traceback.
        out.close()
        out.join_thread()
        os._exit(1)
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


class RanksFailed(AssertionError):
    """A rank raised, died or missed the deadline. ``results`` has what the others returned."""

    def __init__(self, message: str, results: dict[int, Any]) -> None:
        super().__init__(message)
        self.results = results


def run_ranks(fn: Callable[..., Any], world_size: int, timeout_s: float, *args: Any,
              env: dict[str, str] | None = None, daemon: bool = True) -> list[Any]:
    ctx = _context()
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, env or {}, out, args, dict(os.environ)),
                    daemon=daemon)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise RanksFailed(f"ranks {missing} missed the {timeout_s}s deadline; "
                                  f"errors: {errors}", results)
            try:
                rank, ok, value = out.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in results]
                if dead and not errors:
                    # Give a dying rank a moment to report its traceback.
                    try:
                        rank, ok, value = out.get(timeout=2.0)
                    except queue.Empty:
                        raise RanksFailed(f"ranks {dead} died without a result", results) from None
                else:
                    continue
            if ok:
                results[rank] = value
            else:
                errors.append(f"[rank {rank}]\n{value}")
                # The peers of a failed rank may wait in a collective: do not wait out the deadline.
                deadline = min(deadline, time.monotonic() + 10.0)
        if errors:
            raise RanksFailed("\n".join(errors), results)
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
