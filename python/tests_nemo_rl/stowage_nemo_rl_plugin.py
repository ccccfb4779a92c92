"""A pytest plugin that runs NeMo-RL's own data-plane tests that are
written against an adapter, unmodified, from a NeMo-RL checkout, against
:class:`stowage.nemo_rl.StowageDataPlaneClient` as well as against their
own ``NoOpDataPlaneClient``:

    cd $RL && PYTHONPATH=$RL:$STOWAGE/python/tests_nemo_rl python -m pytest \\
        -p stowage_nemo_rl_plugin --noconftest -o addopts= \\
        tests/unit/data_plane/test_interface_contract.py \\
        tests/unit/data_plane/test_correctness.py

(``scripts/test-nemo-rl`` does it, with the other suites of
:data:`MAKES_NOOP`). Every test that takes an adapter runs twice,
``[noop]`` (NeMo-RL's in-process adapter, the control) and ``[stowage]``:

- ``test_interface_contract.py`` parameterizes its ``client`` fixture over
  builders (``[_build_noop]`` today); the plugin gives it the builders
  ``[_build_noop, stowage]``, and the suite's fixture builds and closes
  each client as it does its own.
- ``test_correctness.py`` makes its client in each test with
  ``NoOpDataPlaneClient()``; for ``[stowage]`` the plugin puts a maker of
  stowage clients in that module's namespace for the test's duration
  (``monkeypatch``), and closes what it made at the test's end. So for
  the tests of the other :data:`MAKES_NOOP` suites that call
  ``NoOpDataPlaneClient()`` in their bodies or in a fixture of their
  module (test_observability.py's ``wrapped_client``).

A ``[stowage]`` test that made no stowage client fails: the suite would
have changed how it makes its clients, and run NoOp under stowage's id.

Each stowage client is connected to one local plane of two shm units
(started once per session, stopped by its pids at the end) in a namespace
of its own, so every test, like one with a fresh NoOp client, starts with
no partitions, samples or claims.

:data:`NOOP_ONLY` lists the tests that look into NoOp's own private state;
they run for ``[noop]`` only (what they check is checked for stowage in
stowage's words, in test_nemo_rl_suites.py).

``--noconftest``: NeMo-RL's ``tests/unit/conftest.py`` starts, for every
session, a Ray cluster and a GPU monitor (autouse), and the data plane's
conftest.py a TransferQueue client for its ``tq_client`` fixtures; these
suites use neither. ``-o addopts=``: their pytest options stop at the first
failure (``-x``).
"""

from __future__ import annotations

import importlib
import inspect
import itertools
from typing import Any, Callable, Iterator, List, Optional, Sequence

import pytest

#: The suites this plugin knows, by module name (the last dotted part).
CONTRACT = "test_interface_contract"
CORRECTNESS = "test_correctness"

#: (module, test): tests that read NoOp's private attributes (its
#: ``_partitions`` records), so run for ``[noop]`` only.
NOOP_ONLY = {
    (CORRECTNESS, "test_double_register_partition_is_idempotent_overwrite"),
}

#: The suites whose tests make their own client with ``NoOpDataPlaneClient()``.
MAKES_NOOP = {
    CORRECTNESS,
    "test_sync_one_hop",
    "test_preshard_extras",
    "test_writeback_pipeline_e2e",
    "test_observability",
}

#: Modules some of these tests import that pull in NeMo-RL's trainer (and
#: with it wandb, mlflow, swanlab, tensorboard, ..., and Python 3.13's
#: typing): a test importing one is skipped, with the import's error, where
#: it does not import (scripts/test-nemo-rl installs only what the data
#: plane needs).
NEEDS_FULL_NEMO_RL = ("nemo_rl.algorithms.grpo_sync",)

ADAPTER_IDS = ["noop", "stowage"]

_plane: Any = None
# The session's pytest config: its base temporary directory holds every
# test's tmp_path, so it is the units' checkpoint root (NeMo-RL's
# checkpoint tests save under tmp_path).
_config: Any = None
_namespaces = itertools.count()
#: How many stowage clients build_stowage has made (see nemo_rl_adapter).
_built = 0


def _module_name(module: Any) -> str:
    return module.__name__.rsplit(".", 1)[-1]


def _is_data_plane_suite(module: Any, name: str) -> bool:
    return _module_name(module) == name and ".data_plane." in f".{module.__name__}"


