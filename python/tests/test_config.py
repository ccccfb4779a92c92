"""stowage.config: the TOML config file, as Python reads it."""

from __future__ import annotations

import ipaddress
import pathlib
import re
import socket

import pytest

import stowage
import stowage.config

ROOT = pathlib.Path(__file__).resolve().parents[2]

DEFAULTS = {
    "units": {
        "count": None,
        "memory": 1 << 30,
        "cpus": 1.0,
        "reservation_lease": 30.0,
        "pin_lease": 30.0,
        "max_connections": 1024,
        "max_handshakes": 128,
        "max_handshakes_per_source": 32,
        "max_session_connections": 64,
        "max_session_holds": 16384,
        "checkpoint_root": None,
        "nixl": False,
        "require_rdma": True,
        "disk": None,
    },
    "placement": {"clusters": "all"},
    "listen": {"host": "127.0.0.1", "tcp_port": 0, "unix_dir": None},
    "auth": {"secret_file": None, "insecure": False},
    "timeouts": {"op": 30.0, "start": 120.0, "stop": 30.0, "frame": 10.0, "handshake": 1.0},
    "client": {"namespace": "default", "transport": "auto", "wait_for_memory": None},
    "metrics": {"enabled": True, "listen": "127.0.0.1:0"},
}


def test_defaults():
    assert stowage.config.load() == DEFAULTS
    assert stowage.config.load(text="") == DEFAULTS
    assert stowage.config.load(text="# nothing set\n") == DEFAULTS


def test_the_example_file_loads(tmp_path):
    cfg = stowage.config.load(ROOT / "examples" / "stowage.toml")
    assert cfg["units"]["count"] == 4
    assert cfg["units"]["memory"] == 1 << 30
    assert cfg["units"]["disk"] == {
        "root": "/local/stowage",
        "capacity": 20 << 30,
        "high_watermark": 0.9,
        "low_watermark": 0.8,
    }
    assert cfg["placement"]["clusters"] == ["train", "inference"]
    assert cfg["listen"]["host"] == "node-ip"
    assert cfg["auth"]["secret_file"] == "/etc/stowage/secret"
    assert cfg["timeouts"]["start"] == 120.0
    assert cfg["client"]["wait_for_memory"] == 10.0
    assert cfg["metrics"] == {"enabled": True, "listen": "127.0.0.1:9464"}
    # Every key of every section is there, and no other.
    for section, keys in DEFAULTS.items():
        assert set(cfg[section]) == set(keys), section
    assert set(cfg) == set(DEFAULTS)
    # A str path works as well as a pathlib.Path.
    assert stowage.config.load(str(ROOT / "examples" / "stowage.toml")) == cfg


def test_the_docs_toml_blocks_load():
    md = (ROOT / "docs" / "config.md").read_text()
    blocks = re.findall(r"^```toml\n(.*?)^```$", md, flags=re.S | re.M)
    assert blocks, "docs/config.md shows no TOML block"
    for block in blocks:
        cfg = stowage.config.load(text=block)
        assert cfg != DEFAULTS
    # The typical job shown there.
    cfg = stowage.config.load(text=blocks[0])
    assert cfg["units"]["memory"] == 8 << 30
    assert cfg["units"]["count"] is None
    assert cfg["placement"]["clusters"] == ["train"]
    assert cfg["timeouts"]["op"] == 60.0


def test_values_are_normalized():
    cfg = stowage.config.load(
        text="""
        [units]
        memory = 1048576
        cpus = 0.25
        pin_lease = "1500ms"
        [units.disk]
        root = "/d"
        capacity = "2GB"
        [client]
        transport = "tcp"
        wait_for_memory = "1m 30s"
        """
    )
    u = cfg["units"]
    assert u["memory"] == 1 << 20 and isinstance(u["memory"], int)
    assert u["cpus"] == 0.25
    assert u["pin_lease"] == 1.5 and isinstance(u["pin_lease"], float)
    assert u["disk"]["capacity"] == 2_000_000_000
    assert u["disk"]["high_watermark"] == 0.9
    assert cfg["client"] == {"namespace": "default", "transport": "tcp", "wait_for_memory": 90.0}


@pytest.mark.parametrize(
    "text, key, phrase",
    [
        ("[units]\nmemroy = '1GiB'\n", "units.memroy", "unknown field `memroy`"),
        ("[timeout]\nop = '1s'\n", "timeout", "unknown field `timeout`"),
        ("[units]\nmemory = 'lots'\n", "units.memory", "not a size"),
        ("[units]\npin_lease = 30\n", "units.pin_lease", "duration string"),
        ("[units.disk]\nroot = '/d'\nlow_watermark = 0.95\n", "units.disk.low_watermark", "below"),
        ("[placement]\nclusters = 'train'\n", "placement.clusters", '["train"]'),
        ("[listen]\nhost = 'localhost'\n", "listen.host", "node-ip"),
        ("[auth]\nsecret_file = 'relative'\n", "auth.secret_file", "absolute"),
        ("[client]\ntransport = 'udp'\n", "client.transport", "unknown variant"),
    ],
)
def test_bad_keys_raise_naming_the_key(tmp_path, text, key, phrase):
    with pytest.raises(stowage.InvalidRequest) as e:
        stowage.config.load(text=text)
    assert e.value.key == key
    assert f"{key}: " in str(e.value)
    assert phrase in str(e.value)
    # From a file: the file is named too.
    path = tmp_path / "stowage.toml"
    path.write_text(text)
    with pytest.raises(stowage.InvalidRequest) as e:
        stowage.config.load(path)
    assert str(e.value).startswith(str(path))
    assert e.value.file == str(path)
    assert e.value.key == key


def test_syntax_error_has_a_position():
    with pytest.raises(stowage.InvalidRequest) as e:
        stowage.config.load(text="[units]\nmemory = \n")
    assert str(e.value).startswith("<config text>:2:")
    assert e.value.key is None


def test_missing_file(tmp_path):
    path = tmp_path / "absent.toml"
    with pytest.raises(stowage.InvalidRequest) as e:
        stowage.config.load(path)
    assert str(path) in str(e.value)
    assert "cannot read" in str(e.value)
    assert e.value.file == str(path)


def test_path_and_text_together():
    with pytest.raises(stowage.InvalidRequest, match="not both"):
        stowage.config.load(ROOT / "examples" / "stowage.toml", text="")


def test_resolve_listen_host():
    assert stowage.config.resolve_listen_host("127.0.0.1") == "127.0.0.1"
    assert stowage.config.resolve_listen_host("0.0.0.0") == "0.0.0.0"
    # "node-ip": an address of this host: a listener binds it.
    ip = stowage.config.resolve_listen_host("node-ip")
    addr = ipaddress.ip_address(ip)
    assert not addr.is_unspecified
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        assert s.getsockname()[0] == ip
    with pytest.raises(stowage.InvalidRequest, match="not a listen host"):
        stowage.config.resolve_listen_host("localhost")
