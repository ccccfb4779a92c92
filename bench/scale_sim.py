#!/usr/bin/env python3
"""Scale simulation: many units, many client sessions on each, on one machine.

In an RL job every client process touches every unit (rows live on unit
``row % N``), so a unit holds one session per client process and a client
process one connection per unit. This program builds that shape as large as
this machine holds and measures what it costs:

    python3 bench/scale_sim.py [--bin target/release] [--points 16x500,16x1000,32x1000,64x1000,64x2000]
                               [--transport shm|tcp] [--procs 10] [--memory-mib 16]
                               [--seconds 3] [--timeout 5] [--unit-arg ARG]... [--out FILE]
    python3 bench/scale_sim.py --model [--from FILE] [--units 2000] [--clients 8000]

For each point ``UxS`` it starts U ``stowage unit`` processes (each a small
slab, a Unix socket and a loopback TCP port in a private temp directory, one
shared secret) and ``--procs`` holder processes (``examples/sessions
--child``) that open S sessions in all: each session is one client of all U
units that puts and gets one 4 KiB value on each unit, so every unit holds S
sessions and U x S connections are open. Then a foreground client of all U
units (``examples/sessions --fg-child``) puts and gets 4 KiB values, rows
spread over the units, for ``--seconds``. Printed per point: sessions that
succeeded; per unit (mean over the units): threads, RSS over the slab
(RssAnon + RssFile), open fds; per held session: KiB of unit RSS and unit
fds; the foreground op/s, p50 and p99 of one op, and the units' CPU time per
op. Points run in the order given and stop growing at the first one whose
sessions do not all succeed or that would leave the machine short of memory
or open files.

``--model`` fits what the run measured (or the JSON that ``--out`` wrote,
``--from``) against sessions per unit (least squares, y = a + b * S) and
extrapolates to ``--units`` units x ``--clients`` client processes (each
process one session and one connection on every unit): connections, memory,
threads and fds per unit, fds per client process, and the per-op cost.

Needs ``cargo build --release -p stowage-cli --examples --bin stowage``.
Every process it starts is stopped by its pid; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, asdict, field

KIB = 1024
MIB = 1024 * 1024


# ------------------------------------------------------------------ /proc


def proc_status(pid: int) -> dict[str, int]:
    """Threads and RSS fields (KiB) of a process."""
    out = {"Threads": 0, "VmRSS": 0, "RssAnon": 0, "RssFile": 0, "RssShmem": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in out:
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def proc_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KIB
    return 0


def threads_now() -> int:
    """Threads (and processes) on the machine now: /proc/loadavg's 4th field."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[1])


def pid_max() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


def nofile_hard() -> int:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return hard if hard != resource.RLIM_INFINITY else 1 << 20


def raise_nofile() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ------------------------------------------------------------------ processes


