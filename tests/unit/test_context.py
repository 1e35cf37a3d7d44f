"""One rank's run in parts with one owner each (lifecycle.context): who changes which part, what the watchdog thread
may read, and the one name of the step deadline.

The owner tests read the package's source (AST): a new writer of a part, or a new read on the watchdog thread,
fails here until it is declared — and the declaration is the place to ask whether it is safe.
"""

from __future__ import annotations

import ast
import dataclasses
import threading
from pathlib import Path

import pytest

from tests.helpers import ROOT

PKG = ROOT / "lifecycle"

OWNERS: dict[str, set[str]] = {
    # the training thread: the phases, the resume (both tiers) and commit, a trainer's Job, the session's signal handler (Python
    # runs signal handlers on the main thread) and its building of the next in-process attempt
    "progress": {"lifecycle.phases.init", "lifecycle.phases.warmup", "lifecycle.phases.train",
                 "lifecycle.phases.checkpoint", "lifecycle.recovery.resume", "lifecycle.recovery.memory",
                 "lifecycle.machine.job",
                 "lifecycle.machine.session", "lifecycle.machine.orchestrator"},
    # the communicators: made by init and warmup, the checkpoint coordination's and the memory tier's own groups,
    # released by teardown
    "comms": {"lifecycle.phases.init", "lifecycle.phases.warmup", "lifecycle.phases.checkpoint",
              "lifecycle.recovery.memory", "lifecycle.phases.teardown"},
    # the deadline book is made once, with the watchdog, before the first phase
    "deadlines": {"lifecycle.machine.session"},
    "ops": set(),
    "identity": set(),
}
"""Which modules may assign (or edit in place) each part's fields. Nothing under lifecycle.watchdog writes any."""

WATCHDOG_THREAD = ["watchdog/core.py", "watchdog/report.py", "watchdog/members.py", "watchdog/causes.py"]
"""The code the watchdog thread runs with the run's context."""

SAFE_READS: dict[str, set[str] | None] = {
    # frozen identity
    "policy": None, "run_dir": None, "rank": None, "world_size": None, "local_rank": None, "attempt": None,
    "own_loop": None, "identity": None,
    # guarded: their own locks
    "deadlines": {"deadline", "derivation"}, "ops": {"snapshot"}, "compute": {"fields"}, "events": None,
    # replaced whole (a tuple, an int), or fixed for the round
    "comms": {"groups", "restart_round"}, "step": None, "parallel": None, "progress": {"restarts_left"},
}
"""What the watchdog thread may read of the context (``None``: anything below it)."""


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _chain(node: ast.expr) -> list[str]:
    """``a.b.c`` -> ["a", "b", "c"] (empty when the base is not a name)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Subscript):
        return _chain(node.value)
    if not isinstance(node, ast.Name):
        return []
    return [node.id, *reversed(parts)]


def _written_parts(tree: ast.AST) -> set[str]:
    """The parts of a context this module changes: assignments through ``<ctx>.<part>.<field>`` (or ``<ctx>.<part>``
    itself), and in-place edits (``.append`` ...) of a part's field."""
    parts = set(OWNERS)
    found: set[str] = set()

    def note(chain: list[str]) -> None:
        found.update(name for before, name in zip(chain, chain[1:], strict=False)
                     if name in parts and before.endswith("ctx"))

    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple)
                                                                else [target])]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "append", "extend", "clear", "update", "pop", "remove", "insert", "setdefault"):
            targets = [node.func.value]
        for t in targets:
            note(_chain(t))
    return found


def test_each_part_of_the_context_is_changed_by_its_owners_only() -> None:
    writers: dict[str, set[str]] = {part: set() for part in OWNERS}
    for path in sorted(PKG.rglob("*.py")):
        module = _module(path)
        if module == "lifecycle.context":
            continue
        for part in _written_parts(ast.parse(path.read_text(), str(path))):
            writers[part].add(module)
    stray = {part: sorted(w - OWNERS[part]) for part, w in writers.items() if w - OWNERS[part]}
    assert not stray, f"parts changed outside their owners (declare the owner in OWNERS, or move the write): {stray}"
    assert not any(m.startswith("lifecycle.watchdog") for w in writers.values() for m in w)
    # the rule sees what it claims to: the known writers are found
    assert {"lifecycle.phases.train", "lifecycle.recovery.resume"} <= writers["progress"]
    assert {"lifecycle.phases.init", "lifecycle.phases.warmup"} <= writers["comms"]


def test_the_owner_rule_catches_a_write_from_elsewhere() -> None:
    tree = ast.parse("def f(self):\n    self.ctx.progress.step = 3\n    ctx.comms.groups.append(g)\n")
    assert _written_parts(tree) == {"progress", "comms"}
    assert _written_parts(ast.parse("x = ctx.progress.step\nctx.ops.count('dp')\n")) == set()


def _watchdog_reads() -> list[tuple[str, int, list[str]]]:
    out = []
    for rel in WATCHDOG_THREAD:
        path = PKG / rel
        tree = ast.parse(path.read_text(), str(path))
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and id(node) not in inner:
                chain = _chain(node)
                if len(chain) >= 2 and chain[0] == "ctx":
                    out.append((rel, node.lineno, chain[1:]))
                elif len(chain) >= 3 and chain[:2] == ["self", "ctx"]:
                    out.append((rel, node.lineno, chain[2:]))
    return out


