"""TransferQueue's own SimpleStorage units on planned nodes
(:mod:`stowage.tq_simple`), on a local multi-node Ray cluster
(``ray.cluster_utils.Cluster``, every node on 127.0.0.1): the units run on
exactly the nodes stowage's placement plans (each actor asked for its own
node id), TransferQueue's kv operations and its own kv suite pass against
them, and a placement that cannot be met fails fast, naming the node and
what is missing, with nothing left running.

Needs ``transferqueue`` (``scripts/test-tq`` runs these in a venv that has it).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

# Without it Ray moves a node asked to run on 127.0.0.1 to the machine's
# other address; it must be set before ray is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

tq = pytest.importorskip(
    "transfer_queue",
    reason="transferqueue is not installed: these tests need `pip install 'stowage-rl[tq]'` "
    "(scripts/test-tq runs them in a venv that has it)",
)
torch = pytest.importorskip("torch", reason="TransferQueue needs torch")

import ray  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transfer_queue import interface  # noqa: E402
from transfer_queue.storage.bootstrap import StorageBootstrapProvider  # noqa: E402

import stowage  # noqa: E402
import stowage.tq_simple  # noqa: E402
from stowage.ray import PlacementError  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
LOOPBACK = "127.0.0.1"
#: Each bounded wait for Ray to settle (a killed actor's state and CPUs).
SETTLE_S = 60.0
#: How long the units may take to start (their start_timeout).
START_S = 600.0
#: TransferQueue's kv suite, run in a child pytest (a few minutes on a
#: loaded 2-core machine at most).
SUITE_S = 1200.0


# -- no cluster --------------------------------------------------------------------


def test_the_provider_is_registered_and_without_the_block_is_transferqueues(monkeypatch):
    provider = StorageBootstrapProvider.get_provider("SimpleStorage")
    assert getattr(provider, "__wrapped__", None) is stowage.tq_simple.initialize_simple_storage
    calls = []
    monkeypatch.setattr(stowage.tq_simple, "_tq_provider", lambda conf: calls.append(conf) or "tq")
    conf = OmegaConf.create({"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {}}})
    assert provider(conf) == "tq" and calls == [conf]
    conf.backend.SimpleStorage.storage_unit_placement = None
    assert provider(conf) == "tq" and len(calls) == 2


@pytest.mark.parametrize(
    "block, want",
    [
        (
            {"clusters": ["train"], "nodes": {"train": ["a", "b"], "inference": ["c"]}},
            ["a", "b", "a", "b"],
        ),
        ({"nodes": {"train": ["a", "b"], "inference": ["c"]}}, ["a", "b", "c"] * 2),
        (
            {
                "clusters": "all",
                "nodes": {"train": ["a", "b"], "teacher:t": ["b", "d"]},
                "count": 5,
            },
            ["a", "b", "d", "a", "b"],
        ),
        (
            {"clusters": ["inference"], "nodes": {"train": ["a"], "inference": ["c"]}, "count": 1},
            ["c"],
        ),
    ],
)
def test_plan(block, want):
    assert stowage.tq_simple.plan(block) == want
    assert stowage.tq_simple.plan(OmegaConf.create(block)) == want


@pytest.mark.parametrize(
    "block, phrase",
    [
        ({"clusters": ["train"]}, "storage_unit_placement.nodes must map"),
        ({"nodes": {}}, "storage_unit_placement.nodes must map"),
        ({"nodes": ["a"]}, "storage_unit_placement.nodes must map"),
        ({"nodes": {"train": ["a"]}, "clustres": ["train"]}, "unknown key 'clustres'"),
        ({"nodes": {"train": ["a"]}, "clusters": ["trian"]}, 'its clusters: "train"'),
        ({"nodes": {"train": ["a"]}, "count": 0}, "at least 1"),
        ({"nodes": {"train": ["a"]}, "cpus": -1}, "storage_unit_placement.cpus"),
        ({"nodes": {"train": ["a"]}, "start_timeout": 0}, "start_timeout must be more than 0"),
        ("train", "must be a mapping"),
    ],
)
def test_plan_errors(block, phrase):
    with pytest.raises(stowage.InvalidRequest) as e:
        stowage.tq_simple.plan(block)
    assert phrase in str(e.value)


def test_transferqueues_kv_suite_passes_against_placed_units(tmp_path):
    """TransferQueue's own test_kv_interface_e2e.py, unmodified, in a child
    pytest whose plugin (stowage_tq_simple_plugin) starts a three-node
    cluster and places two SimpleStorage units on its two "train" nodes;
    the plugin reports where each unit runs. (Runs before the module's
    cluster starts: one local cluster at a time.)"""
    site = pathlib.Path(tq.__file__).resolve().parent.parent
    suite = site / "tests" / "e2e" / "test_kv_interface_e2e.py"
    assert suite.is_file(), f"{suite} is not in the installed transferqueue"
    report = tmp_path / "placement.json"
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p),
        TQ_TEST_BACKEND="PlacedSimpleStorage",
        STOWAGE_TQ_SIMPLE_REPORT=str(report),
        RAY_DEDUP_LOGS="0",
    )
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "-p", "stowage_tq_simple_plugin", "-W", "ignore::DeprecationWarning",
        "-o", "asyncio_default_fixture_loop_scope=function", str(suite),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=SUITE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"the kv suite did not finish within {SUITE_S:g} s:\n{out[-6000:]}")
    tail = out[-6000:]
    assert proc.returncode == 0, tail
    summary = [ln for ln in out.splitlines() if " passed" in ln]
    assert summary, tail
    # Every test of the suite ran and passed: nothing failed, skipped or deselected.
    assert re.match(r"^=* ?\d+ passed(, \d+ warnings?)? in ", summary[-1]), summary[-1]
    got = json.loads(report.read_text())
    # Two units, one on each of the two "train" nodes, each where planned.
    assert got["actual"] == got["planned"], got
    assert len(got["planned"]) == 2 and len(set(got["planned"])) == 2, got
    assert got["names"] == [f"TransferQueueStorageUnit#{i}" for i in range(2)]


# -- on a cluster -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """A head (2 CPUs: the controller, the driver's tasks) and two nodes A
    and B with 3 CPUs each. Every wait below is bounded."""
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "node_ip_address": LOOPBACK},
    )
    try:
        nodes = [c.head_node] + [c.add_node(num_cpus=3, node_ip_address=LOOPBACK) for _ in "AB"]
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes(timeout=120)
        c.head, c.a, c.b = (n.node_id for n in nodes)
        yield c
    finally:
        tq.close()
        ray.shutdown()
        c.shutdown()


def _conf(**placement):
    # Generous: each unit starts a Python worker that imports torch, on a
    # 2-core machine shared with others.
    placement.setdefault("start_timeout", START_S)
    return OmegaConf.create(
        {
            "controller": {"polling_mode": True},
            "backend": {
                "storage_backend": "SimpleStorage",
                "SimpleStorage": {"storage_unit_placement": placement},
            },
        }
    )


def _on_node(handles):
    """The node id each actor reports for itself."""
    return ray.get(
        [
            h.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
            for h in handles.values()
        ],
        timeout=60,
    )


def _same_rows(got, want):
    """Row by row equal (TransferQueue may return a jagged nested tensor)."""
    rows = list(got.unbind()) if got.is_nested else list(got)
    return len(rows) == len(want) and all(torch.equal(g, w) for g, w in zip(rows, want))


def _stored_rows(handles):
    return ray.get(
        [
            h.__ray_call__.remote(lambda self: self.storage_data.active_key_count)
            for h in handles.values()
        ],
        timeout=60,
    )


def _not_dead(classes=("SimpleStorageUnit", "TransferQueueController")):
    """Actors of these classes that Ray does not (yet) consider dead."""
    actors = ray._private.state.actors()
    return [
        (a["ActorClassName"], a["State"], a["Address"]["NodeID"])
        for a in actors.values()
        if a["ActorClassName"] in classes and a["State"] != "DEAD"
    ]


def _units_ever():
    """Every SimpleStorageUnit actor Ray has a record of, dead ones included."""
    return sorted(
        a["ActorID"]
        for a in ray._private.state.actors().values()
        if a["ActorClassName"] == "SimpleStorageUnit"
    )


def _settled(want_cpus):
    """Waits (bounded) until no unit or controller actor is left and every
    CPU is free again; returns what is left and the free CPUs."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        left = _not_dead()
        free = ray.available_resources().get("CPU", 0.0)
        if (not left and free == want_cpus) or time.monotonic() > deadline:
            return left, free
        time.sleep(0.2)


def test_units_run_on_exactly_the_planned_nodes_and_serve_kv(cluster):
    """clusters: [train] over train = [A, B] (inference = [head] left out),
    no count: two units per node, A, B, A, B; each SimpleStorageUnit
    reports that node itself; rows put through TransferQueue land on every
    unit and read back, and a clear empties them all."""
    c = cluster
    total = ray.cluster_resources()["CPU"]
    final = tq.init(_conf(clusters=["train"], nodes={"train": [c.a, c.b], "inference": [c.head]}))
    try:
        handles = interface._TQ_STORAGE["SimpleStorage"]
        assert list(handles) == [f"TransferQueueStorageUnit#{i}" for i in range(4)]
        assert _on_node(handles) == [c.a, c.b, c.a, c.b]
        # Ray's own record agrees: no other SimpleStorageUnit runs anywhere.
        units = sorted(n for cls, state, n in _not_dead(("SimpleStorageUnit",)))
        assert units == sorted([c.a, c.b, c.a, c.b])
        assert final.backend.SimpleStorage.num_data_storage_units == 4
        assert sorted(final.backend.SimpleStorage.zmq_info) == sorted(handles)

        keys = [f"k{i}" for i in range(32)]
        ids = torch.arange(32 * 4).reshape(32, 4)
        reward = torch.arange(32, dtype=torch.float32) / 4
        tq.kv_batch_put(
            keys=keys,
            partition_id="p0",
            fields=TensorDict({"ids": ids, "reward": reward}, batch_size=32),
            tags=[{"i": i} for i in range(32)],
        )
        rows = _stored_rows(handles)
        assert sum(rows) == 32 and all(r > 0 for r in rows), rows
        got = tq.kv_batch_get(keys=keys, partition_id="p0")
        assert _same_rows(got["ids"], ids) and _same_rows(got["reward"], reward)
        some = keys[5:9]
        got = tq.kv_batch_get(keys=some, partition_id="p0", select_fields=["ids"])
        assert _same_rows(got["ids"], ids[5:9]) and list(got.keys()) == ["ids"]
        assert sorted(tq.kv_list(partition_id="p0")["p0"]) == sorted(keys)
        tq.kv_clear(keys=keys, partition_id="p0")
        assert _stored_rows(handles) == [0, 0, 0, 0]
    finally:
        tq.close()
    left, free = _settled(total)
    assert left == [] and free == total, (left, free)


@pytest.mark.parametrize(
    "case",
    ["node not in the cluster", "too few CPUs", "lacks required_node_resource"],
)
def test_an_unsatisfiable_placement_fails_at_once(cluster, case):
    """Before anything starts: the error names the node and what is
    missing; TransferQueue's controller is removed, no unit runs."""
    c = cluster
    total = ray.cluster_resources()["CPU"]
    ghost = "ab" * 28
    if case == "node not in the cluster":
        conf, node, what = _conf(nodes={"train": [c.a, ghost]}), ghost, "not in this Ray cluster"
    elif case == "too few CPUs":
        # Four units of 1 CPU on A, which has 3.
        conf, node, what = _conf(nodes={"train": [c.a]}, count=4), c.a, "CPU"
    else:
        conf = _conf(nodes={"train": [c.a, c.b]})
        conf.backend.SimpleStorage.required_node_resource = "ssd_node"
        node, what = c.a, "ssd_node"
    units_before = _units_ever()
    with pytest.raises(PlacementError) as e:
        tq.init(conf)
    msg = str(e.value)
    assert node in msg and what in msg, msg
    # Refused before any unit was created (not after a start timeout).
    assert _units_ever() == units_before
    assert interface._TQ_CONTROLLER is None and interface._TQ_STORAGE is None
    left, free = _settled(total)
    assert left == [] and free == total, (left, free)


def test_a_unit_that_cannot_come_up_fails_within_start_timeout_and_nothing_is_left(cluster):
    """A's CPUs are all taken: its unit stays pending; after start_timeout
    the error names it, its node and the CPUs free there; the unit that
    came up on B is shut down and killed, and the controller too."""
    c = cluster
    total = ray.cluster_resources()["CPU"]

    @ray.remote(num_cpus=3)
    class Hog:
        def ready(self):
            return True

    hog = Hog.options(scheduling_strategy=NodeAffinitySchedulingStrategy(c.a, soft=False)).remote()
    try:
        ray.get(hog.ready.remote(), timeout=SETTLE_S)
        with pytest.raises(PlacementError) as e:
            tq.init(_conf(nodes={"train": [c.a, c.b]}, count=2, start_timeout=20))
        msg = str(e.value)
        assert (
            f"unit 0 (TransferQueueStorageUnit#0) on node {c.a} did not come up within 20 s" in msg
        )
        assert f"it needs 1 CPU on node {c.a}, which has 0 of its 3 CPUs free" in msg, msg
        assert "not enough CPU free" in msg, msg
        assert interface._TQ_CONTROLLER is None and interface._TQ_STORAGE is None
        left, _ = _settled(total - 3)
        assert left == [], left
    finally:
        ray.kill(hog, no_restart=True)
    left, free = _settled(total)
    assert left == [] and free == total, (left, free)
