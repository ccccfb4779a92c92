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
per-cell ``custom_backend_meta``; see :func:`_encode_rows`. CUDA tensors
are copied to host memory before a put (no GPU-direct path).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import pickle
import sys
import threading
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

import stowage

from .tq_worker import ray_runtime_env_hook, setup_worker

logger = logging.getLogger("stowage.tq")

__all__ = [
    "BACKEND",
    "RowsLost",
    "StowageStorage",
    "StowageStorageManager",
    "initialize_stowage_storage",
    "ray_runtime_env_hook",
    "setup_worker",
]

#: The name under which the manager and the provider are registered, and
#: the key of the config block (``conf.backend.Stowage``).
BACKEND = "Stowage"

#: Defaults of the ``conf.backend.Stowage`` block (docs: README, "With
#: TransferQueue").
DEFAULTS: Dict[str, Any] = {
    "count": 2,  # storage units
    "memory": "1GiB",  # per unit (also reserved as Ray memory)
    "cpus": 0.01,  # Ray CPUs per unit actor
    "spread": False,  # False: every unit on the initializing process's node
    "listen_host": "127.0.0.1",  # "node-ip" for units that other hosts reach
    "disk": None,  # {root, capacity, high_watermark, low_watermark}
    "checkpoint_root": "/",  # where tq.save_checkpoint may write
    "secret_file": None,  # the units' shared secret (each node reads it)
    "insecure": False,
    "namespace": "transfer_queue",
    "timeout": 120.0,  # seconds, every put/get/clear
    "start_timeout": 120.0,
    "stop_timeout": 30.0,
    "directory": None,  # written by the provider; or given: external units
}

# The tag of a pickled non-tensor value, in custom_backend_meta and at the
# head of the stored bytes.
_PICKLE_TAG = "stowage-pickle5"
_MAGIC = b"STWPKL5\x00"

_CHECKPOINT_SUBDIR = "stowage"
_CHECKPOINT_INFO = "stowage_checkpoint.json"


class RowsLost(RuntimeError):
    """Rows whose storage unit died (or was replaced): their values are
    gone. ``partition``, ``global_indexes`` (the lost rows asked for) and
    ``unit`` (its index) say which; the stowage error is the cause."""

    def __init__(self, partition: str, global_indexes: List[int], unit: Optional[int], op: str):
        self.partition = partition
        self.global_indexes = global_indexes
        self.unit = unit
        super().__init__(
            f"stowage {op}: storage unit {unit} is gone, and with it the rows "
            f"{_short_list(global_indexes)} of partition {partition!r} "
            f"({len(global_indexes)} lost rows asked for); re-produce them"
        )


def _short_list(xs: Sequence[Any], n: int = 20) -> str:
    xs = list(xs)
    if len(xs) <= n:
        return str(xs)
    return "[" + ", ".join(map(str, xs[:n])) + f", ... ({len(xs) - n} more)]"


# -- configuration -----------------------------------------------------------------


