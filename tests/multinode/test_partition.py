"""Two nodes (network namespaces joined by a veth pair), `torchrun --nnodes 2` on each: a clean run, the link
cut mid-train, the store's host killed, and a re-run that resumes. Every rank must leave on its own within
step deadline + heartbeat_stale_s + 10 s, naming the other side or the lost store (ranks whose torchrun agent is killed
die with it).

Needs root and `ip netns` (skipped with the reason otherwise). Every namespace and process is removed at
the end, whatever happens.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.multinode.cluster import TwoNodes, why_not_available

_WHY = why_not_available()
pytestmark = [pytest.mark.multinode, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

STEP_S, STALE_S = 5.0, 5.0
BOUND_S = STEP_S + STALE_S + 10.0
RANKS = {0: (0, 1), 1: (2, 3)}  # node index -> global ranks


def _exit_codes(tmp: Path, node: int) -> dict[int, int | str]:
    """Per rank of ``node``: the exit code its events recorded (or how it ended without one)."""
    out: dict[int, int | str] = {}
    for rank in RANKS[node]:
        path = tmp / f"node{node}" / "run" / "events" / f"rank_{rank}.jsonl"
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() \
            else []
        ends = [e for e in events if e.get("name") in ("exit", "teardown_deadline")]
        out[rank] = ends[-1].get("exit_code", "?") if ends else "no exit event"
    return out


def _committed_step(tmp: Path) -> int:
    return int((tmp / "ckpt" / "latest_checkpointed_iteration.txt").read_text())


def _start_and_wait_for_a_checkpoint(c: TwoNodes, tmp: Path) -> None:
    c.start("train.steps=300")
    assert c.wait_for(tmp / "ckpt" / "latest", 90), [n.output()[-3000:] for n in c.nodes]
    time.sleep(1.0)


def _gone_within_bound(c: TwoNodes, since: float) -> None:
    gone = c.wait_ranks_gone(BOUND_S + 20)
    took = {name: (t - since if t is not None else None) for name, t in gone.items()}
    assert all(t is not None and t <= BOUND_S for t in took.values()), (took, BOUND_S)


@pytest.mark.timeout(150)
def test_a_clean_two_node_run_exits_0_on_both_nodes(tmp_path: Path) -> None:
    with TwoNodes(tmp_path) as c:
        c.start("train.steps=30")
        codes = c.wait_agents(120)
        assert codes == {n.name: 0 for n in c.nodes}, [n.output()[-3000:] for n in c.nodes]
        assert all(not n.rank_pids() for n in c.nodes)
        assert _committed_step(tmp_path) == 30
        assert _exit_codes(tmp_path, 0) == {0: 0, 1: 0} and _exit_codes(tmp_path, 1) == {2: 0, 3: 0}


@pytest.mark.timeout(170)
def test_a_cut_link_takes_every_rank_down_in_bounded_time_and_a_rerun_resumes(tmp_path: Path) -> None:
    with TwoNodes(tmp_path) as c:
        _start_and_wait_for_a_checkpoint(c, tmp_path)
        _gone_within_bound(c, c.cut())
        a, b = c.nodes
        # Each side names the other side's ranks or the lost store.
        assert re.search(r"rank [23]\b|\b2-3\b|side channel lost", a.output()), a.output()[-4000:]
        assert re.search(r"rank [01]\b|\b0-1\b|side channel lost|store \S+ does not answer", b.output()), \
            b.output()[-4000:]
        for node in (0, 1):
            codes = _exit_codes(tmp_path, node)
            assert all(code not in (0, "no exit event") for code in codes.values()), (node, codes)
        c.wait_agents(30)
        c.kill_all()
        assert all(not n.rank_pids() for n in c.nodes)
        last = _committed_step(tmp_path)
        c.mend()
        c.start(f"train.steps={last + 20}", attempt=2)  # the same commands again, 20 steps further
        codes = c.wait_agents(120)
        assert codes == {n.name: 0 for n in c.nodes}, [n.output()[-3000:] for n in c.nodes]
        assert f"attempt 2: resumed from step {last}" in a.output()
        assert _committed_step(tmp_path) == last + 20


@pytest.mark.timeout(150)
def test_killing_the_store_host_takes_every_rank_down_in_bounded_time(tmp_path: Path) -> None:
    with TwoNodes(tmp_path) as c:
        _start_and_wait_for_a_checkpoint(c, tmp_path)
        killed = c.kill_agent(c.nodes[0])  # torchrun's agent on node A hosts the rendezvous store
        # Node A's ranks die with their agent (the parent-death signal): none outlives its launcher.
        gone = c.wait_ranks_gone(5)
        assert gone[c.nodes[0].name] is not None and gone[c.nodes[0].name] - killed < 3, (gone, killed)
        _gone_within_bound(c, killed)
        a, b = c.nodes
        # Node B names what it lost: the store, or node A's ranks (its collective's peers at node A's address).
        peer = re.escape(a.addr)  # a closed or reset connection to node A's address, as gloo words either
        assert re.search(rf"side channel lost: store \S+ unreachable|Connection closed by peer \[{peer}\]"
                         rf"|\[{peer}\]:\d+: Connection reset by peer", b.output()), b.output()[-4000:]
        assert set(_exit_codes(tmp_path, 0).values()) == {"no exit event"}  # killed with the agent: nothing written
        codes = _exit_codes(tmp_path, 1)
        assert all(code not in (0, "no exit event") for code in codes.values()), codes
        assert _committed_step(tmp_path) >= 10
