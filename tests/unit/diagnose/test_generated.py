"""Never a wrong culprit, on 4,000 generated failures (tests/unit/diagnose/failures.py): every layout shape, fault
and loss of evidence the generator makes; the verdict names the culprit or nobody, never another rank. Two worker
processes (pure Python, no torch, no process group), about 11 s on 2 cores. ``make bench-diagnose`` runs 10^6."""

from __future__ import annotations

import tempfile
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from tests.unit.diagnose.failures import FAULTS, check

CASES = 4_000


def run_range(start: int, stop: int) -> tuple[list[tuple[int, str, int, list[int], str]], Counter[str], Counter[str]]:
    """Seeds [start, stop): the wrong verdicts (seed, fault, culprit, named, evidence) and per fault the cases and
    the decided ones."""
    wrong, seen, decided = [], Counter[str](), Counter[str]()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        folder = Path(tmp) / "case"
        for seed in range(start, stop):
            out = check(seed, folder)
            seen[out.case.fault] += 1
            decided[out.case.fault] += out.decided
            if out.wrong:
                wrong.append((seed, out.case.fault, out.case.culprit, out.culprits, out.case.evidence))
    return wrong, seen, decided


@pytest.mark.timeout(150)
def test_generated_failures_never_name_a_rank_outside_the_truth() -> None:
    half = CASES // 2
    with ProcessPoolExecutor(2) as pool:
        parts = list(pool.map(run_range, (0, half), (half, CASES)))
    wrong = [w for p in parts for w in p[0]]
    seen = sum((p[1] for p in parts), Counter[str]())
    decided = sum((p[2] for p in parts), Counter[str]())
    assert wrong == [], wrong[:10]
    assert sum(seen.values()) == CASES and set(seen) == set(FAULTS)
    # the evidence decides a share of each fault that leaves its own trace (an exception, a crash the launcher saw,
    # a stalled rank whose dump shows it left every op it entered)
    for fault in ("raise", "crash", "stall_before", "stall_between", "slow", "other_op"):
        assert decided[fault] > 0.05 * seen[fault], (fault, decided, seen)


def test_a_generated_case_is_the_same_every_time() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        a = check(12345, Path(tmp) / "a")
        b = check(12345, Path(tmp) / "b")
    assert (a.case.fault, a.case.culprit, a.case.evidence, a.culprits) == (b.case.fault, b.case.culprit,
                                                                          b.case.evidence, b.culprits)
    assert a.case.records == b.case.records
