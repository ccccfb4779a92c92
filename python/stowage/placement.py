"""Where a job's storage units go: the clusters a placement names, and one
node per unit over their nodes.

A job has clusters (training workers, inference engines, a teacher's
workers), each registered under a name such as ``"train"``,
``"inference"`` or ``"teacher:<name>"``. A colocated run registers one
cluster object under two names; it is one cluster.

    from stowage.placement import select_clusters, plan_unit_nodes

    clusters = select_clusters(["train"], {"train": train, "inference": infer})
    nodes = plan_unit_nodes(clusters, count=None)   # node id of each unit

A cluster is a sequence of node-id strs, or an object with node ids: an
attribute ``node_ids`` (a list, or a method returning one), else a method
``get_node_ids()``. Both functions are deterministic; bad input raises
:class:`stowage.InvalidRequest`. The rules are in docs/config.md
("Placement").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping as _MappingABC
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Union

from . import _native
from ._native import InvalidRequest

__all__ = ["node_ids", "plan_unit_nodes", "select_clusters"]

#: Notes about the placement (a name left out whose cluster is selected
#: anyway through another name) are logged here, at INFO.
logger = logging.getLogger("stowage.placement")


def select_clusters(
    placement: Union[str, Sequence[str]], clusters_by_name: Mapping[str, Any]
) -> List[Any]:
    """The clusters ``placement`` names: ``"all"`` (every one) or a
    non-empty list of names, keys of ``clusters_by_name``.

    Each cluster comes once, in the mapping's order, whatever the order of
    the names. One object under two names is one cluster (by identity,
    ``is``): naming either selects it, so leaving the other name out
    excludes nothing (that is logged to the ``stowage.placement`` logger).
    A name the mapping lacks raises InvalidRequest listing the names it has.
    """
    selected, notes = _native.select_clusters(placement, clusters_by_name)
    for note in notes:
        logger.info("%s", note)
    return selected


def node_ids(cluster: Any) -> List[Any]:
    """The node ids of a cluster: its ``node_ids`` attribute (called if it
    is a method), else its ``get_node_ids()``, else the cluster itself as a
    sequence of node ids. Order is kept; an unordered set is refused."""
    if isinstance(cluster, (str, bytes)):
        raise InvalidRequest(
            f"a cluster is a list of node ids or an object with node_ids, not the string {cluster!r}"
        )
    ids = getattr(cluster, "node_ids", None)
    if ids is not None:
        if callable(ids):
            ids = ids()
        source = f"{type(cluster).__name__}.node_ids"
    else:
        get = getattr(cluster, "get_node_ids", None)
        if callable(get):
            ids = get()
            source = f"{type(cluster).__name__}.get_node_ids()"
        else:
            ids = cluster
            source = f"a cluster ({type(cluster).__name__})"
    if isinstance(ids, (str, bytes, set, frozenset, _MappingABC)) or not isinstance(ids, Iterable):
        raise InvalidRequest(
            f"{source} must be a list of node ids (or an object with node_ids or get_node_ids()), "
            f"not {type(ids).__name__}"
        )
    return list(ids)


def plan_unit_nodes(clusters: Sequence[Any], count: Optional[int] = None) -> List[str]:
    """One node id per unit: the nodes of ``clusters`` (e.g. what
    :func:`select_clusters` returned), cluster by cluster, each in its
    given order, a node shared by two clusters counted once; unit ``i``
    goes to node ``i % n`` (round-robin). ``count=None``: two units per
    node. No nodes, or a count below 1, raises InvalidRequest."""
    if isinstance(clusters, (str, bytes)) or not isinstance(clusters, Iterable):
        raise InvalidRequest(f"clusters must be a list of clusters, not {type(clusters).__name__}")
    return _native.plan_unit_nodes([node_ids(c) for c in clusters], count)
