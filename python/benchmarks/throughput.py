"""Large-value throughput as a user gets it, against C memcpy of the same
cold bytes, in one run.

A writer process puts values (1 MiB, 16 MiB) sliced from a seeded random
512 MiB buffer, walking through it so that nothing is in the caches; a
reader process, another one, gets them back into new arrays and then into
`out=` arrays (its destinations walk through a 512 MiB buffer of its own).
Two units over shm, default placement. The limit is a memcpy over the
same kind of cold source and destination: libc's memcpy through ctypes
(which releases the GIL) on one thread, and split over as many threads as
stowage copies with (up to 4 for copies of 8 MiB and more) on the same
thread pool (`stowage._native.copy`). Medians of --rounds.

Each writer and reader makes two passes: the first is what a new process
pays (it fills its page tables of the slab as it goes, about 1.3 us per
4 KiB page on this VM); the second reuses the same slab ranges, as a
long-lived trainer or rollout worker does.

Target (issue "Performance, round 2"): every stowage figure >= 0.9x the
single-thread cold memcpy of the same size.

    .venv/bin/python python/benchmarks/throughput.py [--rounds 3] [--total 512]
"""

import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

import stowage
from stowage import _native

MiB = 1 << 20
POOL = 512 * MiB
SIZES = (1 * MiB, 16 * MiB)
_libc = ctypes.CDLL(None)
_libc.memcpy.restype = ctypes.c_void_p
_libc.memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def addr(a):
    return a.__array_interface__["data"][0]


def stowage_threads(size):
    # stowage_shm::copy_threads: copies of 8 MiB or more go over up to 4 cores.
    return min(4, os.cpu_count() or 1) if size >= 8 * MiB else 1


def memcpy_gbps(size, total, threads, src, dst):
    """Copy `total` bytes in pieces of `size` from cold `src` offsets to
    cold `dst` offsets: libc memcpy on one thread, or split over `threads`
    threads of the same pool stowage copies with (stowage._native.copy, no
    thread started per copy)."""
    n = total // size
    t = time.perf_counter()
    for i in range(n):
        s, d = (i * size) % (POOL - size), (i * size * 7) % (POOL - size)
        if threads == 1:
            _libc.memcpy(addr(dst) + d, addr(src) + s, size)
        else:
            _native.copy(dst[d : d + size], src[s : s + size], threads)
    return n * size / (time.perf_counter() - t) / 1e9


def writer(directory, size, total, go, done, out):
    """Two passes: put every value (a new process: the first touch of its
    mapping of the slab), let the reader read them, clear, and put them
    again (its mapping now warm: the ranges freed are reused)."""
    src = np.random.default_rng(1).integers(0, 256, POOL, dtype=np.uint8)
    n = total // size
    rates = []
    with stowage.connect(directory, timeout=60) as dp:
        for p in range(2):
            t = time.perf_counter()
            for i in range(n):
                off = (i * size + p * 4096) % (POOL - size)
                dp.put("tp", [i], {"v": [src[off : off + size]]})
            rates.append(n * size / (time.perf_counter() - t) / 1e9)
            go.put(p)
            done.get(timeout=900)
            dp.clear("tp", list(range(n)))
    out.put(("put", rates))


def reader(directory, size, total, go, done, out):
    """Per pass: get every value into a new array, then into `out=` slices
    of a faulted-in buffer of its own, walked through."""
    dst = np.ones(POOL, dtype=np.uint8)
    n = total // size
    new, into = [], []
    with stowage.connect(directory, timeout=60) as dp:
        for p in range(2):
            go.get(timeout=900)
            t = time.perf_counter()
            for i in range(n):
                got = dp.get("tp", [i], ["v"])["v"][0]
                del got
            new.append(n * size / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            for i in range(n):
                off = (i * size * 7 + p * 4096) % (POOL - size)
                dp.get("tp", [i], ["v"], out={"v": [dst[off : off + size]]})
            into.append(n * size / (time.perf_counter() - t) / 1e9)
            done.put(p)
    out.put(("get", (new, into)))


def run_pair(directory, size, total):
    ctx = mp.get_context("spawn")
    go, done, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    ps = [
        ctx.Process(target=writer, args=(directory, size, total, go, done, out)),
        ctx.Process(target=reader, args=(directory, size, total, go, done, out)),
    ]
    for p in ps:
        p.start()
    res = dict(out.get(timeout=1800) for _ in ps)
    for p in ps:
        p.join(timeout=60)
    new, into = res["get"]
    return res["put"], new, into


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--total", type=int, default=512, help="MiB moved per size and round")
    args = ap.parse_args()
    total = args.total * MiB
    src = np.random.default_rng(2).integers(0, 256, POOL, dtype=np.uint8)
    dst = np.ones(POOL, dtype=np.uint8)
    rows = {s: [] for s in SIZES}
    with stowage.local(units=2, memory="2GiB") as plane:
        # The units fault their slabs in on threads of their own after they
        # start (about 3 s for 2 GiB here): measure after that.
        time.sleep(10)
        for _ in range(args.rounds):
            for size in SIZES:
                th = stowage_threads(size)
                m1 = memcpy_gbps(size, total, 1, src, dst)
                mt = memcpy_gbps(size, total, th, src, dst) if th > 1 else m1
                put, new, into = run_pair(plane.directory, size, total)
                rows[size].append((m1, mt, put[0], new[0], into[0], put[1], new[1], into[1]))
    print(f"2 units over shm, writer and reader in their own processes, {args.total} MiB per size, "
          f"median of {args.rounds} (GB/s; ratio to 1-thread cold memcpy)")
    for label, base in (("first pass: new processes, first touch of their slab mappings", 2),
                        ("second pass: the same processes, ranges reused", 5)):
        print(f"  {label}")
        print(f"  {'size':>6} | {'memcpy 1t':>9} | {'memcpy Nt':>13} | {'put':>12} | {'get new':>12} | {'get out=':>12}")
        for size in SIZES:
            med = [statistics.median(r[i] for r in rows[size]) for i in range(8)]
            m1, mt = med[0], med[1]
            put, new, into = med[base], med[base + 1], med[base + 2]
            th = stowage_threads(size)
            print(
                f"  {size // MiB:>4}Mi | {m1:9.2f} | {mt:8.2f} ({th}t) | {put:6.2f} {put / m1:4.2f}x | "
                f"{new:6.2f} {new / m1:4.2f}x | {into:6.2f} {into / m1:4.2f}x"
            )


if __name__ == "__main__":
    main()
