"""start_units says, within its timeout, what it is waiting for: on a small
local Ray (one CPU, started by each test's own driver, a subprocess with a
bounded run), units that cannot be scheduled because the CPU or the memory
they need is taken raise PlacementError naming the missing resource, what
the node has free and what the cluster's tasks and actors wait for; units
whose CPUs leave the cluster less than one CPU are started with a warning
saying so."""

import importlib.util

import drivers
import pytest
from drivers import line

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="Ray is not installed (pip install 'stowage-rl[ray]')",
)

# The driver's preamble: a private one-CPU Ray (address="local": never a
# cluster already running on this machine).
PREAMBLE = """
import logging, sys, time
import ray, stowage, stowage.ray
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
node = ray.get_runtime_context().get_node_id()
print("NODE", node)

@ray.remote(num_cpus=1)
class Holder:
    def ping(self):
        return 1

@ray.remote(num_cpus=1)
def a_task():
    return 1

def placement_error(config, nodes, timeout):
    t0 = time.monotonic()
    try:
        stowage.ray.start_units(config, nodes, timeout=timeout)
    except stowage.ray.PlacementError as e:
        print("ERROR", str(e).replace("\\n", " "))
        print("SECONDS", round(time.monotonic() - t0, 1))
    else:
        print("STARTED")
"""


def driver(body: str, timeout: float = 180) -> str:
    return drivers.driver(PREAMBLE, body, timeout)


def test_a_unit_whose_cpu_is_taken_fails_naming_the_cpu_and_the_waiting_work():
    out = driver(
        """
        holder = Holder.remote()
        assert ray.get(holder.ping.remote(), timeout=60) == 1  # the one CPU is taken
        waiting = a_task.remote()  # and a task waits for it
        placement_error({"units": {"memory": "16MiB", "cpus": 1}}, [node], timeout=5)
        """
    )
    msg = line(out, "ERROR")
    assert float(line(out, "SECONDS")) < 5 + 20, out  # its timeout, and a bounded teardown
    assert f"unit 0 on node {line(out, 'NODE')} did not come up within 5 s" in msg, msg
    assert "still PENDING_CREATION" in msg, msg
    assert "it needs 1 CPU and 16 MiB of memory on node" in msg, msg
    assert "which has 0 of its 1 CPU and " in msg, msg
    assert "not enough CPU free" in msg, msg
    assert "the Ray cluster has 0 of its 1 CPUs" in msg, msg
    # The task waits for the CPU too (Ray's own report).
    assert (
        "tasks and actors waiting for resources, as `ray status` reports them: 1 x {1 CPU}" in msg
    ), msg


def test_a_unit_whose_memory_is_taken_fails_naming_the_memory():
    out = driver(
        """
        total = ray.cluster_resources()["memory"]
        # Every byte of Ray memory but 8 MiB is held (and no CPU).
        holder = Holder.options(num_cpus=0, memory=int(total) - (8 << 20)).remote()
        assert ray.get(holder.ping.remote(), timeout=60) == 1
        placement_error({"units": {"memory": "64MiB"}}, [node, node], timeout=5)
        """
    )
    msg = line(out, "ERROR")
    # Each unit still pending at the deadline is named as such.
    for i in (0, 1):
        assert f"unit {i} on node {line(out, 'NODE')} did not come up within 5 s" in msg, msg
    assert "not waited for" not in msg, msg
    assert "it needs 64 MiB of memory on node" in msg, msg
    assert "which has 8 MiB of its " in msg, msg
    assert "not enough memory free" in msg, msg


def test_units_that_leave_less_than_one_cpu_are_started_with_a_warning():
    out = driver(
        """
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        units = stowage.ray.start_units({"units": {"memory": "16MiB", "cpus": 0.5}}, [node], timeout=120)
        print("PROBLEMS", stowage.ray.stop_units(units, timeout=30))
        """
    )
    assert line(out, "PROBLEMS") == "[[]]", out
    assert (
        "CPUs reserved by 1 storage unit(s): 0.5 of this Ray cluster's 1, leaving 0.5: a Ray "
        "task or actor that asks for 1 CPU" in out
    ), out
