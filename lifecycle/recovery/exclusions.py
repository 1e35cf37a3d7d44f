"""Nodes to leave out of the next attempt: the hosts a run's verdicts blamed, accumulated across its attempts.

When the verdict of an attempt blames ranks for something their host may be at fault for — a rank that died, a hang
it was the culprit of, a peer that stopped answering, a cut link — their hosts are recorded in
``<run_dir>/exclude_nodes.json`` (per attempt, and a count per host) and listed, most often blamed first, in
``<run_dir>/exclude_nodes.txt``: one comma-separated line, ready for SLURM's ``--exclude`` / ``scontrol update
ExcNodeList=`` or a Kubernetes node-affinity rule. A rank that raised (the code's fault, not the node's) blames no
host. Recording the same attempt twice counts it once. Pure Python: no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lifecycle.rundir import safeio

FILE = "exclude_nodes.json"
HOSTLIST = "exclude_nodes.txt"
HOST_CAUSES = ("dead", "hang", "unresponsive", "lost")
"""The verdicts that may be the node's fault."""


def blamed_hosts(summary: dict[str, Any]) -> list[str]:
    """The hosts of the ranks the attempt's verdict blames for a cause a node may be at fault for."""
    blame = summary.get("blame") or {}
    if blame.get("cause") not in HOST_CAUSES:
        return []
    hosts = {int(r): h for r, h in (summary.get("hosts") or {}).items()}
    return sorted({hosts[r] for r in blame.get("ranks") or [] if r in hosts})


def record(run_dir: Path, summary: dict[str, Any]) -> list[str]:
    """Add the attempt's blamed hosts to the run's exclusion list (idempotent per attempt); the hosts added."""
    hosts = blamed_hosts(summary)
    if not hosts:
        return []
    path = Path(run_dir) / FILE
    data = safeio.try_json(path)
    known = data.get("attempts") if isinstance(data, dict) else None
    attempts = {str(k): [str(h) for h in v] for k, v in known.items() if isinstance(v, list)} \
        if isinstance(known, dict) else {}
    attempts[str(summary.get("attempt", 1))] = hosts
    counts: dict[str, int] = {}
    for named in attempts.values():
        for host in named:
            counts[host] = counts.get(host, 0) + 1
    ordered = sorted(counts, key=lambda h: (-counts[h], h))
    safeio.write_text(path, json.dumps({"attempts": attempts, "counts": counts, "exclude": ordered}, indent=1) + "\n")
    safeio.write_text(Path(run_dir) / HOSTLIST, ",".join(ordered) + "\n")
    return hosts
