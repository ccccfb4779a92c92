"""TransferQueue's storage manager for stowage (:mod:`stowage.tq`): how
a batch's columns become stowage values and back (tensors as they are,
anything else as authenticated pickled cells), and the manager that puts,
gets and clears them and hands checkpoints to :mod:`stowage._tq_checkpoint`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import stowage

from . import _compat, _tq_cells
from ._tq_checkpoint import _load_checkpoint, _RestoredCells, _save_checkpoint
from ._tq_config import (
    BACKEND,
    _block,
    _checkpoint_cell_key,
    _client_secret,
    _reveal_directory,
)

# The mark of a pickled non-tensor value in custom_backend_meta (the stored
# bytes carry their own head and tag: stowage._tq_cells).
_PICKLE_TAG = "stowage-pickle5"


class RowsLost(stowage.Error, RuntimeError):
    """Rows whose storage unit died (or was replaced): their values are
    gone. ``partition``, ``global_indexes`` (the lost rows asked for) and
    ``unit`` (its index) say which; the stowage error (:class:`stowage.LostKeys`)
    is the cause. A :class:`stowage.Error` (and, as before, a
    ``RuntimeError``)."""

    def __init__(self, partition: str, global_indexes: List[int], unit: Optional[int], op: str):
        self.partition = partition
        self.global_indexes = global_indexes
        self.unit = unit
        super().__init__(
            f"stowage {op}: storage unit {unit} is gone, and with it the rows "
            f"{_short_list(global_indexes)} of partition {partition!r} "
            f"({len(global_indexes)} lost rows asked for); re-produce them"
        )


RowsLost.__module__ = "stowage.tq"


def _short_list(xs: Sequence[Any], n: int = 20) -> str:
    xs = list(xs)
    if len(xs) <= n:
        return str(xs)
    return "[" + ", ".join(map(str, xs[:n])) + f", ... ({len(xs) - n} more)]"


# -- values ----------------------------------------------------------------------

# torch dtypes stowage stores as they are (others are pickled).
_TORCH_DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
)


#: ``seal(position, value)``: the stored cell of a non-tensor value at a
#: batch position (see :func:`stowage._tq_cells.seal`).
Seal = Callable[[int, Any], np.ndarray]


def _host(t: Any) -> Any:
    """A CPU, contiguous, grad-free version of tensor ``t`` (a copy only
    when needed: CUDA and other devices are copied to host memory)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def _encode_rows(name: str, col: Any, n: int, seal: Seal) -> Tuple[Any, bool]:
    """A column for DataPlane.put and whether it is pickled.

    Tensors (dense, nested jagged or strided; CUDA ones copied to host)
    are stored as they are, one value per row with its dtype and shape.
    Anything else — lists (TensorDict's LinkedList), numpy object/bytes
    arrays, NonTensorStack/NonTensorData, tensors of dtypes stowage does not
    store — is stored one pickle (protocol 5) per row, as the uint8 value
    ``seal(position, value)`` makes: a head, an HMAC-SHA-256 tag under the
    plane's cell key over the cell's namespace, partition, row, field and
    pickle, then the pickle (:mod:`stowage._tq_cells`). The manager notes
    it in the controller's custom_backend_meta, and a get unpickles only
    cells so marked whose tag it checked first: whoever can write a unit's
    rows (another local user, without the secret) cannot make a reader
    unpickle bytes of their choosing, nor move a good cell to another row.
    """
    import torch

    if isinstance(col, torch.Tensor):
        if str(col.dtype).replace("torch.", "") not in _TORCH_DTYPES:
            return [seal(i, r) for i, r in enumerate(col.unbind())], True
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
        NonTensorData = NonTensorStack = ()
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
    return [seal(i, v) for i, v in enumerate(values)], True


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
            return stowage._to_torch(np.stack(rows))
        if same_dtype and all(r.ndim >= 1 and r.shape[1:] == rows[0].shape[1:] for r in rows):
            # One contiguous buffer, one copy: the jagged tensor's values,
            # in memory from stowage's read cache (warm pages when the
            # caller freed an earlier batch of this size).
            out = stowage.empty((sum(r.shape[0] for r in rows), *rows[0].shape[1:]), dt)
            np.concatenate(rows, axis=0, out=out)
            values = stowage._to_torch(out)
            lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
            offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=offsets[1:])
            return torch.nested.nested_tensor_from_jagged(values, offsets)
        rows = [stowage._to_torch(r if owned else np.array(r)) for r in rows]
    elif not arrays:
        rows = [
            stowage._to_torch(r if owned else np.array(r)) if isinstance(r, np.ndarray) else r
            for r in rows
        ]
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


