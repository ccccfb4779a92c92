"""The README's examples, and how a test runs one as a user would.

Every fenced ``python`` block of README.md is either an example program,
identical to its file in python/examples (and run by a test), or a
fragment listed in FRAGMENTS with the reason it is not a program.

`run_example` runs a block exactly as written: ``python script.py``, in a
subprocess, with no patched call and no argument, in the environment of
this test run less the variables a user's shell would not have (Ray's and
stowage's, PYTHONPATH), with a bounded timeout. Two things are the
machine's, not the example's:

- TMPDIR is a fresh private directory. It is where Ray keeps its session
  and the address of the last Ray started on the machine
  (``$TMPDIR/ray/ray_current_cluster``, which a bare ``ray.init()`` joins),
  so that the example finds only the Ray this test started, or none,
  never another one running on the same host, as on a user's own
  machine.
- With ``ray_cpus=N``, a Ray head with N CPUs is started on that machine
  first (``ray start --head --num-cpus N``), as a user who ran ``ray
  start`` would have it, and the example's ``ray.init()`` joins it. CI
  machines have 2 cores; a test that runs an example with ``ray_cpus=2``
  sees the Ray resources of such a machine whatever this host has.

Every process started (the example, the Ray it started, the Ray head) is
found by its session and stopped by its pid; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator, List, Optional, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

#: README section -> the example file its python block is.
EXAMPLES = {
    "## From Python": "grpo_step.py",
    "## On a Ray cluster": "ray_units.py",
    "## With TransferQueue": "tq_stowage.py",
    "## Streaming GRPO across processes": "grpo_stream.py",
}

#: Python blocks that are fragments of a larger setup, not programs: the
#: first line of each, and why no test runs it as a program.
FRAGMENTS = {
    'plane = stowage.connect(["tcp:10.0.0.5:7000"], '
    'secret=open("/etc/stowage/secret").read().strip())': (
        "connects to the unit the Authentication section's shell block starts on 10.0.0.5 "
        "(crates/cli/tests/readme.rs runs that block, as written, on such a host)"
    ),
}

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.S | re.M)


def blocks(lang: str) -> List[Tuple[str, str]]:
    """Every fenced block of README.md in `lang`, as (the nearest heading
    above it, its text)."""
    text = README.read_text()
    out = []
    for m in _FENCE.finditer(text):
        if m.group(1) != lang:
            continue
        above = re.findall(r"^(#{2,3} .*)$", text[: m.start()], flags=re.M)
        out.append((above[-1] if above else "", m.group(2)))
    return out


def readme_block(heading: str) -> str:
    """The first python block of the README section under `heading`."""
    text = README.read_text()
    assert heading in text, f"no {heading!r} section in README.md"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert found, f"no python block under {heading!r}"
    return found[0]


@dataclasses.dataclass
class Run:
    command: str
    returncode: Optional[int]  # None: killed at its timeout
    stdout: str
    stderr: str
    seconds: float

    def explain(self) -> str:
        rc = "killed at its timeout" if self.returncode is None else f"exit {self.returncode}"
        return (
            f"`{self.command}`: {rc} after {self.seconds:.1f} s\n"
            f"--- stdout (end)\n{self.stdout[-3000:]}\n--- stderr (end)\n{self.stderr[-6000:]}"
        )


def _user_env(tmpdir: str) -> Dict[str, str]:
    """This run's environment as a user's shell has it: no Ray or stowage
    variable (a test harness's RAY_ADDRESS, RAY_DEDUP_LOGS, STOWAGE_SECRET
    ...), no PYTHONPATH; TMPDIR the machine's private temporary directory."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "STOWAGE_")) and k != "PYTHONPATH"
    }
    env["TMPDIR"] = tmpdir
    return env


def _session_of(pid: int) -> Optional[int]:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The fields after the command name (which may hold spaces): state,
    # ppid, pgrp, session, ...
    return int(stat.rsplit(")", 1)[1].split()[3])


