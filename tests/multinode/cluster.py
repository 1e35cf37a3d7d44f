"""Two "nodes" on one machine: two network namespaces joined by a veth pair, `torchrun --nnodes 2` in each.

Needs root and iproute2 (``ip netns``). :class:`TwoNodes` is a context manager that always deletes its
namespaces (the veth pair goes with them) and kills every process it started, even when the body fails.
Used by tests/multinode and bench/partition.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.213.7"
PORT = 29511

POLICY = """\
# Two nodes x 2 ranks, the synthetic kind: small deadlines so a partition is reported in seconds.
defaults:
  - _self_
run: {name: partition}
parallelism: {tp: 1, pp: 1, ep: 1}
train:
  kind: synthetic
  steps: 2000
  options: {hidden: 16, batch: 4, step_sleep_s: 0.05}
warmup: {groups: [world, dp], ops: [barrier, all_reduce]}
moe: {zero_token: {action: "off"}}
checkpoint: {every_steps: 10, keep_last: 2}
watchdog:
  poll_interval_s: 0.5
  heartbeat_stale_s: 5
  deadlines: {init: 60, warmup: 20, step: 5, checkpoint: 20, teardown: 5}
teardown: {deadline_s: 10}
"""


def why_not_available() -> str | None:
    """None when network namespaces can be made here, else why not (the tests skip with it)."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"lcprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


@dataclass
class Node:
    name: str  # namespace
    index: int
    addr: str
    dev: str
    proc: subprocess.Popen[bytes] | None = None
    out: Path | None = None
    exited_at: float | None = None

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out and self.out.exists() else ""

    def pids(self) -> list[int]:
        got = _ip("netns", "pids", self.name, check=False)
        return [int(p) for p in got.stdout.split()] if got.returncode == 0 else []

    def rank_pids(self) -> list[int]:
        """Processes of this node that are ranks (not the torchrun agent)."""
        out = []
        for pid in self.pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "lifecycle" in cmd and "torch.distributed.run" not in cmd:
                out.append(pid)
        return out

    def agent_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


@dataclass
class TwoNodes:
    """``with TwoNodes(tmp) as nodes: nodes.start(...); nodes.cut(); ...``"""

    tmp: Path
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    nodes: list[Node] = field(default_factory=list)
    policy_dir: Path | None = None

    def __enter__(self) -> TwoNodes:
        self.nodes = [Node(f"lcA{self.tag}", 0, f"{SUBNET}.1", f"lcvA{self.tag}"),
                      Node(f"lcB{self.tag}", 1, f"{SUBNET}.2", f"lcvB{self.tag}")]
        try:
            for n in self.nodes:
                _ip("netns", "add", n.name)
                _ip("-n", n.name, "link", "set", "lo", "up")
            a, b = self.nodes
            _ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
            for n in self.nodes:
                _ip("link", "set", n.dev, "netns", n.name)
                _ip("-n", n.name, "addr", "add", f"{n.addr}/24", "dev", n.dev)
                _ip("-n", n.name, "link", "set", n.dev, "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.policy_dir = self.tmp / "policies"
        self.policy_dir.mkdir(parents=True, exist_ok=True)
        (self.policy_dir / "partition.yaml").write_text(POLICY)
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()
        for n in self.nodes:
            _ip("netns", "del", n.name, check=False)

    # ---- processes ----------------------------------------------------------------------------------
    def command(self, node: Node, *overrides: str) -> list[str]:
        return ["ip", "netns", "exec", node.name, "env", f"GLOO_SOCKET_IFNAME={node.dev}", "OMP_NUM_THREADS=1",
                "PYTHONUNBUFFERED=1", sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--node-rank", str(node.index), "--nproc-per-node", "2", "--master-addr", self.nodes[0].addr,
                "--master-port", str(PORT), "--max-restarts", "0", "--monitor-interval", "0.1",
                "-m", "lifecycle", "run", "-d", str(self.policy_dir), "-n", "partition",
                f"run.dir={self.tmp / f'node{node.index}' / 'run'}", f"checkpoint.dir={self.tmp / 'ckpt'}",
                *overrides]

    def start(self, *overrides: str, attempt: int = 1) -> None:
        for n in self.nodes:
            n.out = self.tmp / f"node{n.index}.attempt{attempt}.log"
            n.exited_at = None
            with n.out.open("wb") as f:
                n.proc = subprocess.Popen(self.command(n, *overrides), stdout=f, stderr=subprocess.STDOUT,
                                          cwd=ROOT, start_new_session=True)

    def wait_for(self, path: Path, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if path.exists() or any(n.proc is not None and n.proc.poll() is not None for n in self.nodes):
                return path.exists()
            time.sleep(0.1)
        return False

    def cut(self) -> float:
        """Take node B's end of the link down; returns the monotonic time of the cut."""
        _ip("-n", self.nodes[1].name, "link", "set", self.nodes[1].dev, "down")
        return time.monotonic()

    def mend(self) -> None:
        _ip("-n", self.nodes[1].name, "link", "set", self.nodes[1].dev, "up")

    def kill_agent(self, node: Node) -> float:
        """SIGKILL the torchrun agent of ``node`` (its ranks are left running, orphaned)."""
        assert node.proc is not None
        os.kill(node.proc.pid, signal.SIGKILL)
        node.proc.wait(10)
        return time.monotonic()

    def wait_ranks_gone(self, timeout_s: float) -> dict[str, float | None]:
        """Monotonic time at which each node had no rank process left (None: still there at the timeout)."""
        end = time.monotonic() + timeout_s
        gone: dict[str, float | None] = {n.name: None for n in self.nodes}
        while time.monotonic() < end and any(v is None for v in gone.values()):
            for n in self.nodes:
                if gone[n.name] is None and not n.rank_pids():
                    gone[n.name] = time.monotonic()
            time.sleep(0.1)
        return gone

    def wait_agents(self, timeout_s: float) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for n in self.nodes:
            if n.proc is None:
                continue
            try:
                out[n.name] = n.proc.wait(max(timeout_s, 0.1))
            except subprocess.TimeoutExpired:
                out[n.name] = None
        return out

    def kill_all(self) -> None:
        for n in self.nodes:
            for pid in n.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if n.proc is not None and n.proc.poll() is None:
                try:
                    os.killpg(n.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    n.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
