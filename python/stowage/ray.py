"""Storage units as Ray actors, pinned to planned nodes.

    import ray, stowage, stowage.ray

    ray.init()
    units = stowage.ray.start_units({"units": {"memory": "4GiB"}}, node_ids)
    # any process on any node, e.g. inside a Ray task:
    plane = stowage.connect(units.directory)
    ...
    stowage.ray.stop_units(units)

:func:`start_units` starts one :class:`StowageUnit` actor per planned node,
hard-pinned to it (node affinity, ``soft=False``). Each actor runs a unit
inside its own process (:class:`stowage._native.Unit`: the server runs on
its own Rust threads, so the actor keeps answering Ray calls) listening on
tcp at the config's ``listen.host`` (loopback by default; ``"node-ip"``:
Ray's address of the node) and on a Unix socket in a private directory.
It returns :class:`Units`, whose ``directory`` any process on any node
passes to :func:`stowage.connect`: clients on a unit's host use shared
memory, the others tcp.

Ray is not on the operation path: clients talk to the units directly.
After an operation on a unit failed (its connection broke, or, with
copies, it ran out of time), the client asks :func:`liveness` whether Ray
considers that unit's actor dead (then its keys are lost:
:class:`stowage.LostKeys`; with copies the client goes on without the
unit, and fences it — it stops serving — as soon as it answers) or alive
(a slow unit: a retryable error or :class:`stowage.Timeout`).

:func:`stop_units` runs every unit's teardown explicitly (Ray ends actors
— ``ray.kill``, the end of their job — without running any), bounded, and
never raises. Actors
are not detached: when the job that started them ends, Ray kills them;
their processes exit and each unit's disk directory stays behind, locked
by nobody, until the next unit started under the same disk root removes
it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from . import Error, InvalidRequest, _compat, _native, _secret

__all__ = [
    "PlacementError",
    "StowageUnit",
    "UnitRefused",
    "Units",
    "liveness",
    "start_units",
    "stop_units",
]

logger = logging.getLogger("stowage.ray")

#: How long :func:`stop_units` takes at most for units it was not given
#: the config of (the config's ``timeouts.stop`` otherwise).
STOP_TIMEOUT_S = 30.0
#: How long a failed :func:`start_units` spends tearing down the units it
#: started (beyond its own timeout).
CLEANUP_TIMEOUT_S = 2.0
#: How long a failed :func:`start_units` spends asking Ray why units are
#: still pending (beyond its own timeout).
DIAGNOSE_S = 2.0
#: How long :func:`liveness` waits for Ray's answer by default.
LIVENESS_TIMEOUT_S = 5.0


class PlacementError(Error):
    """Units could not be placed or started: a planned node is missing, dead
    or short of resources, or a unit did not come up in time. The message
    names every unit and what was missing; nothing started is left
    running."""


# -- the actor ---------------------------------------------------------------


class StowageUnit:
    """A Ray actor that owns one storage unit (memory, disk directory,
    sockets) for its lifetime. Started by :func:`start_units`."""

    def __init__(self, index: int, unit_kwargs: Dict[str, Any], listen: Dict[str, Any]):
        ctx = ray.get_runtime_context()
        node_ip = ray.util.get_node_ip_address()
        host = node_ip if listen["host"] == "node-ip" else listen["host"]
        bind = f"[{host}]:{listen['tcp_port']}" if ":" in host else f"{host}:{listen['tcp_port']}"
        uds = None
        if listen.get("unix_dir"):
            uds = os.path.join(listen["unix_dir"], f"stowage-unit-{index}-{os.getpid()}.sock")
        metrics = unit_kwargs.get("metrics_listen")
        if metrics is not None and metrics != "off":
            # [metrics] listen: a fixed port becomes port + index (as
            # `stowage up` does); port 0 picks a free one.
            mhost, mport = metrics.rsplit(":", 1)
            mhost = mhost.strip("[]")
            mport = int(mport) + index if int(mport) else 0
            metrics = f"[{mhost}]:{mport}" if ":" in mhost else f"{mhost}:{mport}"
            unit_kwargs = dict(unit_kwargs, metrics_listen=metrics)
        self._unit = _native.Unit(name=f"unit-{index}", tcp=bind, uds=uds, **unit_kwargs)
        tcp = self._unit.tcp_addr
        assert tcp is not None  # it was given a tcp address to bind
        if host in ("0.0.0.0", "::"):
            # Bound to every interface: clients elsewhere use the node's IP.
            port = tcp.rsplit(":", 1)[1]
            tcp = f"tcp:[{node_ip}]:{port}" if ":" in node_ip else f"tcp:{node_ip}:{port}"
        self._entry = {
            "index": index,
            "node": ctx.get_node_id(),
            "host": _native.host_id(),
            "uds": self._unit.uds_addr,
            "tcp": tcp,
            "instance_id": self._unit.instance_id,
            "pid": self._unit.pid,
            "ray": {"actor_id": ctx.get_actor_id(), "namespace": ctx.namespace},
        }
        if self._unit.metrics_url is not None:
            self._entry["metrics"] = self._unit.metrics_url

    def ready(self) -> bool:
        """True once the unit serves (the actor's constructor has run)."""
        return self._unit.running

    def info(self) -> Dict[str, Any]:
        """This unit's directory entry."""
        return dict(self._entry)

    def stats(self, timeout: float = 10.0) -> Dict[str, Any]:
        """The unit's counters."""
        return self._unit.stats(timeout)

    def close(self, timeout: float = 30.0) -> List[str]:
        """Tear the unit down within about ``timeout`` seconds (its disk
        directory and socket directory are removed). Never raises; returns
        what could not be done. The actor stays up until killed."""
        try:
            return self._unit.stop(timeout)
        except BaseException as e:  # noqa: BLE001 - teardown must report, not raise
            return [f"teardown failed: {e!r}"]


_actor_class: Any = None


def _actor() -> Any:
    global _actor_class
    if _actor_class is None:
        # Threaded: close() and stats() run while another call is busy.
        # (Ray's annotations of ray.remote lack the actor options.)
        _actor_class = ray.remote(max_concurrency=4, max_restarts=0)(StowageUnit)  # type: ignore[call-overload]
    return _actor_class


# -- started units -------------------------------------------------------------


class Units(Sequence):
    """Started units: a sequence of their actor handles (unit ``i`` is
    ``units[i]``), with ``directory`` (pass it to :func:`stowage.connect`
    from any process), ``node_ids`` (the node of each unit) and
    ``stop_timeout`` (the config's ``timeouts.stop``, what
    :func:`stop_units` takes by default)."""

    def __init__(
        self, actors: List[Any], directory: Dict[str, Any], stop_timeout: float = STOP_TIMEOUT_S
    ):
        self.actors = list(actors)
        self.directory = directory
        self.node_ids = [e["node"] for e in directory["units"]]
        self.stop_timeout = stop_timeout

    def __len__(self) -> int:
        return len(self.actors)

    def __getitem__(self, i: Any) -> Any:
        return self.actors[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.actors)

    def __repr__(self) -> str:
        return f"<stowage.ray.Units {len(self)} units on nodes {self.node_ids}>"


# -- configuration and planning -------------------------------------------------


def _load_config(config: Any) -> Dict[str, Dict[str, Any]]:
    """The config as :func:`stowage.config.load` gives it (every key, sizes
    in bytes, durations in seconds), from a file's path or a dict of
    sections. The extension module checks a dict as it checks a file: an
    unknown section or key (a typo), a wrong type or a value out of range
    raises InvalidRequest naming the key."""
    if isinstance(config, (str, os.PathLike)):
        return _native.load_config(os.fspath(config))
    if isinstance(config, Mapping):
        return _native.load_config(mapping=config)
    raise InvalidRequest(
        f"config must be a dict, the path of a config file or what stowage.config.load returned, "
        f"not {type(config).__name__}"
    )


class _Settings:
    """What the launcher takes from a config (docs/config.md)."""

    def __init__(self, config: Any, secret: Optional[Union[bytes, str]] = None):
        cfg = _load_config(config)
        units, listen, timeouts = cfg["units"], cfg["listen"], cfg["timeouts"]
        self.count: Optional[int] = units["count"]
        self.replicas: int = units["replicas"]
        self.placement = cfg["placement"]["clusters"]
        self.memory: int = units["memory"]
        self.cpus: float = units["cpus"]
        self.start_timeout: float = timeouts["start"]
        self.stop_timeout: float = timeouts["stop"]
        kw: Dict[str, Any] = {
            "memory": self.memory,
            "reservation_lease": units["reservation_lease"],
            "pin_lease": units["pin_lease"],
            "frame_timeout": timeouts["frame"],
            "handshake_timeout": timeouts["handshake"],
        }
        for key in (
            "max_connections",
            "max_sessions",
            "threads",
            "max_handshakes",
            "max_handshakes_per_source",
            "max_session_connections",
            "max_session_holds",
        ):
            kw[key] = units[key]
        if units["checkpoint_root"] is not None:
            kw["checkpoint_root"] = units["checkpoint_root"]
        if units["nixl"]:
            kw["nixl"] = True
            kw["require_rdma"] = units["require_rdma"]
        disk = units["disk"]
        if disk is not None:
            kw["disk"] = disk["root"]
            kw["disk_capacity"] = disk["capacity"]
            kw["high_watermark"] = disk["high_watermark"]
            kw["low_watermark"] = disk["low_watermark"]
        metrics = cfg["metrics"]
        if not metrics["enabled"]:
            kw["metrics"] = False
        else:
            kw["metrics_listen"] = metrics["listen"]
        auth = cfg["auth"]
        #: A secret this launcher generated: the directory carries it.
        self.generated: Optional[bytes] = None
        if auth["insecure"]:
            if secret is not None or auth["secret_file"] is not None:
                raise InvalidRequest("config: auth.insecure means no secret, but one was given")
            kw["insecure"] = True
        elif secret is not None:
            kw["secret"] = secret
        elif auth["secret_file"] is not None:
            # Read by each unit on its own node: the secret never travels.
            kw["secret_file"] = auth["secret_file"]
        else:
            env = _secret(None)
            if env is None:
                # Loopback TCP is open to every local user: a fresh
                # secret for this plane, handed to clients in its
                # directory.
                env = self.generated = _native.generate_secret()
            kw["secret"] = env
        self.unit_kwargs = kw
        self.listen = {
            "host": listen["host"],
            "tcp_port": listen["tcp_port"],
            "unix_dir": listen["unix_dir"],
        }


def _plan(settings: _Settings, clusters_or_nodes: Any) -> List[str]:
    """One Ray node id per unit."""
    if isinstance(clusters_or_nodes, Mapping):
        from . import placement

        clusters = placement.select_clusters(settings.placement, clusters_or_nodes)
        return [str(n) for n in placement.plan_unit_nodes(clusters, settings.count)]
    if isinstance(clusters_or_nodes, (str, bytes)) or not isinstance(clusters_or_nodes, Sequence):
        raise InvalidRequest(
            "clusters_or_nodes must be a list of Ray node ids (one per unit) "
            "or a mapping of cluster name -> cluster"
        )
    nodes = [str(n) for n in clusters_or_nodes]
    if not nodes:
        raise InvalidRequest("no nodes planned: start_units needs at least one node id")
    return nodes


def _is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "localhost")


