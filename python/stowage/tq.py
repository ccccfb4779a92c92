"""stowage as a TransferQueue storage backend (``transferqueue==0.1.11``).

Importing this module registers, in this process:

- ``StowageStorageManager`` with TransferQueue's ``StorageManagerFactory``
  under ``"Stowage"``: a full storage manager (not the per-cell KV path),
  so one ``put_data`` moves a batch's columns to each unit in one round;
- a bootstrap provider ``"Stowage"`` (``StorageBootstrapProvider``) that
  ``tq.init`` calls: it starts the storage units as Ray actors
  (:func:`stowage.ray.start_units`) and publishes their directory in
  ``conf.backend.Stowage.directory``, which every attaching process reads
  from the controller's stored config.

Switch a TransferQueue job to stowage with one line of its config::

    backend:
      storage_backend: Stowage
      Stowage:            # optional; every key has a default
        memory: 4GiB      # per unit
        count: 2

Every process that runs a TransferQueue client needs this module
imported. Ray workers (tasks and actors) get it through
:func:`setup_worker` (``worker_process_setup_hook``, which imports it as
soon as the worker imports ``transfer_queue``); for drivers you do not
control, set ``RAY_RUNTIME_ENV_HOOK=stowage.tq.ray_runtime_env_hook`` in
their environment, which adds that hook at every ``ray.init``.

Rows are TransferQueue global indexes, partitions are TransferQueue
partitions, fields are fields. Non-tensor values (strings, dicts, numpy
object or bytes arrays, ``NonTensorStack``/``NonTensorData``) are stored as
pickles (protocol 5) in uint8 values, marked as such in the controller's
per-cell ``custom_backend_meta``, each with an HMAC-SHA-256 tag under a key
derived from the plane's shared secret that binds it to its namespace,
partition, row and field; a get unpickles a cell only after its tag was
checked (:mod:`stowage._tq_cells`, :class:`UntrustedCell`). Without a
secret, pickled cells are refused unless ``insecure_pickles: true``. CUDA
tensors are copied to host memory before a put (no GPU-direct path).

Checkpoints are written only under ``checkpoint_root``: by default a
private (0700) directory of the user in the job's temporary directory
(:func:`default_checkpoint_root`; a fresh private one when another user
took that name first), never ``/``.

The directory's secret (``secret_hex``) is kept in the config wrapped so
that it prints as ``<redacted>``: TransferQueue logs its whole config.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import secrets
import stat
import tempfile
import threading
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

import stowage

from . import _compat, _tq_cells
from ._tq_cells import UntrustedCell
from .tq_worker import ray_runtime_env_hook, setup_worker

logger = logging.getLogger("stowage.tq")

__all__ = [
    "BACKEND",
    "CheckpointRefused",
    "RowsLost",
    "StowageStorage",
    "StowageStorageManager",
    "UntrustedCell",
    "default_checkpoint_root",
    "initialize_stowage_storage",
    "ray_runtime_env_hook",
    "setup_worker",
]

#: The name under which the manager and the provider are registered, and
#: the key of the config block (``conf.backend.Stowage``).
BACKEND = "Stowage"

#: Defaults of the ``conf.backend.Stowage`` block (docs: README, "With
#: TransferQueue").
DEFAULTS: Dict[str, Any] = {
    "count": 2,  # storage units
    "memory": "1GiB",  # per unit (also reserved as Ray memory)
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

# The mark of a pickled non-tensor value in custom_backend_meta (the stored
# bytes carry their own head and tag: stowage._tq_cells).
_PICKLE_TAG = "stowage-pickle5"

_CHECKPOINT_SUBDIR = "stowage"
_CHECKPOINT_INFO = "stowage_checkpoint.json"


class RowsLost(stowage.Error, RuntimeError):
    """Rows whose storage unit died (or was replaced): their values are
    gone. ``partition``, ``global_indexes`` (the lost rows asked for) and
    ``unit`` (its index) say which; the stowage error (:class:`stowage.LostKeys`)
    is the cause. A :class:`stowage.Error` (and, as before, a
    ``RuntimeError``)."""

    def __init__(self, partition: str, global_indexes: List[int], unit: Optional[int], op: str):
        self.partition = partition
        self.global_indexes = global_indexes
        self.unit = unit
        super().__init__(
            f"stowage {op}: storage unit {unit} is gone, and with it the rows "
            f"{_short_list(global_indexes)} of partition {partition!r} "
            f"({len(global_indexes)} lost rows asked for); re-produce them"
        )


class CheckpointRefused(stowage.Error, RuntimeError):
    """A checkpoint that ``tq.load_checkpoint`` refused before changing
    anything: its ``stowage_checkpoint.json`` names a path outside the
    checkpoint or sizes it wrongly, or a pickled cell in it does not carry
    a right tag (changed, or saved under another secret: see
    ``checkpoint_secret_file``). A :class:`stowage.Error` (and, as before,
    a ``RuntimeError``)."""


def _short_list(xs: Sequence[Any], n: int = 20) -> str:
    xs = list(xs)
    if len(xs) <= n:
        return str(xs)
    return "[" + ", ".join(map(str, xs[:n])) + f", ... ({len(xs) - n} more)]"


# -- configuration -----------------------------------------------------------------


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


#: The name of the default checkpoint root, in the temporary directory.
_DEFAULT_ROOT_NAME = "stowage-tq-checkpoints-{uid}"


def default_checkpoint_root() -> str:
    """The units' checkpoint root when ``checkpoint_root`` is not given:
    ``<tmp>/stowage-tq-checkpoints-<uid>``, where ``<tmp>`` is this
    process's temporary directory (``$TMPDIR``, else ``/tmp``), created
    owner-only (0700) if missing. ``tq.save_checkpoint(dir)`` is then
    refused for a ``dir`` outside it: give ``checkpoint_root`` (a directory
    only you can write, on every unit's host) to save elsewhere.

    Refused (:class:`stowage.InvalidRequest`) if that path exists and is
    not a directory of this user that only this user can use (e.g. another
    user created it first, or it is a symbolic link);
    :func:`initialize_stowage_storage` then falls back to a fresh private
    directory (:func:`_fallback_checkpoint_root`) instead of failing."""
    uid = os.getuid()
    path = os.path.join(tempfile.gettempdir(), _DEFAULT_ROOT_NAME.format(uid=uid))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        what = (
            "a symbolic link"
            if stat.S_ISLNK(st.st_mode)
            else "not a directory"
            if not stat.S_ISDIR(st.st_mode)
            else f"owned by uid {st.st_uid}"
            if st.st_uid != uid
            else f"open to other users (mode {stat.S_IMODE(st.st_mode):03o})"
        )
        raise stowage.InvalidRequest(
            f"the default checkpoint root {path} is {what}, so it is not private to this user; "
            f"remove it, or set backend.{BACKEND}.checkpoint_root to a directory that only you "
            f"can write"
        )
    return path


def _fallback_checkpoint_root() -> str:
    """The checkpoint root of a bootstrap that gave none: the default root
    (:func:`default_checkpoint_root`), or, when that is refused (another
    local user made it first, or it is a link), a fresh private (0700)
    directory ``<tmp>/stowage-tq-checkpoints-<uid>-XXXXXXXX`` of this job,
    with a warning naming the refused path: a name another user can take
    must not keep a job from starting. Nothing is written into the refused
    path. (A ``checkpoint_root`` the user configured is never replaced: an
    unsafe one is an error.)"""
    try:
        return default_checkpoint_root()
    except stowage.InvalidRequest as e:
        path = tempfile.mkdtemp(prefix=_DEFAULT_ROOT_NAME.format(uid=os.getuid()) + "-")
        logger.warning(
            "%s; checkpoints of this job go to the fresh private directory %s instead "
            "(set backend.%s.checkpoint_root to choose one)",
            e,
            path,
            BACKEND,
        )
        return path


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


# -- bootstrap -------------------------------------------------------------------


class StowageStorage:
    """What the bootstrap provider returns (TransferQueue keeps it in
    ``_TQ_STORAGE``): the started units. :meth:`close` stops them (every
    unit's teardown, then its actor is killed); it runs by itself when the
    object is dropped, which ``tq.close()`` does, and at interpreter exit.
    Units given by an external directory are not stopped."""

    def __init__(self, units: Any, directory: Mapping[str, Any], stop_timeout: float):
        self.units = units
        self.directory = dict(directory)
        self._finalizer = weakref.finalize(self, StowageStorage._stop, units, stop_timeout)

    @staticmethod
    def _stop(units: Any, timeout: float) -> None:
        if units is None:
            return
        try:
            import stowage.ray

            problems = stowage.ray.stop_units(units, timeout=timeout)
            if any(problems):
                logger.warning("stopping the stowage units: %s", problems)
        except Exception as e:  # noqa: BLE001 - teardown never raises
            logger.warning("stopping the stowage units failed: %r", e)

    def close(self) -> None:
        """Stop the units (idempotent, never raises)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __repr__(self) -> str:
        n = len(self.directory.get("units", ()))
        return f"<stowage.tq.StowageStorage {n} units{' (closed)' if self.closed else ''}>"


def _plan_nodes(block: Mapping[str, Any]) -> List[str]:
    import ray

    here = ray.get_runtime_context().get_node_id()
    count = int(block["count"])
    if count < 1:
        raise stowage.InvalidRequest(f"backend.{BACKEND}.count must be at least 1, not {count}")
    if not block["spread"]:
        return [here] * count
    alive = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    order = [here] + [n for n in alive if n != here]
    return [order[i % len(order)] for i in range(count)]


def _controller_cpus() -> float:
    """The Ray CPUs TransferQueue's controller actor reserves (1 in
    transferqueue 0.1.11)."""
    try:
        return float(_compat.controller_default_options().get("num_cpus", 1))
    except Exception:  # noqa: BLE001 - another TransferQueue: assume Ray's default
        return 1.0


def _abandon_controller() -> None:
    """After a failed bootstrap: kill the controller tq.init created and
    forget it, so that later tq.init calls start afresh instead of waiting
    forever for a config that never comes."""
    try:
        import ray

        ctl = _compat.controller()
        if ctl is not None:
            ray.kill(ctl, no_restart=True)
        _compat.forget_controller()
    except Exception as e:  # noqa: BLE001 - best effort; the original error matters
        logger.warning(
            "could not remove TransferQueue's controller after a failed bootstrap: %r", e
        )


def initialize_stowage_storage(conf: Any) -> StowageStorage:
    """TransferQueue's bootstrap provider for ``storage_backend: Stowage``.

    Starts ``count`` units as Ray actors (``stowage.ray.start_units``) from
    ``conf.backend.Stowage`` and writes their directory to
    ``conf.backend.Stowage.directory``; with a ``directory`` given there
    (external units, e.g. from ``stowage up``), starts nothing. On any
    failure, stops what it started and removes TransferQueue's controller
    before re-raising."""
    units = None
    try:
        import stowage.ray

        if conf.backend.get(BACKEND) is None:
            conf.backend[BACKEND] = {}
        block = _block(conf.backend[BACKEND])
        if block["directory"] is not None:
            directory = stowage._directory_of(block["directory"])
            if directory is None:
                raise stowage.InvalidRequest(
                    f"backend.{BACKEND}.directory must be a directory (a dict or a JSON file), "
                    f"not {block['directory']!r}"
                )
            _publish_directory(conf, directory)
            return StowageStorage(None, directory, float(block["stop_timeout"]))
        if block["checkpoint_root"] is None:
            block["checkpoint_root"] = _fallback_checkpoint_root()
            conf.backend[BACKEND].checkpoint_root = block["checkpoint_root"]
        # Within start_timeout: up, or a PlacementError naming what Ray
        # lacks (the CPUs and memory each unit needs against what its node
        # has free, and what the cluster's tasks and actors wait for).
        units = stowage.ray.start_units(_unit_config(block), _plan_nodes(block))
        _publish_directory(conf, units.directory)
        logger.info("started %d stowage units for TransferQueue", len(units))
        stowage.ray._warn_if_no_cpu_is_left(
            _controller_cpus() + float(block["cpus"]) * len(units),
            f"TransferQueue's controller and {len(units)} stowage unit(s)",
        )
        return StowageStorage(units, units.directory, float(block["stop_timeout"]))
    except BaseException:
        if units is not None:
            StowageStorage._stop(units, float(DEFAULTS["stop_timeout"]))
        _abandon_controller()
        raise


# -- values ----------------------------------------------------------------------

# torch dtypes stowage stores as they are (others are pickled).
_TORCH_DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
)


#: ``seal(position, value)``: the stored cell of a non-tensor value at a
#: batch position (see :func:`stowage._tq_cells.seal`).
Seal = Callable[[int, Any], np.ndarray]


def _host(t: Any) -> Any:
    """A CPU, contiguous, grad-free version of tensor ``t`` (a copy only
    when needed: CUDA and other devices are copied to host memory)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def _encode_rows(name: str, col: Any, n: int, seal: Seal) -> Tuple[Any, bool]:
    """A column for DataPlane.put and whether it is pickled.

    Tensors (dense, nested jagged or strided; CUDA ones copied to host)
    are stored as they are, one value per row with its dtype and shape.
    Anything else — lists (TensorDict's LinkedList), numpy object/bytes
    arrays, NonTensorStack/NonTensorData, tensors of dtypes stowage does not
    store — is stored one pickle (protocol 5) per row, as the uint8 value
    ``seal(position, value)`` makes: a head, an HMAC-SHA-256 tag under the
    plane's cell key over the cell's namespace, partition, row, field and
    pickle, then the pickle (:mod:`stowage._tq_cells`). The manager notes
    it in the controller's custom_backend_meta, and a get unpickles only
    cells so marked whose tag it checked first: whoever can write a unit's
    rows (another local user, without the secret) cannot make a reader
    unpickle bytes of their choosing, nor move a good cell to another row.
    """
    import torch

    if isinstance(col, torch.Tensor):
        if str(col.dtype).replace("torch.", "") not in _TORCH_DTYPES:
            return [seal(i, r) for i, r in enumerate(col.unbind())], True
        if col.is_nested:
            if col.device.type != "cpu":
                col = col.cpu()
            rows = [_host(r) for r in col.unbind()]
        else:
            rows = _host(col)
        return rows, False
    try:
        from tensordict import NonTensorData, NonTensorStack
    except ImportError:  # pragma: no cover
        NonTensorData = NonTensorStack = ()
    if isinstance(col, (NonTensorStack, NonTensorData)):
        values = col.tolist()
        if not isinstance(values, list) or len(values) != n:
            values = [col.data] * n if isinstance(col, NonTensorData) else list(values)
    elif isinstance(col, np.ndarray) and col.dtype.kind in "biuf":
        return np.ascontiguousarray(col), False
    else:
        values = list(col)
    if len(values) != n:
        raise stowage.InvalidRequest(f"field {name!r}: {len(values)} values for {n} rows")
    return [seal(i, v) for i, v in enumerate(values)], True


def _pack(rows: List[Any], owned: bool) -> Any:
    """One field of get_data, as TransferQueue's own managers pack it: all
    0-d tensors stacked; tensors as a jagged nested tensor (strided when
    more than one dimension is ragged); anything else a NonTensorStack.

    ``rows`` are numpy arrays (``owned``: fresh, else views into a unit's
    memory) or Python values; the result never aliases a unit's memory."""
    import torch
    from tensordict import NonTensorStack

    arrays = all(isinstance(r, np.ndarray) for r in rows)
    if arrays and rows:
        dt = rows[0].dtype
        same_dtype = all(r.dtype == dt for r in rows)
        if same_dtype and all(r.ndim == 0 for r in rows):
            return stowage._to_torch(np.stack(rows))
        if same_dtype and all(r.ndim >= 1 and r.shape[1:] == rows[0].shape[1:] for r in rows):
            # One contiguous buffer, one copy: the jagged tensor's values,
            # in memory from stowage's read cache (warm pages when the
            # caller freed an earlier batch of this size).
            out = stowage.empty((sum(r.shape[0] for r in rows), *rows[0].shape[1:]), dt)
            np.concatenate(rows, axis=0, out=out)
            values = stowage._to_torch(out)
            lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
            offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=offsets[1:])
            return torch.nested.nested_tensor_from_jagged(values, offsets)
        rows = [stowage._to_torch(r if owned else np.array(r)) for r in rows]
    elif not arrays:
        rows = [
            stowage._to_torch(r if owned else np.array(r)) if isinstance(r, np.ndarray) else r
            for r in rows
        ]
    tensors = all(isinstance(r, torch.Tensor) for r in rows)
    if tensors and rows:
        if all(r.dim() == 0 for r in rows):
            return torch.stack(rows)
        for layout in (torch.jagged, torch.strided):
            try:
                return torch.nested.as_nested_tensor(rows, layout=layout)
            except (RuntimeError, TypeError):
                continue
    return NonTensorStack(*rows)


_POOL: Optional[concurrent.futures.ThreadPoolExecutor] = None
_POOL_LOCK = threading.Lock()


def _pack_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads (one per core) that pack the fields of a get in parallel."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="stowage-tq-pack"
            )
        return _POOL


