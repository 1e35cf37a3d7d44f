"""The run directory as one rank of a job takes it: the launcher (``lifecycle run``), rank 0 of a job another launcher
started (torchrun, srun) and ``lifecycle.attach()`` check the folders, take the run directory's lock (one launcher
per run directory) and check what the world size decides before any rank starts; ranks other than 0 check the
folders only."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lifecycle import rundir
from lifecycle.errors import PolicyError, PolicyIssue, UsageError

if TYPE_CHECKING:
    from lifecycle.policy.schema import Policy
    from lifecycle.rundir.runlock import RunLock


def preflight(policy: Policy, world_size: int, ranks_per_node: int | None = None) -> None:
    """What the world size, the communicator budget and the checkpoint folder decide before any rank starts
    (PolicyError/UsageError: exit 2); the run's folders are checked by :func:`own_run_dir`. ``ranks_per_node``:
    the local launcher's ranks; else torchrun's ``LOCAL_WORLD_SIZE``, else 8."""
    from lifecycle.machine import preflight as checks
    from lifecycle.policy.checks import world_issues
    from lifecycle.policy.timeouts import issues as timeout_issues

    issues = world_issues(policy, world_size)
    if not issues:
        issues = _layout_issues(policy, world_size)
    if not issues:
        issues = timeout_issues(policy, last_save_s=_last_save_s(Path(policy.run.dir)))
    if issues:
        raise PolicyError(issues, source=f"world size {world_size}")
    checks.check_megatron_imports(policy)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    per_node = ranks_per_node or (int(local) if local.isdigit() and int(local) > 0 else min(world_size, 8))
    checks.check_comm_budget(policy, world_size, per_node)
    checks.check_control_plane(policy, world_size, per_node)
    checks.check_memory_tier(policy, per_node)
    checks.events_flush_every()
    ck = policy.checkpoint  # the folders themselves were checked when the run directory was taken (own_run_dir)
    checks.check_resume(ck.dir, ck.resume, ck.on_corrupt)


def _last_save_s(run_dir: Path) -> float | None:
    """How long the run's last committed save took (save + commit, its summary.json), if the run has one."""
    from lifecycle.rundir import safeio

    summary = safeio.try_json(run_dir / rundir.SUMMARY)
    saves = summary.get("checkpoints") if isinstance(summary, dict) else None
    done = [c for c in saves if isinstance(c, dict) and c.get("committed")] if isinstance(saves, list) else []
    if not done:
        return None
    last = done[-1]
    try:
        return float(last.get("save_s") or 0.0) + float(last.get("commit_s_max") or last.get("commit_s") or 0.0)
    except (TypeError, ValueError):
        return None


def _layout_issues(policy: Policy, world_size: int) -> list[PolicyIssue]:
    """Megatron's own layout rules at this world size (instances, order), checked as its
    ``initialize_model_parallel`` would check them after init."""
    from lifecycle.distributed.layout import of_policy

    try:
        of_policy(policy, world_size)
    except UsageError as exc:
        key = "parallelism.dist_opt_instances" if "dist_opt_instances" in str(exc) else (
            "parallelism.order" if "order" in str(exc) else "parallelism")
        return [PolicyIssue(key, str(exc), has_value=False)]
    return []


_HELD: dict[Path, RunLock] = {}
"""The run directories this process holds the lock of (the launcher, or rank 0 under another launcher)."""


def own_run_dir(policy: Policy, *, peers_starting: bool = False) -> Path:
    """Check where the run may write (before anything there is read or moved), then take the run directory's
    lock: one launcher per run directory (a second one exits 2 naming the holder). The resolved run directory.
    ``peers_starting``: rank 0 of a job other ranks of which start now (torchrun, srun, attach)."""
    from lifecycle.machine import preflight as checks
    from lifecycle.rundir import runlock

    issues = checks.place_problem(policy.run.dir, policy.checkpoint.dir)
    if issues:
        raise PolicyError(issues, source="before launch")
    checks.check_owner(policy.run.dir, policy.run.adopt_existing, peers_starting=peers_starting)
    checks.check_dirs(policy.run.dir, policy.checkpoint.dir)
    run_dir = Path(policy.run.dir).resolve()
    if run_dir not in _HELD:
        lock = runlock.RunLock(run_dir).acquire()
        if lock.took_over:
            print(f"lifecycle: took over run directory {run_dir} from a launcher that is gone ({lock.took_over})",
                  flush=True)
        _HELD[run_dir] = lock
    return run_dir


def release_run_dir(run_dir: Path) -> None:
    lock = _HELD.pop(Path(run_dir), None)
    if lock is not None:
        lock.release()


def prepare_rank_dir(policy: Policy, rank: int, world: int, overrides: Sequence[str], *, hint: str) -> Path:
    """One rank of a job started by another launcher (torchrun, srun, a trainer's own): rank 0 checks what can be
    checked before init and writes the resolved policy; every rank checks the folders. The run directory."""
    import lifecycle.rundir as rundir
    from lifecycle.policy.load import write_resolved
    from lifecycle.rundir import safeio

    if rank == 0:
        from lifecycle.machine import preflight as checks

        run_dir = own_run_dir(policy, peers_starting=world > 1)
        if rundir.holds_run(run_dir) and policy.checkpoint.resume == "never":
            raise UsageError(f"run directory {run_dir} already holds a run and checkpoint.resume=never; set a new "
                             f"run id ({hint}) or checkpoint.resume=auto to continue it")
        preflight(policy, world)
        checks.mark_owner(run_dir)
        write_resolved(policy, run_dir)
        safeio.write_text(run_dir / rundir.OVERRIDES, "".join(f"{o}\n" for o in overrides))
    else:
        from lifecycle.machine import preflight as checks

        checks.check_dirs(policy.run.dir, policy.checkpoint.dir)
        run_dir = Path(policy.run.dir).resolve()
    return run_dir
