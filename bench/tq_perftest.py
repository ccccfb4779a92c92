#!/usr/bin/env python3
"""TransferQueue's own perftest (scripts/performance_test/perftest.py, shipped
in the transferqueue wheel) against stowage, SimpleStorage and
MooncakeStore, with the same arguments, each on a private local Ray
instance.

    STOWAGE_TQ_VENV=... scripts/test-tq -k nothing   # or any venv with transferqueue + stowage
    $VENV/bin/python bench/tq_perftest.py [--backends stowage,simple,mooncake] [--out DIR] \\
        [-- perftest arguments, default: the default case]

Each backend runs in its own process (one Ray instance each,
``address="local"``, never a ``ray start`` cluster of the machine), with
stowage registered in every Ray worker through
``stowage.tq_worker.setup_worker``. The perftest's ``main()`` runs
unchanged; its CSV goes to OUT/<backend>.csv, the summary table
(per-iteration put/get/total Gb/s, the median, the load average) to
stdout and OUT/summary.md. MooncakeStore needs ``mooncake_master`` on PATH
(the venv's bin/); its bootstrap kills any ``mooncake_master`` by name and
leaves its own running, which this script then stops by pid.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {
    "stowage": os.path.join(HERE, "tq", "stowage.yaml"),
    "simple": os.path.join(HERE, "tq", "simple.yaml"),
    "mooncake": os.path.join(HERE, "tq", "mooncake.yaml"),
}

_CHILD = r"""
import os, runpy, sys
import ray
import transfer_queue
import stowage.tq  # registers Stowage in this process too
ray.init(address="local", num_cpus=8, include_dashboard=False,
         runtime_env={"worker_process_setup_hook": "stowage.tq_worker.setup_worker"})
ip = ray.util.get_node_ip_address()
script = os.path.join(os.path.dirname(os.path.dirname(transfer_queue.__file__)),
                      "scripts", "performance_test", "perftest.py")
sys.argv = [script, "--head_node_ip", ip] + sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    ray.shutdown()
"""


def _mooncake_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-x", "mooncake_master"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def run(backend: str, out: str, extra: list[str]) -> tuple[list[dict], float, str]:
    csv_path = os.path.join(out, f"{backend}.csv")
    log_path = os.path.join(out, f"{backend}.log")
    before = set(_mooncake_pids())
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run(
            [sys.executable, "-c", _CHILD, "--backend_config", CONFIGS[backend], "--output_csv", csv_path, *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env, timeout=1800,
        ).returncode
    wall = time.monotonic() - t0
    for pid in set(_mooncake_pids()) - before:  # what this run's bootstrap started
        try:
            os.kill(pid, 15)
        except ProcessLookupError:
            pass
    if rc != 0 or not os.path.exists(csv_path):
        return [], wall, f"failed (exit {rc}; see {log_path})"
    with open(csv_path) as f:
        return list(csv.DictReader(f)), wall, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="stowage,simple,mooncake")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "tq"))
    ap.add_argument("perftest_args", nargs="*", help="after --: passed to perftest.py as they are")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for b in args.backends.split(","):
        load = os.getloadavg()[0]
        res, wall, err = run(b, args.out, args.perftest_args)
        rows.append((b, res, wall, err, load))
        print(f"{b}: {err or 'done'} in {wall:.0f} s", flush=True)
    lines = [
        f"perftest arguments: {' '.join(args.perftest_args) or '(defaults: 1024 rows x 10 fields x 8192 float32, 4 iterations)'}",
        f"machine: {os.cpu_count()} CPUs; load average before each run in the table",
        "",
        "| backend | put Gb/s per iteration | get Gb/s per iteration | total Gb/s per iteration | total, median | load avg | wall |",
        "|---|---|---|---|---|---|---|",
    ]
    med = {}
    for b, res, wall, err, load in rows:
        if err:
            lines.append(f"| {b} | {err} | | | | {load:.1f} | {wall:.0f} s |")
            continue
        f = lambda k: ", ".join(f"{float(r[k]):.2f}" for r in res)  # noqa: E731
        med[b] = statistics.median(float(r["total_gbit_per_sec"]) for r in res)
        lines.append(
            f"| {b} | {f('put_gbit_per_sec')} | {f('get_gbit_per_sec')} | {f('total_gbit_per_sec')} "
            f"| {med[b]:.2f} | {load:.1f} | {wall:.0f} s |"
        )
    if "stowage" in med:
        lines.append("")
        for other in ("simple", "mooncake"):
            if other in med:
                lines.append(f"stowage / {other} (median total): {med['stowage'] / med[other]:.1f}x")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "summary.md"), "w") as fh:
        fh.write(text + "\n")


if __name__ == "__main__":
    main()
