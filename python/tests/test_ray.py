"""stowage.ray on a real local Ray cluster: three logical nodes on this
machine (ray.cluster_utils.Cluster, every process on 127.0.0.1), shared by
the module's tests. Units start as actors pinned to their planned nodes;
clients in other Ray workers put and get through them; a killed unit's
keys, and only those, are reported lost; stop_units leaves no process and
no directory behind; a placement that cannot be met fails within its
timeout, naming what was missing."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import numpy as np
import pytest

# Without it Ray moves a node asked to run on 127.0.0.1 to the machine's
# other address; it must be set before ray is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'stowage-rl[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

import stowage  # noqa: E402
import stowage.ray  # noqa: E402
from stowage import _native  # noqa: E402

from conftest import (  # noqa: E402
    NO_ENTRY,
    NO_SECRET,
    alive,
    assert_other_user_refused,
    can_switch_user,
    stowage_as_other_user,
    wait_dead,
    wait_stopped,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
# Generous: the units start a Python worker each on a 2-core machine.
START_S = 90.0
HEX32 = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def cluster():
    """A head node and two more: head and B with 3 CPUs, C with 2 (the
    placement tests run C out of CPUs). Every wait below is bounded."""
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 3,
            "include_dashboard": False,
            "node_ip_address": LOOPBACK,
        },
    )
    try:
        nodes = [c.head_node]
        for cpus in (3, 2):
            nodes.append(c.add_node(num_cpus=cpus, node_ip_address=LOOPBACK))
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes(timeout=60)
        c.node_ids = [n.node_id for n in nodes]
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def settled_cpus(want: float, timeout: float = 30.0) -> float:
    """The cluster's free CPUs once they equal `want` (or after `timeout`):
    a killed actor's CPU comes back when its worker is gone."""
    deadline = time.monotonic() + timeout
    while True:
        got = ray.available_resources().get("CPU", 0.0)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


# -- the README example (first: it places a unit on every node) --------------


def readme_ray_example() -> str:
    from readme_examples import readme_block

    return readme_block("## On a Ray cluster")


def test_the_launcher_takes_its_settings_from_the_checked_config(tmp_path):
    """No Ray cluster needed: a dict config is checked by the extension
    module as a file is (stowage.ray validates nothing itself), and the
    launcher takes normalized values from it."""
    secret = b"s" * 16
    s = stowage.ray._Settings(
        {
            "units": {"memory": "16MiB", "pin_lease": 5, "disk": {"root": "/d"}, "cpus": 0},
            "timeouts": {"start": "1m", "stop": 7.5},
            "listen": {"host": "node-ip"},
        },
        secret,
    )
    assert s.memory == 16 << 20 and s.cpus == 0.0 and s.count is None
    assert s.start_timeout == 60.0 and s.stop_timeout == 7.5
    kw = s.unit_kwargs
    assert kw["memory"] == 16 << 20 and kw["pin_lease"] == 5.0 and kw["reservation_lease"] == 30.0
    assert (kw["disk"], kw["disk_capacity"], kw["high_watermark"]) == ("/d", 20 << 30, 0.9)
    assert kw["secret"] == secret and s.generated is None
    assert s.listen == {"host": "node-ip", "tcp_port": 0, "unix_dir": None}
    # What stowage.config.load returned, and a file's path, give the same.
    path = tmp_path / "stowage.toml"
    path.write_text('[units]\nmemory = "16MiB"\npin_lease = "5s"\n')
    loaded = stowage.config.load(path)
    for config in (loaded, str(path), path):
        t = stowage.ray._Settings(config, secret)
        assert t.memory == 16 << 20 and t.unit_kwargs["pin_lease"] == 5.0
    for bad, key in [
        ({"units": {"memroy": "1GiB"}}, "units.memroy"),
        ({"unit": {}}, "unit"),
        ({"units": {"cpus": -1}}, "units.cpus"),
        ({"timeouts": {"start": "soon"}}, "timeouts.start"),
        ({"units": {"disk": {"capacity": "1GiB"}}}, "units.disk"),
    ]:
        with pytest.raises(stowage.InvalidRequest) as e:
            stowage.ray._Settings(bad, secret)
        assert e.value.key == key, (bad, str(e.value))
    with pytest.raises(stowage.InvalidRequest, match="config must be a dict"):
        stowage.ray._Settings(["units"], secret)


