"""The ``conf.backend.Stowage`` block of a TransferQueue config
(:mod:`stowage.tq`): its defaults and checks, the stowage config the units
start from, the secrets it names, and the directory published in it with
its secret redacted from every printed form."""

from __future__ import annotations

import os
import stat
from typing import Any, Dict, Mapping, Optional

import stowage

from . import _compat, _tq_cells

#: The name under which the manager and the provider are registered, and
#: the key of the config block (``conf.backend.Stowage``).
BACKEND = "Stowage"

#: Defaults of the ``conf.backend.Stowage`` block (docs: README, "With
#: TransferQueue").
DEFAULTS: Dict[str, Any] = {
    "count": 2,  # storage units
    "memory": "1GiB",  # per unit (also reserved as Ray memory)
    # Copies of every row, each on another unit; None: the directory's (1
    # for the units started here). Every client of the plane uses it.
    "replicas": None,
    # Ray CPUs per unit actor: none by default. A unit serves on its own
    # threads and needs no Ray CPU to do it; TransferQueue's controller
    # already takes one, and on a 2-CPU machine a unit that took more
    # would leave no room for a 1-CPU task.
    "cpus": 0,
    "spread": False,  # False: every unit on the initializing process's node
    "listen_host": "127.0.0.1",  # "node-ip" for units that other hosts reach
    "disk": None,  # {root, capacity, high_watermark, low_watermark}
    # Where tq.save_checkpoint may write; None: default_checkpoint_root().
    "checkpoint_root": None,
    "secret_file": None,  # the units' shared secret (each node reads it)
    "insecure": False,
    # Store and unpickle non-tensor values unauthenticated on a plane with
    # no secret (anyone who can write the units' rows then runs code in
    # the job's readers); with a secret, cells are always authenticated.
    "insecure_pickles": False,
    # The secret of the plane that saved the checkpoints to load, when not
    # this plane's: their pickled cells are checked under it and re-tagged.
    "checkpoint_secret_file": None,
    "namespace": "transfer_queue",
    "timeout": 120.0,  # seconds, every put/get/clear
    "start_timeout": 120.0,
    "stop_timeout": 30.0,
    "directory": None,  # written by the provider; or given: external units
}


def _plain(x: Any) -> Any:
    """A DictConfig/ListConfig as plain dicts and lists (other values as they are)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - TransferQueue depends on omegaconf
        return x
    if isinstance(x, (DictConfig, ListConfig)):
        return OmegaConf.to_container(x, resolve=True)
    return x


def _block(config: Any) -> Dict[str, Any]:
    """The ``conf.backend.Stowage`` block over the defaults; unknown keys
    (typos) are errors."""
    given = _plain(config) or {}
    if not isinstance(given, Mapping):
        raise stowage.InvalidRequest(
            f"backend.{BACKEND} must be a mapping, not {type(given).__name__}"
        )
    unknown = sorted(set(given) - set(DEFAULTS) - {"zmq_info"})
    if unknown:
        raise stowage.InvalidRequest(
            f"backend.{BACKEND}: unknown key {unknown[0]!r} (the keys are {sorted(DEFAULTS)})"
        )
    return {**DEFAULTS, **given}


def _unit_config(block: Mapping[str, Any]) -> Dict[str, Any]:
    """The stowage config (docs/config.md sections) for start_units."""
    units: Dict[str, Any] = {"memory": block["memory"], "cpus": float(block["cpus"])}
    if block["replicas"] is not None:
        units["replicas"] = block["replicas"]
    if block["checkpoint_root"] is not None:
        units["checkpoint_root"] = os.fspath(block["checkpoint_root"])
    disk = block["disk"]
    if disk is not None:
        if isinstance(disk, (str, os.PathLike)):
            disk = {"root": os.fspath(disk)}
        units["disk"] = dict(disk)
    auth: Dict[str, Any] = {}
    if block["insecure"]:
        auth["insecure"] = True
    if block["secret_file"] is not None:
        auth["secret_file"] = os.fspath(block["secret_file"])
    return {
        "units": units,
        "listen": {"host": str(block["listen_host"])},
        "auth": auth,
        "timeouts": {"start": float(block["start_timeout"]), "stop": float(block["stop_timeout"])},
    }


def _client_secret(block: Mapping[str, Any]) -> Optional[bytes]:
    if block["secret_file"] is None:
        return None  # stowage.connect reads STOWAGE_SECRET
    with open(block["secret_file"], "rb") as f:
        return f.read().rstrip(b"\r\n")


def _checkpoint_cell_key(block: Mapping[str, Any]) -> Optional[bytes]:
    """The cell key of ``checkpoint_secret_file`` (the secret of the plane
    that saved the checkpoints to load), or None. The file must be
    owner-only, as every secret file."""
    path = block["checkpoint_secret_file"]
    if path is None:
        return None
    path = os.fspath(path)
    with open(path, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & 0o077:
            raise stowage.InvalidRequest(
                f"backend.{BACKEND}.checkpoint_secret_file {path} may be read or written by other "
                f"users (mode {stat.S_IMODE(mode):03o}); make it owner-only: chmod 600 {path}"
            )
        secret = f.read(4099).rstrip(b"\r\n")
    if len(secret) < 16:
        raise stowage.InvalidRequest(
            f"backend.{BACKEND}.checkpoint_secret_file {path} holds {len(secret)} bytes; a secret "
            f"has at least 16"
        )
    return _tq_cells.cell_key_of(secret)


class _Redacted:
    """A secret kept in TransferQueue's config (which it logs whole at
    INFO, and stores in its controller): its ``str``/``repr`` (and YAML
    form) are ``<redacted>``, but it pickles with its value, so the
    processes that read the stored config still get it
    (:func:`_reveal_directory`). TransferQueue's config allows objects
    (``allow_objects``)."""

    __slots__ = ("value",)

    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return "'<redacted>'"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        return (_Redacted, (self.value,))


def _register_yaml_redaction() -> None:
    try:
        _compat.omegaconf_dumper().add_representer(
            _Redacted, lambda dumper, _v: dumper.represent_str("<redacted>")
        )
    except Exception:  # noqa: BLE001  # pragma: no cover - another omegaconf; str/repr stay redacted
        pass


def _redact_directory(directory: Mapping[str, Any]) -> Dict[str, Any]:
    """``directory`` with its secret (``secret_hex``) wrapped so that no
    printed config shows it."""
    d = dict(directory)
    if isinstance(d.get("secret_hex"), str):
        d["secret_hex"] = _Redacted(d["secret_hex"])
    return d


def _reveal_directory(directory: Mapping[str, Any]) -> Dict[str, Any]:
    """The directory :func:`_redact_directory` wrapped, as
    :func:`stowage.connect` reads it."""
    d = dict(directory)
    if isinstance(d.get("secret_hex"), _Redacted):
        d["secret_hex"] = d["secret_hex"].value
    return d


def _publish_directory(conf: Any, directory: Mapping[str, Any]) -> None:
    """Writes ``directory`` to ``conf.backend.Stowage.directory``, its
    secret redacted from every printed form."""
    from omegaconf import DictConfig, flag_override

    node = conf.backend[BACKEND]
    _register_yaml_redaction()
    if isinstance(node, DictConfig):
        with flag_override(node, "allow_objects", True):
            node.directory = _redact_directory(directory)
    else:
        node.directory = _redact_directory(directory)
