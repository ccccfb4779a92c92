"""A streaming GRPO pipeline in separate processes (the README's "Streaming
GRPO across processes"): rollout producers put groups of samples, a reward
stage claims whole groups and writes their advantages into the same rows,
trainer ranks claim whole groups that have advantages."""
import multiprocessing as mp
import queue
import time

import numpy as np
import stowage

STEP = "step-0"
PRODUCERS, PROMPTS, G = 2, 6, 4  # 2 producers x 6 prompts x 4 samples = 48 rows
RANKS = 2  # trainer ranks; each claims up to 2 groups at a time
SAMPLES = PRODUCERS * PROMPTS * G
DEADLINE_S = 120  # every process gives up (and fails) after this


def group_of(key):
    return key.rsplit("/", 1)[0]  # "p1-q3/2" -> "p1-q3"


def by_group(keys):
    groups = {}
    for k in keys:
        groups.setdefault(group_of(k), []).append(k)
    return groups


def claims(plane, task, fields, deadline):
    """`task`'s claims, batch by batch, until it has claimed every sample
    (whichever process claimed them)."""
    while plane.claim_status(STEP, task)["consumed"] < SAMPLES:
        assert time.monotonic() < deadline, f"{task}: not done in {DEADLINE_S} s"
        try:
            yield plane.claim(STEP, task, fields, 2 * G, timeout=1.0)
        except stowage.Timeout:
            pass  # nothing ready yet, or another rank took the last groups


def rollout(directory, producer):
    rng = np.random.default_rng(producer)
    with stowage.connect(directory) as plane:
        for q in range(PROMPTS):
            group = f"p{producer}-q{q}"  # one prompt's G responses
            keys = [f"{group}/{i}" for i in range(G)]
            lengths = rng.integers(16, 256, G)
            plane.put(STEP, keys, {
                "input_ids": [rng.integers(0, 32_000, n, dtype=np.int64) for n in lengths],
                "logprobs": [rng.standard_normal(n).astype(np.float32) for n in lengths],
            }, groups=[group] * G)  # the group's rows live on unit plane.unit_of(group)
            time.sleep(0.05)  # generating takes a while; the stages below do not wait for all


def reward(directory):
    deadline = time.monotonic() + DEADLINE_S
    with stowage.connect(directory) as plane:
        for keys in claims(plane, "reward", ["input_ids"], deadline):
            for group, ks in by_group(keys).items():
                unit = plane.unit_of(group)
                ids = plane.get(STEP, ks, ["input_ids"], unit=unit)["input_ids"]
                r = np.array([np.mean(t % 2 == 0) for t in ids], dtype=np.float32)  # a verifier
                adv = ((r - r.mean()) / (r.std() + 1e-6)).astype(np.float32)
                # New fields on the same rows: the group's rows are ready for "train" now.
                plane.put(STEP, ks, {"reward": r, "advantage": adv}, unit=unit, groups=[group] * G)


def train(directory, rank, results):
    deadline = time.monotonic() + DEADLINE_S
    trained, steps = [], 0
    with stowage.connect(directory) as plane:
        for keys in claims(plane, "train", ["input_ids", "advantage"], deadline):
            for group, ks in by_group(keys).items():
                assert len(ks) == G, f"rank {rank}: {group} came with {len(ks)} of {G} samples"
                batch = plane.get(STEP, ks, ["logprobs", "advantage"], unit=plane.unit_of(group))
                adv = np.stack(batch["advantage"])
                assert abs(adv.sum()) < 1e-3, adv  # normalised within the group
                loss = -np.mean([a * lp.mean() for a, lp in zip(adv, batch["logprobs"])])
                assert np.isfinite(loss)  # a training step on it here
                trained += ks
            steps += len(keys) > 0
    results.put((rank, trained, steps))


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    with stowage.local(units=2, memory="128MiB") as plane:
        plane.register_tasks(STEP, ["reward", "train"], SAMPLES, group_size=G)
        d, results = plane.directory, ctx.Queue()
        procs = [ctx.Process(target=rollout, args=(d, p)) for p in range(PRODUCERS)]
        procs += [ctx.Process(target=reward, args=(d,))]
        procs += [ctx.Process(target=train, args=(d, r, results)) for r in range(RANKS)]
        for p in procs:
            p.start()
        trained = {}  # rank -> (its samples, its steps)
        try:
            end = time.monotonic() + DEADLINE_S + 30
            while len(trained) < RANKS:
                failed = [p.name for p in procs if p.exitcode not in (None, 0)]
                assert not failed and time.monotonic() < end, f"failed or late: {failed}"
                try:
                    rank, keys, steps = results.get(timeout=1.0)
                    trained[rank] = (keys, steps)
                except queue.Empty:
                    pass
            for p in procs:
                p.join(timeout=30)
        finally:
            for p in procs:  # whatever is still running is stopped by its pid
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
        assert [p.exitcode for p in procs] == [0] * len(procs), [p.exitcode for p in procs]

        every = [k for ks, _ in trained.values() for k in ks]
        put = [f"p{p}-q{q}/{i}" for p in range(PRODUCERS) for q in range(PROMPTS) for i in range(G)]
        assert sorted(every) == sorted(put), "a sample trained twice, or never"
        status = {t: plane.claim_status(STEP, t) for t in ("reward", "train")}
        assert all(s["consumed"] == SAMPLES and s["leased"] == 0 for s in status.values()), status
        for rank, (keys, steps) in sorted(trained.items()):
            groups = len(by_group(keys))
            print(f"trainer rank {rank}: {groups} groups, {len(keys)} samples, {steps} steps")
        print(f"{SAMPLES} samples ({SAMPLES // G} groups of {G}), each rewarded and trained once")
        plane.clear_partition(STEP)
    print("GRPO stream done")
