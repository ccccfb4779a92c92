"""The read cache: large buffers of gets into new arrays (and
``stowage.empty``) are reused after they are freed, never while any array
over them is alive."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import stowage

from conftest import same

MiB = 1 << 20


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@pytest.fixture
def cache():
    """A fresh cache of 256 MiB for the test, the old limit after it."""
    limit = stowage.read_cache_info()["limit"]
    stowage.set_read_cache(0)
    stowage.set_read_cache(256 * MiB)
    yield
    stowage.set_read_cache(limit)


def test_empty_is_a_writable_array_of_the_shape(cache):
    a = stowage.empty((3, 1 << 17), np.float32)
    assert a.shape == (3, 1 << 17) and a.dtype == np.float32
    assert a.flags.writeable and a.flags.c_contiguous
    a[:] = 7
    assert float(a.sum()) == 7 * a.size
    small = stowage.empty(5, np.int64)
    assert small.shape == (5,)
    with pytest.raises(stowage.InvalidRequest, match="negative"):
        stowage.empty((2, -1))


def test_freed_buffer_is_reused_and_a_live_one_never(cache):
    a = stowage.empty(8 * MiB)
    a[:] = 1
    where = addr(a)
    # A view keeps the memory: a new buffer must be elsewhere, and
    # writing it leaves the view's bytes alone.
    v = a[MiB:]
    del a
    gc.collect()
    b = stowage.empty(8 * MiB)
    where_b = addr(b)
    assert where_b != where
    b[:] = 2
    assert int(v.min()) == 1 and int(v.max()) == 1
    del v, b
    gc.collect()
    info = stowage.read_cache_info()
    assert info["bytes"] == 2 * 8 * MiB
    hits = info["hits"]
    c = stowage.empty(8 * MiB)
    assert addr(c) in (where, where_b) and stowage.read_cache_info()["hits"] == hits + 1
    assert stowage.read_cache_info()["bytes"] == 8 * MiB


def test_cache_is_bounded_and_can_be_turned_off(cache):
    bufs = [stowage.empty(64 * MiB) for _ in range(6)]
    del bufs
    gc.collect()
    assert stowage.read_cache_info()["bytes"] <= 256 * MiB
    stowage.set_read_cache(0)
    assert stowage.read_cache_info()["bytes"] == 0
    hits = stowage.read_cache_info()["hits"]
    stowage.empty(4 * MiB)
    assert stowage.read_cache_info()["hits"] == hits
    with pytest.raises(stowage.InvalidRequest):
        stowage.set_read_cache(-1)


def test_gets_into_reused_buffers_return_the_stored_values(cache, dp, part):
    rng = np.random.default_rng(3)
    first = rng.standard_normal((2, 1 << 19)).astype(np.float32)  # 2 MiB a row
    second = rng.standard_normal((2, 1 << 19)).astype(np.float32)
    dp.put(part, [0, 1], {"x": first})
    dp.put(part, [2, 3], {"x": second})
    got = dp.get(part, [0, 1], ["x"])["x"]
    assert same(np.stack(got), first)
    kept = got[0]
    del got
    gc.collect()
    hits = stowage.read_cache_info()["hits"]
    again = dp.get(part, [2, 3], ["x"])["x"]
    # The freed row-1 buffer was reused and holds row 3's bytes now; the
    # kept row-0 array still holds its own.
    assert stowage.read_cache_info()["hits"] >= hits + 1
    assert same(np.stack(again), second)
    assert same(kept, first[0])
