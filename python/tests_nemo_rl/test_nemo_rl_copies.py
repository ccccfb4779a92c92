"""StowageDataPlaneClient's claims on a plane that keeps two copies of
every sample: a unit killed (SIGKILL) between claims loses no sample and
serves none twice, and consumption status still adds up (the claimed
samples' consumption is marked on every copy; docs/replication.md#claims).
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


def test_with_two_copies_checkpoints_are_refused_saying_why(tmp_path):
    with stowage.local(units=2, memory="32MiB", replicas=2) as plane:
        dp = StowageDataPlaneClient(plane)
        try:
            for call in (
                lambda: dp.save_checkpoint(tmp_path / "c"),
                lambda: dp.load_checkpoint(tmp_path / "c"),
            ):
                with pytest.raises(NotImplementedError, match="replicas = 2"):
                    call()
        finally:
            dp.close()
