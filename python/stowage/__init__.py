"""stowage: a data plane for RL post-training.

Rollout workers, reward and reference models, the driver and the trainer
ranks put, get and clear rows of fields (token ids, logprobs, masks,
advantages) in *storage units*: processes that own all data memory. Bytes
move directly between your arrays and a unit's memory, through shared
memory on the same host or TCP elsewhere, with the GIL released.

    import numpy as np, stowage

    with stowage.local(units=2, memory="256MiB") as dp:
        dp.put("step-0", [0, 1], {
            "input_ids": [np.arange(5), np.arange(7)],   # jagged: one array per row
            "reward": np.array([0.5, 1.0]),              # dense: split along axis 0
        })
        got = dp.get("step-0", [0, 1], ["input_ids", "reward"])
        got["input_ids"][1]                              # array([0, 1, ..., 6])
        dp.clear("step-0", [0, 1])

Keys are ints in [0, 2**63) or strs. Values are numpy arrays (bool,
int8..int64, uint8..uint64, float16, bfloat16 via ml_dtypes, float32,
float64) or CPU torch tensors; they must be C-contiguous: stowage never
copies an array behind your back. Errors are subclasses of
:class:`stowage.Error`.

A renamed name keeps its old spelling for one release, with a
DeprecationWarning: ``stowage.Key`` is now :data:`RowKey`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import warnings
import weakref
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Union,
)

import numpy as np

from . import _native
from . import config as config  # stowage.config.load
from . import placement as placement  # stowage.placement.*
from ._native import (
    Corrupt,
    Error,
    InvalidRequest,
    Io,
    KeyCollision,
    LostKeys,
    NotFound,
    NotOwner,
    Timeout,
    TransferFailed,
    Unauthorized,
    UnitFull,
    Unreachable,
)
from ._packed import PackedChunk, PackedView

if TYPE_CHECKING:  # pragma: no cover
    import torch

__version__: str = _native.__version__

__all__ = [
    "Corrupt",
    "DataPlane",
    "Error",
    "InvalidRequest",
    "Io",
    "KeyCollision",
    "LostKeys",
    "NotFound",
    "NotOwner",
    "PackedChunk",
    "PackedView",
    "RowKey",
    "Timeout",
    "TransferFailed",
    "Unauthorized",
    "UnitFull",
    "Unreachable",
    "__version__",
    "connect",
    "empty",
    "local",
    "read_cache_info",
    "set_read_cache",
]

#: A row key: an int in [0, 2**63) or a str.
RowKey = Union[int, str]
#: Row keys: a sequence of ints and strs, or a 1-D integer numpy array.
Keys = Union[Sequence[RowKey], np.ndarray]
#: An array: a numpy array or a CPU torch tensor.
Array = Union[np.ndarray, "torch.Tensor"]
#: A column: one array split along its first axis (one entry per key), or
#: a list of one array per key (each of any shape).
ColumnLike = Union[Array, Sequence[Array]]

# Old names, kept for one release: old name -> (new name, its value).
_DEPRECATED: Dict[str, Any] = {"Key": ("RowKey", RowKey)}

if TYPE_CHECKING:  # pragma: no cover
    # Type checkers see the old names as the new ones (deprecated).
    Key = RowKey
else:

    def __getattr__(name: str) -> Any:
        """A deprecated name (PEP 562): warns, then gives the new name's value."""
        old = _DEPRECATED.get(name)
        if old is None:
            raise AttributeError(f"module 'stowage' has no attribute {name!r}")
        new, value = old
        warnings.warn(
            f"stowage.{name} is deprecated; use stowage.{new}", DeprecationWarning, stacklevel=2
        )
        return value


def empty(shape: Union[int, Sequence[int]], dtype: Any = np.uint8) -> np.ndarray:
    """A new writable C-contiguous array, like ``numpy.empty``, whose memory
    comes from stowage's read cache when it is 1 MiB or larger.

    Gets into new arrays use the same cache: freed buffers of 1 MiB and
    more are kept mapped (up to ``STOWAGE_HOST_CACHE`` bytes, default
    1 GiB, process-wide) and reused for the next value of a similar size,
    so a training loop that reads the same sizes every step fills warm
    memory instead of faulting in fresh pages. The memory returns to the
    cache when the last array or tensor over it is freed. Its contents
    are undefined until written."""
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    n = 1
    for d in dims:
        if int(d) < 0:
            raise InvalidRequest(f"negative dimension {d} in shape {dims}")
        n *= int(d)
    return _native.host_empty(n * dt.itemsize).view(dt).reshape(dims)


def read_cache_info() -> Dict[str, int]:
    """The read cache (see :func:`empty`): ``bytes`` kept now, ``limit``,
    and the ``hits`` and ``misses`` of buffers of 1 MiB and more."""
    return dict(_native.host_cache_info())


