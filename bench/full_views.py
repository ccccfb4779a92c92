#!/usr/bin/env python3
"""How long a put short of memory that views hold takes to fail (issue 37,
"full means full"): the two stall cases of the issue, as a user meets
them, with separate processes.

    .venv/bin/python bench/full_views.py [--slab 64MiB] [--value 30MiB]
                                         [--seconds 10] [--timeout 8]

(a) A viewer process puts a --value value (row 0) and views it; with
    ``--held 2`` (default) it replaces the value and views the new one too;
    then it clears the row, so its views alone keep the bytes. Then it
    puts a --value value itself (its own views hold the memory), and a
    writer process puts one (another's views). Each put's time to its
    answer is printed, with the answer (the target: ``UnitFull`` within
    100 ms, its message naming the views). Then a writer with
    ``wait_for_memory`` puts while the views are held; the viewer drops
    them, and the time from the drop to the put's return is printed (the
    put goes in as soon as the views are dropped).

(b) Four processes churn one unit of --slab for --seconds: each puts
    values of 2-8 MiB into rows of its own (replacing earlier ones),
    clears rows, and keeps views of its last three values (values it
    replaces or clears under its views). Each put that fails is timed; the
    table gives the answers and the time to each. After a refusal a
    process clears a row, and drops its oldest view when the error says its
    own views hold memory (without that, views of all four can hold the
    whole unit and every put is refused: full is full).

Every call has a deadline of --timeout seconds (the issue's runs: 8 s for
(a), 60 s for (b)); a put that was answered Busy until then is a
``Timeout``. No figure is a pass/fail: this is a benchmark.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time

import numpy as np

import stowage

MIB = 1 << 20


def parse_size(s: str) -> int:
    s = s.strip()
    for suffix, mult in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


def timed_put(dp, partition, row, value):
    """(seconds, answer): "ok", or the exception's class and message."""
    t = time.perf_counter()
    try:
        dp.put(partition, [row], {"v": [value]})
        answer = "ok"
    except stowage.Error as e:
        answer = f"{type(e).__name__}: {e}"
    return time.perf_counter() - t, answer


def viewer_main(directory, cfg, to_parent, from_parent):
    dp = stowage.connect(directory, namespace="fv", timeout=cfg["timeout"])
    value = np.full(cfg["value"], 1, dtype=np.uint8)
    views = []
    dp.put("a", [0], {"v": [value]})
    views.append(dp.get_view("a", [0], "v"))
    for _ in range(cfg["held"] - 1):
        dp.put("a", [0], {"v": [value]})
        views.append(dp.get_view("a", [0], "v"))
    dp.clear("a", [0])
    to_parent.put(("own", timed_put(dp, "a", 1, value)))
    from_parent.get()
    views.clear()
    to_parent.put(("dropped", time.perf_counter()))
    from_parent.get()


def writer_main(directory, cfg, wait, to_parent):
    dp = stowage.connect(
        directory, namespace="fv", timeout=cfg["timeout"], wait_for_memory=wait
    )
    value = np.full(cfg["value"], 2, dtype=np.uint8)
    # Reach the unit first: the time below is the put's alone.
    dp.stats()
    to_parent.put(("ready", None))
    took, answer = timed_put(dp, "a", 2, value)
    to_parent.put(("put", (took, answer, time.perf_counter())))


def case_a(args, ctx):
    cfg = {"value": parse_size(args.value), "timeout": args.timeout, "held": args.held}
    with stowage.local(units=1, memory=parse_size(args.slab), namespace="fv") as dp:
        to_parent, from_parent = ctx.Queue(), ctx.Queue()
        viewer = ctx.Process(target=viewer_main, args=(dp.directory, cfg, to_parent, from_parent))
        viewer.start()
        _, (took, answer) = to_parent.get(timeout=120)
        print(f"(a) viewer's own put, {cfg['held']} x {args.value} under its views:")
        print(f"    {took * 1e3:9.1f} ms  {answer}")
        q = ctx.Queue()
        w = ctx.Process(target=writer_main, args=(dp.directory, cfg, None, q))
        w.start()
        q.get(timeout=120)
        _, (took, answer, _) = q.get(timeout=120)
        w.join()
        print("(a) another process's put:")
        print(f"    {took * 1e3:9.1f} ms  {answer}")
        q = ctx.Queue()
        w = ctx.Process(target=writer_main, args=(dp.directory, cfg, args.timeout, q))
        w.start()
        q.get(timeout=120)
        time.sleep(1.0)
        from_parent.put("drop")
        _, dropped = to_parent.get(timeout=120)
        _, (took, answer, returned) = q.get(timeout=120)
        w.join()
        from_parent.put("exit")
        viewer.join()
        print("(a) a put with wait_for_memory, the views dropped 1 s after it began:")
        print(
            f"    {took * 1e3:9.1f} ms in all, returned {(returned - dropped) * 1e3:.1f} ms "
            f"after the drop  {answer}"
        )