def _check_nodes(nodes: List[str], settings: _Settings) -> None:
    """Fail fast when a planned node does not exist, is dead, or cannot hold
    the units planned on it (Ray's total CPU and memory resources), and
    when units on several hosts would listen on loopback only."""
    cpus, memory = settings.cpus, settings.memory
    known = {n["NodeID"]: n for n in ray.nodes()}
    wanted: Dict[str, List[int]] = {}
    for i, n in enumerate(nodes):
        wanted.setdefault(n, []).append(i)
    problems = []
    for node, idx in wanted.items():
        units = f"unit{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))}"
        info = known.get(node)
        if info is None:
            problems.append(f"node {node} (for {units}) is not in this Ray cluster")
            continue
        if not info.get("Alive", False):
            problems.append(f"node {node} (for {units}) is dead")
            continue
        total = info.get("Resources", {})
        if cpus > 0 and total.get("CPU", 0) < cpus * len(idx):
            problems.append(
                f"node {node} has {total.get('CPU', 0):g} CPUs; {units} need {cpus * len(idx):g} "
                f"({cpus:g} each)"
            )
        if total.get("memory", 0) < memory * len(idx):
            problems.append(
                f"node {node} has {int(total.get('memory', 0))} bytes of Ray memory; "
                f"{units} need {memory * len(idx)}"
            )
    if problems:
        raise PlacementError("cannot place the storage units: " + "; ".join(problems))
    ips = sorted({known[n].get("NodeManagerAddress", "?") for n in wanted})
    if len(ips) > 1 and _is_loopback(settings.listen["host"]):
        raise PlacementError(
            f"the planned nodes are on {len(ips)} hosts ({', '.join(ips)}) but listen.host is "
            f"{settings.listen['host']}: clients on one host could not reach units on another; "
            'set listen.host = "node-ip"'
        )


