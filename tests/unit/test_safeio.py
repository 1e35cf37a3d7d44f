"""Nothing in a run or checkpoint directory can block or mislead: FIFOs, devices, sockets, directories, huge or
deeply nested files where lifecycle keeps its own files are refused by name, never opened blocking nor replaced; a
symbolic link is never written through; a write the file system refuses is one line naming the folder."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle import rundir
from lifecycle.checkpoint import ckptdir
from lifecycle.obs.events import EventLog, read_events
from lifecycle.rundir import safeio

pytestmark = pytest.mark.timeout(30)


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def test_a_fifo_is_refused_by_name_at_once(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path / "summary.json")
    t0 = time.monotonic()
    with pytest.raises(safeio.RunDirError, match=r"summary.json: is a FIFO, not a regular file; .* remove it"):
        safeio.read_json(fifo)
    assert time.monotonic() - t0 < 1.0
    assert safeio.try_json(fifo) is None
    with pytest.raises(safeio.RunDirError, match="is a FIFO"):
        safeio.open_regular(fifo)


def test_devices_directories_big_and_deep_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(safeio.RunDirError, match="is a character device"):
        safeio.read_bytes("/dev/zero")
    with pytest.raises(safeio.RunDirError, match="is a directory"):
        safeio.read_bytes(tmp_path)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 2000)
    with pytest.raises(safeio.RunDirError, match="2000 bytes, more than the 1000"):
        safeio.read_bytes(big, limit=1000)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(safeio.RunDirError, match="nested too deeply"):
        safeio.read_json(deep, limit=1 << 20)
    assert safeio.read_bytes(tmp_path / "missing") is None


@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
def test_writes_refuse_what_is_not_a_regular_file_and_write_nothing(tmp_path: Path, kind: str) -> None:
    import socket

    path = tmp_path / "summary.json"
    if kind == "fifo":
        _fifo(path)
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))
    else:
        path = Path("/dev/full")  # never opened nor replaced, whoever runs the test
    name = {"fifo": "a FIFO", "socket": "a socket", "device": "a character device"}[kind]
    t0 = time.monotonic()
    for write in (lambda: safeio.write_text(path, "{}"), lambda: safeio.open_append(path),
                  lambda: safeio.open_rw(path)):
        with pytest.raises(safeio.RunDirError, match=f"{path}: is {name}, not a regular file; lifecycle writes only "
                           "regular files and never replaces or writes through anything else: remove it"):
            write()
    assert time.monotonic() - t0 < 1.0 and not path.is_file() and not path.is_symlink()
    assert [p.name for p in tmp_path.iterdir()] == ([] if kind == "device" else ["summary.json"])  # no temporary
    (tmp_path / "adir").mkdir()
    with pytest.raises(safeio.RunDirError, match="is a directory where lifecycle keeps a file"):
        safeio.write_text(tmp_path / "adir", "x")


def test_links_are_replaced_by_a_file_never_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "passwd"
    outside.write_text("root:x:0:0\n")
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    link = run / "events" / "rank_0.jsonl"
    link.symlink_to(outside)
    with pytest.raises(safeio.RunDirError, match=f"rank_0.jsonl: is a symbolic link \\(to {outside}\\), not a "
                       "regular file"):
        safeio.open_append(link)
    with pytest.raises(safeio.RunDirError, match="is a symbolic link"):
        EventLog(run, 0)
    assert outside.read_text() == "root:x:0:0\n"
    safeio.write_text(link, "mine\n")  # a replacing write replaces the link itself
    assert not link.is_symlink() and link.read_text() == "mine\n" and outside.read_text() == "root:x:0:0\n"
    planted = run / f".summary.json.{os.getpid()}.tmp"  # the temporary's name, taken by a link
    planted.symlink_to(outside)
    safeio.write_text(run / "summary.json", "{}")
    assert (run / "summary.json").read_text() == "{}" and outside.read_text() == "root:x:0:0\n"
    assert not planted.exists() and not planted.is_symlink()


def test_a_write_the_file_system_refuses_is_one_line_naming_the_folder(tmp_path: Path) -> None:
    from lifecycle.errors import HangError, PhaseError, RunDirError, StorageError, exit_code

    ck = tmp_path / "ck"
    folders = {"checkpoint.dir": ck, "run.dir": tmp_path}
    ro = OSError(errno.EROFS, "Read-only file system", str(ck / "iter_0000008.tmp"))
    error = safeio.storage_error(ro, folders)
    assert isinstance(error, StorageError) and exit_code(error) == 4 and error.__cause__ is ro
    assert str(error) == (f"checkpoint.dir {ck} is on a read-only file system: cannot write {ck}/iter_0000008.tmp "
                          f"(Read-only file system); remount it read-write or point checkpoint.dir at another "
                          f"folder, then run again (committed checkpoints are untouched)")
    full = safeio.storage_error(OSError(errno.ENOSPC, "No space left on device"), folders, "checkpoint.dir")
    assert str(full).startswith(f"checkpoint.dir {ck} is on a full file system: a write failed (No space left")
    events = OSError(errno.EDQUOT, "Disk quota exceeded", str(tmp_path / "events" / "rank_0.jsonl"))
    assert str(safeio.storage_error(events, folders)).startswith(f"run.dir {tmp_path} is over its disk quota:")
    early = safeio.storage_error(OSError(errno.ENOSPC, "No space left on device", "/x/.lock"), {}, before_start=True)
    assert isinstance(early, RunDirError) and exit_code(early) == 2
    assert str(early) == "/x/.lock is on a full file system (No space left on device); free space there or use " \
                         "another folder"
    for other in (OSError(errno.ENOENT, "No such file"), RuntimeError("x"), BrokenPipeError(errno.EPIPE, "pipe")):
        assert safeio.storage_error(other, folders, "checkpoint.dir") is None
    # torch.save on a full disk: a RuntimeError raised while handling the OSError, wrapped by the save handle
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos")  # noqa: B904 - as torch
    except RuntimeError as torch_error:
        wrapped = PhaseError("rank 0: checkpoint write failed")
        wrapped.__cause__ = torch_error
        hang = HangError("rank 0: checkpoint write not done")
        hang.__cause__ = torch_error
    assert str(safeio.storage_error(wrapped, folders, "checkpoint.dir")).startswith(
        f"checkpoint.dir {ck} is on a full file system: a write failed (No space left on device)")
    assert safeio.storage_error(hang, folders, "checkpoint.dir") is None  # a hang stays a hang (exit 3)


def test_the_run_directory_files_never_block(tmp_path: Path) -> None:
    _fifo(tmp_path / rundir.ATTEMPT)
    with pytest.raises(safeio.RunDirError, match="attempt: is a FIFO"):
        rundir.current_attempt(tmp_path)
    (tmp_path / rundir.ATTEMPT).unlink()
    (tmp_path / rundir.ATTEMPT).write_text("banana\n")
    with pytest.raises(safeio.RunDirError, match="holds 'banana', not an attempt number"):
        rundir.current_attempt(tmp_path)
    for junk in ("99999999999999999999999", "-3", "1e3", "٣", "2.0"):  # bounded, plain decimal digits only
        (tmp_path / rundir.ATTEMPT).write_text(f"{junk}\n")
        with pytest.raises(safeio.RunDirError, match="not an attempt number"):
            rundir.current_attempt(tmp_path)
    (tmp_path / rundir.ATTEMPT).write_text(f"{rundir.MAX_ATTEMPT}\n")
    assert rundir.current_attempt(tmp_path) == rundir.MAX_ATTEMPT
    _fifo(tmp_path / rundir.ATTEMPTS_DIR / "1" / rundir.SUMMARY)
    (tmp_path / rundir.ATTEMPTS_DIR / "2").mkdir()
    (tmp_path / rundir.ATTEMPTS_DIR / "2" / rundir.SUMMARY).write_text("[" * 100_000)
    assert [a["outcome"] for a in rundir.earlier_attempts(tmp_path)] == [
        "no summary (the launcher did not finish)"] * 2
    _fifo(tmp_path / rundir.SHUTDOWN_MARKER)
    assert rundir.read_marker(tmp_path) == {}
    _fifo(rundir.events_file(tmp_path, 1))
    assert rundir.last_event(tmp_path, 1) is None
    with pytest.raises(safeio.RunDirError, match="rank_1.jsonl: is a FIFO"):
        EventLog(tmp_path, 1)
    problems: list[str] = []
    assert 1 not in read_events(tmp_path, problems)
    assert any("rank_1.jsonl: not a regular file" in p for p in problems)


def test_a_fifo_as_tracker_or_manifest_is_a_named_problem(tmp_path: Path) -> None:
    _fifo(tmp_path / ckptdir.TRACKER)
    tracker = ckptdir.read_tracker(tmp_path)
    assert tracker.error is not None and "is a FIFO" in tracker.error
    folder = tmp_path / "iter_0000002"
    folder.mkdir()
    (folder / ckptdir.COMPLETE).write_text("{}")
    _fifo(folder / ckptdir.MANIFEST)
    assert "manifest.json is unreadable (is a FIFO" in (ckptdir.problem(folder) or "")


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=400))
def test_any_tracker_content_is_read_or_named_never_raised(content: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / ckptdir.TRACKER).write_bytes(content)
        tracker = ckptdir.read_tracker(Path(d))
        assert (tracker.name is None) != (tracker.error is None)


def test_manifest_digests_name_a_changed_file_and_older_manifests_still_load(tmp_path: Path) -> None:
    folder = tmp_path / "iter_0000001"
    (folder / "sub").mkdir(parents=True)
    for name, data in (("metadata.json", b"{}"), ("rank_0.pt", b"a" * 100), ("sub/rank_1.pt", b"b" * 100)):
        (folder / name).write_bytes(data)
    names = list(ckptdir.listing(folder))
    shares = [ckptdir.share(names, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(names) and not set(shares[0]) & set(shares[1])
    ckptdir.write_manifest(folder, ckptdir.digests(folder, names))
    assert ckptdir.problem(folder) is None
    assert all(ckptdir.changed(folder, r, 2) is None for r in range(2))
    (folder / "sub" / "rank_1.pt").write_bytes(b"c" * 100)  # same size, other content
    assert ckptdir.problem(folder) is None  # sizes cannot tell
    found = [ckptdir.changed(folder, r, 2) for r in range(2)]
    assert sum(f is not None for f in found) == 1  # exactly the rank whose share holds it
    assert "sub/rank_1.pt does not hold what was committed" in next(f for f in found if f)
    # A manifest of sizes only (format 1, older lifecycle) is complete and has nothing to check.
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "files": {n: 100 for n in names if "pt" in n}}))
    assert ckptdir.problem(folder) is None and ckptdir.changed(folder, 0, 1) is None
    (folder / "manifest.json").write_text(json.dumps({"format": 2, "files": {"rank_0.pt": {"bytes": True}}}))
    assert "manifest.json is unreadable (ValueError)" == ckptdir.problem(folder)


def test_the_attempt_the_ranks_agreed_on_is_what_the_next_attempt_counts_from(tmp_path: Path) -> None:
    events = tmp_path / "rank_1.jsonl"
    lines = [{"t": 1, "kind": "instant", "name": "attempt", "attempt": 1}]
    lines += [{"t": 2 + i, "kind": "begin", "name": "x"} for i in range(5)]
    lines += [{"t": 9, "kind": "instant", "name": "attempt", "attempt": 3, "counted": 1}]
    events.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert rundir._first_attempt(events) == 3  # counted 1 (its file was gone), agreed 3 at init
    events.write_text(json.dumps(lines[0]) + "\n")
    assert rundir._first_attempt(events) == 1
    assert rundir._first_attempt(tmp_path / "missing.jsonl") is None
    events.write_bytes(b"\xff garbage\n")
    assert rundir._first_attempt(events) == 1
