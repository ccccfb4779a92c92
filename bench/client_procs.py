"""Op rate and latency of Python client processes, from fewer to many more
than the cores (issue 37: a waiting client must not steal the unit's core).

    .venv/bin/python bench/client_procs.py [--procs 1,4,16,64] [--units 2]
        [--value 4096] [--seconds 3] [--rounds 1] [--spin adaptive,always]
        [--hogs 0] [--floor] [--json PATH]

Starts ``--units`` local units (``stowage.local``, shm, 1 GiB each, default
placement: row r on unit r % units). Each point runs N client processes
(forked from a server that imported numpy and stowage, each connecting
with the plane's directory as a worker does): each puts a ``--value``-byte
row and gets it back with ``out=``, in a loop, over consecutive rows of its
own (so its ops go round the units), clearing its 16 rows every 16 puts
(not timed, not counted). A client warms up (its connections, their
request rings) before it says ready; all start on one word and run for
``--seconds``. Rounds interleave the points. ``--spin always,adaptive``
runs each point twice, alternating, on two planes: waiters that spin as
before issue 37 (``STOWAGE_SPIN_ALWAYS=1`` in the units and clients), and
waiters that spin only with a core to spare (the default). ``--hogs N``
keeps N busy-loop processes running beside, as other work on a shared
host. ``--floor`` adds a row per point, alternating with the others: the
same client processes doing the same put-then-get loop of ``--value``
bytes over a Unix socket against ``echo_floor`` (a one-thread epoll server
that stores nothing and answers each request at once; build it with
``cargo build --release -p stowage-cli --example echo_floor``): the rate a
synchronous request and reply allows at all on this host, whatever the
server does.

Reported per point (median [min-max] over the rounds): op/s (puts and gets
of all clients, over the time from the start word to the last client's
end), p50 and p99 of one put or one get over every client's ops, and the
clients' and units' CPU time per op. Then rate(64)/rate(4) and the issue's
targets beside them: 64 processes >= 0.8x the 4-process rate with p99 <=
5 ms, 16 processes p99 <= 1 ms. A benchmark: no figure is a pass/fail.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

CLEAR_EVERY = 16


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid`, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick


def loadavg_running() -> str:
    """/proc/loadavg's runnable/total threads, now."""
    with open("/proc/loadavg") as f:
        return f.read().split()[3]


class FloorServer:
    """echo_floor, started on a socket in a temporary directory and stopped
    by its pid."""

    def __init__(self):
        import tempfile

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        exe = os.path.join(root, "target", "release", "examples", "echo_floor")
        if not os.path.exists(exe):
            raise SystemExit(
                f"--floor needs {exe}: cargo build --release -p stowage-cli --example echo_floor"
            )
        self.dir = tempfile.TemporaryDirectory(prefix="stowage-floor-")
        self.path = os.path.join(self.dir.name, "floor.sock")
        self.proc = subprocess.Popen([exe, self.path])
        deadline = time.monotonic() + 10
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SystemExit("echo_floor did not start")
            time.sleep(0.01)

    def close(self):
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.dir.cleanup()


def client(idx, directory, mode, value, seconds, ready, go, results):
    if mode == "always":
        os.environ["STOWAGE_SPIN_ALWAYS"] = "1"  # read at the first wait
    import numpy as np

    import stowage

    dp = stowage.connect(directory, namespace="procs", timeout=30.0)
    src = np.full(value, idx % 251, dtype=np.uint8)
    out = np.zeros(value, dtype=np.uint8)
    base = idx * 1_000_000
    part = "procs"
    rows = [0]
    outs = {"v": [out]}
    cols = {"v": [src]}
    # Warm up: connections, rings (opened after a few round trips).
    for i in range(64):
        rows[0] = base + i % CLEAR_EVERY
        dp.put(part, rows, cols)
        dp.get(part, rows, ["v"], out=outs)
        if i % CLEAR_EVERY == CLEAR_EVERY - 1:
            dp.clear(part, list(range(base, base + CLEAR_EVERY)))
    ready.put(idx)
    go.wait()
    cpu0 = time.process_time()
    lat = []
    t_end = time.monotonic() + seconds
    i = 0
    clock = time.perf_counter_ns
    while True:
        rows[0] = base + i % CLEAR_EVERY
        t0 = clock()
        dp.put(part, rows, cols)
        t1 = clock()
        dp.get(part, rows, ["v"], out=outs)
        t2 = clock()
        lat.append(t1 - t0)
        lat.append(t2 - t1)
        i += 1
        if i % CLEAR_EVERY == 0:
            dp.clear(part, list(range(base, base + CLEAR_EVERY)))
            if time.monotonic() >= t_end:
                break
    end = time.monotonic()
    if out[0] != src[0]:
        raise SystemExit(f"client {idx}: a value read back differs")
    results.put((idx, end, time.process_time() - cpu0, np.asarray(lat, dtype=np.int64).tobytes()))
    dp.close()


