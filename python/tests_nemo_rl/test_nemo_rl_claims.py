"""StowageDataPlaneClient's task-mediated path against real units:
register_partition, claim_meta, check_consumption_status, groups.

These need the claim methods of the extension's Client (register_tasks,
claim, claim_status, unit_of, put's groups=)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip(
    "torch", reason="stowage.nemo_rl needs torch: pip install 'stowage-rl[nemo-rl]'"
)
pytest.importorskip(
    "tensordict", reason="stowage.nemo_rl needs tensordict: pip install 'stowage-rl[nemo-rl]'"
)
import torch
from tensordict import TensorDict

from stowage.nemo_rl import StowageDataPlaneClient

#: Bound of every blocking claim that is expected to succeed.
WAIT_S = 30.0


def _put(dp, part, ids, **extra):
    td = TensorDict({"x": torch.arange(len(ids))}, batch_size=[len(ids)])
    return dp.put_samples(ids, part, td, **extra)


def test_claim_returns_ready_samples_once_per_task(dp, part):
    dp.register_partition(part, ["x"], num_samples=4, consumer_tasks=["ref", "train"])
    ids = [f"s{i}" for i in range(4)]
    _put(dp, part, ids)
    assert not dp.check_consumption_status(part, ["ref", "train"])

    meta = dp.claim_meta(part, "ref", ["x"], batch_size=4, timeout_s=WAIT_S)
    assert sorted(meta.sample_ids) == ids
    assert meta.task_name == "ref"
    assert meta.fields == ["x"]
    assert meta.partition_id == part
    # Claimed once by "ref": nothing more for it; "train" still has all.
    assert dp.claim_meta(part, "ref", ["x"], batch_size=4, blocking=False).size == 0
    assert dp.check_consumption_status(part, ["ref"])
    assert not dp.check_consumption_status(part, ["ref", "train"])

    got = []
    while len(got) < 4:
        m = dp.claim_meta(part, "train", ["x"], batch_size=3, timeout_s=WAIT_S)
        assert 0 < m.size <= 3
        got += m.sample_ids
    assert sorted(got) == ids
    assert dp.check_consumption_status(part, ["ref", "train"])
    # Claims do not consume data: the rows stay readable.
    assert dp.get_data(meta)["x"].shape == (4,)


def test_claim_waits_for_every_required_field(dp, part):
    dp.register_partition(part, ["x", "adv"], num_samples=2, consumer_tasks=["train"])
    ids = ["a", "b"]
    _put(dp, part, ids)
    assert dp.claim_meta(part, "train", ["x", "adv"], batch_size=2, blocking=False).size == 0
    dp.put_samples(["b"], part, TensorDict({"adv": torch.ones(1)}, batch_size=[1]))
    meta = dp.claim_meta(part, "train", ["x", "adv"], batch_size=2, timeout_s=WAIT_S)
    assert meta.sample_ids == ["b"]


def test_claim_meta_carries_tags_and_sequence_lengths(dp, part):
    dp.register_partition(part, ["x"], num_samples=3, consumer_tasks=["train"])
    tags = [{"input_lengths": 4, "std": 0.5}, {"input_lengths": 9}, {"input_lengths": 1}]
    _put(dp, part, ["a", "b", "c"], tags=tags)
    # A later put without tags keeps them.
    dp.put_samples(["b"], part, TensorDict({"y": torch.zeros(1)}, batch_size=[1]))
    meta = dp.claim_meta(part, "train", ["x"], batch_size=3, timeout_s=WAIT_S)
    by_id = dict(zip(meta.sample_ids, zip(meta.tags, meta.sequence_lengths)))
    assert by_id == {"a": (tags[0], 4), "b": (tags[1], 9), "c": (tags[2], 1)}


def test_claim_meta_of_samples_put_without_tags(dp, part):
    dp.register_partition(part, ["x"], num_samples=2, consumer_tasks=["train"])
    _put(dp, part, ["a"], tags=[{"input_lengths": 3}])
    _put(dp, part, ["b"])
    meta = dp.claim_meta(part, "train", ["x"], batch_size=2, timeout_s=WAIT_S)
    by_id = dict(zip(meta.sample_ids, zip(meta.tags, meta.sequence_lengths)))
    assert by_id == {"a": ({"input_lengths": 3}, 3), "b": ({}, 0)}


def test_claim_for_an_unregistered_task_raises_key_error(dp, part):
    dp.register_partition(part, ["x"], num_samples=1, consumer_tasks=["train"])
    _put(dp, part, ["a"])
    with pytest.raises(KeyError, match="trian"):
        dp.claim_meta(part, "trian", ["x"], batch_size=1, blocking=False)
    with pytest.raises(KeyError, match="task"):
        dp.claim_meta(part + "-never-registered", "train", ["x"], batch_size=1, timeout_s=1.0)
    assert not dp.check_consumption_status(part, ["trian"])


def test_non_blocking_claim_with_nothing_ready_is_empty(dp, part):
    dp.register_partition(part, ["x"], num_samples=2, consumer_tasks=["train"])
    meta = dp.claim_meta(part, "train", ["x"], batch_size=2, blocking=False)
    assert meta.size == 0
    assert meta.sample_ids == []
    assert meta.fields == ["x"]
    assert meta.task_name == "train"


def test_blocking_claim_raises_timeout_error(dp, part):
    dp.register_partition(part, ["x"], num_samples=2, consumer_tasks=["train"])
    with pytest.raises(TimeoutError):
        dp.claim_meta(part, "train", ["x"], batch_size=2, timeout_s=0.5)


def test_blocking_claim_is_woken_by_a_put(plane, dp, part):
    dp.register_partition(part, ["x"], num_samples=1, consumer_tasks=["train"])
    producer = StowageDataPlaneClient(plane)
    started = threading.Event()
    result = {}

    def consume():
        started.set()
        try:
            result["meta"] = dp.claim_meta(part, "train", ["x"], batch_size=1, timeout_s=WAIT_S)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            result["error"] = e

    t = threading.Thread(target=consume)
    t.start()
    try:
        assert started.wait(WAIT_S)
        _put(producer, part, ["late"])
    finally:
        t.join(WAIT_S + 10)
        producer.close()
    assert not t.is_alive()
    assert "error" not in result, result.get("error")
    assert result["meta"].sample_ids == ["late"]


def test_two_clients_claim_disjoint_samples(plane, part):
    a = StowageDataPlaneClient(plane)
    b = StowageDataPlaneClient(plane)
    try:
        a.register_partition(part, ["x"], num_samples=40, consumer_tasks=["train"])
        b.register_partition(part, ["x"], num_samples=40, consumer_tasks=["train"])
        ids = [f"s{i}" for i in range(40)]
        _put(a, part, ids)
        got = {"a": [], "b": []}

        def drain(name, client):
            while True:
                m = client.claim_meta(part, "train", ["x"], batch_size=3, blocking=False)
                if m.size == 0:
                    return
                got[name] += m.sample_ids

        threads = [threading.Thread(target=drain, args=x) for x in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in threads)
        assert not set(got["a"]) & set(got["b"])
        assert sorted(got["a"] + got["b"]) == sorted(ids)
        assert a.check_consumption_status(part, ["train"])
    finally:
        a.close()
        b.close()


def test_register_partition_is_idempotent(dp, part):
    for _ in range(2):
        dp.register_partition(
            part, ["x"], num_samples=4, consumer_tasks=["train"], grpo_group_size=2
        )
    with pytest.raises(ValueError):
        dp.register_partition(
            part, ["x"], num_samples=4, consumer_tasks=["train"], grpo_group_size=4
        )


def test_groups_are_claimed_whole(dp, part):
    g = 4
    dp.register_partition(
        part, ["x"], num_samples=3 * g, consumer_tasks=["train"], grpo_group_size=g
    )
    full = [f"{u}_g{i}" for u in ("p0", "p1") for i in range(g)]
    partial = [f"p2_g{i}" for i in range(g - 1)]
    _put(dp, part, full + partial)

    claimed = []
    while True:
        m = dp.claim_meta(part, "train", ["x"], batch_size=2 * g, blocking=False)
        if m.size == 0:
            break
        claimed += m.sample_ids
    assert sorted(claimed) == sorted(full)
    assert not dp.check_consumption_status(part, ["train"])

    # The last member completes p2: claimable now, as a whole group.
    _put(dp, part, [f"p2_g{g - 1}"])
    m = dp.claim_meta(part, "train", ["x"], batch_size=g, timeout_s=WAIT_S)
    assert sorted(m.sample_ids) == sorted([*partial, f"p2_g{g - 1}"])
    assert dp.check_consumption_status(part, ["train"])


def test_batch_smaller_than_a_group_is_a_value_error(dp, part):
    dp.register_partition(part, ["x"], num_samples=4, consumer_tasks=["train"], grpo_group_size=4)
    _put(dp, part, [f"p_g{i}" for i in range(4)])
    with pytest.raises(ValueError):
        dp.claim_meta(part, "train", ["x"], batch_size=2, blocking=False)