def test_readme_ray_example_runs_as_written(cluster, tmp_path):
    script = tmp_path / "ray_units.py"
    script.write_text(readme_ray_example())
    # The example's ray.init() joins this cluster (RAY_ADDRESS).
    env = dict(os.environ, RAY_ADDRESS=cluster.address)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Ray example done" in done.stdout


# -- units shared by the placement and client tests --------------------------


@pytest.fixture(scope="module")
def units(cluster):
    """One unit per node, 32 MiB and 1 CPU each (the placement test counts
    on the CPU)."""
    u = stowage.ray.start_units(
        {"units": {"memory": "32MiB", "cpus": 1}}, cluster.node_ids, timeout=START_S
    )
    yield u
    stowage.ray.stop_units(u, timeout=30)


@pytest.mark.skipif(not can_switch_user(), reason="needs root and setpriv to play another user")
def test_the_units_refuse_another_user_and_the_directory_carries_their_secret(units, part):
    """Issue 21: start_units without a secret generates one per plane; the
    units' loopback TCP and Unix sockets refuse another user (uid 65534);
    the directory (in memory) carries the secret to this job's clients."""
    if os.environ.get("STOWAGE_SECRET"):
        pytest.skip("STOWAGE_SECRET is set: the units use it")
    assert len(units.directory["secret_hex"]) == 128
    for u in units.directory["units"]:
        assert_other_user_refused(stowage_as_other_user("stats", u["tcp"]), NO_SECRET)
        assert_other_user_refused(stowage_as_other_user("stats", u["uds"]), NO_ENTRY)
    with stowage.connect(units.directory, transport="tcp", timeout=30) as plane:
        # (Nothing put: the module's units count rows in later tests.)
        assert len(plane.stats()) == len(units)
    # Connecting is lazy: the first call is refused.
    tcp = [u["tcp"] for u in units.directory["units"]]
    with stowage.connect(tcp, timeout=10, secret=None) as plane:
        with pytest.raises(stowage.Unauthorized):
            plane.stats()


@ray.remote(num_cpus=0)
def node_of_actor(actor):
    """A unit actor's node, as the actor's own runtime context says."""
    return ray.get(actor.info.remote())["node"]


def test_units_start_on_their_planned_nodes(cluster, units):
    assert units.node_ids == cluster.node_ids
    assert len(units) == 3
    entries = units.directory["units"]
    assert units.directory["stowage_directory"] == 1
    assert units.directory["replicas"] == 1
    # Each actor reports the node it runs on (ray.get_runtime_context()
    # inside the actor), asked here from another worker.
    assert ray.get([node_of_actor.remote(a) for a in units], timeout=60) == cluster.node_ids
    host = _native.host_id()
    for i, (e, actor) in enumerate(zip(entries, units)):
        assert e["index"] == i
        assert e["node"] == cluster.node_ids[i]
        assert e["host"] == host  # every logical node is this machine
        assert HEX32.fullmatch(e["instance_id"]), e
        assert e["uds"].startswith("unix:/") and e["uds"].endswith("/unit.sock")
        assert e["tcp"].startswith(f"tcp:{LOOPBACK}:"), e["tcp"]
        assert e["ray"]["actor_id"] == actor._actor_id.hex()
        assert e["ray"]["namespace"] == ray.get_runtime_context().namespace
        assert alive(e["pid"]) and e["pid"] != os.getpid()
        assert ray.get(actor.ready.remote(), timeout=30) is True
        assert ray.get(actor.stats.remote(), timeout=30)["capacity"] == 32 << 20
        # [metrics] by default: each unit serves /metrics on loopback.
        assert e["metrics"].startswith(f"http://{LOOPBACK}:"), e
        with urllib.request.urlopen(e["metrics"], timeout=10) as r:
            text = r.read().decode()
        assert f'stowage_slab_capacity_bytes{{unit="unit-{i}"}} {32 << 20}' in text, text[:2000]
    # The directory is plain JSON.
    assert json.loads(json.dumps(units.directory)) == units.directory


