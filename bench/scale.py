"""The control plane at 256 .. 16,384 simulated ranks: the real side-channel code against one real TCPStore.

    OMP_NUM_THREADS=1 .venv/bin/python bench/scale.py [--ranks 256,1024,4096,16384] [--procs 4] [--seconds 20]

The store server is a process of its own (as the launcher hosts it), torch's default libuv server. Each simulated
rank is a real TCPStore client (one connection, as a rank's watchdog has) and runs the real per-poll code of the
watchdog's side channel: ``SideChannel.publish`` of a record the real ``ProgressTracker`` makes, ``beat``, ``alarm``
and ``causes.Heartbeats.check`` (its ring neighbour's and rank 0's counters). Ranks live in a few processes, each
polling its ranks one after another from a few threads over at most ``CONNECTIONS`` connections (ranks share one
above that: see its note).

Two cores cannot issue 16,384 ranks' polls a second, so time is dilated: every rank polls every ``dilation`` seconds
instead of every second (``watchdog.poll_interval_s`` = 1). What is scaled back: calls per real second = N x the
calls counted per healthy poll (the load the design puts on the server at the real interval), and the alarm's fan-out
time, which takes one poll: measured / dilation. What is not scaled: call latencies (measured at the dilated rate:
a lower load than the real one; ``capacity`` measures the server at full load) and the server's memory.

Parts:
- capacity: the most calls per second one server answers here, with every core busy issuing the poll mix
  (``--procs`` processes x 16 connections, no pause): the baseline the load is compared against (target: the
  design's load at most a quarter of it).
- per N: calls per real second, p50/p99 latency, rank 0's CPU per poll (its share of the poll, plus its rank-0-only
  reads: the straggler view's ``multi_get`` of every record up to 1,024 ranks, parsed), the server's RSS, and the
  time from a frozen rank's detection (its neighbour's heartbeat read goes stale) to the alarm on every rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lifecycle.watchdog import causes  # noqa: E402
from lifecycle.watchdog.core import FULL_VIEW_MAX, straggler_every_s  # noqa: E402
from lifecycle.watchdog.sidechannel import SideChannel  # noqa: E402
from lifecycle.watchdog.tracker import ProgressTracker  # noqa: E402

RUN_ID = "scale"
THREADS = 8
"""Threads per process that poll its ranks (a thread polls a slice of them in turn)."""
CONNECTIONS = 64
"""Store connections per process: above that, simulated ranks share one (the server's work is per call). Each new
connection costs the server a reverse lookup of the client's address (``[::ffff:127.0.0.1]`` is not in /etc/hosts
here, so it goes to DNS, which sometimes answers only after its 5 s retry): 16,384 connections would take most of an
hour to open on this machine, and the connections of the real job are said apart (connect_s)."""


def _server() -> tuple[subprocess.Popen[bytes], int]:
    code = ("import datetime,sys,time\nfrom torch.distributed import TCPStore\n"
            "s=TCPStore('127.0.0.1',0,None,True,datetime.timedelta(seconds=60))\nprint(s.port,flush=True)\n"
            "time.sleep(86400)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _client(port: int) -> object:
    from torch.distributed import TCPStore

    for attempt in range(5):
        try:
            store = TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=60))
            store.set_timeout(datetime.timedelta(seconds=60))
            return store
        except Exception:  # noqa: BLE001 - a connection the server dropped under the load: again
            if attempt == 4:
                raise
            time.sleep(0.5)
    raise AssertionError


def _record(rank: int) -> dict[str, object]:
    tracker = ProgressTracker(rank)
    tracker.on_event({"kind": "begin", "name": "step", "step": 1200, "group": "world", "phase": "train"})
    return tracker.record()


class Sim:
    """One process's simulated ranks."""

    def __init__(self, port: int, ranks: list[int], world: int, connect_threads: int = 16) -> None:
        self.world = world
        self.ranks = ranks
        conns = min(len(ranks), CONNECTIONS)
        clients: dict[int, object] = {}
        lock = threading.Lock()

        def connect(part: list[int]) -> None:
            for i in part:
                client = _client(port)
                with lock:
                    clients[i] = client

        parts = [list(range(conns))[i::connect_threads] for i in range(connect_threads)]
        threads = [threading.Thread(target=connect, args=(p,)) for p in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # rank at position k uses client k % conns: with conns a multiple of THREADS, each client serves one thread
        self.channels = {r: SideChannel(clients[k % conns], RUN_ID) for k, r in enumerate(ranks)}  # type: ignore[arg-type]
        self.beats = {r: causes.Heartbeats(r, world, stale_s=1e9) for r in ranks}
        self.records = {r: _record(r) for r in ranks}

    def poll(self, r: int, lat: list[float]) -> tuple[int, bool]:
        """One rank's poll: what Watchdog._tick does on a healthy rank (publish and beat, the alarm, two peers'
        heartbeats). Returns the store calls it made and whether an alarm stands."""
        ch = self.channels[r]
        calls = 0
        t = time.perf_counter()
        ch.publish(r, self.records[r])
        ch.beat(r)
        t2 = time.perf_counter()
        lat.append((t2 - t) / 2)
        calls += 2
        t = time.perf_counter()
        standing = ch.alarm()
        lat.append(time.perf_counter() - t)
        calls += 1 + (standing is not None)
        t = time.perf_counter()
        self.beats[r].check(ch)
        lat.append((time.perf_counter() - t) / len(self.beats[r].peers))
        calls += len(self.beats[r].peers)
        return calls, standing is not None


def _worker(port: int, ranks: list[int], world: int, period_s: float, seconds: float, frozen: int | None,
            out: mp.Queue) -> None:  # type: ignore[type-arg]
    sim = Sim(port, ranks, world)
    out.put(("ready", os.getpid()))
    start_at = out_get_start(sim)
    lat: list[float] = []
    calls = [0] * THREADS
    healthy = [0] * THREADS  # calls of polls that found no alarm (the load of a healthy job)
    polls = [0] * THREADS
    lateness: list[float] = []
    seen: dict[int, float] = {}
    stop_at = start_at + seconds

    def loop(i: int) -> None:
        mine = ranks[i::THREADS]
        n = 0
        while True:
            due = start_at + n * period_s
            if due >= stop_at:
                return
            now = time.time()
            if now < due:
                time.sleep(due - now)
            else:
                lateness.append(now - due)
            for r in mine:
                if r == frozen:
                    continue  # a frozen rank polls nothing
                made, alarmed = sim.poll(r, lat)
                calls[i] += made
                if alarmed and r not in seen:
                    seen[r] = time.time()
                if not alarmed:
                    healthy[i] += made
                    polls[i] += 1
            n += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(THREADS)]
    cpu0 = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(("done", {"calls": sum(calls), "healthy": sum(healthy), "polls": sum(polls), "lat": lat[::max(len(lat) // 20000, 1)], "late": lateness,
                      "seen": seen, "cpu": time.process_time() - cpu0}))


def out_get_start(sim: Sim) -> float:
    """The common start time, handed through a key every process waits for."""
    ch = next(iter(sim.channels.values()))
    ch.store.wait([f"{RUN_ID}/start"], datetime.timedelta(seconds=900))
    return float(bytes(ch.store.get(f"{RUN_ID}/start")).decode())


def capacity(port: int, procs: int, seconds: float) -> dict[str, float]:
    """Calls per second with every core issuing the poll mix as fast as it can."""
    q: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    ps = [mp.Process(target=_cap_worker, args=(port, 16, seconds, i, q)) for i in range(procs)]
    for p in ps:
        p.start()
    got = [q.get(timeout=seconds + 120) for _ in ps]
    for p in ps:
        p.join(30)
    calls = sum(g["calls"] for g in got)
    lat = sorted(x for g in got for x in g["lat"])
    return {"calls_per_s": calls / seconds, "p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[int(len(lat) * .99)]}


def _cap_worker(port: int, conns: int, seconds: float, index: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    world = 4096
    ranks = list(range(index * conns, (index + 1) * conns))
    sim = Sim(port, ranks, world, connect_threads=4)
    lat: list[float] = []
    total = [0] * conns
    stop = time.time() + seconds

    def loop(i: int, r: int) -> None:
        while time.time() < stop:
            total[i] += sim.poll(r, lat)[0]

    threads = [threading.Thread(target=loop, args=(i, r)) for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    q.put({"calls": sum(total), "lat": lat[::max(len(lat) // 20000, 1)]})


def rank0_cpu(port: int, world: int, reps: int = 5) -> dict[str, float]:
    """Rank 0's own poll (publish, beat, alarm, two heartbeats) plus its rank-0-only view: one ``records`` read of
    every rank (the straggler view, only at world <= FULL_VIEW_MAX), parsed. CPU seconds per poll."""
    sim = Sim(port, [0], world, connect_threads=1)
    ch = sim.channels[0]
    everyone = list(range(world))
    lat: list[float] = []
    t = time.process_time()
    for _ in range(reps):
        sim.poll(0, lat)
    own = (time.process_time() - t) / reps
    view, size = 0.0, 0
    if world <= FULL_VIEW_MAX:
        t = time.process_time()
        for _ in range(reps):
            recs = ch.records(everyone)
        view = (time.process_time() - t) / reps
        size = sum(len(json.dumps(r)) for r in recs.values() if r is not None)
    return {"own_ms": own * 1e3, "view_ms": view * 1e3, "view_bytes": size}


def run_n(port: int, server_pid: int, world: int, procs: int, seconds: float, dilation: float) -> dict[str, object]:
    from torch.distributed import TCPStore

    admin = TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=600))
    ch = SideChannel(admin, RUN_ID)  # type: ignore[arg-type]
    frozen = world // 2 + 1
    q: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    ps = [mp.Process(target=_worker, args=(port, list(range(i, world, procs)), world, dilation, seconds, frozen, q))
          for i in range(procs)]
    t0 = time.time()
    for p in ps:
        p.start()
    for _ in ps:
        assert q.get(timeout=900)[0] == "ready"
    connect_s = time.time() - t0
    rss_connected = _rss_mib(server_pid)
    ch.publish(frozen, _record(frozen))  # it was alive before it froze
    admin.set(ch.key("started"), ",".join(str(r) for r in range(world)) + ",")  # every rank announced
    start = time.time() + 2.0
    admin.set(f"{RUN_ID}/start", str(start))
    # the frozen rank's neighbour finds its counter stale (here: at half the run) and raises the alarm
    # (0.37 of a poll into a period: the polls of a process come in a burst at each period's start, and an alarm
    # raised on a boundary would be seen at once; the real ranks' polls are spread, and one waits up to a poll)
    time.sleep(max(start + seconds / 2 + 0.37 * dilation - time.time(), 0))
    detected = time.time()
    ch.raise_alarm({"rank": frozen - 1, "cause": "unresponsive", "detail": f"rank {frozen} stopped", "t": detected})
    results = [q.get(timeout=seconds + 600) for _ in ps]
    for p in ps:
        p.join(60)
    done = [r[1] for r in results]
    calls = sum(d["calls"] for d in done)
    per_poll = sum(d["healthy"] for d in done) / max(sum(d["polls"] for d in done), 1)
    lat = sorted(x for d in done for x in d["lat"])
    seen = {int(r): t for d in done for r, t in d["seen"].items()}
    alive = world - 1
    fanout = (max(seen.values()) - detected) if len(seen) == alive else float("nan")
    late = sorted(x for d in done for x in d["late"])
    cpu0 = rank0_cpu(port, world)
    return {"N": world, "connect_s": round(connect_s, 1), "dilation": dilation,
            "calls_per_real_s": per_poll * world, "calls_per_rank_poll": per_poll,
            "calls_measured_per_s": calls / seconds,
            "p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[int(len(lat) * 0.99)],
            "poll_late_p99_s": late[int(len(late) * 0.99)] if late else 0.0,
            "alarm_seen": f"{len(seen)}/{alive}", "fanout_real_s": fanout / dilation,
            "rank0_cpu_ms_per_poll": cpu0["own_ms"] + cpu0["view_ms"] / straggler_every_s(world),  # a 1 s poll
            "rank0_view_bytes": cpu0["view_bytes"], "server_rss_mib": rss_connected,
            "client_cpu_s": sum(d["cpu"] for d in done)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="256,1024,4096,16384")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0, help="wall seconds of polling per N")
    ap.add_argument("--capacity-seconds", type=float, default=8.0)
    args = ap.parse_args()
    rows = []
    for n in [int(x) for x in args.ranks.split(",")]:
        server, port = _server()
        try:
            cap = capacity(port, args.procs, args.capacity_seconds)
            print(f"capacity: {cap['calls_per_s']:.0f} calls/s, p50 {cap['p50_ms']:.3f} ms, "
                  f"p99 {cap['p99_ms']:.3f} ms", flush=True)
            dilation = max(1.0, n / 512)  # ~2,800 calls/s of polling from the clients at every N
            # at least four dilated polls, the alarm at half of them
            row = run_n(port, server.pid, n, args.procs, max(args.seconds, 4 * dilation), dilation)
            row["capacity_calls_per_s"] = cap["calls_per_s"]
            row["load_share"] = row["calls_per_real_s"] / cap["calls_per_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            server.kill()
            server.wait()
    print("\n| N | dilation | calls/s (real) | calls/rank/poll | share of capacity | p50 ms | p99 ms | alarm on every "
          "rank after (real s) | rank 0 CPU/poll ms | rank 0 view bytes | server RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['N']} | {r['dilation']:g} | {r['calls_per_real_s']:.0f} | {r['calls_per_rank_poll']:.2f} | "
              f"{r['load_share']:.2f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['fanout_real_s']:.2f} "
              f"({r['alarm_seen']}) | {r['rank0_cpu_ms_per_poll']:.2f} | {r['rank0_view_bytes']} | "
              f"{r['server_rss_mib']:.0f} |")


if __name__ == "__main__":
    main()
