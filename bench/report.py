"""results.json -> results.md (tables, ratios, targets) and results.png.

    python bench/report.py bench/results/results.json [--publish]
        # redo md + png from a json; --publish also puts them in docs/
"""

from __future__ import annotations

import json
import os
import sys

import statistics

NAMES = {
    "stowage-shm": "stowage shm",
    "stowage-tcp": "stowage tcp",
    "stowage-shm-one-unit": "stowage shm, every op on one unit (best case)",
    "stowage-tcp-one-unit": "stowage tcp, every op on one unit (best case)",
    "stowage": "stowage",
    "mooncake": "Mooncake Store (tcp)",
    "mooncake-row": "Mooncake Store (tcp), one key per row",
    "mooncake-shm": "Mooncake Store, same host (dummy client of a local real client, shared memory)",
    "ray": "Ray object store (same-host shm)",
}
PEERS = ["mooncake", "ray"]
SHORT = {"stowage-shm": "stowage shm", "stowage-tcp": "stowage tcp", "mooncake": "Mooncake tcp",
         "mooncake-row": "Mooncake tcp, key per row", "mooncake-shm": "Mooncake same host", "ray": "Ray (shm)"}
NM = "not measured"
PYSOCK = "Python socket, request/reply"
STREAM = "tuned TCP stream"


# ---------------------------------------------------------------------------
# rounds: every figure as the median over the rounds, with its range


class M(float):
    """A median over rounds that remembers each round's value (in round
    order) and the range."""

    def __new__(cls, vals):
        vals = [float(v) for v in vals]
        o = float.__new__(cls, statistics.median(vals))
        o.vals = vals
        o.lo, o.hi = min(vals), max(vals)
        return o


def _num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


FAILED = []  # (path, "k of n rounds failed: error") for failures merged away


def _is_err(x):
    return isinstance(x, dict) and "error" in x


def _merge(xs, path=""):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    ok = [x for x in xs if not _is_err(x)]
    if ok and len(ok) < len(xs) and not all(isinstance(x, dict) for x in xs):
        bad = next(x for x in xs if _is_err(x))
        FAILED.append((path, f"{len(xs) - len(ok)} of {len(xs)} rounds failed, e.g.: {bad['error']}"))
        return _merge(ok, path)
    if all(_num(x) for x in xs):
        if all(x == xs[0] for x in xs) and not all(isinstance(x, M) for x in xs):
            return xs[0]
        return M(xs)
    if all(isinstance(x, dict) for x in xs):
        ok = [x for x in xs if "error" not in x]
        if not ok:
            return xs[0]
        out = {}
        for k in dict.fromkeys(k for x in ok for k in x):
            out[k] = _merge([x.get(k) for x in ok], f"{path}/{k}")
        if len(ok) < len(xs):
            bad = next(x for x in xs if "error" in x)
            out["failed_rounds"] = f"{len(xs) - len(ok)} of {len(xs)} rounds failed, e.g.: {bad['error']}"
        return out
    if all(isinstance(x, list) for x in xs) and len({len(x) for x in xs}) == 1:
        return [_merge(list(t), f"{path}[{i}]") for i, t in enumerate(zip(*xs))]
    return xs[0]


def merged(results) -> dict:
    """One results dict (systems, limits) whose varying figures are M: the
    median over the interleaved rounds, with each round's value. A JSON
    without rounds (one run) is returned as it is."""
    rounds = results.get("rounds")
    if not rounds:
        return results
    out = {k: v for k, v in results.items() if k != "rounds"}
    FAILED.clear()
    out["systems"] = _merge([r.get("systems", {}) for r in rounds], "systems") or {}
    out["limits"] = _merge([r.get("limits") for r in rounds], "limits")
    out["failed_merged"] = list(FAILED)
    out["n_rounds"] = len(rounds)
    out["loads"] = [r.get("load_before") for r in rounds]
    return out


def _vals(x, n):
    return list(x.vals) if isinstance(x, M) else [x] * n


def _ratio(a, b):
    """a / b, round by round where both are per-round figures."""
    if a is None or b is None or b == 0:
        return None
    if isinstance(a, M) or isinstance(b, M):
        n = max(len(getattr(a, "vals", [0])), len(getattr(b, "vals", [0])))
        av, bv = _vals(a, n), _vals(b, n)
        if len(av) == len(bv):
            return M([x / y for x, y in zip(av, bv) if y])
    return a / b


def _err(x):
    if isinstance(x, dict):
        if "error" in x:
            return x["error"]
        if "not_measured" in x:
            return x["not_measured"]
    return None


def _f(x, fmt="{:.2f}"):
    if x is None:
        return NM
    if isinstance(x, M) and len(x.vals) > 1:
        return f"{fmt.format(float(x))} [{fmt.format(x.lo)}–{fmt.format(x.hi)}]"
    return fmt.format(float(x))


def _x(x):
    return _f(x, "{:.2f}x")


def _ms(x):
    return _f(None if x is None else x * 1e3 if not isinstance(x, M) else M([v * 1e3 for v in x.vals]), "{:.1f}")


def _size(n) -> str:
    n = int(n)
    if n >= 1 << 30:
        return f"{n / (1 << 30):g} GiB"
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def sizes_index(results) -> dict:
    idx = {}
    for sysname, r in results.get("systems", {}).items():
        for label, rows in (r.get("sizes") or {}).items():
            if isinstance(rows, list):
                for row in rows:
                    idx[(label, int(row["size"]), int(row["batch"]))] = row
    lim = results.get("limits") or {}
    for row in lim.get("sizes") or []:
        idx[("limits", int(row["size"]), int(row["batch"]))] = row
    return idx


def _g(idx, label, size, batch, key):
    row = idx.get((label, size, batch))
    if not row or "skipped" in row:
        return None
    return row.get(key)


