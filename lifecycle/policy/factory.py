"""Whether a handler kind's factory (``"module:attr"``) can give a step handler, checked before any rank starts.

A kind's factory module may import torch and megatron, and ``lifecycle validate`` imports neither: a module that is
Python source is found (:func:`importlib.util.find_spec`, which imports its parent packages only) and read, not run;
the attribute must be defined there, and a class without base classes must define the :class:`StepHandler` methods.
A module already imported, built into the interpreter or compiled is imported and the object itself is checked.
The built-in kinds are not checked here (their factories are lifecycle's own, and import torch).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import sys
from pathlib import Path

from lifecycle.policy import imports

HANDLER_METHODS = ("setup", "step", "begin_save", "load", "close")
"""What :class:`lifecycle.handlers.StepHandler` asks of a handler."""
MAX_SOURCE_BYTES = 4 << 20


@functools.cache
def factory_problem(factory: str) -> str | None:
    """Why ``factory`` cannot build a step handler, or None. Bounded like every import of a package's code."""
    module, sep, attr = factory.partition(":")
    if not sep or not module or not attr.isidentifier():
        return f"factory '{factory}' is not of the form 'package.module:Attribute'"
    try:
        return imports.bounded(module, lambda: _problem(module, attr))
    except KeyboardInterrupt:
        raise
    except TimeoutError as exc:
        return f"finding module '{module}' {exc}"
    except ModuleNotFoundError as exc:
        return f"module '{module}' is not installed ({exc})"
    except BaseException as exc:  # noqa: BLE001 - a parent package that raises (SystemExit too) is the answer
        return f"module '{module}' cannot be found: {type(exc).__name__}: {exc}"


def _problem(module: str, attr: str) -> str | None:
    spec = importlib.util.find_spec(module)
    if spec is None:
        return f"module '{module}' is not installed"
    origin = spec.origin or ""
    if module in sys.modules or not origin.endswith(".py"):
        return _object_problem(importlib.import_module(module), module, attr)
    return _source_problem(Path(origin), module, attr)


def _object_problem(mod: object, module: str, attr: str) -> str | None:
    obj = getattr(mod, attr, None)
    if obj is None:
        return f"module '{module}' has no attribute '{attr}'"
    if isinstance(obj, type):
        missing = [m for m in HANDLER_METHODS if not callable(getattr(obj, m, None))]
        return _class_problem(f"{module}.{attr}", missing)
    return None if callable(obj) else f"{module}.{attr} is a {type(obj).__name__}, not a class or function"


def _source_problem(path: Path, module: str, attr: str) -> str | None:
    try:
        if path.stat().st_size > MAX_SOURCE_BYTES:
            return None  # not read: the run finds out
        tree = ast.parse(path.read_bytes(), str(path))
    except (OSError, SyntaxError, ValueError) as exc:
        return f"module '{module}' ({path}) cannot be read: {type(exc).__name__}: {exc}"
    node = _binding(tree.body, attr)
    if node is None:
        return f"module '{module}' ({path}) defines no '{attr}'"
    if isinstance(node, ast.ClassDef) and not [b for b in node.bases if not _is_object(b)]:
        defined = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        return _class_problem(f"{module}.{attr}", [m for m in HANDLER_METHODS if m not in defined])
    return None  # a function, a subclass, an assignment or an import: what it gives is known when it runs


def _binding(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The last top-level statement of ``body`` that binds ``name`` (inside if/try/with blocks too)."""
    found: ast.stmt | None = None
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            found = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                found = node
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                found = node
        elif isinstance(node, ast.If | ast.Try | ast.With):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                      *[h.body for h in getattr(node, "handlers", [])]]
            found = next((b for b in (_binding(block, name) for block in blocks) if b is not None), found)
    return found


def _is_object(base: ast.expr) -> bool:
    return isinstance(base, ast.Name) and base.id == "object"


def _class_problem(name: str, missing: list[str]) -> str | None:
    if not missing:
        return None
    return (f"{name} is a class without {', '.join(f'{m}()' for m in missing)}: not a step handler (a kind's factory "
            f"builds a lifecycle.handlers.StepHandler from the kind's options)")
