"""argv: STUBBORN_RANK. Each rank binds its life to the launcher's (as lifecycle's worker does), notes "ready" and
sleeps; on SIGTERM it notes whether the .shutdown marker exists and exits 0, except STUBBORN_RANK, which ignores
SIGTERM. Plain python, no torch."""

import os
import signal
import sys
import time

from _common import RANK, note, on_sigterm_note_marker

from lifecycle.launch.parent import die_with_launcher

die_with_launcher()

if RANK == int(sys.argv[1]):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    on_sigterm_note_marker()
note("ready", os.getpid())
time.sleep(60)
