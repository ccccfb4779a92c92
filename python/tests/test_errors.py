"""Bad input raises the right stowage.Error subclass and leaves stored data
intact; unit failures are typed (LostKeys, Timeout, UnitFull)."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from typing import Union

import numpy as np
import pytest

import stowage

from conftest import same, wait_stopped


def test_hierarchy():
    for cls in (
        stowage.UnitFull,
        stowage.TransferFailed,
        stowage.LostKeys,
        stowage.Timeout,
        stowage.NotFound,
        stowage.InvalidRequest,
        stowage.Unauthorized,
        stowage.NotOwner,
        stowage.Unreachable,
    ):
        assert issubclass(cls, stowage.Error) and cls is not stowage.Error
        assert cls.__name__ in stowage.__all__
    assert issubclass(stowage.Error, Exception)
    assert stowage.Error.retryable is False
    assert stowage.Error.__module__ == "stowage"
    # Another session's reservation or pin is not an authentication
    # failure: NotOwner and Unauthorized are apart.
    assert not issubclass(stowage.NotOwner, stowage.Unauthorized)
    assert not issubclass(stowage.Unauthorized, stowage.NotOwner)
    assert stowage.NotOwner is stowage._native.NotOwner


def test_every_exception_of_the_package_is_a_stowage_error():
    """The pure-Python exceptions too, and those that were RuntimeErrors
    still are (callers that caught them that way keep working). stowage.tq
    needs TransferQueue: its RowsLost and CheckpointRefused are checked in
    python/tests_tq."""
    from stowage import _tq_cells

    assert issubclass(_tq_cells.UntrustedCell, stowage.Error)
    assert issubclass(_tq_cells.UntrustedCell, RuntimeError)
    ray = pytest.importorskip("stowage.ray", reason="Ray is not installed")
    assert issubclass(ray.PlacementError, stowage.Error)


def test_row_key_and_its_deprecated_alias():
    assert stowage.RowKey == Union[int, str]
    with pytest.warns(DeprecationWarning, match=r"stowage\.Key is deprecated; use stowage\.RowKey"):
        key = stowage.Key
    assert key is stowage.RowKey
    with pytest.warns(DeprecationWarning, match="RowKey"):
        from stowage import Key
    assert Key is stowage.RowKey
    # Other names are no more there than before.
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        stowage.Nope  # noqa: B018
    assert not hasattr(stowage, "Nope")
    # The new name itself does not warn.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert stowage.RowKey is stowage.RowKey


BASE_KEYS = [0, 1, "base"]


@pytest.fixture
def stored(dp, part):
    """A partition with rows that bad calls must leave alone."""
    dp.put(part, BASE_KEYS, {"x": np.arange(9, dtype=np.int16).reshape(3, 3)})
    return part


def assert_intact(dp, part):
    got = dp.get(part, BASE_KEYS, ["x"])["x"]
    assert same(np.stack(got), np.arange(9, dtype=np.int16).reshape(3, 3))
    assert dp.list(part) == {0: ["x"], 1: ["x"], "base": ["x"]}


BAD_COLUMNS = {
    "complex64": lambda: np.zeros((2, 3), np.complex64),
    "object": lambda: np.array([object(), object()], dtype=object),
    "object jagged": lambda: [np.zeros(3), np.array([1, "a"], dtype=object)],
    "unicode": lambda: np.array(["ab", "cd"]),
    "datetime": lambda: np.zeros(2, "datetime64[s]"),
    "longdouble": lambda: np.zeros(2, np.longdouble),
    "structured": lambda: np.zeros(2, [("a", "i4"), ("b", "f4")]),
    "big endian": lambda: np.zeros((2, 2), ">i4"),
    "non-contiguous": lambda: np.zeros((2, 6), np.float32)[:, ::2],
    "fortran order": lambda: np.asfortranarray(np.zeros((2, 3), np.float32)),
    "non-contiguous jagged": lambda: [np.zeros(4), np.zeros(8)[::2]],
    "too many rows": lambda: np.zeros((3, 2)),
    "too few values": lambda: [np.zeros(2)],
    "0-d dense": lambda: np.float32(1.0),
    "0-d array dense": lambda: np.array(1.0),
    "python list values": lambda: [[1, 2], [3]],
    "bytes": lambda: b"abcd",
}


@pytest.mark.parametrize("case", sorted(BAD_COLUMNS))
def test_bad_columns(dp, stored, case):
    with pytest.raises(stowage.InvalidRequest):
        dp.put(stored, ["new-a", 2], {"ok": np.zeros((2, 2)), "bad": BAD_COLUMNS[case]()})
    # Nothing of the failed put is stored, not even its valid column.
    assert_intact(dp, stored)
    with pytest.raises(stowage.NotFound):
        dp.get(stored, ["new-a"], ["ok"])


@pytest.mark.parametrize(
    "keys",
    [[-1], [2**63], [1.5], [None], [True], [b"raw"], "abc", 5, np.array([[1, 2]]), np.array([0.5])],
    ids=["negative", "2**63", "float", "None", "bool", "bytes", "str", "int", "2-D", "float array"],
)
def test_bad_keys(dp, stored, keys):
    with pytest.raises(stowage.InvalidRequest):
        dp.put(stored, keys, {"x": [np.zeros(1)]})
    with pytest.raises(stowage.InvalidRequest):
        dp.get(stored, keys, ["x"])
    assert_intact(dp, stored)


def test_bad_fields_and_calls(dp, stored):
    with pytest.raises(stowage.InvalidRequest):
        dp.put(stored, [0], {"": [np.zeros(1)]})
    with pytest.raises(stowage.InvalidRequest):
        dp.put(stored, [0], [np.zeros(1)])  # not a dict
    with pytest.raises(stowage.InvalidRequest):
        dp.get(stored, [0], [1])
    with pytest.raises(stowage.InvalidRequest):
        dp.get(stored, [0], ["x"], as_="jax")
    assert_intact(dp, stored)


def test_not_found_names_every_missing_key(dp, stored):
    with pytest.raises(stowage.NotFound) as e:
        dp.get("no-such-partition", [0, "base"], ["x"])
    assert sorted(map(str, e.value.keys)) == sorted(map(str, [(0, "x"), ("base", "x")]))
    assert not e.value.retryable
    with pytest.raises(stowage.NotFound) as e:
        dp.get(stored, [0, "missing", 1], ["x", "y"])
    assert set(e.value.keys) == {("missing", "x"), (0, "y"), ("missing", "y"), (1, "y")}
    assert_intact(dp, stored)


def test_closed_plane_refuses_calls(part):
    plane = stowage.local(units=1, memory="8MiB")
    plane.close()
    assert plane.closed
    with pytest.raises(stowage.InvalidRequest, match="closed"):
        plane.get(part, [0], ["x"])
    plane.close()  # idempotent


def test_unit_full_is_typed_and_stores_nothing(part):
    with stowage.local(units=1, memory="4MiB") as plane:
        plane.put(part, [0], {"x": [np.ones(1000)]})
        with pytest.raises(stowage.UnitFull) as e:
            plane.put(part, [1, 2], {"x": [np.zeros(8 << 20, np.uint8), np.zeros(10)]})
        assert e.value.retryable and e.value.unit == 0
        assert plane.list(part) == {0: ["x"]}
        assert same(plane.get(part, [0], ["x"])["x"][0], np.ones(1000))


def test_views_of_cleared_values_are_full_at_once_and_a_waiting_put_goes_in_once_dropped(part):
    # Issue 37: memory that views of cleared or replaced values hold is
    # used. A put short of it is UnitFull at once (not Busy until its
    # deadline), naming the views; with wait_for_memory it goes in once
    # they are dropped. (The same with separate processes:
    # crates/cli/tests/full_views.rs.)
    with stowage.local(units=1, memory="16MiB") as plane:
        v = np.ones(6 << 20, np.uint8)
        plane.put(part, [0], {"x": [v]})
        views = [plane.get_view(part, [0], "x")]
        plane.put(part, [0], {"x": [v]})  # replaced under the first view
        views.append(plane.get_view(part, [0], "x"))
        assert plane.clear(part, [0]) == 1  # cleared under the second
        with pytest.raises(stowage.UnitFull) as e:
            plane.put(part, [1], {"x": [v]}, timeout=30)
        assert "views of cleared or replaced values" in str(e.value), str(e.value)
        assert "this client's own views" in str(e.value), str(e.value)
        waiting = stowage.connect(plane.directory, timeout=60, wait_for_memory=60)
        done = []
        t = threading.Thread(target=lambda: done.append(waiting.put(part, [1], {"x": [v]})))
        t.start()
        t.join(0.5)
        assert t.is_alive() and not done, "the put went in while the views held the memory"
        views.clear()
        t.join(60)
        assert done == [None], "the waiting put did not go in once the views were dropped"
        assert same(plane.get(part, [1], ["x"])["x"][0], v)


def test_lost_keys_when_a_unit_is_killed(part):
    with stowage.local(units=2, memory="16MiB") as plane:
        keys = list(range(6))
        plane.put(part, keys, {"a": np.arange(6.0), "b": [np.arange(k) for k in keys]})
        plane.put(part, ["s1"], {"a": [np.zeros(())], "b": [np.zeros(1)]}, unit=1)
        os.kill(plane.unit_pids[1], signal.SIGKILL)
        with pytest.raises(stowage.LostKeys) as e:
            plane.get(part, keys, ["a", "b"])
        assert e.value.unit == 1
        assert set(e.value.keys) == {(k, f) for k in (1, 3, 5) for f in ("a", "b")}
        assert not e.value.retryable
        with pytest.raises(stowage.LostKeys) as e:
            plane.get(part, ["s1"], ["a"], unit=1)
        assert e.value.keys == [("s1", "a")]
        with pytest.raises(stowage.LostKeys) as e:
            plane.put(part, [7, 9], {"a": np.zeros(2)})
        assert e.value.unit == 1
        assert sorted(e.value.keys) == [(7, "a"), (9, "a")]
        # The other unit's rows are intact.
        got = plane.get(part, [0, 2, 4], ["a", "b"])
        assert [float(a) for a in got["a"]] == [0.0, 2.0, 4.0]
        assert all(same(b, np.arange(k)) for b, k in zip(got["b"], (0, 2, 4)))


def test_timeout_when_a_unit_stops_answering_and_gil_is_released(part):
    with stowage.local(units=1, memory="8MiB") as plane:
        plane.put(part, [0], {"x": [np.arange(4)]})
        pid = plane.unit_pids[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_stopped(pid)
            errors = []

            def call():
                try:
                    plane.get(part, [0], ["x"], timeout=1.0)
                except stowage.Error as e:
                    errors.append(e)

            t = threading.Thread(target=call)
            t.start()
            spins = 0
            start = time.monotonic()
            while t.is_alive():
                spins += 1  # runs only if the call released the GIL
            elapsed = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGCONT)
        assert len(errors) == 1 and isinstance(errors[0], stowage.Timeout), errors
        assert errors[0].retryable
        assert 0.9 < elapsed < 10
        assert spins > 10_000
        assert same(plane.get(part, [0], ["x"])["x"][0], np.arange(4))


def test_an_unreachable_unit_is_its_own_error_in_plain_words(tmp_path):
    missing = tmp_path / "nothing.sock"
    # Connecting opens nothing: the first call on the unit reaches it.
    plane = stowage.connect([f"unix:{missing}"], timeout=2)
    with pytest.raises(stowage.Unreachable) as e:
        plane.get("p", [0], ["x"])
    err = e.value
    assert err.unit == 0 and err.address == f"unix:{missing}" and err.retryable
    text = str(err)
    assert text.startswith(f"cannot reach unit 0 at unix:{missing}: "), text
    assert "No such file or directory" in text
    # No Rust debug formatting in what users read.
    for debug in ("Broken(", "Some(", "BlobId(", "Timeout {"):
        assert debug not in text, text
    # A tcp port where nothing listens: refused, same type.
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    plane = stowage.connect([f"tcp:127.0.0.1:{port}"], timeout=2)
    with pytest.raises(stowage.Unreachable, match="refused"):
        plane.put("p", [0], {"x": np.zeros(1)})
    # The eager check raises the same.
    with pytest.raises(stowage.Unreachable, match="refused"):
        plane.check_units()


# Every variant of the Rust client's error (stowage_client::Error), by name:
# each arrives in Python as the stowage class of the same name.
CLIENT_ERROR_VARIANTS = (
    "UnitFull",
    "TransferFailed",
    "LostKeys",
    "Timeout",
    "NotFound",
    "Corrupt",
    "KeyCollision",
    "InvalidRequest",
    "Unauthorized",
    "NotOwner",
    "Unreachable",
    "Io",
)


def test_every_client_error_has_its_own_class():
    """Some cannot be provoked from Python (two row keys whose hashes
    collide, a local I/O failure): the mapping is checked on an example of
    each variant."""
    for name in CLIENT_ERROR_VARIANTS:
        cls = getattr(stowage, name)
        assert issubclass(cls, stowage.Error) and cls is not stowage.Error
        assert name in stowage.__all__
        assert cls is getattr(stowage._native, name)
        err = stowage._native._error_of(name)
        assert type(err) is cls, (name, type(err))
    collision = stowage._native._error_of("KeyCollision")
    assert (collision.partition, collision.requested, collision.stored) == ("p", "a", "b")
    assert not collision.retryable
    corrupt = stowage._native._error_of("Corrupt")
    assert corrupt.unit == 0 and corrupt.keys == [(1, "f")]
    with pytest.raises(ValueError):
        stowage._native._error_of("NoSuchVariant")


def test_a_corrupt_disk_copy_raises_corrupt_for_exactly_its_key(tmp_path):
    rng = np.random.default_rng(9)
    vals = [rng.integers(0, 255, 512 * 1024, dtype=np.uint8) for _ in range(16)]
    with stowage.local(units=1, memory="4MiB", disk=str(tmp_path), disk_capacity="64MiB") as plane:
        for i, v in enumerate(vals):
            plane.put("p", [i], {"v": [v]})
        end = time.monotonic() + 10
        while plane.stats()[0]["spilled_blobs"] < 4:
            assert time.monotonic() < end, "nothing spilled"
            time.sleep(0.05)
        (unit_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
        blob = sorted(p for p in unit_dir.iterdir() if p.suffix == ".blob")[0]
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0x40
        blob.write_bytes(bytes(data))
        bad = []
        for i, v in enumerate(vals):
            try:
                got = plane.get("p", [i], ["v"])["v"][0]
            except stowage.Corrupt as e:
                assert e.unit == 0 and e.keys == [(i, "v")] and not e.retryable
                bad.append(i)
            else:
                assert same(got, v), i
        assert len(bad) == 1, bad
