"""Agreements over the store with a cost per rank that does not grow with the world size.

What a world collective would decide — every rank's flag is true, the newest step every rank holds, the largest of
the ranks' values, one rank's value for everyone — decided with a few store calls per rank and one
:func:`~lifecycle.distributed.barrier.store_barrier` (4 calls and one server-side wait): no process group, so no
world-sized mesh, and a missed deadline names the ranks that did not arrive (:class:`~lifecycle.errors.HangError`).

Every rank of ``ranks`` calls each function with the same ``key`` (unique per agreement: callers number them), at
the same point of its run. Counters are never reused; :class:`Agreements` deletes each agreement's own keys of the
one before it, once the next one's barrier proves every rank has read them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lifecycle.distributed.barrier import store_barrier

if TYPE_CHECKING:
    from torch.distributed import Store

_NAMESPACE = "lifecycle/agree:"


@dataclass
class Agreements:
    """One rank's numbered agreements on one store client (one thread uses it)."""

    store: Store
    rank: int
    ranks: list[int]
    prefix: str
    phase: str | None = None
    group: str = "world"
    _seq: int = 0
    _stale: list[str] = field(default_factory=list)
    """Keys this rank wrote for the last agreement: deleted after the next one's barrier."""

    def _base(self, what: str) -> str:
        self._seq += 1
        return f"{_NAMESPACE}{self.prefix}/{self._seq}:{what}"

    def _barrier(self, base: str, timeout_s: float) -> None:
        store_barrier(self.store, f"{base}/b", self.rank, self.ranks, timeout_s, phase=self.phase, group=self.group)
        for key in self._stale:  # every rank has left the last agreement: nobody reads these again
            try:
                self.store.delete_key(key)
            except RuntimeError:  # a store without delete_key (FileStore): harmless
                break
        self._stale = []

    def all_true(self, what: str, ok: bool, timeout_s: float) -> bool:
        """Whether every rank's ``ok`` is true (3 calls + a barrier per rank)."""
        base = self._base(what)
        bad = f"{base}/bad"
        self.store.add(bad, 0 if ok else 1)
        self._barrier(base, timeout_s)
        self._stale.append(bad)
        return int(self.store.add(bad, 0)) == 0

    def newest_common(self, what: str, mine: Iterable[int], timeout_s: float) -> int | None:
        """The largest value every rank has in ``mine`` (a few small sets: a call per value and rank), or None."""
        base = self._base(what)
        values = sorted(set(mine), reverse=True)
        keys = {v: f"{base}/have/{v}" for v in values}
        for key in keys.values():
            self.store.add(key, 1)
        self._barrier(base, timeout_s)
        self._stale += keys.values()
        for value in values:  # newest first: the first one every rank counted is the answer
            if int(self.store.add(keys[value], 0)) == len(self.ranks):
                return value
        return None

    def largest(self, what: str, value: int, timeout_s: float) -> int:
        """The largest of every rank's ``value`` (non-negative): one ``compare_set`` per rank while the ranks agree
        (the first sets it, the others find it standing), another for each smaller value a rank replaces."""
        base = self._base(what)
        key, mine, expected = f"{base}/max", str(value), ""
        while True:  # compare_set answers what stands after it: ours, or another rank's
            got = bytes(self.store.compare_set(key, expected, mine)).decode()
            if got == mine or int(got) >= value:
                break
            expected = got  # a smaller value stands: replace exactly it
        self._barrier(base, timeout_s)
        self._stale.append(key)
        return int(bytes(self.store.get(key)).decode())

    def from_rank(self, what: str, source: int, value: object, timeout_s: float) -> object:
        """``source``'s ``value`` (JSON) on every rank: one ``set`` on ``source``, a barrier, one ``get`` on each
        rank."""
        base = self._base(what)
        key = f"{base}/value"
        if self.rank == source:
            self.store.set(key, json.dumps(value))
        self._barrier(base, timeout_s)
        if self.rank == source:
            self._stale.append(key)
        return json.loads(bytes(self.store.get(key)).decode())

    def alike(self, what: str, mine: list[tuple[str, list[int], bytes]], payload: bytes,
              timeout_s: float) -> dict[str, dict[int, bytes]]:
        """For each of this rank's groups (name, its ranks, this rank's token): whether every member's token is this
        rank's. Returns, for each group where one is not, every member's ``payload`` (read only then, a
        ``multi_get`` over the group; a member that gave none is absent). On the common path one ``set`` and two
        calls per group and rank."""
        import hashlib

        base = self._base(what)
        self.store.set(f"{base}/p/{self.rank}", payload)
        keys = {name: f"{base}/g/{name}/{ranks[0]}/{hashlib.sha1(token).hexdigest()}"
                for name, ranks, token in mine if ranks}
        for key in keys.values():
            self.store.add(key, 1)
        self._barrier(base, timeout_s)
        self._stale += [f"{base}/p/{self.rank}", *keys.values()]
        odd: dict[str, dict[int, bytes]] = {}
        for name, ranks, _ in mine:
            if ranks and int(self.store.add(keys[name], 0)) != len(ranks):
                present = [r for r in ranks if self.store.check([f"{base}/p/{r}"])]
                got = self.store.multi_get([f"{base}/p/{r}" for r in present]) if present else []
                odd[name] = {r: bytes(v) for r, v in zip(present, got, strict=True)}
        return odd
