#!/usr/bin/env python3
"""stowage side by side with Mooncake Store, Ray's object store and the
machine's limits, all measured in one run.

    scripts/bench-setup && .venv-bench/bin/python bench/compare.py [--quick]
        [--workloads sizes,latency,grpo-step,dapo-churn,disk,scaling,big-batch,zero-copy,partial,kill]
        [--systems stowage,mooncake,ray] [--rounds 5] [--out bench/results] [--publish]

Each system runs in its own runner process (bench/run_system.py); the
whole Mooncake side (its master, the processes that own its memory and its
benchmark clients) runs inside a private network namespace made here with
`unshare --net`, because Mooncake's transfer engine listens on every
interface. The limits (libc memcpy on cold buffers, a Python socket pair with
request/reply, a tuned TCP stream, sequential disk I/O) run in a runner of
their own, in the same run. The runners go in interleaved rounds (limits,
stowage, Mooncake, Ray, limits, ...; --rounds, default 5); every figure is
reported as the median and [min-max] over the rounds. Writes OUT/results.json (every
figure and the machine), OUT/results.md (tables, ratios, targets) and
OUT/results.png (the chart); runner logs go to OUT/logs/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import selectors
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402  (drops OPENBLAS_* overrides for this process and its children)

ALL_WORKLOADS = ["sizes", "latency", "grpo-step", "dapo-churn", "disk", "scaling", "big-batch", "zero-copy",
                 "partial", "kill"]
ALL_SYSTEMS = ["stowage", "mooncake", "ray"]

# Rough seconds per (system, workload), quick and full: the progress bar's
# weights, so that its ETA means something.
WEIGHTS = {
    True: {"sizes": 20, "latency": 8, "grpo-step": 20, "dapo-churn": 15, "disk": 20, "scaling": 20,
           "big-batch": 10, "zero-copy": 5, "partial": 5, "kill": 5},
    False: {"sizes": 40, "latency": 12, "grpo-step": 50, "dapo-churn": 20, "disk": 25, "scaling": 30,
            "big-batch": 25, "zero-copy": 8, "partial": 8, "kill": 5},
}
SYSTEM_SCALE = {"limits": 0.5, "stowage": 2.0, "mooncake": 1.5, "ray": 2.0}


def machine() -> dict:
    def read(path):
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return ""

    cpu = next((ln.split(":", 1)[1].strip() for ln in read("/proc/cpuinfo").splitlines() if ln.startswith("model name")), platform.processor())
    mem = next((int(ln.split()[1]) * 1024 for ln in read("/proc/meminfo").splitlines() if ln.startswith("MemTotal")), None)
    versions = {}
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ["numpy", "matplotlib", "tqdm", "ray", "mooncake-transfer-engine-non-cuda", "stowage", "ml_dtypes"]:
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {
        "cores": os.cpu_count(), "memory_bytes": mem, "cpu_model": cpu,
        "kernel": platform.release(), "os": platform.platform(), "python": platform.python_version(),
        "packages": versions, "git_commit": commit, "git_dirty": dirty,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def netns_available() -> str:
    """'' when a private network namespace can be made here, else why not."""
    for tool in ("unshare", "ip"):
        if not shutil.which(tool):
            return f"`{tool}` is missing (apt-get install util-linux iproute2)"
    try:
        p = subprocess.run(["unshare", "--net", "--", "ip", "link", "set", "lo", "up"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unshare --net failed: {e}"
    if p.returncode != 0:
        return f"unshare --net failed (root or CAP_SYS_ADMIN needed): {p.stderr.strip()}"
    return ""


def importable(system: str) -> str:
    """'' when the system's Python package imports in this environment."""
    mod = {"stowage": "stowage", "mooncake": "mooncake.store", "ray": "ray"}[system]
    p = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        hint = " (run scripts/bench-setup)" if system != "stowage" else " (run scripts/bench-setup; it builds the wheel)"
        return f"cannot import {mod}: {last}{hint}"
    return ""


