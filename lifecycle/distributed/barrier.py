"""A barrier over the c10d key-value store that names the ranks that did not arrive.

Why not ``dist.barrier`` or ``monitored_barrier``: a collective barrier on a hung group hangs too (NCCL) or,
for gloo's ``monitored_barrier``, names the late ranks but leaves the group unusable after a timeout. This
barrier issues no process-group operation at all: it only talks to the rendezvous store (TCPStore, the
default-group store, a PrefixStore over either, or a HashStore in one process), so every process group is
untouched and still usable after a timeout.

Protocol for one barrier (``key`` unique per call; callers number them, e.g. ``"barrier/<point>/<seq>"``):

1. every rank appends ``"<rank>,"`` to ``<key>/arrived`` and increments ``<key>/count``;
2. the rank whose increment reaches ``len(ranks)`` settles ``<key>/result`` to ``ok`` with ``compare_set``;
   the others wait on ``<key>/result`` until the deadline;
3. a rank whose wait times out reads ``<key>/arrived`` and tries to settle ``result`` to
   ``timeout:<missing ranks>``. ``compare_set`` makes exactly one outcome win, so every rank (a late
   arriver included) sees the same verdict and the same missing ranks: either all pass or all raise;
4. on success each rank increments ``<key>/left``; the last one deletes the keys, so a long job does not
   grow the store. Keys of a failed barrier stay (late arrivers must still read the verdict).

Cost on the common path: 4 store round trips per rank plus one wait (about 10 µs each on TCPStore), O(1)
in the world size; the failure path adds two. A key must not be reused while any rank may still be inside
the barrier with it; reusing a key after a success is safe only once all ranks have left (hence: number them).
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import TYPE_CHECKING

from lifecycle.errors import HangError, PhaseError

if TYPE_CHECKING:
    from torch.distributed import Store

logger = logging.getLogger(__name__)

_NAMESPACE = "lifecycle/barrier:"  # keeps caller keys away from torch's own keys (e.g. TCPStore's "init/")
_OK = "ok"
_TIMEOUT = "timeout:"


def get_store() -> Store:
    """The default process group's store (``init_process_group`` must have run on this rank).

    It is a ``PrefixStore("default_pg", ...)`` over the rendezvous TCPStore client. Who hosts the TCPStore
    server decides how long it lives:

    - under torchrun / torch elastic and ``lifecycle run`` (``TORCHELASTIC_USE_AGENT_STORE=True``), the
      agent (launcher) process hosts it: the store outlives every rank, rank 0 included, so surviving ranks
      can still coordinate (and name the dead) after any rank dies;
    - under ``mp.spawn`` or a plain env:// start, rank 0 hosts it and it dies with rank 0; store calls
      then fail fast with ``torch.distributed.DistNetworkError`` (but a ``set`` is not acknowledged: the
      first one after the server died "succeeds" and is lost). ``store_barrier`` turns that into a
      ``PhaseError`` that says so.

    The returned object keeps working after ``destroy_process_group`` (hold on to it). A TCPStore client
    serialises its calls, so a thread that blocks on the store (a watchdog) should use ``store.clone()``.
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def store_barrier(store: Store, key: str, rank: int, ranks: list[int], timeout_s: float, *,
                  phase: str | None = None, group: str | None = None) -> None:
    """Block until every rank in ``ranks`` has called this with the same ``key``, or raise ``HangError``.

    Every rank in ``ranks`` (global ranks) must call it with the same ``key``, ``ranks`` and
    ``timeout_s``; ranks outside ``ranks`` do not call it. No process group is used. ``group`` and
    ``phase`` only label the error. On timeout every participant raises ``HangError`` whose ``missing``
    lists the global ranks that had not arrived when the first rank's deadline passed. An unreachable
    store raises ``PhaseError``.
    """
    members = sorted(set(ranks))
    if rank not in members:
        raise ValueError(f"store_barrier {key!r}: rank {rank} is not one of the ranks {members}")
    if timeout_s <= 0:
        raise ValueError(f"store_barrier {key!r}: timeout_s must be > 0 (got {timeout_s})")
    from torch.distributed import DistNetworkError

    try:
        verdict = _arrive_and_wait(store, _Keys(key), rank, members, time.monotonic() + timeout_s)
    except DistNetworkError as e:
        raise PhaseError(
            f"barrier {key!r}: the store is unreachable ({e.__class__.__name__}). If rank 0 hosted it "
            "(mp.spawn, env:// without an agent), it died with rank 0: launch with torchrun or "
            "`lifecycle run` so that the launcher hosts it", phase=phase, rank=rank, group=group) from e
    if verdict != _OK:
        raise _hang_error(key, rank, verdict, timeout_s, phase=phase, group=group)


