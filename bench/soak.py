"""Soak: an RL job's steps for a bounded time against units with a disk
tier, watching the units for anything that grows (issue 37).

    .venv/bin/python bench/soak.py [--minutes 10] [--rows 1024] [--units 2]
                                   [--memory 64MiB] [--trainers 2] [--rollouts 2]
                                   [--rollout-steps 4] [--kill-every 3] [--json PATH]

The driver starts the units as a user does (`stowage.local`: `stowage unit`
child processes with a disk tier under a temporary directory, memory small
enough that every step crosses the high watermark), then runs GRPO-shaped
steps until --minutes have passed:

- rollout processes (--rollouts at a time, spawned interpreters that
  connect with the plane's directory) put the step's batch: --rows jagged
  rows (512-4,096 tokens) x 3 fields (input_ids int64,
  generation_logprobs bfloat16, token_mask int32), each its share of the
  rows in one call. A rollout lives --rollout-steps steps, then ends; its
  replacement is spawned a step ahead. Every --kill-every-th one to end is
  SIGKILLed by the driver while it loops putting an extra batch (a
  partition nobody reads, cleared by the driver afterwards): most likely
  mid-put. Of the others, every second one closes its client before it
  exits and every other one just exits.
- trainer processes (--trainers) live for the whole run. Each step each
  views its share of the batch (get_view, 3 fields), gets another
  trainer's share of input_ids (a copy), puts a written-back field
  (advantages, bfloat16) on its rows, clears its rows of the previous step
  while still holding their views, and only then drops those views: views
  are held across one step, and cleared values stay pinned under them.
  A few values per step are compared with a regeneration.

Every minute it prints the op rate (client calls of all processes per
second, and the bytes they moved), the p99 latency of each kind of call
(put, get, view, clear), the views that came back "in the disk tier, no
room to bring it back" and were read with a copying get instead (as the
error says; not an error), and, per unit process, at the minute's last
sample: RSS (VmRSS), heap, open fds (/proc/<pid>/fd), threads (Threads
in /proc/<pid>/status), its index bytes, disk bytes, the bytes its disk
tier wrote and read in the minute, and its sessions (from its stats). The
driver samples between steps, every client idle, at the first step end
--sample-every seconds after the previous sample: always the same point
of a step (its views held, the previous step's rows cleared). "heap" here
is RssAnon: the unit's private anonymous resident memory (allocator heap,
thread stacks, and the small interpreter that boots the unit), which
excludes its slab (a shared memfd, RssShmem) and the pages of its binary
(RssFile); the unit's own account of its index is `index`.

At the end it prints, per unit, each of those figures' slope: a least
squares line through the samples after the warm-up (the first minute, or a
tenth of a shorter run), per 10 minutes, as a percentage of the first
sample after the warm-up; the op rate's trend the same way (over 20 s
windows); and "errors: N (besides the K kills it caused)", where an error
is any failed call, wrong value, process that died unasked or step that
did not finish in --step-timeout. Then one JSON line with every figure.
No figure is a pass/fail: this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402  (drops the OPENBLAS overrides as it loads)
import numpy as np  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

NAMESPACE = "soak"
PARTITION = "soak"
DOOMED = "doomed"  # the killed rollouts' extra batches
# (field, dtype, field number for common.value)
FIELDS = [("input_ids", "int64", 0), ("generation_logprobs", "bfloat16", 1), ("token_mask", "int32", 5)]
FIELD_NAMES = [f for f, _, _ in FIELDS]
WRITEBACK = ("advantages", "bfloat16", 4)
KINDS = ("put", "get", "view", "clear")
DOOM_ROWS = 128  # rows of 4,096 tokens x 3 fields per extra put of a rollout to be killed


def parse_size(text: str) -> int:
    t = text.strip()
    for suffix, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("G", GiB), ("M", MiB), ("K", KiB), ("B", 1)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def step_lengths(cfg: dict, step: int) -> np.ndarray:
    return common.lengths(cfg["rows"], seed=1_000_003 + step)


def key(cfg: dict, step: int, row: int) -> int:
    return step * cfg["rows"] + row


def make_value(row: int, field: tuple, length: int, step: int):
    _, dt, num = field
    return common.value(row, num, int(length), dt, version=step)


def same_bytes(a, b) -> bool:
    return np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


class Ops:
    """A process's record of its calls: (kind, end time, seconds, bytes)."""

    def __init__(self):
        self.rec = []
        self.errors = []
        self.fallbacks = 0  # views that came back as "in the disk tier, no room": read with get

    def call(self, kind, nbytes, fn, *a, **kw):
        t = time.monotonic()
        out = fn(*a, **kw)
        e = time.monotonic()
        self.rec.append((kind, e, e - t, nbytes))
        return out

    def take(self):
        rec, err, fb = self.rec, self.errors, self.fallbacks
        self.rec, self.errors, self.fallbacks = [], [], 0
        return rec, err, fb


