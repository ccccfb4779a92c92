"""The disk tier, checkpoints and teardown through the Python API."""

import os

import numpy as np
import pytest

import stowage


def values(n, size, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(n)]


def test_more_than_memory_spills_and_reads_back(tmp_path):
    vals = values(24, 1 << 20, 1)
    keys = list(range(24))
    with stowage.local(
        units=1,
        memory="8MiB",
        disk=str(tmp_path),
        disk_capacity="256MiB",
        high_watermark=0.5,
        low_watermark=0.3,
    ) as plane:
        plane.put("p", keys, {"v": vals})
        got = plane.get("p", keys, ["v"])["v"]
        assert all(np.array_equal(a, b) for a, b in zip(got, vals))
        assert plane.stats()[0]["spilled_blobs"] > 0
        assert len(os.listdir(tmp_path)) == 1  # the unit's own directory
    # Closing removed the unit's directory.
    assert os.listdir(tmp_path) == []


def test_full_memory_and_disk_raise_unit_full_and_keep_data(tmp_path):
    vals = values(16, 1 << 20, 2)
    with stowage.local(units=1, memory="4MiB", disk=str(tmp_path), disk_capacity="4MiB") as plane:
        stored = 0
        with pytest.raises(stowage.UnitFull):
            for i, v in enumerate(vals):
                plane.put("p", [i], {"v": [v]})
                stored += 1
        assert 5 <= stored < 16
        got = plane.get("p", list(range(stored)), ["v"])["v"]
        assert all(np.array_equal(a, b) for a, b in zip(got, vals))


def test_checkpoint_restore_and_shutdown(tmp_path):
    vals = values(10, 1000, 3)
    keys = [f"uid_{i}" for i in range(10)]
    with stowage.local(units=1, memory="16MiB") as plane:
        # A unit started without a checkpoint root takes no checkpoint.
        with pytest.raises(stowage.Unauthorized):
            plane.checkpoint(str(tmp_path / "nope"))
        assert not (tmp_path / "nope").exists()
    with stowage.local(units=1, memory="16MiB", checkpoint_root=str(tmp_path)) as plane:
        plane.put("step", keys, {"x": vals})
        # Nor one outside its root.
        with pytest.raises(stowage.Unauthorized):
            plane.checkpoint("/tmp/stowage-outside-the-root")
        info = plane.checkpoint(str(tmp_path / "ck"))
        assert info[0]["entries"] == 20  # 10 values + 10 row names
        assert info[0]["rows"] == 10
        assert plane.shutdown(5.0) == [[]]
    restore = ["--restore", str(tmp_path / "ck" / "unit-0")]
    with stowage.local(units=1, memory="16MiB", unit_args=restore) as plane:
        assert sorted(plane.list("step")) == sorted(keys)
        got = plane.get("step", keys, ["x"])["x"]
        assert all(np.array_equal(a, b) for a, b in zip(got, vals))


def test_a_tcp_plane_checkpoints_and_shuts_down_over_its_unix_sockets(tmp_path):
    # Units refuse admin requests over tcp; a local plane sends them over
    # the Unix sockets, where its own user is let in.
    with stowage.local(
        units=1, memory="16MiB", transport="tcp", checkpoint_root=str(tmp_path)
    ) as plane:
        plane.put("p", [0], {"x": [np.arange(4)]})
        assert plane.checkpoint(str(tmp_path / "ck"))[0]["entries"] == 1
        assert plane.shutdown(5.0) == [[]]
