"""The merged trace on event files written here: valid trace-event JSON, spans nest per track, cut spans closed."""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.errors import UsageError
from lifecycle.obs import gantt, timeline
from lifecycle.obs.events import EventLog
from lifecycle.obs.spans import phase_of, rank_spans

PHASES = ["X", "i", "M", "C"]


def _write(run_dir: Path, rank: int, events: list[dict[str, Any]], torn: str = "") -> None:
    path = run_dir / "events" / f"rank_{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + torn)


def _ev(t: int, kind: str, name: str, rank: int = 0, phase: str = "train", **kw: Any) -> dict[str, Any]:
    return {"t": t, "rank": rank, "local_rank": rank, "host": "h", "phase": phase, "kind": kind, "name": name, **kw}


def _real_run(run_dir: Path, ranks: int = 2) -> None:
    """Two ranks written through the real EventLog: phases, nested spans, instants, a scalar."""
    for rank in range(ranks):
        log = EventLog(run_dir, rank, rank)
        for phase in ("init", "warmup", "train"):
            log.phase = phase
            log.emit("begin", f"phase:{phase}")
            with log.span("warm:all_reduce" if phase == "warmup" else "step", group="dp"):
                with log.span("barrier:after_init", group="world"):
                    pass
            log.scalar("mem_gib", 1.5)
            log.emit("end", f"phase:{phase}", dur_us=1)
        log.instant("exit", exit_code=0)
        log.close()


def check_trace(trace: dict[str, Any]) -> None:
    """Trace-event format checks, and that complete events nest on every (pid, tid) track."""
    json.loads(json.dumps(trace))  # plain JSON, nothing that only Python can read
    assert isinstance(trace["traceEvents"], list) and trace["displayTimeUnit"] == "ms"
    body = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert min(e["ts"] for e in body) == 0
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in trace["traceEvents"]:
        assert e["ph"] in PHASES and isinstance(e["name"], str) and isinstance(e["pid"], int), e
        if e["ph"] != "M":
            assert isinstance(e["tid"], int) and isinstance(e["ts"], int) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], int) and e["dur"] >= 0, e
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
        if e["ph"] == "i":
            assert e["s"] in ("t", "p", "g")
    for track, xs in tracks.items():
        stack: list[int] = []  # end times of the open ancestors
        for e in sorted(xs, key=lambda x: (x["ts"], -x["dur"])):
            while stack and stack[-1] <= e["ts"] and not (stack[-1] == e["ts"] and e["dur"] == 0):
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1], (track, e, stack)
            stack.append(e["ts"] + e["dur"])


def test_real_event_log_gives_a_valid_nested_trace(tmp_path: Path) -> None:
    _real_run(tmp_path)
    trace = timeline.build_trace(timeline.load(tmp_path))
    check_trace(trace)
    names = {(e["ph"], e["name"]) for e in trace["traceEvents"]}
    assert {("X", "phase:init"), ("X", "phase:warmup"), ("X", "phase:train"), ("X", "warm:all_reduce"),
            ("X", "step"), ("i", "exit"), ("i", "barrier:after_init"), ("C", "mem_gib (rank 1)")} <= names
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {0: "rank 0 (local 0)", 1: "rank 1 (local 1)"}
    cats = {e["name"]: e.get("cat") for e in trace["traceEvents"] if e["ph"] == "X"}
    assert cats["phase:train"] == "phase" and cats["warm:all_reduce"] == "collective"
    assert cats["barrier:after_init"] == "barrier" and cats["step"] == "train"


def test_spans_cut_by_a_crash_end_at_the_last_event_and_are_marked(tmp_path: Path) -> None:
    _write(tmp_path, 0, [_ev(100, "begin", "phase:train"), _ev(110, "begin", "step", step=1),
                         _ev(150, "end", "step", step=1, dur_us=40, loss=0.5), _ev(160, "end", "phase:train"),
                         _ev(170, "instant", "exit", exit_code=0)])
    _write(tmp_path, 1, [_ev(105, "begin", "phase:train", rank=1), _ev(112, "begin", "step", rank=1, step=1),
                         _ev(120, "begin", "save", rank=1), _ev(140, "instant", "fault_drill", rank=1,
                                                                  action="crash")],
           torn='{"t": 141, "rank": 1, "kin')
    trace = timeline.build_trace(timeline.load(tmp_path))
    check_trace(trace)
    cut = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 1}
    assert set(cut) == {"phase:train (cut)", "step 1 (cut)", "save (cut)"}  # a step slice carries its number
    for e in cut.values():  # closed at rank 1's last event (t=140, ts relative to t=100)
        assert e["ts"] + e["dur"] == 40 and "died" in e["args"]["cut"]
    whole = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    assert all("cut" not in e["args"] for e in whole)
    assert [e for e in trace["traceEvents"] if e["ph"] == "C"][0]["args"] == {"value": 0.5}


