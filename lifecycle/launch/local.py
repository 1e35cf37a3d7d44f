"""Local launcher: N ranks on this machine, a store that outlives them, a fast shutdown naming who failed.

Built on torch's elastic process layer (``elastic.multiprocessing.start_processes``, under torchrun), not
on ``torch.distributed.launcher.api`` (torchrun's agent): in torch 2.13, on a worker failure the agent's
``PContext.wait(0)`` -> ``_poll`` at once calls ``close()`` with a hard-coded 30 s SIGTERM->SIGKILL grace
(``shutdown_timeout`` only applies when the agent itself is signalled), leaving no hook to write the
shutdown marker first; it picks the first failure by error-file time (``@record`` workers only) and knows
no phases. From torch we use ``SubprocessContext`` (a rank per Popen in its own session, so ``killpg``
reaches the rank's children too; ``TailLog`` tees logs; ``TORCHELASTIC_ERROR_FILE`` for ``@record``) and
the agent's store arrangement: the TCPStore server lives here and ranks get
``TORCHELASTIC_USE_AGENT_STORE=True``, so env:// rendezvous connects as a client on every rank
(``rendezvous.py: _create_c10d_store``) and the store outlives every rank, rank 0 included. Monitoring
(Linux pidfds: we wake at the first exit), shutdown and signals are ours; the handlers ``PContext.start``
installs (they raise, and are never restored) are replaced for the call and restored after it.

Rank output: stdout and stderr of rank R go, interleaved, to ``run_dir/logs/rank_<R>.log`` (a ``/bin/sh``
wrapper redirects both, then ``exec``s argv, so the pid is the rank's own); ``console_ranks`` (rank 0) are
also tailed to this process's stdout. ``PYTHONUNBUFFERED=1`` unless given: a killed rank's log is complete.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import lifecycle.rundir as rundir
from lifecycle.launch import preload as preload_mod
from lifecycle.launch.parent import ENV_LAUNCHER_PID
from lifecycle.launch.signals import SignalTrap, torch_leaves_our_signals

logger = logging.getLogger(__name__)

_SH = ("-c", 'log=$1; shift; exec "$@" >"$log" 2>&1', "lifecycle-rank")
_REAP_S = 5.0  # bounded wait after SIGKILL: a rank in uninterruptible sleep cannot be reaped at all


@dataclass(frozen=True)
class LaunchResult:
    """How a local job ended. Ranks the launcher signalled or killed are never the failure cause."""

    exit_code: int  # of the first failed rank (a signal N gives 128+N); else 0, or 128+N if stopped by N
    first_failure: int | None  # the rank that failed first, before the launcher brought the job down
    how: str | None  # "exit 4" or "signal SIGKILL"
    phase: str | None  # from the last line of run_dir/events/rank_<R>.jsonl of that rank, if any
    per_rank: dict[int, int]  # Popen return codes (negative: killed by that signal)
    wall_s: float
    stopped_by: str | None = None  # the signal the launcher received and forwarded (preemption)
    killed: tuple[int, ...] = field(default=())  # ranks still alive after the grace, SIGKILLed
    aborted: bool = False  # a second SIGINT/SIGTERM cut the grace short: the ranks were SIGKILLed at once

    def describe(self) -> str:
        """One line for humans, e.g. ``rank 2 failed first (exit 4) in phase warmup``."""
        if self.first_failure is not None:
            line = f"rank {self.first_failure} failed first ({self.how})"
            line += f" in phase {self.phase}" if self.phase else ""
        elif self.stopped_by and not self.per_rank:
            line = f"stopped on {self.stopped_by} before any rank started (nothing to save)"
        elif self.stopped_by:
            line = f"stopped on {self.stopped_by}, " + ("every rank exited cleanly" if self.exit_code == 0
                                                        else f"exit {self.exit_code}")
        else:
            line = f"all {len(self.per_rank)} ranks succeeded"
        if self.killed:
            line += f"; ranks {list(self.killed)} were killed " + (
                "at once (asked again during the grace period)" if self.aborted else "after the grace period")
        return line


def launch_local(argv: list[str], nproc: int, run_dir: Path, *, env: dict[str, str] | None = None,
                 kill_grace_s: float = 3.0, preempt_grace_s: float = 3.0, poll_s: float = 0.1,
                 console_ranks: Iterable[int] = (0,), preload: Sequence[str] | None = None,
                 pool: PreloadPool | None = None, launched_at: float | None = None) -> LaunchResult:
    """Run ``argv`` as ranks 0..nproc-1 on this machine and return when every rank has ended.

    On the first rank that ends non-zero, writes ``run_dir/.shutdown``, SIGTERMs (and SIGCONTs) the others
    and SIGKILLs what is left after ``kill_grace_s``. SIGINT/SIGTERM sent to the launcher (main thread only)
    are a preemption request: the ranks get SIGTERM without the marker (they agree on a stop step, save and
    leave) and up to ``preempt_grace_s`` to end; a second one kills them at once. If the launcher itself raises,
    every rank is SIGKILLed at once. No rank process, nor anything left in a rank's process group, survives the
    call, nor the launcher: each rank is told to die with it (``LIFECYCLE_LAUNCHER_PID``, see
    :func:`die_with_launcher`).

    ``preload``: modules to import once in a process the ranks are forked from (``argv`` must be ``python -m
    MODULE ...``; see :mod:`lifecycle.launch.preload`); ``None`` starts every rank by ``exec``. ``pool``: keep the
    preload process for the caller's next launch (a relaunched attempt forks from it without importing again); the
    caller closes the pool. Without one, the preload process ends with this launch. ``launched_at``: when the
    launch began for the ranks' start-up (``LIFECYCLE_LAUNCHED_AT``; now when not given).
    """
    if nproc < 1 or not argv or poll_s <= 0 or kill_grace_s < 0 or preempt_grace_s < 0:
        raise ValueError(f"launch_local: need argv, nproc >= 1, poll_s > 0, kill_grace_s >= 0, preempt_grace_s >= 0 "
                         f"(got argv={argv!r}, nproc={nproc}, poll_s={poll_s}, kill_grace_s={kill_grace_s}, "
                         f"preempt_grace_s={preempt_grace_s})")
    run_dir = Path(run_dir).resolve()
    logs = _prepare(run_dir, nproc)
    start = time.monotonic()
    launched_at = time.time() if launched_at is None else launched_at  # the ranks' start-up counts from it
    own = pool is None
    pool = PreloadPool() if pool is None else pool
    zygote = pool.take(argv, run_dir, preload, env)
    store = _host_store()
    envs = {r: _rank_env(r, nproc, int(store.port), run_dir, env) | {rundir.ENV_LAUNCHED: f"{launched_at:.3f}"}
            for r in range(nproc)}
    console = set(console_ranks)
    try:
        for _ in range(2):  # a kept preload process that died since the last launch is replaced once
            if zygote is None:
                break
            why = zygote.wait_ready(preload_mod.READY_S)
            if why is not None:
                print(f"lifecycle: the ranks' preload process did not start ({why}); starting each rank by itself",
                      file=sys.stderr, flush=True)
                break
            result = _launch_forked(zygote, argv, envs, logs, console, run_dir, kill_grace_s, preempt_grace_s,
                                    poll_s, start)
            if result is not None:
                return result
            zygote = pool.take(argv, run_dir, preload, env)
    finally:
        if own:
            pool.close()
    from torch.distributed.elastic.multiprocessing import start_processes

    with SignalTrap() as trap:
        if trap.received:
            return _not_started(trap, start)
        with torch_leaves_our_signals():
            pc = start_processes(
                name="lifecycle", entrypoint="/bin/sh", envs=envs,
                args={r: (*_SH, str(logs[r]), *argv) for r in range(nproc)},
                logs_specs=_rank_logs(run_dir / rundir.LOGS_DIR, logs, console),
                log_line_prefixes=dict.fromkeys(console, ""),  # worker log lines carry their own [rank N]
            )
        try:
            trap.arm()  # PContext.start replaced SIGHUP/SIGQUIT's handlers with ones that raise
            return _watch({r: h.proc for r, h in pc.subprocess_handlers.items()}, trap, run_dir, kill_grace_s,
                          preempt_grace_s, poll_s, start)
        finally:
            pc.close(timeout=1)  # normally all reaped by now: this only stops the log tailers
            del store  # the store server lives exactly as long as the ranks


def _not_started(trap: SignalTrap, start: float) -> LaunchResult:
    """A stop signal came before any rank started: none is started, there is nothing to save (exit 0, the
    exit-code table's stop before training)."""
    sig = trap.received[0]
    print(f"lifecycle: {sig.name} before any rank started: none is started, nothing to save", flush=True)
    return LaunchResult(0, None, None, None, {}, time.monotonic() - start, sig.name)


def _watch(procs: dict[int, Any], trap: SignalTrap, run_dir: Path, kill_grace_s: float, preempt_grace_s: float,
           poll_s: float, start: float) -> LaunchResult:
    """Monitor the started ranks to the end; whatever happens, none is left alive."""
    job = _Job(procs, trap, poll_s)
    try:
        return job.run(run_dir, kill_grace_s, preempt_grace_s, start)
    finally:
        job.kill_all()


class PreloadPool:
    """The preload process of a job's successive launches (``lifecycle run``'s relaunched attempts): the imports are
    paid once per job, not once per attempt. A process that is gone, failed a fork or imported other modules is
    replaced at the next :meth:`take`."""

    def __init__(self) -> None:
        self._zygote: preload_mod.Zygote | None = None
        self._modules: tuple[str, ...] = ()

    def take(self, argv: list[str], run_dir: Path, preload: Sequence[str] | None,
             env: dict[str, str] | None) -> preload_mod.Zygote | None:
        """The preload process to fork this launch's ranks from (None: start them by ``exec``)."""
        if preload is None or argv[1:2] != ["-m"] or not preload_mod.enabled({**os.environ, **(env or {})}):
            return None
        have, want = self._modules, tuple(preload)
        if self._zygote is not None and self._zygote.usable and want[:len(have)] == have:
            self._zygote.extend(want[len(have):])  # a process started early with torch's: megatron-core's too
            self._modules = want
            return self._zygote
        self.close()
        self._start(run_dir, want, env)
        return self._zygote

    def prestart(self, run_dir: Path, modules: Sequence[str]) -> None:
        """Start the preload process now with ``modules`` (``lifecycle run``: torch's, while it composes the policy);
        :meth:`take` adds what the launch needs."""
        if self._zygote is None and preload_mod.enabled():
            self._start(run_dir, tuple(modules), None)

    def _start(self, run_dir: Path, modules: tuple[str, ...], env: dict[str, str] | None) -> None:
        common = dict(env or {})
        for name in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED"):
            common.setdefault(name, os.environ.get(name, "1"))
        self._zygote, self._modules = preload_mod.Zygote(run_dir, modules, common, ENV_LAUNCHER_PID), modules

    def close(self, *, kill: bool = False) -> None:
        """The preload process leaves (its ranks have ended: each launch waits for them); ``kill``: at once, its
        imports unfinished (no launch came: a policy error, a refusal before any rank)."""
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.close(kill=kill)


def _launch_forked(zygote: preload_mod.Zygote, argv: list[str], envs: dict[int, dict[str, str]],
                   logs: dict[int, Path], console: set[int], run_dir: Path, kill_grace_s: float,
                   preempt_grace_s: float, poll_s: float, start: float) -> LaunchResult | None:
    """:func:`launch_local` with ranks forked from the preload process (the same monitoring and shutdown); None when
    the preload process was gone before the first rank was forked (the caller replaces it)."""
    from torch.distributed.elastic.multiprocessing.tail_log import TailLog

    tail = TailLog("lifecycle", {r: str(logs[r]) for r in sorted(console) if r in logs}, sys.stdout,
                   dict.fromkeys(console, ""))
    started = False
    with SignalTrap() as trap:
        if trap.received:
            return _not_started(trap, start)
        try:
            procs: dict[int, Any] = {}
            for r, rank_env in envs.items():
                full = {**os.environ, **rank_env,
                        "TORCHELASTIC_ERROR_FILE": str(rundir.error_file(run_dir, r))}
                try:
                    procs[r] = zygote.fork(r, argv, full, logs[r])
                except OSError:
                    if procs:
                        raise
                    return None  # the preload process was gone before the first rank: nothing to clean up
            tail.start()
            trap.arm()
            started = True
            return _watch(procs, trap, run_dir, kill_grace_s, preempt_grace_s, poll_s, start)
        finally:
            if not started:
                zygote.close(kill=True)  # ranks forked before a failed fork die with it (parent-death signal)
            tail.stop()


class _Job:
    """The monitored rank processes of one launch."""

    def __init__(self, procs: dict[int, Any], trap: SignalTrap, poll_s: float) -> None:
        self.procs, self.trap, self.poll_s = procs, trap, poll_s
        self.codes: dict[int, int] = {}
        self.killed: list[int] = []
        self.watch = _ExitWatch(procs)

    def run(self, run_dir: Path, grace_s: float, preempt_s: float, start: float) -> LaunchResult:
        cause = self._monitor(run_dir)
        stop = self.trap.received[0] if cause is None and self.trap.received else None
        if cause is not None:
            try:
                rundir.write_marker(run_dir, f"rank {cause} failed ({_how(self.codes[cause])})", rank=cause,
                                    how=_how(self.codes[cause]),
                                    phase=(rundir.last_event(run_dir, cause) or {}).get("phase"))
            except (OSError, rundir.safeio.RunDirError) as exc:  # the ranks still come down, without the marker
                print(f"lifecycle: cannot write {run_dir / rundir.SHUTDOWN_MARKER} ({exc}); stopping the ranks "
                      f"without it", file=sys.stderr, flush=True)
        if len(self.codes) < len(self.procs):
            if stop is not None:
                print(f"lifecycle: {stop.name}: the ranks save and stop (up to {preempt_s:g}s, "
                      f"checkpoint.grace_s + teardown.deadline_s); {stop.name} again stops them at once", flush=True)
            # The ranks take SIGTERM as the preemption request whatever reached the launcher (SIGINT included).
            self._shutdown(signal.SIGTERM, grace_s if stop is None else preempt_s)
        if cause is not None:
            code = self.codes[cause]
            exit_code, how = (code if code >= 0 else 128 - code), _how(code)
            phase = (rundir.last_event(run_dir, cause) or {}).get("phase")
        else:
            ok = all(c == 0 for c in self.codes.values()) and len(self.trap.received) < 2
            last = self.trap.received[-1] if self.trap.received else None
            exit_code, how, phase = (0 if ok or last is None else 128 + last), None, None
        return LaunchResult(exit_code, cause, how, phase, dict(sorted(self.codes.items())),
                            time.monotonic() - start, stop.name if stop else None, tuple(self.killed),
                            aborted=len(self.trap.received) > 1)

    def _monitor(self, run_dir: Path) -> int | None:
        """Until every rank ended, one failed (returns it) or the launcher got a signal."""
        while len(self.codes) < len(self.procs) and not self.trap.received:
            failed = [r for r in self._reap(self.watch.wait(self.poll_s)) if self.codes[r] != 0]
            if failed:  # several in one wake-up: the earliest last event, then the lowest rank
                return min(failed, key=lambda r: ((rundir.last_event(run_dir, r) or {}).get("t", 1e99), r))
        return None

    def _reap(self, ranks: Iterable[int]) -> list[int]:
        ended = []
        for r in ranks:
            code = self.procs[r].poll() if r not in self.codes else None
            if code is not None:
                self.codes[r] = code
                self.watch.forget(r)
                ended.append(r)
        return ended

    def _alive(self) -> list[int]:
        return [r for r in self.procs if r not in self.codes]

    def _shutdown(self, sig: signal.Signals, grace_s: float) -> None:
        logger.warning("sending %s to ranks %s (SIGKILL after %.1fs)", sig.name, self._alive(), grace_s)
        for r in self._alive():
            _killpg(self.procs[r].pid, sig)
            _killpg(self.procs[r].pid, signal.SIGCONT)  # a stopped rank must run to see the signal
        deadline, signals_seen = time.monotonic() + grace_s, len(self.trap.received)
        while self._alive() and time.monotonic() < deadline:
            if len(self.trap.received) > signals_seen:
                break  # asked (again) while shutting down: do not wait out the grace
            self._reap(self.watch.wait(min(self.poll_s, max(deadline - time.monotonic(), 0.0))))
        self.killed = self._alive()
        self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL every live rank's process group, reap (bounded), sweep what ranks left behind."""
        for r in self._alive():
            _killpg(self.procs[r].pid, signal.SIGKILL)
        for r in self._alive():
            try:
                self.procs[r].wait(_REAP_S)
            except subprocess.TimeoutExpired:
                logger.error("rank %d (pid %d) survived SIGKILL (uninterruptible sleep?)", r, self.procs[r].pid)
            self._reap([r])
        for p in self.procs.values():  # grandchildren of ranks that ended on their own
            _killpg(p.pid, signal.SIGKILL)
        self.watch.close()


class _ExitWatch:
    """Wakes up as soon as a rank process ends (Linux pidfds); without pidfds, every ``timeout_s``."""

    def __init__(self, procs: dict[int, Any]) -> None:
        self._all = list(procs)
        self._fds: dict[int, int] = {}
        self._poller: Any = select.poll()
        try:
            for r, p in procs.items():
                self._fds[r] = os.pidfd_open(p.pid)
                self._poller.register(self._fds[r], select.POLLIN)
        except (AttributeError, OSError):  # not Linux >= 5.3
            self.close()
            self._poller = None

    def wait(self, timeout_s: float) -> list[int]:
        """Ranks that may have ended since the last call."""
        if self._poller is None:
            time.sleep(timeout_s)
            return self._all
        by_fd = {fd: r for r, fd in self._fds.items()}
        return [by_fd[fd] for fd, _ in self._poller.poll(timeout_s * 1000) if fd in by_fd]

    def forget(self, rank: int) -> None:
        fd = self._fds.pop(rank, None)
        if fd is not None:
            self._poller.unregister(fd)
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _rank_logs(log_dir: Path, logs: dict[int, Path], console: set[int]) -> Any:
    """Where rank output goes: the sh wrapper writes the files; torch tails the console ranks' files."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class RankLogs(LogsSpecs):
        @property
        def root_log_dir(self) -> str:
            return str(log_dir)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            errors = {r: str(rundir.error_file(log_dir.parent, r)) for r in envs}
            for r, path in errors.items():
                envs[r]["TORCHELASTIC_ERROR_FILE"] = path  # where @record writes a failing rank's traceback
            return LogsDest(stdouts=dict.fromkeys(envs, ""), stderrs=dict.fromkeys(envs, ""),
                            tee_stdouts={r: str(logs[r]) for r in envs if r in console},
                            error_files=errors)

    return RankLogs(log_dir=str(log_dir))


def _prepare(run_dir: Path, nproc: int) -> dict[int, Path]:
    """Make run_dir/logs and drop what a previous launch in the same run_dir left that would mislead."""
    (run_dir / rundir.LOGS_DIR).mkdir(parents=True, exist_ok=True)
    rundir.clear_marker(run_dir)
    for r in range(nproc):
        rundir.error_file(run_dir, r).unlink(missing_ok=True)
        # The shell's redirect opens the log by name: whatever a path there is (a link, a FIFO), it goes first.
        rundir.log_file(run_dir, r).unlink(missing_ok=True)
    return {r: rundir.log_file(run_dir, r) for r in range(nproc)}


def _host_store() -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, None, True, timedelta(minutes=5), wait_for_workers=False)


def _rank_env(rank: int, nproc: int, port: int, run_dir: Path, extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(extra or {})
    for name in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED"):
        if name not in env and name not in os.environ:
            env[name] = "1"
    return env | {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_USE_AGENT_STORE": "True",
        rundir.ENV_RUN_DIR: str(run_dir), ENV_LAUNCHER_PID: str(os.getpid()),
    }


def _how(code: int) -> str:
    return f"exit {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group is already gone
        pass