def floor_client(idx, path, mode, value, seconds, ready, go, results):
    """`client`'s loop against echo_floor: a put sends a header and the
    value and reads an 8-byte answer; a get sends a header and reads the
    header and the value into the same kind of out= buffer."""
    import socket
    import struct

    import numpy as np

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    src = np.full(value, idx % 251, dtype=np.uint8)
    put_msg = struct.pack("<II", 1, value) + src.tobytes()
    get_msg = struct.pack("<II", 2, value)
    head = bytearray(8)
    out = np.zeros(value, dtype=np.uint8)
    out_view = memoryview(out).cast("B")

    def recv_exactly(view):
        got = 0
        while got < len(view):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise SystemExit(f"floor client {idx}: the server closed")
            got += n

    def put():
        sock.sendall(put_msg)
        recv_exactly(memoryview(head))

    def get():
        sock.sendall(get_msg)
        recv_exactly(memoryview(head))
        recv_exactly(out_view)

    for _ in range(64):
        put()
        get()
    ready.put(idx)
    go.wait()
    cpu0 = time.process_time()
    lat = []
    t_end = time.monotonic() + seconds
    i = 0
    clock = time.perf_counter_ns
    while True:
        t0 = clock()
        put()
        t1 = clock()
        get()
        t2 = clock()
        lat.append(t1 - t0)
        lat.append(t2 - t1)
        i += 1
        if i % CLEAR_EVERY == 0 and time.monotonic() >= t_end:
            break
    end = time.monotonic()
    results.put((idx, end, time.process_time() - cpu0, np.asarray(lat, dtype=np.int64).tobytes()))
    sock.close()


