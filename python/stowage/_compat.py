"""Every private API of Ray and TransferQueue that stowage uses, in one
place, checked against the versions it was written for.

Nothing else in the package reaches into ``ray._private``, an actor
handle's private attributes, Ray's autoscaler SDK, TransferQueue's
underscored names, or omegaconf's (which TransferQueue brings): it calls
the functions here.

Written for:

- Ray :data:`RAY` ``2.60`` (any 2.60.x: the ``ray==2.60.*`` that
  scripts/build-python installs; the ``ray`` extra asks for ``>=2.60``);
- TransferQueue :data:`TQ` ``0.1.11`` (the ``tq`` extra's
  ``transferqueue==0.1.11``);
- omegaconf: whichever TransferQueue brings, not checked (stowage uses one
  private name of it, to redact secrets in YAML dumps, and goes without
  that when it is missing).

On the first use of a package's private API, this module reads the
package's installed version (its ``__version__``, else its distribution's
metadata), once per process. A version it was written for is used
silently. Another one is used as it is, with one logged warning per
package (logger ``stowage.compat``), as long as the API is there; where it
is not, the call raises :class:`UnsupportedVersion`, which names the
version it found and the one it supports.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
import threading
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple, TypeVar

from ._native import Error

logger = logging.getLogger("stowage.compat")

T = TypeVar("T")


class Package(NamedTuple):
    """A package whose private API stowage uses, and the version (a
    release, or a prefix of releases: ``2.60`` is every ``2.60.x``) this
    module was written for."""

    label: str  # its name in messages
    module: str  # its import name
    dist: str  # its distribution's name
    supported: str


RAY = Package("Ray", "ray", "ray", "2.60")
TQ = Package("TransferQueue", "transfer_queue", "transferqueue", "0.1.11")


class UnsupportedVersion(Error, RuntimeError):
    """The installed Ray or TransferQueue lacks a private API stowage uses:
    it is not a version stowage was written for, and the message says
    which version it found and which one stowage supports."""


def installed_version(pkg: Package) -> str:
    """The installed version of ``pkg`` (``"unknown"`` when neither its
    module nor its distribution says)."""
    module = sys.modules.get(pkg.module) or importlib.import_module(pkg.module)
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(pkg.dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def supports(pkg: Package, version: str) -> bool:
    """Whether ``version`` of ``pkg`` is one this module was written for."""
    return version == pkg.supported or version.startswith(pkg.supported + ".")


# Per package (its module name): whether its installed version is
# supported, and that version; filled at the first use.
_seen: Dict[str, Tuple[bool, str]] = {}
_lock = threading.Lock()


def _check(pkg: Package) -> Tuple[bool, str]:
    seen = _seen.get(pkg.module)
    if seen is not None:
        return seen
    with _lock:
        seen = _seen.get(pkg.module)
        if seen is None:
            version = installed_version(pkg)
            seen = (supports(pkg, version), version)
            if not seen[0]:
                logger.warning(
                    "stowage uses private APIs of %s written for %s %s; found %s %s: using "
                    "them as they are (a call whose API is gone raises UnsupportedVersion)",
                    pkg.label,
                    pkg.label,
                    pkg.supported,
                    pkg.label,
                    version,
                )
            _seen[pkg.module] = seen
    return seen


def _private(pkg: Package, what: str, get: Callable[[], T]) -> T:
    """``get()``, which looks up the private API ``what`` of ``pkg``
    (without calling it), after the version check; when it is missing from
    a version this module was not written for, :class:`UnsupportedVersion`."""
    ok, version = _check(pkg)
    try:
        return get()
    except (AttributeError, ImportError) as e:
        if ok:
            raise
        raise UnsupportedVersion(
            f"stowage uses {what}, a private API of {pkg.label} {pkg.supported}, which the "
            f"installed {pkg.label} {version} lacks ({e}); stowage supports {pkg.label} "
            f"{pkg.supported}"
        ) from e


def _attr(pkg: Package, module: str, name: str) -> Any:
    """``module.name``, a private API of ``pkg``."""
    return _private(pkg, f"{module}.{name}", lambda: getattr(importlib.import_module(module), name))


# -- Ray ---------------------------------------------------------------------


def actor_states() -> Dict[str, Any]:
    """Every actor's entry in Ray's control store (GCS), by actor id (hex):
    ``ray._private.state.actors()``."""
    result: Dict[str, Any] = _attr(RAY, "ray._private.state", "actors")()
    return result


def actor_info(actor_id: str) -> Any:
    """One actor's entry in Ray's control store (GCS), with its
    ``"State"``: ``ray._private.state.actors(actor_id=...)``."""
    return _attr(RAY, "ray._private.state", "actors")(actor_id=actor_id)


def available_resources_per_node() -> Dict[str, Dict[str, float]]:
    """Each node's free resources: ``ray._private.state.available_resources_per_node()``."""
    result: Dict[str, Dict[str, float]] = _attr(
        RAY, "ray._private.state", "available_resources_per_node"
    )()
    return result


