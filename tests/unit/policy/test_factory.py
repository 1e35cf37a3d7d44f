"""A kind's factory checked without running its module (lifecycle.policy.factory); the built-ins are not checked."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from lifecycle.policy import registry
from lifecycle.policy.factory import factory_problem

SOURCE = '''raise RuntimeError("a factory check must not run this module")
import os.path as joined
from somewhere import Imported
try:
    from torch import nn
except ImportError:
    Fallback = None
class Sub(Imported):
    pass
class Whole:
    def setup(self, ctx): ...
    def step(self, ctx, step): ...
    def begin_save(self, ctx, d): ...
    def load(self, ctx, d): ...
    def close(self): ...
class Half(object):
    def step(self, ctx, step): ...
def build(options):
    return Whole()
Assigned = build
'''


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module that raises when run, on sys.path for this test."""
    name = f"fac_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize("attr", ["Sub", "Whole", "build", "Assigned", "Imported", "joined", "nn", "Fallback"])
def test_what_can_build_a_handler_passes_without_running_the_module(module: str, attr: str) -> None:
    assert factory_problem(f"{module}:{attr}") is None
    assert module not in sys.modules


def test_what_cannot_is_named(module: str) -> None:
    assert factory_problem(f"{module}:Half") == (
        f"{module}.Half is a class without setup(), begin_save(), load(), close(): not a step handler (a kind's "
        f"factory builds a lifecycle.handlers.StepHandler from the kind's options)")
    missing = factory_problem(f"{module}:Missing") or ""
    assert missing.startswith(f"module '{module}' (/") and missing.endswith(f"{module}.py) defines no 'Missing'")
    assert factory_problem(f"{module}_gone:Step") == f"module '{module}_gone' is not installed"
    assert factory_problem(f"{module}") == f"factory '{module}' is not of the form 'package.module:Attribute'"
    assert module not in sys.modules


def test_an_imported_or_built_in_module_is_checked_on_the_object() -> None:
    assert factory_problem("builtins:len") is None
    assert factory_problem("math:pi") == "math.pi is a float, not a class or function"
    assert factory_problem("builtins:nope") == "module 'builtins' has no attribute 'nope'"
    assert factory_problem("lifecycle.backends.synthetic:SyntheticStep") is None


def test_the_built_in_kinds_are_not_checked() -> None:
    for kind in ("megatron_gpt", "synthetic"):
        assert registry.factory_issue(registry.get("train", kind)) is None
