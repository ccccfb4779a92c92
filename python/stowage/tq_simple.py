"""TransferQueue's own SimpleStorage units on planned nodes
(``transferqueue==0.1.11``).

Importing this module replaces, in this process, TransferQueue's bootstrap
provider ``"SimpleStorage"`` (the function ``tq.init`` calls to start the
storage units) with one that reads an extra block of the SimpleStorage
config, ``storage_unit_placement``. Without that block it calls
TransferQueue's own provider, unchanged (round-robin over every alive
node). With it, the units go where stowage's placement says::

    backend:
      storage_backend: SimpleStorage
      SimpleStorage:
        total_storage_size: 100000
        storage_unit_placement:
          clusters: [train]          # "all", or the names of the clusters that hold units
          nodes:                     # every cluster of the job: name -> its Ray node ids
            train: [<node id>, <node id>]
            inference: [<node id>]
          count: null                # null: two units per node of the selected clusters

The units are planned with :mod:`stowage.placement` (the clusters
``clusters`` names, round-robin over their nodes, two per node unless
``count`` says otherwise; :func:`plan`), and each ``SimpleStorageUnit`` actor
is started hard-pinned to its node (``NodeAffinitySchedulingStrategy``,
``soft=False``). ``num_data_storage_units`` is set to the number planned.
Everything else is TransferQueue's: the actors are named
``TransferQueueStorageUnit#<i>`` as TransferQueue names them, the backend
is still ``SimpleStorage`` (its storage manager, ``tq.close()``, metrics
and checkpoints work unchanged), and processes that only attach
(``tq.init()`` without a config) need nothing from stowage.

A placement that cannot be met fails fast with
:class:`stowage.ray.PlacementError`, as :func:`stowage.ray.start_units`
does: a planned node that is not in the Ray cluster, is dead, has fewer
CPUs than its units reserve or lacks ``required_node_resource`` is named
before anything starts; a unit that fails to start, or is not up within
``start_timeout`` seconds, is named with its node and why (e.g. the CPUs
its node has free). Nothing is left running then: the units that came up
are shut down, every unit actor is killed, and so is the controller
``tq.init`` made (a later ``tq.init`` starts afresh).

Only the process that calls ``tq.init(conf)`` first needs this import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Union
from uuid import uuid4

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import stowage

from . import placement
from . import ray as stowage_ray
from .ray import PlacementError

__all__ = [
    "KEY",
    "PLACEMENT_DEFAULTS",
    "PlacementError",
    "initialize_simple_storage",
    "plan",
    "unit_nodes",
]

logger = logging.getLogger("stowage.tq_simple")

#: The key of the placement block in ``conf.backend.SimpleStorage``.
KEY = "storage_unit_placement"

#: The keys of the ``storage_unit_placement`` block and their defaults.
PLACEMENT_DEFAULTS: Dict[str, Any] = {
    # "all", or a list of cluster names (keys of `nodes`): stowage's
    # placement.clusters.
    "clusters": "all",
    # Cluster name -> its Ray node ids (hex strs), in the cluster's order.
    "nodes": None,
    # How many units; None: two per node of the selected clusters.
    "count": None,
    # Ray CPUs each SimpleStorageUnit actor reserves (TransferQueue's own: 1).
    "cpus": 1.0,
    # Seconds for every unit to come up.
    "start_timeout": 120.0,
}

#: How long a failed start spends shutting down the units that came up.
CLEANUP_TIMEOUT_S = 5.0

#: TransferQueue's own SimpleStorage provider (called without the block).
_tq_provider: Optional[Callable[[Any], Any]] = None


def _plain(x: Any) -> Any:
    """A DictConfig/ListConfig as plain dicts and lists (other values as they are)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(x, (DictConfig, ListConfig)):
        return OmegaConf.to_container(x, resolve=True)
    return x


def _where(key: str = "") -> str:
    return f"backend.SimpleStorage.{KEY}{'.' + key if key else ''}"


