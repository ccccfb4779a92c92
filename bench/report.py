"""results.json -> results.md (tables, ratios, targets) and results.png.

    python bench/report.py bench/results/results.json [--publish]
        # redo md + png from a json; --publish also puts them in docs/
"""

from __future__ import annotations

import json
import os
import sys

NAMES = {
    "stowage-shm": "stowage shm",
    "stowage-tcp": "stowage tcp",
    "stowage-shm-rr": "stowage shm, ops alternating over 2 units",
    "stowage-tcp-rr": "stowage tcp, ops alternating over 2 units",
    "stowage": "stowage (shm)",
    "mooncake": "Mooncake Store",
    "ray": "Ray object store",
}
PEERS = ["mooncake", "ray"]
NM = "not measured"


def _err(x):
    if isinstance(x, dict):
        if "error" in x:
            return x["error"]
        if "not_measured" in x:
            return x["not_measured"]
    return None


def _f(x, fmt="{:.2f}"):
    return NM if x is None else fmt.format(x)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def sizes_index(results) -> dict:
    idx = {}
    for sysname, r in results.get("systems", {}).items():
        for label, rows in (r.get("sizes") or {}).items():
            if isinstance(rows, list):
                for row in rows:
                    idx[(label, row["size"], row["batch"])] = row
    lim = results.get("limits") or {}
    for row in lim.get("sizes") or []:
        idx[("limits", row["size"], row["batch"])] = row
    return idx


def sizes_errors(results) -> dict:
    out = {}
    for sysname, r in results.get("systems", {}).items():
        if _err(r):
            out[sysname] = _err(r)
        for label, rows in (r.get("sizes") or {}).items():
            if _err(rows):
                out[label] = _err(rows)
    return out


def _g(idx, label, size, batch, key):
    row = idx.get((label, size, batch))
    if not row or "skipped" in row:
        return None
    return row.get(key)


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def grpo_index(results) -> dict:
    out = {}
    for sysname, r in results.get("systems", {}).items():
        for v in r.get("grpo-step") or []:
            out[(sysname, v.get("variant"))] = v
    return out


