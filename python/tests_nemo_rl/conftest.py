"""Fixtures of stowage.nemo_rl's tests: a local plane of two unit processes
for the module (each test works in a partition of its own), and a
StowageDataPlaneClient over it.

Needs torch and tensordict (``pip install 'stowage-rl[nemo-rl]'``; the
venv that ``scripts/test-tq`` builds has both)."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip(
    "torch", reason="stowage.nemo_rl needs torch: pip install 'stowage-rl[nemo-rl]'"
)
pytest.importorskip(
    "tensordict", reason="stowage.nemo_rl needs tensordict: pip install 'stowage-rl[nemo-rl]'"
)

import stowage
from stowage.nemo_rl import StowageDataPlaneClient

_counter = itertools.count()


@pytest.fixture(scope="module")
def plane():
    """Two shm units of 64 MiB; stopped (by their pids, through
    LocalPlane.stop) when the module's tests are done."""
    with stowage.local(units=2, memory="64MiB") as p:
        yield p


@pytest.fixture
def dp(plane):
    """A client over the module's plane (it does not own the plane)."""
    client = StowageDataPlaneClient(plane)
    yield client
    client.close()


@pytest.fixture
def part(request) -> str:
    """A partition name of this test's own."""
    return f"{request.node.name}-{next(_counter)}"
