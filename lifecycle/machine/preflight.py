"""Checks of what can be known before any rank starts: the folders a run writes and the launcher's environment.

Each check returns :class:`~lifecycle.errors.PolicyIssue` lines (``key: what (got value)``) or raises a
:class:`~lifecycle.errors.UsageError`; both exit 2 before a process group exists. Pure Python, no torch.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from lifecycle import rundir
from lifecycle.errors import CheckpointError, PolicyError, PolicyIssue, RunDirError, UsageError

if TYPE_CHECKING:
    from lifecycle.policy.schema import Policy

_SYSTEM = (Path("/proc"), Path("/sys"), Path("/dev"))
_SYSTEM_ROOTS = frozenset(Path(p) for p in ("/", "/bin", "/boot", "/etc", "/lib", "/lib64", "/opt", "/root", "/sbin",
                                            "/srv", "/tmp", "/usr", "/var", "/home", "/mnt", "/media", "/run"))
"""Folders a run may live under but never be: a run moves and replaces files in its own folder."""
_MANAGED = (rundir.EVENTS_DIR, rundir.LOGS_DIR, rundir.ATTEMPTS_DIR)
"""Sub-folders of a run directory that lifecycle moves or rewrites at every attempt."""


def _resolved(path: Path) -> Path:
    try:
        return path.expanduser().resolve()
    except RuntimeError as exc:  # Python < 3.13: "Symlink loop from ..."
        raise OSError(errno.ELOOP, "a symlink loop") from exc


def _first_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return candidate
    return Path("/")


def dir_problem(path_text: str, key: str = "folder") -> str | None:
    """Why ``path_text`` cannot be a folder this run writes into, or None. Creates the folder when missing
    (the run would create it anyway) and writes and removes one small probe file (a file of no bytes fits on a
    full disk). A full or read-only file system is a :class:`~lifecycle.errors.RunDirError` naming ``key``."""
    try:
        path = _resolved(Path(path_text))
        if any(path == s or s in path.parents for s in _SYSTEM):
            return f"is under {next(s for s in _SYSTEM if path == s or s in path.parents)} (a system folder)"
        existing = _first_existing(path)
        if not existing.is_dir():
            where = "is" if existing == path else f"has a parent {existing} that is"
            return f"{where} a file, not a folder"
        path.mkdir(parents=True, exist_ok=True)
        _probe(path)
    except OSError as exc:
        from lifecycle.rundir.safeio import STORAGE_ERRNOS

        if exc.errno in STORAGE_ERRNOS:  # full or read-only: no setting fixes it, one line rather than a list
            what, fix = STORAGE_ERRNOS[exc.errno]
            raise RunDirError(f"{key} {path_text} {what} ({exc.strerror}); {fix} or point {key} at another folder",
                              path=path_text) from None
        return f"is not writable ({exc.strerror or exc})"
    return None


_PROBE = re.compile(r"^\.lifecycle-probe-\d+$")
"""The writability probe a starting rank writes and removes (another rank of the job may be looking meanwhile)."""


def _probe(folder: Path) -> None:
    probe = folder / f".lifecycle-probe-{os.getpid()}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, b"lifecycle\n" * 410)  # 4 KiB: one block, as a rank's first event line would need
    finally:
        os.close(fd)
        probe.unlink()


def place_problem(run_dir: str, checkpoint_dir: str) -> list[PolicyIssue]:
    """Folders a run must not take: ``/`` or a system folder itself, a checkpoint folder inside the run's managed
    sub-folders (moved aside at the next attempt) or the run directory inside the checkpoint folder. No I/O but
    resolving the paths."""
    issues = []
    try:
        run, ckpt = _resolved(Path(run_dir)), _resolved(Path(checkpoint_dir))
    except OSError:
        return []  # dir_problem names it
    for key, value, path in (("run.dir", run_dir, run), ("checkpoint.dir", checkpoint_dir, ckpt)):
        if path in _SYSTEM_ROOTS or path == Path.home():
            issues.append(PolicyIssue(key, f"is {path}, a system or home folder itself; a run moves and replaces "
                                           f"files in its folder: use a folder of its own (e.g. {path / 'runs'})",
                                      value))
    for sub in _MANAGED:
        managed = run / sub
        if ckpt == managed or managed in ckpt.parents:
            issues.append(PolicyIssue("checkpoint.dir", f"lies inside {managed}, which lifecycle moves aside at the "
                                      f"next attempt (the checkpoints would be lost to the resume); keep it out of "
                                      f"{', '.join(_MANAGED)}", checkpoint_dir))
    if ckpt != run and ckpt in run.parents:
        issues.append(PolicyIssue("run.dir", f"lies inside checkpoint.dir {ckpt}, whose folders are pruned and set "
                                  f"aside; put the checkpoints inside the run directory or beside it", run_dir))
    return issues


MARKER = rundir.RUN_MARKER
_OURS = (MARKER, rundir.RESOLVED, rundir.ATTEMPT, rundir.LOCK)


def check_owner(run_dir: str, adopt_existing: bool, *, peers_starting: bool = False) -> None:
    """A non-empty ``run.dir`` that lifecycle did not make is refused (exit 2) unless ``run.adopt_existing``.

    ``peers_starting``: under torchrun/srun the other ranks of this job start at the same time and create their
    own files before rank 0 looks (``events/rank_<R>.jsonl``, ``logs/``, the checkpoint folder): such files are
    not counted."""
    path = Path(run_dir)
    try:
        # Empty folders are nobody's data (the checkpoint folder other ranks create at start-up, say).
        entries = [p.name for p in path.iterdir() if not _empty_dir(p) and not _PROBE.match(p.name)
                   and not (peers_starting and _peer_made(p))] if path.is_dir() else []
    except OSError:
        return  # dir_problem names it
    if not entries or adopt_existing or any(name in entries for name in _OURS):
        return
    shown = ", ".join(sorted(entries)[:5]) + (" ..." if len(entries) > 5 else "")
    raise PolicyError.single("run.dir", f"is a non-empty folder lifecycle did not make ({shown}); a run would move "
                             f"its events/ and logs/ aside and overwrite summary.json: pick an empty or new folder, "
                             f"or set run.adopt_existing=true", run_dir)


_PEER_FILES = {rundir.EVENTS_DIR: re.compile(r"^rank_\d+\.jsonl$"), rundir.LOGS_DIR: re.compile(r"^rank_\d+\.[a-z.]+$")}


def _peer_made(path: Path) -> bool:
    """A folder holding only what a starting rank of this job writes there (its events file, its log)."""
    shape = _PEER_FILES.get(path.name)
    if shape is None or not path.is_dir() or path.is_symlink():
        return False
    return all(shape.match(p.name) and p.is_file() for p in path.iterdir())


def _empty_dir(path: Path) -> bool:
    try:
        return path.is_dir() and not path.is_symlink() and next(path.iterdir(), None) is None
    except OSError:
        return False


def mark_owner(run_dir: str | Path) -> None:
    """Record that lifecycle made (or adopted) ``run_dir``."""
    from lifecycle.rundir import safeio

    marker = Path(run_dir) / MARKER
    if not marker.is_file():
        safeio.write_text(marker, "a lifecycle run directory\n")


def check_dirs(run_dir: str, checkpoint_dir: str) -> None:
    """Raise a PolicyError (exit 2) when ``run.dir`` or ``checkpoint.dir`` cannot be written or must not be."""
    issues = place_problem(run_dir, checkpoint_dir)
    if issues:
        raise PolicyError(issues, source="before launch")
    for key, value in (("run.dir", run_dir), ("checkpoint.dir", checkpoint_dir)):
        why = dir_problem(value, key)
        if why is not None:
            issues.append(PolicyIssue(key, f"{why}; point it at a writable folder", value))
    if issues:
        raise PolicyError(issues, source="before launch")
    check_run_files(Path(run_dir))


def _run_files() -> tuple[str, ...]:
    import lifecycle.rundir as rundir
    from lifecycle.rundir import restarts

    return (rundir.RESOLVED, rundir.SHA256, rundir.SHUTDOWN_MARKER, rundir.HANG_REPORT, rundir.SUMMARY, rundir.TRACE,
            rundir.TIMELINE_PNG, rundir.OVERRIDES, rundir.ATTEMPT, rundir.LOCK, MARKER, restarts.LEDGER)


def check_run_files(run_dir: Path) -> None:
    """Before anything in ``run_dir`` is read, moved or written: each name lifecycle writes there is missing or a
    regular file, each of its folders (events/, logs/, attempts/) missing or a folder, and each ``rank_*`` file in
    events/ and logs/ a regular file. A FIFO, device, socket or symbolic link (appends never follow one) that an
    earlier run or anyone left there is a :class:`~lifecycle.errors.RunDirError` (exit 2) naming it, not a hang
    or a write outside the run directory; nothing is written."""
    from lifecycle.rundir import safeio

    hint = "remove it (or move it away) and run again, or use another run.dir"
    for name in _run_files():
        safeio.check_writable(run_dir / name, replace=False, hint=hint)
    for local in run_dir.glob("hang_report.*.json"):
        safeio.check_writable(local, replace=False, hint=hint)
    for name in _MANAGED:
        folder = run_dir / name
        if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
            raise RunDirError(f"{folder}: {_what(folder)} where lifecycle keeps its {name}/ folder; remove or "
                              f"rename it and run again, or use another run.dir", path=str(folder))
    for name in (rundir.EVENTS_DIR, rundir.LOGS_DIR):
        for entry in _rank_entries(run_dir / name):
            safeio.check_writable(entry, replace=False, hint=hint)


def _what(path: Path) -> str:
    return "is a regular file" if path.is_file() and not path.is_symlink() else "is not a folder"


def _rank_entries(folder: Path) -> list[Path]:
    try:
        return sorted(folder.glob("rank_*")) if folder.is_dir() else []
    except OSError:
        return []


def _int_env(name: str, value: str | None, *, default: int | None = None) -> int:
    if value is None:
        if default is None:
            raise UsageError(f"{name} is not set: RANK and WORLD_SIZE must be set by the launcher (torchrun, srun "
                             f"or `lifecycle run`)")
        return default
    try:
        return int(value.strip())
    except ValueError:
        raise UsageError(f"{name}={value[:40]!r} is not an integer; the launcher must set it (torchrun, srun or "
                         f"`lifecycle run`)") from None


def rank_env(env: dict[str, str] | os._Environ[str] | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the launcher's environment, range-checked (UsageError, exit 2)."""
    env = os.environ if env is None else env
    rank = _int_env("RANK", env.get("RANK"))
    world = _int_env("WORLD_SIZE", env.get("WORLD_SIZE"))
    local = _int_env("LOCAL_RANK", env.get("LOCAL_RANK"), default=0)
    if world < 1:
        raise UsageError(f"WORLD_SIZE={world} must be at least 1")
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is outside the world of WORLD_SIZE={world} ranks (0..{world - 1}); check the "
                         f"launcher's settings")
    if local < 0:
        raise UsageError(f"LOCAL_RANK={local} must be >= 0")
    return rank, world, local