def summarize(results) -> dict:
    """The performance targets (docs/targets.md), measured, with a verdict."""
    idx = sizes_index(results)
    targets = []
    big = [1 << 20, 16 << 20, 64 << 20]

    def verdict(val, ok):
        return NM if val is None else ("met" if ok else "missed")

    # shm vs single-thread memcpy
    ratios = []
    for s in big:
        m = _g(idx, "limits", s, 1, "memcpy_1t_gbps")
        for k in ("put_gbps", "get_gbps"):
            r = _ratio(_g(idx, "stowage-shm", s, 1, k), m)
            if r is not None:
                ratios.append((r, f"{k[:3]} {_size(s)}"))
    cli = ((results.get("systems", {}).get("stowage") or {}).get("cli_bench") or {})
    src = ""
    if not ratios and cli.get("sizes"):  # no Python figures: the CLI's own, in its own run
        src = " (source: `stowage bench` CLI)"
        for c in cli["sizes"]:
            if c["size"] >= 1 << 20:
                ratios += [(c["shm_put_gbps"] / c["memcpy_gbps"], f"put {_size(c['size'])}"),
                           (c["shm_get_gbps"] / c["memcpy_gbps"], f"get {_size(c['size'])}")]
    worst = min(ratios) if ratios else None
    targets.append({"target": "shm put/get >= 0.7x single-thread memcpy, 1-64 MiB",
                    "measured": None if worst is None else f"worst {worst[0]:.2f}x ({worst[1]}); " + ", ".join(f"{n} {r:.2f}x" for r, n in ratios) + src,
                    "verdict": verdict(worst, worst and worst[0] >= 0.7)})
    ratios = []
    for s in big:
        for k, lk in (("put_gbps", "tcp_put_gbps"), ("get_gbps", "tcp_get_gbps")):
            r = _ratio(_g(idx, "stowage-tcp", s, 1, k), _g(idx, "limits", s, 1, lk))
            if r is not None:
                ratios.append((r, f"{k[:3]} {_size(s)}"))
    src = ""
    if not ratios and cli.get("sizes"):
        src = " (source: `stowage bench` CLI)"
        for c in cli["sizes"]:
            if c["size"] >= 1 << 20:
                ratios += [(c["tcp_put_gbps"] / c["raw_tcp_put_gbps"], f"put {_size(c['size'])}"),
                           (c["tcp_get_gbps"] / c["raw_tcp_get_gbps"], f"get {_size(c['size'])}")]
    worst = min(ratios) if ratios else None
    targets.append({"target": "tcp put/get >= 0.8x raw loopback TCP, 1-64 MiB",
                    "measured": None if worst is None else f"worst {worst[0]:.2f}x ({worst[1]}); " + ", ".join(f"{n} {r:.2f}x" for r, n in ratios) + src,
                    "verdict": verdict(worst, worst and worst[0] >= 0.8)})
    lat = ((results.get("systems", {}).get("stowage") or {}).get("latency") or {}).get("stowage-shm") or {}
    p50 = (lat.get("put") or {}).get("p50_us")
    clil = (cli.get("latency") or {}).get("shm") or {}
    note = f"; Rust client (`stowage bench`): {clil['put_p50_us']:.1f} us" if clil.get("put_p50_us") is not None else ""
    rr = (((results.get("systems", {}).get("stowage") or {}).get("latency") or {}).get("stowage-shm-rr") or {}).get("put", {}).get("p50_us")
    if rr is not None:
        note += f"; ops alternating over 2 units (Python): {rr:.1f} us"
    if p50 is None and clil.get("put_p50_us") is not None:
        targets.append({"target": "64 KiB put p50 <= 25 us on shm",
                        "measured": f"{clil['put_p50_us']:.1f} us (source: `stowage bench` CLI, Rust client)",
                        "verdict": verdict(clil["put_p50_us"], clil["put_p50_us"] <= 25)})
    else:
        targets.append({"target": "64 KiB put p50 <= 25 us on shm",
                        "measured": None if p50 is None else f"{p50:.1f} us from Python, every op on one unit{note}",
                        "verdict": verdict(p50, p50 is not None and p50 <= 25)})
    g = grpo_index(results)
    for peer in PEERS:
        vals = []
        for (sysname, variant), v in g.items():
            if sysname != "stowage" or "step_s" not in v:
                continue
            pv = g.get((peer, variant)) or {}
            if "step_s" in pv:
                vals.append((pv["step_s"] / v["step_s"], variant))
        worst = min(vals) if vals else None
        targets.append({"target": f"grpo-step >= 3x faster than {NAMES[peer]}",
                        "measured": None if worst is None else ", ".join(f"{n} {r:.2f}x" for r, n in vals),
                        "verdict": verdict(worst, worst and worst[0] >= 3)})
    ch = (results.get("systems", {}).get("stowage") or {}).get("dapo-churn") or {}
    gr = ch.get("rss_growth_after_step2")
    used = [s.get("used_after_step") for s in ch.get("steps", [])]
    targets.append({"target": "dapo-churn: flat memory over 10 steps",
                    "measured": None if gr is None else f"unit RSS {ch['rss_first_mib']:.0f} -> {ch['rss_last_mib']:.0f} MiB ({gr * 100:+.1f}% after step 2); used after each step {sorted(set(used))}",
                    "verdict": verdict(gr, gr is not None and abs(gr) <= 0.05)})
    return {"targets": targets}


