"""Goodput accounting (lifecycle.obs.goodput) on run directories written event by event: relaunches, in-place
restarts, failures past the last commit, and 300 seeded random runs whose buckets must always sum to the wall
time, with every step either productive or lost and the productive ones exactly the final state's."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from lifecycle.obs import goodput
from tests.unit.inproc import cli

S = 1_000_000  # µs


class Writer:
    """Rank 0's events of one attempt, on a clock that only moves forward."""

    def __init__(self, t: int) -> None:
        self.t = t
        self.events: list[dict[str, Any]] = []

    def at(self, kind: str, name: str, dt: float = 0.0, **fields: Any) -> None:
        self.t += int(dt * S)
        self.events.append({"t": self.t, "rank": 0, "kind": kind, "name": name, **fields})

    def span(self, name: str, seconds: float, **fields: Any) -> None:
        self.at("begin", name, 0.0, **fields)
        self.at("end", name, seconds, **fields)

    def write(self, folder: Path) -> None:
        (folder / "events").mkdir(parents=True, exist_ok=True)
        (folder / "events" / "rank_0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in self.events))


def _attempt(w: Writer, number: int, first: int, last: int, *, resume: bool, commit_every: int,
             fail_at: int | None = None, step_s: float = 1.0, age_s: float = 2.0) -> list[int]:
    """One attempt: start-up, an optional resume, steps first..last (a failure inside step fail_at), teardown.
    Returns the steps it committed."""
    w.at("instant", "attempt", attempt=number, process_start_s=age_s)
    w.at("begin", "phase:init", 0.5)
    w.at("end", "phase:init", 1.0)
    w.span("phase:warmup", 0.5)
    w.at("begin", "phase:train", 0.1)
    if resume:
        w.span("resume", 0.3, step=first - 1)
    committed = []
    for step in range(first, last + 1):
        if step == fail_at:
            w.at("begin", "step", 0.0, step=step)
            w.at("instant", "failure", step_s / 2, step=step, exit_code=4)
            w.at("begin", "phase:teardown", 0.1, failure=True)
            w.at("end", "phase:teardown", 0.4, failure=True)
            w.at("instant", "exit", 0.0, exit_code=4)
            return committed
        w.span("step", step_s, step=step)
        w.span("stop_flag", 0.05)
        if commit_every and step % commit_every == 0:
            w.at("end", "phase:train", 0.0)
            w.at("begin", "phase:checkpoint", 0.0)
            w.span("save", 0.2, step=step)
            w.span("commit", 0.1, step=step, outcome="ok")
            w.at("end", "phase:checkpoint", 0.0)
            w.at("begin", "phase:train", 0.0)
            committed.append(step)
    w.at("end", "phase:train", 0.0)
    w.span("phase:teardown", 0.3)
    w.at("instant", "exit", 0.0, exit_code=0)
    return committed


def _run_dir(tmp_path: Path, writers: list[Writer]) -> Path:
    run = tmp_path / "run"
    for n, w in enumerate(writers[:-1], 1):
        w.write(run / "attempts" / str(n))
    writers[-1].write(run)
    (run / "attempt").write_text(str(len(writers)))
    return run


def _check_sums(g: goodput.Goodput) -> None:
    assert all(v >= -1e-9 for v in g.buckets.values()), g.buckets
    assert sum(g.buckets.values()) == pytest.approx(g.wall_s, abs=1e-5), (g.buckets, g.wall_s)


def test_a_relaunch_counts_the_recomputed_steps_as_lost_and_the_gap_as_relaunch(tmp_path: Path) -> None:
    first = Writer(1000 * S)
    _attempt(first, 1, 1, 10, resume=False, commit_every=5, fail_at=8)
    second = Writer(first.t + 3 * S + int(2.0 * S))  # 3 s between the last event and the next process start
    _attempt(second, 2, 6, 10, resume=True, commit_every=5)
    g = goodput.account(_run_dir(tmp_path, [first, second]))
    _check_sums(g)
    assert g.attempts == 2 and g.failures == 1
    assert g.steps_productive == 10 and g.steps_lost == 3  # 6 and 7 done again, 8 never finished
    assert g.buckets["productive"] == pytest.approx(10.0, abs=1e-6)
    assert g.buckets["lost"] == pytest.approx(2.0, abs=1e-6)  # the unfinished step 8 is detection, not work
    assert g.buckets["detection"] == pytest.approx(0.5, abs=1e-6)  # last progress (the stop flag) -> the failure
    assert g.buckets["relaunch"] == pytest.approx(3.0, abs=1e-6)
    assert g.buckets["restore"] == pytest.approx(0.3, abs=1e-6)
    assert g.buckets["checkpoint"] == pytest.approx(0.6, abs=1e-6)  # 5 in attempt 1, 10 in attempt 2
    assert g.buckets["startup"] == pytest.approx(2 * (2.0 + 1.0 + 0.5 + 0.5 + 0.1), abs=1e-6)
    assert "2 attempts" in g.line() and "lost 2.0s (3 steps)" in g.line()


def test_a_hang_counts_from_the_last_progress_even_when_the_aborted_op_ends_just_before_the_report(
        tmp_path: Path) -> None:
    """Rank 0 waits 1.5 s in a gradient all-reduce for a frozen peer; the report aborts the group, so the op (and the
    step) end a few ms before the hang_report: the report's own no-progress time places the detection."""
    w = Writer(2000 * S)
    w.at("instant", "attempt", attempt=1, process_start_s=0.0)
    w.span("phase:init", 0.5)
    w.at("begin", "phase:train", 0.0)
    for step in (1, 2):
        w.span("step", 1.0, step=step)
    w.at("begin", "step", 0.0, step=3)
    w.at("begin", "grad_reduce", 0.2, step=3)
    w.at("end", "grad_reduce", 1.5, step=3)  # aborted by the report
    w.at("end", "step", 0.001, step=3)
    w.at("instant", "hang_report", 0.002, cause="hang", idle_s=1.503)
    w.at("begin", "phase:teardown", 0.0, failure=True)
    w.at("end", "phase:teardown", 0.3, failure=True)
    w.at("instant", "exit", 0.0, exit_code=3)
    g = goodput.account(_run_dir(tmp_path, [w]))
    _check_sums(g)
    assert g.buckets["detection"] == pytest.approx(1.503, abs=1e-3), g.buckets
    # steps 1-2 (never committed) and step 3 up to the stall: lost with the failed run
    assert g.buckets["lost"] == pytest.approx(2.2, abs=1e-3), g.buckets


def test_an_in_place_restart_in_one_events_file_and_a_run_that_ended_failed(tmp_path: Path) -> None:
    w = Writer(5000 * S)
    _attempt(w, 1, 1, 6, resume=False, commit_every=3, fail_at=5)
    _attempt(w, 2, 4, 6, resume=True, commit_every=3)  # the same process: its `attempt` instant is in_process
    w.events[[i for i, e in enumerate(w.events) if e["name"] == "attempt"][1]]["in_process"] = True
    g = goodput.account(_run_dir(tmp_path, [w]))
    _check_sums(g)
    assert g.attempts == 1 and g.failures == 1 and g.steps_productive == 6 and g.steps_lost == 2  # 4, and 5 cut
    assert g.buckets["teardown"] > 0.4  # the failure's teardown, not the training after the restart

    ended = Writer(9000 * S)
    _attempt(ended, 1, 1, 9, resume=False, commit_every=4, fail_at=7)  # committed 4; 5 and 6 lost with the run
    g = goodput.account(_run_dir(tmp_path / "failed", [ended]))
    _check_sums(g)
    assert g.steps_productive == 4 and g.steps_lost == 3 and g.buckets["productive"] == pytest.approx(4.0)


def test_the_command_prints_the_buckets_and_their_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = Writer(1000 * S)
    _attempt(w, 1, 1, 4, resume=False, commit_every=2)
    run = _run_dir(tmp_path, [w])
    code, out, _ = cli(capsys, "goodput", str(run))
    assert code == 0 and out.startswith("goodput  0.") and "  productive       4.00s   43.5%" in out, out
    code, out, _ = cli(capsys, "goodput", "--json", str(run))
    data = json.loads(out)
    assert code == 0 and data["steps"] == {"productive": 4, "lost": 0} and set(data["buckets_s"]) == set(goodput.BUCKETS)
    code, _, err = cli(capsys, "goodput", str(tmp_path))
    assert code == 2 and "no events/ folder: not a lifecycle run directory" in err and "Traceback" not in err


def test_no_events_is_no_goodput_and_junk_lines_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "run" / "events").mkdir(parents=True)
    assert goodput.account(tmp_path / "run").goodput is None
    (tmp_path / "run" / "events" / "rank_0.jsonl").write_text("not json\n{\"t\": \"x\"}\n")
    g = goodput.account(tmp_path / "run")
    assert g.goodput is None and g.line() == "no training time recorded"


