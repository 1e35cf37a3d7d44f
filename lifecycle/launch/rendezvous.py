"""The rendezvous of a rank started by another launcher (srun, a script), checked before the rank makes any store client.

Without torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE=True``), rank 0 hosts the rendezvous store on
``MASTER_PORT`` inside ``init_process_group``. So before the rank starts: on rank 0 that port must be free (another
program listening there is a usage error, exit 2, not a lost side channel); every other rank waits for the store to
accept a connection, bounded by the init deadline, saying once for whom, where and how long it waits. torch's own
connect loop retries too, but each of its failures prints a C++ stack trace (hundreds of ``frame #`` lines), and
the watchdog's side channel would add its own.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import time

from lifecycle.errors import HangError, UsageError

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
RETRY_S = 0.5
CONNECT_TIMEOUT_S = 5.0


def check(rank: int, init_deadline_s: float, env: dict[str, str] | os._Environ[str] | None = None) -> None:
    """Rank 0: MASTER_PORT free on this host (UsageError). Other ranks: wait until rank 0's store accepts a connection
    at MASTER_ADDR:MASTER_PORT, at most ``init_deadline_s`` (HangError). Nothing under torchrun's agent store. The
    variables were checked by :func:`lifecycle.machine.preflight.check_rendezvous_env`."""
    env = os.environ if env is None else env
    if env.get(AGENT_STORE_ENV) == "True":
        return
    addr, port = env["MASTER_ADDR"].strip(), int(env["MASTER_PORT"].strip())
    if rank == 0:
        check_port_free(port)
    else:
        wait_for_store(rank, addr, port, init_deadline_s)


def check_port_free(port: int) -> None:
    """A UsageError naming the port when this host cannot listen on it (another program holds it)."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store: TIME_WAIT is no owner
                probe.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                why = "is taken by another program" if exc.errno == errno.EADDRINUSE else "needs privileges"
                raise UsageError(
                    f"MASTER_PORT={port} {why} on this host ({exc.strerror}): rank 0 hosts the rendezvous store there "
                    f"(RANK=0 without torchrun's agent store); give every rank of the job a free port "
                    f"(MASTER_PORT, the launcher's --master-port) or stop the program that holds it") from None
            # no IPv6 on this host (or no such address family): that family cannot conflict


def wait_for_store(rank: int, addr: str, port: int, deadline_s: float) -> None:
    """Return once ``addr:port`` accepts a TCP connection; a HangError after ``deadline_s`` (rank 0 never came)."""
    start = time.monotonic()
    said = False
    while True:
        left = deadline_s - (time.monotonic() - start)
        error = _connect(addr, port, min(max(left, 0.1), CONNECT_TIMEOUT_S))
        if error is None:
            return
        left = deadline_s - (time.monotonic() - start)
        if left <= 0:
            raise HangError(
                f"rank {rank} waited {deadline_s:g}s (watchdog.deadlines.init) for rank 0's rendezvous store at "
                f"{addr}:{port} (MASTER_ADDR:MASTER_PORT): {error}; start rank 0 of this job with the same "
                f"MASTER_ADDR/MASTER_PORT, check that MASTER_ADDR is rank 0's host and the port is open between the "
                f"hosts, or raise watchdog.deadlines.init", phase="init", rank=rank, deadline_s=deadline_s,
                missing=[0])
        if not said:
            print(f"lifecycle: rank {rank} waits up to {deadline_s:g}s (watchdog.deadlines.init) for rank 0's "
                  f"rendezvous store at {addr}:{port} (MASTER_ADDR:MASTER_PORT): {error} so far", file=sys.stderr,
                  flush=True)
            said = True
        time.sleep(min(RETRY_S, left))


def _connect(addr: str, port: int, timeout_s: float) -> str | None:
    """None when ``addr:port`` accepts a connection (closed at once), else why not."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return None
    except socket.gaierror as exc:
        return f"the host name does not resolve ({exc.strerror})"
    except TimeoutError:
        return f"no answer within {timeout_s:g}s"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()
