"""Storage units on a Ray cluster, end to end (the README's "On a Ray cluster")."""
import numpy as np
import ray
import stowage
import stowage.ray

ray.init()  # joins the cluster named by RAY_ADDRESS, or starts a local one

# 1. One unit per alive node, each an actor hard-pinned to its node.
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
units = stowage.ray.start_units({"units": {"memory": "64MiB"}}, nodes, timeout=120)
try:
    # 2. Rollout workers, anywhere in the cluster, write their samples: the
    #    directory is all they need (shared memory to units on their host,
    #    tcp to the others).
    @ray.remote
    def rollout(directory, worker):
        keys = [f"w{worker}-s{i}" for i in range(4)]
        with stowage.connect(directory) as plane:
            plane.put("step-0", keys, {
                "input_ids": [np.arange(8 + i, dtype=np.int64) for i in range(4)],
                "reward": np.full(4, float(worker), dtype=np.float32),
            })
        return keys

    keys = [k for ks in ray.get([rollout.remote(units.directory, w) for w in range(2)]) for k in ks]

    # 3. A trainer worker reads them back.
    @ray.remote
    def train(directory, keys):
        with stowage.connect(directory) as plane:
            batch = plane.get("step-0", keys, ["input_ids", "reward"])
            plane.clear_partition("step-0")
        return sum(len(t) for t in batch["input_ids"]), float(sum(batch["reward"]))

    tokens, reward = ray.get(train.remote(units.directory, keys))
    assert (tokens, reward) == (2 * (8 + 9 + 10 + 11), 4.0), (tokens, reward)
finally:
    # 4. Every unit's teardown runs (disk and socket directories removed),
    #    then its actor is killed; bounded, never raises.
    problems = stowage.ray.stop_units(units, timeout=30)

assert problems == [[] for _ in nodes], problems
print("Ray example done")
