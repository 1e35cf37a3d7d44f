"""Rank 0's progress: a bar erased at the end on a real terminal (a pty), plain lines in a log, silence elsewhere."""

from __future__ import annotations

import io
import os
import select
from collections.abc import Iterator

import pytest

from lifecycle.obs import progress
from lifecycle.obs.progress import CLEAR, Progress


@pytest.fixture
def tty() -> Iterator[tuple[io.TextIOWrapper, int]]:
    """A real terminal: the slave end of a pty for writing, the master fd to read what it showed."""
    master, slave = os.openpty()
    stream = open(slave, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    yield stream, master
    stream.close()
    os.close(master)


def _read(master: int, quiet_s: float = 0.3) -> str:
    """Everything the terminal received: the pty delivers output asynchronously, so read until it is quiet."""
    data = b""
    while select.select([master], [], [], quiet_s)[0]:
        data += os.read(master, 1 << 16)
    return data.decode()


def test_log_gets_about_ten_lines_and_the_last_step() -> None:
    out = io.StringIO()
    with progress.for_rank(0, "train", 100, stream=out) as bar:
        for step in range(1, 101):
            bar.update(step, loss=1.0 / step)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and "\r" not in out.getvalue()
    assert lines[0].startswith("[rank 0] train step 10/100 (10%)") and "eta" in lines[0]
    assert lines[-1].startswith("[rank 0] train step 100/100 (100%)") and lines[-1].endswith("loss=0.01")


def test_resumed_run_counts_from_the_resume_step() -> None:
    out = io.StringIO()
    bar = Progress("train", 20, start=10, every=5, stream=out)
    for step in range(11, 21):
        bar.update(step)
    bar.close()
    assert [line.split()[4] for line in out.getvalue().splitlines()] == ["15/20", "20/20"]


def test_other_ranks_print_nothing() -> None:
    out = io.StringIO()
    with progress.for_rank(3, "train", 10, stream=out) as bar:
        for step in range(1, 11):
            bar.update(step)
    with progress.activity(3, "checkpoint step 10", stream=out):
        pass
    assert out.getvalue() == ""


def test_terminal_bar_is_drawn_in_place_and_erased(tty: tuple[io.TextIOWrapper, int]) -> None:
    stream, master = tty
    bar = Progress("train", 4, stream=stream)
    assert bar.tty
    for step in range(1, 5):
        bar.update(step, loss=0.5)
    bar.close()
    bar.close()  # safe twice
    shown = _read(master)
    assert "\n" not in shown and shown.endswith(CLEAR)
    assert "train |" + "#" * 28 + "| 4/4" in shown and "loss=0.5" in shown


def test_activity_logs_start_and_end_or_erases_on_a_terminal(tty: tuple[io.TextIOWrapper, int]) -> None:
    out = io.StringIO()
    with progress.activity(0, "checkpoint step 6", stream=out):
        pass
    start, end = out.getvalue().splitlines()
    assert start == "[rank 0] checkpoint step 6 ..." and end.startswith("[rank 0] checkpoint step 6 done in ")
    with pytest.raises(RuntimeError), progress.activity(0, "checkpoint step 7", stream=out):
        raise RuntimeError("boom")
    assert "checkpoint step 7 FAILED in" in out.getvalue()
    stream, master = tty
    with progress.activity(0, "checkpoint step 8", stream=stream):
        pass
    shown = _read(master)
    assert "checkpoint step 8 ..." in shown and shown.endswith(CLEAR) and "\n" not in shown


def test_closed_console_does_not_fail_training() -> None:
    out = io.StringIO()
    out.close()
    bar = Progress("train", 2, stream=out)
    bar.update(2)
    bar.close()
