"""The fault-drill matrix on 4 real gloo ranks: {init, warmup, train, checkpoint, teardown} x {stall, crash,
raise, signal}, plus a rank that skips a collective. The stall, crash and raise cells of one fault share a launch:
each phase's drill fires in its own attempt, and the launcher relaunches the next.

One model-free layout (tp2, the synthetic train kind) keeps every run at a few seconds. For each cell:
the job's exit code (3 stall, 4 crash/raise, 0 SIGTERM = graceful preemption), every rank leaving on
its own within the deadline plus a few seconds, the watchdog report on the surviving ranks naming the
phase, group, op and the stuck or dead rank, no rank process left behind, and the last committed
checkpoint still loading.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.runs import SYNTHETIC, Run, lifecycle_run

pytestmark = pytest.mark.distributed
DEADLINE = 4.0  # warmup, step, checkpoint and teardown deadlines of the matrix
INIT_STALL_DEADLINE = 10.0  # must also cover the start-up skew of 4 ranks on a loaded machine
SLACK = 6.0  # detection, report, abort and exit, on 2 shared cores
BASE = [*SYNTHETIC, "parallelism.tp=2", "train.steps=4", "checkpoint.every_steps=2",
        "watchdog.deadlines.init=60", f"watchdog.deadlines.warmup={DEADLINE}", f"watchdog.deadlines.step={DEADLINE}",
        f"watchdog.deadlines.checkpoint={DEADLINE}", f"watchdog.deadlines.teardown={DEADLINE}",
        "teardown.deadline_s=5", "watchdog.poll_interval_s=0.25"]
# Where each phase's drill fires: a point every rank reaches with all its peers up and connected.
WHERE = {"init": "op: initialize_model_parallel", "warmup": "op: all_reduce, group: tp", "train": "step: 3",
         "checkpoint": "step: 4, op: save", "teardown": "op: barrier"}
CODE = {"stall": 3, "crash": 4, "raise": 4, "signal": 0}
# The step `latest` points at afterwards (None: no checkpoint yet). A SIGTERM is a preemption: save and stop.
LATEST = {"init": None, "warmup": None, "train": 2, "checkpoint": 2, "teardown": 4}
# A signal in step 3 is read after step 4 (checkpoint.signal_overlap), which also is a save step: one save.
LATEST_SIGNAL = {"init": None, "warmup": None, "train": 4, "checkpoint": 4, "teardown": 4}


def _drill(phase: str, fault: str, rank: int) -> list[str]:
    where = "" if (phase, fault) == ("init", "stall") else f", {WHERE[phase]}"  # stall before the rendezvous
    extra = [f"watchdog.deadlines.init={INIT_STALL_DEADLINE}"] if (phase, fault) == ("init", "stall") else []
    return [*extra, f"+faults=[{{at: {phase}, ranks: [{rank}], action: {fault}{where}}}]"]


def _report_block(run: Run, rank: int) -> str:
    lines = run.log(rank).splitlines()
    start = next((i for i, line in enumerate(lines) if "lifecycle watchdog:" in line), None)
    assert start is not None, f"no watchdog report on rank {rank}:\n{run.log(rank)[-3000:]}"
    return "\n".join(line for line in lines[start:] if line.startswith(f"[rank {rank}] "))


def _assert_reports(run: Run, phase: str, culprit: int) -> None:
    for rank in sorted(set(range(4)) - {culprit}):
        block = _report_block(run, rank)
        assert f" in phase {phase}" in block.splitlines()[0], block
        assert re.search(rf"stuck: rank {culprit} \[", block), block
        assert re.search(r"rank \d (waits in|is past) \S+ on group \S+ \(op #\d+", block), block
    report = json.loads((run.run_dir / "hang_report.json").read_text())
    assert report["culprits"] == [culprit], report["culprits"]  # the one guilty rank, never its partners
    assert report["reporter"] == (1 if culprit == 0 and report["dead"] else 0), report["reporter"]


def _assert_exits(run: Run, phase: str, fault: str, culprit: int) -> None:
    """Every rank left by itself, soon after the drill fired (a crashed rank has no exit event)."""
    status = run.summary()["exit_status_per_rank"]
    events = run.events()
    fired = next(e["t"] for e in events[culprit] if e["name"] == "fault_drill") / 1e6
    deadline = (INIT_STALL_DEADLINE if phase == "init" else DEADLINE) if fault == "stall" else 0.0
    for rank, evs in events.items():
        if fault == "crash" and rank == culprit:
            continue
        assert "killed" not in status[str(rank)]["how"], status
        ends = [e["t"] for e in evs if e["name"] in ("exit", "teardown_deadline")]
        assert ends, (rank, status, evs[-6:], run.log(rank)[-3000:])  # how it left, when it did not say
        last = max(ends) / 1e6
        if fault != "signal":
            assert last - fired < deadline + SLACK, (rank, last - fired)


def _assert_no_rank_left(run: Run) -> None:
    import psutil

    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if str(run.run_dir) in " ".join(p.info["cmdline"] or []):
                left.append(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    assert not left, f"rank processes left behind: {left}"


def _assert_checkpoint(run: Run, step: int | None) -> None:
    import torch

    root = run.run_dir / "checkpoints"
    if step is None:
        assert not (root / "latest").exists()
        return
    latest = root / (root / "latest").read_text().strip()
    assert latest.name == f"iter_{step:07d}", latest
    assert (latest / "metadata.json").is_file()
    for rank in range(4):
        state: dict[str, Any] = torch.load(latest / f"rank_{rank}.pt", weights_only=True)
        assert state["step"] == step and state["model"]


PHASES = list(WHERE)


def _attempt(run: Run, n: int, last: int) -> Run:
    """Attempt ``n`` of a chained run: its own folder (attempts/<n>/) once a later attempt started."""
    return run if n == last else Run(run.proc, run.run_dir / "attempts" / str(n), run.wall_s)


@pytest.mark.timeout(170)
@pytest.mark.parametrize("fault", ["crash", "raise", "stall"])
def test_fault_drill_in_each_phase_then_the_relaunch(tmp_path: Path, fault: str) -> None:
    """One cell per attempt of one `lifecycle run`: attempt N rehearses ``fault`` in the Nth phase (init, warmup,
    train, checkpoint, teardown) and the launcher relaunches the next from its preload process, resuming from what
    the failed attempts committed. Each attempt is checked as a run of its own: the exit code, every rank leaving
    within the deadline, the report naming phase, group, op and the one culprit; at the end no rank left and the
    commits each failure left (the next attempt's resume says what the last one committed)."""
    culprits = [0 if (phase, fault) == ("train", "crash") else 1 for phase in PHASES]  # rank 0 dies once
    drills = ", ".join(_drill_yaml(phase, fault, culprit, n) for n, (phase, culprit) in
                       enumerate(zip(PHASES, culprits, strict=True), start=1))
    init = [f"watchdog.deadlines.init={INIT_STALL_DEADLINE}"] if fault == "stall" else []
    run = lifecycle_run(tmp_path, 4, *BASE, *init, f"restart.max_restarts={len(PHASES) - 1}", "restart.mode=relaunch",
                        "restart.max_no_progress=10", f"+faults=[{drills}]", timeout=160)
    last = len(PHASES)
    assert run.code == CODE[fault], run.output
    _assert_no_rank_left(run)
    for n, (phase, culprit) in enumerate(zip(PHASES, culprits, strict=True), start=1):
        attempt = _attempt(run, n, last)
        summary = attempt.summary()
        assert summary["attempt"] == n and summary["exit_code"] == CODE[fault], (phase, summary.get("outcome"))
        _assert_exits(attempt, phase, fault, culprit)
        _assert_reports(attempt, phase, culprit)
        if n < last:  # what attempt n left committed, as attempt n+1 resumed it
            assert _resumed(_attempt(run, n + 1, last)) == LATEST[phase], (phase, n)
    _assert_checkpoint(run, LATEST["teardown"])


def _resumed(run: Run) -> int | None:
    """The step rank 0 resumed from (its log's ``resumed from step N``), None for a fresh start."""
    found = re.search(r"resumed from step (\d+)", run.log(0))
    return int(found.group(1)) if found else None


def _drill_yaml(phase: str, fault: str, rank: int, attempt: int) -> str:
    where = "" if (phase, fault) == ("init", "stall") else f", {WHERE[phase]}"  # stall before the rendezvous
    return f"{{at: {phase}, ranks: [{rank}], action: {fault}{where}, attempts: [{attempt}]}}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("phase", PHASES)
def test_a_sigterm_in_each_phase_is_a_graceful_stop(tmp_path: Path, phase: str) -> None:
    """A SIGTERM is a preemption, not a failure: exit 0, no report, the save it leads to (one run per phase: a stop
    ends the run, so the phases cannot share one)."""
    run = lifecycle_run(tmp_path, 4, *BASE, *_drill(phase, "signal", 1), timeout=80)
    assert run.code == CODE["signal"], run.output
    _assert_no_rank_left(run)
    _assert_exits(run, phase, "signal", 1)
    assert not (run.run_dir / "hang_report.json").exists()
    _assert_checkpoint(run, LATEST_SIGNAL[phase])


@pytest.mark.timeout(90)
def test_skipped_collective_is_reported_before_any_timeout(tmp_path: Path) -> None:
    deadline = 30
    run = lifecycle_run(tmp_path, 4, *BASE, f"watchdog.deadlines.warmup={deadline}",
                        "+faults=[{at: warmup, ranks: [1], action: skip, op: all_reduce, group: tp}]", timeout=80)
    assert run.code == 3, run.output  # a divergence is a hang named before it happens: the hang code
    _assert_no_rank_left(run)
    events = run.events()
    fired = next(e["t"] for e in events[1] if e["name"] == "fault_drill") / 1e6
    for rank in range(4):
        block = _report_block(run, rank)
        assert "COLLECTIVE SEQUENCE MISMATCH in phase warmup" in block, block
        assert "on group tp" in block and "ranks 0 and 1 wait for each other" in block, block
        last = max(e["t"] for e in events[rank] if e["name"] == "exit") / 1e6
        assert last - fired < deadline / 2, (rank, last - fired)
    for rank in range(4):  # no timeout fired anywhere: the divergence was named first
        assert "HangError" not in run.log(rank) and "did not complete within" not in run.log(rank)


@pytest.mark.timeout(120)
def test_a_rank_stalled_in_a_megatron_step_is_the_one_culprit_not_its_tp_and_ep_partners(tmp_path: Path) -> None:
    """The megatron kind at tp2 ep2 (world 4): the stalled rank's tp and ep partners wait inside their own step, in
    collectives lifecycle does not trace (tensor-parallel all-reduce, MoE all-to-all); they are blocked in a
    collective, the stalled rank in its own code: only it is named."""
    run = lifecycle_run(tmp_path, 4, "parallelism.tp=2", "train.steps=4", "checkpoint.every_steps=0",
                        "watchdog.deadlines.init=60", f"watchdog.deadlines.step={DEADLINE}", "teardown.deadline_s=5",
                        f"watchdog.deadlines.teardown={DEADLINE}",
                        "watchdog.poll_interval_s=0.25", "+faults=[{at: train, step: 3, ranks: [2], action: stall}]",
                        timeout=100)
    assert run.code == 3, run.output
    report = json.loads((run.run_dir / "hang_report.json").read_text())
    assert report["culprits"] == [2], report["culprits"]
    assert {r: rec.get("blocked") for r, rec in report["ranks"].items()}["2"] == "own code"