# -- the manager -------------------------------------------------------------------


def _groups(metadata: Any) -> Dict[str, List[int]]:
    """Batch positions by partition, in order."""
    out: Dict[str, List[int]] = {}
    for pos, p in enumerate(metadata.partition_ids):
        out.setdefault(p, []).append(pos)
    return out


def _register() -> None:
    from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
    from transfer_queue.storage.managers.base import StorageManager, StorageManagerFactory

    global StowageStorageManager
    if _compat.registered_manager(BACKEND) is not None and StowageStorageManager is not None:
        return

    class _Manager(StorageManager):
        __doc__ = _MANAGER_DOC

        def __init__(
            self, controller_info: Any, config: Any, zmq_context: Any = None, **kwargs: Any
        ):
            self._plane: Optional[stowage.DataPlane] = None
            super().__init__(controller_info, config, zmq_context=zmq_context)
            block = _block(config)
            directory = block["directory"]
            if directory is None:
                raise RuntimeError(
                    f"backend.{BACKEND}.directory is not set: the Stowage bootstrap provider did not "
                    f"run (import stowage.tq in the process that calls tq.init first)"
                )
            if not isinstance(directory, (str, os.PathLike)):
                directory = _reveal_directory(directory)
            self._namespace = str(block["namespace"])
            self._timeout = float(block["timeout"])
            self._plane = stowage.connect(
                directory,
                namespace=self._namespace,
                timeout=self._timeout,
                secret=_client_secret(block),
            )
            self._shm = all(u.startswith("unix:") for u in self._plane.units)
            # The key of the pickled cells' tags, derived from the plane's
            # secret by the native client (never the secret itself).
            self._cell_key: Optional[bytes] = self._plane._client.cell_key()
            self._insecure_pickles = bool(block["insecure_pickles"])
            self._checkpoint_key = _checkpoint_cell_key(block)

        # -- put ----------------------------------------------------------

        async def put_data(self, data: Any, metadata: Any, data_parser: Any = None) -> None:
            if data_parser is not None:
                raise NotImplementedError("data_parser is supported by SimpleStorage only")
            if metadata.size == 0:
                return
            from transfer_queue.metadata import extract_field_schema

            field_schema = extract_field_schema(data)
            n = metadata.size
            gidx = list(metadata.global_indexes)
            parts = list(metadata.partition_ids)
            columns: Dict[str, Any] = {}
            tags: Dict[str, Optional[str]] = {}
            for f in data.keys():
                columns[f], pickled = _encode_rows(f, data[f], n, self._sealer(parts, gidx, f))
                tags[f] = _PICKLE_TAG if pickled else None
            groups = _groups(metadata)
            await asyncio.to_thread(self._put_sync, groups, gidx, columns)
            backend_meta = {g: dict(tags) for g in gidx}
            for p, positions in groups.items():
                if len(groups) == 1:
                    sub_schema, keys, meta = field_schema, gidx, backend_meta
                else:
                    keys = [gidx[i] for i in positions]
                    meta = {g: backend_meta[g] for g in keys}
                    sub_schema = {
                        f: (
                            {
                                **s,
                                "per_sample_shapes": [s["per_sample_shapes"][i] for i in positions],
                            }
                            if "per_sample_shapes" in s
                            else s
                        )
                        for f, s in field_schema.items()
                    }
                await self.notify_data_update(p, keys, sub_schema, meta)

        def _sealer(self, parts: List[str], gidx: List[int], field: str) -> Seal:
            key, ns, insecure = self._cell_key, self._namespace, self._insecure_pickles

            def seal(i: int, value: Any) -> np.ndarray:
                return _tq_cells.seal(key, ns, parts[i], gidx[i], field, value, insecure)

            return seal

        def _put_sync(
            self, groups: Dict[str, List[int]], gidx: List[int], columns: Dict[str, Any]
        ) -> None:
            plane = self._live()
            for p, positions in groups.items():
                if len(groups) == 1:
                    keys, cols = gidx, columns
                else:
                    keys = [gidx[i] for i in positions]
                    cols = {f: _select(c, positions) for f, c in columns.items()}
                try:
                    plane.put(p, keys, cols)
                except stowage.LostKeys as e:
                    raise _lost(p, e, "put") from e

        # -- get ----------------------------------------------------------

        async def get_data(self, metadata: Any) -> Any:
            from tensordict import TensorDict

            if metadata.size == 0:
                return TensorDict({}, batch_size=0)
            fields = list(metadata.field_names)
            columns = await asyncio.to_thread(self._get_sync, metadata, fields)
            return TensorDict(columns, batch_size=len(metadata))

        def _get_sync(self, metadata: Any, fields: List[str]) -> Dict[str, Any]:
            client = self._live()._client
            gidx = list(metadata.global_indexes)
            n = len(gidx)
            rows: Dict[str, List[Any]] = {f: [None] * n for f in fields}
            owned = True
            for p, positions in _groups(metadata).items():
                keys = [gidx[i] for i in positions]
                try:
                    got = None
                    if self._shm:
                        # Read in place (one copy, into the packed result);
                        # values in the disk tier that the slab has no room
                        # to bring back need a copying get.
                        try:
                            got = client.get_view(p, keys, fields, None, None, True)
                            owned = False
                        except stowage.TransferFailed as e:
                            if e.in_flight:
                                raise
                    if got is None:
                        got = client.get(p, keys, fields, None, None, True)
                except stowage.NotFound as e:
                    raise _not_found(p, e) from e
                except stowage.LostKeys as e:
                    raise _lost(p, e, "get") from e
                for f, vals in zip(fields, got):
                    col = rows[f]
                    for i, v in zip(positions, vals):
                        col[i] = v
            backend_meta = _compat.custom_backend_meta(metadata)
            parts = list(metadata.partition_ids)
            key, ns, insecure = self._cell_key, self._namespace, self._insecure_pickles
            for f in fields:
                col = rows[f]
                for i in range(n):
                    if (backend_meta[i] or {}).get(f) == _PICKLE_TAG:
                        # Checked before it is unpickled (UntrustedCell).
                        col[i] = _tq_cells.open_cell(
                            key, ns, parts[i], gidx[i], f, col[i], insecure
                        )
            # Packing copies every value once into fresh memory (the
            # result must not alias a unit's); numpy releases the GIL for
            # it, so the fields are packed on all cores at once.
            packed = _pack_pool().map(lambda f: _pack(rows[f], owned=owned), fields)
            return dict(zip(fields, packed))

        # -- clear --------------------------------------------------------

        async def clear_data(self, metadata: Any, fields: Any = None) -> None:
            if metadata.size == 0:
                return
            await asyncio.to_thread(self._clear_sync, metadata)

        def _clear_sync(self, metadata: Any) -> None:
            plane = self._live()
            gidx = list(metadata.global_indexes)
            for p, positions in _groups(metadata).items():
                try:
                    plane.clear(p, [gidx[i] for i in positions])
                except stowage.LostKeys as e:
                    raise _lost(p, e, "clear") from e

        # -- checkpoints --------------------------------------------------

        async def save_checkpoint(self, checkpoint_dir: str) -> None:
            await asyncio.to_thread(_save_checkpoint, self._live(), self._namespace, checkpoint_dir)

        async def load_checkpoint(self, checkpoint_dir: str) -> None:
            cells = _RestoredCells(
                self._cell_key, self._namespace, self._checkpoint_key, self._insecure_pickles
            )
            await asyncio.to_thread(
                _load_checkpoint, self._live(), cells, checkpoint_dir, self._timeout
            )

        # -- lifecycle ----------------------------------------------------

        def _live(self) -> stowage.DataPlane:
            if self._plane is None or self._plane.closed:
                raise RuntimeError("the Stowage storage manager is closed")
            return self._plane

        def close(self) -> None:
            plane = getattr(self, "_plane", None)
            if plane is not None:
                plane.close()
            super().close()

    _Manager.__name__ = _Manager.__qualname__ = "StowageStorageManager"
    _Manager.__module__ = __name__
    StowageStorageManager = StorageManagerFactory.register(BACKEND)(_Manager)
    StorageBootstrapProvider.register_provider(BACKEND)(initialize_stowage_storage)