def _size(n: float) -> str:
    """Bytes as a person reads them (``16 MiB``, ``1.5 GiB``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{int(n)} bytes"


def _resource(name: str, amount: float) -> str:
    """``1 CPU``, ``2 CPUs``, ``16 MiB of memory``, ``0.5 GPU``."""
    if name in ("memory", "object_store_memory"):
        return f"{_size(amount)} of {name.replace('_', ' ')}"
    return f"{amount:g} {name}{'s' if name == 'CPU' and amount != 1 else ''}"


def _free_of(name: str, free: float, total: Optional[float]) -> str:
    """``0 of its 2 CPUs``, ``1.2 GiB of its 2 GiB of memory``."""
    if total is None:
        return _resource(name, free)
    if name in ("memory", "object_store_memory"):
        return f"{_size(free)} of its {_resource(name, total)}"
    return f"{free:g} of its {_resource(name, total)}"


def _bundle(bundle: Mapping[str, float]) -> str:
    return ", ".join(_resource(k, v) for k, v in sorted(bundle.items())) or "nothing"


def _waiting_work() -> str:
    """What the cluster's tasks and actors are waiting for, as Ray's
    autoscaler state in its control store (GCS) reports it, e.g. ``2 x {1
    CPU}`` (the demands ``ray status`` shows; actors pinned to a node, as
    units are, are not among them)."""
    status = _compat.cluster_status(ray.get_runtime_context().gcs_address, timeout=2)
    shapes: Dict[str, int] = {}
    for demand in status.resource_demands.ray_task_actor_demand:
        for by_count in demand.bundles_by_count:
            key = _bundle(by_count.bundle)
            shapes[key] = shapes.get(key, 0) + by_count.count
    return "; ".join(f"{n} x {{{k}}}" for k, n in sorted(shapes.items())) or "none"


class UnitRefused(PlacementError, InvalidRequest):
    """A unit refused its settings (e.g. a disk root another user owns):
    the message carries the unit's own reason. A :class:`PlacementError`
    like every failed start, and an :class:`stowage.InvalidRequest`: the
    settings are what was wrong."""


# What a unit's actor says when its unit refused to start (the native
# `Unit`'s error, the last line of the actor's creation error).
_REFUSED = "the unit could not start: "


def _await_units(
    refs: List[Any],
    actors: List[Any],
    labels: List[str],
    nodes: List[str],
    deadline: Tuple[float, float],
    need: Tuple[float, int],
    results: List[Any],
    what: str,
) -> None:
    """Wait for each unit's first reply (``refs[i]``, of actor ``actors[i]``
    pinned to ``nodes[i]``; stored into ``results[i]``) until every one came,
    one failed, or the deadline passed (``deadline``: the monotonic time and
    the timeout it came from; ``need``: the CPUs and Ray memory each unit
    reserves). Raises :class:`PlacementError` (``what`` did not start;
    :class:`UnitRefused` when a unit refused its settings) naming
    each unit that did not come up (``labels[i]`` names it) and, after a
    timeout, what Ray says about the cluster. Every unit still pending at the deadline is reported with
    why it waits (:func:`_pending_reasons`); after a unit failed, the others
    were not waited for."""
    at, timeout = deadline
    index = {r: i for i, r in enumerate(refs)}
    failed: List[str] = []
    refused = False
    pending = list(refs)
    while pending and not failed:
        left = at - time.monotonic()
        if left <= 0:
            break
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            i = index[ref]
            try:
                results[i] = ray.get(ref, timeout=max(0.1, at - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - reported per unit
                said = _short(e)
                refused = refused or _REFUSED in said
                failed.append(f"{labels[i]} on node {nodes[i]} failed to start: {said}")
    why: Dict[int, str] = {}
    cluster = ""
    timed_out = bool(pending) and not failed
    if timed_out:
        why, cluster = _pending_reasons(
            {index[r]: actors[index[r]] for r in pending}, nodes, need[0], need[1]
        )
    for ref in pending:
        i = index[ref]
        if timed_out:
            failed.append(
                f"{labels[i]} on node {nodes[i]} did not come up within {timeout:g} s: {why[i]}"
            )
        else:
            failed.append(f"{labels[i]} on node {nodes[i]} was not waited for")
    if failed:
        raise (UnitRefused if refused else PlacementError)(
            f"{what} did not start: " + "; ".join(failed) + (f" ({cluster})" if cluster else "")
        )


def _pending_reasons(
    actors: Dict[int, Any], nodes: List[str], cpus: float, memory: int
) -> Tuple[Dict[int, str], str]:
    """Why units that did not come up in time are still pending, as far as
    Ray's state tells within :data:`DIAGNOSE_S` seconds: per unit, its
    actor's state and what it needs against what its node has free; and
    for the cluster, its free CPUs and memory and what Ray's tasks and
    actors wait for."""
    states, avail, total, work = _bounded_all(
        [
            _compat.actor_states,
            _compat.available_resources_per_node,
            _compat.total_resources_per_node,
            _waiting_work,
        ],
        DIAGNOSE_S,
    )
    states, avail, total = states or {}, avail or {}, total or {}
    need = {"CPU": cpus, "memory": float(memory)}
    out = {}
    for i, actor in actors.items():
        state = (states.get(_compat.actor_id_hex(actor)) or {}).get("State")
        why = f"still {state or 'not started'}"
        needs = " and ".join(_resource(k, v) for k, v in need.items() if v > 0)
        why += f"; it needs {needs} on node {nodes[i]}"
        if nodes[i] in avail:
            free, has = avail[nodes[i]], total.get(nodes[i], {})
            parts = [_free_of(k, free.get(k, 0.0), has.get(k)) for k, v in need.items() if v > 0]
            why += f", which has {' and '.join(parts)} free"
            short = [k for k, v in need.items() if v > 0 and free.get(k, 0.0) < v]
            if short:
                why += f": not enough {' and '.join(short)} free"
        out[i] = why
    cluster = ""
    if avail:
        free_cpu = sum(r.get("CPU", 0.0) for r in avail.values())
        free_mem = sum(r.get("memory", 0.0) for r in avail.values())
        all_cpu = sum(r.get("CPU", 0.0) for r in total.values())
        cluster = (
            f"the Ray cluster has {free_cpu:g} of its {all_cpu:g} CPUs and {_size(free_mem)} "
            f"of memory free"
        )
    if work is not None:
        cluster += (
            f"{'; ' if cluster else ''}tasks and actors waiting for resources, as `ray status` "
            f"reports them: {work}"
        )
    return out, cluster


def _warn_if_no_cpu_is_left(reserved: float, what: str) -> Optional[str]:
    """Log (and return) a warning when ``reserved`` Ray CPUs, what ``what``
    just took, leave this Ray cluster less than one CPU of its total: a
    task or actor that asks for one CPU (Ray's default for tasks) could
    then never be scheduled, and ``ray.get`` on it would wait forever."""
    if reserved <= 0:
        return None
    total = (_bounded(ray.cluster_resources, 2.0) or {}).get("CPU")
    if total is None or total - reserved >= 1:
        return None
    text = (
        f"CPUs reserved by {what}: {reserved:g} of this Ray cluster's {total:g}, leaving "
        f"{max(0.0, total - reserved):g}: a Ray task or actor that asks for 1 CPU (the default "
        f"for tasks) can never be scheduled here; reserve fewer (units.cpus, default 0) or "
        f"give the cluster more CPUs"
    )
    logger.warning("%s", text)
    return text


def _short(e: BaseException) -> str:
    """The gist of a Ray error (the cause, without the traceback)."""
    cause = getattr(e, "cause", None) or e.__cause__
    text = str(cause) if cause is not None else str(e)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else type(e).__name__)[:500]


def start_units(
    config: Any,
    clusters_or_nodes: Any,
    *,
    timeout: Optional[float] = None,
    secret: Optional[Union[bytes, str]] = None,
) -> Units:
    """Start one storage unit per planned node as a Ray actor pinned to it.

    ``config``: a dict of config sections, the path of a config file, or
    what :func:`stowage.config.load` returned (keys and defaults:
    docs/config.md). The launcher reads ``units`` (``memory``, also
    reserved as Ray memory; ``cpus``, the Ray CPUs of each actor; leases,
    limits, ``checkpoint_root``, ``disk``; ``count`` for a mapping of
    clusters), ``placement.clusters``, ``listen`` (``host``: an address or
    ``"node-ip"``, Ray's address of the unit's node, which units on several
    hosts need; ``tcp_port``; ``unix_dir``), ``timeouts.start``,
    ``timeouts.stop`` (for :func:`stop_units`), ``timeouts.frame`` and
    ``timeouts.handshake``, and ``units.replicas``: the copies of every
    row the plane's clients keep, written into the directory (its
    ``replicas``) so that :func:`stowage.connect` uses it; fewer planned
    units than that raises :class:`stowage.InvalidRequest`, naming both
    numbers, before any unit starts.

    ``clusters_or_nodes``: a list of Ray node ids, one per unit (already
    planned), or a mapping of cluster name -> cluster (then the clusters
    ``placement.clusters`` names are selected and ``units.count`` units
    planned round-robin over their nodes, see :mod:`stowage.placement`).

    The units' shared secret (every client proves it; see
    :func:`stowage.connect`): ``secret`` (bytes or str) if given, else
    ``auth.secret_file`` (each unit reads that owner-only file on its own
    node), else ``STOWAGE_SECRET`` of this process, else a fresh one
    generated here for these units; none only with ``auth.insecure``
    (every local user, and anyone who reaches a unit, can then read,
    overwrite and clear every value). A secret from this process reaches
    the actors in Ray's actor-creation request (visible to whoever can run
    code on the Ray cluster anyway); ``auth.secret_file`` keeps it on the
    nodes. The directory carries the secret only when it was generated
    here (``secret_hex``; :func:`stowage.connect` proves it): pass the
    dict in memory (Ray object, actor argument), and keep any file holding
    it owner-only (``chmod 600``).

    Raises :class:`PlacementError` when a planned node is missing, dead or
    short of CPUs or memory (at once, before anything starts), or when a
    unit fails to start (:class:`UnitRefused`, also an
    :class:`stowage.InvalidRequest`, at once with the unit's own reason
    when it refused its settings) or is not up within ``timeout`` seconds (default
    ``timeouts.start``, 2 minutes); the message names each unit and what
    was missing: for a unit still pending, its actor's state, the CPUs
    and memory it needs against what its node has free, and, for the
    cluster, its free CPUs and memory and what Ray's tasks and actors are
    waiting for (asking Ray takes at most :data:`DIAGNOSE_S` more). What
    was started is then torn down and killed, which takes at most
    :data:`CLEANUP_TIMEOUT_S` more. Ray must be initialized (``ray.init``).

    Logs a warning when the CPUs the units reserve (``units.cpus`` each,
    none by default) leave the cluster less than one CPU: a task asking
    for Ray's default of one CPU could never be scheduled.
    """
    t0 = time.monotonic()
    settings = _Settings(config, secret)
    if timeout is None:
        timeout = settings.start_timeout
    deadline = t0 + timeout
    nodes = _plan(settings, clusters_or_nodes)
    if len(nodes) < settings.replicas:
        raise InvalidRequest(
            f"units.replicas = {settings.replicas} needs at least {settings.replicas} units, "
            f"but {len(nodes)} were planned"
        )
    if not ray.is_initialized():
        raise PlacementError("Ray is not initialized: call ray.init() before start_units")
    _check_nodes(nodes, settings)

    actors: List[Any] = []
    entries: List[Optional[Dict[str, Any]]] = []
    try:
        for i, node in enumerate(nodes):
            actors.append(
                _actor()
                .options(
                    num_cpus=settings.cpus,
                    memory=settings.memory,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                )
                .remote(i, settings.unit_kwargs, settings.listen)
            )
        refs = [a.info.remote() for a in actors]
        entries = [None] * len(refs)
        _await_units(
            refs,
            actors,
            [f"unit {i}" for i in range(len(refs))],
            nodes,
            (deadline, timeout),
            (settings.cpus, settings.memory),
            entries,
            "storage units",
        )
        units = [e for e in entries if e is not None]
        for i, entry in enumerate(units):
            # Hard node affinity makes this impossible; it is checked anyway.
            if entry["node"] != nodes[i]:
                raise PlacementError(f"unit {i} runs on node {entry['node']}, not on {nodes[i]}")
    except BaseException:
        # Units that came up remove their directories; all are killed.
        came_up = [i < len(entries) and entries[i] is not None for i in range(len(actors))]
        stop_units([a for a, up in zip(actors, came_up) if up], timeout=CLEANUP_TIMEOUT_S)
        _kill_all([a for a, up in zip(actors, came_up) if not up])
        raise
    logger.info("started %d storage units in %.1f s", len(actors), time.monotonic() - t0)
    _warn_if_no_cpu_is_left(settings.cpus * len(actors), f"{len(actors)} storage unit(s)")
    directory: Dict[str, Any] = {
        "stowage_directory": 1,
        "replicas": settings.replicas,
        "units": units,
    }
    if settings.generated is not None:
        directory["secret_hex"] = settings.generated.hex()
    return Units(actors, directory, settings.stop_timeout)


# -- teardown ------------------------------------------------------------------


def _kill_all(actors: Sequence[Any]) -> None:
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception as e:  # noqa: BLE001 - teardown never raises
            logger.warning("could not kill a storage unit actor: %r", e)


def stop_units(
    units: Union[Units, Sequence[Any]], timeout: Optional[float] = None
) -> List[List[str]]:
    """Tear every unit down (in parallel) and kill its actor, within about
    ``timeout`` seconds (default: the config's ``timeouts.stop`` that
    :func:`start_units` was given, else 30); never raises.

    Each unit's teardown runs explicitly (it stops taking work, abandons a
    checkpoint that does not finish, removes its disk directory and its
    socket directory); a unit whose teardown does not answer in time is
    killed anyway. Returns, per unit, what could not be done (also
    logged)."""
    try:
        actors = list(units.actors if isinstance(units, Units) else units)
    except Exception as e:  # noqa: BLE001
        logger.warning("stop_units: not a list of units: %r", e)
        return []
    if timeout is None:
        timeout = getattr(units, "stop_timeout", STOP_TIMEOUT_S)
    problems: List[List[str]] = [[] for _ in actors]
    try:
        deadline = time.monotonic() + max(0.0, timeout)
        # The unit's own bound leaves room for its answer to travel back.
        unit_timeout = max(0.1, timeout * 0.8 - 0.5)
        refs: List[Any] = []
        for i, a in enumerate(actors):
            try:
                refs.append(a.close.remote(unit_timeout))
            except Exception as e:  # noqa: BLE001
                refs.append(None)
                problems[i].append(f"could not ask for teardown: {_short(e)}")
        live = [r for r in refs if r is not None]
        done: set = set()
        if live:
            ready, _ = ray.wait(
                live, num_returns=len(live), timeout=max(0.0, deadline - time.monotonic())
            )
            done = set(ready)
        for i, ref in enumerate(refs):
            if ref is None:
                continue
            if ref not in done:
                problems[i].append(f"teardown did not finish within {timeout:g} s; killed")
                continue
            try:
                problems[i].extend(ray.get(ref, timeout=0.1))
            except Exception as e:  # noqa: BLE001 - a dead actor's teardown cannot run
                problems[i].append(f"teardown did not run: {_short(e)}")
    except Exception as e:  # noqa: BLE001 - teardown never raises
        logger.warning("stop_units: %r", e)
    finally:
        _kill_all(actors)
    for i, p in enumerate(problems):
        for line in p:
            logger.warning("storage unit %d: %s", i, line)
    return problems


# -- liveness ------------------------------------------------------------------


def _bounded(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` on a helper thread, or None when it fails or does not
    return within ``timeout`` seconds (a stuck Ray call cannot hold the
    caller past its bound)."""
    return _bounded_all([fn], timeout)[0]


