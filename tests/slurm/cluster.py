"""A one-node SLURM on this machine: munged, slurmctld and slurmd in a temporary state folder.

The distribution's packages (`slurmctld slurmd slurm-client munge`) are installed with apt-get when missing. Needs
root (the daemons run as root here). :class:`Slurm` is a context manager: it fails within ``UP_S`` when the node does
not come up idle, and always cancels its jobs, stops its daemons, kills what its jobs left and removes its folder,
even when the body fails. Used by tests/slurm.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
SBIN = "/usr/sbin:/sbin"
UP_S = 60.0
INSTALL_S = 100.0  # with the start and the first job inside that test's 180 s

# One node that oversubscribes this machine's cores (CPUs=32 whatever it has, config_overrides: every test job runs at
# once), no cgroups, no accounting. Finished jobs stay visible to scontrol for MinJobAge. OverTimeLimit=0: a time limit kills
# at --time. KillWait: the grace from srun's SIGTERM to SIGKILL at the time limit.
CONF = """\
ClusterName=lifecycle
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.socket
CredType=cred/munge
StateSaveLocation={dir}/ctld
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
JobRequeue=1
OverTimeLimit=0
KillWait=10
MinJobAge=600
MessageTimeout=20
SlurmdTimeout=300
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
GresTypes=lowa,lowb
NodeName={host} NodeAddr=127.0.0.1 CPUs=32 RealMemory=1000 Gres=lowa:1,lowb:1 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP PreemptMode=OFF
PartitionName=low Nodes={host} MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={grace}
PartitionName=high Nodes={host} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""
# Preemption (a real one): a job in partition `high` that asks for the generic resource a job in `low` holds (`lowa` or
# `lowb`, one of each on the node) takes it from that job, which SLURM signals and gives GRACE_S to end; jobs in `test`
# are never preempted. What SLURM signals at a preemption: the job's tasks (SIGTERM), or with the user-signal setting
# (its name by version: user_signal_setting) the batch shell, with the job's own --signal.
GRACE_S = 60


def _sbin_env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{os.environ.get('PATH', '')}:{SBIN}"}


def _missing() -> list[str]:
    path = _sbin_env()["PATH"]
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def why_not_available() -> str | None:
    """None when a SLURM can be started here (installing the packages when missing), else why not."""
    if os.geteuid() != 0:
        return "needs root (munged, slurmctld and slurmd run as root here)"
    if not _missing():
        return None
    if shutil.which("apt-get") is None:
        return f"SLURM is not installed ({', '.join(_missing())} missing) and there is no apt-get to install it"
    env = {**_sbin_env(), "DEBIAN_FRONTEND": "noninteractive"}
    deadline = time.monotonic() + INSTALL_S
    tail = ""
    for update in (False, True):  # the package lists may be stale or absent on a fresh machine
        try:
            if update:
                subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env,
                               timeout=max(1.0, deadline - time.monotonic()))
            proc = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
                                  capture_output=True, text=True, env=env,
                                  timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return f"apt-get install {' '.join(PACKAGES)} did not finish within {INSTALL_S:.0f}s"
        tail = (proc.stdout + proc.stderr).strip()[-300:]
        if proc.returncode == 0 and not _missing():
            return None
    return f"apt-get install {' '.join(PACKAGES)} failed: {tail}"


