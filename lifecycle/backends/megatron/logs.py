"""megatron-core log lines that lifecycle answers itself, kept out of a run's output while the call that logs them
runs (a filter on megatron's own logger, removed after: a trainer's own calls still see every line)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class _Drop(logging.Filter):
    def __init__(self, parts: tuple[str, ...]) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


@contextlib.contextmanager
def quiet(logger: str, *parts: str) -> Iterator[None]:
    """Drop the records of ``logger`` whose message contains one of ``parts`` while the block runs."""
    target = logging.getLogger(logger)
    drop = _Drop(parts)
    target.addFilter(drop)
    try:
        yield
    finally:
        target.removeFilter(drop)
