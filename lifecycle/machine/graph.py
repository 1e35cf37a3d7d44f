"""The lifecycle as data: phases, the order the orchestrator runs them in, and the legal transitions,
checked when this module is imported.

init -> warmup -> train <-> checkpoint -> teardown, and a failure edge from every phase to teardown.
The graph must have exactly one initial phase, every phase reachable from it, teardown reachable
from every phase, and teardown terminal; the main path must follow legal edges (a phase left out when
disabled included). A bad edit to these tables fails at import, not mid-run.

The phase names are the policy's vocabulary (``faults[].at`` validates against them), so they are
declared once as the ``Phase`` literal of :mod:`lifecycle.policy.base` (the policy layer imports nothing
from here) and read from it.
"""

from __future__ import annotations

from lifecycle.errors import TransitionError
from lifecycle.policy.base import PHASES

INITIAL = "init"
TERMINAL = "teardown"
MAIN_PATH: tuple[str, ...] = ("init", "warmup", "train", "teardown")
"""The phases the orchestrator runs in order (each may be disabled by the policy but the first and last)."""
OPTIONAL: frozenset[str] = frozenset({"warmup"})
"""Main-path phases the policy may switch off (``warmup.enabled``)."""
LOOPS: dict[str, str] = {"train": "checkpoint"}
"""Side trips taken between steps and returned from: train -> checkpoint -> train."""

# Success edges. init may skip warmup (warmup.enabled=false) and train (train.steps=0) is still entered.
TRANSITIONS: dict[str, frozenset[str]] = {
    "init": frozenset({"warmup", "train"}),
    "warmup": frozenset({"train"}),
    "train": frozenset({"checkpoint", "teardown"}),
    "checkpoint": frozenset({"train", "teardown"}),
    "teardown": frozenset(),
}
# The failure edge: from every phase but the terminal one, straight to teardown.
FAILURE_EDGES: dict[str, str] = {p: TERMINAL for p in PHASES if p != TERMINAL}


def can_go(src: str | None, dst: str, *, failure: bool = False) -> bool:
    """Whether ``src -> dst`` is legal (``src=None`` means not started: only the initial phase)."""
    if src is None:
        return dst == INITIAL
    if failure:
        return FAILURE_EDGES.get(src) == dst
    return dst in TRANSITIONS.get(src, frozenset())


def check_transition(src: str | None, dst: str, *, failure: bool = False) -> None:
    """Raise ``TransitionError("can't go to checkpoint from warmup")`` for an illegal transition."""
    if not can_go(src, dst, failure=failure):
        where = f"from {src}" if src else "before init"
        raise TransitionError(f"can't go to {dst} {where}", phase=src)


def _reachable(start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        node = todo.pop()
        nxt = set(TRANSITIONS[node]) | ({FAILURE_EDGES[node]} if node in FAILURE_EDGES else set())
        todo.extend(nxt - seen)
        seen |= nxt
    return seen


def validate_graph() -> None:
    """The checks run at import; raises ``TransitionError`` naming the defect."""
    if set(TRANSITIONS) != set(PHASES):
        raise TransitionError(f"graph phases {sorted(TRANSITIONS)} differ from {sorted(PHASES)}")
    initial = [p for p in PHASES if not any(p in t for t in TRANSITIONS.values())]
    if initial != [INITIAL]:
        raise TransitionError(f"the graph needs exactly one initial phase ({INITIAL}); found {initial}")
    unreachable = set(PHASES) - _reachable(INITIAL)
    if unreachable:
        raise TransitionError(f"phases unreachable from {INITIAL}: {sorted(unreachable)}")
    traps = [p for p in PHASES if TERMINAL not in _reachable(p)]
    if traps:
        raise TransitionError(f"trap phases that never reach {TERMINAL}: {traps}")
    if TRANSITIONS[TERMINAL]:
        raise TransitionError(f"{TERMINAL} must be terminal; it has edges to {sorted(TRANSITIONS[TERMINAL])}")
    _validate_paths()


def _validate_paths() -> None:
    if MAIN_PATH[0] != INITIAL or MAIN_PATH[-1] != TERMINAL:
        raise TransitionError(f"the main path must run from {INITIAL} to {TERMINAL}: {MAIN_PATH}")
    for i, phase in enumerate(MAIN_PATH[:-1]):
        if MAIN_PATH[i + 1] not in TRANSITIONS[phase]:
            raise TransitionError(f"main path step {phase} -> {MAIN_PATH[i + 1]} is not an edge of the graph")
    for i, phase in enumerate(MAIN_PATH[1:-1], start=1):
        if phase in OPTIONAL and MAIN_PATH[i + 1] not in TRANSITIONS[MAIN_PATH[i - 1]]:
            raise TransitionError(f"optional phase {phase}: {MAIN_PATH[i - 1]} -> {MAIN_PATH[i + 1]} is not an edge")
    for src, side in LOOPS.items():
        if side not in TRANSITIONS[src] or src not in TRANSITIONS[side]:
            raise TransitionError(f"loop {src} -> {side} -> {src} needs both edges")
    missing = set(PHASES) - set(MAIN_PATH) - set(LOOPS.values())
    if missing:
        raise TransitionError(f"phases neither on the main path nor a loop: {sorted(missing)}")


validate_graph()
