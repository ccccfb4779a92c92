"""Type stubs of the extension module ``stowage._native`` (crates/python).

The public API is the ``stowage`` package; this module is its engine.
"""

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, final

import numpy as np

__version__: str
__all__ = [
    "Client",
    "Corrupt",
    "Error",
    "InvalidRequest",
    "Io",
    "KeyCollision",
    "LocalPlane",
    "LostKeys",
    "NotFound",
    "NotOwner",
    "Timeout",
    "TransferFailed",
    "Unauthorized",
    "Unit",
    "UnitFull",
    "Unreachable",
    "__version__",
    "_error_of",
    "copy",
    "directory_hosts",
    "directory_replicas",
    "directory_secret",
    "generate_secret",
    "host_cache_info",
    "host_empty",
    "host_id",
    "load_config",
    "main",
    "merge_claims_states",
    "plan_unit_nodes",
    "read_directory_file",
    "rebuild_copies",
    "rejoin",
    "repair",
    "resolve_directory",
    "resolve_listen_host",
    "route_logs",
    "select_clusters",
    "set_host_cache",
    "under_replicated",
    "write_directory_file",
]

# Type aliases of these stubs only (the module has no such names).
# A row key: an int in [0, 2**63) or a str.
_RowKey = Union[int, str]
_Keys = Union[Sequence[_RowKey], np.ndarray]
# A numpy array, or ("bfloat16", int16 array) for a reinterpreted tensor.
_ArrayArg = Union[np.ndarray, Tuple[str, np.ndarray]]
# A dense array (split along axis 0) or a list of one array per key.
_ColumnArg = Union[_ArrayArg, List[_ArrayArg]]

def main(argv: List[str]) -> int:
    """Run the ``stowage`` command line (``argv[0]`` is the program name)
    with the GIL released; return its exit status (0, 1, or 2 for usage)."""

class Error(Exception):
    """Base class of every stowage error."""

    retryable: bool
    unit: Optional[int]

class UnitFull(Error):
    unit: int

class TransferFailed(Error):
    unit: int
    reason: str
    in_flight: bool

class LostKeys(Error):
    unit: int
    keys: List[Tuple[_RowKey, str]]

class Timeout(Error): ...

class NotFound(Error):
    keys: List[Tuple[_RowKey, str]]

class InvalidRequest(Error): ...

class Unauthorized(Error):
    """Authentication only: a wrong or missing secret, another user, an
    admin request this client may not make (or the client refused the
    unit)."""

class NotOwner(Error):
    """A reservation or pin belongs to another session."""

class Unreachable(Error):
    address: str
    reason: str

class Corrupt(Error):
    unit: int
    keys: List[Tuple[_RowKey, str]]

class KeyCollision(Error):
    partition: str
    requested: str
    stored: Optional[str]

class Io(Error): ...

def _error_of(variant: str) -> Error:
    """The exception a sample of the client's error ``variant`` (its Rust
    name) becomes (tests check every variant has its class)."""

def host_id() -> str: ...
def route_logs() -> None:
    """Route the extension's log events to Python's ``logging`` now."""

# The read cache (crates/python/src/arrays.rs); stowage.empty and friends
# wrap it.

def host_empty(nbytes: int) -> np.ndarray:
    """A writable 1-d uint8 array of ``nbytes`` from the read cache."""

def host_cache_info() -> Dict[str, int]:
    """The read cache: ``bytes``, ``limit``, ``hits``, ``misses``."""

def set_host_cache(limit: int) -> None: ...
def copy(dst: np.ndarray, src: np.ndarray, threads: Optional[int] = None) -> None:
    """Copy ``src``'s bytes into ``dst`` the way stowage copies (benchmarks)."""

def resolve_directory(
    json: str, transport: str = "auto"
) -> Tuple[List[str], List[Optional[str]]]: ...
def generate_secret() -> bytes: ...
def read_directory_file(path: str) -> str: ...
def write_directory_file(json: str, path: str) -> None: ...
def directory_secret(json: str) -> Optional[bytes]: ...
def directory_hosts(json: str) -> List[Optional[str]]:
    """The host of each unit of the directory (None where it does not
    say)."""

def repair(client: Client, timeout: Optional[float] = None) -> Dict[str, Any]:
    """One repair pass of ``client``."""

def rebuild_copies(client: Client, timeout: Optional[float] = None) -> Dict[str, Any]:
    """Every row's copies from whichever copy holds it."""

