"""stowage as NeMo-RL's data plane: :class:`StowageDataPlaneClient`, a
``nemo_rl.data_plane.interfaces.DataPlaneClient`` on stowage units.

Needs torch and tensordict (``pip install stowage-rl[nemo-rl]``); NeMo-RL
itself is optional. When ``nemo_rl`` can be imported, the client subclasses
its ``DataPlaneClient`` and returns its ``KVBatchMeta``; without it, the
same shapes come from :class:`KVBatchMeta` here.

Samples are rows (the sample id is the row key), fields are fields, a
partition is a partition. Consumer tasks and their claims live in the
units (``Client.register_tasks``, ``Client.claim``), so any number of
processes claim from one partition and each row goes to a task once. A
sample ``"<uid>_g<i>"`` belongs to group ``<uid>`` (any other id is a
group of its own), and every row of a group is placed on the unit
``Client.unit_of(group)``: every process finds it there without knowing
how the partition was registered, and a claim with a GRPO group size
hands out whole groups. docs/nemo-rl.md maps each method to its stowage
calls and says where the semantics differ from TransferQueue's.

    import stowage
    from stowage.nemo_rl import StowageDataPlaneClient

    dp = StowageDataPlaneClient.from_directory("/shared/stowage-directory.json")
    dp.register_partition("step-0", ["input_ids"], num_samples=8,
                          consumer_tasks=["train"], grpo_group_size=4)
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from tensordict import TensorDict

import stowage

from . import _column, _native, _tq_checkpoint
from ._nemo_rl_codec import (
    TAGS_FIELD,
    columns_of,
    decode_tags,
    encode_tags,
    group_of,
    sequence_lengths_of,
    tensordict_of,
)

__all__ = ["KVBatchMeta", "StowageDataPlaneClient", "group_of"]

try:  # NeMo-RL's own boundary types, when it is installed.
    import nemo_rl.data_plane.interfaces as _nemo  # type: ignore[import-not-found]
except ImportError:
    _nemo = None
_Base: Any = _nemo.DataPlaneClient if _nemo is not None else None
_NemoKVBatchMeta: Any = _nemo.KVBatchMeta if _nemo is not None else None


@dataclass
class _LocalKVBatchMeta:
    """NeMo-RL's ``KVBatchMeta`` shape, for use without NeMo-RL: the ids of
    a batch's samples in a partition, with what a consumer needs to route
    them without reading tensors (fields, sequence lengths, tags)."""

    partition_id: str
    task_name: Optional[str]
    sample_ids: List[str]
    fields: Optional[List[str]] = None
    sequence_lengths: Optional[List[int]] = None
    extra_info: Dict[str, Any] = field(default_factory=dict)
    tags: Optional[List[Dict[str, Any]]] = None

    def __post_init__(self) -> None:
        if self.tags is not None and len(self.tags) != len(self.sample_ids):
            raise ValueError(
                f"KVBatchMeta: {len(self.tags)} tags for {len(self.sample_ids)} sample ids"
            )

    @property
    def size(self) -> int:
        return len(self.sample_ids)

    def stamp_tags(self, scalars: Dict[str, Sequence[Any]]) -> None:
        """Set ``tags[i][name] = values[i]`` for every column of ``scalars``."""
        if self.tags is None:
            self.tags = [{} for _ in self.sample_ids]
        for name, values in scalars.items():
            if len(values) != self.size:
                raise ValueError(f"stamp_tags: {name!r} has {len(values)} values, not {self.size}")
            for tag, v in zip(self.tags, values):
                tag[name] = v

    def _with_rows(self, rows: Sequence[int]) -> "_LocalKVBatchMeta":
        lens = self.sequence_lengths
        return _LocalKVBatchMeta(
            partition_id=self.partition_id,
            task_name=self.task_name,
            sample_ids=[self.sample_ids[i] for i in rows],
            fields=self.fields,
            sequence_lengths=None if lens is None else [lens[i] for i in rows],
            extra_info=dict(self.extra_info or {}),
            tags=None if self.tags is None else [self.tags[i] for i in rows],
        )

    def subset(self, indices: Sequence[int]) -> "_LocalKVBatchMeta":
        return self._with_rows(list(indices))

    def slice(self, start: int, stop: int) -> "_LocalKVBatchMeta":
        return self._with_rows(range(self.size)[start:stop])

    def drop(self, indices: Sequence[int]) -> "Optional[_LocalKVBatchMeta]":
        gone = set(indices)
        kept = [i for i in range(self.size) if i not in gone]
        return self._with_rows(kept) if kept else None

    def concat(self, *others: "_LocalKVBatchMeta") -> "_LocalKVBatchMeta":
        metas = (self, *others)
        if any(m.partition_id != self.partition_id for m in others):
            raise ValueError("KVBatchMeta.concat: the metas are of different partitions")
        lens = (
            [n for m in metas for n in (m.sequence_lengths or [])]
            if all(m.sequence_lengths is not None for m in metas)
            else None
        )
        tags = (
            [t for m in metas for t in (m.tags or [])]
            if all(m.tags is not None for m in metas)
            else None
        )
        return _LocalKVBatchMeta(
            partition_id=self.partition_id,
            task_name=self.task_name,
            sample_ids=[s for m in metas for s in m.sample_ids],
            fields=self.fields,
            sequence_lengths=lens,
            extra_info=dict(self.extra_info or {}),
            tags=tags,
        )

    def with_fields(self, field_names: Sequence[str]) -> "_LocalKVBatchMeta":
        out = self._with_rows(range(self.size))
        out.fields = list(dict.fromkeys([*(self.fields or []), *field_names]))
        if out.tags is not None:
            out.tags = [dict(t) for t in out.tags]
        return out


#: NeMo-RL's ``KVBatchMeta`` when it is installed, else the same shape here.
KVBatchMeta: Any = _NemoKVBatchMeta if _NemoKVBatchMeta is not None else _LocalKVBatchMeta
if _NemoKVBatchMeta is None:
    _LocalKVBatchMeta.__name__ = _LocalKVBatchMeta.__qualname__ = "KVBatchMeta"

_BaseClass: Any = _Base if _Base is not None else object


# -- the client's claim methods ----------------------------------------------
# Every call of Client.register_tasks, claim, claim_status, unit_of and of
# put's groups= keyword is in this block.


def _unit_of(client: Any, group: str) -> int:
    return int(client.unit_of(group))


def _register_tasks(
    client: Any,
    partition: str,
    tasks: List[str],
    samples: int,
    group_size: Optional[int],
    timeout: Optional[float],
) -> None:
    client.register_tasks(partition, tasks, samples, group_size=group_size, timeout=timeout)


def _claim(
    client: Any,
    partition: str,
    task: str,
    fields: List[str],
    count: int,
    block: bool,
    timeout: Optional[float],
) -> List[Union[str, int]]:
    return list(client.claim(partition, task, fields, count, block=block, timeout=timeout))


def _claim_status(
    client: Any, partition: str, task: str, timeout: Optional[float]
) -> Dict[str, int]:
    return dict(client.claim_status(partition, task, timeout=timeout))


def _claims_state(client: Any, unit: int, timeout: Optional[float]) -> bytes:
    return bytes(client.claims_state(unit, timeout))


def _load_claims(client: Any, unit: int, state: bytes, timeout: Optional[float]) -> None:
    client.load_claims(unit, state, timeout)


def _put_rows(
    client: Any,
    partition: str,
    keys: List[str],
    columns: List[Tuple[str, Any]],
    unit: int,
    groups: List[str],
    timeout: Optional[float],
) -> None:
    client.put(partition, keys, columns, unit=unit, timeout=timeout, groups=groups)


# ------------------------------------------------------------------------------

#: The adapter's record in a checkpoint directory: its format and the
#: caller's metadata.
_METADATA = "stowage_nemo_rl.json"
#: The field that names a row's group (``put(..., groups=)`` writes it).
_GROUP_FIELD = "\0g:"


class _Borrowed:
    """What the checkpoint helpers of ``stowage.tq`` use of a
    ``stowage.DataPlane`` (its client, units and checkpoint), over a client
    this adapter does not own: nothing here closes it."""

    def __init__(self, client: Any) -> None:
        self._client = client

    @property
    def units(self) -> List[str]:
        return list(self._client.units)

    def checkpoint(self, dir: str) -> List[Dict[str, Any]]:
        return list(self._client.checkpoint(str(dir), None))


def _native_client(client: Any) -> _native.Client:
    """The extension's Client of a ``stowage.DataPlane`` or a Client itself."""
    if isinstance(client, stowage.DataPlane):
        return client._client
    if isinstance(client, _native.Client):
        return client
    raise TypeError(
        f"expected a stowage.DataPlane or a stowage._native.Client, got {type(client).__name__}"
    )


