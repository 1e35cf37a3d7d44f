"""Init: the default process group, Megatron's model-parallel groups, the policy check, after_init barriers."""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import TYPE_CHECKING

from lifecycle.errors import NoProgress, PhaseError, PolicyError
from lifecycle.phases.base import Action, GroupView, barrier_actions, sequence_check
from lifecycle.phases.points import run_points
from lifecycle.policy.checks import world_issues
from lifecycle.policy.timeouts import adopted_issue, collective_timeout_s

if TYPE_CHECKING:
    from torch.distributed import Store

    from lifecycle.context import RunContext
    from lifecycle.policy.schema import Policy

log = logging.getLogger(__name__)


def pick_backend(requested: str) -> str:
    """``auto`` is nccl when CUDA is available, else gloo."""
    if requested != "auto":
        return requested
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def nccl_env(ctx: RunContext) -> None:
    """NCCL only: Flight Recorder ring buffer and dump on timeout, into the run directory.

    torch >= 2.10 names the variables ``TORCH_FR_*`` (the ``TORCH_NCCL_*`` names still work there, with a
    deprecation warning per rank); both are set only where the new name is not understood.
    """
    import torch

    fr = ctx.policy.distributed.flight_recorder
    if not fr.enabled:
        return
    new = tuple(int(x) for x in torch.__version__.split(".")[:2] if x.isdigit()) >= (2, 10)
    prefix = str(ctx.run_dir / "nccl_trace_rank_")
    names = {"buffer": "TORCH_FR_BUFFER_SIZE" if new else "TORCH_NCCL_TRACE_BUFFER_SIZE",
             "file": "TORCH_FR_DUMP_TEMP_FILE" if new else "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
    os.environ.setdefault(names["buffer"], str(fr.buffer_size))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault(names["file"], prefix)


def apply_nccl_env(ctx: RunContext, *, adopted: bool) -> dict[str, str]:
    """``distributed.nccl_env`` and ``distributed.connect`` into this rank's environment, before its first process
    group (the same values on every rank: they come from the policy whose hash the ranks compare); recorded as the
    ``nccl_env`` event (what the environment holds afterwards). A value the environment already held otherwise is
    replaced and said; a trainer's NCCL group that existed before ``attach`` keeps what it was created with."""
    env = ctx.policy.distributed.effective_nccl_env()
    replaced = {k: os.environ[k] for k, v in env.items() if k in os.environ and os.environ[k] != v}
    os.environ.update(env)
    if replaced and ctx.rank == 0:
        log.info("the policy's NCCL settings replace the environment's: %s",
                 ", ".join(f"{k}={env[k]} (was {v})" for k, v in sorted(replaced.items())))
    if adopted and ctx.rank == 0:
        log.warning("the trainer's NCCL process group existed before lifecycle.attach: distributed.nccl_env and "
                    "distributed.connect apply to the communicators created from now on (set them before "
                    "init_process_group to cover the default group too)")
    ctx.events.instant("nccl_env", env={k: os.environ.get(k) for k in env})
    return env


def default_group_timeout_s() -> float | None:
    """The timeout of the live default process group (a trainer's own, under ``lifecycle.attach``), read from its
    backend's options; None when no group exists or this torch does not say. Local, no collective."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not dist.is_initialized():
        return None
    try:
        device = torch.device("cuda") if str(c10d.get_backend()) == "nccl" else torch.device("cpu")
        return float(c10d._get_default_group()._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError, ValueError):
        return None


def _check_adopted_timeout(ctx: RunContext) -> None:
    """A trainer's own default group whose timeout would end a collective before the watchdog names the culprit:
    said once (rank 0), with what to change; the trainer's group is its own to configure."""
    if ctx.rank != 0:
        return
    seconds = default_group_timeout_s()
    if seconds is None:  # another torch: nothing to compare
        return
    why = adopted_issue(ctx.policy, seconds)
    if why is not None:
        log.warning("timeouts: %s", why)
        ctx.events.instant("timeout_chain", warning=why)


class InitPhase:
    phase = "init"

    @staticmethod
    def plan(policy: Policy, view: GroupView | None = None) -> list[Action]:
        dl = policy.deadline("init")
        par = policy.parallelism
        layout = (f"tp={par.tp} pp={par.pp} cp={par.cp} ep={par.ep} etp={par.expert_tp} vpp={par.vpp} "
                  f"dist_opt_instances={par.dist_opt_instances}")
        return [
            Action("import:backend", None, None, "the backend's imports, before the rendezvous"),
            Action("init_process_group", "world", dl, f"backend={policy.distributed.backend}, env://"),
            Action("initialize_model_parallel", "world", dl, layout),
            Action("check_policy_hash", "world", dl, "all_gather of the resolved policy's sha256, each rank's "
                   "attempt number (the newest is agreed) and rank 0's restart verdict (restart.max_no_progress)"),
            *barrier_actions(policy, "after_init", dl),
            *sequence_check(policy, "init -> warmup"),
        ]

    def enabled(self, ctx: RunContext) -> bool:
        return True

    def run(self, ctx: RunContext) -> None:
        """Collective on the default group: every rank must run it."""
        issues = world_issues(ctx.policy, ctx.world_size)
        if issues:
            raise PolicyError(issues, source=f"world size {ctx.world_size}")
        self._process_group(ctx)
        self._model_parallel(ctx)
        self._check_policy(ctx)
        run_points(ctx, "after_init", ctx.deadline("init"))

    def _process_group(self, ctx: RunContext) -> None:
        import torch
        import torch.distributed as dist

        from lifecycle.distributed.barrier import get_store

        adopted = dist.is_initialized()  # the trainer's own group (lifecycle.attach): used as it is, never destroyed
        ctx.comms.adopted_world = adopted
        backend = str(dist.get_backend()) if adopted else pick_backend(ctx.policy.distributed.backend)
        apply_nccl_env(ctx, adopted=adopted and backend == "nccl")
        kwargs: dict[str, object] = {}
        if backend == "nccl" and not adopted:
            nccl_env(ctx)
            torch.cuda.set_device(ctx.local_rank)
            if ctx.policy.distributed.eager_init:  # accelerator only: the communicator is created now
                kwargs["device_id"] = torch.device("cuda", ctx.local_rank)
        # The backend's imports (seconds) before the rendezvous: the ranks then meet with less skew, and the
        # timeline can fold the start-up away.
        with ctx.events.span("import:backend"):
            ctx.parallel.load()
        ctx.drills.fire("init", op="init_process_group")
        with ctx.events.span("init_process_group", group="world", backend=backend, adopted=adopted or None):
            if not adopted:
                # Longer than every watchdog deadline: the watchdog names the culprit before torch's own timeout.
                timeout = datetime.timedelta(seconds=collective_timeout_s(ctx.policy, own_loop=ctx.own_loop))
                restarted = in_process_store(ctx) or restart_store(timeout)
                if restarted is not None:
                    kwargs["store"] = restarted
                dist.init_process_group(backend, timeout=timeout, rank=ctx.rank, world_size=ctx.world_size, **kwargs)
        ctx.comms.store = get_store()
        if adopted:
            _check_adopted_timeout(ctx)

    def _model_parallel(self, ctx: RunContext) -> None:
        ctx.drills.fire("init", op="initialize_model_parallel")
        with ctx.events.span("initialize_model_parallel", group="world"):
            ctx.comms.adopted_groups = ctx.parallel.is_initialized()  # the trainer's model-parallel groups: its own
            if not ctx.comms.adopted_groups:
                ctx.parallel.initialize(ctx.policy.parallelism, collective_timeout_s(ctx.policy, own_loop=ctx.own_loop))

    def _check_policy(self, ctx: RunContext) -> None:
        """All-gather every rank's policy sha256 and attempt number on the default group; a policy that differs is
        an error, an attempt number that differs is agreed (:func:`_agree_attempt`)."""
        import torch
        import torch.distributed as dist

        from lifecycle.distributed.collectives import device_for, wait_works
        from lifecycle.policy.load import sha256
        from lifecycle.recovery import progress
        from lifecycle.rundir import restarts

        digest = sha256(ctx.policy)
        refused, start_step = progress.verdict(ctx.run_dir, ctx.policy, digest) if ctx.rank == 0 else (None, None)
        payload = (bytes.fromhex(digest) + min(ctx.attempt, 1 << 31).to_bytes(4, "little")
                   + (b"\x01" if refused else b"\x00"))
        mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device_for())
        out = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
        ctx.drills.fire("init", op="check_policy_hash", group="world")
        with ctx.events.span("check_policy_hash", group="world"):
            work = dist.all_gather(out, mine, async_op=True)
            wait_works([work], "all_gather", "world", list(range(ctx.world_size)), ctx.deadline("init"),
                  time.monotonic())
        ctx.ops.count("world")
        rows = [bytes(t.cpu().tolist()) for t in out]
        digests = [row[:32].hex() for row in rows]
        _agree_attempt(ctx, [int.from_bytes(row[32:36], "little") for row in rows])
        if rows[0][36]:
            raise NoProgress(refused or "rank 0 refused to start this attempt: restart.max_no_progress attempts in a "
                             f"row failed without committing a newer checkpoint (see {ctx.run_dir}/restarts.jsonl)",
                             phase="init", rank=ctx.rank)
        if ctx.rank == 0:
            restarts.record_start(ctx.run_dir, ctx.attempt, start_step, digest)
            ctx.progress.started_attempt = True
        majority = max(set(digests), key=digests.count)
        differ = [r for r, d in enumerate(digests) if d != majority]
        if differ:
            raise PhaseError(f"the resolved policy differs between ranks: ranks {differ} have another sha256 "
                             f"than the majority ({majority[:12]}); launch every rank with the same policy and "
                             f"overrides", phase="init", rank=ctx.rank, group="world")