class Procs:
    """Processes stopped by their pids at the end, on every path out."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def add(self, p: subprocess.Popen) -> subprocess.Popen:
        self.procs.append(p)
        return p

    def stop(self, grace: float = 5.0) -> None:
        for p in self.procs:
            try:
                if p.stdin and not p.stdin.closed:
                    try:
                        p.stdin.write(b"stop\n")
                        p.stdin.flush()
                    except OSError:
                        pass
                    p.stdin.close()
            except OSError:
                pass
        end = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()  # by its pid
                p.wait(timeout=10)
        self.procs.clear()

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def read_line(p: subprocess.Popen, prefix: str, timeout: float) -> str | None:
    """The first stdout line of `p` starting with `prefix`, within `timeout`."""
    got: list[str] = []

    def reader() -> None:
        assert p.stdout is not None
        for raw in p.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith(prefix):
                got.append(line)
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    return got[0] if got else None


def fields(line: str) -> dict[str, str]:
    head, _, err = line.partition(" first_error=")
    out = dict(w.split("=", 1) for w in head.split()[1:] if "=" in w)
    out["first_error"] = err.strip()
    return out


@dataclass
class Point:
    units: int
    sessions: int
    transport: str
    ok: int = 0
    failed: int = 0
    first_error: str = ""
    open_s: float = 0.0
    # Per unit, mean over the units, before and while holding the sessions.
    threads_before: float = 0.0
    threads: float = 0.0
    rss_over_before_kib: float = 0.0
    rss_over_kib: float = 0.0
    fds_before: float = 0.0
    fds: float = 0.0
    # Foreground client.
    fg_ops: int = 0
    fg_op_s: float = 0.0
    fg_p50_us: float = float("nan")
    fg_p99_us: float = float("nan")
    fg_pair_p99_us: float = float("nan")
    fg_errors: int = 0
    fg_error: str = ""
    unit_cpu_us_per_op: float = float("nan")
    holder_fds: float = 0.0
    holder_rss_kib: float = 0.0
    procs: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def kib_per_session(self) -> float:
        return (self.rss_over_kib - self.rss_over_before_kib) / max(self.ok, 1)

    @property
    def fds_per_session(self) -> float:
        return (self.fds - self.fds_before) / max(self.ok, 1)

    @property
    def threads_per_session(self) -> float:
        return (self.threads - self.threads_before) / max(self.ok, 1)


def start_units(
    procs: Procs, bin_dir: str, n: int, memory: int, tmp: str, secret_file: str, unit_args: list[str]
) -> list[tuple[int, str, str]]:
    """Start n units; (pid, unix address, tcp address) of each."""
    stowage = os.path.join(bin_dir, "stowage")
    env = dict(os.environ)
    env.setdefault("RUST_LOG", "error")
    env.pop("STOWAGE_SECRET", None)
    units = []
    for i in range(n):
        sock = os.path.join(tmp, f"unit-{i}.sock")
        log = open(os.path.join(tmp, f"unit-{i}.log"), "wb")
        p = procs.add(
            subprocess.Popen(
                [
                    stowage, "unit", "--name", f"unit-{i}", "--memory", str(memory),
                    "--listen", f"unix:{sock}", "--listen", "tcp:127.0.0.1:0",
                    "--secret-file", secret_file, "--exit-with-stdin", "--no-mlock",
                    "--metrics-listen", "off", *unit_args,
                ],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
            )
        )
        line = read_line(p, "READY ", 30)
        if line is None:
            raise RuntimeError(f"unit {i} did not report ready within 30 s (log: {log.name})")
        tcp = next(w[4:] for w in line.split() if w.startswith("tcp="))
        units.append((p.pid, f"unix:{sock}", f"tcp:{tcp}"))
    return units


def run_point(args, n_units: int, n_sessions: int) -> Point:
    pt = Point(units=n_units, sessions=n_sessions, transport=args.transport)
    sessions_bin = os.path.join(args.bin, "examples", "sessions")
    tmp = tempfile.mkdtemp(prefix="stowage-scale-sim-")
    os.chmod(tmp, 0o700)
    secret = secrets.token_hex(32)  # the secret's bytes are this text
    secret_file = os.path.join(tmp, "secret")
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secret.encode())
    os.close(fd)
    secret_hex = secret.encode().hex()
    try:
        with Procs() as units_procs, Procs() as holders:
            units = start_units(
                units_procs, args.bin, n_units, args.memory_mib * MIB, tmp, secret_file, args.unit_arg
            )
            pids = [u[0] for u in units]
            addrs = [u[1] if args.transport == "shm" else u[2] for u in units]
            addr_args = [a for addr in addrs for a in ("--addr", addr)]
            time.sleep(0.5)

            def per_unit():
                st = [proc_status(p) for p in pids]
                return (
                    sum(s["Threads"] for s in st) / len(st),
                    sum(s["RssAnon"] + s["RssFile"] for s in st) / len(st),
                    sum(proc_fds(p) for p in pids) / len(pids),
                )

            pt.threads_before, pt.rss_over_before_kib, pt.fds_before = per_unit()
            nprocs = max(1, min(args.procs, n_sessions))
            pt.procs = nprocs
            share = [n_sessions // nprocs + (1 if k < n_sessions % nprocs else 0) for k in range(nprocs)]
            t = time.monotonic()
            kids = []
            for k, s in enumerate(share):
                p = holders.add(
                    subprocess.Popen(
                        [
                            sessions_bin, "--child", *addr_args, "--sessions", str(s), "--tag", str(k),
                            "--openers", str(args.openers), "--timeout", str(args.timeout),
                        ],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    )
                )
                assert p.stdin is not None
                p.stdin.write(f"{secret_hex}\n".encode())
                p.stdin.flush()
                kids.append(p)
            # Each opener's share of sessions, each within its deadline
            # (a connect to each unit), plus slack.
            bound = (max(share) / args.openers + 1) * (args.timeout * 2 + 1) * n_units + 120
            end = time.monotonic() + bound
            for k, p in enumerate(kids):
                line = read_line(p, "OPENED ", max(1.0, end - time.monotonic()))
                if line is None:
                    raise RuntimeError(f"holder {k} did not report within {bound:.0f} s")
                f = fields(line)
                pt.ok += int(f["ok"])
                pt.failed += int(f["failed"])
                if f["first_error"] and not pt.first_error:
                    pt.first_error = f["first_error"]
            pt.open_s = time.monotonic() - t
            time.sleep(0.5)
            pt.threads, pt.rss_over_kib, pt.fds = per_unit()
            pt.holder_fds = sum(proc_fds(p.pid) for p in kids) / len(kids)
            pt.holder_rss_kib = sum(proc_status(p.pid)["VmRSS"] for p in kids) / len(kids)
            cpu0 = sum(proc_cpu_s(p) for p in pids)
            fg = subprocess.Popen(
                [sessions_bin, "--fg-child", *addr_args, "--seconds", str(args.seconds),
                 "--timeout", str(args.timeout)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            )
            holders.add(fg)
            assert fg.stdin is not None
            fg.stdin.write(f"{secret_hex}\n".encode())
            fg.stdin.flush()
            line = read_line(fg, "FG ", args.seconds + args.timeout * (n_units + 2) + 60)
            cpu1 = sum(proc_cpu_s(p) for p in pids)
            if line is None:
                pt.fg_error = "the foreground client did not report (connect failed?)"
            else:
                f = fields(line)
                pt.fg_ops = int(f["ops"])
                pt.fg_op_s = pt.fg_ops / max(float(f["secs"]), 1e-9)
                pt.fg_p50_us = float(f["op_p50"])
                pt.fg_p99_us = float(f["op_p99"])
                pt.fg_pair_p99_us = float(f["pair_p99"])
                pt.fg_errors = int(f["errors"])
                pt.fg_error = f["first_error"]
                pt.unit_cpu_us_per_op = (cpu1 - cpu0) * 1e6 / max(pt.fg_ops, 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return pt


def show_table(points: list[Point]) -> None:
    print(
        f"{'units':>5} {'sess/unit':>9} {'ok':>6} {'failed':>6} {'open s':>7} | "
        f"{'thr/unit':>8} {'MiB/unit':>8} {'fds/unit':>8} | {'KiB/sess':>8} {'fds/sess':>8} "
        f"{'thr/sess':>8} | {'fg op/s':>8} {'p50 us':>7} {'p99 us':>8} {'unit cpu us/op':>14}"
    )
    for p in points:
        print(
            f"{p.units:>5} {p.sessions:>9} {p.ok:>6} {p.failed:>6} {p.open_s:>7.1f} | "
            f"{p.threads:>8.0f} {p.rss_over_kib / KIB:>8.1f} {p.fds:>8.0f} | "
            f"{p.kib_per_session:>8.1f} {p.fds_per_session:>8.2f} {p.threads_per_session:>8.2f} | "
            f"{p.fg_op_s:>8.0f} {p.fg_p50_us:>7.1f} {p.fg_p99_us:>8.1f} {p.unit_cpu_us_per_op:>14.1f}"
        )
    for p in points:
        if p.first_error or p.fg_error:
            print(f"  {p.units}x{p.sessions}: first session error: {p.first_error or '-'}; "
                  f"foreground: {p.fg_error or '-'}")
    print(
        "(per unit: mean over the units while the sessions are held; MiB/unit: RSS over the slab, "
        "RssAnon + RssFile; KiB/sess, fds/sess, thr/sess: growth over the idle unit per session "
        "held; fg: one client of every unit, 4 KiB put+get, rows spread over the units; p50/p99 of "
        "one op; unit cpu: all units' CPU time during the foreground run per foreground op)"
    )


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x (b = 0 with one distinct x)."""
    pts = [(x, y) for x, y in zip(xs, ys) if y == y]  # drop NaN
    if not pts:
        return float("nan"), 0.0
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return my - b * mx, b