def point(ctx, directory, mode, unit_pids, n, args):
    import numpy as np

    ready, results = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    procs = [
        ctx.Process(
            target=floor_client if mode == "floor" else client,
            args=(i, directory, mode, args.value, args.seconds, ready, go, results),
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    for _ in range(n):
        ready.get(timeout=120)
    units0 = sum(cpu_seconds(p) for p in unit_pids)
    start = time.monotonic()
    go.set()
    got = [results.get(timeout=args.seconds + 120) for _ in range(n)]
    units1 = sum(cpu_seconds(p) for p in unit_pids)
    for p in procs:
        p.join(timeout=30)
        if p.exitcode != 0:
            raise SystemExit(f"a client exited with {p.exitcode}")
    lat = np.concatenate([np.frombuffer(g[3], dtype=np.int64) for g in got])
    ops = len(lat)
    elapsed = max(g[1] for g in got) - start
    return {
        "procs": n,
        "ops_per_s": ops / elapsed,
        "p50_us": float(np.percentile(lat, 50)) / 1e3,
        "p99_us": float(np.percentile(lat, 99)) / 1e3,
        "client_cpu_per_op_us": sum(g[2] for g in got) / ops * 1e6,
        "unit_cpu_per_op_us": (units1 - units0) / ops * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--procs", default="1,4,16,64", help="client processes per point (default 1,4,16,64)"
    )
    ap.add_argument("--units", type=int, default=2, help="local units (default 2)")
    ap.add_argument("--value", type=int, default=4096, help="bytes per value (default 4096)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per point (default 3)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds over the points (default 1)")
    ap.add_argument(
        "--spin",
        default="adaptive",
        help="how waiters spin, comma-separated to compare: adaptive (the default: only with a core"
        " to spare) or always (STOWAGE_SPIN_ALWAYS=1, as before issue 37)",
    )
    ap.add_argument(
        "--hogs",
        type=int,
        default=0,
        help="CPU-bound processes (busy loops) kept running through the run: other work that wants"
        " the cores, as on a shared host (default 0)",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="add the same loop against echo_floor (a server that stores nothing) at each point",
    )
    ap.add_argument("--json", metavar="PATH", help="also write every figure to PATH")
    args = ap.parse_args()
    points = [int(x) for x in args.procs.split(",")]

    import stowage

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "stowage"])
    modes = args.spin.split(",") + (["floor"] if args.floor else [])
    runs = {(m, n): [] for m in modes for n in points}
    planes = {}
    floor_server = None
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)
    ]
    try:
        if args.floor:
            floor_server = FloorServer()
        for m in modes:
            if m == "floor":
                continue
            # The units read STOWAGE_SPIN_ALWAYS once, from the environment
            # they start with.
            if m == "always":
                os.environ["STOWAGE_SPIN_ALWAYS"] = "1"
            planes[m] = stowage.local(units=args.units, memory="1GiB", transport="shm")
            os.environ.pop("STOWAGE_SPIN_ALWAYS", None)
        for r in range(args.rounds):
            for n in points:
                # Modes alternate point by point (and their order each round).
                for m in modes if r % 2 == 0 else modes[::-1]:
                    if m == "floor":
                        where, pids = floor_server.path, [floor_server.proc.pid]
                    else:
                        where, pids = planes[m].directory, list(planes[m].unit_pids)
                    res = point(ctx, where, m, pids, n, args)
                    runs[(m, n)].append(res)
                    print(
                        f"round {r + 1} {m:8s} procs {n:3d}: {res['ops_per_s']:9,.0f} op/s"
                        f"  p50 {res['p50_us']:8.1f} us  p99 {res['p99_us']:9.1f} us"
                        f"  cpu/op client {res['client_cpu_per_op_us']:5.1f} us"
                        f" unit {res['unit_cpu_per_op_us']:5.1f} us  loadavg {loadavg_running()}",
                        flush=True,
                    )
    finally:
        for dp in planes.values():
            dp.close()
        if floor_server is not None:
            floor_server.close()
        for h in hogs:
            h.kill()
            h.wait()

    def med(m, n, k):
        v = [x[k] for x in runs[(m, n)]]
        return statistics.median(v), min(v), max(v)

    print(
        f"\n{args.units} units, shm, {args.value} B put+get, Python client processes;"
        f" median [min-max] of {args.rounds} round(s); {args.hogs} busy-loop process(es) beside"
    )
    print(
        "| waiting | processes | op/s | p50 µs | p99 µs | client CPU/op µs | unit CPU/op µs |"
    )
    print("|---|---|---|---|---|---|---|")
    for m in modes:
        for n in points:
            v, lo, hi = med(m, n, "ops_per_s")
            print(
                f"| {m} | {n} | {v:,.0f} [{lo:,.0f}–{hi:,.0f}] | {med(m, n, 'p50_us')[0]:.1f} |"
                f" {med(m, n, 'p99_us')[0]:.1f} | {med(m, n, 'client_cpu_per_op_us')[0]:.1f} |"
                f" {med(m, n, 'unit_cpu_per_op_us')[0]:.1f} |"
            )
    if args.floor and 64 in points:
        for m in modes:
            if m != "floor":
                ratio = med(m, 64, "ops_per_s")[0] / med("floor", 64, "ops_per_s")[0]
                print(f"{m}: rate(64) / floor's rate(64) = {ratio:.2f}")
    for m in modes:
        if 4 in points and 64 in points:
            ratio = med(m, 64, "ops_per_s")[0] / med(m, 4, "ops_per_s")[0]
            print(
                f"{m}: rate(64)/rate(4) = {ratio:.2f} (target >= 0.8);"
                f" p99(64) = {med(m, 64, 'p99_us')[0] / 1e3:.2f} ms (target <= 5)"
            )
        if 16 in points:
            print(f"{m}: p99(16) = {med(m, 16, 'p99_us')[0] / 1e3:.2f} ms (target <= 1)")
    if args.json:
        with open(args.json, "w") as f:
            by_name = {f"{m} {n}": v for (m, n), v in runs.items()}
            json.dump({"args": vars(args), "runs": by_name}, f)


if __name__ == "__main__":
    main()
