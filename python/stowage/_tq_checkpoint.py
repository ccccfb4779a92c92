"""Checkpoints of the TransferQueue backend (:mod:`stowage.tq`): where
they may be written (:func:`default_checkpoint_root`), the save through
the units' own checkpoints, and the load that checks a checkpoint's record
and every pickled cell before it replaces the live rows."""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
import tempfile
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

import stowage

from . import _tq_cells
from ._tq_config import BACKEND

logger = logging.getLogger("stowage.tq")

_CHECKPOINT_SUBDIR = "stowage"
_CHECKPOINT_INFO = "stowage_checkpoint.json"


class CheckpointRefused(stowage.Error, RuntimeError):
    """A checkpoint that ``tq.load_checkpoint`` refused before changing
    anything: its ``stowage_checkpoint.json`` names a path outside the
    checkpoint or sizes it wrongly, or a pickled cell in it does not carry
    a right tag (changed, or saved under another secret: see
    ``checkpoint_secret_file``). A :class:`stowage.Error` (and, as before,
    a ``RuntimeError``)."""


CheckpointRefused.__module__ = "stowage.tq"


#: The name of the default checkpoint root, in the temporary directory.
_DEFAULT_ROOT_NAME = "stowage-tq-checkpoints-{uid}"


def default_checkpoint_root() -> str:
    """The units' checkpoint root when ``checkpoint_root`` is not given:
    ``<tmp>/stowage-tq-checkpoints-<uid>``, where ``<tmp>`` is this
    process's temporary directory (``$TMPDIR``, else ``/tmp``), created
    owner-only (0700) if missing. ``tq.save_checkpoint(dir)`` is then
    refused for a ``dir`` outside it: give ``checkpoint_root`` (a directory
    only you can write, on every unit's host) to save elsewhere.

    Refused (:class:`stowage.InvalidRequest`) if that path exists and is
    not a directory of this user that only this user can use (e.g. another
    user created it first, or it is a symbolic link);
    :func:`initialize_stowage_storage` then falls back to a fresh private
    directory (:func:`_fallback_checkpoint_root`) instead of failing."""
    uid = os.getuid()
    path = os.path.join(tempfile.gettempdir(), _DEFAULT_ROOT_NAME.format(uid=uid))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        what = (
            "a symbolic link"
            if stat.S_ISLNK(st.st_mode)
            else "not a directory"
            if not stat.S_ISDIR(st.st_mode)
            else f"owned by uid {st.st_uid}"
            if st.st_uid != uid
            else f"open to other users (mode {stat.S_IMODE(st.st_mode):03o})"
        )
        raise stowage.InvalidRequest(
            f"the default checkpoint root {path} is {what}, so it is not private to this user; "
            f"remove it, or set backend.{BACKEND}.checkpoint_root to a directory that only you "
            f"can write"
        )
    return path


def _fallback_checkpoint_root() -> str:
    """The checkpoint root of a bootstrap that gave none: the default root
    (:func:`default_checkpoint_root`), or, when that is refused (another
    local user made it first, or it is a link), a fresh private (0700)
    directory ``<tmp>/stowage-tq-checkpoints-<uid>-XXXXXXXX`` of this job,
    with a warning naming the refused path: a name another user can take
    must not keep a job from starting. Nothing is written into the refused
    path. (A ``checkpoint_root`` the user configured is never replaced: an
    unsafe one is an error.)"""
    try:
        return default_checkpoint_root()
    except stowage.InvalidRequest as e:
        path = tempfile.mkdtemp(prefix=_DEFAULT_ROOT_NAME.format(uid=os.getuid()) + "-")
        logger.warning(
            "%s; checkpoints of this job go to the fresh private directory %s instead "
            "(set backend.%s.checkpoint_root to choose one)",
            e,
            path,
            BACKEND,
        )
        return path


def _save_checkpoint(plane: stowage.DataPlane, namespace: str, checkpoint_dir: str) -> None:
    """Every unit writes its data and index to
    ``<checkpoint_dir>/stowage/<id>/unit-<i>`` on its own host, under its
    own checkpoint root, through its control path (no payload through this
    process; a fresh ``id`` per save, so that a part left on another host
    under an earlier save's name is never in the way). A small JSON file
    in ``checkpoint_dir`` on this host records, with relative paths only,
    what load needs: per part its unit, that unit's address and host name,
    and where the part lies under that unit's checkpoint root
    (TransferQueue renames ``checkpoint_dir`` after this, on this host
    only)."""
    root = os.path.abspath(checkpoint_dir)
    cid = secrets.token_hex(8)
    parts = f"{_CHECKPOINT_SUBDIR}/{cid}"
    infos = plane.checkpoint(os.path.join(root, parts))
    # This host may hold no part (units elsewhere, no shared filesystem).
    os.makedirs(root, mode=0o700, exist_ok=True)
    addresses = plane.units
    record = {
        "format": 2,
        "namespace": namespace,
        "id": cid,
        "units": [
            {
                "dir": f"{parts}/unit-{i}",
                "address": addresses[i],
                **{k: v for k, v in info.items() if k != "dir"},
                # With copies, a unit down at the save writes no part:
                # its rows are in their copies' parts.
                **({"down": True} if _down_at_save(info) else {}),
            }
            for i, info in enumerate(infos)
        ],
    }
    with open(os.path.join(root, _CHECKPOINT_INFO), "w", encoding="utf-8") as f:
        json.dump(record, f, default=str)


