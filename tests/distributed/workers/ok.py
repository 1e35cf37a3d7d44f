"""Every rank: check the launcher's env, all_reduce on gloo, print to stdout and stderr, exit 0."""

import os
import sys

from _common import RANK, WORLD, init_gloo, note

assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
assert os.environ["LOCAL_RANK"] == str(RANK) and os.environ["LOCAL_WORLD_SIZE"] == str(WORLD)
init_gloo()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

t = torch.ones(1)
dist.all_reduce(t)
note("env", {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "GROUP_RANK")})
print(f"rank {RANK} stdout sum={t.item():g}")
print(f"rank {RANK} stderr line", file=sys.stderr)
dist.destroy_process_group()
