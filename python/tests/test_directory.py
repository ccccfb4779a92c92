"""Directories: connect by directory (dict or file) from another process,
the transport chosen per unit, the expected instance checked, and the
liveness source asked only after a failure (with copies, a unit it says
is dead is gone around and fenced)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import stowage
from stowage import _native

from conftest import wait_dead, wait_stopped


def test_another_process_connects_by_directory_file(dp, part, tmp_path):
    keys = [0, 1, 2, 3]
    dp.put(part, keys, {"x": [np.arange(i + 1) for i in keys]})
    path = tmp_path / "directory.json"
    # Owner-only: the directory carries the plane's generated secret.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(dp.directory, f)
    script = textwrap.dedent(
        f"""
        import numpy as np, stowage
        with stowage.connect({str(path)!r}) as c:
            got = c.get({part!r}, [0, 1, 2, 3], ["x"])["x"]
            assert [list(a) for a in got] == [list(range(i + 1)) for i in range(4)], got
            # Same host: every unit through shared memory.
            assert all(u.startswith("unix:") for u in c.units), c.units
            c.put({part!r}, [9], {{"y": np.array([42])}})
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert [int(a) for a in dp.get(part, [9], ["y"])["y"]] == [42]


def test_transport_is_chosen_per_unit(dp, part):
    d = dp.directory
    # Unit 1 "elsewhere": this client reaches it over tcp, unit 0 over shm.
    d["units"][1]["host"] = "another-host/net:1/mnt:1"
    with stowage.connect(d) as c:
        assert c.units[0].startswith("unix:") and c.units[1].startswith("tcp:"), c.units
        c.put(part, [0, 1], {"v": np.array([5, 6])})
        assert [int(a) for a in dp.get(part, [0, 1], ["v"])["v"]] == [5, 6]
    with stowage.connect(d, transport="tcp") as c:
        assert all(u.startswith("tcp:") for u in c.units), c.units
        assert [int(a) for a in c.get(part, [0, 1], ["v"])["v"]] == [5, 6]
    with pytest.raises(stowage.InvalidRequest, match="unit 1 runs on another host"):
        stowage.connect(d, transport="shm")


def test_bad_directories_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(stowage.InvalidRequest, match="cannot read the directory file"):
        stowage.connect(str(bad))
    with pytest.raises(stowage.InvalidRequest, match="no address"):
        stowage.connect({"stowage_directory": 1, "units": [{"index": 0}]})
    with pytest.raises(stowage.InvalidRequest, match="format 7"):
        stowage.connect({"stowage_directory": 7, "units": []})


def test_another_instance_than_the_directory_names_reports_lost_keys(dp, part):
    d = dp.directory
    d["units"][0]["instance_id"] = "0" * 31 + "1"
    with stowage.connect(d) as c:
        with pytest.raises(stowage.LostKeys) as e:
            c.get(part, [0], ["nothing"])
        assert e.value.unit == 0
        # Reported once: afterwards the unit is simply what it is.
        with pytest.raises(stowage.NotFound):
            c.get(part, [0], ["nothing"])


def test_liveness_is_asked_only_after_a_failure(part):
    calls = []

    def liveness(unit: int) -> str:
        calls.append(unit)
        return "dead" if unit == 1 else "alive"

    with stowage.local(units=2, memory="32MiB") as plane:
        client = _native.Client(
            plane.units, "default", 10.0, secret=plane._plane.secret, liveness=liveness
        )
        c = stowage.DataPlane(client)
        keys = list(range(8))
        for _ in range(20):
            c.put(part, keys, {"x": np.arange(8)})
            assert [int(a) for a in c.get(part, keys, ["x"])["x"]] == keys
        assert calls == [], "the liveness source was asked on the successful path"
        victim = plane.unit_pids[1]
        os.kill(victim, signal.SIGKILL)
        assert wait_dead(victim)
        with pytest.raises(stowage.LostKeys) as e:
            c.get(part, keys, ["x"])
        assert e.value.unit == 1
        assert sorted(k for k, _ in e.value.keys) == [k for k in keys if k % 2 == 1]
        assert calls and set(calls) == {1}
        # Unit 0 keeps serving.
        assert [int(a) for a in c.get(part, [0, 2], ["x"])["x"]] == [0, 2]
        c.close()


def test_a_local_planes_socket_directory_is_owner_only(dp):
    import stat

    for u in dp.units:
        sock_dir = os.path.dirname(u[len("unix:") :])
        assert stat.S_IMODE(os.stat(sock_dir).st_mode) == 0o700, sock_dir


def test_a_silent_unit_the_liveness_source_says_is_dead_is_gone_around_and_fenced(part):
    """With 2 copies: unit 1 stops answering (SIGSTOP, as a lost host whose
    address refuses nothing) and the liveness source (Ray's, in a Ray
    plane) says it is dead. The put that runs out of time on it asks,
    and the client goes on without it: the puts after go in. Once it
    answers again the client fences it (it exits), and a new client reads
    every row as last put (docs/replication.md#fencing)."""
    said = {"dead": False}

    def liveness(unit: int) -> str:
        return "dead" if unit == 1 and said["dead"] else "alive"

    with stowage.local(units=3, memory="32MiB", replicas=2) as plane:
        client = _native.Client(
            plane.units,
            "default",
            2.0,
            secret=plane._plane.secret,
            liveness=liveness,
            replicas=2,
        )
        c = stowage.DataPlane(client)
        keys = list(range(12))
        c.put(part, keys, {"x": np.arange(12)})
        victim = plane.unit_pids[1]
        os.kill(victim, signal.SIGSTOP)
        try:
            wait_stopped(victim)
            said["dead"] = True
            failed = 0
            for k in keys:
                try:
                    c.put(part, [k], {"x": np.array([k + 100])})
                except stowage.Error:
                    failed += 1
                    c.put(part, [k], {"x": np.array([k + 100])})
            assert failed <= 1, f"{failed} puts failed after unit 1 was taken as down"
        finally:
            os.kill(victim, signal.SIGCONT)
        assert wait_dead(victim), "unit 1 was not fenced once it answered"
        c.close()
        with stowage.connect(plane.directory) as fresh:
            got = fresh.get(part, keys, ["x"])["x"]
            assert [int(a) for a in got] == [k + 100 for k in keys]
