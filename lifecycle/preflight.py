"""Checks of what can be known before any rank starts: the folders a run writes and the launcher's environment.

Each check returns :class:`~lifecycle.errors.PolicyIssue` lines (``key: what (got value)``) or raises a
:class:`~lifecycle.errors.UsageError`; both exit 2 before a process group exists. Pure Python, no torch.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from lifecycle.errors import CheckpointError, PolicyError, PolicyIssue, UsageError

_SYSTEM = (Path("/proc"), Path("/sys"), Path("/dev"))


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


def dir_problem(path_text: str) -> str | None:
    """Why ``path_text`` cannot be a folder this run writes into, or None. Creates the folder when missing
    (the run would create it anyway) and writes and removes one probe file."""
    try:
        path = _resolved(Path(path_text))
        if any(path == s or s in path.parents for s in _SYSTEM):
            return f"is under {next(s for s in _SYSTEM if path == s or s in path.parents)} (a system folder)"
        existing = _first_existing(path)
        if not existing.is_dir():
            where = "is" if existing == path else f"has a parent {existing} that is"
            return f"{where} a file, not a folder"
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".lifecycle-probe-{os.getpid()}"
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
        probe.unlink()
    except OSError as exc:
        return f"is not writable ({exc.strerror or exc})"
    return None


def check_dirs(run_dir: str, checkpoint_dir: str) -> None:
    """Raise a PolicyError (exit 2) when ``run.dir`` or ``checkpoint.dir`` cannot be written."""
    issues = []
    for key, value in (("run.dir", run_dir), ("checkpoint.dir", checkpoint_dir)):
        why = dir_problem(value)
        if why is not None:
            issues.append(PolicyIssue(key, f"{why}; point it at a writable folder", value))
    if issues:
        raise PolicyError(issues, source="before launch")


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


def check_resume(checkpoint_dir: str, resume: str, on_corrupt: str) -> None:
    """What the checkpoint folder alone decides, before any rank starts (exit 2): ``resume: required`` with no
    usable checkpoint, and, with ``on_corrupt: error``, a tracker that cannot be used or that names a folder
    that is not complete. The ranks check again at resume (the files may change in between)."""
    from lifecycle import ckptdir

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
