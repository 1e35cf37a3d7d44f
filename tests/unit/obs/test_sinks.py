"""Event sinks by name on a real EventLog: events flow in, close() closes them, a failing sink is dropped."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from lifecycle.errors import UsageError
from lifecycle.obs import sinks
from lifecycle.obs.events import EventLog


class Collect:
    """A sink that keeps what it sees (registered for these tests)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.where, self.closed = (run_dir, rank), 0
        self.seen: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        self.seen.append(event)

    def close(self) -> None:
        self.closed += 1


class Broken(Collect):
    def __call__(self, event: dict[str, Any]) -> None:
        raise OSError("disk full")


sinks.register("test-collect", Collect, replace=True)
sinks.register("test-broken", Broken, replace=True)


def test_unknown_sink_lists_the_available_names(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"unknown event sink 'nope'. Available names: .*tensorboard"):
        sinks.create("nope", tmp_path, 0)
    with pytest.raises(ValueError, match="already registered"):
        sinks.register("tensorboard", Collect)


def test_attached_sink_sees_events_and_is_closed_with_the_log(tmp_path: Path) -> None:
    log = EventLog(tmp_path, 3)
    [sink] = sinks.attach(log, ["test-collect"])
    assert isinstance(sink, Collect) and sink.where == (tmp_path, 3)
    with log.span("step", step=1):
        pass
    log.scalar("loss", 0.25)
    log.close()
    log.close()
    assert [(e["kind"], e["name"]) for e in sink.seen] == [("begin", "step"), ("end", "step"), ("scalar", "loss")]
    assert sink.closed == 1


def test_failing_sink_is_switched_off_and_the_rank_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = EventLog(tmp_path, 0)
    sinks.attach(log, ["test-broken", "test-collect"])
    log.instant("a")
    log.instant("b")
    log.close()
    assert len(log.listeners) == 1 and "event sink 'test-broken' failed (OSError: disk full)" in caplog.text
    assert caplog.text.count("switched off") == 1


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sinks.ENV, " tensorboard, ,test-collect")
    assert sinks.from_env() == ["tensorboard", "test-collect"]
    monkeypatch.delenv(sinks.ENV)
    assert sinks.from_env() == []


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_sink_writes_event_files(tmp_path: Path) -> None:
    log = EventLog(tmp_path, 0)
    sinks.attach(log, ["tensorboard"])
    log.step = 1
    with log.span("step") as extra:
        extra["loss"] = 0.5
    log.close()
    assert list((tmp_path / "tensorboard" / "rank_0").glob("events.out.tfevents.*"))


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_sink_without_tensorboard_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="pip install tensorboard"):
        sinks.create("tensorboard", tmp_path, 0)
    with pytest.raises(UsageError, match="the event sink 'tensorboard', which needs the package tensorboard: not "
                                         "installed; pip install tensorboard"):
        sinks.check(["tensorboard"])


def test_event_log_attaches_the_sinks_named_in_the_environment(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sinks.ENV, "test-collect")
    log = EventLog(tmp_path, 0)
    log.instant("exit")
    log.close()
    assert len(log.listeners) == 1 and log.listeners[0].sink.seen[0]["name"] == "exit"
    monkeypatch.setenv(sinks.ENV, "nope")
    with pytest.raises(UsageError, match="unknown event sink 'nope'"):
        EventLog(tmp_path, 1)


def test_sinks_and_their_packages_are_checked_before_any_rank_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from tests.unit.inproc import cli

    sinks.register("test-needs", Collect, replace=True, requires=("no_such_package_xyz",))
    sinks.check(["test-collect"])
    with pytest.raises(UsageError, match=r"^LIFECYCLE_SINKS names the event sink 'test-needs', which needs the package "
                                         r"no_such_package_xyz: not installed; pip install no_such_package_xyz \(or "
                                         r"remove 'test-needs' from LIFECYCLE_SINKS\)$"):
        sinks.check(["test-collect", "test-needs"])
    with pytest.raises(UsageError, match="LIFECYCLE_SINKS names an unknown event sink 'nope'. Available names: "):
        sinks.check(["nope"])
    monkeypatch.setenv(sinks.ENV, "test-needs")
    code, _, err = cli(capsys, "run", "--nproc", "2", f"run.dir={tmp_path / 'run'}", "train.kind=synthetic",
                       "~train.options", "moe.zero_token.action=off", "parallelism.ep=1")
    assert code == 2 and "error: LIFECYCLE_SINKS names the event sink 'test-needs'" in err
    assert not (tmp_path / "run").exists()
