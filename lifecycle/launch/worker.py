"""One rank of a run: ``python -m lifecycle.launch.worker RUN_DIR``.

The process's entry: it dies with its launcher, sets up logging and runs the rank's session
(:func:`lifecycle.machine.session.run_rank`); an error of lifecycle's own is one line and its exit code.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lifecycle.errors import ExitCode, LifecycleError, exit_code


def main(argv: list[str] | None = None) -> int:
    from lifecycle.machine.stops import record_early

    record_early()  # a stop that comes before the rank's session takes over is acted on by it, not fatal
    from lifecycle.launch.parent import die_with_launcher
    from lifecycle.machine.session import run_rank
    from lifecycle.obs.logconfig import setup_logging

    die_with_launcher()
    args = sys.argv[1:] if argv is None else argv
    setup_logging()
    crash_stacks()
    if len(args) != 1:
        print("usage: python -m lifecycle.launch.worker RUN_DIR", file=sys.stderr)
        return ExitCode.USAGE
    try:
        return run_rank(Path(args[0]))
    except LifecycleError as exc:
        from lifecycle.rundir.elastic import record_failure

        print(f"[rank {os.environ.get('RANK', '?')}] error: {exc}", file=sys.stderr, flush=True)
        rank = os.environ.get("RANK", "")
        record_failure(rank=int(rank) if rank.isdigit() else -1, error=type(exc).__name__, message=str(exc),
                       exit_code=exit_code(exc), phase=exc.phase or "before init", group=exc.group)
        return exit_code(exc)


def crash_stacks() -> None:
    """A rank that crashes in native code (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT: a library, a driver) writes the
    Python stack of every thread to its stderr — the rank's log — before it dies of the same signal, so the launcher
    still names the signal (Python's ``faulthandler``; already on under ``-X faulthandler``/``PYTHONFAULTHANDLER``)."""
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave now: interpreter shutdown could wait on threads a hung peer left behind.
    os._exit(code)
