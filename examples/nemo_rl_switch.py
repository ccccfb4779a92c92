"""A NeMo-RL job on stowage (docs/nemo-rl.md, "How a NeMo-RL job switches"):
units on the job's Ray cluster, their directory in the `data_plane` config
the job already hands its workers, and StowageDataPlaneClient where the job
called NeMo-RL's build_data_plane_client. Needs ray, torch and tensordict
(pip install 'stowage-rl[ray,nemo-rl]'); NeMo-RL itself is optional."""
import ray
import torch
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tensordict import TensorDict

import stowage.ray
from stowage.nemo_rl import StowageDataPlaneClient


def build_data_plane_client(dp_cfg):
    """What the job calls where it called NeMo-RL's
    build_data_plane_client(dp_cfg, bootstrap=...), on the driver and in
    every worker alike: there is nothing to bootstrap."""
    return StowageDataPlaneClient.from_directory(dp_cfg["stowage_directory"])


def node_ids(placement_groups):
    """The nodes of a cluster's placement groups (NeMo-RL's RayVirtualCluster:
    cluster.get_placement_groups())."""
    tables = [placement_group_table(pg) for pg in placement_groups]
    return [node for t in tables for node in t["bundles_to_node_id"].values()]


@ray.remote(num_cpus=1)
class TrainWorker:
    """A policy worker: NeMo-RL's TQWorkerMixin.setup_data_plane(cfg) is
    where it builds its client, from the config the driver sent."""

    def setup_data_plane(self, dp_cfg):
        self.dp = build_data_plane_client(dp_cfg)

    def train_step(self, partition):
        meta = self.dp.claim_meta(partition, "train", ["input_ids", "advantages"], batch_size=4)
        batch = self.dp.get_data(meta)  # a TensorDict of the claimed group
        return list(meta.sample_ids), batch["advantages"].sum().item()

    def close(self):
        self.dp.close()


ray.init()  # joins the cluster named by RAY_ADDRESS, or starts a local one

# The job's training cluster: placement groups it reserved (here one bundle).
train_pgs = [placement_group([{"CPU": 1}])]
ray.get([pg.ready() for pg in train_pgs], timeout=120)

# 1. The driver starts the units on the nodes of the clusters the placement names.
units = stowage.ray.start_units(
    {"units": {"memory": "64MiB", "count": 2}, "placement": {"clusters": ["train"]}},
    {"train": node_ids(train_pgs)},
    timeout=120,
)
try:
    # 2. Their directory goes into the data_plane config that the job hands
    #    to every worker already (TQPolicy -> setup_data_plane, rollout actors).
    dp_cfg = {"enabled": True, "impl": "transfer_queue", "stowage_directory": units.directory}
    dp = build_data_plane_client(dp_cfg)  # the driver's client
    worker = TrainWorker.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(train_pgs[0])
    ).remote()
    ray.get(worker.setup_data_plane.remote(dp_cfg))

    # 3. put -> claim -> get_data: two prompts' groups of 4 responses.
    dp.register_partition("step-0", ["input_ids", "advantages"], num_samples=8,
                          consumer_tasks=["train"], grpo_group_size=4)
    ids = [f"prompt{p}_g{i}" for p in range(2) for i in range(4)]
    dp.put_samples(ids, "step-0", TensorDict({
        "input_ids": torch.arange(8 * 16).reshape(8, 16),
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5] * 2),
    }, batch_size=[8]))
    claimed = [ray.get(worker.train_step.remote("step-0"), timeout=120) for _ in range(2)]
    groups = sorted(sorted(sample_ids) for sample_ids, _ in claimed)
    assert groups == [ids[:4], ids[4:]], groups  # whole groups, each claimed once
    assert [adv for _, adv in claimed] == [0.0, 0.0], claimed
    assert dp.check_consumption_status("step-0", ["train"])
    dp.clear_samples(None, "step-0")  # what this client put
    ray.get(worker.close.remote())
    dp.close()
finally:
    problems = stowage.ray.stop_units(units, timeout=30)

assert problems == [[], []], problems
print("NeMo-RL switch done")
