"""What the communicators of one rank will cost, estimated before launch from the policy and the layout alone.

The model (per NCCL communicator of ``n`` ranks; gloo twins cost no device memory and are listed apart)::

    bytes = channels x peers x sum(buffer of each enabled protocol)  [+ NVLS buffers when NCCL_NVLS_ENABLE=1]
    peers = 2 for the ring (one send, one receive connection) + 2 for the tree (parent, child) when n > 2
            (with distributed.connect=lazy only the ring is counted: the tree connects at first use)
    buffers per connection and channel: Simple = NCCL_BUFFSIZE (4 MiB), LL = 512 KiB, LL128 = 4,915,200 B
            (NCCL's DEFAULT_BUFFSIZE, DEFAULT_LL_BUFFSIZE = 8 lines x 512 threads x 8 steps x 16 B, and
            DEFAULT_LL128_BUFFSIZE = 120 elements x 640 threads x 8 steps x 8 B); NCCL_PROTO removes protocols
    channels = NCCL_MAX_NCHANNELS when set, else 16 inside a node and 8 across nodes (typical of NVLink and
            InfiniBand systems; NCCL decides from the topology at init)
    NVLS (only when NCCL_NVLS_ENABLE=1, a group inside one node of more than 2 ranks): 2 x channels x NCCL_BUFFSIZE

Checked against published figures (order of magnitude): 544 MB for a 2-rank communicator on A100 at NCCL's defaults
(NCCL issue #964) — this model gives 294 MiB. PyTorch creates one communicator per group object even when two groups
hold the same ranks, so every such duplicate is paid again: :func:`estimate` names them and what they cost.
Pure Python: ``lifecycle explain`` prints it without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lifecycle.jsontypes import JsonDict
from lifecycle.policy.groupnames import GROUP_NAMES

if TYPE_CHECKING:
    from lifecycle.distributed.groups import ResolvedGroup
    from lifecycle.distributed.layout import Layout, RankSet
    from lifecycle.policy.schema import Policy

MIB = 1 << 20
SIMPLE = 4 * MIB
LL = 512 * 1024
LL128 = 4_915_200
CHANNELS_INTRA = 16
CHANNELS_INTER = 8
GLOO_TWINS = ("dp_gloo", "dp_cp_gloo", "edp_gloo")


@dataclass(frozen=True)
class Settings:
    """The NCCL settings the estimate depends on (from ``distributed.effective_nccl_env()``)."""

    buffsize: int = SIMPLE
    max_channels: int | None = None
    protocols: tuple[str, ...] = ("LL", "LL128", "Simple")
    nvls: bool = False
    eager: bool = True

    @staticmethod
    def of(env: dict[str, str]) -> Settings:
        protos: tuple[str, ...] = ("LL", "LL128", "Simple")
        spec = env.get("NCCL_PROTO")
        if spec:
            named = tuple(p.strip() for p in spec.lstrip("^").split(","))
            protos = tuple(p for p in protos if p not in named) if spec.startswith("^") else named
        return Settings(buffsize=int(env.get("NCCL_BUFFSIZE", SIMPLE)),
                        max_channels=int(env["NCCL_MAX_NCHANNELS"]) if "NCCL_MAX_NCHANNELS" in env else None,
                        protocols=protos, nvls=env.get("NCCL_NVLS_ENABLE") == "1",
                        eager=env.get("NCCL_RUNTIME_CONNECT", "0") == "0")


def communicator_bytes(n: int, *, intra_node: bool, settings: Settings) -> int:
    """The estimated device memory of one NCCL communicator of ``n`` ranks (0 for a communicator of one)."""
    if n <= 1:
        return 0
    channels = settings.max_channels or (CHANNELS_INTRA if intra_node else CHANNELS_INTER)
    per_connection = sum({"Simple": settings.buffsize, "LL": LL, "LL128": LL128}[p] for p in settings.protocols)
    peers = 2 + (2 if n > 2 and settings.eager else 0)
    nvls = 2 * channels * settings.buffsize if settings.nvls and intra_node and n > 2 else 0
    return channels * peers * per_connection + nvls


@dataclass
class Bill:
    """One rank's communicators: name(s), ranks, whether inside one node, and the estimated bytes."""

    rank: int
    ranks_per_node: int
    backend: str = "nccl"
    communicators: list[JsonDict] = field(default_factory=list)
    duplicates: list[JsonDict] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    """Groups with a communicator here that the job's own collectives never use (``warmup.groups: used`` skips
    them); empty when the train kind's collectives are not known."""

    @property
    def total(self) -> int:
        return sum(int(c["bytes"]) for c in self.communicators)

    def as_dict(self) -> JsonDict:
        wasted = sum(int(d["bytes"]) for d in self.duplicates)
        unused = sum(int(c["bytes"]) for c in self.communicators if c["group"] in self.unused)
        return {"unused_by_job": self.unused, "unused_bytes": unused, "backend": self.backend, "rank": self.rank,
                "ranks_per_node": self.ranks_per_node, "total_bytes": self.total,
                "total_gib": round(self.total / 2**30, 3), "communicators": self.communicators,
                "identical_rank_sets": self.duplicates, "duplicate_bytes": wasted}


