"""Watchdog parts without rank processes: the progress tracker, the diagnosis, the causes, the side channel
on a real in-process TCPStore, and the sequence check on a real HashStore shared by threads."""

from __future__ import annotations

import datetime
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lifecycle.distributed.groups import ResolvedGroup
from lifecycle.errors import HangError, PhaseError
from lifecycle.rundir import SHUTDOWN_MARKER
from lifecycle.watchdog import causes, diagnosis, seqcheck
from lifecycle.watchdog.causes import Cause
from lifecycle.watchdog.sidechannel import SideChannel
from lifecycle.watchdog.tracker import ProgressTracker

torch_dist = pytest.importorskip("torch.distributed")


def _ev(kind: str, name: str, phase: str = "warmup", **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "name": name, "phase": phase, **fields}


def _rec(rank: int, phase: str, op: list[Any] | None, begun: dict[str, int], *, last: list[Any] | None = None,
         ranks: list[int] | None = None, sync: int = 0, state: str = "running") -> dict[str, Any]:
    return {"rank": rank, "state": state, "phase": phase, "step": None, "op": op, "last": last or op,
            "ranks": ranks, "begun": begun, "idle_s": 1.0, "t": 100.0, "sync": sync}


# ---- tracker --------------------------------------------------------------------------------------
def test_tracker_counts_ops_per_group_and_keeps_the_open_span() -> None:
    asked: list[str] = []
    t = ProgressTracker(0, members=lambda label: asked.append(label) or [0, 1])
    t.on_event(_ev("begin", "phase:warmup"))
    t.on_event(_ev("begin", "warm:barrier", group="tp", ranks=[0, 1]))
    t.on_event(_ev("end", "warm:barrier", group="tp"))
    t.on_event(_ev("begin", "barrier:after_warmup", group="dp"))
    t.on_event(_ev("begin", "barrier:after_warmup", group="dp"))  # a second begin: the label is resolved once
    t.on_event({"kind": "instant", "name": "fault_drill", "phase": "warmup"})
    rec = t.record()
    assert rec["begun"] == {"world": 1, "tp": 1, "dp": 2}
    assert rec["op"] == ["barrier:after_warmup", "dp", 2, None] and rec["ranks"] == [0, 1]
    assert asked == ["dp"]
    assert t.waiting_in() is not None and t.idle_s() < 5


def test_tracker_keeps_the_op_an_exception_left_and_freezes_after_failure() -> None:
    t = ProgressTracker(3)
    t.on_event(_ev("begin", "step", phase="train", step=2))
    t.on_event(_ev("end", "step", phase="train", step=2, outcome="error: HangError"))
    assert t.record()["op"] == ["step", "world", 1, 2]
    t.set_state("failed", "HangError: x")
    t.on_event(_ev("begin", "teardown:failure", phase="teardown"))
    rec = t.record()
    assert rec["phase"] == "train" and rec["state"] == "failed" and rec["begun"] == {"world": 1}
    assert t.waiting_in() is None


def test_tracker_survives_a_failing_member_lookup() -> None:
    t = ProgressTracker(0, members=lambda label: 1 / 0)  # type: ignore[arg-type,return-value]
    t.on_event(_ev("begin", "barrier:x", group="dp"))
    assert t.record()["ranks"] is None


def test_store_keys_are_numbered_in_call_order_and_counted() -> None:
    from lifecycle.context import RunContext
    from lifecycle.policy.load import validate

    ctx = RunContext.of(validate({}), Path("."), 0, 1, 0, None, None, None)  # type: ignore[arg-type]
    assert [ctx.ops.next_key("x") for _ in range(3)] == ["lifecycle/x/0", "lifecycle/x/1", "lifecycle/x/2"]
    assert ctx.ops.snapshot()[1] == 3


