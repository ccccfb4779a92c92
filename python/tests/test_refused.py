"""A unit that refuses to start tells its launcher why, at once: its
launcher raises InvalidRequest with the unit's own reason instead of
waiting out its start timeout."""

import os
import time

import pytest

import stowage


def _root_of_another_user(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("not root: cannot make a directory another user owns")
    os.chmod(tmp_path, 0o711)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    return theirs


def test_local_with_a_disk_root_another_user_owns_raises_the_units_reason(tmp_path):
    theirs = _root_of_another_user(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(stowage.InvalidRequest) as e:
        stowage.local(units=2, memory="16MiB", disk=str(theirs))
    assert time.monotonic() - t0 < 2.0
    assert str(e.value).startswith("unit 0 refused to start: "), str(e.value)
    assert "owned by uid 65534" in str(e.value) and "chown" in str(e.value), str(e.value)


def test_start_units_with_a_disk_root_another_user_owns_raises_the_units_reason(tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is not installed")
    import stowage.ray

    theirs = _root_of_another_user(tmp_path)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        node = ray.get_runtime_context().get_node_id()
        t0 = time.monotonic()
        with pytest.raises(stowage.ray.UnitRefused) as e:
            stowage.ray.start_units(
                {"units": {"memory": "16MiB", "disk": {"root": str(theirs)}}}, [node], timeout=60
            )
        assert time.monotonic() - t0 < 30.0
        # Typed both ways: a failed placement, and settings that were wrong.
        assert isinstance(e.value, stowage.ray.PlacementError)
        assert isinstance(e.value, stowage.InvalidRequest)
        assert "the unit could not start: " in str(e.value), str(e.value)
        assert "owned by uid 65534" in str(e.value) and "chown" in str(e.value), str(e.value)
    finally:
        ray.shutdown()
