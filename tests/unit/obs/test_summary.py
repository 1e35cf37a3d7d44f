"""summary.json from event files written here: phases over ranks, warmup per group, checkpoints, exits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lifecycle.distributed.ranks import fmt_ranks as rank_ranges
from lifecycle.launch.local import LaunchResult
from lifecycle.obs import summary
from tests.unit.obs.test_timeline import _ev, _write


def _rank(rank: int, train_us: int, *, crash: bool = False) -> list[dict]:  # type: ignore[type-arg]
    evs = [_ev(0, "begin", "phase:warmup", rank, "warmup"),
           _ev(10, "begin", "warm:all_reduce", rank, "warmup", group="dp"),
           _ev(10 + 100 * (rank + 1), "end", "warm:all_reduce", rank, "warmup", group="dp", outcome="ok"),
           _ev(500, "end", "phase:warmup", rank, "warmup"),
           _ev(500, "begin", "phase:train", rank),
           _ev(510, "begin", "save", rank, step=2, path="/ck/iter_2", reason="periodic"),
           _ev(510 + 1000 * (rank + 1), "end", "save", rank, step=2, path="/ck/iter_2", reason="periodic",
               outcome="ok"),
           _ev(3000, "begin", "commit", rank, step=2, path="/ck/iter_2"),
           _ev(3500, "end", "commit", rank, step=2, path="/ck/iter_2", write_s=0.1, outcome="ok"),
           _ev(3600, "instant", "zero_token", rank, count=2)]
    if crash:
        return evs + [_ev(3700, "instant", "fault_drill", rank, action="crash", drill_step=3)]
    return evs + [_ev(500 + train_us, "end", "phase:train", rank), _ev(500 + train_us, "instant", "exit", rank,
                                                                        exit_code=4)]


def test_summary_of_a_run_where_a_rank_died(tmp_path: Path) -> None:
    _write(tmp_path, 0, _rank(0, 4_000_000))
    _write(tmp_path, 1, _rank(1, 0, crash=True))
    launch = LaunchResult(exit_code=17, first_failure=1, how="exit 17", phase="train", per_rank={0: 4, 1: 17, 2: -9},
                          wall_s=3.0, killed=(2,))
    s = summary.build(tmp_path, launch)
    assert s["ranks"] == 3
    train = s["phases"]["train"]
    assert train["max_s"] == 4.0 and train["slowest_rank"] == 0 and train["cut_ranks"] == [1]
    assert train["min_s"] == (3700 - 500) / 1e6  # the cut phase counts up to rank 1's last event
    assert s["warmup_per_group"]["dp"] == {"min_s": 0.0001, "median_s": 0.00015, "max_s": 0.0002,
                                           "slowest_rank": 1, "ranks": 2, "ops": ["all_reduce"]}
    [ck] = s["checkpoints"]
    assert ck["step"] == 2 and ck["save_s"] == 0.002 and ck["save_slowest_rank"] == 1
    assert ck["commit_s"] == 0.0005 and ck["committed"] and ck["write_s"] == 0.1
    assert s["zero_token_events"] == {0: 2, 1: 2}
    status = s["exit_status_per_rank"]
    assert status[0] == {"exit_code": 4, "how": "exit 4", "last_phase": "train", "error": None}
    assert status[1]["exit_code"] == 17 and status[1]["how"] == "exit 17"
    assert status[2] == {"exit_code": 137, "how": "killed by the launcher after the grace period",
                         "last_phase": None, "error": None}
    assert s["fault_drills"] == [{"rank": 1, "phase": "train", "action": "crash", "drill_step": 3}]
    text = summary.render(s)
    assert "cut on ranks 1" in text and "drill    crash on rank 1 in train step 3" in text
    assert "zero-token events: 4 on ranks 0-1" in text and "exit 17: ranks 1" in text
    summary.write(tmp_path, s)
    assert json.loads((tmp_path / "summary.json").read_text())["phases"]["train"]["cut_ranks"] == [1]


def test_uncommitted_save_is_reported(tmp_path: Path) -> None:
    _write(tmp_path, 0, [_ev(0, "begin", "phase:checkpoint", phase="checkpoint"),
                         _ev(5, "begin", "save", step=4, path="/ck/iter_4", phase="checkpoint"),
                         _ev(9, "end", "save", step=4, path="/ck/iter_4", phase="checkpoint", outcome="ok"),
                         _ev(10, "begin", "commit", step=4, path="/ck/iter_4", phase="checkpoint")])
    s = summary.build(tmp_path)
    assert s["checkpoints"][0]["committed"] is False
    assert "NOT saved step 4" in summary.render(s)
    assert s["exit_status_per_rank"][0]["how"] == "no exit event"


def test_rank_ranges() -> None:
    assert rank_ranges([3, 0, 1, 2, 6, 8, "9"]) == "0-3,6,8-9"
    assert rank_ranges([]) == ""


def test_hang_reports_are_listed_with_the_report_file(tmp_path: Path) -> None:
    _write(tmp_path, 0, [_ev(0, "begin", "phase:train"),
                         _ev(9, "instant", "hang_report", cause="collective mismatch", culprits=[2, 3], dead=[],
                             report=str(tmp_path / "hang_report.json")),
                         _ev(10, "end", "phase:train"), _ev(11, "instant", "exit", exit_code=3)])
    (tmp_path / "hang_report.json").write_text("{}")
    s = summary.build(tmp_path)
    assert s["hang_reports"][0]["cause"] == "collective mismatch" and s["hang_reports"][0]["culprits"] == [2, 3]
    assert s["hang_report_file"] == str(tmp_path / "hang_report.json")
    assert "hang     reported by 1 rank(s): collective mismatch culprits 2-3; see " in summary.render(s)


def test_blame_follows_the_watchdogs_diagnosis_not_the_first_rank_to_exit(tmp_path: Path) -> None:
    import json as _json

    from lifecycle.obs.summary import blame

    s = {"first_failure": 0, "failed_phase": "warmup", "outcome": "rank 0 failed first (exit 3) in phase warmup"}
    assert blame(tmp_path, s) == {"ranks": [0], "cause": "failed", "phase": "warmup", "source": "launcher",
                                  "detail": s["outcome"]}
    (tmp_path / "hang_report.json").write_text(_json.dumps({"cause": "hang", "culprits": [1], "phase": "warmup",
                                                            "detail": "rank 1 made no progress"}))
    got = blame(tmp_path, s)
    assert got is not None and got["ranks"] == [1] and got["source"] == "hang_report.json"
    (tmp_path / "hang_report.json").write_text(_json.dumps({"cause": "usage", "culprits": [2]}))
    assert blame(tmp_path, s)["source"] == "launcher"  # type: ignore[index]  # a config error is not a hang


def _cut_after(log: Any, cut: int | None) -> Callable[..., bool]:
    """``log.emit`` until ``cut`` events were written (a rank that died there); then it writes nothing (False)."""
    n = 0

    def emit(kind: str, name: str, **kw: object) -> bool:
        nonlocal n
        n += 1
        if cut is not None and n > cut:
            return False
        log.emit(kind, name, **kw)
        return True

    return emit


def test_the_summary_leaves_the_per_step_collectives_unread_and_says_the_same(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Generated runs through the real EventLog (steps with their gradient, loss and stop-flag collectives, a save,
    ranks cut anywhere, inside a collective too): the summary that does not parse the per-step collectives equals the
    one that parses every line."""
    import random

    from lifecycle.obs.events import EventLog

    rng = random.Random(7)
    for case in range(30):
        run = tmp_path / str(case)
        ranks = rng.randint(1, 3)
        for rank in range(ranks):
            log = EventLog(run, rank, rank)
            log.phase = "train"
            log.emit("begin", "phase:train")
            steps = rng.randint(0, 12)
            emit = _cut_after(log, rng.choice([None, rng.randint(0, 6 * steps + 1)]))
            ok = True
            for step in range(1, steps + 1):
                log.step = step
                ok = (emit("begin", "step") and emit("begin", "grad_reduce", group="dp")
                      and emit("end", "grad_reduce", group="dp", dur_us=5, outcome="ok")
                      and emit("begin", "loss_all_reduce", group="dp")
                      and emit("end", "loss_all_reduce", group="dp", dur_us=3, outcome="ok")
                      and emit("end", "step", dur_us=50, outcome="ok", loss=1.0 / step)
                      and emit("begin", "stop_flag", group="world") and emit("end", "stop_flag", group="world"))
                if ok and step % 4 == 0:
                    ok = (emit("begin", "save", path=f"/ck/{step}", reason="periodic")
                          and emit("end", "save", path=f"/ck/{step}", outcome="ok"))
                if not ok:
                    break
            if ok:
                log.emit("end", "phase:train")
                log.emit("instant", "exit", exit_code=0, step=steps)
            log.close()
        launch = LaunchResult(exit_code=0, first_failure=None, how=None, phase=None,
                              per_rank=dict.fromkeys(range(ranks), 0), wall_s=1.0)
        skipping = summary.build(run, launch, goodput=False)
        with monkeypatch.context() as m:
            m.setattr(summary, "PER_STEP_OPS", ())
            every_line = summary.build(run, launch, goodput=False)
        assert skipping == every_line, case