_MANAGER_DOC = """TransferQueue's storage manager for stowage (registered as "Stowage").

Rows are global indexes, partitions TransferQueue partitions, fields
fields. ``put_data`` writes every column of the batch with one stowage put
(each unit gets its rows of every column in one round), upserting per cell
(a cell may change shape or kind); ``get_data`` returns a TensorDict like
SimpleStorage's (rows in ``global_indexes`` order; 0-d values stacked,
tensors as jagged nested tensors built from one contiguous buffer, others a
NonTensorStack), copies that do not alias the units' memory; a missing
row raises ``transfer_queue.StorageKeyNotFoundError``, a row whose unit
died :class:`RowsLost`. Non-tensor values are pickled cells with an
HMAC-SHA-256 tag (under a key derived from the plane's secret) that a get
checks before it unpickles them (:class:`UntrustedCell` otherwise).
``clear_data`` removes whole rows. Checkpoints go through the units' own
(``save_checkpoint``/``load_checkpoint``): each unit writes its part on its
own host under its ``checkpoint_root``, and a load restores each part on
the host that has it; a load refuses a record naming paths outside the
checkpoint, a part no unit has (naming its unit and host) and cells whose
tag is wrong (:class:`CheckpointRefused`)."""

StowageStorageManager: Any = None