def in_process_store(ctx: RunContext) -> Store | None:
    """After an in-process restart: the store the last round's groups used, under a prefix of this round (the keys of
    the groups that failed are never read again). None otherwise."""
    if ctx.comms.restart_base is None:
        return None
    import torch.distributed as dist

    return dist.PrefixStore(f"lifecycle/inproc/{ctx.comms.restart_round}", ctx.comms.restart_base)


def restart_store(timeout: datetime.timedelta) -> Store | None:
    """Under torchrun's restarts (``--max-restarts``) the agent's store outlives the ranks, with the keys the last
    round's ranks wrote: a rank of the next round could read a dead peer's gloo address and fail to connect ("Connection
    refused"). From the first restart on, the default group's store is that store under a prefix of the round.
    None otherwise (torch's own env:// rendezvous)."""
    import torch.distributed as dist

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart in ("", "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"lifecycle/restart/{restart}", client)


def _agree_attempt(ctx: RunContext, attempts: list[int]) -> None:
    """Every rank continues as the newest attempt any rank counted (under torchrun/srun each rank counts from its
    own events file, and a replaced node's or a wiped local run directory counts from 1). Ranks that counted
    another number say so, record the agreed one, and rank 0 records it in the run directory, which fences off
    ranks of older attempts (:func:`lifecycle.rundir.fence`)."""
    import lifecycle.rundir as rundir

    agreed = max(attempts)
    if agreed == ctx.attempt and len(set(attempts)) == 1:
        return
    if ctx.rank == 0:
        others = {r: a for r, a in enumerate(attempts) if a != agreed}
        log.warning("the ranks counted different attempts (%s): all continue as attempt %d",
                    ", ".join(f"rank {r}: {a}" for r, a in sorted(others.items())[:8]), agreed)
        if agreed != ctx.attempt:
            rundir.record_attempt(ctx.run_dir, agreed)
    if agreed != ctx.attempt:
        ctx.events.instant("attempt", attempt=agreed, counted=ctx.attempt, world_size=ctx.world_size)
        ctx.agree_attempt(agreed)