def _best(a, b):
    """The better of two limits, round by round."""
    if a is None:
        return b
    if b is None:
        return a
    n = max(len(getattr(a, "vals", [0])), len(getattr(b, "vals", [0])))
    av, bv = _vals(a, n), _vals(b, n)
    if len(av) == len(bv) and n > 1:
        return M([max(x, y) for x, y in zip(av, bv)])
    return max(a, b)


def grpo_index(results) -> dict:
    out = {}
    for sysname, r in results.get("systems", {}).items():
        for v in r.get("grpo-step") or []:
            out[(v.get("label") or sysname, v.get("variant"))] = v
    return out


def grpo_variants(g) -> list:
    vs = []
    for (_, v) in g:
        if v not in vs:
            vs.append(v)
    return vs


def grpo_pairs(g):
    """(variant, comparison, peer label, stowage label, ratio peer/stowage)
    for every pair the report compares. tcp vs tcp: Mooncake's better
    layout against stowage over tcp; same host vs same host: Ray against
    stowage over shm; shm vs tcp: Mooncake against stowage over shm
    (labelled so, never the headline)."""
    out = []
    for v in grpo_variants(g):
        def step(lb):
            x = g.get((lb, v)) or {}
            return x.get("step_s")

        mc = [(lb, step(lb)) for lb in ("mooncake", "mooncake-row") if step(lb) is not None]
        best_mc = min(mc, key=lambda t: float(t[1])) if mc else (None, None)
        for comp, peer, peer_s, st in (("tcp vs tcp", best_mc[0], best_mc[1], "stowage-tcp"),
                                       ("same host vs same host", "ray", step("ray"), "stowage-shm"),
                                       ("same host vs same host", "mooncake-shm", step("mooncake-shm"), "stowage-shm"),
                                       ("stowage shm vs Mooncake tcp", best_mc[0], best_mc[1], "stowage-shm")):
            if peer_s is None and peer == "mooncake-shm":
                continue
            out.append((v, comp, peer, st, _ratio(peer_s, step(st))))
    return out


def summarize(results) -> dict:
    """The round-2 targets (docs/targets.md), judged on the figures this
    harness measures; the others point at the benchmark that measures
    them."""
    idx = sizes_index(results)
    targets = []
    systems = results.get("systems", {})
    st = systems.get("stowage") or {}

    def verdict(val, ok):
        return NM if val is None else ("met" if ok else "missed")

    # shm vs single-thread cold memcpy, 1 and 16 MiB
    ratios = []
    for s in (1 << 20, 16 << 20):
        m = _g(idx, "limits", s, 1, "memcpy_1t_gbps")
        for k, nm in (("put_gbps", "put"), ("get_gbps", "get(out=)")):
            r = _ratio(_g(idx, "stowage-shm", s, 1, k), m)
            if r is not None:
                ratios.append((r, f"{nm} {_size(s)}"))
    worst = min(ratios, key=lambda t: float(t[0])) if ratios else None
    targets.append({"target": "shm put and get(out=) of 1 MiB and 16 MiB values ≥ 0.9x single-thread memcpy of the same cold bytes",
                    "measured": None if worst is None else "; ".join(f"{n} {_x(r)}" for r, n in ratios) + " (ratios to libc memcpy, 1 thread, cold)",
                    "verdict": verdict(worst, worst and float(worst[0]) >= 0.9)})
    targets.append({"target": "shm get into new arrays, 1 MiB and 16 MiB, ≥ 0.9x cold memcpy",
                    "measured": "measured by python/benchmarks/throughput.py (this harness reads into preallocated arrays)",
                    "verdict": "not judged here"})
    lat = (st.get("latency") or {}).get("stowage-shm") or {}
    best = (st.get("latency") or {}).get("stowage-shm-one-unit") or {}
    for op in ("put", "get"):
        p50 = (lat.get(op) or {}).get("p50_us")
        rate = (lat.get(op) or {}).get("ops_per_s")
        b50 = (best.get(op) or {}).get("p50_us")
        ok = p50 is not None and float(p50) <= 20 and rate is not None and float(rate) >= 40000
        targets.append({"target": f"64 KiB {op} from one Python client, default placement: p50 ≤ 20 µs and ≥ 40k op/s",
                        "measured": None if p50 is None else f"p50 {_f(p50, '{:.1f}')} µs, {_f(rate, '{:.0f}')} op/s; best case (every op on one unit): p50 {_f(b50, '{:.1f}')} µs",
                        "verdict": verdict(p50, ok)})
    sc = ((st.get("scaling") or {}).get("stowage-shm") or {}).get("levels") or []
    l16 = next((lv for lv in sc if int(lv["clients"]) == 16), None)
    for op in ("put", "get"):
        x = (l16 or {}).get(op) or {}
        ok = x and float(x["ops_per_s"]) >= 50000 and float(x["p99_us"]) <= 1000
        targets.append({"target": f"64 KiB {op}, 16 client processes (shm): ≥ 50k op/s, p99 ≤ 1 ms",
                        "measured": None if not x else f"{_f(x['ops_per_s'], '{:.0f}')} op/s, p99 {_f(x['p99_us'], '{:.0f}')} µs",
                        "verdict": verdict(x.get("ops_per_s"), ok)})
    targets.append({"target": "GRPO batch (1,024 jagged rows x 3 fields, 37.7 MB): put ≤ 5 ms, get ≤ 7 ms, get(out=) ≤ 5 ms, get_view ≤ 1 ms",
                    "measured": "measured by python/benchmarks/grpo_batch.py (the zero-copy table below is a batch of this harness's own fields)",
                    "verdict": "not judged here"})
    targets.append({"target": "a 4 GiB unit ready to serve in ≤ 1 s",
                    "measured": "measured by python/benchmarks/unit_start.py", "verdict": "not judged here"})
    ratios = []
    cli_raw = {int(c["size"]): c for c in ((st.get("cli_bench") or {}).get("sizes") or [])}
    for s in sorted({k[1] for k in idx if k[1] >= 1 << 20}):
        for b in sorted({k[2] for k in idx if k[1] == s}):
            for k, nm in (("put", "put"), ("get", "get")):
                lim = _best(_g(idx, "limits", s, b, f"stream_{k}_gbps"), _g(idx, "limits", s, b, f"pysock_{k}_gbps"))
                lim = _best(lim, (cli_raw.get(s) or {}).get(f"raw_tcp_{k}_gbps"))
                r = _ratio(_g(idx, "stowage-tcp", s, b, f"{k}_gbps"), lim)
                if r is not None:
                    ratios.append((r, f"{nm} {_size(s)} x{b}"))
    worst = min(ratios, key=lambda t: float(t[0])) if ratios else None
    targets.append({"target": "tcp ≥ 0.9x the best tuned raw loopback TCP stream, 1 MiB and up",
                    "measured": None if worst is None else f"worst {_x(worst[0])} ({worst[1]}); " + "; ".join(f"{n} {_x(r)}" for r, n in ratios)
                    + f" (against the best of the {STREAM} and the {PYSOCK}, both Python, and `stowage bench`'s Rust raw TCP "
                      "request/reply of the same value size)",
                    "verdict": ("met against these baselines; provisional until a Rust tuned stream is measured"
                                if worst and float(worst[0]) >= 0.9 else verdict(worst, False))})
    g = grpo_index(results)
    for comp in ("tcp vs tcp", "same host vs same host"):
        vals = [(r, v, peer) for v, c, peer, stl, r in grpo_pairs(g) if c == comp and r is not None]
        worst = min(vals, key=lambda t: float(t[0])) if vals else None
        targets.append({"target": f"RL step ≥ 3x every peer, {comp}" + (" (Mooncake, its better layout, against stowage tcp)" if comp == "tcp vs tcp" else " (Ray's object store, and Mooncake's dummy-client path where measured, against stowage shm)"),
                        "measured": None if not vals else "; ".join(f"{v} {_x(r)}" + ("" if comp == "tcp vs tcp" else f" ({NAMES.get(p_, p_).split(' (')[0].split(',')[0]})") for r, v, p_ in vals),
                        "verdict": verdict(worst, worst and float(worst[0]) >= 3)})
    ch = st.get("dapo-churn") or {}
    if ch.get("steps"):
        slab = ch["units"] * ch["unit_memory"]
        peak = max(float(s_["rss_after_step"]) for s_ in ch["steps"])
        over = peak / slab - 1
        targets.append({"target": "unit resident memory ≤ slab + 5%",
                        "measured": f"units' VmRSS at most {peak / 2**20:.0f} MiB over slabs of {slab / 2**20:.0f} MiB ({over * 100:+.1f}%), dapo-churn, median round",
                        "verdict": "met" if over <= 0.05 else "missed"})
        gr = ch.get("rss_growth_after_step2")
        targets.append({"target": "(round 1) dapo-churn: flat memory over 10 steps",
                        "measured": None if gr is None else f"unit VmRSS {_f(ch['rss_first_mib'], '{:.0f}')} → {_f(ch['rss_last_mib'], '{:.0f}')} MiB ({_f(None if gr is None else gr * 100, '{:+.1f}')}% after step 2)",
                        "verdict": verdict(gr, gr is not None and abs(float(gr)) <= 0.05)})
    else:
        targets.append({"target": "unit resident memory ≤ slab + 5%", "measured": None, "verdict": NM})
    return {"targets": targets}