def test_end_without_begin_is_rebuilt_from_its_duration() -> None:
    spans = rank_spans(0, [_ev(500, "end", "commit", dur_us=200), _ev(600, "instant", "exit")])
    assert [(s.name, s.start_us, s.end_us, s.cut) for s in spans] == [("commit", 300, 500, False)]


def test_unfinished_inner_span_is_cut_when_its_parent_ends() -> None:
    spans = rank_spans(0, [_ev(0, "begin", "phase:train"), _ev(1, "begin", "step"), _ev(9, "end", "phase:train")])
    by_name = {s.name: s for s in spans}
    assert by_name["step"].cut and by_name["step"].end_us == 9 and not by_name["phase:train"].cut
    assert by_name["step"].depth == 1 and by_name["phase:train"].depth == 0


def test_hosts_become_processes(tmp_path: Path) -> None:
    _write(tmp_path, 0, [{**_ev(0, "instant", "exit"), "host": "node-a"}])
    _write(tmp_path, 1, [{**_ev(5, "instant", "exit", rank=1), "host": "node-b"}])
    trace = timeline.build_trace(timeline.load(tmp_path))
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert procs == {0: "node-a", 1: "node-b"}
    assert {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "i"} == {(0, 0), (1, 1)}


def test_not_a_run_directory_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="is not a directory"):
        timeline.load(tmp_path / "missing")
    with pytest.raises(UsageError, match="no events in .*rank_<R>.jsonl"):
        timeline.load(tmp_path)
    _write(tmp_path, 0, [], torn="not json\n")
    with pytest.raises(UsageError, match="no events"):
        timeline.main(tmp_path)


def test_main_writes_the_trace_gzip_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _real_run(tmp_path)
    assert timeline.main(tmp_path, out=tmp_path / "t.json.gz", no_png=True) == 0
    check_trace(json.loads(gzip.decompress((tmp_path / "t.json.gz").read_bytes())))
    assert "ui.perfetto.dev" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert timeline.main(tmp_path) == 0
    assert (tmp_path / "trace.json").is_file()
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("what, files", [("png", {"trace.json", "timeline.png"}), ("trace", {"trace.json"}),
                                         ("off", set())])
def test_the_end_of_a_job_leaves_what_run_timeline_says(tmp_path: Path, what: str, files: set[str]) -> None:
    if what == "png":
        pytest.importorskip("matplotlib")
    _real_run(tmp_path)
    timeline.end_of_job(tmp_path, what)
    assert {p.name for p in tmp_path.iterdir() if p.is_file()} == files


