"""One GRPO step through stowage, end to end (the README's "From Python")."""
import numpy as np
import stowage

rng = np.random.default_rng(0)
PROMPTS, GROUP = 8, 8  # 8 prompts x 8 samples = 64 rows

with stowage.local(units=2, memory="256MiB") as plane:
    step = "step-0"
    keys = [f"uid_{p}_{g}" for p in range(PROMPTS) for g in range(GROUP)]

    # 1. Rollout workers write what they generated (jagged: one length per row).
    lengths = rng.integers(512, 4096, len(keys))
    input_ids = [rng.integers(0, 32_000, n, dtype=np.int64) for n in lengths]
    plane.put(step, keys, {
        "input_ids": input_ids,
        "generation_logprobs": [rng.standard_normal(n).astype(np.float32) for n in lengths],
        "token_mask": [np.ones(n, dtype=np.int32) for n in lengths],
        "rewards": rng.random(len(keys)).astype(np.float32),  # dense: one value per row
    })

    # 2. Logprob workers each read a shard's tokens and write a column back.
    for shard in (keys[: len(keys) // 2], keys[len(keys) // 2 :]):
        tokens = plane.get(step, shard, ["input_ids"])["input_ids"]
        prev = [np.full(len(t), -1.0, dtype=np.float32) for t in tokens]  # a forward pass here
        plane.put(step, shard, {"prev_logprobs": prev})

    # 3. The driver turns rewards into group-normalised advantages.
    r = np.stack(plane.get(step, keys, ["rewards"])["rewards"]).reshape(PROMPTS, GROUP)
    adv = (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + 1e-6)
    plane.put(step, keys, {"advantages": adv.reshape(-1).astype(np.float32)})

    # 4. Each trainer rank reads its shard in place (zero-copy views).
    fields = ["input_ids", "prev_logprobs", "token_mask", "advantages"]
    for rank in range(2):
        shard = keys[rank::2]
        batch = plane.get_view(step, shard, fields)
        for k, ids in zip(shard, batch["input_ids"]):
            assert np.array_equal(ids, input_ids[keys.index(k)])
        del batch  # releases the pins

    # 5. The step is cleared.
    plane.clear_partition(step)
    assert plane.list(step) == {}

print("GRPO step done")
