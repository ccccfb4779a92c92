"""stowage as a TransferQueue storage backend (``transferqueue==0.1.11``).

Importing this module registers, in this process:

- ``StowageStorageManager`` with TransferQueue's ``StorageManagerFactory``
  under ``"Stowage"``: a full storage manager (not the per-cell KV path),
  so one ``put_data`` moves a batch's columns to each unit in one round;
- a bootstrap provider ``"Stowage"`` (``StorageBootstrapProvider``) that
  ``tq.init`` calls: it starts the storage units as Ray actors
  (:func:`stowage.ray.start_units`) and publishes their directory in
  ``conf.backend.Stowage.directory``, which every attaching process reads
  from the controller's stored config.

Switch a TransferQueue job to stowage with one line of its config::

    backend:
      storage_backend: Stowage
      Stowage:            # optional; every key has a default
        memory: 4GiB      # per unit
        count: 2

Every process that runs a TransferQueue client needs this module
imported. Ray workers (tasks and actors) get it through
:func:`setup_worker` (``worker_process_setup_hook``, which imports it as
soon as the worker imports ``transfer_queue``); for drivers you do not
control, set ``RAY_RUNTIME_ENV_HOOK=stowage.tq.ray_runtime_env_hook`` in
their environment, which adds that hook at every ``ray.init``.

Rows are TransferQueue global indexes, partitions are TransferQueue
partitions, fields are fields. Non-tensor values (strings, dicts, numpy
object or bytes arrays, ``NonTensorStack``/``NonTensorData``) are stored as
pickles (protocol 5) in uint8 values, marked as such in the controller's
per-cell ``custom_backend_meta``, each with an HMAC-SHA-256 tag under a key
derived from the plane's shared secret that binds it to its namespace,
partition, row and field; a get unpickles a cell only after its tag was
checked (:mod:`stowage._tq_cells`, :class:`UntrustedCell`). Without a
secret, pickled cells are refused unless ``insecure_pickles: true``. CUDA
tensors are copied to host memory before a put (no GPU-direct path).

Checkpoints are written only under ``checkpoint_root``: by default a
private (0700) directory of the user in the job's temporary directory
(:func:`default_checkpoint_root`; a fresh private one when another user
took that name first), never ``/``.

The directory's secret (``secret_hex``) is kept in the config wrapped so
that it prints as ``<redacted>``: TransferQueue logs its whole config.
"""

from __future__ import annotations

import json
import logging
import weakref
from typing import Any, List, Mapping

import stowage

from . import _compat, _tq_manager
from ._tq_cells import UntrustedCell
from ._tq_checkpoint import CheckpointRefused, _fallback_checkpoint_root, default_checkpoint_root
from ._tq_checkpoint import _load_checkpoint as _load_checkpoint
from ._tq_checkpoint import _RestoredCells as _RestoredCells
from ._tq_checkpoint import _save_checkpoint as _save_checkpoint
from ._tq_config import (
    BACKEND,
    DEFAULTS,
    _block,
    _publish_directory,
    _reveal_directory,
    _unit_config,
)
from ._tq_manager import RowsLost
from .tq_worker import ray_runtime_env_hook, setup_worker

logger = logging.getLogger("stowage.tq")

__all__ = [
    "BACKEND",
    "CheckpointRefused",
    "RowsLost",
    "StowageStorage",
    "StowageStorageManager",
    "UntrustedCell",
    "default_checkpoint_root",
    "initialize_stowage_storage",
    "ray_runtime_env_hook",
    "setup_worker",
]


# -- bootstrap -------------------------------------------------------------------


