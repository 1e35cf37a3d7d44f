"""Model sizes no rank can allocate, refused when the policy is validated (exit 2) instead of an allocation traceback
after init.

A kind's options model that has ``model_size()`` (:class:`lifecycle.policy.options.ModelSize`: the built-in kinds)
gives a lower estimate of the floats one rank holds; at 4 bytes each it must stay within the larger of
:data:`MAX_RANK_BYTES` and this machine's memory. The estimate is low on purpose (weights and one micro-batch's
activations, no optimizer state): a refused size is one that cannot be allocated, never one that merely might not fit.
"""

from __future__ import annotations

from pydantic import BaseModel

from lifecycle.errors import PolicyIssue
from lifecycle.hostinfo import fmt_bytes, memory_bytes
from lifecycle.policy.sections import ParallelismConfig

MAX_RANK_BYTES = 1 << 40
"""1 TiB: more than any one accelerator or a rank's share of any host holds today."""
BYTES_PER_FLOAT = 4


def rank_bytes(options: BaseModel | None, par: ParallelismConfig) -> int | None:
    """The lower estimate of one rank's model bytes, or None for a kind without ``model_size()``."""
    size_of = getattr(options, "model_size", None)
    if not callable(size_of):
        return None
    size = size_of()
    floats = size.whole + size.split // (par.tp * par.pp) + size.expert // (par.ep * par.expert_tp * par.pp)
    return int(floats) * BYTES_PER_FLOAT


def model_size_issues(options: BaseModel | None, par: ParallelismConfig, steps: int) -> list[PolicyIssue]:
    """The size key that takes the model past what one rank can allocate, with the estimate and the bound."""
    estimate = rank_bytes(options, par) if steps else None
    bound = max(MAX_RANK_BYTES, memory_bytes())
    if estimate is None or options is None or estimate <= bound:
        return []
    key = _largest_key(options, par, estimate)
    split = (f", split over tp={par.tp} pp={par.pp} ep={par.ep} etp={par.expert_tp}"
             if par.tp * par.pp * par.ep > 1 else "")
    return [PolicyIssue(f"train.options.{key}" if key else "train.options",
                        f"the model would take about {fmt_bytes(estimate)} on each rank (a lower estimate: fp32 "
                        f"weights and one micro-batch's activations{split}), more than one rank can allocate: "
                        f"{fmt_bytes(bound)} (the larger of {fmt_bytes(MAX_RANK_BYTES)} and this machine's memory); "
                        f"lower it or split the model over more ranks", getattr(options, key) if key else None,
                        has_value=bool(key))]


def _largest_key(options: BaseModel, par: ParallelismConfig, estimate: int) -> str | None:
    """The integer option above its default whose default would shrink the estimate the most."""
    best, smallest = None, estimate
    for name, info in type(options).model_fields.items():
        value, default = getattr(options, name), info.default
        if isinstance(value, bool) or not isinstance(value, int) or not isinstance(default, int) or value <= default:
            continue
        shrunk = rank_bytes(options.model_copy(update={name: default}), par)
        if shrunk is not None and shrunk < smallest:
            best, smallest = info.alias or name, shrunk
    return best
