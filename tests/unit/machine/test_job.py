"""The public face (``import lifecycle``) and the Job's answers to a caller's mistakes, on one real gloo rank.

The Job runs in a subprocess (``_attach_probe.py``): ``attach`` starts a watchdog, installs signal handlers and
owns the default group, as it would in a trainer. Every mistake is a ``LifecycleError`` that says what to do;
nothing hangs; a closed job can be attached again and resumes what the first one committed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import free_port
from tests.distributed.runs import FAST, SYNTHETIC
from tests.helpers import ROOT

PROBE = Path(__file__).with_name("_attach_probe.py")


def test_import_lifecycle_loads_no_torch_and_every_public_name_resolves() -> None:
    code = ("import sys, lifecycle; assert 'torch' not in sys.modules, 'torch imported';"
            "print(sorted(lifecycle.__all__));"
            "[getattr(lifecycle, n) for n in lifecycle.__all__]")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    names = set(json.loads(proc.stdout.replace("'", '"')))
    assert {"attach", "Job", "Decision", "load_policy", "Policy", "LifecycleError", "PolicyError", "UsageError",
            "install_zero_token_guard", "HandlerSpec"} <= names


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_caller_mistakes_are_clear_errors_and_a_closed_job_can_be_attached_again(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PORT": str(free_port()), "PORT2": str(free_port())}
    overrides = [*SYNTHETIC, *FAST, f"run.dir={tmp_path / 'run'}", "checkpoint.every_steps=2"]
    proc = subprocess.run([sys.executable, str(PROBE), *overrides], capture_output=True, text=True, timeout=100,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-4000:]  # the last `with` raised
    lines = proc.stdout.strip().splitlines()
    assert "clean exit closed: True 0" in lines
    assert "finally ran: True 4" in lines and lines[-1] == "atexit ran"  # the trainer's clean-up ran, then exit 4
    assert "ValueError" in proc.stderr and "the trainer's own bug" in proc.stderr
    out = json.loads(next(line for line in lines if line.startswith("{")))
    no_env = out["no_env"]
    assert no_env[0] == "UsageError" and no_env[2] == 2
    assert "no process group and no launcher environment" in no_env[1] and "torchrun" in no_env[1]
    assert out["twice"][0] == "UsageError" and "called twice" in out["twice"][1]
    assert out["watch_non_module"][0] == "UsageError" and "got str" in out["watch_non_module"][1]
    assert "holding ['int']" in out["watch_list_of_junk"][1]
    assert "called already" in out["watch_twice"][1]
    assert "total must be an integer >= 0 (got -1)" in out["steps_negative"][1]
    assert out["steps_done"] == [1, 2, 3] and out["close"] == 0 and out["close_again"] == 0
    assert "this Job is closed" in out["steps_after_close"][1] and "this Job is closed" in out["boundary_after_close"][1]
    for call in ("watch", "step", "report", "phase", "save", "checkpoint", "fail"):  # every call names itself
        assert out[f"{call}_after_close"][:2] == ["UsageError", f"job.{call}(): this Job is closed (its teardown ran); "
                                                                f"attach again for a new run"], (call, out)
    assert out["resumed"] == 3 and out["weights_restored"] is True and out["steps_again"] == [4, 5]
    assert out["save_unwatched"][0] == "UsageError" and "no model is watched" in out["save_unwatched"][1]
    assert "job.steps() before job.watch()" in out["steps_before_watch"][1]
    assert "not one of lifecycle's own spans" in out["phase_reserved_name"][1]
    # adopted with torch's default gloo timeout (1800 s): eval (1800 s, set by nobody) fits 34 s under it, the
    # deadlines FAST set stay, and no "timeouts:" warning says the chain is broken
    dl = out["adopted_deadlines"]
    assert dl["eval"] == 1800 - 34 and (dl["step"], dl["checkpoint"], dl["warmup"]) == (20, 30, 20), dl
    assert out["adopted_group_kept"] is True
    assert "process-group timeout is" not in proc.stderr
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest == "iter_0000005"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())  # the failed attempt's, by rank 0
    assert summary["attempt"] == 4 and summary["exit_code_per_rank"] == {"0": 4}
    assert summary["failures"][0]["error"] == "ValueError"