def test_without_matplotlib_the_trace_is_still_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    _real_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` sees when it is not installed
    assert timeline.main(tmp_path) == 0
    assert (tmp_path / "trace.json").is_file() and not (tmp_path / "timeline.png").exists()
    assert "matplotlib is not installed (pip install 'megatron-lifecycle[plot]')" in capsys.readouterr().err


def test_gantt_draws_cut_phases_failure_paths_and_markers(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from lifecycle.obs import gantt

    _write(tmp_path, 0, [_ev(0, "begin", "phase:train"), _ev(5, "instant", "hang_report", cause="late rank"),
                         _ev(6, "instant", "failure", error="HangError"), _ev(7, "end", "phase:train"),
                         _ev(7, "begin", "phase:teardown", phase="teardown", failure=True),
                         _ev(9, "end", "phase:teardown", phase="teardown"), _ev(9, "instant", "exit")])
    _write(tmp_path, 1, [_ev(1, "begin", "phase:train", rank=1), _ev(4, "instant", "fault_drill", rank=1)])
    out = gantt.plot(timeline.load(tmp_path), tmp_path / "g.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size < 200_000


def _hostile_run(run_dir: Path) -> None:
    """One good rank, and every kind of broken content issue 11 found (wrong types, bad bytes, a folder)."""
    good = [_ev(100, "begin", "phase:train"), _ev(200, "end", "phase:train", dur_us=100),
            _ev(150, "scalar", "mem", value=float("nan"))]
    wrong = [{"t": "x", "kind": "begin", "name": "a"}, {"t": 1, "kind": 5, "name": "a"},
             _ev(1, "end", "q", dur_us="abc"), {**_ev(1, "instant", "a"), "host": ["x"]},
             _ev(10**30, "instant", "late"), {**_ev(1, "instant", "b"), "t": True}, _ev(-5, "instant", "early"),
             {**_ev(1, "instant", "c"), "rank": "zero"}]
    _write(run_dir, 0, good + wrong)
    with open(run_dir / "events" / "rank_0.jsonl", "ab") as f:
        f.write(b"\xff\xfe not UTF-8\n[1, 2]\n" + b"[" * 100_000 + b"\n" + b"9" * 5000 + b"\n" + b'{"t": 12')
    (run_dir / "events" / "rank_1.jsonl").write_bytes(bytes(range(256)) * 8)
    (run_dir / "events" / "rank_2.jsonl").mkdir()
    (run_dir / "events" / "rank_x.jsonl").write_text("{}\n")


@pytest.mark.timeout(30)
def test_malformed_lines_events_and_files_are_skipped_and_counted(tmp_path: Path) -> None:
    _hostile_run(tmp_path)
    problems: list[str] = []
    events = timeline.load(tmp_path, problems)
    assert list(events) == [0] and [e["name"] for e in events[0]] == ["phase:train", "phase:train", "mem"]
    expected = ["rank_0.jsonl: 5 malformed lines skipped", "rank_1.jsonl: 9 malformed lines skipped",
                "rank_2.jsonl: not a regular file; skipped", "rank_x.jsonl: not a rank number; skipped",
                "rank_0.jsonl: 8 malformed events skipped (a wrong type of t, kind, name, host, rank or dur_us)"]
    assert sorted(problems) == sorted(expected)
    trace = timeline.build_trace(events)
    check_trace(trace)
    assert not [e for e in trace["traceEvents"] if e["ph"] == "C"]  # a nan value draws no counter
    scanned: list[str] = []  # the streaming first pass of `lifecycle timeline` finds the same
    assert list(timeline.scan(tmp_path, scanned)) == [0] and sorted(scanned) == sorted(expected)


@pytest.mark.timeout(60)
def test_main_says_what_it_skipped_and_never_crashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _hostile_run(tmp_path)
    assert timeline.main(tmp_path, no_png=True) == 0
    err = capsys.readouterr().err
    assert "skipped  rank_0.jsonl: 5 malformed lines skipped" in err and "rank_2.jsonl: not a regular" in err
    check_trace(json.loads((tmp_path / "trace.json").read_text()))


@pytest.mark.parametrize(("out", "match"), [
    ("{tmp}", "--out {tmp}: is a directory; give a file name"),
    ("{tmp}/events/rank_0.jsonl/t.json", "rank_0.jsonl is a file, not a folder; choose another place"),
    ("/proc/lifecycle-test/t.json", "cannot create its folder"),
])
def test_output_paths_are_checked_before_anything_is_written(tmp_path: Path, out: str, match: str) -> None:
    _real_run(tmp_path)
    with pytest.raises(UsageError, match=re.escape(match.format(tmp=tmp_path))):
        timeline.main(tmp_path, out=out.format(tmp=tmp_path), no_png=True)
    assert not (tmp_path / "trace.json").exists()


@pytest.mark.parametrize(("flag", "kind"), [("--out", "device"), ("--out", "fifo"), ("--out", "socket"),
                                           ("--png", "fifo"), ("--out", "dev")])
def test_devices_fifos_sockets_and_system_folders_are_refused_never_replaced(
        tmp_path: Path, flag: str, kind: str) -> None:
    import os
    import socket
    import stat

    _real_run(tmp_path)
    target = {"device": Path("/dev/full"), "dev": Path("/dev/lifecycle-trace.json")}.get(kind, tmp_path / "out" / kind)
    target.parent.mkdir(exist_ok=True)
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(target))
    what = {"device": "is a character device", "fifo": "is a FIFO", "socket": "is a socket",
            "dev": "lies under /dev, a system folder"}[kind]
    with pytest.raises(UsageError, match=re.escape(f"{flag} {target}: {what}")):
        timeline.main(tmp_path, out=target) if flag == "--out" else timeline.main(tmp_path, png=target)
    assert not (tmp_path / "trace.json").exists() and not (tmp_path / "timeline.png").exists()  # nothing written
    if kind != "dev":
        assert not stat.S_ISREG(os.lstat(target).st_mode)
    assert not Path("/dev/lifecycle-trace.json").exists() and stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_a_link_in_the_run_directory_is_replaced_never_written_through(tmp_path: Path) -> None:
    _real_run(tmp_path)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.json"
    outside.write_text("mine")
    (tmp_path / "trace.json").symlink_to(outside)
    assert timeline.main(tmp_path, no_png=True) == 0
    assert outside.read_text() == "mine" and not (tmp_path / "trace.json").is_symlink()
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


def test_an_unwritable_png_is_a_usage_error(tmp_path: Path) -> None:
    _real_run(tmp_path)
    with pytest.raises(UsageError, match="--png .*/proc/version"):
        timeline.main(tmp_path, png="/proc/version")


_NAMES = ("phase:init", "phase:train", "step", "save", "commit", "warm:all_reduce", "barrier:x", "init_process_group")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.tuples(st.sampled_from(["begin", "end", "instant", "scalar"]), st.sampled_from(_NAMES),
                                   st.integers(0, 50)), max_size=40), min_size=1, max_size=3))
def test_the_streamed_trace_is_the_in_memory_one_and_the_gantt_keeps_every_phase(
        rows: list[list[tuple[str, str, int]]]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        t = 1000
        for rank, row in enumerate(rows):
            events = [_ev(t, "instant", "attempt", rank=rank, attempt=1)]
            for kind, name, dt in row:  # any order: unmatched ends, unclosed begins, cut spans
                t += dt
                events.append(_ev(t, kind, name, rank=rank, step=dt, value=1.0, loss=0.5))
            _write(run_dir, rank, events)
        heads = timeline.scan(run_dir)
        n, drawn = timeline.write_streaming(heads, run_dir / "t.json", {})
        streamed = json.loads((run_dir / "t.json").read_text())
        in_memory = timeline.build_trace(timeline.load(run_dir))
        check_trace(streamed)

        def key(e: dict[str, Any]) -> str:
            return json.dumps(e, sort_keys=True)

        assert sorted(map(key, streamed["traceEvents"])) == sorted(map(key, in_memory["traceEvents"]))
        assert n == sum(e["ph"] != "M" for e in in_memory["traceEvents"])
        assert streamed["metadata"] == in_memory["metadata"]
        full = timeline.load(run_dir)
        for rank in full:  # the Gantt's phase bars from the kept events are those of all the events
            def phases(evs: list[dict[str, Any]], r: int = rank) -> list[tuple[str, int, int, bool]]:
                return [(s.name, s.start_us, s.end_us, s.cut) for s in rank_spans(r, evs) if phase_of(s)]

            assert phases(drawn[rank]) == phases(full[rank])


def test_the_gantt_keeps_about_two_ticks_per_drawn_step_of_a_long_run(tmp_path: Path) -> None:
    events = [_ev(0, "begin", "phase:train")]
    for step in range(1, 5001):
        events += [_ev(10 * step, "begin", "step", step=step), _ev(10 * step + 5, "end", "step", step=step)]
    _write(tmp_path, 0, events)  # no end of phase:train: cut at the last step's end
    _, drawn = timeline.write_streaming(timeline.scan(tmp_path), tmp_path / "t.json.gz", {})
    steps = [e for e in drawn[0] if e["name"] == "step"]
    assert 2 * gantt.MAX_TICKS <= len(steps) // 2 <= 4 * gantt.MAX_TICKS
    cut = [s for s in rank_spans(0, drawn[0]) if s.name == "phase:train"]
    assert cut[0].cut and cut[0].end_us == 50005
    assert json.loads(gzip.decompress((tmp_path / "t.json.gz").read_bytes()))["metadata"]["ranks"] == 1
