"""Give up gloo's collectives in place: shut down this process's connections to its peers.

Gloo cannot abort a collective (``_abort_process_group`` leaves it blocked), and destroying a process group does not
close its connections while anything still refers to it (a pending work, a traceback's frames, a module). A rank that
restarts in place (``restart.mode: in_process``) therefore shuts down (``shutdown(SHUT_RDWR)``) every TCP
connection of its process except the store's: each collective of this rank, and each peer's that waits on it, fails
at once with "Connection closed by peer", so every rank leaves its phase and the old process groups can go. The
new process groups open new connections. Only lifecycle's own ranks restart in place (never a trainer's own loop
under ``lifecycle.attach``), whose connections are the store's and the process groups'.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def store_port() -> int | None:
    """The rendezvous store's port (``MASTER_PORT``): its connections are kept (the ranks agree there)."""
    port = os.environ.get("MASTER_PORT", "")
    return int(port) if port.isdigit() else None


def cut_connections(keep_port: int | None) -> int:
    """Shut down every established TCP connection of this process whose local or remote port is not ``keep_port``;
    the number shut down. The descriptors stay open (their owners close them)."""
    import psutil

    cut = 0
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError) as exc:
        log.warning("cannot list this process's connections (%s): its collectives are not given up", exc)
        return 0
    for c in conns:
        if c.fd < 0 or not c.raddr or c.status != psutil.CONN_ESTABLISHED:
            continue
        if keep_port is not None and keep_port in (c.laddr.port, c.raddr.port):
            continue
        try:
            sock = socket.socket(fileno=os.dup(c.fd))
        except OSError:
            continue  # closed meanwhile
        try:
            sock.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass
        finally:
            sock.close()  # the duplicate only: the connection's own descriptor stays with its owner
    return cut