@ray.remote(num_cpus=0)
def worker_puts_and_gets(directory, part):
    """A client inside a Ray worker; counts liveness calls (there must be
    none: every operation succeeds)."""
    import stowage
    import stowage.ray

    calls = []
    real = stowage.ray.liveness

    def counting(entry, *a, **kw):
        calls.append(entry["index"])
        return real(entry, *a, **kw)

    stowage.ray.liveness = counting
    try:
        with stowage.connect(directory) as plane:
            keys = list(range(9))
            plane.put(part, keys, {"tok": [np.arange(k + 1, dtype=np.int32) for k in keys]})
            got = plane.get(part, keys, ["tok"])["tok"]
            units = plane.units
            rows = [s["rows"] for s in plane.stats()]
        # Ray's answer from inside a worker (what a failure would ask).
        said = [real(e) for e in directory["units"]]
        return [a.tolist() for a in got], units, rows, calls, said
    finally:
        stowage.ray.liveness = real


def test_a_client_in_another_ray_worker_puts_and_gets(units, part):
    got, addrs, rows, calls, said = ray.get(
        worker_puts_and_gets.remote(units.directory, part), timeout=120
    )
    assert got == [list(range(k + 1)) for k in range(9)]
    # Same host: every unit through its Unix socket (shared memory).
    assert addrs == [e["uds"] for e in units.directory["units"]]
    assert rows == [3, 3, 3]
    assert calls == []
    assert said == ["alive"] * 3
    # What the worker put, this process reads.
    with stowage.connect(units.directory) as plane:
        mine = plane.get(part, [4, 8], ["tok"])["tok"]
        assert [a.tolist() for a in mine] == [list(range(5)), list(range(9))]
        plane.clear_partition(part)