@pytest.mark.parametrize("seed", range(300))
def test_generated_runs_sum_to_the_wall_time_and_keep_exactly_the_final_steps(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    steps, every = rng.randint(3, 30), rng.choice([0, 1, 2, 5])
    writers, done, commit, t = [], 0, 0, 100 * S
    while done < steps and len(writers) < 6:
        w = Writer(t)
        fail = rng.randint(commit + 1, steps) if rng.random() < 0.5 and len(writers) < 5 else None
        committed = _attempt(w, len(writers) + 1, commit + 1, steps, resume=commit > 0, commit_every=every,
                             fail_at=fail, step_s=rng.uniform(0.01, 2.0), age_s=rng.uniform(0, 5))
        commit = max(committed, default=commit)
        done = steps if fail is None else done
        writers.append(w)
        t = w.t + int(rng.uniform(0, 10) * S) + int(6 * S)
    g = goodput.account(_run_dir(tmp_path, writers))
    _check_sums(g)
    finished = done == steps
    assert g.steps_productive == (steps if finished else commit), (seed, g.to_json())
    computed = sum(1 for w in writers for e in w.events if e["name"] == "step" and e["kind"] == "begin")
    assert g.steps_productive + g.steps_lost == computed, (seed, g.to_json())
    assert g.attempts == len(writers) and 0 <= (g.goodput or 0) <= 1
    # the timeline's shading: in time order, back to back, and each bucket's pieces add up to its seconds
    assert all(lo < hi for lo, hi, _ in g.segments) and all(
        a[1] <= b[0] for a, b in zip(g.segments, g.segments[1:], strict=False))
    shaded = dict.fromkeys(goodput.BUCKETS, 0.0)
    for lo, hi, bucket in g.segments:
        shaded[bucket] += (hi - lo) / 1e6
    for bucket, seconds in g.buckets.items():
        assert shaded[bucket] == pytest.approx(seconds, abs=1e-5), (seed, bucket, shaded, g.buckets)


@pytest.mark.parametrize("seed", range(20))
def test_the_steps_thrown_away_are_found_from_the_end_as_a_full_scan_finds_them(seed: int) -> None:
    """Restarts resume anywhere before the last step: the survivors stay in rising order, so the scan from the end
    (linear in the steps run, where a full scan per step was quadratic) finds exactly the steps >= the one run."""
    rng = random.Random(seed)
    survivors: dict[int, int] = {}
    step = 0
    for _ in range(400):
        step = rng.randint(max(step - 30, 1), step) if rng.random() < 0.05 else step + 1
        found = goodput._from_end(survivors, step)
        assert found == sorted(m for m in survivors if m >= step), (seed, step)
        for m in found:
            survivors.pop(m)
        survivors[step] = step


def _collective_attempt(w: Writer, rng: random.Random, number: int, first: int, last: int,
                        fail_at: int | None) -> None:
    """One attempt as the megatron kind writes it: each step's gradient and loss all-reduces inside it, the stop
    flag read at some boundaries, ties to the µs, and a failure cut anywhere inside a step (an op begun and never
    ended, aborted just before a hang report, or the rank killed inside it)."""
    w.at("instant", "attempt", attempt=number, process_start_s=rng.uniform(0, 0.4))  # < the gap between attempts
    w.span("phase:init", 0.4)
    w.at("begin", "phase:train", 0.1)
    if first > 1:
        w.span("resume", 0.2, step=first - 1)
    for step in range(first, last + 1):
        w.at("begin", "step", rng.choice([0.0, 0.000001, 0.001]), step=step)
        ops = [("grad_reduce", 0.01), ("grad_reduce", 0.01), ("loss_all_reduce", 0.003)]
        for i, (op, seconds) in enumerate(ops):
            w.at("begin", op, rng.uniform(0, 0.05), step=step)
            if step == fail_at and i == rng.randrange(3):
                how = rng.random()
                if how < 0.3:  # killed: the file ends inside the op, or just after it ended
                    if rng.random() < 0.5:
                        w.at("end", op, seconds, step=step, dur_us=int(seconds * S))
                    return
                if how < 0.65:  # aborted by the report: the op, then the step, end just before it
                    w.at("end", op, rng.uniform(0.5, 2.0), step=step, outcome="error: aborted")
                    w.at("end", "step", 0.001, step=step)
                    w.at("instant", "hang_report", 0.002, cause="hang", idle_s=rng.uniform(0, 2.5))
                else:  # a peer crashed: this rank's report while the op never ends
                    w.at("instant", "failure", rng.uniform(0.1, 1.0), step=step, exit_code=4)
                w.span("phase:teardown", 0.2, failure=True)
                w.at("instant", "exit", 0.0, exit_code=4)
                return
            w.at("end", op, seconds, step=step, dur_us=int(seconds * S))
        w.at("end", "step", 0.002, step=step, loss=1.0 / step)
        if rng.random() < 0.5:
            w.span("stop_flag", rng.choice([0.0, 0.00003]), step=step)
        if rng.random() < 0.2:
            w.span("memory_save", 0.003, step=step)
    w.at("end", "phase:train", 0.0)
    w.span("phase:teardown", 0.1)
    w.at("instant", "exit", 0.0, exit_code=0)


@pytest.mark.parametrize("seed", range(60))
def test_leaving_the_per_step_collectives_unparsed_changes_no_bucket(tmp_path: Path, seed: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The accounting reads neither the per-step collectives' begin lines nor their spans: the same buckets, steps
    and shading to the µs as reading every line, on generated runs that fail inside those collectives."""
    rng = random.Random(seed)
    steps, writers, done, t = rng.randint(2, 25), [], 0, 50 * S
    while done < steps and len(writers) < 5:
        w = Writer(t)
        first = max(done - rng.randint(0, 3), 0) + 1
        fail = rng.randint(first, steps) if rng.random() < 0.6 and len(writers) < 4 else None
        _collective_attempt(w, rng, len(writers) + 1, first, steps, fail)
        done = steps if fail is None else max(fail - 1, 0)
        writers.append(w)
        t = w.t + int(rng.uniform(0.5, 5) * S)
    run = _run_dir(tmp_path, writers)
    fast = goodput.account(run)
    monkeypatch.setattr(goodput, "_UNREAD", ())
    monkeypatch.setattr(goodput, "PER_STEP_OPS", ())
    full = goodput.account(run)
    assert fast.to_json() == full.to_json() and fast.segments == full.segments, seed
    _check_sums(fast)