def _makes_noop(module: Any, function: Any, fixturenames: Sequence[str]) -> bool:
    """Whether ``function``, a test of one of MAKES_NOOP, makes its client
    with ``NoOpDataPlaneClient()`` (the name the plugin substitutes), in its
    body or in a fixture of its module that it requests."""
    if _module_name(module) not in MAKES_NOOP or ".data_plane." not in f".{module.__name__}":
        return False
    if getattr(module, "NoOpDataPlaneClient", None) is None:
        return False
    makers = [function] + [
        getattr(module, name) for name in fixturenames if callable(getattr(module, name, None))
    ]
    for f in makers:
        try:
            source = inspect.getsource(f)
        except (OSError, TypeError):
            continue
        if "NoOpDataPlaneClient()" in source:
            return True
    return False


def _skip_without_algorithms(function: Any) -> None:
    """Skip a test that imports one of NEEDS_FULL_NEMO_RL when that module
    does not import here, saying why."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return
    for name in NEEDS_FULL_NEMO_RL:
        if name not in source:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - ImportError, or what its imports raise (pydantic, transformers version checks)
            pytest.skip(
                f"needs {name}, which does not import in this environment ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); it needs NeMo-RL's whole "
                "dependency set and Python 3.13"
            )


def _local_plane() -> Any:
    """The session's plane (two shm units of 64 MiB), started on first use."""
    global _plane
    if _plane is None:
        import stowage

        root = _config._tmp_path_factory.getbasetemp() if _config is not None else None
        _plane = stowage.local(units=2, memory="64MiB", checkpoint_root=root)
    return _plane


def pytest_configure(config):
    global _config
    _config = config


def build_stowage() -> Any:
    """A StowageDataPlaneClient of its own namespace on the session's plane;
    it owns its connection (``close`` closes it)."""
    import stowage
    from stowage.nemo_rl import StowageDataPlaneClient

    global _built
    _built += 1
    plane = _local_plane()
    conn = stowage.connect(plane.directory, namespace=f"nemo-rl-suite-{next(_namespaces)}")
    return StowageDataPlaneClient(conn, owns_client=True)


build_stowage.__name__ = "stowage"


def pytest_sessionfinish(session, exitstatus):
    global _plane
    if _plane is not None:
        _plane.close()  # stops the units by their pids
        _plane = None


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc):
    module = metafunc.module
    if _is_data_plane_suite(module, CONTRACT) and "client" in metafunc.fixturenames:
        noop = getattr(module, "_build_noop", None)
        if noop is None:
            raise pytest.UsageError(
                f"stowage_nemo_rl_plugin: {module.__name__} has no _build_noop; "
                "NeMo-RL's contract suite changed, and this plugin needs to follow it"
            )
        # A parametrize mark on the test takes precedence over the client
        # fixture's own params (pytest's fixture manager skips an argname a
        # mark parametrizes), so the two builders replace [_build_noop].
        metafunc.definition.add_marker(
            pytest.mark.parametrize("client", [noop, build_stowage], indirect=True, ids=ADAPTER_IDS)
        )
    elif (
        _makes_noop(module, metafunc.function, metafunc.fixturenames)
        and "nemo_rl_adapter" in metafunc.fixturenames
    ):
        if (_module_name(module), metafunc.definition.originalname) in NOOP_ONLY:
            ids = ["noop"]
        else:
            ids = ADAPTER_IDS
        metafunc.definition.add_marker(
            pytest.mark.parametrize("nemo_rl_adapter", ids, indirect=True, ids=ids)
        )


@pytest.fixture(autouse=True)
def nemo_rl_adapter(request, monkeypatch) -> Iterator[Optional[str]]:
    """The adapter a test runs against: in test_correctness.py (and the
    other MAKES_NOOP suites), what its ``NoOpDataPlaneClient()`` calls
    make; in test_interface_contract.py, the ``client`` fixture's builder. A ``[stowage]`` test that made no
    stowage client is an error (the suite changed how it makes clients,
    and ran NoOp under the stowage id)."""
    before = _built
    _skip_without_algorithms(request.function)
    callspec = getattr(request.node, "callspec", None)
    params = callspec.params if callspec is not None else {}
    adapter: Optional[str] = getattr(request, "param", None)
    if params.get("client") is build_stowage:
        adapter = "stowage"
    if adapter != "stowage":
        yield adapter
        return
    made: List[Any] = []

    def make() -> Any:
        c = build_stowage()
        made.append(c)
        return c

    maker: Callable[[], Any] = make
    if _makes_noop(request.module, request.function, request.fixturenames):
        monkeypatch.setattr(request.module, "NoOpDataPlaneClient", maker)
    try:
        yield adapter
    finally:
        for c in made:
            c.close()
    if _built == before:
        pytest.fail(
            f"{request.node.nodeid}: the test made no StowageDataPlaneClient; the suite "
            "no longer makes its clients the way stowage_nemo_rl_plugin substitutes them"
        )
