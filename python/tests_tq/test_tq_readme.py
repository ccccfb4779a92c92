"""The README's "With TransferQueue" example is python/examples/tq_stowage.py
and runs as written (on a private local Ray instance), and the worker hook
registers the backend when a worker imports transfer_queue."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip(
    "transfer_queue",
    reason="transferqueue is not installed: these tests need `pip install 'stowage[tq]'` "
    "(scripts/test-tq runs them in a venv that has it)",
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _readme_block(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    assert heading in text, f"no {heading!r} section in README.md"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, f"no python block under {heading!r}"
    return blocks[0]


def test_readme_tq_example_is_the_example_file():
    assert (
        _readme_block("## With TransferQueue")
        == (ROOT / "python/examples/tq_stowage.py").read_text()
    )


def test_readme_tq_example_runs_as_written(tmp_path):
    script = tmp_path / "tq_stowage.py"
    script.write_text(_readme_block("## With TransferQueue"))
    # A private Ray instance: a bare ray.init() would join a `ray start`
    # cluster running on this machine.
    boot = "import ray, runpy, sys; ray.init = (lambda f: lambda **kw: f(address='local', num_cpus=4, include_dashboard=False, **kw))(ray.init); runpy.run_path(sys.argv[1], run_name='__main__')"
    # No secret is given: the example's strings are authenticated with a key
    # derived from the secret its units generated for themselves.
    env = {k: v for k, v in os.environ.items() if k != "STOWAGE_SECRET"}
    done = subprocess.run(
        [sys.executable, "-c", boot, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "TransferQueue example done" in done.stdout


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
