"""A test's own driver: a Python subprocess that runs a script (its own
private Ray, say) with a bounded run, and the tagged lines it prints.
Shared by python/tests and python/tests_tq (which puts this directory on
sys.path)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def driver(preamble: str, body: str, timeout: float) -> str:
    """Run ``preamble`` + the dedented ``body`` in a fresh interpreter
    within ``timeout`` seconds; it must exit 0. Its stdout and stderr."""
    done = subprocess.run(
        [sys.executable, "-c", preamble + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    return done.stdout + done.stderr


def line(out: str, tag: str) -> str:
    """The rest of the first line of ``out`` that starts with ``tag``."""
    for ln in out.splitlines():
        if ln.startswith(tag + " "):
            return ln[len(tag) + 1 :]
    raise AssertionError(f"no {tag} line in:\n{out[-4000:]}")
