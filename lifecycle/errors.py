"""The one exception tree of lifecycle.

Every error carries data, not only text: the phase it happened in, the rank, the group and the
deadline that ran out, plus the process exit code it maps to. The CLI prints ``str(err)`` (never a
traceback) for user errors; :func:`exit_code` is the one place an error becomes the process exit code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ExitCode:
    """Process exit codes, documented in docs/running.md and used everywhere."""

    OK = 0  # success, also a graceful stop on SIGTERM (preemption)
    USAGE = 2  # bad policy, bad override, bad command line
    HANG = 3  # the watchdog detected a hang
    RANK_FAILED = 4  # a rank raised or died
    TEARDOWN_DEADLINE = 5  # teardown hit its hard deadline and the process exited by force
    NO_PROGRESS = 6  # attempts in a row failed without committing a newer checkpoint: not restarting


@dataclass(frozen=True)
class ExitRule:
    """One exit code and what a scheduler should do with it (the one table: docs/running.md, the sbatch and Kubernetes
    examples and their tests read it)."""

    code: str
    meaning: str
    then: str
    """``done``, ``restart`` (requeue / restart the pod), or ``stop`` (a restart would repeat it)."""
    advice: str


EXIT_RULES = (
    ExitRule("0", "success; also a graceful stop after a preemption signal (the save committed, or nothing to save "
             "before training)", "done", "nothing to do; a preempted run resumes when started again"),
    ExitRule("2", "bad policy, override, command line, environment, checkpoint or run-directory input (every error "
             "named: `key.path: message (got VALUE)`, the file, the port)", "stop", "fix the input; a restart repeats it"),
    ExitRule("3", "a hang detected by the watchdog, a collective sequence that diverged or a peer that stopped "
             "answering", "restart", "restart from the last commit; exclude the node the report names when it repeats"),
    ExitRule("4", "a rank failed: it raised or died (a rank killed by a signal counts)", "restart",
             "restart from the last commit; read the rank's log"),
    ExitRule("5", "teardown hit its hard deadline and the process exited by force (the work is committed)",
             "restart", "restart; the exit hung, not the training"),
    ExitRule("6", "not restarting: `restart.max_no_progress` attempts in a row failed without committing a newer "
             "checkpoint", "stop", "fix the cause, then run again with `restart.max_no_progress=0`"),
    ExitRule("128+N", "killed by signal N before a clean stop (137: SIGKILL, 143: SIGTERM without the save "
             "landing)", "restart", "restart from the last commit"),
)
"""Every exit code of a run, in one table. Codes 3-6 can be changed in ``teardown.exit_codes``."""


def exit_codes_markdown() -> str:
    """The table of :data:`EXIT_RULES` as docs/running.md shows it (a test keeps them equal)."""
    rows = ["| code | meaning | a scheduler should | what to do |", "|---|---|---|---|"]
    rows += [f"| {r.code} | {r.meaning} | {r.then} | {r.advice} |" for r in EXIT_RULES]
    return "\n".join(rows) + "\n"


def codes_that(then: str) -> list[int]:
    """The numeric exit codes a scheduler should ``then`` (``done``, ``restart``, ``stop``)."""
    return [int(r.code) for r in EXIT_RULES if r.then == then and r.code.isdigit()]


class LifecycleError(Exception):
    """Base class. Attributes say where it happened; ``exit_code`` says how the process ends (:func:`exit_code`)."""

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

    @property
    def exit_code(self) -> int:
        """The exit code with the default codes (a run uses its policy's: :func:`exit_code`)."""
        return exit_code(self)


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


class BadState(PhaseError):
    """A rank's state holds a NaN or inf at a save (``checkpoint.check_finite``): never saved; a restart resumes
    from the last good state."""


class DrillError(PhaseError):
    """Raised by a ``raise`` fault drill."""


class SequenceMismatch(PhaseError):
    """Ranks of one group issued different numbers of collectives on it (or one is blocked in an extra one): the
    job would hang at the diverging collective, so it exits with the hang code.

    ``ranks`` lists the global ranks whose counts disagree.
    """


    def __init__(self, message: str, *, ranks: list[int] | None = None, **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.ranks = sorted(set(ranks or []))


class NoProgress(LifecycleError):
    """``restart.max_no_progress`` attempts in a row failed before committing a checkpoint newer than the one they
    started from: this attempt refuses to start (``exit_codes.no_progress``), so no launcher restarts it forever."""


class RestartRequested(LifecycleError):
    """Another rank failed and the ranks restart in place (``restart.mode: in_process``): this rank leaves its phase
    at the next step boundary to join them. Not a failure of this rank's."""


class JobFailed(LifecycleError):
    """A trainer's Job (``lifecycle.attach``) failed where no other error says so (its teardown); ``code`` is the
    exit code the process leaves with when nothing catches it."""

    def __init__(self, message: str, *, code: int, **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.code = code


class RunDirError(UsageError):
    """A file of a run or checkpoint directory cannot be used (not a regular file, too large, unreadable);
    ``path`` names it. Exit 2: the folder's content is wrong, not the job."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class UnusableInput(RunDirError):
    """An input of ``lifecycle diagnose`` that is safe to read but cannot be used (a dump whose rank is not known):
    skipped with a note while other inputs are usable; exit 2 only when nothing else is."""


class StorageError(PhaseError):
    """A file system refused a rank's write during the run: read-only, full or over its quota.
    ``path`` names the file, the message the run's folder it lies in (``checkpoint.dir``, ``run.dir``) and what to
    do. The run failed (exit ``rank_failed``), its input did not; the committed checkpoints stay as they were."""

    def __init__(self, message: str, *, path: str | None = None, **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.path = path


class Shutdown(BaseException):  # noqa: N818 - a request, not an error: it must pass ``except Exception``
    """The launcher is taking the job down (another rank failed, or a preemption deadline): leave through the
    failure path. A BaseException, so that no ``except Exception`` of a trainer swallows it."""


class StoreUnavailable(RuntimeError):
    """The watchdog's side channel: the store did not answer in time, is not connected (yet), or the connection
    failed. Internal to the watchdog thread, which carries on with what it knows locally."""


class PolicyExitCodes(Protocol):
    """The policy's ``teardown.exit_codes`` (hang and rank_failed can be changed per policy)."""

    @property
    def hang(self) -> int: ...

    @property
    def rank_failed(self) -> int: ...

    @property
    def no_progress(self) -> int: ...


def exit_code(exc: BaseException, codes: PolicyExitCodes | None = None) -> int:
    """The one place a process's exit code comes from when it ends with ``exc``: 2 for the user's input (policy,
    command line, environment, checkpoint or run-directory files), the policy's hang code (``codes``, else 3) for a
    hang or a diverged collective sequence, its rank_failed code (else 4) for anything else."""
    if isinstance(exc, JobFailed):
        return exc.code
    if isinstance(exc, PolicyError | UsageError):
        return ExitCode.USAGE
    if isinstance(exc, HangError | SequenceMismatch):
        return codes.hang if codes is not None else ExitCode.HANG
    if isinstance(exc, NoProgress):
        return codes.no_progress if codes is not None else ExitCode.NO_PROGRESS
    return codes.rank_failed if codes is not None else ExitCode.RANK_FAILED


def culprits(exc: BaseException) -> list[int]:
    """The global ranks an error names as the cause (the ranks that did not arrive, or whose counts disagree)."""
    if isinstance(exc, HangError):
        return exc.missing
    if isinstance(exc, SequenceMismatch):
        return exc.ranks
    return []


class HangError(PhaseError):
    """A deadline passed: a collective, barrier or wait did not complete in time.

    ``missing`` lists the global ranks that did not arrive, when known.
    """


    def __init__(self, message: str, *, missing: list[int] | None = None, **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.missing = list(missing or [])


class PeerFailed(PhaseError):
    """A collective broke because a peer failed or died first (the watchdog's alarm names it): the consequence of that
    failure, not an error of this rank's; the rank-failed code like the peer's."""


class PeerLeftAfterHang(HangError):
    """A collective broke because a peer left after the watchdog reported a hang, a silent rank or a divergence: the
    consequence of that report, not a timeout of this rank's; the hang code like the rest."""