def _not_found(e: stowage.NotFound, partition: str) -> KeyError:
    missing = ", ".join(f"({k!r}, {f!r})" for k, f in list(e.keys)[:8])
    more = f" and {len(e.keys) - 8} more" if len(e.keys) > 8 else ""
    return KeyError(
        f"not stored in partition {partition!r} (cleared, or not produced yet): "
        f"(sample, field) {missing}{more}"
    )


class StowageDataPlaneClient(_BaseClass):
    """NeMo-RL's ``DataPlaneClient`` on stowage units.

    ``client``: a :class:`stowage.DataPlane` (from :func:`stowage.connect`
    or :func:`stowage.local`) or the extension's ``Client`` it wraps. It
    stays the caller's: :meth:`close` closes it only when ``owns_client``
    (what :meth:`from_directory` sets). ``timeout``: the deadline, in
    seconds, of every call but a blocking claim (None: the client's).
    """

    def __init__(
        self, client: Any, *, owns_client: bool = False, timeout: Optional[float] = None
    ) -> None:
        self._owner = client
        self._client = _native_client(client)
        self._owns = owns_client
        self._timeout = timeout
        # Per partition: the sample ids this client put, in order (the
        # clear_samples(None, ...) form clears them).
        self._produced: Dict[str, Dict[str, None]] = {}
        self._closed = False
        # Whether a data operation (or a load) ran through this client.
        self._used = False

    @classmethod
    def from_directory(
        cls,
        directory: Union[str, "os.PathLike[str]", Dict[str, Any]],
        *,
        namespace: str = "default",
        timeout: float = 30.0,
        transport: str = "auto",
        secret: Optional[Union[bytes, str]] = None,
    ) -> "StowageDataPlaneClient":
        """A client of the units a directory names: the dict a launcher
        returned (:func:`stowage.ray.start_units`,
        :attr:`stowage.DataPlane.directory`), the path of a JSON file
        holding it, or that JSON as a string. The connection is the
        client's own: :meth:`close` closes it."""
        if isinstance(directory, str) and directory.lstrip().startswith("{"):
            directory = json.loads(directory)
        plane = stowage.connect(
            directory, namespace=namespace, timeout=timeout, transport=transport, secret=secret
        )
        return cls(plane, owns_client=True)

    # -- placement -------------------------------------------------------------

    def _by_unit(self, sample_ids: Sequence[str]) -> Dict[int, List[int]]:
        """Positions of ``sample_ids`` by the unit their group lives on."""
        units: Dict[str, int] = {}
        out: Dict[int, List[int]] = {}
        for i, sid in enumerate(sample_ids):
            g = group_of(sid)
            u = units.get(g)
            if u is None:
                u = units[g] = _unit_of(self._client, g)
            out.setdefault(u, []).append(i)
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("StowageDataPlaneClient is closed")

    def _begin(self) -> None:
        """A data operation: the client must be open, and a later
        :meth:`load_checkpoint` is refused."""
        self._check_open()
        self._used = True

    # -- (A) task-mediated -------------------------------------------------------

    def register_partition(
        self,
        partition_id: str,
        fields: List[str],
        num_samples: int,
        consumer_tasks: List[str],
        grpo_group_size: Optional[int] = None,
        enums: Optional[Dict[str, List[str]]] = None,
    ) -> None:
        """Register ``consumer_tasks`` on every unit, expecting
        ``num_samples`` rows, claimed in groups of ``grpo_group_size``.
        Idempotent; ``fields`` and ``enums`` need no declaring in stowage
        (fields come into being when put)."""
        del fields, enums
        self._begin()
        if not consumer_tasks:
            return
        g = int(grpo_group_size) if grpo_group_size is not None else None
        try:
            _register_tasks(
                self._client,
                partition_id,
                [str(t) for t in consumer_tasks],
                int(num_samples),
                g,
                self._timeout,
            )
        except stowage.InvalidRequest as e:
            raise ValueError(f"register_partition({partition_id!r}): {e}") from e

    def claim_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: List[str],
        batch_size: int,
        dp_rank: Optional[int] = None,
        blocking: bool = True,
        timeout_s: float = 60.0,
    ) -> Any:
        """Claim up to ``batch_size`` samples of ``partition_id`` that have
        every field of ``required_fields`` and that ``task_name`` has not
        claimed. Blocking: waits (woken by the units) until at least one
        sample, or one whole group, is claimable, and raises TimeoutError
        after ``timeout_s``; not blocking: an empty meta when there is
        none. An unregistered task raises KeyError. ``dp_rank`` is
        reserved (ignored), as in NeMo-RL."""
        del dp_rank
        self._begin()
        fields = [str(f) for f in required_fields]
        try:
            keys = _claim(
                self._client,
                partition_id,
                task_name,
                fields,
                int(batch_size),
                bool(blocking),
                max(0.0, float(timeout_s)),
            )
        except stowage.Timeout as e:
            raise TimeoutError(
                f"claim_meta(partition={partition_id!r}, task={task_name!r}): nothing claimable "
                f"after {timeout_s} s"
            ) from e
        except stowage.InvalidRequest as e:
            status = _claim_status(self._client, partition_id, task_name, self._timeout)
            if not status.get("registered"):
                raise KeyError(
                    f"task {task_name!r} is not registered on partition {partition_id!r} "
                    "(register_partition(..., consumer_tasks=[...]) names it)"
                ) from e
            raise ValueError(f"claim_meta({partition_id!r}, {task_name!r}): {e}") from e
        if not keys:
            return KVBatchMeta(
                partition_id=partition_id, task_name=task_name, sample_ids=[], fields=fields
            )
        sample_ids = [str(k) for k in keys]
        tags = self._read_tags(partition_id, sample_ids)
        return KVBatchMeta(
            partition_id=partition_id,
            task_name=task_name,
            sample_ids=sample_ids,
            fields=fields,
            sequence_lengths=sequence_lengths_of(tags),
            tags=tags,
        )

    def get_data(self, meta: Any, select_fields: Optional[List[str]] = None) -> TensorDict:
        """``get_samples`` of the meta's samples: ``select_fields``, else
        ``meta.fields``; neither is a ValueError (never every field)."""
        fields = select_fields if select_fields is not None else meta.fields
        if fields is None:
            raise ValueError(
                "get_data needs select_fields or meta.fields: it never reads every field"
            )
        return self.get_samples(list(meta.sample_ids), meta.partition_id, list(fields))

    def check_consumption_status(self, partition_id: str, task_names: List[str]) -> bool:
        """Whether every task has claimed at least the samples registered
        for it (summed over the units; false for an unregistered task)."""
        self._begin()
        for t in task_names:
            s = _claim_status(self._client, partition_id, t, self._timeout)
            if not s.get("registered") or s.get("consumed", 0) < s.get("samples", 0):
                return False
        return True

    # -- (B) direct by key ----------------------------------------------------------

    def put_samples(
        self,
        sample_ids: List[str],
        partition_id: str,
        fields: Optional[TensorDict] = None,
        tags: Optional[List[Dict[str, Any]]] = None,
    ) -> Any:
        """Write ``fields`` (tensor leaves; nested tensors for jagged
        fields) and ``tags`` of ``sample_ids``, each group's rows on its
        unit. Fields already stored are replaced, others kept; tags are
        replaced only when given. Non-tensor leaves and unsupported dtypes
        raise TypeError before anything is stored."""
        self._begin()
        ids = [str(s) for s in sample_ids]
        if not ids:
            return KVBatchMeta(partition_id=partition_id, task_name=None, sample_ids=[])
        if tags is not None and len(tags) != len(ids):
            raise ValueError(f"put_samples: {len(tags)} tags for {len(ids)} sample ids")
        cols = columns_of(fields, len(ids)) if fields is not None else []
        field_names = [name for name, _ in cols] if fields is not None else None
        if tags is not None:
            cols.append((TAGS_FIELD, encode_tags(tags)))
        if cols:
            for unit, rows in self._by_unit(ids).items():
                keys = [ids[i] for i in rows]
                part = [(name, self._rows_of(name, col, rows, len(ids))) for name, col in cols]
                _put_rows(
                    self._client,
                    partition_id,
                    keys,
                    part,
                    unit,
                    [group_of(k) for k in keys],
                    self._timeout,
                )
        produced = self._produced.setdefault(partition_id, {})
        for s in ids:
            produced[s] = None
        meta_tags = [dict(t) for t in tags] if tags is not None else [{} for _ in ids]
        return KVBatchMeta(
            partition_id=partition_id,
            task_name=None,
            sample_ids=ids,
            fields=field_names,
            sequence_lengths=sequence_lengths_of(meta_tags),
            tags=meta_tags,
        )

    @staticmethod
    def _rows_of(name: str, col: Any, rows: List[int], n: int) -> Any:
        """The column ``col`` (dense tensor or list of rows) at positions
        ``rows``, ready for the extension (no copy when it is every row)."""
        if len(rows) == n and rows == list(range(n)):
            return _column(name, col)
        if isinstance(col, list):
            return _column(name, [col[i] for i in rows])
        return _column(name, col[torch.tensor(rows, dtype=torch.long)])

    def get_samples(
        self, sample_ids: List[str], partition_id: str, select_fields: List[str]
    ) -> TensorDict:
        """``select_fields`` of ``sample_ids``, batched in their order: a
        dense tensor where every row has the same shape, a nested tensor
        (jagged layout) where rows differ. A (sample, field) that was
        cleared or never put raises KeyError. Claims nothing."""
        self._begin()
        ids = [str(s) for s in sample_ids]
        fields = [str(f) for f in select_fields]
        if not ids:
            return TensorDict({}, batch_size=(0,))
        per_field: List[List[Any]] = [[None] * len(ids) for _ in fields]
        try:
            for unit, rows in self._by_unit(ids).items():
                got = self._client.get(
                    partition_id, [ids[i] for i in rows], fields, unit, self._timeout, True
                )
                for dst, arrays in zip(per_field, got):
                    for i, a in zip(rows, arrays):
                        dst[i] = a
        except stowage.NotFound as e:
            raise _not_found(e, partition_id) from e
        return tensordict_of(fields, per_field, len(ids))

    def list_sample_ids(self, partition_id: str) -> List[str]:
        """The ids of the samples stored in ``partition_id`` now, sorted
        (metadata only: no tensor is read, nothing is claimed; an unknown
        partition has none)."""
        self._begin()
        return sorted(str(k) for k in self._client.list(partition_id, self._timeout))

    def clear_samples(self, sample_ids: Optional[List[str]], partition_id: str) -> None:
        """Clear whole rows. ``None``: the samples this client put in
        ``partition_id`` and has not cleared (warns when there are none:
        pass the ids)."""
        self._begin()
        produced = self._produced.get(partition_id, {})
        if sample_ids is None:
            ids = list(produced)
            if not ids:
                warnings.warn(
                    f"clear_samples(None, {partition_id!r}): this client put no samples in "
                    "that partition (or cleared them), so nothing was cleared; pass the sample ids "
                    "(KVBatchMeta.sample_ids) to clear what others put",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return
        else:
            ids = [str(s) for s in sample_ids]
        for unit, rows in self._by_unit(ids).items():
            self._client.clear(partition_id, [ids[i] for i in rows], unit, self._timeout)
        for s in ids:
            produced.pop(s, None)
        if not produced:
            self._produced.pop(partition_id, None)

    # -- checkpoints (NeMo-RL's later interface) ------------------------------------

    def save_checkpoint(
        self, checkpoint_dir: Any, *, metadata: Optional[Dict[str, Any]] = None
    ) -> None:
        """Save the units' data plane to ``checkpoint_dir``: every unit writes
        its rows (tensors and tags) and its claims state (each registered
        partition's tasks, group size, samples, the order its rows are
        claimed in, and what each task consumed) under its own checkpoint
        root, as ``DataPlane.checkpoint`` does; ``checkpoint_dir`` gets a
        record of where the parts are and ``metadata`` (JSON, returned by
        :meth:`load_checkpoint`). Samples leased by a claim in flight are
        saved as not consumed: after a load they are claimable again.
        Callers keep clears and other saves away until it returns. With
        copies (``replicas`` over 1) each row is saved once, by the unit
        that is its source (a unit down at the save writes no part: its
        rows are in their copies' parts; docs/replication.md#checkpoints)."""
        self._check_open()
        meta = {} if metadata is None else metadata
        if not isinstance(meta, dict):
            raise TypeError(f"save_checkpoint: metadata is a {type(meta).__name__}, not a dict")
        body = json.dumps({"format": 1, "user_metadata": meta})
        root = os.path.abspath(os.fspath(checkpoint_dir))
        owner = self._owner if isinstance(self._owner, stowage.DataPlane) else None
        _tq_checkpoint._save_checkpoint(
            owner if owner is not None else _Borrowed(self._client),  # type: ignore[arg-type]
            self._client.namespace,
            root,
        )
        tmp = os.path.join(root, _METADATA + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, _METADATA))

    def load_checkpoint(self, checkpoint_dir: Any) -> Dict[str, Any]:
        """Restore a checkpoint :meth:`save_checkpoint` wrote into the units
        this client uses, before any data operation through it (refused
        after one: RuntimeError). Each part is served by a unit restored
        from it (on this host, or by a live unit on the part's host, as
        ``stowage.tq`` loads do); its partitions are cleared in the live
        units, its rows put back on the unit of the same index, and its
        claims state loaded there (``Client.load_claims``): registrations,
        row order and each task's consumption as saved. The live plane must
        have as many units as the saved one (ValueError). Returns the
        ``metadata`` given to :meth:`save_checkpoint`. Not transactional: a
        failed load leaves this client refusing another. With copies every
        row is put back with its copies (a part's rows on the unit of its
        index, as the save's sources held them), and every unit gets the
        claims state of all the parts together: the consumption of every
        row it may come to claim, so that a unit's death after the load
        neither serves a consumed sample again nor loses a count
        (docs/replication.md#checkpoints)."""
        self._check_open()
        if self._used:
            raise RuntimeError(
                "load_checkpoint needs a client before any data operation (register, claim, "
                "put, get, list, clear, consumption status) or another load"
            )
        root = os.path.realpath(os.fspath(checkpoint_dir))
        with open(os.path.join(root, _METADATA), encoding="utf-8") as f:
            saved = json.load(f)
        user = saved.get("user_metadata", {}) if isinstance(saved, dict) else None
        if not isinstance(user, dict) or saved.get("format") != 1:
            raise ValueError(f"{os.path.join(root, _METADATA)} is not a checkpoint's metadata")
        record = _tq_checkpoint._checkpoint_record(root)
        entries = record["units"]
        units = len(self._client.units)
        if len(entries) != units:
            raise ValueError(
                f"the checkpoint {root} has {len(entries)} parts and this data plane "
                f"{units} units: a load needs as many units as the save had"
            )
        self._used = True
        ns = record.get("namespace") or self._client.namespace
        plane = _Borrowed(self._client)
        parts: List[Any] = []
        # With copies, a unit down at the save wrote no part (its rows are
        # in its copies' parts).
        present = [i for i, entry in enumerate(entries) if entry.get("down") is not True]
        try:
            for i in present:
                entry = entries[i]
                path = _tq_checkpoint._checkpoint_here(root, entry)
                if path is not None:
                    local = stowage.local(
                        units=1,
                        memory=_tq_checkpoint._checkpoint_unit(path, entry),
                        namespace=ns,
                        timeout=self._timeout or 30.0,
                        unit_args=["--restore", path],
                    )
                    parts.append(_tq_checkpoint._Part(local))
                else:
                    parts.append(_tq_checkpoint._open_elsewhere(plane, root, i, entry, ns))  # type: ignore[arg-type]
            names = sorted({p for part in parts for p in part.source.partitions()})
            for p in names:
                self._client.clear_partition(p, self._timeout)
            for unit, part in zip(present, parts):
                self._copy_part(part.source._client, unit)
            states = [_claims_state(part.source._client, 0, self._timeout) for part in parts]
            if self._client.replicas > 1:
                merged = _native.merge_claims_states(states)
                for unit in range(units):
                    _load_claims(self._client, unit, merged, self._timeout)
            else:
                for unit, state in zip(present, states):
                    _load_claims(self._client, unit, state, self._timeout)
        finally:
            for part in parts:
                part.close(plane)
        return dict(user)

    def _copy_part(self, src: Any, unit: int) -> None:
        """Every row of the restored part ``src`` put on unit ``unit``, each
        with its group."""
        for p in src.partitions(self._timeout):
            by_field: Dict[str, List[Any]] = {}
            for key, fields in src.list(p, self._timeout).items():
                for f in fields:
                    # A group's field comes back with the put's groups.
                    if not f.startswith(_GROUP_FIELD):
                        by_field.setdefault(f, []).append(key)
            for f, keys in by_field.items():
                for s in range(0, len(keys), 4096):
                    chunk = keys[s : s + 4096]
                    vals = src.get(p, chunk, [f], None, self._timeout, True)[0]
                    vals = [
                        ("bfloat16", v.view(np.int16)) if v.dtype.kind == "V" else v for v in vals
                    ]
                    ids = [str(k) for k in chunk]
                    _put_rows(
                        self._client,
                        p,
                        chunk,
                        [(f, vals)],
                        unit,
                        [group_of(k) for k in ids],
                        self._timeout,
                    )

    # -- (C) lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Forget this client's put registry, and close the connection when
        this client owns it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._produced.clear()
        if self._owns:
            self._owner.close()

    # -- helpers --------------------------------------------------------------------

    def _read_tags(self, partition_id: str, ids: List[str]) -> List[Dict[str, Any]]:
        """The tags of ``ids`` ({} for a sample put without tags)."""
        tags: List[Dict[str, Any]] = [{} for _ in ids]
        for unit, rows in self._by_unit(ids).items():
            keys = [ids[i] for i in rows]
            try:
                (values,) = self._client.get(
                    partition_id, keys, [TAGS_FIELD], unit, self._timeout, False
                )
            except stowage.NotFound as e:
                # Some rows have no tags: read those that have.
                missing = {str(k) for k, _ in e.keys}
                have = [i for i in rows if ids[i] not in missing]
                if not have:
                    continue
                (values,) = self._client.get(
                    partition_id, [ids[i] for i in have], [TAGS_FIELD], unit, self._timeout, False
                )
                rows = have
            for i, v in zip(rows, values):
                tags[i] = decode_tags(v)
        return tags
