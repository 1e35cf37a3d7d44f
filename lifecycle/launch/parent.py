"""A rank dies with the launcher that started it: no orphan keeps running (and writing into a run directory a new
launcher may own) after its launcher is gone, however the launcher went (``kill -9`` included).

Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) is set as the rank starts, before any import of
torch: the kernel kills the rank the moment its parent exits. A rank whose launcher died before the signal was set
(its parent is already another process) leaves at once. The local launcher names itself in
``LIFECYCLE_LAUNCHER_PID``; under torchrun the parent is the elastic agent. Elsewhere (a trainer's own script, srun)
nothing is set: those processes belong to whoever started them. Pure Python: no torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

ENV_LAUNCHER_PID = "LIFECYCLE_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def die_with_launcher() -> bool:
    """Bind this process's life to its launcher's (see the module). True when bound; a process whose launcher is
    already gone exits 1 here with one line."""
    given = os.environ.get(ENV_LAUNCHER_PID, "")
    if given.isdigit():
        launcher = int(given)
    elif os.environ.get("TORCHELASTIC_RUN_ID") is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE"):
        launcher = os.getppid()  # torchrun's agent started this worker
    else:
        return False
    return die_with(launcher)


def die_with(parent: int) -> bool:
    """Bind this process's life to ``parent``'s, which must be its parent: SIGKILL the moment it exits. True when
    bound (Linux); a process whose parent is already gone exits 1 here with one line."""
    if not _set_pdeathsig(signal.SIGKILL):
        return False
    if os.getppid() != parent:  # it died between our fork and the prctl: the signal will never come
        print(f"[rank {os.environ.get('RANK', '?')}] lifecycle: the launcher (pid {parent}) is gone before this "
              f"rank started; leaving", file=sys.stderr, flush=True)
        os._exit(1)
    return True


def _set_pdeathsig(sig: signal.Signals) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False
