"""A rank started by another launcher, before it makes any store client (lifecycle.launch.rendezvous): rank 0's port
free, the other ranks' bounded wait for it. Real sockets on localhost, no processes."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifecycle.errors import HangError, UsageError
from lifecycle.launch import rendezvous
from tests.unit.inproc import cli

QUICK = ["train.kind=synthetic", "~train.options", "moe.zero_token.action=off", "parallelism.ep=1"]


@pytest.fixture
def listening() -> Iterator[int]:
    """A port another program listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


@pytest.fixture
def refused() -> Iterator[int]:
    """A port nothing listens on (held, not listening: connections are refused)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def _rank_env(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, port: int) -> None:
    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port)):
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv(rendezvous.AGENT_STORE_ENV, raising=False)


def test_rank_0_refuses_a_port_another_program_holds(listening: int) -> None:
    with pytest.raises(UsageError, match=rf"^MASTER_PORT={listening} is taken by another program on this host .*: "
                                         r"rank 0 hosts the rendezvous store there .*; give every rank of the job a "
                                         r"free port \(MASTER_PORT, the launcher's --master-port\) or stop the "
                                         r"program that holds it$"):
        rendezvous.check(0, 60, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(listening)})
    rendezvous.check(0, 60, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(listening),
                             rendezvous.AGENT_STORE_ENV: "True"})  # torchrun's agent hosts it: nothing to check


def test_a_rank_waits_for_the_store_then_goes_on(listening: int) -> None:
    start = time.monotonic()
    rendezvous.wait_for_store(1, "127.0.0.1", listening, 5)
    assert time.monotonic() - start < 1


@pytest.mark.timeout(20)
def test_a_rendezvous_that_never_comes_is_one_line_per_condition(refused: int, capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    with pytest.raises(HangError) as exc:
        rendezvous.wait_for_store(3, "127.0.0.1", refused, 0.6)
    assert 0.6 <= time.monotonic() - start < 3 and exc.value.missing == [0] and exc.value.phase == "init"
    assert str(exc.value) == (
        f"rank 3 waited 0.6s (watchdog.deadlines.init) for rank 0's rendezvous store at 127.0.0.1:{refused} "
        f"(MASTER_ADDR:MASTER_PORT): connection refused; start rank 0 of this job with the same MASTER_ADDR/"
        f"MASTER_PORT, check that MASTER_ADDR is rank 0's host and the port is open between the hosts, or raise "
        f"watchdog.deadlines.init")
    assert capsys.readouterr().err == (f"lifecycle: rank 3 waits up to 0.6s (watchdog.deadlines.init) for rank 0's "
                                       f"rendezvous store at 127.0.0.1:{refused} (MASTER_ADDR:MASTER_PORT): "
                                       f"connection refused so far\n")


@pytest.mark.timeout(30)
def test_run_as_another_launchers_rank_checks_the_rendezvous_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], listening: int,
        refused: int) -> None:
    _rank_env(monkeypatch, 1, 2, refused)
    code, _, err = cli(capsys, "run", f"run.dir={tmp_path / 'r1'}", "watchdog.deadlines.init=0.5", *QUICK)
    assert code == 3 and len(err.splitlines()) == 2 and "frame #" not in err, err
    assert err.splitlines()[1].startswith("error: rank 1 waited 0.5s (watchdog.deadlines.init) for rank 0's ")
    _rank_env(monkeypatch, 0, 1, listening)
    code, _, err = cli(capsys, "run", f"run.dir={tmp_path / 'r0'}", *QUICK)
    assert code == 2 and err.startswith(f"error: MASTER_PORT={listening} is taken by another program"), err
    assert not (tmp_path / "r0").exists() and not (tmp_path / "r1").exists()