def _plain(x: Any) -> Any:
    """A DictConfig/ListConfig as plain dicts and lists (other values as they are)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - TransferQueue depends on omegaconf
        return x
    if isinstance(x, (DictConfig, ListConfig)):
        return OmegaConf.to_container(x, resolve=True)
    return x


def _block(config: Any) -> Dict[str, Any]:
    """The ``conf.backend.Stowage`` block over the defaults; unknown keys
    (typos) are errors."""
    given = _plain(config) or {}
    if not isinstance(given, Mapping):
        raise stowage.InvalidRequest(f"backend.{BACKEND} must be a mapping, not {type(given).__name__}")
    unknown = sorted(set(given) - set(DEFAULTS) - {"zmq_info"})
    if unknown:
        raise stowage.InvalidRequest(
            f"backend.{BACKEND}: unknown key {unknown[0]!r} (the keys are {sorted(DEFAULTS)})"
        )
    return {**DEFAULTS, **given}


def _unit_config(block: Mapping[str, Any]) -> Dict[str, Any]:
    """The stowage config (docs/config.md sections) for start_units."""
    units: Dict[str, Any] = {"memory": block["memory"], "cpus": float(block["cpus"])}
    if block["checkpoint_root"] is not None:
        units["checkpoint_root"] = os.fspath(block["checkpoint_root"])
    disk = block["disk"]
    if disk is not None:
        if isinstance(disk, (str, os.PathLike)):
            disk = {"root": os.fspath(disk)}
        units["disk"] = dict(disk)
    auth: Dict[str, Any] = {}
    if block["insecure"]:
        auth["insecure"] = True
    if block["secret_file"] is not None:
        auth["secret_file"] = os.fspath(block["secret_file"])
    return {
        "units": units,
        "listen": {"host": str(block["listen_host"])},
        "auth": auth,
        "timeouts": {"start": float(block["start_timeout"]), "stop": float(block["stop_timeout"])},
    }


def _client_secret(block: Mapping[str, Any]) -> Optional[bytes]:
    if block["secret_file"] is None:
        return None  # stowage.connect reads STOWAGE_SECRET
    with open(block["secret_file"], "rb") as f:
        return f.read().rstrip(b"\r\n")


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


def _abandon_controller() -> None:
    """After a failed bootstrap: kill the controller tq.init created and
    forget it, so that later tq.init calls start afresh instead of waiting
    forever for a config that never comes."""
    try:
        import ray
        from transfer_queue import interface

        ctl = interface._TQ_CONTROLLER
        if ctl is not None:
            ray.kill(ctl, no_restart=True)
        interface._TQ_CONTROLLER = None
        interface._TQ_STORAGE = None
    except Exception as e:  # noqa: BLE001 - best effort; the original error matters
        logger.warning("could not remove TransferQueue's controller after a failed bootstrap: %r", e)


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
            conf.backend[BACKEND].directory = directory
            return StowageStorage(None, directory, float(block["stop_timeout"]))
        units = stowage.ray.start_units(_unit_config(block), _plan_nodes(block))
        conf.backend[BACKEND].directory = units.directory
        logger.info("started %d stowage units for TransferQueue", len(units))
        return StowageStorage(units, units.directory, float(block["stop_timeout"]))
    except BaseException:
        if units is not None:
            StowageStorage._stop(units, float(DEFAULTS["stop_timeout"]))
        _abandon_controller()
        raise


# -- values ----------------------------------------------------------------------

# torch dtypes stowage stores as they are (others are pickled).
_TORCH_DTYPES = (
    "bool", "uint8", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64",
)


def _pickled(value: Any) -> np.ndarray:
    return np.frombuffer(_MAGIC + pickle.dumps(value, protocol=5), dtype=np.uint8)


def _unpickled(arr: np.ndarray, where: str) -> Any:
    raw = arr.tobytes()
    if not raw.startswith(_MAGIC):
        raise RuntimeError(f"stowage: {where} is marked pickled but was not written by stowage.tq")
    return pickle.loads(raw[len(_MAGIC):])


def _host(t: Any) -> Any:
    """A CPU, contiguous, grad-free version of tensor ``t`` (a copy only
    when needed: CUDA and other devices are copied to host memory)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def _encode_rows(name: str, col: Any, n: int) -> Tuple[Any, bool]:
    """A column for DataPlane.put and whether it is pickled.

    Tensors (dense, nested jagged or strided; CUDA ones copied to host)
    are stored as they are, one value per row with its dtype and shape.
    Anything else — lists (TensorDict's LinkedList), numpy object/bytes
    arrays, NonTensorStack/NonTensorData, tensors of dtypes stowage does not
    store — is stored one pickle (protocol 5) per row, as a uint8 value
    that starts with a magic marker; the manager notes it in the
    controller's custom_backend_meta, and unpickles only values so marked
    and carrying the marker, i.e. values that a put of this manager wrote
    in this namespace. Units are trusted by the job's clients (a same-host
    client maps their memory), so unpickling what they return adds no
    trust the job did not already give them.
    """
    import torch

    if isinstance(col, torch.Tensor):
        if str(col.dtype).replace("torch.", "") not in _TORCH_DTYPES:
            return [_pickled(r) for r in col.unbind()], True
        if col.is_nested:
            if col.device.type != "cpu":
                col = col.cpu()
            rows = [_host(r) for r in col.unbind()]
        else:
            rows = _host(col)
        return rows, False
    try:
        from tensordict import NonTensorData, NonTensorStack
    except ImportError:  # pragma: no cover
        NonTensorData = NonTensorStack = ()  # type: ignore[assignment,misc]
    if isinstance(col, (NonTensorStack, NonTensorData)):
        values = col.tolist()
        if not isinstance(values, list) or len(values) != n:
            values = [col.data] * n if isinstance(col, NonTensorData) else list(values)
    elif isinstance(col, np.ndarray) and col.dtype.kind in "biuf":
        return np.ascontiguousarray(col), False
    else:
        values = list(col)
    if len(values) != n:
        raise stowage.InvalidRequest(f"field {name!r}: {len(values)} values for {n} rows")
    return [_pickled(v) for v in values], True


