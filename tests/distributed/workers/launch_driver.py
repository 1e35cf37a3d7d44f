"""argv: RUN_DIR NPROC GRACE_S -- WORKER_ARGV...: run launch_local in this process (so a test can signal
the launcher without signalling pytest) and print the LaunchResult as JSON."""

import dataclasses
import json
import sys
from pathlib import Path

from lifecycle.launch.local import launch_local

run_dir, nproc, grace = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
argv = sys.argv[sys.argv.index("--") + 1:]
result = launch_local(argv, nproc, run_dir, kill_grace_s=grace, preempt_grace_s=grace)
print(json.dumps({**dataclasses.asdict(result), "describe": result.describe()}))
sys.exit(result.exit_code)
