"""Warmup collectives: tiny real operations that make a communicator connect, each with a deadline.

Every op has the signature ``op(pg, ranks, timeout_s, *, group_name) -> seconds`` and **all ranks of
``pg`` must call it** (the same op, in the same order) or it times out. Each is issued with
``async_op=True`` and waited on with ``work.wait(timeout=...)``, a real deadline on gloo and NCCL: a
late, hung or absent peer becomes a HangError naming the op, the group and the deadline instead of a
silent hang. The payloads are checked (an all-reduce of ones sums to the group size, ...), so a
mismatched group shows up as a PhaseError.

After a timeout the communicator is unusable (the timed-out work stays queued on gloo, NCCL aborts):
the caller should fail the run, not retry on the same group.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from lifecycle.errors import HangError, PhaseError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Work

logger = logging.getLogger(__name__)


class WarmupOp(Protocol):
    def __call__(self, pg: ProcessGroup, ranks: list[int], timeout_s: float, *, group_name: str) -> float: ...


def _device(pg: ProcessGroup) -> torch.device:
    # NCCL communicators only take tensors on the current GPU; everything else here runs on CPU.
    if "nccl" in str(dist.get_backend(pg)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _member(ranks: list[int], op: str, group_name: str) -> int:
    rank = dist.get_rank()
    if rank not in ranks:
        raise PhaseError(f"{op}: rank {rank} is not in group {group_name!r} {ranks}",
                         group=group_name, rank=rank)
    return rank


def wait_works(works: Sequence[Work], op: str, group_name: str, ranks: list[int], timeout_s: float,
               start: float) -> float:
    """Wait for async works until ``start + timeout_s``; return the seconds since ``start``.

    Local (waits on works already issued). A missed deadline raises HangError naming ``op``, the group
    and the deadline; any other failure of the work (a peer died) raises PhaseError.
    """
    deadline = start + timeout_s
    for work in works:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))
        except RuntimeError as exc:
            _raise(exc, op, group_name, ranks, timeout_s, time.monotonic() >= deadline)
    return time.monotonic() - start



def _raise(exc: RuntimeError, op: str, group_name: str, ranks: list[int], timeout_s: float,
           past_deadline: bool) -> None:
    rank = dist.get_rank()
    where = f"{op} on group {group_name!r} (ranks {ranks}) on rank {rank}"
    if past_deadline or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
        raise HangError(f"{where} did not complete within the {timeout_s:g}s deadline: a peer is "
                        f"late, hung or skipped it", group=group_name, rank=rank,
                        deadline_s=timeout_s) from exc
    raise PhaseError(f"{where} failed: {exc}", group=group_name, rank=rank, deadline_s=timeout_s) from exc


def _check(ok: bool, op: str, group_name: str, got: object, expected: object) -> None:
    if not ok:
        raise PhaseError(f"{op} on group {group_name!r} returned {got}, expected {expected}: the ranks "
                         f"disagree about the group", group=group_name, rank=dist.get_rank())


def barrier(pg: ProcessGroup, ranks: list[int], timeout_s: float, *, group_name: str) -> float:
    """Barrier on ``pg``; every rank of the group must call it. Returns the seconds it took."""
    _member(ranks, "barrier", group_name)
    start = time.monotonic()
    work = dist.barrier(group=pg, async_op=True)
    return wait_works([work], "barrier", group_name, ranks, timeout_s, start)


def all_reduce(pg: ProcessGroup, ranks: list[int], timeout_s: float, *, group_name: str) -> float:
    """Sum one element over ``pg``; every rank of the group must call it. Returns the seconds."""
    _member(ranks, "all_reduce", group_name)
    t = torch.ones(1, device=_device(pg))
    start = time.monotonic()
    work = dist.all_reduce(t, group=pg, async_op=True)
    took = wait_works([work], "all_reduce", group_name, ranks, timeout_s, start)
    _check(int(t.item()) == len(ranks), "all_reduce", group_name, t.item(), len(ranks))
    return took


def all_gather(pg: ProcessGroup, ranks: list[int], timeout_s: float, *, group_name: str) -> float:
    """Gather every rank's global rank over ``pg``; every rank of the group must call it."""
    rank = _member(ranks, "all_gather", group_name)
    dev = _device(pg)
    mine = torch.tensor([float(rank)], device=dev)
    out = [torch.empty(1, device=dev) for _ in ranks]
    start = time.monotonic()
    work = dist.all_gather(out, mine, group=pg, async_op=True)
    took = wait_works([work], "all_gather", group_name, ranks, timeout_s, start)
    got = [int(t.item()) for t in out]
    _check(got == ranks, "all_gather", group_name, got, ranks)
    return took


def all_to_all(pg: ProcessGroup, ranks: list[int], timeout_s: float, *, group_name: str) -> float:
    """Send one element to every peer of ``pg`` (``all_to_all_single``: gloo has no list form).

    Every rank of the group must call it. Returns the seconds it took.
    """
    rank = _member(ranks, "all_to_all", group_name)
    dev = _device(pg)
    send = torch.full((len(ranks),), float(rank), device=dev)
    recv = torch.empty(len(ranks), device=dev)
    start = time.monotonic()
    work = dist.all_to_all_single(recv, send, group=pg, async_op=True)
    took = wait_works([work], "all_to_all", group_name, ranks, timeout_s, start)
    got = [int(v) for v in recv.tolist()]
    _check(got == ranks, "all_to_all", group_name, got, ranks)
    return took


def p2p(pg: ProcessGroup, ranks: list[int], timeout_s: float, *, group_name: str) -> float:
    """Ring exchange over ``pg``: send to the next and previous rank, receive from both.

    Every rank of the group must call it (pipeline-style send/recv connects pairs that collectives
    may not). A group of one rank is a no-op.
    """
    rank = _member(ranks, "p2p", group_name)
    if len(ranks) == 1:
        return 0.0
    i = ranks.index(rank)
    nxt, prev = ranks[(i + 1) % len(ranks)], ranks[i - 1]
    dev = _device(pg)
    mine = torch.tensor([float(rank)], device=dev)
    from_prev, from_next = torch.empty(1, device=dev), torch.empty(1, device=dev)
    # Distinct tags keep the two directions apart on gloo when next == prev (a group of two).
    ops = [dist.P2POp(dist.isend, mine, nxt, group=pg, tag=0),
           dist.P2POp(dist.irecv, from_prev, prev, group=pg, tag=0),
           dist.P2POp(dist.isend, mine, prev, group=pg, tag=1),
           dist.P2POp(dist.irecv, from_next, nxt, group=pg, tag=1)]
    start = time.monotonic()
    works = dist.batch_isend_irecv(ops)
    took = wait_works(works, "p2p", group_name, ranks, timeout_s, start)
    got = [int(from_prev.item()), int(from_next.item())]
    _check(got == [prev, nxt], "p2p", group_name, got, [prev, nxt])
    return took


OPS: dict[str, WarmupOp] = {
    "barrier": barrier,
    "all_reduce": all_reduce,
    "all_gather": all_gather,
    "all_to_all": all_to_all,
    "p2p": p2p,
}
