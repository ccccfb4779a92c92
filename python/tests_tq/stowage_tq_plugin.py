"""A pytest plugin that runs TransferQueue's own end-to-end suites against
stowage, unmodified, from the installed ``transferqueue`` package:

    TQ_TEST_BACKEND=Stowage python -m pytest -p stowage_tq_plugin \\
        $SITE/tests/e2e/test_kv_interface_e2e.py $SITE/tests/e2e/test_e2e_lifecycle_consistency.py

(with this directory on PYTHONPATH; ``scripts/test-tq`` does it). It

- imports :mod:`stowage.tq`, which registers the ``Stowage`` backend;
- adds a ``Stowage`` entry to each test module's ``BACKEND_CONFIGS`` (their
  fixtures look the name in ``TQ_TEST_BACKEND`` up there), and with
  ``TQ_TEST_BACKEND=Stowage`` replaces the one config of
  ``test_checkpoint_e2e.py`` (``_TQ_CONFIG``, SimpleStorage) with stowage's
  and deselects its three tests of SimpleStorage's own files
  (:data:`SIMPLE_STORAGE_ONLY`);
- starts, before each module's own fixtures, a private local Ray instance
  (``address="local"``: never a ``ray start`` cluster that happens to run
  on the machine) with enough logical CPUs for the controller, the
  storage units and the suite's Ray task, and with
  :func:`stowage.tq_worker.setup_worker` as the workers' setup hook. The
  modules' fixtures shut Ray down at their end; the next module gets a new
  one.

A conftest.py would not apply: the tests live in site-packages.
"""

from __future__ import annotations

import os

import pytest

#: The Stowage entry added to the suites' BACKEND_CONFIGS.
STOWAGE_CONFIG = {
    "controller": {"polling_mode": True},
    "backend": {
        "storage_backend": "Stowage",
        "Stowage": {"count": 2, "memory": "256MiB"},
    },
}

#: Logical CPUs of the private Ray instance: TransferQueue's controller
#: takes 1, each SimpleStorage unit 1 (the control run), the kv suite's Ray
#: task 1; Stowage units take none (their `cpus` default).
RAY_CPUS = int(os.environ.get("STOWAGE_TQ_RAY_CPUS", "8"))


#: Tests of test_checkpoint_e2e.py that look into SimpleStorage's own
#: checkpoint files (``simple_storage/``, its unit list) or assert that
#: SimpleStorage forces ``include_storage=True``: they run against
#: SimpleStorage only.
SIMPLE_STORAGE_ONLY = {
    ("test_checkpoint_e2e", "test_tensor_fields"),
    ("test_checkpoint_e2e", "test_storage_saved_is_true"),
    ("test_checkpoint_e2e", "test_load_raises_on_storage_unit_count_mismatch"),
}


def pytest_configure(config):
    import stowage.tq  # noqa: F401 - registers the backend in this process


def _prepare(config):
    """Complete STOWAGE_CONFIG (once pytest's temporary directory is set up)."""
    # The units generate their secret (TransferQueue's clients get it in the
    # directory), as a user's would. Checkpoints are allowed under pytest's private (0700) temporary
    # directory, where the suites' tmp_path directories are (the default
    # root is a private directory of its own).
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None:  # pragma: no cover - pytest's tmpdir plugin is off
        return
    base = factory.getbasetemp()
    STOWAGE_CONFIG["backend"]["Stowage"].update(checkpoint_root=str(base))


def pytest_collection_modifyitems(session, config, items):
    _prepare(config)
    seen = set()
    for item in items:
        mod = getattr(item, "module", None)
        if mod is None or id(mod) in seen or not hasattr(mod, "BACKEND_CONFIGS"):
            continue
        seen.add(id(mod))
        mod.BACKEND_CONFIGS.setdefault("Stowage", STOWAGE_CONFIG)
    if os.environ.get("TQ_TEST_BACKEND") != "Stowage":
        return
    skipped = [i for i in items if (i.module.__name__, i.name) in SIMPLE_STORAGE_ONLY]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [i for i in items if i not in skipped]
    for item in items:
        mod = getattr(item, "module", None)
        if mod is None or id(mod) in seen or not hasattr(mod, "_TQ_CONFIG"):
            continue
        # test_checkpoint_e2e.py names its backend in one module-level
        # config (SimpleStorage) instead of BACKEND_CONFIGS.
        seen.add(id(mod))
        from omegaconf import OmegaConf

        mod._TQ_CONFIG = OmegaConf.create(STOWAGE_CONFIG)


@pytest.fixture(scope="module", autouse=True)
def _stowage_private_ray():
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=RAY_CPUS,
            include_dashboard=False,
            runtime_env={"worker_process_setup_hook": "stowage.tq_worker.setup_worker"},
        )
    yield
