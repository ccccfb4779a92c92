"""torch tensors in and out (skipped when torch is not installed)."""

from __future__ import annotations

import numpy as np
import pytest

import stowage

torch = pytest.importorskip("torch")

DTYPES = [
    torch.bool,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_round_trip(dp, part, dtype):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        values = [torch.rand(5, generator=g) > 0.5, torch.rand(2, 3, generator=g) > 0.5]
    elif dtype.is_floating_point:
        values = [torch.randn(5, generator=g).to(dtype), torch.randn(2, 3, generator=g).to(dtype)]
    else:
        values = [
            torch.randint(0, 100, (5,), generator=g).to(dtype),
            torch.randint(0, 100, (2, 3), generator=g).to(dtype),
        ]
    dense = torch.stack([values[0], values[0]])
    dp.put(part, [0, 1], {"j": values, "d": dense})
    got = dp.get(part, [0, 1], ["j", "d"], as_="torch")
    for a, b in zip(values, got["j"]):
        assert isinstance(b, torch.Tensor) and b.dtype == dtype and torch.equal(a, b)
    assert all(torch.equal(values[0], b) for b in got["d"])
    # Into preallocated tensors.
    out = torch.zeros((2, 5), dtype=dtype)
    dp.get(part, [0, 1], ["d"], out={"d": out})
    assert torch.equal(out, dense)


def test_torch_bfloat16_to_numpy(dp, part):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    t = torch.arange(8, dtype=torch.bfloat16)
    dp.put(part, [0], {"x": [t]})
    a = dp.get(part, [0], ["x"])["x"][0]
    assert a.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(a.astype(np.float32), np.arange(8, dtype=np.float32))


def test_torch_bad_tensors(dp, part):
    with pytest.raises(stowage.InvalidRequest, match="contiguous"):
        dp.put(part, [0, 1], {"x": torch.zeros(4, 2).t()})
    with pytest.raises(stowage.InvalidRequest):
        dp.put(part, [0], {"x": [torch.zeros(2, dtype=torch.complex64)]})
    assert dp.list(part) == {}
