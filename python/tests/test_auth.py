"""The shared secret from Python: stowage.local and stowage.connect with
``secret=`` or STOWAGE_SECRET, against real unit processes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import stowage

from conftest import (
    NO_ENTRY,
    NO_SECRET,
    assert_other_user_refused,
    can_switch_user,
    same,
    stowage_as_other_user,
)

SECRET = "py-s3cret-Horse-battery-staple-99"
WRONG = "py-not-the-secret-long-enough-000"
PY = [sys.executable, "-m", "stowage"]


@pytest.fixture(autouse=True)
def no_secret_in_env(monkeypatch):
    monkeypatch.delenv("STOWAGE_SECRET", raising=False)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_local_plane_with_a_secret_serves_only_clients_that_prove_it(transport):
    with stowage.local(units=1, memory="16MiB", transport=transport, secret=SECRET) as dp:
        dp.put("p", [1, "k"], {"x": [np.arange(5), np.arange(3.0)]})
        for wrong in (None, WRONG, WRONG.encode()):
            # Connecting is lazy: the first call on the unit is refused.
            with stowage.connect(dp.units, secret=wrong, timeout=5) as c:
                with pytest.raises(stowage.Unauthorized) as e:
                    c.get("p", [1], ["x"])
            assert "shared secret" in str(e.value)
            assert SECRET not in str(e.value) and WRONG not in str(e.value)
        # The refused clients touched nothing.
        got = dp.get("p", [1, "k"], ["x"])["x"]
        assert same(got[0], np.arange(5)) and same(got[1], np.arange(3.0))
        # The right secret, as str or bytes.
        for right in (SECRET, SECRET.encode()):
            with stowage.connect(dp.units, secret=right, timeout=5) as c:
                assert same(c.get("p", [1], "x")["x"][0], np.arange(5))
                assert SECRET not in repr(c.stats())


def test_the_secret_comes_from_the_environment_by_default(monkeypatch):
    monkeypatch.setenv("STOWAGE_SECRET", SECRET)
    with stowage.local(units=1, memory="16MiB") as dp:
        dp.put("p", [0], {"x": [np.arange(4)]})
        with stowage.connect(dp.units, timeout=5) as c:
            assert same(c.get("p", [0], "x")["x"][0], np.arange(4))
        monkeypatch.delenv("STOWAGE_SECRET")
        with stowage.connect(dp.units, timeout=5) as c:
            with pytest.raises(stowage.Unauthorized):
                c.get("p", [0], ["x"])
        # An explicit secret wins over the environment.
        monkeypatch.setenv("STOWAGE_SECRET", WRONG)
        with stowage.connect(dp.units, secret=SECRET, timeout=5) as c:
            assert c.list("p") == {0: ["x"]}


def test_a_client_with_a_secret_refuses_a_unit_without_one():
    with stowage.local(units=1, memory="16MiB", insecure=True) as dp:
        with stowage.connect(dp.units, secret=SECRET, timeout=5) as c:
            with pytest.raises(stowage.Unauthorized) as e:
                c.put("p", [0], {"x": [np.arange(3)]})
        assert "without a secret" in str(e.value)


def test_short_or_odd_secrets_are_invalid():
    with pytest.raises(stowage.InvalidRequest) as e:
        stowage.connect(["unix:/nonexistent.sock"], secret="short")
    assert "at least 16" in str(e.value) and "short" not in str(e.value)
    with pytest.raises(stowage.InvalidRequest):
        stowage.connect(["unix:/nonexistent.sock"], secret=1234567890123456789)


def test_a_unit_with_a_secret_file_never_shows_the_secret(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    sock = tmp_path / "u.sock"
    log = tmp_path / "unit.log"
    with open(log, "w") as err:
        p = subprocess.Popen(
            [
                *PY,
                "unit",
                "--memory",
                "16MiB",
                "--no-mlock",
                "--listen",
                f"unix:{sock}",
                "--listen",
                "tcp:127.0.0.1:0",
                "--secret-file",
                str(secret_file),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "RUST_LOG": "debug"},
        )
    try:
        ready = p.stdout.readline()
        assert ready.startswith("READY "), ready
        tcp = next(w for w in ready.split() if w.startswith("tcp="))[4:]
        addrs = [f"unix:{sock}", f"tcp:{tcp}"]
        with stowage.connect(addrs, secret=SECRET, timeout=5) as c:
            c.put("p", [0, 1], {"x": [np.arange(3), np.arange(4)]})
        for addr in addrs:
            with stowage.connect([addr], timeout=5) as c:
                with pytest.raises(stowage.Unauthorized):
                    c.get("p", [0], ["x"])
        r = subprocess.run(
            [*PY, "stats", *addrs],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "STOWAGE_SECRET": SECRET},
        )
        assert r.returncode == 0 and "2 rows" in r.stdout, r.stdout + r.stderr
        assert SECRET not in r.stdout + r.stderr
        r = subprocess.run([*PY, "stats", addrs[0]], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "shared secret" in r.stderr, r.stderr
        with stowage.connect(addrs, secret=SECRET, timeout=5) as c:
            assert same(c.get("p", [1], "x")["x"][0], np.arange(4))
    finally:
        p.kill()
        p.wait(timeout=10)
    logged = log.read_text()
    assert "refused a connection before its Hello" in logged
    assert SECRET not in logged and SECRET not in ready


def test_a_unit_beyond_loopback_needs_a_secret_or_insecure():
    r = subprocess.run(
        [*PY, "unit", "--memory", "4MiB", "--no-mlock", "--listen", "tcp:0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode != 0 and "--insecure" in r.stderr, r.stderr


# -- another user of this host (issue 21): uid 65534 via setpriv -------------

needs_setpriv = pytest.mark.skipif(
    not can_switch_user(), reason="needs root and setpriv to play another user"
)


@needs_setpriv
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_stowage_local_refuses_another_user_and_serves_its_own(transport):
    with stowage.local(units=1, memory="16MiB", transport=transport) as dp:
        d = dp.directory
        assert len(d["secret_hex"]) == 128, "a generated secret, in the directory"
        (u,) = d["units"]
        assert_other_user_refused(stowage_as_other_user("stats", u["tcp"]), NO_SECRET)
        assert_other_user_refused(stowage_as_other_user("stats", u["uds"]), NO_ENTRY)
        # The plane's own client, and another of this user given the
        # directory (in memory), work; a client without the secret does not.
        dp.put("p", [0], {"x": [np.arange(3)]})
        with stowage.connect(d, transport="tcp", timeout=10) as c:
            assert same(c.get("p", [0], "x")["x"][0], np.arange(3))
        with stowage.connect([u["tcp"]], timeout=5) as c:
            with pytest.raises(stowage.Unauthorized):
                c.get("p", [0], ["x"])
    # The control: an insecure plane (every plane before) serves the other
    # user, so the refusals above are the secret's.
    with stowage.local(units=1, memory="16MiB", insecure=True) as open_dp:
        assert "secret_hex" not in open_dp.directory
        r = stowage_as_other_user("stats", open_dp.directory["units"][0]["tcp"])
        assert r.returncode == 0 and "bytes used" in r.stdout, r.stdout + r.stderr


@needs_setpriv
def test_an_in_process_unit_on_tcp_refuses_another_user():
    u = stowage._native.Unit("4MiB", tcp="127.0.0.1:0", mlock=False)
    try:
        assert u.secret is not None
        assert_other_user_refused(stowage_as_other_user("stats", u.tcp_addr), NO_SECRET)
        with stowage.connect(u.tcp_addr, secret=u.secret, timeout=5) as c:
            c.put("p", [0], {"x": [np.arange(2)]})
    finally:
        assert u.stop(10.0) == []


def test_a_directory_file_with_a_secret_must_be_owner_only(tmp_path):
    with stowage.local(units=1, memory="16MiB") as dp:
        path = tmp_path / "units.json"
        path.write_text(__import__("json").dumps(dp.directory))
        path.chmod(0o644)
        with pytest.raises(stowage.InvalidRequest) as e:
            stowage.connect(str(path), timeout=5)
        assert "chmod 600" in str(e.value)
        assert dp.directory["secret_hex"] not in str(e.value)
        path.chmod(0o600)
        with stowage.connect(str(path), timeout=5) as c:
            assert len(c.stats()) == 1


def test_an_insecure_local_plane_cannot_have_a_secret():
    with pytest.raises(stowage.InvalidRequest):
        stowage.local(units=1, memory="16MiB", insecure=True, secret=SECRET)
