"""The watchdog's side channel: its own client of the rendezvous TCPStore, and the keys it uses there.

Why a store and not the process groups: a hung or broken communicator cannot carry news about itself.
The TCPStore of the rendezvous is reachable without any process group; under torchrun/torch elastic
and ``lifecycle run`` the launcher hosts it, so it outlives every rank (rank 0 included). A TCPStore
client serialises its calls, so the watchdog thread has its own client (a blocked call there must not
delay the training thread) and the main thread's failure path another one.

Keys (under ``lifecycle/wd/<run id>/<restart attempt>/``, then ``ip<N>/`` after N in-process restarts, so a
restarted job does not read old ones):

- ``rec/<rank>``: the rank's progress record (JSON), re-published at every poll: ``set`` is one
  un-acknowledged message (a few µs), and the record's wall-clock ``t`` doubles as a heartbeat;
- ``hb/<rank>``: a counter bumped at every poll; peers read it with ``add(key, 0)``, which never
  blocks, and call a rank dead when it stops moving (no clock comparison between hosts);
- ``started``: ``"<rank>,"`` appended by every rank once, so a diagnosis reads only existing keys;
- ``alarm``: the first rank that detects a hang or fails sets it (``compare_set``: one winner); every
  other rank sees it at its next poll, reports and acts, so one detection takes the whole job down.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
from typing import TYPE_CHECKING

from lifecycle.jsontypes import JsonDict

if TYPE_CHECKING:
    from torch.distributed import Store

ENV_RESTART = "TORCHELASTIC_RESTART_COUNT"
CLIENTS = threading.Lock()
"""Held while lifecycle makes a store client (a new one or a clone): never two at once in one process. A rank forked
from the preload process died of SIGSEGV in a client's constructor while a second thread was in the same constructor
(and the main thread in ``init_process_group``); the clients are made one at a time, and under a launcher-hosted store
before ``init_process_group`` (``Watchdog.start``)."""


def connect(timeout_s: float, op_timeout_s: float = 5.0) -> Store | None:
    """A new client of the rendezvous store (MASTER_ADDR/MASTER_PORT), or None without that env.

    Connecting retries until ``timeout_s`` (under mp.spawn rank 0 creates the server inside
    ``init_process_group``); afterwards a call that would block (``get`` of a missing key) gives up
    after ``op_timeout_s``.
    """
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    from torch.distributed import TCPStore

    with CLIENTS:
        store = TCPStore(addr, int(port), None, False, datetime.timedelta(seconds=timeout_s))
    store.set_timeout(datetime.timedelta(seconds=op_timeout_s))
    return store


def answers(timeout_s: float) -> bool:
    """Whether the rendezvous store's port accepts a connection within ``timeout_s`` (a plain socket, closed at once;
    True without MASTER_ADDR/MASTER_PORT). Probed before each :func:`connect` attempt: a store that does not answer yet
    costs a quiet retry, not torch's c10d timeout line with its C++ stack in the rank's log."""
    import socket

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return True
    try:
        with socket.create_connection((addr, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def store_address() -> str:
    """``HOST:PORT`` of the rendezvous store, for messages."""
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


class SideChannel:
    """The watchdog's keys on one store client. Each method is one store call unless it says otherwise."""

    def __init__(self, store: Store, run_id: str, round_: int = 0) -> None:
        self.store = store
        inproc = f"ip{round_}/" if round_ else ""  # an in-process restart's round: the last round's alarm is gone
        self.prefix = f"lifecycle/wd/{run_id}/{os.environ.get(ENV_RESTART, '0')}/{inproc}"

    def key(self, name: str) -> str:
        return self.prefix + name

    def clone(self) -> SideChannel:
        """The same keys on a new connection (for another thread)."""
        other = SideChannel.__new__(SideChannel)
        with CLIENTS:
            other.store, other.prefix = self.store.clone(), self.prefix
        return other

    def announce(self, rank: int, record: JsonDict) -> None:
        self.publish(rank, record)
        self.store.append(self.key("started"), f"{rank},")

    def publish(self, rank: int, record: JsonDict) -> None:
        self.store.set(self.key(f"rec/{rank}"), json.dumps(record, default=str))

    def beat(self, rank: int) -> int:
        return int(self.store.add(self.key(f"hb/{rank}"), 1))

    def beats(self, rank: int) -> int:
        """The peer's heartbeat counter (0: it has not started); never blocks."""
        return int(self.store.add(self.key(f"hb/{rank}"), 0))

    def started(self) -> list[int]:
        key = self.key("started")
        if not self.store.check([key]):
            return []
        return sorted({int(t) for t in bytes(self.store.get(key)).decode().split(",") if t})

    def records(self, ranks: list[int]) -> dict[int, JsonDict | None]:
        """Records of ``ranks`` (one ``multi_get`` over those that announced themselves; others None)."""
        have = set(self.started())
        present = [r for r in ranks if r in have]
        out: dict[int, JsonDict | None] = dict.fromkeys(ranks)
        if present:
            values = self.store.multi_get([self.key(f"rec/{r}") for r in present])
            out.update({r: json.loads(bytes(v).decode()) for r, v in zip(present, values, strict=True)})
        return out

    def record(self, rank: int) -> JsonDict | None:
        key = self.key(f"rec/{rank}")
        if not self.store.check([key]):
            return None
        return dict(json.loads(bytes(self.store.get(key)).decode()))

    def raise_alarm(self, info: JsonDict) -> JsonDict:
        """Set the alarm unless another rank did first; returns the alarm that stands (two calls)."""
        won = bytes(self.store.compare_set(self.key("alarm"), "", json.dumps(info, default=str))).decode()
        return dict(json.loads(won))

    def alarm(self) -> JsonDict | None:
        """The standing alarm, or None (one ``check``; a ``get`` too when there is one)."""
        key = self.key("alarm")
        if not self.store.check([key]):
            return None
        return dict(json.loads(bytes(self.store.get(key)).decode()))
