"""_native.Unit: a unit running on threads of this process (what a
stowage.ray actor holds), reached by clients as any unit is, torn down by
stop() with nothing left behind."""

from __future__ import annotations

import os
import re
import stat

import numpy as np
import pytest

import stowage
from stowage import _native


def socket_dir(unit: _native.Unit) -> str:
    return os.path.dirname(unit.uds_addr[len("unix:") :])


def test_a_unit_in_this_process_serves_and_stops_cleanly(tmp_path, part):
    disk = tmp_path / "disk"
    u = _native.Unit("8MiB", tcp="127.0.0.1:0", disk=str(disk), disk_capacity="16MiB")
    sock = socket_dir(u)
    try:
        assert re.fullmatch(r"[0-9a-f]{32}", u.instance_id)
        assert u.pid == os.getpid()
        assert re.fullmatch(r"tcp:127\.0\.0\.1:\d+", u.tcp_addr) and not u.tcp_addr.endswith(":0")
        assert u.running
        # Its socket's directory is its own (owner-only).
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o700
        assert len(os.listdir(disk)) == 1
        # Given tcp and no secret, the unit made one: its own clients prove it.
        assert u.secret is not None and len(u.secret) == 64
        for addr in (u.uds_addr, u.tcp_addr):
            # Connecting is lazy: the first call is refused.
            with stowage.connect(addr, timeout=5) as c:
                with pytest.raises(stowage.Unauthorized):
                    c.stats()
            with stowage.connect(addr, secret=u.secret) as c:
                c.put(part, [1, 2], {"x": [np.arange(3), np.arange(4)]})
                got = c.get(part, [1, 2], ["x"])["x"]
                assert [a.tolist() for a in got] == [[0, 1, 2], [0, 1, 2, 3]]
        s = u.stats()
        assert s["capacity"] == 8 << 20 and s["rows"] == 2
    finally:
        problems = u.stop(10)
    assert problems == []
    assert not u.running
    assert os.listdir(disk) == []
    assert not os.path.exists(sock)
    assert u.stop(1) == []  # idempotent
    with pytest.raises(stowage.Error, match="stopped"):
        u.stats()
    with pytest.raises(stowage.Error):
        stowage.connect(u.uds_addr, timeout=2).get(part, [1], ["x"])


def test_stop_while_a_client_is_connected(part):
    u = _native.Unit("4MiB")
    assert u.tcp_addr is None
    c = stowage.connect(u.uds_addr, timeout=5)
    c.put(part, [0], {"x": [np.arange(2)]})
    assert u.stop(5) == []
    # The unit takes no more work; the client hears an error, not a hang.
    with pytest.raises(stowage.Error):
        c.put(part, [1], {"x": [np.arange(2)]})
    c.close()


def test_a_unit_at_a_given_socket_path(tmp_path, part):
    path = tmp_path / "u.sock"
    u = _native.Unit("4MiB", uds=f"unix:{path}", name="given")
    assert u.uds_addr == f"unix:{path}"
    with stowage.connect(u.uds_addr) as c:
        c.put(part, [0], {"x": [np.arange(2)]})
    assert u.stop(5) == []
    assert not path.exists()
    assert tmp_path.is_dir()  # only the socket is removed, not its directory


def test_bad_arguments_are_refused():
    with pytest.raises(stowage.InvalidRequest, match="tcp must be an address"):
        _native.Unit("4MiB", tcp="somewhere")
    with pytest.raises(stowage.InvalidRequest):
        _native.Unit("lots")
    with pytest.raises(stowage.Error, match="memory must be at least 4 KiB"):
        _native.Unit(1024)


SECRET = "unit-s3cret-Horse-battery-staple"


def test_a_unit_with_a_shared_secret(tmp_path, part, monkeypatch):
    monkeypatch.delenv("STOWAGE_SECRET", raising=False)
    u = _native.Unit("4MiB", tcp="127.0.0.1:0", secret=SECRET)
    try:
        for addr in (u.uds_addr, u.tcp_addr):
            # Connecting is lazy: the first call is refused.
            with stowage.connect(addr, timeout=5) as c:
                with pytest.raises(stowage.Unauthorized):
                    c.stats()
            with stowage.connect(addr, secret=SECRET, timeout=5) as c:
                c.put(part, [0], {"x": [np.arange(2)]})
        # Its own admin requests prove the secret too.
        assert u.stats()["rows"] == 1
    finally:
        assert u.stop(5) == []

    # From an owner-only file (as a launcher's units read it on their node).
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    u = _native.Unit("4MiB", secret_file=str(path))
    try:
        with stowage.connect(u.uds_addr, secret=SECRET, timeout=5) as c:
            assert c.list(part) == {}
    finally:
        assert u.stop(5) == []
    path.chmod(0o644)
    with pytest.raises(stowage.InvalidRequest, match=str(path)):
        _native.Unit("4MiB", secret_file=str(path))
    with pytest.raises(stowage.InvalidRequest):
        _native.Unit("4MiB", secret=SECRET, insecure=True)
    with pytest.raises(stowage.InvalidRequest):
        _native.Unit("4MiB", secret="short")


def test_beyond_loopback_a_unit_serves_only_with_a_secret():
    # Given none, the unit generates one (loopback or not, TCP is never
    # served without one unless insecure=True): a client without it is
    # refused.
    u = _native.Unit("4MiB", tcp="0.0.0.0:0", mlock=False)
    try:
        assert u.secret is not None
        port = u.tcp_addr.rsplit(":", 1)[1]
        # Connecting is lazy: the first call is refused.
        with stowage.connect([f"tcp:127.0.0.1:{port}"], timeout=5) as c:
            with pytest.raises(stowage.Unauthorized):
                c.stats()
        with stowage.connect([f"tcp:127.0.0.1:{port}"], secret=u.secret, timeout=5) as c:
            assert len(c.stats()) == 1
    finally:
        assert u.stop(10.0) == []