def test_killing_a_unit_loses_exactly_its_keys(cluster, part, monkeypatch, tmp_path):
    calls = []
    real = stowage.ray.liveness

    def counting(entry, *a, **kw):
        calls.append(entry["index"])
        return real(entry, *a, **kw)

    monkeypatch.setattr(stowage.ray, "liveness", counting)
    # These units listen on Ray's address of their node (127.0.0.1 here)
    # and put their sockets in a directory of ours.
    sockets = tmp_path / "sockets"
    sockets.mkdir()
    cfg = {
        "units": {"memory": "16MiB"},
        "listen": {"host": "node-ip", "unix_dir": str(sockets)},
    }
    two = stowage.ray.start_units(cfg, cluster.node_ids[:2], timeout=START_S)
    try:
        entries = two.directory["units"]
        assert all(e["tcp"].startswith(f"tcp:{LOOPBACK}:") for e in entries), entries
        assert all(e["uds"].startswith(f"unix:{sockets}/") for e in entries), entries
        plane = stowage.connect(two.directory, timeout=10)
        keys = list(range(10))
        for _ in range(5):
            plane.put(part, keys, {"x": np.arange(10, dtype=np.int64)})
            assert [int(a) for a in plane.get(part, keys, ["x"])["x"]] == keys
            assert plane.list(part).keys() == set(keys)
            plane.stats()
        assert calls == [], "Ray was asked about liveness on the successful path"
        assert [real(e) for e in entries] == ["alive", "alive"]

        # A unit that is alive but does not answer (stopped): a retryable
        # error, and its keys are not lost.
        os.kill(entries[0]["pid"], signal.SIGSTOP)
        try:
            wait_stopped(entries[0]["pid"])
            with pytest.raises(stowage.Error) as e:
                plane.get(part, [0, 2], ["x"], timeout=1.0)
            assert isinstance(e.value, (stowage.Timeout, stowage.TransferFailed)), repr(e.value)
            assert e.value.retryable
        finally:
            os.kill(entries[0]["pid"], signal.SIGCONT)
        assert set(calls) <= {0}
        assert [int(a) for a in plane.get(part, [0, 2], ["x"])["x"]] == [0, 2]
        calls.clear()

        victim = entries[1]["pid"]
        ray.kill(two[1], no_restart=True)
        assert wait_dead(victim, 30)
        with pytest.raises(stowage.LostKeys) as e:
            plane.get(part, keys, ["x"])
        assert e.value.unit == 1
        assert sorted(k for k, _ in e.value.keys) == [k for k in keys if k % 2 == 1]
        assert calls and set(calls) == {1}
        assert real(entries[1]) == "dead"
        assert real(entries[0]) == "alive"
        # Unit 0 keeps serving: its keys, and new ones.
        assert [int(a) for a in plane.get(part, [0, 2, 4], ["x"])["x"]] == [0, 2, 4]
        plane.put(part, [20], {"y": np.array([7])})
        assert [int(a) for a in plane.get(part, [20], ["y"])["y"]] == [7]
        plane.close()
    finally:
        problems = stowage.ray.stop_units(two, timeout=20)
    # Never raises: the dead unit's teardown is reported, the live one's ran.
    assert problems[0] == []
    assert len(problems[1]) == 1 and "teardown did not run" in problems[1][0]
    assert wait_dead(entries[0]["pid"], 30)
    # The unit torn down removed its socket; the killed one could not.
    assert os.listdir(sockets) == [os.path.basename(entries[1]["uds"])]


def test_stop_units_leaves_no_process_and_no_directory(cluster, tmp_path, part):
    disk = tmp_path / "disk"
    cfg = {"units": {"memory": "16MiB", "disk": {"root": str(disk), "capacity": "64MiB"}}}
    two = stowage.ray.start_units(cfg, cluster.node_ids[:2], timeout=START_S)
    entries = two.directory["units"]
    pids = [e["pid"] for e in entries]
    socket_dirs = [pathlib.Path(e["uds"][len("unix:") :]).parent for e in entries]
    with stowage.connect(two.directory) as plane:
        plane.put(part, [0, 1], {"v": np.ones((2, 1000), dtype=np.float32)})
    assert len(os.listdir(disk)) == 2  # one locked directory per unit
    assert all(d.is_dir() for d in socket_dirs)

    problems = stowage.ray.stop_units(two, timeout=30)

    assert problems == [[], []]
    for pid in pids:
        assert wait_dead(pid, 30), f"unit process {pid} still runs"
    assert os.listdir(disk) == []
    assert not any(d.exists() for d in socket_dirs)
    # Stopping again is harmless (the actors are gone; nothing raises).
    again = stowage.ray.stop_units(two, timeout=5)
    assert len(again) == 2 and all(again)


