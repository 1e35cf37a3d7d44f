"""What this machine has for ranks: CPUs, memory, visible GPUs. Read from the OS without torch (no CUDA context in
the launcher), each a few system calls."""

from __future__ import annotations

import os
import re
from pathlib import Path

_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def cpus() -> int:
    """CPUs this process may run on (its affinity mask: taskset, a cgroup cpuset, a SLURM allocation)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def memory_bytes() -> int:
    """Physical memory, or this process's cgroup limit when lower (a container, a SLURM job)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 0
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text(errors="replace").strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < (total or 1 << 62):
            total = int(text)
    return total


def visible_gpus(env: dict[str, str] | os._Environ[str] | None = None) -> int:
    """NVIDIA GPUs a rank may use: the entries of ``CUDA_VISIBLE_DEVICES`` up to the first invalid one (as CUDA reads
    it), else the ``/dev/nvidiaN`` devices."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            entry = entry.strip()
            if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
                break
            count += 1
        return count
    try:
        return sum(1 for p in Path("/dev").iterdir() if re.fullmatch(r"nvidia\d+", p.name))
    except OSError:
        return 0


def fmt_bytes(n: float) -> str:
    """``1.5 GiB``, ``3.2e+06 TiB``: short and readable at any size."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB" if n < 1e5 else f"{n:.1e} TiB"
