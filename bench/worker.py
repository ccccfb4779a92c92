"""A client process of the multi-process workloads (grpo-step, dapo-churn,
disk): a rollout worker when it puts, a logprob worker or trainer rank when
it reads, the driver's write-back when it writes two columns again.

Run as a subprocess (stowage, Mooncake): one JSON command per stdin line,
one JSON answer per stdout line. For Ray the same class runs as an actor
(RayGrpoWorker), whose values are Ray objects passed through the runner.

Every value lives in one preallocated arena per role (registered once with
Mooncake, outside the timed sections); reads land in preallocated arrays,
so every system copies into memory the reader owns.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import common  # noqa: E402
from common import FIELDS, FIELD_NAMES, WRITEBACK  # noqa: E402


def _dtype(system: str, dt: str):
    if dt == "bfloat16":
        return common.bf16_dtype() if system == "stowage" else np.dtype("uint16")
    return np.dtype(dt)


class Arena:
    """Values of `fields` for `rows`, as views into one 64-byte aligned
    buffer: vals[field][i] is row rows[i]'s value."""

    def __init__(self, system, rows, lens, fields, fill_version=None, alloc=None):
        specs = [(f, _dtype(system, dt), dt) for f, dt, _ in FIELDS if f in fields]
        total = 0
        layout = []
        for f, npdt, _ in specs:
            for r in rows:
                n = int(lens[r]) * np.dtype(npdt).itemsize
                layout.append((f, r, total, n))
                total += (n + 63) & ~63
        if alloc is not None:  # memory a client must move values through (Mooncake's dummy client)
            self.buf = alloc(total + 64)
            self.buf.fill(0)
        else:
            self.buf = np.zeros(total + 64, dtype=np.uint8)
        base = (-self.buf.ctypes.data) % 64
        self.vals = {f: [] for f, _, _ in specs}
        dtypes = {f: npdt for f, npdt, _ in specs}
        fidx = {f: i for i, f in enumerate(FIELD_NAMES)}
        srcdt = {f: dt for f, _, dt in specs}
        for f, r, off, n in layout:
            v = self.buf[base + off: base + off + n].view(dtypes[f])
            if fill_version is not None:
                src = common.value(r, fidx[f], int(lens[r]), srcdt[f], fill_version)
                v[...] = src.view(v.dtype)
            self.vals[f].append(v)
        self.nbytes = sum(n for _, _, _, n in layout)


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned buffer (Mooncake registers whole pages)."""
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off:off + nbytes]


class GrpoWorker:
    def __init__(self, system: str, conn: dict, w: int):
        self.system = system
        self.w = w
        self.client = None
        if system != "ray":
            from systems import CONNECT

            self.client = CONNECT[system](conn)
        self.sets = {}

    # -- commands --------------------------------------------------------

    def prepare(self, rows_total: int, seed: int, sets: dict, tokens=None) -> dict:
        """sets: name -> {"rows": [...], "fields": [...], "version": int or
        null (null: an empty arena to read into), "side": a write-back
        (bool), "side_fields": fields a read takes from the write-back};
        tokens: [min, max] tokens per row."""
        t = time.perf_counter()
        self.sets = {}
        lens = common.lengths(rows_total, seed, *(tokens or (common.MIN_TOKENS, common.MAX_TOKENS)))
        self.lens = lens
        for name, spec in sets.items():
            a = Arena(self.system, spec["rows"], lens, spec["fields"], spec.get("version"),
                      alloc=getattr(self.client, "alloc", None))
            a.rows = spec["rows"]
            a.fields = spec["fields"]
            a.side = bool(spec.get("side"))
            a.side_fields = list(spec.get("side_fields") or ())
            self.sets[name] = a
            if self.client is not None:
                self.client.register([a.buf])
        return {"dt": time.perf_counter() - t}

    def put(self, part: str, set: str) -> dict:
        a = self.sets[set]
        t = time.perf_counter()
        self.client.put_rows(part, a.rows, a.vals, side=a.side)
        return {"dt": time.perf_counter() - t, "bytes": a.nbytes}

    def read(self, part: str, set: str, verify: dict = None) -> dict:
        a = self.sets[set]
        t = time.perf_counter()
        self.client.get_into(part, a.rows, a.fields, a.vals, side=a.side_fields)
        dt = time.perf_counter() - t
        if verify is not None:
            self.verify(a, verify)
        return {"dt": dt, "bytes": a.nbytes}

    def verify(self, a: Arena, versions: dict) -> None:
        fidx = {f: i for i, f in enumerate(FIELD_NAMES)}
        srcdt = {f: dt for f, dt, _ in FIELDS}
        for f in a.fields:
            for r, v in zip(a.rows, a.vals[f]):
                want = common.value(r, fidx[f], int(self.lens[r]), srcdt[f], versions.get(f, 0))
                if not np.array_equal(v.view(np.uint8), want.view(np.uint8)):
                    raise AssertionError(f"worker {self.w}: row {r} field {f} read back wrong")

    def clear(self, part: str, rows: list, fields: list = FIELD_NAMES) -> dict:
        t = time.perf_counter()
        n = self.client.clear(part, rows, fields)
        return {"dt": time.perf_counter() - t, "n": n}

    def clear_partition(self, part: str, rows: list, fields: list = FIELD_NAMES) -> dict:
        t = time.perf_counter()
        n = self.client.clear_partition(part, rows, fields)
        return {"dt": time.perf_counter() - t, "n": n}

    # -- the scaling workload: 64 KiB values, one op per call ------------

    def small_prepare(self, n: int, size: int, pool: int = 32 << 20) -> dict:
        """A source and a destination buffer of `pool` bytes each (cold:
        values are taken from them in turn), registered where that
        matters."""
        if self.client is not None and getattr(self, "small_src", None) is not None:
            self.client.unregister([self.small_src, self.small_dst])  # before they are freed
        self.small = {"n": n, "size": size, "slots": max(2, pool // size)}
        rng = np.random.default_rng(self.w + 1)
        nbytes = self.small["slots"] * size
        self.small_src = _aligned(nbytes)
        self.small_src[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        self.small_dst = _aligned(nbytes)
        self.small_dst.fill(0)
        if self.client is not None:
            self.client.register([self.small_src, self.small_dst])
        return {}

    def _slot(self, buf, i):
        size, slots = self.small["size"], self.small["slots"]
        o = (i % slots) * size
        return buf[o:o + size]

    def small_put(self, part: str, base: int) -> dict:
        n = self.small["n"]
        lat = np.empty(n)
        t0 = time.perf_counter()
        for i in range(n):
            t = time.perf_counter()
            self.client.put_rows(part, [base + i], {"v": [self._slot(self.small_src, i)]})
            lat[i] = time.perf_counter() - t
        t1 = time.perf_counter()
        return {"dt": t1 - t0, "t0": t0, "t1": t1, "lat_us": (lat * 1e6).tolist()}

    def small_get(self, part: str, base: int, refs=None) -> dict:
        n = self.small["n"]
        lat = np.empty(n)
        t0 = time.perf_counter()
        for i in range(n):
            t = time.perf_counter()
            self.client.get_into(part, [base + i], ["v"], {"v": [self._slot(self.small_dst, i)]})
            lat[i] = time.perf_counter() - t
        t1 = time.perf_counter()
        return {"dt": t1 - t0, "t0": t0, "t1": t1, "lat_us": (lat * 1e6).tolist()}

    def small_clear(self, part: str, base: int) -> dict:
        self.client.clear(part, [base + i for i in range(self.small["n"])], ["v"])
        return {}

    def close(self) -> dict:
        if self.client is not None:
            self.client.close()
            self.client = None
        return {}


class RayGrpoWorker(GrpoWorker):
    """The same phases on Ray's object store: a put is ray.put in this
    actor (the values' owner), a read is ray.get + a copy out into this
    actor's arrays, a clear is dropping every reference. Objects are one
    per (writer, field) ("shard", Ray's cheapest layout for bulk data) or
    one per row ("row", so that a subset of rows can be freed)."""

    def __init__(self, w: int):
        super().__init__("ray", {}, w)

    def small_put(self, part: str, base: int) -> dict:
        """ray.put of each value in turn; the refs go back to the driver,
        which hands them to the reading actor."""
        import ray

        n = self.small["n"]
        lat = np.empty(n)
        refs = []
        t0 = time.perf_counter()
        for i in range(n):
            t = time.perf_counter()
            refs.append(ray.put(self._slot(self.small_src, i)))
            lat[i] = time.perf_counter() - t
        t1 = time.perf_counter()
        self.small_refs = refs
        return {"dt": t1 - t0, "t0": t0, "t1": t1, "lat_us": (lat * 1e6).tolist(), "refs": refs}

    def small_get(self, part: str, base: int, refs=None) -> dict:
        """ray.get of each value in turn (another actor's), copied out."""
        import ray

        n = self.small["n"]
        lat = np.empty(n)
        t0 = time.perf_counter()
        for i in range(n):
            t = time.perf_counter()
            np.copyto(self._slot(self.small_dst, i), ray.get(refs[i], timeout=120))
            lat[i] = time.perf_counter() - t
        t1 = time.perf_counter()
        return {"dt": t1 - t0, "t0": t0, "t1": t1, "lat_us": (lat * 1e6).tolist()}

    def small_clear(self, part: str, base: int) -> dict:
        self.small_refs = []
        return {}

    def put(self, part: str, set: str, granularity: str = "shard") -> dict:
        import ray

        a = self.sets[set]
        t = time.perf_counter()
        shards = []
        if granularity == "shard":
            for f in a.fields:
                shards.append({"ref": ray.put({f: a.vals[f]}), "rows": a.rows, "fields": [f]})
        else:
            for i, r in enumerate(a.rows):
                obj = {f: [a.vals[f][i]] for f in a.fields}
                shards.append({"ref": ray.put(obj), "rows": [r], "fields": a.fields})
        dt = time.perf_counter() - t
        return {"dt": dt, "bytes": a.nbytes, "shards": shards}

    def read(self, part: str, set: str, catalog: list, verify: dict = None) -> dict:
        import ray

        a = self.sets[set]
        # Where each wanted (row, field) is (bookkeeping, untimed).
        where = {}
        for si, sh in enumerate(catalog):
            for pos, r in enumerate(sh["rows"]):
                for f in sh["fields"]:
                    where[(r, f)] = (si, pos)
        need = sorted({where[(r, f)][0] for f in a.fields for r in a.rows})
        refs = [catalog[si]["ref"] for si in need]
        t = time.perf_counter()
        objs = dict(zip(need, ray.get(refs, timeout=300)))
        for f in a.fields:
            for r, out in zip(a.rows, a.vals[f]):
                si, pos = where[(r, f)]
                np.copyto(out, objs[si][f][pos])
        dt = time.perf_counter() - t
        del objs
        if verify is not None:
            self.verify(a, verify)
        return {"dt": dt, "bytes": a.nbytes}


def main() -> int:
    """The subprocess loop: {"op": name, "args": {...}} -> {"ok": ...} or
    {"error": "..."}; exits when stdin closes."""
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write to the answer stream
    worker = None
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "init":
                worker = GrpoWorker(**cmd["args"])
                res = {}
            else:
                res = getattr(worker, cmd["op"])(**cmd.get("args", {}))
            out.write(json.dumps({"ok": res}) + "\n")
        except Exception as e:  # noqa: BLE001 - reported to the runner
            out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        if cmd["op"] == "close":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
