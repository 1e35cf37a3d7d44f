"""Rank processes forked from one process that imported torch (and megatron-core) once.

A rank's start-up is mostly imports: torch takes about a second of CPU, megatron-core three more, and N ranks on one
machine pay them N times at once (on 2 cores, 4 megatron ranks spend ~6 s of wall time importing before they meet).
``lifecycle run`` therefore starts one *preload* process (``python -m lifecycle.launch.preload RUN_DIR MODULE...``)
that imports what the run's ranks need, then forks every rank from it: each child is a fresh session (so the
launcher's ``killpg`` reaches its children), writes to ``run_dir/logs/rank_<R>.log``, takes the rank's environment and
runs ``python -m lifecycle.launch.worker RUN_DIR`` as ``__main__``. Nothing is shared at run time: the preload process
starts no thread and no CUDA context before it forks (importing torch creates neither), and each rank creates its
own process groups after the fork.

Lifetimes chain: the preload process dies with the launcher (parent-death signal), each rank with the preload
process (``LIFECYCLE_LAUNCHER_PID`` names it; see :mod:`lifecycle.launch.parent`), so no rank outlives the launcher.
The preload process reaps the ranks and reports each exit status to the launcher over its stdout; to the launcher a
rank is a :class:`Forked` handle with the ``pid``/``poll``/``wait`` it used on a ``Popen``.

Protocol (one line each): launcher -> preload: a JSON request ``{"rank", "log", "env", "argv"}``, or ``{"import":
[MODULE, ...]}`` (more imports: ``lifecycle run`` starts the process with torch's before it has composed the policy,
then asks for megatron-core's when the policy needs them); preload -> launcher: ``ready`` (after the imports, and
after each ``import`` request), ``pid RANK PID``, ``exit PID CODE`` (negative: killed by that signal), ``error TEXT``.
Only on machines without an NVIDIA driver (gloo on CPUs): an import may touch CUDA, and a CUDA context does not
survive a fork, so GPU ranks start by ``exec`` as before. ``LIFECYCLE_PRELOAD=0`` turns it off (every rank is then started by ``exec`` as before); a preload process that does
not come up in :data:`READY_S` is given up for the same start-by-exec, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_PRELOAD = "LIFECYCLE_PRELOAD"
READY_S = 120.0
"""How long the launcher waits for the preload process's imports (a cold shared file system can take a minute)."""

TORCH = ("torch", "torch.distributed", "lifecycle.launch.worker", "lifecycle.machine.session", "lifecycle.machine.orchestrator")
# lifecycle's megatron backend first: its package sets the warning filters megatron-core's import needs
# torch._dynamo: a torch optimizer's __init__ imports it (torch.optim's _disable_dynamo), which megatron's optimizer
# builds in every rank otherwise (0.7 s each; the synthetic kind never imports it)
MEGATRON = ("lifecycle.backends.megatron", "megatron.core", "megatron.core.models.gpt",
            "lifecycle.backends.megatron.parallel", "torch._dynamo")


