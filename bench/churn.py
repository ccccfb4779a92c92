"""Churn: client processes put and clear values of mixed sizes against one
storage unit kept 60-90% full, the way a long RL run's steps cut its slab
into pieces (issue 23).

    .venv/bin/python bench/churn.py [--steps 2000] [--clients 4] [--slab 1GiB]
                                    [--units 1] [--seed 0] [--transport shm]

The driver starts the unit(s) as a user does (`stowage.local`: `stowage
unit` child processes, a slab of --slab each) and --clients client
processes (spawned interpreters, each connecting with the plane's
directory). The clients share one counter of steps: each step, a client
reads the units' stats, then either puts one new value (size log-uniform
in [--min-size, --max-size], bytes sliced from a seeded random pool of its
own) or clears a random one of the values it put earlier, so that clears
come in random order. Which one: below --low of the slab (stored data plus
puts under way in any client) it puts, above --high it clears, in between
it puts with a chance that falls from 1 at --low to 0 at --high; a put
that would take the slab past --high becomes a clear. A refused put (UnitFull, or Timeout waiting for room) is a step
too, recorded with the data fraction of its unit right after the refusal.

It reports the refused puts (the target is none while the data is below
95% of the slab: every one of those is free memory the unit could not
use), steps/s, the bytes compaction moved per step (the units' stats
`compaction_bytes`, `compaction_moves`; n/a on a unit that does not report
them), and the units' memory over the run, sampled from /proc/<pid>/status
(VmRSS, and its parts RssAnon, the heap, and RssShmem, the slab pages the
unit process itself touched). A share of clears (--verify) first read the
value back and compare it byte for byte. It prints a table, then one JSON
line with every figure. No figure is a pass/fail: this is a benchmark, not
a test.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback

import numpy as np

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

NAMESPACE = "churn"
PARTITION = "churn"
# Values start at a random offset in the first POOL_SLACK bytes of a
# client's pool, so that no two values of a size hold the same bytes.
POOL_SLACK = 1 * MiB
REFUSED_TARGET_BELOW = 0.95

for _var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
    os.environ.pop(_var, None)


def parse_size(text: str) -> int:
    """`1GiB`, `512MiB`, `64KiB`, `4096` -> bytes."""
    t = text.strip()
    for suffix, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("G", GiB), ("M", MiB), ("K", KiB), ("B", 1)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def fmt_size(n: float) -> str:
    for unit, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= mult:
            return f"{n / mult:.2f} {unit}"
    return f"{int(n)} B"


def data_bytes(s: dict) -> int:
    """Bytes of stored data in a unit's stats. Since issue 23 `used` is
    stored data only (reservations and spares are reported beside it); a
    unit from before it (no `free_bytes` key) counts reservations, spares
    and quarantined ranges in `used`, which are taken back out here."""
    if "free_bytes" in s:
        return int(s["used"])
    return int(s["used"]) - int(s.get("reserved_bytes", 0)) - int(s.get("quarantined_bytes", 0))


def proc_mem(pid: int) -> dict:
    """VmRSS, RssAnon, RssShmem of a process, in bytes (empty when gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssAnon:", "RssShmem:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def start_time(pid: int):
    """The start time of process `pid` (field 22 of /proc/<pid>/stat), or
    None when there is none or it has exited (a zombie has). With the pid it
    names one process: a pid that was reused has another start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except (OSError, IndexError):
        return None


def stop_by_pid(pid: int, started, grace: float = 5.0) -> str:
    """Make sure the process `pid` that started at `started` is gone:
    SIGTERM, then SIGKILL after `grace` seconds; every wait bounded. A pid
    now held by another process is left alone. Returns how it ended."""

    def ours():
        return started is not None and start_time(pid) == started

    if not ours():
        return "exited"
    for sig, how in ((signal.SIGTERM, "SIGTERM"), (signal.SIGKILL, "SIGKILL")):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return "exited"
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not ours():
                return how
            time.sleep(0.05)
    return "still running"


def stop_client(p, grace: float = 5.0) -> str:
    """Make sure client process `p` (not yet reaped while it runs, so its
    pid is its own) is gone: SIGTERM, then SIGKILL; bounded waits."""
    p.join(timeout=10)
    if p.exitcode is not None:
        return "exited"
    for stop, how in ((p.terminate, "SIGTERM"), (p.kill, "SIGKILL")):
        stop()
        p.join(timeout=grace)
        if p.exitcode is not None:
            return how
    return "still running"


def quantile(a, p):
    if not a:
        return float("nan")
    s = sorted(a)
    return s[min(len(s) - 1, round((len(s) - 1) * p))]


# ---------------------------------------------------------------------------
# a client process


class BoundedLock:
    """`with BoundedLock(lock, seconds)`: the clients' shared lock, taken within
    `seconds` or TimeoutError (a client stopped while holding it must not
    hang the others)."""

    def __init__(self, lock, seconds):
        self.lock, self.seconds = lock, seconds

    def __enter__(self):
        if not self.lock.acquire(timeout=self.seconds):
            raise TimeoutError(f"the clients' step lock not free in {self.seconds:.0f}s")

    def __exit__(self, *exc):
        self.lock.release()


def client_main(idx, directory, cfg, lock, ticket, inflight, go, results):
    """One client: connect, say ready, wait for go, then take steps from
    the shared counter until --steps are taken (or the deadline). Sends
    one dict to `results` at the end (or an error)."""
    try:
        import stowage

        rng = np.random.default_rng([cfg["seed"], idx])
        pool = rng.integers(0, 256, cfg["max_size"] + POOL_SLACK, dtype=np.uint8)
        out = np.empty(cfg["max_size"], dtype=np.uint8)
        dp = stowage.connect(directory, namespace=NAMESPACE, timeout=cfg["op_timeout"])
        units = len(dp.units)
        lo_ln, hi_ln = math.log(cfg["min_size"]), math.log(cfg["max_size"])
        live = []  # (key, size, offset) of this client's values, in put order
        next_key = idx
        res = {
            "client": idx,
            "puts": 0,
            "clears": 0,
            "put_bytes": 0,
            "refused": [],
            "errors": [],
            "verified": 0,
            "verify_failed": [],
            "put_s": [],
            "clear_s": [],
            "idle_waits": 0,
        }
        results.put({"ready": idx})
        # `go` is a flag polled here, not an Event: Event.set() waits for
        # every sleeper to wake, and a stopped client would hold it forever.
        until = time.monotonic() + cfg["ready_timeout"]
        while not go.value:
            if time.monotonic() > until:
                raise TimeoutError("no go from the driver")
            time.sleep(0.001)
        deadline = time.monotonic() + cfg["max_seconds"]
        while time.monotonic() < deadline:
            stats = dp.stats()
            cap = sum(int(s["capacity"]) for s in stats)
            data = sum(data_bytes(s) for s in stats)
            size = round(math.exp(rng.uniform(lo_ln, hi_ln)))
            coin = rng.random()
            with BoundedLock(lock, cfg["lock_timeout"]):
                if ticket.value >= cfg["steps"]:
                    break
                level = data + sum(inflight[:])
                if level < cfg["low"] * cap:
                    action = "put"
                elif level > cfg["high"] * cap:
                    action = "clear"
                else:
                    # the nearer --high, the likelier a clear: the fill
                    # wanders over the band around its middle
                    action = (
                        "put" if coin < (cfg["high"] * cap - level) / ((cfg["high"] - cfg["low"]) * cap) else "clear"
                    )
                if action == "put" and level + size > cfg["high"] * cap:
                    action = "clear"
                if action == "clear" and not live:
                    # Nothing of its own to clear: a put of what still
                    # fits under the band, or wait for the others.
                    size = min(size, int(cfg["high"] * cap - level))
                    action = "put" if size >= cfg["min_size"] else "idle"
                if action != "idle":
                    ticket.value += 1
                    step = ticket.value
                if action == "put":
                    inflight[next_key % units] += size
            if action == "idle":
                res["idle_waits"] += 1
                time.sleep(0.005)
                continue
            if action == "put":
                key = next_key
                next_key += cfg["clients"]
                u = key % units
                off = int(rng.integers(0, POOL_SLACK // 64)) * 64
                val = pool[off : off + size]
                t = time.perf_counter()
                try:
                    dp.put(PARTITION, [key], {"v": [val]})
                    res["put_s"].append(time.perf_counter() - t)
                    res["puts"] += 1
                    res["put_bytes"] += size
                    live.append((key, size, off))
                except (stowage.UnitFull, stowage.Timeout) as e:
                    waited = time.perf_counter() - t
                    after = dp.stats()[u]
                    res["refused"].append(
                        {
                            "step": step,
                            "client": idx,
                            "unit": u,
                            "size": size,
                            "kind": type(e).__name__,
                            "waited_s": round(waited, 3),
                            "data_frac": round(data_bytes(after) / int(after["capacity"]), 4),
                            "free_bytes": int(after.get("free_bytes", int(after["capacity"]) - int(after["used"]))),
                            "largest_free": after.get("largest_free"),
                            "msg": str(e)[:200],
                        }
                    )
                except stowage.Error as e:
                    res["errors"].append(f"step {step} put {size}: {type(e).__name__}: {str(e)[:200]}")
                finally:
                    with BoundedLock(lock, cfg["lock_timeout"]):
                        inflight[u] -= size
            else:
                i = int(rng.integers(0, len(live)))
                key, size, off = live[i]
                live[i] = live[-1]
                live.pop()
                try:
                    if rng.random() < cfg["verify"]:
                        dst = out[:size]
                        dp.get(PARTITION, [key], "v", out={"v": [dst]})
                        res["verified"] += 1
                        if not np.array_equal(dst, pool[off : off + size]):
                            res["verify_failed"].append({"step": step, "key": key, "size": size})
                    t = time.perf_counter()
                    dp.clear(PARTITION, [key])
                    res["clear_s"].append(time.perf_counter() - t)
                    res["clears"] += 1
                except stowage.Error as e:
                    res["errors"].append(f"step {step} clear {key}: {type(e).__name__}: {str(e)[:200]}")
        res["left_live"] = len(live)
        res["left_live_bytes"] = sum(s for _, s, _ in live)
        dp.close()
        results.put({"done": res})
    except BaseException:  # noqa: BLE001 - reported to the driver
        results.put({"failed": idx, "error": traceback.format_exc()})


# ---------------------------------------------------------------------------
# the driver


class Sampler(threading.Thread):
    """Every `interval` seconds: each unit's memory (/proc/<pid>/status)
    and the data fraction of the slab (stats), until stopped."""

    def __init__(self, dp, pids, interval):
        super().__init__(daemon=True)
        self.dp, self.pids, self.interval = dp, pids, interval
        self.stop_ev = threading.Event()
        self.samples = []  # (t, {pid: mem}, data_frac or None)

    def sample(self):
        mem = {pid: proc_mem(pid) for pid in self.pids}
        try:
            stats = self.dp.stats(timeout=10.0)
            frac = sum(data_bytes(s) for s in stats) / sum(int(s["capacity"]) for s in stats)
        except Exception:  # noqa: BLE001 - a missed sample, not a failure
            frac = None
        self.samples.append((time.monotonic(), mem, frac))

    def run(self):
        while not self.stop_ev.wait(self.interval):
            self.sample()


def settle_rss(pids, timeout):
    """Wait (at most `timeout` s) until the units' RSS stops growing: a
    unit locks its slab in after it starts, and the churn's first sample
    should not count that."""
    last, same = None, 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and same < 5:
        now = sum(proc_mem(pid).get("VmRSS", 0) for pid in pids)
        same = same + 1 if now == last else 0
        last = now
        time.sleep(0.1)


def summarize_mem(samples, key):
    """first/min/max/last of the units' summed `key` over the samples."""
    vals = [sum(m.get(key, 0) for m in mem.values()) for _, mem, _ in samples if mem]
    if not vals:
        return None
    # 21 points at even times over the run, to plot or eyeball
    series = [vals[round(i * (len(vals) - 1) / 20)] for i in range(21)]
    return {
        "first": vals[0],
        "min": min(vals),
        "max": max(vals),
        "last": vals[-1],
        "samples": len(vals),
        "series": series,
    }


def sum_stat(stats, key):
    if any(key not in s for s in stats):
        return None
    return sum(int(s[key]) for s in stats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="steps over all clients together (default 2000)")
    ap.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    ap.add_argument("--units", type=int, default=1, help="storage units (default 1)")
    ap.add_argument("--slab", default="1GiB", help="slab of each unit (default 1GiB)")
    ap.add_argument("--min-size", default="1KiB", help="smallest value (default 1KiB)")
    ap.add_argument("--max-size", default="64MiB", help="largest value (default 64MiB)")
    ap.add_argument("--low", type=float, default=0.60, help="below this fill a step puts (default 0.60)")
    ap.add_argument("--high", type=float, default=0.90, help="above this fill a step clears (default 0.90)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transport", default="shm", choices=("shm", "tcp", "nixl"))
    ap.add_argument(
        "--unit-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra `stowage unit` option (repeat), e.g. --unit-arg=--huge-pages --unit-arg=4k",
    )
    ap.add_argument(
        "--verify",
        type=float,
        default=0.1,
        help="share of clears that first read the value back and compare it (default 0.1)",
    )
    ap.add_argument("--op-timeout", type=float, default=10.0, help="seconds per put/get/clear (default 10)")
    ap.add_argument("--max-seconds", type=float, default=1800.0, help="bound on the churn phase (default 1800)")
    ap.add_argument("--sample-interval", type=float, default=0.05, help="seconds between memory samples")
    ap.add_argument("--json", metavar="PATH", help="also write the JSON line to PATH")
    args = ap.parse_args()

    import stowage

    cfg = {
        "steps": args.steps,
        "clients": args.clients,
        "seed": args.seed,
        "min_size": parse_size(args.min_size),
        "max_size": parse_size(args.max_size),
        "low": args.low,
        "high": args.high,
        "verify": args.verify,
        "op_timeout": args.op_timeout,
        "max_seconds": args.max_seconds,
        "ready_timeout": 120.0,
        "lock_timeout": 60.0,
    }
    if not (0 < cfg["min_size"] <= cfg["max_size"]) or not (0 <= args.low < args.high <= 1):
        ap.error("need 0 < min-size <= max-size and 0 <= low < high <= 1")

    ctx = mp.get_context("spawn")
    procs = []
    unit_pids = []
    dp = None
    sampler = None
    ended = {}
    try:
        dp = stowage.local(
            units=args.units,
            memory=parse_size(args.slab),
            transport=args.transport,
            namespace=NAMESPACE,
            timeout=args.op_timeout,
            unit_args=args.unit_arg,
        )
        unit_pids = [(pid, start_time(pid)) for pid in dp.unit_pids]
        first = dp.stats()
        page_mode = ",".join(sorted({str(s.get("page_mode", "?")) for s in first}))
        lock = ctx.Lock()
        ticket = ctx.Value("q", 0, lock=False)
        inflight = ctx.Array("q", args.units, lock=False)
        go = ctx.Value("b", 0, lock=False)
        results = ctx.Queue()
        for i in range(args.clients):
            p = ctx.Process(
                target=client_main,
                name=f"churn-client-{i}",
                args=(i, dp.directory, cfg, lock, ticket, inflight, go, results),
            )
            p.start()
            procs.append(p)

        done, failed = [], []

        def collect(msg):
            if "done" in msg:
                done.append(msg["done"])
            elif "failed" in msg:
                failed.append(msg)

        ready = 0
        deadline = time.monotonic() + cfg["ready_timeout"]
        while ready < args.clients:
            try:
                msg = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"{ready} of {args.clients} clients ready after {cfg['ready_timeout']:.0f}s"
                ) from None
            if "ready" in msg:
                ready += 1
            else:
                collect(msg)
                if failed:
                    raise RuntimeError(f"client {failed[0]['failed']} failed:\n{failed[0]['error']}")

        settle_rss([pid for pid, _ in unit_pids], timeout=30.0)
        sampler = Sampler(dp, [pid for pid, _ in unit_pids], args.sample_interval)
        sampler.sample()  # the first sample: before any step
        before = dp.stats()
        t0 = time.monotonic()
        go.value = 1
        sampler.start()
        # a client's last call may start at its deadline and take --op-timeout
        slack = 3 * args.op_timeout + 10
        deadline = t0 + args.max_seconds + slack
        while len(done) + len(failed) < args.clients:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"clients not finished after {args.max_seconds + slack:.0f}s")
            try:
                collect(results.get(timeout=min(left, 5.0)))
            except queue.Empty:
                gone = [p for p in procs if p.exitcode is not None and p.exitcode != 0]
                if gone:
                    raise RuntimeError(f"client {gone[0].name} exited with {gone[0].exitcode}") from None
        elapsed = time.monotonic() - t0
        sampler.stop_ev.set()
        sampler.join(timeout=15)
        sampler.sample()  # the last sample: after every step
        after = dp.stats()
        if failed:
            for f in failed:
                print(f"client {f['failed']} failed:\n{f['error']}", file=sys.stderr)
            return 1
    finally:
        if sampler is not None:
            sampler.stop_ev.set()
        for p in procs:
            ended[f"client {p.name} pid {p.pid}"] = stop_client(p)
        if dp is not None:
            dp.close()  # stops the units
        for pid, started in unit_pids:
            ended[f"unit pid {pid}"] = stop_by_pid(pid, started)
        if sys.exc_info()[0] is not None:  # no report follows: say how they ended here
            print(f"processes stopped by pid: {ended}", file=sys.stderr)
    stuck = {k: v for k, v in ended.items() if v == "still running"}
    if stuck:
        print(f"processes that would not stop: {stuck}", file=sys.stderr)

    report(args, cfg, page_mode, done, before, after, sampler.samples, elapsed, ended)
    return 0


