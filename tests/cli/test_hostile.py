"""Hostile and broken input end to end (issue 11): exit 2 (or 0), never a traceback, within a second of CPU
and 200 MiB of memory, with a short error. Each case runs the real CLI in a fresh interpreter that reports
its own exit code, time and peak memory (resource.getrusage), so the numbers are the command's alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT, fill_up

BAD = Path(__file__).parent / "bad_policies"
MAX_CPU_S = 1.0  # CPU seconds of the command (interpreter start-up excluded)
MAX_PEAK_MIB = 200
MAX_STDERR = 2000

PROBE = """
import json, os, resource, sys, time
wall, cpu = time.perf_counter(), time.process_time()
rc = 1
try:
    from lifecycle.cli import main
    rc = main(sys.argv[1:])
except SystemExit as exc:  # argparse
    rc = exc.code if isinstance(exc.code, int) else 2
finally:
    # VmHWM is this address space's own peak; ru_maxrss keeps the parent's size across fork + exec (a pytest
    # process that loaded torch would make every probe look 500 MB large).
    try:
        hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
        peak = int(hwm.split()[1]) / 1024
    except (OSError, IndexError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(os.environ["LIFECYCLE_PROBE_OUT"], "w") as f:
        json.dump({"rc": rc, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                   "peak_mib": peak}, f)
sys.exit(rc)
"""


@dataclass
class Probe:
    rc: int
    wall_s: float
    cpu_s: float
    peak_mib: float
    stdout: str
    stderr: str


def probe(tmp_path: Path, *args: str, timeout: float = 60) -> Probe:
    """Run ``lifecycle ARGS`` in a fresh interpreter; its exit code, time and peak memory."""
    out = tmp_path / "probe.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LIFECYCLE_PROBE_OUT": str(out)}
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
    stats = json.loads(out.read_text())
    assert stats["rc"] == proc.returncode, proc.stderr
    return Probe(stdout=proc.stdout, stderr=proc.stderr, **stats)


def _setup(tmp_path: Path, name: str) -> Path:
    """Files and folders a case needs that the corpus cannot hold (a 50 MB file, a symlink loop...)."""
    d = tmp_path / name
    d.mkdir()
    if name == "big":
        with open(d / "big.yaml", "wb") as f:  # 50 MB (sparse: the guard reads 1 MiB + 1 byte of it)
            f.write(b"description: x\n")
            f.truncate(50 << 20)
    elif name == "loop":
        (d / "a").symlink_to(d / "b")
        (d / "b").symlink_to(d / "a")
    elif name == "binary_dir":
        (d / "preset").mkdir()
        (d / "preset" / "ok.yaml").write_text("# @package _global_\ndescription: fine\n")
        (d / "junk.yaml").write_bytes(bytes(range(256)) * 16)
    return d


CASES = {  # name: (args, expected exit code, expected text on stderr; "{d}" is the case's folder)
    "alias_bomb": (["validate", "-d", str(BAD), "-n", "alias_bomb"], 2, "expand to more than 5000 values"),
    "50MB_file": (["validate", "-d", "{d}", "-n", "big"], 2, "larger than the limit of 1048576 bytes; shrink it, "
                  "or raise the limit with LIFECYCLE_MAX_POLICY_BYTES=<bytes> (got 52428800)"),
    # the parser may refuse 10,000 levels before our guard does (PyYAML >= 6.0.4): either way, file and line
    "deep_nesting": (["validate", "-d", str(BAD), "-n", "deep_nesting"], 2,
                     re.compile(r"deep_nesting\.yaml:2:\d+: (nested deeper than 32 levels|not valid YAML: "
                                r"exceeded maximum nesting depth)")),
    "deep_nesting_guard": (["validate", "-d", str(BAD), "-n", "deep_nesting_guard"], 2,
                           "deep_nesting_guard.yaml:2:45: nested deeper than 32 levels"),
    "binary": (["explain", "-d", str(BAD), "-n", "binary"], 2, "binary.yaml:1: not UTF-8: byte 0x89"),
    "interpolation_bomb": (["validate", "-d", str(BAD), "-n", "interpolation_bomb"], 2, "resolutions"),
    "group_number": (["validate", "checkpoint=5"], 2, "checkpoint: a config group takes the name"),
    "group_null": (["diff", "preset=null", ""], 2, "preset: a config group takes the name"),
    "100k_digit_int": (["validate", "train.steps=" + "9" * 100_000], 2, "longer than 4096 characters"),
    "1000_part_key": (["validate", ".".join(["a"] * 1000) + "=1"], 2, "the key has 1000 parts"),
    "hydra_override": (["validate", "hydra.run.dir=/tmp/x"], 2, "policies configure lifecycle, not Hydra"),
    "inf_deadline": (["validate", "watchdog.deadlines.init=inf"], 2, "Input should be a finite number"),
    "symlink_loop": (["validate", "--config-dir", "{d}/a"], 2, "--config-dir: cannot be resolved"),
    "world_2**63": (["explain", "--world-size", str(2**63)], 2, "must be an integer from 1 to 2147483647"),
    "world_digits": (["explain", "--world-size", "9" * 100_000], 2, "(100000 characters)"),
    "rank_outside": (["explain", "--world-size", "8", "--rank", "8"], 2, "--rank: must be in [0, 8)"),
    "huge_value": (["validate", "checkpoint.keep_last=" + "x" * 4000], 2, "(4002 characters in all)"),
    "policies_binary": (["policies", "-d", "{d}"], 2, "junk.yaml:2: not UTF-8"),
}
SETUP = {"50MB_file": "big", "symlink_loop": "loop", "policies_binary": "binary_dir"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_input_exits_2_fast_small_and_short(tmp_path: Path, name: str) -> None:
    args, code, expected = CASES[name]
    d = _setup(tmp_path, SETUP[name]) if name in SETUP else tmp_path
    run = probe(tmp_path, *[a.replace("{d}", str(d)) for a in args])
    assert run.rc == code, run.stderr[-2000:]
    found = expected.search(run.stderr) if isinstance(expected, re.Pattern) else expected in run.stderr
    assert "Traceback" not in run.stderr and found, run.stderr[-2000:]
    assert len(run.stderr) < MAX_STDERR, run.stderr[:3000]
    assert run.cpu_s < MAX_CPU_S and run.peak_mib < MAX_PEAK_MIB, run


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", [
    ["explain", "--json", "--world-size", "100000000", "--rank", "99999999", "parallelism.tp=8", "train.options.heads=8"],
    ["explain", "--world-size", str(2**30), "--rank", "12345", "preset=moe_large", "parallelism.tp=8", "train.options.heads=8",
     "parallelism.ep=8", "parallelism.dist_opt_instances=4"],
    ["schema"],
    ["policies"],
    ["diff", "preset=moe", "preset=moe_large"],
])
def test_largest_commands_stay_bounded(tmp_path: Path, args: list[str]) -> None:
    """explain at 10^8 ranks grew to 18 GB: now every command stays under 200 MiB."""
    run = probe(tmp_path, *args)
    assert run.rc in (0, 1) and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.peak_mib < MAX_PEAK_MIB and run.cpu_s < 2.0, run
    if "--json" in args:
        layout = json.loads(run.stdout)["layout"]
        assert layout["groups"]["tp"] == list(range(99999992, 100000000))
        assert layout["large_groups"]["world"] == {"size": 100_000_000, "ranks": "0-99999999"}


@pytest.mark.timeout(120)
def test_timeline_skips_broken_events_and_checks_its_output(tmp_path: Path) -> None:
    events = tmp_path / "run" / "events"
    events.mkdir(parents=True)
    good = [{"t": 10, "rank": 0, "host": "h", "phase": "init", "kind": "begin", "name": "phase:init"},
            {"t": 20, "rank": 0, "host": "h", "phase": "init", "kind": "end", "name": "phase:init", "dur_us": 10}]
    lines = [json.dumps(e) for e in good] + [json.dumps({"t": "soon", "kind": 1, "name": None})]
    (events / "rank_0.jsonl").write_bytes("\n".join(lines).encode() + b"\n\xff\xfe\x00 not UTF-8\n")
    (events / "rank_1.jsonl").mkdir()
    run = probe(tmp_path, "timeline", str(tmp_path / "run"), "--no-png")
    assert run.rc == 0 and "Traceback" not in run.stderr, run.stderr
    assert "rank_0.jsonl: 1 malformed line skipped" in run.stderr
    assert "rank_0.jsonl: 1 malformed event skipped" in run.stderr and "rank_1.jsonl: not a regular file" \
        in run.stderr
    run = probe(tmp_path, "timeline", str(tmp_path / "run"), "--out", "/proc/lifecycle/trace.json")
    assert run.rc == 2 and "--out /proc/lifecycle/trace.json: cannot create its folder" in run.stderr
    assert "Traceback" not in run.stderr
    os.mkfifo(tmp_path / "fifo.png")
    written = (tmp_path / "run" / "trace.json").stat().st_mtime_ns
    for flag, target, what in (("--out", "/dev/full", "is a character device"),
                               ("--png", str(tmp_path / "fifo.png"), "is a FIFO")):
        run = probe(tmp_path, "timeline", str(tmp_path / "run"), flag, target)
        assert run.rc == 2 and run.stderr == f"error: {flag} {target}: {what}, not a regular file; lifecycle " \
            "writes only regular files and never replaces or writes through anything else: give the name of a " \
            "regular file\n", run.stderr
    assert Path("/dev/full").is_char_device() and (tmp_path / "fifo.png").is_fifo()
    assert (tmp_path / "run" / "trace.json").stat().st_mtime_ns == written  # refused before a trace was written


RUN = ["run", "--nproc", "2", "train.kind=synthetic", "~train.options", "moe.zero_token.action=off",
       "parallelism.ep=1"]


def _full_disk(folder: Path) -> None:
    """A 200 KiB tmpfs at ``folder``, filled up (root only; the test unmounts it)."""
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(folder)], check=True, timeout=10)
    fill_up(folder)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["full disk", "logs is a file", "events is a file", "fifo summary", "linked events"])
def test_a_run_directory_lifecycle_cannot_use_is_one_line_before_any_rank_starts(tmp_path: Path, case: str) -> None:
    run_dir = tmp_path / "run"
    if case == "full disk":
        if os.geteuid() != 0:
            pytest.skip("mounts a tmpfs: root only")
        _full_disk(tmp_path / "full")
        run_dir = tmp_path / "full" / "run"
        expected = f"run.dir {run_dir} is on a full file system (No space left on device); free space there"
    else:
        (run_dir / "events").mkdir(parents=True)
        (run_dir / ".lifecycle-run").write_text("a lifecycle run directory\n")
        name = {"logs is a file": "logs", "events is a file": "events", "fifo summary": "summary.json",
                "linked events": "events/rank_0.jsonl"}[case]
        if case.endswith("is a file"):
            (run_dir / name).rmdir() if (run_dir / name).is_dir() else None
            (run_dir / name).write_text("x")
            expected = f"{run_dir / name}: is a regular file where lifecycle keeps its {name}/ folder"
        elif case == "fifo summary":
            os.mkfifo(run_dir / name)
            expected = f"{run_dir / name}: is a FIFO, not a regular file"
        else:
            (run_dir / name).symlink_to(tmp_path / "passwd")
            expected = f"{run_dir / name}: is a symbolic link (to {tmp_path / 'passwd'}), not a regular file"
    try:
        run = probe(tmp_path, *RUN, f"run.dir={run_dir}", timeout=30)
    finally:
        if case == "full disk":
            subprocess.run(["umount", "-l", str(tmp_path / "full")], check=False, timeout=10)
    assert run.rc == 2 and run.stderr.startswith(f"error: {expected}") and run.stderr.count("\n") == 1, run.stderr
    assert "Traceback" not in run.stdout + run.stderr and not (tmp_path / "passwd").exists()
