"""Run the selected workloads against one system and print the figures.

    python bench/run_system.py --system stowage|mooncake|ray|limits \
        --workloads sizes,latency,grpo-step,dapo-churn,disk [--quick] \
        --disk-dir DIR

bench/compare.py starts one of these per system (Mooncake's inside a
private network namespace) and reads its stdout: one JSON object per line,
`progress` events while it runs and `result` events with the figures.
Diagnostics go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import common  # noqa: E402
from common import FIELD_NAMES, WRITEBACK, MiB, emit, log, progress  # noqa: E402

# ---------------------------------------------------------------------------
# worker pools: the four client processes of the multi-process workloads


class ProcPool:
    """bench/worker.py subprocesses, one JSON command/answer per line."""

    def __init__(self, system: str, conn: dict, n: int, timeout: float):
        self.timeout = timeout
        self.procs = []
        for w in range(n):
            p = subprocess.Popen(
                [sys.executable, os.path.join(HERE, "worker.py")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr,
            )
            self.procs.append(p)
        self.call("init", [{"system": system, "conn": conn, "w": w} for w in range(n)])

    def call(self, op: str, args: list) -> list:
        """Send `op` to the first len(args) workers (args[i] to worker i)
        at once; wait, bounded, for each of their answers."""
        procs = self.procs[:len(args)]
        for p, a in zip(procs, args):
            p.stdin.write((json.dumps({"op": op, "args": a}) + "\n").encode())
            p.stdin.flush()
        sel = selectors.DefaultSelector()
        bufs = {}
        for i, p in enumerate(procs):
            sel.register(p.stdout, selectors.EVENT_READ, i)
            bufs[i] = b""
        deadline = time.monotonic() + self.timeout
        answers = {}
        while len(answers) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"workers gave no answer to {op!r} within {self.timeout:.0f}s")
            for key, _ in sel.select(left):
                i = key.data
                chunk = os.read(key.fileobj.fileno(), 1 << 20)
                if not chunk:
                    raise RuntimeError(f"worker {i} exited during {op!r}")
                bufs[i] += chunk
                if bufs[i].endswith(b"\n"):
                    answers[i] = json.loads(bufs[i])
                    sel.unregister(key.fileobj)
        sel.close()
        out = []
        for i in range(len(procs)):
            a = answers[i]
            if "error" in a:
                raise RuntimeError(f"worker {i} {op}: {a['error']}")
            out.append(a["ok"])
        return out

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write(b'{"op": "close"}\n')
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                common.stop_pid(p)


class RayPool:
    """The same workers as Ray actors."""

    def __init__(self, n: int, timeout: float, num_cpus: int = 1):
        import ray

        from worker import RayGrpoWorker

        self.ray = ray
        self.timeout = timeout
        cls = ray.remote(num_cpus=num_cpus)(RayGrpoWorker)
        self.actors = [cls.remote(w) for w in range(n)]

    def call(self, op: str, args: list) -> list:
        futs = [getattr(a, op).remote(**x) for a, x in zip(self.actors, args)]
        return self.ray.get(futs, timeout=self.timeout)

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []


# ---------------------------------------------------------------------------
# sizes and latency (one client: this process)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= MiB else f"{n >> 10} KiB"


def _arena(nbytes: int) -> np.ndarray:
    """A page-aligned buffer (Mooncake registers whole buffers; two small
    heap arrays may share a page and be refused)."""
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off:off + nbytes]


def _values(size: int, batch: int, seed: int, fill: bool = True):
    """`batch` values of `size` bytes as views into one aligned arena:
    (arena, [values])."""
    arena = _arena(size * batch)
    vals = [arena[i * size:(i + 1) * size] for i in range(batch)]
    for i, v in enumerate(vals):
        v.fill((seed * 31 + i * 7 + 1) & 0xFF if fill else 0)
    return arena, vals


def _pool(nbytes: int, fill: bool) -> np.ndarray:
    """A page-aligned, pre-faulted buffer of `nbytes` (a multiple of 8):
    a cheap pattern different at every 8 bytes, or zeros."""
    a = _arena(nbytes)
    if fill:
        w = a.view(np.uint64)
        w[:] = np.arange(w.size, dtype=np.uint64)
        w *= np.uint64(0x9E3779B97F4A7C15)
    else:
        a.fill(0)
    return a


def _slot(pool: np.ndarray, size: int, batch: int, k: int) -> list:
    """Slot k of a pool cut into batches of `batch` values of `size`
    bytes: successive iterations take successive slots, so that a pool far
    larger than the cache keeps every iteration's bytes cold."""
    n = size * batch
    slots = max(1, pool.nbytes // n)
    base = (k % slots) * n
    return [pool[base + j * size: base + (j + 1) * size] for j in range(batch)]


def sizes_blob(backend, label: str, quick: bool, frac0: float, frac1: float, grid=None, workload="sizes") -> list:
    """put then get of `batch` values of `size` bytes from this process,
    timed separately; clear (untimed) between iterations. Sources and
    destinations walk through pools far larger than the cache."""
    grid = grid or common.size_grid(quick)
    client = backend.client
    cells = [(s, b) for s in grid["sizes"] for b in grid["batches"]]
    rows = []
    if workload == "sizes":
        _warm_blob(client)
    src_pool = _pool(grid["pool"], True)
    out_pool = _pool(grid["pool"], False)
    client.register([src_pool, out_pool])
    try:
        for ci, (size, batch) in enumerate(cells):
            progress(workload, frac0 + (frac1 - frac0) * ci / len(cells), f"{label} {_size(size)} x{batch}")
            if size * batch > grid["max_batch_bytes"]:
                rows.append({"system": label, "size": size, "batch": batch, "skipped": f"batch of {size * batch >> 20} MiB exceeds {grid['max_batch_bytes'] >> 20} MiB"})
                continue
            iters = common.iters_for(grid, size, batch)
            keys = list(range(batch))
            tput = tget = 0.0
            stop_at = time.monotonic() + grid["max_seconds"]
            done = 0
            for i in range(iters + 1):  # the first (checked) is not timed
                if i > grid["min_iters"] and time.monotonic() > stop_at:
                    break
                src = _slot(src_pool, size, batch, i)
                outs = _slot(out_pool, size, batch, i)
                t = time.perf_counter()
                client.put_rows(workload, keys, {"v": src})
                t1 = time.perf_counter()
                client.get_into(workload, keys, ["v"], {"v": outs})
                t2 = time.perf_counter()
                if i == 0:
                    for a, o in zip(src, outs):
                        if not np.array_equal(a, o):
                            raise AssertionError(f"{label}: {size} B value read back wrong")
                else:
                    tput += t1 - t
                    tget += t2 - t1
                    done += 1
                client.clear(workload, keys, ["v"])
            nbytes = size * batch * done
            rows.append({"system": label, "size": size, "batch": batch, "iters": done,
                         "put_gbps": nbytes / tput / 1e9, "get_gbps": nbytes / tget / 1e9})
            log(f"{label} {workload} {size} x{batch}: put {rows[-1]['put_gbps']:.2f} get {rows[-1]['get_gbps']:.2f} GB/s")
    finally:
        client.unregister([src_pool, out_pool])
    return rows


# Every system first runs the same ops for this long, unmeasured: stowage's
# first few thousand small ops on this VM are ~10x slower than its steady
# state (adaptive polling settling), and Ray's and Mooncake's first ops
# also pay one-off costs.
LATENCY_WARMUP_S = 1.0


def _warm_blob(client) -> None:
    """Small puts and gets for LATENCY_WARMUP_S, unmeasured."""
    a_arena, vals = _values(64 * 1024, 16, 5)
    o_arena, outs = _values(64 * 1024, 16, 0, fill=False)
    client.register([a_arena, o_arena])
    keys = list(range(16))
    warm_until = time.monotonic() + LATENCY_WARMUP_S
    i = 0
    while time.monotonic() < warm_until:
        k = i % 16
        client.put_rows("warm", [k], {"v": [vals[k]]})
        client.get_into("warm", [k], ["v"], {"v": [outs[k]]})
        i += 1
    client.clear("warm", keys, ["v"])
    client.unregister([a_arena, o_arena])


LAT_POOL = 128 * MiB  # the latency workload's cold source / destination


def latency_blob(backend, label: str, quick: bool, stride: int = 1) -> dict:
    """Single 64 KiB put then get, keys 0..1023 in turn (stride 1: default
    placement, row r on unit r % units, as a user's rows are spread;
    stride = units: every op on one unit, the best case). Values come from
    a 128 MiB source and land in a 128 MiB destination, walked in turn."""
    size = 64 * 1024
    iters = common.latency_iters(quick)
    client = backend.client
    src_pool = _pool(LAT_POOL, True)
    out_pool = _pool(LAT_POOL, False)
    client.register([src_pool, out_pool])
    puts, gets = [], []
    warm_until = time.monotonic() + LATENCY_WARMUP_S
    i = 0
    nkeys = 1024
    try:
        while len(puts) < iters:
            row = [(i % nkeys) * stride]
            a = _slot(src_pool, size, 1, i)
            out = _slot(out_pool, size, 1, i)
            t = time.perf_counter_ns()
            client.put_rows("lat", row, {"v": a})
            t1 = time.perf_counter_ns()
            client.get_into("lat", row, ["v"], {"v": out})
            t2 = time.perf_counter_ns()
            if i == 0 and not np.array_equal(a[0], out[0]):
                raise AssertionError(f"{label}: latency value read back wrong")
            i += 1
            if i % nkeys == 0:
                client.clear("lat", [k * stride for k in range(nkeys)], ["v"])
            if i > 100 and time.monotonic() > warm_until:
                puts.append(t1 - t)
                gets.append(t2 - t1)
        if i % nkeys:
            client.clear("lat", [k * stride for k in range(i % nkeys)], ["v"])
    finally:
        client.unregister([src_pool, out_pool])
    return {"system": label, "size": size, "placement": "one unit" if stride > 1 else "default",
            "put": common.quantiles_us(puts), "get": common.quantiles_us(gets)}


# Ray: ray.put in an actor (the owner), ray.get + copy out here.

def _ray_putter():
    """An actor that owns what it puts: the writer of the single-client
    workloads (a get of an object from the process that put it would not
    cross processes)."""
    import ray

    @ray.remote(num_cpus=1)
    class Putter:
        def __init__(self):
            self.pools = {}

        def _pool(self, nbytes):
            if nbytes not in self.pools:
                self.pools = {nbytes: _pool(nbytes, True)}
            return self.pools[nbytes]

        def put(self, size, batch, pool, slot):
            """One ray.put of the batch (a list of arrays, as a Ray user
            moves a batch), timed around that call in this process."""
            vals = _slot(self._pool(pool), size, batch, slot)
            t = time.perf_counter_ns()
            ref = ray.put(vals)
            return time.perf_counter_ns() - t, [ref]

        def put_each(self, size, pool, first, n):
            """n single values, one ray.put each (the latency workload)."""
            p = self._pool(pool)
            dts, refs = [], []
            for k in range(first, first + n):
                v = _slot(p, size, 1, k)[0]
                t = time.perf_counter_ns()
                refs.append(ray.put(v))
                dts.append(time.perf_counter_ns() - t)
            return dts, refs

    return Putter.remote()


def sizes_ray(backend, quick: bool, frac0: float, frac1: float, grid=None, workload="sizes") -> list:
    """A batch is one ray.put (in the Putter actor) of a list of arrays
    and one ray.get here of that object (its arrays are read-only views of
    the object store), each array then copied into the destination."""
    import ray

    grid = grid or common.size_grid(quick)
    putter = _ray_putter()
    cells = [(s, b) for s in grid["sizes"] for b in grid["batches"]]
    rows = []
    if workload == "sizes":
        warm_until = time.monotonic() + LATENCY_WARMUP_S
        k = 0
        while time.monotonic() < warm_until:
            _, refs = ray.get(putter.put.remote(64 * 1024, 16, 64 * MiB, k), timeout=300)
            ray.get(refs[0], timeout=300)
            del refs
            k += 1
    pool = grid["pool"]
    out_pool = _pool(pool, False)
    for ci, (size, batch) in enumerate(cells):
        progress(workload, frac0 + (frac1 - frac0) * ci / len(cells), f"ray {_size(size)} x{batch}")
        if size * batch > grid["max_batch_bytes"]:
            rows.append({"system": "ray", "size": size, "batch": batch, "skipped": f"batch of {size * batch >> 20} MiB exceeds {grid['max_batch_bytes'] >> 20} MiB"})
            continue
        iters = common.iters_for(grid, size, batch)
        tput = tget = 0
        stop_at = time.monotonic() + grid["max_seconds"]
        done = 0
        for i in range(iters + 1):
            if i > grid["min_iters"] and time.monotonic() > stop_at:
                break
            dt_put, refs = ray.get(putter.put.remote(size, batch, pool, i), timeout=300)
            outs = _slot(out_pool, size, batch, i)
            t = time.perf_counter_ns()
            objs = ray.get(refs[0], timeout=300)
            for o, out in zip(objs, outs):
                np.copyto(out, o)
            dt = time.perf_counter_ns() - t
            del objs, refs
            if i == 0:
                want = _pool(size * batch, True)  # slot 0: the pattern's first bytes
                for j, o in enumerate(outs):
                    if not np.array_equal(o, want[j * size:(j + 1) * size]):
                        raise AssertionError(f"ray: {size} B value read back wrong")
                del want
            else:
                tput += dt_put
                tget += dt
                done += 1
        nbytes = size * batch * done
        rows.append({"system": "ray", "size": size, "batch": batch, "iters": done,
                     "put_gbps": nbytes / tput, "get_gbps": nbytes / tget})
        log(f"ray {workload} {size} x{batch}: put {rows[-1]['put_gbps']:.2f} get {rows[-1]['get_gbps']:.2f} GB/s")
    ray.kill(putter)
    return rows


def latency_ray(backend, quick: bool) -> dict:
    """ray.put of one 64 KiB value in the Putter actor (timed there), then
    ray.get of it here and a copy out."""
    import ray

    size = 64 * 1024
    iters = common.latency_iters(quick)
    putter = _ray_putter()
    out_pool = _pool(LAT_POOL, False)
    puts, gets = [], []
    chunk = 250
    done = -chunk  # warm-up chunks until LATENCY_WARMUP_S have passed
    warm_until = time.monotonic() + LATENCY_WARMUP_S
    k = 0
    while done < iters:
        dts, refs = ray.get(putter.put_each.remote(size, LAT_POOL, k, chunk), timeout=300)
        for r in refs:
            out = _slot(out_pool, size, 1, k)[0]
            k += 1
            t = time.perf_counter_ns()
            np.copyto(out, ray.get(r, timeout=60))
            gets.append(time.perf_counter_ns() - t)
        puts.extend(dts)
        del refs
        if done < 0:
            puts, gets = [], []
            if time.monotonic() < warm_until:
                continue
        done += chunk
    ray.kill(putter)
    return {"system": "ray", "size": size, "placement": "one object store",
            "put": common.quantiles_us(puts), "get": common.quantiles_us(gets)}


# ---------------------------------------------------------------------------
# the multi-process workloads


def unit_memory(nbytes: float, floor: int = 64 * MiB) -> int:
    return max(floor, int(-(-nbytes // MiB)) * MiB)


def _workers(system, backend, timeout, n=None):
    n = n or common.WORKERS
    if system == "ray":
        return RayPool(n, timeout, num_cpus=1 if n <= 4 else 0)
    return ProcPool(system, backend.conn(), n, timeout)



def _driver_clear(system, backend, catalog, part, rows, partition=True):
    """The driver clears rows (stowage, Mooncake) or drops its references
    (Ray: objects go when no reference is left)."""
    t = time.perf_counter()
    if system == "ray":
        catalog.clear()  # the last references: Ray frees the objects
    elif partition:
        backend.client.clear_partition(part, rows, FIELD_NAMES)
    else:
        backend.client.clear(part, rows, FIELD_NAMES)
    return time.perf_counter() - t


def _phase(pool, op, args, system, catalog=None):
    """One phase on every worker at once: wall time from the first
    command to the last answer, and the slowest worker's own time."""
    if system == "ray" and op == "read":
        for a in args:
            a["catalog"] = catalog
    t = time.perf_counter()
    res = pool.call(op, args)
    wall = time.perf_counter() - t
    if system == "ray" and op == "put":
        for r in res:
            catalog.extend(r["shards"])
    return {"wall_s": wall, "max_worker_s": max(r["dt"] for r in res), "bytes": sum(r.get("bytes", 0) for r in res)}


def grpo_steps(system, backend, rows, reps, label, disk=None, frac=(0.0, 1.0), workload="grpo-step",
               transport="shm", tokens=None):
    """put (rollout) -> read all rows (logprob workers) -> write back two
    columns -> read all rows (trainer ranks) -> clear; 4 client processes,
    4 units. One warm-up step (checked against regenerated values), then
    `reps` timed steps. `transport`: stowage's (shm or tcp); Mooncake's
    is tcp, Ray's the node's shared-memory object store."""
    W = common.WORKERS
    tokens = list(tokens or (common.MIN_TOKENS, common.MAX_TOKENS))
    lens = common.lengths(rows, 0, *tokens)
    nbytes = common.step_bytes(lens)
    if disk:
        mem = unit_memory(nbytes / 3 / common.UNITS, floor=0)
    else:
        mem = unit_memory(nbytes * 2.5 / common.UNITS)
    progress(workload, frac[0], f"{label}: starting {system}")
    backend.start(common.UNITS, mem, transport, disk=disk)
    pool = _workers(system, backend, timeout=600)
    try:
        sets = []
        for w in range(W):
            r1 = common.shard_rows(rows, W, "reader1", w)
            sets.append({"rows_total": rows, "seed": 0, "tokens": tokens, "sets": {
                "put": {"rows": common.shard_rows(rows, W, "writer", w), "fields": FIELD_NAMES, "version": 0},
                "read1": {"rows": r1, "fields": FIELD_NAMES, "version": None},
                "wb": {"rows": r1, "fields": WRITEBACK, "version": 1, "side": True},
                "read2": {"rows": common.shard_rows(rows, W, "reader2", w), "fields": FIELD_NAMES, "version": None,
                          "side_fields": WRITEBACK},
            }})
        pool.call("prepare", sets)
        steps = []
        for rep in range(reps + 1):
            progress(workload, frac[0] + (frac[1] - frac[0]) * (rep + 1) / (reps + 2), f"{label} step {rep}")
            part = f"{label}-{rep}"
            catalog = []
            verify = rep == 0
            ph = {}
            ph["put"] = _phase(pool, "put", [{"part": part, "set": "put"}] * W, system, catalog)
            ph["read1"] = _phase(pool, "read", [{"part": part, "set": "read1", "verify": {} if verify else None}] * W, system, catalog)
            if system == "ray":
                # the write-back replaces the two columns' objects
                catalog[:] = [s for s in catalog if s["fields"][0] not in WRITEBACK]
            ph["writeback"] = _phase(pool, "put", [{"part": part, "set": "wb"}] * W, system, catalog)
            ph["read2"] = _phase(pool, "read", [{"part": part, "set": "read2", "verify": {f: 1 for f in WRITEBACK} if verify else None}] * W, system, catalog)
            used = backend.used_bytes()
            rss = common.sum_rss(backend.memory_pids())
            unit_stats = backend.stats() if hasattr(backend, "stats") else None
            ph["clear"] = {"wall_s": _driver_clear(system, backend, catalog, part, list(range(rows)))}
            total = sum(p["wall_s"] for p in ph.values())
            steps.append({"rep": rep, "warmup": rep == 0, "phases": ph, "step_s": total,
                          "used_bytes_before_clear": used, "rss_before_clear": rss,
                          "unit_stats_before_clear": unit_stats})
            log(f"{system} {label} step {rep}: {total * 1e3:.1f} ms " + " ".join(f"{k}={v['wall_s'] * 1e3:.1f}" for k, v in ph.items()))
        timed = [s for s in steps if not s["warmup"]]
        med = sorted(timed, key=lambda s: s["step_s"])[len(timed) // 2]
        return {"system": system, "variant": label, "rows": rows, "step_bytes": nbytes, "tokens": tokens,
                "transport": transport, "layout": getattr(backend, "layout", None),
                "unit_memory": mem, "units": common.UNITS, "workers": W,
                "disk": bool(disk), "step_s": med["step_s"],
                "phases_s": {k: v["wall_s"] for k, v in med["phases"].items()},
                "steps": steps}
    finally:
        pool.close()
        backend.stop()


def dapo_churn(system, backend, quick, frac=(0.0, 1.0)):
    """Generate 3x the rows kept, clear the filtered two thirds at once,
    read the kept third, clear it; 10 steps; the memory-owning processes'
    resident memory after every step."""
    shape = common.churn_shape(quick)
    W = common.WORKERS
    kept_n = shape["kept"]
    rows = kept_n * shape["factor"]
    lens = common.lengths(rows, 1)
    nbytes = common.step_bytes(lens)
    mem = unit_memory(nbytes * 1.5 / common.UNITS)
    rng = np.random.default_rng(7)
    kept = sorted(rng.choice(rows, size=kept_n, replace=False).tolist())
    filtered = sorted(set(range(rows)) - set(kept))
    progress("dapo-churn", frac[0], f"starting {system}")
    backend.start(common.UNITS, mem, "shm" if system != "mooncake" else "tcp")
    pool = _workers(system, backend, timeout=600)
    try:
        sets = [{"rows_total": rows, "seed": 1, "sets": {
            "put": {"rows": common.shard_rows(rows, W, "writer", w), "fields": FIELD_NAMES, "version": 0},
            "read": {"rows": kept[w::W], "fields": FIELD_NAMES, "version": None},
        }} for w in range(W)]
        pool.call("prepare", sets)
        steps = []
        rss0 = common.sum_rss(backend.memory_pids())
        for s in range(shape["steps"]):
            progress("dapo-churn", frac[0] + (frac[1] - frac[0]) * (s + 1) / (shape["steps"] + 1), f"{system} step {s}")
            part = f"churn-{s}"
            catalog = []
            gran = {"granularity": "row"} if system == "ray" else {}
            ph = {"put": _phase(pool, "put", [dict({"part": part, "set": "put"}, **gran)] * W, system, catalog)}
            rss_peak = common.sum_rss(backend.memory_pids())
            t = time.perf_counter()
            if system == "ray":
                fset = set(filtered)
                catalog[:] = [sh for sh in catalog if sh["rows"][0] not in fset]
            else:
                backend.client.clear(part, filtered, FIELD_NAMES)
            ph["clear_filtered"] = {"wall_s": time.perf_counter() - t}
            ph["read_kept"] = _phase(pool, "read", [{"part": part, "set": "read", "verify": {} if s == 0 else None}] * W, system, catalog)
            ph["clear_kept"] = {"wall_s": _driver_clear(system, backend, catalog, part, kept, partition=True)}
            rss = common.sum_rss(backend.memory_pids())
            steps.append({"step": s, "step_s": sum(p["wall_s"] for p in ph.values()),
                          "phases_s": {k: v["wall_s"] for k, v in ph.items()},
                          "rss_after_put": rss_peak["VmRSS"], "rss_after_step": rss["VmRSS"],
                          "rss_shmem_after_step": rss.get("RssShmem", 0),
                          "shm_alloc_after_put": rss_peak["shm_alloc"], "shm_alloc_after_step": rss["shm_alloc"],
                          "used_after_step": backend.used_bytes()})
            log(f"{system} churn step {s}: {steps[-1]['step_s'] * 1e3:.1f} ms rss {rss['VmRSS'] >> 20} MiB used {steps[-1]['used_after_step']}")
        r = [st["rss_after_step"] for st in steps]
        base = r[1] if len(r) > 1 else r[0]
        sh = [st["shm_alloc_after_step"] for st in steps]
        shb = sh[1] if len(sh) > 1 else sh[0]
        return {"shm_growth_after_step2": (sh[-1] - shb) / shb if shb else None,
                "shm_first_mib": sh[0] / MiB, "shm_last_mib": sh[-1] / MiB,"system": system, "rows_generated": rows, "rows_kept": kept_n, "step_bytes": nbytes,
                "unit_memory": mem, "units": common.UNITS, "rss_before": rss0["VmRSS"], "steps": steps,
                "rss_growth_after_step2": (r[-1] - base) / base if base else None,
                "rss_first_mib": r[0] / MiB, "rss_last_mib": r[-1] / MiB,
                "step_s_median": float(np.median([st["step_s"] for st in steps]))}
    finally:
        pool.close()
        backend.stop()


# ---------------------------------------------------------------------------
# limits


def _limit_row(limits, tcp, stream, size, batch, iters, pool):
    nt = limits.stowage_copy_threads(size)
    m1 = limits.memcpy_gbps(size, batch, iters, 1, pool)
    mn = limits.memcpy_gbps(size, batch, iters, nt, pool) if nt > 1 else m1
    tp, tg = tcp.gbps(size, batch, iters)
    sp, sg = stream.stream_gbps(size, batch, iters)
    log(f"limits {size} x{batch}: memcpy 1t {m1:.2f} {nt}t {mn:.2f}; py socket {tp:.2f}/{tg:.2f}; stream {sp:.2f}/{sg:.2f}")
    return {"size": size, "batch": batch, "iters": iters, "memcpy_1t_gbps": m1,
            "memcpy_nt_gbps": mn, "memcpy_threads": nt,
            "pysock_put_gbps": tp, "pysock_get_gbps": tg,
            "stream_put_gbps": sp, "stream_get_gbps": sg}


def run_limits(workloads, quick, disk_dir):
    """memcpy (libc, cold buffers, 1 thread and stowage's thread count),
    the Python socket request/reply pair, the tuned TCP stream, disk."""
    import limits

    out = {}
    if "sizes" in workloads or "big-batch" in workloads:
        tcp = limits.RawTcp()
        stream = limits.RawTcp(tuned=True)
        try:
            if "sizes" in workloads:
                grid = common.size_grid(quick)
                cells = [(s, b) for s in grid["sizes"] for b in grid["batches"]]
                rows = []
                for ci, (size, batch) in enumerate(cells):
                    progress("sizes", ci / len(cells), f"limits {_size(size)} x{batch}")
                    if size * batch > grid["max_batch_bytes"]:
                        continue
                    rows.append(_limit_row(limits, tcp, stream, size, batch, common.iters_for(grid, size, batch), grid["pool"]))
                out["sizes"] = rows
            if "big-batch" in workloads:
                bb = common.big_batch(quick)
                progress("big-batch", 0.0, "limits")
                size, batch, iters = bb["size"], bb["batch"], bb["iters"]
                nt = limits.stowage_copy_threads(size)
                m1 = limits.memcpy_gbps(size, batch, iters, 1, 0)
                mn = limits.memcpy_gbps(size, batch, iters, nt, 0) if nt > 1 else m1
                # the same bytes as one stream, from 8 values sent over and over
                sp, sg = stream.stream_gbps(size, 8, iters * batch // 8)
                out["big-batch"] = {"size": size, "batch": batch, "iters": iters, "memcpy_1t_gbps": m1,
                                    "memcpy_nt_gbps": mn, "memcpy_threads": nt,
                                    "stream_put_gbps": sp, "stream_get_gbps": sg}
                log(f"limits big-batch: memcpy {m1:.2f}/{mn:.2f} stream {sp:.2f}/{sg:.2f}")
        finally:
            tcp.close()
            stream.close()
    if "latency" in workloads:
        progress("latency", 0.0, "Python socket 64 KiB")
        tcp = limits.RawTcp()
        try:
            iters = common.latency_iters(quick)
            puts, gets = tcp.latency_ns(64 * 1024, iters + 100)
        finally:
            tcp.close()
        cp = limits.memcpy_latency_ns(64 * 1024, iters)
        out["latency"] = {"tcp_put": common.quantiles_us(puts[100:]), "tcp_get": common.quantiles_us(gets[100:]),
                          "memcpy": common.quantiles_us(cp)}
    if "disk" in workloads:
        progress("disk", 0.0, "sequential write/read")
        total = common.step_bytes(common.lengths(common.disk_rows(quick), 0))
        w, r = limits.disk_gbps(disk_dir, total)
        out["disk"] = {"dir": disk_dir, "bytes": total, "write_fsync_gbps": w, "read_gbps": r}
    return out


# ---------------------------------------------------------------------------


def stowage_cli(quick: bool, binary: str = None, extra=()) -> dict:
    """`stowage bench` (the Rust client, no Python in the loop), run
    through the Python package's command line (or `binary`): its printed
    figures."""
    cmd = ([binary] if binary else [sys.executable, "-m", "stowage"]) + ["bench"] + (["--quick"] if quick else []) + list(extra)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {p.stderr.strip()[-500:]}"}
    rows, lat = [], {}
    for line in p.stdout.splitlines():
        cols = [c.strip() for c in line.split("|")]
        if len(cols) == 6 and cols[0] and cols[0][-1] in "KMG" and cols[0][:-1].replace(".", "").isdigit():
            num, unit = float(cols[0][:-1]), cols[0][-1]
            size = int(num * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit])
            m = float(cols[1])
            sp, sg = map(float, cols[2].split())
            rp, rg = map(float, cols[3].split())
            tp, tg = map(float, cols[4].split())
            rows.append({"size": size, "memcpy_gbps": m, "shm_put_gbps": sp, "shm_get_gbps": sg,
                         "raw_tcp_put_gbps": rp, "raw_tcp_get_gbps": rg, "tcp_put_gbps": tp, "tcp_get_gbps": tg})
        if line.startswith("64 KiB single op on"):
            tr = line.split(" on ")[1].split(":")[0]
            parts = line.split(":", 1)[1].replace("µs", "").replace(";", "").split()
            vals = [float(x) for x in parts if x.replace(".", "").isdigit()]
            if len(vals) == 4:
                lat[tr] = {"put_p50_us": vals[0], "put_p99_us": vals[1], "get_p50_us": vals[2], "get_p99_us": vals[3]}
    return {"sizes": rows, "latency": lat, "stdout": p.stdout}


def run_system(system, workloads, quick, disk_dir, round_no=0):
    import extra
    from systems import BACKENDS

    res = {"system": system}
    if system == "limits":
        res.update(run_limits(workloads, quick, disk_dir))
        return res
    if system == "stowage":
        try:
            import stowage  # noqa: F401
        except ImportError as e:
            return stowage_cli_only(workloads, quick, disk_dir, f"{type(e).__name__}: {e}")
    backend = BACKENDS[system]()
    res["version"] = backend.version()
    # (label, transport) per system: stowage over shm (same host) and tcp;
    # Mooncake over tcp (its transfer engine, the only path that crosses
    # processes in this client configuration); Ray's node-local
    # shared-memory object store.
    variants = {"stowage": [("stowage-shm", "shm"), ("stowage-tcp", "tcp")],
                "mooncake": [("mooncake", "tcp")], "ray": [("ray", "shm")]}[system]

    def guarded(name, fn):
        try:
            out = fn()
            emit("partial", name=name, result=out)  # kept by compare.py if this runner overruns later
            return out
        except Exception as e:  # noqa: BLE001 - one workload's failure is reported, the rest run
            log(traceback.format_exc())
            try:
                backend.stop()
            except Exception:  # noqa: BLE001
                pass
            return {"error": f"{type(e).__name__}: {e}"}

    if "sizes" in workloads or "latency" in workloads:
        grid = common.size_grid(quick)
        mem = unit_memory(grid["max_batch_bytes"] * 1.25 / common.SIZES_UNITS + 64 * MiB)
        for ti, (label, tr) in enumerate(variants):

            def single():
                backend.start(common.SIZES_UNITS, mem, tr)
                try:
                    out = {}
                    if "sizes" in workloads:
                        f0, f1 = ti / len(variants), (ti + 1) / len(variants)
                        out["sizes"] = (sizes_ray(backend, quick, f0, f1) if system == "ray"
                                        else sizes_blob(backend, label, quick, f0, f1))
                    if "latency" in workloads:
                        progress("latency", ti / len(variants), label)
                        if system == "ray":
                            out["latency"] = latency_ray(backend, quick)
                        else:
                            # default placement (rows spread over the units) is the figure;
                            # stowage's every-op-on-one-unit run is its best case
                            out["latency"] = latency_blob(backend, label, quick, stride=1)
                            if system == "stowage":
                                out["latency-one-unit"] = latency_blob(backend, label + "-one-unit", quick,
                                                                       stride=common.SIZES_UNITS)
                    return out
                finally:
                    backend.stop()

            r = guarded(f"{label} sizes/latency", single)
            if "error" in r:
                for w in ("sizes", "latency"):
                    if w in workloads:
                        res.setdefault(w, {})[label] = r
            else:
                for w, v in r.items():
                    if w == "latency-one-unit":
                        res.setdefault("latency", {})[label + "-one-unit"] = v
                    else:
                        res.setdefault(w, {})[label] = v
        if system == "stowage" and "sizes" in workloads:
            progress("sizes", 1.0, "stowage bench (Rust client)")
            res["cli_bench"] = guarded("stowage bench", lambda: stowage_cli(True))  # --quick: one round's share
    if "grpo-step" in workloads:
        res["grpo-step"] = []
        runs = list(variants)
        if system == "mooncake":
            runs += [("mooncake-row", "tcp"), ("mooncake-shm", "shm")]
        steps = common.grpo_variants(quick)
        todo = [(lb, tr, v) for v in steps for lb, tr in runs]
        for vi, (lb, tr, (name, rows, reps, tokens)) in enumerate(todo):
            fr = (vi / len(todo), (vi + 1) / len(todo))
            be = BACKENDS[system](layout=lb.split("-")[1]) if lb.startswith("mooncake-") else backend
            out = guarded(f"{lb} {name}", lambda: grpo_steps(system, be, rows, reps, name, frac=fr,
                                                             transport=tr, tokens=tokens))
            out.setdefault("variant", name)
            out["label"] = lb
            res["grpo-step"].append(out)
    if "dapo-churn" in workloads:
        res["dapo-churn"] = guarded("dapo-churn", lambda: dapo_churn(system, backend, quick))
    if "disk" in workloads:
        rows = common.disk_rows(quick)
        d = os.path.join(disk_dir, system)
        os.makedirs(d, exist_ok=True)
        total = common.step_bytes(common.lengths(rows, 0))
        disk = {"dir": d, "capacity": 2 * total}
        res["disk"] = guarded("disk", lambda: grpo_steps(system, backend, rows, 1, f"disk-{rows}", disk=disk,
                                                         workload="disk", transport=variants[0][1]))
        if system == "mooncake" and "error" in res["disk"]:
            res["disk"]["error"] = MOONCAKE_DISK_REASON + res["disk"]["error"]
    if "scaling" in workloads:
        res["scaling"] = {}
        for vi, (lb, tr) in enumerate(variants):
            fr = (vi / len(variants), (vi + 1) / len(variants))
            res["scaling"][lb] = guarded(f"{lb} scaling", lambda: extra.scaling(system, backend, quick, tr, lb, fr))
    if "big-batch" in workloads:
        res["big-batch"] = {}
        for lb, tr in variants:
            progress("big-batch", 0.0, lb)
            res["big-batch"][lb] = guarded(f"{lb} big-batch", lambda: extra.big_batch(system, backend, quick, tr, lb))
    if "zero-copy" in workloads:
        progress("zero-copy", 0.0, system)
        if system == "mooncake":
            res["zero-copy"] = {"not_measured": "not measured: Mooncake Store 0.3.13.post1 has no read that maps a value "
                                "held by another process without copying it (get_buffer / batch_get_buffer copy it into "
                                "the client's own buffer)"}
        else:
            res["zero-copy"] = guarded("zero-copy", lambda: extra.zero_copy(system, backend, quick))
    if "partial" in workloads:
        res["partial"] = []
        for lb, tr in variants:
            progress("partial", 0.0, lb)
            r = guarded(f"{lb} partial", lambda: extra.partial(system, backend, quick, tr, lb))
            res["partial"] += r if isinstance(r, list) else [dict(r, system=lb)]
    if "kill" in workloads:
        progress("kill", 0.0, system)
        if round_no == 0:
            lb, tr = variants[0]
            res["kill"] = guarded("kill", lambda: extra.kill_unit(system, backend, quick, tr, lb))
    return res


def stowage_cli_only(workloads, quick, disk_dir, why) -> dict:
    """Without the Python package: what the `stowage` binary's own
    benchmark measures (source "cli"); everything else is not measured."""
    binary = os.path.join(os.path.dirname(HERE), "target", "release", "stowage")
    res = {"system": "stowage", "source": "cli"}
    if not os.path.exists(binary):
        res["error"] = f"not measured: the Python package is missing ({why}) and so is {binary} (cargo build --release)"
        return res
    res["error"] = f"the Python package is missing ({why}): only `stowage bench` figures (Rust client, source cli) were measured"
    if "sizes" in workloads or "latency" in workloads:
        progress("sizes", 0.0, "stowage bench (CLI)")
        res["cli_bench"] = stowage_cli(quick, binary)
    if "disk" in workloads:
        progress("disk", 0.0, "stowage bench --disk-only (CLI)")
        d = os.path.join(disk_dir, "stowage-cli")
        os.makedirs(d, exist_ok=True)
        res["cli_disk"] = stowage_cli(quick, binary, ["--disk", d, "--disk-only"])
    return res


MOONCAKE_DISK_REASON = (
    "not measured: Mooncake's SSD offload (master --enable_offload=true; each segment owner with "
    "enable_ssd_offload and ssd_offload_path in the disk tier's directory) did not carry the part of the step "
    "that memory could not hold; the step failed with: "
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", required=True, choices=["stowage", "mooncake", "ray", "limits"])  # noqa: E501
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--disk-dir", required=True)
    ap.add_argument("--round", type=int, default=0, help="which interleaved round this is (the kill workload runs in round 0 only)")
    a = ap.parse_args()
    # compare.py stops a runner that overruns with SIGTERM: unwind, so that
    # every backend stops the processes it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workloads = a.workloads.split(",")
    try:
        res = run_system(a.system, workloads, a.quick, a.disk_dir, a.round)
    except Exception as e:  # noqa: BLE001 - reported as the system's error
        log(traceback.format_exc())
        res = {"system": a.system, "error": f"{type(e).__name__}: {e}"}
    emit("result", result=res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