def _table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _lat_row(name, v):
    p, gt = v.get("put") or {}, v.get("get") or {}
    return [name, v.get("placement", ""), _f(p.get("p50_us"), "{:.1f}"), _f(p.get("p99_us"), "{:.1f}"), _f(p.get("ops_per_s"), "{:.0f}"),
            _f(gt.get("p50_us"), "{:.1f}"), _f(gt.get("p99_us"), "{:.1f}"), _f(gt.get("ops_per_s"), "{:.0f}")]


def headline(results) -> list:
    """The run's findings in sentences, every figure from results.json."""
    out = []
    g = grpo_index(results)
    for v, comp, peer, stl, r in grpo_pairs(g):
        if r is None:
            continue
        ps = (g.get((peer, v)) or {}).get("step_s")
        ss = (g.get((stl, v)) or {}).get("step_s")
        out.append(f"grpo-step {v}, {comp}: {NAMES.get(peer, peer)} {_ms(ps)} ms, {NAMES.get(stl, stl)} {_ms(ss)} ms: "
                   f"stowage faster by {_x(r)}.")
    for v in grpo_variants(g):
        f, rw = g.get(("mooncake", v)) or {}, g.get(("mooncake-row", v)) or {}
        if f.get("step_s") is not None and rw.get("step_s") is not None:
            out.append(f"Mooncake layouts, {v}: one key per (row, field) {_ms(f['step_s'])} ms, one key per row "
                       f"(multi-buffer puts and gets) {_ms(rw['step_s'])} ms.")
    idx = sizes_index(results)
    for s, b in sorted({(k[1], k[2]) for k in idx if k[0] == "ray"}):
        if b > 1 and s >= 1 << 20:
            out.append(f"Ray, a batch of {b} x {_size(s)} in one ray.put: put {_f(_g(idx, 'ray', s, b, 'put_gbps'))} GB/s, "
                       f"get {_f(_g(idx, 'ray', s, b, 'get_gbps'))} GB/s (stowage shm {_f(_g(idx, 'stowage-shm', s, b, 'put_gbps'))} / "
                       f"{_f(_g(idx, 'stowage-shm', s, b, 'get_gbps'))} GB/s).")
    for s in sorted({k[1] for k in idx if k[0] == "limits" and k[2] == 1}):
        row = idx.get(("limits", s, 1)) or {}
        if s >= 1 << 20:
            out.append(f"memcpy (libc, cold) of {_size(s)}: {_f(row.get('memcpy_1t_gbps'))} GB/s on 1 thread, "
                       f"{_f(row.get('memcpy_nt_gbps'))} GB/s on {int(row.get('memcpy_threads', 1))} (stowage's thread count for that size); "
                       f"stowage shm put {_f(_g(idx, 'stowage-shm', s, 1, 'put_gbps'))}, get(out=) {_f(_g(idx, 'stowage-shm', s, 1, 'get_gbps'))} GB/s.")
    lat = ((results.get("systems", {}).get("stowage") or {}).get("latency") or {})
    d, one = lat.get("stowage-shm") or {}, lat.get("stowage-shm-one-unit") or {}
    if d.get("put"):
        out.append(f"64 KiB from Python, default placement (rows spread over {results.get('config', {}).get('sizes_units', 2)} units): put p50 "
                   f"{_f(d['put']['p50_us'], '{:.1f}')} µs, get p50 {_f(d['get']['p50_us'], '{:.1f}')} µs; best case, every op on one unit: "
                   f"put {_f((one.get('put') or {}).get('p50_us'), '{:.1f}')} µs, get {_f((one.get('get') or {}).get('p50_us'), '{:.1f}')} µs.")
    systems = results.get("systems", {})
    for lb, v in ((lb, v) for r in systems.values() for lb, v in (r.get("big-batch") or {}).items()):
        if isinstance(v, dict) and v.get("put_gbps") is not None:
            out.append(f"big-batch, {NAMES.get(lb, lb)}: {int(v['batch'])} x {_size(v['size'])} ({_size(v['batch_bytes'])}) in one call: "
                       f"put {_f(v['put_gbps'])} GB/s, get {_f(v['get_gbps'])} GB/s.")
    zs = {s_: (systems.get(s_) or {}).get("zero-copy") for s_ in ("stowage", "ray")}
    if all(isinstance(z, dict) and z.get("get_view_ms") is not None for z in zs.values()):
        out.append(f"zero-copy read of a {zs['stowage']['bytes'] / 1e6:.1f} MB batch: stowage get_view {_f(zs['stowage']['get_view_ms'])} ms, "
                   f"Ray ray.get {_f(zs['ray']['get_view_ms'])} ms.")
    for lb, v in ((lb, v) for r in systems.values() for lb, v in (r.get("scaling") or {}).items()):
        lv = (v.get("levels") or [])[-1:] if isinstance(v, dict) else []
        for x in lv:
            out.append(f"scaling, {NAMES.get(lb, lb)}, {int(x['clients'])} clients: put {_f(x['put']['ops_per_s'], '{:.0f}')} op/s "
                       f"(p99 {_f(x['put']['p99_us'], '{:.0f}')} µs), get {_f(x['get']['ops_per_s'], '{:.0f}')} op/s (p99 {_f(x['get']['p99_us'], '{:.0f}')} µs).")
    for r in systems.values():
        for v in r.get("partial") or []:
            if isinstance(v, dict) and v.get("one_ms") is not None:
                out.append(f"partial read, {NAMES.get(v['system'], v['system'])} ({v['layout']}): 1 of 5 fields {_f(v['one_ms'])} ms, "
                           f"all 5 {_f(v['all_ms'])} ms.")
    for sysname, r in results.get("systems", {}).items():
        k = r.get("kill")
        if isinstance(k, dict) and not _err(k):
            what = k.get("error_type") or k.get("outcome")
            extra = ""
            if k.get("error_type") == "LostKeys":
                extra = f", naming {k.get('rows_named')} rows (exactly the killed unit's: {k.get('rows_named_are_the_killed_units')})"
            elif k.get("error_codes") is not None:
                extra = f": {k.get('values_failed')} of {k.get('values_total')} values failed with codes {k.get('error_codes')}"
            out.append(f"Killed {k.get('killed')}: {NAMES.get(sysname, sysname)} reported {what}{extra} "
                       f"after {_f(k.get('seconds_to_answer'), '{:.2f}')} s.")
    return out