# ---- diagnosis ------------------------------------------------------------------------------------
def test_the_stalled_rank_is_the_culprit_not_the_ranks_waiting_on_it() -> None:
    records = {
        0: _rec(0, "warmup", ["warm:all_reduce", "tp", 2, None], {"world": 3, "tp": 2}, ranks=[0, 1]),
        1: _rec(1, "warmup", None, {"world": 3, "tp": 1}, last=["warm:barrier", "tp", 1, None], ranks=[0, 1]),
        2: _rec(2, "warmup", ["warm:barrier", "tp_dp", 1, None], {"world": 3, "tp": 2, "tp_dp": 1},
                ranks=[0, 1, 2, 3]),
        3: _rec(3, "warmup", ["warm:barrier", "tp_dp", 1, None], {"world": 3, "tp": 2, "tp_dp": 1},
                ranks=[0, 1, 2, 3]),
    }
    d = diagnosis.diagnose("hang", "rank 0 made no progress", records, 4, phase="warmup", now=100.0)
    assert d.culprits == [1]
    assert d.waits[0].missing == [1] and d.waits[2].missing == [0, 1] and d.waits[1].missing == []
    text = diagnosis.render(d, 0)
    assert text.splitlines()[0].startswith("[rank 0] lifecycle watchdog: HANG in phase warmup")
    assert "rank 0 waits in warm:all_reduce on group tp (op #2 on tp): arrived [0], missing [1]" in text
    assert "stuck: rank 1 [alive]: phase warmup, after op warm:barrier on group tp (#1)" in text
    assert json.loads(json.dumps(d.to_json()))["culprits"] == [1]


@pytest.mark.parametrize("frozen", [0, 1, 2, 3])
def test_a_rank_frozen_in_its_own_code_is_the_one_culprit_whatever_its_partners(frozen: int) -> None:
    """Ranks 0-1 and 2-3 are tp (or ep) partners, untraced collectives between them; 0-2 and 1-3 dp partners in a
    traced gradient reduction. The frozen rank's partner waits inside its step too, but blocked in a collective."""
    partner = frozen ^ 1
    step = ["step", "world", 19, 3]
    records: dict[int, dict[str, Any] | None] = {}
    for r in range(4):
        if r in (frozen, partner):
            records[r] = {**_rec(r, "train", step, {"world": 19, "dp": 5}), "blocked": "own code" if r == frozen
                          else "collective"}
        else:
            records[r] = {**_rec(r, "train", ["grad_reduce", "dp", 6, 3], {"world": 19, "dp": 6}, ranks=[0, 1, 2, 3]),
                          "blocked": "collective"}
    d = diagnosis.diagnose("hang", "no progress", records, 4, phase="train", now=100.0)
    assert d.culprits == [frozen], d.culprits
    assert f"stuck: rank {frozen} [alive]: phase train, in op step on group world (#19), busy in its own code" in \
        diagnosis.render(d, partner)
    for r in (frozen, partner):  # nobody looked where they are (an older record): both stay named
        del records[r]["blocked"]  # type: ignore[index]
    assert diagnosis.diagnose("hang", "x", records, 4, phase="train", now=100.0).culprits == sorted({frozen, partner})


def test_the_innermost_span_with_its_own_deadline_bounds_the_rank() -> None:
    t = ProgressTracker(0)
    t.on_event(_ev("begin", "setup", "train", deadline="setup"))  # a trainer's set-up after attach
    assert t.bound() == "setup"
    t.on_event(_ev("begin", "watch", "train", deadline="setup"))
    t.on_event(_ev("begin", "resume", "train", deadline="checkpoint"))  # a load, not a step
    assert t.bound() == "checkpoint"
    t.on_event(_ev("end", "resume", "train"))
    t.on_event(_ev("end", "watch", "train"))
    t.on_event(_ev("end", "setup", "train"))
    t.on_event(_ev("begin", "step", "train", step=1))
    assert t.bound() == "step"
    t.on_event(_ev("begin", "eval", "train", step=1, deadline="eval", group="trainer", ranks=[0]))
    assert t.bound() == "eval" and t.begun["world"] == 4  # a trainer's phase is not an op every rank runs
    t.on_event(_ev("begin", "all_reduce", "train", step=1, group="dp"))  # a collective inside it: the phase's
    assert t.bound() == "step"
    cause = causes.deadline_passed(t, 0.0, 0, bound="eval")
    assert cause is not None and "the eval deadline is 0s" in cause.detail


