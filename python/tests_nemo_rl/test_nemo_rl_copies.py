"""StowageDataPlaneClient's claims on a plane that keeps two copies of
every sample: a unit killed (SIGKILL) between claims loses no sample and
serves none twice, and consumption status still adds up (the claimed
samples' consumption is marked on every copy; docs/replication.md#claims);
the same after a checkpoint saved and loaded with two copies.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip(
    "torch", reason="stowage.nemo_rl needs torch: pip install 'stowage-rl[nemo-rl]'"
)
pytest.importorskip(
    "tensordict", reason="stowage.nemo_rl needs tensordict: pip install 'stowage-rl[nemo-rl]'"
)
import torch
from tensordict import TensorDict

import stowage
from stowage.nemo_rl import StowageDataPlaneClient

WAIT_S = 30.0


def _alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (a killed unit is a
    child of this process until the plane reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _claim_all(dp, part, task, batch):
    """Claim until a claim gets nothing (at most 60 s)."""
    got = []
    deadline = time.monotonic() + 60.0
    while True:
        m = dp.claim_meta(part, task, ["x"], batch_size=batch, blocking=False)
        if m.size == 0:
            return got
        got += m.sample_ids
        assert time.monotonic() < deadline, "claims never ran dry"


def test_with_two_copies_a_killed_unit_loses_and_repeats_no_claimed_sample(part):
    with stowage.local(units=3, memory="64MiB", replicas=2) as plane:
        ids = [f"s{i}" for i in range(30)]
        a = StowageDataPlaneClient(plane)
        b = StowageDataPlaneClient(stowage.connect(plane.directory), owns_client=True)
        try:
            a.register_partition(part, ["x"], num_samples=len(ids), consumer_tasks=["train"])
            td = TensorDict({"x": torch.arange(len(ids))}, batch_size=[len(ids)])
            a.put_samples(ids, part, td)
            first = a.claim_meta(part, "train", ["x"], batch_size=6, timeout_s=WAIT_S)
            second = b.claim_meta(part, "train", ["x"], batch_size=6, timeout_s=WAIT_S)
            assert first.size > 0 and second.size > 0
            # The unit that claimed them (each claim keeps the first unit's
            # lease first) dies: its copy claims its samples now.
            homes = {plane.unit_of(s) for s in list(first.sample_ids) + list(second.sample_ids)}
            assert 0 in homes, homes
            victim = plane.unit_pids[0]
            os.kill(victim, signal.SIGKILL)
            assert _wait_dead(victim)

            rest = _claim_all(a, part, "train", 4) + _claim_all(b, part, "train", 5)
            claimed = list(first.sample_ids) + list(second.sample_ids) + rest
            assert sorted(claimed) == sorted(ids), "each sample exactly once"
            assert a.check_consumption_status(part, ["train"])
            assert b.check_consumption_status(part, ["train"])
            # The samples are all still readable, from their copies.
            got = a.get_samples(ids, part, ["x"])["x"]
            assert got.tolist() == list(range(len(ids)))
        finally:
            a.close()
            b.close()


@pytest.mark.parametrize("down_at_save", [False, True], ids=["all_up", "unit_down_at_save"])
def test_with_two_copies_a_load_keeps_every_consumption_through_a_unit_death(
    tmp_path, down_at_save
):
    """Saved with two copies after some samples were consumed (with
    ``unit_down_at_save``, unit 2 killed first: its rows are in their
    copies' parts), loaded into a fresh plane of two copies; then the unit
    whose samples were claimed first is killed. Its copy claims its
    samples now: no sample consumed before the save is served again, every
    other one is served once, the counts add up, and the data reads back
    (docs/replication.md#checkpoints)."""
    root = tmp_path / "ckroot"
    os.mkdir(root, 0o700)
    ids = [f"s{i}" for i in range(30)]
    values = list(range(100, 130))
    with stowage.local(units=3, memory="64MiB", replicas=2, checkpoint_root=str(root)) as a:
        dp = StowageDataPlaneClient(a)
        try:
            dp.register_partition("p", ["x"], num_samples=len(ids), consumer_tasks=["train", "rm"])
            dp.put_samples(ids, "p", TensorDict({"x": torch.tensor(values)}, batch_size=[30]))
            train = list(
                dp.claim_meta("p", "train", ["x"], batch_size=11, blocking=False).sample_ids
            )
            rm = list(dp.claim_meta("p", "rm", ["x"], batch_size=4, blocking=False).sample_ids)
            assert (len(train), len(rm)) == (11, 4)
            if down_at_save:
                victim = a.unit_pids[2]
                os.kill(victim, signal.SIGKILL)
                assert _wait_dead(victim)
                # Reading every sample finds it dead (the save needs to know).
                assert dp.get_samples(ids, "p", ["x"])["x"].tolist() == values
            dp.save_checkpoint(root / "ck", metadata={"step": 3})
        finally:
            dp.close()

    with stowage.local(units=3, memory="64MiB", replicas=2) as b:
        dp = StowageDataPlaneClient(b)
        try:
            assert dp.load_checkpoint(root / "ck") == {"step": 3}
            assert dp.list_sample_ids("p") == sorted(ids)
            assert not dp.check_consumption_status("p", ["train"])
            victim = b.unit_pids[0]
            os.kill(victim, signal.SIGKILL)
            assert _wait_dead(victim)
            left = _claim_all(dp, "p", "train", 4)
            assert sorted(left) == sorted(set(ids) - set(train)), "each unconsumed sample once"
            assert dp.check_consumption_status("p", ["train"])
            rest = _claim_all(dp, "p", "rm", 7)
            assert sorted(rest) == sorted(set(ids) - set(rm))
            assert dp.check_consumption_status("p", ["rm"])
            assert dp.get_samples(ids, "p", ["x"])["x"].tolist() == values
        finally:
            dp.close()