def markdown(results) -> str:
    raw = results
    results = merged(results)
    m = results.get("machine", {})
    cfg = results.get("config", {})
    idx = sizes_index(results)
    lines = []
    mem = m.get("memory_bytes") or 0
    pk = m.get("packages", {})
    n = results.get("n_rounds", 1)
    loads = ", ".join(f"{x[0]:.1f}" for x in results.get("loads") or [] if x)
    lines.append(f"Machine: {m.get('cores')} cores ({m.get('cpu_model')}), {mem / 2**30:.1f} GiB, Linux {m.get('kernel')}, "
                 f"Python {m.get('python')}; stowage {pk.get('stowage')} (commit {str(m.get('git_commit'))[:10]}{' + local changes' if m.get('git_dirty') else ''}), "
                 f"Mooncake {pk.get('mooncake-transfer-engine-non-cuda')}, Ray {pk.get('ray')}, numpy {pk.get('numpy')}. "
                 f"Run: {'--quick' if cfg.get('quick') else 'full'}, {n} interleaved round(s), {m.get('date_utc')}, {raw.get('elapsed_s', 0):.0f} s; "
                 f"1-minute load average before each round: {loads or 'n/a'}.")
    lines.append("")
    lines.append(f"Every figure is the median over the {n} rounds, with [min–max] where it varied; a ratio is taken round by round "
                 "(both figures from the same round), then its median and range.")
    lines.append("")
    errs = []
    for sysname, r in results.get("systems", {}).items():
        if _err(r):
            errs.append(f"- **{NAMES.get(sysname, sysname)}**: {_err(r)}")
            continue
        for w in ("sizes", "latency", "scaling", "big-batch"):
            for label, v in (r.get(w) or {}).items():
                if _err(v):
                    errs.append(f"- **{NAMES.get(label, label)}** {w}: {_err(v)}")
                elif isinstance(v, dict) and v.get("failed_rounds"):
                    errs.append(f"- **{NAMES.get(label, label)}** {w}: {v['failed_rounds']}")
        for v in r.get("grpo-step") or []:
            if _err(v):
                errs.append(f"- **{NAMES.get(v.get('label') or sysname, sysname)}** grpo-step {v.get('variant')}: {_err(v)}")
            elif v.get("failed_rounds"):
                errs.append(f"- **{NAMES.get(v.get('label') or sysname, sysname)}** grpo-step {v.get('variant')}: {v['failed_rounds']}")
        for v in r.get("partial") or []:
            if _err(v):
                errs.append(f"- **{NAMES.get(v.get('system'), sysname)}** partial: {_err(v)}")
        for w in ("dapo-churn", "disk", "zero-copy", "kill"):
            if _err(r.get(w)):
                errs.append(f"- **{NAMES.get(sysname, sysname)}** {w}: {_err(r.get(w))}")
            elif isinstance(r.get(w), dict) and r[w].get("failed_rounds"):
                errs.append(f"- **{NAMES.get(sysname, sysname)}** {w}: {r[w]['failed_rounds']}")
        if _err(r.get("cli_bench")):
            errs.append(f"- **stowage bench (CLI)**: {_err(r.get('cli_bench'))}")
    if _err(results.get("limits")):
        errs.append(f"- **limits**: {_err(results.get('limits'))}")
    for path, msg in results.get("failed_merged") or []:
        errs.append(f"- `{path}`: {msg} (the figures are over the other rounds)")

    hl = headline(results)
    if hl:
        lines.append("### What this run shows (generated from results.json)")
        lines.append("")
        lines += [f"- {h}" for h in hl]
        lines.append("")

    summ = summarize(results)
    lines.append("### Targets (docs/targets.md, round 2)")
    lines.append("")
    lines.append(_table(["target", "measured", "verdict"],
                        [[t["target"], t["measured"] or NM, t["verdict"]] for t in summ["targets"]]))
    lines.append("")

    # grpo
    g = grpo_index(results)
    variants = grpo_variants(g)
    if variants:
        lines.append("### grpo-step: one RL step, ms (4 units, 4 client processes)")
        lines.append("")
        lines.append("Each peer against stowage on the same kind of path: **tcp vs tcp** is the headline (Mooncake's transfer "
                     "engine over loopback TCP, in its better layout, against stowage over tcp); **same host vs same host** puts "
                     "Ray's shared-memory object store, and Mooncake's dummy clients of a local real client, against stowage's "
                     "shared memory; stowage shm against Mooncake tcp is shown with that label only.")
        lines.append("")
        lines.append(_table(["variant", "comparison", "peer", "stowage", "stowage faster by"],
                            [[v, c, NAMES.get(p, p) if p else NM, NAMES[s_], _x(r)] for v, c, p, s_, r in grpo_pairs(g)]))
        lines.append("")
        rows = []
        for v in variants:
            for lb in ("stowage-shm", "stowage-tcp", "mooncake", "mooncake-row", "mooncake-shm", "ray"):
                x = g.get((lb, v))
                if x is None:
                    continue
                if x.get("step_s") is None:
                    rows.append([v, NAMES[lb], NM, "", "", "", "", "", ""])
                    continue
                ph = x["phases_s"]
                tok = x.get("tokens") or ["", ""]
                rows.append([v, NAMES[lb], f"{int(x['rows'])} rows of {int(tok[0])}–{int(tok[1])} tokens, {x['step_bytes'] / 1e6:.0f} MB",
                             _ms(x["step_s"]), _ms(ph["put"]), _ms(ph["read1"]), _ms(ph["writeback"]), _ms(ph["read2"]), _ms(ph["clear"])])
        lines.append(_table(["variant", "system", "data", "step", "put", "read (group 1)", "write-back", "read (group 2)", "clear"], rows))
        lines.append("")

    # sizes
    labels = [lb for lb in ("stowage-shm", "stowage-tcp", "mooncake", "ray") if any(k[0] == lb for k in idx)]
    cells = sorted({(k[1], k[2]) for k in idx}, key=lambda c: (c[1], c[0]))
    if cells:
        lines.append("### sizes: put / get throughput, GB/s (one client; a batch is one call; cold sources and destinations)")
        lines.append("")
        hdr = ["value", "batch"] + [f"{NAMES[lb]} put / get" for lb in labels] + \
              ["memcpy 1 thread", "memcpy, stowage's threads", f"{PYSOCK} put / get", f"{STREAM} put / get"]
        rows = []
        for s, b in cells:
            r = [_size(s), b]
            for lb in labels:
                row = idx.get((lb, s, b))
                r.append("skipped" if row and "skipped" in row else f"{_f(_g(idx, lb, s, b, 'put_gbps'))} / {_f(_g(idx, lb, s, b, 'get_gbps'))}")
            lim = idx.get(("limits", s, b)) or {}
            r.append(_f(lim.get("memcpy_1t_gbps")))
            r.append(f"{_f(lim.get('memcpy_nt_gbps'))} ({int(lim.get('memcpy_threads', 1))}t)" if lim else NM)
            r.append(f"{_f(lim.get('pysock_put_gbps'))} / {_f(lim.get('pysock_get_gbps'))}")
            r.append(f"{_f(lim.get('stream_put_gbps'))} / {_f(lim.get('stream_get_gbps'))}")
            rows.append(r)
        lines.append(_table(hdr, rows))
        lines.append("")
        lines.append("stowage's ratios (put / get), same cells, round by round:")
        lines.append("")
        rows = []
        for s, b in cells:
            def rr(a, bl, bk):
                return f"{_x(_ratio(_g(idx, a, s, b, 'put_gbps'), _g(idx, bl, s, b, bk[0])))} / {_x(_ratio(_g(idx, a, s, b, 'get_gbps'), _g(idx, bl, s, b, bk[1])))}"
            rows.append([_size(s), b,
                         rr("stowage-shm", "limits", ("memcpy_1t_gbps", "memcpy_1t_gbps")),
                         rr("stowage-shm", "limits", ("memcpy_nt_gbps", "memcpy_nt_gbps")),
                         rr("stowage-tcp", "limits", ("stream_put_gbps", "stream_get_gbps")),
                         rr("stowage-tcp", "limits", ("pysock_put_gbps", "pysock_get_gbps")),
                         rr("stowage-tcp", "mooncake", ("put_gbps", "get_gbps")),
                         rr("stowage-shm", "ray", ("put_gbps", "get_gbps"))])
        lines.append(_table(["value", "batch", "shm / memcpy 1t", "shm / memcpy same threads", f"tcp / {STREAM}", f"tcp / {PYSOCK}",
                             "tcp / Mooncake tcp", "shm / Ray (same host)"], rows))
        skipped = sorted({row["skipped"] for row in idx.values() if "skipped" in row})
        if skipped:
            lines.append("")
            lines.append("Skipped cells: " + "; ".join(skipped) + " (the big-batch table moves a larger batch).")
        lines.append("")
        cli = (results.get("systems", {}).get("stowage") or {}).get("cli_bench") or {}
        if cli.get("sizes"):
            lines.append("stowage's Rust client in the same rounds (`stowage bench`, no Python in the loop; its own memcpy and its own raw TCP, hot buffers):")
            lines.append("")
            lines.append(_table(["value", "memcpy", "shm put / get", "raw TCP put / get", "tcp put / get"],
                                [[_size(c["size"]), _f(c["memcpy_gbps"]), f"{_f(c['shm_put_gbps'])} / {_f(c['shm_get_gbps'])}",
                                  f"{_f(c['raw_tcp_put_gbps'])} / {_f(c['raw_tcp_get_gbps'])}", f"{_f(c['tcp_put_gbps'])} / {_f(c['tcp_get_gbps'])}"]
                                 for c in cli["sizes"]]))
            lines.append("")

    # big batch
    brow = []
    for sysname, r in results.get("systems", {}).items():
        for label, v in (r.get("big-batch") or {}).items():
            if _err(v) or v.get("put_gbps") is None:
                brow.append([NAMES.get(label, label), NM, NM])
                continue
            brow.append([NAMES.get(label, label), f"{int(v['batch'])} x {_size(v['size'])} = {_size(v['batch_bytes'])}", f"{_f(v['put_gbps'])} / {_f(v['get_gbps'])}"])
    bl = (results.get("limits") or {}).get("big-batch")
    if bl:
        brow.append([f"memcpy 1 thread / {int(bl['memcpy_threads'])} threads (libc)", "", f"{_f(bl['memcpy_1t_gbps'])} / {_f(bl['memcpy_nt_gbps'])}"])
        brow.append([f"{STREAM} put / get", "", f"{_f(bl['stream_put_gbps'])} / {_f(bl['stream_get_gbps'])}"])
    if brow:
        lines.append("### big-batch: one multi-GiB batch in one put and one get, GB/s")
        lines.append("")
        lines.append(_table(["system", "batch", "put / get"], brow))
        lines.append("")

    # latency
    lrows = []
    for sysname, r in results.get("systems", {}).items():
        for label, v in (r.get("latency") or {}).items():
            if _err(v) or not v.get("put"):
                continue
            lrows.append(_lat_row(NAMES.get(label, label), v))
        for tr, v in (((r.get("cli_bench") or {}).get("latency")) or {}).items():
            lrows.append([f"stowage {tr}, Rust client (`stowage bench`)", "every op on one unit", _f(v['put_p50_us'], "{:.1f}"), _f(v['put_p99_us'], "{:.1f}"), NM,
                          _f(v['get_p50_us'], "{:.1f}"), _f(v['get_p99_us'], "{:.1f}"), NM])
    ll = (results.get("limits") or {}).get("latency")
    if ll:
        lrows.append(_lat_row(f"{PYSOCK} (blocking, TCP_NODELAY)", {"placement": "", "put": ll["tcp_put"], "get": ll["tcp_get"]}))
        lrows.append([f"memcpy (libc, cold)", "", _f(ll["memcpy"]["p50_us"], "{:.1f}"), _f(ll["memcpy"]["p99_us"], "{:.1f}"), "", "", "", ""])
    if lrows:
        lines.append("### latency: one 64 KiB value per call from one Python client, µs (op/s: one op at a time)")
        lines.append("")
        lines.append(_table(["system", "placement", "put p50", "put p99", "put op/s", "get p50", "get p99", "get op/s"], lrows))
        lines.append("")

    # scaling
    srow = []
    for sysname, r in results.get("systems", {}).items():
        for label, v in (r.get("scaling") or {}).items():
            if _err(v):
                srow.append([NAMES.get(label, label), NM, "", "", "", ""])
                continue
            for lv in v.get("levels") or []:
                srow.append([NAMES.get(label, label), int(lv["clients"]), _f(lv["put"]["ops_per_s"], "{:.0f}"), _f(lv["put"]["p99_us"], "{:.0f}"),
                             _f(lv["get"]["ops_per_s"], "{:.0f}"), _f(lv["get"]["p99_us"], "{:.0f}")])
    if srow:
        lines.append("### scaling: N client processes, 64 KiB values one op per call (2 units; each get reads another client's keys)")
        lines.append("")
        lines.append(_table(["system", "clients", "put op/s (all clients)", "put p99 µs", "get op/s (all clients)", "get p99 µs"], srow))
        lines.append("")

    # zero copy
    zrow = []
    for sysname, r in results.get("systems", {}).items():
        z = r.get("zero-copy")
        if not z:
            continue
        if _err(z):
            zrow.append([NAMES.get(sysname, sysname), _err(z), "", "", "", ""])
            continue
        zrow.append([NAMES.get(sysname, sysname), f"{int(z['rows'])} rows x {len(z['fields'])} fields, {z['bytes'] / 1e6:.1f} MB",
                     _f(z["put_ms"]), _f(z["get_view_ms"]), _f(z["get_new_ms"]), _f(z["get_out_ms"])])
    if zrow:
        lines.append("### zero-copy: a GRPO batch read without copying, ms")
        lines.append("")
        lines.append("stowage: `put`, `get_view` (read-only views into the units' memory), `get` (new arrays), `get(out=)`. "
                     "Ray: one `ray.put` of the batch (a dict of per-row arrays) in an actor; `ray.get` here (numpy arrays are "
                     "read-only views of the object store), `ray.get` + copies into new arrays, `ray.get` + copies into preallocated ones.")
        lines.append("")
        lines.append(_table(["system", "batch", "put", "zero-copy get", "get, new arrays", "get into preallocated"], zrow))
        lines.append("")

    # partial
    prow = []
    for sysname, r in results.get("systems", {}).items():
        for v in r.get("partial") or []:
            if _err(v):
                prow.append([NAMES.get(v.get("system"), sysname), "", NM, "", "", ""])
                continue
            prow.append([NAMES.get(v["system"], v["system"]), v["layout"], f"{int(v['rows'])} rows; 1 field {v['one_field_bytes'] / 1e6:.1f} MB of {v['all_bytes'] / 1e6:.1f} MB",
                         _f(v["one_ms"]), _f(v["all_ms"]), _x(_ratio(v["all_ms"], v["one_ms"]))])
    if prow:
        lines.append("### partial: read 1 of 5 fields of every row, ms (one client, into preallocated arrays)")
        lines.append("")
        lines.append(_table(["system", "layout", "data", "1 field", "all 5 fields", "5 fields / 1 field"], prow))
        lines.append("")

    # kill
    krow = []
    for sysname, r in results.get("systems", {}).items():
        k = r.get("kill")
        if not k:
            continue
        if _err(k):
            krow.append([NAMES.get(sysname, sysname), "", NM, _err(k), ""])
            continue
        detail = k.get("message", "")
        if k.get("error_type") == "LostKeys":
            detail = (f"LostKeys(unit={k.get('unit')}): {k.get('keys_named')} (row, field) keys naming {k.get('rows_named')} rows, "
                      f"exactly the killed unit's rows: {k.get('rows_named_are_the_killed_units')}; {k.get('other_rows', '')}")
        krow.append([NAMES.get(sysname, sysname), k.get("killed", ""), k.get("error_type") or k.get("outcome"), detail.replace("|", "/"),
                     _f(k.get("seconds_to_answer"), "{:.2f}")])
    if krow:
        lines.append("### kill: the process holding part of a step killed (SIGKILL), then every row read")
        lines.append("")
        lines.append(_table(["system", "killed", "the reader is told", "detail", "seconds to answer"], krow))
        lines.append("")

    # churn
    crow = []
    for sysname, r in results.get("systems", {}).items():
        c = r.get("dapo-churn")
        if not c:
            continue
        if _err(c):
            crow.append([NAMES[sysname], NM, "", "", "", "", ""])
            continue
        rss = " ".join(f"{s['rss_after_step'] / 2**20:.0f}" for s in c["steps"])
        shm = " ".join(f"{s.get('shm_alloc_after_step', 0) / 2**20:.0f}" for s in c["steps"])
        sg = c.get("shm_growth_after_step2")
        crow.append([NAMES[sysname], f"{int(c['rows_generated'])} -> {int(c['rows_kept'])} rows, {c['step_bytes'] / 1e6:.0f} MB",
                     rss, _f(None if c.get("rss_growth_after_step2") is None else c["rss_growth_after_step2"] * 100, "{:+.1f}") + "%", shm,
                     NM if sg is None else _f(sg * 100, "{:+.1f}") + "%", _ms(c["step_s_median"])])
    if crow:
        lines.append("### dapo-churn: memory of the memory-owning processes after each of 10 steps, MiB (median round)")
        lines.append("")
        lines.append("VmRSS sums /proc/PID/status of the units (stowage), the segment owners and master (Mooncake), the raylet (Ray); "
                     "shared memory is the allocation of the memfd or /dev/shm files they map, each counted once "
                     "(Ray's plasma pages are faulted in by its workers, so the raylet's VmRSS misses them).")
        lines.append("")
        lines.append(_table(["system", "per step", "VmRSS after steps 1..10", "VmRSS growth (step 2 -> 10)",
                             "shared memory after steps 1..10", "shared growth", "step ms (median)"], crow))
        lines.append("")

    # disk
    drow = []
    for sysname, r in results.get("systems", {}).items():
        d = r.get("disk")
        if not d:
            continue
        if _err(d):
            drow.append([NAMES.get(sysname, sysname), NM, "", "", ""])
            continue
        ph = d["phases_s"]
        drow.append([NAMES.get(sysname, sysname), f"{int(d['rows'])} rows, {d['step_bytes'] / 1e6:.0f} MB; memory {d['units'] * d['unit_memory'] / 1e6:.0f} MB",
                     _ms(d["step_s"]), " / ".join(_ms(ph[k]) for k in ("put", "read1", "writeback", "read2", "clear")),
                     _f(_ratio(d["step_bytes"], d["step_s"]) / 1e9 if d.get("step_s") else None)])
    dl = (results.get("limits") or {}).get("disk")
    if drow:
        lines.append("### disk: the grpo step with memory for a third of it, ms")
        lines.append("")
        lines.append(_table(["system", "data", "step", "put / read 1 / write-back / read 2 / clear", "step bytes / step time, GB/s"], drow))
        if dl:
            lines.append("")
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
            shown = dl["dir"][len(root):] if dl["dir"].startswith(root) else dl["dir"]
            lines.append(f"Limit on the same filesystem (`{shown}`): sequential write + fsync {_f(dl['write_fsync_gbps'])} GB/s, "
                         f"read (page cache dropped) {_f(dl['read_gbps'])} GB/s, {dl['bytes'] / 1e6:.0f} MB.")
        lines.append("")
    lines.append("### Workload parameters of this run")
    lines.append("")
    for k, v in (cfg.get("shapes") or {}).items():
        lines.append(f"- `{k}`: `{json.dumps(v, default=str)}`")
    lines.append("")
    if errs:
        lines.append("### Not measured / failed")
        lines.append("")
        lines.extend(errs)
        lines.append("")
    return "\n".join(lines)