class StowageStorage:
    """What the bootstrap provider returns (TransferQueue keeps it in
    ``_TQ_STORAGE``): the started units. :meth:`close` stops them (every
    unit's teardown, then its actor is killed); it runs by itself when the
    object is dropped, which ``tq.close()`` does, and at interpreter exit.
    Units given by an external directory are not stopped."""

    def __init__(self, units: Any, directory: Mapping[str, Any], stop_timeout: float):
        self.units = units
        self.directory = dict(directory)
        self._finalizer = weakref.finalize(self, StowageStorage._stop, units, stop_timeout)

    @staticmethod
    def _stop(units: Any, timeout: float) -> None:
        if units is None:
            return
        try:
            import stowage.ray

            problems = stowage.ray.stop_units(units, timeout=timeout)
            if any(problems):
                logger.warning("stopping the stowage units: %s", problems)
        except Exception as e:  # noqa: BLE001 - teardown never raises
            logger.warning("stopping the stowage units failed: %r", e)

    def close(self) -> None:
        """Stop the units (idempotent, never raises)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __repr__(self) -> str:
        n = len(self.directory.get("units", ()))
        return f"<stowage.tq.StowageStorage {n} units{' (closed)' if self.closed else ''}>"


def _plan_nodes(block: Mapping[str, Any]) -> List[str]:
    import ray

    here = ray.get_runtime_context().get_node_id()
    count = int(block["count"])
    if count < 1:
        raise stowage.InvalidRequest(f"backend.{BACKEND}.count must be at least 1, not {count}")
    if not block["spread"]:
        return [here] * count
    alive = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    order = [here] + [n for n in alive if n != here]
    return [order[i % len(order)] for i in range(count)]


def _controller_cpus() -> float:
    """The Ray CPUs TransferQueue's controller actor reserves (1 in
    transferqueue 0.1.11)."""
    try:
        return float(_compat.controller_default_options().get("num_cpus", 1))
    except Exception:  # noqa: BLE001 - another TransferQueue: assume Ray's default
        return 1.0


def _abandon_controller() -> None:
    """After a failed bootstrap: kill the controller tq.init created and
    forget it, so that later tq.init calls start afresh instead of waiting
    forever for a config that never comes."""
    try:
        import ray

        ctl = _compat.controller()
        if ctl is not None:
            ray.kill(ctl, no_restart=True)
        _compat.forget_controller()
    except Exception as e:  # noqa: BLE001 - best effort; the original error matters
        logger.warning(
            "could not remove TransferQueue's controller after a failed bootstrap: %r", e
        )


def initialize_stowage_storage(conf: Any) -> StowageStorage:
    """TransferQueue's bootstrap provider for ``storage_backend: Stowage``.

    Starts ``count`` units as Ray actors (``stowage.ray.start_units``) from
    ``conf.backend.Stowage`` and writes their directory to
    ``conf.backend.Stowage.directory``; with a ``directory`` given there
    (external units, e.g. from ``stowage up``), starts nothing. On any
    failure, stops what it started and removes TransferQueue's controller
    before re-raising."""
    units = None
    try:
        import stowage.ray

        if conf.backend.get(BACKEND) is None:
            conf.backend[BACKEND] = {}
        block = _block(conf.backend[BACKEND])
        if block["directory"] is not None:
            directory = stowage._directory_of(block["directory"])
            if directory is None:
                raise stowage.InvalidRequest(
                    f"backend.{BACKEND}.directory must be a directory (a dict or a JSON file), "
                    f"not {block['directory']!r}"
                )
            # A replicas given must be the directory's (raises otherwise).
            text = json.dumps(_reveal_directory(directory))
            stowage._native.directory_replicas(text, block["replicas"])
            _publish_directory(conf, directory)
            return StowageStorage(None, directory, float(block["stop_timeout"]))
        if block["checkpoint_root"] is None:
            block["checkpoint_root"] = _fallback_checkpoint_root()
            conf.backend[BACKEND].checkpoint_root = block["checkpoint_root"]
        # Within start_timeout: up, or a PlacementError naming what Ray
        # lacks (the CPUs and memory each unit needs against what its node
        # has free, and what the cluster's tasks and actors wait for).
        units = stowage.ray.start_units(_unit_config(block), _plan_nodes(block))
        _publish_directory(conf, units.directory)
        logger.info("started %d stowage units for TransferQueue", len(units))
        stowage.ray._warn_if_no_cpu_is_left(
            _controller_cpus() + float(block["cpus"]) * len(units),
            f"TransferQueue's controller and {len(units)} stowage unit(s)",
        )
        return StowageStorage(units, units.directory, float(block["stop_timeout"]))
    except BaseException:
        if units is not None:
            StowageStorage._stop(units, float(DEFAULTS["stop_timeout"]))
        _abandon_controller()
        raise


#: TransferQueue's storage manager class (registered under :data:`BACKEND`).
StowageStorageManager: Any = _tq_manager.register(initialize_stowage_storage)
