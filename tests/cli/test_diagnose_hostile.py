"""`lifecycle diagnose` on input from machines you do not trust: every bad file is exit 2 naming it, no
traceback, in bounded time and memory; a pickle's ``__reduce__`` never runs; unknown lines are skipped and counted."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_cli

CASE = ROOT / "tests" / "data" / "diagnose" / "cases" / "plain_stall_before_fr"


class Payload:
    """Unpickling this with the standard loader creates a folder: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (str(self.marker),))


def _refused(proc: object, name: Path, why: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)  # type: ignore[attr-defined]
    err = proc.stderr  # type: ignore[attr-defined]
    assert "Traceback" not in err and str(name) in err and why in err, err


def test_a_reduce_payload_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    dump = tmp_path / "fr_trace_rank_0"
    dump.write_bytes(pickle.dumps({"version": "2.10", "entries": [Payload(marker)]}, protocol=2))
    _refused(run_cli("diagnose", str(dump)), dump, "names a Python object (posix.mkdir)")
    assert not marker.exists()
    with pytest.raises(FileNotFoundError):  # the same bytes do run code with pickle.load: the test is real
        marker.stat()
    pickle.loads(dump.read_bytes())
    assert marker.is_dir()


def test_truncated_and_foreign_pickles_are_refused(tmp_path: Path) -> None:
    whole = (CASE / "fr" / "fr_trace_rank_0").read_bytes()
    cut = tmp_path / "fr_trace_rank_0"
    cut.write_bytes(whole[: len(whole) // 2])
    _refused(run_cli("diagnose", str(cut)), cut, "truncated")
    other = tmp_path / "model.pkl"
    other.write_bytes(pickle.dumps({"weights": [1.0, 2.0]}))
    _refused(run_cli("diagnose", str(other)), other, "not a Flight Recorder dump")


def test_json_bombs_are_refused(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text('{"version": "2.10", "entries": ' + "[" * 200_000 + "]" * 200_000 + "}")
    _refused(run_cli("diagnose", str(deep)), deep, "nested too deeply")
    digits = tmp_path / "digits.json"
    digits.write_text('{"message": ' + "9" * 100_000 + "}")
    _refused(run_cli("diagnose", str(digits)), digits, "not valid JSON")


def test_a_1_gib_single_line_is_refused_in_bounded_time_and_memory(tmp_path: Path) -> None:
    huge = tmp_path / "console.log"
    with huge.open("wb") as f:
        f.write(b"[rank0]: " + b"x" * 8192)
        f.truncate(1 << 30)  # the rest reads as NUL bytes: one line of 1 GiB, 8 KiB on disk
    # Its own peak memory: a wrapper process whose only child is the command (this process's children so far
    # include whatever earlier tests started).
    probe = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stdout.write(p.stderr.rstrip() + chr(10)); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
             "sys.exit(p.returncode)")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "lifecycle", "diagnose", str(huge)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert time.monotonic() - t0 < 20
    *err, peak_kib = proc.stdout.splitlines()
    proc.stderr = "\n".join(err)
    _refused(proc, huge, "longer than 1048576 bytes")
    assert int(peak_kib) < 300 * 1024, peak_kib


def test_binary_junk_named_is_refused_and_skipped_in_a_folder(tmp_path: Path) -> None:
    junk = tmp_path / "core.1234"
    junk.write_bytes(bytes(range(256)) * 64)
    _refused(run_cli("diagnose", str(junk)), junk, "binary data")
    shutil.copytree(CASE / "fr", tmp_path / "fr")
    layout = ("-w", "4", "-o", "parallelism.tp=2", "-o", "parallelism.ep=1", "-o", "parallelism.etp=1")
    proc = run_cli("diagnose", "--json", str(tmp_path), *layout)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["inputs"]["skipped_files"] == 1 and out["culprits"] == [1]


def test_symlink_loops_fifos_and_unreadable_files(tmp_path: Path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    _refused(run_cli("diagnose", str(loop)), loop, "symbolic link loop")
    folder = tmp_path / "logs"
    folder.mkdir()
    (folder / "a").symlink_to(folder / "b")
    (folder / "b").symlink_to(folder / "a")
    _refused(run_cli("diagnose", str(folder)), folder / "a", "symbolic link loop")
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    _refused(run_cli("diagnose", str(fifo)), fifo, "not a regular file")


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    # a regular file whose read fails (EIO) even for root: the process's own memory file at offset 0
    unreadable = Path("/proc/self/mem")
    _refused(run_cli("diagnose", str(unreadable)), unreadable, "cannot be read")


def test_unknown_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    log = tmp_path / "rank_0.log"
    log.write_text("".join(f"epoch {i} lr 0.1 tokens/s 1234\n" for i in range(1000)))
    proc = run_cli("diagnose", "--json", str(log))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["inputs"]["lines"] == 1000 and out["inputs"]["lines_skipped"] == 1000 and out["culprits"] == []