def _select(col: Any, positions: List[int]) -> Any:
    if isinstance(col, list):
        return [col[i] for i in positions]
    import torch

    idx = torch.tensor(positions) if isinstance(col, torch.Tensor) else positions
    return col[idx]


def _not_found(partition: str, e: Any) -> Exception:
    from transfer_queue import StorageKeyNotFoundError

    keys = sorted({k for k, _ in getattr(e, "keys", [])}, key=str)
    return StorageKeyNotFoundError(
        f"stowage: rows {_short_list(keys)} of partition {partition!r} are not stored "
        f"(missing (row, field): {_short_list(getattr(e, 'keys', []), 10)})"
    )


def _lost(partition: str, e: Any, op: str) -> RowsLost:
    keys = sorted({k for k, _ in getattr(e, "keys", [])}, key=str)
    return RowsLost(partition, keys, getattr(e, "unit", None), op)


# -- checkpoints -------------------------------------------------------------------


def _save_checkpoint(plane: stowage.DataPlane, namespace: str, checkpoint_dir: str) -> None:
    """Every unit writes its data and index to
    ``<checkpoint_dir>/stowage/<id>/unit-<i>`` on its own host, under its
    own checkpoint root, through its control path (no payload through this
    process; a fresh ``id`` per save, so that a part left on another host
    under an earlier save's name is never in the way). A small JSON file
    in ``checkpoint_dir`` on this host records, with relative paths only,
    what load needs: per part its unit, that unit's address and host name,
    and where the part lies under that unit's checkpoint root
    (TransferQueue renames ``checkpoint_dir`` after this, on this host
    only)."""
    root = os.path.abspath(checkpoint_dir)
    cid = secrets.token_hex(8)
    parts = f"{_CHECKPOINT_SUBDIR}/{cid}"
    infos = plane.checkpoint(os.path.join(root, parts))
    # This host may hold no part (units elsewhere, no shared filesystem).
    os.makedirs(root, mode=0o700, exist_ok=True)
    addresses = plane.units
    record = {
        "format": 2,
        "namespace": namespace,
        "id": cid,
        "units": [
            {
                "dir": f"{parts}/unit-{i}",
                "address": addresses[i],
                **{k: v for k, v in info.items() if k != "dir"},
            }
            for i, info in enumerate(infos)
        ],
    }
    with open(os.path.join(root, _CHECKPOINT_INFO), "w", encoding="utf-8") as f:
        json.dump(record, f, default=str)


