"""What NeMo-RL's own data-plane tests check through NoOp's private state,
checked for StowageDataPlaneClient in stowage's words (scripts/test-nemo-rl
runs those tests for NoOp only: stowage_nemo_rl_plugin.NOOP_ONLY)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "torch", reason="stowage.nemo_rl needs torch: pip install 'stowage-rl[nemo-rl]'"
)
pytest.importorskip(
    "tensordict", reason="stowage.nemo_rl needs tensordict: pip install 'stowage-rl[nemo-rl]'"
)
import torch
from tensordict import TensorDict

#: Bound of every blocking claim that is expected to succeed.
WAIT_S = 30.0


def test_registering_again_replaces_num_samples(dp, part):
    """NeMo-RL's test_double_register_partition_is_idempotent_overwrite reads
    NoOp's record of the partition: a second register_partition (a retry,
    with other fields and num_samples) replaces the first. In stowage the
    tasks' expected sample count is what a registration records (fields
    need no declaring): the second one's count is the one consumption is
    measured against, and the fields of the first are not required."""
    dp.register_partition(part, fields=["a"], num_samples=2, consumer_tasks=["t"])
    dp.register_partition(part, fields=["b"], num_samples=4, consumer_tasks=["t"])
    ids = [f"s{i}" for i in range(4)]
    dp.put_samples(ids, part, TensorDict({"b": torch.arange(4)}, batch_size=[4]))

    first = dp.claim_meta(part, "t", ["b"], batch_size=2, timeout_s=WAIT_S)
    assert first.size == 2
    # Under the first registration (2 samples) this would be done.
    assert not dp.check_consumption_status(part, ["t"])

    rest = dp.claim_meta(part, "t", ["b"], batch_size=4, timeout_s=WAIT_S)
    assert sorted(first.sample_ids + rest.sample_ids) == ids
    assert dp.check_consumption_status(part, ["t"])