def _bounded_all(fns: List[Callable[[], Any]], timeout: float) -> List[Any]:
    """Every ``fn()`` at once, each on a helper thread; the results of
    those that returned within ``timeout`` seconds in all (None for the
    others, and for those that failed)."""
    futures = [_on_daemon_thread(fn) for fn in fns]
    concurrent.futures.wait(futures, timeout)
    return [f.result() if f.done() and f.exception() is None else None for f in futures]


def _on_daemon_thread(fn: Callable[[], Any]) -> concurrent.futures.Future:
    """A future of ``fn()``, run on a thread of its own. A daemon thread,
    not a :class:`concurrent.futures.ThreadPoolExecutor`'s: the interpreter
    waits for those at exit, and a Ray call that never returns would keep
    the process from exiting."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn())
        except Exception as e:  # noqa: BLE001 - unknown: the caller gets None
            future.set_exception(e)

    threading.Thread(target=run, name="stowage-ray-query", daemon=True).start()
    return future


def _actor_state(actor_id: str, timeout: float) -> Optional[str]:
    """The actor's state as Ray's control store (GCS) knows it ("ALIVE",
    "DEAD", "PENDING_CREATION", ...), or None when not known within
    ``timeout`` seconds."""
    info = _bounded(lambda: _compat.actor_info(actor_id), timeout)
    return info.get("State") if isinstance(info, Mapping) else None


def liveness(entry: Mapping[str, Any], timeout: float = LIVENESS_TIMEOUT_S) -> str:
    """Whether the Ray actor of a directory entry is ``"dead"`` (its unit
    and the keys it held are gone), ``"alive"``, or ``"unknown"`` (not an
    entry of a Ray-started unit, Ray not initialized in this process, no
    answer within ``timeout`` seconds, any error). Never raises.

    :func:`stowage.connect` calls it only after an operation on that unit
    failed, never on the operation path."""
    try:
        actor_id = entry["ray"]["actor_id"]
        if not ray.is_initialized():
            return "unknown"
        state = _actor_state(str(actor_id), timeout)
    except Exception:  # noqa: BLE001 - never raises
        return "unknown"
    if state == "DEAD":
        return "dead"
    if state == "ALIVE":
        return "alive"
    return "unknown"