class _RestoredCells:
    """What a restore does with the pickled cells of a checkpoint: each is
    checked before it is put back, and re-tagged for this plane when it was
    saved under another secret (``checkpoint_secret_file``) or namespace."""

    def __init__(
        self, key: Optional[bytes], namespace: str, old_key: Optional[bytes], insecure: bool
    ):
        self.key = key
        self.namespace = namespace
        self.old_key = old_key
        self.insecure = insecure
        #: The namespace the checkpoint's rows were saved in (its record).
        self.saved_namespace = namespace

    def values(self, partition: str, keys: List[Any], field: str, vals: List[Any]) -> List[Any]:
        """``vals`` (of rows ``keys``) to put back: pickled cells checked,
        re-tagged where needed; :class:`CheckpointRefused` for one that
        is not authentic. Never unpickles anything.

        A cell is recognized by its head (the checkpoint does not carry
        TransferQueue's per-cell metadata, which marks what is pickled), so
        a uint8 tensor whose first 8 bytes are a cell head is taken for one
        and refused unless its tag is right."""
        out = list(vals)
        for j, v in enumerate(vals):
            if _tq_cells.is_cell(v):
                raw = v.tobytes()
                new = self._cell(raw, partition, keys[j], field)
                if new is not raw:
                    out[j] = np.frombuffer(new, dtype=np.uint8)
        return out

    def _cell(self, raw: bytes, partition: str, row: Any, field: str) -> bytes:
        if self.key is None:
            # No secret here: no tag can be checked or made; such a plane
            # unpickles only with insecure_pickles, and then checks nothing.
            return raw
        where = f"row {row!r} field {field!r} of partition {partition!r}"
        if raw.startswith(_tq_cells.MAGIC_INSECURE):
            raise CheckpointRefused(
                f"stowage.tq: the checkpoint's {where} is a pickled cell without a tag (saved "
                f"without a secret, with insecure_pickles, or by an older stowage), and this plane "
                f"authenticates every pickled cell; nothing was loaded. Load it into a plane "
                f"without a secret and with backend.{BACKEND}.insecure_pickles: true if you trust it"
            )
        for k in (self.key, self.old_key):
            if k is None:
                continue
            if k == self.key and self.saved_namespace == self.namespace:
                if _tq_cells.verified(raw, k, self.namespace, partition, row, field) is not None:
                    return raw
                continue
            new = _tq_cells.retag(
                raw, k, self.saved_namespace, self.key, self.namespace, partition, row, field
            )
            if new is not None:
                return new
        raise CheckpointRefused(
            f"stowage.tq: the checkpoint's {where} is a pickled cell whose tag is wrong: it was "
            f"changed or moved, or the checkpoint was saved under another secret (then give that "
            f"secret as backend.{BACKEND}.checkpoint_secret_file); nothing was loaded"
        )