def enabled(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(ENV_PRELOAD, "1").strip().lower() not in ("0", "false", "no",
                                                                                                "off")


def modules_for(megatron: bool) -> tuple[str, ...]:
    return TORCH + (MEGATRON if megatron else ())


class Forked:
    """A rank forked by the preload process, as the launcher sees it (the part of ``Popen`` it uses)."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid, self._zygote = pid, zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._zygote.code_of(self)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._zygote.changed:
            while self._zygote.code_of(self) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
                # Woken by a status line; a rank that outlives its reported end (the preload process gone, the
                # parent-death signal on its way) is looked at again every 0.1 s.
                self._zygote.changed.wait(0.1 if left is None else min(left, 0.1))
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The launcher's end of one preload process."""

    def __init__(self, run_dir: Path, modules: Sequence[str], env: Mapping[str, str], launcher_env: str) -> None:
        self.changed = threading.Condition()
        self._codes: dict[int, int] = {}
        self._pids: dict[int, int] = {}
        self._errors: list[str] = []
        self._asked, self._done = 1, 0  # import requests sent (the start's own included), and their "ready" lines
        self._gone = False
        full = {**os.environ, **env, launcher_env: str(os.getpid())}
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(run_dir), *modules], env=full,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, name="lifecycle-preload", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            kind, _, rest = raw.decode(errors="replace").strip().partition(" ")
            with self.changed:
                if kind == "ready":
                    self._done += 1
                elif kind == "pid":
                    rank, pid = rest.split()
                    self._pids[int(rank)] = int(pid)
                    self._codes.pop(int(pid), None)  # a pid of an earlier launch's rank, reused by the kernel
                elif kind == "exit":
                    pid, code = rest.split()
                    self._codes[int(pid)] = int(code)
                elif kind == "error":
                    self._errors.append(rest)
                self.changed.notify_all()
        with self.changed:
            self._gone = True
            self.changed.notify_all()

    def _ready(self) -> bool:
        return self._done >= self._asked

    def wait_ready(self, timeout_s: float) -> str | None:
        """None when the imports are done; else why not (the process is stopped then)."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not self._ready() and not self._gone and time.monotonic() < deadline:
                self.changed.wait(deadline - time.monotonic())
            if self._ready():
                return None
            why = self._errors[-1] if self._errors else ("it exited" if self._gone else f"not ready in {timeout_s:g}s")
        self.close(kill=True)
        return why

    def extend(self, modules: Sequence[str]) -> None:
        """Import ``modules`` too before the next fork (:meth:`wait_ready` waits for them)."""
        if not modules:
            return
        assert self.proc.stdin is not None
        with self.changed:
            self._asked += 1  # the "ready" of an import still under way is not this one's
        try:
            self.proc.stdin.write(json.dumps({"import": list(modules)}).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            with self.changed:
                self._gone = True
                self.changed.notify_all()

    @property
    def usable(self) -> bool:
        """Still running and taking requests (its imports done or under way: :meth:`wait_ready` waits for them): the
        next launch (a relaunched attempt, or the first one after an early start) can fork from it."""
        with self.changed:
            return not self._gone and not self._errors and self.proc.poll() is None

    def fork(self, rank: int, argv: Sequence[str], env: Mapping[str, str], log_file: Path) -> Forked:
        request = json.dumps({"rank": rank, "argv": list(argv), "env": dict(env), "log": str(log_file)})
        assert self.proc.stdin is not None
        with self.changed:
            self._pids.pop(rank, None)  # the same rank of an earlier launch from this process
        try:
            self.proc.stdin.write(request.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise OSError(f"the preload process could not start rank {rank}: it exited") from exc
        with self.changed:
            while rank not in self._pids:
                if self._gone or self._errors:
                    raise OSError(f"the preload process could not start rank {rank}: "
                                  f"{self._errors[-1] if self._errors else 'it exited'}")
                self.changed.wait(1.0)
            return Forked(self._pids[rank], self)

    def code_of(self, rank: Forked) -> int | None:
        with self.changed:
            if rank.returncode is None:
                code = self._codes.get(rank.pid)
                if code is None and self._gone and not _alive(rank.pid):
                    code = -9  # the preload process is gone: its ranks died with it (parent-death SIGKILL)
                rank.returncode = code
            return rank.returncode

    def close(self, *, kill: bool = False) -> None:
        """No more ranks: the process leaves once its ranks have (``kill``: at once)."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5.0)
        self._reader.join(5.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- the preload process ----------------------------------------------------------------------------------------
_STATUS_FD = 1  # moved off fd 1 at start: what an import prints must not reach the launcher as a status line


def _say(line: str) -> None:
    os.write(_STATUS_FD, (line.replace("\n", " ") + "\n").encode())


def _child(request: dict[str, Any], keep_closed: Sequence[int]) -> None:
    """In the forked rank: its own session, log, environment and argv; never returns."""
    import runpy
    import warnings

    code = 1
    try:
        from lifecycle.launch.parent import die_with
        from lifecycle.machine.stops import record_early

        record_early()  # a stop that comes before the rank's session takes over is acted on by it, not fatal

        os.setsid()
        die_with(int(request["env"][_launcher_env()]))  # from the first instruction, whatever module runs
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd in keep_closed:
            try:
                os.close(fd)
            except OSError:
                pass
        os.environ.clear()
        os.environ.update(request["env"])
        _name(f"lifecycle-rank{int(request['rank'])}")  # what top and `ps -o comm` show (the command line is shared)
        argv = list(request["argv"])
        if argv[1:2] != ["-m"] or len(argv) < 3:
            raise ValueError(f"the preload process runs `python -m MODULE ...` only (got {argv})")
        sys.argv = [argv[2], *argv[3:]]
        # The module was imported here already (that is the point): running it as __main__ again is what
        # `python -m` does too, so runpy's note about it is noise.
        warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                                category=RuntimeWarning)
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the rank's own error, into its log as python would print it
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _name(title: str) -> None:
    """This process's name in /proc/PID/comm (Linux ``PR_SET_NAME``, 15 characters); nothing elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(15, title.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    import importlib

    from lifecycle.launch.parent import die_with_launcher

    global _STATUS_FD
    args = list(sys.argv[1:] if argv is None else argv)
    _STATUS_FD = os.dup(1)
    os.dup2(2, 1)  # stdout of the imports goes where stderr goes (nowhere: the launcher discards it)
    die_with_launcher()

    def imported(names: Sequence[str]) -> bool:
        for name in names:
            try:
                importlib.import_module(name)
            except BaseException as exc:  # noqa: BLE001 - the launcher falls back to starting ranks by exec
                _say(f"error importing {name}: {type(exc).__name__}: {exc}")
                return False
        sys.stdout.flush()
        sys.stderr.flush()
        _say("ready")
        return True

    if not imported(args[1:]):
        return 1
    children: dict[int, int] = {}  # pidfd -> pid
    buf, closed = b"", False
    while not closed or children:
        readable, _, _ = select.select(([] if closed else [0]) + list(children), [], [])
        for fd in readable:
            if fd == 0:
                chunk = os.read(0, 1 << 20)
                closed = not chunk
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    request = json.loads(line)
                    if "import" in request:
                        if not imported(request["import"]):
                            return 1
                        continue
                    request["env"][_launcher_env()] = str(os.getpid())  # the rank dies with this process
                    pid = os.fork()
                    if pid == 0:
                        _child(request, [_STATUS_FD, *children])
                    children[os.pidfd_open(pid)] = pid
                    _say(f"pid {int(request['rank'])} {pid}")
            else:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")
    return 0


def _launcher_env() -> str:
    from lifecycle.launch.parent import ENV_LAUNCHER_PID

    return ENV_LAUNCHER_PID


if __name__ == "__main__":
    _code = main()
    os._exit(_code)  # no interpreter shutdown of torch and megatron-core: the launcher waits for this exit
