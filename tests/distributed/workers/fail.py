"""argv: FAIL_RANK MODE. FAIL_RANK exits 4 in phase warmup; the others block in an all_reduce that the
failing rank never joins (MODE=collective) or sleep (MODE=sleep), noting on SIGTERM whether the
launcher wrote its .shutdown marker first."""

import sys
import time

from _common import RANK, event, init_gloo, on_sigterm_note_marker

fail_rank, mode = int(sys.argv[1]), sys.argv[2]
on_sigterm_note_marker()
init_gloo()
event("init")
event("warmup", name="warm_groups")
if RANK == fail_rank:
    time.sleep(0.5)
    event("warmup", kind="error", name="boom")
    sys.exit(4)
if mode == "collective":
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
time.sleep(60)