def _checkpoint_record(root: str) -> Dict[str, Any]:
    """``stowage_checkpoint.json`` of the checkpoint at ``root``, its shape
    checked."""
    path = os.path.join(root, _CHECKPOINT_INFO)
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    units = record.get("units") if isinstance(record, dict) else None
    ns = record.get("namespace") if isinstance(record, dict) else None
    if (
        not isinstance(units, list)
        or not units
        or not all(isinstance(u, dict) for u in units)
        or not (ns is None or isinstance(ns, str))
        or record.get("format") not in (1, 2)
    ):
        raise CheckpointRefused(
            f"stowage.tq: {path} is not a stowage checkpoint record (format 1 or 2, a namespace "
            f"and a non-empty list of units)"
        )
    return record


def _relative(path: Any) -> bool:
    """Whether ``path`` is a relative path of plain names (no absolute
    path, no ``..`` or ``.``, no NUL)."""
    parts = path.split("/") if isinstance(path, str) else []
    return (
        isinstance(path, str)
        and not os.path.isabs(path)
        and "\0" not in path
        and not any(p in ("", ".", "..") for p in parts)
    )


def _checkpoint_here(root: str, entry: Mapping[str, Any]) -> Optional[str]:
    """The directory of one checkpointed unit on this host, or None when
    this host does not have it (then a unit restores it on its own host).

    The record may name only a relative path of plain names inside the
    checkpoint (no absolute path, no ``..`` or ``.``, no symbolic link on
    the way, a directory at the end)."""
    d = entry.get("dir")
    if not isinstance(d, str) or not _relative(d):
        raise CheckpointRefused(
            f"stowage.tq: the checkpoint record names the unit directory {d!r}, which is not a "
            f"relative path inside the checkpoint {root} (absolute paths and '..' are refused)"
        )
    path = root
    for p in d.split("/"):
        path = os.path.join(path, p)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise CheckpointRefused(
                f"stowage.tq: {path}, on the way to a unit directory of the checkpoint, is {what}"
            )
    return path


