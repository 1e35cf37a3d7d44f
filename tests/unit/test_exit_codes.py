"""One exit-code contract: the table in lifecycle.errors is what docs/running.md shows and what the Kubernetes
example acts on (the sbatch example: tests/slurm/)."""

from __future__ import annotations

import yaml

from lifecycle.errors import EXIT_RULES, ExitCode, codes_that, exit_codes_markdown
from tests.helpers import ROOT


def test_the_docs_show_the_table_of_the_code() -> None:
    assert exit_codes_markdown() in (ROOT / "docs" / "running.md").read_text()
    numeric = {int(r.code) for r in EXIT_RULES if r.code.isdigit()}
    constants = {v for k, v in vars(ExitCode).items() if k.isupper()}
    assert numeric == constants, (numeric, constants)
    assert set(codes_that("stop")) == {ExitCode.USAGE, ExitCode.NO_PROGRESS}
    assert set(codes_that("restart")) == {ExitCode.HANG, ExitCode.RANK_FAILED, ExitCode.TEARDOWN_DEADLINE}
    assert codes_that("done") == [ExitCode.OK]


def test_the_kubernetes_jobset_stops_on_the_stop_codes_and_restarts_on_the_rest() -> None:
    spec = yaml.safe_load((ROOT / "examples" / "kubernetes" / "jobset.yaml").read_text())["spec"]
    assert spec["failurePolicy"]["maxRestarts"] > 0
    assert {"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]} in spec["failurePolicy"]["rules"]
    job = spec["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == 0  # every other failure fails the Job at once: the JobSet restarts it
    stop = [r for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert [sorted(r["onExitCodes"]["values"]) for r in stop] == [sorted(codes_that("stop"))]
    assert all(r["onExitCodes"]["operator"] == "In" for r in stop)
    pod = job["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert float(env["LIFECYCLE_SIGNAL_LEAD_S"]) == pod["terminationGracePeriodSeconds"]
    assert "lifecycle verdict" in pod["containers"][0]["args"][0]  # torchrun's own exit code is 1 for any failure