def estimate(groups: dict[str, RankSet], rank: int, ranks_per_node: int, settings: Settings,
             warmed: list[str] | None = None, *, backend: str = "nccl",
             messages: dict[str, int] | None = None) -> Bill:
    """The bill of ``rank`` for its groups (name -> ranks; the default group as ``world``). ``warmed``: the group
    names the run creates a communicator for (warmup.groups); None: every group. ``backend`` gloo: every group is
    a gloo communicator (the twins included) costing :func:`gloo_bytes` of its largest message in ``messages``
    (group name -> bytes). O(groups), whatever the world."""
    bill = Bill(rank, ranks_per_node, backend)
    by_ranks: dict[RankSet, list[str]] = {}
    for name in GROUP_NAMES:
        ranks = groups.get(name)
        twin = name in GLOO_TWINS and backend != "gloo"
        if ranks is None or twin or (warmed is not None and name not in warmed and name != "world"):
            continue
        intra = ranks.base // ranks_per_node == ranks.last // ranks_per_node  # ascending: first and last decide
        nbytes = (gloo_bytes(ranks.size, (messages or {}).get(name, 4)) if backend == "gloo"
                  else communicator_bytes(ranks.size, intra_node=intra, settings=settings))
        bill.communicators.append({"group": name, "size": ranks.size, "intra_node": intra, "bytes": nbytes})
        by_ranks.setdefault(ranks, []).append(name)
    cost = {c["group"]: c["bytes"] for c in bill.communicators}
    for ranks, names in by_ranks.items():
        if len(names) > 1 and ranks.size > 1:
            bill.duplicates.append({"groups": names, "size": ranks.size,
                                    "bytes": sum(int(cost[n]) for n in names[1:])})
    return bill


def rank_bill(layout: Layout, rank: int, ranks_per_node: int, settings: Settings, warmed: list[str] | None, *,
              backend: str = "nccl", messages: dict[str, int] | None = None) -> Bill:
    """:func:`estimate` for ``rank``'s groups in ``layout``."""
    # With one distributed-optimizer instance megatron hands out the dp_cp and edp objects for these: no
    # communicator of their own.
    same_object = ("intra_dp_cp", "intra_edp") if layout.dist_opt_instances == 1 else ()
    groups = {n: g for n in GROUP_NAMES if n not in same_object and (g := layout.group_of(n, rank)) is not None}
    return estimate(groups, rank, ranks_per_node, settings, warmed, backend=backend, messages=messages)


def backend_of(policy: Policy) -> str:
    """The backend the run will use: ``distributed.backend``, and for ``auto`` nccl where this machine has an NVIDIA
    driver (what ``torch.cuda.is_available()`` answers on the ranks, read without importing torch), else gloo."""
    chosen = str(policy.distributed.backend)
    if chosen != "auto":
        return chosen
    return "nccl" if has_nvidia_driver() else "gloo"


def has_nvidia_driver() -> bool:
    """Whether this machine has an NVIDIA driver (read without importing torch)."""
    import os

    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


def policy_bill(policy: Policy, layout: Layout, rank: int, ranks_per_node: int) -> Bill:
    """``rank``'s bill for the run ``policy`` describes: its backend, its NCCL settings, the groups warmup creates
    (``warmup.groups``; the default group always) and, on gloo, the largest message warmed on each."""
    from lifecycle.distributed.messages import job_messages, requested_groups

    warmed = requested_groups(policy, layout.world_size) if policy.warmup.enabled else []
    messages: dict[str, int] = {}
    if "job" in policy.warmup.sizes:
        for m in job_messages(policy):
            messages[m.group] = max(messages.get(m.group, 0), m.nbytes)
    from lifecycle.distributed.messages import used_groups

    bill = rank_bill(layout, rank, ranks_per_node, Settings.of(policy.distributed.effective_nccl_env()), warmed,
                     backend=backend_of(policy), messages=messages)
    used = used_groups(policy, layout.world_size)
    if used is not None:
        bill.unused = [c["group"] for c in bill.communicators if c["group"] not in used and c["size"] > 1]
    return bill


GLOO_BASE = 64 * 1024
"""Gloo: what warming one communicator costs whatever its size (its ops' objects and work queue entries)."""
GLOO_PER_PEER = 8 * 1024
"""Gloo: what one pair (a full-mesh TCP connection to one peer) holds once used."""
GLOO_MESSAGE_FACTOR = 4
"""Gloo: resident memory left after warming with the largest message, in multiples of that message (the warm
tensors and gloo's scratch, which glibc keeps once its mmap threshold has grown).

The three are measured on this project's CPU machines (bench/comm_memory.py, bench/RESULTS.md), not gloo constants:
the model answers "how much", to the order of magnitude, for a CPU rehearsal of a budget."""


def gloo_bytes(n: int, largest_message: int) -> int:
    """The estimated resident memory of one gloo communicator of ``n`` ranks whose largest message has
    ``largest_message`` bytes (0 for a communicator of one)."""
    if n <= 1:
        return 0
    return GLOO_BASE + (n - 1) * GLOO_PER_PEER + GLOO_MESSAGE_FACTOR * largest_message


def live_estimate(policy: Policy, groups: Sequence[ResolvedGroup]) -> dict[str, int]:
    """Per warmed group of this rank (:class:`~lifecycle.distributed.groups.ResolvedGroup` labels), the model's bytes
    for the backend it really uses: NCCL's from the policy's settings (inside a node when its ranks share
    ``LOCAL_WORLD_SIZE``-sized blocks), gloo's from its size and the largest message warmed on it."""
    import os

    import torch.distributed as dist

    from lifecycle.distributed.messages import job_messages

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or dist.get_world_size()
    settings = Settings.of(policy.distributed.effective_nccl_env())
    sizes = {m.group: max(m.nbytes, 0) for m in job_messages(policy)} if "job" in policy.warmup.sizes else {}
    out = {}
    for g in groups:
        if dist.get_backend(g.pg) == "nccl":
            intra = g.ranks[0] // per_node == g.ranks[-1] // per_node
            out[g.label] = communicator_bytes(g.size, intra_node=intra, settings=settings)
        else:
            out[g.label] = gloo_bytes(g.size, max([sizes.get(n, 4) for n in g.names], default=4))
    return out