def _to_torch(a: np.ndarray) -> Any:
    import torch

    if a.dtype.kind == "V":  # raw bfloat16
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _pack(rows: List[Any], owned: bool) -> Any:
    """One field of get_data, as TransferQueue's own managers pack it: all
    0-d tensors stacked; tensors as a jagged nested tensor (strided when
    more than one dimension is ragged); anything else a NonTensorStack.

    ``rows`` are numpy arrays (``owned``: fresh, else views into a unit's
    memory) or Python values; the result never aliases a unit's memory."""
    import torch
    from tensordict import NonTensorStack

    arrays = all(isinstance(r, np.ndarray) for r in rows)
    if arrays and rows:
        dt = rows[0].dtype
        same_dtype = all(r.dtype == dt for r in rows)
        if same_dtype and all(r.ndim == 0 for r in rows):
            return _to_torch(np.stack(rows))
        if same_dtype and all(r.ndim >= 1 and r.shape[1:] == rows[0].shape[1:] for r in rows):
            # One contiguous buffer, one copy: the jagged tensor's values,
            # in memory from stowage's read cache (warm pages when the
            # caller freed an earlier batch of this size).
            out = stowage.empty((sum(r.shape[0] for r in rows),) + rows[0].shape[1:], dt)
            np.concatenate(rows, axis=0, out=out)
            values = _to_torch(out)
            lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
            offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=offsets[1:])
            return torch.nested.nested_tensor_from_jagged(values, offsets)
        rows = [_to_torch(r if owned else np.array(r)) for r in rows]
    elif not arrays:
        rows = [_to_torch(r if owned else np.array(r)) if isinstance(r, np.ndarray) else r for r in rows]
    tensors = all(isinstance(r, torch.Tensor) for r in rows)
    if tensors and rows:
        if all(r.dim() == 0 for r in rows):
            return torch.stack(rows)
        for layout in (torch.jagged, torch.strided):
            try:
                return torch.nested.as_nested_tensor(rows, layout=layout)
            except (RuntimeError, TypeError):
                continue
    return NonTensorStack(*rows)


_POOL: Optional[concurrent.futures.ThreadPoolExecutor] = None
_POOL_LOCK = threading.Lock()


def _pack_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads (one per core) that pack the fields of a get in parallel."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="stowage-tq-pack"
            )
        return _POOL


# -- the manager -------------------------------------------------------------------


