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


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until every thread of `pid` has stopped: a stop signal takes
    effect thread by thread, and a thread may still answer meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"unit {pid} did not stop")


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


#: The uid (and gid) that plays another user of this host.
OTHER_UID = 65534


def can_switch_user() -> bool:
    """Whether this process can run a command as another user (root and
    util-linux's setpriv)."""
    import shutil

    return os.geteuid() == 0 and shutil.which("setpriv") is not None


def stowage_as_other_user(*args: str, timeout: float = 60.0):
    """``stowage ARGS`` (the command line of the extension module alone)
    run as uid/gid 65534 with no supplementary groups, without
    STOWAGE_SECRET; returns the finished process (text output). The module
    is copied into a fresh directory anyone may read, so a refusal is the
    unit's, never a failed exec."""
    import shutil
    import subprocess
    import sys
    import tempfile

    from stowage import _UNIT_BOOT, _native

    shared = tempfile.mkdtemp(prefix="stowage-other-")
    try:
        os.chmod(shared, 0o755)
        module = os.path.join(shared, os.path.basename(_native.__file__))
        shutil.copy(_native.__file__, module)
        os.chmod(module, 0o755)
        env = {k: v for k, v in os.environ.items() if k != "STOWAGE_SECRET"}
        return subprocess.run(
            [
                "setpriv",
                "--reuid",
                str(OTHER_UID),
                "--regid",
                str(OTHER_UID),
                "--clear-groups",
                os.path.realpath(sys.executable),
                "-c",
                _UNIT_BOOT,
                module,
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
            cwd="/",
        )
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def assert_other_user_refused(r, because) -> None:
    """The other user's command failed, for one of ``because`` (not for
    failing to run)."""
    out = r.stdout + r.stderr
    assert r.returncode != 0, f"another user was served: {out}"
    assert "setpriv:" not in out and "Traceback" not in out, f"it did not even run: {out}"
    assert any(b in out for b in because), f"refused, but not for {because}: {out}"


#: Why a unit's TCP listener refuses another user: no secret to prove.
NO_SECRET = ("unauthorized", "shared secret")
#: Why its Unix socket does: a private directory, or the uid check.
NO_ENTRY = ("Permission denied", "permission denied", "uid")
