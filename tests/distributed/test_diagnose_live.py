"""`lifecycle diagnose` on fresh jobs the recorded cases never showed: another world size, step, rank and group,
plain torch.distributed under torchrun on gloo (small timeouts), read back through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_cli

JOB = ROOT / "tests" / "data" / "diagnose" / "jobs" / "plain_loop.py"
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(90)]


def _torchrun(tmp: Path, nproc: int, **env: str) -> Path:
    out = tmp / "job"
    (out / "fr").mkdir(parents=True)
    full = {**os.environ, "OMP_NUM_THREADS": "1", "COLL_TIMEOUT_S": "3", "CKPT_DIR": str(tmp / "ckpt"), **env}
    if env.get("FR_DIR") == "yes":
        full.update(FR_DIR=str(out / "fr"), TORCH_FR_BUFFER_SIZE="500")
    proc = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node",
                           str(nproc), str(JOB)], env=full, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=80)
    assert proc.returncode != 0
    (out / "console.txt").write_bytes(proc.stdout)
    return out


def test_a_rank_stalled_inside_a_step_of_a_world_6_job(tmp_path: Path) -> None:
    out = _torchrun(tmp_path, 6, TP="3", FAULT="stall_inside", FAULT_RANK="4", FAULT_STEP="3", FR_DIR="yes")
    # gloo's dumps alone: rank 4 left every collective it entered, but gloo records no send or receive
    alone = json.loads(run_cli("diagnose", "--json", str(out)).stdout)
    assert alone["culprits"] == [] and alone["suspects"] == [4], alone
    assert any("-w N -o" in m for m in alone["missing"]), alone["missing"]
    # the job's layout, as its user gives it (tp=3 at world 6, no pipeline, no experts), decides
    layout = ("-w", "6", "-o", "parallelism.tp=3", "-o", "parallelism.ep=1", "-o", "parallelism.etp=1")
    proc = run_cli("diagnose", "--json", str(out), *layout)
    assert proc.returncode == 0, proc.stderr
    verdict = json.loads(proc.stdout)
    assert verdict["culprits"] == [4], verdict
    assert verdict["cause"] == "never entered" and verdict["group"]["ranks"] == [1, 4]
    assert verdict["dimension"] == "dp" and verdict["stage"] == "train"


def test_a_rank_killed_in_a_world_2_job_without_dumps(tmp_path: Path) -> None:
    out = _torchrun(tmp_path, 2, FAULT="kill", FAULT_RANK="0", FAULT_STEP="4", CKPT_STEP="9")
    proc = run_cli("diagnose", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("lifecycle diagnose: culprit rank(s) 0: crashed"), proc.stdout
