"""Begin/end events of one rank paired into spans; the timeline and the summary both read runs through this.

Spans on one rank nest (they are context managers on one thread, and the phase spans enclose them). A rank
that died (SIGKILL, ``os._exit``, a hard deadline) leaves begins without an end: such a span is *cut* and
is closed at the rank's last recorded event, which is the last moment we know the rank was alive.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

#: Keys every event carries; the rest are the span's own fields.
COMMON_KEYS = frozenset({"t", "rank", "local_rank", "host", "phase", "kind", "name", "dur_us"})


@dataclass(frozen=True)
class Span:
    """One begin/end pair of a rank (``end`` is None when the rank never wrote it)."""

    rank: int
    name: str
    start_us: int
    end_us: int
    depth: int
    begin: dict[str, Any]
    end: dict[str, Any] | None

    @property
    def cut(self) -> bool:
        return self.end is None

    @property
    def dur_us(self) -> int:
        return max(self.end_us - self.start_us, 0)

    @property
    def fields(self) -> dict[str, Any]:
        """The span's own fields: the begin's, updated with the end's (outcome, bytes, loss...)."""
        merged = {**self.begin, **(self.end or {})}
        return {k: v for k, v in merged.items() if k not in COMMON_KEYS}


MAX_US = 1 << 62
"""Timestamps and durations beyond this (about 146,000 years in µs) are malformed."""
_INT_FIELDS = ("rank", "local_rank")


def _int(value: Any, low: int = 0, high: int = MAX_US) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def is_valid(e: Any) -> bool:
    """A well-formed event: a dict with an integer ``t``, string ``kind`` and ``name``, and, when present,
    a string ``host``, integer ``rank``/``local_rank`` and a non-negative integer ``dur_us``."""
    return (isinstance(e, dict) and _int(e.get("t")) and isinstance(e.get("kind"), str)
            and isinstance(e.get("name"), str) and isinstance(e.get("host", ""), str)
            and all(_int(e[k], 0, 1 << 31) for k in _INT_FIELDS if k in e)
            and ("dur_us" not in e or e["dur_us"] is None or _int(e["dur_us"])))


def valid_events(events: list[Any]) -> list[dict[str, Any]]:
    """The well-formed events (:func:`is_valid`), in file order."""
    return [e for e in events if is_valid(e)]


def rank_spans(rank: int, events: list[dict[str, Any]], *, valid: bool = False) -> list[Span]:
    """Pair one rank's begin/end events (file order = emission order) into spans, cut spans included; ``valid``: the
    events passed :func:`valid_events` already (not checked again)."""
    return sorted(iter_spans(rank, events if valid else valid_events(events)), key=lambda s: (s.start_us, s.depth))


def iter_spans(rank: int, events: Iterable[dict[str, Any]]) -> Iterator[Span]:
    """:func:`rank_spans` over a stream of well-formed events, each span yielded when it closes (cut spans at the
    end): memory is the open spans, not the events."""
    stack: list[tuple[dict[str, Any], int]] = []
    last_t = -1
    for e in events:
        last_t = max(last_t, e["t"])
        if e["kind"] == "begin":
            stack.append((e, len(stack)))
        elif e["kind"] == "end":
            yield from _close(rank, stack, e)
    while stack:
        begin, depth = stack.pop()
        yield Span(rank, begin["name"], begin["t"], max(last_t, begin["t"]), depth, begin, None)


def _close(rank: int, stack: list[tuple[dict[str, Any], int]], end: dict[str, Any]) -> list[Span]:
    """The span ``end`` closes, plus any span opened inside it that never ended (cut at this end)."""
    match = next((i for i in range(len(stack) - 1, -1, -1) if stack[i][0]["name"] == end["name"]), None)
    if match is None:  # the begin is missing (a torn line): rebuild the start from the duration
        start = end["t"] - int(end.get("dur_us") or 0)
        return [Span(rank, end["name"], start, end["t"], len(stack), end, end)]
    out = []
    while len(stack) > match + 1:
        begin, depth = stack.pop()
        out.append(Span(rank, begin["name"], begin["t"], end["t"], depth, begin, None))
    begin, depth = stack.pop()
    out.append(Span(rank, end["name"], begin["t"], end["t"], depth, begin, end))
    return out


def phase_of(span: Span) -> str | None:
    """``train`` for a ``phase:train`` span, else None."""
    return span.name.split(":", 1)[1] if span.name.startswith("phase:") else None
