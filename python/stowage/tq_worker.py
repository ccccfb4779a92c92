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
import logging
import sys
from typing import Any, Dict, Optional

import wrapt

logger = logging.getLogger("stowage.tq")

#: The worker_process_setup_hook this module provides.
SETUP_HOOK = "stowage.tq_worker.setup_worker"

# Whether setup_worker registered its post-import hook (once per process).
_hooked = False


def _import_backend(_transfer_queue: Any) -> None:
    """The post-import hook of ``transfer_queue``."""
    importlib.import_module("stowage.tq")


def setup_worker() -> None:
    """A Ray ``worker_process_setup_hook``: makes the Stowage backend
    available in this worker. It imports :mod:`stowage.tq` (which registers
    the backend) now if ``transfer_queue`` is imported already, otherwise as
    soon as it is (a post-import hook: :func:`wrapt.register_post_import_hook`)."""
    global _hooked
    if "transfer_queue" in sys.modules:
        importlib.import_module("stowage.tq")
        return
    if not _hooked:
        wrapt.register_post_import_hook(_import_backend, "transfer_queue")
        _hooked = True


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
