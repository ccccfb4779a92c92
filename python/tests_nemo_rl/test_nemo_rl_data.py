"""StowageDataPlaneClient's direct-by-key path against real units: put,
get and clear of dense and jagged fields, tags, the errors NeMo-RL's
callers rely on, construction and close.

(Every put, get and clear places a sample's rows with Client.unit_of, and
put passes groups=: these tests need the claim methods of the extension's
Client.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

pytest.importorskip(
    "torch", reason="stowage.nemo_rl needs torch: pip install 'stowage-rl[nemo-rl]'"
)
pytest.importorskip(
    "tensordict", reason="stowage.nemo_rl needs tensordict: pip install 'stowage-rl[nemo-rl]'"
)
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import stowage
import stowage.nemo_rl as nr
from stowage.nemo_rl import KVBatchMeta, StowageDataPlaneClient


def _ids(n, prefix="s"):
    return [f"{prefix}{i}" for i in range(n)]


def _jagged(lengths, dtype=torch.int64, start=0):
    rows = [torch.arange(start, start + n, dtype=dtype) for n in lengths]
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged), rows


def test_import_stowage_does_not_import_torch():
    code = "import sys, stowage; sys.exit(1 if 'torch' in sys.modules else 0)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"import stowage imported torch: {r.stdout}{r.stderr}"


def test_dense_fields_round_trip_with_their_dtypes(dp, part):
    ids = _ids(4)
    td = TensorDict(
        {
            "input_ids": torch.arange(4 * 6, dtype=torch.int64).reshape(4, 6),
            "logprobs": torch.randn(4, 6, dtype=torch.bfloat16),
            "reward": torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float32),
            "mask": torch.tensor([[True, False]] * 4),
            "weights": torch.randn(4, 2, 3, dtype=torch.float64),
            "small": torch.tensor([1, 2, 3, 4], dtype=torch.int32),
        },
        batch_size=[4],
    )
    meta = dp.put_samples(ids, part, td)
    assert meta.sample_ids == ids
    assert meta.partition_id == part
    assert sorted(meta.fields) == sorted(td.keys())

    got = dp.get_samples(ids, part, list(td.keys()))
    assert tuple(got.batch_size) == (4,)
    for k in td.keys():
        assert got[k].dtype == td[k].dtype, k
        assert got[k].shape == td[k].shape, k
        assert torch.equal(got[k], td[k]), k


def test_get_returns_samples_in_the_order_asked(dp, part):
    ids = _ids(6)
    dp.put_samples(ids, part, TensorDict({"x": torch.arange(6)}, batch_size=[6]))
    order = ["s5", "s0", "s3", "s1"]
    got = dp.get_samples(order, part, ["x"])
    assert got["x"].tolist() == [5, 0, 3, 1]


def test_jagged_fields_come_back_as_jagged_nested_tensors(dp, part):
    ids = _ids(3)
    ids_nt, rows = _jagged([3, 7, 1])
    lp_rows = [torch.randn(n, dtype=torch.bfloat16) for n in (3, 7, 1)]
    lp_nt = torch.nested.as_nested_tensor(lp_rows, layout=torch.jagged)
    # A jagged field with a trailing dense dimension.
    emb_rows = [torch.randn(n, 4) for n in (2, 5, 3)]
    emb_nt = torch.nested.as_nested_tensor(emb_rows, layout=torch.jagged)
    td = TensorDict({"input_ids": ids_nt, "lp": lp_nt, "emb": emb_nt}, batch_size=[3])
    dp.put_samples(ids, part, td)

    got = dp.get_samples(ids, part, ["input_ids", "lp", "emb"])
    for name, want in (("input_ids", rows), ("lp", lp_rows), ("emb", emb_rows)):
        v = got[name]
        assert v.is_nested and v.layout == torch.jagged, name
        assert v.dtype == want[0].dtype, name
        back = v.unbind()
        assert len(back) == len(want)
        for a, b in zip(back, want):
            assert torch.equal(a, b), name


def test_nested_field_of_equal_rows_comes_back_dense(dp, part):
    # Stowage keeps per-row values, not the batch's layout: rows of one
    # shape are stacked (as NeMo-RL's codec and TransferQueue do).
    nt, rows = _jagged([4, 4])
    dp.put_samples(_ids(2), part, TensorDict({"x": nt}, batch_size=[2]))
    got = dp.get_samples(_ids(2), part, ["x"])["x"]
    assert not got.is_nested
    assert torch.equal(got, torch.stack(rows))


def test_a_later_put_adds_fields_and_keeps_the_others(dp, part):
    ids = _ids(2)
    dp.put_samples(ids, part, TensorDict({"a": torch.tensor([1, 2])}, batch_size=[2]))
    dp.put_samples(ids, part, TensorDict({"b": torch.tensor([3.0, 4.0])}, batch_size=[2]))
    got = dp.get_samples(ids, part, ["a", "b"])
    assert got["a"].tolist() == [1, 2]
    assert got["b"].tolist() == [3.0, 4.0]


def test_put_meta_carries_tags_and_sequence_lengths(dp, part):
    ids = _ids(3)
    tags = [{"input_lengths": 5, "uid": "p0"}, {"input_lengths": 2}, {"std": 0.25}]
    meta = dp.put_samples(ids, part, TensorDict({"x": torch.zeros(3)}, batch_size=[3]), tags=tags)
    assert meta.tags == tags
    assert meta.sequence_lengths == [5, 2, 0]
    assert meta.tags is not tags  # the caller's dicts are not aliased


def test_put_meta_without_input_lengths_has_no_sequence_lengths(dp, part):
    meta = dp.put_samples(
        _ids(2), part, TensorDict({"x": torch.zeros(2)}, batch_size=[2]), tags=[{"a": 1}, {}]
    )
    assert meta.sequence_lengths is None
    meta = dp.put_samples(_ids(2), part, TensorDict({"x": torch.zeros(2)}, batch_size=[2]))
    assert meta.tags == [{}, {}]
    assert meta.sequence_lengths is None


def test_tags_are_stored_as_a_row_field(dp, plane, part):
    ids = _ids(2)
    tags = [{"input_lengths": 3, "ok": True}, {"input_lengths": 4, "name": "b"}]
    dp.put_samples(ids, part, tags=tags)
    assert sorted(dp.list_sample_ids(part)) == ids
    # Through the extension directly: one JSON document per row.
    assert dp._read_tags(part, ids) == tags


def test_tensor_valued_tags_are_stored_as_numbers(dp, part):
    ids = _ids(2)
    meta = KVBatchMeta(partition_id=part, task_name=None, sample_ids=ids)
    meta.stamp_tags({"input_lengths": torch.tensor([7, 9]), "std": np.array([0.5, 1.5])})
    dp.put_samples(ids, part, tags=meta.tags)
    assert dp._read_tags(part, ids) == [
        {"input_lengths": 7, "std": 0.5},
        {"input_lengths": 9, "std": 1.5},
    ]


def test_tags_that_are_not_primitives_are_refused(dp, part):
    with pytest.raises(TypeError, match=r"tags\[1\]"):
        dp.put_samples(_ids(2), part, tags=[{}, {"obj": object()}])
    assert dp.list_sample_ids(part) == []


def test_get_of_a_cleared_sample_raises_key_error(dp, part):
    ids = _ids(3)
    dp.put_samples(ids, part, TensorDict({"x": torch.arange(3)}, batch_size=[3]))
    dp.clear_samples(["s1"], part)
    assert dp.get_samples(["s0", "s2"], part, ["x"])["x"].tolist() == [0, 2]
    with pytest.raises(KeyError, match="s1"):
        dp.get_samples(ids, part, ["x"])


def test_get_of_an_unproduced_field_raises_key_error(dp, part):
    ids = _ids(2)
    dp.put_samples(ids, part, TensorDict({"x": torch.arange(2)}, batch_size=[2]))
    with pytest.raises(KeyError, match="advantages"):
        dp.get_samples(ids, part, ["x", "advantages"])


def test_get_of_no_samples_is_an_empty_batch(dp, part):
    got = dp.get_samples([], part, ["x"])
    assert tuple(got.batch_size) == (0,)


def test_get_data_needs_fields(dp, part):
    ids = _ids(2)
    dp.put_samples(ids, part, TensorDict({"x": torch.arange(2)}, batch_size=[2]))
    bare = KVBatchMeta(partition_id=part, task_name=None, sample_ids=ids, fields=None)
    with pytest.raises(ValueError, match="fields"):
        dp.get_data(bare)
    assert dp.get_data(bare, select_fields=["x"])["x"].tolist() == [0, 1]
    named = KVBatchMeta(partition_id=part, task_name=None, sample_ids=ids, fields=["x"])
    assert dp.get_data(named)["x"].tolist() == [0, 1]


@pytest.mark.parametrize("kind", ["data", "stack"])
def test_non_tensor_leaves_are_refused_and_nothing_is_stored(dp, part, kind):
    if kind == "data":
        leaf = NonTensorData("hello", batch_size=[2])
    else:
        leaf = NonTensorStack(NonTensorData("a"), NonTensorData("b"))
    td = TensorDict({"x": torch.zeros(2), "meta": leaf}, batch_size=[2])
    with pytest.raises(TypeError, match=r"non-tensor.*meta|meta.*non-tensor"):
        dp.put_samples(_ids(2), part, td)
    assert dp.list_sample_ids(part) == []


def test_unsupported_dtype_is_refused_naming_the_field(dp, part):
    td = TensorDict(
        {"x": torch.zeros(2), "z": torch.zeros(2, 3, dtype=torch.complex64)}, batch_size=[2]
    )
    with pytest.raises(TypeError, match=r"'z'.*complex64"):
        dp.put_samples(_ids(2), part, td)
    assert dp.list_sample_ids(part) == []


def test_rows_and_ids_must_agree(dp, part):
    td = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
    with pytest.raises(ValueError, match="3"):
        dp.put_samples(_ids(2), part, td)
    with pytest.raises(ValueError, match="tags"):
        dp.put_samples(_ids(2), part, tags=[{}])


def test_non_contiguous_and_grad_tensors_are_stored(dp, part):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # (4, 3), not contiguous
    w = torch.ones(4, 2, requires_grad=True)
    dp.put_samples(_ids(4), part, TensorDict({"x": x, "w": w}, batch_size=[4]))
    got = dp.get_samples(_ids(4), part, ["x", "w"])
    assert torch.equal(got["x"], x)
    assert torch.equal(got["w"], w.detach())


def test_clear_none_clears_what_this_process_put(plane, part):
    mine = StowageDataPlaneClient(plane)
    other = StowageDataPlaneClient(plane)
    try:
        mine.put_samples(["a", "b"], part, TensorDict({"x": torch.arange(2)}, batch_size=[2]))
        other.put_samples(["c"], part, TensorDict({"x": torch.arange(1)}, batch_size=[1]))
        mine.clear_samples(None, part)
        assert mine.list_sample_ids(part) == ["c"]
        # Cleared: the registry is empty now, and says so.
        with pytest.warns(RuntimeWarning, match="nothing was cleared"):
            mine.clear_samples(None, part)
        assert other.list_sample_ids(part) == ["c"]
    finally:
        mine.close()
        other.close()


def test_clear_none_warns_when_this_process_put_nothing(dp, plane, part):
    plane.put(part, ["z"], {"x": np.zeros(1)})
    with pytest.warns(RuntimeWarning, match=part):
        dp.clear_samples(None, part)
    assert dp.list_sample_ids(part) == ["z"]


def test_explicit_clear_leaves_the_rest_of_the_registry(dp, part):
    dp.put_samples(_ids(3), part, TensorDict({"x": torch.arange(3)}, batch_size=[3]))
    dp.clear_samples(["s0"], part)
    dp.clear_samples(None, part)
    assert dp.list_sample_ids(part) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp.clear_samples(["never-put"], part)  # unknown ids: no error


def test_list_sample_ids_is_sorted_and_empty_for_an_unknown_partition(dp, part):
    dp.put_samples(["b", "c", "a"], part, TensorDict({"x": torch.arange(3)}, batch_size=[3]))
    assert dp.list_sample_ids(part) == ["a", "b", "c"]
    assert dp.list_sample_ids(part + "-none") == []


def test_close_is_idempotent_and_ends_use(plane, part):
    c = StowageDataPlaneClient(plane)
    c.close()
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.put_samples(["a"], part, TensorDict({"x": torch.zeros(1)}, batch_size=[1]))
    # The plane was the caller's: still open.
    plane.put(part, ["a"], {"x": np.zeros(1)})
    assert plane.list(part) == {"a": ["x"]}


def test_from_directory_file_and_json(plane, tmp_path, part):
    path = tmp_path / "directory.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(plane.directory, f)
    by_file = StowageDataPlaneClient.from_directory(str(path))
    by_json = StowageDataPlaneClient.from_directory(json.dumps(plane.directory))
    by_dict = StowageDataPlaneClient.from_directory(plane.directory)
    try:
        by_file.put_samples(["a"], part, TensorDict({"x": torch.tensor([7])}, batch_size=[1]))
        assert by_json.get_samples(["a"], part, ["x"])["x"].tolist() == [7]
        assert by_dict.get_samples(["a"], part, ["x"])["x"].tolist() == [7]
    finally:
        for c in (by_file, by_json, by_dict):
            c.close()
    # Each owned its connection: closed with it.
    assert by_file._owner.closed
    by_file.close()


def test_construction_refuses_other_objects():
    with pytest.raises(TypeError, match="DataPlane"):
        StowageDataPlaneClient("unix:/nowhere.sock")


def test_groups_are_placed_on_their_unit(dp, plane, part):
    unit_of = {g: nr._unit_of(plane._client, g) for g in (f"u{i}" for i in range(16))}
    assert set(unit_of.values()) == {0, 1}, "16 groups, all on one of two units"
    ids = [f"{g}_g{i}" for g in unit_of for i in range(3)]
    dp.put_samples(ids, part, TensorDict({"x": torch.arange(len(ids))}, batch_size=[len(ids)]))
    for g, u in unit_of.items():
        members = [f"{g}_g{i}" for i in range(3)]
        got = plane.get(part, members, ["x"], unit=u)
        assert len(got["x"]) == 3
        with pytest.raises(stowage.NotFound):
            plane.get(part, members, ["x"], unit=1 - u)
    got = dp.get_samples(ids, part, ["x"])
    assert got["x"].tolist() == list(range(len(ids)))


def test_group_of():
    assert nr.group_of("abc_g3") == "abc"
    assert nr.group_of("a_g1_g12") == "a_g1"
    assert nr.group_of("plain") == "plain"
    assert nr.group_of("x_gy") == "x_gy"
    assert nr.group_of("_g1") == "_g1"
