"""torch elastic's error file: the way ``@record`` reports a failed rank to torchrun.

torchrun exits 1 for any failed worker, so a rank's own exit code (3 hang, 4 rank failed, 5 teardown deadline,
2 usage) only reaches the user through the file named by ``TORCHELASTIC_ERROR_FILE``: torchrun's failure summary
shows its ``message`` and ``py_callstack`` as the root cause. Every path that ends a rank with a non-zero code
writes it (the failure path, the watchdog's abort, the teardown deadline); the local launcher sets the variable
too (``RUN_DIR/logs/rank_<R>.error.json``). Pure Python.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lifecycle.rundir import safeio

ENV = "TORCHELASTIC_ERROR_FILE"
_recorded: list[Path] = []


def record_failure(*, rank: int, error: str, message: str, exit_code: int, phase: str | None,
                   group: str | None = None, ranks: list[int] | None = None, detail: str = "") -> Path | None:
    """Write this rank's failure where torch elastic looks for it (no-op without ``TORCHELASTIC_ERROR_FILE``).

    The first record of a process wins: a later, secondary failure (teardown after a hang) does not replace it.
    """
    target = os.environ.get(ENV)
    if not target:
        return None
    path = Path(target)
    if _recorded:
        return _recorded[0]
    lines = [f"lifecycle: {error} on rank {rank} in phase {phase} -> exit code {exit_code}",
             f"  {message[:1500]}"]
    if group:
        lines.append(f"  group: {group}")
    if ranks:
        lines.append(f"  ranks named: {sorted(set(ranks))[:64]}")
    if detail:
        lines.append(f"  {detail}")
    data = {
        "message": {
            "message": f"{error}: {message[:1500]}",
            "extraInfo": {"py_callstack": "\n".join(lines), "timestamp": str(int(time.time()))},
        },
        "lifecycle": {"rank": rank, "error": error, "phase": phase, "group": group,
                      "ranks": sorted(set(ranks or []))[:1024], "exit_code": exit_code},
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        safeio.write_text(path, json.dumps(data))  # a FIFO or device there is refused, a link replaced
    except (OSError, safeio.RunDirError):
        return None
    _recorded.append(path)
    return path
