"""The NCCL and torch-NCCL environment a policy may set (``distributed.nccl_env``): an allow-list with types.

Only settings that matter for memory and hangs are accepted; an unknown or misspelt name is a policy error with a
suggestion, a value of the wrong type names the key. Values are written to every rank's environment as strings
(booleans as ``1``/``0``) before the first process group (:func:`effective`). Sources: NCCL's environment variable
documentation (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html) and torch's ProcessGroupNCCL
(``TORCH_NCCL_*``, ``TORCH_FR_*``).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from lifecycle.errors import PolicyIssue


@dataclass(frozen=True)
class Knob:
    kind: str
    """bool (0/1, true/false), int (with ``low``..``high``), list (comma-separated ``choices``, a leading ``^``
    excludes them), choice (one of ``choices``) or str."""
    what: str
    low: int = 0
    high: int = 1 << 40
    choices: tuple[str, ...] = ()


_ALGOS = ("Ring", "Tree", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT")
_PROTOS = ("LL", "LL128", "Simple")

KNOBS: dict[str, Knob] = {
    "NCCL_RUNTIME_CONNECT": Knob("bool", "connect an algorithm's channels at its first use (NCCL >= 2.22 default 1); "
                                 "set from distributed.connect"),
    "NCCL_BUFFSIZE": Knob("int", "bytes of each channel's buffer per peer and protocol (default 4 MiB)", 1 << 12,
                          1 << 31),
    "NCCL_NVLS_ENABLE": Knob("bool", "NVLink SHARP (NVLS): large extra buffers on NVSwitch systems"),
    "NCCL_MIN_NCHANNELS": Knob("int", "fewest channels (rings/trees) per communicator", 1, 64),
    "NCCL_MAX_NCHANNELS": Knob("int", "most channels per communicator (fewer: less memory, less bandwidth)", 1, 64),
    "NCCL_MIN_CTAS": Knob("int", "fewest CTAs per collective", 1, 64),
    "NCCL_MAX_CTAS": Knob("int", "most CTAs per collective", 1, 64),
    "NCCL_NCHANNELS_PER_NET_PEER": Knob("int", "channels per remote peer for p2p", 1, 64),
    "NCCL_PROTO": Knob("list", "protocols allowed (^ excludes)", choices=_PROTOS),
    "NCCL_ALGO": Knob("list", "algorithms allowed (^ excludes)", choices=_ALGOS),
    "NCCL_P2P_LEVEL": Knob("choice", "how far GPU peer-to-peer is used", choices=("LOC", "NVL", "PIX", "PXB", "PHB",
                                                                                   "SYS")),
    "NCCL_NET_GDR_LEVEL": Knob("choice", "how far GPUDirect RDMA is used", choices=("LOC", "PIX", "PXB", "PHB",
                                                                                      "SYS")),
    "NCCL_P2P_NET_CHUNKSIZE": Knob("int", "bytes per network p2p chunk", 1 << 10, 1 << 30),
    "NCCL_CUMEM_ENABLE": Knob("bool", "allocate NCCL buffers with cuMem (needed for NVLS)"),
    "NCCL_COLLNET_ENABLE": Knob("bool", "CollNet (in-network reduction)"),
    "NCCL_IB_DISABLE": Knob("bool", "do not use InfiniBand"),
    "NCCL_CROSS_NIC": Knob("int", "rings/trees may use different NICs (0, 1, 2 = auto)", 0, 2),
    "NCCL_SOCKET_IFNAME": Knob("str", "network interfaces for bootstrap and sockets"),
    "NCCL_DEBUG": Knob("choice", "NCCL log level", choices=("VERSION", "WARN", "INFO", "TRACE")),
    "NCCL_DEBUG_SUBSYS": Knob("str", "NCCL log subsystems (INIT,COLL,P2P,NET,...)"),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": Knob("int", "what a timed-out collective does (0 none, 1 abort and tear down, "
                                            "2 only tear down, 3 abort without teardown)", 0, 3),
    "TORCH_NCCL_BLOCKING_WAIT": Knob("bool", "wait() blocks and raises on timeout"),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": Knob("bool", "dump the Flight Recorder on timeout"),
    "TORCH_NCCL_TRACE_BUFFER_SIZE": Knob("int", "Flight Recorder entries (torch < 2.10 name)", 0, 1 << 24),
    "TORCH_FR_BUFFER_SIZE": Knob("int", "Flight Recorder entries", 0, 1 << 24),
    "TORCH_NCCL_DESYNC_DEBUG": Knob("bool", "report which rank desynchronised on timeout"),
    "TORCH_NCCL_ENABLE_MONITORING": Knob("bool", "torch's heartbeat monitor thread"),
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": Knob("int", "seconds before torch's monitor kills a stuck process", 1,
                                             86400),
    "TORCH_NCCL_AVOID_RECORD_STREAMS": Knob("bool", "free collective buffers without recordStream"),
    "TORCH_NCCL_USE_COMM_NONBLOCKING": Knob("bool", "non-blocking communicator init and abort"),
    "TORCH_NCCL_HIGH_PRIORITY": Knob("bool", "high-priority CUDA streams for collectives"),
    "TORCH_NCCL_CUDA_EVENT_CACHE": Knob("bool", "reuse CUDA events of collectives"),
}


def _issue(name: str, message: str, value: object) -> PolicyIssue:
    return PolicyIssue(f"distributed.nccl_env.{name}", message, value)


def check(env: dict[str, object]) -> list[PolicyIssue]:
    """Every problem of a ``distributed.nccl_env`` mapping: unknown names (with the closest known one), values of
    the wrong type or out of range."""
    issues = []
    for name, value in env.items():
        knob = KNOBS.get(name)
        if knob is None:
            near = difflib.get_close_matches(name.upper(), KNOBS, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}? " if near else ""
            issues.append(_issue(name, f"not a setting lifecycle manages; {hint}the allowed names are listed by "
                                 f"`lifecycle schema` and in docs/policy.md", value))
            continue
        why = _bad(knob, value)
        if why:
            issues.append(_issue(name, why, value))
    return issues


def _bad(knob: Knob, value: object) -> str | None:
    if knob.kind == "bool":
        return None if isinstance(value, bool) or value in (0, 1) else "must be true/false (or 1/0)"
    if knob.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            return "must be an integer"
        return None if knob.low <= value <= knob.high else f"must be in [{knob.low}, {knob.high}]"
    if not isinstance(value, str) or not value or "\n" in value or "\x00" in value:
        return "must be a one-line string"
    if knob.kind == "choice":
        return None if value in knob.choices else f"must be one of {', '.join(knob.choices)}"
    if knob.kind == "list":
        items = [v.strip() for v in value.lstrip("^").split(",")]
        bad = [v for v in items if v not in knob.choices]
        return f"unknown {', '.join(bad)}; choose among {', '.join(knob.choices)}" if bad else None
    return None if re.fullmatch(r"[\w.,:=^/ +-]+", value) else "holds characters an environment value must not"


def as_env(value: object) -> str:
    """The environment string of a checked value (booleans as 1/0)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def effective(env: dict[str, object], connect: str) -> dict[str, str]:
    """What every rank sets before its first process group: the policy's settings and ``NCCL_RUNTIME_CONNECT`` from
    ``distributed.connect`` (eager: 0, every channel connected while the communicator is warmed; lazy: 1)."""
    out = {name: as_env(v) for name, v in sorted(env.items())}
    out.setdefault("NCCL_RUNTIME_CONNECT", "0" if connect == "eager" else "1")
    return out
