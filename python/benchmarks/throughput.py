"""Large-value throughput as a user gets it, against C memcpy of the same
cold bytes, in one run.

A writer process puts values (1 MiB, 16 MiB) sliced from a seeded random
512 MiB buffer, walking through it so that nothing is in the caches; a
reader process, another one, gets them back into new arrays and then into
`out=` arrays (its destinations walk through a 512 MiB buffer of its own).
Two units over shm, default placement. The limit is a memcpy over the
same kind of cold source and destination: libc's memcpy through ctypes
(which releases the GIL) on one thread, and split over as many threads as
stowage copies with (up to 4 for copies of 1 MiB and more) on the same
thread pool (`stowage._native.copy`). Medians of --rounds.

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
    # stowage_shm::copy_threads: copies of 1 MiB or more go over up to 4 cores.
    return min(4, os.cpu_count() or 1) if size >= 1 * MiB else 1


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


def writer(directory, size, total, out):
    src = np.random.default_rng(1).integers(0, 256, POOL, dtype=np.uint8)
    n = total // size
    with stowage.connect(directory, timeout=60) as dp:
        t = time.perf_counter()
        for i in range(n):
            off = (i * size) % (POOL - size)
            dp.put("tp", [i], {"v": [src[off : off + size]]})
        out.put(n * size / (time.perf_counter() - t) / 1e9)


def reader(directory, size, total, out):
    dst = np.ones(POOL, dtype=np.uint8)  # faulted in, then walked through
    n = total // size
    with stowage.connect(directory, timeout=60) as dp:
        t = time.perf_counter()
        for i in range(n):
            got = dp.get("tp", [i], ["v"])["v"][0]
            del got
        new = n * size / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for i in range(n):
            off = (i * size * 7) % (POOL - size)
            dp.get("tp", [i], ["v"], out={"v": [dst[off : off + size]]})
        into = n * size / (time.perf_counter() - t) / 1e9
        dp.clear("tp", list(range(n)))
    out.put((new, into))


def run(target, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    r = q.get(timeout=900)
    p.join(timeout=60)
    return r


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
                put = run(writer, plane.directory, size, total)
                new, into = run(reader, plane.directory, size, total)
                rows[size].append((m1, mt, put, new, into))
    print(f"2 units over shm, writer and reader in their own processes, {args.total} MiB per size, "
          f"median of {args.rounds} (GB/s; ratio to 1-thread cold memcpy)")
    print(f"{'size':>6} | {'memcpy 1t':>9} | {'memcpy Nt':>13} | {'put':>12} | {'get new':>12} | {'get out=':>12}")
    for size in SIZES:
        med = [statistics.median(r[i] for r in rows[size]) for i in range(5)]
        m1, mt, put, new, into = med
        th = stowage_threads(size)
        print(
            f"{size // MiB:>4}Mi | {m1:9.2f} | {mt:8.2f} ({th}t) | {put:6.2f} {put / m1:4.2f}x | "
            f"{new:6.2f} {new / m1:4.2f}x | {into:6.2f} {into / m1:4.2f}x"
        )


if __name__ == "__main__":
    main()