class _RestoredCells:
    """What a restore does with the pickled cells of a checkpoint: each is
    checked before it is put back, and re-tagged for this plane when it was
    saved under another secret (``checkpoint_secret_file``) or namespace."""

    def __init__(
        self, key: Optional[bytes], namespace: str, old_key: Optional[bytes], insecure: bool
    ):
        self.key = key
        self.namespace = namespace
        self.old_key = old_key
        self.insecure = insecure
        #: The namespace the checkpoint's rows were saved in (its record).
        self.saved_namespace = namespace

    def values(self, partition: str, keys: List[Any], field: str, vals: List[Any]) -> List[Any]:
        """``vals`` (of rows ``keys``) to put back: pickled cells checked,
        re-tagged where needed; :class:`CheckpointRefused` for one that
        is not authentic. Never unpickles anything.

        A cell is recognized by its head (the checkpoint does not carry
        TransferQueue's per-cell metadata, which marks what is pickled), so
        a uint8 tensor whose first 8 bytes are a cell head is taken for one
        and refused unless its tag is right."""
        out = list(vals)
        for j, v in enumerate(vals):
            if _tq_cells.is_cell(v):
                raw = v.tobytes()
                new = self._cell(raw, partition, keys[j], field)
                if new is not raw:
                    out[j] = np.frombuffer(new, dtype=np.uint8)
        return out

    def _cell(self, raw: bytes, partition: str, row: Any, field: str) -> bytes:
        if self.key is None:
            # No secret here: no tag can be checked or made; such a plane
            # unpickles only with insecure_pickles, and then checks nothing.
            return raw
        where = f"row {row!r} field {field!r} of partition {partition!r}"
        if raw.startswith(_tq_cells.MAGIC_INSECURE):
            raise CheckpointRefused(
                f"stowage.tq: the checkpoint's {where} is a pickled cell without a tag (saved "
                f"without a secret, with insecure_pickles, or by an older stowage), and this plane "
                f"authenticates every pickled cell; nothing was loaded. Load it into a plane "
                f"without a secret and with backend.{BACKEND}.insecure_pickles: true if you trust it"
            )
        for k in (self.key, self.old_key):
            if k is None:
                continue
            if k == self.key and self.saved_namespace == self.namespace:
                if _tq_cells.verified(raw, k, self.namespace, partition, row, field) is not None:
                    return raw
                continue
            new = _tq_cells.retag(
                raw, k, self.saved_namespace, self.key, self.namespace, partition, row, field
            )
            if new is not None:
                return new
        raise CheckpointRefused(
            f"stowage.tq: the checkpoint's {where} is a pickled cell whose tag is wrong: it was "
            f"changed or moved, or the checkpoint was saved under another secret (then give that "
            f"secret as backend.{BACKEND}.checkpoint_secret_file); nothing was loaded"
        )


def _checkpoint_record(root: str) -> Dict[str, Any]:
    """``stowage_checkpoint.json`` of the checkpoint at ``root``, its shape
    checked."""
    path = os.path.join(root, _CHECKPOINT_INFO)
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    units = record.get("units") if isinstance(record, dict) else None
    ns = record.get("namespace") if isinstance(record, dict) else None
    if (
        not isinstance(units, list)
        or not units
        or not all(isinstance(u, dict) for u in units)
        or not (ns is None or isinstance(ns, str))
        or record.get("format") not in (1, 2)
    ):
        raise CheckpointRefused(
            f"stowage.tq: {path} is not a stowage checkpoint record (format 1 or 2, a namespace "
            f"and a non-empty list of units)"
        )
    return record


def _relative(path: Any) -> bool:
    """Whether ``path`` is a relative path of plain names (no absolute
    path, no ``..`` or ``.``, no NUL)."""
    parts = path.split("/") if isinstance(path, str) else []
    return (
        isinstance(path, str)
        and not os.path.isabs(path)
        and "\0" not in path
        and not any(p in ("", ".", "..") for p in parts)
    )


