"""A pytest plugin that runs TransferQueue's own kv suite, unmodified, against
SimpleStorage units placed by :mod:`stowage.tq_simple` on a local
multi-node Ray cluster:

    TQ_TEST_BACKEND=PlacedSimpleStorage python -m pytest -p stowage_tq_simple_plugin \\
        $SITE/tests/e2e/test_kv_interface_e2e.py

(with this directory on PYTHONPATH; test_tq_simple_placement.py runs it so).
It

- imports :mod:`stowage.tq_simple`, which takes over TransferQueue's
  SimpleStorage bootstrap provider;
- starts, before each module's own fixtures, a private three-node Ray
  cluster (``ray.cluster_utils.Cluster``, every node on 127.0.0.1: a head
  with 2 CPUs for the controller and the suite's tasks, and two nodes
  with 3 CPUs, the ``train`` cluster), and adds to the module's
  ``BACKEND_CONFIGS`` a ``PlacedSimpleStorage`` entry: ``storage_backend:
  SimpleStorage`` with a ``storage_unit_placement`` block that selects
  ``train`` (the head is the ``inference`` cluster, left out) with
  ``count: 2``: one unit on each ``train`` node;
- checks, at the module's first test, that every unit runs on its planned
  node (each actor's own ``get_node_id()``), and writes the planned and
  the actual nodes as JSON to ``$STOWAGE_TQ_SIMPLE_REPORT`` when set.

The module's fixtures call ``ray.init`` only when Ray is not initialized
(it is, on this cluster) and shut Ray down at their end; the cluster
stops after them.
"""

from __future__ import annotations

import json
import os

import pytest

# Without it Ray moves a node asked to run on 127.0.0.1 to the machine's
# other address; it must be set before ray is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

BACKEND = "PlacedSimpleStorage"
LOOPBACK = "127.0.0.1"

_state: dict = {}


def pytest_configure(config):
    import stowage.tq_simple  # noqa: F401 - takes over the SimpleStorage provider


@pytest.fixture(scope="module", autouse=True)
def _stowage_placed_cluster(request):
    import ray
    from ray.cluster_utils import Cluster

    import stowage.tq_simple

    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "node_ip_address": LOOPBACK},
    )
    try:
        train = [c.add_node(num_cpus=3, node_ip_address=LOOPBACK) for _ in range(2)]
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes(timeout=120)
        block = {
            "clusters": ["train"],
            "nodes": {
                "train": [n.node_id for n in train],
                "inference": [c.head_node.node_id],
            },
            "count": 2,
            # Generous: each unit starts a Python worker that imports
            # torch, on a 2-core machine shared with others.
            "start_timeout": 600,
        }
        _state.update(planned=stowage.tq_simple.plan(block), checked=False)
        configs = getattr(request.module, "BACKEND_CONFIGS", None)
        if configs is not None:
            configs[BACKEND] = {
                "controller": {"polling_mode": True},
                "backend": {
                    "storage_backend": "SimpleStorage",
                    "SimpleStorage": {
                        "total_storage_size": 200,
                        "storage_unit_placement": block,
                    },
                },
            }
        yield
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(autouse=True)
def _stowage_units_on_plan(request):
    """Once per module, after its TransferQueue system is up: every unit
    runs on its planned node."""
    if _state.get("checked") or "tq_system" not in request.fixturenames:
        yield
        return
    request.getfixturevalue("tq_system")
    from transfer_queue import interface

    import stowage.tq_simple

    handles = interface._TQ_STORAGE["SimpleStorage"]
    actual = stowage.tq_simple.unit_nodes(handles)
    _state["checked"] = True
    report = os.environ.get("STOWAGE_TQ_SIMPLE_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump({"planned": _state["planned"], "actual": actual, "names": list(handles)}, f)
    assert actual == _state["planned"], (actual, _state["planned"])
    yield
