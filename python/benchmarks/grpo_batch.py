"""Python-level put/get of a GRPO-shaped batch against a numpy copy of the
same bytes, measured in the same run.

1,024 rows; fields input_ids int64, generation_logprobs bf16, prev_logprobs
bf16, token_mask int32, advantages bf16; lengths uniform 512-4,096 tokens.
The baseline copies every value into a preallocated buffer with numpy (the
least a consumer that wants its own arrays must do). Target: put and get
each >= 0.5x the numpy copy's throughput over shm.

    .venv/bin/python python/benchmarks/grpo_batch.py [--rows 1024] [--reps 5] [--transport shm]
"""
import argparse
import time

import numpy as np

import stowage

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bf16 bytes are what matter for the transfer
    BF16 = np.dtype(np.uint16)


def batch(rows, rng):
    lens = rng.integers(512, 4097, rows)
    cols = {
        "input_ids": [rng.integers(0, 32_000, n, dtype=np.int64) for n in lens],
        "generation_logprobs": [rng.standard_normal(n).astype(np.float32).astype(BF16) for n in lens],
        "prev_logprobs": [rng.standard_normal(n).astype(np.float32).astype(BF16) for n in lens],
        "token_mask": [np.ones(n, dtype=np.int32) for n in lens],
        "advantages": [np.full(n, 0.5, dtype=np.float32).astype(BF16) for n in lens],
    }
    return cols


def best(fn, reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--units", type=int, default=2)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    cols = batch(args.rows, rng)
    fields = list(cols)
    keys = [f"uid_{i}" for i in range(args.rows)]
    nbytes = sum(a.nbytes for v in cols.values() for a in v)
    outs = {f: [np.empty_like(a) for a in v] for f, v in cols.items()}

    def numpy_copy():
        for f, v in cols.items():
            for src, dst in zip(v, outs[f]):
                np.copyto(dst, src)

    copy_t = best(numpy_copy, args.reps)
    flat_src = np.ones(nbytes, dtype=np.uint8)
    flat_dst = np.empty_like(flat_src)
    flat_t = best(lambda: np.copyto(flat_dst, flat_src), args.reps)
    gb = nbytes / 1e9
    memory = f"{max(256, 2 * nbytes // args.units // (1 << 20) + 64)}MiB"
    with stowage.local(units=args.units, memory=memory, transport=args.transport) as plane:
        part = iter(range(1 << 30))

        def put():
            plane.put(f"p{next(part)}", keys, cols)

        put_t = best(put, args.reps)
        for p in plane.partitions():
            plane.clear_partition(p)
        plane.put("g", keys, cols)
        get_t = best(lambda: plane.get("g", keys, fields), args.reps)
        get_out_t = best(lambda: plane.get("g", keys, fields, out=outs), args.reps)

        def view():
            v = plane.get_view("g", keys, fields)
            del v

        view_t = best(view, args.reps) if args.transport == "shm" else float("nan")
        got = plane.get("g", keys, fields, out=outs)
        for f in fields:
            assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(got[f], cols[f]))

    def line(name, t):
        return f"  {name:<24} {t * 1e3:8.2f} ms  {gb / t:6.2f} GB/s  {copy_t / t:5.2f}x numpy copy"

    print(
        f"GRPO batch: {args.rows} rows x {len(fields)} fields, {nbytes / 2**20:.1f} MiB, "
        f"{args.units} units over {args.transport} (best of {args.reps})"
    )
    print(line("numpy copy", copy_t))
    print(line("(one contiguous copy)", flat_t))
    print(line("put", put_t))
    print(line("get (new arrays)", get_t))
    print(line("get (out= arrays)", get_out_t))
    if args.transport == "shm":
        print(line("get_view (zero copy)", view_t))
    print("target: put and get >= 0.5x numpy copy")


if __name__ == "__main__":
    main()
