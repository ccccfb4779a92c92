"""StowageDataPlaneClient.save_checkpoint / load_checkpoint against real
units: a load into fresh units brings back the data, the tags, the
registrations and every task's consumption (a claim after the load never
returns a sample consumed before the save), and the caller's metadata."""

from __future__ import annotations

import os

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


def _put(dp, part, ids, base):
    td = TensorDict(
        {"x": torch.arange(len(ids)) + base, "y": torch.ones(len(ids), 3) * base},
        batch_size=[len(ids)],
    )
    tags = [{"n": base + i, "who": f"s{i}"} for i in range(len(ids))]
    dp.put_samples(ids, part, td, tags=tags)


def _claim_all(dp, part, task, fields):
    out = []
    while True:
        m = dp.claim_meta(part, task, fields, batch_size=64, blocking=False)
        if m.size == 0:
            return out
        out += m.sample_ids


def test_a_load_brings_back_data_tags_and_consumption(tmp_path):
    root = tmp_path / "ckroot"
    os.mkdir(root, 0o700)
    plain = [f"s{i}" for i in range(12)]
    grouped = [f"u{g}_g{i}" for g in range(4) for i in range(2)]
    with stowage.local(units=2, memory="64MiB", checkpoint_root=str(root)) as a:
        dp = StowageDataPlaneClient(a)
        dp.register_partition("plain", ["x", "y"], 12, ["train", "reward"])
        dp.register_partition("groups", ["x"], 8, ["train"], grpo_group_size=2)
        _put(dp, "plain", plain, 100)
        _put(dp, "groups", grouped, 200)
        train = dp.claim_meta("plain", "train", ["x"], batch_size=5, blocking=False).sample_ids
        reward = dp.claim_meta("plain", "reward", ["y"], batch_size=3, blocking=False).sample_ids
        gtrain = dp.claim_meta("groups", "train", ["x"], batch_size=2, blocking=False).sample_ids
        assert (len(train), len(reward), len(gtrain)) == (5, 3, 2)
        dp.save_checkpoint(root / "ck1", metadata={"step": 7, "name": "run"})
        # After the save: more consumption, and a sample cleared: not in it.
        dp.claim_meta("plain", "train", ["x"], batch_size=4, blocking=False)
        dp.clear_samples(["s11"], "plain")
        dp.close()

    with stowage.local(units=2, memory="64MiB") as b:
        dp = StowageDataPlaneClient(b)
        assert dp.load_checkpoint(root / "ck1") == {"step": 7, "name": "run"}
        assert dp.list_sample_ids("plain") == sorted(plain)
        assert dp.list_sample_ids("groups") == sorted(grouped)
        got = dp.get_samples(plain, "plain", ["x", "y"])
        assert got["x"].tolist() == [100 + i for i in range(12)]
        assert torch.equal(got["y"], torch.ones(12, 3) * 100)
        # Consumption as saved: counts, and exactly the samples not consumed.
        assert not dp.check_consumption_status("plain", ["train"])
        left = _claim_all(dp, "plain", "train", ["x"])
        assert sorted(left) == sorted(set(plain) - set(train))
        assert dp.check_consumption_status("plain", ["train"])
        m = dp.claim_meta("plain", "reward", ["x", "y"], batch_size=64, blocking=False)
        assert sorted(m.sample_ids) == sorted(set(plain) - set(reward))
        # Tags came back with the rows.
        assert [t["n"] for t in m.tags] == [100 + int(s[1:]) for s in m.sample_ids]
        assert [t["who"] for t in m.tags] == m.sample_ids
        # Groups: still registered with groups of 2, whole groups, the
        # consumed one never again.
        g = _claim_all(dp, "groups", "train", ["x"])
        assert sorted(g) == sorted(set(grouped) - set(gtrain))
        assert set(gtrain) == {f"{gtrain[0].split('_g')[0]}_g{i}" for i in range(2)}
        # A second load through a used client is refused.
        with pytest.raises(RuntimeError):
            dp.load_checkpoint(root / "ck1")
        dp.close()

    # Another number of units: refused before anything changes.
    with stowage.local(units=1, memory="64MiB") as c:
        dp = StowageDataPlaneClient(c)
        with pytest.raises(ValueError):
            dp.load_checkpoint(root / "ck1")
        assert dp.list_sample_ids("plain") == []
        dp.close()


def test_a_save_checks_its_metadata_and_where_it_goes(tmp_path):
    with stowage.local(units=1, memory="16MiB") as plane:
        dp = StowageDataPlaneClient(plane)
        with pytest.raises(TypeError):
            dp.save_checkpoint(tmp_path / "x", metadata=["not", "a", "dict"])
        with pytest.raises(TypeError):
            dp.save_checkpoint(tmp_path / "x", metadata={"f": object()})
        # Units without a checkpoint root take no checkpoint.
        with pytest.raises(stowage.Error):
            dp.save_checkpoint(tmp_path / "x", metadata={})
        with pytest.raises(FileNotFoundError):
            dp.load_checkpoint(tmp_path / "missing")
        dp.close()
