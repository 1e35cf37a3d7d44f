"""The inputs besides recorded consoles and dumps: torch elastic's error files, lifecycle's own run directories
(recorded from lifecycle's fault drills: the verdict is the one their ``hang_report.json`` gives), the launchers'
prefixes one by one, and gloo's line shapes (third_party/gloo/gloo/transport/tcp/pair.cc)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from lifecycle.diagnose import diagnose, lines, prefixes
from lifecycle.errors import RunDirError

DATA = Path(__file__).resolve().parents[2] / "data" / "diagnose"
RUNDIRS = DATA / "rundirs"
# torch/distributed/elastic/multiprocessing/errors/__init__.py: the failure summary torchrun prints
SUMMARY = """[rank0]: Traceback (most recent call last):
[rank0]: torch.distributed.DistBackendError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error \
[127.0.0.1]:40121: Connection reset by peer
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-26_10:00:00
  host      : node3
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4101)
  error_file: {errdir}/attempt_0/0/error.json
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_10:00:00
  host      : node3
  rank      : 5 (local_rank: 1)
  exitcode  : 1 (pid: 4102)
  error_file: {errdir}/attempt_0/1/error.json
  traceback : Traceback (most recent call last):
============================================================
"""


def _error_file(path: Path, exc_type: str, message: str) -> None:
    """As torch's ErrorHandler.record_exception writes it (error_handler.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"message": {"message": f"{exc_type}: {message}", "extraInfo": {
        "py_callstack": f"Traceback (most recent call last):\n  File \"train.py\", line 9, in step\n{exc_type}: "
                        f"{message}\n", "timestamp": "1795725419"}}}))


def test_an_elastic_error_file_gets_its_rank_from_torchruns_summary(tmp_path: Path) -> None:
    errdir = tmp_path / "torchelastic_x" / "job"
    _error_file(errdir / "attempt_0" / "1" / "error.json", "ValueError", "bad batch at step 7")
    _error_file(errdir / "attempt_0" / "0" / "error.json", "torch.distributed.DistBackendError",
                "Read error [127.0.0.1]:40121: Connection reset by peer")
    (tmp_path / "console.txt").write_text(SUMMARY.format(errdir=errdir))
    out = diagnose([str(tmp_path)]).as_json()
    assert out["culprits"] == [5] and out["cause"] == "crashed", out  # rank 5 = local 1 of that node
    assert any("attempt_0/1/error.json" in w for w in out["evidence"])
    assert out["hosts"] == ["node3"]


def test_an_error_file_without_a_summary_takes_its_rank_from_lifecycle_or_its_name(tmp_path: Path) -> None:
    _error_file(tmp_path / "logs" / "rank_2.error.json", "RuntimeError", "CUDA error: an illegal memory access")
    assert diagnose([str(tmp_path)]).as_json()["culprits"] == [2]
    alone = tmp_path / "other"
    _error_file(alone / "error.json", "RuntimeError", "boom")
    out = diagnose([str(alone)]).as_json()
    assert out["culprits"] == [] and out["inputs"]["unattributed_lines"] == 1


def test_a_lifecycle_run_directory_gives_the_verdict_of_its_hang_report() -> None:
    run = RUNDIRS / "train_stall"
    report = json.loads((run / "hang_report.json").read_text())
    out = diagnose([str(run)]).as_json()
    assert out["culprits"] == report["culprits"] == [1]
    assert out["cause"] == "never entered" and out["stage"] == report["phase"] == "train"
    assert out["group"] == {"name": "world", "desc": "world", "ranks": [0, 1, 2, 3]}
    # events/*.jsonl, restarts.jsonl, the checkpoints' .pt files are no input: counted as skipped, never refused
    assert out["inputs"]["skipped_files"] >= 9


def test_a_restarted_run_gives_the_current_attempts_verdict() -> None:
    out = diagnose([str(RUNDIRS / "restarted")]).as_json()
    assert out["culprits"] == [3] and out["cause"] == "never entered"  # attempt 3; attempts 1 and 2 named 1, 2
    assert out["evidence"] == [str(RUNDIRS / "restarted" / "hang_report.json")]
    assert any("earlier attempts" in n for n in out["notes"])


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (str(self.marker),))


def test_a_pickle_met_in_a_folder_that_is_no_dump_is_skipped_and_never_run(tmp_path: Path) -> None:
    run = shutil.copytree(RUNDIRS / "train_stall", tmp_path / "run")
    marker = tmp_path / "pwned"
    (run / "checkpoints" / "legacy.pt").write_bytes(pickle.dumps({"model": Payload(marker)}, protocol=2))
    (run / "checkpoints" / "plain.pkl").write_bytes(pickle.dumps({"step": 3}, protocol=2))
    out = diagnose([str(run)]).as_json()
    assert out["culprits"] == [1] and not marker.exists()
    assert sum("no Flight Recorder dump" in n for n in out["notes"]) == 2


