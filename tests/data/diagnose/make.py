"""Make the recorded evidence of tests/unit/diagnose: real jobs that do not use lifecycle, each with one fault.

Run from the repository root (about 5 minutes on 2 CPU cores; it replaces tests/data/diagnose/cases/):

    OMP_NUM_THREADS=1 .venv/bin/python tests/data/diagnose/make.py [CASE ...]

Every case starts ``torchrun --standalone`` (gloo, 4 ranks, collective timeout 4 s) on jobs/plain_loop.py (plain
torch.distributed) or jobs/megatron_loop.py (a plain megatron-core loop) with one injected fault whose culprit is
known, and keeps what a user would have: the console (``console.txt``), torchrun's ``--log-dir`` tree where the case
asks for it (``logs/``), the Flight Recorder dumps the ranks wrote (``fr/``), and ``expected.json`` (the fault, the
rank that has it; never anything lifecycle computed). Two cases are re-labelled copies of a real case's per-rank
logs: one file per node with ``srun --label`` prefixes (``N: ``), and Ray actor prefixes (``(RayTrainWorker pid=...,
ip=...)``): the lines are the real ones, only the launcher's prefix differs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
CASES_DIR = HERE / "cases"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")

# name: (job, fault, faulty rank, fault step, flight recorder (None / "pickle" / "json"), launcher)
CASES: dict[str, tuple[str, str, int, int, str | None, str]] = {
    "plain_stall_before_fr": ("plain", "stall_before", 1, 2, "pickle", "tee"),
    "plain_stall_before": ("plain", "stall_before", 1, 2, None, "console"),
    "plain_stall_inside_fr": ("plain", "stall_inside", 2, 3, "json", "console"),
    "plain_stall_inside": ("plain", "stall_inside", 2, 3, None, "tee"),
    "plain_kill_fr": ("plain", "kill", 3, 2, "pickle", "console"),
    "plain_kill": ("plain", "kill", 1, 2, None, "tee"),
    "plain_raise_fr": ("plain", "raise", 2, 2, "pickle", "tee"),
    "plain_raise": ("plain", "raise", 1, 3, None, "console"),
    "plain_skip_fr": ("plain", "skip", 1, 2, "pickle", "console"),
    "plain_skip": ("plain", "skip", 3, 2, None, "tee"),
    "plain_other_group_first_fr": ("plain", "other_group_first", 1, 2, "pickle", "tee"),
    "plain_other_group_first": ("plain", "other_group_first", 2, 2, None, "console"),
    "plain_no_rendezvous": ("plain", "no_rendezvous", 3, 0, None, "tee"),
    "plain_no_rendezvous_fr": ("plain", "no_rendezvous", 2, 0, "pickle", "console"),
    "plain_stall_save_fr": ("plain", "stall_save", 1, 3, "pickle", "tee"),
    "plain_stall_save": ("plain", "stall_save", 0, 3, None, "console"),
    "megatron_stall_inside_fr": ("megatron", "stall_inside", 2, 2, "pickle", "tee"),
    "megatron_stall_before_fr": ("megatron", "stall_before", 3, 3, "pickle", "console"),
    "megatron_skip_fr": ("megatron", "skip", 1, 2, "pickle", "console"),
    "megatron_raise": ("megatron", "raise", 0, 2, None, "tee"),
}
# Cases of other shapes: world, extra environment, and seconds after which torchrun itself is killed from outside
# (SIGTERM to the launcher while the job hangs: no rank fails by itself, the collective timeout is long)
EXTRA: dict[str, dict[str, object]] = {
    "pipe_stall_fr": {"world": 6, "env": {"PIPE": "1", "TP": "1"}},
    "plain_stall_inside_w6_nodump": {"world": 6, "env": {"TP": "3", "DUMP_ON_TERM": "0"}},
    "plain_exit_console": {"world": 4, "env": {}},
    "plain_killed_outside_fr": {"world": 6, "env": {"TP": "2", "COLL_TIMEOUT_S": "300"}, "kill_after": 12},
}
CASES.update({
    "pipe_stall_fr": ("plain", "stall_pipe", 4, 2, "pickle", "console"),
    "plain_stall_inside_w6_nodump": ("plain", "stall_inside", 4, 2, "json", "tee"),
    "plain_exit_console": ("plain", "exit", 2, 2, None, "console"),
    "plain_killed_outside_fr": ("plain", "stall_before", 5, 2, "pickle", "tee"),
})
RELABELLED = {"slurm_label_stall_inside": "plain_stall_inside", "ray_raise": "plain_raise_fr"}
GROUPS = {"stall_pipe": "default_pg", "exit": "default_pg", "stall_before": "tp", "stall_inside": "dp", "skip": "dp", "other_group_first": "tp",
          "stall_save": "default_pg", "no_rendezvous": "default_pg"}


def _env(case: tuple[str, str, int, int, str | None, str], fr_dir: Path, ckpt: Path,
         extra: dict[str, str] | None = None) -> dict[str, str]:
    _, fault, rank, step, fr, _ = case
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT": fault, "FAULT_RANK": str(rank),
           "FAULT_STEP": str(step), "CKPT_DIR": str(ckpt), "PYTHONUNBUFFERED": "1", **(extra or {})}
    if fr:
        env.update(TORCH_FR_BUFFER_SIZE="2000", FR_DIR=str(fr_dir), FR_JSON="1" if fr == "json" else "0")
    return env


def run_case(name: str) -> None:
    case = CASES[name]
    out = CASES_DIR / name
    shutil.rmtree(out, ignore_errors=True)
    (out / "fr").mkdir(parents=True)
    job = HERE / "jobs" / ("plain_loop.py" if case[0] == "plain" else "megatron_loop.py")
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp) / "logs"
        extra = EXTRA.get(name, {})
        world = int(extra.get("world", 4))  # type: ignore[call-overload]
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(world)]
        if case[5] == "tee":
            cmd += ["--log-dir", str(logs), "--tee", "3"]
        t0 = time.monotonic()
        env = _env(case, out / "fr", Path(tmp) / "ckpt", extra.get("env"))  # type: ignore[arg-type]
        with subprocess.Popen([*cmd, str(job)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) as proc:
            if "kill_after" in extra:
                time.sleep(float(extra["kill_after"]))  # type: ignore[arg-type]
                proc.send_signal(signal.SIGTERM)  # from outside: the operator, the scheduler
            output, _ = proc.communicate(timeout=300)
        (out / "console.txt").write_bytes(output)
        if logs.is_dir():
            _keep_logs(logs, out / "logs")
    if not any((out / "fr").iterdir()):
        (out / "fr").rmdir()
    expected = {"job": case[0], "fault": case[1], "culprits": [case[2]], "step": case[3] or None,
                "group": "default_pg" if case[0] == "plain" and case[1] in ("kill", "raise") else GROUPS.get(case[1]),
                "flight_recorder": case[4], "launcher": f"torchrun {case[5]}", "world_size": world,
                "torchrun_exit": proc.returncode, "torch": _torch_version()}
    tp = int(extra.get("env", {}).get("TP", "2"))  # type: ignore[union-attr]
    if tp in (1, 2):  # the job's layout as diagnose -w N -o ... gives it (the policy's model takes tp 1 or 2)
        pp = ["parallelism.pp=2"] if extra.get("env", {}).get("PIPE") == "1" else []  # type: ignore[union-attr]
        expected["diagnose_overrides"] = [f"parallelism.tp={tp}", *pp, "parallelism.ep=1", "parallelism.etp=1"]
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"{name}: torchrun exit {proc.returncode} in {time.monotonic() - t0:.1f}s", flush=True)


def _keep_logs(src: Path, dst: Path) -> None:
    """torchrun's log dir (``<run id>_<random>/attempt_0/<local rank>/std{out,err}.log``) with the random folder
    named ``job`` (the tree stays the same from one generation to the next)."""
    for run in src.iterdir():
        shutil.copytree(run, dst / "job")
        for empty in [p for p in (dst / "job").rglob("*") if p.is_file() and p.stat().st_size == 0]:
            empty.unlink()


def _torch_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torch")


def relabel(name: str, source: str) -> None:
    """One log per SLURM node (``srun --label``: ``<task id>: line``) or Ray actor prefixes, from the real
    per-rank lines of ``source`` (its --log-dir tree, else its console's ``[rankN]:``-prefixed lines)."""
    out = CASES_DIR / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    per_rank = _per_rank_lines(CASES_DIR / source)
    if name.startswith("slurm"):
        for node in (0, 1):
            lines = [f"{r}: {line}" for r in (2 * node, 2 * node + 1) for line in per_rank.get(r, [])]
            (out / f"slurm-4242.node{node}.out").write_text("\n".join(lines) + "\n")
    else:
        lines = [f"(RayTrainWorker pid={51200 + r}, ip=10.0.0.{1 + r // 2}) {line}"
                 for r in sorted(per_rank) for line in per_rank[r]]
        (out / "ray-driver.log").write_text("\n".join(lines) + "\n")
    if (CASES_DIR / source / "fr").is_dir():
        shutil.copytree(CASES_DIR / source / "fr", out / "fr")
    expected = json.loads((CASES_DIR / source / "expected.json").read_text())
    expected.update(launcher="srun --label (re-labelled)" if name.startswith("slurm") else "ray (re-labelled)",
                    relabelled_from=source)
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"{name}: re-labelled from {source}", flush=True)


def _per_rank_lines(case: Path) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for path in sorted((case / "logs").rglob("std*.log")) if (case / "logs").is_dir() else []:
        rank = int(path.parent.name)  # one node: local rank = global rank
        found.setdefault(rank, []).extend(path.read_text().splitlines())
    if found:
        return found
    for line in (case / "console.txt").read_text().splitlines():
        m = re.match(r"\[rank(\d+)\]:(.*)", line)
        if m:
            found.setdefault(int(m.group(1)), []).append(f"[rank{m.group(1)}]:{m.group(2)}")
    return found


def main(names: list[str]) -> None:
    for name in names or list(CASES):
        run_case(name)
    for name, source in RELABELLED.items():
        if not names or name in names or source in names:
            relabel(name, source)


if __name__ == "__main__":
    main(sys.argv[1:])