def nbytes_of(cols: dict) -> int:
    return sum(int(a.nbytes) for vals in cols.values() for a in vals)


# ---------------------------------------------------------------------------
# the client processes: commands and answers over a Pipe of their own (a
# killed process can corrupt only its own pipe)


def recv_bounded(conn, seconds: float):
    if not conn.poll(seconds):
        raise TimeoutError(f"no command from the driver in {seconds:.0f}s")
    return conn.recv()


def rollout_main(slot, gen, directory, cfg, conn):
    ops = Ops()
    try:
        import stowage

        dp = stowage.connect(directory, namespace=NAMESPACE, timeout=cfg["op_timeout"])
        conn.send(("ready", os.getpid()))
        while True:
            cmd = recv_bounded(conn, cfg["idle_timeout"])
            if cmd[0] == "put":
                _, step, doom = cmd
                lens = step_lengths(cfg, step)
                rows = list(range(slot, cfg["rows"], cfg["rollouts"]))
                cols = {f[0]: [make_value(r, f, lens[r], step) for r in rows] for f in FIELDS}
                keys = [key(cfg, step, r) for r in rows]
                try:
                    ops.call("put", nbytes_of(cols), dp.put, PARTITION, keys, cols)
                except stowage.Error as e:
                    ops.errors.append(f"rollout {slot}.{gen} step {step} put: {type(e).__name__}: {str(e)[:300]}")
                conn.send(("done", *ops.take()))
                if doom:
                    # An extra batch, put again and again under new keys
                    # until the driver's SIGKILL: nearly all of the loop is
                    # inside put.
                    extra = {f[0]: [make_value(r, f, 4096, step) for r in range(DOOM_ROWS)] for f in FIELDS}
                    conn.send(("dooming",))
                    n = 0
                    deadline = time.monotonic() + cfg["idle_timeout"]
                    while time.monotonic() < deadline:
                        base = (os.getpid() << 24) + n * DOOM_ROWS
                        try:
                            dp.put(DOOMED, list(range(base, base + DOOM_ROWS)), extra)
                        except stowage.Error:
                            pass  # full of doomed batches: the kill comes anyway
                        n += 1
                    return
            elif cmd[0] == "exit":
                conn.send(("bye", *ops.take()))
                if cmd[1]:
                    dp.close()
                    return
                os._exit(0)  # no close, no interpreter teardown: the connections just end
            else:
                raise ValueError(f"unknown command {cmd!r}")
    except BaseException:  # noqa: BLE001 - reported to the driver
        try:
            conn.send(("failed", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass


def trainer_main(idx, directory, cfg, conn):
    ops = Ops()
    try:
        import stowage

        dp = stowage.connect(directory, namespace=NAMESPACE, timeout=cfg["op_timeout"])
        T = cfg["trainers"]
        mine = list(range(idx, cfg["rows"], T))
        other = list(range((idx + 1) % T, cfg["rows"], T))
        held = None  # the previous step's views
        rng = random.Random(idx)
        conn.send(("ready", os.getpid()))
        while True:
            cmd = recv_bounded(conn, cfg["idle_timeout"])
            if cmd[0] == "exit":
                held = None
                dp.close()
                conn.send(("bye", *ops.take()))
                return
            _, step = cmd
            lens = step_lengths(cfg, step)
            keys = [key(cfg, step, r) for r in mine]
            where = f"trainer {idx} step {step}"
            views = None
            try:
                nb = sum(int(lens[r]) for r in mine) * (8 + 2 + 4)
                try:
                    views = ops.call("view", nb, dp.get_view, PARTITION, keys, FIELD_NAMES)
                except stowage.TransferFailed as e:
                    if e.in_flight:
                        raise
                    # A value in the disk tier that the slab has no room
                    # to bring back: a copying get, as the client says
                    # (and as stowage's TransferQueue manager does).
                    ops.fallbacks += 1
                    views = ops.call("get", nb, dp.get, PARTITION, keys, FIELD_NAMES)
                for _ in range(cfg["verify"]):
                    i = rng.randrange(len(mine))
                    f = FIELDS[rng.randrange(len(FIELDS))]
                    if not same_bytes(views[f[0]][i], make_value(mine[i], f, lens[mine[i]], step)):
                        ops.errors.append(f"{where}: view of row {mine[i]} {f[0]} read back wrong")
            except stowage.Error as e:
                ops.errors.append(f"{where} view: {type(e).__name__}: {str(e)[:300]}")
            try:
                nb = sum(int(lens[r]) for r in other) * 8
                got = ops.call("get", nb, dp.get, PARTITION, [key(cfg, step, r) for r in other], "input_ids")
                i = rng.randrange(len(other))
                if not same_bytes(got["input_ids"][i], make_value(other[i], FIELDS[0], lens[other[i]], step)):
                    ops.errors.append(f"{where}: get of row {other[i]} input_ids read back wrong")
                del got
            except stowage.Error as e:
                ops.errors.append(f"{where} get: {type(e).__name__}: {str(e)[:300]}")
            try:
                wb = {WRITEBACK[0]: [make_value(r, WRITEBACK, lens[r], step) for r in mine]}
                ops.call("put", nbytes_of(wb), dp.put, PARTITION, keys, wb)
                del wb
            except stowage.Error as e:
                ops.errors.append(f"{where} write-back put: {type(e).__name__}: {str(e)[:300]}")
            if step > 0:
                # the previous step's rows, still under this trainer's views
                try:
                    ops.call("clear", 0, dp.clear, PARTITION, [key(cfg, step - 1, r) for r in mine])
                except stowage.Error as e:
                    ops.errors.append(f"{where} clear: {type(e).__name__}: {str(e)[:300]}")
            held = views  # the views of step - 1 go here
            del views
            conn.send(("done", *ops.take()))
    except BaseException:  # noqa: BLE001 - reported to the driver
        try:
            conn.send(("failed", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
    finally:
        held = None  # noqa: F841


# ---------------------------------------------------------------------------
# the driver


def proc_figures(pid: int) -> dict:
    """RSS, heap (RssAnon), slab pages (RssShmem), threads, open fds."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssShmem", "RssFile"):
                    out[k] = int(v.split()[0]) * 1024
                elif k == "Threads":
                    out["threads"] = int(v)
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return out


class Sampler:
    """Each unit's /proc figures and stats, taken by the driver between
    steps (every client idle, the same point of the step every time: the
    step's views held, the previous step's rows cleared)."""

    def __init__(self, dp, pids):
        self.dp, self.pids = dp, pids
        self.samples = []  # (t, [per unit dict])
        self.errors = []

    def sample(self):
        per = [proc_figures(pid) for pid in self.pids]
        try:
            stats = self.dp.stats(timeout=10.0)
            for d, s in zip(per, stats):
                d["index_bytes"] = int(s.get("index_bytes", 0))
                d["disk_used"] = int(s.get("disk_used", 0))
                d["used"] = int(s.get("used", 0))
                d["pinned_bytes"] = int(s.get("pinned_bytes", 0))
                d["sessions"] = len(s.get("sessions", []))
                d["spilled_blobs"] = int(s.get("spilled_blobs", 0))
                d["disk_write_bytes"] = int(s.get("disk_write_bytes", 0))
                d["disk_read_bytes"] = int(s.get("disk_read_bytes", 0))
        except Exception as e:  # noqa: BLE001 - a missed sample is reported as an error
            self.errors.append(f"stats: {type(e).__name__}: {str(e)[:200]}")
        self.samples.append((time.monotonic(), per))


class Child:
    """A client process and the driver's end of its pipe."""

    def __init__(self, ctx, name, target, args):
        self.name = name
        self.conn, child_end = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=target, name=name, args=(*args, child_end), daemon=True)
        self.proc.start()
        child_end.close()
        self.ready = False

    def expect(self, what: str, seconds: float):
        """The next message, which must be `what`; bounded."""
        if not self.conn.poll(seconds):
            raise TimeoutError(f"{self.name}: no {what!r} in {seconds:.0f}s (exit code {self.proc.exitcode})")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"{self.name} ended (exit code {self.proc.exitcode}) before {what!r}") from None
        if msg[0] == "failed":
            raise RuntimeError(f"{self.name} failed:\n{msg[1]}")
        if msg[0] != what:
            raise RuntimeError(f"{self.name}: {msg[0]!r} where {what!r} was due")
        if what == "ready":
            self.ready = True
        return msg

    def stop(self, grace: float = 5.0) -> str:
        """Gone for sure: join, SIGTERM, SIGKILL; every wait bounded."""
        p = self.proc
        p.join(timeout=grace)
        if p.exitcode is None:
            for stop, how in ((p.terminate, "SIGTERM"), (p.kill, "SIGKILL")):
                stop()
                p.join(timeout=grace)
                if p.exitcode is not None:
                    self.conn.close()
                    return how
            return "still running"
        self.conn.close()
        return "exited"


def lsq_slope(points):
    """Least-squares slope of [(x, y)], or None with under 2 distinct x."""
    if len(points) < 2:
        return None
    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points], dtype=float)
    if np.ptp(xs) == 0:
        return None
    xm = xs.mean()
    return float(((xs - xm) * (ys - ys.mean())).sum() / ((xs - xm) ** 2).sum())