def test_the_tracker_says_where_an_idle_training_thread_is_blocked() -> None:
    import torch.distributed as dist

    t = ProgressTracker(0)
    t.on_event(_ev("begin", "step", "train", step=1))
    t.t_progress -= 5.0
    assert t.record()["blocked"] == "own code"  # this thread, here: test code
    ready = threading.Event()
    waiting = ProgressTracker(1)
    store = dist.HashStore()
    c10d: Any = dist.distributed_c10d

    def in_a_collective() -> None:
        waiting.on_event(_ev("begin", "step", "train", step=1))
        ready.set()
        # A torch.distributed call that blocks until its peer comes, as a collective does.
        c10d._store_based_barrier(1, store, "x", 2, datetime.timedelta(seconds=20))

    thread = threading.Thread(target=in_a_collective, daemon=True)
    thread.start()
    ready.wait(5)
    time.sleep(0.5)
    waiting.t_progress -= 5.0
    blocked = waiting.record()["blocked"]
    store.set(f"{c10d.STORE_BASED_BARRIER_PREFIX}:x:last_worker", "1")  # the peer came
    thread.join(10)
    assert blocked == "collective"


def test_a_rank_behind_on_store_sync_points_is_named_when_no_span_shows_it() -> None:
    same = ["phase:checkpoint", "world", 16, 2]
    records = {r: _rec(r, "checkpoint", None, {"world": 16}, last=same, sync=2 if r != 1 else 1) for r in range(4)}
    d = diagnosis.diagnose("hang", "x", records, 4, phase="checkpoint", now=100.0)
    assert d.culprits == [1] and d.lagging == {1: 1}
    assert "it passed 1 store sync points" in diagnosis.render(d, 0)


def test_dead_and_failed_ranks_are_the_culprits() -> None:
    records: dict[int, dict[str, Any] | None] = {
        0: _rec(0, "train", ["step", "world", 9, 3], {"world": 9}), 1: None,
        2: _rec(2, "train", ["step", "world", 9, 3], {"world": 9}, state="failed")}
    d = diagnosis.diagnose("dead", "rank 1 ended", records, 3, dead={1: "exit 4"}, origin=1, now=100.0)
    assert d.culprits == [1]
    assert "stuck: rank 1 [DEAD (exit 4)]: never reported" in diagnosis.render(d, 0)
    d = diagnosis.diagnose("failed", "rank 2 raised", records, 3, origin=2, now=100.0)
    assert d.culprits == [2]


def test_a_rank_that_left_reporting_a_hang_is_a_reporter_not_the_culprit() -> None:
    """Ranks 0, 2, 3 wait in init for rank 1; rank 2's watchdog fired first and it left with the hang code: rank 3
    sees rank 2 dead, yet the stuck rank is 1, the one every wait misses."""
    waiting = ["init_process_group", "world", 3, None]
    records: dict[int, dict[str, Any] | None] = {
        0: _rec(0, "init", waiting, {"world": 3}, ranks=[0, 1, 2, 3]),
        1: _rec(1, "init", None, {"world": 2}, last=["import:backend", "world", 2, None], ranks=[0, 1, 2, 3]),
        2: {**_rec(2, "init", waiting, {"world": 3}, ranks=[0, 1, 2, 3]), "state": "aborted",
            "error": "watchdog: hang"},
        3: _rec(3, "init", waiting, {"world": 3}, ranks=[0, 1, 2, 3]),
    }
    d = diagnosis.diagnose("dead", "rank 2 ended (exit 3)", records, 4, dead={2: "exit 3"}, origin=2, now=100.0)
    assert d.culprits == [1]
    assert "stuck: rank 1 [" in diagnosis.render(d, 3)
    records[2] = {**records[2], "error": None, "state": "failed"}  # a rank that failed by itself stays the cause
    d = diagnosis.diagnose("dead", "rank 2 ended (exit 4)", records, 4, dead={2: "exit 4"}, origin=2, now=100.0)
    assert d.culprits == [2]


def test_stale_records_are_dead() -> None:
    records = {0: _rec(0, "train", None, {}), 1: {**_rec(1, "train", None, {}), "t": 50.0},
               2: {**_rec(2, "train", None, {}, state="exited"), "t": 10.0}}
    assert list(diagnosis.stale_ranks(records, now=100.0, stale_s=30.0)) == [1]


