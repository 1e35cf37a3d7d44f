"""Suite-wide guards: env restored, no process group left behind, no leaked threads or children."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")


def session_helpers() -> list[Any]:
    """multiprocessing's resource tracker and the ranks' forkserver (tests/_dist.py): direct children of this process
    shared by the whole session, not leaks. A rank forked from the forkserver shares its command line but is the
    forkserver's child, so it is still counted."""
    import psutil

    return [c for c in psutil.Process().children() if any(
        k in " ".join(c.cmdline()) for k in ("resource_tracker", "forkserver"))]


@pytest.fixture(autouse=True)
def _clean_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    env = dict(os.environ)
    threads = set(threading.enumerate())
    yield
    os.environ.clear()
    os.environ.update(env)
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            pytest.fail("test left the default process group initialized")
    leaked = [t for t in set(threading.enumerate()) - threads
              if t.is_alive() and not t.daemon and t.name != "QueueFeederThread"]
    if leaked:
        pytest.fail(f"test leaked threads: {[t.name for t in leaked]}")
    try:
        import psutil

        helpers = session_helpers()
        children = [c for c in psutil.Process().children(recursive=True) if c.is_running()
                    and c.status() != psutil.STATUS_ZOMBIE and c not in helpers]
    except Exception:  # noqa: BLE001 - psutil races with exiting children
        children = []
    if children:
        for c in children:
            c.kill()
        pytest.fail(f"test leaked child processes: {[c.pid for c in children]}")


# `make test` runs the tests that start no ranks on both cores (pytest-xdist: -m "in_process"), then the rest one at a
# time: every test under tests/unit and tests/cli that is not marked `distributed` starts no process group of its own
# (a `lifecycle run` there is refused before any rank starts), so two of them never contend for deadlines.
IN_PROCESS_DIRS = ("unit", "cli")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).resolve().parent
    for item in items:
        try:
            top = Path(str(item.path)).resolve().relative_to(tests).parts[0]
        except ValueError:
            continue
        if top in IN_PROCESS_DIRS and item.get_closest_marker("distributed") is None:
            item.add_marker(pytest.mark.in_process)
