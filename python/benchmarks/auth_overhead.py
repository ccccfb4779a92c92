"""What the shared secret costs: connect (handshake) time and the latency of
64 KiB put and get, with and without a secret, over shm and tcp, measured
in the same run (interleaved rounds, medians).

The secret is proved once per connection (HMAC-SHA-256 challenge-response,
one extra round trip); operations on an open connection carry nothing
extra, so the op ratios should sit at 1.0 within noise.

    .venv/bin/python python/benchmarks/auth_overhead.py [--rounds 5] [--ops 2000]
"""
import argparse
import statistics
import time

import numpy as np

import stowage

SECRET = b"benchmark-secret-0123456789abcdef"


def connect_times(addrs, secret, n):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        c = stowage.connect(addrs, secret=secret, timeout=10)
        out.append(time.perf_counter() - t)
        c.close()
    return out


def op_times(dp, n, value):
    put, get = [], []
    for i in range(n):
        k = [i % 64]
        t = time.perf_counter()
        dp.put("bench", k, {"v": [value]})
        put.append(time.perf_counter() - t)
        t = time.perf_counter()
        dp.get("bench", k, ["v"])
        get.append(time.perf_counter() - t)
    return put, get


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--connects", type=int, default=200)
    args = ap.parse_args()
    value = np.random.default_rng(0).integers(0, 255, 64 << 10, dtype=np.uint8)
    planes = {
        "none": stowage.local(units=1, memory="64MiB", insecure=True),
        "secret": stowage.local(units=1, memory="64MiB", secret=SECRET),
    }
    res = {}
    try:
        for rnd in range(args.rounds):
            # Alternate which plane goes first: nothing favours either.
            order = list(planes.items())[:: 1 if rnd % 2 == 0 else -1]
            for name, dp in order:
                secret = SECRET if name == "secret" else None
                for transport in ("shm", "tcp"):
                    addrs = dp.units if transport == "shm" else [
                        u["tcp"] for u in dp.directory["units"]
                    ]
                    r = res.setdefault((name, transport), {"connect": [], "put": [], "get": []})
                    r["connect"].append(
                        statistics.median(connect_times(addrs, secret, args.connects))
                    )
                    c = stowage.connect(addrs, secret=secret, timeout=10)
                    put, get = op_times(c, args.ops, value)
                    c.close()
                    r["put"].append(statistics.median(put))
                    r["get"].append(statistics.median(get))
    finally:
        for dp in planes.values():
            dp.close()
    print(f"{args.rounds} interleaved rounds (each: median of {args.connects} connects, "
          f"{args.ops} ops of 64 KiB); ratio = secret / no secret, paired by round")
    print(f"{'transport':9} {'what':8} {'no secret':>11} {'secret':>11} {'ratio':>7}  ratio range")
    for transport in ("shm", "tcp"):
        for what in ("connect", "put", "get"):
            a = res[("none", transport)][what]
            b = res[("secret", transport)][what]
            ratios = sorted(y / x for x, y in zip(a, b))
            print(f"{transport:9} {what:8} {statistics.median(a) * 1e6:9.1f}us "
                  f"{statistics.median(b) * 1e6:9.1f}us {statistics.median(ratios):7.2f}  "
                  f"{ratios[0]:.2f}-{ratios[-1]:.2f}")

if __name__ == "__main__":
    main()
