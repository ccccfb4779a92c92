"""Put and get round trips: every dtype, jagged and dense, odd shapes, big
values and big batches, int and str keys."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import stowage

from conftest import same

DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
]


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def sample(rng: np.random.Generator, name: str, shape) -> np.ndarray:
    dt = np_dtype(name)
    if name == "bool":
        return rng.random(shape) > 0.5
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    return (rng.standard_normal(shape) * 100).astype(dt)


@pytest.mark.parametrize("name", DTYPES)
def test_every_dtype_jagged(dp, part, name):
    rng = np.random.default_rng(1)
    shapes = [(7,), (3, 5), (), (1, 2, 3), (0,), (64,)]
    values = [sample(rng, name, s) for s in shapes]
    keys = list(range(len(values)))
    dp.put(part, keys, {"v": values})
    got = dp.get(part, keys, ["v"])["v"]
    assert len(got) == len(values)
    for a, b in zip(values, got):
        assert same(a, b), (a, b)
        assert b.flags.c_contiguous and b.flags.writeable and b.flags.aligned


@pytest.mark.parametrize("name", DTYPES)
def test_every_dtype_dense(dp, part, name):
    rng = np.random.default_rng(2)
    dense = sample(rng, name, (5, 4, 3))
    keys = [f"row-{i}" for i in range(5)]
    dp.put(part, keys, {"d": dense})
    got = dp.get(part, keys, "d")["d"]
    assert [g.shape for g in got] == [(4, 3)] * 5
    for i, g in enumerate(got):
        assert same(dense[i], g)
    # A dense array of one dimension gives 0-d values.
    flat = sample(rng, name, (5,))
    dp.put(part, keys, {"s": flat})
    got = dp.get(part, keys, ["s"])["s"]
    assert all(g.shape == () for g in got)
    assert same(np.stack(got), flat)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "bool"])
def test_tcp_transport(dp_tcp, part, name):
    rng = np.random.default_rng(3)
    values = [sample(rng, name, (n,)) for n in (1, 1000, 0)]
    dp_tcp.put(part, [0, 1, 2], {"v": values, "w": np.stack([values[1]] * 3)})
    got = dp_tcp.get(part, [0, 1, 2], ["v", "w"])
    assert all(same(a, b) for a, b in zip(values, got["v"]))
    assert all(same(values[1], b) for b in got["w"])


def test_zero_length_values(dp, part):
    values = [np.zeros((0,), np.int64), np.zeros((3, 0), np.float32), np.zeros((0, 0, 2), np.uint8)]
    dp.put(part, ["a", "b", "c"], {"e": values, "dense": np.zeros((3, 0), np.float64)})
    got = dp.get(part, ["a", "b", "c"], ["e", "dense"])
    for a, b in zip(values, got["e"]):
        assert same(a, b)
    assert [g.shape for g in got["dense"]] == [(0,)] * 3
    # Zero rows: nothing to do, and nothing fails.
    dp.put(part, [], {"e": []})
    assert dp.get(part, [], ["e"]) == {"e": []}


def test_returned_arrays_are_independent_copies(dp, part):
    a = np.arange(10, dtype=np.int32)
    dp.put(part, [0], {"x": [a]})
    got = dp.get(part, [0], ["x"])["x"][0]
    got[:] = -1
    a[:] = 7  # the caller's array after the put: not the stored value either
    assert same(dp.get(part, [0], ["x"])["x"][0], np.arange(10, dtype=np.int32))


def test_a_large_batch_of_small_values_reads_back_exactly(dp, part):
    # Values of all sizes and dtypes that add up to more than 8 MiB per
    # unit: the get fills them together on the cores, new arrays carved
    # from one buffer per unit. Each is its own value, aligned, writable,
    # and lives on after the others are gone.
    rng = np.random.default_rng(9)
    n = 1500
    keys = list(range(n))
    cols = {
        "ids": [rng.integers(0, 1 << 40, int(k), dtype=np.int64) for k in rng.integers(0, 3000, n)],
        "lp": [
            rng.standard_normal(int(k)).astype(ml_dtypes.bfloat16) for k in rng.integers(1, 5000, n)
        ],
        "mask": [rng.random((int(k), 3)) > 0.5 for k in rng.integers(0, 700, n)],
    }
    assert sum(a.nbytes for v in cols.values() for a in v) > 2 * (9 << 20)
    dp.put(part, keys, cols)
    got = dp.get(part, keys, list(cols))
    for f, want in cols.items():
        assert all(same(a, b) for a, b in zip(want, got[f])), f
        assert all(a.flags.aligned and a.flags.writeable for a in got[f])
    # Independent: writing one returned value changes no other, nor the store.
    got["ids"][5][:] = -1
    assert same(got["ids"][6], cols["ids"][6])
    keep = got["lp"][n - 1]
    del got
    import gc

    gc.collect()
    assert same(keep, cols["lp"][n - 1])
    assert same(dp.get(part, [5], ["ids"])["ids"][0], cols["ids"][5])
    outs = {f: [np.empty_like(a) for a in v] for f, v in cols.items()}
    dp.get(part, keys, list(cols), out=outs)
    for f, want in cols.items():
        assert all(same(a, b) for a, b in zip(want, outs[f])), f
    # A wrong out= destination is refused before anything is copied.
    bad = {f: list(v) for f, v in outs.items()}
    bad["lp"][3] = np.empty(len(cols["lp"][3]) + 1, dtype=cols["lp"][3].dtype)
    with pytest.raises(stowage.InvalidRequest):
        dp.get(part, keys, list(cols), out=bad)


def test_small_values_of_a_get_share_their_buffers(dp, part):
    # Small values read one by one (a batch too small to copy on several
    # threads) go into shared 64 KiB buffers, one Python object keeping
    # each, not one per value: values up to 4 KiB, across several chunks,
    # every one exact, aligned, writable and independent of the others.
    rng = np.random.default_rng(4)
    n = 300
    sizes = [0, 1, 63, 64, 65, 512, 4095 // 8, 4096 // 8] + [
        int(k) for k in rng.integers(0, 513, n - 8)
    ]
    vals = [rng.integers(-(1 << 60), 1 << 60, k, dtype=np.int64) for k in sizes]
    flags = [rng.random(k) > 0.5 for k in sizes]
    keys = list(range(n))
    dp.put(part, keys, {"v": vals, "f": flags})
    got = dp.get(part, keys, ["v", "f"])
    assert all(same(a, b) for a, b in zip(vals, got["v"]))
    assert all(same(a, b) for a, b in zip(flags, got["f"]))
    assert all(a.flags.aligned and a.flags.writeable for a in got["v"])
    # Shared: far fewer owners than values (about 0.7 MB in 64 KiB chunks).
    owners = {id(a.base) for f in ("v", "f") for a in got[f] if a.nbytes}
    assert 2 <= len(owners) < n // 4, len(owners)
    # Independent: writing one value changes no neighbour in its chunk.
    for a in got["v"]:
        a[:] = -7
    assert all(same(a, b) for a, b in zip(flags, got["f"]))
    keep = got["v"][n - 1]
    del got
    import gc

    gc.collect()
    assert np.all(keep == -7)
    assert same(dp.get(part, [n - 1], ["v"])["v"][0], vals[n - 1])


def test_value_of_256_mib():
    n = (256 << 20) // 8
    big = np.arange(n, dtype=np.int64)
    with stowage.local(units=1, memory="300MiB") as plane:
        plane.put("big", [0], {"x": [big]})
        got = plane.get("big", [0], ["x"])["x"][0]
        assert got.nbytes == 256 << 20
        assert same(big, got)
        del got
        out = np.empty_like(big)
        plane.get("big", [0], ["x"], out={"x": [out]})
        assert same(big, out)
        view = plane.get_view("big", [0], ["x"])["x"][0]
        assert view[12345] == 12345 and view[-1] == n - 1
        assert same(big, view)
        del view


def test_batch_of_10000_rows(dp, part):
    n = 10_000
    rng = np.random.default_rng(4)
    keys = np.arange(n, dtype=np.int64)
    dense = rng.integers(0, 50_000, size=(n, 16), dtype=np.int32)
    lens = rng.integers(0, 40, size=n)
    jagged = [rng.standard_normal(int(k)).astype(np.float32) for k in lens]
    dp.put(part, keys, {"ids": dense, "logprobs": jagged})
    got = dp.get(part, keys, ["ids", "logprobs"])
    assert len(got["ids"]) == n and len(got["logprobs"]) == n
    assert same(np.stack(got["ids"]), dense)
    assert all(same(a, b) for a, b in zip(jagged, got["logprobs"]))
    listed = dp.list(part)
    assert len(listed) == n and listed[0] == ["ids", "logprobs"]
    assert dp.clear(part, keys) == 2 * n
    assert dp.list(part) == {}


def test_string_and_int_keys(dp, part):
    keys = [0, "uid-g3", 17, "ünïcode ✓", 2**63 - 1, np.int64(5)]
    values = [np.full(3, i, np.int16) for i in range(len(keys))]
    dp.put(part, keys, {"x": values})
    got = dp.get(part, keys, ["x"])["x"]
    assert all(same(a, b) for a, b in zip(values, got))
    listed = dp.list(part)
    assert set(listed) == {0, "uid-g3", 17, "ünïcode ✓", 2**63 - 1, 5}
    assert all(f == ["x"] for f in listed.values())
    assert all(type(k) in (int, str) for k in listed)
    # A key array works as a key list does.
    got = dp.get(part, np.array([17, 0], dtype=np.uint32), ["x"])["x"]
    assert same(got[0], values[2]) and same(got[1], values[0])


def test_rewrite_replaces_and_adds_fields(dp, part):
    dp.put(part, [1, 2], {"a": [np.arange(3), np.arange(4)]})
    dp.put(part, [1], {"a": [np.ones((2, 2), np.float16)], "b": [np.array([True])]})
    got = dp.get(part, [1, 2], ["a"])["a"]
    assert same(got[0], np.ones((2, 2), np.float16))
    assert same(got[1], np.arange(4))
    assert dp.list(part) == {1: ["a", "b"], 2: ["a"]}


def test_named_unit_placement(dp, part):
    # Row 1 would live on unit 1; put it on unit 0 explicitly.
    dp.put(part, [1, "k"], {"x": [np.arange(2), np.arange(3)]}, unit=0)
    got = dp.get(part, [1, "k"], ["x"], unit=0)["x"]
    assert same(got[0], np.arange(2)) and same(got[1], np.arange(3))
    with pytest.raises(stowage.NotFound):
        dp.get(part, [1], ["x"])  # looked up on unit 1
    assert dp.clear(part, [1, "k"], unit=0) == 2
    assert dp.list(part) == {}
    with pytest.raises(stowage.InvalidRequest):
        dp.put(part, [1], {"x": [np.arange(2)]}, unit=5)


def test_clear_partition_and_stats(dp, part):
    dp.put(part, list(range(6)), {"x": np.zeros((6, 100), np.float64)})
    before = dp.stats()
    assert len(before) == 2
    assert {"capacity", "used", "entries", "rows", "pins", "blobs"} <= set(before[0])
    assert all(s["capacity"] == 64 << 20 for s in before)
    assert part in dp.partitions()
    assert dp.clear_partition(part) == 6
    assert dp.list(part) == {}
    assert part not in dp.partitions()
    after = dp.stats()
    assert sum(s["entries"] for s in after) == sum(s["entries"] for s in before) - 6
