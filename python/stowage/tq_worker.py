"""Ray hooks that make the TransferQueue backend (:mod:`stowage.tq`)
available in workers, without importing TransferQueue (or torch) in
workers that never use it. Kept apart from :mod:`stowage.tq`, which
imports TransferQueue at once.

- ``ray.init(runtime_env={"worker_process_setup_hook": "stowage.tq_worker.setup_worker"})``;
- or, for drivers you do not control, the environment variable
  ``RAY_RUNTIME_ENV_HOOK=stowage.tq.ray_runtime_env_hook`` (Ray calls it at
  every ``ray.init`` and it adds that hook).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
from typing import Any, Dict, Optional

logger = logging.getLogger("stowage.tq")

#: The worker_process_setup_hook this module provides.
SETUP_HOOK = "stowage.tq_worker.setup_worker"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Imports stowage.tq right after ``transfer_queue`` is imported."""

    def __init__(self) -> None:
        self._busy = False

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "transfer_queue" or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """The package's own loader (resource readers and all), plus the import
    of stowage.tq once the package has run."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        _remove_finder()
        importlib.import_module("stowage.tq")


_finder: Optional[_AfterImport] = None


def _remove_finder() -> None:
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None


def setup_worker() -> None:
    """A Ray ``worker_process_setup_hook``: makes the Stowage backend
    available in this worker. It imports :mod:`stowage.tq` (which registers
    the backend) now if ``transfer_queue`` is imported already, otherwise as
    soon as it is."""
    global _finder
    if "transfer_queue" in sys.modules:
        importlib.import_module("stowage.tq")
        return
    if _finder is None:
        _finder = _AfterImport()
        sys.meta_path.insert(0, _finder)


def ray_runtime_env_hook(runtime_env: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """For ``RAY_RUNTIME_ENV_HOOK=stowage.tq.ray_runtime_env_hook`` (or
    ``stowage.tq_worker.ray_runtime_env_hook``): Ray calls it at every
    ``ray.init`` of a driver whose environment names it, and it adds
    :func:`setup_worker` as the job's ``worker_process_setup_hook``, unless
    the job sets one already (then that one must import stowage.tq)."""
    env = dict(runtime_env or {})
    hook = env.get("worker_process_setup_hook")
    if hook is None:
        env["worker_process_setup_hook"] = SETUP_HOOK
    elif hook not in (SETUP_HOOK, "stowage.tq.setup_worker"):
        logger.warning(
            "worker_process_setup_hook is %r already; it must import stowage.tq for workers "
            "to use the Stowage backend",
            hook,
        )
    return env