def _arrive_and_wait(store: Store, keys: _Keys, rank: int, members: list[int], deadline: float) -> str:
    """Steps 1-4 of the protocol; returns the verdict every participant sees."""
    store.append(keys.arrived, f"{rank},")
    if int(store.add(keys.count, 1)) == len(members):
        verdict = _settle(store, keys, _OK)
    else:
        verdict = _wait_verdict(store, keys, members, deadline)
    if verdict == _OK:
        _leave(store, keys, len(members))
    return verdict


class _Keys:
    """The store keys of one barrier."""

    def __init__(self, key: str) -> None:
        base = _NAMESPACE + key
        self.arrived, self.count = f"{base}/arrived", f"{base}/count"
        self.result, self.left = f"{base}/result", f"{base}/left"

    def all(self) -> tuple[str, ...]:
        return self.arrived, self.count, self.result, self.left


def _settle(store: Store, keys: _Keys, verdict: str) -> str:
    """Propose a verdict; returns the one that won (the first ``compare_set`` on a missing key)."""
    return bytes(store.compare_set(keys.result, "", verdict)).decode()


def _wait_verdict(store: Store, keys: _Keys, members: list[int], deadline: float) -> str:
    from torch.distributed import DistStoreError

    left = max(deadline - time.monotonic(), 0.001)
    try:
        store.wait([keys.result], datetime.timedelta(seconds=left))
    except DistStoreError:  # the wait timed out (a lost connection is DistNetworkError and propagates)
        arrived = _parse_ranks(bytes(store.get(keys.arrived)).decode())
        missing = [r for r in members if r not in arrived]
        return _settle(store, keys, _TIMEOUT + ",".join(map(str, missing)))
    return bytes(store.get(keys.result)).decode()


def missing_keys(store: Store, keys: list[str], timeout_s: float) -> list[int]:
    """Block in the store server until every key exists; return the indexes of keys still absent at the
    deadline (empty: all there). No process group; one wait on the common path, no polling."""
    from torch.distributed import DistStoreError

    try:
        store.wait(keys, datetime.timedelta(seconds=max(timeout_s, 0.001)))
        return []
    except DistStoreError:  # timed out (a lost connection is DistNetworkError and propagates)
        return [i for i, k in enumerate(keys) if not store.check([k])]


def _leave(store: Store, keys: _Keys, n: int) -> None:
    # Only once all n ranks have read the verdict is it safe to delete it.
    if int(store.add(keys.left, 1)) != n:
        return
    for k in keys.all():
        try:
            store.delete_key(k)
        except RuntimeError:  # FileStore has no delete_key: the keys stay, which is harmless
            return


def _parse_ranks(text: str) -> set[int]:
    return {int(tok) for tok in text.replace(",", " ").split()}


def _hang_error(key: str, rank: int, verdict: str, timeout_s: float, *, phase: str | None,
                group: str | None) -> HangError:
    missing = sorted(_parse_ranks(verdict[len(_TIMEOUT):])) if verdict.startswith(_TIMEOUT) else []
    where = f"barrier {key!r}" + (f" on group {group!r}" if group else "")
    if missing:
        who = f"ranks {missing} did not arrive"
        if rank in missing:
            who += f" (this rank, {rank}, arrived after the deadline)"
    else:
        who = "every rank arrived, but not before the first deadline passed"
    message = f"{where} timed out after {float(timeout_s)}s: {who}"
    logger.debug("[rank %d] %s", rank, message)
    return HangError(message, missing=missing, phase=phase, rank=rank, group=group, deadline_s=timeout_s)
