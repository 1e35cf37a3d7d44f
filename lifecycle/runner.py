"""`lifecycle run`: compose the policy once, then either launch local ranks or run as one rank.

With RANK/WORLD_SIZE in the environment (torchrun, srun wrappers) this process is one rank of a larger
job: it composes the same policy (the run id comes from TORCHELASTIC_RUN_ID / SLURM_JOB_ID, identical
on every rank) and runs the orchestrator in-process. Otherwise it writes the resolved policy into a new
run directory, starts ``--nproc`` ranks through :func:`lifecycle.launch.launch_local`, and prints the
summary. It returns the exit code of the first rank that failed.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from lifecycle.errors import PolicyError, UsageError


def _new_run_id() -> str:
    # Generated once, here, and handed to every rank: never derived from per-rank clocks.
    return f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"


def run(overrides: Sequence[str], *, nproc: int = 4, config_dir: str | None = None,
        config_name: str = "config") -> int:
    from lifecycle.policy.load import load

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_as_rank(overrides, config_dir, config_name)
    if nproc < 1:
        raise UsageError(f"--nproc must be >= 1 (got {nproc})")
    os.environ.setdefault("LIFECYCLE_RUN_ID", _new_run_id())
    loaded = load(overrides, config_dir=config_dir, config_name=config_name)
    return launch(loaded.policy, nproc)


def launch(policy: object, nproc: int) -> int:
    """Write the resolved policy, start the ranks, print and write the summary."""
    from lifecycle.launch import launch_local
    from lifecycle.obs import summary
    from lifecycle.policy.checks import world_issues
    from lifecycle.policy.load import write_resolved
    from lifecycle.policy.schema import Policy

    assert isinstance(policy, Policy)
    issues = world_issues(policy, nproc)
    if issues:
        raise PolicyError(issues, source=f"--nproc {nproc}")
    run_dir = Path(policy.run.dir).resolve()
    if (run_dir / "events").exists():
        raise UsageError(f"run directory {run_dir} already holds a run; pick another run.name/run.id or "
                         f"remove it (checkpoints there can be resumed with checkpoint.dir=...)")
    write_resolved(policy, run_dir)
    print(f"lifecycle: {nproc} ranks, run directory {run_dir}", flush=True)
    result = launch_local([sys.executable, "-m", "lifecycle.worker", str(run_dir)], nproc, run_dir)
    info = summary.build(run_dir, result)
    summary.write(run_dir, info)
    print(summary.render(info), flush=True)
    _timeline(run_dir)
    return int(result.exit_code)


def _timeline(run_dir: Path) -> None:
    """The merged trace (and the PNG when matplotlib is installed); never changes the run's exit code."""
    import logging

    from lifecycle.obs import timeline

    try:
        timeline.main(run_dir)
    except Exception as exc:  # noqa: BLE001 - a picture must not fail a finished run
        logging.getLogger(__name__).warning("timeline not written: %s", exc)


def _run_as_rank(overrides: Sequence[str], config_dir: str | None, config_name: str) -> int:
    from lifecycle.policy.load import load, write_resolved
    from lifecycle.worker import run_rank

    loaded = load(overrides, config_dir=config_dir, config_name=config_name)
    run_dir = Path(loaded.policy.run.dir).resolve()
    if os.environ.get("RANK") == "0":
        write_resolved(loaded.policy, run_dir)
    return run_rank(run_dir, loaded.policy)