def check_rendezvous_env(env: dict[str, str] | os._Environ[str] | None = None) -> None:
    """Under a launcher (torchrun, srun): MASTER_ADDR set and MASTER_PORT a port number, else a UsageError (exit 2)
    now instead of a rendezvous that fails seconds later inside init_process_group."""
    env = os.environ if env is None else env
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    if not addr:
        raise UsageError("MASTER_ADDR is not set: the launcher (torchrun, srun wrapper) must set the rendezvous "
                         "host of rank 0")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"MASTER_PORT={port[:40]!r} is not a port number (1-65535); check the launcher's "
                         f"--master-port / rendezvous settings")


def check_megatron_imports(policy: Policy) -> None:
    """A job that runs megatron-core (the megatron kind) beside an nvidia-resiliency-ext that megatron-core refuses
    at import: a UsageError (exit 2) naming both versions and the fix, before any rank starts."""
    from lifecycle.policy import installed

    why = installed.nvrx_conflict() if policy.train.kind == "megatron_gpt" else None
    if why is not None:
        raise UsageError(why)


def check_comm_budget(policy: Policy, world_size: int, ranks_per_node: int) -> None:
    """``distributed.comm_memory_budget_gib``: every rank's estimated communicator memory, for the backend the run
    will use (:func:`~lifecycle.distributed.comm_memory.backend_of`), within the budget, or a PolicyError (exit 2)
    naming the rank, the estimate, its largest groups and what shrinks them. At most 4096 ranks are estimated
    (evenly spread, the last included): the bills of a Megatron layout repeat across its replicas. Warmup checks
    what each group really took against the same budget."""
    budget = policy.distributed.comm_memory_budget_gib
    if budget is None:
        return
    from lifecycle.distributed.comm_memory import policy_bill
    from lifecycle.distributed.layout import of_policy

    layout = of_policy(policy, world_size)
    step = max(world_size // 4096, 1)
    worst = None
    for rank in sorted({*range(0, world_size, step), world_size - 1}):
        bill = policy_bill(policy, layout, rank, ranks_per_node)
        if worst is None or bill.total > worst.total:
            worst = bill
    if worst is None or worst.total <= budget * 2**30:
        return
    top = sorted(worst.communicators, key=lambda c: -c["bytes"])[:3]
    shown = ", ".join(f"{c['group']} ({c['size']} ranks) {c['bytes'] / 2**20:.1f} MiB" for c in top)
    dup = sum(int(d["bytes"]) for d in worst.duplicates)
    knobs = ("distributed.nccl_env (NCCL_BUFFSIZE, NCCL_MAX_NCHANNELS, NCCL_PROTO), " if worst.backend == "nccl"
             else "")
    raise PolicyError.single(
        "distributed.comm_memory_budget_gib",
        f"rank {worst.rank}'s {worst.backend} communicators would take {worst.total / 2**30:.3f} GiB by the "
        f"estimate (`lifecycle explain --world-size {world_size} --rank {worst.rank}`), over the budget; largest: "
        f"{shown}" + (f"; {dup / 2**20:.1f} MiB of it for groups that repeat another's ranks" if dup else "")
        + f"; shrink with {knobs}warmup.groups: used, or raise the budget", budget)


def check_control_plane(policy: Policy, world_size: int, ranks_per_node: int) -> None:
    """The plan's sockets within this process's open-file limit (which the ranks it starts inherit; a rank under
    torchrun or srun checks its own) and the watchdogs' store calls within ``watchdog.store_budget_calls_per_s``
    (:func:`lifecycle.machine.cost.limits`), or a PolicyError (exit 2) naming the key that lowers it."""
    from lifecycle.distributed.layout import of_policy
    from lifecycle.machine.cost import limits

    limits(policy, of_policy(policy, world_size), ranks_per_node)


ENV_EVENTS_FLUSH = "LIFECYCLE_EVENTS_FLUSH_EVERY"


def events_flush_every(env: dict[str, str] | os._Environ[str] | None = None) -> int:
    """How many events a rank buffers before it writes them (``LIFECYCLE_EVENTS_FLUSH_EVERY``; 256 by default):
    1 makes every event reach the file as it happens, for a monitor that follows a run live (a write then can sit
    inside a collective's span: keep the events on a local disk). Anything but a positive integer is a UsageError
    naming the variable."""
    text = (env if env is not None else os.environ).get(ENV_EVENTS_FLUSH, "").strip()
    if not text:
        return 256
    if not text.isdigit() or not 0 < int(text) <= 1 << 20:
        raise UsageError(f"{ENV_EVENTS_FLUSH}={text!r}: not a count of events between writes (1 .. {1 << 20}); "
                         f"unset it or give a positive integer")
    return int(text)


MEMORY_COPY_FACTOR = 3
"""A rank's memory-tier copy against its weights' lower estimate: the weights and an Adam optimizer's two moments."""


def check_memory_tier(policy: Policy, ranks_per_node: int) -> None:
    """``checkpoint.memory``: its folder exists and can be written, and the node's copies fit in what it has free —
    each local rank's state (at least its weights and two optimizer moments by the kind's lower estimate) times
    ``keep``, twice with ``replicate`` — or a PolicyError (exit 2) naming the numbers and the keys that shrink them."""
    from lifecycle.hostinfo import fmt_bytes
    from lifecycle.policy.modelsize import rank_bytes
    from lifecycle.recovery.copies import free_bytes

    m = policy.checkpoint.memory
    if not m.every_steps or not policy.train.steps:
        return
    folder = Path(m.dir)
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise PolicyError.single("checkpoint.memory.dir", "is not a folder this process can write (a node-local "
                                 "tmpfs such as /dev/shm); create it or set checkpoint.memory.dir", m.dir)
    estimate = rank_bytes(policy.train.options, policy.parallelism)
    free = free_bytes(folder)
    if estimate is None or free is None:
        return
    need = estimate * MEMORY_COPY_FACTOR * m.keep * (2 if m.replicate else 1) * ranks_per_node
    if need > free:
        raise PolicyError.single(
            "checkpoint.memory", f"the copies of this node's {ranks_per_node} rank(s) take at least {fmt_bytes(need)} "
            f"(each rank's state {fmt_bytes(estimate * MEMORY_COPY_FACTOR)} x keep {m.keep}"
            f"{' x 2 (replicate)' if m.replicate else ''}), more than {m.dir} has free ({fmt_bytes(free)}): lower "
            f"checkpoint.memory.keep, set replicate=false, point checkpoint.memory.dir at a larger tmpfs, or set "
            f"checkpoint.memory.every_steps=0", m.every_steps)


def check_resume(checkpoint_dir: str, resume: str, on_corrupt: str) -> None:
    """What the checkpoint folder alone decides, before any rank starts (exit 2): ``resume: required`` with no
    usable checkpoint, and, with ``on_corrupt: error``, a tracker that cannot be used or that names a folder
    that is not complete. The ranks check again at resume (the files may change in between)."""
    from lifecycle.checkpoint import ckptdir

    if resume == "never":
        return
    root = Path(checkpoint_dir)
    found = ckptdir.candidates(root)
    tracker = found.tracker
    if on_corrupt == "error":
        hint = "fix or remove it, or set checkpoint.on_corrupt=fallback to resume from the newest older one"
        if tracker.error is not None:
            raise CheckpointError(f"checkpoint.dir {root}: the tracker {tracker.path} {tracker.error}; {hint}",
                                  path=str(tracker.path))
        head = str(root / tracker.name) if tracker.name else None
        if head is not None and head in found.rejected:
            raise CheckpointError(f"checkpoint.dir {root}: checkpoint {head} (named by the tracker "
                                  f"{tracker.path}) cannot be used: {found.rejected[head]}; {hint}", path=head)
    if resume == "required" and not found.paths:
        raise PolicyError.single("checkpoint.resume", f"is required but {root} holds no complete checkpoint; set "
                                 f"checkpoint.resume=auto or point checkpoint.dir at an earlier run's checkpoints",
                                 resume)
