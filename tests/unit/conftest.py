"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.onerank import MakeCtx, make_ctx_fixture


@pytest.fixture
def make_ctx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeCtx]:
    """A factory of one-rank RunContexts (real gloo, world 1, in this process); cleans up after the test."""
    yield from make_ctx_fixture(tmp_path, monkeypatch)
