"""Policy sections that need no handler registry: run, distributed, parallelism, warmup, barriers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from lifecycle.policy.base import Flag, Seconds, Section
from lifecycle.policy.groupnames import GROUP_NAMES, closest

WarmupOp = Literal["barrier", "all_reduce", "all_gather", "all_to_all", "p2p"]


def _ops(*ops: WarmupOp) -> list[WarmupOp]:
    return list(ops)


WarmupSize = Literal["tiny", "job"]


def _sizes(*sizes: WarmupSize) -> list[WarmupSize]:
    return list(sizes)


def check_group_name(name: str) -> str:
    """Validate a symbolic group name; the error suggests the closest valid one."""
    if name not in GROUP_NAMES:
        hint = closest(name)
        did_you_mean = f"did you mean '{hint}'? " if hint else ""
        raise ValueError(f"unknown group '{name}'; {did_you_mean}valid names: {', '.join(GROUP_NAMES)}")
    return name


MAX_NAME_BYTES = 200
"""run.name in UTF-8, leaving room for ``-<run.id>`` within a file name's 255 bytes."""


def folder_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be (part of) one folder name, or None."""
    if "/" in name:
        return "contains '/'"
    if name in (".", ".."):
        return f"is {name!r}"
    if "\x00" in name:
        return "contains a NUL character"
    if not name.isprintable():
        return "contains a control character"
    if name != name.strip():
        return "starts or ends with a space"
    size = len(name.encode("utf-8", "surrogatepass"))
    return f"is {size} bytes long in UTF-8 (at most {MAX_NAME_BYTES})" if size > MAX_NAME_BYTES else None


class RunConfig(Section):
    name: str = Field("lifecycle", min_length=1)
    """Run name: used in the run directory and in every log line. Letters of any script, digits, `_-.` and spaces;
    not `/`, a control character, `.` or `..`."""
    id: str = Field("local", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Run id, identical on every rank (the launcher, SLURM or torchrun provide it; never a per-rank clock)."""
    dir: str = Field("runs/lifecycle-local", min_length=1)
    """The run directory (default runs/<name>-<id>): resolved policy, per-rank events, summary, hang reports, checkpoints."""
    seed: int = Field(1234, ge=0, le=2**32 - 1)
    """Seed for model init and the synthetic data (0 .. 2^32-1: derived per-rank and per-step seeds stay in range)."""
    adopt_existing: Flag = False
    """Let a run use a non-empty ``run.dir`` that lifecycle did not make (by default refused: its ``events/`` or
    ``summary.json`` would be moved or overwritten)."""
    timeline: Literal["png", "trace", "off"] = "png"
    """What the end of a job leaves beside the summary: ``png`` the merged ``trace.json`` and the ``timeline.png``
    Gantt (when matplotlib is installed; about half a second before the exit code), ``trace`` the trace alone,
    ``off`` neither. ``lifecycle timeline RUN_DIR`` draws them at any time."""

    @field_validator("name")
    @classmethod
    def _folder_name(cls, v: str) -> str:
        why = folder_name_problem(v)
        if why is not None:
            raise ValueError(f"cannot be part of a folder name: it {why} (the run directory is "
                             f"runs/<run.name>-<run.id>); use letters of any script, digits, '_', '-' or '.'")
        return v


class FlightRecorderConfig(Section):
    enabled: Flag = True
    """NCCL only: set TORCH_NCCL_TRACE_BUFFER_SIZE and dump the trace on timeout."""
    buffer_size: PositiveInt = 2000
    """Entries kept per rank in the NCCL Flight Recorder ring buffer."""


