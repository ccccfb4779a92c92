#!/usr/bin/env python3
"""What one small call costs from Python, and how much of it is the Python
wrapper: ``DataPlane.put`` / ``DataPlane.get(out=)`` against the native
calls under them (``put`` / ``get_into`` of ``stowage._native.Client``),
timed in the same loop so that a noisy machine moves both alike.

    .venv/bin/python bench/call_overhead.py [--bytes 64] [--units 1] [--rounds 6] [--calls 10000]

Starts ``--units`` local units (``stowage.local``, shm), then for each round
times ``--calls`` calls of each kind (after 1,000 warm-up calls) on one row
of ``--bytes`` (one unit: every call on unit 0) and prints each round's
median in microseconds, then the median over rounds and the wrapper's share
(``DataPlane`` minus native). Compare two builds by running each in turn
(``PYTHONPATH`` pointing at each build's package), alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import stowage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=64, help="value size (default 64)")
    ap.add_argument("--units", type=int, default=1, help="local units (default 1)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds (default 6)")
    ap.add_argument(
        "--calls", type=int, default=10000, help="timed calls per kind a round (default 10000)"
    )
    args = ap.parse_args()
    n = max(1, args.bytes // 8)
    src = np.arange(n, dtype=np.int64)
    dst = np.zeros(n, dtype=np.int64)
    with stowage.local(units=args.units, memory="256MiB") as dp:
        native = dp._client
        calls = {
            "DataPlane.put": lambda: dp.put("p", [0], {"v": [src]}),
            "native put": lambda: native.put("p", [0], [("v", [src])], None, None),
            "DataPlane.get(out=)": lambda: dp.get("p", [0], ["v"], out={"v": [dst]}),
            "native get_into": lambda: native.get_into("p", [0], ["v"], [[dst]], None, None),
        }
        p50 = {k: [] for k in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                for _ in range(1000):
                    call()
                times = []
                for _ in range(args.calls):
                    t = time.perf_counter_ns()
                    call()
                    times.append(time.perf_counter_ns() - t)
                p50[name].append(statistics.median(times) / 1e3)
        if not np.array_equal(src, dst):
            raise SystemExit("the value read back differs from the one put")
    print(f"{n * 8} bytes, {args.units} unit(s), p50 of {args.calls} calls per round, us")
    for name, v in p50.items():
        rounds = " ".join(f"{x:6.2f}" for x in v)
        print(f"{name:20s} {rounds} | median {statistics.median(v):6.2f}")
    for wrapper, under in (
        ("DataPlane.put", "native put"),
        ("DataPlane.get(out=)", "native get_into"),
    ):
        w = statistics.median(p50[wrapper]) - statistics.median(p50[under])
        print(f"{wrapper} over {under}: {w:+.2f} us")


if __name__ == "__main__":
    main()
