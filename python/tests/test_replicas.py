"""replicas = k: a local plane started for k copies of every row keeps
them (each unit holds its own rows and copies of its neighbours'), its
directory carries k to every client that connects by it, a client told
another number than the directory's is refused, and k larger than the
units is refused before any unit starts."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

import stowage
from stowage import _native

from conftest import wait_dead


@pytest.fixture(scope="module")
def dp2():
    """Three shm units, two copies of every row."""
    with stowage.local(units=3, memory="32MiB", replicas=2) as plane:
        yield plane


def test_a_local_plane_keeps_two_copies_and_its_directory_says_so(dp2, part, tmp_path):
    assert dp2.replicas == 2
    assert dp2.directory["replicas"] == 2
    # One host: no row's copies are on hosts of their own, and it says so.
    assert dp2.copies_short_of_hosts == 3
    keys = list(range(12))
    dp2.put(part, keys, {"x": [np.arange(k + 1) for k in keys]})
    # Every row on two units: 12 rows, 24 stored, 8 on each unit (its own
    # 4 and the 4 of the unit before it).
    assert [s["rows"] for s in dp2.stats()] == [8, 8, 8]

    # Another client, by the directory file alone: it uses two copies
    # without being told.
    path = tmp_path / "directory.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(dp2.directory, f)
    with stowage.connect(str(path)) as c:
        assert c.replicas == 2
        assert c.copies_short_of_hosts == 3
        got = c.get(part, keys, ["x"])["x"]
        assert [len(a) for a in got] == [k + 1 for k in keys]
        # Its puts keep two copies too.
        c.put(part, [100, 101, 102], {"y": np.array([7, 8, 9])})
    assert [s["rows"] for s in dp2.stats()] == [10, 10, 10]
    # Saying the directory's own number is fine.
    with stowage.connect(dp2.directory, replicas=2) as c:
        assert c.replicas == 2


def test_a_connected_client_reads_the_next_copy_of_a_dead_unit(part):
    with stowage.local(units=2, memory="32MiB", replicas=2) as plane:
        keys = list(range(6))
        plane.put(part, keys, {"x": np.arange(6) * 10})
        with stowage.connect(plane.directory) as c:
            victim = plane.unit_pids[0]
            os.kill(victim, signal.SIGKILL)
            assert wait_dead(victim)
            # Unit 0's rows come from their copies on unit 1.
            got = c.get(part, keys, ["x"], timeout=10.0)["x"]
            assert [int(a) for a in got] == [k * 10 for k in keys]


def test_a_client_repairs_a_dead_units_copies_in_the_background(part):
    """Once a client finds a unit dead, its background repair gives the
    rows that had a copy there their second copy on the units left: so a
    second unit's death afterwards loses nothing."""
    with stowage.local(units=3, memory="32MiB", replicas=2) as plane:
        keys = list(range(12))
        plane.put(part, keys, {"x": np.arange(12) * 10})
        with stowage.connect(plane.directory) as c:
            pids = plane.unit_pids
            os.kill(pids[0], signal.SIGKILL)
            assert wait_dead(pids[0])
            # The get finds unit 0 dead: rows 0, 3, 6, 9 (copies on 0 and
            # 1) and 2, 5, 8, 11 (on 2 and 0) are short of a copy.
            got = c.get(part, keys, ["x"], timeout=10.0)["x"]
            assert [int(a) for a in got] == [k * 10 for k in keys]
            until = time.monotonic() + 30
            while c.metrics()["repairs_pending"] or not c.metrics()["repaired_newcomers"]:
                assert time.monotonic() < until, c.metrics()
                time.sleep(0.05)
            m = c.metrics()
            assert (m["repaired_newcomers"], m["repaired_values"]) == (2, 8), m
            # Nothing left: a pass now copies nothing, and nothing lacks.
            assert c.under_replicated() == []
            r = c.repair()
            assert (r["done"], r["left"], r["values"]) == (0, 0, 0), r
            os.kill(pids[1], signal.SIGKILL)
            assert wait_dead(pids[1])
            got = c.get(part, keys, ["x"], timeout=10.0)["x"]
            assert [int(a) for a in got] == [k * 10 for k in keys]


def test_what_a_newcomer_lacks_is_counted_and_a_pass_copies_it(part):
    """A client that finds a unit dead counts what the units that took its
    copies lack, and one pass (as the background repair would) copies it;
    rows left with one copy get their copies from rebuild_copies."""
    with stowage.local(units=3, memory="32MiB", replicas=2) as plane:
        keys = list(range(12))
        plane.put(part, keys, {"x": np.arange(12) * 10, "y": np.arange(12)})
        with stowage.connect(plane.directory) as c:
            assert c.under_replicated() == []
            r = c.rebuild_copies()
            # Every unit's rows, each copy to the other: nothing missing.
            assert (r["done"], r["left"], r["values"]) == (6, 0, 0), r
            pid = plane.unit_pids[2]
            os.kill(pid, signal.SIGKILL)
            assert wait_dead(pid)
            c.get(part, keys, ["x"], timeout=10.0)
            short = sorted((s["unit"], s["rows"], s["values"]) for s in c.under_replicated())
            # Unit 1's rows (copies on 1 and 2) and unit 2's (on 2 and 0),
            # 4 rows of 2 values each, unless the background pass was first.
            assert short in ([(1, 4, 8), (2, 4, 8)], []), short
            c.repair()
            assert c.under_replicated() == []
            # By this pass or the background one, in this client: 16.
            assert c.metrics()["repaired_values"] == 16, c.metrics()


