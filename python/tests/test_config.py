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
        "replicas": 1,
        "memory": 1 << 30,
        "cpus": 0.0,
        "reservation_lease": 30.0,
        "pin_lease": 30.0,
        "max_connections": 16384,
        "max_sessions": 16384,
        "threads": 0,
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
    "metrics": {"enabled": True, "listen": "127.0.0.1:0", "token_file": None},
}


def test_defaults():
    assert stowage.config.load() == DEFAULTS
    assert stowage.config.load(text="") == DEFAULTS
    assert stowage.config.load(text="# nothing set\n") == DEFAULTS


def test_the_example_file_loads(tmp_path):
    cfg = stowage.config.load(ROOT / "examples" / "stowage.toml")
    assert cfg["units"]["count"] == 4
    assert cfg["units"]["replicas"] == 2
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
    assert cfg["metrics"] == {
        "enabled": True,
        "listen": "127.0.0.1:9464",
        "token_file": "/etc/stowage/metrics.token",
    }
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


# A config given as a dict of sections (what stowage.ray.start_units takes)
# is checked by the extension module as a file is.


def test_a_dict_is_checked_as_a_file_is():
    from_text = stowage.config.load(
        text="""
        [units]
        memory = "16MiB"
        pin_lease = "1500ms"
        [units.disk]
        root = "/d"
        [timeouts]
        start = "1m"
        [client]
        wait_for_memory = "1m 30s"
        """
    )
    from_dict = stowage._native.load_config(
        mapping={
            "units": {"memory": "16MiB", "pin_lease": "1500ms", "disk": {"root": "/d"}},
            "timeouts": {"start": "1m"},
            "client": {"wait_for_memory": "1m 30s"},
        }
    )
    assert from_dict == from_text
    # What load returned goes back in unchanged: durations as seconds,
    # sizes as bytes, None for unset keys.
    assert stowage._native.load_config(mapping=from_text) == from_text
    assert stowage._native.load_config(mapping=DEFAULTS) == DEFAULTS
    assert stowage._native.load_config(mapping={}) == DEFAULTS
    example = stowage.config.load(ROOT / "examples" / "stowage.toml")
    assert stowage._native.load_config(mapping=example) == example
    # A duration given as a number is seconds.
    cfg = stowage._native.load_config(
        mapping={"units": {"pin_lease": 2, "reservation_lease": 0.25}}
    )
    assert cfg["units"]["pin_lease"] == 2.0 and cfg["units"]["reservation_lease"] == 0.25


@pytest.mark.parametrize(
    "mapping, key, phrase",
    [
        ({"units": {"memroy": "1GiB"}}, "units.memroy", "unknown field `memroy`"),
        ({"timeout": {"op": "1s"}}, "timeout", "unknown field `timeout`"),
        ({"units": {"memory": "lots"}}, "units.memory", "not a size"),
        ({"units": {"memory": 0}}, "units.memory", "more than 0"),
        ({"units": {"pin_lease": "soon"}}, "units.pin_lease", "not a duration"),
        ({"units": {"disk": {"capacity": "1GiB"}}}, "units.disk", "missing field `root`"),
        (
            {"units": {"disk": {"root": "/d", "low_watermark": 0.95}}},
            "units.disk.low_watermark",
            "below",
        ),
        ({"auth": {"secret_file": "relative"}}, "auth.secret_file", "absolute"),
        ({"client": {"transport": "udp"}}, "client.transport", "unknown variant"),
    ],
)
def test_bad_dict_keys_raise_naming_the_key(mapping, key, phrase):
    with pytest.raises(stowage.InvalidRequest) as e:
        stowage._native.load_config(mapping=mapping)
    assert e.value.key == key
    assert str(e.value).startswith(f"<config>: {key}: ")
    assert phrase in str(e.value)


@pytest.mark.parametrize(
    "mapping, phrase",
    [
        ({"units": {"pin_lease": -1}}, "units.pin_lease: a duration in seconds is 0 or more"),
        ({"units": {"memory": object()}}, "units.memory: a config value is a str"),
        ({"units": {1: 2}}, "units: a key is a str"),
        (["units"], "config must be a mapping of sections"),
    ],
)
def test_dict_values_of_no_config_type_are_refused(mapping, phrase):
    with pytest.raises(stowage.InvalidRequest, match=re.escape(phrase)):
        stowage._native.load_config(mapping=mapping)
