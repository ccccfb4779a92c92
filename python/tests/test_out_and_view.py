"""get(..., out=...) into caller arrays, and zero-copy get_view."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import stowage

from conftest import same, settled_pins, total_pins


def test_out_list_of_arrays(dp, part):
    values = [np.arange(5, dtype=np.float32), np.arange(12, dtype=np.float32).reshape(3, 4)]
    dp.put(part, ["a", "b"], {"x": values})
    outs = [np.zeros(5, np.float32), np.zeros((3, 4), np.float32)]
    got = dp.get(part, ["a", "b"], ["x"], out={"x": outs})
    assert got["x"] is outs
    assert same(outs[0], values[0]) and same(outs[1], values[1])


def test_out_dense_array(dp, part):
    dense = np.random.default_rng(0).integers(0, 100, size=(8, 6), dtype=np.int64)
    dp.put(part, list(range(8)), {"ids": dense, "mask": dense > 50})
    out = np.zeros((8, 6), np.int64)
    mask = np.zeros((8, 6), bool)
    got = dp.get(part, list(range(8)), ["ids", "mask"], out={"ids": out, "mask": mask})
    assert got["ids"] is out and got["mask"] is mask
    assert same(out, dense) and same(mask, dense > 50)
    # A dense out array over jagged puts of equal shapes works too.
    dp.put(part, [10, 11], {"j": [np.arange(3.0), np.arange(3.0) + 1]})
    out = np.empty((2, 3))
    dp.get(part, [10, 11], ["j"], out={"j": out})
    assert same(out, np.stack([np.arange(3.0), np.arange(3.0) + 1]))


def test_out_mismatches_are_invalid_and_harmless(dp, part):
    dp.put(part, [0, 1], {"x": np.arange(8, dtype=np.int32).reshape(2, 4)})
    bad = {
        "dtype": [np.zeros(4, np.float32), np.zeros(4, np.float32)],
        "size": [np.zeros(5, np.int32), np.zeros(4, np.int32)],
        "count": [np.zeros(4, np.int32)],
        "dense rows": np.zeros((3, 4), np.int32),
        "readonly": [np.zeros(4, np.int32), np.zeros(4, np.int32)],
        "noncontiguous": [np.zeros(8, np.int32)[::2], np.zeros(4, np.int32)],
        "overlap": [np.zeros(4, np.int32)] * 2,
        "not an array": [[0, 0, 0, 0], [0, 0, 0, 0]],
    }
    bad["readonly"][0].flags.writeable = False
    for what, out in bad.items():
        with pytest.raises(stowage.InvalidRequest):
            dp.get(part, [0, 1], ["x"], out={"x": out})
            pytest.fail(what)
    with pytest.raises(stowage.InvalidRequest, match="no entry"):
        dp.get(part, [0, 1], ["x"], out={"y": np.zeros((2, 4), np.int32)})
    got = dp.get(part, [0, 1], ["x"])["x"]
    assert same(np.stack(got), np.arange(8, dtype=np.int32).reshape(2, 4))


def test_view_is_zero_copy_and_pins_until_collected(dp, part):
    values = [np.arange(1000, dtype=np.float64), np.arange(6, dtype=np.int8).reshape(2, 3)]
    dp.put(part, [0, 1], {"x": values})
    assert total_pins(dp) == 0
    view = dp.get_view(part, [0, 1], ["x"])
    arrays = view["x"]
    assert same(arrays[0], values[0]) and same(arrays[1], values[1])
    assert all(not a.flags.writeable and not a.flags.owndata for a in arrays)
    assert all(a.flags.aligned for a in arrays)
    with pytest.raises(ValueError):
        arrays[0][0] = 1.0
    assert total_pins(dp) == 2  # one per unit that holds a value
    # Stats show what this client's sessions hold, per unit.
    stats = dp.stats()
    held = [s for u in stats for s in u["sessions"] if s["pins"] > 0]
    assert len(held) == 2 and all(s["held_bytes"] > 0 for s in held)
    assert sum(u["held_bytes"] for u in stats) >= 1000 * 8 + 6
    # Pinned values stay in place even when their rows are cleared and the
    # space is written again.
    dp.clear(part, [0, 1])
    dp.put(part, [0, 1], {"x": [np.full(1000, -1.0), np.full((2, 3), -1, np.int8)]})
    assert same(arrays[0], values[0]) and same(arrays[1], values[1])
    # One array keeps the whole call's pins.
    first = arrays[0]
    del view, arrays
    gc.collect()
    assert settled_pins(dp, 0, timeout=0.5) == 2
    assert first.sum() == values[0].sum()
    del first
    gc.collect()
    assert settled_pins(dp, 0) == 0
    assert same(dp.get(part, [0], ["x"])["x"][0], np.full(1000, -1.0))


def test_view_of_missing_keys_pins_nothing(dp, part):
    dp.put(part, [0], {"x": [np.arange(3)]})
    with pytest.raises(stowage.NotFound) as e:
        dp.get_view(part, [0, 1], ["x"])
    assert e.value.keys == [(1, "x")]
    assert settled_pins(dp, 0) == 0


def test_view_needs_shm(dp_tcp, part):
    dp_tcp.put(part, [0], {"x": [np.arange(3)]})
    with pytest.raises(stowage.InvalidRequest, match="shm"):
        dp_tcp.get_view(part, [0], ["x"])


def test_a_value_stored_in_pieces_reads_back_whole_and_views_as_a_copy():
    # One 16 MiB unit (a 1 MiB spare zone) cut into 512 KiB holes: a
    # 6 MiB value is larger than any free range, so the unit stores it in
    # pieces. get and get(out=) reassemble it; get_view hands a copy.
    with stowage.local(units=1, memory="16MiB") as dp:
        chunk = 1 << 19
        for i in range(28):  # one put each: a put's values share one blob
            dp.put("p", [i], {"h": [np.full(chunk, i, np.uint8)]})
        # Views of the kept values pin them: compaction cannot gather the
        # holes before the big put.
        kept = [i for i in range(28) if i % 2 == 0]
        pinned = dp.get_view("p", kept, ["h"])
        dp.clear("p", [i for i in range(28) if i % 2 == 1])
        stats = dp.stats()[0]
        big = np.random.default_rng(7).integers(0, 255, size=6 << 20, dtype=np.uint8)
        assert stats["largest_free"] < big.nbytes <= stats["free_bytes"], stats
        dp.put("p", ["big"], {"x": [big]})
        assert dp.stats()[0]["split_blobs"] >= 1
        assert same(dp.get("p", ["big"], ["x"])["x"][0], big)
        out = np.zeros_like(big)
        dp.get("p", ["big"], ["x"], out={"x": [out]})
        assert same(out, big)
        view = dp.get_view("p", ["big"], ["x"])["x"][0]
        assert same(view, big)
        assert view.flags.writeable and view.flags.owndata is not None
        packed = dp.get_packed_view("p", ["big"], ["x"]).chunks[0].values["x"]
        assert same(packed, big) and packed.flags.writeable, "a packed view copies it too"
        del packed
        del pinned
        gc.collect()
        assert settled_pins(dp, 0) == 0, "a copied split value holds no pin"
        # The kept values are intact.
        for i, v in zip(kept, dp.get("p", kept, ["h"])["h"]):
            assert same(v, np.full(chunk, i, np.uint8))
