"""The shape of the code base: every Python file is linted, imports form no cycle, layers stay apart, every
exception lives in ``errors.py``, the public face is what ``__all__`` says.

The import graph is read from the AST of every module under ``lifecycle/`` — imports inside functions
included (a lazy import still ties two modules together); imports under ``if TYPE_CHECKING:`` count for the
cycle check (a circle of type hints is still a circle a reader must hold in mind) and not for what importing a
module runs. Importing ``lifecycle.a.b`` also runs ``lifecycle/a/__init__.py``, so a module depends on its parent
packages too.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGE = ROOT / "lifecycle"
LINTED_DIRS = ("lifecycle", "tests", "bench", "examples")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, *, type_checking: bool = False) -> set[str]:
    """Absolute names imported anywhere in ``tree`` (under ``if TYPE_CHECKING`` only with ``type_checking``):
    ``import a.b`` gives ``a.b``; ``from a import b`` gives ``a`` and ``a.b`` (the caller keeps those that are
    modules)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph(*, parents: bool = False, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the lifecycle modules it imports. ``from pkg import sub`` depends on ``pkg.sub`` (the package
    itself only when a name is taken from it). With ``parents`` a module also depends on the packages above
    it and above each import (their ``__init__`` runs first): what importing it may run, transitively."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        names = _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", type_checking=type_checking)
        deps = {n for n in names if n in modules}
        deps -= {d for d in deps if any(n.startswith(d + ".") and n in modules for n in names)
                 and not _takes_a_name(d, names, modules)}
        if parents:
            for dep in list(deps) + [name]:
                parts = dep.split(".")
                deps.update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules)
        deps.discard(name)
        graph[name] = deps
    return graph


def _takes_a_name(package: str, names: set[str], modules: dict[str, Path]) -> bool:
    """Whether ``from package import X`` takes an X that is not a submodule."""
    return any(n.startswith(package + ".") and n.count(".") == package.count(".") + 1 and n not in modules
               for n in names)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_import_graph_has_no_cycle_type_hints_included() -> None:
    assert _cycles(_graph()) == [], "import cycles among lifecycle modules"
    cycles = _cycles(_graph(type_checking=True))
    assert cycles == [], f"import cycles among lifecycle modules (TYPE_CHECKING imports included): {cycles}"


def test_every_exception_class_is_defined_in_errors() -> None:
    from lifecycle import errors

    elsewhere = []
    for name, path in _modules().items():
        if name == "lifecycle.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    (b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "").endswith(
                        ("Error", "Exception", "Mismatch", "Unavailable", "Shutdown")) for b in node.bases):
                elsewhere.append(f"{name}.{node.name}")
    assert elsewhere == [], f"exception classes outside lifecycle/errors.py: {elsewhere}"
    for cls in (errors.Shutdown, errors.RunDirError, errors.DrillError, errors.SequenceMismatch,
                errors.StoreUnavailable):
        assert cls.__module__ == "lifecycle.errors"


def test_no_exception_is_matched_by_its_type_name() -> None:
    offenders = []
    for name, path in _modules().items():
        text = path.read_text()
        for needle in ('__name__ == "Shutdown"', "is_divergence", 'getattr(exc, "ranks"', 'getattr(exc, "missing"'):
            if needle in text:
                offenders.append(f"{name}: {needle}")
    assert offenders == [], offenders


def test_the_exit_code_comes_from_one_function() -> None:
    from lifecycle import errors
    from lifecycle.policy.load import validate

    codes = validate({"teardown": {"exit_codes": {"hang": 13, "rank_failed": 14}}}).teardown.exit_codes
    cases = [(errors.PolicyError.single("a", "b"), 2, 2), (errors.RunDirError("x"), 2, 2),
             (errors.CheckpointError("x"), 2, 2), (errors.HangError("x"), 3, 13),
             (errors.SequenceMismatch("x"), 3, 13), (errors.DrillError("x"), 4, 14), (RuntimeError("x"), 4, 14),
             (errors.Shutdown(), 4, 14)]
    for exc, default, policy in cases:
        assert errors.exit_code(exc) == default and errors.exit_code(exc, codes) == policy, exc
        if isinstance(exc, errors.LifecycleError):
            assert exc.exit_code == default


