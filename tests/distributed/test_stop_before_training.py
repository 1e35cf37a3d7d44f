"""A stop signal that finds a rank stuck before training (lifecycle.machine.blocked_stop), under real torchrun: a
rank that crashed in init makes torchrun SIGTERM the other, which waits in the rendezvous for it and never reaches
the step boundary where the stop flag is read. A rank that moves on keeps the flag (the fault matrix's init-signal
and warmup-signal cells: the job exits 0 together)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lifecycle.obs.events import read_events
from tests._dist import free_port
from tests.distributed.runs import FAST, SYNTHETIC

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(90)
def test_a_rank_waiting_in_init_for_a_crashed_peer_leaves_on_torchruns_sigterm(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id",
           f"stop-{os.getpid()}-{time.monotonic_ns()}", "-m", "lifecycle", "run", f"run.dir={run_dir}", *SYNTHETIC,
           *FAST, "train.steps=4", "+faults=[{at: init, ranks: [1], action: crash}]"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=80, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]  # torchrun reports rank 1's crash
    assert "SIGKILL" not in out and "forcefully exiting" not in out, out[-3000:]  # torchrun's kill after 30 s
    assert "[rank 0] SIGTERM while in init and no progress for 5s" in out and "leaving now (exit 0)" in out, out[-3000:]
    events = read_events(run_dir)[0]
    stop = [e for e in events if e["name"] == "stop_before_training"]
    assert len(stop) == 1 and stop[0]["stuck_in"] == "init" and stop[0]["signal"] == "SIGTERM", stop
    last = [e for e in events if e["name"] == "exit"][-1]
    assert last["by"] == "signal" and last["exit_code"] == 0, last
    assert took < 25, took  # start-up, the crash, 5 s without progress; never torchrun's 30 s grace