def _parent_of(pid: int) -> Optional[int]:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _processes_of(root: int) -> List[int]:
    """The processes of `root`'s session, and its descendants (Ray moves
    some into process groups of their own)."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    parents = {p: _parent_of(p) for p in pids}
    found = {p for p in pids if _session_of(p) == root}
    grew = True
    while grew:
        grew = False
        for p, parent in parents.items():
            if p not in found and parent in found:
                found.add(p)
                grew = True
    found.discard(os.getpid())
    return sorted(found)


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_processes(root: int, grace: float = 20.0) -> List[int]:
    """Stops every process of the session `root` leads (and their
    descendants), each by its pid: SIGTERM, then SIGKILL for those still
    there after `grace` seconds. Returns the pids that were still running."""
    pids = _processes_of(root)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        pids = [p for p in pids if _alive(p)]
        if not pids:
            break
    return pids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def machine(ray_cpus: Optional[int] = None) -> Iterator[Dict[str, str]]:
    """A private TMPDIR and the environment a user's shell would have; with
    `ray_cpus`, a Ray head with that many CPUs started on it, which a bare
    ``ray.init()`` there joins. Yields the environment."""
    # Short: Ray's Unix sockets live under it.
    tmpdir = tempfile.mkdtemp(prefix="stx-", dir="/tmp")
    env = _user_env(tmpdir)
    head = None
    try:
        if ray_cpus is not None:
            ray_bin = str(pathlib.Path(sys.executable).with_name("ray"))
            with open(os.path.join(tmpdir, "ray-start.log"), "wb") as log_file:
                head = subprocess.Popen(
                    [
                        ray_bin,
                        "start",
                        "--head",
                        "--block",
                        f"--num-cpus={ray_cpus}",
                        "--num-gpus=0",
                        f"--port={_free_port()}",
                        f"--dashboard-agent-listen-port={_free_port()}",
                        "--include-dashboard=false",
                        "--disable-usage-stats",
                    ],
                    env=env,
                    cwd=tmpdir,
                    stdout=subprocess.DEVNULL,
                    stderr=log_file,
                    start_new_session=True,
                )
            # `ray start` writes the address a bare ray.init() joins once
            # the head serves.
            address = pathlib.Path(tmpdir, "ray", "ray_current_cluster")
            deadline = time.monotonic() + 90
            while not address.exists():
                log = pathlib.Path(tmpdir, "ray-start.log").read_text(errors="replace")
                assert head.poll() is None, f"ray start exited {head.returncode}:\n{log[-4000:]}"
                assert time.monotonic() < deadline, f"ray start not up in 90 s:\n{log[-4000:]}"
                time.sleep(0.2)
        yield env
    finally:
        if head is not None:
            left = stop_processes(head.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                head.wait(timeout=10)
            assert not left, f"Ray head processes that would not stop: {left}"
        shutil.rmtree(tmpdir, ignore_errors=True)


def run_example(code: str, name: str, *, timeout: float, ray_cpus: Optional[int] = None) -> Run:
    """Runs `code` as ``python NAME`` on a machine (see `machine`), in a
    private working directory, within `timeout` seconds; stops every
    process it started."""
    with machine(ray_cpus) as env:
        work = pathlib.Path(env["TMPDIR"], "work")
        work.mkdir()
        (work / name).write_text(code)
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, name],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
            rc: Optional[int] = proc.returncode
        except subprocess.TimeoutExpired:
            stop_processes(proc.pid, grace=5)
            out, err = proc.communicate(timeout=30)
            rc = None
        finally:
            # A Ray the example started (ray.init() without a cluster to
            # join) stops with it; whatever did not is stopped here.
            stop_processes(proc.pid, grace=10)
        where = f"on a {ray_cpus}-CPU Ray" if ray_cpus else "on a fresh machine"
        return Run(f"python {name} ({where})", rc, out, err, time.monotonic() - t0)