def test_the_public_face_imports_no_torch_and_every_name_in_all_resolves() -> None:
    code = ("import sys, lifecycle; assert 'torch' not in sys.modules, 'import lifecycle imported torch'; "
            "[getattr(lifecycle, n) for n in lifecycle.__all__]; print(len(lifecycle.__all__))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.strip()) >= 10


def test_only_a_handful_of_modules_sit_at_the_top() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert top == ["__init__", "__main__", "cli", "context", "errors", "hostinfo", "jsontypes"], top


def _rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between lifecycle's rooms: each folder (``lifecycle.policy``) or top-level module
    (``lifecycle.context``) as one node; the package's face (``lifecycle/__init__.py``) is left out."""
    def room(module: str) -> str | None:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 else None

    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if (src := room(module)) is not None:
            rooms.setdefault(src, set()).update(t for t in map(room, targets) if t is not None and t != src)
    return rooms


def test_the_folders_stand_on_floors_type_hints_included() -> None:
    """No two folders import each other, directly or around a circle (type hints and lazy imports included): each
    folder stands above what it uses. The floors, bottom up: errors, jsontypes, hostinfo; rundir; policy (the
    schema, the kinds' registry and options); distributed; obs, handlers (the protocols); watchdog; context;
    checkpoint (the folder's files); recovery; phases and backends; machine; launch, diagnose; cli."""
    rooms = _rooms(_graph(type_checking=True))
    assert _cycles(rooms) == [], f"folders that import each other: {_cycles(rooms)}"
    below = {"lifecycle.rundir": set(), "lifecycle.policy": {"lifecycle.rundir"}}
    for room, allowed in below.items():
        extra = rooms[room] - allowed - {"lifecycle.errors", "lifecycle.jsontypes", "lifecycle.hostinfo"}
        assert not extra, f"{room} imports {sorted(extra)}, above it"
    above_recovery = {"lifecycle.phases", "lifecycle.backends", "lifecycle.machine", "lifecycle.launch",
                      "lifecycle.diagnose", "lifecycle.cli"}
    assert not rooms["lifecycle.recovery"] & above_recovery, sorted(rooms["lifecycle.recovery"] & above_recovery)


def test_recovery_has_one_home() -> None:
    """Restart decisions, the no-progress verdict, exclusions, in-place restarts, resume and both checked tiers
    live in ``lifecycle/recovery/``; the folders they came from hold none of them again."""
    modules = _modules()
    home = {"decisions", "progress", "exclusions", "inprocess", "resume", "memory", "copies", "state_check",
            "rejections"}
    assert {f"lifecycle.recovery.{m}" for m in home} <= set(modules)
    elsewhere = {"lifecycle.phases.memory", "lifecycle.phases.resume", "lifecycle.phases.state_check",
                 "lifecycle.checkpoint.memory", "lifecycle.checkpoint.progress", "lifecycle.checkpoint.rejections",
                 "lifecycle.obs.exclusions", "lifecycle.machine.inprocess"}
    assert not elsewhere & set(modules), sorted(elsewhere & set(modules))


def test_only_the_command_line_reaches_into_launch() -> None:
    """``launch/`` starts processes and nothing else: the engine (machine, phases, watchdog, ...) never imports it;
    a rank's run is assembled by ``machine/session.py`` for ``lifecycle run`` and ``attach()`` alike."""
    graph = _graph(type_checking=True)
    into = {m: sorted(t for t in targets if t.startswith("lifecycle.launch"))
            for m, targets in graph.items() if not m.startswith("lifecycle.launch") and m != "lifecycle.cli"}
    assert not {m: t for m, t in into.items() if t}, into
    assert "lifecycle.machine.session" in graph["lifecycle.launch.worker"]
    assert "lifecycle.machine.session" in graph["lifecycle.machine.job"]


def test_the_run_directory_floor_imports_nothing_above_it() -> None:
    """``lifecycle.rundir`` (the run directory's files, restarts ledger, lock, elastic error files, safe I/O) stands
    on errors and jsontypes only, type hints included: every layer above may use it, it uses none of them."""
    graph = _graph(type_checking=True)
    allowed = {"lifecycle", "lifecycle.errors", "lifecycle.jsontypes"}
    floor = {m for m in graph if m == "lifecycle.rundir" or m.startswith("lifecycle.rundir.")}
    assert floor >= {"lifecycle.rundir", "lifecycle.rundir.safeio", "lifecycle.rundir.restarts"}, floor
    above = {m: sorted(t for t in graph[m] if t not in allowed and t not in floor) for m in floor}
    assert not any(above.values()), above


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("if TYPE_CHECKING:\n    import lifecycle.x\nelse:\n    import lifecycle.y\n"
                     "def f():\n    from lifecycle import z\n")
    assert _imports(tree, "lifecycle.m", False) == {"lifecycle.y", "lifecycle", "lifecycle.z"}
    assert _cycles(_rooms({"lifecycle.a.x": {"lifecycle.b.y"}, "lifecycle.b.z": {"lifecycle.a"},
                           "lifecycle": {"lifecycle.a.x"}})) == [["lifecycle.a", "lifecycle.b"]]


def test_megatron_is_imported_only_under_backends() -> None:
    offenders = []
    for name, path in _modules().items():
        if name.startswith("lifecycle.backends"):
            continue
        names = _imports(ast.parse(path.read_text()), name, path.name == "__init__.py")
        if any(n == "megatron" or n.startswith("megatron.") for n in names):
            offenders.append(name)
    assert offenders == [], f"modules outside lifecycle/backends import megatron: {offenders}"


def test_the_policy_layer_depends_on_no_execution_layer() -> None:
    graph = _graph(parents=True)
    forbidden = ("lifecycle.phases", "lifecycle.machine", "lifecycle.backends", "lifecycle.watchdog")
    for name in [n for n in graph if n.startswith("lifecycle.policy")]:
        seen, todo = {name}, [name]
        while todo:  # everything importing this module can run, transitively
            for dep in graph[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        bad = sorted(d for d in seen if d.startswith(forbidden))
        assert bad == [], f"{name} reaches {bad}"


def _python_files() -> set[str]:
    files = {"setup.py"} if (ROOT / "setup.py").is_file() else set()
    for top in LINTED_DIRS:
        for dirpath, dirnames, filenames in os.walk(ROOT / top):
            dirnames[:] = [d for d in dirnames if d not in ("__pycache__", ".venv", "build") and
                           not d.endswith(".egg-info")]
            files.update(str((Path(dirpath) / f).relative_to(ROOT)) for f in filenames if f.endswith(".py"))
    return files


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (make test installs it with the dev extra)")
    return [exe]


@pytest.mark.timeout(60)
def test_ruff_checks_every_python_file() -> None:
    proc = subprocess.run([*_ruff(), "check", "--show-files"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True)
    checked = {str(Path(line.strip()).resolve().relative_to(ROOT)) for line in proc.stdout.splitlines()
               if line.strip().endswith(".py")}
    missing = sorted(_python_files() - checked)
    assert missing == [], f"ruff does not check: {missing}"


@pytest.mark.timeout(60)
def test_the_lint_configuration_is_what_make_test_runs() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "ruff check\n" in makefile or "ruff check \n" in makefile, \
        "make lint must run plain `ruff check` so that pyproject's include list decides what is linted"
    proc = subprocess.run([*_ruff(), "check", "--output-format", "json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert json.loads(proc.stdout or "[]") == [], proc.stdout[:2000]
