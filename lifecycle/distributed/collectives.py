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


def _device(pg: ProcessGroup | None) -> torch.device:
    # NCCL communicators only take tensors on the current GPU; everything else here runs on CPU.
    if "nccl" in str(dist.get_backend(pg)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_for(pg: ProcessGroup | None = None) -> torch.device:
    """Where a tensor for a collective on ``pg`` (default: the default group) must live: the current GPU on
    NCCL, the CPU on gloo. Local."""
    return _device(pg)


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
    may not). A group of one rank is a no-op. For the pipeline group see :func:`pipeline_p2p`.
    """
    rank = _member(ranks, "p2p", group_name)
    i = ranks.index(rank)
    return _exchange(pg, ranks, ranks[i - 1], ranks[(i + 1) % len(ranks)], timeout_s, group_name)


def pipeline_neighbours(ranks: list[int], rank: int, *, interleaved: bool) -> tuple[int | None, int | None]:
    """(previous stage, next stage) of ``rank``; ``ranks`` in stage order, as Megatron's pipeline group lists
    them. The first and last stage talk to each other only in the interleaved schedule, where the last
    stage's virtual chunk k feeds the first stage's chunk k + 1. Pure."""
    i, n = ranks.index(rank), len(ranks)
    prev = ranks[i - 1] if i > 0 or interleaved else None
    nxt = ranks[(i + 1) % n] if i < n - 1 or interleaved else None
    return prev, nxt


def pipeline_p2p(pg: ProcessGroup, ranks: list[int], timeout_s: float, *, group_name: str,
                 interleaved: bool = False, numel: int = 1) -> float:
    """Batched send/recv with this rank's real pipeline neighbours (previous and next stage, and the
    wrap-around link of the interleaved schedule), as Megatron's schedule sends activations
    (``batch_isend_irecv`` on the pp group): the communicators it will use exist before step 1.

    Every rank of the pipeline group ``pg`` must call it, with the same ``interleaved``.
    """
    rank = _member(ranks, "p2p", group_name)
    prev, nxt = pipeline_neighbours(ranks, rank, interleaved=interleaved)
    return _exchange(pg, ranks, prev, nxt, timeout_s, group_name, numel)


def _exchange(pg: ProcessGroup, ranks: list[int], prev: int | None, nxt: int | None, timeout_s: float,
              group_name: str, numel: int = 1) -> float:
    """Send this rank's global rank to ``prev`` and ``nxt`` (either may be None) and receive theirs.

    A message to the next rank travels on tag 0, to the previous one on tag 1, so the two directions stay
    apart on gloo when both neighbours are one rank (a group of two).
    """
    rank = dist.get_rank()
    peers = [(peer, tags) for peer, tags in ((prev, (1, 0)), (nxt, (0, 1))) if peer is not None and peer != rank]
    if not peers:
        return 0.0
    dev = _device(pg)
    mine = torch.full((numel,), float(rank), device=dev)
    got = [torch.empty(numel, device=dev) for _ in peers]
    ops = []
    for (peer, (send_tag, recv_tag)), buf in zip(peers, got, strict=True):
        ops += [dist.P2POp(dist.isend, mine, peer, group=pg, tag=send_tag),
                dist.P2POp(dist.irecv, buf, peer, group=pg, tag=recv_tag)]
    start = time.monotonic()
    works = dist.batch_isend_irecv(ops)
    took = wait_works(works, "p2p", group_name, ranks, timeout_s, start)
    values = [int(t[0].item()) if bool((t == t[0]).all()) else -1 for t in got]
    expected = [peer for peer, _ in peers]
    _check(values == expected, "p2p", group_name, values, expected)
    return took


def sized(op: str, nbytes: int, *, interleaved: bool = False) -> WarmupOp:
    """``op`` with a message of ``nbytes`` (fp32 elements, at least one per peer) instead of one element: the
    size the job will send on the group (:mod:`lifecycle.distributed.messages`), so NCCL connects the algorithm and
    protocol that size takes. The payload is checked as the 1-element ops check theirs."""
    numel = max(nbytes // 4, 1)

    def run(pg: ProcessGroup, ranks: list[int], timeout_s: float, *, group_name: str) -> float:
        rank = _member(ranks, op, group_name)
        dev = _device(pg)
        n = len(ranks)
        if op == "p2p":
            prev, nxt = pipeline_neighbours(ranks, rank, interleaved=interleaved)
            return _exchange(pg, ranks, prev, nxt, timeout_s, group_name, numel)
        start = time.monotonic()
        if op == "all_reduce":
            t = torch.ones(numel, device=dev)
            took = wait_works([dist.all_reduce(t, group=pg, async_op=True)], op, group_name, ranks, timeout_s, start)
            _check(bool((t == n).all()), op, group_name, t[:4].tolist(), n)
        elif op == "all_gather":
            mine = torch.full((numel,), float(rank), device=dev)
            out = [torch.empty(numel, device=dev) for _ in ranks]
            took = wait_works([dist.all_gather(out, mine, group=pg, async_op=True)], op, group_name, ranks,
                              timeout_s, start)
            got = [int(t[0].item()) if bool((t == t[0]).all()) else -1 for t in out]
            _check(got == ranks, op, group_name, got, ranks)
        elif op == "all_to_all":
            per = max(numel // n, 1)
            send = torch.full((per * n,), float(rank), device=dev)
            recv = torch.empty(per * n, device=dev)
            took = wait_works([dist.all_to_all_single(recv, send, group=pg, async_op=True)], op, group_name, ranks,
                              timeout_s, start)
            got = [int(v) for v in recv.view(n, per)[:, 0].tolist()]
            _check(got == ranks and bool((recv.view(n, per) == recv.view(n, per)[:, :1]).all()), op, group_name,
                   got, ranks)
        else:
            raise ValueError(f"no sized form of warmup op {op!r}")
        return took

    return run


OPS: dict[str, WarmupOp] = {
    "barrier": barrier,
    "all_reduce": all_reduce,
    "all_gather": all_gather,
    "all_to_all": all_to_all,
    "p2p": p2p,
}