def p99(a):
    if not a:
        return None
    s = sorted(a)
    return s[min(len(s) - 1, round((len(s) - 1) * 0.99))]


class Run:
    def __init__(self, args, cfg):
        self.args, self.cfg = args, cfg
        self.ops = []  # (kind, end, seconds, bytes) of every process
        self.errors = []
        self.kills = 0
        self.fallbacks = 0
        self.rollouts_started = 0
        self.rollouts_ended = {"close": 0, "exit": 0, "SIGKILL": 0}
        self.step_ends = []
        self.events = []  # (t, "spawn"|"kill"|"exit")
        self.stopped = {}

    def absorb(self, msg):
        rec, err, fb = msg[1], msg[2], msg[3]
        self.ops.extend(rec)
        self.errors.extend(err)
        self.fallbacks += fb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the steps run (default 10)")
    ap.add_argument("--rows", type=int, default=1024, help="rows per step (default 1024)")
    ap.add_argument("--units", type=int, default=2, help="storage units (default 2)")
    ap.add_argument("--memory", default="64MiB", help="each unit's memory (default 64MiB)")
    ap.add_argument("--high-watermark", type=float, default=0.5, help="the disk tier's (default 0.5)")
    ap.add_argument("--low-watermark", type=float, default=0.3, help="the disk tier's (default 0.3)")
    ap.add_argument("--disk-capacity", default="2GiB", help="each unit's disk tier (default 2GiB)")
    ap.add_argument("--disk-dir", default=None, help="where the disk tier's temporary root goes (default $TMPDIR)")
    ap.add_argument("--trainers", type=int, default=2, help="trainer processes, alive all run (default 2)")
    ap.add_argument("--rollouts", type=int, default=2, help="rollout processes at a time (default 2)")
    ap.add_argument("--rollout-steps", type=int, default=4, help="steps a rollout process lives (default 4)")
    ap.add_argument("--kill-every", type=int, default=3, help="every N-th rollout to end is SIGKILLed (default 3)")
    ap.add_argument("--verify", type=int, default=2, help="values per trainer and step compared (default 2)")
    ap.add_argument("--op-timeout", type=float, default=30.0, help="seconds per call (default 30)")
    ap.add_argument("--step-timeout", type=float, default=120.0, help="a step not done by then ends the run")
    ap.add_argument(
        "--sample-every", type=float, default=5.0, help="seconds between unit samples, taken between steps (default 5)"
    )
    ap.add_argument("--json", metavar="PATH", help="also write the JSON line to PATH")
    args = ap.parse_args()
    if args.rollouts < 1 or args.trainers < 1 or args.rows < max(args.rollouts, args.trainers):
        ap.error("need at least one rollout and one trainer, and a row for each")
    if args.rollout_steps < 1 or args.kill_every < 1:
        ap.error("--rollout-steps and --kill-every are at least 1")

    import stowage

    cfg = {
        "rows": args.rows,
        "rollouts": args.rollouts,
        "trainers": args.trainers,
        "verify": args.verify,
        "op_timeout": args.op_timeout,
        # a client waits this long for its next command; the driver's
        # longest gap is a step's other phases
        "idle_timeout": args.step_timeout * 2 + 60,
    }
    run = Run(args, cfg)
    ctx = mp.get_context("spawn")
    disk_root = tempfile.mkdtemp(prefix="stowage-soak-", dir=args.disk_dir)
    dp = None
    sampler = None
    trainers, slots, pending = [], [], []
    unit_pids = []
    warm = min(60.0, args.minutes * 6.0)
    duration = args.minutes * 60.0
    aborted = None
    t0 = None
    try:
        dp = stowage.local(
            units=args.units,
            memory=parse_size(args.memory),
            namespace=NAMESPACE,
            timeout=args.op_timeout,
            disk=disk_root,
            disk_capacity=parse_size(args.disk_capacity),
            high_watermark=args.high_watermark,
            low_watermark=args.low_watermark,
        )
        unit_pids = list(dp.unit_pids)
        directory = dp.directory
        for i in range(args.trainers):
            trainers.append(Child(ctx, f"trainer-{i}", trainer_main, (i, directory, cfg)))
        gens = [0] * args.rollouts

        def spawn(slot):
            gens[slot] += 1
            run.rollouts_started += 1
            c = Child(ctx, f"rollout-{slot}.{gens[slot]}", rollout_main, (slot, gens[slot], directory, cfg))
            c.slot = slot
            return c

        # slot i's first rollout lives a share of --rollout-steps, so that
        # the ends are spread over the steps
        for i in range(args.rollouts):
            c = spawn(i)
            c.ends = max(0, args.rollout_steps - 1 - (i * args.rollout_steps) // args.rollouts)
            slots.append(c)
        for c in trainers + slots:
            c.expect("ready", 120.0)

        sampler = Sampler(dp, unit_pids)
        sampler.sample()
        t0 = time.monotonic()
        next_minute = 1
        ended = 0
        step = 0
        while time.monotonic() - t0 < duration:
            step_deadline = time.monotonic() + args.step_timeout

            def left(deadline=step_deadline):
                return max(0.1, deadline - time.monotonic())

            # the replacements of the rollouts that end at this step, a step ahead
            for c in slots:
                if c.ends == step and not any(p.slot == c.slot for p in pending):
                    pending.append(spawn(c.slot))
            # which of them end killed: every --kill-every-th to end
            n = ended
            for c in slots:
                c.kill = False
                if c.ends == step:
                    n += 1
                    c.kill = n % args.kill_every == 0
            for c in slots:
                c.conn.send(("put", step, c.kill))
            doomed = []
            for c in slots:
                run.absorb(c.expect("done", left()))
            # the rollouts whose life ends here: killed mid-put, or asked to exit
            for c in list(slots):
                if c.ends != step:
                    continue
                ended += 1
                if c.kill:
                    c.expect("dooming", left())
                    time.sleep(random.uniform(0.002, 0.03))
                    os.kill(c.proc.pid, signal.SIGKILL)
                    c.proc.join(timeout=10)
                    if c.proc.exitcode != -signal.SIGKILL:
                        run.errors.append(f"{c.name}: not ended by the SIGKILL (exit code {c.proc.exitcode})")
                    run.kills += 1
                    run.rollouts_ended["SIGKILL"] += 1
                    doomed.append(c)
                else:
                    close = ended % 2 == 0
                    c.conn.send(("exit", close))
                    run.absorb(c.expect("bye", left()))
                    c.proc.join(timeout=min(30.0, left()))
                    if c.proc.exitcode != 0:
                        run.errors.append(f"{c.name}: exit code {c.proc.exitcode} after its exit")
                    run.rollouts_ended["close" if close else "exit"] += 1
                run.stopped[f"{c.name} pid {c.proc.pid}"] = c.stop()
                nxt = next(p for p in pending if p.slot == c.slot)
                pending.remove(nxt)
                nxt.ends = step + args.rollout_steps
                slots[slots.index(c)] = nxt
            for c in trainers:
                c.conn.send(("step", step))
            for c in trainers:
                run.absorb(c.expect("done", left()))
            if doomed:
                t = time.monotonic()
                try:
                    dp.clear_partition(DOOMED)
                    run.ops.append(("clear", time.monotonic(), time.monotonic() - t, 0))
                except stowage.Error as e:
                    run.errors.append(f"driver step {step} clear_partition: {type(e).__name__}: {str(e)[:300]}")
            # the next step's rollouts must be ready before it starts
            for c in slots:
                if not c.ready:
                    c.expect("ready", left())
            run.step_ends.append(time.monotonic())
            step += 1
            if run.step_ends[-1] - sampler.samples[-1][0] >= args.sample_every or run.step_ends[-1] - t0 >= duration:
                sampler.sample()
            while time.monotonic() - t0 >= next_minute * 60.0:
                print_minute(run, sampler, t0, next_minute, unit_pids)
                next_minute += 1
    except (Exception, KeyboardInterrupt):  # noqa: BLE001 - the run ends; the report says why
        aborted = traceback.format_exc()
        print(f"the run stopped early:\n{aborted}", file=sys.stderr)
        run.errors.append("run stopped early: " + aborted.strip().splitlines()[-1][:300])
    finally:
        for c in trainers + slots + pending:
            if c.proc.exitcode is None and aborted is None:
                try:
                    if not c.ready:  # a replacement not yet used
                        c.expect("ready", 60.0)
                    c.conn.send(("exit", True))
                    run.absorb(c.expect("bye", 30.0))
                except Exception as e:  # noqa: BLE001
                    run.errors.append(f"{c.name} at the end: {type(e).__name__}: {e}")
            run.stopped[f"{c.name} pid {c.proc.pid}"] = c.stop()
        if dp is not None:
            dp.close()  # stops the units
        for pid in unit_pids:
            try:
                os.kill(pid, 0)
                run.errors.append(f"unit pid {pid} still running after close")
            except ProcessLookupError:
                pass
        shutil.rmtree(disk_root, ignore_errors=True)
    if t0 is None or sampler is None:
        return 1
    elapsed = time.monotonic() - t0
    if (elapsed % 60.0) > 5.0 or not run.step_ends:
        print_minute(run, sampler, t0, int(elapsed // 60) + 1, unit_pids, partial=True)
    run.errors.extend(sampler.errors)
    summary(run, sampler, t0, elapsed, warm, unit_pids)
    return 1 if aborted else 0


# ---------------------------------------------------------------------------
# the report

UNIT_FIGURES = [
    # (key, label, scale, unit text)
    ("VmRSS", "RSS", MiB, "MiB"),
    ("RssAnon", "heap", MiB, "MiB"),
    ("fds", "fds", 1, ""),
    ("threads", "threads", 1, ""),
    ("index_bytes", "index", KiB, "KiB"),
]


def fmt(v, scale, unit):
    if v is None:
        return "n/a"
    if scale == 1:
        return f"{v:d}" if isinstance(v, int) else f"{v:.1f}"
    return f"{v / scale:.1f} {unit}"


def print_minute(run, sampler, t0, minute, unit_pids, partial=False):
    lo, hi = t0 + (minute - 1) * 60.0, t0 + minute * 60.0
    ops = [o for o in run.ops if lo <= o[1] < hi]
    span = min(hi, time.monotonic()) - lo
    steps = sum(1 for t in run.step_ends if lo <= t < hi)
    moved = sum(o[3] for o in ops)
    lat = {k: p99([o[2] for o in ops if o[0] == k]) for k in KINDS}
    lat_s = ", ".join(f"{k} {lat[k] * 1e3:.1f}" if lat[k] is not None else f"{k} n/a" for k in KINDS)
    tag = f"minute {minute}" + (f" (partial, {span:.0f} s)" if partial else "")
    print(
        f"{tag}: {steps} steps, {len(ops) / span:.1f} calls/s, {moved / span / 1e6:.1f} MB/s; "
        f"p99 ms: {lat_s}; so far: {run.rollouts_started} rollouts started, {run.kills} killed, "
        f"{run.fallbacks} views read with get (disk tier, no room), {len(run.errors)} errors",
        flush=True,
    )
    last = [s for t, s in sampler.samples if t < hi]
    if not last:
        return
    first = ([s for t, s in sampler.samples if t <= lo] or [last[0]])[-1]
    for i, (pid, d) in enumerate(zip(unit_pids, last[-1])):
        parts = [f"{label} {fmt(d.get(k), sc, u)}" for k, label, sc, u in UNIT_FIGURES]
        parts.append(f"disk {fmt(d.get('disk_used'), MiB, 'MiB')}")
        for k, what in (("disk_write_bytes", "written"), ("disk_read_bytes", "read")):
            if k in d and k in first[i]:
                parts.append(f"{what} {(d[k] - first[i][k]) / MiB:.0f} MiB")
        parts.append(f"sessions {d.get('sessions', 'n/a')}")
        print(f"  unit {i} (pid {pid}): " + ", ".join(parts), flush=True)


def summary(run, sampler, t0, elapsed, warm, unit_pids):
    after = [(t - t0, s) for t, s in sampler.samples if t - t0 >= warm]
    units = []
    print()
    print(
        f"soak: {len(run.step_ends)} steps in {elapsed / 60:.1f} min, {run.args.units} units of "
        f"{run.args.memory} + disk tier (watermarks {run.args.high_watermark}/{run.args.low_watermark}), "
        f"{run.args.rows} rows x {len(FIELDS)} fields per step, {run.args.trainers} trainers, "
        f"{run.rollouts_started} rollout processes ({run.rollouts_ended['close']} closed, "
        f"{run.rollouts_ended['exit']} just exited, {run.kills} SIGKILLed); "
        f"{run.fallbacks} views read with a copying get (in the disk tier, no room to bring back)"
    )
    print(
        f"slopes: least squares over the {len(after)} samples after {warm:.0f} s, per 10 minutes, "
        f"as % of the first of them"
    )
    for i, pid in enumerate(unit_pids):
        figs = {}
        cells = []
        for k, label, sc, u in UNIT_FIGURES:
            pts = [(t / 600.0, s[i][k]) for t, s in after if k in s[i]]
            if not pts:
                figs[k] = None
                cells.append(f"{label} n/a")
                continue
            start, end = pts[0][1], pts[-1][1]
            slope = lsq_slope(pts)
            pct = None if slope is None or start == 0 else 100.0 * slope / start
            figs[k] = {"start": start, "end": end, "slope_per_10min": slope, "slope_pct": pct}
            cells.append(
                f"{label} {fmt(start, sc, u)} -> {fmt(end, sc, u)}" + ("" if pct is None else f" ({pct:+.1f}%/10min)")
            )
        units.append(figs)
        print(f"  unit {i} (pid {pid}): " + "; ".join(cells))
    # the op rate over 20 s windows after the warm-up (whole windows only)
    win = 20.0
    n_win = int((elapsed - warm) // win)
    rates = []
    for w in range(n_win):
        lo = t0 + warm + w * win
        rates.append((lo + win / 2 - t0, sum(1 for o in run.ops if lo <= o[1] < lo + win) / win))
    rate_slope = lsq_slope([(t / 600.0, r) for t, r in rates])
    rate_pct = None if rate_slope is None or not rates or rates[0][1] == 0 else 100.0 * rate_slope / rates[0][1]
    if rates:
        rs = [r for _, r in rates]
        print(
            f"  op rate: {rs[0]:.1f} -> {rs[-1]:.1f} calls/s over {len(rs)} windows of {win:.0f} s "
            f"(min {min(rs):.1f}, max {max(rs):.1f})" + ("" if rate_pct is None else f"; trend {rate_pct:+.1f}%/10min")
        )
    else:
        print("  op rate: n/a (no whole 20 s window after the warm-up)")
    lat = {k: p99([o[2] for o in run.ops if o[0] == k]) for k in KINDS}
    print(
        "  p99 over the run, ms: "
        + ", ".join(f"{k} {lat[k] * 1e3:.1f}" if lat[k] is not None else f"{k} n/a" for k in KINDS)
    )
    slowest = sorted(run.ops, key=lambda o: -o[2])[:5]
    print(
        "  slowest calls: "
        + ", ".join(
            f"{k} {sec * 1e3:.0f} ms at {end - sec - t0:.1f} s ({nb / MiB:.1f} MiB)" for k, end, sec, nb in slowest
        )
    )
    print(f"errors: {len(run.errors)} (besides the {run.kills} kills it caused)")
    for e in run.errors[:10]:
        print(f"  {e}")
    if len(run.errors) > 10:
        print(f"  ... {len(run.errors) - 10} more")
    hows = {}
    for how in run.stopped.values():
        hows[how] = hows.get(how, 0) + 1
    print("processes stopped by pid: " + ", ".join(f"{n} {h}" for h, n in sorted(hows.items())))
    line = {
        "bench": "soak",
        "args": vars(run.args),
        "elapsed_s": round(elapsed, 1),
        "steps": len(run.step_ends),
        "warmup_s": warm,
        "rollouts_started": run.rollouts_started,
        "rollouts_ended": run.rollouts_ended,
        "kills": run.kills,
        "view_fallbacks": run.fallbacks,
        "errors": run.errors,
        "units": [{"pid": pid, **figs} for pid, figs in zip(unit_pids, units)],
        "op_rate_windows": [[round(t, 1), round(r, 2)] for t, r in rates],
        "op_rate_trend_pct_per_10min": rate_pct,
        "p99_s": lat,
        "slowest": [[k, round(end - sec - t0, 3), sec, nb] for k, end, sec, nb in slowest],
        "samples": [[round(t - t0, 1), s] for t, s in sampler.samples],
        "stopped": run.stopped,
    }
    text = json.dumps(line)
    print(text)
    if run.args.json:
        with open(run.args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
