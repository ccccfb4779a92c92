"""Fixtures of stowage.nemo_rl's tests: a local plane of two unit processes
for the module (each test works in a partition of its own), and a
StowageDataPlaneClient over it.

The tests need torch and tensordict (``pip install 'stowage-rl[nemo-rl]'``;
the venv that ``scripts/test-tq`` builds has both); each module skips
without them."""

from __future__ import annotations

import itertools

import pytest

import stowage

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
    from stowage.nemo_rl import StowageDataPlaneClient

    client = StowageDataPlaneClient(plane)
    yield client
    client.close()


@pytest.fixture
def part(request) -> str:
    """A partition name of this test's own."""
    return f"{request.node.name}-{next(_counter)}"