def _checkpoint_here(root: str, entry: Mapping[str, Any]) -> Optional[str]:
    """The directory of one checkpointed unit on this host, or None when
    this host does not have it (then a unit restores it on its own host).

    The record may name only a relative path of plain names inside the
    checkpoint (no absolute path, no ``..`` or ``.``, no symbolic link on
    the way, a directory at the end)."""
    d = entry.get("dir")
    if not isinstance(d, str) or not _relative(d):
        raise CheckpointRefused(
            f"stowage.tq: the checkpoint record names the unit directory {d!r}, which is not a "
            f"relative path inside the checkpoint {root} (absolute paths and '..' are refused)"
        )
    path = root
    for p in d.split("/"):
        path = os.path.join(path, p)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise CheckpointRefused(
                f"stowage.tq: {path}, on the way to a unit directory of the checkpoint, is {what}"
            )
    return path


def _check_claim(entry: Mapping[str, Any], on_disk: int) -> None:
    """Refuse a record that says a unit's part holds more bytes than its
    files do (the memory of the unit that restores it comes from the
    files, never from the record)."""
    claimed = entry.get("bytes", 0)
    if claimed is None:
        claimed = 0
    if (
        isinstance(claimed, bool)
        or not isinstance(claimed, int)
        or claimed < 0
        or claimed > on_disk
    ):
        raise CheckpointRefused(
            f"stowage.tq: the checkpoint record says unit directory {entry.get('dir')!r} holds "
            f"{claimed!r} bytes, and its files hold {on_disk}: the record is damaged or was changed"
        )