def run_runner(system, workloads, args, bar, base, weight, logdir, round_no=0) -> dict:
    """Start bench/run_system.py for `system`, follow its progress, return
    its result; stop it (its whole process group, by id) if it overruns."""
    cmd = [sys.executable, os.path.join(HERE, "run_system.py"), "--system", system,
           "--workloads", ",".join(workloads), "--disk-dir", args.disk_dir, "--round", str(round_no)]
    if args.quick:
        cmd.append("--quick")
    if system == "mooncake":
        cmd = ["unshare", "--net", "--", "bash", "-c", 'ip link set lo up && exec "$0" "$@"'] + cmd
    env = dict(os.environ, BENCH_LOGDIR=logdir, PYTHONUNBUFFERED="1", GLOG_minloglevel="1")
    log = open(os.path.join(logdir, f"{system}.log"), "ab")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                            env=env, cwd=ROOT, start_new_session=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + args.timeout
    result = None
    partial = {}
    buf = b""
    order = [w for w in ALL_WORKLOADS if w in workloads]
    share = weight / max(1, len(order))
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{system} runner overran {args.timeout:.0f}s")
            if not sel.select(min(left, 1.0)):
                bar.refresh()
                continue
            chunk = os.read(proc.stdout.fileno(), 1 << 20)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("ev") == "progress":
                    wl = ev["workload"]
                    i = order.index(wl) if wl in order else 0
                    target = base + share * (i + ev["frac"])
                    if target > bar.n:
                        bar.update(target - bar.n)
                    bar.set_description(f"{system}: {wl} {ev.get('what', '')}"[:60])
                elif ev.get("ev") == "partial":
                    partial[ev["name"]] = ev["result"]
                elif ev.get("ev") == "result":
                    result = ev["result"]
        proc.wait(timeout=60)
    except (TimeoutError, subprocess.TimeoutExpired) as e:
        # what finished before the overrun, as the runner reported it
        result = {"system": system, "error": str(e), "completed_before_error": partial}
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the runner unwinds and stops what it started
            proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
    finally:
        sel.close()
        log.close()
    if result is None:
        with open(os.path.join(logdir, f"{system}.log"), errors="replace") as f:
            tail = f.read()[-800:]
        result = {"system": system, "error": f"runner exited with {proc.returncode} and no result; log tail: {tail}"}
    if bar.n < base + weight:
        bar.update(base + weight - bar.n)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer iterations (a few minutes on 2 cores)")
    ap.add_argument("--workloads", default=",".join(ALL_WORKLOADS))
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--disk-dir", default=os.path.join(ROOT, "target", "bench-disk"),
                    help="the disk tier's directory (and where the disk limit is measured)")
    ap.add_argument("--publish", action="store_true",
                    help="also put the tables into docs/benchmarks.md and the chart into docs/benchmarks.png")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per system runner and round (default 600 quick, 900 full)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved rounds (limits, stowage, Mooncake, Ray, then again ...); figures are the median "
                         "and [min-max] over rounds (default 5; 2 with --quick)")
    args = ap.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    systems = [s for s in args.systems.split(",") if s]
    for w in workloads:
        if w not in ALL_WORKLOADS:
            ap.error(f"unknown workload {w!r} (choose from {', '.join(ALL_WORKLOADS)})")
    for s in systems:
        if s not in ALL_SYSTEMS:
            ap.error(f"unknown system {s!r} (choose from {', '.join(ALL_SYSTEMS)})")
    if args.timeout is None:
        args.timeout = 600.0 if args.quick else 900.0
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    args.out = os.path.abspath(args.out)
    args.disk_dir = os.path.abspath(args.disk_dir)
    logdir = os.path.join(args.out, "logs")
    os.makedirs(logdir, exist_ok=True)
    os.makedirs(args.disk_dir, exist_ok=True)

    from tqdm import tqdm

    import report

    started = time.time()
    runners = ["limits"] + systems
    weights = {s: SYSTEM_SCALE[s] * sum(WEIGHTS[args.quick][w] for w in workloads) for s in runners}
    results = {"machine": machine(), "config": {"quick": args.quick, "workloads": workloads, "systems": systems,
                                               "rounds": args.rounds, "units": common.UNITS, "workers": common.WORKERS,
                                               "sizes_units": common.SIZES_UNITS, "disk_dir": args.disk_dir,
                                               "shapes": common.shapes(args.quick)},
               "rounds": []}
    bar = tqdm(total=args.rounds * sum(weights.values()), unit="s",
               bar_format="{desc:<60} {percentage:3.0f}%|{bar}| {elapsed}<{remaining}", dynamic_ncols=True)
    base = 0.0
    skip = {}
    for s in runners:
        why = ""
        if s not in ("limits", "stowage"):  # without its package, stowage falls back to its CLI
            why = importable(s)
            if not why and s == "mooncake":
                why = netns_available()
        if why:
            skip[s] = why
            tqdm.write(f"{s}: not measured: {why}")
    for rnd in range(args.rounds):
        one = {"round": rnd, "systems": {}, "load_before": os.getloadavg()}
        for s in runners:
            if s in skip:
                one["systems"][s] = {"system": s, "error": f"not measured: {skip[s]}"}
                bar.update(weights[s])
            else:
                r = run_runner(s, workloads, args, bar, base, weights[s], logdir, rnd)
                if s == "limits":
                    one["limits"] = r
                else:
                    one["systems"][s] = r
                if "error" in r:
                    tqdm.write(f"round {rnd}: {s}: {r['error']}")
            base += weights[s]
        results["rounds"].append(one)
        # what is done so far survives an interrupted run
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    bar.close()
    results["elapsed_s"] = time.time() - started
    results["summary"] = report.summarize(report.merged(results))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    md = report.markdown(results)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    try:
        report.chart(results, os.path.join(args.out, "results.png"))
    except Exception as e:  # noqa: BLE001 - the tables stand without the chart
        print(f"chart not written: {type(e).__name__}: {e}", file=sys.stderr)
    if args.publish:
        report.publish(args.out, os.path.join(ROOT, "docs", "benchmarks.md"))
    print(md)
    print(f"wrote {args.out}/results.json, results.md, results.png ({results['elapsed_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
