"""The policy: one frozen, validated pydantic model. Validate once, at load; handlers trust it."""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import (
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lifecycle.errors import PolicyError, PolicyIssue
from lifecycle.policy.base import Flag, Phase, PositiveSteps, Seconds, Section, Steps, check_deadline_key
from lifecycle.policy.sections import (
    BarriersConfig,
    DistributedConfig,
    ParallelismConfig,
    RunConfig,
    WarmupConfig,
    check_group_name,
)
from lifecycle.policy.versions import SCHEMA_VERSION

TeardownStep = Literal[
    "barrier", "finalize_async", "destroy_model_parallel", "destroy_subgroups", "destroy_process_group"
]
DEFAULT_TEARDOWN: list[TeardownStep] = [
    "barrier", "finalize_async", "destroy_model_parallel", "destroy_subgroups", "destroy_process_group"
]


Signal = Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"]


def _signals(*names: Signal) -> list[Signal]:
    return list(names)


class TrainConfig(Section):
    kind: str = "megatron_gpt"
    """Step handler kind, by name from the handler registry (built-ins: megatron_gpt, synthetic)."""
    steps: Steps = 20
    """Train steps; 0 runs init -> warmup -> teardown and builds no model."""
    options: Any = None
    """Options of the chosen kind (see its options model); validated against the kind at load."""
    # Data here: the kind's model is applied by lifecycle.policy.kinds.resolve, the step that reads what is installed.


class ZeroTokenConfig(Section):
    action: Literal["dummy_forward", "error", "warn", "off"] = "off"
    """What a rank whose local experts receive zero tokens does: dummy_forward keeps autograd aligned."""


class MoEConfig(Section):
    zero_token: ZeroTokenConfig = ZeroTokenConfig()
    """The zero-token guard."""


class MemoryTierConfig(Section):
    every_steps: Steps = 0
    """Copy every rank's state to node-local memory every n train steps (0: no memory tier). A failed attempt's next
    one (relaunched or in place) resumes from the newest step every rank holds there when it is newer than the last
    committed checkpoint; the persistent checkpoints stay the source of truth at their own cadence."""
    keep: int = Field(1, ge=1, le=2)
    """Copies of each rank's state kept (the newest one or two steps); the memory taken is keep x the rank's state,
    twice with ``replicate`` (its own copy and the one it holds for its buddy)."""
    replicate: Flag = True
    """Send each copy to a buddy rank on another node (so a lost node's ranks restore from their buddies); with one
    node the buddy is the next rank on the same node."""
    dir: str = Field("/dev/shm", min_length=1)
    """Node-local folder the copies live in (tmpfs: a copy outlives its rank's process, not the node)."""


class CheckpointConfig(Section):
    dir: str = Field("checkpoints", min_length=1)
    """Checkpoint root (default <run.dir>/checkpoints); committed saves are iter_NNNNNNN/ with a `latest` tracker."""
    every_steps: Steps = 0
    """Save every n train steps; 0 disables periodic saves."""
    at_end: Flag = True
    """Save after the last train step."""
    on_signal: Flag = True
    """On a preemption signal, agree on a stop step, save, and exit 0."""
    signals: list[Signal] = Field(default_factory=lambda: _signals("SIGTERM"))
    """Signals treated as a preemption request."""
    grace_s: Seconds = 120.0
    """Time from a preemption signal to exit, save included: the local launcher waits this long (plus
    teardown.deadline_s) for its ranks after a SIGTERM or Ctrl-C before it kills them."""
    signal_lead_s: Seconds | None = None
    """How long the scheduler waits from its signal to its kill (SLURM --signal=B:TERM@lead, Kubernetes
    terminationGracePeriodSeconds); null: LIFECYCLE_SIGNAL_LEAD_S, else unknown. It must cover grace_s +
    teardown.deadline_s (validate refuses less)."""
    signal_check_every: PositiveInt | Literal["auto"] = 1
    """Agree on a preemption stop every n train steps (one world all-reduce; also at every periodic-save step):
    n > 1 saves that all-reduce on the other steps, and a signal then waits up to n-1 more steps before the save.
    auto: about every 0.5 s of training — n from the slowest rank's step time, agreed in the same all-reduce (every
    step until the first agreement, at most every 50 steps)."""
    signal_overlap: Flag = True
    """Run that all-reduce while the next step computes and act on it at that step's end: it leaves the training
    thread's path, and a signal then stops one step later (a periodic-save step and the last step agree at once)."""
    async_: Flag = Field(False, alias="async")
    """Write shards in the background; commit at the next step boundary (two-phase commit still)."""
    async_strategy: Literal["auto", "mcore", "nvrx"] = "auto"
    """Whose code plans and writes a megatron-core checkpoint: mcore (megatron-core's own async save), nvrx
    (nvidia-resiliency-ext's, megatron-core 0.17+; validate refuses it when the package is missing) or auto (nvrx
    where megatron-core asks for it and a compatible nvidia-resiliency-ext is installed, else mcore). The commit
    protocol is lifecycle's either way."""
    fully_parallel: Flag = False
    """Spread the write of replicated tensors over the data-parallel ranks."""
    coordination: Literal["store", "gloo"] = "store"
    """How ranks agree that every write is durable: the TCPStore or a dedicated gloo group (never NCCL)."""
    verify: Literal["digest", "size"] = "digest"
    """What a resume checks of the files it loads: digest (the ranks hash their shares at commit and check them at
    resume, so a replaced or corrupted file is named before step 1) or size (the manifest's sizes only)."""
    keep_last: NonNegativeInt = 2
    """Committed checkpoints kept; 0 keeps all."""
    resume: Literal["auto", "never", "required"] = "auto"
    """auto: load the tracker's checkpoint when there is one; required: error when there is none."""
    on_corrupt: Literal["error", "fallback"] = "error"
    """A corrupt or missing checkpoint at resume: error, or fall back to the previous committed one."""
    check_finite: Flag = True
    """Before every save (either tier) check that each rank's state is finite: a NaN or inf fails the run on that
    rank naming the tensor, and is never saved (the next attempt resumes from the last good state)."""
    check_replicas: Flag = True
    """Before every save (either tier) the data-parallel replicas of each weight compare digests (one all-gather of
    two numbers per tensor per replica group; the kinds that name their replicas: megatron_gpt, synthetic): ranks
    whose weights silently diverged fail the run naming the group, the tensor and the ranks, and the state is not
    saved."""
    check_restore: Flag = True
    """The first step after a restore (either tier) is checked: a NaN or inf loss (or, with
    ``restore_loss_factor``, a loss above that factor x the loss recorded at save) rejects the restored state
    (recorded in <checkpoint.dir>/.restore-rejected.json) and fails the attempt; the next one falls back to the
    commit or memory copy before it, once per state. With no older commit left the run stops with the no-progress
    code instead of starting over from step 0."""
    restore_loss_factor: float | None = Field(None, gt=1.0, le=1e6)
    """With check_restore: the first loss after a restore may be at most this factor x the loss recorded at save
    (null: only NaN/inf are refused; the loss of the next batch legitimately differs)."""
    memory: MemoryTierConfig = MemoryTierConfig()
    """The in-memory checkpoint tier (off by default)."""


class ExitCodes(Section):
    hang: int = Field(3, ge=1, le=255)
    """A hang detected by the watchdog."""
    rank_failed: int = Field(4, ge=1, le=255)
    """A rank raised or died."""
    teardown_deadline: int = Field(5, ge=1, le=255)
    """Teardown hit its hard deadline."""
    no_progress: int = Field(6, ge=1, le=255)
    """restart.max_no_progress attempts in a row failed without committing a newer checkpoint: not restarting (a
    batch script must not requeue on it)."""

    @model_validator(mode="after")
    def _distinct(self) -> ExitCodes:
        codes = [self.hang, self.rank_failed, self.teardown_deadline, self.no_progress]
        if len(set(codes)) != 4 or 2 in codes:
            raise ValueError("exit codes hang, rank_failed, teardown_deadline, no_progress must be distinct and not 2 "
                             "(usage)")
        return self


class RestartConfig(Section):
    max_restarts: int = Field(0, ge=0, le=1000)
    """`lifecycle run`: how many times a failed attempt is followed by the next one in the same run directory (it
    resumes from the last committed checkpoint). torchrun --max-restarts and a SLURM requeue restart the same way."""
    max_no_progress: int = Field(3, ge=0, le=1000)
    """Attempts in a row that failed without committing a checkpoint newer than the one they started from, after
    which the next attempt refuses to start (exit_codes.no_progress), whoever launches it; 0: never refuse."""
    mode: Literal["relaunch", "in_process"] = "relaunch"
    """relaunch: a restart starts new processes. in_process: after an exception on a rank (or a collective divergence
    caught before the collective) the ranks agree on the store, destroy their process groups, re-create them under a
    new store prefix, warm them, reload the last committed checkpoint and go on in the same processes; a failure the
    processes cannot recover from (a dead rank, a hang, a rank that does not come back in time) falls back to a
    relaunch, saying why. Each restart counts against max_restarts."""
    in_process_deadline_s: Seconds = 60.0
    """in_process: how long every rank has, from the failure, to leave its collectives, destroy its process groups
    and meet the others on the store; a rank that does not make it turns the restart into a relaunch."""


class TeardownConfig(Section):
    success: list[TeardownStep] = Field(default_factory=lambda: list(DEFAULT_TEARDOWN))
    """Steps of a clean exit, in order."""
    failure: Literal["abort", "destroy"] = "abort"
    """Failure path: abort process groups (no barrier) then destroy, or only destroy."""
    deadline_s: Seconds = 60.0
    """Hard limit over the whole teardown; then the process exits by force (code 5)."""
    exit_codes: ExitCodes = ExitCodes()
    """Process exit codes."""


AUTO_CEILING_S: dict[str, float] = {"step": 600.0, "checkpoint": 1200.0, "eval": 1800.0}
"""The static deadline of an ``auto`` phase: it applies until calibrated, and caps the adaptive value."""


class Deadlines(Section):
    init: Seconds = 300.0
    """Seconds for init: process group, model-parallel groups, policy check."""
    warmup: Seconds = 120.0
    """Seconds for each warmup op and barrier."""
    step: Seconds | Literal["auto"] = 600.0
    """Seconds for one train step (its collectives included); auto: follows the observed step times (watchdog.adaptive)."""
    checkpoint: Seconds | Literal["auto"] = 1200.0
    """Seconds for one checkpoint save and its commit; auto: follows the observed checkpoint spans."""
    teardown: Seconds = 30.0
    """Seconds for the teardown collectives (barrier, destroy)."""
    setup: Seconds = 1800.0
    """A trainer's own loop (attach): its set-up from attach() to its first step (model build, load_checkpoint, data
    iterators); no step deadline applies before the first step."""
    eval: Seconds | Literal["auto"] = 1800.0
    """A trainer's own loop: its work in job.phase(name) (evaluation, logging, callbacks) and between a boundary and
    its next job.step(); auto: follows the observed spans."""

    def static(self, name: str) -> float:
        """The deadline in seconds, ``auto`` read as its static ceiling."""
        value = getattr(self, name)
        return AUTO_CEILING_S[name] if value == "auto" else float(value)


class AdaptiveConfig(Section):
    factor: float = Field(4.0, ge=1.0, le=1000.0)
    """An auto deadline is factor x the quantile of the recent window (clamped to [floor_s, the static default])."""
    quantile: float = Field(0.99, gt=0.0, le=1.0)
    """Which quantile of the window (0.99: p99)."""
    window: int = Field(200, ge=1, le=100_000)
    """Observations (steps, checkpoint spans) the quantile is taken over."""
    floor_s: Seconds = 1.5
    """An auto step deadline is never shorter than this: with the 1 s poll a stalled step is named within 3 s (a
    frozen rank's peers wait 1.5 polls for its record), and a 1000-step soak of the default job raised no false
    alarm (bench/RESULTS.md)."""
    span_floor_s: Seconds = 5.0
    """An auto checkpoint deadline or a trainer's auto eval deadline is never shorter than this (storage and
    evaluation vary more than steps)."""
    calibration_steps: int = Field(20, ge=1, le=1_000_000)
    """Observations before the auto deadline replaces the static one (the first step after a resume is static too)."""


class StragglerConfig(Section):
    action: Literal["report", "off"] = "report"
    """report: name a rank whose step compute time stays above its peers' median (event, rank-0 log, summary)."""
    factor: float = Field(1.5, gt=1.0, le=1000.0)
    """A straggler's median compute time is at least factor x the median of the other ranks'."""
    window: int = Field(50, ge=2, le=100_000)
    """Steps each rank's median compute time is taken over (a rank is judged once its window is full)."""


class WatchdogConfig(Section):
    enabled: Flag = True
    """Watch every phase against its deadline through the TCPStore side channel."""
    deadlines: Deadlines = Deadlines()
    """Per-phase deadlines; process-group timeouts of a phase derive from them."""
    poll_interval_s: Seconds = 1.0
    """How often the watchdog thread checks deadlines and heartbeats."""
    heartbeat_stale_s: Seconds = 30.0
    """A peer whose heartbeat is older than this is reported unresponsive (frozen, cut off or dead): a hang."""
    action: Literal["abort", "report"] = "abort"
    """abort: report, abort process groups and exit with the hang code; report: only report."""
    sequence_check: Flag = True
    """Compare per-group collective counts across ranks at phase boundaries."""
    adaptive: AdaptiveConfig = AdaptiveConfig()
    """How auto deadlines (deadlines.step / deadlines.checkpoint: auto) follow what the job does."""
    straggler: StragglerConfig = StragglerConfig()
    """Naming ranks that are persistently slower than their peers (the job goes on)."""
    store_budget_calls_per_s: float | None = Field(11500.0, gt=0)
    """The store calls per second the watchdogs of all ranks may ask of the rendezvous store's one server (5 a rank
    per poll): validate -w and run refuse a world size over it, naming the poll interval that fits. The default is a
    quarter of what one server answered on a 2-core machine (bench/scale.py); null: no budget."""


class FaultDrill(Section):
    at: Phase
    """Phase the drill fires in."""
    step: Steps | None = None
    """Train step it fires at (train and checkpoint phases only)."""
    ranks: list[NonNegativeInt] = Field(min_length=1)
    """Global ranks the drill fires on."""
    attempts: list[PositiveInt] | None = None
    """The attempts of the run it fires in (1: the first launch; each restart or re-run is the next); null: every
    attempt. [1] rehearses a fault the restart recovers from."""
    action: Literal["stall", "crash", "raise", "signal", "skip", "zero_tokens", "slow", "hold_memory", "nan_weights",
                    "perturb_weights"]
    """stall: sleep forever; crash: os._exit; raise: an exception; signal: SIGTERM to itself; skip: skip a collective;
    zero_tokens: the routers send no token to these ranks' local experts, at every step from `step` on (or at `steps`);
    slow: `seconds` of extra compute in every train step from `step` on (a straggler); at checkpoint, `seconds`
    once before the matching op (a slow file system: op save or commit); hold_memory: at warmup, `mib` of resident
    memory held from the matching warm op on, as if that group's communicator took more than estimated (the
    communicator budget's rehearsal on gloo; on CUDA warmup measures device memory, which this does not move); nan_weights:
    at train, a NaN written into one of this rank's parameters as the step begins (a corrupted state, for the state
    checks of the checkpoint tiers); perturb_weights: at train, one value of one of this rank's parameters moved by
    1e-3 as the step begins (finite: a data-parallel replica that silently diverged, for the replica check)."""
    seconds: Seconds | None = None
    """slow only: extra seconds per step (train), or once (checkpoint)."""
    mib: PositiveFloat | None = None
    """hold_memory only: MiB held."""
    steps: list[PositiveSteps] | None = None
    """zero_tokens only: the train steps it acts at, instead of every step from `step` on."""
    op: str | None = None
    """Only before this op (e.g. all_reduce, barrier, save)."""
    group: str | None = None
    """Only on this group."""

    @model_validator(mode="after")
    def _step_phase(self) -> FaultDrill:
        if self.step is not None and self.at not in ("train", "checkpoint"):
            raise ValueError(f"step applies to train and checkpoint drills only, not at={self.at}")
        if self.action == "zero_tokens" and (self.at != "train" or (self.step is None) == (self.steps is None)):
            raise ValueError("a zero_tokens drill is at: train, with either step (from that step on) or steps")
        if self.steps is not None and (self.action != "zero_tokens" or not self.steps):
            raise ValueError("steps applies to zero_tokens drills only, and needs at least one step")
        if (self.action == "slow") != (self.seconds is not None) or (
                self.action == "slow" and self.at not in ("train", "checkpoint")):
            raise ValueError("a slow drill is at: train (extra time per step from step on) or at: checkpoint (once, "
                             "before its op), with seconds; seconds applies to slow drills only")
        if (self.action == "hold_memory") != (self.mib is not None) or (
                self.action == "hold_memory" and self.at != "warmup"):
            raise ValueError("a hold_memory drill is at: warmup, with mib; mib applies to hold_memory drills only")
        if self.action in ("nan_weights", "perturb_weights") and self.at != "train":
            raise ValueError(f"a {self.action} drill is at: train")
        if self.group is not None:
            check_group_name(self.group)
        return self


class Policy(Section):
    """A lifecycle policy. Every key is documented in the policy table of docs/policy.md."""

    schema_version: int = SCHEMA_VERSION
    """Policy schema version this file targets."""
    description: str = ""
    """One line shown by `lifecycle policies`."""
    run: RunConfig = RunConfig()
    """Name, id, directory and seed of the run."""
    distributed: DistributedConfig = DistributedConfig()
    """Process-group backend and NCCL-only settings (timeouts derive from watchdog.deadlines)."""
    parallelism: ParallelismConfig = ParallelismConfig()
    """Megatron parallel sizes; the world size is checked against them at run time."""
    warmup: WarmupConfig = WarmupConfig()
    """Which groups to warm, with which ops, before training fills memory."""
    barriers: BarriersConfig = BarriersConfig()
    """Named barrier points."""
    train: TrainConfig = TrainConfig()
    """The step handler and how many steps."""
    moe: MoEConfig = MoEConfig()
    """MoE-specific guards."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """When and how checkpoints are saved, committed, pruned and resumed."""
    teardown: TeardownConfig = TeardownConfig()
    """How the job exits, cleanly or after a failure."""
    watchdog: WatchdogConfig = WatchdogConfig()
    """Deadlines per phase and what happens when one passes."""
    restart: RestartConfig = RestartConfig()
    """Restarts after a failure, and when to stop restarting."""
    faults: list[FaultDrill] = Field(default_factory=list)
    """Fault drills; empty by default."""

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(f"this lifecycle reads schema version {SCHEMA_VERSION}; upgrade lifecycle "
                             f"or migrate the policy")
        return v

    @model_validator(mode="before")
    @classmethod
    def _derive_dirs(cls, data: Any) -> Any:
        """run.id, run.dir and checkpoint.dir default from each other (and the launcher's env)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        run = data.get("run", {})
        if isinstance(run, dict):
            run = dict(run)
            run.setdefault("id", default_run_id())
            run.setdefault("dir", f"runs/{run.get('name', 'lifecycle')}-{run['id']}")
            data["run"] = run
        ck = data.get("checkpoint", {})
        if isinstance(ck, dict) and "dir" not in ck and isinstance(run, dict):
            data["checkpoint"] = {**ck, "dir": f"{run['dir']}/checkpoints"}
        return data

    @model_validator(mode="after")
    def _cross(self, info: ValidationInfo) -> Policy:
        # A PolicyError (not a ValueError) passes through pydantic untouched and keeps each key path.
        issues = cross_field_issues(self, own_loop=bool(info.context and info.context.get(OWN_LOOP)))
        if issues:
            raise PolicyError(issues)
        return self

    def deadline(self, key: str) -> float:
        """The static watchdog deadline ``watchdog.deadlines.<key>`` in seconds (``auto`` reads as its ceiling; the
        run's deadline book applies the learned value). ``key`` is a deadline's one name: ``step``, not ``train``."""
        return self.watchdog.deadlines.static(check_deadline_key(key))

    def is_auto(self, key: str) -> bool:
        return getattr(self.watchdog.deadlines, check_deadline_key(key)) == "auto"


def default_run_id() -> str:
    """A run id identical on every rank: from the local launcher, torchrun or SLURM, else ``local``."""
    for var in ("LIFECYCLE_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if os.environ.get(var):
            return os.environ[var]
    return "local"


# ---- cross-field rules (the world size is not known here: see lifecycle.policy.checks.world_issues) -----------
OWN_LOOP = "own_loop"
"""Validation context key: the policy drives a trainer's own loop (``lifecycle.attach``), whose model is the
trainer's: no rule about the built-in kind's model (``train.options``) applies."""


def cross_field_issues(p: Policy, *, own_loop: bool = False) -> list[PolicyIssue]:
    """Rules that span sections (the world size is not known here: see :func:`world_issues`). ``own_loop``: the
    trainer builds its model, so ``train.options`` (the built-in kind's model) is not held against the layout."""
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
    issues.extend(_fault_issues(p))
    if p.restart.max_restarts and p.checkpoint.resume == "never":
        issues.append(PolicyIssue("restart.max_restarts", "a restart resumes from the last committed checkpoint, "
                                  "which checkpoint.resume=never forbids; set checkpoint.resume=auto or no restarts",
                                  p.restart.max_restarts))
    if p.restart.mode == "in_process" and not p.restart.max_restarts:
        issues.append(PolicyIssue("restart.mode", "in_process restarts nothing with restart.max_restarts=0; set "
                                  "restart.max_restarts (each restart, in place or not, counts)", p.restart.mode))
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


def _fault_issues(p: Policy) -> list[PolicyIssue]:
    issues: list[PolicyIssue] = []
    for i, drill in enumerate(p.faults):
        if drill.step is not None and drill.step > p.train.steps:
            issues.append(PolicyIssue(f"faults.{i}.step", f"is after the last train step ({p.train.steps})",
                                      drill.step))
    return issues
