"""NCCL-only evidence, which a CPU machine cannot produce: lines built from the format strings of PyTorch's
torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp (v2.6.0 ... v2.13.0: ``logPrefix()``, the watchdog's
``WorkNCCL(...)`` timeout, ``failure detected by watchdog at work sequence id``, the heartbeat monitor's ``Received a
dump signal``), TraceUtils.h (the desync report), NCCL's src/misc/socket.cc and src/transport/net_ib.cc (``NCCL
WARN`` lines naming a peer), and Flight Recorder dumps as FlightRecorderDetail.hpp writes them (``pg_config`` with
each group's ranks as the string "[0, 1]"; ``version`` "2.4" in torch 2.6, "2.10" in torch 2.13)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from lifecycle.diagnose import diagnose

GLOG = "[E1126 10:00:00.123456789 ProcessGroupNCCL.cpp:{line}] "
PREFIX = "[PG ID {pgid} PG GUID {guid}({desc}) Rank {grank}] "
MONITOR = ("Received a dump signal due to a collective timeout from {src} and we will try our best to dump the debug "
           "info. Last enqueued NCCL work: {enq}, last completed NCCL work: {done}.This is most likely caused by "
           "incorrect usages of collectives, e.g., wrong sizes used across ranks, the order of collectives is not "
           "same for all ranks or the scheduled collective, for some reason, didn't run. Additionally, this can be "
           "caused by GIL deadlock or other reasons such as network errors or bugs in the communications library "
           "(e.g. NCCL), etc. ")


def _victim(rank: int, seq: int, guid: str = "0", desc: str = "default_pg", grank: int | None = None) -> list[str]:
    grank = rank if grank is None else grank
    return [
        f"[rank{rank}]:" + GLOG.format(line=632) + f"[Rank {grank}] Watchdog caught collective operation timeout: "
        f"WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 "
        f"milliseconds before timing out.",
        f"[rank{rank}]:" + GLOG.format(line=2271) + PREFIX.format(pgid=0, guid=guid, desc=desc, grank=grank)
        + f" failure detected by watchdog at work sequence id: {seq} PG status: last enqueued work: {seq}, last "
        f"completed work: {seq - 1}",
    ]


def _stalled(rank: int, enq: int) -> str:
    return (f"[rank{rank}]:" + GLOG.format(line=1746) + PREFIX.format(pgid=0, guid="0", desc="default_pg", grank=rank)
            + MONITOR.format(src="rank 0", enq=enq, done=enq))


def _write(tmp: Path, name: str, lines: list[str]) -> str:
    path = tmp / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_rank_behind_on_the_default_group_is_a_suspect_until_its_dump_proves_it_waits_for_nobody(
        tmp_path: Path) -> None:
    # rank 2's heartbeat line: every op it entered on the default group finished; it may still wait in a subgroup
    # (its own watchdog had not fired when the job ended), so its line alone never names it
    lines = [*_victim(0, 6), *_victim(1, 6), _stalled(2, 5), *_victim(3, 6)]
    out = diagnose([_write(tmp_path, "console.log", lines)]).as_json()
    assert out["culprits"] == [] and out["suspects"] == [2]
    assert any("dumps of rank(s) 2" in m for m in out["missing"])
    # its dump proves it: every op it entered finished (NCCL's completed state), nothing open on any group
    entries = [{"process_group": ["0", "default_pg"], "collective_seq_id": s, "profiling_name": "nccl:all_reduce",
                "record_id": s - 1, "state": "completed", "input_sizes": [[1]]} for s in range(1, 6)]
    dump = {"version": "2.10", "entries": entries, "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                                        "ranks": "[0, 1, 2, 3]"}}}
    (tmp_path / "fr_trace_rank_2.json").write_text(json.dumps(dump))
    out = diagnose([str(tmp_path)]).as_json()
    assert out["culprits"] == [2] and out["cause"] == "never entered" and out["seq"] == 6
    assert out["group"]["desc"] == "default_pg" and out["op"] == "allreduce"


def test_a_subgroup_hang_with_only_default_group_progress_is_undecided(tmp_path: Path) -> None:
    # ranks 0 and 1 time out on tp group 3; rank 1's line about the default group says nothing of tp
    lines = [*_victim(0, 4, guid="3", desc="TENSOR_MODEL_PARALLEL_GROUP", grank=0), _stalled(1, 9)]
    out = diagnose([_write(tmp_path, "console.log", lines)]).as_json()
    assert out["culprits"] == [] and out["missing"]


def test_older_status_lines_and_per_rank_files(tmp_path: Path) -> None:
    # torch <= 2.5: "Exception (either an error or timeout) detected by watchdog at work: ..."
    for r in (0, 1):
        _write(tmp_path, f"rank_{r}.log", [
            f"[PG 0 (default_pg) Rank {r}] Exception (either an error or timeout) detected by watchdog at work: 12, "
            f"last enqueued NCCL work: 12, last completed NCCL work: 11."])
    _write(tmp_path, "rank_2.log", [PREFIX.format(pgid=0, guid="0", desc="default_pg", grank=2)
                                    + MONITOR.format(src="rank 0", enq=11, done=11)])
    out = diagnose([str(tmp_path)]).as_json()
    assert out["culprits"] == [] and out["suspects"] == [2]


def test_the_desync_report_names_the_lagging_rank(tmp_path: Path) -> None:
    lines = ["[rank0]:" + GLOG.format(line=632) + PREFIX.format(pgid=0, guid="0", desc="default_pg", grank=0)
             + "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=41208, OpType=ALLREDUCE, NumelIn=1, "
             "NumelOut=1, Timeout(ms)=600000) ran for 600000 milliseconds before timing out.",
             "[rank0]:\t - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:",
             "[rank0]:\t   - [3] joined but didn't finish collective #41207 (count from 1)"]
    out = diagnose([_write(tmp_path, "console.log", lines)]).as_json()
    assert out["culprits"] == [3] and out["cause"] == "entered, not finished"


def test_nccl_warn_lines_naming_both_ends_are_a_network_link(tmp_path: Path) -> None:
    lines = ["node7:4242:4301 [3] misc/socket.cc:49 NCCL WARN Net : Connection closed by remote peer "
             "node8.cluster<51022>",
             "node7:4242:4305 [3] NCCL WARN NET/IB : Got completion from peer 10.0.0.8<51022> with status=12 "
             "opcode=0 len=0 vendor err 129 (Recv) hca mlx5_0",
             *_victim(0, 3), *_victim(1, 3)]
    out = diagnose([_write(tmp_path, "console.log", lines)]).as_json()
    assert out["culprits"] == [] and out["cause"] == "network link"
    assert {"node7", "node8.cluster<51022>"} <= set(out["hosts"])


def _nccl_dump(version: str, rank: int, last: int, groups: dict[str, tuple[str, list[int]]],
               done: int | None = None) -> dict[str, object]:
    """A dump shaped as FlightRecorderDetail.hpp writes it: ``last`` ops on the tp group of this rank, the first
    ``done`` of them completed (the watchdog saw them finish)."""
    done = last - 1 if done is None else done
    entries = []
    for seq in range(1, last + 1):
        entries.append({"record_id": seq - 1, "pg_id": 1, "process_group": ("3", groups["3"][0]),
                        "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": "nccl:all_reduce",
                        "time_created_ns": 1, "input_sizes": [[1024]], "output_sizes": [[1024]],
                        "state": "completed" if seq <= done else "scheduled", "retired": seq <= done, "timeout_ms": 600000, "is_p2p": False,
                        "frames": [{"name": "all_reduce", "filename": "distributed_c10d.py", "line": 1}]})
    return {"version": version, "comm_lib_version": "2.21.5", "entries": entries,
            "pg_config": {g: {"name": g, "desc": d, "ranks": str(r)} for g, (d, r) in groups.items()},
            "pg_status": {"1": {"last_enqueued_collective": last, "last_started_collective": last,
                                "last_completed_collective": done}}}


def test_nccl_dumps_of_every_version_give_their_rank_from_their_groups(tmp_path: Path) -> None:
    for version in ("2.4", "2.7", "2.10"):
        folder = tmp_path / version
        folder.mkdir()
        for rank, last in ((4, 8), (5, 7)):  # rank 5 finished op 7 and never entered op 8 of tp group 3 = [4, 5]
            groups = {"0": ("default_pg", list(range(8))), "3": ("TENSOR_MODEL_PARALLEL_GROUP", [4, 5]),
                      "7": ("DATA_PARALLEL_GROUP", [rank % 4, rank % 4 + 4])}
            data = _nccl_dump(version, rank, last, groups, done=7)
            name = f"trace_{'ab'[rank - 4]}"  # the file names say nothing: the rank comes from the dump
            if version == "2.7":
                (folder / name).write_text(json.dumps(data))
            else:
                (folder / name).write_bytes(pickle.dumps(data, protocol=2))
        out = diagnose([str(folder)]).as_json()
        assert out["culprits"] == [5], (version, out)
        assert out["dimension"] == "tp" and out["group"]["ranks"] == [4, 5] and out["seq"] == 8
        assert {d["rank_from"] for d in out["inputs"]["dumps"].values()} == {"the dump's groups"}