def test_clusters_by_name_and_a_config_file(cluster, tmp_path):
    """A mapping of clusters: the config's placement selects them and its
    count plans the units round-robin over their nodes; the config comes
    as a file path or as stowage.config.load's dict."""
    import stowage.config

    head, b, c = cluster.node_ids
    clusters = {"train": [head, b], "inference": [c]}
    path = tmp_path / "stowage.toml"
    path.write_text(
        '[units]\nmemory = "16MiB"\ncount = 3\n'
        '[placement]\nclusters = ["train"]\n'
        '[timeouts]\nstop = "20s"\n'
    )
    path.write_text(path.read_text() + "[metrics]\nenabled = false\n")
    u = stowage.ray.start_units(str(path), clusters, timeout=START_S)
    try:
        assert u.node_ids == [head, b, head]
        # Metrics off: no endpoint, and units count no requests.
        assert all("metrics" not in e for e in u.directory["units"])
        assert ray.get(u[0].stats.remote(), timeout=30)["ops"] == 0
        assert ray.get([node_of_actor.remote(a) for a in u], timeout=60) == [head, b, head]
        assert u.stop_timeout == 20.0
    finally:
        assert stowage.ray.stop_units(u) == [[], [], []]

    cfg = stowage.config.load(
        text='[units]\nmemory = "16MiB"\ncount = 1\n[placement]\nclusters = ["inference"]\n'
    )
    u = stowage.ray.start_units(cfg, clusters, timeout=START_S)
    try:
        assert u.node_ids == [c]
    finally:
        assert stowage.ray.stop_units(u, timeout=20) == [[]]

    with pytest.raises(stowage.InvalidRequest, match="teacher:x"):
        stowage.ray.start_units({"placement": {"clusters": ["teacher:x"]}}, clusters, timeout=5)
    with pytest.raises(stowage.InvalidRequest, match=r"units\.memroy"):
        stowage.ray.start_units({"units": {"memroy": "1GiB"}}, [head], timeout=5)


def test_units_for_two_copies_of_every_row(cluster, part):
    """units.replicas: the directory carries it, a client connecting by it
    keeps two copies of every row, and fewer planned units than copies
    start nothing."""
    cfg = {"units": {"memory": "16MiB", "replicas": 2}}
    with pytest.raises(stowage.InvalidRequest, match="needs at least 2 units, but 1 were planned"):
        stowage.ray.start_units(cfg, cluster.node_ids[:1], timeout=START_S)
    two = stowage.ray.start_units(cfg, cluster.node_ids[:2], timeout=START_S)
    try:
        assert two.directory["replicas"] == 2
        with stowage.connect(two.directory, timeout=10) as plane:
            assert plane.replicas == 2
            plane.put(part, [0, 1, 2], {"x": np.arange(3)})
            assert [int(a) for a in plane.get(part, [0, 1, 2], ["x"])["x"]] == [0, 1, 2]
        # Every row on both units.
        assert [ray.get(u.stats.remote(), timeout=30)["rows"] for u in two] == [3, 3]
    finally:
        assert stowage.ray.stop_units(two, timeout=20) == [[], []]


def test_units_with_a_shared_secret(cluster, tmp_path, part, monkeypatch):
    """auth.secret_file: each unit reads the secret on its node; clients
    must prove it, the directory does not hold it, and teardown (an admin
    request) proves it too."""
    monkeypatch.delenv("STOWAGE_SECRET", raising=False)
    secret = "ray-s3cret-Horse-battery-staple-1"
    path = tmp_path / "secret"
    path.write_text(secret + "\n")
    path.chmod(0o600)
    cfg = {"units": {"memory": "16MiB"}, "auth": {"secret_file": str(path)}}
    one = stowage.ray.start_units(cfg, cluster.node_ids[:1], timeout=START_S)
    try:
        assert secret not in json.dumps(one.directory)
        # Connecting is lazy: the first call is refused.
        with stowage.connect(one.directory, timeout=10, secret=None) as refused:
            with pytest.raises(stowage.Unauthorized):
                refused.stats()
        with stowage.connect(one.directory, secret=secret, timeout=10) as plane:
            plane.put(part, [0, 1], {"x": [np.arange(2), np.arange(3)]})
            assert [a.tolist() for a in plane.get(part, [0, 1], ["x"])["x"]] == [[0, 1], [0, 1, 2]]
        assert ray.get(one[0].stats.remote(), timeout=30)["rows"] == 2
    finally:
        problems = stowage.ray.stop_units(one, timeout=20)
    assert problems == [[]]


