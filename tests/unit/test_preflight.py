"""Checks before any rank starts: folders, the launcher's environment, the checkpoint folder."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from lifecycle.checkpoint import ckptdir
from lifecycle.errors import CheckpointError, PolicyError, UsageError
from lifecycle.machine.preflight import check_dirs, check_resume, dir_problem, rank_env


def test_a_writable_folder_passes_and_is_created(tmp_path: Path) -> None:
    assert dir_problem(str(tmp_path / "a" / "b")) is None
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []


@pytest.mark.parametrize("path,why", [
    ("f", "is a file"), ("f/sub", "has a parent"), ("/proc/self/run", "is under /proc"),
    ("/sys/kernel/x", "is under /sys"),
])
def test_folders_a_run_cannot_write_are_named(tmp_path: Path, path: str, why: str) -> None:
    (tmp_path / "f").write_text("x")
    assert why in (dir_problem(str(tmp_path / path)) or "")


def test_a_symlink_loop_is_named(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert "symlink loop" in (dir_problem(str(tmp_path / "a" / "run")) or "") or \
        "not writable" in (dir_problem(str(tmp_path / "a" / "run")) or "")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_unwritable_folder_is_named(tmp_path: Path) -> None:
    (tmp_path / "ro").mkdir(mode=0o500)
    assert "not writable" in (dir_problem(str(tmp_path / "ro" / "run")) or "")


def test_check_dirs_lists_every_bad_key(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(PolicyError) as info:
        check_dirs(str(tmp_path / "f"), "/proc/ckpt")
    assert [i.path for i in info.value.issues] == ["run.dir", "checkpoint.dir"]
    assert info.value.exit_code == 2


@pytest.mark.parametrize("env,match", [
    ({}, "RANK is not set"),
    ({"RANK": "zz", "WORLD_SIZE": "4"}, "RANK='zz' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ({"RANK": "5", "WORLD_SIZE": "4"}, r"RANK=5 is outside the world of WORLD_SIZE=4 ranks \(0..3\)"),
    ({"RANK": "-1", "WORLD_SIZE": "4"}, "outside the world"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "zz"}, "LOCAL_RANK='zz' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "-2"}, "LOCAL_RANK=-2 must be >= 0"),
])
def test_the_launcher_environment_is_range_checked(env: dict[str, str], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        rank_env(env)


def test_rank_env_reads_a_good_environment() -> None:
    assert rank_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == (3, 4, 1)


def _committed(root: Path, step: int) -> Path:
    folder = root / ckptdir.iter_name(step)
    folder.mkdir(parents=True)
    (folder / "rank_0.pt").write_bytes(b"x" * 100)
    (folder / "metadata.json").write_text("{}")
    ckptdir.write_manifest(folder)
    ckptdir.write_tracker(root, step)
    return folder


@pytest.mark.parametrize("content,why", [
    (b"\xff\xfe garbage", "is not UTF-8 text (byte 0)"),
    (b"../../etc\n", "not an iter_NNNNNNN folder"),
    (b"iter_0000010/../../x", "not an iter_NNNNNNN folder"),
    (b"", "not an iter_NNNNNNN folder"),
    (b"x" * 1000, "longer than 256 bytes"),
])
def test_a_bad_tracker_is_named_and_never_followed(tmp_path: Path, content: bytes, why: str) -> None:
    _committed(tmp_path, 10)
    (tmp_path / ckptdir.TRACKER).write_bytes(content)
    tracker = ckptdir.read_tracker(tmp_path)
    assert tracker.name is None and why in (tracker.error or "")
    with pytest.raises(CheckpointError, match="the tracker"):
        check_resume(str(tmp_path), "auto", "error")
    check_resume(str(tmp_path), "auto", "fallback")  # the ranks will fall back to iter_0000010
    assert [p.name for p in ckptdir.candidates(tmp_path).paths] == ["iter_0000010"]


def test_megatron_lm_tracker_alone_is_read(tmp_path: Path) -> None:
    _committed(tmp_path, 7)
    (tmp_path / ckptdir.TRACKER).unlink()
    assert ckptdir.read_tracker(tmp_path).name == "iter_0000007"


def test_truncated_shard_and_missing_metadata_are_named(tmp_path: Path) -> None:
    folder = _committed(tmp_path, 3)
    (folder / "rank_0.pt").write_bytes(b"x" * 10)
    assert ckptdir.problem(folder) == "rank_0.pt has 10 bytes, 100 were written (truncated or overwritten)"
    with pytest.raises(CheckpointError, match=r"checkpoint \S+iter_0000003 \(named by the tracker \S+\) cannot be used: "
                       r"rank_0.pt has 10 bytes"):
        check_resume(str(tmp_path), "auto", "error")
    (folder / "metadata.json").unlink()
    assert "metadata.json is missing" in (ckptdir.problem(folder) or "")


def test_resume_required_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="checkpoint.resume: is required but"):
        check_resume(str(tmp_path / "none"), "required", "error")
    check_resume(str(tmp_path / "none"), "auto", "error")


def test_prune_keeps_the_tracker_and_protected_and_counts_only_complete(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _committed(tmp_path, step)
    (tmp_path / "iter_0000003" / "metadata.json").unlink()  # incomplete: never counted, never deleted
    ckptdir.write_tracker(tmp_path, 2)
    pruned = ckptdir.prune(tmp_path, 1, {"iter_0000001"})
    assert [p.name for p in pruned] == []  # 4 newest, 2 tracker, 1 protected; 3 incomplete
    ckptdir.write_tracker(tmp_path, 4)
    assert [p.name for p in ckptdir.prune(tmp_path, 1, set())] == ["iter_0000001", "iter_0000002"]
    assert sorted(p.name for p in ckptdir.committed(tmp_path)) == ["iter_0000003", "iter_0000004"]


@pytest.mark.parametrize(("overrides", "key"), [
    (["preset=moe_large"], "parallelism.dist_opt_instances"),  # world 4: expert dp 1 cannot hold 2 instances
    # pp not last: megatron needs dp (2) == expert dp (1) for one set of pipeline groups
    (["parallelism.pp=2", "parallelism.ep=2", "parallelism.order=tp-cp-ep-pp-dp"], "parallelism.order"),
])
def test_megatron_layout_rules_at_the_launch_world_size_are_checked_before_launch(
        tmp_path: Path, overrides: list[str], key: str) -> None:
    from lifecycle.machine.rankdir import preflight
    from lifecycle.policy.load import load

    policy = load([*overrides, f"run.dir={tmp_path / 'run'}", "train.options.num_layers=4"]).policy
    with pytest.raises(PolicyError, match=key.replace(".", r"\.")) as info:
        preflight(policy, 4)
    assert "world size 4" in str(info.value)
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_places_a_run_must_not_take(tmp_path: Path) -> None:
    from lifecycle.machine.preflight import place_problem

    assert place_problem(str(tmp_path / "run"), str(tmp_path / "run" / "checkpoints")) == []
    assert place_problem(str(tmp_path / "run"), str(tmp_path / "elsewhere")) == []
    said = [str(i) for i in place_problem("/", "/ckpt")]
    assert said and said[0].startswith("run.dir: is /, a system or home folder itself")
    said = [str(i) for i in place_problem(str(tmp_path / "run"), str(tmp_path / "run" / "attempts" / "c"))]
    assert said and "lies inside" in said[0] and "attempts, which lifecycle moves aside" in said[0]
    said = [str(i) for i in place_problem(str(tmp_path / "ck" / "run"), str(tmp_path / "ck"))]
    assert said and said[0].startswith("run.dir: lies inside checkpoint.dir")


def test_a_foreign_folder_is_refused_unless_adopted(tmp_path: Path) -> None:
    from lifecycle.machine.preflight import check_owner, mark_owner

    check_owner(str(tmp_path / "missing"), False)
    check_owner(str(tmp_path), False)  # empty
    # another starting rank's writability probe, there for a moment (seen once on a two-node torchrun job): ours
    (tmp_path / ".lifecycle-probe-7692").write_bytes(b"lifecycle\n")
    check_owner(str(tmp_path), False)
    (tmp_path / ".lifecycle-probe-7692x").write_bytes(b"x")  # not the probe's name: someone else's
    with pytest.raises(PolicyError, match=r"did not make \(.lifecycle-probe-7692x\)"):
        check_owner(str(tmp_path), False)
    (tmp_path / ".lifecycle-probe-7692x").unlink()
    (tmp_path / "data.bin").write_bytes(b"x")
    with pytest.raises(PolicyError, match=r"run.dir: is a non-empty folder lifecycle did not make \(data.bin\)"):
        check_owner(str(tmp_path), False)
    check_owner(str(tmp_path), True)
    mark_owner(tmp_path)
    check_owner(str(tmp_path), False)


def test_the_rendezvous_environment_is_checked() -> None:
    from lifecycle.machine.preflight import check_rendezvous_env

    check_rendezvous_env({"MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    for env, needle in (({"MASTER_PORT": "1"}, "MASTER_ADDR is not set"),
                        ({"MASTER_ADDR": "h", "MASTER_PORT": "0"}, "MASTER_PORT='0' is not a port number"),
                        ({"MASTER_ADDR": "h", "MASTER_PORT": "-5"}, "is not a port number"),
                        ({"MASTER_ADDR": "h"}, "MASTER_PORT='' is not a port number")):
        with pytest.raises(UsageError, match=needle):
            check_rendezvous_env(env)


def test_one_launcher_holds_a_run_directory(tmp_path: Path) -> None:
    from lifecycle import rundir
    from lifecycle.rundir import runlock, safeio

    first = runlock.RunLock(tmp_path).acquire()
    assert first.took_over is None
    with pytest.raises(safeio.RunDirError, match=rf"run directory {tmp_path} is in use by another launcher \(host "):
        runlock.RunLock(tmp_path).acquire()
    first.release()
    first.release()
    again = runlock.RunLock(tmp_path).acquire()
    again.release()
    (tmp_path / rundir.LOCK).write_text("host gone, pid 1, started then\n")  # a holder that died holding it
    taken = runlock.RunLock(tmp_path).acquire()
    assert taken.took_over == "host gone, pid 1, started then"
    # The lock is on the folder: deleting (or replacing) its file while the holder runs hands nobody the directory.
    (tmp_path / rundir.LOCK).unlink()
    with pytest.raises(safeio.RunDirError, match="in use by another launcher"):
        runlock.RunLock(tmp_path).acquire()
    (tmp_path / rundir.LOCK).write_text("")
    with pytest.raises(safeio.RunDirError, match="in use by another launcher"):
        runlock.RunLock(tmp_path).acquire()
    taken.release()
    runlock.RunLock(tmp_path).acquire().release()


def test_files_a_starting_peer_writes_do_not_make_the_folder_foreign(tmp_path: Path) -> None:
    """Under torchrun the other ranks create their event files before rank 0 looks; anything else still counts."""
    from lifecycle.machine.preflight import check_owner

    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "rank_3.jsonl").write_text("")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank_3.log").write_text("")
    check_owner(str(tmp_path), False, peers_starting=True)
    with pytest.raises(PolicyError, match=r"did not make \(events, logs\)"):
        check_owner(str(tmp_path), False)
    (tmp_path / "events" / "notes.txt").write_text("mine")
    with pytest.raises(PolicyError, match=r"did not make \(events\)"):
        check_owner(str(tmp_path), False, peers_starting=True)


def _left_behind(run: Path, what: str) -> tuple[Path, str]:
    """What an earlier run (or anyone) left where a run keeps its files; (the path, how it is named)."""
    import socket

    run.mkdir(parents=True, exist_ok=True)
    (run / "events").mkdir(exist_ok=True)
    outside = run.parent / "passwd"
    outside.write_text("root:x:0:0\n")
    path = {"logs file": run / "logs", "events file": run / "events", "attempts file": run / "attempts",
            "fifo summary": run / "summary.json", "fifo log": run / "logs" / "rank_1.log",
            "socket lock": run / ".lock", "linked events": run / "events" / "rank_0.jsonl",
            "linked ledger": run / "restarts.jsonl"}[what]
    path.parent.mkdir(exist_ok=True)
    if what.endswith(" file"):
        if path.is_dir():
            path.rmdir()
        path.write_text("x")
        return path, f"is a regular file where lifecycle keeps its {path.name}/ folder; remove or rename it"
    if what.startswith("fifo"):
        os.mkfifo(path)
        return path, "is a FIFO, not a regular file; lifecycle writes only regular files"
    if what.startswith("socket"):
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))
        return path, "is a socket, not a regular file"
    path.symlink_to(outside)
    return path, f"is a symbolic link (to {outside}), not a regular file; lifecycle writes only regular files"


@pytest.mark.parametrize("what", ["logs file", "events file", "attempts file", "fifo summary", "fifo log",
                                  "socket lock", "linked events", "linked ledger"])
def test_what_is_left_where_a_run_keeps_its_files_is_refused_before_anything_is_written(
        tmp_path: Path, what: str) -> None:
    from lifecycle.errors import RunDirError, exit_code

    run = tmp_path / "run"
    path, named = _left_behind(run, what)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(RunDirError, match=re.escape(f"{path}: {named}")) as info:
        check_dirs(str(run), str(run / "checkpoints"))
    assert exit_code(info.value) == 2 and "\n" not in str(info.value)
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.name != "checkpoints")
    assert after == before  # nothing written or moved (the checkpoint folder is made, empty, as before)
    assert (tmp_path / "passwd").read_text() == "root:x:0:0\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a 200 KiB tmpfs: root only")
def test_a_full_disk_is_one_line_naming_the_folder(tmp_path: Path) -> None:
    import subprocess

    from lifecycle.errors import RunDirError

    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(full)], check=True, timeout=10)
    try:
        fd = os.open(full / "fill", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError, match="No space left"):
            while True:
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        with pytest.raises(RunDirError, match=re.escape(f"run.dir {full / 'r'} is on a full file system (No space "
                                                        f"left on device); free space there or point run.dir at")):
            check_dirs(str(full / "r"), str(full / "r" / "checkpoints"))
        assert list((full / "r").iterdir()) == []  # the probe is gone, nothing else was made
    finally:
        subprocess.run(["umount", "-l", str(full)], check=False, timeout=10)


def test_the_events_flush_count_comes_from_the_environment_or_is_refused_naming_it() -> None:
    from lifecycle.errors import UsageError
    from lifecycle.machine.preflight import events_flush_every

    assert events_flush_every({}) == 256 and events_flush_every({"LIFECYCLE_EVENTS_FLUSH_EVERY": "1"}) == 1
    for bad in ("0", "-3", "x", "1.5", str(1 << 21)):
        with pytest.raises(UsageError, match="LIFECYCLE_EVENTS_FLUSH_EVERY"):
            events_flush_every({"LIFECYCLE_EVENTS_FLUSH_EVERY": bad})
