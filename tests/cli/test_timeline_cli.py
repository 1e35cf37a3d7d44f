"""`lifecycle timeline` as a subprocess on real 2-rank runs (synthetic train), a clean one and a crashed one."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.runs import FAST, SYNTHETIC, lifecycle_run
from tests.helpers import run_cli
from tests.unit.obs.test_timeline import check_trace

HAS_MPL = importlib.util.find_spec("matplotlib") is not None
PHASES = ("init", "warmup", "train", "checkpoint", "teardown")


def _x(trace: dict[str, Any], tid: int) -> list[str]:
    return [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tid]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_timeline_of_a_real_run(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 2, *SYNTHETIC, *FAST, "train.steps=4", "checkpoint.every_steps=2")
    assert run.code == 0, run.output
    s = run.summary()
    assert set(s["phases"]) == set(PHASES) and all(p["ranks"] == 2 for p in s["phases"].values())
    assert [c["step"] for c in s["checkpoints"]] == [2, 4] and all(c["committed"] for c in s["checkpoints"])
    assert s["warmup_per_group"]["world"]["ranks"] == 2
    assert {st["how"] for st in s["exit_status_per_rank"].values()} == {"exit 0"}

    out = run_cli("timeline", str(run.run_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ui.perfetto.dev" in out.stdout
    trace = json.loads((run.run_dir / "trace.json").read_text())
    check_trace(trace)
    threads = {e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {0, 1}
    for rank in (0, 1):
        names = _x(trace, rank)
        assert {f"phase:{p}" for p in PHASES} <= set(names)
        assert {"init_process_group", "warm:all_reduce", "step 1", "save", "commit"} <= set(names)
        assert "grad_all_reduce" in names and "stop_flag" in names  # the step's collectives, slices of their own
        assert not [n for n in names if n.endswith("(cut)")]
    assert trace["metadata"]["outcome"] == "all 2 ranks succeeded"
    png = run.run_dir / "timeline.png"
    if HAS_MPL:
        assert png.read_bytes()[:4] == b"\x89PNG" and "png " in out.stdout
    else:
        assert not png.exists() and "matplotlib is not installed" in out.stderr


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_crashed_rank_gets_cut_spans_and_the_run_a_summary(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 2, *SYNTHETIC, *FAST, "train.steps=6", "run.timeline=png",
                        "+faults=[{at: train, ranks: [1], action: crash, step: 3}]")
    assert run.code != 0, run.output  # the crash drill leaves through os._exit, no teardown
    s = run.summary()
    assert s["first_failure"] == 1 and 1 in s["phases"]["train"]["cut_ranks"]
    status = s["exit_status_per_rank"]
    assert set(status) == {"0", "1"} and status["1"]["how"] == f"exit {s['exit_code']}"
    assert status["1"]["last_phase"] == "train" and isinstance(status["0"]["exit_code"], int)
    assert s["fault_drills"][0]["rank"] == 1 and "drill    crash on rank 1 in train step 3" in run.output

    out = run_cli("timeline", str(run.run_dir), "--out", str(tmp_path / "t.json"), "--no-png")
    assert out.returncode == 0, out.stdout + out.stderr
    trace = json.loads((tmp_path / "t.json").read_text())
    check_trace(trace)
    assert "phase:train (cut)" in _x(trace, 1) and "phase:init" in _x(trace, 0)
    instants = {(e["tid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "i"}
    assert (1, "fault_drill") in instants and (1, "exit") not in instants
    # `lifecycle run` itself left the trace of the failed run (and the picture when matplotlib is there)
    assert (run.run_dir / "trace.json").is_file()
    assert (run.run_dir / "timeline.png").exists() == HAS_MPL


def test_a_directory_without_events_exits_2_without_traceback(tmp_path: Path) -> None:
    out = run_cli("timeline", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: no events in ")
    out = run_cli("timeline", str(tmp_path / "nope"))
    assert out.returncode == 2 and "is not a directory" in out.stderr and "Traceback" not in out.stderr
