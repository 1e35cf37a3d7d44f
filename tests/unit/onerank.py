"""Helpers for a one-rank run context in this process: real gloo (world 1, env:// on a free port), a model-parallel
backend that records what it is asked, the synthetic step kind. No processes are started."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lifecycle.context import RunContext
from lifecycle.distributed.faults import Drills
from lifecycle.obs.events import EventLog, read_events
from lifecycle.policy.load import validate
from tests._dist import free_port


class RecordingParallel:
    """A ParallelState: ``world`` and the names in ``present`` map to the default group."""

    def __init__(self, present: tuple[str, ...] = ("world", "dp")) -> None:
        self.present = present
        self.calls: list[str] = []
        self.initialized = False

    def load(self) -> None:
        self.calls.append("load")

    def initialize(self, par: Any, timeout_s: float) -> None:
        self.calls.append(f"initialize tp={par.tp} pp={par.pp} ep={par.ep} timeout={timeout_s:g}")
        self.initialized = True

    def is_initialized(self) -> bool:
        return self.initialized

    def get_group(self, name: str) -> Any:
        import torch.distributed as dist

        return dist.group.WORLD if name in self.present and dist.is_initialized() else None

    def destroy(self) -> None:
        self.calls.append("destroy")
        self.initialized = False


MakeCtx = Callable[..., RunContext]


def make_ctx_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeCtx]:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    made: list[RunContext] = []

    def make(policy: dict[str, Any] | None = None, *, parallel: Any = None) -> RunContext:
        data: dict[str, Any] = {
            "run": {"dir": str(tmp_path / "run"), "id": "unit"},
            "checkpoint": {"dir": str(tmp_path / "ckpt")},
            "train": {"kind": "synthetic", "steps": 3, "options": {"hidden": 8, "batch": 4}},
            "warmup": {"ops": ["barrier", "all_reduce"]},
            "watchdog": {"enabled": False, "deadlines": {"init": 20, "warmup": 10, "step": 10, "checkpoint": 20,
                                                         "teardown": 5}},
            "teardown": {"deadline_s": 10},
        }
        for key, value in (policy or {}).items():
            data[key] = {**data[key], **value} if isinstance(value, dict) and key in data else value
        p = validate(data)
        run_dir = Path(p.run.dir)
        ctx = RunContext.of(p, run_dir, 0, 1, 0, EventLog(run_dir, 0), Drills(p.faults, 0),
                            parallel or RecordingParallel())
        made.append(ctx)
        return ctx

    yield make
    import torch.distributed as dist

    for ctx in made:
        ctx.events.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def names(ctx: RunContext, kind: str = "begin") -> list[str]:
    """Names of this rank's events of ``kind`` so far (the log is flushed first)."""
    ctx.events.flush()
    return [e["name"] for e in read_events(ctx.run_dir)[0] if e["kind"] == kind]