def test_the_watchdog_thread_reads_only_frozen_guarded_or_whole_replaced_state() -> None:
    reads = _watchdog_reads()
    assert len(reads) > 30, "the scan found the watchdog's reads"
    bad = []
    for rel, line, chain in reads:
        allowed = SAFE_READS.get(chain[0], set())
        if chain[0] not in SAFE_READS or (allowed is not None and len(chain) > 1 and chain[1] not in allowed):
            bad.append(f"{rel}:{line}: ctx.{'.'.join(chain)}")
    assert not bad, ("the watchdog thread reads state the training thread changes without a lock or a snapshot "
                     f"(give it one, then declare it in SAFE_READS): {sorted(set(bad))}")


def test_the_watchdog_names_the_run_only_through_its_protocols() -> None:
    """lifecycle.watchdog.run states what the watchdog reads (mypy holds it to that); no watchdog module imports the
    context or the machine, type hints included: the engine gives the watchdog what it needs (its refusal rule too)."""
    above = []
    for path in sorted((PKG / "watchdog").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                a.name for a in node.names] if isinstance(node, ast.Import) else []
            above += [f"{path.name}: {n}" for n in names if n.startswith(("lifecycle.context", "lifecycle.machine"))]
    assert not above, above
    from lifecycle.watchdog import run

    declared = {name for cls in (run.WatchedRun,) for name in dir(cls) if not name.startswith("_")}
    assert declared == set(SAFE_READS) - {"local_rank", "identity"}, declared ^ set(SAFE_READS)


def _ctx(tmp_path: Path):  # type: ignore[no-untyped-def]
    from lifecycle.context import RunContext
    from lifecycle.distributed.faults import Drills
    from lifecycle.distributed.parallel import WorldOnly
    from lifecycle.obs.events import EventLog
    from lifecycle.policy.load import validate

    policy = validate({"watchdog": {"deadlines": {"step": "auto", "init": 7}}})
    return RunContext.of(policy, tmp_path, 1, 2, 1, EventLog(tmp_path, 1), Drills([], 1), WorldOnly(), attempt=3)


def test_the_identity_is_frozen_and_init_agrees_the_attempt_once(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    with pytest.raises(AttributeError):
        ctx.rank = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.identity.attempt = 4  # type: ignore[misc]
    before = ctx.identity
    ctx.agree_attempt(4)
    assert (ctx.attempt, ctx.drills.attempt, before.attempt) == (4, 4, 3)
    assert ctx.identity.rank == 1 and ctx.identity.run_dir == tmp_path


def test_the_step_deadline_has_one_name(tmp_path: Path) -> None:
    from lifecycle.context import ADAPTIVE, DeadlineBook
    from lifecycle.policy.base import DEADLINE_KEYS
    from lifecycle.policy.schema import Deadlines
    from lifecycle.watchdog.adaptive import AdaptiveDeadline
    from lifecycle.watchdog.tracker import deadline_key

    ctx = _ctx(tmp_path)
    assert set(DEADLINE_KEYS) == set(Deadlines.model_fields), "the keys are the YAML's"
    assert set(ADAPTIVE) <= set(DEADLINE_KEYS) and deadline_key("train") == "step"
    for name in ("train", "phase:train", "steps"):
        with pytest.raises(ValueError, match="not a watchdog.deadlines key"):
            ctx.policy.deadline(name)
        if name != "train":
            with pytest.raises(ValueError, match="not a watchdog.deadlines key"):
                ctx.deadlines.deadline(name)
    assert ctx.deadline("init") == 7.0 and ctx.deadline("step") == 600.0
    with pytest.warns(DeprecationWarning, match="'step'"):
        assert ctx.deadline("train") == 600.0  # a step handler written before: still served, with a warning
    book = DeadlineBook(ctx.policy, {"step": AdaptiveDeadline("step", 600.0, ctx.policy.watchdog.adaptive)})
    with pytest.raises(ValueError, match="not an adaptive deadline key"):
        DeadlineBook(ctx.policy, {"train": book.learned["step"]})
    with pytest.raises(TypeError):
        book.learned["checkpoint"] = book.learned["step"]  # type: ignore[index]  # fixed when made


def test_the_op_counter_snapshot_is_consistent_while_the_training_thread_counts(tmp_path: Path) -> None:
    """The watchdog thread's snapshot is a prefix of what the training thread did (labels counted in order, each
    once, a store key taken after each): never a label without the ones before it, never keys ahead of counts."""
    ctx = _ctx(tmp_path)
    n, seen, wrong, stop = 20_000, [], [], threading.Event()

    def read() -> None:
        while not stop.is_set():
            counts, keys = ctx.ops.snapshot()
            seen.append(len(counts))
            if set(counts) != {f"g{i}" for i in range(len(counts))} or not len(counts) - 1 <= keys <= len(counts):
                wrong.append((len(counts), keys))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(n):
            ctx.ops.count(f"g{i}")
            ctx.ops.next_key("x")
    finally:
        stop.set()
        reader.join(10)
    assert not wrong, wrong[:5]
    assert ctx.ops.snapshot() == ({f"g{i}": 1 for i in range(n)}, n)
    assert len(seen) > 1 and seen == sorted(seen)
