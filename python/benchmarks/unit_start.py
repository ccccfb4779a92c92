"""How fast a unit of a large slab is ready, and where its first-touch
cost goes: `stowage unit` is started as its own process; we time its READY
line, a client's first connect and 64 KiB put, and then fill the slab with
16 MiB puts from a new client (taken from a cold 512 MiB buffer) while
the unit is still faulting its slab in, and again once it is done (the
unit logs `slab faulted in`). Each round starts a new unit.

    .venv/bin/python python/benchmarks/unit_start.py [--memory 4GiB] [--rounds 3] [--mlock]
"""

import argparse
import os
import re
import select
import statistics
import subprocess
import tempfile
import time

import numpy as np

import stowage

BIN = os.environ.get("STOWAGE_BIN", "target/release/stowage")


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+)(GiB|MiB)", s)
    if not m:
        raise SystemExit(f"--memory {s!r}: use e.g. 4GiB or 512MiB")
    return int(m.group(1)) << (30 if m.group(2) == "GiB" else 20)


def wait_line(proc, pattern, timeout):
    """The first stdout/stderr line of `proc` matching `pattern`, within `timeout`."""
    deadline = time.monotonic() + timeout
    buf = {proc.stdout.fileno(): b"", proc.stderr.fileno(): b""}
    while time.monotonic() < deadline:
        r, _, _ = select.select(list(buf), [], [], max(0.0, deadline - time.monotonic()))
        for fd in r:
            chunk = os.read(fd, 65536)
            buf[fd] += chunk
            for line in buf[fd].split(b"\n"):
                if re.search(pattern, line.decode(errors="replace")):
                    return line.decode(errors="replace"), time.monotonic()
    raise TimeoutError(f"no line matching {pattern!r} within {timeout} s")


def fill(addr, memory, src, value_bytes):
    """Put values of `value_bytes` until a slab's worth is in; GB/s."""
    with stowage.connect([addr], timeout=60) as dp:
        n = int(memory * 0.8) // value_bytes
        per = value_bytes // 4
        t = time.perf_counter()
        for i in range(n):
            off = (i * per) % (src.size - per)
            dp.put("fill", [i], {"v": [src[off : off + per]]})
        took = time.perf_counter() - t
        dp.clear_partition("fill")
    return n * value_bytes / took / 1e9


def one_round(memory, mlock, src):
    with tempfile.TemporaryDirectory() as d:
        sock = os.path.join(d, "u.sock")
        args = [BIN, "unit", "--memory", str(memory), "--listen", f"unix:{sock}"]
        if not mlock:
            args.append("--no-mlock")
        env = dict(os.environ, RUST_LOG="info")
        t0 = time.monotonic()
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            _, t_ready = wait_line(proc, r"READY", 120)
            addr = f"unix:{sock}"
            t = time.perf_counter()
            dp = stowage.connect([addr], timeout=60)
            t_conn = time.perf_counter() - t
            v = src[: 64 << 10 >> 2]
            t = time.perf_counter()
            dp.put("p", [0], {"v": [v]})
            t_put = time.perf_counter() - t
            dp.close()
            early = fill(addr, memory, src, 16 << 20)
            _, t_faulted = wait_line(proc, r"slab faulted in", 300)
            late = fill(addr, memory, src, 16 << 20)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {
        "ready_s": t_ready - t0,
        "first_connect_ms": t_conn * 1e3,
        "first_64KiB_put_ms": t_put * 1e3,
        "faulted_in_s": t_faulted - t0,
        "fill_while_faulting_GBps": early,
        "fill_after_GBps": late,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", default="4GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mlock", action="store_true", help="let the unit mlock (needs CAP_IPC_LOCK)")
    args = ap.parse_args()
    memory = parse_size(args.memory)
    src = np.random.default_rng(0).standard_normal((512 << 20) // 4).astype(np.float32)
    rows = [one_round(memory, args.mlock, src) for _ in range(args.rounds)]
    print(f"unit of {args.memory}, mlock {'on' if args.mlock else 'off'}, {args.rounds} rounds (median [min-max])")
    for k in rows[0]:
        xs = [r[k] for r in rows]
        print(f"  {k:26s} {statistics.median(xs):8.3f} [{min(xs):.3f}-{max(xs):.3f}]")


if __name__ == "__main__":
    main()
