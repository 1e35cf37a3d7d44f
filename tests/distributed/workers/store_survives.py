"""Rank 0 leaves first; the others check that the launcher's store (and a store barrier on it) still
work once rank 0 is dead."""

import datetime
import os
import time

from _common import RANK, WORLD, init_gloo, note

init_gloo()
from lifecycle.distributed.barrier import get_store, store_barrier  # noqa: E402

store = get_store()
store.set(f"pid/{RANK}", str(os.getpid()))
store_barrier(store, "barrier/started/0", RANK, list(range(WORLD)), 20.0)
if RANK == 0:
    raise SystemExit(0)
pid0 = int(store.get("pid/0"))
deadline = time.monotonic() + 20
while time.monotonic() < deadline:  # rank 0 is reaped by the launcher as soon as it exits
    try:
        os.kill(pid0, 0)
    except ProcessLookupError:
        break
    time.sleep(0.05)
else:
    raise SystemExit(8)
from torch.distributed import TCPStore  # noqa: E402

store.set(f"after/{RANK}", "alive")
fresh = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                 datetime.timedelta(seconds=10))
fresh.set(f"fresh/{RANK}", "x")
survivors = list(range(1, WORLD))
store_barrier(store, "barrier/survivors/0", RANK, survivors, 20.0)
note("store", {"peers": [store.get(f"after/{r}").decode() for r in survivors],
               "fresh": fresh.get(f"fresh/{RANK}").decode()})
os._exit(0)  # the default group has a dead member: skip its teardown
