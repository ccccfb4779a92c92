"""The command line through Python (python -m stowage), and the life of
local planes' unit processes."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np

import stowage
from stowage import _native

from conftest import alive, same, wait_dead

PY = [sys.executable, "-m", "stowage"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*PY, *args], capture_output=True, text=True, timeout=timeout)


def test_version_help_and_usage_errors():
    r = run("--version")
    assert r.returncode == 0 and "stowage" in r.stdout
    r = run("--help")
    assert r.returncode == 0 and "unit" in r.stdout and "local" in r.stdout
    r = run("no-such-command")
    assert r.returncode == 2 and "error" in r.stderr
    assert _native.main(["stowage", "--version"]) == 0


def start_unit(tmp_path, *extra: str) -> tuple[subprocess.Popen, str]:
    sock = tmp_path / "u.sock"
    p = subprocess.Popen(
        [*PY, "unit", "--memory", "256MiB", "--listen", f"unix:{sock}", *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = p.stdout.readline()
    assert line.startswith("READY uds="), line
    return p, f"unix:{sock}"


def test_unit_command_serves_and_stops_on_sigint(tmp_path):
    p, addr = start_unit(tmp_path)
    try:
        with stowage.connect([addr], namespace="cli") as plane:
            plane.put("p", ["k"], {"x": [np.arange(5)]})
            assert same(plane.get("p", ["k"], ["x"])["x"][0], np.arange(5))
            assert plane.stats()[0]["capacity"] == 256 << 20
        r = run("stats", addr)
        assert r.returncode == 0 and "1 rows" in r.stdout, r.stdout
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=10) == -signal.SIGINT
    finally:
        p.kill()
        p.wait()


def test_unit_command_exits_with_stdin(tmp_path):
    p, _ = start_unit(tmp_path, "--exit-with-stdin")
    try:
        p.stdin.close()
        assert p.wait(timeout=10) == 0
    finally:
        p.kill()
        p.wait()


def test_local_command_runs_units_through_python():
    r = run("local", "--units", "1", "--memory", "64MiB", "--steps", "1", "--rows", "16")
    assert r.returncode == 0, r.stderr
    assert "unit 0" in r.stdout and "GB/s" in r.stdout


def test_close_stops_units():
    plane = stowage.local(units=2, memory="8MiB")
    pids = plane.unit_pids
    assert all(alive(p) for p in pids)
    plane.put("p", [0], {"x": [np.arange(2)]})
    plane.close()
    assert not any(alive(p) for p in pids)


def huge_page_advised_heap(pid: int) -> list[str]:
    """The private anonymous mappings of `pid` advised MADV_HUGEPAGE (the
    `hg` of their VmFlags in /proc/<pid>/smaps): its heap's, not a slab's
    (a shared memfd) nor a file's."""
    found, head = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and not fields[0].endswith(":") and "-" in fields[0]:
                # address perms offset dev inode [path]
                path = fields[5] if len(fields) > 5 else ""
                anonymous = not path or path in ("[heap]", "[stack]")
                head = line.strip() if fields[1].endswith("p") and anonymous else None
            elif fields and fields[0] == "VmFlags:" and head is not None and "hg" in fields[1:]:
                found.append(head)
    return found


def test_a_units_heap_is_not_advised_for_huge_pages(tmp_path):
    # A unit started from Python allocates with the extension's mimalloc,
    # which by default advised its arenas MADV_HUGEPAGE: there a page in
    # use made its 2 MiB region resident, at fault or when khugepaged
    # collapsed it, and the soak's units' heaps were twice their use and
    # grew with time (docs/benchmarks.md, Soak). Puts past the slab spill
    # to the disk tier and gets read them back, so the unit's threads have
    # all allocated.
    plane = stowage.local(
        units=1,
        memory="8MiB",
        disk=str(tmp_path),
        disk_capacity="64MiB",
        high_watermark=0.5,
        low_watermark=0.3,
    )
    try:
        pid = plane.unit_pids[0]
        # 32 MB: most of it spills
        vals = [np.full(100_000 + i, i, dtype=np.int64) for i in range(40)]
        plane.put("p", list(range(40)), {"x": vals})
        got = plane.get("p", list(range(40)), ["x"])["x"]
        assert all(same(a, b) for a, b in zip(got, vals))
        assert plane.stats()[0]["disk_used"] > 0
        assert huge_page_advised_heap(pid) == []
    finally:
        plane.close()


def test_garbage_collection_stops_units():
    plane = stowage.local(units=1, memory="8MiB")
    pid = plane.unit_pids[0]
    del plane
    gc.collect()
    assert wait_dead(pid)


def script(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


def test_units_stop_at_interpreter_exit():
    r = subprocess.run(
        script(
            """
            import stowage
            dp = stowage.local(units=2, memory="8MiB")
            print(*dp.unit_pids, flush=True)
            """
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    pids = [int(p) for p in r.stdout.split()]
    assert len(pids) == 2
    assert all(wait_dead(p) for p in pids)


def test_units_exit_when_their_parent_is_killed():
    p = subprocess.Popen(
        script(
            """
            import sys, time, stowage
            dp = stowage.local(units=1, memory="8MiB")
            print(dp.unit_pids[0], dp.units[0], flush=True)
            time.sleep(600)
            """
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid, addr = p.stdout.readline().split()
        pid = int(pid)
        assert alive(pid)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    assert wait_dead(pid)
    # A killed process cannot remove its plane's socket directory.
    shutil.rmtree(os.path.dirname(addr.removeprefix("unix:")), ignore_errors=True)
