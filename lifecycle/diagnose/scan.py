"""Find the lines of a chunk that can matter, at the speed of ``bytes.find``: a log of 1 MB is mostly training output
that no parser uses, and one regular expression of ~30 alternatives visits every byte in Python's engine (~45 ms a
MB), while a search for each of a few literal words runs at memory speed (~0.4 ms a MB each).

Every line a parser of :mod:`lines` or :mod:`logs` uses holds one of :data:`NEEDLES` (the watchdog's lines say
"watchdog" or "enqueued", the store's and the rendezvous' "timeout"/"timed out", the desync report "lagging" or
"collective #", torchrun's summary "local_rank", "host", "exitcode", "error_file" ...). Megatron's ``iteration N/ M``
lines, one a step, are not parsed one by one: only the last of each chunk (:func:`last_iteration`), since the step a
job reached is the highest it logged. Pure Python.
"""

from __future__ import annotations

import re

NEEDLES = (b"Traceback", b"Error", b"Exception", b"Interrupt", b"imed out", b"imeout", b"atchdog", b"nqueued",
           b"NCCL WARN", b"exitcode", b"local_rank", b"closing signal", b"monitoredBarrier", b"lagging",
           b"collective #", b"onnection", b'File "', b" from ", b"terminate called", b"what(", b"host ",
           b"error_file", b"PG GUID", b"Root Cause")
ITERATION = re.compile(rb"\biteration\s+(?P<it>\d+)\s*/\s*\d+")
LOOK_BACK = 64
"""How many ``iteration`` words are tried from the end of a chunk (a line may say it several times)."""


def candidates(data: bytes) -> list[int]:
    """The start of every line of ``data`` that holds a needle, in order, each once."""
    starts: set[int] = set()
    for needle in NEEDLES:
        at = data.find(needle)
        while at != -1:
            start = data.rfind(b"\n", 0, at) + 1
            starts.add(start)
            end = data.find(b"\n", at)
            if end == -1:
                break
            at = data.find(needle, end)
    return sorted(starts)


def last_iteration(data: bytes) -> tuple[int, int] | None:
    """(line start, iteration) of the last ``iteration N/ M`` line of ``data``, or None."""
    end = len(data)
    for _ in range(LOOK_BACK):
        at = data.rfind(b"iteration", 0, end)
        if at == -1:
            return None
        start = data.rfind(b"\n", 0, at) + 1
        stop = data.find(b"\n", at)
        m = ITERATION.search(data, start, stop if stop != -1 else len(data))
        if m is not None:
            return start, int(m.group("it"))
        end = at
    return None