def _checkpoint_unit(path: str, entry: Mapping[str, Any]) -> int:
    """The memory of the temporary unit that restores the part at ``path``
    on this host: sized from the bytes of its files as found on disk, not
    from the record (a record that claims more bytes than its files hold
    is refused)."""
    on_disk = 0
    with os.scandir(path) as it:
        for e in it:
            if e.is_file(follow_symlinks=False):
                on_disk += e.stat(follow_symlinks=False).st_size
    _check_claim(entry, on_disk)
    return max(64 << 20, on_disk + on_disk // 4 + (32 << 20))


class _Part:
    """One checkpointed unit's rows, served for a load: by a temporary
    unit of this process (the part is on this host), or by a restore unit
    that a live unit started on its own host (``unit``, ``restore_id``)."""

    def __init__(self, source: stowage.DataPlane, unit: Optional[int] = None, restore_id: int = 0):
        self.source = source
        self.unit = unit
        self.restore_id = restore_id

    def close(self, plane: stowage.DataPlane) -> None:
        self.source.close()
        if self.unit is not None:
            try:
                plane._client.close_restore(self.unit, self.restore_id)
            except Exception as e:  # noqa: BLE001 - it also stops by itself when idle
                logger.warning("could not close the restore unit of unit %d: %r", self.unit, e)


def _where(entry: Mapping[str, Any], index: int) -> str:
    """Where a part was written, as the record says it."""
    return (
        f"part {index} (written by unit {index}"
        f"{' at ' + str(entry['address']) if entry.get('address') else ''}"
        f"{' on host ' + repr(entry['host']) if entry.get('host') else ''}"
        f"{', as ' + repr(entry['stored']) + ' under its checkpoint root' if entry.get('stored') else ''})"
    )


def _open_elsewhere(
    plane: stowage.DataPlane, root: str, index: int, entry: Mapping[str, Any], ns: str
) -> _Part:
    """A restore unit serving part ``index``, started by the live unit on
    whose host it lies: the part's own unit first, then every other,
    each asked for the part inside the checkpoint (where a shared
    filesystem or a moved checkpoint has it) and then where its unit wrote
    it (TransferQueue renames the checkpoint directory on this host only).
    Refused (:class:`CheckpointRefused`) when no unit has it, naming every
    unit asked, its host and what it found missing."""
    stored = entry.get("stored")
    if stored is not None and stored != "" and not _relative(stored):
        raise CheckpointRefused(
            f"stowage.tq: the checkpoint record places {_where(entry, index)} at {stored!r} under "
            f"its unit's checkpoint root, which is not a relative path there (absolute paths and "
            f"'..' are refused)"
        )
    candidates = [os.path.join(root, entry["dir"])]
    if stored:
        candidates.append(stored)
    addresses = plane.units
    order = ([index] if index < len(addresses) else []) + [
        j for j in range(len(addresses)) if j != index
    ]
    tried: List[str] = []
    for j in order:
        for dir in candidates:
            try:
                got = plane._client.open_restore(j, dir, ns)
            except stowage.Error as e:
                msg = str(e)
                if "outside this unit's checkpoint root" in msg or "takes no checkpoints" in msg:
                    tried.append(f"unit {j} ({addresses[j]}): {msg}")
                    continue
                if isinstance(e, (stowage.Unreachable, stowage.Timeout)):
                    tried.append(f"unit {j} ({addresses[j]}) did not answer: {msg}")
                    break
                raise CheckpointRefused(
                    f"stowage.tq: unit {j} ({addresses[j]}) refused {_where(entry, index)} at "
                    f"{dir!r}: {msg}; nothing was loaded"
                ) from e
            if "missing" in got:
                tried.append(f"unit {j} ({addresses[j]}, host {got['host']!r}): {got['missing']}")
                continue
            part = _Part(stowage.DataPlane(got["client"]), j, got["id"])
            try:
                info = got["info"]
                want = entry.get("manifest_xxh3")
                if want is not None and want != info["manifest_xxh3"]:
                    raise CheckpointRefused(
                        f"stowage.tq: unit {j} ({addresses[j]}, host {got['host']!r}) has at "
                        f"{got['path']} a checkpoint that is not {_where(entry, index)}: its "
                        f"manifest differs from the record's; nothing was loaded"
                    )
                _check_claim(entry, sum(int(f[1]) for f in info["files"]))
            except BaseException:
                part.close(plane)
                raise
            return part
    raise CheckpointRefused(
        f"stowage.tq: {_where(entry, index)} of the checkpoint {root} is missing: "
        f"{'; '.join(tried)}; nothing was loaded"
    )


def _down_at_save(info: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's info is that of a unit that was down (with
    copies: no part, no host, nothing written; docs/replication.md)."""
    return not info.get("host") and not info.get("files") and not info.get("rows")


def _load_checkpoint(
    plane: stowage.DataPlane, cells: _RestoredCells, checkpoint_dir: str, timeout: float
) -> None:
    """Replace the running units' rows of this namespace with the
    checkpoint's, under the same partitions and global indexes.

    The record is checked first (only relative paths: inside the
    checkpoint, and under the units' checkpoint roots). Each part is then
    served again, read-only in effect: a part this host has
    (:func:`_checkpoint_here`: the caller's own host, or a shared
    filesystem) by a temporary unit of this process restored from its
    directory (what ``stowage unit --restore`` does), sized from its files;
    any other by a restore unit that a live unit on the part's host starts
    there (:func:`_open_elsewhere`), found through the part's own unit
    first; a missing part is refused naming every unit asked and its host.
    A damaged part is refused where it is restored. Every pickled cell is
    then checked (:class:`_RestoredCells`, nothing is unpickled); only once
    all of that passed are the live rows cleared and the checkpoint's rows
    put back through the running units (the cells checked again, re-tagged
    for this plane where needed). The restoring units stop at the end."""
    root = os.path.realpath(checkpoint_dir)
    record = _checkpoint_record(root)
    ns = record.get("namespace") or cells.namespace
    cells.saved_namespace = ns
    # A unit down at the save (with copies) has no part to read back.
    entries = [(i, u) for i, u in enumerate(record["units"]) if u.get("down") is not True]
    here = [_checkpoint_here(root, u) for _, u in entries]
    parts: List[_Part] = []
    try:
        for (i, entry), path in zip(entries, here):
            if path is not None:
                memory = _checkpoint_unit(path, entry)
                local = stowage.local(
                    units=1,
                    memory=memory,
                    namespace=ns,
                    timeout=timeout,
                    unit_args=["--restore", path],
                )
                parts.append(_Part(local))
            else:
                parts.append(_open_elsewhere(plane, root, i, entry, ns))
        sources = [p.source for p in parts]
        # Every cell checked before anything changes (values read in place).
        for src, p, f, chunk in _checkpoint_chunks(sources):
            vals = None
            if src._client.shm:
                try:
                    vals = src._client.get_view(p, chunk, [f], None, None, True)[0]
                except stowage.TransferFailed:
                    vals = None
            if vals is None:
                vals = src._client.get(p, chunk, [f], None, None, True)[0]
            cells.values(p, chunk, f, vals)
            del vals
        for p in plane.partitions():
            plane.clear_partition(p)
        for src, p, f, chunk in _checkpoint_chunks(sources):
            vals = src._client.get(p, chunk, [f], None, None, True)[0]
            vals = cells.values(p, chunk, f, vals)
            vals = [("bfloat16", v.view(np.int16)) if v.dtype.kind == "V" else v for v in vals]
            plane._client.put(p, chunk, [(f, vals)], None, None)
    finally:
        for part in parts:
            part.close(plane)


def _checkpoint_chunks(sources: List[stowage.DataPlane]) -> Any:
    """(source, partition, field, keys) of every stored cell of the
    restoring units, 4096 rows at a time."""
    for src in sources:
        for p in src.partitions():
            by_field: Dict[str, List[Any]] = {}
            for key, fields in src.list(p).items():
                for f in fields:
                    by_field.setdefault(f, []).append(key)
            for f, keys in by_field.items():
                for s in range(0, len(keys), 4096):
                    yield src, p, f, keys[s : s + 4096]