def test_another_number_than_the_directorys_is_refused(dp2):
    d = dp2.directory
    with pytest.raises(
        stowage.InvalidRequest, match="replicas=3 was given, but the plane's directory says 2"
    ):
        stowage.connect(d, replicas=3)
    with pytest.raises(stowage.InvalidRequest, match="replicas=1 was given"):
        stowage.connect(d, replicas=1)
    # A directory written before the key: one copy.
    old = {k: v for k, v in d.items() if k != "replicas"}
    with stowage.connect(old) as c:
        assert c.replicas == 1
    with pytest.raises(stowage.InvalidRequest, match="directory says 1"):
        stowage.connect(old, replicas=2)
    # A directory naming more copies than units.
    with pytest.raises(stowage.InvalidRequest, match="replicas = 4 for 3 units"):
        stowage.connect({**d, "replicas": 4})


def test_more_replicas_than_units_is_refused():
    for n in (3, 0):
        with pytest.raises(stowage.InvalidRequest, match=f"replicas={n} for 2 units"):
            stowage.local(units=2, memory="32MiB", replicas=n)
    # Addresses without a directory: the client itself refuses.
    with pytest.raises(stowage.InvalidRequest, match="replicas = 3 for 2 units"):
        stowage.connect(["unix:/nonexistent/a.sock", "unix:/nonexistent/b.sock"], replicas=3)
    with pytest.raises(stowage.InvalidRequest, match="at least 1, got -1"):
        _native.Client(["unix:/nonexistent/a.sock"], replicas=-1)


def test_the_config_key():
    assert stowage.config.load()["units"]["replicas"] == 1
    assert stowage.config.load(text="[units]\nreplicas = 2\n")["units"]["replicas"] == 2
    for text, phrase in [
        ("[units]\nreplicas = 0\n", "at least 1"),
        ("[units]\nreplicas = 1.5\n", "expected usize"),
        ("[units]\ncount = 2\nreplicas = 3\n", "need at least 3 units, but units.count is 2"),
    ]:
        with pytest.raises(stowage.InvalidRequest, match=phrase) as e:
            stowage.config.load(text=text)
        assert e.value.key == "units.replicas"


def test_ray_start_units_refuses_fewer_units_than_replicas():
    ray_launcher = pytest.importorskip("stowage.ray")
    # Refused before anything starts (Ray need not even be running).
    with pytest.raises(
        stowage.InvalidRequest,
        match=r"units\.replicas = 3 needs at least 3 units, but 2 were planned",
    ):
        ray_launcher.start_units({"units": {"replicas": 3}}, ["node-a", "node-b"])


def test_the_transferqueue_block_passes_replicas_on():
    from stowage import _tq_config

    assert "replicas" not in _tq_config._unit_config(_tq_config._block({}))["units"]
    cfg = _tq_config._unit_config(_tq_config._block({"replicas": 2}))
    assert cfg["units"]["replicas"] == 2
    # What start_units reads of it.
    assert _native.load_config(mapping=cfg)["units"]["replicas"] == 2


def test_a_unit_started_again_rejoins_and_is_repaired(part):
    """Unit 1 is killed; rows are rewritten and cleared around it; a unit
    started again at its socket (empty, another instance) is taken back in
    with ``rejoin`` (docs/replication.md#rejoining), the background repair
    fills it, and with unit 2 then killed every row of unit 1's reads back
    from the rejoined unit as last put, the cleared ones not found."""
    with stowage.local(units=3, memory="32MiB", replicas=2) as plane:
        keys = list(range(12))
        plane.put(part, keys, {"x": np.arange(12)})
        with stowage.connect(plane.directory) as c:
            pids = plane.unit_pids
            os.kill(pids[1], signal.SIGKILL)
            assert wait_dead(pids[1])
            c.put(part, keys, {"x": np.arange(12) + 100}, timeout=10.0)
            c.clear(part, [9, 10, 11])
            assert c.rejoin(0)["already"]
            again = _native.Unit(
                "32MiB",
                uds=plane.units[1][len("unix:") :],
                secret=plane._plane.secret,
                mlock=False,
                metrics=False,
            )
            try:
                r = c.rejoin(1)
                assert not r["already"] and r["epoch"] == 1, r
                assert r["instance"] == again.instance_id, r
                assert (r["moved"], r["unreached"]) == (3, []), r
                until = time.monotonic() + 30
                while c.under_replicated() or c.metrics()["repairs_pending"]:
                    assert time.monotonic() < until, c.under_replicated()
                    time.sleep(0.05)
                os.kill(pids[2], signal.SIGKILL)
                assert wait_dead(pids[2])
                got = c.get(part, keys[:9], ["x"], timeout=10.0)["x"]
                assert [int(a) for a in got] == [k + 100 for k in keys[:9]]
                for k in (9, 10, 11):
                    with pytest.raises(stowage.NotFound):
                        c.get(part, [k], ["x"], timeout=10.0)
            finally:
                again.stop()
