"""Logging set-up for the command line and the ranks: one stderr handler with a ``[rank N]`` prefix.

The library itself adds no handlers (``logging.getLogger(__name__)`` everywhere); the entry points call
:func:`setup_logging` once.
"""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(verbose: bool = False) -> None:
    """One stderr handler on the ``lifecycle`` logger, prefixed with ``[rank N]`` when RANK is set."""
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("lifecycle")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False