def chart(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = merged(results)
    idx = sizes_index(results)
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    styles = {"stowage-shm": ("C0", "o"), "stowage-tcp": ("C9", "o"), "mooncake": ("C1", "s"), "ray": ("C2", "^"),
              "memcpy": ("k", ""), "tcp": ("0.5", "")}
    sizes = sorted({k[1] for k in idx if k[2] == 1})
    for ax, key, title in ((axes[0][0], "put_gbps", "put, one value per call"), (axes[0][1], "get_gbps", "get, one value per call")):
        for lb in ("stowage-shm", "stowage-tcp", "mooncake", "ray"):
            pts = [(s, _g(idx, lb, s, 1, key)) for s in sizes]
            pts = [(s, v) for s, v in pts if v is not None]
            if pts:
                c, mk = styles[lb]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=mk, color=c, label=NAMES[lb])
        pts = [(s, _g(idx, "limits", s, 1, "memcpy_1t_gbps")) for s in sizes]
        pts = [(s, v) for s, v in pts if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "k--", label="memcpy (libc, cold), 1 thread")
        lk = "stream_put_gbps" if key == "put_gbps" else "stream_get_gbps"
        pts = [(s, _g(idx, "limits", s, 1, lk)) for s in sizes]
        pts = [(s, v) for s, v in pts if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ":", color="0.4", label=STREAM + " (Python)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes)
        ax.set_xticklabels([_size(s) for s in sizes])
        ax.set_xlabel("value size")
        ax.set_ylabel("GB/s")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    # grpo bars: the whole step per system (log scale: the systems differ
    # by more than 10x; the phases are in the table)
    ax = axes[1][0]
    g = grpo_index(results)
    variants = []
    for (_, v) in g:
        if v not in variants:
            variants.append(v)
    systems = [lb for lb in ("stowage-shm", "stowage-tcp", "mooncake", "mooncake-row", "mooncake-shm", "ray") if any(k[0] == lb for k in g)]
    colors = {"stowage-shm": "C0", "stowage-tcp": "C9", "mooncake": "C1", "mooncake-row": "C3", "mooncake-shm": "C5", "ray": "C2"}
    width = 0.8 / max(1, len(systems))
    for si, s in enumerate(systems):
        for vi, v in enumerate(variants):
            x = g.get((s, v))
            xpos = vi + (si - (len(systems) - 1) / 2) * width
            if not x or "step_s" not in x:
                ax.text(xpos, 1, "not\nmeasured", ha="center", va="bottom", fontsize=7, rotation=90)
                continue
            ms = float(x["step_s"]) * 1e3
            ax.bar(xpos, ms, width * 0.9, color=colors[s], label=SHORT.get(s, s) if vi == 0 else None)
            ax.text(xpos, ms * 1.05, f"{ms:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi * 8)  # room for the legend above the bars
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels(variants)
    ax.set_ylabel("ms per step (log scale)")
    ax.set_title("grpo-step (median round): put, 2 reads, write-back, clear; 4 clients")
    ax.legend(fontsize=7, loc="upper left", ncol=3)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    # churn
    ax = axes[1][1]
    for s in ("stowage", "mooncake", "ray"):
        c = (results.get("systems", {}).get(s) or {}).get("dapo-churn") or {}
        if c.get("steps"):
            col = {"stowage": "C0", "mooncake": "C1", "ray": "C2"}[s]
            xs = [st["step"] + 1 for st in c["steps"]]
            ax.plot(xs, [float(st["rss_after_step"]) / 2**20 for st in c["steps"]], marker="o", label=f"{NAMES[s]} VmRSS", color=col)
            shm = [float(st.get("shm_alloc_after_step") or 0) / 2**20 for st in c["steps"]]
            if any(shm):
                ax.plot(xs, shm, marker="x", linestyle="--", label=f"{NAMES[s]} shared memory", color=col)
    ax.set_xlabel("step")
    ax.set_ylabel("memory-owning processes, MiB")
    ax.set_title("dapo-churn: memory after each step")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    m = results.get("machine", {})
    fig.suptitle(f"stowage vs Mooncake Store vs Ray, {m.get('cores')} cores, {'quick' if results.get('config', {}).get('quick') else 'full'} run, median of {results.get('n_rounds', 1)} rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


START, END = "<!-- results:start -->", "<!-- results:end -->"


def publish(results_dir: str, docs_md: str) -> None:
    """Put results.md between the markers of docs/benchmarks.md and copy
    results.png beside it as benchmarks.png."""
    import shutil

    with open(os.path.join(results_dir, "results.md")) as f:
        md = f.read()
    with open(docs_md) as f:
        doc = f.read()
    if START not in doc or END not in doc:
        raise ValueError(f"{docs_md} has no {START} ... {END} section")
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    with open(docs_md, "w") as f:
        f.write(head + START + "\n" + md.rstrip() + "\n" + END + tail)
    png = os.path.join(results_dir, "results.png")
    if os.path.exists(png):
        shutil.copyfile(png, os.path.join(os.path.dirname(docs_md), "benchmarks.png"))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--publish"]
    src = args[0] if args else os.path.join(os.path.dirname(__file__), "results", "results.json")
    with open(src) as f:
        res = json.load(f)
    res["summary"] = summarize(merged(res))
    out = os.path.dirname(os.path.abspath(src))
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown(res))
    chart(res, os.path.join(out, "results.png"))
    if "--publish" in sys.argv:
        publish(out, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks.md"))
    print(markdown(res))