def through_origin(xs: list[float], ys: list[float]) -> float:
    """Least squares y = b x."""
    sxx = sum(x * x for x in xs)
    return sum(x * y for x, y in zip(xs, ys)) / sxx if sxx else float("nan")


def model(points: list[Point], units: int, clients: int) -> None:
    good = [p for p in points if p.ok > 0]
    if not good:
        print("model: no point with held sessions to fit")
        return
    S = clients  # every client process holds one session on every unit
    n = len(good)
    # Per unit: the idle unit, plus a cost per session held (fitted over
    # every point: growth = b x sessions).
    held = [float(p.ok) for p in good]
    thr0 = sum(p.threads_before for p in good) / n
    mem0 = sum(p.rss_over_before_kib for p in good) / n
    fds0 = sum(p.fds_before for p in good) / n
    thr_b = through_origin(held, [p.threads - p.threads_before for p in good])
    mem_b = through_origin(held, [p.rss_over_kib - p.rss_over_before_kib for p in good])
    fds_b = through_origin(held, [p.fds - p.fds_before for p in good])
    # Client side: what a holder process keeps per connection (one session
    # on one unit).
    conns = [p.ok / max(p.procs, 1) * p.units for p in good]
    cl_fds = through_origin(conns, [p.holder_fds for p in good])
    cl_kib = through_origin(conns, [p.holder_rss_kib for p in good])
    print(f"model: {units} units x {clients} client processes, every process one session "
          f"(one connection) on every unit; from {n} measured point(s) "
          f"({', '.join(f'{p.units}x{p.ok}' for p in good)}): idle unit + b x sessions")
    print(f"  connections per unit:        {S:,}  (plane-wide: {units * S:,})")
    print(f"  threads per unit:            {thr0 + thr_b * S:,.0f}   (idle {thr0:.0f}, b {thr_b:.4f} per session)")
    print(f"  unit RSS over the slab:      {(mem0 + mem_b * S) / KIB:,.1f} MiB   "
          f"(idle {mem0 / KIB:.1f} MiB, b {mem_b:.1f} KiB per session)")
    print(f"  open fds per unit:           {fds0 + fds_b * S:,.0f}   (idle {fds0:.0f}, b {fds_b:.2f} per session)")
    print(f"  fds per client process:      {cl_fds * units:,.0f}   ({cl_fds:.2f} per unit it is connected to)")
    print(f"  client process RSS:          {cl_kib * units / KIB:,.1f} MiB   ({cl_kib:.1f} KiB per unit it is "
          f"connected to; slab pages it touches come on top)")
    # Per op: against sessions where they differ, against units where they do.
    top = max(good, key=lambda p: (p.ok, p.units))
    for name, get in (("one op p50, us", lambda p: p.fg_p50_us), ("one op p99, us", lambda p: p.fg_p99_us),
                      ("unit CPU per op, us", lambda p: p.unit_cpu_us_per_op)):
        parts = [f"measured at {top.units}x{top.ok}: {get(top):.1f}"]
        for axis, key in (("session", lambda p: p.ok), ("unit", lambda p: p.units)):
            xs = [key(p) for p in good]
            if len(set(xs)) > 1:
                a, b = fit(xs, [get(p) for p in good])
                at = S if axis == "session" else units
                parts.append(f"fit against {axis}s: b {b:.4f} per {axis}, "
                             f"{max(a + b * at, get(top)):,.1f} at {at:,} {axis}s")
        print(f"  {name + ':':<28} " + "; ".join(parts))
    print("  (per-session costs carry over linearly; the per-op fits are a trend within what "
          "was measured, never taken below the largest point measured, not a promise beyond it)")


