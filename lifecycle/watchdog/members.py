"""Global member ranks of this rank's group by label, for the watchdog's records and the sequence check.

Labels are what the events and ``ctx.ops`` use: a warmup label (``edp=intra_edp``: every
symbolic name of one communicator), a symbolic group name (``dp``), or ``world``/``store`` (every rank).
Local only, no collective; None when the group is unknown on this rank.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lifecycle.distributed.groups import group_ranks

if TYPE_CHECKING:
    from lifecycle.watchdog.run import WatchedRun

log = logging.getLogger(__name__)
EVERY_RANK = ("world", "store")


def members_of(ctx: WatchedRun, label: str) -> list[int] | None:
    """The ranks of this rank's group ``label``, ascending, or None."""
    if label in EVERY_RANK:
        return list(range(ctx.world_size))
    names = label.split("=")
    for group in ctx.comms.groups:
        if group.label == label or names[0] in group.names:
            return sorted(group.ranks)
    try:
        found = group_ranks(ctx.parallel, names[0])
    except Exception as exc:  # noqa: BLE001 - an unknown name or a getter that asserts
        log.debug("no members for group %r: %s", label, exc)
        return None
    return sorted(found[1]) if found else None