def test_crossed_waits_are_a_divergence_and_lockstep_ranks_are_not() -> None:
    mine = ProgressTracker(0)  # rank 0: tp #1 done, blocked in tp #2; rank 1 skipped tp #2, blocked in mp #1
    mine.on_event(_ev("begin", "warm:barrier", group="tp", ranks=[0, 1]))
    mine.on_event(_ev("end", "warm:barrier", group="tp"))
    mine.on_event(_ev("begin", "warm:all_reduce", group="tp", ranks=[0, 1]))
    op = mine.waiting_in()
    peer = _rec(1, "warmup", ["warm:barrier", "mp", 1, None], {"tp": 1, "mp": 1}, ranks=[0, 1])
    found = diagnosis.crossed(0, op, {"tp": 2}, {1: peer}, 2)
    assert found is not None and found[1] == [0, 1] and "ranks 0 and 1 wait for each other" in found[0]
    # The peer is merely behind in the same program (it will reach tp #2 after tp #1): no divergence.
    behind = _rec(1, "warmup", ["warm:barrier", "tp", 1, None], {"tp": 1}, ranks=[0, 1])
    assert diagnosis.crossed(0, op, {"tp": 2}, {1: behind}, 2) is None


# ---- causes ---------------------------------------------------------------------------------------
def test_classify() -> None:
    from lifecycle.errors import DrillError, SequenceMismatch, Shutdown

    class LookAlike(BaseException):  # matched by type, not by its name
        pass

    LookAlike.__name__ = "Shutdown"
    assert causes.classify(HangError("x")) == "hang"
    assert causes.classify(SequenceMismatch("x", ranks=[1])) == "sequence"
    assert causes.classify(Shutdown("launcher")) == "shutdown"
    assert causes.classify(LookAlike("launcher")) == "failed"
    assert causes.classify(PhaseError("all_reduce failed: Connection closed by peer [127.0.0.1]:1")) == "peer"
    assert causes.classify(RuntimeError("Socket Timeout: timed out after 30s")) == "hang"
    assert causes.classify(DrillError("fault drill: raise")) == "failed"


def test_marker_names_the_rank_that_ended(tmp_path: Path) -> None:
    assert causes.from_marker(tmp_path) is None
    (tmp_path / SHUTDOWN_MARKER).write_text(json.dumps({"reason": "rank 2 failed (exit 4)", "rank": 2,
                                                                "how": "exit 4", "phase": "train"}))
    cause = causes.from_marker(tmp_path)
    assert cause is not None and cause.dead == {2: "exit 4"} and cause.phase == "train" and not cause.urgent


def test_deadline_cause_names_the_op() -> None:
    t = ProgressTracker(2)
    t.on_event(_ev("begin", "warm:barrier", group="tp", ranks=[2, 3]))
    assert causes.deadline_passed(t, 60.0, 2) is None
    cause = causes.deadline_passed(t, 0.0, 2)
    assert cause is not None and cause.urgent and "at warm:barrier on group tp" in cause.detail


# ---- side channel on a real TCPStore ----------------------------------------------------------------
@pytest.fixture
def channel() -> Any:
    server = torch_dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    client = torch_dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=5))
    yield SideChannel(client, "unit")
    del client, server


def test_side_channel_records_alarm_and_heartbeats(channel: SideChannel) -> None:
    channel.announce(0, {"rank": 0, "state": "running"})
    channel.announce(2, {"rank": 2, "state": "exited"})
    assert channel.started() == [0, 2]
    assert channel.records([0, 1, 2]) == {0: {"rank": 0, "state": "running"}, 1: None,
                                          2: {"rank": 2, "state": "exited"}}
    first = Cause("hang", "rank 3 stuck", 3, "warmup", {}, [1]).alarm(3)
    assert channel.raise_alarm(first)["rank"] == 3
    assert channel.raise_alarm(Cause("dead", "later", 0, "warmup").alarm(0))["rank"] == 3  # first one stands
    seen = causes.from_alarm(channel.clone(), rank=0)
    assert seen is not None and seen.kind == "hang" and seen.hint == [1] and seen.origin == 3
    assert causes.from_alarm(channel, rank=3) is None  # a rank does not react to its own alarm

    beats = causes.Heartbeats(rank=1, world=3, stale_s=0.05)  # watches rank 2 and rank 0
    channel.beat(0)
    channel.beat(2)
    assert beats.check(channel) is None
    time.sleep(0.1)
    dead = beats.check(channel)  # rank 0 stopped beating and still says "running"; rank 2 exited
    # Silent without exiting (frozen, cut off): reported at once, with the hang code, not as a rank that failed.
    assert dead is not None and dead.kind == "unresponsive" and list(dead.dead) == [0] and dead.urgent


