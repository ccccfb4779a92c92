"""Fixtures: local data planes of real unit processes (small memory, so
the tests stay fast)."""

from __future__ import annotations

import itertools
import os
import time

import numpy as np
import pytest

import stowage

_counter = itertools.count()


@pytest.fixture(scope="module")
def dp():
    """Two shm units of 64 MiB, shared by the tests of a module (each test
    works in its own partition)."""
    with stowage.local(units=2, memory="64MiB") as plane:
        yield plane


@pytest.fixture(scope="module")
def dp_tcp():
    with stowage.local(units=2, memory="32MiB", transport="tcp") as plane:
        yield plane


@pytest.fixture
def part(request) -> str:
    """A partition name of this test's own."""
    return f"{request.node.name}-{next(_counter)}"


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.array_equal(
            np.ascontiguousarray(a).reshape(-1).view(np.uint8),
            np.ascontiguousarray(b).reshape(-1).view(np.uint8),
        )
    )


def total_pins(plane: stowage.DataPlane) -> int:
    return sum(s["pins"] for s in plane.stats())


def settled_pins(plane: stowage.DataPlane, want: int, timeout: float = 5.0) -> int:
    """The pin count once it equals `want` (or after `timeout`): releasing a
    view's pins is a one-way message that a stats call on another
    connection may overtake."""
    deadline = time.monotonic() + timeout
    while True:
        n = total_pins(plane)
        if n == want or time.monotonic() > deadline:
            return n
        time.sleep(0.01)


def pytest_configure(config):
    os.environ.setdefault("RUST_LOG", "warn")
