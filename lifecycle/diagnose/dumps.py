"""Flight Recorder dumps, pickle or JSON, as PyTorch writes them (``version`` "2.2" ... "2.10"; torch 2.6 writes
"2.4" or "2.5", torch 2.13 "2.10"; the fields read here exist in all of them: ``pg_config``, ``pg_status``,
``entries`` with ``process_group``, ``collective_seq_id``, ``profiling_name``, ``record_id``, ``frames``).

Which rank wrote a dump is read from the dump: the only rank in every group its ``pg_config`` lists (a rank
records only the groups it belongs to). A dump that cannot tell (gloo's dumps list no group; a job with only the
default group) takes the rank from its file name (torch names them ``<prefix><rank>``), and the verdict says so;
when both exist and disagree, the dump wins. Never ``eval``: rank lists are parsed as digits and commas only.
Pure Python.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from lifecycle.diagnose import facts as F
from lifecycle.diagnose import files, safepickle
from lifecycle.diagnose.facts import Dump, DumpOp
from lifecycle.errors import RunDirError, UnusableInput
from lifecycle.jsontypes import Json, JsonDict

VERSION = re.compile(r"^2\.(\d{1,3})$")
RANK_LIST = re.compile(r"^\[\s*\d*(?:\s*,\s*\d+)*\s*\]$")
PEER = re.compile(r"\s*(\d{1,7})\s*(?:->|<-)\s*(\d{1,7})\s*$")
"""NCCL names a point-to-point op with its ends as group ranks: ``nccl:send 0->1``, ``nccl:recv 1<-0``."""
FILE_RANK = re.compile(r"(\d{1,7})(?:\.(?:json|pkl|pickle|bin))?$")
MAX_ENTRIES = 200_000
MAX_FRAMES = 24
FRAMED = 8
"""The last entries of a dump whose stack frames are kept."""


def _refuse(path: Path, why: str) -> RunDirError:
    return RunDirError(f"{path}: {why}", path=str(path))


def load(path: Path, kind: str, *, named: bool = True) -> JsonDict | None:
    """The dump's top-level mapping, read safely (pickle: the restricted loader; JSON: bounded, depth-checked).
    A file named on the command line that is no dump is a RunDirError; one met while walking a folder (``named``
    False: a checkpoint, an optimizer state, any other pickle) is None, to be skipped and counted."""
    raw = files.read_bounded(path, files.MAX_DUMP, "Flight Recorder dump")
    foreign = "refuse" if named else "none"
    value: Json = safepickle.loads(raw, path, foreign=foreign) if kind == "pickle" else loads_json(raw, path)
    if not isinstance(value, dict) or not isinstance(value.get("version"), str):
        if not named:
            return None
        raise _refuse(path, "not a Flight Recorder dump (no 'version' key)")
    if not VERSION.match(value["version"]):
        raise _refuse(path, f"Flight Recorder dump version {value['version'][:20]!r} is not one PyTorch 2.x writes")
    return value


def loads_json(raw: bytes, path: Path) -> Json:
    try:
        return json.loads(raw)
    except RecursionError:
        raise _refuse(path, "JSON nested too deeply: refused") from None
    except ValueError as exc:
        raise _refuse(path, f"not valid JSON ({str(exc)[:200]})") from None


def summarize(value: JsonDict, where: str, path: Path) -> Dump:
    members, descs = _pg_config(value.get("pg_config"), path)
    everyone = members.pop("", None)
    ops = _entries(value.get("entries"), path)
    rank, rank_from = _rank(members, path)
    dump = Dump(rank, where, value["version"], rank_from, ops, descs=descs, members=members,
                world=len(everyone) if everyone else None, wrapped=bool(ops) and ops[0].record > 0,
                states=any(op.state in ("started", "completed") for op in ops) or _nccl(value.get("entries")))
    for op in ops:
        if not op.p2p:
            dump.enq[op.group] = max(dump.enq.get(op.group, 0), op.seq)
        if op.desc:
            dump.descs.setdefault(op.group, op.desc)
    return dump


def _nccl(entries: Json) -> bool:
    """An NCCL dump (its ops are asynchronous: only a recorded state proves one finished)."""
    first = entries[-1] if isinstance(entries, list) and entries else None
    name = first.get("profiling_name") if isinstance(first, dict) else None
    return isinstance(name, str) and name.startswith("nccl:")


def _pg_config(config: Json, path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Group name -> member ranks and desc; the unnamed entry gloo writes (all ranks) is kept under ``""``."""
    members: dict[str, tuple[int, ...]] = {}
    descs: dict[str, str] = {}
    if not isinstance(config, dict):
        return members, descs
    for name, info in list(config.items())[:100_000]:
        if not isinstance(info, dict) or not isinstance(name, str):
            continue
        ranks = info.get("ranks")
        parsed = _ranks(ranks)
        if parsed:
            members[name] = parsed
        if name and isinstance(info.get("desc"), str):
            descs[name] = info["desc"][:200]
    return members, descs


