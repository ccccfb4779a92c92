"""stowage.placement: which clusters hold units, and one node per unit."""

from __future__ import annotations

import logging

import pytest

import stowage
from stowage.placement import node_ids, plan_unit_nodes, select_clusters


class VirtualCluster:
    """A stand-in for a framework's cluster object: node ids by method."""

    def __init__(self, *nodes: str):
        self._nodes = list(nodes)

    def get_node_ids(self):
        return list(self._nodes)


class AttrCluster:
    """Node ids as a plain attribute."""

    def __init__(self, *nodes: str):
        self.node_ids = list(nodes)


class MethodCluster:
    """Node ids from a zero-argument ``node_ids()`` method."""

    def __init__(self, *nodes: str):
        self._nodes = list(nodes)

    def node_ids(self):
        return tuple(self._nodes)


TRAIN = ["t0", "t1"]
INFER = ["i0"]
TEACHER = ["t1", "x0"]  # shares t1 with TRAIN
COLOCATED = ["c0", "c1"]

# (what, placement, clusters_by_name, expected selection as names of the
# objects above, names the alias note must call left out)
SELECT_CASES = [
    ("all", "all", {"train": TRAIN, "inference": INFER}, ["TRAIN", "INFER"], []),
    (
        "all keeps mapping order",
        "all",
        {"inference": INFER, "train": TRAIN},
        ["INFER", "TRAIN"],
        [],
    ),
    ("one name", ["inference"], {"train": TRAIN, "inference": INFER}, ["INFER"], []),
    (
        "mapping order, not placement order",
        ["teacher:t", "train"],
        {"train": TRAIN, "inference": INFER, "teacher:t": TEACHER},
        ["TRAIN", "TEACHER"],
        [],
    ),
    ("a tuple of names", ("train",), {"train": TRAIN, "inference": INFER}, ["TRAIN"], []),
    ("a name twice", ["train", "train"], {"train": TRAIN, "inference": INFER}, ["TRAIN"], []),
    (
        "colocated under all: one cluster",
        "all",
        {"train": COLOCATED, "inference": COLOCATED, "teacher:t": TEACHER},
        ["COLOCATED", "TEACHER"],
        [],
    ),
    (
        "colocated, both names: one cluster, no note",
        ["inference", "train"],
        {"train": COLOCATED, "inference": COLOCATED},
        ["COLOCATED"],
        [],
    ),
    (
        "colocated, one name excluded: excludes nothing",
        ["train"],
        {"train": COLOCATED, "inference": COLOCATED, "teacher:t": TEACHER},
        ["COLOCATED"],
        ["inference"],
    ),
    (
        "colocated, the other name excluded",
        ["inference", "teacher:t"],
        {"train": COLOCATED, "teacher:t": TEACHER, "inference": COLOCATED},
        ["COLOCATED", "TEACHER"],
        ["train"],
    ),
    (
        'a cluster named "all" is selected by ["all"]',
        ["all"],
        {"all": TRAIN, "train": INFER},
        ["TRAIN"],
        [],
    ),
]

_OBJECTS = {"TRAIN": TRAIN, "INFER": INFER, "TEACHER": TEACHER, "COLOCATED": COLOCATED}


@pytest.mark.parametrize(
    "placement, clusters, want, left_out",
    [c[1:] for c in SELECT_CASES],
    ids=[c[0] for c in SELECT_CASES],
)
def test_select_clusters_table(caplog, placement, clusters, want, left_out):
    with caplog.at_level(logging.INFO, logger="stowage.placement"):
        got = select_clusters(placement, clusters)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g is _OBJECTS[w]
    notes = [r for r in caplog.records if r.name == "stowage.placement"]
    if not left_out:
        assert notes == []
    else:
        assert len(notes) == 1
        msg = notes[0].getMessage()
        assert notes[0].levelno == logging.INFO
        assert "excludes nothing" in msg
        for name in left_out:
            assert f'leaving out "{name}"' in msg


def test_identity_not_equality_makes_a_cluster():
    a = ["n0", "n1"]
    b = ["n0", "n1"]  # equal, but another object: another cluster
    got = select_clusters("all", {"train": a, "inference": b})
    assert len(got) == 2 and got[0] is a and got[1] is b
    # Their nodes are the same nodes, though: each counts once.
    assert plan_unit_nodes(got) == ["n0", "n1", "n0", "n1"]


def test_select_clusters_returns_the_objects_given():
    vc = VirtualCluster("a", "b")
    got = select_clusters(["train"], {"train": vc, "inference": vc})
    assert got == [vc] and got[0] is vc


@pytest.mark.parametrize(
    "placement, clusters, phrase",
    [
        (["trian"], {"train": TRAIN, "inference": INFER}, 'its clusters: "train", "inference"'),
        (["Train"], {"train": TRAIN}, 'cluster "Train"'),
        ([], {"train": TRAIN}, "names no cluster"),
        ((), {"train": TRAIN}, "names no cluster"),
        ("train", {"train": TRAIN}, '["train"]'),
        ("", {"train": TRAIN}, '"all" or a list'),
        (None, {"train": TRAIN}, '"all" or a list'),
        (3, {"train": TRAIN}, '"all" or a list'),
        ([1], {"train": TRAIN}, "a cluster name is a str"),
        ("all", {}, "no clusters"),
        (["train"], {}, "no clusters"),
        ("all", [("train", TRAIN)], "must be a mapping"),
        ("all", {1: TRAIN}, "a cluster name is a str"),
    ],
)
def test_select_clusters_errors(placement, clusters, phrase):
    with pytest.raises(stowage.InvalidRequest) as e:
        select_clusters(placement, clusters)
    assert phrase in str(e.value)


