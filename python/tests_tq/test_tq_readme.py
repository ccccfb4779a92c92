"""The README's "With TransferQueue" example is python/examples/tq_stowage.py
and runs as written: ``python tq_stowage.py``, nothing patched, on a fresh
machine (its ray.init() starts Ray with this host's CPUs, 2 on CI) and on
a machine where a 2-CPU Ray runs (it joins that one, whatever this host
has): TransferQueue's controller takes one CPU and the units none, so the
example's 1-CPU tasks have the other. python/tests/readme_examples.py says
what a run's machine is. And the worker hook registers the backend when a
worker imports transfer_queue."""

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip(
    "transfer_queue",
    reason="transferqueue is not installed: these tests need `pip install 'stowage-rl[tq]'` "
    "(scripts/test-tq runs them in a venv that has it)",
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python" / "tests"))
from readme_examples import readme_block, run_example  # noqa: E402


def test_readme_tq_example_is_the_example_file():
    assert (
        readme_block("## With TransferQueue")
        == (ROOT / "python/examples/tq_stowage.py").read_text()
    )


@pytest.mark.parametrize("ray_cpus", [None, 2], ids=["fresh-machine", "2-cpu-ray"])
def test_readme_tq_example_runs_as_written(ray_cpus):
    # No secret is given (run_example drops STOWAGE_SECRET): the example's
    # strings are authenticated with a key derived from the secret its
    # units generated for themselves.
    run = run_example(
        readme_block("## With TransferQueue"), "tq_stowage.py", timeout=300, ray_cpus=ray_cpus
    )
    assert run.returncode == 0, run.explain()
    assert "TransferQueue example done" in run.stdout, run.explain()


def test_setup_worker_registers_when_transfer_queue_is_imported():
    code = (
        "import sys, stowage.tq_worker as w; w.setup_worker(); "
        "assert 'transfer_queue' not in sys.modules and 'torch' not in sys.modules; "
        "import transfer_queue; from importlib import resources; from omegaconf import OmegaConf; "
        "from transfer_queue.storage.managers.base import StorageManagerFactory as F; "
        "from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider as P; "
        "assert 'Stowage' in F._registry and P.get_provider('Stowage') is not None; "
        "OmegaConf.load(resources.files('transfer_queue') / 'config.yaml'); print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]


def test_runtime_env_hook_adds_the_setup_hook():
    import stowage.tq

    assert stowage.tq.ray_runtime_env_hook(None) == {
        "worker_process_setup_hook": "stowage.tq_worker.setup_worker"
    }
    assert stowage.tq.ray_runtime_env_hook({"env_vars": {"A": "1"}})["env_vars"] == {"A": "1"}
    assert stowage.tq.ray_runtime_env_hook({"worker_process_setup_hook": "mine.hook"}) == {
        "worker_process_setup_hook": "mine.hook"
    }
