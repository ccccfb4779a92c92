"""asyncio variants and calls from several threads at once."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import stowage

from conftest import same


def test_async_put_get_clear(dp, part):
    async def main():
        await dp.aput(part, [0, 1], {"x": [np.arange(3), np.arange(4)]})
        got = await dp.aget(part, [0, 1], ["x"])
        assert same(got["x"][0], np.arange(3)) and same(got["x"][1], np.arange(4))
        out = [np.zeros(3, np.int64), np.zeros(4, np.int64)]
        await dp.aget(part, [0, 1], ["x"], out={"x": out})
        assert same(out[1], np.arange(4))
        # Many calls in flight at once.
        results = await asyncio.gather(*(dp.aget(part, [i % 2], ["x"]) for i in range(16)))
        assert all(same(r["x"][0], np.arange(3 + i % 2)) for i, r in enumerate(results))
        assert await dp.aclear(part, [0, 1]) == 2
        with pytest.raises(stowage.NotFound):
            await dp.aget(part, [0], ["x"])

    asyncio.run(main())


def test_threads(dp, part):
    errors = []

    def worker(t: int):
        try:
            for i in range(20):
                key = f"t{t}-{i}"
                value = np.full((i + 1, 3), t * 100 + i, np.int32)
                dp.put(part, [key], {"v": [value]})
                got = dp.get(part, [key], ["v"])["v"][0]
                assert same(got, value)
                dp.clear(part, [key])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert dp.list(part) == {}