def _groups(metadata: Any) -> Dict[str, List[int]]:
    """Batch positions by partition, in order."""
    out: Dict[str, List[int]] = {}
    for pos, p in enumerate(metadata.partition_ids):
        out.setdefault(p, []).append(pos)
    return out


def _register() -> None:
    from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
    from transfer_queue.storage.managers.base import StorageManager, StorageManagerFactory

    global StowageStorageManager
    if StorageManagerFactory._registry.get(BACKEND) is not None and StowageStorageManager is not None:
        return

    class _Manager(StorageManager):
        __doc__ = _MANAGER_DOC

        def __init__(self, controller_info: Any, config: Any, zmq_context: Any = None, **kwargs: Any):
            self._plane: Optional[stowage.DataPlane] = None
            super().__init__(controller_info, config, zmq_context=zmq_context)
            block = _block(config)
            directory = block["directory"]
            if directory is None:
                raise RuntimeError(
                    f"backend.{BACKEND}.directory is not set: the Stowage bootstrap provider did not "
                    f"run (import stowage.tq in the process that calls tq.init first)"
                )
            if not isinstance(directory, (str, os.PathLike)):
                directory = dict(directory)
            self._namespace = str(block["namespace"])
            self._timeout = float(block["timeout"])
            self._plane = stowage.connect(
                directory,
                namespace=self._namespace,
                timeout=self._timeout,
                secret=_client_secret(block),
            )
            self._shm = all(u.startswith("unix:") for u in self._plane.units)

        # -- put ----------------------------------------------------------

        async def put_data(self, data: Any, metadata: Any, data_parser: Any = None) -> None:
            if data_parser is not None:
                raise NotImplementedError("data_parser is supported by SimpleStorage only")
            if metadata.size == 0:
                return
            from transfer_queue.metadata import extract_field_schema

            field_schema = extract_field_schema(data)
            n = metadata.size
            columns: Dict[str, Any] = {}
            tags: Dict[str, Optional[str]] = {}
            for f in data.keys():
                columns[f], pickled = _encode_rows(f, data[f], n)
                tags[f] = _PICKLE_TAG if pickled else None
            gidx = list(metadata.global_indexes)
            groups = _groups(metadata)
            await asyncio.to_thread(self._put_sync, groups, gidx, columns)
            backend_meta = {g: dict(tags) for g in gidx}
            for p, positions in groups.items():
                if len(groups) == 1:
                    sub_schema, keys, meta = field_schema, gidx, backend_meta
                else:
                    keys = [gidx[i] for i in positions]
                    meta = {g: backend_meta[g] for g in keys}
                    sub_schema = {
                        f: (
                            {**s, "per_sample_shapes": [s["per_sample_shapes"][i] for i in positions]}
                            if "per_sample_shapes" in s
                            else s
                        )
                        for f, s in field_schema.items()
                    }
                await self.notify_data_update(p, keys, sub_schema, meta)

        def _put_sync(self, groups: Dict[str, List[int]], gidx: List[int], columns: Dict[str, Any]) -> None:
            plane = self._live()
            for p, positions in groups.items():
                if len(groups) == 1:
                    keys, cols = gidx, columns
                else:
                    keys = [gidx[i] for i in positions]
                    cols = {f: _select(c, positions) for f, c in columns.items()}
                try:
                    plane.put(p, keys, cols)
                except stowage.LostKeys as e:
                    raise _lost(p, e, "put") from e

        # -- get ----------------------------------------------------------

        async def get_data(self, metadata: Any) -> Any:
            from tensordict import TensorDict

            if metadata.size == 0:
                return TensorDict({}, batch_size=0)
            fields = list(metadata.field_names)
            columns = await asyncio.to_thread(self._get_sync, metadata, fields)
            return TensorDict(columns, batch_size=len(metadata))

        def _get_sync(self, metadata: Any, fields: List[str]) -> Dict[str, Any]:
            client = self._live()._client
            gidx = list(metadata.global_indexes)
            n = len(gidx)
            rows: Dict[str, List[Any]] = {f: [None] * n for f in fields}
            owned = True
            for p, positions in _groups(metadata).items():
                keys = [gidx[i] for i in positions]
                try:
                    got = None
                    if self._shm:
                        # Read in place (one copy, into the packed result);
                        # values in the disk tier that the slab has no room
                        # to bring back need a copying get.
                        try:
                            got = client.get_view(p, keys, fields, None, None, True)
                            owned = False
                        except stowage.TransferFailed as e:
                            if e.in_flight:
                                raise
                    if got is None:
                        got = client.get(p, keys, fields, None, None, True)
                except stowage.NotFound as e:
                    raise _not_found(p, e) from e
                except stowage.LostKeys as e:
                    raise _lost(p, e, "get") from e
                for f, vals in zip(fields, got):
                    col = rows[f]
                    for i, v in zip(positions, vals):
                        col[i] = v
            backend_meta = metadata._custom_backend_meta
            for f in fields:
                col = rows[f]
                for i in range(n):
                    if (backend_meta[i] or {}).get(f) == _PICKLE_TAG:
                        col[i] = _unpickled(col[i], f"row {gidx[i]} field {f!r}")
            # Packing copies every value once into fresh memory (the
            # result must not alias a unit's); numpy releases the GIL for
            # it, so the fields are packed on all cores at once.
            packed = _pack_pool().map(lambda f: _pack(rows[f], owned=owned), fields)
            return dict(zip(fields, packed))

        # -- clear --------------------------------------------------------

        async def clear_data(self, metadata: Any, fields: Any = None) -> None:
            if metadata.size == 0:
                return
            await asyncio.to_thread(self._clear_sync, metadata)

        def _clear_sync(self, metadata: Any) -> None:
            plane = self._live()
            gidx = list(metadata.global_indexes)
            for p, positions in _groups(metadata).items():
                try:
                    plane.clear(p, [gidx[i] for i in positions])
                except stowage.LostKeys as e:
                    raise _lost(p, e, "clear") from e

        # -- checkpoints --------------------------------------------------

        async def save_checkpoint(self, checkpoint_dir: str) -> None:
            await asyncio.to_thread(_save_checkpoint, self._live(), self._namespace, checkpoint_dir)

        async def load_checkpoint(self, checkpoint_dir: str) -> None:
            await asyncio.to_thread(
                _load_checkpoint, self._live(), self._namespace, checkpoint_dir, self._timeout
            )

        # -- lifecycle ----------------------------------------------------

        def _live(self) -> stowage.DataPlane:
            if self._plane is None or self._plane.closed:
                raise RuntimeError("the Stowage storage manager is closed")
            return self._plane

        def close(self) -> None:
            plane = getattr(self, "_plane", None)
            if plane is not None:
                plane.close()
            super().close()

    _Manager.__name__ = _Manager.__qualname__ = "StowageStorageManager"
    _Manager.__module__ = __name__
    StowageStorageManager = StorageManagerFactory.register(BACKEND)(_Manager)
    StorageBootstrapProvider.register_provider(BACKEND)(initialize_stowage_storage)


