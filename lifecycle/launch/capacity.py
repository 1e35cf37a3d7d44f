"""How many local ranks this machine can run, checked before the local launcher starts any (``--nproc``).

NCCL runs one rank per visible GPU. Gloo ranks share the CPUs and the memory: at most ``max(8, 4 x CPUs)`` (8 on a
small machine, so the CPU tests' 8-rank jobs run on 2 cores) and as many as the memory holds at
:data:`RANK_BASE_BYTES` per rank plus the model's estimate (:mod:`lifecycle.policy.modelsize`). ``--oversubscribe``
starts them anyway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lifecycle import hostinfo
from lifecycle.errors import UsageError

if TYPE_CHECKING:
    from lifecycle.policy.schema import Policy

RANK_BASE_BYTES = 512 << 20
"""What one rank takes before its model: measured 250 MiB resident for a synthetic rank and 410 MiB for a
megatron_gpt one (torch, megatron, gloo, the watchdog) on CPU, rounded up."""
MIN_GLOO_RANKS = 8
GLOO_RANKS_PER_CPU = 4
OVERRIDE = "--oversubscribe"


def nproc_bound(policy: Policy) -> tuple[int, str]:
    """(the most local ranks this machine runs for ``policy``, why that many)."""
    if _backend(policy) == "nccl":
        gpus = hostinfo.visible_gpus()
        return gpus, (f"the nccl backend runs one rank per GPU and {gpus} are visible here (CUDA_VISIBLE_DEVICES, "
                      f"/dev/nvidiaN); set distributed.backend=gloo to run CPU ranks")
    from lifecycle.policy.modelsize import rank_bytes

    cpus = hostinfo.cpus()
    by_cpu = max(MIN_GLOO_RANKS, GLOO_RANKS_PER_CPU * cpus)
    memory = hostinfo.memory_bytes()
    per_rank = RANK_BASE_BYTES + (rank_bytes(policy.train.options, policy.parallelism) or 0)
    by_memory = memory // per_rank if memory else by_cpu
    why = (f"gloo ranks share the CPUs and the memory: max({MIN_GLOO_RANKS}, {GLOO_RANKS_PER_CPU} x {cpus} CPUs) = "
           f"{by_cpu} for the CPUs, {hostinfo.fmt_bytes(memory)} / {hostinfo.fmt_bytes(per_rank)} per rank (a rank's "
           f"{hostinfo.fmt_bytes(RANK_BASE_BYTES)} plus its model's estimate) = {by_memory} for the memory")
    return min(by_cpu, by_memory), why


def _backend(policy: Policy) -> str:
    """The backend the ranks will pick: ``auto`` is nccl only with an NVIDIA driver, a visible GPU and a torch built
    with CUDA (asked without initialising CUDA here)."""
    from lifecycle.distributed.comm_memory import backend_of

    if policy.distributed.backend != "auto" or backend_of(policy) == "gloo":
        return backend_of(policy)
    import torch

    return "nccl" if torch.backends.cuda.is_built() and hostinfo.visible_gpus() > 0 else "gloo"


def check_nproc(policy: Policy, nproc: int, *, oversubscribe: bool = False) -> None:
    """A UsageError (exit 2) when ``nproc`` local ranks are more than :func:`nproc_bound` allows, unless
    ``oversubscribe``."""
    if oversubscribe:
        return
    bound, why = nproc_bound(policy)
    if nproc > bound:
        raise UsageError(f"--nproc {nproc} is more local ranks than this machine runs ({bound}): {why}; lower "
                         f"--nproc, spread the job over more machines (torchrun, srun), or pass {OVERRIDE} to start "
                         f"them anyway")