def _ranks(value: Json) -> tuple[int, ...] | None:
    if isinstance(value, list) and all(isinstance(r, int) for r in value):
        return tuple(value)
    if isinstance(value, str) and len(value) < 10_000_000 and RANK_LIST.match(value):
        return tuple(int(r) for r in re.findall(r"\d+", value))
    return None


def _entries(entries: Json, path: Path) -> list[DumpOp]:
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise _refuse(path, "its 'entries' is not a list: not a Flight Recorder dump")
    pairs = [(op, e) for e in entries[-MAX_ENTRIES:] if (op := _entry(e)) is not None]
    pairs.sort(key=lambda pair: pair[0].record)
    # only the stacks of the last ops are read (where the rank waits): the others would cost time and memory at
    # thousands of ranks; the last collective's too when point-to-point ops (pipeline stages) follow it
    last = next(((op, e) for op, e in reversed(pairs) if not op.p2p), None)
    for op, e in [*pairs[-FRAMED:], *([last] if last else [])]:
        op.frames = _frames(e.get("frames") if isinstance(e, dict) else None)
    return [op for op, _ in pairs]


def _entry(e: Json) -> DumpOp | None:
    if not isinstance(e, dict):
        return None
    pg, seq, name = e.get("process_group"), e.get("collective_seq_id"), e.get("profiling_name")
    if not (isinstance(pg, list | tuple) and pg and isinstance(pg[0], str) and isinstance(seq, int)
            and isinstance(name, str)):
        return None
    p2p = e.get("is_p2p") is True or any(w in name for w in ("send", "recv"))
    record_id = e.get("record_id")
    record = record_id if isinstance(record_id, int) else 0
    sizes = sys.intern(str(e.get("input_sizes"))[:120]) if isinstance(e.get("input_sizes"), list) else ""
    desc = sys.intern(pg[1][:200]) if len(pg) > 1 and isinstance(pg[1], str) else ""
    p2p_seq = e.get("p2p_seq_id")
    state = e.get("state")
    peer = PEER.search(name) if p2p else None
    op = sys.intern((PEER.sub("", name.split(":")[-1]).strip() if p2p else name.split(":")[-1])[:80])
    return DumpOp(sys.intern(pg[0][:200]), (p2p_seq if isinstance(p2p_seq, int) else 0) if p2p else seq,
                  op, sizes, int(record), "", p2p, desc, sys.intern(state[:20]) if isinstance(state, str) else "",
                  int(peer.group(2)) if peer else None)  # send a->b, recv a<-b: a is the rank, b its peer


def _frames(frames: Json) -> str:
    if not isinstance(frames, list):
        return ""
    names = [f"{f.get('name')} {f.get('filename')}" for f in frames[:MAX_FRAMES] if isinstance(f, dict)]
    return " | ".join(n[:200] for n in names)


def _rank(members: dict[str, tuple[int, ...]], path: Path) -> tuple[int, str]:
    common: set[int] | None = None
    for ranks in members.values():
        common = set(ranks) if common is None else common & set(ranks)
    named = FILE_RANK.search(path.name)
    if common is not None and len(common) == 1:
        return common.pop(), "the dump's groups"
    if named is None:
        raise UnusableInput(f"{path}: a Flight Recorder dump that does not tell its rank (its groups do not single one "
                       f"out) and whose file name does not end in the rank (torch names them <prefix><rank>)",
                       path=str(path))
    return int(named.group(1)), "the file name (the dump's groups do not single out a rank)"


def descs_of(dump: Dump) -> dict[str, str]:
    out = {F.DEFAULT: F.DEFAULT_DESC}
    out.update({g: d for g, d in dump.descs.items() if d})
    return out
