"""TransferQueue's bootstrap says, within its start_timeout, what it is
waiting for: on a small local Ray (two CPUs, started by each test's own
driver, a subprocess with a bounded run), units that cannot be scheduled
because TransferQueue's controller and the other unit took the CPUs make
tq.init raise PlacementError naming the missing CPU; units that leave the
cluster less than one CPU beside the controller start with a warning
saying so."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python" / "tests"))
import drivers
from drivers import line

pytest.importorskip(
    "transfer_queue",
    reason="transferqueue is not installed: these tests need `pip install 'stowage-rl[tq]'` "
    "(scripts/test-tq runs them in a venv that has it)",
)

PREAMBLE = """
import logging, sys, time
import ray, stowage.ray, stowage.tq
import transfer_queue as tq
from omegaconf import OmegaConf

# A private two-CPU Ray (address="local": never a cluster already running
# on this machine).
ray.init(
    address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
    runtime_env={"worker_process_setup_hook": "stowage.tq_worker.setup_worker"},
)

def init(block):
    return tq.init(OmegaConf.create({"backend": {"storage_backend": "Stowage", "Stowage": block}}))
"""


def driver(body: str, timeout: float = 240) -> str:
    return drivers.driver(PREAMBLE, body, timeout)


def test_units_without_a_cpu_fail_tq_init_naming_the_cpu_within_the_start_timeout():
    out = driver(
        """
        t0 = time.monotonic()
        try:
            # The controller takes one CPU, the first unit the other.
            init({"count": 2, "cpus": 1, "memory": "16MiB", "start_timeout": 5})
        except stowage.ray.PlacementError as e:
            print("ERROR", str(e).replace("\\n", " "))
            print("SECONDS", round(time.monotonic() - t0, 1))
        else:
            print("STARTED")
        # The failed bootstrap removed TransferQueue's controller.
        try:
            ray.get_actor("TransferQueueController", namespace="transfer_queue")
            print("CONTROLLER still there")
        except ValueError:
            print("CONTROLLER gone")
        """
    )
    msg = line(out, "ERROR")
    assert float(line(out, "SECONDS")) < 5 + 30, out  # start_timeout, and bounded teardown
    assert "did not come up within 5 s: still PENDING_CREATION" in msg, msg
    assert "it needs 1 CPU and 16 MiB of memory on node" in msg, msg
    assert "which has 0 of its 2 CPUs" in msg, msg
    assert "not enough CPU free" in msg, msg
    assert "the Ray cluster has 0 of its 2 CPUs" in msg, msg
    assert line(out, "CONTROLLER") == "gone", out


def test_units_that_leave_less_than_one_cpu_beside_the_controller_start_with_a_warning():
    out = driver(
        """
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        init({"count": 1, "cpus": 0.5, "memory": "16MiB"})
        tq.close()
        print("CLOSED")
        """
    )
    assert "CLOSED" in out, out
    assert (
        "CPUs reserved by TransferQueue's controller and 1 stowage unit(s): 1.5 of this Ray "
        "cluster's 2, leaving 0.5: a Ray task or actor that asks for 1 CPU" in out
    ), out