class DistributedConfig(Section):
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto is nccl when CUDA is available, else gloo."""
    eager_init: Flag = True
    """NCCL only: init_process_group(device_id=...) creates the communicator now, not at first use."""
    flight_recorder: FlightRecorderConfig = FlightRecorderConfig()
    """NCCL Flight Recorder settings (ignored on gloo)."""
    memory_headroom_gib: float = Field(0.0, ge=0, allow_inf_nan=False)
    """CUDA only: fail warmup at the group after which free GPU memory is below this (0 disables the check)."""
    comm_memory_budget_gib: float | None = Field(None, gt=0, allow_inf_nan=False)
    """The most memory one rank's communicators may take (device memory for NCCL, host memory for gloo): `lifecycle
    run` refuses before launch (exit 2) when a rank's estimate (`lifecycle explain`: comm_memory, for the backend the
    run will use) exceeds it, naming the largest groups and the settings that shrink them; warmup fails at the first
    group whose measured cost takes the rank past it. null: no budget."""
    connect: Literal["eager", "lazy"] = "eager"
    """NCCL: eager sets NCCL_RUNTIME_CONNECT=0, so every communicator connects all its channels while it is warmed
    (their memory is taken at warmup, not at step 1); lazy (NCCL's default since 2.22) connects each algorithm's
    channels at its first use."""
    nccl_env: dict[str, StrictBool | StrictInt | StrictStr] = Field(default_factory=dict)
    """NCCL and torch-NCCL settings set identically on every rank before the first process group, from an
    allow-list (NCCL_BUFFSIZE, NCCL_MAX_NCHANNELS, NCCL_NVLS_ENABLE, NCCL_PROTO, NCCL_ALGO, TORCH_NCCL_* ...: see
    lifecycle/policy/nccl.py); recorded in summary.json and shown by explain."""

    @field_validator("nccl_env")
    @classmethod
    def _known_settings(cls, v: dict[str, object]) -> dict[str, object]:
        from lifecycle.errors import PolicyError
        from lifecycle.policy.nccl import check

        issues = check(v)
        if issues:
            raise PolicyError(issues)
        return v

    @model_validator(mode="after")
    def _connect_agrees(self) -> DistributedConfig:
        from lifecycle.errors import PolicyError
        from lifecycle.policy.nccl import as_env

        explicit = self.nccl_env.get("NCCL_RUNTIME_CONNECT")
        want = "0" if self.connect == "eager" else "1"
        if explicit is not None and as_env(explicit) != want:
            raise PolicyError.single("distributed.nccl_env.NCCL_RUNTIME_CONNECT",
                                     f"contradicts distributed.connect={self.connect} (which sets it to {want}); "
                                     f"drop it from nccl_env and choose distributed.connect", explicit)
        return self

    def effective_nccl_env(self) -> dict[str, str]:
        """What every rank sets before its first process group (:func:`lifecycle.policy.nccl.effective`)."""
        from lifecycle.policy.nccl import effective

        return effective(dict(self.nccl_env), self.connect)


class ParallelismConfig(Section):
    tp: PositiveInt = 1
    """Tensor-parallel size."""
    pp: PositiveInt = 1
    """Pipeline-parallel size."""
    cp: PositiveInt = 1
    """Context-parallel size."""
    ep: PositiveInt = 1
    """Expert-model-parallel size."""
    etp: PositiveInt | None = None
    """Expert-tensor-parallel size; null means equal to tp (Megatron's default)."""
    vpp: PositiveInt | None = None
    """Virtual pipeline stages per rank (interleaved schedule); null disables it."""
    dist_opt_instances: PositiveInt = 1
    """Distributed-optimizer instances; > 1 creates the inter-instance (partial expert-DP) group."""
    order: Literal["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"] = "tp-cp-ep-dp-pp"
    """Rank order of the parallel dimensions (Megatron's `order`); tp-cp-ep-pp-dp is Megatron-LM's --use-tp-pp-dp-mapping."""

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    @model_validator(mode="after")
    def _vpp_needs_pp(self) -> ParallelismConfig:
        if self.vpp is not None and self.vpp > 1 and self.pp == 1:
            raise ValueError(f"vpp={self.vpp} needs pp > 1; set parallelism.pp or parallelism.vpp=null")
        return self


class WarmupConfig(Section):
    enabled: Flag = True
    """Run the warmup phase at all."""
    groups: Literal["all", "used"] | list[str] = "all"
    """Groups to warm, by symbolic name, or `all` (every group that exists in this layout), or `used` (the groups the
    train kind's collectives use: fewer communicators, less memory; all for a kind whose collectives lifecycle does
    not know, and in a trainer's own loop under `lifecycle.attach()`). The first step checks either way: a group it
    used that warmup did not warm is named (`groups_used` event, a warning)."""
    ops: list[WarmupOp] = Field(default_factory=lambda: _ops("barrier", "all_reduce"), min_length=1)
    """Ops issued on every warmed group, in this order."""
    order: Literal["group_major", "op_major"] = "group_major"
    """group_major: all ops on one group, then the next group; op_major: one op on all groups, then the next op."""
    required: list[str] = Field(default_factory=list)
    """Groups that must exist in the layout; a missing one is an error instead of a skip."""
    deadline_s: Seconds | None = None
    """Deadline of each warmup op; null means watchdog.deadlines.warmup."""
    sizes: list[WarmupSize] = Field(default_factory=lambda: _sizes("tiny", "job"), min_length=1)
    """tiny: the ops above with one element; job: besides, each group gets the messages the job will send on it, at
    their size (gradient bucket, parameter all-gather, token all-to-all, one activation), so every algorithm and
    protocol path NCCL picks by size is connected before step 1."""

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list):
            if not v:
                raise ValueError("empty list; use 'all' or name at least one group")
            for name in v:
                check_group_name(name)
        return v

    @field_validator("required")
    @classmethod
    def _required(cls, v: list[str]) -> list[str]:
        for name in v:
            check_group_name(name)
        return v


class BarrierPoint(Section):
    group: str = "world"
    """Group whose ranks meet at this point."""
    timeout_s: Seconds | None = None
    """Barrier timeout; null means the deadline of the phase it runs in."""
    via: Literal["store", "collective"] = "store"
    """store: a TCPStore barrier that names late ranks and keeps process groups usable; collective: pg barrier."""
    if_missing: Literal["skip", "error"] = "skip"
    """What to do when the group does not exist in this layout."""

    @field_validator("group")
    @classmethod
    def _group(cls, v: str) -> str:
        return check_group_name(v)


class EveryNBarrier(BarrierPoint):
    n: PositiveInt = 100
    """Barrier after every n-th train step."""


class BarriersConfig(Section):
    after_init: list[BarrierPoint] = Field(default_factory=list)
    """Barriers right after init (the seed fix: a barrier on inter_dist_opt)."""
    after_warmup: list[BarrierPoint] = Field(default_factory=list)
    """Barriers at the end of warmup."""
    before_checkpoint: list[BarrierPoint] = Field(default_factory=list)
    """Barriers before every checkpoint save."""
    after_checkpoint: list[BarrierPoint] = Field(default_factory=list)
    """Barriers after every committed checkpoint."""
    before_teardown: list[BarrierPoint] = Field(default_factory=list)
    """Barriers at the start of a successful teardown."""
    every_n_steps: EveryNBarrier | None = None
    """A barrier every n train steps; null disables it."""
