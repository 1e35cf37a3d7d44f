"""Symbolic process-group names a policy may use.

Pure Python (no torch): the policy validator and ``lifecycle explain`` import it. Each name maps to one
Megatron-Core group kind; ``world`` is the default group. Gloo twins exist where Megatron creates them.
"""

from __future__ import annotations

import difflib

GROUPS: dict[str, str] = {
    "world": "every rank (the default process group)",
    "dp": "data parallel",
    "dp_cp": "data parallel x context parallel",
    "tp": "tensor parallel",
    "pp": "pipeline parallel",
    "cp": "context parallel",
    "mp": "model parallel (tp x pp)",
    "tp_cp": "tensor x context parallel",
    "tp_dp": "tensor x data parallel",
    "tp_dp_cp": "tensor x data x context parallel",
    "embd": "embedding (first and last pipeline stage)",
    "pos_embd": "position embedding (first pipeline stage)",
    "ep": "expert model parallel",
    "etp": "expert tensor parallel",
    "edp": "expert data parallel",
    "tp_ep": "expert tensor x expert model parallel",
    "tp_ep_pp": "expert tensor x expert model x pipeline parallel",
    "tp_ep_pp_egtp": "expert tensor x expert model x pipeline parallel once more, merged across expert GTP peers "
                     "(megatron-core 0.19+: the expert optimizer's gradient-norm group; the ranks of tp_ep_pp)",
    "intra_edp": "expert data parallel inside one distributed-optimizer instance",
    "intra_dist_opt": "all ranks of one distributed-optimizer instance",
    "inter_dist_opt": "across distributed-optimizer instances (inter partial expert-DP; the seed bug)",
    "intra_dp_cp": "data x context parallel inside one distributed-optimizer instance (the dense optimizer's "
                   "reduce-scatter and all-gather)",
    "dp_gloo": "data parallel, gloo twin",
    "dp_cp_gloo": "data x context parallel, gloo twin",
    "edp_gloo": "expert data parallel, gloo twin",
}

GROUP_NAMES: tuple[str, ...] = tuple(GROUPS)
ALL = "all"


def closest(name: str, options: tuple[str, ...] | list[str] = GROUP_NAMES) -> str | None:
    """The closest valid name to ``name`` (for "did you mean" hints), or None."""
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return match[0] if match else None
