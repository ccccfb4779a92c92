"""The workloads added in round 2: client scaling, a multi-GiB batch,
zero-copy reads, partial-field reads and a unit killed in the middle of a
step. bench/run_system.py runs them; each returns a JSON-able dict (or a
list of them) and never estimates a figure it did not measure.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

import common
from common import FIELD_NAMES, MiB, log, progress


def _q(samples_us) -> dict:
    a = np.sort(np.asarray(samples_us, dtype=np.float64))
    if a.size == 0:
        return {}

    def q(p):
        return float(a[min(a.size - 1, int(round((a.size - 1) * p)))])

    return {"p50_us": q(0.5), "p99_us": q(0.99), "n": int(a.size)}


# ---------------------------------------------------------------------------
# scaling: N client processes, 64 KiB values, one op per call


def scaling(system, backend, quick, transport, label, frac=(0.0, 1.0)):
    """Each of N clients puts its own keys one op at a time, then gets the
    keys of the client before it (so no get reads what its own process
    put). Op rate: all ops over the span from the first op's start to the
    last op's end (every client's clock is CLOCK_MONOTONIC)."""
    from run_system import _workers, unit_memory

    shape = common.scaling_shape(quick, system)
    size = shape["size"]
    ladder = shape["clients"]
    nmax = max(ladder)
    peak = max(n * max(shape["min_ops"], shape["ops_total"] // n) for n in ladder) * size
    backend.start(common.SIZES_UNITS, unit_memory(peak * 1.5 / common.SIZES_UNITS + 64 * MiB), transport)
    pool = None
    out = {"system": label, "transport": transport, "size": size, "units": common.SIZES_UNITS, "levels": []}
    try:
        progress("scaling", frac[0], f"{label}: starting {nmax} clients")
        pool = _workers(system, backend, timeout=600, n=nmax)
        for li, n in enumerate(ladder):
            progress("scaling", frac[0] + (frac[1] - frac[0]) * (li + 1) / (len(ladder) + 1), f"{label} {n} clients")
            ops = max(shape["min_ops"], shape["ops_total"] // n)
            pool.call("small_prepare", [{"n": ops, "size": size, "pool": max(8 * MiB, 128 * MiB // n)}] * n)
            part = f"scale-{n}"
            puts = pool.call("small_put", [{"part": part, "base": w * ops} for w in range(n)])
            if system == "ray":
                gargs = [{"part": part, "base": 0, "refs": puts[(w - 1) % n]["refs"]} for w in range(n)]
            else:
                gargs = [{"part": part, "base": ((w - 1) % n) * ops} for w in range(n)]
            gets = pool.call("small_get", gargs)
            pool.call("small_clear", [{"part": part, "base": w * ops} for w in range(n)])
            lvl = {"clients": n, "ops_per_client": ops}
            for name, res in (("put", puts), ("get", gets)):
                span = max(r["t1"] for r in res) - min(r["t0"] for r in res)
                lat = [x for r in res for x in r["lat_us"]]
                lvl[name] = dict(_q(lat), ops_per_s=n * ops / span)
            out["levels"].append(lvl)
            log(f"{label} scaling {n}: put {lvl['put']['ops_per_s']:.0f}/s p99 {lvl['put']['p99_us']:.0f} us; "
                f"get {lvl['get']['ops_per_s']:.0f}/s p99 {lvl['get']['p99_us']:.0f} us")
        return out
    finally:
        if pool is not None:
            pool.close()
        backend.stop()


# ---------------------------------------------------------------------------
# big-batch: a multi-GiB batch in one put and one get


def big_batch(system, backend, quick, transport, label):
    from run_system import sizes_blob, sizes_ray, unit_memory

    bb = common.big_batch(quick)
    n = bb["size"] * bb["batch"]
    grid = {"sizes": [bb["size"]], "batches": [bb["batch"]], "max_batch_bytes": n, "budget": 0,
            "min_iters": bb["iters"], "max_iters": bb["iters"], "max_seconds": 0.0, "pool": n}
    backend.start(common.SIZES_UNITS, unit_memory(n * 1.15 / common.SIZES_UNITS + 64 * MiB), transport)
    try:
        if system == "ray":
            rows = sizes_ray(backend, quick, 0.0, 1.0, grid=grid, workload="big-batch")
        else:
            rows = sizes_blob(backend, label, quick, 0.0, 1.0, grid=grid, workload="big-batch")
        return dict(rows[0], system=label, transport=transport, batch_bytes=n)
    finally:
        backend.stop()


# ---------------------------------------------------------------------------
# zero-copy reads: stowage get_view against Ray's ray.get of numpy arrays


def _arena(system, rows, lens, fields, version=0):
    from worker import Arena

    return Arena(system, list(range(rows)), lens, fields, version)


def zero_copy(system, backend, quick):
    """A GRPO batch (jagged rows x 3 fields) put once per iteration, read
    back four ways: zero-copy (stowage get_view; Ray's ray.get, whose
    numpy arrays are read-only views of its object store), into new
    arrays (stowage get; Ray: ray.get + a copy into fresh arrays), into
    preallocated arrays (stowage get(out=); Ray: ray.get + copyto)."""
    import run_system

    shape = common.zero_copy_shape(quick)
    rows, fields = shape["rows"], shape["fields"]
    lens = common.lengths(rows, 2)
    arena = _arena(system, rows, lens, fields)
    nbytes = arena.nbytes
    outs = _arena(system, rows, lens, fields, None)
    keys = list(range(rows))
    backend.start(common.SIZES_UNITS, run_system.unit_memory(nbytes * 3 / common.SIZES_UNITS + 64 * MiB), "shm")
    t = {"put": [], "get_view": [], "get_new": [], "get_out": []}
    try:
        if system == "ray":
            import ray

            putter = _ray_batch_putter()
            for i in range(shape["iters"] + 1):
                dt, refs = ray.get(putter.put.remote(rows, fields), timeout=300)
                t0 = time.perf_counter()
                obj = ray.get(refs[0], timeout=300)
                t1 = time.perf_counter()
                new = {f: [np.array(v) for v in obj[f]] for f in fields}
                t2 = time.perf_counter()
                obj2 = ray.get(refs[0], timeout=300)
                for f in fields:
                    for v, o in zip(obj2[f], outs.vals[f]):
                        np.copyto(o, v)
                t3 = time.perf_counter()
                if i == 0:
                    _check(arena, obj, fields)
                else:
                    t["put"].append(dt / 1e9)
                    t["get_view"].append(t1 - t0)
                    t["get_new"].append(t2 - t0)
                    t["get_out"].append(t3 - t2)
                del obj, obj2, new, refs
            ray.kill(putter)
        else:
            dp = backend.dp
            for i in range(shape["iters"] + 1):
                t0 = time.perf_counter()
                dp.put("zc", keys, arena.vals)
                t1 = time.perf_counter()
                views = dp.get_view("zc", keys, fields)
                t2 = time.perf_counter()
                if i == 0:
                    _check(arena, views, fields)
                del views
                t3 = time.perf_counter()
                new = dp.get("zc", keys, fields)
                t4 = time.perf_counter()
                del new
                t5 = time.perf_counter()
                dp.get("zc", keys, fields, out=outs.vals)
                t6 = time.perf_counter()
                dp.clear("zc", keys)
                if i > 0:
                    t["put"].append(t1 - t0)
                    t["get_view"].append(t2 - t1)
                    t["get_new"].append(t4 - t3)
                    t["get_out"].append(t6 - t5)
    finally:
        backend.stop()
    res = {"system": system, "rows": rows, "fields": fields, "bytes": nbytes, "iters": shape["iters"]}
    for k, v in t.items():
        res[k + "_ms"] = float(np.median(v)) * 1e3
    log(f"{system} zero-copy: " + " ".join(f"{k} {res[k + '_ms']:.2f} ms" for k in t))
    return res


def _check(arena, got, fields):
    for f in fields:
        for a, b in zip(arena.vals[f], got[f]):
            if not np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)):
                raise AssertionError(f"zero-copy: field {f} read back wrong")


def _ray_batch_putter():
    import ray

    @ray.remote(num_cpus=1)
    class BatchPutter:
        def __init__(self):
            self.arenas = {}

        def put(self, rows, fields, seed=2):
            key = (rows, tuple(fields), seed)
            if key not in self.arenas:
                self.arenas = {key: _arena("ray", rows, common.lengths(rows, seed), fields)}
            a = self.arenas[key]
            obj = {f: a.vals[f] for f in fields}
            t = time.perf_counter_ns()
            ref = ray.put(obj)
            return time.perf_counter_ns() - t, [ref]

    return BatchPutter.remote()


# ---------------------------------------------------------------------------
# partial-field reads: get 1 of 5 fields


PARTIAL_FIELDS = FIELD_NAMES[:5]


def partial(system, backend, quick, transport, label):
    """Rows of 5 fields put once; each iteration reads every row's one
    field, then all 5 fields, into preallocated arrays. stowage and
    Mooncake's per-field keys read just that field; Mooncake's row layout
    reads its byte range of each row's key; Ray's batch is one object
    (dict of fields), whose ray.get maps the whole object without copying
    and the one field is copied out."""
    import run_system
    from systems import mooncake_connect

    shape = common.partial_shape(quick)
    rows, field = shape["rows"], shape["field"]
    lens = common.lengths(rows, 3)
    src = _arena(system, rows, lens, PARTIAL_FIELDS)
    outs = _arena(system, rows, lens, PARTIAL_FIELDS, None)
    keys = list(range(rows))
    one_bytes = sum(v.nbytes for v in src.vals[field])
    backend.start(common.SIZES_UNITS, run_system.unit_memory(src.nbytes * 3 / common.SIZES_UNITS + 64 * MiB), transport)
    results = []
    try:
        if system == "ray":
            import ray

            putter = _ray_batch_putter()
            _, refs = ray.get(putter.put.remote(rows, PARTIAL_FIELDS, 3), timeout=300)
            t1s, t5s = [], []
            for i in range(shape["iters"] + 1):
                t0 = time.perf_counter()
                obj = ray.get(refs[0], timeout=300)
                for v, o in zip(obj[field], outs.vals[field]):
                    np.copyto(o, v)
                t1 = time.perf_counter()
                del obj
                t2 = time.perf_counter()
                obj = ray.get(refs[0], timeout=300)
                for f in PARTIAL_FIELDS:
                    for v, o in zip(obj[f], outs.vals[f]):
                        np.copyto(o, v)
                t3 = time.perf_counter()
                del obj
                if i == 0:
                    _check(src, outs.vals, PARTIAL_FIELDS)
                else:
                    t1s.append(t1 - t0)
                    t5s.append(t3 - t2)
            ray.kill(putter)
            results.append(_partial_row(label, "one object per batch (dict of fields)", rows, one_bytes, src.nbytes, t1s, t5s))
        else:
            clients = [(backend.client, "one key per (row, field)" if system == "mooncake" else "default")]
            if system == "mooncake":
                clients.append((mooncake_connect(dict(backend.conn(), layout="row")), "one key per row (byte ranges)"))
            for ci, (client, layout) in enumerate(clients):
                part = f"partial-{ci}"
                client.register([src.buf, outs.buf])
                client.put_rows(part, keys, src.vals)
                t1s, t5s = [], []
                for i in range(shape["iters"] + 1):
                    t0 = time.perf_counter()
                    client.get_into(part, keys, [field], outs.vals)
                    t1 = time.perf_counter()
                    client.get_into(part, keys, PARTIAL_FIELDS, outs.vals)
                    t2 = time.perf_counter()
                    if i == 0:
                        _check(src, outs.vals, PARTIAL_FIELDS)
                    else:
                        t1s.append(t1 - t0)
                        t5s.append(t2 - t1)
                client.clear(part, keys, PARTIAL_FIELDS)
                client.unregister([src.buf, outs.buf])
                if client is not backend.client:
                    client.close()
                results.append(_partial_row(label, layout, rows, one_bytes, src.nbytes, t1s, t5s))
    finally:
        backend.stop()
    return results


def _partial_row(label, layout, rows, one_bytes, all_bytes, t1s, t5s):
    r = {"system": label, "layout": layout, "rows": rows, "one_field_bytes": one_bytes, "all_bytes": all_bytes,
         "one_ms": float(np.median(t1s)) * 1e3, "all_ms": float(np.median(t5s)) * 1e3}
    log(f"{label} partial ({layout}): 1 field {r['one_ms']:.2f} ms, 5 fields {r['all_ms']:.2f} ms")
    return r


# ---------------------------------------------------------------------------
# a unit killed in the middle of a step


def kill_unit(system, backend, quick, transport, label):
    """Rows of every field put over 4 units (stowage, Mooncake: 4 memory
    processes) or by one owner (Ray), the process holding part of them
    killed (SIGKILL), then every row read: what the reader is told, and
    how long it takes to be told."""
    import run_system

    rows = common.kill_shape(quick)["rows"]
    lens = common.lengths(rows, 4)
    src = _arena(system, rows, lens, FIELD_NAMES)
    outs = _arena(system, rows, lens, FIELD_NAMES, None)
    keys = list(range(rows))
    units = common.UNITS
    backend.start(units, run_system.unit_memory(src.nbytes * 3 / units + 64 * MiB), transport)
    res = {"system": label, "rows": rows, "units": units}
    try:
        if system == "ray":
            import ray

            putter = _ray_batch_putter()
            _, refs = ray.get(putter.put.remote(rows, FIELD_NAMES, 4), timeout=300)
            ready, _ = ray.wait(refs, timeout=60, fetch_local=False)  # sealed before the kill (not fetched here)
            assert ready, "ray: the batch was not ready before the kill"
            res["killed"] = "the actor that put the batch (its owner)"
            ray.kill(putter, no_restart=True)
            try:  # the owner is gone once a call to it fails
                ray.get(putter.put.remote(1, FIELD_NAMES[:1]), timeout=60)
            except Exception:  # noqa: BLE001 - RayActorError expected
                pass
            # read at once, then again after Ray has had time to learn of
            # the owner's death (it is told asynchronously)
            for when, pause in (("at once", 0.0), ("after 2 s", 2.0)):
                time.sleep(pause)
                t = time.perf_counter()
                try:
                    ray.get(refs[0], timeout=60)
                    outcome, etype, msg = "read succeeded", None, ""
                except Exception as e:  # noqa: BLE001 - what Ray reports is the figure
                    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
                    outcome, etype = "raised", type(e).__name__
                    msg = next((ln for ln in lines if "owner" in ln.lower() or "died" in ln.lower()), lines[0] if lines else "")[:300]
                dt = time.perf_counter() - t
                if when == "at once":
                    res["first_read"] = f"{outcome}{' ' + etype if etype else ''} ({dt:.2f} s)"
                else:
                    res.update({"outcome": outcome, "error_type": etype, "message": msg, "seconds_to_answer": dt})
            res["message"] = f"read at once after the owner died: {res['first_read']}; 2 s later: " + (
                f"{res['error_type']}: {res['message']}" if res.get("error_type") else res["outcome"])
            return res
        client = backend.client
        client.register([src.buf, outs.buf])
        client.put_rows("kill", keys, src.vals)
        client.get_into("kill", keys, FIELD_NAMES, outs.vals)  # readable before the kill
        victim = 1
        pids = backend.memory_pids()
        res["killed"] = f"memory process {victim} of {units} (pid {pids[victim]})"
        os.kill(pids[victim], signal.SIGKILL)
        _wait_gone(pids[victim])
        time.sleep(0.5)
        t = time.perf_counter()
        if system == "stowage":
            import stowage

            try:
                backend.dp.get("kill", keys, FIELD_NAMES, out=outs.vals, timeout=60)
                res["outcome"] = "read succeeded"
            except stowage.LostKeys as e:
                named = sorted({k for k, _ in e.keys})
                res.update({"outcome": "raised", "error_type": "LostKeys", "unit": e.unit,
                            "keys_named": len(e.keys), "rows_named": len(named),
                            "rows_named_are_the_killed_units": named == [r for r in keys if r % units == victim],
                            "message": str(e).strip().splitlines()[0][:300]})
            except Exception as e:  # noqa: BLE001
                res.update({"outcome": "raised", "error_type": type(e).__name__, "message": str(e)[:300]})
            res["seconds_to_answer"] = time.perf_counter() - t
            alive = [r for r in keys if r % units != victim]
            try:
                backend.dp.get("kill", alive, FIELD_NAMES, timeout=60)
                res["other_rows"] = f"the {len(alive)} rows on the other units read back"
            except Exception as e:  # noqa: BLE001
                res["other_rows"] = f"{type(e).__name__}: {str(e)[:200]}"
        else:  # Mooncake: per-key return codes
            ks, ptrs, sizes = [], [], []
            from systems import mooncake_key

            for f in FIELD_NAMES:
                for r, a in zip(keys, outs.vals[f]):
                    ks.append(mooncake_key("kill", r, f))
                    ptrs.append(a.ctypes.data)
                    sizes.append(a.nbytes)
            got = client.store.batch_get_into(ks, ptrs, sizes)
            res["seconds_to_answer"] = time.perf_counter() - t
            bad = [(k, g) for k, g, s in zip(ks, got, sizes) if g != s]
            codes = sorted({int(g) for _, g in bad})
            res.update({"outcome": "per-key error codes" if bad else "read succeeded",
                        "values_failed": len(bad), "values_total": len(ks), "error_codes": codes,
                        "message": f"batch_get_into returned {codes} for {len(bad)} of {len(ks)} values"})
        return res
    finally:
        try:
            backend.stop()
        except Exception as e:  # noqa: BLE001 - a plane with a dead unit may complain on close
            log(f"{label} kill: stop: {type(e).__name__}: {e}")


def _wait_gone(pid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.02)
