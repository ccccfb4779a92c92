"""The TransferQueue backend's pickled cells, authenticated (no TransferQueue
import here, so that these functions are tested without it).

A non-tensor value of a TransferQueue field is stored by :mod:`stowage.tq`
as one pickle (protocol 5) per cell, in a uint8 value. Whoever can write a
unit's rows could otherwise make the job's readers unpickle bytes of their
choosing, i.e. run code as the job's user. So each cell carries a tag::

    b"STWPKH1\\0" | tag (32 bytes) | pickle
    tag = HMAC-SHA-256(cell key, "stowage tq cell v1" | namespace | partition
                       | row | field | pickle)

(each string length-prefixed, so no two places share a message). The cell
key is derived from the plane's shared secret by the native client
(``HMAC-SHA-256(secret, b"stowage tq cell key v1")``, never the secret
itself; see :func:`cell_key_of`). A reader checks the tag in constant time
on its own copy of the bytes, and unpickles that same copy only if the tag
is right: a cell written by anyone without the key, a cell changed in any
byte, or a good cell copied to another row, field, partition or namespace
is refused with :class:`UntrustedCell` and never unpickled.

A plane without a secret has no key: then pickled cells are refused, both
ways, unless the backend config says ``insecure_pickles: true``; they are
then stored unauthenticated (``b"STWPKL5\\0" | pickle``, the format of
stowage before cell tags) and anyone who can write the units' rows can run
code in the job's readers.

What a tag does not prevent: a cell written again with an older value of
the same cell (a replay of what this job wrote there). That substitutes
data, as a write of a tensor cell does, but runs no code that the job did
not itself pickle.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import struct
import threading
from collections import OrderedDict
from typing import Any, Optional, Tuple, Union

import numpy as np

from ._native import Error

#: The head of an authenticated pickled cell.
MAGIC = b"STWPKH1\x00"
#: The head of an unauthenticated pickled cell (``insecure_pickles``).
MAGIC_INSECURE = b"STWPKL5\x00"
#: Bytes of a tag.
TAG_LEN = 32
#: What HMAC-SHA-256 under the secret derives the cell key from.
CELL_KEY_LABEL = b"stowage tq cell key v1"
_CONTEXT = b"stowage tq cell v1"

#: The backend option that allows unauthenticated pickled cells.
INSECURE_OPTION = "backend.Stowage.insecure_pickles"

Row = Union[int, str]


class UntrustedCell(Error, RuntimeError):
    """A pickled cell that was refused (and not unpickled): its tag is
    missing or wrong, it was written for another place, or the plane has no
    secret to check it with. A :class:`stowage.Error` (and, as before, a
    ``RuntimeError``)."""


def cell_key_of(secret: Union[bytes, str]) -> bytes:
    """The cell key of a plane with shared secret ``secret``: what the
    native client's ``cell_key()`` returns. Used for a checkpoint made under
    another secret (``checkpoint_secret_file``)."""
    if isinstance(secret, str):
        secret = secret.encode()
    return hmac.new(secret, CELL_KEY_LABEL, hashlib.sha256).digest()


def _part(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _row(row: Row) -> bytes:
    # TransferQueue rows are global indexes (ints); stowage keys may be strs.
    if isinstance(row, (int, np.integer)) and not isinstance(row, bool):
        return b"i" + str(int(row)).encode()
    if isinstance(row, str):
        return b"s" + row.encode()
    raise TypeError(f"a row key is an int or a str, not {type(row).__name__}")


# HMAC states after the key, the context and a namespace, copied per cell
# (a copy costs less than keying a new HMAC); a few, bounded.
_BASES: "OrderedDict[Tuple[bytes, str], Any]" = OrderedDict()
_BASES_LOCK = threading.Lock()


def _base(key: bytes, namespace: str) -> Any:
    with _BASES_LOCK:
        m = _BASES.get((key, namespace))
        if m is None:
            m = hmac.new(key, _CONTEXT, hashlib.sha256)
            m.update(_part(namespace.encode()))
            _BASES[(key, namespace)] = m
            if len(_BASES) > 16:
                _BASES.popitem(last=False)
        return m.copy()


def tag(key: bytes, namespace: str, partition: str, row: Row, field: str, payload: Any) -> bytes:
    """The tag of ``payload`` (a pickle) stored in this place."""
    m = _base(key, namespace)
    m.update(_part(partition.encode()) + _part(_row(row)) + _part(field.encode()))
    m.update(payload)
    return m.digest()


def _where(partition: str, row: Row, field: str) -> str:
    return f"row {row!r} field {field!r} of partition {partition!r}"


def no_key_error(where: str) -> UntrustedCell:
    return UntrustedCell(
        f"stowage.tq: {where} is a non-tensor value (a pickle), and this plane has no shared "
        f"secret to authenticate it with, so it is neither stored nor unpickled. Give the units "
        f"a secret (backend.Stowage.secret_file, or STOWAGE_SECRET), or set "
        f"{INSECURE_OPTION}: true to store and unpickle such values unauthenticated (then "
        f"anyone who can write the units' rows can run code in this job's readers)"
    )


def seal(
    key: Optional[bytes],
    namespace: str,
    partition: str,
    row: Row,
    field: str,
    value: Any,
    insecure: bool = False,
) -> np.ndarray:
    """The stored cell (a uint8 array) of ``value`` at this place: tagged
    under ``key``; without a key, unauthenticated if ``insecure``, else
    :class:`UntrustedCell`."""
    if key is None:
        if not insecure:
            raise no_key_error(_where(partition, row, field))
        return np.frombuffer(MAGIC_INSECURE + pickle.dumps(value, protocol=5), dtype=np.uint8)
    payload = pickle.dumps(value, protocol=5)
    t = tag(key, namespace, partition, row, field, payload)
    return np.frombuffer(MAGIC + t + payload, dtype=np.uint8)


def is_cell(arr: Any) -> bool:
    """Whether a stored value has the head of a pickled cell (of either
    format). A tensor of uint8 may start so too: the controller's
    per-cell metadata, not this, says what is pickled."""
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 1:
        return False
    head = arr[: len(MAGIC)].tobytes()
    return head in (MAGIC, MAGIC_INSECURE)


def verified(
    raw: bytes, key: bytes, namespace: str, partition: str, row: Row, field: str
) -> Optional[memoryview]:
    """The pickle of authenticated cell ``raw`` (a view of its bytes) if
    its tag is right for this place under ``key`` (constant-time compare),
    else None."""
    if len(raw) < len(MAGIC) + TAG_LEN or not raw.startswith(MAGIC):
        return None
    got = raw[len(MAGIC) : len(MAGIC) + TAG_LEN]
    payload = memoryview(raw)[len(MAGIC) + TAG_LEN :]
    want = tag(key, namespace, partition, row, field, payload)
    return payload if hmac.compare_digest(got, want) else None


def open_cell(
    key: Optional[bytes],
    namespace: str,
    partition: str,
    row: Row,
    field: str,
    arr: Any,
    insecure: bool = False,
) -> Any:
    """The value of the stored cell ``arr`` at this place, unpickled only
    after its tag was checked; :class:`UntrustedCell` (and no unpickling)
    if it is not authentic.

    The bytes are copied out of ``arr`` first (it may be a view of a unit's
    shared memory that another process can write), and the tag is checked
    on that copy, which is what is unpickled."""
    where = _where(partition, row, field)
    raw = arr.tobytes() if isinstance(arr, np.ndarray) else bytes(arr)
    if key is None:
        if not insecure:
            raise no_key_error(where)
        if raw.startswith(MAGIC_INSECURE):
            return pickle.loads(raw[len(MAGIC_INSECURE) :])
        if raw.startswith(MAGIC):
            raise UntrustedCell(
                f"stowage.tq: {where} was written by a client with the plane's shared secret, "
                f"and this client has none to check it with: give it the secret "
                f"(backend.Stowage.secret_file, or STOWAGE_SECRET)"
            )
        raise UntrustedCell(
            f"stowage.tq: {where} is marked pickled but was not written by stowage.tq"
        )
    payload = verified(raw, key, namespace, partition, row, field)
    if payload is None:
        if raw.startswith(MAGIC_INSECURE):
            why = (
                "it carries no tag (written without a secret, e.g. with "
                f"{INSECURE_OPTION}, or by someone else)"
            )
        elif raw.startswith(MAGIC):
            why = (
                "its tag is wrong: it was changed, copied from another row, field or partition, "
                "or written under another secret"
            )
        else:
            why = "it was not written by stowage.tq"
        raise UntrustedCell(
            f"stowage.tq: refusing to unpickle {where}: {why}. Nothing was unpickled; whoever "
            f"can write the units' rows may be tampering with them"
        )
    return pickle.loads(payload)


def retag(
    raw: bytes,
    old_key: bytes,
    old_namespace: str,
    key: bytes,
    namespace: str,
    partition: str,
    row: Row,
    field: str,
) -> Optional[bytes]:
    """``raw`` tagged for this place under ``key`` and ``namespace`` if its
    tag is right under ``old_key`` and ``old_namespace``, else None."""
    payload = verified(raw, old_key, old_namespace, partition, row, field)
    if payload is None:
        return None
    return MAGIC + tag(key, namespace, partition, row, field, payload) + bytes(payload)