def _table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def markdown(results) -> str:
    m = results.get("machine", {})
    cfg = results.get("config", {})
    idx = sizes_index(results)
    lines = []
    mem = m.get("memory_bytes") or 0
    pk = m.get("packages", {})
    lines.append(f"Machine: {m.get('cores')} cores ({m.get('cpu_model')}), {mem / 2**30:.1f} GiB, Linux {m.get('kernel')}, "
                 f"Python {m.get('python')}; stowage {pk.get('stowage')} (commit {str(m.get('git_commit'))[:10]}{' + local changes' if m.get('git_dirty') else ''}), "
                 f"Mooncake {pk.get('mooncake-transfer-engine-non-cuda')}, Ray {pk.get('ray')}, numpy {pk.get('numpy')}. "
                 f"Run: {'--quick' if cfg.get('quick') else 'full'}, {m.get('date_utc')}, {results.get('elapsed_s', 0):.0f} s.")
    lines.append("")
    # errors / not measured
    errs = []
    for sysname, r in results.get("systems", {}).items():
        if _err(r):
            errs.append(f"- **{NAMES.get(sysname, sysname)}**: {_err(r)}")
            continue
        for w in ("sizes", "latency"):
            for label, v in (r.get(w) or {}).items():
                if _err(v):
                    errs.append(f"- **{NAMES.get(label, label)}** {w}: {_err(v)}")
        for v in r.get("grpo-step") or []:
            if _err(v):
                errs.append(f"- **{NAMES.get(sysname, sysname)}** grpo-step {v.get('variant')}: {_err(v)}")
        for w in ("dapo-churn", "disk"):
            if _err(r.get(w)):
                errs.append(f"- **{NAMES.get(sysname, sysname)}** {w}: {_err(r.get(w))}")
        if _err(r.get("cli_bench")):
            errs.append(f"- **stowage bench (CLI)**: {_err(r.get('cli_bench'))}")
    if _err(results.get("limits")):
        errs.append(f"- **limits**: {_err(results.get('limits'))}")

    # targets
    summ = results.get("summary") or summarize(results)
    lines.append("### Targets (docs/targets.md)")
    lines.append("")
    lines.append(_table(["target", "measured", "verdict"],
                        [[t["target"], t["measured"] or NM, t["verdict"]] for t in summ["targets"]]))
    lines.append("")

    # sizes
    labels = [lb for lb in ("stowage-shm", "stowage-tcp", "mooncake", "ray") if any(k[0] == lb for k in idx)]
    cells = sorted({(k[1], k[2]) for k in idx}, key=lambda c: (c[1], c[0]))
    if cells:
        lines.append("### sizes: put / get throughput, GB/s (one client; a batch is one call)")
        lines.append("")
        hdr = ["value", "batch"] + [f"{NAMES[lb]} put / get" for lb in labels] + ["memcpy 1 thread", "memcpy all cores", "raw TCP put / get"]
        rows = []
        for s, b in cells:
            r = [_size(s), b]
            for lb in labels:
                row = idx.get((lb, s, b))
                if row and "skipped" in row:
                    r.append("skipped")
                else:
                    r.append(f"{_f(_g(idx, lb, s, b, 'put_gbps'))} / {_f(_g(idx, lb, s, b, 'get_gbps'))}")
            r.append(_f(_g(idx, "limits", s, b, "memcpy_1t_gbps")))
            r.append(_f(_g(idx, "limits", s, b, "memcpy_all_gbps")))
            r.append(f"{_f(_g(idx, 'limits', s, b, 'tcp_put_gbps'))} / {_f(_g(idx, 'limits', s, b, 'tcp_get_gbps'))}")
            rows.append(r)
        lines.append(_table(hdr, rows))
        lines.append("")
        lines.append("stowage's ratios (put / get) to the limits and peers, same cells:")
        lines.append("")
        hdr = ["value", "batch", "shm / memcpy 1t", "tcp / raw TCP", "shm / Mooncake", "shm / Ray"]
        rows = []
        for s, b in cells:
            def rr(a, ak, bl, bk):
                return f"{_f(_ratio(_g(idx, a, s, b, ak[0]), _g(idx, bl, s, b, bk[0])), '{:.2f}x')} / {_f(_ratio(_g(idx, a, s, b, ak[1]), _g(idx, bl, s, b, bk[1])), '{:.2f}x')}"
            pg = ("put_gbps", "get_gbps")
            rows.append([_size(s), b,
                         rr("stowage-shm", pg, "limits", ("memcpy_1t_gbps", "memcpy_1t_gbps")),
                         rr("stowage-tcp", pg, "limits", ("tcp_put_gbps", "tcp_get_gbps")),
                         rr("stowage-shm", pg, "mooncake", pg),
                         rr("stowage-shm", pg, "ray", pg)])
        lines.append(_table(hdr, rows))
        skipped = sorted({row["skipped"] for row in idx.values() if "skipped" in row})
        if skipped:
            lines.append("")
            lines.append("Skipped cells: " + "; ".join(skipped) + " (the batch and its copies would not fit this machine next to the store).")
        lines.append("")
        cli = (results.get("systems", {}).get("stowage") or {}).get("cli_bench") or {}
        if cli.get("sizes"):
            lines.append("stowage's Rust client in the same run (`stowage bench`, no Python in the loop; its own memcpy and raw TCP):")
            lines.append("")
            lines.append(_table(["value", "memcpy", "shm put / get", "raw TCP put / get", "tcp put / get", "shm/memcpy", "tcp/raw"],
                                [[_size(c["size"]), f"{c['memcpy_gbps']:.2f}", f"{c['shm_put_gbps']:.2f} / {c['shm_get_gbps']:.2f}",
                                  f"{c['raw_tcp_put_gbps']:.2f} / {c['raw_tcp_get_gbps']:.2f}", f"{c['tcp_put_gbps']:.2f} / {c['tcp_get_gbps']:.2f}",
                                  f"{c['shm_put_gbps'] / c['memcpy_gbps']:.2f}x / {c['shm_get_gbps'] / c['memcpy_gbps']:.2f}x",
                                  f"{c['tcp_put_gbps'] / c['raw_tcp_put_gbps']:.2f}x / {c['tcp_get_gbps'] / c['raw_tcp_get_gbps']:.2f}x"]
                                 for c in cli["sizes"]]))
            lines.append("")

    # latency
    lrows = []
    for sysname, r in results.get("systems", {}).items():
        for label, v in (r.get("latency") or {}).items():
            if _err(v) or not v.get("put"):
                continue
            p, gt = v["put"], v["get"]
            lrows.append([NAMES.get(label, label), _f(p.get("p50_us"), "{:.1f}"), _f(p.get("p99_us"), "{:.1f}"), _f(p.get("p999_us"), "{:.1f}"),
                          _f(gt.get("p50_us"), "{:.1f}"), _f(gt.get("p99_us"), "{:.1f}"), _f(gt.get("p999_us"), "{:.1f}")])
        for tr, v in (((r.get("cli_bench") or {}).get("latency")) or {}).items():
            lrows.append([f"stowage {tr}, Rust client (`stowage bench`)", f"{v['put_p50_us']:.1f}", f"{v['put_p99_us']:.1f}", NM,
                          f"{v['get_p50_us']:.1f}", f"{v['get_p99_us']:.1f}", NM])
    ll = (results.get("limits") or {}).get("latency")
    if ll:
        lrows.append(["raw loopback TCP (Python)", _f(ll["tcp_put"]["p50_us"], "{:.1f}"), _f(ll["tcp_put"]["p99_us"], "{:.1f}"), _f(ll["tcp_put"]["p999_us"], "{:.1f}"),
                      _f(ll["tcp_get"]["p50_us"], "{:.1f}"), _f(ll["tcp_get"]["p99_us"], "{:.1f}"), _f(ll["tcp_get"]["p999_us"], "{:.1f}")])
        lrows.append(["memcpy (numpy)", _f(ll["memcpy"]["p50_us"], "{:.1f}"), _f(ll["memcpy"]["p99_us"], "{:.1f}"), _f(ll["memcpy"]["p999_us"], "{:.1f}"), "", "", ""])
    if lrows:
        lines.append("### latency: one 64 KiB value, µs")
        lines.append("")
        lines.append(_table(["system", "put p50", "put p99", "put p99.9", "get p50", "get p99", "get p99.9"], lrows))
        lines.append("")

    # grpo
    g = grpo_index(results)
    variants = []
    for (_, v) in g:
        if v not in variants:
            variants.append(v)
    if variants:
        lines.append("### grpo-step: one RL step, ms (4 units, 4 client processes; median of the timed steps)")
        lines.append("")
        rows = []
        for v in variants:
            st = g.get(("stowage", v)) or {}
            for sysname in ("stowage", "mooncake", "ray"):
                x = g.get((sysname, v))
                if x is None:
                    continue
                if "step_s" not in x:
                    rows.append([v, NAMES[sysname], NM, "", "", "", "", "", "", ""])
                    continue
                ph = x["phases_s"]
                sp = "" if sysname == "stowage" or "step_s" not in st else f"{x['step_s'] / st['step_s']:.2f}x"
                rows.append([v, NAMES[sysname], f"{x['rows']} rows, {x['step_bytes'] / 1e6:.0f} MB", f"{x['step_s'] * 1e3:.1f}",
                             f"{ph['put'] * 1e3:.1f}", f"{ph['read1'] * 1e3:.1f}", f"{ph['writeback'] * 1e3:.1f}",
                             f"{ph['read2'] * 1e3:.1f}", f"{ph['clear'] * 1e3:.1f}", sp])
        lines.append(_table(["variant", "system", "data", "step", "put", "read (group 1)", "write-back", "read (group 2)", "clear", "stowage faster by"], rows))
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
        crow.append([NAMES[sysname], f"{c['rows_generated']} -> {c['rows_kept']} rows, {c['step_bytes'] / 1e6:.0f} MB",
                     rss, f"{c['rss_growth_after_step2'] * 100:+.1f}%", shm, NM if sg is None else f"{sg * 100:+.1f}%",
                     f"{c['step_s_median'] * 1e3:.1f}"])
    if crow:
        lines.append("### dapo-churn: memory of the memory-owning processes after each of 10 steps, MiB")
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
            e = _err(d)
            drow.append([NAMES[sysname], e if e.startswith(NM) else f"{NM}: {e}", "", "", ""])
            continue
        ph = d["phases_s"]
        drow.append([NAMES[sysname], f"{d['rows']} rows, {d['step_bytes'] / 1e6:.0f} MB; memory {d['units'] * d['unit_memory'] / 1e6:.0f} MB",
                     f"{d['step_s'] * 1e3:.0f}", " / ".join(f"{ph[k] * 1e3:.0f}" for k in ("put", "read1", "writeback", "read2", "clear")),
                     f"{d['step_bytes'] / d['step_s'] / 1e9:.2f}"])
    dl = (results.get("limits") or {}).get("disk")
    if drow:
        lines.append("### disk: the grpo step with memory for a third of it, ms")
        lines.append("")
        lines.append(_table(["system", "data", "step", "put / read 1 / write-back / read 2 / clear", "step bytes / step time, GB/s"], drow))
        if dl:
            lines.append("")
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
            shown = dl["dir"][len(root):] if dl["dir"].startswith(root) else dl["dir"]
            lines.append(f"Limit on the same filesystem (`{shown}`): sequential write + fsync {dl['write_fsync_gbps']:.2f} GB/s, "
                         f"read (page cache dropped) {dl['read_gbps']:.2f} GB/s, {dl['bytes'] / 1e6:.0f} MB.")
        lines.append("")
    cd = (results.get("systems", {}).get("stowage") or {}).get("cli_disk") or {}
    if cd.get("stdout"):
        lines.append("### disk, stowage CLI (`stowage bench --disk DIR --disk-only`, source cli)")
        lines.append("")
        lines.append("```")
        lines.append(cd["stdout"].rstrip())
        lines.append("```")
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
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "k--", label="memcpy, 1 thread")
        lk = "tcp_put_gbps" if key == "put_gbps" else "tcp_get_gbps"
        pts = [(s, _g(idx, "limits", s, 1, lk)) for s in sizes]
        pts = [(s, v) for s, v in pts if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ":", color="0.4", label="raw loopback TCP")
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
    systems = ["stowage", "mooncake", "ray"]
    colors = {"stowage": "C0", "mooncake": "C1", "ray": "C2"}
    width = 0.8 / len(systems)
    for si, s in enumerate(systems):
        for vi, v in enumerate(variants):
            x = g.get((s, v))
            xpos = vi + (si - (len(systems) - 1) / 2) * width
            if not x or "step_s" not in x:
                ax.text(xpos, 1, "not\nmeasured", ha="center", va="bottom", fontsize=7, rotation=90)
                continue
            ms = x["step_s"] * 1e3
            ax.bar(xpos, ms, width * 0.9, color=colors[s], label=NAMES[s] if vi == 0 else None)
            ax.text(xpos, ms * 1.05, f"{ms:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels([f"{v} ({(next((x['rows'] for (_, vv), x in g.items() if vv == v and 'rows' in x), ''))} rows)" for v in variants])
    ax.set_ylabel("ms per step (log scale)")
    ax.set_title("grpo-step: put, 2 reads, write-back, clear; 4 clients")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    # churn
    ax = axes[1][1]
    for s in systems:
        c = (results.get("systems", {}).get(s) or {}).get("dapo-churn") or {}
        if c.get("steps"):
            col = {"stowage": "C0", "mooncake": "C1", "ray": "C2"}[s]
            xs = [st["step"] + 1 for st in c["steps"]]
            ax.plot(xs, [st["rss_after_step"] / 2**20 for st in c["steps"]], marker="o", label=f"{NAMES[s]} VmRSS", color=col)
            shm = [st.get("shm_alloc_after_step", 0) / 2**20 for st in c["steps"]]
            if any(shm):
                ax.plot(xs, shm, marker="x", linestyle="--", label=f"{NAMES[s]} shared memory", color=col)
    ax.set_xlabel("step")
    ax.set_ylabel("memory-owning processes, MiB")
    ax.set_title("dapo-churn: memory after each step")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    m = results.get("machine", {})
    fig.suptitle(f"stowage vs Mooncake Store vs Ray, {m.get('cores')} cores, {'quick' if results.get('config', {}).get('quick') else 'full'} run")
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
    res["summary"] = summarize(res)
    out = os.path.dirname(os.path.abspath(src))
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown(res))
    chart(res, os.path.join(out, "results.png"))
    if "--publish" in sys.argv:
        publish(out, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks.md"))
    print(markdown(res))
