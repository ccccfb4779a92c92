"""stowage as a TransferQueue backend: what TransferQueue's own suites do
not cover (a unit killed mid-step, the disk tier, checkpoints, close).

Needs ``transferqueue`` (``pip install 'stowage-rl[tq]'``; ``scripts/test-tq``
builds a venv with it). Every test starts its own TransferQueue system on a
private local Ray instance and closes it.
"""

from __future__ import annotations

import json
import os
import time

import pytest

tq = pytest.importorskip(
    "transfer_queue",
    reason="transferqueue is not installed: these tests need `pip install 'stowage-rl[tq]'` "
    "(scripts/test-tq runs them in a venv that has it)",
)
torch = pytest.importorskip("torch", reason="TransferQueue needs torch")

import numpy as np  # noqa: E402
import ray  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transfer_queue import interface  # noqa: E402

import stowage  # noqa: E402
import stowage.tq  # noqa: E402

#: Settings every system of this module gets: a secret (pickled cells are
#: authenticated with a key derived from it; until every launcher makes
#: one itself), and checkpoints allowed under pytest's private (0700)
#: temporary directory, where the tests save them.
BASE: dict = {}


@pytest.fixture(scope="module", autouse=True)
def private_ray(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    secret = tmp_path_factory.mktemp("secret") / "secret"
    secret.touch(mode=0o600)
    secret.write_text(os.urandom(32).hex())
    BASE.update(secret_file=str(secret), checkpoint_root=str(base))
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


def _connect(directory):
    with open(BASE["secret_file"], "rb") as f:
        return stowage.connect(directory, namespace="transfer_queue", secret=f.read().strip())


def _conf(**block):
    return OmegaConf.create(
        {
            "controller": {"polling_mode": True},
            "backend": {
                "storage_backend": "Stowage",
                "Stowage": {"count": 2, "memory": "64MiB", **BASE, **block},
            },
        }
    )


@pytest.fixture
def system():
    """A TransferQueue system on two stowage units; closed after the test."""
    tq.init(_conf())
    yield interface._TQ_STORAGE["Stowage"]
    tq.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait_gone(pids, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _gidx(partition, keys):
    ctl = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    snap = ray.get(ctl.get_partition_snapshot.remote(partition))
    return [snap.keys_mapping[k] for k in keys]


def test_unit_killed_mid_step_names_the_lost_rows(system):
    keys = [f"k{i}" for i in range(8)]
    tq.kv_batch_put(
        keys=keys,
        partition_id="step-0",
        fields=TensorDict({"ids": torch.arange(8 * 4).reshape(8, 4)}, batch_size=8),
        tags=[{} for _ in keys],
    )
    gidx = _gidx("step-0", keys)
    # Global index g lives on unit g % 2: kill unit 0 between put and get.
    entry = system.directory["units"][0]
    ray.kill(system.units[0], no_restart=True)
    assert _wait_gone([entry["pid"]]) == []
    with pytest.raises(stowage.tq.RowsLost) as info:
        tq.kv_batch_get(keys=keys, partition_id="step-0")
    lost = sorted(g for g in gidx if g % 2 == 0)
    assert sorted(info.value.global_indexes) == lost
    assert info.value.partition == "step-0" and info.value.unit == 0
    assert str(lost) in str(info.value), str(info.value)
    # The other unit's rows still read back.
    kept = [k for k, g in zip(keys, gidx) if g % 2 == 1]
    got = tq.kv_batch_get(keys=kept, partition_id="step-0")
    want = torch.stack([torch.arange(4) + 4 * keys.index(k) for k in kept])
    assert torch.equal(torch.stack(list(got["ids"].unbind())), want)


def test_with_two_copies_a_unit_killed_mid_run_loses_no_row():
    """replicas: 2 over 3 units: a unit killed mid-step loses nothing; the
    job goes on (puts, gets and clears of the next steps); once repaired,
    a second unit's death loses nothing either."""
    tq.init(_conf(count=3, replicas=2))
    try:
        system = interface._TQ_STORAGE["Stowage"]
        keys = [f"k{i}" for i in range(12)]

        def put(step):
            ids = torch.arange(12 * 4).reshape(12, 4) + 1000 * step
            tq.kv_batch_put(
                keys=keys,
                partition_id=f"step-{step}",
                fields=TensorDict({"ids": ids}, batch_size=12),
                tags=[{} for _ in keys],
            )
            return ids

        def check(step, want):
            got = tq.kv_batch_get(keys=keys, partition_id=f"step-{step}")
            assert torch.equal(_rows(got["ids"]), want), step

        want0 = put(0)
        entry = system.directory["units"][0]
        ray.kill(system.units[0], no_restart=True)
        assert _wait_gone([entry["pid"]]) == []
        # Every row of the step put before the kill reads back.
        check(0, want0)
        # The next steps: put, read, clear, with one unit fewer.
        for step in (1, 2):
            check(step, put(step))
        tq.kv_clear(keys=keys, partition_id="step-1")
        want2 = put(2)
        check(2, want2)
        check(0, want0)
        # Repaired (by the job's own clients in the background, or by this
        # pass): every row has its 2 copies on the 2 units left, so a
        # second kill loses nothing either.
        with _connect(system.directory) as c:
            # Asking every unit finds unit 0 dead.
            with pytest.raises(stowage.Error):
                c.stats()
            r = c.repair(timeout=60.0)
            assert r["left"] == 0, r
            assert c.under_replicated() == []
        entry = system.directory["units"][1]
        ray.kill(system.units[1], no_restart=True)
        assert _wait_gone([entry["pid"]]) == []
        check(0, want0)
        check(2, want2)
    finally:
        tq.close()


def test_with_two_copies_a_checkpoint_keeps_one_copy_and_loads_with_a_unit_down(tmp_path):
    """replicas: 2 over 3 units: a save writes each row once; with a unit
    killed (and found dead) before the save, its part is marked down and
    its rows are in the others' parts, and a load puts every row back."""
    tq.init(_conf(count=3, replicas=2))
    try:
        system = interface._TQ_STORAGE["Stowage"]
        keys = [f"k{i}" for i in range(12)]
        ids = torch.arange(12 * 4).reshape(12, 4)
        tq.kv_batch_put(
            keys=keys,
            partition_id="train",
            fields=TensorDict({"ids": ids}, batch_size=12),
            tags=[{} for _ in keys],
        )
        plane = _connect(system.directory)
        try:
            stored = len(plane.list("train"))
        finally:
            plane.close()
        ckpt = tmp_path / "ckpt"
        tq.save_checkpoint(str(ckpt))
        record = json.loads((ckpt / "stowage_checkpoint.json").read_text())
        assert sum(u["rows"] for u in record["units"]) == stored, record

        entry = system.directory["units"][0]
        ray.kill(system.units[0], no_restart=True)
        assert _wait_gone([entry["pid"]]) == []
        # The job's client finds unit 0 dead as it reads.
        got = tq.kv_batch_get(keys=keys, partition_id="train")
        assert torch.equal(_rows(got["ids"]), ids)
        ckpt2 = tmp_path / "ckpt2"
        tq.save_checkpoint(str(ckpt2))
        record = json.loads((ckpt2 / "stowage_checkpoint.json").read_text())
        units = record["units"]
        assert units[0].get("down") is True and units[0]["rows"] == 0, units[0]
        assert sum(u["rows"] for u in units) == stored, record
        assert not (ckpt2 / units[0]["dir"]).exists()

        tq.kv_clear(keys=keys[6:], partition_id="train")
        tq.load_checkpoint(str(ckpt2))
        got = tq.kv_batch_get(keys=keys, partition_id="train")
        assert torch.equal(_rows(got["ids"]), ids)
    finally:
        tq.close()


def _rows(nested):
    return torch.stack(list(nested.unbind()))


def test_got_batches_are_writable_copies_even_from_reused_memory(system):
    # 2 MiB fields: the packed values come from stowage's read cache, which
    # reuses a freed batch's memory for the next get of that size.
    a, b = torch.randn(8, 1 << 16), torch.randn(8, 1 << 16)
    ka, kb = [f"a{i}" for i in range(8)], [f"b{i}" for i in range(8)]
    tq.kv_batch_put(keys=ka, partition_id="p", fields=TensorDict({"x": a}, batch_size=8))
    tq.kv_batch_put(keys=kb, partition_id="p", fields=TensorDict({"x": b}, batch_size=8))
    first = tq.kv_batch_get(keys=ka, partition_id="p")["x"]
    hits = stowage.read_cache_info()["hits"]
    freed = tq.kv_batch_get(keys=kb, partition_id="p")
    del freed
    second = tq.kv_batch_get(keys=kb, partition_id="p")["x"]
    assert stowage.read_cache_info()["hits"] > hits
    assert torch.equal(_rows(first), a) and torch.equal(_rows(second), b)
    # Writing what came back changes neither the other batch nor the units.
    first.values().add_(1.0)
    assert torch.equal(_rows(second), b)
    assert torch.equal(_rows(tq.kv_batch_get(keys=ka, partition_id="p")["x"]), a)


def test_disk_tier_spills_instead_of_failing(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    tq.init(_conf(count=1, memory="16MiB", disk={"root": str(disk), "capacity": "512MiB"}))
    try:
        rng = np.random.default_rng(0)
        batches = {}
        # 12 batches of 4 rows x 1 MiB: 48 MiB into a 16 MiB unit.
        for b in range(12):
            keys = [f"b{b}-{i}" for i in range(4)]
            vals = torch.from_numpy(rng.random((4, 1 << 18), dtype=np.float32))
            tq.kv_batch_put(
                keys=keys,
                partition_id="big",
                fields=TensorDict({"x": vals}, batch_size=4),
                tags=[{} for _ in keys],
            )
            batches[b] = (keys, vals)
        plane = _connect(interface._TQ_STORAGE["Stowage"].directory)
        try:
            stats = plane.stats()[0]
        finally:
            plane.close()
        assert stats["disk_write_bytes"] > stats["capacity"] and stats["spilled_blobs"] > 0, stats
        for keys, vals in batches.values():
            got = tq.kv_batch_get(keys=keys, partition_id="big")["x"]
            for want, have in zip(vals, got.unbind()):
                assert torch.equal(want, have)
    finally:
        tq.close()
    # The unit's own disk directory is removed at close.
    deadline = time.monotonic() + 30
    while os.listdir(disk) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert os.listdir(disk) == []


def test_checkpoint_round_trip_replaces_rows(system, tmp_path):
    keys = [f"s{i}" for i in range(6)]
    ids = [torch.arange(3 + i, dtype=torch.int64) for i in range(6)]
    fields = TensorDict(
        {
            "ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
            "reward": torch.arange(6, dtype=torch.bfloat16),
            "text": [f"sample {i}" for i in range(6)],
        },
        batch_size=6,
    )
    tq.kv_batch_put(
        keys=keys, partition_id="train", fields=fields, tags=[{"i": i} for i in range(6)]
    )
    before = _gidx("train", keys)
    ckpt = tmp_path / "ckpt"
    tq.save_checkpoint(str(ckpt))
    record = json.loads((ckpt / "stowage_checkpoint.json").read_text())
    dirs = [u["dir"] for u in record["units"]]
    assert [d.split("/")[0] for d in dirs] == ["stowage", "stowage"]
    assert [d.split("/")[-1] for d in dirs] == ["unit-0", "unit-1"]
    assert all((ckpt / d).is_dir() for d in dirs)
    assert str(tmp_path) not in (ckpt / "stowage_checkpoint.json").read_text()

    # Overwrite some rows, clear others, add a partition: load must replace all of it.
    tq.kv_batch_put(
        keys=keys[:3],
        partition_id="train",
        fields=TensorDict({"reward": torch.full((3,), 9.0, dtype=torch.bfloat16)}, batch_size=3),
        tags=[{} for _ in range(3)],
    )
    tq.kv_clear(keys=keys[3:], partition_id="train")
    tq.kv_batch_put(
        keys=["x"],
        partition_id="other",
        fields=TensorDict({"ids": torch.ones(1, 2)}, batch_size=1),
        tags=[{}],
    )

    tq.load_checkpoint(str(ckpt))
    assert _gidx("train", keys) == before
    got = tq.kv_batch_get(keys=keys, partition_id="train")
    for want, have in zip(ids, got["ids"].unbind()):
        assert torch.equal(want, have)
    assert got["reward"].dtype == torch.bfloat16
    assert torch.equal(got["reward"], torch.arange(6, dtype=torch.bfloat16))
    assert list(got["text"]) == [f"sample {i}" for i in range(6)]
    # What was written after the save is gone from the units too.
    plane = _connect(system.directory)
    try:
        assert plane.partitions() == ["train"]
        assert sorted(plane.list("train")) == sorted(before)
    finally:
        plane.close()


def test_close_leaves_no_process_and_no_directory(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    tq.init(_conf(disk={"root": str(disk)}))
    storage = interface._TQ_STORAGE["Stowage"]
    entries = storage.directory["units"]
    pids = [e["pid"] for e in entries]
    sock_dirs = [os.path.dirname(e["uds"][len("unix:") :]) for e in entries]
    tq.kv_batch_put(
        keys=["a"],
        partition_id="p",
        fields=TensorDict({"v": torch.ones(1, 3)}, batch_size=1),
        tags=[{}],
    )
    assert all(_alive(p) for p in pids) and all(os.path.isdir(d) for d in sock_dirs)
    assert len(os.listdir(disk)) == 2
    del storage
    tq.close()
    assert _wait_gone(pids) == []
    assert [d for d in sock_dirs if os.path.exists(d)] == []
    assert os.listdir(disk) == []


def test_failed_bootstrap_leaves_nothing_and_init_works_again():
    with pytest.raises(stowage.ray.PlacementError):
        tq.init(_conf(memory="100TiB"))
    with pytest.raises(ValueError):
        ray.get_actor("TransferQueueController", namespace="transfer_queue")
    tq.init(_conf())
    try:
        tq.kv_put(key="k", partition_id="p", fields={"v": torch.ones(2)}, tag={})
        assert torch.equal(tq.kv_batch_get(keys=["k"], partition_id="p")["v"][0], torch.ones(2))
    finally:
        tq.close()
