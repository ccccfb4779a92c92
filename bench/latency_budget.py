#!/usr/bin/env python3
"""What a 64 KiB put and get from one Python client can cost at least on
this machine, against what they cost: the targets of issue 24 (put p50
<= 15 us, get p50 <= 10 us; shm, default placement, cold buffers) set
beside their parts, all measured in the same run.

    .venv/bin/python bench/latency_budget.py [--rounds 5] [--calls 10000] [--units 2]

Starts ``--units`` local units (``stowage.local``, shm, default placement:
row r on unit r % units) and, each round, in turn:

1. ``copy cold->cold``: 64 KiB copied (``np.copyto``) from a 128 MiB
   source into a 128 MiB destination, walked in turn (nothing in the
   caches): the copy a put makes, from a cold array into slab memory that
   no cache holds;
2. ``copy hot->cold``: the same 64 KiB copied again and again into the
   walked destination: the copy a get makes, from the value just put (in
   cache) into a cold ``out`` array;
3. ``call 64 B put`` / ``call 64 B get(out=)``: ``DataPlane.put`` and
   ``DataPlane.get(out=)`` of one 64-byte row: the round trip to the
   unit's process, the client library and the Python call, with no copy
   worth the name;
4. ``op 64 KiB put`` / ``op 64 KiB get(out=)``: the target's measure,
   64 KiB values from the walked source into the walked destination (as
   ``bench/compare.py``'s latency workload does).

Each line is the p50 of ``--calls`` timed calls (after 500 untimed ones)
per round; the last column is the median over rounds. The copies are
``np.copyto`` minus the p50 of a 64-byte ``np.copyto`` (its call), so they
are the bytes' cost alone. Then, per op, the budget: the target less the
copy is what the round trip and the call may take at most; beside it the
64-byte call as measured, and the copy plus the call (the op's cost if the
two added up and nothing else did) against the op measured.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import stowage

SIZE = 64 * 1024
POOL = 128 << 20
NKEYS = 1024
TARGET = {"put": 15.0, "get": 10.0}


def p50(call, calls: int) -> float:
    """The p50 (us) of `calls` timed calls of `call(i)` after 500 untimed."""
    for i in range(500):
        call(i)
    times = []
    for i in range(500, 500 + calls):
        t = time.perf_counter_ns()
        call(i)
        times.append(time.perf_counter_ns() - t)
    return statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    ap.add_argument(
        "--calls", type=int, default=10000, help="timed calls per line a round (default 10000)"
    )
    ap.add_argument("--units", type=int, default=2, help="local units (default 2)")
    args = ap.parse_args()
    if args.rounds < 1 or args.calls < 1 or args.units < 1:
        raise SystemExit("--rounds, --calls and --units must be at least 1")
    slots = POOL // SIZE
    # Every page written before timing (no first-touch faults timed),
    # then walked so that no slot is in a cache when its turn comes.
    src = np.random.default_rng(0).integers(0, 255, POOL, dtype=np.uint8).reshape(slots, SIZE)
    dst = np.ones((slots, SIZE), dtype=np.uint8)
    hot = np.full(SIZE, 7, dtype=np.uint8)
    tiny_src, tiny_dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    small, small_out = np.arange(8, dtype=np.int64), np.zeros(8, dtype=np.int64)

    with stowage.local(units=args.units, memory="1GiB", transport="shm") as dp:
        lines = {
            "copy 64 B (the call)": lambda i: np.copyto(tiny_dst, tiny_src),
            "copy cold->cold": lambda i: np.copyto(dst[i % slots], src[(i + slots // 2) % slots]),
            "copy hot->cold": lambda i: np.copyto(dst[i % slots], hot),
            "call 64 B put": lambda i: dp.put("small", [i % NKEYS], {"v": [small]}),
            "call 64 B get(out=)": lambda i: dp.get(
                "small", [i % NKEYS], ["v"], out={"v": [small_out]}
            ),
        }
        got = {k: [] for k in [*lines, "op 64 KiB put", "op 64 KiB get(out=)"]}
        for _ in range(args.rounds):
            for name, call in lines.items():
                got[name].append(p50(call, args.calls))
            dp.clear("small", list(range(NKEYS)))
            # The op pair in one loop, as a user's step would: put a row,
            # then read it back into a cold destination.
            puts, gets = [], []
            for i in range(500 + args.calls):
                if i % NKEYS == 0 and i:
                    dp.clear("big", list(range(NKEYS)))  # untimed: rows reused
                row, slot = [i % NKEYS], i % slots
                t = time.perf_counter_ns()
                dp.put("big", row, {"v": src[slot : slot + 1]})
                t1 = time.perf_counter_ns()
                dp.get("big", row, ["v"], out={"v": dst[slot : slot + 1]})
                t2 = time.perf_counter_ns()
                if i >= 500:
                    puts.append(t1 - t)
                    gets.append(t2 - t1)
            if not np.array_equal(src[slot], dst[slot]):
                raise SystemExit("a 64 KiB value read back differs from the one put")
            if not np.array_equal(small, small_out):
                raise SystemExit("a 64-byte value read back differs from the one put")
            dp.clear("big", list(range(NKEYS)))
            got["op 64 KiB put"].append(statistics.median(puts) / 1e3)
            got["op 64 KiB get(out=)"].append(statistics.median(gets) / 1e3)

    med = {k: statistics.median(v) for k, v in got.items()}
    call = med["copy 64 B (the call)"]
    print(f"{args.units} unit(s), shm, default placement; p50 per round of {args.calls} calls, us")
    for name, v in got.items():
        print(f"{name:22s} {' '.join(f'{x:6.2f}' for x in v)} | median {med[name]:6.2f}")
    copy = {
        "put": med["copy cold->cold"] - call,
        "get": med["copy hot->cold"] - call,
    }
    for op, small_call, measured in (
        ("put", med["call 64 B put"], med["op 64 KiB put"]),
        ("get", med["call 64 B get(out=)"], med["op 64 KiB get(out=)"]),
    ):
        left = TARGET[op] - copy[op]
        print(
            f"{op}: target {TARGET[op]:.1f}; its copy alone {copy[op]:.2f}, leaving {left:.2f} for the "
            f"round trip and the call, which take {small_call:.2f} with 64 B ({small_call / left:.2f}x "
            f"what is left); copy + call {copy[op] + small_call:.2f}, measured {measured:.2f} "
            f"({measured / TARGET[op]:.2f}x the target)"
        )


if __name__ == "__main__":
    main()
