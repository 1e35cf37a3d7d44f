"""JSON inputs: Flight Recorder JSON dumps, torch elastic's error files (``TORCHELASTIC_ERROR_FILE``), and
lifecycle's own ``hang_report.json`` (a run directory gets the verdict its watchdog wrote).

An error file's rank comes from torchrun's failure summary (``error_file: <path>`` under ``rank : <r>``), from
lifecycle's own ``lifecycle.rank`` field, or from its name (``rank_<r>.error.json`` in a lifecycle run directory).
JSON is read bounded (:data:`files.MAX_JSON`) and a document nested too deeply is refused, never followed.
Pure Python.
"""

from __future__ import annotations

import re
from pathlib import Path

from lifecycle import rundir
from lifecycle.diagnose import dumps, files, lines
from lifecycle.diagnose import facts as F
from lifecycle.diagnose.facts import Evidence, Fact
from lifecycle.diagnose.logs import Reader
from lifecycle.jsontypes import JsonDict

ERROR_NAME = re.compile(r"^rank_(?P<rank>\d{1,7})\.error\.json$")
CAUSES = {"hang": "never entered", "unresponsive": "never entered", "dead": "crashed", "failed": "crashed",
          "usage": "crashed", "sequence": "diverged", "lost": "network link"}
PHASES = {"init": "init", "warmup": "warmup", "train": "train", "checkpoint": "checkpoint", "teardown": "exit"}


def read_json(path: Path, reader: Reader) -> bool:
    """Read one JSON input; False when it is no file this reads (it is then only counted)."""
    raw = files.read_bounded(path, files.MAX_JSON, "JSON input")
    value = dumps.loads_json(raw, path)
    if not isinstance(value, dict):
        return False
    if isinstance(value.get("version"), str) and ("entries" in value or "pg_config" in value):
        _dump(path, value, reader.ev)
        return True
    if "culprits" in value and "cause" in value and "waits" in value:
        _hang_report(path, value, reader.ev)
        return True
    if isinstance(value.get("message"), dict | str):
        _error_file(path, value, reader)
        return True
    return False


def _dump(path: Path, value: JsonDict, ev: Evidence) -> None:
    if not dumps.VERSION.match(value["version"]):
        raise files.RunDirError(f"{path}: Flight Recorder dump version {value['version'][:20]!r} is not one PyTorch "
                                f"2.x writes", path=str(path))
    add_dump(ev, dumps.summarize(value, str(path), path))


def add_dump(ev: Evidence, dump: F.Dump) -> None:
    if dump.rank in ev.dumps:
        ev.notes.append(f"two dumps say they are rank {dump.rank}: {ev.dumps[dump.rank].where} and {dump.where}; "
                        f"the first is used")
        return
    ev.dumps[dump.rank] = dump
    ev.descs.update({g: d for g, d in dump.descs.items() if d and g not in ev.descs})
    for g, ranks in dump.members.items():
        ev.members.setdefault(g, ranks)
    if dump.world:
        ev.see_world(dump.world)
    if F.DEFAULT in dump.members:
        ev.see_world(len(dump.members[F.DEFAULT]))


def _hang_report(path: Path, value: JsonDict, ev: Evidence) -> None:
    culprits = tuple(r for r in value.get("culprits") or [] if isinstance(r, int))
    wait = _wait_of(value, culprits)
    phase = value.get("phase") if isinstance(value.get("phase"), str) else None
    ev.add(Fact(F.REPORT, None, str(path), ranks=culprits, cause=CAUSES.get(str(value.get("cause")), "crashed"),
                stage=PHASES.get(phase or ""), detail=f"lifecycle's hang report: {str(value.get('detail'))[:300]}",
                group=wait.get("group"), seq=wait.get("seq"), op=wait.get("op")))
    if isinstance(value.get("world_size"), int):
        ev.see_world(value["world_size"])
    group, members = wait.get("group"), wait.get("members")
    if isinstance(group, str) and isinstance(members, list) and all(isinstance(r, int) for r in members):
        # lifecycle names a group by the dimensions that share its ranks ("dp", "tp=mp=tp_cp"): the first is its own
        ev.members.setdefault(group, tuple(members))
        ev.descs.setdefault(group, group.split("=")[0])


def _report_order(fact: Fact) -> tuple[int, int, str]:
    """The current attempt's full report first: the run directory's own ``hang_report.json`` (its current attempt),
    then ``attempts/<N>/`` from the newest; a rank's local report (``hang_report.<R>.json``) after a full one."""
    path = Path(fact.where)
    attempt = path.parent.name if path.parent.parent.name == rundir.ATTEMPTS_DIR else ""
    newest = -int(attempt) if attempt.isdigit() else -(1 << 30)
    return int(path.name != rundir.HANG_REPORT), newest, fact.where


def keep_current_report(ev: Evidence) -> None:
    """Of several lifecycle hang reports (a run restarted: ``attempts/<N>/hang_report.json``), keep the current
    attempt's: the verdict is the one its own ``hang_report.json`` gives."""
    reports = sorted(ev.of(F.REPORT), key=_report_order)
    if len(reports) < 2:
        return
    ev.facts = [f for f in ev.facts if f.kind != F.REPORT or f is reports[0]]
    ev.notes.append(f"{len(reports)} lifecycle hang reports: {reports[0].where} is the current attempt's and is "
                    f"used; the others describe earlier attempts")


def _wait_of(report: JsonDict, culprits: tuple[int, ...]) -> JsonDict:
    found = report.get("waits")
    for wait in (found.values() if isinstance(found, dict) else []):
        if isinstance(wait, dict) and set(wait.get("missing") or []) & set(culprits):
            return {k: wait.get(k) for k in ("group", "seq", "op", "members")}
    return {}


def _error_file(path: Path, value: JsonDict, reader: Reader) -> None:
    message = value["message"]
    text = str(message.get("message") if isinstance(message, dict) else message)[:2000]
    kind = F.CONSEQUENCE if lines.is_consequence(text) else F.CRASH
    fact = Fact(kind, None, f"{path}:1", detail=text[:500], stage=lines.stage_of(text))
    own = value.get("lifecycle")
    mapped = next((v for k, v in reader.errfiles.items() if Path(k).parts[-3:] == path.parts[-3:]), None)
    name = ERROR_NAME.match(path.name)
    if isinstance(own, dict) and isinstance(own.get("rank"), int) and own["rank"] >= 0:
        fact.rank = own["rank"]
    elif mapped is not None:
        fact.rank = mapped[1]
    elif name:
        fact.rank = int(name.group("rank"))
    else:
        reader.ev.unattributed += 1
        return
    reader.ev.add(fact)