def parse_points(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        u, _, s = item.partition("x")
        out.append((int(u), int(s)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release", help="directory of stowage and examples/sessions")
    ap.add_argument("--points", default="16x500,16x1000,32x1000,64x1000,64x2000",
                    help="UNITSxSESSIONS,... run in order, growing")
    ap.add_argument("--transport", choices=["shm", "tcp"], default="shm")
    ap.add_argument("--procs", type=int, default=10, help="holder processes per point")
    ap.add_argument("--openers", type=int, default=8, help="threads per holder opening sessions")
    ap.add_argument("--memory-mib", type=int, default=16, help="slab per unit")
    ap.add_argument("--seconds", type=float, default=3.0, help="foreground run per point")
    ap.add_argument("--timeout", type=float, default=5.0, help="each client's deadline")
    ap.add_argument("--unit-arg", action="append", default=[], help="passed to every unit")
    ap.add_argument("--out", help="write the measured points here (JSON)")
    ap.add_argument("--model", action="store_true", help="extrapolate from the points measured")
    ap.add_argument("--from", dest="from_file", help="with --model: points from this JSON, not a run")
    ap.add_argument("--units", type=int, default=2000, help="--model: units")
    ap.add_argument("--clients", type=int, default=8000, help="--model: client processes")
    args = ap.parse_args()

    if args.from_file:
        with open(args.from_file) as f:
            points = [Point(**{k: v for k, v in d.items() if k in Point.__dataclass_fields__})
                      for d in json.load(f)]
        show_table(points)
        model(points, args.units, args.clients)
        return 0

    for need in ("stowage", os.path.join("examples", "sessions")):
        if not os.path.exists(os.path.join(args.bin, need)):
            print(f"scale_sim: {os.path.join(args.bin, need)} not found: "
                  "cargo build --release -p stowage-cli --examples --bin stowage", file=sys.stderr)
            return 2
    raise_nofile()
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"scale_sim: {os.cpu_count()} cores, {mem_available() / 2**30:.1f} GiB available, "
          f"open-file hard limit {nofile_hard()}, {args.transport}, {args.memory_mib} MiB slab per unit, "
          f"{args.procs} holder processes, {args.seconds} s foreground per point, load {load}")
    points: list[Point] = []
    # What a held session costs a unit, from the last point (a guess first:
    # a thread-per-connection unit's thread and its touched stack).
    kib_per_session, threads_per_session = 256.0, 1.0
    for n_units, n_sessions in parse_points(args.points):
        # Room: each unit's slab and what its sessions cost; threads take
        # pids, shared with everyone on the machine: use at most half the
        # ones free.
        need = n_units * (args.memory_mib * MIB + n_sessions * kib_per_session * 1.5 * KIB)
        if need > mem_available() * 0.6:
            print(f"  {n_units}x{n_sessions}: skipped and stopped: would need ~{need / 2**30:.1f} GiB")
            break
        threads = n_units * (16 + n_sessions * threads_per_session) + args.procs * (args.openers + 2)
        if threads > 0.5 * (pid_max() - threads_now()):
            print(f"  {n_units}x{n_sessions}: skipped and stopped: ~{threads:.0f} threads would take "
                  f"more than half the free pids (pid_max {pid_max()}, {threads_now()} in use)")
            break
        per_holder = 2 * n_units * n_sessions / max(1, min(args.procs, n_sessions)) + 64
        if per_holder > nofile_hard() or n_sessions + 64 > nofile_hard():
            print(f"  {n_units}x{n_sessions}: skipped and stopped: ~{per_holder:.0f} fds per holder "
                  f"past the hard limit {nofile_hard()} (use more --procs)")
            break
        t = time.monotonic()
        p = run_point(args, n_units, n_sessions)
        points.append(p)
        print(f"  {n_units}x{n_sessions}: {p.ok} ok, {p.failed} failed, foreground "
              f"{p.fg_op_s:.0f} op/s p99 {p.fg_p99_us:.1f} us ({time.monotonic() - t:.0f} s)", flush=True)
        if p.failed or p.fg_ops == 0:
            print("  (stopped growing: not every session succeeded)")
            break
        if p.ok:
            kib_per_session = max(p.kib_per_session, 4.0)
            threads_per_session = max(p.threads_per_session, 0.01)
    show_table(points)
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(p) for p in points], f, indent=1)
    if args.model:
        model(points, args.units, args.clients)
    return 0


if __name__ == "__main__":
    sys.exit(main())
