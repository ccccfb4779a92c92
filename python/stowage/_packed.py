"""The values of :meth:`stowage.DataPlane.get_packed_view`: per unit, each
field's values of its rows back to back (:class:`PackedChunk`), and the
whole call's (:class:`PackedView`)."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import numpy as np

from ._native import InvalidRequest


@dataclasses.dataclass(frozen=True)
class PackedChunk:
    """One unit's share of a :meth:`DataPlane.get_packed_view`: the keys
    that live on ``unit`` and, per field, their values packed along the
    first axis."""

    #: The unit that holds these rows.
    unit: int
    #: int64 positions in the call's ``keys`` of this chunk's rows, in the
    #: order of ``keys``.
    rows: np.ndarray
    #: field -> the rows' values back to back along the first axis: row
    #: ``rows[i]``'s value is ``values[f][offsets[f][i]:offsets[f][i + 1]]``.
    #: A read-only array over the unit's memory when the values lie back
    #: to back there, else a writeable copy.
    values: Dict[str, np.ndarray]
    #: field -> int64 offsets along the first axis, ``len(rows) + 1`` of
    #: them, from 0 (the same for every field whose values have the same
    #: first dimensions).
    offsets: Dict[str, np.ndarray]


class PackedView:
    """The values of a :meth:`DataPlane.get_packed_view`: one
    :class:`PackedChunk` per unit that holds some of the keys, in unit
    order (:attr:`chunks`), and :meth:`joined` for one field's values of
    every key in the order of the keys. The values stay pinned until every
    array of the call is garbage-collected."""

    def __init__(self, fields: List[str], n: int, chunks: List[PackedChunk]):
        self._fields = fields
        self._n = n
        #: One per unit that holds some of the keys, in unit order.
        self.chunks: List[PackedChunk] = chunks

    @property
    def fields(self) -> List[str]:
        """The fields asked for."""
        return list(self._fields)

    def __len__(self) -> int:
        """How many keys were asked for."""
        return self._n

    def __repr__(self) -> str:
        units = [c.unit for c in self.chunks]
        return f"<stowage PackedView of {self._n} rows x {self._fields} on units {units}>"

    def joined(self, field: str) -> Tuple[np.ndarray, np.ndarray]:
        """``(values, offsets)`` of ``field`` for every key in the order of
        the call's keys (``values[offsets[i]:offsets[i + 1]]`` is key
        ``i``'s value): what ``torch.nested.nested_tensor_from_jagged``
        takes. The chunk's own arrays (no copy) when one chunk holds every
        key in order; else one copy into new arrays."""
        if field not in self._fields:
            raise InvalidRequest(f"field {field!r} was not asked for ({self._fields})")
        if len(self.chunks) == 1:
            c = self.chunks[0]
            if np.array_equal(c.rows, np.arange(self._n)):
                return c.values[field], c.offsets[field]
        if not self.chunks:
            raise InvalidRequest("an empty view has no values to join")
        # Each key's (chunk, position in it), then its slice, in key order.
        lengths = np.zeros(self._n, dtype=np.int64)
        for c in self.chunks:
            lengths[c.rows] = np.diff(c.offsets[field])
        offsets = np.zeros(self._n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        first = self.chunks[0].values[field]
        out = np.empty((int(offsets[-1]), *first.shape[1:]), dtype=first.dtype)
        for c in self.chunks:
            o = c.offsets[field]
            v = c.values[field]
            for i, r in enumerate(c.rows):
                out[offsets[r] : offsets[r + 1]] = v[o[i] : o[i + 1]]
        return out, offsets
