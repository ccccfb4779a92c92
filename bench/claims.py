#!/usr/bin/env python3
"""Claims without a controller: stowage's claim against NeMo-RL's path
through TransferQueue 0.1.11, side by side in one run on this machine.

    $VENV/bin/python bench/claims.py [--quick] [--systems stowage,tq] [--procs 1,4,16]

``$VENV``: a virtual environment with stowage and transferqueue 0.1.11
(``scripts/test-tq`` makes one); ``--systems stowage`` needs stowage only.

Two workloads, each in separate processes started fresh (``spawn``):

* throughput, per N in ``--procs``: N producer processes put ``--rows``
  samples (one field ``input_ids``, ``--tokens`` int32 each, ``--put-batch``
  rows per put, string sample ids, as NeMo-RL's ``put_samples`` does), then
  N consumer processes claim them all for one task, ``--claim-batch`` rows a
  claim. Timed apart: the put phase (first put started to last put
  returned) and the claim phase (the consumers released together, to the
  last claim that returned rows). claims/s = claims that returned rows per
  second of the claim phase; samples/s = rows claimed per second.
* readiness: one consumer process blocked in a claim of one row, one
  producer process that puts one row after a random delay and records when
  its put returned; the consumer records when its claim returned. Both read
  ``CLOCK_MONOTONIC`` (one clock for every process on the host). p50/p99 of
  (claim returned - put returned) over ``--trials``; a claim can return
  before the producer's put does (the unit answers the claimer first): the
  figure is then negative, and kept as it is.

stowage: ``stowage.local(units=--units)`` (shared memory, default
placement), ``register_tasks`` then ``put`` / ``claim(block=True)``; the
claims live in the units. TransferQueue: ``transfer_queue.init`` with its
default config (SimpleStorage, 2 storage units) and NeMo-RL's overlay
(``controller.polling_mode: True``), on a private local Ray instance; a
producer calls ``kv_batch_put`` (the put notifies the controller), a
consumer runs NeMo-RL's ``claim_meta`` loop: ``get_meta(mode="fetch",
task_name=...)`` on the controller, ``time.sleep(poll)`` while it comes back
empty, then ``kv_retrieve_keys``. TransferQueue's readiness runs with
NeMo-RL's shipped poll interval (0.5 s) and with a tight one (1 ms), which
leaves only the controller's own cost.

Every run checks that each sample was claimed exactly once for the task
(the claimed ids, counted, equal the ids put) and exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import random
import sys
import time

for _var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
    os.environ.pop(_var, None)

TASK = "train"
FIELD = "input_ids"
NEMO_RL_POLL_S = 0.5  # NeMo-RL's claim_meta_poll_interval_s as it ships
TIGHT_POLL_S = 0.001
CLAIM_TIMEOUT_S = 60.0


def now_ns() -> int:
    # one clock for every process of the host (perf_counter_ns is per process)
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# ---------------------------------------------------------------------------
# the two systems behind one small interface, built inside each child


class StowageSide:
    def __init__(self, directory: dict):
        import numpy as np

        import stowage

        self.np = np
        self.stowage = stowage
        self.dp = stowage.connect(directory)

    def put(self, partition: str, keys: list, tokens: int, base: int) -> None:
        rows = self.np.arange(base * tokens, (base + len(keys)) * tokens, dtype=self.np.int32)
        self.dp.put(partition, keys, {FIELD: rows.reshape(len(keys), tokens)})

    def claim(self, partition: str, count: int, timeout: float, poll: float) -> list:
        try:
            return self.dp.claim(partition, TASK, [FIELD], count, block=True, timeout=timeout)
        except self.stowage.Timeout:
            return []

    def warm(self, partition: str) -> None:
        # opens this client's connections (the first call on a unit does)
        self.dp.claim(partition, TASK, [FIELD], 1, block=False)

    def close(self) -> None:
        self.dp.close()


class TQSide:
    def __init__(self, gcs: str):
        import ray
        import torch
        import transfer_queue as tq
        from tensordict import TensorDict

        self.torch, self.tq, self.TensorDict = torch, tq, TensorDict
        ray.init(address=gcs, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        tq.init()  # attaches to the running controller, as NeMo-RL's workers do
        self.client = tq.get_client()

    def put(self, partition: str, keys: list, tokens: int, base: int) -> None:
        rows = self.torch.arange(base * tokens, (base + len(keys)) * tokens, dtype=self.torch.int32)
        td = self.TensorDict({FIELD: rows.reshape(len(keys), tokens)}, batch_size=[len(keys)])
        self.tq.kv_batch_put(keys=keys, partition_id=partition, fields=td, tags=[{} for _ in keys])

    def claim(self, partition: str, count: int, timeout: float, poll: float) -> list:
        # NeMo-RL's TQDataPlaneClient.claim_meta, blocking
        deadline = time.time() + timeout
        while True:
            meta = self.client.get_meta(
                data_fields=[FIELD],
                batch_size=count,
                partition_id=partition,
                task_name=TASK,
                mode="fetch",
                sampling_config={},
            )
            if getattr(meta, "size", 0) > 0:
                break
            if time.time() >= deadline:
                return []
            time.sleep(poll)
        return list(
            self.client.kv_retrieve_keys(
                global_indexes=list(meta.global_indexes), partition_id=partition
            )
        )

    def warm(self, partition: str) -> None:
        # the client's sockets and the controller's partition lookup
        self.client.get_meta(
            data_fields=[FIELD],
            batch_size=1,
            partition_id=partition,
            task_name=TASK,
            mode="fetch",
            sampling_config={},
        )

    def close(self) -> None:
        pass


def make_side(system: str, handle):
    return StowageSide(handle) if system == "stowage" else TQSide(handle)


# ---------------------------------------------------------------------------
# children


def producer(system, handle, partition, keys, base, args, ready, go, out):
    side = make_side(system, handle)
    side.put(partition + "-warm", [f"w{base}"], args.tokens, 0)
    ready.wait()
    go.wait()
    t0 = now_ns()
    for i in range(0, len(keys), args.put_batch):
        side.put(partition, keys[i : i + args.put_batch], args.tokens, base + i)
    out.put(("put", t0, now_ns()))
    side.close()


def consumer(system, handle, partition, args, ready, go, claimed_total, out):
    side = make_side(system, handle)
    side.warm(partition + "-warm")
    ready.wait()
    go.wait()
    t0 = now_ns()
    last = t0
    got, claims, stopped, waits = [], 0, False, []
    while not stopped:
        tc = now_ns()
        # A long timeout that never fires while rows are there (every row
        # is put before the first claim), so that the run measures claims,
        # not timeouts; consumers stop on the rows put for that purpose
        # after the last sample. An empty answer means the claims are
        # stuck: the exactly-once check then fails.
        keys = side.claim(partition, args.claim_batch, CLAIM_TIMEOUT_S, TIGHT_POLL_S)
        if not keys:
            break
        real = [k for k in keys if not str(k).startswith("stop-")]
        stopped = len(real) < len(keys)
        if real:
            last = now_ns()
            waits.append((last - tc) / 1e6)
            claims += 1
            got.extend(real)
            with claimed_total.get_lock():
                claimed_total.value += len(real)
                done = claimed_total.value == args.rows
            if done:
                # every row claimed: wake the consumers blocked in a claim
                # with rows of their own, one claim's worth each
                n = args.procs_now * args.claim_batch
                side.put(partition, [f"stop-{i}" for i in range(n)], args.tokens, 0)
    out.put(("claim", t0, last, claims, got, waits))
    side.close()


def ready_consumer(system, handle, partition, trials, poll, conn):
    side = make_side(system, handle)
    side.warm(partition + "-warm")
    conn.send("up")
    for _ in range(trials):
        conn.recv()  # arm
        conn.send("armed")
        keys = side.claim(partition, 1, 30.0, poll)
        conn.send((now_ns(), keys))
    side.close()


def ready_producer(system, handle, partition, tokens, conn):
    side = make_side(system, handle)
    side.put(partition + "-put-warm", ["w"], tokens, 0)
    conn.send("up")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        key, delay = msg
        time.sleep(delay)
        side.put(partition, [key], tokens, 0)
        conn.send(now_ns())
    side.close()


# ---------------------------------------------------------------------------
# driver


def throughput(ctx, system, handle, partition, n, args) -> dict:
    args.procs_now = n
    per = args.rows // n
    keys_of = [[f"p{p}-{i}" for i in range(per)] for p in range(n)]
    every = {k for ks in keys_of for k in ks}
    out = ctx.Queue()
    ready_p, go_p = ctx.Barrier(n + 1), ctx.Barrier(n + 1)
    ready_c, go_c = ctx.Barrier(n + 1), ctx.Barrier(n + 1)
    total = ctx.Value("q", 0)
    procs = [
        ctx.Process(
            target=producer,
            args=(system, handle, partition, keys_of[p], p * per, args, ready_p, go_p, out),
        )
        for p in range(n)
    ]
    procs += [
        ctx.Process(
            target=consumer, args=(system, handle, partition, args, ready_c, go_c, total, out)
        )
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    try:
        ready_p.wait(timeout=600)
        ready_c.wait(timeout=600)
        go_p.wait(timeout=60)
        puts = [out.get(timeout=600) for _ in range(n)]
        go_c.wait(timeout=60)
        claims = [out.get(timeout=600) for _ in range(n)]
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                os.kill(p.pid, 15)
    put_s = (max(e for _, _, e in puts) - min(s for _, s, _ in puts)) / 1e9
    claim_s = (max(c[2] for c in claims) - min(c[1] for c in claims)) / 1e9
    got = [str(k) for c in claims for k in c[4]]
    n_claims = sum(c[3] for c in claims)
    if len(got) != len(every) or set(got) != every:
        dup = len(got) - len(set(got))
        raise SystemExit(
            f"{system} N={n}: claimed {len(got)} samples ({dup} twice, "
            f"{len(every - set(got))} never) of {len(every)} put: not exactly once"
        )
    waits = [w for c in claims for w in c[5]]
    return {
        "claim_p50_ms": pct(waits, 50),
        "claim_max_ms": max(waits),
        "put_s": put_s,
        "claim_s": claim_s,
        "claims": n_claims,
        "samples": len(got),
        "claims_per_s": n_claims / claim_s,
        "samples_per_s": len(got) / claim_s,
        "put_rows_per_s": len(every) / put_s,
    }


def readiness(ctx, system, handle, partition, trials, poll) -> list:
    cc, cp = ctx.Pipe(), ctx.Pipe()
    c = ctx.Process(target=ready_consumer, args=(system, handle, partition, trials, poll, cc[1]))
    p = ctx.Process(target=ready_producer, args=(system, handle, partition, 64, cp[1]))
    c.start()
    p.start()
    lat = []
    try:
        for conn in (cc[0], cp[0]):
            if not conn.poll(600):
                raise SystemExit(f"{system}: a readiness process did not start")
            conn.recv()
        rng = random.Random(36)
        for i in range(trials):
            cc[0].send("arm")
            cc[0].recv()
            # a put lands at a random point of the claimer's wait (of its
            # poll cycle, when it polls)
            delay = 0.001 + rng.uniform(0, max(poll, 0.004))
            cp[0].send((f"r{i}", delay))
            if not cp[0].poll(60) or not cc[0].poll(60):
                raise SystemExit(f"{system}: readiness trial {i} got no answer in 60 s")
            t_put = cp[0].recv()
            t_claim, keys = cc[0].recv()
            if [str(k) for k in keys] != [f"r{i}"]:
                raise SystemExit(f"{system}: readiness trial {i} claimed {keys}, not ['r{i}']")
            lat.append((t_claim - t_put) / 1e6)
        cp[0].send(None)
    finally:
        for proc in (c, p):
            proc.join(timeout=60)
            if proc.is_alive():
                os.kill(proc.pid, 15)
    return lat


def pct(v: list, q: float) -> float:
    s = sorted(v)
    # nearest rank
    return s[min(len(s), max(1, math.ceil(q / 100 * len(s)))) - 1]


def run_stowage(ctx, args) -> dict:
    import stowage

    res = {"tp": {}, "ready": {}}
    with stowage.local(units=args.units, memory="1GiB", replicas=args.replicas) as dp:
        handle = dp.directory
        for n in args.procs:
            part = f"tp{n}"
            dp.register_tasks(part, [TASK], args.rows)
            dp.register_tasks(part + "-warm", [TASK], 1)
            res["tp"][n] = throughput(ctx, "stowage", handle, part, n, args)
            st = dp.claim_status(part, TASK)
            # the units' own count: every row put, and the stop rows claimed
            if (
                st["consumed"] < args.rows
                or st["consumed"] > args.rows + n * args.claim_batch
                or st["leased"]
            ):
                raise SystemExit(
                    f"stowage N={n}: claim_status {st}, expected {args.rows} rows consumed "
                    f"(and at most {n * args.claim_batch} stop rows), none leased"
                )
            r = res["tp"][n]
            print(
                f"  stowage N={n}: {r['claims_per_s']:.0f} claims/s, a claim p50 {r['claim_p50_ms']:.3f} ms, "
                f"max {r['claim_max_ms']:.1f} ms",
                file=sys.stderr,
            )
        dp.register_tasks("ready", [TASK], args.trials)
        dp.register_tasks("ready-warm", [TASK], 1)
        res["ready"]["block"] = readiness(ctx, "stowage", handle, "ready", args.trials, 0.0)
    return res


def run_tq(ctx, args) -> dict:
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    res = {"tp": {}, "ready": {}}
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    try:
        # TransferQueue's default config (SimpleStorage, 2 units, no
        # capacity limit) with NeMo-RL's overlay: polling_mode, so that
        # get_meta returns empty instead of blocking in the controller.
        tq.init(OmegaConf.create({"controller": {"polling_mode": True}}))
        gcs = ray.get_runtime_context().gcs_address
        for n in args.procs:
            res["tp"][n] = throughput(ctx, "tq", gcs, f"tp{n}", n, args)
            r = res["tp"][n]
            print(
                f"  tq N={n}: {r['claims_per_s']:.0f} claims/s, a claim p50 {r['claim_p50_ms']:.3f} ms, "
                f"max {r['claim_max_ms']:.1f} ms",
                file=sys.stderr,
            )
        res["ready"]["poll 1 ms"] = readiness(
            ctx, "tq", gcs, "ready-tight", args.trials, TIGHT_POLL_S
        )
        res["ready"]["poll 0.5 s"] = readiness(
            ctx, "tq", gcs, "ready-nemo", args.slow_trials, NEMO_RL_POLL_S
        )
    finally:
        try:
            tq.close()
        finally:
            ray.shutdown()
    return res


def machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} CPUs ({cpu}), {mem:.0f} GiB, Linux {platform.release()}, Python {platform.python_version()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rows and trials")
    ap.add_argument("--systems", default="stowage,tq")
    ap.add_argument("--procs", default="1,4,16", help="producer = consumer process counts")
    ap.add_argument(
        "--rows", type=int, help="samples per throughput run (default 16384; quick 4096)"
    )
    ap.add_argument("--put-batch", type=int, default=64, help="rows per put (default 64)")
    ap.add_argument("--claim-batch", type=int, default=16, help="rows per claim (default 16)")
    ap.add_argument("--tokens", type=int, default=64, help="int32 tokens per row (default 64)")
    ap.add_argument(
        "--units", type=int, default=2, help="stowage units (default 2, as TQ's storage units)"
    )
    ap.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="stowage copies of every row (default 1; docs/replication.md#claims)",
    )
    ap.add_argument("--trials", type=int, help="readiness trials (default 1000; quick 200)")
    ap.add_argument(
        "--slow-trials", type=int, help="readiness trials at the 0.5 s poll (default 100; quick 30)"
    )
    args = ap.parse_args()
    args.procs = [int(x) for x in args.procs.split(",")]
    args.rows = args.rows or (4096 if args.quick else 16384)
    args.trials = args.trials or (200 if args.quick else 1000)
    args.slow_trials = args.slow_trials or (30 if args.quick else 100)
    unit = max(args.procs) * args.put_batch
    if args.rows % unit or args.rows % args.claim_batch:
        raise SystemExit(
            f"--rows must be a multiple of {unit} (procs x put batch) and of the claim batch"
        )
    systems = args.systems.split(",")
    ctx = mp.get_context("spawn")
    load0 = os.getloadavg()[0]
    results = {}
    for s in systems:
        print(f"running {s} ...", file=sys.stderr)
        results[s] = run_stowage(ctx, args) if s == "stowage" else run_tq(ctx, args)

    print(f"# bench/claims.py {'--quick ' if args.quick else ''}on {machine()}")
    print(
        f"# {args.rows} samples of {args.tokens} int32 tokens, {args.put_batch} rows per put, "
        f"{args.claim_batch} rows per claim; stowage: {args.units} units, {args.replicas} cop{'y' if args.replicas == 1 else 'ies'} of every row"
    )
    print(f"# load average (1 min) at start {load0:.2f}, at end {os.getloadavg()[0]:.2f}")
    print()
    print(
        "throughput: N producer + N consumer processes; put phase, then claim phase "
        "(claim p50/max: one claim that returned rows)"
    )
    head = (
        f"{'N':>3} {'system':8} {'put rows/s':>11} {'claims/s':>10} {'samples/s':>11} "
        f"{'claim p50 ms':>13} {'claim max ms':>13}"
    )
    print(head)
    for n in args.procs:
        for s in systems:
            r = results[s]["tp"][n]
            print(
                f"{n:>3} {s:8} {r['put_rows_per_s']:>11.0f} {r['claims_per_s']:>10.0f} {r['samples_per_s']:>11.0f} "
                f"{r['claim_p50_ms']:>13.3f} {r['claim_max_ms']:>13.1f}"
            )
        if "stowage" in results and "tq" in results:
            a, b = results["stowage"]["tp"][n], results["tq"]["tp"][n]
            print(
                f"{n:>3} {'ratio':8} {a['put_rows_per_s'] / b['put_rows_per_s']:>10.1f}x "
                f"{a['claims_per_s'] / b['claims_per_s']:>9.1f}x {a['samples_per_s'] / b['samples_per_s']:>10.1f}x"
            )
    print()
    print("readiness: put returned -> blocked claim returned, ms (one producer, one consumer)")
    print(f"{'system':28} {'trials':>6} {'p50':>9} {'p99':>9} {'min':>9} {'max':>9}")
    for s in systems:
        for mode, lat in results[s]["ready"].items():
            name = f"{s} ({mode})" if s == "tq" else f"{s} (claim block=True)"
            print(
                f"{name:28} {len(lat):>6} {pct(lat, 50):>9.3f} {pct(lat, 99):>9.3f} {min(lat):>9.3f} {max(lat):>9.3f}"
            )
    print()
    print("every sample claimed exactly once per task: checked")


if __name__ == "__main__":
    main()
