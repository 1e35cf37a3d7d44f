"""Property test of the checkpoint layer (the synthetic kind, world 1, real commit/prune/resume code):
random sequences of saves, crashes at each point of a save, damage from outside (truncated shard, lost
metadata, garbage tracker), resumes and prunes.

Invariants, checked after every operation of lifecycle's own (not after the damage the test does itself):
- the tracker names a complete checkpoint that exists (or there is no tracker and no committed checkpoint);
- a resume loads only what was committed, byte for byte (a shard changed in place, sizes intact, is refused by its
  digest and the next older checkpoint is loaded);
- nothing disappears without a trace: a folder that is gone was a complete checkpoint deleted by pruning,
  never the tracker's nor the one the run resumed from, with at least ``keep_last`` complete newer ones
  left; an incomplete or corrupt folder is only ever renamed aside.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from lifecycle.checkpoint import ckptdir
from lifecycle.context import RunContext
from lifecycle.distributed.faults import Drills
from lifecycle.errors import CheckpointError
from lifecycle.obs.events import EventLog
from lifecycle.phases import checkpoint
from lifecycle.policy.load import validate
from lifecycle.recovery.resume import resume
from tests.unit.onerank import RecordingParallel


class Crash(BaseException):
    """The process died here (raised from inside the code under test by a patched step)."""


class CheckpointMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="ckpt-prop-"))
        self.root = self.tmp / "ckpt"
        self.keep_last = 2
        self.resumed_from: int | None = None
        self.damaged = False
        self.ctx = self._ctx()
        self.before: dict[str, bool] = {}

    def _ctx(self) -> RunContext:
        import torch.distributed as dist

        from lifecycle.distributed.barrier import get_store

        policy = validate({
            "run": {"dir": str(self.tmp / "run"), "id": "prop"},
            "checkpoint": {"dir": str(self.root), "keep_last": self.keep_last, "on_corrupt": "fallback"},
            "train": {"kind": "synthetic", "steps": 1000, "options": {"hidden": 4, "batch": 2}},
        })
        ctx = RunContext.of(policy, self.tmp / "run", 0, 1, 0, EventLog(self.tmp / "run", 0), Drills([], 0),
                            RecordingParallel())
        assert dist.is_initialized()
        ctx.comms.store = get_store()
        ctx.step_handler = self._handler(ctx)
        return ctx

    def _handler(self, ctx: RunContext) -> Any:
        from lifecycle.backends.synthetic import SyntheticStep

        handler = SyntheticStep(ctx.policy.train.options)
        handler.setup(ctx)
        return handler

    def teardown(self) -> None:
        self.ctx.events.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- bookkeeping around lifecycle's own operations ------------------------------------------------
    def _snapshot(self) -> dict[str, bool]:
        if not self.root.is_dir():
            return {}
        return {p.name: ckptdir.problem(p) is None for p in self.root.iterdir()
                if p.is_dir() and ckptdir.step_of(p.name) is not None}

    def _own(self, op: Any, *, repairs: bool) -> None:
        """Run one of lifecycle's operations; a commit or a resume re-establishes the tracker, a prune does not
        (it must only never break it)."""
        before, tracked_before = self._snapshot(), ckptdir.read_tracker(self.root).name
        try:
            op()
        except Crash:
            repairs = False
        if repairs:
            self.damaged = False
        self._check_nothing_vanished(before, tracked_before)

    def _check_nothing_vanished(self, before: dict[str, bool], tracked_before: str | None) -> None:
        now = self._snapshot()
        aside = {p.name.split(".")[0] for p in self.root.iterdir()} if self.root.is_dir() else set()
        tracked = ckptdir.read_tracker(self.root).name
        complete_now = sorted(n for n, ok in now.items() if ok)
        for name, was_complete in before.items():
            if name in now or name in aside:
                continue
            assert was_complete, f"{name} was incomplete and was deleted instead of set aside"
            assert name not in (tracked_before, tracked), f"{name} (the tracker's) was deleted"
            if self.resumed_from is not None:
                assert name != ckptdir.iter_name(self.resumed_from), "the resumed-from checkpoint was deleted"
            newer = [n for n in complete_now if n > name]
            assert len(newer) >= self.keep_last, f"{name} pruned with only {newer} newer"

    # ---- lifecycle's operations -------------------------------------------------------------------------
    @rule(steps=st.integers(1, 3))
    def save(self, steps: int) -> None:
        self.ctx.progress.step += steps
        self._own(lambda: checkpoint.save(self.ctx, "periodic"), repairs=True)

    @rule(steps=st.integers(1, 3), where=st.sampled_from(["write", "finalize", "rename", "tracker", "prune"]))
    def crash_mid_save(self, steps: int, where: str) -> None:
        self.ctx.progress.step += steps
        targets = {"write": (type(self.ctx.step_handler), "begin_save"), "finalize": (ckptdir, "write_manifest"),
                   "rename": (os, "replace"), "tracker": (ckptdir, "write_tracker"), "prune": (ckptdir, "prune")}
        owner, attr = targets[where]
        original = getattr(owner, attr)

        def crash(*args: Any, **kwargs: Any) -> Any:
            if where == "rename" and not str(args[0]).endswith(".tmp"):
                return original(*args, **kwargs)  # only the commit's rename of the .tmp folder
            raise Crash(where)

        setattr(owner, attr, crash)
        try:
            self._own(lambda: checkpoint.save(self.ctx, "periodic"), repairs=True)
        finally:
            setattr(owner, attr, original)
        self.ctx.progress.pending_save = None  # the process is gone: a restart begins with a resume
        self.resume()

    @rule()
    def resume(self) -> None:
        self.ctx.progress.step, self.ctx.progress.resumed_from = 0, None
        self.ctx.step_handler = self._handler(self.ctx)

        def op() -> None:
            resume(self.ctx)

        try:
            self._own(op, repairs=True)
        except CheckpointError:
            raise AssertionError("resume with on_corrupt=fallback raised") from None
        self.resumed_from = self.ctx.progress.resumed_from
        if self.resumed_from is not None:  # what a resume loads is what was committed, byte for byte
            folder = self.root / ckptdir.iter_name(self.resumed_from)
            assert ckptdir.changed(folder, 0, 1) is None
            saved = torch.load(folder / "rank_0.pt", weights_only=True)
            assert saved["step"] == self.ctx.step == self.resumed_from  # the step the folder is named for
            assert ckptdir.read_tracker(self.root).name == folder.name  # ... and the folder the tracker names
            self._same_weights(saved["model"])
        else:  # nothing loaded: the weights the run starts with, whatever a rejected load did to them
            assert self.ctx.step == 0
            self._same_weights(self._handler(self.ctx).model.state_dict())

    def _same_weights(self, expected: dict[str, Any]) -> None:
        model = self.ctx.step_handler.model.state_dict()  # type: ignore[union-attr]
        assert model.keys() == expected.keys()
        assert all(torch.equal(model[k], expected[k]) for k in model)

    @rule()
    def prune(self) -> None:
        protect = {ckptdir.iter_name(self.resumed_from)} if self.resumed_from is not None else set()
        self._own(lambda: ckptdir.prune(self.root, self.keep_last, protect), repairs=False)

    # ---- damage from outside ----------------------------------------------------------------------------
    def _complete(self) -> list[Path]:
        return [p for p in ckptdir.committed(self.root) if ckptdir.problem(p) is None]

    @precondition(lambda self: bool(self._complete()))
    @rule(data=st.data())
    def truncate_shard(self, data: st.DataObject) -> None:
        folder = data.draw(st.sampled_from(self._complete()))
        shard = folder / "rank_0.pt"
        shard.write_bytes(shard.read_bytes()[: max(shard.stat().st_size // 2, 1)])
        self.damaged = True

    @precondition(lambda self: bool(self._complete()))
    @rule(data=st.data(), flip=st.integers(0, 1 << 16))
    def overwrite_shard_same_size(self, data: st.DataObject, flip: int) -> None:
        """Content changed, sizes intact: only the digests recorded at commit can tell."""
        shard = data.draw(st.sampled_from(self._complete())) / "rank_0.pt"
        raw = bytearray(shard.read_bytes())
        raw[flip % len(raw)] ^= 0xFF
        shard.write_bytes(bytes(raw))
        self.damaged = True

    @precondition(lambda self: bool(self._complete()))
    @rule(data=st.data())
    def delete_metadata(self, data: st.DataObject) -> None:
        (data.draw(st.sampled_from(self._complete())) / "metadata.json").unlink()
        self.damaged = True

    @precondition(lambda self: len(self._complete()) >= 2)
    @rule(data=st.data(), manifest=st.booleans(), into_tracked=st.booleans())
    def copy_another_steps_files(self, data: st.DataObject, manifest: bool, into_tracked: bool) -> None:
        """A folder that holds another save's files (with or without that save's manifest): named for one step,
        holding another; often the one the tracker names."""
        complete = self._complete()
        tracked = ckptdir.read_tracker(self.root).name
        target = next((p for p in complete if p.name == tracked), None) if into_tracked else None
        target = target or data.draw(st.sampled_from(complete))
        source = data.draw(st.sampled_from([p for p in complete if p != target]))
        for f in source.iterdir():
            if manifest or f.name != ckptdir.MANIFEST:
                shutil.copyfile(f, target / f.name)
        self.damaged = True

    @precondition(lambda self: self.root.is_dir())
    @rule(garbage=st.binary(max_size=64))
    def garbage_tracker(self, garbage: bytes) -> None:
        (self.root / ckptdir.TRACKER).write_bytes(garbage)
        self.damaged = True

    @invariant()
    def tracker_names_a_complete_checkpoint(self) -> None:
        if self.damaged or not self.root.is_dir():
            return
        tracker = ckptdir.read_tracker(self.root)
        if tracker.name is None:
            assert tracker.error is None, tracker.error
            return
        assert ckptdir.problem(self.root / tracker.name) is None, (tracker.name, ckptdir.problem(
            self.root / tracker.name))


@pytest.mark.timeout(170)
def test_no_sequence_of_saves_crashes_damage_and_resumes_loses_a_committed_checkpoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime

    import torch.distributed as dist

    from tests._dist import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        run_state_machine_as_test(CheckpointMachine, settings=settings(
            max_examples=150, stateful_step_count=15, deadline=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    finally:
        dist.destroy_process_group()
