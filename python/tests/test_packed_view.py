"""get_packed_view: a field's values of each unit's rows in one array plus
row offsets, zero-copy where a put laid them back to back."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import stowage

from conftest import same, settled_pins, total_pins


def jagged(rng, n, dtype=np.int64, inner=()):
    lens = rng.integers(0, 40, n)
    return [rng.integers(-100, 100, (int(k), *inner)).astype(dtype) for k in lens]


def check_chunks(view, keys, cols):
    """Every key in exactly one chunk; each chunk's values are its rows'."""
    seen = []
    for c in view.chunks:
        assert c.rows.dtype == np.int64
        seen.extend(c.rows.tolist())
        for f, want in cols.items():
            v, o = c.values[f], c.offsets[f]
            assert o.dtype == np.int64 and len(o) == len(c.rows) + 1 and o[0] == 0
            assert o[-1] == len(v)
            for i, r in enumerate(c.rows):
                assert same(v[o[i] : o[i + 1]], want[r]), (f, r)
    assert sorted(seen) == list(range(len(keys)))


def in_place(a):
    return not a.flags.writeable and not a.flags.owndata


def test_a_put_views_packed_in_place_per_unit(dp, part):
    rng = np.random.default_rng(1)
    keys = list(range(20))
    cols = {
        "ids": jagged(rng, 20),
        "lp": [rng.standard_normal(len(a)).astype(np.float32) for a in jagged(rng, 20)],
        "pix": jagged(rng, 20, np.uint8, (2, 3)),
    }
    dp.put(part, keys, cols)
    view = dp.get_packed_view(part, keys, list(cols))
    assert len(view) == 20 and view.fields == list(cols)
    # Rows spread over both units (r % 2): one chunk each, in unit order,
    # its rows in the order of the keys.
    assert [c.unit for c in view.chunks] == [0, 1]
    assert [c.rows.tolist() for c in view.chunks] == [keys[0::2], keys[1::2]]
    check_chunks(view, keys, cols)
    for c in view.chunks:
        for f, v in c.values.items():
            assert in_place(v), f
            assert v.flags.c_contiguous and v.flags.aligned
            assert v.dtype == cols[f][0].dtype and v.shape[1:] == cols[f][0].shape[1:]
    # In key order: one copy, the values of every key.
    for f, want in cols.items():
        v, o = view.joined(f)
        assert v.flags.writeable and len(o) == 21
        for i in range(20):
            assert same(v[o[i] : o[i + 1]], want[i])
    with pytest.raises(stowage.InvalidRequest):
        view.joined("nope")


def test_a_view_of_one_unit_in_order_joins_without_a_copy(dp, part):
    rng = np.random.default_rng(2)
    cols = {"ids": jagged(rng, 9)}
    dp.put(part, list(range(9)), cols, unit=1)
    view = dp.get_packed_view(part, list(range(9)), "ids", unit=1)
    (c,) = view.chunks
    assert c.unit == 1 and c.rows.tolist() == list(range(9))
    v, o = view.joined("ids")
    assert v is c.values["ids"] and o is c.offsets["ids"] and in_place(v)
    check_chunks(view, range(9), cols)
    # A subset in the put's order is one range too; rows out of that order
    # are copied.
    sub = dp.get_packed_view(part, [2, 3, 4], "ids", unit=1)
    assert in_place(sub.chunks[0].values["ids"])
    check_chunks(sub, [2, 3, 4], {"ids": [cols["ids"][r] for r in (2, 3, 4)]})
    rev = dp.get_packed_view(part, [4, 3, 2], "ids", unit=1)
    assert rev.chunks[0].values["ids"].flags.writeable
    check_chunks(rev, [4, 3, 2], {"ids": [cols["ids"][r] for r in (4, 3, 2)]})


def test_rows_of_several_puts_are_copied_once(dp, part):
    rng = np.random.default_rng(3)
    a, b = jagged(rng, 4), jagged(rng, 4)
    # A second field follows x in the first put's blob: the two puts'
    # x values can never lie back to back, wherever the blobs land.
    dp.put(part, [0, 2], {"x": [a[0], a[2]], "y": [np.zeros(3), np.zeros(3)]})
    dp.put(part, [4, 6], {"x": [b[0], b[2]]})
    view = dp.get_packed_view(part, [0, 2, 4, 6], ["x"])
    (c,) = view.chunks
    assert c.unit == 0
    assert c.values["x"].flags.writeable and c.values["x"].flags.owndata is not None
    check_chunks(view, [0, 2, 4, 6], {"x": [a[0], a[2], b[0], b[2]]})


def test_pinned_until_the_last_array_is_dropped_even_when_cleared(dp, part):
    rng = np.random.default_rng(4)
    cols = {"x": jagged(rng, 6, np.float64), "m": jagged(rng, 6, np.int32)}
    keys = [f"uid_{i}" for i in range(6)]
    dp.put(part, keys, cols)
    assert total_pins(dp) == 0
    view = dp.get_packed_view(part, keys, ["x", "m"])
    assert total_pins(dp) == len(view.chunks) == 2
    # Cleared and written again: the view still reads what it pinned.
    dp.clear(part, keys)
    dp.put(part, keys, {"x": [np.full(len(a), -1.0) for a in cols["x"]]})
    check_chunks(view, keys, cols)
    kept = view.chunks[1].values["m"]
    want = np.concatenate([cols["m"][r] for r in view.chunks[1].rows])
    del view
    gc.collect()
    assert settled_pins(dp, 2, timeout=0.5) == 2, "one array keeps the call's pins"
    assert same(kept, want)
    del kept
    gc.collect()
    assert settled_pins(dp, 0) == 0


def test_fields_that_cannot_pack_are_refused_and_pin_nothing(dp, part):
    dp.put(part, [0, 2], {"x": [np.arange(3), np.arange(3.0)]})
    with pytest.raises(stowage.InvalidRequest, match="cannot be packed"):
        dp.get_packed_view(part, [0, 2], "x")
    dp.put(part, [4, 6], {"y": [np.zeros((2, 3)), np.zeros((2, 4))]})
    with pytest.raises(stowage.InvalidRequest, match="cannot be packed"):
        dp.get_packed_view(part, [4, 6], "y")
    with pytest.raises(stowage.NotFound):
        dp.get_packed_view(part, [0, 1], "x")
    gc.collect()
    assert settled_pins(dp, 0) == 0


def test_scalars_pack_one_element_per_row_and_empty_calls_are_empty(dp, part):
    dp.put(part, [0, 1, 2], {"r": np.array([0.5, 1.5, 2.5], dtype=np.float32)})
    view = dp.get_packed_view(part, [0, 1, 2], "r")
    v, o = view.joined("r")
    assert same(v, np.array([0.5, 1.5, 2.5], dtype=np.float32)) and o.tolist() == [0, 1, 2, 3]
    empty = dp.get_packed_view(part, [], "r")
    assert empty.chunks == [] and len(empty) == 0


def test_packed_views_need_shm(dp_tcp, part):
    dp_tcp.put(part, [0], {"x": [np.arange(3)]})
    with pytest.raises(stowage.InvalidRequest, match="shm"):
        dp_tcp.get_packed_view(part, [0], ["x"])
