"""Time and peak memory of `lifecycle diagnose` on a job of 1024 ranks: one console log of 1 MB per rank plus every
rank's Flight Recorder dump (pickle, the shape torch writes), against baselines measured in the same run on the
same files: ``grep -c`` over the logs' bytes, and PyTorch's own analyzer (``python -m
torch.distributed.flight_recorder.fr_trace``) on the dumps next to ``lifecycle diagnose`` on the dumps alone.

    OMP_NUM_THREADS=1 python bench/diagnose_scale.py [--ranks 1024] [--log-mb 1] [--entries 400] [--keep DIR]

The job: tp 8 (TENSOR_MODEL_PARALLEL_GROUP), dp = ranks / 8 (DATA_PARALLEL_GROUP), a loss all-reduce on the
default group; each step runs tp, dp, default. Rank 777 stalls before its tp all-reduce of the last step: its tp
partners wait there, every other rank waits in dp (each dp group holds a rank of 777's tp group). The logs are what a
Megatron job prints (an ``iteration`` line per step, which the reader must parse, plus other lines) and, at their
end, ProcessGroupNCCL's watchdog lines (the shapes of tests/unit/diagnose/test_nccl_shapes.py). Each command runs in
a fresh process; peak RSS from ``wait4``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TP = 8


def culprit(ranks: int) -> int:
    """Rank 777 of 1024 (scaled with ``--ranks``)."""
    return ranks * 777 // 1024
FRAMES = [{"name": "all_reduce", "filename": "torch/distributed/distributed_c10d.py", "line": 2806},
          {"name": "wrapper", "filename": "torch/distributed/c10d_logger.py", "line": 81},
          {"name": "reduce_gradients", "filename": "megatron/core/distributed/finalize_model_grads.py", "line": 290},
          {"name": "train_step", "filename": "megatron/training/training.py", "line": 1202},
          {"name": "pretrain", "filename": "megatron/training/training.py", "line": 420}]


def _groups(ranks: int) -> tuple[dict[str, tuple[str, list[int]]], dict[int, list[str]]]:
    """name -> (desc, ranks) and rank -> its groups in program order (tp, dp, default)."""
    groups: dict[str, tuple[str, list[int]]] = {"0": ("default_pg", list(range(ranks)))}
    for k in range(ranks // TP):
        groups[str(1 + k)] = ("TENSOR_MODEL_PARALLEL_GROUP", list(range(k * TP, (k + 1) * TP)))
    for k in range(TP):
        groups[str(1 + ranks // TP + k)] = ("DATA_PARALLEL_GROUP", list(range(k, ranks, TP)))
    order = {r: [str(1 + r // TP), str(1 + ranks // TP + r % TP), "0"] for r in range(ranks)}
    return groups, order


def _ops_done(rank: int, ranks: int, steps: int) -> int:
    """Ops the rank entered (3 per step): the culprit none of the last step, its tp partners the tp op of it, the
    others tp and dp."""
    bad = culprit(ranks)
    if rank == bad:
        return 3 * (steps - 1)
    return 3 * (steps - 1) + (1 if rank // TP == bad // TP else 2)


def write_dumps(folder: Path, ranks: int, entries: int) -> int:
    folder.mkdir(parents=True)
    groups, order = _groups(ranks)
    steps = entries // 3 + 50  # the ring buffer wrapped: the first entries were overwritten
    total = 0
    for rank in range(ranks):
        done = _ops_done(rank, ranks, steps)
        mine = order[rank]
        out = []
        for i in range(max(done - entries, 0), done):
            g = mine[i % 3]
            out.append({"record_id": i, "pg_id": int(g), "process_group": (g, groups[g][0]),
                        "collective_seq_id": i // 3 + 1, "p2p_seq_id": 0, "op_id": i // 3 + 1,
                        "profiling_name": "nccl:all_reduce", "time_created_ns": 1795721599271615176 + i,
                        "input_sizes": [[4096]], "input_dtypes": ["Float"], "output_sizes": [[4096]],
                        "output_dtypes": ["Float"], "state": "completed" if i < done - 1 else "scheduled",
                        "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
                        "retired": i < done - 1, "timeout_ms": 600000, "is_p2p": False, "frames": FRAMES,
                        "thread_id": "140714529467264", "thread_name": "pt_main_thread"})
        config = {g: {"name": g, "desc": groups[g][0], "ranks": str(groups[g][1])} for g in mine}
        status = {g: {"last_enqueued_collective": max((e["collective_seq_id"] for e in out
                                                       if e["process_group"][0] == g), default=-1),
                      "last_started_collective": -1, "last_completed_collective": -1} for g in mine}
        data = {"version": "2.10", "comm_lib_version": "2.27.5", "pg_config": config, "pg_status": status,
                "entries": out}
        blob = pickle.dumps(data, protocol=2)
        (folder / f"nccl_trace_rank_{rank}").write_bytes(blob)
        total += len(blob)
    return total


ITERATION = ("[rank{r}]: [2026-11-26 10:{m:02d}:{s:02d}] iteration {it:8d}/  500000 | consumed samples: {cs:12d} | "
             "elapsed time per iteration (ms): 1234.5 | learning rate: 1.000000E-04 | global batch size:  2048 | "
             "lm loss: 2.345678E+00 | loss scale: 1.0 | grad norm: 0.345 | number of skipped iterations:   0 | "
             "number of nan iterations:   0 |\n")
OTHER = ("[rank{r}]: [2026-11-26 10:{m:02d}:{s:02d}] throughput per GPU (TFLOP/s/GPU): 412.3 | tokens/s/gpu: 4123.5 "
         "| mem-alloc-GB: 61.20 | mem-max-alloc-GB: 70.91 | data fetch: 0.21 ms\n")
GLOG = "[rank{r}]:[E1126 10:59:59.123456789 ProcessGroupNCCL.cpp:{line}] "
PREFIX = "[PG ID {pgid} PG GUID {guid}({desc}) Rank {grank}] "


def _tail(rank: int, ranks: int, steps: int) -> str:
    groups, order = _groups(ranks)
    if rank == culprit(ranks):
        return (GLOG.format(r=rank, line=1746) + PREFIX.format(pgid=0, guid="0", desc="default_pg", grank=rank)
                + "Received a dump signal due to a collective timeout from rank 0 and we will try our best to dump "
                f"the debug info. Last enqueued NCCL work: {steps - 1}, last completed NCCL work: {steps - 1}.\n")
    done = _ops_done(rank, ranks, steps)
    g = order[rank][(done - 1) % 3]
    desc, members = groups[g]
    grank = members.index(rank)
    seq = steps
    return (GLOG.format(r=rank, line=632) + PREFIX.format(pgid=int(g), guid=g, desc=desc, grank=grank)
            + f"[Rank {grank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE,"
            f" NumelIn=4096, NumelOut=4096, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.\n"
            + GLOG.format(r=rank, line=2271) + PREFIX.format(pgid=int(g), guid=g, desc=desc, grank=grank)
            + f"failure detected by watchdog at work sequence id: {seq} PG status: last enqueued work: {seq}, "
            f"last completed work: {seq - 1}\n")


def write_logs(folder: Path, ranks: int, size: int, steps: int) -> int:
    total = 0
    for rank in range(ranks):
        node = folder / f"node{rank // 8:03d}"
        node.mkdir(parents=True, exist_ok=True)
        parts, n, it = [], 0, 0
        while n < size:
            it += 1
            line = (ITERATION if it % 2 else OTHER).format(r=rank, m=it // 60 % 60, s=it % 60, it=it, cs=it * 2048)
            parts.append(line)
            n += len(line)
        data = ("".join(parts) + _tail(rank, ranks, steps)).encode()
        (node / f"rank_{rank}.log").write_bytes(data)
        total += len(data)
    return total


def measure(cmd: list[str], timeout: float) -> tuple[float, float, int, str]:
    """(wall s, peak RSS MB, exit code, the first 300 characters of stdout) of a fresh process."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            _, status, usage = _wait(proc.pid, timeout)
        except TimeoutError:
            proc.kill()
            os.waitpid(proc.pid, 0)
            return timeout, float("nan"), -9, "timed out"
        wall = time.monotonic() - t0
        out.seek(0)
        text = out.read().decode("utf-8", "replace")
    code = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_maxrss / 1024, code, text


