"""stowage.nemo_rl's boundary types: with NeMo-RL importable, the client
subclasses its DataPlaneClient (every abstract method implemented) and
the module's KVBatchMeta is NeMo-RL's; without it, the local KVBatchMeta
has the same fields and transforms. No units needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip(
    "torch", reason="stowage.nemo_rl needs torch: pip install 'stowage-rl[nemo-rl]'"
)
pytest.importorskip(
    "tensordict", reason="stowage.nemo_rl needs tensordict: pip install 'stowage-rl[nemo-rl]'"
)

import stowage.nemo_rl as nr

# A stand-in for nemo_rl.data_plane.interfaces: an ABC with the boundary's
# methods (list_sample_ids, save_checkpoint and load_checkpoint included, as
# NeMo-RL's later versions have them)
# and a KVBatchMeta class of its own.
_FAKE_INTERFACES = """
from abc import ABC, abstractmethod  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

@dataclass
class KVBatchMeta:
    partition_id: str
    task_name: object
    sample_ids: list
    fields: object = None
    sequence_lengths: object = None
    extra_info: dict = field(default_factory=dict)
    tags: object = None

    @property
    def size(self):
        return len(self.sample_ids)

class DataPlaneClient(ABC):
    pass

for _name in ["register_partition", "claim_meta", "get_data", "check_consumption_status",
              "put_samples", "get_samples", "list_sample_ids", "clear_samples",
              "save_checkpoint", "load_checkpoint", "close"]:
    setattr(DataPlaneClient, _name, abstractmethod(lambda self, *a, **k: None))
DataPlaneClient.__abstractmethods__ = frozenset(
    n for n in dir(DataPlaneClient) if getattr(getattr(DataPlaneClient, n), "__isabstractmethod__", False)
)
"""

_CHECK = """
import stowage, stowage.nemo_rl as nr  # noqa: E402
from nemo_rl.data_plane.interfaces import DataPlaneClient, KVBatchMeta  # noqa: E402
assert issubclass(nr.StowageDataPlaneClient, DataPlaneClient)
assert nr.KVBatchMeta is KVBatchMeta
with stowage.local(units=1, memory="16MiB") as plane:
    c = nr.StowageDataPlaneClient(plane)   # TypeError if an abstract method is missing
    m = c.put_samples([], "p")
    assert type(m) is KVBatchMeta, type(m)
    # Checkpoints are implemented: units without a checkpoint root refuse
    # a save, and a load after a data operation (the put above) is refused.
    for call, error in ((lambda: c.save_checkpoint("/nowhere"), stowage.Error),
                        (lambda: c.load_checkpoint("/nowhere"), RuntimeError)):
        try:
            call()
        except NotImplementedError:
            raise AssertionError("checkpoints are implemented")
        except error:
            pass
        else:
            raise AssertionError("a checkpoint call that cannot succeed returned")
    c.close()
print("ok")
"""


def test_with_nemo_rl_the_client_is_its_data_plane_client(tmp_path):
    pkg = tmp_path / "nemo_rl" / "data_plane"
    pkg.mkdir(parents=True)
    (tmp_path / "nemo_rl" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "interfaces.py").write_text(_FAKE_INTERFACES)
    r = subprocess.run(
        [sys.executable, "-c", _CHECK],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


@pytest.fixture
def meta():
    return nr._LocalKVBatchMeta(
        partition_id="p",
        task_name="t",
        sample_ids=["a", "b", "c"],
        fields=["x"],
        sequence_lengths=[1, 2, 3],
        extra_info={"k": 1},
        tags=[{"i": 0}, {"i": 1}, {"i": 2}],
    )


def test_local_meta_checks_tags_align():
    with pytest.raises(ValueError, match="tags"):
        nr._LocalKVBatchMeta(partition_id="p", task_name=None, sample_ids=["a"], tags=[])


def test_local_meta_subset_slice_drop(meta):
    s = meta.subset([2, 0])
    assert (s.sample_ids, s.sequence_lengths, s.tags) == (["c", "a"], [3, 1], [{"i": 2}, {"i": 0}])
    assert (s.partition_id, s.task_name, s.fields, s.extra_info) == ("p", "t", ["x"], {"k": 1})
    assert s.extra_info is not meta.extra_info
    sl = meta.slice(1, 3)
    assert (sl.sample_ids, sl.sequence_lengths) == (["b", "c"], [2, 3])
    d = meta.drop([1])
    assert d is not None and d.sample_ids == ["a", "c"]
    assert meta.drop([0, 1, 2]) is None
    assert meta.size == 3


def test_local_meta_concat(meta):
    other = nr._LocalKVBatchMeta(partition_id="p", task_name="t", sample_ids=["d"])
    c = meta.concat(meta.slice(0, 1))
    assert c.sample_ids == ["a", "b", "c", "a"]
    assert c.sequence_lengths == [1, 2, 3, 1]
    assert len(c.tags) == 4
    # One side without lengths or tags: the result has none.
    c2 = meta.concat(other)
    assert c2.sample_ids == ["a", "b", "c", "d"]
    assert c2.sequence_lengths is None and c2.tags is None
    with pytest.raises(ValueError, match="partition"):
        meta.concat(nr._LocalKVBatchMeta(partition_id="q", task_name="t", sample_ids=[]))


def test_local_meta_with_fields_and_stamp_tags(meta):
    w = meta.with_fields(["y", "x", "z"])
    assert w.fields == ["x", "y", "z"]
    assert meta.fields == ["x"]
    w.tags[0]["i"] = 99
    assert meta.tags[0]["i"] == 0
    bare = nr._LocalKVBatchMeta(partition_id="p", task_name=None, sample_ids=["a", "b"])
    bare.stamp_tags({"r": [0.5, 1.0]})
    assert bare.tags == [{"r": 0.5}, {"r": 1.0}]
    with pytest.raises(ValueError, match="'r'"):
        bare.stamp_tags({"r": [1.0]})
