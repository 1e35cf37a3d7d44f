"""Every phase on a one-rank context in this process (real gloo, world 1): milliseconds, no processes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lifecycle import rundir
from lifecycle.context import RunContext
from lifecycle.errors import CheckpointError, PhaseError, PolicyError
from lifecycle.obs.events import read_events
from lifecycle.phases import checkpoint, train
from lifecycle.phases.init import InitPhase
from lifecycle.phases.teardown import HardDeadline, TeardownPhase
from lifecycle.phases.train import TrainPhase, agree_stop, auto_cadence
from lifecycle.phases.warmup import WarmupPhase
from lifecycle.recovery.resume import resume
from tests.unit.onerank import MakeCtx, RecordingParallel, names

pytestmark = pytest.mark.timeout(60)


def _init(ctx: RunContext) -> RunContext:
    InitPhase().run(ctx)
    return ctx


def test_init_creates_the_group_the_store_and_the_layout_and_checks_the_policy(make_ctx: MakeCtx) -> None:
    ctx = _init(make_ctx())
    assert dist.is_initialized() and dist.get_world_size() == 1 and ctx.comms.store is not None
    assert isinstance(ctx.parallel, RecordingParallel)
    # the groups' timeout outlasts every watchdog deadline (20 s here) plus the time to report: the watchdog names
    # the culprit before torch's own timeout
    assert ctx.parallel.calls == ["load", "initialize tp=1 pp=1 ep=1 timeout=54"]
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert backend.options._timeout.total_seconds() == 54 and not ctx.comms.adopted_world
    assert ctx.ops.snapshot()[0]["world"] == 1  # the policy-hash all_gather
    assert names(ctx) == ["import:backend", "init_process_group", "initialize_model_parallel", "check_policy_hash"]


def test_init_refuses_a_layout_the_world_cannot_hold_before_any_group_exists(make_ctx: MakeCtx) -> None:
    ctx = make_ctx({"parallelism": {"tp": 2}, "train": {"kind": "megatron_gpt", "options": {}}})
    with pytest.raises(PolicyError, match="world size 1 is not divisible by tp"):
        InitPhase().run(ctx)
    assert not dist.is_initialized()


def test_init_runs_the_after_init_barrier_on_the_store(make_ctx: MakeCtx) -> None:
    ctx = _init(make_ctx({"barriers": {"after_init": [{"group": "world"}, {"group": "tp"}]}}))
    assert "barrier:after_init" in names(ctx)
    assert ctx.ops.snapshot()[1] == 2  # the skipped group (no tp here) still takes its key: keys stay aligned


def test_warmup_issues_every_op_on_every_group_once(make_ctx: MakeCtx) -> None:
    ops = ["barrier", "all_reduce", "all_gather", "all_to_all", "p2p"]
    ctx = _init(make_ctx({"warmup": {"ops": ops, "sizes": ["tiny"]}}))
    WarmupPhase().run(ctx)
    assert [g.label for g in ctx.comms.groups] == ["world=dp"]  # one communicator, every name it answers to
    assert ctx.ops.snapshot()[0]["world=dp"] == len(ops)
    assert [n for n in names(ctx) if n.startswith("warm:")] == [f"warm:{op}" for op in ops]
    assert set(ctx.progress.warmup_s) == {"world=dp"} and ctx.progress.warmup_s["world=dp"] >= 0


def test_warmup_sends_the_job_sized_messages_after_the_tiny_ops(make_ctx: MakeCtx) -> None:
    ctx = _init(make_ctx({"warmup": {"ops": ["barrier", "all_reduce"]}}))  # sizes [tiny, job]: the default
    WarmupPhase().run(ctx)
    ctx.events.flush()
    warm = [e for e in read_events(ctx.run_dir)[0] if e["name"].startswith("warm:") and e["kind"] == "begin"]
    hidden = ctx.policy.train.options.hidden
    assert [(e["name"], e.get("bytes")) for e in warm] == [
        ("warm:barrier", None), ("warm:all_reduce", None), ("warm:all_reduce", (hidden * hidden + 2 * hidden + 1) * 4)]
    assert ctx.ops.snapshot()[0]["world=dp"] == 3


def test_warmup_records_what_each_group_cost_and_stops_at_the_one_past_the_budget(make_ctx: MakeCtx) -> None:
    ctx = _init(make_ctx())
    WarmupPhase().run(ctx)
    ctx.events.flush()
    mem = [e for e in read_events(ctx.run_dir)[0] if e["name"] == "comm_memory"]
    assert len(mem) == 1 and mem[0]["source"] == "rss" and set(mem[0]["groups"]) == {"world=dp"}
    assert mem[0]["groups"]["world=dp"]["measured_bytes"] >= 0 and mem[0]["total_bytes"] >= 0
    assert mem[0]["groups"]["world=dp"]["estimate_bytes"] == 0  # one rank: no peer, no buffers
    # a group that takes more than the budget (a drill holds 64 MiB in its warm op) fails warmup, named
    held = make_ctx({"distributed": {"comm_memory_budget_gib": 0.03},
                     "faults": [{"at": "warmup", "ranks": [0], "action": "hold_memory", "mib": 64, "group": "world"}]})
    with pytest.raises(PhaseError, match=r"warming group world=dp took this rank's communicator memory to 6\d\.\d MiB"):
        WarmupPhase().run(_init(held))


def test_warmup_fails_on_a_required_group_the_layout_lacks(make_ctx: MakeCtx) -> None:
    ctx = _init(make_ctx({"warmup": {"required": ["tp"]}}))
    with pytest.raises(PhaseError, match="required group 'tp' does not exist"):
        WarmupPhase().run(ctx)


def test_warmup_is_disabled_by_the_policy(make_ctx: MakeCtx) -> None:
    assert not WarmupPhase().enabled(make_ctx({"warmup": {"enabled": False}}))


def test_train_runs_the_steps_and_saves_at_the_end(make_ctx: MakeCtx) -> None:
    ctx = _init(make_ctx({"train": {"steps": 4}}))
    saves: list[tuple[int, str]] = []
    TrainPhase(lambda c, reason: saves.append((c.step, reason))).run(ctx)
    assert ctx.step == 4 and saves == [(4, "end")]
    ctx.events.flush()
    assert names(ctx).count("step") == 4
    assert ctx.step_handler is not None


def test_train_saves_every_n_steps_and_not_twice_at_the_end(make_ctx: MakeCtx) -> None:
    ctx = _init(make_ctx({"train": {"steps": 4}, "checkpoint": {"every_steps": 2}}))
    saves: list[tuple[int, str]] = []
    TrainPhase(lambda c, reason: saves.append((c.step, reason))).run(ctx)
    assert saves == [(2, "periodic"), (4, "periodic")]


def test_a_signal_before_training_stops_without_building_a_model(make_ctx: MakeCtx) -> None:
    ctx = _init(make_ctx())
    ctx.progress.stop.preempt_signal = "SIGTERM"
    assert agree_stop(ctx) is True
    TrainPhase(lambda c, r: None).run(ctx)
    assert ctx.step_handler is None and ctx.step == 0


@pytest.mark.parametrize(("overlap", "stop"), [(True, 4), (False, 3)])
def test_a_signal_mid_training_saves_and_stops_at_the_step_boundary(make_ctx: MakeCtx, overlap: bool,
                                                                     stop: int) -> None:
    """Overlapped, the flag issued after step 3 is read after step 4; otherwise after step 3 itself."""
    ctx = _init(make_ctx({"train": {"steps": 10}, "checkpoint": {"signal_overlap": overlap}}))
    saves: list[tuple[int, str]] = []
    phase = TrainPhase(lambda c, reason: saves.append((c.step, reason)))
    phase._build = _signal_after(phase._build, 3)  # type: ignore[method-assign]
    phase.run(ctx)
    assert ctx.progress.stop.stop_step == stop and saves == [(stop, "preemption")]
    ctx.events.flush()
    flags = [e for e in read_events(ctx.run_dir)[0] if e["name"] == "stop_flag" and e["kind"] == "end"]
    assert [e.get("step") for e in flags] == [None, *range(1, stop + 1)] if not overlap else \
        [None, *range(2, stop + 1)]  # before the first step; then after each step (overlapped: one later)
    assert [bool(e.get("overlapped")) for e in flags[1:]] == [overlap] * (len(flags) - 1)


def test_the_auto_cadence_spaces_the_agreements_by_the_slowest_step_time() -> None:
    assert auto_cadence(0.0) == 1  # not known yet: every step
    assert [auto_cadence(s) for s in (0.05, 0.1, 0.3, 0.5, 2.0)] == [10, 5, 1, 1, 1]
    assert auto_cadence(1e-4) == train.SIGNAL_CHECK_MAX


@pytest.mark.parametrize(("signal_after", "stop"), [(None, None), (60, 103)])
def test_an_auto_cadence_agrees_every_step_until_a_step_time_is_known_then_every_n(
        make_ctx: MakeCtx, monkeypatch: pytest.MonkeyPatch, signal_after: int | None, stop: int | None) -> None:
    """Overlapped: issued after step 1 (no step time yet: n = 1), read after 2 with the period of step 2 proposed
    at once, read after 3; from then on every SIGNAL_CHECK_MAX steps (a target of 1000 s: the cap) — a signal
    waits for the next agreement."""
    monkeypatch.setattr(train, "SIGNAL_CHECK_S", 1000.0)
    ctx = _init(make_ctx({"train": {"steps": 120}, "checkpoint": {"signal_check_every": "auto"}}))
    saves: list[tuple[int, str]] = []
    phase = TrainPhase(lambda c, reason: saves.append((c.step, reason)))
    if signal_after is not None:
        phase._build = _signal_after(phase._build, signal_after)  # type: ignore[method-assign]
    phase.run(ctx)
    ctx.events.flush()
    flags = [e.get("step") for e in read_events(ctx.run_dir)[0] if e["name"] == "stop_flag" and e["kind"] == "end"]
    if stop is None:
        assert flags == [None, 2, 3, 53, 103] and ctx.step == 120 and saves == [(120, "end")]
    else:
        assert flags == [None, 2, 3, 53, 103] and ctx.progress.stop.stop_step == stop and saves == [(stop, "preemption")]


def test_a_signal_at_a_save_step_is_agreed_at_once_and_saves_once(make_ctx: MakeCtx) -> None:
    ctx = _init(make_ctx({"train": {"steps": 10}, "checkpoint": {"every_steps": 4}}))
    saves: list[tuple[int, str]] = []
    phase = TrainPhase(lambda c, reason: saves.append((c.step, reason)))
    phase._build = _signal_after(phase._build, 4)  # type: ignore[method-assign]
    phase.run(ctx)
    assert ctx.progress.stop.stop_step == 4 and saves == [(4, "periodic")]


def _signal_after(build, n):  # type: ignore[no-untyped-def]
    def wrapped(ctx: RunContext):  # type: ignore[no-untyped-def]
        handler = build(ctx)
        step = handler.step

        def counting(c: RunContext, i: int) -> dict[str, float]:
            if i == n:
                c.progress.stop.preempt_signal = "SIGTERM"
            return step(c, i)

        handler.step = counting
        return handler
    return wrapped


def test_checkpoint_commits_in_two_phases_and_resumes(make_ctx: MakeCtx, tmp_path: Path) -> None:
    ctx = _init(make_ctx({"train": {"steps": 2}}))
    TrainPhase(checkpoint.save).run(ctx)
    root = tmp_path / "ckpt"
    assert (root / "latest").read_text().strip() == "iter_0000002"
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "latest", "latest_checkpointed_iteration.txt"]
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert ctx.progress.saved == [str(root / "iter_0000002")] and ctx.progress.pending_save is None
    done = names(ctx)
    assert done.index("barrier:ckpt_prepare") < done.index("save") < done.index("commit") < \
        done.index("barrier:ckpt_committed")
    fresh = TrainPhase(checkpoint.save)
    ctx.progress.step, ctx.step_handler = 0, fresh._build(ctx)
    ctx.step_handler.setup(ctx)
    resume(ctx)
    assert ctx.step == 2 and ctx.progress.resumed_from == 2


def test_pruning_never_deletes_through_a_link_nor_fails_the_commit_it_follows(make_ctx: MakeCtx, tmp_path: Path) -> None:
    ctx = _init(make_ctx({"train": {"steps": 3}, "checkpoint": {"keep_last": 1}}))
    run = TrainPhase(checkpoint.save)
    ctx.step_handler = run._build(ctx)
    ctx.step_handler.setup(ctx)
    root, outside = tmp_path / "ckpt", tmp_path / "elsewhere"
    ctx.progress.step = 1
    checkpoint.save(ctx, "periodic")
    (root / "iter_0000001").rename(outside)  # an older checkpoint kept elsewhere, linked into the folder
    (root / "iter_0000001").symlink_to(outside, target_is_directory=True)
    for step in (2, 3):
        ctx.progress.step = step
        checkpoint.save(ctx, "periodic")
    assert (root / "latest").read_text().strip() == "iter_0000003" and ctx.progress.saved[-1] == str(root / "iter_0000003")
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("iter")) == ["iter_0000001", "iter_0000003"]
    assert (outside / "rank_0.pt").is_file() and (root / "iter_0000001").is_symlink()


def _saved_at(ctx: RunContext, *steps: int) -> Path:
    ctx.step_handler = TrainPhase(checkpoint.save)._build(ctx)
    ctx.step_handler.setup(ctx)
    for step in steps:
        ctx.progress.step = step
        checkpoint.save(ctx, "periodic")
    return Path(ctx.policy.checkpoint.dir)


def _fresh(ctx: RunContext) -> None:
    ctx.progress.step, ctx.progress.resumed_from = 0, None
    ctx.step_handler = TrainPhase(checkpoint.save)._build(ctx)
    ctx.step_handler.setup(ctx)


def _bound(folder: Path, **layout: object) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["layout"].update(layout)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_of_another_layout_is_resharded_or_refused_never_set_aside(make_ctx: MakeCtx,
                                                                               capsys: pytest.CaptureFixture[str]) -> None:
    ctx = _init(make_ctx({"checkpoint": {"on_corrupt": "fallback"}}))
    root = _saved_at(ctx, 2)
    folder = root / "iter_0000002"
    bound = json.loads((folder / "manifest.json").read_text())
    assert (bound["format"], bound["step"], bound["layout"]["world_size"], bound["layout"]["kind"]) == \
        (3, 2, 1, "synthetic")
    _bound(folder, world_size=2, dp=2)  # written by two ranks: the synthetic kind's replicas load at any world
    _fresh(ctx)
    resume(ctx)
    assert ctx.step == 2 and "resuming iter_0000002 resharded: world_size 2 -> 1, dp 2 -> 1" in capsys.readouterr().out
    _bound(folder, kind="own_loop")  # a trainer's own model's state: not this kind's
    _fresh(ctx)
    with pytest.raises(CheckpointError, match=r"it holds the state of train.kind own_loop, not synthetic\. A change "
                                              r"of layout or model is not damage: nothing was set aside"):
        resume(ctx)
    assert ctx.step == 0 and folder.is_dir() and (root / "latest").read_text().strip() == folder.name


def test_a_load_rejected_after_it_ran_leaves_every_rank_on_the_fresh_state(make_ctx: MakeCtx) -> None:
    import torch

    ctx = _init(make_ctx({"checkpoint": {"on_corrupt": "fallback", "verify": "size", "keep_last": 0}}))
    root = _saved_at(ctx, 2, 3)
    shutil.copyfile(root / "iter_0000002" / "rank_0.pt", root / "iter_0000003" / "rank_0.pt")  # same size
    shutil.rmtree(root / "iter_0000002")
    _fresh(ctx)
    initial = {k: v.clone() for k, v in ctx.step_handler.model.state_dict().items()}  # type: ignore[union-attr]
    resume(ctx)  # step 3 loads step 2's weights, is rejected, and nothing older is left
    assert ctx.step == 0 and ctx.progress.resumed_from is None
    now = ctx.step_handler.model.state_dict()  # type: ignore[union-attr]
    assert all(torch.equal(now[k], initial[k]) for k in initial)
    assert [p.name.split(".")[0] for p in root.iterdir() if p.name.startswith("iter")] == ["iter_0000003"]
    assert ".corrupt-" in next(p.name for p in root.iterdir() if p.name.startswith("iter"))


def test_async_checkpoint_commits_at_the_next_boundary(make_ctx: MakeCtx, tmp_path: Path) -> None:
    ctx = _init(make_ctx({"train": {"steps": 3}, "checkpoint": {"every_steps": 2, "async": True}}))
    calls: list[str] = []

    def save(c: RunContext, reason: str) -> None:
        calls.append(f"{reason}@{c.step}")
        checkpoint.save(c, reason)

    TrainPhase(save).run(ctx)
    # step 2's save was committed at step 3's boundary, the last one at the end of train: both through the
    # checkpoint phase (its deadline), not inside a step or teardown
    assert calls == ["periodic@2", "async_commit@3", "end@3", "async_commit@3"]
    assert [Path(p).name for p in ctx.progress.saved] == ["iter_0000002", "iter_0000003"] and ctx.progress.pending_save is None
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000003"


def test_a_rank_of_a_replaced_attempt_never_commits(make_ctx: MakeCtx, tmp_path: Path) -> None:
    ctx = _init(make_ctx({"train": {"steps": 4}, "checkpoint": {"every_steps": 2}}))
    run = TrainPhase(checkpoint.save)
    ctx.step_handler = run._build(ctx)
    ctx.step_handler.setup(ctx)
    ctx.progress.step = 2
    checkpoint.save(ctx, "periodic")
    root = tmp_path / "ckpt"
    assert (root / "latest").read_text().strip() == "iter_0000002"
    # A requeued job started attempt 2 in this run directory while this rank (attempt 1) still runs.
    (ctx.run_dir / rundir.ATTEMPT).write_text("2\n")
    ctx.progress.step = 4
    with pytest.raises(PhaseError, match="attempt 2 of this run has started .* belongs to attempt 1 and stops "
                                         "without committing"):
        checkpoint.save(ctx, "periodic")
    assert (root / "latest").read_text().strip() == "iter_0000002" and not (root / "iter_0000004").exists()
    assert rundir.newer_attempt(ctx.run_dir, 2) is None and rundir.newer_attempt(ctx.run_dir, 1) == 2


def test_resume_required_without_a_checkpoint_is_an_error(make_ctx: MakeCtx) -> None:
    ctx = _init(make_ctx({"checkpoint": {"resume": "required"}}))
    with pytest.raises(CheckpointError, match="resume=required"):
        TrainPhase(checkpoint.save).run(ctx)


def test_teardown_success_runs_the_policy_steps_in_order(make_ctx: MakeCtx) -> None:
    ctx = _init(make_ctx())
    teardown = TeardownPhase()
    deadline = teardown.arm(ctx)
    teardown.run(ctx)
    deadline.cancel()
    assert not dist.is_initialized()
    assert isinstance(ctx.parallel, RecordingParallel) and ctx.parallel.calls[-1] == "destroy"
    assert [n for n in names(ctx) if n.startswith("teardown:")] == [
        f"teardown:{s}" for s in ctx.policy.teardown.success]


def test_teardown_failure_path_does_not_wait_on_peers(make_ctx: MakeCtx) -> None:
    ctx = _init(make_ctx({"barriers": {"before_teardown": [{"group": "world"}]}}))
    TeardownPhase().run_failure(ctx, RuntimeError("x"))
    assert not dist.is_initialized()
    assert "barrier:before_teardown" not in names(ctx)


def test_hard_deadline_cancel_is_idempotent() -> None:
    fired: list[str] = []
    d = HardDeadline(30.0, 5, fired.append).start()
    d.cancel()
    d.cancel()
    assert fired == []


def test_a_learned_deadline_is_restored_at_the_same_layout_and_recalibrated_at_another(make_ctx: MakeCtx,
                                                                                     tmp_path: Path) -> None:
    import json

    from lifecycle.checkpoint import learned
    from lifecycle.context import DeadlineBook
    from lifecycle.watchdog.adaptive import AdaptiveDeadline

    ctx = make_ctx()
    cfg = ctx.policy.watchdog.adaptive
    ctx.deadlines = DeadlineBook(ctx.policy, {"step": AdaptiveDeadline("step", 600.0, cfg)})
    for _ in range(cfg.calibration_steps):
        ctx.deadlines.observe("step", 0.5)
    ctx.agree_deadlines(ctx.deadlines.proposals())
    folder = tmp_path / "iter_0000005"
    folder.mkdir()
    assert learned.write(ctx, folder)
    again = make_ctx()
    again.deadlines = DeadlineBook(again.policy, {"step": AdaptiveDeadline("step", 600.0, cfg)})
    learned.load(again, folder)
    assert again.deadline("step") == ctx.deadline("step") < 600
    # the same file at world size 4 (another layout): the static deadline stays, and the event says why
    data = json.loads((folder / learned.NAME).read_text())
    data["layout"]["world_size"] = 4
    (folder / learned.NAME).write_text(json.dumps(data))
    other = make_ctx()
    other.deadlines = DeadlineBook(other.policy, {"step": AdaptiveDeadline("step", 600.0, cfg)})
    learned.load(other, folder)
    assert other.deadline("step") == 600.0
    other.events.flush()
    [event] = [e for e in read_events(other.run_dir)[0] if e["name"] == "deadline"]
    assert event["source"] == "static" and "was for world size 4" in event["how"] and "recalibrating" in event["how"]


def test_memory_copies_resume_the_next_attempt_and_a_run_that_starts_over_never_uses_them(make_ctx: MakeCtx,
                                                                                           tmp_path: Path) -> None:
    from lifecycle.recovery import copies as files
    from lifecycle.recovery.resume import resume_tiers

    shm = tmp_path / "shm"
    shm.mkdir()
    tier = {"every_steps": 2, "dir": str(shm)}
    ctx = _init(make_ctx({"train": {"steps": 4}, "checkpoint": {"at_end": False, "memory": tier}}))
    TrainPhase(checkpoint.save).run(ctx)
    assert ctx.comms.memory is not None
    ctx.comms.memory.finish(ctx)
    weights = {k: v.clone() for k, v in ctx.step_handler.model.state_dict().items()}  # type: ignore[union-attr]
    base = files.root(shm, tmp_path / "ckpt")
    assert files.steps(files.own_dir(base, 0)) == [4]  # keep 1: step 2's copy went once step 4's was written
    assert not list((tmp_path / "ckpt").glob("iter_*"))  # nothing committed: the copies are all there is

    # The next attempt: a fresh model resumes from step 4's copy, weights and all.
    fresh = TrainPhase(checkpoint.save)
    ctx.progress.step, ctx.step_handler = 0, fresh._build(ctx)
    ctx.step_handler.setup(ctx)
    assert resume_tiers(ctx)
    assert ctx.step == 4 and ctx.progress.resumed_from == 4 and ctx.progress.resumed_tier == "memory"
    restored = ctx.step_handler.model.state_dict()  # type: ignore[attr-defined]
    assert all(torch.equal(restored[k], v) for k, v in weights.items())

    # resume: never starts over: a new lineage, and the old copies are never loaded.
    over = _init(make_ctx({"train": {"steps": 4}, "checkpoint": {"resume": "never", "memory": tier}}))
    over.step_handler = fresh._build(over)
    over.step_handler.setup(over)
    assert not resume_tiers(over) and over.step == 0
    again = make_ctx({"train": {"steps": 4}, "checkpoint": {"memory": tier}})
    again.step_handler = fresh._build(again)
    again.step_handler.setup(again)
    assert not resume_tiers(again) and again.step == 0  # bound to the old lineage: not used, and dropped
    assert files.steps(files.own_dir(base, 0)) == []


def test_watched_modules_round_trip_their_memory_copy() -> None:
    from lifecycle.backends.watched import WatchedModules

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()

    class Ctx:
        step = 7

    handler = WatchedModules([model], opt)
    state = handler.memory_state(Ctx())  # type: ignore[arg-type]
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    moments = opt.state_dict()["state"][0]["exp_avg"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert handler.load_memory_state(Ctx(), state) == 7  # type: ignore[arg-type]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], moments)


def test_a_state_whose_first_step_fails_is_rejected_once_then_the_commit_before_it_and_then_nothing(
        make_ctx: MakeCtx, tmp_path: Path) -> None:
    """checkpoint.check_restore: the first step after a restore gives NaN: that commit is recorded as rejected and
    the next resume falls back to the one before; a loss above restore_loss_factor x the loss recorded at save
    rejects that one too, and with nothing older the run stops with the no-progress code (never from step 0)."""
    from lifecycle.errors import BadState, NoProgress
    from lifecycle.recovery import rejections
    from lifecycle.recovery.state_check import check_restored

    ctx = _init(make_ctx({}))
    ctx.step_handler = TrainPhase(checkpoint.save)._build(ctx)
    ctx.step_handler.setup(ctx)
    root = Path(ctx.policy.checkpoint.dir)
    for step, loss in ((2, 0.5), (4, 0.25)):
        ctx.progress.step, ctx.progress.last_loss = step, loss
        checkpoint.save(ctx, "periodic")
    assert json.loads((root / "iter_0000004" / "manifest.json").read_text())["loss"] == 0.25
    _fresh(ctx)
    resume(ctx)
    assert ctx.step == 4 and ctx.progress.restored == ("persistent", "iter_0000004", 0.25)
    with pytest.raises(BadState, match="the first step after restoring the persistent tier's iter_0000004 gave "
                                       "loss nan: that state is rejected"):
        check_restored(ctx, 5, float("nan"), ctx.progress.restored)
    assert list(rejections.read(root)["persistent"]) == ["iter_0000004"]
    ctx.events.flush()
    assert [e for e in read_events(ctx.run_dir)[0] if e["name"] == "state_check"][-1]["check"] == "restore"

    _fresh(ctx)
    resume(ctx)  # once: the commit before it
    assert ctx.step == 2 and ctx.progress.restored == ("persistent", "iter_0000002", 0.5)
    strict = make_ctx({"checkpoint": {"restore_loss_factor": 3.0}})
    check_restored(strict, 3, 1.4, ctx.progress.restored)  # within 3 x 0.5: the next batch's loss may differ
    check_restored(ctx, 3, 1e9, ctx.progress.restored)  # no factor: only NaN/inf are refused
    with pytest.raises(BadState, match=r"loss 1.6, more than 3 x the 0.5 recorded at save"):
        check_restored(strict, 3, 1.6, ctx.progress.restored)

    _fresh(ctx)
    with pytest.raises(NoProgress, match="rejected after a restore .*not starting over from step 0"):
        resume(ctx)
    assert ctx.step == 0