def _wait(pid: int, timeout: float) -> tuple[int, int, resource.struct_rusage]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got, status, usage = os.wait4(pid, os.WNOHANG)
        if got:
            return got, status, usage
        time.sleep(0.05)
    raise TimeoutError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--log-mb", type=float, default=1.0)
    ap.add_argument("--entries", type=int, default=400, help="Flight Recorder entries kept per rank")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--keep", help="write the job here and keep it (default: a temp dir, removed)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(args.keep or tmp) / "job"
        steps = args.entries // 3 + 50
        t0 = time.monotonic()
        log_bytes = write_logs(job / "logs", args.ranks, int(args.log_mb * (1 << 20)), steps)
        dump_bytes = write_dumps(job / "fr", args.ranks, args.entries)
        print(f"wrote {args.ranks} logs ({log_bytes / 2**20:.0f} MiB) and {args.ranks} dumps "
              f"({dump_bytes / 2**20:.0f} MiB, {args.entries} entries each) in {time.monotonic() - t0:.0f} s",
              flush=True)
        lifecycle = str(Path(sys.executable).parent / "lifecycle")
        pattern = "Traceback|Error|Watchdog caught|dump signal|watchdog at work|NCCL WARN|iteration"
        runs = {
            "lifecycle diagnose logs + dumps": [lifecycle, "diagnose", "--json", str(job)],
            "baseline: grep -c -r -E (logs)": ["grep", "-c", "-r", "-E", pattern, str(job / "logs")],
            "lifecycle diagnose dumps only": [lifecycle, "diagnose", "--json", str(job / "fr")],
            "baseline: torch fr_trace (dumps)": [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                                                 str(job / "fr"), "-p", "nccl_trace_rank_"],
        }
        rows = {}
        for name, cmd in runs.items():
            wall, rss, code, text = measure(cmd, args.timeout)
            rows[name] = (wall, rss, code)
            print(f"{name}: {wall:.2f} s, peak RSS {rss:.0f} MB, exit {code}", flush=True)
            if name.startswith("lifecycle") and code == 0:
                out = json.loads(text)
                print(f"  verdict: culprits {out['culprits']}, cause {out['cause']}, group "
                      f"{(out['group'] or {}).get('desc')} {(out['group'] or {}).get('ranks')}, seq {out['seq']}",
                      flush=True)
            elif "fr_trace" in name:
                missing = sorted({r for m in re.findall(r"missing ranks: \{([\d, ]*)\}", text)
                                  for r in map(int, re.findall(r"\d+", m))})
                print(f"  its report: {text.count('missing ranks')} collective(s) with missing ranks, those ranks: "
                      f"{missing[:20]}; {'no errors found' if 'No errors found' in text else ''}", flush=True)
            elif code != 0:
                print("  " + text.strip().replace("\n", "\n  ")[-600:], flush=True)
        main_wall, main_rss, _ = rows["lifecycle diagnose logs + dumps"]
        grep_wall = rows["baseline: grep -c -r -E (logs)"][0]
        print(f"bounds: {main_wall:.1f} s <= 20 s: {main_wall <= 20}; {main_rss:.0f} MB <= 500 MB: {main_rss <= 500}; "
              f"x grep {main_wall / grep_wall:.1f}", flush=True)


if __name__ == "__main__":
    main()