_MANAGER_DOC = """TransferQueue's storage manager for stowage (registered as "Stowage").

Rows are global indexes, partitions TransferQueue partitions, fields
fields. ``put_data`` writes every column of the batch with one stowage put
(each unit gets its rows of every column in one round), upserting per cell
(a cell may change shape or kind); ``get_data`` returns a TensorDict like
SimpleStorage's (rows in ``global_indexes`` order; 0-d values stacked,
tensors as jagged nested tensors built from one contiguous buffer, others a
NonTensorStack), copies that do not alias the units' memory; a missing
row raises ``transfer_queue.StorageKeyNotFoundError``, a row whose unit
died :class:`RowsLost`. ``clear_data`` removes whole rows. Checkpoints go
through the units' own (``save_checkpoint``/``load_checkpoint``)."""

StowageStorageManager: Any = None


def _select(col: Any, positions: List[int]) -> Any:
    if isinstance(col, list):
        return [col[i] for i in positions]
    import torch

    idx = torch.tensor(positions) if isinstance(col, torch.Tensor) else positions
    return col[idx]


def _not_found(partition: str, e: Any) -> Exception:
    from transfer_queue import StorageKeyNotFoundError

    keys = sorted({k for k, _ in getattr(e, "keys", [])}, key=str)
    return StorageKeyNotFoundError(
        f"stowage: rows {_short_list(keys)} of partition {partition!r} are not stored "
        f"(missing (row, field): {_short_list(getattr(e, 'keys', []), 10)})"
    )


