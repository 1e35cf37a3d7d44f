"""Fuzzing the CLI (issue 11): random YAML documents and override strings fed to `validate`, `explain` and
`diff` in-process (``lifecycle.cli.main``). Every example must end with exit 0 or 2 (diff: 0, 1 or 2) within
2 s and print no traceback; an exception escaping ``main`` fails the test. Derandomized, so a run is
reproducible; ``tests/cli/test_hostile.py`` proves the same end to end in subprocesses."""

from __future__ import annotations

import contextlib
import io
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from lifecycle.cli import main

# Hypothesis caches what it learns under .hypothesis/ in the working directory: keep the checkout clean.
set_hypothesis_home_dir(str(Path(tempfile.gettempdir()) / "lifecycle-hypothesis"))

SETTINGS = settings(deadline=timedelta(seconds=2), derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

KEYS = ["defaults", "preset", "_self_", "description", "schema_version", "run", "name", "id", "dir", "seed",
        "distributed", "backend", "parallelism", "tp", "pp", "cp", "ep", "etp", "vpp", "dist_opt_instances",
        "warmup", "groups", "ops", "required", "deadline_s", "barriers", "after_init", "group", "timeout_s",
        "train", "kind", "steps", "options", "num_experts", "checkpoint", "every_steps", "async", "grace_s",
        "teardown", "exit_codes", "hang", "watchdog", "deadlines", "init", "step", "faults", "at", "ranks",
        "action", "moe", "zero_token", "hydra", "_target_", "<<", "searchpath", "job"]
PATHS = ["train.steps", "train.kind", "parallelism.tp", "parallelism.ep", "parallelism.pp", "warmup.groups",
         "warmup.ops", "watchdog.deadlines.init", "watchdog.deadlines.step", "checkpoint.grace_s",
         "checkpoint.keep_last", "checkpoint.async", "teardown.deadline_s", "run.name", "description", "faults",
         "barriers.after_init", "train.options.num_experts", "moe.zero_token.action", "hydra.job.chdir",
         "preset", "checkpoint", "warmup", "teardown", "x", "a.b.c"]
TEXTS = ["${run.name}", "${oc.env:HOME}", "${..x}", "???", "${a}${a}", "${oc.env:NOPE_LIFECYCLE}", "inf",
         "-inf", "nan", "null", "moe", "all", "tp", "world", "store", "[1, 2]", "{a: 1}", "*a", "&a x"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.integers(-3, 9),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(TEXTS), st.text(max_size=12),
)
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6),
                                                                inner, max_size=5),
    max_leaves=25,
)
junk = st.text(alphabet=st.sampled_from(list("[]{}:,'\"&*!|>-#%@`$\\ \t\n") + ["\x00", "\ufeff", "é"]),
               max_size=8)
override_values = st.one_of(
    st.sampled_from(TEXTS), st.integers(-(2**70), 2**70).map(str), st.floats().map(str), junk,
    st.text(max_size=10), st.lists(st.sampled_from(["tp", "dp", "1", "x", "[]"]), max_size=4).map(
        lambda xs: "[" + ",".join(xs) + "]"),
)
overrides = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["", "+", "++", "~"]), st.sampled_from(PATHS), override_values).map(
            lambda t: f"{t[0]}{t[1]}={t[2]}"),
        junk, st.text(max_size=16),
    ),
    max_size=4,
)


def run(*argv: str) -> tuple[int, str]:
    """``lifecycle ARGV`` in this process: (exit code, stderr). argparse's exit is exit 2."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
    return code, err.getvalue()


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        run("validate")  # imports and Hydra's plugin scan happen here, not inside a timed example
        yield Path(d)


def _check(code: int, err: str, allowed: tuple[int, ...] = (0, 2)) -> None:
    assert code in allowed, err[-3000:]
    assert "Traceback" not in err and len(err) < 20_000, err[-3000:]


def _dump(doc: Any) -> str:
    return yaml.safe_dump(doc, allow_unicode=True, default_flow_style=None)


@st.composite
def policy_files(draw: st.DrawFn) -> bytes:
    """A random document, with the defaults list often in front, then maybe broken on purpose."""
    doc = draw(documents)
    if isinstance(doc, dict) and draw(st.booleans()):
        doc = {"defaults": [{"preset": draw(st.sampled_from(["moe", "dense", "nope"]))}, "_self_"], **doc}
    text = _dump(doc).encode()
    cut = draw(st.integers(0, len(text)))
    how = draw(st.sampled_from(["keep", "keep", "truncate", "insert", "bytes"]))
    if how == "truncate":
        return text[:cut]
    if how == "insert":
        return text[:cut] + draw(junk).encode() + text[cut:]
    if how == "bytes":
        return text[:cut] + draw(st.binary(min_size=1, max_size=6)) + text[cut:]
    return text


@pytest.mark.timeout(180)
@settings(SETTINGS, max_examples=200)
@given(data=policy_files())
def test_random_policy_files(folder: Path, data: bytes) -> None:
    (folder / "fuzz.yaml").write_bytes(data)
    _check(*run("validate", "--config-dir", str(folder), "--config-name", "fuzz"))


@pytest.mark.timeout(180)
@settings(SETTINGS, max_examples=150)
@given(args=overrides)
def test_random_overrides_validate(folder: Path, args: list[str]) -> None:
    _check(*run("validate", "--", *args) if args else run("validate"))


@pytest.mark.timeout(180)
@settings(SETTINGS, max_examples=100)
@given(args=overrides, world=st.one_of(st.integers(-4, 64), st.integers(1, 2**40), st.sampled_from(
    [2**14, 2**20, 10**8, 2**31 - 1, 2**31])), data=st.data())
def test_random_explain(folder: Path, args: list[str], world: int, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, max(world - 1, 0)) | st.integers(-2, 2**33))
    _check(*run("explain", "--json", "--world-size", str(world), "--rank", str(rank), "--", *args))


@pytest.mark.timeout(180)
@settings(SETTINGS, max_examples=80)
@given(a=overrides, b=overrides, common=overrides)
def test_random_diff(folder: Path, a: list[str], b: list[str], common: list[str]) -> None:
    code, err = run("diff", " ".join(a), " ".join(b), "--", *common)
    _check(code, err, (0, 1, 2))


@pytest.mark.timeout(120)
@settings(SETTINGS, max_examples=60)
@given(doc=documents)
def test_random_documents_through_explain_and_diff(folder: Path, doc: Any) -> None:
    (folder / "doc.yaml").write_text(_dump(doc))
    _check(*run("explain", "--config-dir", str(folder), "--config-name", "doc", "--world-size", "8"))
    code, err = run("diff", "-d", str(folder), "doc", "doc train.steps=3")
    _check(code, err, (0, 1, 2))


def test_the_fuzzer_reaches_both_outcomes(folder: Path) -> None:
    """A sanity check of the harness itself: a valid and an invalid example."""
    assert run("validate", "train.steps=3")[0] == 0
    assert run("validate", "train.steps=-3")[0] == 2
