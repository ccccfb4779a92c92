"""The wire side of :mod:`stowage.nemo_rl`: TensorDict leaves to stowage
columns and back, per-sample tags as JSON bytes, and the group a sample
belongs to. Needs torch and tensordict (the ``stowage-rl[nemo-rl]`` extra).
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from . import _to_torch

#: The per-row field that holds a sample's tags (UTF-8 JSON in a uint8 array).
TAGS_FIELD = "_nemo_rl_tags"

#: The torch dtypes stowage stores (bfloat16 as its bits; the rest as numpy does).
SUPPORTED_DTYPES = frozenset(
    {
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
    }
)

# NeMo-RL names the i-th response of prompt <uid> "<uid>_g<i>".
_GROUP_MEMBER = re.compile(r"^(.+)_g(\d+)$")


def group_of(sample_id: Any) -> str:
    """The group a sample id belongs to: ``<uid>`` for ``"<uid>_g<i>"``,
    else the id itself (a group of one)."""
    s = str(sample_id)
    m = _GROUP_MEMBER.match(s)
    return m.group(1) if m else s


def _row(t: torch.Tensor) -> torch.Tensor:
    """A CPU, C-contiguous, grad-free tensor over the same values."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(sorted(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES))
        raise TypeError(
            f"field {name!r} has dtype {t.dtype}, which stowage does not store "
            f"(it stores {supported})"
        )


def columns_of(td: Any, n: int) -> List[Tuple[str, Any]]:
    """``(field, column)`` pairs for ``Client.put`` from a TensorDict of
    ``n`` rows: a dense tensor leaf becomes one tensor split along its
    first axis; a nested tensor (jagged or strided layout) a list of one
    tensor per row. Non-tensor leaves (``NonTensorData``,
    ``NonTensorStack``, sub-TensorDicts) raise TypeError, unsupported
    dtypes TypeError naming the field, a batch size other than ``(n,)``
    ValueError."""
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"fields must be a TensorDict, got {type(td).__name__}")
    if tuple(td.batch_size)[:1] != (n,):
        raise ValueError(
            f"fields has batch size {tuple(td.batch_size)}, but {n} sample ids were given"
        )
    cols: List[Tuple[str, Any]] = []
    # Top-level keys and get(): a NonTensorData/NonTensorStack leaf shows up
    # here whatever this tensordict version's leaves_only iteration does.
    for key in td.keys():
        name = str(key)
        if name == TAGS_FIELD:
            raise ValueError(f"field name {TAGS_FIELD!r} is reserved for the samples' tags")
        v = td.get(key)
        if not isinstance(v, torch.Tensor):
            raise TypeError(
                f"put_samples: field {name!r} is a non-tensor leaf ({type(v).__name__}); stowage "
                "stores tensors only: tensorize it, pass primitives as tags=, or "
                "send Python objects another way"
            )
        _check_dtype(name, v)
        if v.is_nested:
            rows = [_row(r) for r in v.unbind()]
            if len(rows) != n:
                raise ValueError(f"field {name!r} has {len(rows)} rows, expected {n}")
            cols.append((name, rows))
        else:
            if v.dim() == 0 or v.shape[0] != n:
                raise ValueError(
                    f"field {name!r} has shape {tuple(v.shape)}, expected {n} rows along axis 0"
                )
            cols.append((name, _row(v)))
    return cols


def tensor_of(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """One batched tensor from per-row tensors: stacked when every row has
    the same shape, else a nested tensor (jagged layout where only the
    first dimension varies, strided otherwise)."""
    if not rows:
        return torch.empty(0)
    first = rows[0].shape
    if all(r.shape == first for r in rows[1:]):
        return torch.stack(list(rows))
    if all(r.dim() >= 1 and r.shape[1:] == first[1:] for r in rows) and len(first) >= 1:
        return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)
    return torch.nested.nested_tensor(list(rows))


def tensordict_of(fields: Sequence[str], got: Sequence[Sequence[np.ndarray]], n: int) -> Any:
    """A TensorDict of ``n`` rows from ``Client.get``'s per-field lists of
    per-row arrays (bfloat16 fetched raw)."""
    out: Dict[str, torch.Tensor] = {}
    for f, arrays in zip(fields, got):
        out[f] = tensor_of([_to_torch(a) for a in arrays])
    return TensorDict(out, batch_size=[n])


# -- tags --------------------------------------------------------------------


def _plain(x: Any) -> Any:
    """A tag value JSON can hold: tensor and numpy scalars (and small arrays)
    become Python numbers and lists."""
    if isinstance(x, (torch.Tensor, np.ndarray, np.generic)):
        return x.tolist()
    raise TypeError(f"a tag value of type {type(x).__name__} is not a primitive")


def encode_tags(tags: Sequence[Dict[str, Any]]) -> List[np.ndarray]:
    """One uint8 array of UTF-8 JSON per sample."""
    out = []
    for i, t in enumerate(tags):
        if not isinstance(t, dict):
            raise TypeError(f"tags[{i}] is a {type(t).__name__}, not a dict")
        try:
            text = json.dumps(t, default=_plain, separators=(",", ":"), allow_nan=True)
        except (TypeError, ValueError) as e:
            raise TypeError(f"tags[{i}] cannot be stored: {e}") from None
        out.append(np.frombuffer(text.encode(), dtype=np.uint8).copy())
    return out


def decode_tags(value: Optional[np.ndarray]) -> Dict[str, Any]:
    """A sample's tags from its stored array (None: no tags were put)."""
    if value is None:
        return {}
    tags = json.loads(bytes(np.ascontiguousarray(value).view(np.uint8)).decode())
    return dict(tags)


def sequence_lengths_of(tags: Optional[Sequence[Dict[str, Any]]]) -> Optional[List[int]]:
    """``input_lengths`` of every sample (0 where missing) when any sample
    has that tag, else None."""
    if not tags or not any("input_lengths" in t for t in tags):
        return None
    return [int(t.get("input_lengths", 0)) for t in tags]
