"""A GRPO batch as an RL step moves it, writer and reader in their own
processes, against a C memcpy of the same bytes in the same run.

The batch: 1,024 rows of 512-4,096 tokens (uniform), three fields per row
(input_ids int64, logprobs float32, token_mask int32): 37.7 MB on average,
3,072 values. Two units over shm, default placement (rows spread over
both). Every step the writer process puts the batch into a new partition;
the reader process (another one) then gets it into new arrays, into `out=`
arrays, as zero-copy views (one array per value) and as a packed view (per
unit, one array per field and row offsets); then the writer clears the
partition. Step
1 is what a new process pays (its first touch of the slab's pages and of
its own destination memory); later steps reuse the memory the earlier ones
freed, as an RL loop does. Figures: step 1, then the median [min-max] of
the later steps, over `--rounds` rounds (a new plane and new processes
each).

Targets (issue "Performance, round 2"): put <= 5 ms, get into new arrays
<= 7 ms, get(out=) <= 5 ms, get_view <= 1 ms; a view <= 0.5 ms (issue 37),
which get_packed_view is measured against.

    .venv/bin/python python/benchmarks/grpo_batch.py [--steps 6] [--rounds 3]
"""

import argparse
import ctypes
import multiprocessing as mp
import statistics
import time

import numpy as np

import stowage

FIELDS = ("input_ids", "logprobs", "token_mask")
_libc = ctypes.CDLL(None)
_libc.memcpy.restype = ctypes.c_void_p
_libc.memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def batch(seed=0, rows=1024):
    rng = np.random.default_rng(seed)
    lens = rng.integers(512, 4097, rows)
    return {
        "input_ids": [rng.integers(0, 32_000, n, dtype=np.int64) for n in lens],
        "logprobs": [rng.standard_normal(n).astype(np.float32) for n in lens],
        "token_mask": [np.ones(n, dtype=np.int32) for n in lens],
    }


def writer(directory, steps, rows, go, done, out):
    cols = batch(rows=rows)
    keys = list(range(rows))
    times = []
    with stowage.connect(directory, timeout=60) as dp:
        for s in range(steps):
            t = time.perf_counter()
            dp.put(f"step{s}", keys, cols)
            times.append(time.perf_counter() - t)
            go.put(s)
            done.get(timeout=600)
            dp.clear_partition(f"step{s}")
    out.put(("put", times))


def reader(directory, steps, rows, go, done, out):
    want = batch(rows=rows)
    keys = list(range(rows))
    outs = {f: [np.empty_like(a) for a in v] for f, v in want.items()}
    got_t, out_t, view_t, packed_t = [], [], [], []
    with stowage.connect(directory, timeout=60) as dp:
        for s in range(steps):
            go.get(timeout=600)
            p = f"step{s}"
            t = time.perf_counter()
            got = dp.get(p, keys, FIELDS)
            got_t.append(time.perf_counter() - t)
            if s == 0:
                for f in FIELDS:
                    assert all(np.array_equal(a, b) for a, b in zip(got[f], want[f])), f
            del got
            t = time.perf_counter()
            dp.get(p, keys, FIELDS, out=outs)
            out_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            v = dp.get_view(p, keys, FIELDS)
            view_t.append(time.perf_counter() - t)
            del v
            t = time.perf_counter()
            v = dp.get_packed_view(p, keys, FIELDS)
            packed_t.append(time.perf_counter() - t)
            if s == 0:
                for f in FIELDS:
                    values, offsets = v.joined(f)
                    assert all(
                        np.array_equal(values[offsets[i] : offsets[i + 1]], want[f][i])
                        for i in range(rows)
                    ), f
                assert all(not a.flags.writeable for c in v.chunks for a in c.values.values())
            del v
            done.put(s)
    out.put(("get", (got_t, out_t, view_t, packed_t)))


def memcpy_ms(nbytes):
    """One C memcpy of the batch's bytes between cold, faulted-in buffers."""
    src = np.ones(nbytes + (256 << 20), dtype=np.uint8)
    dst = np.ones_like(src)
    best = []
    for i in range(5):
        off = (i * nbytes) % (256 << 20)
        t = time.perf_counter()
        _libc.memcpy(dst.ctypes.data + off, src.ctypes.data + (256 << 20) - off, nbytes)
        best.append(time.perf_counter() - t)
    return statistics.median(best) * 1e3


def one_round(steps, rows):
    ctx = mp.get_context("spawn")
    go, done, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    with stowage.local(units=2, memory="1GiB") as plane:
        time.sleep(3)  # the units fault their slabs in on threads of their own
        ps = [
            ctx.Process(target=writer, args=(plane.directory, steps, rows, go, done, out)),
            ctx.Process(target=reader, args=(plane.directory, steps, rows, go, done, out)),
        ]
        for p in ps:
            p.start()
        res = dict(out.get(timeout=900) for _ in ps)
        for p in ps:
            p.join(timeout=60)
    put = res["put"]
    got, into, view, packed = res["get"]
    return {
        "put": put,
        "get (new arrays)": got,
        "get (out=)": into,
        "get_view": view,
        "get_packed_view": packed,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=1024)
    args = ap.parse_args()
    nbytes = sum(a.nbytes for v in batch(rows=args.rows).values() for a in v)
    rounds = []
    copies = []
    for _ in range(args.rounds):
        copies.append(memcpy_ms(nbytes))
        rounds.append(one_round(args.steps, args.rows))
    copy = statistics.median(copies)
    print(
        f"GRPO batch: {args.rows} rows x {len(FIELDS)} fields, {nbytes / 1e6:.1f} MB, "
        f"{args.rows * len(FIELDS)} values; 2 units over shm; writer and reader in their own processes; "
        f"{args.rounds} rounds of {args.steps} steps"
    )
    print(f"  one C memcpy of the batch (1 thread, cold): {copy:.2f} ms")
    targets = {
        "put": 5,
        "get (new arrays)": 7,
        "get (out=)": 5,
        "get_view": 1,
        "get_packed_view": 0.5,
    }
    print(f"  {'ms':<18} {'step 1 (new process)':>22} {'later steps: median [min-max]':>34} {'target':>7}")
    for name, target in targets.items():
        first = statistics.median(r[name][0] * 1e3 for r in rounds)
        later = [t * 1e3 for r in rounds for t in r[name][1:]]
        med = statistics.median(later) if later else float("nan")
        lo, hi = (min(later), max(later)) if later else (float("nan"),) * 2
        print(f"  {name:<18} {first:22.2f} {med:14.2f} [{lo:.2f}-{hi:.2f}]{'':>6} {target:>5}")


if __name__ == "__main__":
    main()