def set_read_cache(limit: int) -> None:
    """Keep at most ``limit`` bytes of freed read buffers (0: keep none);
    what is over is unmapped at once."""
    if limit < 0:
        raise InvalidRequest(f"read cache limit {limit} is negative")
    _native.set_host_cache(int(limit))


def _torch_module() -> Any:
    # A torch tensor can only exist if torch is imported already: never
    # import it just to look.
    return sys.modules.get("torch")


def _is_tensor(x: Any) -> bool:
    torch = _torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def _from_tensor(t: Any, what: str, writable: bool = False) -> Any:
    """A numpy array over a CPU tensor's memory (bfloat16 as a tagged int16
    view), without copying."""
    torch = _torch_module()
    if t.device.type != "cpu":
        raise InvalidRequest(
            f"{what}: the tensor is on {t.device}; stowage moves CPU memory (call .cpu() first)"
        )
    if not t.is_contiguous():
        raise InvalidRequest(
            f"{what}: the tensor is not contiguous (strides {t.stride()}); pass t.contiguous() explicitly"
        )
    if writable and t.requires_grad:
        raise InvalidRequest(f"{what}: cannot write into a tensor that requires grad")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return ("bfloat16", t.view(torch.int16).numpy())
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as e:
        raise InvalidRequest(f"{what}: unsupported tensor dtype {t.dtype} ({e})") from None


def _what(name: str, row: Optional[int]) -> str:
    return f"column {name!r}" if row is None else f"column {name!r} row {row}"


def _array(x: Any, name: str, row: Optional[int], writable: bool) -> Any:
    """An array for _native: numpy arrays as they are, tensors as numpy
    arrays over their memory, numpy scalars as 0-d arrays."""
    if isinstance(x, np.ndarray):
        return x
    if _is_tensor(x):
        return _from_tensor(x, _what(name, row), writable)
    if isinstance(x, np.generic) and not writable:
        return np.asarray(x)
    raise InvalidRequest(
        f"{_what(name, row)}: expected a numpy array or a torch tensor, got {type(x).__name__}"
    )


def _column(name: str, col: Any, writable: bool = False) -> Any:
    """A column for _native: an array (dense) or a list of arrays (jagged)."""
    if isinstance(col, (list, tuple)):
        # The common case: numpy arrays, passed on as they are (the native
        # layer checks each one). A loop, not all() over a generator: this
        # runs on every call, and a one-row call is a few microseconds.
        ndarray = np.ndarray  # once, not a module lookup per value
        for a in col:
            if type(a) is not ndarray:
                return [_array(a, name, i, writable) for i, a in enumerate(col)]
        return col if type(col) is list else list(col)
    if isinstance(col, (np.ndarray, np.generic)) or _is_tensor(col):
        return _array(col, name, None, writable)
    raise InvalidRequest(
        f"column {name!r}: expected an array (one entry per key along axis 0) "
        f"or a list of arrays (one per key), got {type(col).__name__}"
    )


def _fields(fields: Union[str, Iterable[str]]) -> List[str]:
    if isinstance(fields, str):
        return [fields]
    fields = list(fields)
    for f in fields:
        if not isinstance(f, str):
            raise InvalidRequest("fields must be strs")
    return fields


def _to_torch(a: np.ndarray) -> Any:
    import torch

    if a.dtype.kind == "V":  # raw bfloat16 (see _native.Client.get)
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    try:
        return torch.from_numpy(a)
    except TypeError as e:
        raise InvalidRequest(f"a {a.dtype} array has no torch equivalent ({e})") from None


