"""A save begun and not yet committed (an async save's handle until the next step boundary)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lifecycle.handlers.protocols import SaveHandle


@dataclass
class PendingSave:
    handle: SaveHandle
    step: int
    tmp: Path
    """The ``iter_NNNNNNN.tmp`` folder being written."""
    final: Path
    """Where the commit renames it."""
    reason: str
