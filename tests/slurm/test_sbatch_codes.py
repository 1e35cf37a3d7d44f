"""The requeue decision of examples/slurm.sbatch follows the one exit-code table (lifecycle.errors.EXIT_RULES): it
never requeues the codes the table says to stop on, requeues those it says to restart on, and requeues a clean exit
only after a time-limit save. No SLURM needed: the script's own `case` runs in bash for every code."""

from __future__ import annotations

import re
import subprocess

import pytest

from lifecycle.errors import EXIT_RULES, codes_that
from tests.helpers import ROOT

SCRIPT = (ROOT / "examples" / "slurm.sbatch").read_text()
DECISION = re.search(r'^requeue=0\ncase "\$code:\$asked" in\n.*?^esac\n', SCRIPT, re.M | re.S)


def _requeues(code: int, asked: str) -> bool:
    assert DECISION is not None
    proc = subprocess.run(["bash", "-c", f'code={code} asked="{asked}"\n{DECISION.group(0)}echo "$requeue"'],
                          capture_output=True, text=True, timeout=10, check=True)
    return proc.stdout.strip() == "1"


def test_the_never_requeued_codes_are_the_tables_stop_codes() -> None:
    assert DECISION is not None, "examples/slurm.sbatch: no `case \"$code:$asked\" in` decision block"
    arms = re.findall(r"^\s+(.+?)\) *(.*?) *;;$", DECISION.group(0), re.M)
    [never] = [patterns for patterns, action in arms if not action]
    codes = {int(c) for c in re.findall(r"\b(\d+):\*", never)}
    assert codes - set(codes_that("done")) == set(codes_that("stop")), never
    assert "2 or 6" in SCRIPT and codes_that("stop") == [2, 6]  # the header names them too


@pytest.mark.parametrize("asked", ["", "time_limit", "stop"])
def test_every_code_of_the_table_gets_the_requeue_the_table_says(asked: str) -> None:
    rules = {r.code: r.then for r in EXIT_RULES}
    for code in [int(c) for c in rules if c.isdigit()] + [137, 143, 1]:
        then = rules.get(str(code), rules["128+N"])  # 1 (a launcher's own failure) as a signal's: restart
        want = asked != "stop" and (then == "restart" or (then == "done" and asked == "time_limit"))
        assert _requeues(code, asked) == want, (code, asked, then)