def churner_main(i, directory, cfg, go, results):
    dp = stowage.connect(directory, namespace="fv", timeout=cfg["timeout"])
    rng = random.Random(i)
    pool = np.frombuffer(rng.randbytes(8 * MIB), dtype=np.uint8)
    views, rows = [], list(range(i * 100, i * 100 + 8))
    refused, ok = [], 0
    while not go.value:
        time.sleep(0.01)
    end = time.monotonic() + cfg["seconds"]
    while time.monotonic() < end:
        row = rng.choice(rows)
        if rng.random() < 0.25:
            dp.clear("b", [row])
            continue
        size = rng.randint(2 * MIB, 8 * MIB)
        took, answer = timed_put(dp, "b", row, pool[:size])
        if answer == "ok":
            ok += 1
            views.append(dp.get_view("b", [row], "v"))
            del views[:-3]
        else:
            refused.append((took, answer))
            # A user making room, as the error says: drop its oldest view
            # when they are its own, and clear a row of its own.
            if "own views" in answer and views:
                views.pop(0)
            dp.clear("b", [rng.choice(rows)])
    views.clear()
    results.put((i, ok, refused))


def case_b(args, ctx):
    cfg = {"timeout": args.timeout, "seconds": args.seconds}
    with stowage.local(units=1, memory=parse_size(args.slab), namespace="fv") as dp:
        go = ctx.Value("b", 0, lock=False)
        results = ctx.Queue()
        procs = [
            ctx.Process(target=churner_main, args=(i, dp.directory, cfg, go, results))
            for i in range(4)
        ]
        for p in procs:
            p.start()
        time.sleep(2.0)
        go.value = 1
        got = [results.get(timeout=args.seconds + 10 * args.timeout + 120) for _ in procs]
        for p in procs:
            p.join()
    ok = sum(g[1] for g in got)
    refused = [r for g in got for r in g[2]]
    print(f"(b) 4 processes, {args.seconds} s on a {args.slab} unit, 3 views each: {ok} puts in")
    kinds = {}
    for took, answer in refused:
        kinds.setdefault(answer.split(":")[0], []).append(took)
    for kind, times in sorted(kinds.items()):
        ms = sorted(t * 1e3 for t in times)
        p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
        over = sum(1 for t in ms if t > 100)
        print(
            f"    {len(ms):5d} {kind:10s} time to the answer: median {statistics.median(ms):.1f} ms, "
            f"p99 {p99:.1f} ms, max {ms[-1]:.1f} ms, {over} over 100 ms"
        )
    views_named = [a for _, a in refused if "views of cleared or replaced values" in a]
    print(f"    UnitFull naming views: {len(views_named)}")
    if views_named:
        print(f"    e.g. {views_named[0]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slab", default="64MiB")
    ap.add_argument("--value", default="30MiB")
    ap.add_argument("--held", type=int, default=2, help="values under the viewer's views (a)")
    ap.add_argument("--seconds", type=float, default=10.0, help="churn time (b)")
    ap.add_argument("--timeout", type=float, default=8.0, help="each call's deadline, s")
    ap.add_argument("--case", choices=["a", "b", "both"], default="both")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    if args.case in ("a", "both"):
        case_a(args, ctx)
    if args.case in ("b", "both"):
        case_b(args, ctx)


if __name__ == "__main__":
    main()