def start_failing(*args, **kwargs):
    """start_units, which must raise PlacementError; with a hang guard (a
    thread joined with a bound) so that a hang fails the test instead of
    stalling the run."""
    out = {}

    def run():
        try:
            stowage.ray.start_units(*args, **kwargs)
            out["result"] = "started"
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(kwargs["timeout"] + 30)
    assert not t.is_alive(), (
        f"start_units did not return within its timeout of {kwargs['timeout']} s"
    )
    assert "error" in out, out
    assert isinstance(out["error"], stowage.ray.PlacementError), repr(out["error"])
    assert isinstance(out["error"], stowage.Error)
    return str(out["error"]), time.monotonic() - t0


def test_unsatisfiable_placement_fails_within_its_timeout_naming_what_is_missing(cluster, units):
    # Free: every CPU but those of the module's units (once the units of
    # earlier tests are gone).
    free = ray.cluster_resources()["CPU"] - len(units)
    assert settled_cpus(free) == free
    head, _, c = cluster.node_ids
    cfg = {"units": {"memory": "16MiB", "cpus": 1}}

    # A node that does not exist.
    ghost = "ab" * 28
    msg, _ = start_failing(cfg, [head, ghost], timeout=20)
    assert f"node {ghost} (for unit 1) is not in this Ray cluster" in msg

    # A node without enough CPUs in total, before anything starts.
    msg, _ = start_failing({"units": {"memory": "16MiB", "cpus": 3}}, [c], timeout=20)
    assert f"node {c} has 2 CPUs; unit 0 need 3" in msg
    msg, _ = start_failing(cfg, [c, c, c], timeout=20)
    assert f"node {c} has 2 CPUs; units 0, 1, 2 need 3" in msg

    # Enough CPUs in total, but one is taken (by the module's unit on C):
    # the second unit cannot come up; the first is stopped again.
    msg, _ = start_failing(cfg, [c, c], timeout=4)
    assert re.search(rf"unit [01] on node {c} did not come up within 4 s: still PENDING", msg), msg
    # It names what the unit needs, what its node has free, and the cluster.
    assert f"it needs 1 CPU and 16 MiB of memory on node {c}, which has " in msg, msg
    assert "not enough CPU free" in msg, msg
    assert "the Ray cluster has" in msg, msg

    # A unit whose start fails (memory below the minimum).
    msg, _ = start_failing({"units": {"memory": 1024}}, [head], timeout=START_S)
    assert f"unit 0 on node {head} failed to start" in msg
    assert "memory must be at least 4 KiB" in msg, msg

    # Nothing started by the failed attempts keeps its CPU.
    assert settled_cpus(free) == free


def test_units_die_with_the_job_that_started_them(cluster, tmp_path):
    disk = tmp_path / "disk"
    script = textwrap.dedent(
        f"""
        import json, ray, stowage.ray
        ray.init(log_to_driver=False)
        units = stowage.ray.start_units(
            {{"units": {{"memory": "16MiB", "disk": {{"root": {str(disk)!r}}}}}}},
            [{cluster.node_ids[1]!r}],
            timeout={START_S})
        print(json.dumps(units.directory), flush=True)
        """
    )
    env = dict(os.environ, RAY_ADDRESS=cluster.address)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stderr
    entry = json.loads(done.stdout.strip().splitlines()[-1])["units"][0]
    # The job ended without stop_units: Ray kills its (non-detached) actors.
    assert wait_dead(entry["pid"], 60), "a unit outlived the job that started it"
    shutil.rmtree(pathlib.Path(entry["uds"][len("unix:") :]).parent, ignore_errors=True)
    # Its disk directory stays, locked by nobody, until the next unit
    # under the same root removes it.
    left = os.listdir(disk)
    assert len(left) == 1 and left[0].startswith("stowage-unit-"), left
    u = _native.Unit("1MiB", disk=str(disk))
    try:
        assert len(os.listdir(disk)) == 1 and os.listdir(disk) != left
    finally:
        assert u.stop(10) == []
    assert os.listdir(disk) == []
