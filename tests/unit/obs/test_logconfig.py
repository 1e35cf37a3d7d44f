"""`lifecycle run | head`: a reader that leaves costs the job nothing (no traceback, no lost exit code)."""

from __future__ import annotations

import io
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifecycle.obs.logconfig import reader_may_leave

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def closed_pipe() -> Iterator[io.TextIOWrapper]:
    """A text stream on a pipe whose reader is gone (the interpreter ignores SIGPIPE: writes fail with EPIPE)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = io.TextIOWrapper(open(write_end, "wb"), encoding="utf-8")  # noqa: SIM115 - closed below
    yield stream
    stream.close()  # its fd points at /dev/null by now: the close flushes without an error


def _as_stdout_and_stderr(stream: io.TextIOWrapper, monkeypatch: pytest.MonkeyPatch) -> None:
    # In the test's body: pytest's capture sets sys.stdout again between a fixture and the test.
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "stderr", stream)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_prints_and_torch_log_tailer_survive_a_reader_that_left(
        closed_pipe: io.TextIOWrapper, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.multiprocessing import tail_log

    _as_stdout_and_stderr(closed_pipe, monkeypatch)
    seen = _Records()  # torch's loggers do not propagate to the root (caplog would see nothing)
    tail_log.logger.addHandler(seen)
    log = tmp_path / "rank_0.log"
    log.write_text("".join(f"[rank 0] train step {i}\n" for i in range(2000)))
    try:
        with reader_may_leave():
            tailer = tail_log.TailLog("lifecycle", {0: str(log)}, sys.stdout, {0: ""}, interval_sec=0.01).start()
            tailer.stop()  # what the launcher's PContext.close() does once the ranks ended
            print("outcome  all 2 ranks succeeded -> exit 0" * 2000, flush=True)
            print("more", file=sys.stderr, flush=True)
    finally:
        tail_log.logger.removeHandler(seen)
    assert sys.stdout is closed_pipe and sys.stderr is closed_pipe  # restored
    assert [r.getMessage() for r in seen.records] == []  # was: "error in log tailer for lifecycle0. BrokenPipeError"


def test_without_it_the_pipe_error_is_raised(closed_pipe: io.TextIOWrapper, monkeypatch: pytest.MonkeyPatch) -> None:
    _as_stdout_and_stderr(closed_pipe, monkeypatch)
    with pytest.raises(BrokenPipeError):
        print("x" * 100_000, flush=True)
    with reader_may_leave():
        print("y", flush=True)  # points the descriptor at /dev/null