def _check_claim(entry: Mapping[str, Any], on_disk: int) -> None:
    """Refuse a record that says a unit's part holds more bytes than its
    files do (the memory of the unit that restores it comes from the
    files, never from the record)."""
    claimed = entry.get("bytes", 0)
    if claimed is None:
        claimed = 0
    if (
        isinstance(claimed, bool)
        or not isinstance(claimed, int)
        or claimed < 0
        or claimed > on_disk
    ):
        raise CheckpointRefused(
            f"stowage.tq: the checkpoint record says unit directory {entry.get('dir')!r} holds "
            f"{claimed!r} bytes, and its files hold {on_disk}: the record is damaged or was changed"
        )


def _checkpoint_unit(path: str, entry: Mapping[str, Any]) -> int:
    """The memory of the temporary unit that restores the part at ``path``
    on this host: sized from the bytes of its files as found on disk, not
    from the record (a record that claims more bytes than its files hold
    is refused)."""
    on_disk = 0
    with os.scandir(path) as it:
        for e in it:
            if e.is_file(follow_symlinks=False):
                on_disk += e.stat(follow_symlinks=False).st_size
    _check_claim(entry, on_disk)
    return max(64 << 20, on_disk + on_disk // 4 + (32 << 20))


class _Part:
    """One checkpointed unit's rows, served for a load: by a temporary
    unit of this process (the part is on this host), or by a restore unit
    that a live unit started on its own host (``unit``, ``restore_id``)."""

    def __init__(self, source: stowage.DataPlane, unit: Optional[int] = None, restore_id: int = 0):
        self.source = source
        self.unit = unit
        self.restore_id = restore_id

    def close(self, plane: stowage.DataPlane) -> None:
        self.source.close()
        if self.unit is not None:
            try:
                plane._client.close_restore(self.unit, self.restore_id)
            except Exception as e:  # noqa: BLE001 - it also stops by itself when idle
                logger.warning("could not close the restore unit of unit %d: %r", self.unit, e)


def _where(entry: Mapping[str, Any], index: int) -> str:
    """Where a part was written, as the record says it."""
    return (
        f"part {index} (written by unit {index}"
        f"{' at ' + str(entry['address']) if entry.get('address') else ''}"
        f"{' on host ' + repr(entry['host']) if entry.get('host') else ''}"
        f"{', as ' + repr(entry['stored']) + ' under its checkpoint root' if entry.get('stored') else ''})"
    )


def _open_elsewhere(
    plane: stowage.DataPlane, root: str, index: int, entry: Mapping[str, Any], ns: str
) -> _Part:
    """A restore unit serving part ``index``, started by the live unit on
    whose host it lies: the part's own unit first, then every other,
    each asked for the part inside the checkpoint (where a shared
    filesystem or a moved checkpoint has it) and then where its unit wrote
    it (TransferQueue renames the checkpoint directory on this host only).
    Refused (:class:`CheckpointRefused`) when no unit has it, naming every
    unit asked, its host and what it found missing."""
    stored = entry.get("stored")
    if stored is not None and stored != "" and not _relative(stored):
        raise CheckpointRefused(
            f"stowage.tq: the checkpoint record places {_where(entry, index)} at {stored!r} under "
            f"its unit's checkpoint root, which is not a relative path there (absolute paths and "
            f"'..' are refused)"
        )
    candidates = [os.path.join(root, entry["dir"])]
    if stored:
        candidates.append(stored)
    addresses = plane.units
    order = ([index] if index < len(addresses) else []) + [
        j for j in range(len(addresses)) if j != index
    ]
    tried: List[str] = []
    for j in order:
        for dir in candidates:
            try:
                got = plane._client.open_restore(j, dir, ns)
            except stowage.Error as e:
                msg = str(e)
                if "outside this unit's checkpoint root" in msg or "takes no checkpoints" in msg:
                    tried.append(f"unit {j} ({addresses[j]}): {msg}")
                    continue
                if isinstance(e, (stowage.Unreachable, stowage.Timeout)):
                    tried.append(f"unit {j} ({addresses[j]}) did not answer: {msg}")
                    break
                raise CheckpointRefused(
                    f"stowage.tq: unit {j} ({addresses[j]}) refused {_where(entry, index)} at "
                    f"{dir!r}: {msg}; nothing was loaded"
                ) from e
            if "missing" in got:
                tried.append(f"unit {j} ({addresses[j]}, host {got['host']!r}): {got['missing']}")
                continue
            part = _Part(stowage.DataPlane(got["client"]), j, got["id"])
            try:
                info = got["info"]
                want = entry.get("manifest_xxh3")
                if want is not None and want != info["manifest_xxh3"]:
                    raise CheckpointRefused(
                        f"stowage.tq: unit {j} ({addresses[j]}, host {got['host']!r}) has at "
                        f"{got['path']} a checkpoint that is not {_where(entry, index)}: its "
                        f"manifest differs from the record's; nothing was loaded"
                    )
                _check_claim(entry, sum(int(f[1]) for f in info["files"]))
            except BaseException:
                part.close(plane)
                raise
            return part
    raise CheckpointRefused(
        f"stowage.tq: {_where(entry, index)} of the checkpoint {root} is missing: "
        f"{'; '.join(tried)}; nothing was loaded"
    )


def _load_checkpoint(
    plane: stowage.DataPlane, cells: _RestoredCells, checkpoint_dir: str, timeout: float
) -> None:
    """Replace the running units' rows of this namespace with the
    checkpoint's, under the same partitions and global indexes.

    The record is checked first (only relative paths: inside the
    checkpoint, and under the units' checkpoint roots). Each part is then
    served again, read-only in effect: a part this host has
    (:func:`_checkpoint_here`: the caller's own host, or a shared
    filesystem) by a temporary unit of this process restored from its
    directory (what ``stowage unit --restore`` does), sized from its files;
    any other by a restore unit that a live unit on the part's host starts
    there (:func:`_open_elsewhere`), found through the part's own unit
    first; a missing part is refused naming every unit asked and its host.
    A damaged part is refused where it is restored. Every pickled cell is
    then checked (:class:`_RestoredCells`, nothing is unpickled); only once
    all of that passed are the live rows cleared and the checkpoint's rows
    put back through the running units (the cells checked again, re-tagged
    for this plane where needed). The restoring units stop at the end."""
    root = os.path.realpath(checkpoint_dir)
    record = _checkpoint_record(root)
    ns = record.get("namespace") or cells.namespace
    cells.saved_namespace = ns
    entries = record["units"]
    here = [_checkpoint_here(root, u) for u in entries]
    parts: List[_Part] = []
    try:
        for i, (entry, path) in enumerate(zip(entries, here)):
            if path is not None:
                memory = _checkpoint_unit(path, entry)
                local = stowage.local(
                    units=1,
                    memory=memory,
                    namespace=ns,
                    timeout=timeout,
                    unit_args=["--restore", path],
                )
                parts.append(_Part(local))
            else:
                parts.append(_open_elsewhere(plane, root, i, entry, ns))
        sources = [p.source for p in parts]
        # Every cell checked before anything changes (values read in place).
        for src, p, f, chunk in _checkpoint_chunks(sources):
            vals = None
            if src._client.shm:
                try:
                    vals = src._client.get_view(p, chunk, [f], None, None, True)[0]
                except stowage.TransferFailed:
                    vals = None
            if vals is None:
                vals = src._client.get(p, chunk, [f], None, None, True)[0]
            cells.values(p, chunk, f, vals)
            del vals
        for p in plane.partitions():
            plane.clear_partition(p)
        for src, p, f, chunk in _checkpoint_chunks(sources):
            vals = src._client.get(p, chunk, [f], None, None, True)[0]
            vals = cells.values(p, chunk, f, vals)
            vals = [("bfloat16", v.view(np.int16)) if v.dtype.kind == "V" else v for v in vals]
            plane._client.put(p, chunk, [(f, vals)], None, None)
    finally:
        for part in parts:
            part.close(plane)


def _checkpoint_chunks(sources: List[stowage.DataPlane]) -> Any:
    """(source, partition, field, keys) of every stored cell of the
    restoring units, 4096 rows at a time."""
    for src in sources:
        for p in src.partitions():
            by_field: Dict[str, List[Any]] = {}
            for key, fields in src.list(p).items():
                for f in fields:
                    by_field.setdefault(f, []).append(key)
            for f, keys in by_field.items():
                for s in range(0, len(keys), 4096):
                    yield src, p, f, keys[s : s + 4096]


_register()
