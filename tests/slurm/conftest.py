"""One real single-node SLURM for the whole session (tests/slurm/cluster.py): installed with apt-get when missing,
started once, always torn down; every test that asks for it is skipped with the reason where it cannot start."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.slurm.cluster import Slurm, why_not_available


@pytest.fixture(scope="session")
def slurm() -> Iterator[Slurm]:
    why = why_not_available()
    if why is not None:
        pytest.skip(f"no SLURM here: {why}")
    with Slurm() as cluster:
        yield cluster
