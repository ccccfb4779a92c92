"""A process that forks after it has put: the child's puts never take the
ids of its parent's later puts (blob ids are drawn from a key each thread
draws once, drawn again after a fork)."""

from __future__ import annotations

import os
import time
import traceback

import numpy as np

import stowage

from conftest import same

SECRET = "fork-test-s3cret-Horse-battery-staple"


def _wait(pid: int, within: float) -> int:
    """The child's exit status, waiting at most `within` seconds (then it
    is killed and the test fails)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child did not finish within {within} s")


def test_a_forked_child_never_repeats_its_parents_blob_ids():
    with stowage.local(units=1, memory="16MiB", secret=SECRET) as dp:
        # The parent's thread draws its key and puts (with spares).
        for r in range(4):
            dp.put("p", [r], {"v": [np.full(64, r, dtype=np.int64)]})
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                with stowage.connect(dp.units, secret=SECRET, timeout=10) as c:
                    for r in range(100, 120):
                        c.put("p", [r], {"v": [np.full(64, r, dtype=np.int64)]})
                code = 0
            finally:
                if code:
                    traceback.print_exc()  # why the child's puts failed
                os._exit(code)
        assert _wait(pid, 30) == 0, "the child's puts failed"
        # The parent goes on: the ids it draws now are the ones a child
        # that kept its parent's key would have used.
        for r in range(4, 24):
            dp.put("p", [r], {"v": [np.full(64, r, dtype=np.int64)]})
        rows = list(range(24)) + list(range(100, 120))
        got = dp.get("p", rows, "v")["v"]
        for r, a in zip(rows, got):
            assert same(a, np.full(64, r, dtype=np.int64)), f"row {r} read back wrong"
