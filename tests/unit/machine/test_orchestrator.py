"""The orchestrator on a one-rank context in this process: phase order from the graph, the failure edge,
exit codes."""

from __future__ import annotations

import io
import os
import signal
from typing import Any

import pytest
import torch.distributed as dist

from lifecycle.machine import graph
from lifecycle.machine.orchestrator import Orchestrator
from lifecycle.obs.events import read_events
from tests.unit.onerank import MakeCtx

pytestmark = pytest.mark.timeout(60)


def _phases(ctx) -> list[tuple[str, bool]]:  # type: ignore[no-untyped-def]
    return [(e["name"].split(":", 1)[1], bool(e.get("failure"))) for e in read_events(ctx.run_dir)[0]
            if e["kind"] == "begin" and e["name"].startswith("phase:")]


def _exit(ctx) -> dict:  # type: ignore[no-untyped-def, type-arg]
    return [e for e in read_events(ctx.run_dir)[0] if e["name"] == "exit"][-1]


def test_a_clean_run_follows_the_main_path_with_the_checkpoint_loop(make_ctx: MakeCtx) -> None:
    ctx = make_ctx({"train": {"steps": 2}, "checkpoint": {"every_steps": 1, "at_end": False}})
    assert Orchestrator(ctx).run() == 0
    assert not dist.is_initialized()
    got = [p for p, _ in _phases(ctx)]
    assert got == ["init", "warmup", "train", "checkpoint", "train", "checkpoint", "train", "teardown"]
    assert list(dict.fromkeys(p for p in got if p != "checkpoint")) == list(graph.MAIN_PATH)
    assert _exit(ctx)["exit_code"] == 0 and _exit(ctx)["step"] == 2


def test_a_disabled_phase_is_skipped(make_ctx: MakeCtx) -> None:
    ctx = make_ctx({"warmup": {"enabled": False}, "train": {"steps": 0}})
    assert Orchestrator(ctx).run() == 0
    assert [p for p, _ in _phases(ctx)] == ["init", "train", "teardown"]


def test_a_raise_takes_the_failure_edge_with_the_rank_failed_code(make_ctx: MakeCtx) -> None:
    ctx = make_ctx({"faults": [{"at": "warmup", "ranks": [0], "action": "raise"}]})
    orchestrator = Orchestrator(ctx)
    assert orchestrator.run() == 4
    assert _phases(ctx) == [("init", False), ("warmup", False), ("teardown", True)]
    assert not dist.is_initialized()
    assert type(orchestrator.error).__name__ == "DrillError"
    failure = [e for e in read_events(ctx.run_dir)[0] if e["name"] == "failure"][0]
    assert failure["phase"] == "warmup" and failure["exit_code"] == 4


def test_a_policy_the_world_cannot_run_exits_2(make_ctx: MakeCtx) -> None:
    ctx = make_ctx({"parallelism": {"tp": 2}, "train": {"kind": "megatron_gpt", "steps": 1, "options": {}}})
    assert Orchestrator(ctx).run() == 2
    assert _phases(ctx) == [("init", False), ("teardown", True)]


def test_a_failing_teardown_step_ends_in_the_failure_path(make_ctx: MakeCtx) -> None:
    ctx = make_ctx({"train": {"steps": 0}, "faults": [{"at": "teardown", "ranks": [0], "action": "raise",
                                                       "op": "destroy_subgroups"}]})
    assert Orchestrator(ctx).run() == 4
    assert not dist.is_initialized()
    assert _exit(ctx)["exit_code"] == 4


def test_every_main_path_phase_has_a_handler(make_ctx: MakeCtx) -> None:
    orchestrator = Orchestrator(make_ctx())
    assert set(graph.MAIN_PATH) <= set(orchestrator.handlers)
    assert all(orchestrator.handlers[p].phase == p for p in graph.MAIN_PATH)


class _SignalledFile(io.BytesIO):
    """A file whose 3rd write is interrupted by a real SIGTERM to this process (the handler runs inside the write,
    called back from torch.save's C++ writer)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: Any) -> int:
        self.writes += 1
        if self.writes == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to this main thread before kill() returns
        return super().write(data)


def test_the_launchers_sigterm_inside_a_torch_save_is_a_shutdown_not_a_failure_of_this_rank(
        make_ctx: MakeCtx) -> None:
    """The launcher marked the job as going down (another rank failed) and sends SIGTERM while this rank writes a
    checkpoint shard: the handler's Shutdown comes out of torch's C++ writer as a RuntimeError ("unexpected pos").
    That must still be the launcher's shutdown, or this rank is blamed for the failure of another."""
    import torch

    from lifecycle.errors import Shutdown
    from lifecycle.machine.session import install_signals
    from lifecycle.rundir import write_marker

    ctx = make_ctx({"train": {"steps": 2}})
    orchestrator = Orchestrator(ctx)
    seen: list[BaseException] = []

    def save_in_train(_ctx, _before, phase, _failure) -> None:  # type: ignore[no-untyped-def]
        if phase == "train":
            write_marker(ctx.run_dir, "rank 1 failed", rank=1)
            try:
                torch.save({"w": torch.ones(64)}, _SignalledFile())
            except BaseException as exc:
                seen.append(exc)
                raise

    ctx.phase_hooks.append(save_in_train)
    restore = install_signals(ctx, orchestrator)
    try:
        code = orchestrator.run()
    finally:
        restore()
    assert seen and not isinstance(seen[0], Shutdown), "torch.save no longer masks the Shutdown: simplify _unmasked"
    assert isinstance(orchestrator.error, Shutdown), orchestrator.error
    assert "SIGTERM from the launcher" in str(orchestrator.error)
    assert code == orchestrator.exit_code(orchestrator.error)
    failure = [e for e in read_events(ctx.run_dir)[0] if e["name"] == "failure"][0]
    assert failure["error"] == "Shutdown", failure


def test_the_launchers_sigterm_as_the_failure_path_begins_does_not_escape_it(
        make_ctx: MakeCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer's failure breaks this rank's collective; the launcher's SIGTERM (its marker written) lands while the
    error is being explained, before ``fail`` runs: the handler must not raise then (the rank would exit 1 with a
    traceback and no exit event, seen in the fault matrix's warmup-crash cell)."""
    from lifecycle.machine.session import install_signals
    from lifecycle.rundir import write_marker

    ctx = make_ctx({"faults": [{"at": "warmup", "ranks": [0], "action": "raise"}]})
    orchestrator = Orchestrator(ctx)
    storage = orchestrator._storage

    def signalled(exc: BaseException) -> BaseException:
        write_marker(ctx.run_dir, "rank 1 failed", rank=1)
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before kill() returns
        return storage(exc)

    monkeypatch.setattr(orchestrator, "_storage", signalled)
    restore = install_signals(ctx, orchestrator)
    try:
        code = orchestrator.run()
    finally:
        restore()
    assert code == 4 and type(orchestrator.error).__name__ == "DrillError"
    assert _exit(ctx)["exit_code"] == 4