def _lost(partition: str, e: Any, op: str) -> RowsLost:
    keys = sorted({k for k, _ in getattr(e, "keys", [])}, key=str)
    return RowsLost(partition, keys, getattr(e, "unit", None), op)


# -- checkpoints -------------------------------------------------------------------


def _save_checkpoint(plane: stowage.DataPlane, namespace: str, checkpoint_dir: str) -> None:
    """Every unit writes its data and index to
    ``<checkpoint_dir>/stowage/unit-<i>`` on its own host (no payload through
    this process); a small JSON file records, with relative paths only, what
    load needs (TransferQueue renames the directory after this)."""
    root = os.path.abspath(checkpoint_dir)
    target = os.path.join(root, _CHECKPOINT_SUBDIR)
    infos = plane.checkpoint(target)
    record = {
        "format": 1,
        "namespace": namespace,
        "units": [
            {"dir": f"{_CHECKPOINT_SUBDIR}/unit-{i}", **{k: v for k, v in info.items() if k != "dir"}}
            for i, info in enumerate(infos)
        ],
    }
    with open(os.path.join(root, _CHECKPOINT_INFO), "w", encoding="utf-8") as f:
        json.dump(record, f, default=str)


def _load_checkpoint(plane: stowage.DataPlane, namespace: str, checkpoint_dir: str, timeout: float) -> None:
    """Replace the running units' rows of this namespace with the
    checkpoint's, under the same partitions and global indexes.

    Each checkpointed unit is started again, read-only in effect, as a
    temporary unit of this process restored from its directory (what
    ``stowage unit --restore`` does); only once every one has started (a
    damaged checkpoint is refused there, before anything changes) are the
    live rows cleared and the checkpoint's rows put back through the
    running units. The temporary units stop at the end."""
    root = os.path.abspath(checkpoint_dir)
    with open(os.path.join(root, _CHECKPOINT_INFO), encoding="utf-8") as f:
        record = json.load(f)
    ns = record.get("namespace", namespace)
    sources: List[stowage.DataPlane] = []
    try:
        for u in record["units"]:
            size = int(u.get("bytes") or 0)
            memory = max(64 << 20, size + size // 4 + (32 << 20))
            sources.append(
                stowage.local(
                    units=1,
                    memory=memory,
                    namespace=ns,
                    timeout=timeout,
                    unit_args=["--restore", os.path.join(root, u["dir"])],
                )
            )
        for p in plane.partitions():
            plane.clear_partition(p)
        for src in sources:
            for p in src.partitions():
                rows = src.list(p)
                by_field: Dict[str, List[Any]] = {}
                for key, fields in rows.items():
                    for f in fields:
                        by_field.setdefault(f, []).append(key)
                for f, keys in by_field.items():
                    for s in range(0, len(keys), 4096):
                        chunk = keys[s : s + 4096]
                        vals = src._client.get(p, chunk, [f], None, None, True)[0]
                        vals = [("bfloat16", v.view(np.int16)) if v.dtype.kind == "V" else v for v in vals]
                        plane._client.put(p, chunk, [(f, vals)], None, None)
    finally:
        for src in sources:
            src.close()


_register()
