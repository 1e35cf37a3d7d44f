"""Name checking in groups.resolve (no processes: it fails before touching a process group)."""

from __future__ import annotations

import pytest

from lifecycle.distributed.groups import resolve
from lifecycle.distributed.parallel import WorldOnly
from lifecycle.errors import PolicyError


def test_unknown_names_are_a_policy_error_with_a_hint() -> None:
    with pytest.raises(PolicyError, match="did you mean .*'edp'") as info:
        resolve(WorldOnly(), ["tp", "edpp"])
    assert info.value.issues[0].value == ["edpp"]


def test_unknown_required_name_is_checked_too() -> None:
    with pytest.raises(PolicyError, match="inter_distopt"):
        resolve(WorldOnly(), "all", required=["inter_distopt"])
