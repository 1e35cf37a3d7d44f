"""Cross-field rules of a policy. Each issue names the key path, the value and the fix."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lifecycle.errors import PolicyIssue

if TYPE_CHECKING:
    from lifecycle.policy.schema import Policy


def cross_field_issues(p: Policy) -> list[PolicyIssue]:
    """Rules that span sections (the world size is not known here: see :func:`world_issues`)."""
    issues: list[PolicyIssue] = []
    dl = p.watchdog.deadlines
    if p.teardown.deadline_s < dl.teardown:
        issues.append(PolicyIssue(
            "teardown.deadline_s",
            f"must be >= watchdog.deadlines.teardown ({dl.teardown}); raise it or lower the deadline",
            p.teardown.deadline_s))
    if p.warmup.deadline_s is not None and p.warmup.deadline_s > dl.warmup:
        issues.append(PolicyIssue(
            "warmup.deadline_s", f"must be <= watchdog.deadlines.warmup ({dl.warmup})", p.warmup.deadline_s))
    experts = getattr(p.train.options, "num_experts", None)
    ep = p.parallelism.ep
    if experts is not None and ep > 1:
        if experts == 0:
            issues.append(PolicyIssue("parallelism.ep", "ep > 1 needs a MoE model; set train.options."
                                      "num_experts or parallelism.ep=1", ep))
        elif ep > experts or experts % ep:
            issues.append(PolicyIssue(
                "parallelism.ep", f"must divide train.options.num_experts ({experts}); pick ep in "
                f"{divisors(experts)}", ep))
    issues.extend(_model_shape_issues(p))
    if p.moe.zero_token.action != "off" and experts == 0:
        issues.append(PolicyIssue("moe.zero_token.action", "the model has no experts (train.options."
                                  "num_experts=0); set it to off", p.moe.zero_token.action))
    issues.extend(_fault_issues(p))
    if "inter_dist_opt" in p.warmup.required and p.parallelism.dist_opt_instances == 1:
        issues.append(PolicyIssue("warmup.required", "names inter_dist_opt, which megatron creates only with "
                                  "parallelism.dist_opt_instances > 1; raise the instances or drop the group",
                                  list(p.warmup.required)))
    return issues


def divisors(n: int, limit: int = 16) -> list[int] | str:
    """The divisors of ``n`` in order (O(sqrt n), for n up to 10^12), or a hint when there are too many."""
    if n > 10**12:
        return "the divisors of that number"
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    found = sorted({*small, *(n // d for d in small)})
    return found if len(found) <= limit else f"{found[:limit]} ... ({len(found)} divisors)"


def _divides(issues: list[PolicyIssue], key: str, size: int, what: str, value: int | None) -> None:
    if value is not None and size > 1 and value % size:
        issues.append(PolicyIssue(key, f"must divide {what} ({value}); megatron would refuse the model at build",
                                  size))


def _model_shape_issues(p: Policy) -> list[PolicyIssue]:
    """What megatron-core checks when it builds the model, checked before anything starts (options of any kind
    that has them: heads, layers, ffn_hidden, seq_len, num_experts)."""
    o, par = p.train.options, p.parallelism
    if p.train.steps == 0 or o is None:
        return []
    issues: list[PolicyIssue] = []
    heads, layers = getattr(o, "heads", None), getattr(o, "num_layers", None)
    ffn, seq = getattr(o, "ffn_hidden", None), getattr(o, "seq_len", None)
    _divides(issues, "parallelism.tp", par.tp, "train.options.heads", heads)
    _divides(issues, "parallelism.tp", par.tp, "train.options.ffn_hidden", ffn)
    # tensor parallelism runs with sequence parallelism (megatron requires it with expert parallelism)
    _divides(issues, "parallelism.tp", par.tp, "train.options.seq_len (sequence parallel)", seq)
    _divides(issues, "parallelism.etp", par.expert_tp, "train.options.ffn_hidden (expert tensor parallel)",
             ffn if getattr(o, "num_experts", 0) else None)
    stages = par.pp * (par.vpp or 1)
    if layers is not None and stages > 1 and layers % stages:
        issues.append(PolicyIssue("train.options.num_layers", f"must be divisible by pp x vpp = {par.pp} x "
                                  f"{par.vpp or 1} = {stages} (one equal share of layers per pipeline stage)",
                                  layers))
    if seq is not None and par.cp > 1 and seq % (2 * par.cp):
        issues.append(PolicyIssue("train.options.seq_len", f"must be divisible by 2 x cp = {2 * par.cp} (context "
                                  f"parallel splits each sequence into 2 x cp chunks)", seq))
    return issues


def _fault_issues(p: Policy) -> list[PolicyIssue]:
    issues: list[PolicyIssue] = []
    for i, drill in enumerate(p.faults):
        if drill.step is not None and drill.step > p.train.steps:
            issues.append(PolicyIssue(f"faults.{i}.step", f"is after the last train step ({p.train.steps})",
                                      drill.step))
    return issues


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