class DataPlane:
    """A client of a set of storage units; from :func:`connect` or :func:`local`.

    Calls may be made from several threads at once (the GIL is released
    during transfers). Every call takes an optional ``timeout`` in seconds
    (default: the one given at connect). A local plane's units stop with
    :meth:`close`, when the object is garbage-collected, or at interpreter
    exit (and exit by themselves if this process dies).
    """

    def __init__(
        self,
        client: _native.Client,
        plane: Optional[_native.LocalPlane] = None,
        admin: Optional[_native.Client] = None,
    ):
        self._client = client
        self._plane = plane
        # Admin requests go over the units' Unix sockets for a local plane
        # (the units accept them there from their own user); a unit with a
        # shared secret also takes checkpoint requests from any client
        # that proved it, over tcp too.
        self._admin = admin if admin is not None else client
        self._finalizer = weakref.finalize(self, DataPlane._shutdown, client, plane, admin)

    @staticmethod
    def _shutdown(
        client: _native.Client,
        plane: Optional[_native.LocalPlane],
        admin: Optional[_native.Client] = None,
    ) -> None:
        client.close()
        if admin is not None:
            admin.close()
        if plane is not None:
            plane.stop()

    # -- lifecycle -----------------------------------------------------------

    def close(self) -> None:
        """Drop the connections and stop the units of a local plane. Arrays
        from :meth:`get_view` and :meth:`get_packed_view` stay readable until they are garbage-collected
        (for a local plane: until the units stop, so drop them first)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "DataPlane":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "local " if self._plane is not None else ""
        state = "closed" if self.closed else ", ".join(self.units)
        return f"<stowage {kind}DataPlane {state}>"

    @property
    def units(self) -> List[str]:
        """The unit addresses, in order (row ``r`` lives on unit ``r % N``
        unless a call names a unit)."""
        return self._client.units

    @property
    def replicas(self) -> int:
        """Copies of every row, each on another unit: copy ``i`` of what unit
        ``u`` holds is on the ``i``-th unit after ``u`` whose host holds no
        earlier copy, when the plane has enough hosts (docs/replication.md;
        see :func:`connect`)."""
        return self._client.replicas

    @property
    def copies_short_of_hosts(self) -> int:
        """How many units' rows have copies sharing a host (the plane has
        fewer hosts than copies; every unit of a :func:`local` plane): 0
        when every row's copies are on distinct hosts. Also logged at
        connect."""
        return self._client.copies_short_of_hosts()

    def repair(self, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """One repair pass now (with copies; docs/replication.md#repair):
        the units that took the copies of a unit this client found dead get
        the rows they lack. The client also repairs by itself in the
        background. Returns ``done`` and ``left`` (pairs of a unit's rows
        and a newcomer), ``values``, ``bytes``, ``refused`` (there
        already, or cleared since they were read) and ``errors``."""
        return _native.repair(self._client, timeout)

    def rebuild_copies(self, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Every row's copies on every unit of its set, from whichever copy
        holds it: after restarting units from a checkpoint that kept one
        copy of each row, before the plane serves (a rebuild alongside
        other clients' clears of the same rows could bring one back).
        Reported as :meth:`repair` reports."""
        return _native.rebuild_copies(self._client, timeout)

    def under_replicated(self, *, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        """What the units that took a dead unit's copies lack (lists only):
        per unit whose rows moved and newcomer, ``unit``, ``source``,
        ``target``, ``rows`` and ``values``; empty when this client found
        no unit down or has repaired them."""
        return _native.under_replicated(self._client, timeout)

    def rejoin(self, unit: int, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Take unit ``unit`` back into the plane (with copies;
        docs/replication.md#rejoining): the unit started again at its
        address after it died or was fenced (empty, another instance) is
        named in a new view of the plane, which every unit up and then
        every client moves to; copies go there again, the copies that
        stood in for it are cleared of its rows, and a repair (this
        client's background one, or :meth:`repair`) gives it the rows put
        before. Needs the plane's secret. Returns ``unit``, ``instance``
        (hex), ``epoch`` (the new view's), ``already`` (it was a member:
        nothing changed), ``moved`` (units that took the view),
        ``unreached`` and ``cleared`` (values cleared where copies
        left)."""
        return _native.rejoin(self._client, unit, timeout)

    @property
    def directory(self) -> Dict[str, Any]:
        """A local plane's directory: pass it (or a JSON file holding it) to
        :func:`connect` in another process, on this host (shared memory) or
        another one (tcp, if the units listen beyond loopback); its
        ``replicas`` is the plane's, which those clients use. When the
        plane generated its secret, the directory carries it
        (``secret_hex``): keep it, and any file holding it, owner-only
        (``chmod 600``; a client refuses a directory file with a secret
        that others may read)."""
        if self._plane is None:
            raise InvalidRequest("not a local data plane: use the directory its launcher returned")
        host = _native.host_id()
        units = []
        for i, (uds, tcp, pid, instance) in enumerate(
            zip(
                self._plane.uds_addrs,
                self._plane.tcp_addrs,
                self._plane.pids,
                self._plane.instance_ids,
            )
        ):
            units.append(
                {
                    "index": i,
                    "host": host,
                    "uds": uds,
                    "tcp": tcp,
                    "pid": pid,
                    "instance_id": instance,
                }
            )
        d: Dict[str, Any] = {"stowage_directory": 1, "replicas": self.replicas, "units": units}
        secret = self._plane.secret
        if self._plane.secret_generated and secret is not None:
            d["secret_hex"] = secret.hex()
        return d

    @property
    def unit_pids(self) -> List[int]:
        """The process ids of a local plane's units."""
        if self._plane is None:
            raise InvalidRequest(
                "not a local data plane: its units are not this process's children"
            )
        return self._plane.pids

    # -- data ----------------------------------------------------------------

    def put(
        self,
        partition: str,
        keys: Keys,
        columns: Mapping[str, ColumnLike],
        unit: Optional[int] = None,
        *,
        timeout: Optional[float] = None,
        groups: Optional[Sequence[str]] = None,
    ) -> None:
        """Write ``columns`` (field -> column) for ``keys`` in ``partition``.

        A column is one array split along its first axis (its length must
        be ``len(keys)``) or a list of ``len(keys)`` arrays of any shapes.
        Array memory is read in place (never copied here); arrays must be
        C-contiguous. Writing an existing (key, field) replaces it
        atomically; a put may add fields to existing rows. ``unit``: place
        every row on that unit (then name it again to read or clear them).
        ``groups``: one group id per key; rows sharing one are claimed
        whole (:meth:`register_tasks`) and live on the group's unit
        (:meth:`unit_of`) unless ``unit`` is given: read and clear them
        with ``unit=unit_of(group)``.

        Raises InvalidRequest for bad input (nothing is stored then),
        UnitFull, TransferFailed, LostKeys, Timeout.
        """
        # type() first: isinstance against typing.Mapping costs more than
        # half a microsecond, on every call.
        if type(columns) is not dict and not isinstance(columns, Mapping):
            raise InvalidRequest("columns must be a dict of field -> column")
        cols = []
        for name, col in columns.items():
            cols.append((name, _column(name, col)))
        self._client.put(
            partition, keys, cols, unit, timeout, None if groups is None else list(groups)
        )

    def get(
        self,
        partition: str,
        keys: Keys,
        fields: Union[str, Sequence[str]],
        unit: Optional[int] = None,
        out: Optional[Mapping[str, Any]] = None,
        as_: str = "numpy",
        *,
        timeout: Optional[float] = None,
    ) -> Dict[str, Any]:
        """Read ``fields`` of ``keys``: a dict field -> list of arrays (one per
        key, with the dtype and shape that was put).

        ``out``: a dict field -> list of preallocated arrays (one per key),
        or field -> one array whose first axis runs over the keys (when
        every value of the field has the same shape); values are written
        into them (dtype and size must match exactly) and ``out``'s entries
        are returned. ``as_="torch"`` returns torch tensors (bfloat16
        included, without ml_dtypes).

        Raises NotFound (naming every missing (key, field)), LostKeys,
        InvalidRequest, TransferFailed, Timeout.
        """
        fields = _fields(fields)
        if out is not None:
            # One loop, no comprehension (a frame of its own in Python
            # 3.11): a one-row get is a few microseconds.
            outs = []
            given = {}
            for f in fields:
                if f not in out:
                    missing = [g for g in fields if g not in out]
                    raise InvalidRequest(f"out has no entry for fields {missing}")
                given[f] = col = out[f]
                outs.append(_column(f, col, writable=True))
            self._client.get_into(partition, keys, fields, outs, unit, timeout)
            return given
        if as_ == "numpy":
            got = self._client.get(partition, keys, fields, unit, timeout, False)
            return dict(zip(fields, got))
        if as_ == "torch":
            got = self._client.get(partition, keys, fields, unit, timeout, True)
            return {f: [_to_torch(a) for a in rows] for f, rows in zip(fields, got)}
        raise InvalidRequest(f"as_ must be 'numpy' or 'torch', not {as_!r}")

    def get_view(
        self,
        partition: str,
        keys: Keys,
        fields: Union[str, Sequence[str]],
        unit: Optional[int] = None,
        *,
        timeout: Optional[float] = None,
    ) -> Dict[str, List[np.ndarray]]:
        """Read-only numpy arrays that point into the units' memory (no copy;
        shared-memory units on this host only): field -> list per key.

        The values stay pinned (in place, even if their rows are cleared or
        replaced) until every array of the call is garbage-collected;
        pinned memory counts against the unit's space, so drop views soon.

        A value the unit stored split across pieces of its memory (it was
        larger than any free range when it was put) is not one range to
        point into: it comes back as a copy, a new writeable array exactly
        as :meth:`get` returns it (one copy, as fast as ``get``).
        """
        fields = _fields(fields)
        got = self._client.get_view(partition, keys, fields, unit, timeout, False)
        return dict(zip(fields, got))

    def get_packed_view(
        self,
        partition: str,
        keys: Keys,
        fields: Union[str, Sequence[str]],
        unit: Optional[int] = None,
        *,
        timeout: Optional[float] = None,
    ) -> PackedView:
        """``fields`` of ``keys`` packed a field at a time, for jagged
        batches: per unit that holds some of the keys, one
        :class:`PackedChunk` with that unit's rows (positions in ``keys``,
        in the order of ``keys``) and, per field, their values back to back
        along the first axis in one array plus int64 ``offsets``
        (``len(rows) + 1``): what ``torch.nested.nested_tensor_from_jagged(
        values, offsets)`` takes. :meth:`PackedView.joined` gives one
        field for every key in key order. Shared-memory units only.

        A field's values of a chunk are one read-only array over the unit's
        memory (no copy, pinned as :meth:`get_view`'s arrays are) when they
        lie back to back there: a put lays each unit's values of a field
        so, in the order of its keys, so a view of rows put by one call, in
        the order they were put (default placement: every unit's share of
        them), is zero-copy. Otherwise (rows of several puts, another
        order, a value the unit stored in pieces) that field's values of
        the chunk are copied once, with the GIL released, into a new
        writeable array.

        Every value of a field must have the same dtype and the same
        dimensions past the first (a 0-d value counts as one element);
        else InvalidRequest. Raises as :meth:`get_view` does otherwise.
        """
        fields = _fields(fields)
        got = self._client.get_packed_view(partition, keys, fields, unit, timeout, False)
        chunks = [
            PackedChunk(u, rows, dict(zip(fields, values)), dict(zip(fields, offsets)))
            for u, rows, values, offsets in got
        ]
        return PackedView(fields, len(keys), chunks)

    def clear(
        self,
        partition: str,
        keys: Keys,
        unit: Optional[int] = None,
        *,
        timeout: Optional[float] = None,
    ) -> int:
        """Clear whole rows (every field) of ``partition``; returns the number
        of values removed. Rows that do not exist are ignored."""
        return self._client.clear(partition, keys, unit, timeout)

    def clear_partition(self, partition: str, *, timeout: Optional[float] = None) -> int:
        """Clear every row of ``partition``; returns the number of values removed."""
        return self._client.clear_partition(partition, timeout)

    # -- claims --------------------------------------------------------------

    def unit_of(self, name: str) -> int:
        """The unit the row named ``name``, or the rows of group ``name``, live on."""
        return self._client.unit_of(name)

    def register_tasks(
        self,
        partition: str,
        tasks: Sequence[str],
        samples: int,
        group_size: Optional[int] = None,
        *,
        timeout: Optional[float] = None,
    ) -> None:
        """Declare the consumer ``tasks`` of ``partition`` on every unit.

        ``samples``: the rows the partition is expected to hold in all
        (:meth:`claim_status` reports it back); ``group_size``: rows put
        with ``groups`` are claimed in whole groups of this size.
        Idempotent; tasks add up; another group size than the registered
        one raises InvalidRequest.
        """
        self._client.register_tasks(partition, list(tasks), samples, group_size, timeout)

    def claim(
        self,
        partition: str,
        task: str,
        fields: Union[str, Iterable[str]],
        count: int,
        *,
        block: bool = True,
        timeout: Optional[float] = None,
    ) -> List[RowKey]:
        """Claim for ``task`` up to ``count`` rows of ``partition`` that have
        every one of ``fields``; returns their keys.

        Each row is claimed at most once per task, by any client; the
        units keep the claims (no controller). With ``block``, waits until
        a unit has a row ready (the unit answers as soon as a put makes
        one ready) and raises Timeout at ``timeout``; without, returns
        ``[]`` when none is. Rows of a group come whole. An unregistered
        task raises InvalidRequest. A claim that has leased rows when its
        timeout comes finishes taking them (up to 10 s more) rather than
        lose them to the task.
        """
        return self._client.claim(partition, task, _fields(fields), count, block, timeout)

    def claim_status(
        self, partition: str, task: str, *, timeout: Optional[float] = None
    ) -> Dict[str, int]:
        """``task``'s progress through ``partition``, summed over the units:
        ``registered`` (0 or 1), ``samples``, ``group_size``, ``consumed``
        (rows claimed for good) and ``leased`` (being claimed now)."""
        return self._client.claim_status(partition, task, timeout)

    def list(self, partition: str, *, timeout: Optional[float] = None) -> Dict[RowKey, List[str]]:
        """The rows of ``partition``: key -> its field names."""
        return self._client.list(partition, timeout)

    def partitions(self, *, timeout: Optional[float] = None) -> List[str]:
        """The partitions of this namespace that hold data, sorted."""
        return self._client.partitions(timeout)

    def check_units(self, *, timeout: Optional[float] = None) -> None:
        """Reach every unit now: open (and keep) one connection to each, in
        unit order, and raise as the first that cannot be reached fails
        (:class:`Unreachable`, :class:`Timeout`, :class:`Unauthorized`).
        Connecting opens nothing; without this, each unit's first call
        reaches it."""
        self._client.check_units(timeout)

    def stats(self, *, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        """Every unit's counters (capacity, used, reserved_bytes,
        quarantined_bytes, blobs, entries, rows, pins, index_bytes, disk
        counters), in unit order, with what clients hold: ``held_bytes``,
        ``overdue_holds`` (holds older than the units' ``--reservation-lease``
        or ``--pin-lease``: reported, never reclaimed while their holder may
        still touch them) and
        ``sessions``, one dict per session (``connections``,
        ``reservations``, ``pins``, ``held_bytes``, ``oldest_hold_ms``,
        ``orphaned``); and ``transport``, how this client reaches the unit
        (``"shm"``, ``"nixl"`` or ``"tcp"``)."""
        return self._client.stats(timeout)

    def metrics(self) -> Dict[str, Any]:
        """This client's own counters (what the units cannot see): per
        operation kind (``put``, ``get``, ``clear``, ``view``, ``control``)
        the calls that succeeded and failed and their latency; Busy answers
        waited out (``busy_retries``, ``busy_wait_seconds``); waits for
        memory (``memory_waits``, ``memory_wait_seconds``); value bytes put
        and got; per unit the latency of its part of puts and gets; and,
        with copies, repairs (``repairs_pending``, ``repaired_newcomers``,
        ``repaired_values``, ``repaired_bytes``,
        ``repair_refused_values``: docs/replication.md#repair) and claimed
        rows whose consumption marks were not written to every copy
        (``claim_marks_failed``: docs/replication.md#claims).
        Latencies are ``{"count", "sum_seconds", "buckets"}`` with
        cumulative ``(upper bound in seconds, count)`` buckets, the last
        bound ``inf``. ``metrics_text()`` gives the same in the Prometheus
        text format (docs/metrics.md)."""
        raw = json.loads(self._client.metrics_json(), parse_constant=float)

        def latency(h: Dict[str, Any]) -> Dict[str, Any]:
            return {
                "count": h["count"],
                "sum_seconds": h["sum_seconds"],
                "buckets": [(float("inf") if b is None else float(b), n) for b, n in h["buckets"]],
            }

        out: Dict[str, Any] = {k: v for k, v in raw.items() if k not in ("operations", "units")}
        out["operations"] = {
            o["op"]: {"ok": o["ok"], "error": o["error"], "latency": latency(o["latency"])}
            for o in raw["operations"]
        }
        out["units"] = [
            {"index": u["index"], "address": u["address"], "latency": latency(u["latency"])}
            for u in raw["units"]
        ]
        return out

    def metrics_text(self) -> str:
        """This client's metrics in the Prometheus text format
        (``stowage_client_...``), e.g. to serve from the application's own
        endpoint."""
        return self._client.metrics_text()

    # -- asyncio -------------------------------------------------------------

    def checkpoint(self, dir: str, *, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        """Every unit writes its data and index to ``dir/unit-<i>`` on its own
        host, under its checkpoint root (no payload passes through this
        process); returns per unit the metadata (``rows``, ``entries``,
        ``bytes``, ``files``, ``manifest_xxh3``, ``host``: the unit's host
        name, ``stored``: where the part lies under that unit's checkpoint
        root). A unit started with ``--restore dir/unit-<i>`` serves the
        same keys. Units take checkpoint requests from a same-user client
        on their Unix socket, and, when they have a shared secret, from any
        client that proved it (over tcp too)."""
        return self._admin.checkpoint(str(dir), timeout)

    def shutdown(self, timeout: float = 30.0) -> List[List[str]]:
        """Stop every unit within ``timeout`` seconds (a checkpoint in
        progress finishes or is abandoned; disk directories are removed).
        Never raises; returns per unit what could not be done."""
        return self._admin.shutdown(timeout)

    async def aput(self, *args: Any, **kwargs: Any) -> None:
        """:meth:`put` in a worker thread (the GIL is released while it runs)."""
        return await asyncio.to_thread(self.put, *args, **kwargs)

    async def aget(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """:meth:`get` in a worker thread."""
        return await asyncio.to_thread(self.get, *args, **kwargs)

    async def aclear(self, *args: Any, **kwargs: Any) -> int:
        """:meth:`clear` in a worker thread."""
        return await asyncio.to_thread(self.clear, *args, **kwargs)


def _directory_of(units: Any) -> Optional[Dict[str, Any]]:
    """The directory ``units`` names, or None when it is a list of addresses."""
    if hasattr(units, "directory") and not isinstance(units, (str, bytes)):
        units = units.directory
    if isinstance(units, Mapping):
        return dict(units)
    if isinstance(units, (str, os.PathLike)):
        path = os.fspath(units)
        if path.startswith(("unix:", "tcp:")) or not os.path.isfile(path):
            return None
        # Read and checked in Rust: a file holding a secret must be
        # owner-only.
        return json.loads(_native.read_directory_file(path))
    return None


def _liveness_of(directory: Mapping[str, Any]) -> Any:
    """The liveness source of a launcher's directory: Ray for units that
    Ray started (asked only after an operation on a unit failed)."""
    entries = list(directory.get("units", ()))
    if not any(isinstance(e, Mapping) and "ray" in e for e in entries):
        return None
    try:
        from . import ray as _ray
    except ImportError as e:  # pragma: no cover - ray entries without ray
        logging.getLogger("stowage").warning(
            "the directory's units were started by Ray, but Ray cannot be imported here (%s); "
            "liveness after a failure falls back to probing their addresses",
            e,
        )
        return None

    def liveness(unit: int) -> str:
        return _ray.liveness(entries[unit])

    return liveness


#: The environment variable that holds the units' shared secret.
SECRET_ENV = "STOWAGE_SECRET"


def _secret(secret: Optional[Union[bytes, str]]) -> Optional[Union[bytes, str]]:
    """``secret``, or else ``STOWAGE_SECRET`` from the environment (as bytes),
    or None."""
    if secret is not None:
        return secret
    env = os.environb.get(SECRET_ENV.encode())
    if env is None:
        return None
    return env.rstrip(b"\r\n")


def connect(
    units: Union[str, os.PathLike, Sequence[str], Mapping[str, Any], Any],
    namespace: str = "default",
    timeout: float = 30.0,
    wait_for_memory: Optional[float] = None,
    transport: str = "auto",
    secret: Optional[Union[bytes, str]] = None,
    nixl: bool = False,
    require_rdma: bool = True,
    replicas: Optional[int] = None,
) -> DataPlane:
    """A client of running units. Connecting opens no connection: each
    unit's first is opened by the first call that touches it, so a client
    of thousands of units costs nothing until it uses them, and a unit
    that cannot be reached (:class:`Unreachable`, :class:`Timeout`,
    :class:`Unauthorized`) fails that call, not this one.
    :meth:`DataPlane.check_units` reaches every unit at once. The threads
    of a process share a few connections per unit.

    ``units`` is a directory — the dict a launcher returned
    (:func:`stowage.ray.start_units`, :attr:`DataPlane.directory`), an object
    with a ``directory`` attribute, or the path of a JSON file holding one —
    or a list of addresses: ``unix:/path/unit.sock`` (shared memory, same
    host) or ``tcp:host:port``.

    With a directory, the transport is chosen per unit: shared memory for
    units on this host, tcp for the others (``transport="tcp"`` forces tcp,
    ``"shm"`` refuses units on other hosts; ``"nixl"`` reaches every unit
    by its tcp address with one-sided NIXL transfers). A unit found to be another
    instance than the directory names reports its keys lost, and for units
    Ray started, Ray is asked whether a unit is dead after an operation on
    it failed (never otherwise).

    ``namespace`` isolates runs sharing units; ``timeout`` is the default
    deadline of every call, in seconds. ``wait_for_memory``: a put that
    finds a unit full (memory and disk) waits up to this many seconds,
    within its deadline, for a clear (or views dropped) to make room
    instead of raising UnitFull at once; it asks again every 5 ms doubling
    to 20 ms, so it goes in that soon after the memory is freed.

    ``secret`` (bytes or str, at least 16 bytes): the units' shared secret,
    proved at every connect; the units must prove it back. Default: the
    ``STOWAGE_SECRET`` environment variable when set, else the directory's
    (``secret_hex``, which a launcher that generated the secret puts there),
    else none. A unit that
    wants a secret refuses a client without the right one, and a client with
    a secret refuses a unit without it: :class:`Unauthorized`, raised by
    the first call on that unit.

    ``nixl``: reach the units this client does not reach over shared memory
    (units on other hosts, or every unit with ``transport="nixl"``) with
    one-sided NIXL transfers where they serve them (``units.nixl``; tcp
    where they do not). Needs a package built with the nixl feature and
    ``libnixl_capi.so`` (docs/nixl.md). ``require_rdma`` (default true):
    refuse to run nixl unless ``UCX_TLS`` holds UCX to RDMA transports.
    :meth:`DataPlane.stats` tells each unit's transport.

    ``replicas``: copies of every row, each on another unit (a put returns
    once every copy is committed; a get reads the next copy when one is
    gone). Every client of a plane must use the same number: by default
    the directory's (``replicas``, which the launchers write; 1 when it
    does not say, or for a list of addresses); one given that differs
    from the directory's raises :class:`InvalidRequest`. At least 1, at
    most the number of units."""
    if transport not in ("auto", "shm", "tcp", "nixl"):
        raise InvalidRequest(f"transport must be 'auto', 'shm', 'tcp' or 'nixl', not {transport!r}")
    use_nixl = nixl or transport == "nixl"
    by_address = "tcp" if transport == "nixl" else transport
    directory = _directory_of(units)
    if directory is not None:
        text = json.dumps(directory)
        addrs, instances = _native.resolve_directory(text, by_address)
        secret = _secret(secret)
        if secret is None:
            secret = _native.directory_secret(text)
        replicas = _native.directory_replicas(text, replicas)
        return DataPlane(
            _native.Client(
                addrs,
                namespace,
                timeout,
                True,
                wait_for_memory,
                secret,
                instances=instances,
                liveness=_liveness_of(directory),
                nixl=use_nixl,
                require_rdma=require_rdma,
                replicas=replicas,
                hosts=_native.directory_hosts(text),
            )
        )
    if isinstance(units, (str, os.PathLike)):
        units = [os.fspath(units)]
    return DataPlane(
        _native.Client(
            list(units),
            namespace,
            timeout,
            by_address != "tcp",
            wait_for_memory,
            _secret(secret),
            nixl=use_nixl,
            require_rdma=require_rdma,
            replicas=1 if replicas is None else replicas,
        )
    )


# Runs the `stowage` command line from the extension module alone: a unit
# process then loads neither this package nor numpy (its resident memory
# stays close to its slab).
_UNIT_BOOT = (
    "import sys, importlib.util as u; "
    "s = u.spec_from_file_location('stowage._native', sys.argv[1]); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); "
    "sys.exit(m.main(['stowage'] + sys.argv[2:]))"
)


def unit_command() -> List[str]:
    """The command that runs one ``stowage unit`` from this interpreter."""
    return [sys.executable, "-c", _UNIT_BOOT, _native.__file__, "unit"]


# How a local plane's start fails when a unit refused its settings.
_REFUSED = re.compile(r"unit \d+ refused to start: ")


def local(
    units: int = 2,
    memory: Union[int, str] = "256MiB",
    transport: str = "shm",
    namespace: str = "default",
    timeout: float = 30.0,
    unit_args: Sequence[str] = (),
    disk: Optional[str] = None,
    disk_capacity: Union[int, str] = "20GiB",
    high_watermark: float = 0.9,
    low_watermark: float = 0.8,
    wait_for_memory: Optional[float] = None,
    checkpoint_root: Optional[str] = None,
    secret: Optional[Union[bytes, str]] = None,
    insecure: bool = False,
    replicas: int = 1,
) -> DataPlane:
    """Start ``units`` storage units of ``memory`` each (bytes, or e.g.
    ``"1GiB"``) as child processes of this interpreter and connect to them
    over ``transport`` (``"shm"``, ``"tcp"``, or ``"nixl"``: the units serve
    NIXL and the client reaches them with one-sided transfers, over whatever
    UCX finds on this host, tcp and cma without an RDMA NIC). The units stop with
    :meth:`DataPlane.close` (or ``with``), at interpreter exit, and by
    themselves if this process dies. ``unit_args``: extra ``stowage unit``
    options, e.g. ``["--pin-lease", "5s"]``.

    ``disk``: the disk tier's root directory (each unit works in its own
    owner-only, locked subdirectory, removed at close); past
    ``high_watermark`` of its memory a unit spills committed values to disk,
    oldest first, down to ``low_watermark``; ``disk_capacity`` per unit.
    Nothing is evicted: memory and disk both full raise UnitFull, or wait up
    to ``wait_for_memory`` seconds for a clear.

    ``checkpoint_root``: :meth:`DataPlane.checkpoint` writes only under this
    directory (without it, the units refuse checkpoints with
    :class:`Unauthorized`).

    ``secret`` (bytes or str): the units require this shared secret of every
    client (it reaches them in an owner-only file, never on a command line)
    and this plane's clients prove it. Default: ``STOWAGE_SECRET`` from the
    environment when set, else a fresh one for this plane (loopback TCP is
    open to every local user); :attr:`DataPlane.directory` carries a
    generated one to other processes. ``insecure=True``: units without a
    secret; every local user can then read, overwrite and clear every value
    over their loopback TCP listeners.

    ``replicas``: copies of every row, each on another unit (at most
    ``units``; more raises :class:`InvalidRequest` before any unit starts);
    :attr:`DataPlane.directory` carries it to the plane's other clients.

    A unit that refuses its settings (e.g. a ``disk`` root another user
    owns) raises :class:`InvalidRequest` at once, with the unit's own
    reason (``unit I refused to start: ...``)."""
    if transport not in ("shm", "tcp", "nixl"):
        raise InvalidRequest(f"transport must be 'shm', 'tcp' or 'nixl', not {transport!r}")
    command = unit_command()
    args = list(unit_args)
    if transport == "nixl":
        # One host: no RDMA between its processes, so UCX may use tcp.
        args += ["--nixl", "--nixl-allow-tcp"]
    if disk is not None:
        args += [
            "--disk",
            str(disk),
            "--disk-capacity",
            str(disk_capacity),
            "--high-watermark",
            str(high_watermark),
            "--low-watermark",
            str(low_watermark),
        ]
    if checkpoint_root is not None:
        args += ["--checkpoint-root", str(checkpoint_root)]
    if insecure and secret is not None:
        raise InvalidRequest("insecure means units without a secret, but one was given")
    if not 1 <= replicas <= units:
        raise InvalidRequest(
            f"replicas={replicas} for {units} units: each copy of a row needs a unit of its own "
            f"(1 to {units})"
        )
    try:
        plane = _native.LocalPlane(
            command,
            units,
            memory,
            args,
            30.0,
            None if insecure else _secret(secret),
            insecure=insecure,
        )
    except Error as e:
        # A unit that refused its settings ("unit I refused to start:
        # REASON", in its own words, as soon as it exited): the settings
        # are what was wrong.
        if _REFUSED.match(str(e)):
            raise InvalidRequest(str(e)) from None
        raise
    secret = plane.secret
    try:
        addrs = plane.uds_addrs if transport == "shm" else plane.tcp_addrs
        client = _native.Client(
            addrs,
            namespace,
            timeout,
            True,
            wait_for_memory,
            secret,
            nixl=transport == "nixl",
            require_rdma=False,
            replicas=replicas,
            hosts=[_native.host_id()] * units,
        )
        # Over tcp, admin requests take the Unix sockets (units accept them
        # there from their own user only).
        admin = None
        if transport != "shm":
            admin = _native.Client(plane.uds_addrs, namespace, timeout, False, None, secret)
    except BaseException:
        plane.stop()
        raise
    return DataPlane(client, plane, admin)
