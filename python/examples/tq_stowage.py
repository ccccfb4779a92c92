"""A TransferQueue job on stowage, end to end (the README's "With TransferQueue")."""
import ray
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import TensorDict

import stowage.tq  # registers the "Stowage" backend in this process

# Workers (Ray tasks and actors) register it too, when they import transfer_queue.
ray.init(runtime_env={"worker_process_setup_hook": "stowage.tq_worker.setup_worker"})

# The one-line switch: storage_backend: Stowage (the block below is optional).
tq.init(OmegaConf.create({
    "backend": {
        "storage_backend": "Stowage",
        "Stowage": {"count": 2, "memory": "256MiB"},
    },
}))
try:
    # A rollout worker, anywhere in the cluster, writes its samples.
    @ray.remote
    def rollout(worker):
        tq.init()  # attaches to the running controller; finds the units in its config
        keys = [f"w{worker}-s{i}" for i in range(4)]
        tq.kv_batch_put(keys=keys, partition_id="step-0", fields=TensorDict({
            "input_ids": torch.nested.as_nested_tensor(
                [torch.arange(8 + i) for i in range(4)], layout=torch.jagged),
            "reward": torch.full((4,), float(worker), dtype=torch.bfloat16),
            "prompt": [f"prompt {worker}/{i}" for i in range(4)],
        }, batch_size=4))
        return keys

    keys = [k for ks in ray.get([rollout.remote(w) for w in range(2)]) for k in ks]

    # The trainer reads the batch back: jagged tensors, stacked rewards, strings.
    batch = tq.kv_batch_get(keys=keys, partition_id="step-0")
    assert [len(t) for t in batch["input_ids"].unbind()] == [8, 9, 10, 11] * 2
    assert batch["reward"].dtype == torch.bfloat16 and batch["reward"].tolist() == [0.0] * 4 + [1.0] * 4
    assert list(batch["prompt"])[5] == "prompt 1/1"
    tq.kv_clear(keys=keys, partition_id="step-0")
finally:
    tq.close()  # stops the units (teardown, then their actors are killed)
    ray.shutdown()
print("TransferQueue example done")