# (what, clusters, count, expected node of each unit)
PLAN_CASES = [
    ("no count: two per node", [["n0", "n1", "n2"]], None, ["n0", "n1", "n2", "n0", "n1", "n2"]),
    (
        "no count over two clusters",
        [["a0", "a1"], ["b0"]],
        None,
        ["a0", "a1", "b0", "a0", "a1", "b0"],
    ),
    ("count below the nodes", [["a0", "a1"], ["b0", "b1"]], 3, ["a0", "a1", "b0"]),
    ("count equal to the nodes", [["a0", "a1"], ["b0"]], 3, ["a0", "a1", "b0"]),
    (
        "count above the nodes wraps",
        [["a0", "a1"], ["b0"]],
        7,
        ["a0", "a1", "b0", "a0", "a1", "b0", "a0"],
    ),
    ("one unit", [["a0", "a1"]], 1, ["a0"]),
    ("one node", [["only"]], 3, ["only", "only", "only"]),
    (
        "shared node counts once",
        [["n0", "n1"], ["n1", "n2"]],
        None,
        ["n0", "n1", "n2", "n0", "n1", "n2"],
    ),
    ("node twice in a cluster", [["n1", "n0", "n1"]], None, ["n1", "n0", "n1", "n0"]),
    ("given order, no sorting", [["z", "a", "m"]], 4, ["z", "a", "m", "z"]),
    ("an empty cluster beside others", [[], ["b0"]], 2, ["b0", "b0"]),
    ("tuples", (("a", "b"),), None, ["a", "b", "a", "b"]),
    ("get_node_ids()", [VirtualCluster("v0", "v1")], 3, ["v0", "v1", "v0"]),
    ("node_ids attribute", [AttrCluster("p0"), ["p0", "p1"]], None, ["p0", "p1", "p0", "p1"]),
    ("node_ids() method", [MethodCluster("m1", "m0")], 2, ["m1", "m0"]),
    (
        "mixed kinds, shared nodes",
        [VirtualCluster("a", "b"), AttrCluster("b", "c"), ["c", "d"]],
        None,
        ["a", "b", "c", "d", "a", "b", "c", "d"],
    ),
]


@pytest.mark.parametrize(
    "clusters, count, want", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES]
)
def test_plan_unit_nodes_table(clusters, count, want):
    assert plan_unit_nodes(clusters, count) == want
    # Deterministic: the same answer every time.
    assert plan_unit_nodes(clusters, count) == want


@pytest.mark.parametrize(
    "clusters, count, phrase",
    [
        ([["n0"]], 0, "at least 1"),
        ([["n0"]], -2, "at least 1"),
        ([["n0"]], True, "an int or None"),
        ([["n0"]], "2", "an int or None"),
        ([["n0"]], 1.5, "an int or None"),
        ([], None, "no nodes"),
        ([[], []], 2, "no nodes"),
        ("n0", None, "not str"),
        (["n0"], None, "not the string"),
        ([["n0", 3]], None, "a node id is a str"),
        ([["n0", ""]], None, "a node id is empty"),
        ([{"n0", "n1"}], None, "not set"),
        ([{"n0": 1}], None, "not dict"),
        ([object()], None, "must be a list of node ids"),
        ([AttrCluster()], None, "no nodes"),
    ],
)
def test_plan_unit_nodes_errors(clusters, count, phrase):
    with pytest.raises(stowage.InvalidRequest) as e:
        plan_unit_nodes(clusters, count)
    assert phrase in str(e.value)


def test_node_ids_prefers_node_ids_over_get_node_ids():
    class Both:
        node_ids = ["x"]

        def get_node_ids(self):
            return ["y"]

    assert node_ids(Both()) == ["x"]
    assert node_ids(VirtualCluster("a")) == ["a"]
    assert node_ids(iter(["g0", "g1"])) == ["g0", "g1"]


def test_select_then_plan():
    """A colocated run with a teacher, placing units on the training side."""
    workers = VirtualCluster("n0", "n1")
    teacher = VirtualCluster("n1", "n2")
    by_name = {"train": workers, "inference": workers, "teacher:big": teacher}
    assert plan_unit_nodes(select_clusters(["train"], by_name)) == ["n0", "n1", "n0", "n1"]
    assert plan_unit_nodes(select_clusters("all", by_name), 4) == ["n0", "n1", "n2", "n0"]


def test_native_functions_match_the_wrappers():
    from stowage import _native

    selected, notes = _native.select_clusters(["train"], {"train": TRAIN, "inference": TRAIN})
    assert selected == [TRAIN] and selected[0] is TRAIN
    assert len(notes) == 1 and 'leaving out "inference"' in notes[0]
    assert _native.plan_unit_nodes([["a"], ["b"]]) == ["a", "b", "a", "b"]
    assert _native.plan_unit_nodes([["a"], ["b"]], count=3) == ["a", "b", "a"]
