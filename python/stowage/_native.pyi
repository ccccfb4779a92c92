"""Type stubs of the extension module ``stowage._native`` (crates/python).

The public API is the ``stowage`` package; this module is its engine.
"""

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

__version__: str

Key = Union[int, str]
Keys = Union[Sequence[Key], np.ndarray]
# A numpy array, or ("bfloat16", int16 array) for a reinterpreted tensor.
ArrayArg = Union[np.ndarray, Tuple[str, np.ndarray]]
# A dense array (split along axis 0) or a list of one array per key.
ColumnArg = Union[ArrayArg, List[ArrayArg]]

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
    keys: List[Tuple[Key, str]]

class Timeout(Error): ...

class NotFound(Error):
    keys: List[Tuple[Key, str]]

class InvalidRequest(Error): ...
class Unauthorized(Error): ...
class Unreachable(Error):
    address: str
    reason: str

def host_id() -> str: ...
def resolve_directory(
    json: str, transport: str = "auto"
) -> Tuple[List[str], List[Optional[str]]]: ...
def generate_secret() -> bytes: ...
def read_directory_file(path: str) -> str: ...
def write_directory_file(json: str, path: str) -> None: ...
def directory_secret(json: str) -> Optional[bytes]: ...

class Client:
    """A connection-pooling client of a set of units; thread-safe."""

    def __init__(
        self,
        units: List[str],
        namespace: str = "default",
        timeout: float = 30.0,
        shm: bool = True,
        wait_for_memory: Optional[float] = None,
        secret: Optional[Union[bytes, str]] = None,
        instances: Optional[List[Optional[str]]] = None,
        liveness: Optional[Callable[[int], str]] = None,
        nixl: bool = False,
        require_rdma: bool = True,
    ) -> None: ...
    @property
    def units(self) -> List[str]: ...
    @property
    def shm(self) -> bool: ...
    def cell_key(self) -> Optional[bytes]: ...
    def close(self) -> None: ...
    def put(
        self,
        partition: str,
        keys: Keys,
        columns: Sequence[Tuple[str, ColumnArg]],
        unit: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> None: ...
    def get(
        self,
        partition: str,
        keys: Keys,
        fields: List[str],
        unit: Optional[int] = None,
        timeout: Optional[float] = None,
        raw_bfloat16: bool = False,
    ) -> List[List[np.ndarray]]: ...
    def get_into(
        self,
        partition: str,
        keys: Keys,
        fields: List[str],
        outs: List[ColumnArg],
        unit: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> None: ...
    def get_view(
        self,
        partition: str,
        keys: Keys,
        fields: List[str],
        unit: Optional[int] = None,
        timeout: Optional[float] = None,
        raw_bfloat16: bool = False,
    ) -> List[List[np.ndarray]]: ...
    def clear(
        self,
        partition: str,
        keys: Keys,
        unit: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> int: ...
    def clear_partition(self, partition: str, timeout: Optional[float] = None) -> int: ...
    def list(self, partition: str, timeout: Optional[float] = None) -> Dict[Key, List[str]]: ...
    def partitions(self, timeout: Optional[float] = None) -> List[str]: ...
    def stats(self, timeout: Optional[float] = None) -> List[Dict[str, Any]]: ...
    def checkpoint(self, dir: str, timeout: Optional[float] = None) -> List[Dict[str, Any]]: ...
    def shutdown(self, timeout: float = 30.0) -> List[List[str]]: ...

class LocalPlane:
    """Unit processes on this machine, stopped by stop() (and exiting by
    themselves when this process dies)."""

    def __init__(
        self,
        command: List[str],
        units: int,
        memory: Union[int, str],
        unit_args: List[str] = ...,
        start_timeout: float = 30.0,
        secret: Optional[Union[bytes, str]] = None,
        insecure: bool = False,
    ) -> None: ...
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
    def running(self) -> bool: ...
    def stop(self) -> None: ...

class Unit:
    """A storage unit running on threads of this process (what a
    ``stowage.ray`` actor holds). ``stop()`` tears it down."""

    def __init__(
        self,
        memory: Union[int, str],
        *,
        name: str = "unit",
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
        max_connections: Optional[int] = None,
        max_handshakes: Optional[int] = None,
        max_handshakes_per_source: Optional[int] = None,
        max_session_connections: Optional[int] = None,
        max_session_holds: Optional[int] = None,
        frame_timeout: Optional[float] = None,
        handshake_timeout: Optional[float] = None,
        secret: Union[bytes, str, None] = None,
        secret_file: Optional[str] = None,
        insecure: bool = False,
    ) -> None: ...
    @property
    def secret(self) -> Optional[bytes]: ...
    @property
    def instance_id(self) -> str: ...
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

def load_config(path: Optional[str] = None, text: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
    """The config file at path, or in text, or the defaults, as a dict of
    sections (sizes in bytes, durations in float seconds)."""

def resolve_listen_host(host: str) -> str:
    """An IP address as it is; "node-ip" as this node's own address."""