@pytest.mark.parametrize(("line", "rank", "local", "text"), [
    ("[rank3]:[E1126 10:00:00.1 ProcessGroupGloo.cpp:143] x", 3, None, "x"),
    ("[default1]:Traceback (most recent call last):", None, 1, "Traceback (most recent call last):"),
    ("[trainer12]:[rank13]: boom", 13, 12, "boom"),
    ("[rank 2] lifecycle watchdog: HANG", 2, None, "lifecycle watchdog: HANG"),
    ("(RayTrainWorker pid=4242, ip=10.0.0.7) [rank5]: ValueError: x", 5, None, "ValueError: x"),
])
def test_launcher_prefixes(line: str, rank: int | None, local: int | None, text: str) -> None:
    who = prefixes.split(line, labelled=False)
    assert (who.rank, who.local, who.text) == (rank, local, text)


def test_srun_label_prefixes_give_the_task_or_the_node() -> None:
    alone = prefixes.split("7: ValueError: x", labelled=True)
    assert (alone.rank, alone.text) == (7, "ValueError: x")  # srun tasks are ranks
    node = prefixes.split("1: [default2]:ValueError: x", labelled=True)
    assert (node.rank, node.local) == (None, 2)  # torchrun under srun: the label is the node, the rank is local
    assert prefixes.labelled(b"0: a\n1: b\n0: c\n1: d\n") and not prefixes.labelled(b"step 1\nstep 2\n0: x\n")
    ray = prefixes.split("(RayTrainWorker pid=4242, ip=10.0.0.7) step 3", labelled=False)
    assert (ray.pid, ray.host) == (4242, "10.0.0.7")


@pytest.mark.parametrize("message", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:9482",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:40121: Connection reset by peer",
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation to "
    "complete",
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:133] Timed out waiting 3000ms for send operation to "
    "complete",
    "NCCL communicator was aborted on rank 3.",
])
def test_gloo_and_nccl_failures_caused_by_a_peer_are_consequences(message: str) -> None:
    assert lines.is_consequence(message)
    assert not lines.is_consequence("ValueError: bad batch at step 3 (injected)")


def test_a_victim_is_never_named_when_the_stalled_ranks_dump_is_lost(tmp_path: Path) -> None:
    # plain_stall_inside_fr (culprit rank 2) without rank 2's dump, the one most often lost: rank 0 waits in dp for
    # rank 2, and gloo's dumps neither record dp's members nor say that rank 0 left the op it entered
    case = Path(__file__).resolve().parents[2] / "data" / "diagnose" / "cases" / "plain_stall_inside_fr"
    shutil.copytree(case, tmp_path / "case")
    (tmp_path / "case" / "fr" / "fr_trace_rank_2.json").unlink()
    out = diagnose([str(tmp_path / "case")]).as_json()
    assert out["culprits"] == [], out
    assert any("group 3 (dp)" in m for m in out["missing"]), out["missing"]


def test_an_unusable_dump_is_skipped_and_named_and_alone_it_exits_2(tmp_path: Path) -> None:
    case = Path(__file__).resolve().parents[2] / "data" / "diagnose" / "cases" / "plain_stall_inside_fr"
    shutil.copytree(case, tmp_path / "case")
    (tmp_path / "case" / "fr" / "fr_trace_rank_3.json").rename(tmp_path / "case" / "fr" / "rank3.trace")
    out = diagnose([str(tmp_path / "case")]).as_json()
    assert any("rank3.trace" in n for n in out["notes"]) and any("rank3.trace" in m for m in out["missing"])
    assert sorted(out["inputs"]["dumps"]) == ["0", "1", "2"]
    alone = tmp_path / "alone"
    alone.mkdir()
    (tmp_path / "case" / "fr" / "rank3.trace").rename(alone / "rank3.trace")
    with pytest.raises(RunDirError, match="does not tell its rank"):
        diagnose([str(alone)])


def test_a_deeply_nested_json_array_is_refused_not_read_as_a_log(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(RunDirError, match="nested too deeply"):
        diagnose([str(deep)])


C10D = "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py"


def test_torchruns_summary_names_a_rank_that_exited_first_with_its_own_code(tmp_path: Path) -> None:
    # console only (torchrun --tee, no --log-dir): rank 2 exited 7 (sys.exit: no traceback), the others were
    # SIGTERMed by torchrun afterwards
    lines = [f"[rank{r}]: step 1: loss 4.0" for r in range(4)]
    lines += ["Failures:"]
    for i, r in enumerate((0, 1, 3)):
        lines += [f"[{i + 1}]:", "  host      : node0", f"  rank      : {r} (local_rank: {r})",
                  f"  exitcode  : -15 (pid: {100 + r})  (SIGTERM)", "  error_file: <N/A>"]
    lines += ["Root Cause (first observed failure):", "[0]:", "  host      : node0", "  rank      : 2 (local_rank: 2)",
              "  exitcode  : 7 (pid: 102) ", "  error_file: <N/A>"]
    (tmp_path / "console.txt").write_text("\n".join(lines) + "\n")
    out = diagnose([str(tmp_path)]).as_json()
    assert out["culprits"] == [2] and out["cause"] == "crashed", out
    # a rank whose own lines say it failed waiting for a peer is a victim, first observed or not
    lines[3:3] = ["[rank2]: Traceback (most recent call last):", f'[rank2]:   File "{C10D}", line 3252, in all_reduce',
                  "[rank2]: RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.3]:29500"]
    (tmp_path / "console.txt").write_text("\n".join(lines) + "\n")
    assert diagnose([str(tmp_path)]).as_json()["culprits"] == []