def test_a_report_reads_the_records_peers_publish_after_the_stall_not_before(channel: SideChannel) -> None:
    from lifecycle.watchdog.core import fresh_records

    def rec(rank: int, op: list[Any], begun: dict[str, int], t: float, **more: Any) -> dict[str, Any]:
        return {"rank": rank, "state": "running", "op": op, "ranks": [0, 1, 2], "begun": begun, "t": t, **more}

    step, reduce = ["step", "world", 19, 3], ["grad_reduce", "dp", 6, 3]
    me = rec(0, reduce, {"world": 19, "dp": 6}, 10.0, blocked="collective")
    channel.announce(1, rec(1, step, {"world": 19, "dp": 5}, 1.0))  # published before it reached the reduce
    channel.announce(2, rec(2, step, {"world": 19, "dp": 5}, 1.0, blocked="own code"))  # frozen: never again
    channel.announce(3, {"rank": 3, "state": "exited", "t": 1.0})
    first = {**channel.records([1, 2, 3]), 0: me}
    stale = diagnosis.diagnose("hang", "rank 2 stuck", first, 3, origin=2)
    assert stale.culprits == [1, 2]  # rank 1's old record shows it behind: a wrong name

    later = threading.Timer(0.2, lambda: channel.publish(1, rec(1, reduce, {"world": 19, "dp": 6}, 2.0)))
    later.start()
    t0 = time.monotonic()
    records = fresh_records(first, channel.records, 0, poll_s=0.4)
    took = time.monotonic() - t0
    later.join()
    assert records[1]["t"] == 2.0 and records[2]["t"] == 1.0 and records[3]["state"] == "exited"
    assert 0.2 <= took < 1.0, took  # rank 1 published at 0.2 s; frozen rank 2 bounds the wait at 1.5 polls
    assert diagnosis.diagnose("hang", "rank 2 stuck", records, 3, origin=2).culprits == [2]
    # the store stops answering: the wait ends at once with what was read
    t0 = time.monotonic()
    assert fresh_records(first, lambda ranks: None, 0, poll_s=0.4)[1]["t"] == 1.0
    assert time.monotonic() - t0 < 0.3



def test_a_failure_report_waits_only_for_peers_that_did_not_publish_since_the_failure(channel: SideChannel) -> None:
    """A dead or failed rank is the culprit whatever the others show: the report waits (up to its bound) only for
    the running peers whose records are older than the failure; the dead rank, and a peer whose record came after
    the failure became known, are not waited for."""
    from lifecycle.watchdog.core import fresh_records

    def rec(rank: int, t: float) -> dict[str, Any]:
        return {"rank": rank, "state": "running", "op": ["step", "world", 5, 3], "t": t}

    now = time.time()
    channel.announce(1, rec(1, now - 5.0))  # the dead rank: its last record, never again
    channel.announce(2, rec(2, now + 0.01))  # published after the failure (its watchdog woke on the signal)
    first = channel.records([1, 2])
    t0 = time.monotonic()
    records = fresh_records(first, channel.records, 0, 1.0, bound_s=0.5, every_s=0.02, skip={1}, since=now)
    assert time.monotonic() - t0 < 0.1 and records[2]["t"] == now + 0.01
    # without `since`, rank 2's record counts as old: the wait runs to its bound (nothing newer comes)
    t0 = time.monotonic()
    fresh_records(first, channel.records, 0, 1.0, bound_s=0.3, every_s=0.02, skip={1})
    assert 0.3 <= time.monotonic() - t0 < 0.6
    # a peer that publishes after the failure ends the wait when it does
    channel.publish(2, rec(2, now - 1.0))
    later = threading.Timer(0.1, lambda: channel.publish(2, rec(2, time.time())))
    later.start()
    t0 = time.monotonic()
    records = fresh_records(channel.records([1, 2]), channel.records, 0, 1.0, bound_s=0.5, every_s=0.02, skip={1},
                            since=now)
    later.join()
    assert 0.1 <= time.monotonic() - t0 < 0.3 and records[2]["t"] >= now