def user_signal_setting(version: str) -> str:
    """The slurm.conf line for "signal a preempted job with its --signal" in the SLURM whose ``slurmctld -V`` is
    ``version``: ``SlurmctldParameters=preempt_send_user_signal`` up to 22.05, ``PreemptParameters=send_user_signal``
    from 23.02 on."""
    found = re.search(r"(\d+)\.(\d+)", version)
    if found is None:
        raise RuntimeError(f"no SLURM version in {version!r}")
    newer = (int(found[1]), int(found[2])) >= (23, 2)
    return "PreemptParameters=send_user_signal" if newer else "SlurmctldParameters=preempt_send_user_signal"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Slurm:
    """One node (this machine, 32 CPUs whatever it has) in partition ``test`` (and ``low``, ``high`` for preemption); :meth:`env` for the client tools."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="lifecycle-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]

    def env(self, **extra: str) -> dict[str, str]:
        return {**_sbin_env(), "SLURM_CONF": str(self.conf), **extra}

    def __enter__(self) -> Slurm:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _daemon(self, *cmd: str) -> None:
        """Start a daemon that forks into the background (not a child of the test process once started)."""
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env(), timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd[0]} did not start (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")

    def _start(self) -> None:
        for sub in ("ctld", "spool"):
            (self.dir / sub).mkdir()
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.conf.write_text(CONF.format(host=self.host, dir=self.dir, ctld_port=_free_port(), d_port=_free_port(),
                                         grace=GRACE_S))
        d = self.dir
        self._daemon("munged", "--force", f"--socket={d}/munge.socket", f"--key-file={key}",
                     f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed")
        self._daemon("slurmctld", "-f", str(self.conf), "-i")
        self._daemon("slurmd", "-f", str(self.conf), "-N", self.host)
        deadline = time.monotonic() + UP_S
        state = ""
        while time.monotonic() < deadline:
            proc = self.tool("sinfo", "-h", "-N", "-p", "test", "-o", "%T", check=False)
            state = proc.stdout.strip() or proc.stderr.strip()
            if state == "idle":
                return
            if state.startswith(("inval", "drain")):
                break
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM node did not come up idle (within {UP_S:.0f}s) (sinfo: {state!r}); "
                           f"slurmctld.log: {self.log('slurmctld')[-800:]} slurmd.log: {self.log('slurmd')[-800:]}")

    def send_user_signal_at_preemption(self) -> str:
        """Turn on SLURM's setting that sends a preempted job its own ``--signal`` (to the batch shell with ``B:``)
        instead of SIGTERM to its tasks (``scontrol reconfigure``; running jobs are not disturbed); the line used."""
        line = user_signal_setting(self.tool("slurmctld", "-V").stdout)
        self.conf.write_text(self.conf.read_text() + line + "\n")
        self.tool("scontrol", "reconfigure")
        return line

    def log(self, daemon: str) -> str:
        path = self.dir / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def tool(self, *cmd: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env(), timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def sbatch(self, script: Path, *args: str, sbatch: tuple[str, ...] = (), env: dict[str, str],
               cwd: Path) -> int:
        proc = subprocess.run(["sbatch", "--parsable", *sbatch, str(script), *args], capture_output=True, text=True,
                              env={**self.env(), **env}, cwd=cwd, timeout=20)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch: exit {proc.returncode}: {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, BatchFlag, Reason, ...)."""
        out = self.tool("scontrol", "-o", "show", "job", str(job_id), check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill whatever a job left and remove the state folder (never raises)."""
        if self.conf.exists():
            try:
                self.tool("scancel", "--full", "--partition=test", check=False, timeout=10)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and self.tool("squeue", "-h", "-t", "R,CG", check=False,
                                                                timeout=10).stdout.strip():
                    time.sleep(0.5)
            except (OSError, subprocess.SubprocessError):
                pass
        _terminate([p for p in map(self._pid, ("slurmd", "slurmctld", "munged")) if p is not None])  # at once: ~2 s
        self._kill_leftovers()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _pid(self, daemon: str) -> psutil.Process | None:
        try:
            return psutil.Process(int((self.dir / f"{daemon}.pid").read_text().strip()))
        except (OSError, ValueError, psutil.Error):
            return None

    def _kill_leftovers(self) -> None:
        """Job steps and ranks that outlived their daemons: every process whose environment names this cluster."""
        mine = str(self.conf).encode()
        left = []
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and mine in Path(f"/proc/{proc.pid}/environ").read_bytes():
                    left.append(proc)
            except (OSError, psutil.Error):
                continue
        _terminate(left)


def _terminate(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
