"""``lifecycle ARGS`` in this process (no interpreter start-up): its exit code, stdout and stderr."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def logger_kept() -> Iterator[None]:
    """The CLI installs its own handler on the ``lifecycle`` logger and stops propagation: undone afterwards, so
    that later tests' ``caplog`` still sees lifecycle's records."""
    log = logging.getLogger("lifecycle")
    handlers, level, propagate = log.handlers[:], log.level, log.propagate
    try:
        yield
    finally:
        log.handlers[:], log.propagate = handlers, propagate
        log.setLevel(level)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``lifecycle.cli.main(argv)``."""
    from lifecycle.cli import main

    capsys.readouterr()
    with logger_kept():
        code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err
