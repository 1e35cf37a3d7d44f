"""Rank 1 ignores SIGTERM and keeps SIGSTOPping itself; rank 2 then exits 4; the others sleep (plain
python, no torch)."""

import os
import signal
import sys
import time

from _common import RANK, event, note, on_sigterm_note_marker, wait_for_note

if RANK == 1:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    note("stopping", os.getpid())
    while True:  # SIGCONT resumes it for an instant: it stops again, only SIGKILL ends it
        os.kill(os.getpid(), signal.SIGSTOP)
on_sigterm_note_marker()
if RANK == 2:
    wait_for_note("stopping", 1)
    time.sleep(0.3)  # let rank 1 reach the stopped state
    event("train", kind="error", name="boom")
    sys.exit(4)
time.sleep(60)