def total_resources_per_node() -> Dict[str, Dict[str, float]]:
    """Each node's resources: ``ray._private.state.total_resources_per_node()``."""
    result: Dict[str, Dict[str, float]] = _attr(
        RAY, "ray._private.state", "total_resources_per_node"
    )()
    return result


def cluster_status(gcs_address: str, timeout: int) -> Any:
    """The autoscaler's view of the cluster (its pending resource demands
    among it), from Ray's internal autoscaler SDK:
    ``ray.autoscaler.v2.sdk.get_cluster_status``."""
    get = _attr(RAY, "ray.autoscaler.v2.sdk", "get_cluster_status")
    return get(gcs_address, timeout=timeout)


def actor_id_hex(actor: Any) -> str:
    """The id (hex) of the actor behind a handle: ``handle._actor_id``."""
    actor_id = _private(RAY, "ActorHandle._actor_id", lambda: actor._actor_id)
    return str(actor_id.hex())


# -- TransferQueue -----------------------------------------------------------


def controller_default_options() -> Mapping[str, Any]:
    """The Ray options TransferQueue's controller actor is started with:
    ``TransferQueueController._default_options``."""
    controller = _attr(TQ, "transfer_queue.controller", "TransferQueueController")
    options: Mapping[str, Any] = _private(
        TQ, "TransferQueueController._default_options", lambda: controller._default_options
    )
    return options


def controller() -> Optional[Any]:
    """The handle of the controller ``tq.init`` made in this process, or
    None: ``transfer_queue.interface._TQ_CONTROLLER``."""
    return _attr(TQ, "transfer_queue.interface", "_TQ_CONTROLLER")


def forget_controller() -> None:
    """Makes ``tq.init`` start afresh: clears
    ``transfer_queue.interface._TQ_CONTROLLER`` and ``_TQ_STORAGE``."""
    names = ("_TQ_CONTROLLER", "_TQ_STORAGE")
    for name in names:
        _attr(TQ, "transfer_queue.interface", name)
    interface = importlib.import_module("transfer_queue.interface")
    for name in names:
        setattr(interface, name, None)


def registered_manager(backend: str) -> Any:
    """The storage manager class registered under ``backend``, or None:
    ``StorageManagerFactory._registry.get(backend)``."""
    factory = _attr(TQ, "transfer_queue.storage.managers.base", "StorageManagerFactory")
    registry: Mapping[str, Any] = _private(
        TQ, "StorageManagerFactory._registry", lambda: factory._registry
    )
    return registry.get(backend)


def custom_backend_meta(metadata: Any) -> Any:
    """A batch's per-row backend notes (what the backend's put returned):
    ``metadata._custom_backend_meta``."""
    return _private(TQ, "BatchMeta._custom_backend_meta", lambda: metadata._custom_backend_meta)


# -- omegaconf (as TransferQueue brings it; not version-checked) -------------


def omegaconf_dumper() -> Any:
    """omegaconf's YAML dumper class: ``omegaconf._utils.get_omega_conf_dumper()``
    (raises when this omegaconf has none)."""
    from omegaconf._utils import get_omega_conf_dumper

    return get_omega_conf_dumper()
