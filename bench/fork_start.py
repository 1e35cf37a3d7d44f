"""Forked ranks through start-up: how many die (a signal, a hang) while their store clients are made.

    OMP_NUM_THREADS=1 .venv/bin/python bench/fork_start.py [--launches 500] [--mode threads,premade]

The parent imports what the preload process imports (torch, torch.distributed, megatron-core) and forks each launch
from it, as `lifecycle run` forks its ranks; the store is hosted by another process, as the launcher hosts it. Each
child is one rank of a world of 1 with the launcher-hosted store (``TORCHELASTIC_USE_AGENT_STORE=True``) and makes
what a rank makes at start-up:

- threads (before): the watchdog's two clients made by two threads at once (``TCPStore(...)`` as
  ``sidechannel.connect`` made them, without its lock) while the main thread runs ``init_process_group`` (env://);
- premade (now): the two clients made first on the main thread by the real ``sidechannel.connect`` (one at a time,
  under ``sidechannel.CLIENTS``, as ``Watchdog.start`` does), then ``init_process_group``.

A child that is not done within 60 s is killed and counted as a hang (a connection can wait 5 s for a reverse lookup
of its address here: see bench/scale.py). Two children at a time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _child(mode: str, port: int, i: int) -> None:
    import torch.distributed as dist
    from torch.distributed import TCPStore

    from lifecycle.watchdog.sidechannel import connect

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(i))
    threads = []
    if mode == "threads":
        def client() -> None:
            TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30))

        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
    else:
        clients = [connect(30.0) for _ in range(2)]
        assert all(c is not None for c in clients)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=30))
    for t in threads:
        t.join()
    dist.destroy_process_group()


def run(mode: str, launches: int, port: int) -> dict[str, int]:
    outcome: dict[str, int] = {}
    live: dict[int, float] = {}

    def reap(block: bool) -> None:
        while live:
            for pid, started in list(live.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    code = os.waitstatus_to_exitcode(status)
                    key = "ok" if code == 0 else (f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}")
                    outcome[key] = outcome.get(key, 0) + 1
                    del live[pid]
                elif time.monotonic() - started > 60:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    outcome["hang"] = outcome.get("hang", 0) + 1
                    del live[pid]
            if not block or len(live) < 2:
                return
            time.sleep(0.005)

    for i in range(launches):
        reap(block=True)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child(mode, port, i + (0 if mode == "threads" else 10**6))
            except BaseException:  # noqa: BLE001 - counted by its code
                code = 3
            os._exit(code)
        live[pid] = time.monotonic()
    while live:
        reap(block=False)
        time.sleep(0.01)
    return outcome


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=500)
    ap.add_argument("--mode", default="threads,premade")
    args = ap.parse_args()
    import megatron.core  # noqa: F401 - what the preload process holds when it forks
    import torch.distributed  # noqa: F401

    code = ("import datetime,time\nfrom torch.distributed import TCPStore\n"
            "s=TCPStore('127.0.0.1',0,None,True,datetime.timedelta(seconds=60))\nprint(s.port,flush=True)\n"
            "time.sleep(86400)")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    try:
        for mode in args.mode.split(","):
            t0 = time.monotonic()
            got = run(mode, args.launches, port)
            print(f"{mode}: {args.launches} launches in {time.monotonic() - t0:.0f} s: {got}", flush=True)
    finally:
        server.kill()


if __name__ == "__main__":
    main()
