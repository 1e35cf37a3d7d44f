"""Which rank wrote a line: the prefixes launchers put in front of it, and what a file's name says.

- torch's own ``[rank<N>]:`` (global rank) and lifecycle's ``[rank <N>] ``;
- torchrun ``--tee``/``--log-dir``: ``[<role><local rank>]:`` (``[default0]:``) and ``attempt_<k>/<local>/std*.log``:
  a local rank, made global with the node's offset learned from lines that carry both, or from torchrun's failure
  summary (``rank : 5 (local_rank: 1)``): one torchrun numbers its node's ranks consecutively;
- ``srun --label``: ``<task>: `` at the start of every line of the file (the task id is the rank unless a torchrun
  prefix follows, then it is the node);
- Ray: ``(<actor> pid=<pid>, ip=<ip>) `` (the pid is tied to a rank by any line that carries both);
- a file named ``rank_<N>.log`` / ``rank<N>.txt`` (lifecycle's ``logs/rank_<N>.log`` and the usual convention).
Pure Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

RAY = re.compile(r"^\((?P<actor>[^\s()]+) pid=(?P<pid>\d+)(?:, ip=(?P<ip>[^)\s]+))?\) ")
LABEL = re.compile(r"^(?P<task>\d{1,6}): ")
TEE = re.compile(r"^\[(?!rank\d)(?P<role>[A-Za-z_][\w\-]*?)(?P<local>\d{1,6})\]:")
TORCH = re.compile(r"^\[rank(?P<rank>\d{1,7})\]:")
LIFECYCLE = re.compile(r"^\[rank (?P<rank>\d{1,7})\] ")
GLOG = re.compile(r"^\[?[IWEF]\d{4} [\d:.]+ (?:\d+ )?[\w./\-]+:\d+\] ")
FILE_RANK = re.compile(r"^rank[_\-]?(?P<rank>\d{1,7})(?:\.(?:log|txt|out|err))?$")
PRESENCE = re.compile(rb"(?m)^(?:\([^)\n]{1,160}\) )?(?:\d{1,6}: )?(?:\[[A-Za-z_][\w\-]{0,30}?\d{1,7}\]:){1,2}")


@dataclass
class Who:
    """What the prefixes of one line say about its writer; ``text`` is the line without them."""

    text: str
    rank: int | None = None
    local: int | None = None
    pid: int | None = None
    host: str | None = None


def split(line: str, *, labelled: bool) -> Who:
    who = Who(line)
    text = line
    m = RAY.match(text)
    if m:
        who.pid, who.host, text = int(m.group("pid")), m.group("ip"), text[m.end():]
    task = None
    if labelled and (m := LABEL.match(text)):
        task, text = int(m.group("task")), text[m.end():]
    text = _inner(text, who)
    if task is not None and who.local is None and who.rank is None:
        who.rank = task
    who.text = GLOG.sub("", text, count=1)
    return who


def _inner(text: str, who: Who) -> str:
    for _ in range(3):
        m = TEE.match(text)
        if m:
            who.local, text = int(m.group("local")), text[m.end():]
            continue
        m = TORCH.match(text) or LIFECYCLE.match(text)
        if m:
            who.rank, text = int(m.group("rank")), text[m.end():]
            if text.startswith(" ") and m.re is TORCH:
                text = text[1:]
            continue
        break
    return text


def labelled(head: bytes) -> bool:
    """Whether a file is ``srun --label`` output: nearly every one of its first lines starts ``<n>: ``."""
    lines = [x for x in head.split(b"\n")[:40] if x.strip()][:-1] or [x for x in head.split(b"\n") if x.strip()]
    if len(lines) < 2:
        return False
    tagged = sum(1 for x in lines if re.match(rb"^\d{1,6}: ", x))
    return tagged >= 0.9 * len(lines)


def of_path(path: Path) -> tuple[int | None, int | None, str]:
    """(global rank, local rank, scope) a file's path gives: ``rank_3.log`` -> global 3; torchrun's
    ``attempt_0/3/stderr.log`` -> local 3 in the scope of its attempt folder; the scope is where local ranks are
    made global (one torchrun)."""
    m = FILE_RANK.match(path.name)
    if m:
        return int(m.group("rank")), None, str(path)
    parent = path.parent
    if path.name in ("stdout.log", "stderr.log") and parent.name.isdigit() and parent.parent.name.startswith(
            "attempt_"):
        return None, int(parent.name), str(parent.parent)
    return None, None, str(path)


def presence(chunk: bytes, *, is_labelled: bool) -> set[tuple[int | None, int | None]]:
    """(rank, local) of every distinct prefix that starts a line of ``chunk``."""
    found = set()
    for prefix in set(PRESENCE.findall(chunk)):
        who = split(prefix.decode("utf-8", "replace") + " ", labelled=is_labelled)
        found.add((who.rank, who.local))
    return found
