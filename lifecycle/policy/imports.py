"""Importing code of installed packages (policy packs, handler entry points) with a deadline.

Every command imports them, ``lifecycle validate`` of the default policy included, so a package whose import never
returns (a network mount that hangs, a lock, ``input()``) must not hang lifecycle: each import runs on a daemon
thread and is waited for at most ``LIFECYCLE_IMPORT_TIMEOUT_S`` seconds (default 5). One that does not return in
time is abandoned (the thread stays blocked in it; Python cannot stop it) and its package is left out for the rest
of the process. While it imports, what it prints goes to stderr: ``--json`` output stays valid JSON.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from lifecycle.errors import UsageError

T = TypeVar("T")
ENV_TIMEOUT = "LIFECYCLE_IMPORT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 5.0
_hung: dict[str, tuple[str, float]] = {}
"""Top-level package -> (the module whose import hung there, its deadline): a later import of the same package would
block on its import lock."""


def timeout_s() -> float:
    """The deadline of one import: ``LIFECYCLE_IMPORT_TIMEOUT_S``, else 5 seconds."""
    text = os.environ.get(ENV_TIMEOUT, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{ENV_TIMEOUT}={text[:40]!r} must be a number of seconds > 0 (the deadline of importing "
                         f"one policy pack or handler package; default {DEFAULT_TIMEOUT_S:g})")
    return value


def hung(module: str) -> str | None:
    """Why importing ``module`` would block: an import in its top-level package hung earlier; else None."""
    before = _hung.get(module.split(".")[0])
    if before is None:
        return None
    if before[0] == module:
        return f"did not finish within {before[1]:g}s"
    return f"did not run: importing '{before[0]}' did not finish within {before[1]:g}s earlier in this process"


def bounded(module: str, load: Callable[[], T]) -> T:
    """``load()`` (an import of ``module``) on a daemon thread, waited for at most :func:`timeout_s`, its stdout sent
    to stderr. Returns what it returns or raises what it raised; raises TimeoutError when it did not finish in time
    (or an import of the same package hung before)."""
    before = hung(module)
    if before is not None:
        raise TimeoutError(before)
    deadline = timeout_s()
    box: dict[str, object] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = load()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, SystemExit included
            box["error"] = exc
        done.set()

    sys.stdout.flush()
    with contextlib.redirect_stdout(sys.stderr):
        threading.Thread(target=target, name=f"lifecycle-import:{module}", daemon=True).start()
        finished = done.wait(deadline)
    if not finished:
        _hung[module.split(".")[0]] = (module, deadline)
        raise TimeoutError(f"did not finish within {deadline:g}s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
