"""Restart in place (``restart.mode: in_process``): which failures it takes, the agreement on a real store, giving up
a peer's blocked reads on real sockets, and what the summary makes of it. No process groups here: those are
tests/distributed/test_restarts.py."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lifecycle.distributed.sockets import cut_connections
from lifecycle.obs.summary import current_attempt, in_process_restarts
from lifecycle.recovery import inprocess
from lifecycle.rundir import write_marker


def _ctx(tmp_path: Path, rank: int = 0, world: int = 4, **restart: object) -> Any:
    from lifecycle.policy.load import load

    policy = load(["restart.mode=in_process", "restart.max_restarts=2", "restart.in_process_deadline_s=0.5",
                          *(f"restart.{k}={v}" for k, v in restart.items())]).policy
    return SimpleNamespace(policy=policy, rank=rank, world_size=world, run_dir=tmp_path, attempt=1, own_loop=False,
                           progress=SimpleNamespace(restarts_left=policy.restart.max_restarts))


def test_only_failures_the_processes_survive_restart_in_place(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    for cause in ("failed", "sequence", "peer"):
        assert inprocess.refusal(ctx, "train", cause) is None, cause
    assert inprocess.refusal(ctx, "checkpoint", "failed") is None
    assert "gloo cannot abort" in str(inprocess.refusal(ctx, "train", "hang"))
    assert "died" in str(inprocess.refusal(ctx, "train", "dead"))
    assert "stopped answering" in str(inprocess.refusal(ctx, "train", "unresponsive"))
    assert "configuration" in str(inprocess.refusal(ctx, "train", "usage"))
    assert "launcher is stopping" in str(inprocess.refusal(ctx, "train", "shutdown"))
    assert "phase init" in str(inprocess.refusal(ctx, "init", "failed"))
    assert "phase teardown" in str(inprocess.refusal(ctx, "teardown", "failed"))
    ctx.progress.restarts_left = 0
    assert "restarts are spent (restart.max_restarts=2)" in str(inprocess.refusal(ctx, "train", "failed"))
    ctx.progress.restarts_left, ctx.own_loop = 1, True
    assert "lifecycle.attach" in str(inprocess.refusal(ctx, "train", "failed"))


def _agree_all(tmp_path: Path, votes: dict[int, str | None], world: int = 4, deadline_s: float = 5.0) -> dict[int, Any]:
    """Each rank of ``votes`` (rank -> refusal or None) agrees on one real store, on its own thread."""
    from torch.distributed import HashStore

    store = HashStore()
    out: dict[int, Any] = {}
    ctxs = {r: _ctx(tmp_path, r, world) for r in votes}  # composed here: Hydra's compose is not for threads

    def one(rank: int) -> None:
        out[rank] = inprocess.agree(ctxs[rank], store, votes[rank], deadline_s)

    threads = [threading.Thread(target=one, args=(r,)) for r in votes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(out) == len(votes)
    return out


def test_every_rank_agrees_when_all_came_and_none_refused(tmp_path: Path) -> None:
    assert _agree_all(tmp_path, dict.fromkeys(range(4))) == dict.fromkeys(range(4))


def test_one_refusal_turns_every_rank_to_a_relaunch_with_its_reason(tmp_path: Path) -> None:
    out = _agree_all(tmp_path, {0: None, 1: "a rank died: its process is gone", 2: None, 3: None})
    assert out[1] == "a rank died: its process is gone"
    assert all(out[r] == "rank 1: a rank died: its process is gone" for r in (0, 2, 3)), out


def test_a_rank_that_never_comes_is_named_at_the_deadline(tmp_path: Path) -> None:
    out = _agree_all(tmp_path, {0: None, 1: None, 2: None}, deadline_s=0.3)
    assert all("rank 3 did not come within 0.5s (restart.in_process_deadline_s)" in str(v) for v in out.values()), out


def test_the_launchers_marker_ends_the_wait(tmp_path: Path) -> None:
    write_marker(tmp_path, "rank 2 exited", rank=2, how="exit 17")
    out = _agree_all(tmp_path, {0: None, 1: None}, deadline_s=30)
    assert all(v == "the launcher is stopping the job (a rank ended)" for v in out.values()), out


def _pair(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(server.getsockname()[:2])
    accepted, _ = server.accept()
    return client, accepted


def test_cutting_gives_up_a_peers_blocked_read_and_keeps_the_store_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as group, socket.create_server(("127.0.0.1", 0)) as store:
        mine, peer = _pair(group)          # a process group's connection: the peer waits on it
        to_store, store_end = _pair(store)  # the store's: kept
        peer.settimeout(10)
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(peer.recv(16)))
        reader.start()
        assert cut_connections(store.getsockname()[1]) >= 1
        reader.join(10)
        assert got == [b""]  # the peer's blocked read ended at once (EOF), as gloo's does: "closed by peer"
        to_store.sendall(b"ok")
        store_end.settimeout(10)
        assert store_end.recv(2) == b"ok"
        for s in (mine, peer, to_store, store_end):
            s.close()


def _ev(name: str, kind: str = "instant", t: float = 0.0, **fields: Any) -> dict[str, Any]:
    return {"t": int(t * 1e6), "rank": 0, "phase": "train", "kind": kind, "name": name, **fields}


def test_the_summary_takes_the_last_attempt_and_times_each_restart_in_place() -> None:
    events = [_ev("attempt", attempt=1), _ev("step", "end", 1.0, dur_us=1000), _ev("failure", t=2.0),
              _ev("restart_in_process", t=2.5, failed_attempt=1, exit_code=4, error="rank 2 raised X", cause="failed",
                  culprits=[2], failed_phase="train", last_step=6, failed_at=2.0, report_s=0.05, destroy_s=0.1, agree_s=0.2),
              _ev("attempt", t=2.5, attempt=2, in_process=True),
              _ev("phase:init", "end", 3.0, dur_us=400_000), _ev("phase:warmup", "end", 3.2, dur_us=200_000),
              _ev("resume", "end", 3.5, dur_us=300_000), _ev("step", "end", 3.9, dur_us=400_000),
              _ev("step", "end", 4.0, dur_us=100_000)]
    assert [e["name"] for e in current_attempt(events)][:2] == ["attempt", "phase:init"]
    assert current_attempt(events[:3]) == events[:3]
    [r] = in_process_restarts(events)
    assert r["culprits"] == [2] and r["failed_attempt"] == 1 and r["restart_s"] == pytest.approx(1.9)
    assert r["stages"] == {"report_s": 0.05, "destroy_s": 0.1, "agree_s": 0.2, "init_s": 0.4, "warmup_s": 0.2, "load_s": 0.3,
                           "first_step_s": 0.4}


def test_in_process_without_restarts_is_refused_and_the_plan_shows_the_restart() -> None:
    from lifecycle.errors import PolicyError
    from lifecycle.machine.plan import build_plan
    from lifecycle.policy.load import load

    with pytest.raises(PolicyError, match=r"restart\.mode: in_process restarts nothing with restart\.max_restarts=0"):
        load(["restart.mode=in_process"])
    plan = build_plan(load(["restart.mode=in_process", "restart.max_restarts=3"]).policy, None).as_dict()
    [step] = [a for a in plan["teardown"] if a["op"] == "restart_in_place"]
    assert "up to 3 times" in step["detail"] and step["deadline_s"] == 60.0
    assert not [a for a in build_plan(load([]).policy, None).as_dict()["teardown"] if a["op"] == "restart_in_place"]


def test_a_relaunch_after_a_restart_in_place_lists_both_earlier_attempts(tmp_path: Path) -> None:
    import json

    from lifecycle.obs.summary import build

    (tmp_path / "attempts" / "1").mkdir(parents=True)  # restarted in place: only its hang report was kept
    (tmp_path / "attempts" / "1" / "hang_report.json").write_text("{}")
    (tmp_path / "attempts" / "2").mkdir()
    (tmp_path / "attempts" / "2" / "summary.json").write_text(json.dumps({
        "exit_code": 3, "outcome": "rank 1 hung", "last_step": 9, "in_process_restarts": [
            {"failed_attempt": 1, "exit_code": 4, "error": "rank 2 raised X", "cause": "failed", "culprits": [2],
             "failed_phase": "train", "last_step": 6, "restart_s": 0.7, "stages": {"report_s": 0.5}}, "junk"]}))
    earlier = build(tmp_path)["earlier_attempts"]
    assert [(a["attempt"], a["mode"], a["exit_code"]) for a in earlier] == [(1, "in_process", 4), (2, "relaunch", 3)]
    assert earlier[0]["blame"]["ranks"] == [2] and "in_process_restarts" not in earlier[1]