def under_replicated(client: Client, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
    """What each newcomer lacks."""

def merge_claims_states(states: List[bytes]) -> bytes:
    """One claims state for every unit of a plane with copies, from a
    checkpoint's parts' states."""

def rejoin(client: Client, unit: int, timeout: Optional[float] = None) -> Dict[str, Any]:
    """Take ``unit`` back into the plane as the instance started again at
    its address."""

def directory_replicas(json: str, given: Optional[int] = None) -> int:
    """The directory's copies of every row (1 when it does not say); a
    ``given`` number that differs raises InvalidRequest."""

@final
class Client:
    """A connection-pooling client of a set of units; thread-safe. Opens no
    connection when made: each unit's first call reaches it
    (``check_units`` reaches every unit at once)."""

    def __new__(
        cls,
        units: List[str],
        namespace: str = ...,  # "default"
        timeout: float = 30.0,
        shm: bool = True,
        wait_for_memory: Optional[float] = None,
        secret: Optional[Union[bytes, str]] = None,
        instances: Optional[List[Optional[str]]] = None,
        liveness: Optional[Callable[[int], str]] = None,
        nixl: bool = False,
        require_rdma: bool = True,
        replicas: int = 1,
        hosts: Optional[List[Optional[str]]] = None,
    ) -> Client: ...
    @property
    def units(self) -> List[str]: ...
    @property
    def namespace(self) -> str: ...
    @property
    def shm(self) -> bool: ...
    @property
    def replicas(self) -> int: ...
    def copies_short_of_hosts(self) -> int: ...
    def cell_key(self) -> Optional[bytes]: ...
    def close(self) -> None: ...
    def put(
        self,
        partition: str,
        keys: _Keys,
        columns: Sequence[Tuple[str, _ColumnArg]],
        unit: Optional[int] = None,
        timeout: Optional[float] = None,
        groups: Optional[List[str]] = None,
    ) -> None: ...
    def unit_of(self, name: str) -> int: ...
    def register_tasks(
        self,
        partition: str,
        tasks: List[str],
        samples: int,
        group_size: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> None: ...
    def claim(
        self,
        partition: str,
        task: str,
        fields: List[str],
        count: int,
        block: bool = True,
        timeout: Optional[float] = None,
    ) -> List[_RowKey]: ...
    def claim_status(
        self, partition: str, task: str, timeout: Optional[float] = None
    ) -> Dict[str, int]: ...
    def claims_state(self, unit: int, timeout: Optional[float] = None) -> bytes: ...
    def load_claims(self, unit: int, state: bytes, timeout: Optional[float] = None) -> None: ...
    def get(
        self,
        partition: str,
        keys: _Keys,
        fields: List[str],
        unit: Optional[int] = None,
        timeout: Optional[float] = None,
        raw_bfloat16: bool = False,
    ) -> List[List[np.ndarray]]: ...
    def get_into(
        self,
        partition: str,
        keys: _Keys,
        fields: List[str],
        outs: List[_ColumnArg],
        unit: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> None: ...
    def get_view(
        self,
        partition: str,
        keys: _Keys,
        fields: List[str],
        unit: Optional[int] = None,
        timeout: Optional[float] = None,
        raw_bfloat16: bool = False,
    ) -> List[List[np.ndarray]]:
        """Read-only arrays over the values in the units' slabs (no copy);
        a value stored split across pieces of a slab comes back as a copy,
        a new writeable array as ``get`` returns it."""
        ...
    def get_packed_view(
        self,
        partition: str,
        keys: _Keys,
        fields: List[str],
        unit: Optional[int] = None,
        timeout: Optional[float] = None,
        raw_bfloat16: bool = False,
    ) -> List[Tuple[int, np.ndarray, List[np.ndarray], List[np.ndarray]]]:
        """Per unit that holds some of the keys, ``(unit, rows, values,
        offsets)``: the int64 positions in ``keys`` of its rows, and per
        field their values back to back along the first axis (read-only
        over the slab when they lie so there, else a writeable copy) and
        int64 offsets along that axis."""
        ...
    def clear(
        self,
        partition: str,
        keys: _Keys,
        unit: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> int: ...
    def clear_partition(self, partition: str, timeout: Optional[float] = None) -> int: ...
    def list(self, partition: str, timeout: Optional[float] = None) -> Dict[_RowKey, List[str]]: ...
    def partitions(self, timeout: Optional[float] = None) -> List[str]: ...
    def stats(self, timeout: Optional[float] = None) -> List[Dict[str, Any]]: ...
    def check_units(self, timeout: Optional[float] = None) -> None: ...
    def metrics_json(self) -> str: ...
    def metrics_text(self) -> str: ...
    def checkpoint(self, dir: str, timeout: Optional[float] = None) -> List[Dict[str, Any]]: ...
    def open_restore(
        self, unit: int, dir: str, namespace: str, timeout: Optional[float] = None
    ) -> Dict[str, Any]: ...
    def close_restore(self, unit: int, id: int, timeout: Optional[float] = None) -> None: ...
    def shutdown(self, timeout: float = 30.0) -> List[List[str]]: ...

@final
class LocalPlane:
    """Unit processes on this machine, stopped by stop() (and exiting by
    themselves when this process dies)."""

    def __new__(
        cls,
        command: List[str],
        units: int,
        memory: Union[int, str],
        unit_args: List[str] = ...,
        start_timeout: float = 30.0,
        secret: Optional[Union[bytes, str]] = None,
        insecure: bool = False,
    ) -> LocalPlane: ...
    @property
    def secret(self) -> Optional[bytes]: ...
    @property
    def secret_generated(self) -> bool: ...
    @property
    def uds_addrs(self) -> List[str]: ...
    @property
    def tcp_addrs(self) -> List[str]: ...
    @property
    def pids(self) -> List[int]: ...
    @property
    def instance_ids(self) -> List[str]: ...
    @property
    def running(self) -> bool: ...
    def stop(self) -> None: ...

@final
class Unit:
    """A storage unit running on threads of this process (what a
    ``stowage.ray`` actor holds). ``stop()`` tears it down."""

    def __new__(
        cls,
        memory: Union[int, str],
        *,
        name: str = ...,  # "unit"
        tcp: Optional[str] = None,
        uds: Optional[str] = None,
        disk: Optional[str] = None,
        disk_capacity: Union[int, str, None] = None,
        high_watermark: float = 0.9,
        low_watermark: float = 0.8,
        reservation_lease: float = 30.0,
        pin_lease: float = 30.0,
        checkpoint_root: Optional[str] = None,
        mlock: bool = True,
        huge_pages: str = ...,  # "auto"
        spare_budget: Union[int, str, None] = None,
        max_connections: Optional[int] = None,
        max_sessions: Optional[int] = None,
        threads: Optional[int] = None,
        max_handshakes: Optional[int] = None,
        max_handshakes_per_source: Optional[int] = None,
        max_session_connections: Optional[int] = None,
        max_session_holds: Optional[int] = None,
        frame_timeout: Optional[float] = None,
        handshake_timeout: Optional[float] = None,
        secret: Union[bytes, str, None] = None,
        secret_file: Optional[str] = None,
        insecure: bool = False,
        metrics: bool = True,
        metrics_listen: Optional[str] = None,
        nixl: bool = False,
        require_rdma: bool = True,
    ) -> Unit: ...
    @property
    def secret(self) -> Optional[bytes]: ...
    @property
    def instance_id(self) -> str: ...
    @property
    def metrics_url(self) -> Optional[str]: ...
    def metrics_text(self) -> Optional[str]: ...
    @property
    def uds_addr(self) -> str: ...
    @property
    def tcp_addr(self) -> Optional[str]: ...
    @property
    def pid(self) -> int: ...
    @property
    def running(self) -> bool: ...
    def stats(self, timeout: float = 10.0) -> Dict[str, Any]: ...
    def stop(self, timeout: float = 30.0) -> List[str]: ...

# Placement and the config file (crates/python/src/cluster.rs); the
# public API is stowage.placement and stowage.config.

def select_clusters(
    placement: Union[str, Sequence[str]], clusters_by_name: Mapping[str, Any]
) -> Tuple[List[Any], List[str]]:
    """The selected cluster objects (each once, in the mapping's order; one
    object under two names is one cluster) and notes worth logging."""

def plan_unit_nodes(clusters: Sequence[Sequence[str]], count: Optional[int] = None) -> List[str]:
    """One node id per unit, round-robin over the clusters' nodes (each
    once, in order); count None: two per node."""

def load_config(
    path: Optional[str] = None,
    text: Optional[str] = None,
    mapping: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Dict[str, Any]]:
    """The config file at path, or in text, or a dict of sections (checked
    as a file is; durations may be numbers of seconds), or the defaults, as
    a dict of sections (sizes in bytes, durations in float seconds)."""

def resolve_listen_host(host: str) -> str:
    """An IP address as it is; "node-ip" as this node's own address."""