def report(args, cfg, page_mode, done, before, after, samples, elapsed, ended):
    steps = sum(r["puts"] + r["clears"] + len(r["refused"]) + len(r["errors"]) for r in done)
    refused = sorted((x for r in done for x in r["refused"]), key=lambda x: x["step"])
    refused_low = [x for x in refused if x["data_frac"] < REFUSED_TARGET_BELOW]
    errors = [e for r in done for e in r["errors"]]
    put_s = [t for r in done for t in r["put_s"]]
    clear_s = [t for r in done for t in r["clear_s"]]
    put_bytes = sum(r["put_bytes"] for r in done)
    verify_failed = [x for r in done for x in r["verify_failed"]]

    comp = {}
    for key in ("compaction_bytes", "compaction_moves", "compaction_micros"):
        b, a = sum_stat(before, key), sum_stat(after, key)
        comp[key] = None if b is None or a is None else a - b
    comp_per_step = None if comp["compaction_bytes"] is None else comp["compaction_bytes"] / max(1, steps)

    # The fill over the run, from the time it first reached --low.
    fracs = [f for _, _, f in samples if f is not None]
    reached = next((i for i, f in enumerate(fracs) if f >= args.low), None)
    band = fracs[reached:] if reached is not None else []
    fill = None
    if band:
        inside = sum(1 for f in band if args.low - 0.02 <= f <= args.high + 0.02)
        fill = {
            "min": round(min(band), 4),
            "mean": round(sum(band) / len(band), 4),
            "max": round(max(band), 4),
            "in_band_share": round(inside / len(band), 4),
            "samples": len(band),
        }
    mem = {k: summarize_mem(samples, k) for k in ("VmRSS", "RssAnon", "RssShmem")}

    unit_word = "unit" if args.units == 1 else "units"
    print()
    print(
        f"churn: {args.clients} client processes, {steps} steps, {args.units} {unit_word} of "
        f"{fmt_size(parse_size(args.slab))} ({args.transport}, {page_mode} pages), values "
        f"{fmt_size(cfg['min_size'])}-{fmt_size(cfg['max_size'])} log-uniform, fill band "
        f"{args.low:.0%}-{args.high:.0%}, seed {args.seed}"
    )
    rows = []
    rows.append(
        (
            "steps/s",
            f"{steps / elapsed:.1f}",
            f"{steps} steps in {elapsed:.1f} s: {sum(r['puts'] for r in done)} puts "
            f"({fmt_size(put_bytes)}), {sum(r['clears'] for r in done)} clears",
        )
    )
    rows.append(
        (
            "refused puts",
            f"{len(refused)}",
            f"{len(refused_low)} with data < {REFUSED_TARGET_BELOW:.0%} of the slab (target 0)",
        )
    )
    if refused:
        shown = " ".join(f"{x['data_frac']:.2f}" for x in refused[:16]) + (" ..." if len(refused) > 16 else "")
        fr = [x["data_frac"] for x in refused]
        rows.append(("  data fraction at each", f"{min(fr):.2f}-{max(fr):.2f}", shown))
        kinds = {}
        for x in refused:
            kinds[x["kind"]] = kinds.get(x["kind"], 0) + 1
        sizes = [x["size"] for x in refused]
        free = [x["free_bytes"] for x in refused]
        rows.append(
            (
                "  refused values",
                ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
                f"sizes {fmt_size(min(sizes))}-{fmt_size(max(sizes))}, median {fmt_size(quantile(sizes, 0.5))}; "
                f"{fmt_size(min(free))}-{fmt_size(max(free))} free at the refusals",
            )
        )
        largest = [x["largest_free"] for x in refused if x.get("largest_free") is not None]
        if largest:
            rows.append(
                ("  largest free range", fmt_size(max(largest)), f"max at the refusals; min {fmt_size(min(largest))}")
            )
    if fill:
        rows.append(
            (
                "fill (data/slab)",
                f"{fill['mean']:.2f}",
                f"mean; min {fill['min']:.2f}, max {fill['max']:.2f} once first at {args.low:.0%}; "
                f"{fill['in_band_share']:.0%} of {fill['samples']} samples in band (+-2%)",
            )
        )
    if comp_per_step is None:
        rows.append(("compaction bytes/step", "n/a", "the unit reports no compaction_bytes / compaction_moves"))
    else:
        rows.append(
            (
                "compaction bytes/step",
                fmt_size(comp_per_step),
                f"{fmt_size(comp['compaction_bytes'])} in {comp['compaction_moves']} moves"
                + (
                    ""
                    if not comp["compaction_micros"]
                    else f", {comp['compaction_micros'] / 1e6:.2f} s of copying"
                    f" ({comp['compaction_bytes'] / comp['compaction_micros'] / 1e3:.1f} GB/s)"
                ),
            )
        )
    for key, what in (
        ("VmRSS", "unit RSS (VmRSS)" if args.units == 1 else "units' RSS (VmRSS, sum)"),
        ("RssAnon", "  of it RssAnon (heap)"),
        ("RssShmem", "  of it RssShmem (slab)"),
    ):
        m = mem[key]
        if m:
            rows.append(
                (
                    what,
                    f"{m['max'] / MiB:.1f} MiB",
                    f"max; first {m['first'] / MiB:.1f}, min {m['min'] / MiB:.1f}, last {m['last'] / MiB:.1f} "
                    f"({m['samples']} samples)",
                )
            )
    rows.append(
        (
            "put latency",
            f"{quantile(put_s, 0.5) * 1e3:.2f} ms",
            f"p50; p99 {quantile(put_s, 0.99) * 1e3:.2f} ms; clear p50 {quantile(clear_s, 0.5) * 1e3:.2f} ms",
        )
    )
    rows.append(("verified values", f"{sum(r['verified'] for r in done)}", f"{len(verify_failed)} read back wrong"))
    if errors:
        rows.append(("other errors", f"{len(errors)}", errors[0][:100]))
    hows = {}
    for how in ended.values():
        hows[how] = hows.get(how, 0) + 1
    rows.append(
        (
            "processes stopped",
            f"{len(ended)}",
            ", ".join(f"{n} {h}" for h, n in sorted(hows.items())) + " (by pid, at the end)",
        )
    )
    w = max(len(r[0]) for r in rows)
    v = max(len(r[1]) for r in rows)
    for name, val, note in rows:
        print(f"  {name:<{w}} | {val:>{v}} | {note}".rstrip(" |"))

    line = {
        "bench": "churn",
        "clients": args.clients,
        "steps": steps,
        "units": args.units,
        "slab_bytes": parse_size(args.slab),
        "transport": args.transport,
        "page_mode": page_mode,
        "min_size": cfg["min_size"],
        "max_size": cfg["max_size"],
        "low": args.low,
        "high": args.high,
        "seed": args.seed,
        "elapsed_s": round(elapsed, 3),
        "steps_per_s": round(steps / elapsed, 2),
        "puts": sum(r["puts"] for r in done),
        "clears": sum(r["clears"] for r in done),
        "put_bytes": put_bytes,
        "refused": len(refused),
        "refused_below_95": len(refused_low),
        "refused_data_frac": [x["data_frac"] for x in refused],
        "refusals": refused,
        "compaction_bytes": comp["compaction_bytes"],
        "compaction_moves": comp["compaction_moves"],
        "compaction_micros": comp["compaction_micros"],
        "compaction_bytes_per_step": comp_per_step,
        "fill": fill,
        "unit_mem": mem,
        "put_p50_ms": round(quantile(put_s, 0.5) * 1e3, 3),
        "put_p99_ms": round(quantile(put_s, 0.99) * 1e3, 3),
        "clear_p50_ms": round(quantile(clear_s, 0.5) * 1e3, 3),
        "verified": sum(r["verified"] for r in done),
        "verify_failed": verify_failed,
        "errors": errors,
        "idle_waits": sum(r["idle_waits"] for r in done),
        "stopped": ended,
    }
    text = json.dumps(line)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