def _block(given: Any) -> Dict[str, Any]:
    """The placement block over its defaults; unknown keys and wrong types
    raise :class:`stowage.InvalidRequest` naming the key."""
    given = _plain(given)
    if not isinstance(given, Mapping):
        raise stowage.InvalidRequest(f"{_where()} must be a mapping, not {type(given).__name__}")
    unknown = sorted(set(given) - set(PLACEMENT_DEFAULTS))
    if unknown:
        raise stowage.InvalidRequest(
            f"{_where()}: unknown key {unknown[0]!r} (the keys are {sorted(PLACEMENT_DEFAULTS)})"
        )
    block = {**PLACEMENT_DEFAULTS, **given}
    nodes = block["nodes"]
    if not isinstance(nodes, Mapping) or not nodes:
        raise stowage.InvalidRequest(
            f"{_where('nodes')} must map each cluster name to its Ray node ids, e.g. "
            f'{{"train": [...], "inference": [...]}}, not {nodes!r}'
        )
    for key in ("cpus", "start_timeout"):
        v = block[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise stowage.InvalidRequest(f"{_where(key)} must be a number >= 0, not {v!r}")
    if block["start_timeout"] <= 0:
        raise stowage.InvalidRequest(f"{_where('start_timeout')} must be more than 0")
    return block


def plan(block: Mapping[str, Any]) -> List[str]:
    """One Ray node id per unit for a ``storage_unit_placement`` block:
    :func:`stowage.placement.select_clusters` of ``clusters`` over
    ``nodes``, then :func:`stowage.placement.plan_unit_nodes` with
    ``count``. Deterministic; bad input raises :class:`stowage.InvalidRequest`."""
    b = _block(block)
    clusters = placement.select_clusters(b["clusters"], b["nodes"])
    return [str(n) for n in placement.plan_unit_nodes(clusters, b["count"])]


class _Needs:
    """What :func:`stowage.ray._check_nodes` asks of a launcher's settings:
    CPUs per unit, Ray memory per unit (SimpleStorage reserves none), and a
    listen host (SimpleStorage binds the node's IP, never loopback)."""

    def __init__(self, cpus: float):
        self.cpus = cpus
        self.memory = 0
        self.listen = {"host": "node-ip"}


def _check_nodes(nodes: List[str], cpus: float, resource: Optional[str]) -> None:
    """Fail fast, before anything starts, when a planned node is missing,
    dead, has fewer CPUs than its units reserve, or lacks TransferQueue's
    ``required_node_resource``."""
    stowage_ray._check_nodes(nodes, _Needs(cpus))  # type: ignore[arg-type]
    if resource is None:
        return
    known = {n["NodeID"]: n for n in ray.nodes()}
    problems = []
    for node in dict.fromkeys(nodes):
        idx = [str(i) for i, n in enumerate(nodes) if n == node]
        if known[node].get("Resources", {}).get(resource, 0) <= 0:
            problems.append(
                f"node {node} (for unit{'s' if len(idx) > 1 else ''} {', '.join(idx)}) lacks the "
                f"resource {resource!r} that backend.SimpleStorage.required_node_resource requires"
            )
    if problems:
        raise PlacementError("cannot place the storage units: " + "; ".join(problems))


def _unit_info() -> Callable[[Any], Dict[str, Any]]:
    """What a unit's actor runs (``__ray_call__``) to say the node it runs
    on, as the actor itself sees it, and its ZMQ address. A nested function,
    so that Ray sends its code: the units' nodes need no stowage."""

    def info(unit: Any) -> Dict[str, Any]:
        import ray as _ray

        return {
            "node": _ray.get_runtime_context().get_node_id(),
            "zmq": unit.get_zmq_server_info(),
        }

    return info


def unit_nodes(handles: Union[Mapping[str, Any], List[Any]], timeout: float = 30.0) -> List[str]:
    """The Ray node id each unit actor runs on, asked of the actor itself
    (``ray.get_runtime_context().get_node_id()`` inside it), in the order
    given (``handles``: TransferQueue's ``{name: handle}`` or a list)."""
    hs = list(handles.values()) if isinstance(handles, Mapping) else list(handles)
    return [
        i["node"]
        for i in ray.get([h.__ray_call__.remote(_unit_info()) for h in hs], timeout=timeout)
    ]


def _runtime_env(config: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """TransferQueue's runtime env for units with SSD offload (its
    bootstrap's rule: glibc's mmap threshold)."""
    ssd = config.get("ssd_offload") or {}
    if not ssd.get("enabled", False):
        return None
    threshold = ssd.get("glibc_mmap_threshold_bytes", 1024 * 1024)
    if threshold is None:
        return None
    threshold = int(threshold)
    if threshold <= 0:
        raise ValueError("glibc_mmap_threshold_bytes must be greater than zero or null")
    return {"env_vars": {"MALLOC_MMAP_THRESHOLD_": str(threshold)}}


def _stop(handles: List[Any], came_up: List[bool]) -> None:
    """Shut the units that came up down (bounded), then kill every actor."""
    up = [h for h, u in zip(handles, came_up) if u]
    try:
        if up:
            ray.wait(
                [h.shutdown.remote() for h in up], num_returns=len(up), timeout=CLEANUP_TIMEOUT_S
            )
    except Exception as e:  # noqa: BLE001 - teardown never raises
        logger.warning("could not shut the SimpleStorage units down: %r", e)
    stowage_ray._kill_all(handles)


def _start(conf: Any, block: Dict[str, Any]) -> Dict[str, Any]:
    t0 = time.monotonic()
    if not ray.is_initialized():
        raise PlacementError("Ray is not initialized: call ray.init() before tq.init")
    nodes = plan(block)
    cpus = float(block["cpus"])
    timeout = float(block["start_timeout"])
    deadline = t0 + timeout
    config = {k: v for k, v in _plain(conf.backend.SimpleStorage).items() if k != KEY}
    config["num_data_storage_units"] = len(nodes)
    config["_run_id"] = uuid4().hex
    _check_nodes(nodes, cpus, config.get("required_node_resource"))
    runtime_env = _runtime_env(config)

    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    names = [f"TransferQueueStorageUnit#{i}" for i in range(len(nodes))]
    handles: List[Any] = []
    infos: List[Optional[Dict[str, Any]]] = [None] * len(nodes)
    try:
        for name, node in zip(names, nodes):
            options: Dict[str, Any] = {
                "name": name,
                "num_cpus": cpus,
                "max_restarts": 0,
                "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False),
            }
            if runtime_env is not None:
                options["runtime_env"] = runtime_env
            handles.append(SimpleStorageUnit.options(**options).remote(config=config))
        refs = [h.__ray_call__.remote(_unit_info()) for h in handles]
        # SimpleStorage's unit actors reserve CPUs only (no Ray memory).
        stowage_ray._await_units(
            refs,
            handles,
            [f"unit {i} ({names[i]})" for i in range(len(nodes))],
            nodes,
            (deadline, timeout),
            (cpus, 0),
            infos,
            "SimpleStorage units",
        )
        for i, info in enumerate(infos):
            assert info is not None
            # Hard node affinity makes this impossible; it is checked anyway.
            if info["node"] != nodes[i]:
                raise PlacementError(
                    f"unit {i} ({names[i]}) runs on node {info['node']}, not on {nodes[i]}"
                )
    except BaseException:
        _stop(handles, [i is not None for i in infos])
        raise
    conf.backend.SimpleStorage.num_data_storage_units = len(nodes)
    conf.backend.SimpleStorage.zmq_info = {
        name: info["zmq"] for name, info in zip(names, infos) if info is not None
    }
    logger.info(
        "started %d SimpleStorage units on their planned nodes in %.1f s: %s",
        len(nodes),
        time.monotonic() - t0,
        nodes,
    )
    return dict(zip(names, handles))


def initialize_simple_storage(conf: Any) -> Any:
    """TransferQueue's bootstrap provider for ``storage_backend:
    SimpleStorage``, as this module registers it.

    Without ``backend.SimpleStorage.storage_unit_placement``: TransferQueue's
    own provider. With it: the units planned from the block (:func:`plan`),
    each started pinned to its node; their ZMQ addresses go to
    ``backend.SimpleStorage.zmq_info`` as TransferQueue's provider writes
    them. Returns ``{actor name: handle}`` as TransferQueue's does, which
    ``tq.close()`` shuts down. On any failure, nothing it started is left
    running, and TransferQueue's controller is removed, before it re-raises."""
    simple = conf.backend.get("SimpleStorage")
    given = simple.get(KEY) if simple is not None else None
    if given is None:
        assert _tq_provider is not None
        return _tq_provider(conf)
    try:
        return _start(conf, _block(given))
    except BaseException:
        from .tq import _abandon_controller

        _abandon_controller()
        raise


initialize_simple_storage._stowage_placed = True  # type: ignore[attr-defined]


def _register() -> None:
    global _tq_provider
    # The package import registers TransferQueue's own providers first.
    from transfer_queue.storage.bootstrap import StorageBootstrapProvider

    current = StorageBootstrapProvider.get_provider("SimpleStorage")
    if getattr(current, "_stowage_placed", False):
        return
    if current is None:
        raise ImportError(
            "stowage.tq_simple: this TransferQueue has no SimpleStorage bootstrap provider "
            "(stowage supports transferqueue==0.1.11)"
        )
    _tq_provider = current
    StorageBootstrapProvider.register_provider("SimpleStorage")(initialize_simple_storage)


_register()
