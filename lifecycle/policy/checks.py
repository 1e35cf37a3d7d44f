"""Rules that need the world size (cross-field rules within one policy are in :mod:`lifecycle.policy.schema`)."""

from __future__ import annotations

from lifecycle.errors import PolicyIssue
from lifecycle.policy.schema import Policy


def world_issues(p: Policy, world_size: int) -> list[PolicyIssue]:
    """Rules that need the real world size (checked by `explain --world-size` and at run time)."""
    par = p.parallelism
    issues: list[PolicyIssue] = []
    mp = par.tp * par.pp * par.cp
    if world_size % mp:
        issues.append(PolicyIssue("parallelism", f"world size {world_size} is not divisible by "
                                  f"tp*pp*cp = {par.tp}*{par.pp}*{par.cp} = {mp}", world_size))
    emp = par.expert_tp * par.ep * par.pp
    if world_size % emp:
        issues.append(PolicyIssue("parallelism", f"world size {world_size} is not divisible by "
                                  f"etp*ep*pp = {par.expert_tp}*{par.ep}*{par.pp} = {emp}", world_size))
    for i, drill in enumerate(p.faults):
        bad = [r for r in drill.ranks if r >= world_size]
        if bad:
            issues.append(PolicyIssue(f"faults.{i}.ranks", f"ranks {bad} do not exist at world size "
                                      f"{world_size}", drill.ranks))
    return issues