def register(provider: Callable[[Any], Any]) -> Any:
    """Register the storage manager, and ``provider`` as the bootstrap
    provider, under :data:`BACKEND` (once a process); returns the
    manager's class."""
    from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
    from transfer_queue.storage.managers.base import StorageManager, StorageManagerFactory

    global StowageStorageManager
    if _compat.registered_manager(BACKEND) is not None and StowageStorageManager is not None:
        return StowageStorageManager

    class _Manager(StorageManager):
        __doc__ = _MANAGER_DOC

        def __init__(
            self, controller_info: Any, config: Any, zmq_context: Any = None, **kwargs: Any
        ):
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
                directory = _reveal_directory(directory)
            self._namespace = str(block["namespace"])
            self._timeout = float(block["timeout"])
            self._plane = stowage.connect(
                directory,
                namespace=self._namespace,
                timeout=self._timeout,
                secret=_client_secret(block),
                replicas=block["replicas"],
            )
            self._shm = all(u.startswith("unix:") for u in self._plane.units)
            # The key of the pickled cells' tags, derived from the plane's
            # secret by the native client (never the secret itself).
            self._cell_key: Optional[bytes] = self._plane._client.cell_key()
            self._insecure_pickles = bool(block["insecure_pickles"])
            self._checkpoint_key = _checkpoint_cell_key(block)

        # -- put ----------------------------------------------------------

        async def put_data(self, data: Any, metadata: Any, data_parser: Any = None) -> None:
            if data_parser is not None:
                raise NotImplementedError("data_parser is supported by SimpleStorage only")
            if metadata.size == 0:
                return
            from transfer_queue.metadata import extract_field_schema

            field_schema = extract_field_schema(data)
            n = metadata.size
            gidx = list(metadata.global_indexes)
            parts = list(metadata.partition_ids)
            columns: Dict[str, Any] = {}
            tags: Dict[str, Optional[str]] = {}
            for f in data.keys():
                columns[f], pickled = _encode_rows(f, data[f], n, self._sealer(parts, gidx, f))
                tags[f] = _PICKLE_TAG if pickled else None
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
                            {
                                **s,
                                "per_sample_shapes": [s["per_sample_shapes"][i] for i in positions],
                            }
                            if "per_sample_shapes" in s
                            else s
                        )
                        for f, s in field_schema.items()
                    }
                await self.notify_data_update(p, keys, sub_schema, meta)

        def _sealer(self, parts: List[str], gidx: List[int], field: str) -> Seal:
            key, ns, insecure = self._cell_key, self._namespace, self._insecure_pickles

            def seal(i: int, value: Any) -> np.ndarray:
                return _tq_cells.seal(key, ns, parts[i], gidx[i], field, value, insecure)

            return seal

        def _put_sync(
            self, groups: Dict[str, List[int]], gidx: List[int], columns: Dict[str, Any]
        ) -> None:
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
            backend_meta = _compat.custom_backend_meta(metadata)
            parts = list(metadata.partition_ids)
            key, ns, insecure = self._cell_key, self._namespace, self._insecure_pickles
            for f in fields:
                col = rows[f]
                for i in range(n):
                    if (backend_meta[i] or {}).get(f) == _PICKLE_TAG:
                        # Checked before it is unpickled (UntrustedCell).
                        col[i] = _tq_cells.open_cell(
                            key, ns, parts[i], gidx[i], f, col[i], insecure
                        )
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
            cells = _RestoredCells(
                self._cell_key, self._namespace, self._checkpoint_key, self._insecure_pickles
            )
            await asyncio.to_thread(
                _load_checkpoint, self._live(), cells, checkpoint_dir, self._timeout
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
    _Manager.__module__ = "stowage.tq"
    StowageStorageManager = StorageManagerFactory.register(BACKEND)(_Manager)
    StorageBootstrapProvider.register_provider(BACKEND)(provider)
    return StowageStorageManager


_MANAGER_DOC = """TransferQueue's storage manager for stowage (registered as "Stowage").

Rows are global indexes, partitions TransferQueue partitions, fields
fields. ``put_data`` writes every column of the batch with one stowage put
(each unit gets its rows of every column in one round), upserting per cell
(a cell may change shape or kind); ``get_data`` returns a TensorDict like
SimpleStorage's (rows in ``global_indexes`` order; 0-d values stacked,
tensors as jagged nested tensors built from one contiguous buffer, others a
NonTensorStack), copies that do not alias the units' memory; a missing
row raises ``transfer_queue.StorageKeyNotFoundError``, a row whose unit
died :class:`RowsLost`. Non-tensor values are pickled cells with an
HMAC-SHA-256 tag (under a key derived from the plane's secret) that a get
checks before it unpickles them (:class:`UntrustedCell` otherwise).
``clear_data`` removes whole rows. Checkpoints go through the units' own
(``save_checkpoint``/``load_checkpoint``): each unit writes its part on its
own host under its ``checkpoint_root``, and a load restores each part on
the host that has it; a load refuses a record naming paths outside the
checkpoint, a part no unit has (naming its unit and host) and cells whose
tag is wrong (:class:`CheckpointRefused`)."""

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