# ---- sequence check on a HashStore shared by threads ------------------------------------------------
def _ctx(store: Any, rank: int, counts: dict[str, int], tmp: Path) -> Any:
    from lifecycle.context import RunContext
    from lifecycle.distributed.faults import Drills
    from lifecycle.distributed.parallel import WorldOnly
    from lifecycle.obs.events import EventLog
    from lifecycle.policy.load import validate

    policy = validate({"watchdog": {"deadlines": {"warmup": 5.0}}})
    groups = [ResolvedGroup(("tp",), None, [0, 1] if rank < 2 else [2, 3])]
    ctx = RunContext.of(policy, tmp, rank, 4, rank, EventLog(tmp, rank), Drills([], rank), WorldOnly(), store=store)
    ctx.comms.groups = tuple(groups)
    for label, n in counts.items():
        for _ in range(n):
            ctx.ops.count(label)
    return ctx


def _boundary(counts_per_rank: list[dict[str, int]], tmp: Path) -> dict[int, BaseException | None]:
    store = torch_dist.HashStore()
    out: dict[int, BaseException | None] = {}

    def one(rank: int) -> None:
        ctx = _ctx(store, rank, counts_per_rank[rank], tmp)
        try:
            seqcheck.SequenceCheck()(ctx, "warmup", "train", False)
            out[rank] = None
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            out[rank] = exc
        finally:
            ctx.events.close()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def test_sequence_check_passes_when_every_group_agrees(tmp_path: Path) -> None:
    same = {"world": 3, "tp": 2}
    assert _boundary([same, same, same, same], tmp_path) == dict.fromkeys(range(4))


def test_sequence_check_names_group_ranks_and_counts(tmp_path: Path) -> None:
    counts = [{"world": 3, "tp": 2}, {"world": 3, "tp": 1}, {"world": 3, "tp": 2}, {"world": 3, "tp": 2}]
    out = _boundary(counts, tmp_path)
    for rank in range(4):
        exc = out[rank]
        assert isinstance(exc, seqcheck.SequenceMismatch), out
        assert exc.group == "tp" and exc.ranks == [0, 1]  # two members, one each: no majority
        assert "group tp (ranks from 0, size 2): ops per rank {'0': 2, '1': 1}" in str(exc)


def test_the_minority_disagrees() -> None:
    found = [{"group": "dp", "first_rank": 0, "size": 3, "counts": {"0": 5, "1": 4, "2": 5}}]
    assert seqcheck.disagreeing(found) == [1]


def test_compare_finds_silent_members() -> None:
    found = seqcheck.compare({0: {"ep": [2, 0, 2]}, 1: {}})
    assert found == [{"group": "ep", "first_rank": 0, "size": 2, "counts": {"0": 2}}]
    assert "1 member(s) issued none" in seqcheck.describe(found, "train")


def test_a_reports_stall_time_is_the_origins_no_progress_plus_its_records_age() -> None:
    """Where goodput's detection begins: the origin's idle time at its record plus how old that record is (a
    frozen rank publishes nothing more); this rank's own when the origin's record is missing."""
    from lifecycle.watchdog.report import _stalled_s

    records = {0: {"idle_s": 0.002, "t": 100.0}, 3: {"idle_s": 1.2, "t": 99.5}}
    d = diagnosis.Diagnosis("hang", "rank 3 made no progress", 3, "train", records=records, now=100.0)
    assert _stalled_s(d, 0) == pytest.approx(1.7)
    lost = diagnosis.Diagnosis("hang", "x", 5, "train", records=records, now=100.0)
    assert _stalled_s(lost, 0) == pytest.approx(0.002)
    assert _stalled_s(diagnosis.Diagnosis("hang", "x", None, "train", records={}, now=1.0), 0) is None
