"""The one exception tree of lifecycle.

Every error carries data, not only text: the phase it happened in, the rank, the group and the
deadline that ran out, plus the process exit code it maps to. The CLI prints ``str(err)`` (never a
traceback) for user errors and exits with ``err.exit_code``.
"""

from __future__ import annotations

from dataclasses import dataclass


class ExitCode:
    """Process exit codes, documented in the README and used everywhere."""

    OK = 0  # success, also a graceful stop on SIGTERM (preemption)
    USAGE = 2  # bad policy, bad override, bad command line
    HANG = 3  # the watchdog detected a hang
    RANK_FAILED = 4  # a rank raised or died
    TEARDOWN_DEADLINE = 5  # teardown hit its hard deadline and the process exited by force


class LifecycleError(Exception):
    """Base class. Attributes say where it happened; ``exit_code`` says how the process ends."""

    exit_code: int = ExitCode.RANK_FAILED

    def __init__(
        self,
        message: str,
        *,
        phase: str | None = None,
        rank: int | None = None,
        group: str | None = None,
        deadline_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.phase = phase
        self.rank = rank
        self.group = group
        self.deadline_s = deadline_s


@dataclass(frozen=True)
class PolicyIssue:
    """One problem found in a policy: where (dotted key path), what, and the offending value."""

    path: str
    message: str
    value: object = None
    has_value: bool = True

    def __str__(self) -> str:
        where = self.path or "<policy>"
        got = f" (got {self.value!r})" if self.has_value else ""
        return f"{where}: {self.message}{got}"


class PolicyError(LifecycleError):
    """The policy (file, overrides, pack) is invalid. ``issues`` lists every problem found."""

    exit_code = ExitCode.USAGE

    def __init__(self, issues: list[PolicyIssue], *, source: str | None = None) -> None:
        self.issues = list(issues)
        self.source = source
        head = f"invalid policy{f' ({source})' if source else ''}: {len(self.issues)} error(s)"
        super().__init__("\n".join([head, *(f"  {i}" for i in self.issues)]))

    @classmethod
    def single(cls, path: str, message: str, value: object = None, *, source: str | None = None,
               has_value: bool = True) -> PolicyError:
        return cls([PolicyIssue(path, message, value, has_value)], source=source)


class UsageError(LifecycleError):
    """The command line or the environment is wrong (missing file, bad world size, ...)."""

    exit_code = ExitCode.USAGE


class CheckpointError(UsageError):
    """A checkpoint cannot be used: missing or truncated files, no metadata, a bad tracker. Exit 2: the input
    is wrong, not the job; ``path`` names the checkpoint (or tracker) and the message says why and what to do."""

    def __init__(self, message: str, *, path: str | None = None, **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.path = path


class TransitionError(LifecycleError):
    """An illegal phase transition, e.g. ``can't go to checkpoint from warmup``."""


class PhaseError(LifecycleError):
    """A phase handler failed on this rank."""


class HangError(PhaseError):
    """A deadline passed: a collective, barrier or wait did not complete in time.

    ``missing`` lists the global ranks that did not arrive, when known.
    """

    exit_code = ExitCode.HANG

    def __init__(self, message: str, *, missing: list[int] | None = None, **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.missing = list(missing or [])
