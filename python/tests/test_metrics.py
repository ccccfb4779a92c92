"""Units' Prometheus metrics, scraped over HTTP and parsed with
prometheus_client's text-format parser; the endpoint against garbage and
slow clients; the client's own metrics; Rust logs in Python's logging."""

from __future__ import annotations

import json
import pathlib
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import stowage

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = [sys.executable, "-m", "stowage"]
KIB = 1 << 10
MIB = 1 << 20


def start_unit(tmp_path, *extra: str):
    """A unit process (python -m stowage unit); returns (process, uds
    address, tcp address, metrics url)."""
    sock = tmp_path / "u.sock"
    p = subprocess.Popen(
        [
            *PY,
            "unit",
            "--no-mlock",
            "--listen",
            f"unix:{sock}",
            "--listen",
            "tcp:127.0.0.1:0",
            "--insecure",
            "--exit-with-stdin",
            *extra,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = p.stdout.readline()
    assert line.startswith("READY "), line
    words = dict(w.split("=", 1) for w in line.split()[1:])
    assert words["metrics"].startswith("http://127.0.0.1:"), line
    return p, f"unix:{sock}", f"tcp:{words['tcp']}", words["metrics"]


def stop_unit(p: subprocess.Popen) -> None:
    p.stdin.close()
    try:
        p.wait(timeout=15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=15)


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()


def samples(text: str) -> dict:
    """(sample name, labels without `unit`) -> value."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "unit"}
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


class Scraper:
    def __init__(self, url: str):
        self.url = url

    def __call__(self) -> dict:
        return samples(scrape_text(self.url))


def v(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def eventually(f, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if f():
            return True
        time.sleep(0.05)
    return f()


def test_counters_and_histograms_move_through_puts_gets_clears_spills_and_errors(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    p, uds, tcp, url = start_unit(
        tmp_path,
        "--memory",
        "8MiB",
        "--disk",
        str(disk),
        "--disk-capacity",
        "48MiB",
        "--high-watermark",
        "0.5",
        "--low-watermark",
        "0.25",
    )
    scrape = Scraper(url)
    try:
        m0 = scrape()
        assert v(m0, "stowage_slab_capacity_bytes") == 8 * MIB
        assert v(m0, "stowage_slab_bytes", state="free") == 8 * MIB
        assert v(m0, "stowage_disk_capacity_bytes") == 48 * MIB
        assert v(m0, "stowage_rows") == 0
        with stowage.connect([uds], namespace="m") as plane:
            # Puts over shared memory: alloc + the client's copy + commit.
            keys = [f"k{i}" for i in range(4)]
            col = [np.full(64 * KIB, i, dtype=np.float32) for i in range(4)]  # 256 KiB each
            plane.put("p", keys, {"x": col})
            m1 = scrape()
            assert (
                v(m1, "stowage_operations_total", op="alloc", outcome="ok")
                - v(m0, "stowage_operations_total", op="alloc", outcome="ok")
                >= 1
            )
            assert (
                v(m1, "stowage_operations_total", op="commit", outcome="ok")
                - v(m0, "stowage_operations_total", op="commit", outcome="ok")
                >= 1
            )
            # The values, and the rows' names (the rows API stores them too).
            assert (
                MIB
                <= v(m1, "stowage_transferred_bytes_total", transport="shm", direction="in")
                - v(m0, "stowage_transferred_bytes_total", transport="shm", direction="in")
                <= MIB + 256
            )
            n = v(m1, "stowage_operation_duration_seconds_count", op="commit")
            assert (
                n >= 1
                and v(m1, "stowage_operation_duration_seconds_bucket", op="commit", le="+Inf") == n
            )
            assert v(m1, "stowage_operation_duration_seconds_sum", op="commit") > 0
            # Each row holds its value and its name.
            assert v(m1, "stowage_rows") == 4 and v(m1, "stowage_entries") == 8
            assert v(m1, "stowage_partitions") == 1
            assert v(m1, "stowage_slab_bytes", state="used") >= MIB
            assert v(m1, "stowage_sessions") >= 1
            assert v(m1, "stowage_sessions_opened_total") >= 1

            # A get over shared memory: resolve + the client's copy + unpin.
            got = plane.get("p", keys, ["x"])["x"]
            assert all(np.array_equal(a, b) for a, b in zip(got, col))
            m2 = scrape()
            assert v(m2, "stowage_operations_total", op="resolve", outcome="ok") > v(
                m1, "stowage_operations_total", op="resolve", outcome="ok"
            )
            assert (
                MIB
                <= v(m2, "stowage_transferred_bytes_total", transport="shm", direction="out")
                - v(m1, "stowage_transferred_bytes_total", transport="shm", direction="out")
                <= MIB + 256
            )

            # Past the high watermark the spiller writes to the disk tier.
            for i in range(6):
                plane.put("q", [f"b{i}"], {"x": [np.full(256 * KIB, i, dtype=np.float32)]})  # 1 MiB
            assert eventually(lambda: v(scrape(), "stowage_spilled_bytes_total") > 0)
            m3 = scrape()
            assert v(m3, "stowage_spill_batches_total") >= 1
            assert v(m3, "stowage_disk_bytes", state="used") > 0
            assert v(m3, "stowage_disk_io_bytes_total", direction="write") > 0
            assert v(m3, "stowage_spilled_blobs") >= 1
            # Reading the oldest (spilled) rows back brings or streams them
            # from disk.
            got = plane.get("p", keys, ["x"])["x"]
            assert all(np.array_equal(a, b) for a, b in zip(got, col))
            m4 = scrape()
            back = ("stowage_promoted_bytes_total", "stowage_disk_streamed_bytes_total")
            assert sum(v(m4, b) for b in back) > sum(v(m3, b) for b in back)
            assert v(m4, "stowage_disk_io_bytes_total", direction="read") > 0

            # An error: more than memory and disk can hold is UnitFull.
            with pytest.raises(stowage.UnitFull):
                plane.put("big", ["huge"], {"x": [np.zeros(80 * MIB, dtype=np.uint8)]})
            # A unit counts a request once it has answered it: a scrape
            # right after the answer may come first (bounded waits below).
            assert eventually(
                lambda: (
                    v(scrape(), "stowage_operations_total", op="alloc", outcome="error")
                    > v(m4, "stowage_operations_total", op="alloc", outcome="error")
                ),
                timeout=5,
            )
            m5 = scrape()
            assert v(m5, "stowage_errors_total", kind="full") > v(
                m4, "stowage_errors_total", kind="full"
            )
            assert v(m5, "stowage_operations_total", op="alloc", outcome="error") > v(
                m4, "stowage_operations_total", op="alloc", outcome="error"
            )

            # Clears: the partitions go, and so do their rows.
            plane.clear_partition("p")
            plane.clear_partition("q")
            dropped = v(m5, "stowage_operations_total", op="drop_partition", outcome="ok")
            assert eventually(
                lambda: (
                    v(scrape(), "stowage_operations_total", op="drop_partition", outcome="ok")
                    >= dropped + 2
                ),
                timeout=5,
            )
            m6 = scrape()
            assert (
                v(m6, "stowage_operations_total", op="drop_partition", outcome="ok")
                - v(m5, "stowage_operations_total", op="drop_partition", outcome="ok")
                == 2
            )
            assert v(m6, "stowage_rows") == 0 and v(m6, "stowage_entries") == 0
            assert v(m6, "stowage_partitions") == 0

        # Over TCP the unit streams the bytes itself: put and get requests.
        with stowage.connect([tcp], namespace="m") as plane:
            plane.put("t", ["a", "b"], {"x": [np.ones(32 * KIB, dtype=np.float32)] * 2})  # 256 KiB
            plane.get("t", ["a", "b"], ["x"])
            m7 = scrape()
            # The values, their names, and alignment padding in the blob.
            for d in ("in", "out"):
                assert (
                    256 * KIB
                    <= v(m7, "stowage_transferred_bytes_total", transport="tcp", direction=d)
                    <= 256 * KIB + 256
                )
            assert v(m7, "stowage_operations_total", op="put", outcome="ok") >= 1
            assert v(m7, "stowage_operations_total", op="get", outcome="ok") >= 1
            assert v(m7, "stowage_operation_duration_seconds_count", op="get") >= 1
            plane.clear_partition("t")
    finally:
        stop_unit(p)


HOLDER = textwrap.dedent(
    """
    import sys, time, numpy as np, stowage
    plane = stowage.connect([sys.argv[1]], namespace="holder")
    plane.put("p", ["k"], {"x": [np.arange(1000, dtype=np.int64)]})
    view = plane.get_view("p", ["k"], ["x"])
    print("PINNED", flush=True)
    time.sleep(600)
    """
)


def test_a_killed_clients_holds_are_reclaimed_and_counted(tmp_path):
    p, uds, _, url = start_unit(tmp_path, "--memory", "16MiB")
    scrape = Scraper(url)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, uds], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "PINNED"
        m0 = scrape()
        assert v(m0, "stowage_pins") >= 1
        assert v(m0, "stowage_holds", kind="pin") >= 1
        assert v(m0, "stowage_slab_bytes", state="pinned") >= 8000
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=15)
        assert eventually(lambda: v(scrape(), "stowage_pins") == 0)
        m1 = scrape()
        assert (
            v(m1, "stowage_reclaimed_holds_total", reason="closed")
            - v(m0, "stowage_reclaimed_holds_total", reason="closed")
            >= 1
        )
        assert v(m1, "stowage_holds", kind="pin") == 0
        assert v(m1, "stowage_oldest_hold_age_seconds") == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=15)
        stop_unit(p)


def documented(section: str) -> dict:
    """docs/metrics.md's table under `section`: metric -> type."""
    md = (ROOT / "docs" / "metrics.md").read_text()
    part = md.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(stowage_[a-z_]+)` \| (\w+) \|", part, flags=re.M))


def exposed(text: str) -> dict:
    """The families of a scrape: exposed name -> type (counters with
    their `_total`, as docs/metrics.md names them)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out[name] = fam.type
    # prometheus_client's parser reads an `_info` gauge as a gauge.
    return out


def test_docs_list_every_unit_metric_with_its_type(tmp_path):
    p, uds, _, url = start_unit(tmp_path, "--memory", "16MiB")
    try:
        with stowage.connect([uds]) as plane:
            plane.put("p", ["k"], {"x": [np.arange(10)]})
            plane.get("p", ["k"], ["x"])
            live = exposed(scrape_text(url))
        docs = documented("Unit metrics")
        assert docs, "docs/metrics.md lists no unit metric"
        assert live == docs
    finally:
        stop_unit(p)


def test_client_metrics_count_and_are_documented(tmp_path):
    p, uds, _, _ = start_unit(tmp_path, "--memory", "16MiB")
    try:
        with stowage.connect([uds]) as plane:
            m0 = plane.metrics()
            plane.put("p", ["a", "b"], {"x": [np.zeros(1024, dtype=np.uint8)] * 2})
            plane.get("p", ["a", "b"], ["x"])
            with pytest.raises(stowage.NotFound):
                plane.get("p", ["missing"], ["x"])
            plane.clear_partition("p")
            m1 = plane.metrics()
            ops = m1["operations"]
            assert ops["put"]["ok"] - m0["operations"]["put"]["ok"] == 1
            assert ops["get"]["ok"] - m0["operations"]["get"]["ok"] == 1
            assert ops["get"]["error"] - m0["operations"]["get"]["error"] == 1
            assert ops["clear"]["ok"] - m0["operations"]["clear"]["ok"] == 1
            # The values, and what the rows API stores beside them (names).
            assert 2048 <= m1["bytes_put"] - m0["bytes_put"] <= 2048 + 256
            assert 2048 <= m1["bytes_got"] - m0["bytes_got"] <= 2048 + 256
            lat = ops["put"]["latency"]
            assert lat["count"] == ops["put"]["ok"] + ops["put"]["error"]
            assert lat["buckets"][-1] == (float("inf"), lat["count"])
            assert m1["units"][0]["address"] == uds and m1["units"][0]["latency"]["count"] >= 2
            assert m1["busy_retries"] == 0 and m1["memory_waits"] == 0
            text = plane.metrics_text()
            fams = {f.name: f for f in text_string_to_metric_families(text)}
            put_ok = [
                s.value
                for s in fams["stowage_client_operations"].samples
                if s.labels == {"op": "put", "outcome": "ok"}
            ]
            assert put_ok == [ops["put"]["ok"]]
            assert exposed(text) == documented("Client metrics")
    finally:
        stop_unit(p)


def raw(url: str, payload: bytes, read: bool = True, timeout: float = 30.0) -> bytes:
    """Send `payload` to the endpoint, read until it closes."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(payload)
        if not read:
            return b""
        out = b""
        while True:
            try:
                b = s.recv(65536)
            except ConnectionResetError:
                break
            if not b:
                break
            out += b
        return out


def test_the_endpoint_survives_garbage_and_slow_clients(tmp_path):
    p, _, _, url = start_unit(tmp_path, "--memory", "16MiB")
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    idle = []
    try:
        assert raw(url, b"GET /nope HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")
        assert raw(url, b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405")
        assert raw(url, b"\x00\xff garbage \r\n\r\n").startswith(b"HTTP/1.1 400")
        assert raw(url, b"GET /metrics\r\n\r\n").startswith(b"HTTP/1.1 400")
        # A head that never ends: answered 431 (or cut off) at 8 KiB.
        big = raw(url, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000)
        assert big == b"" or big.startswith(b"HTTP/1.1 431")
        # A half-sent request is dropped by the endpoint (after its request
        # timeout), never answered.
        half = socket.create_connection((host, int(port)), timeout=30)
        half.sendall(b"GET /metr")
        assert half.recv(100) == b""
        half.close()
        # More silent clients than it holds at once (64): each past the
        # cap takes the place of the oldest silent one, which is closed
        # at once, and a scrape is answered while they are all held.
        for _ in range(70):
            idle.append(socket.create_connection((host, int(port)), timeout=30))
        idle[0].settimeout(3)
        assert idle[0].recv(100) == b""
        assert _scrapes(url)
        for s in idle:
            s.close()
        idle.clear()
        assert eventually(lambda: _scrapes(url))
        # The unit served throughout.
        with stowage.connect([f"unix:{tmp_path / 'u.sock'}"]) as plane:
            plane.put("p", ["k"], {"x": [np.arange(3)]})
    finally:
        for s in idle:
            s.close()
        stop_unit(p)


def _scrapes(url: str) -> bool:
    try:
        return "stowage_rows" in scrape_text(url)
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def test_in_process_unit_metrics_text_and_endpoint_choice():
    u = stowage._native.Unit(16 << 20, name="inproc", mlock=False, metrics_listen="127.0.0.1:0")
    try:
        assert u.metrics_url.startswith("http://127.0.0.1:")
        fams = {f.name for f in text_string_to_metric_families(u.metrics_text())}
        assert "stowage_slab_capacity_bytes" in fams
        assert "stowage_rows" in samples_names(scrape_text(u.metrics_url))
    finally:
        u.stop(5.0)
    off = stowage._native.Unit(16 << 20, name="quiet", mlock=False, metrics_listen="off")
    try:
        assert off.metrics_url is None and off.metrics_text() is not None
    finally:
        off.stop(5.0)


def samples_names(text: str) -> set:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


LOGGING = textwrap.dedent(
    """
    import json, logging, sys, time
    import numpy as np
    import stowage
    records = []
    class Keep(logging.Handler):
        def emit(self, r):
            records.append({"logger": r.name, "level": r.levelname, "message": r.getMessage(),
                            "fields": getattr(r, "stowage", None)})
    log = logging.getLogger("stowage")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    u = stowage._native.Unit(16 << 20, name="inproc", mlock=False)
    with stowage.connect([u.uds_addr], namespace="ns-py") as plane:
        for i in range(50):
            plane.put("p", [f"k{i}"], {"x": [np.arange(10)]})
            plane.get("p", [f"k{i}"], ["x"])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not any(r["message"].startswith("session closed") for r in records):
        time.sleep(0.05)
    u.stop(5.0)
    print(json.dumps(records))
    """
)


def test_rust_logs_reach_python_logging_under_stowage(tmp_path):
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("RUST_LOG", "STOWAGE_LOG_FORMAT")
    }
    r = subprocess.run(
        [sys.executable, "-c", LOGGING], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stderr
    records = json.loads(r.stdout.strip().splitlines()[-1])
    opened = [x for x in records if x["message"].startswith("session opened")]
    assert opened, records
    assert opened[0]["logger"] == "stowage.unit" and opened[0]["level"] == "INFO"
    assert opened[0]["fields"]["unit"] == "inproc"
    assert opened[0]["fields"]["namespace"] == "ns-py"
    assert any(x["message"].startswith("session closed") for x in records), records
    # 100 operations, no line for any of them at the default level.
    assert len(records) < 10, records


def test_the_dashboard_uses_only_documented_metrics():
    dash = json.loads((ROOT / "docs" / "grafana" / "stowage.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {
        re.sub(r"_(bucket|sum|count)$", "", n)
        for e in exprs
        for n in re.findall(r"stowage_[a-z_]+", e)
    }
    known = set(documented("Unit metrics")) | set(documented("Client metrics"))
    assert used and used <= known, used - known
    # The README's alert examples too.
    readme = (ROOT / "README.md").read_text()
    operating = readme.split("## Operating", 1)[1].split("\n## ", 1)[0]
    alerts = {
        re.sub(r"_(bucket|sum|count)$", "", n) for n in re.findall(r"stowage_[a-z_]+", operating)
    }
    assert alerts and alerts <= known, alerts - known
