"""A real Prometheus scrapes units that `stowage up` started, through the
scrape configuration the docs ship (docs/prometheus/prometheus.yml, with
its intervals set to 1 s and its ports replaced by the ones this test's
units and client got), and loads the alert rules the docs ship. Every
query of the Grafana dashboard (docs/grafana/stowage.json), and every
template variable it defines, is evaluated through Prometheus's HTTP API
and must return data.

Run by ./scripts/test-prometheus, which installs Prometheus when missing.
Needs `prometheus` on PATH (or $PROMETHEUS) and the package installed in
this interpreter (./scripts/build-python), whose `stowage` console script
sits beside it.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest

import stowage

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DASHBOARD = DOCS / "grafana" / "stowage.json"
PROM_CONFIG = DOCS / "prometheus" / "prometheus.yml"
PROM_RULES = DOCS / "prometheus" / "stowage-rules.yml"
METRICS_MD = DOCS / "metrics.md"

UNITS = 2
MEMORY = 32 << 20
SCRAPE = "1s"
# Grafana's $__rate_interval is at least four scrape intervals; 10 s holds
# about ten 1 s scrapes.
RATE_INTERVAL = "10s"
# Every wait is bounded by one of these.
START_TIMEOUT = 60.0
QUERY_TIMEOUT = 60.0


def free_ports(n: int) -> int:
    """A port P such that P .. P + n - 1 are free on loopback (unit I of
    `stowage up` serves its metrics on the configured port + I), taken
    below the ephemeral range, where no listener on port 0 and no outgoing
    connection lands in the meantime."""
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(100):
        p = rng.randrange(max(1024, low - 12000), low - n)
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", p + i))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return p
    raise AssertionError(f"found no {n} consecutive free loopback ports in 100 tries")


def wait_for(what: str, timeout: float, probe: Callable[[], Any]) -> Any:
    """Call ``probe`` until it returns something true (returned), at most
    ``timeout`` seconds; fail naming ``what`` and the last answer."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
        except OSError as e:  # not listening yet, or refused
            last = e
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s; last answer: {last!r}")
        time.sleep(0.25)


def stop(p: subprocess.Popen, name: str, timeout: float = 30.0) -> None:
    """Stop ``p`` by its pid: SIGTERM, then SIGKILL past ``timeout``."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"{name} (pid {p.pid}) ignored SIGTERM for {timeout:.0f}s: killed")
            p.kill()
            p.wait(timeout=timeout)


def tail(path: pathlib.Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"({path}: {e})"


class Prometheus:
    """The HTTP API of the Prometheus this test started."""

    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: Any) -> Any:
        q = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> Dict[str, Any]:
        return self.get("/api/v1/query", query=expr)

    def vector(self, expr: str) -> List[Tuple[Dict[str, str], float]]:
        data = self.query(expr)
        assert data["resultType"] == "vector", (expr, data)
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def scalar(self, expr: str) -> float:
        v = self.vector(expr)
        assert len(v) == 1, (expr, v)
        return v[0][1]


def client_metrics_snippet() -> str:
    """The Python block of docs/metrics.md that serves a client's metrics."""
    blocks = re.findall(r"```python\n(.*?)```", METRICS_MD.read_text(), re.S)
    found = [b for b in blocks if "def serve_metrics(" in b]
    assert len(found) == 1, "docs/metrics.md: expected one python block defining serve_metrics"
    return found[0]


class Load:
    """Puts, gets, views, clears and checkpoints through the Python
    package, in a thread, so that every counter and histogram moves while
    Prometheus scrapes: one client over shared memory, one over TCP."""

    def __init__(self, directory: pathlib.Path, checkpoints: pathlib.Path) -> None:
        self.shm = stowage.connect(str(directory))
        self.tcp = stowage.connect(str(directory), transport="tcp")
        self.checkpoints = checkpoints
        self.stop = threading.Event()
        self.error: Optional[BaseException] = None
        self.rounds = 0
        self.thread = threading.Thread(target=self.run, name="load", daemon=True)

    def run(self) -> None:
        rng = np.random.default_rng(0)
        last_checkpoint = 0.0
        try:
            while not self.stop.is_set():
                i = self.rounds
                keys = [f"r{i}-{k}" for k in range(8)]
                for plane, part in ((self.shm, f"shm-{i}"), (self.tcp, f"tcp-{i}")):
                    values = rng.integers(0, 1 << 30, (8, 4096), dtype=np.int64)
                    plane.put(part, keys, {"x": values})
                    got = plane.get(part, keys, ["x"])["x"]
                    assert all(np.array_equal(g, v) for g, v in zip(got, values))
                    if plane is self.shm:
                        view = plane.get_view(part, keys[:2], ["x"])
                        assert np.array_equal(view["x"][0], values[0])
                        del view
                    assert plane.clear_partition(part) == len(keys)
                if time.monotonic() - last_checkpoint > 2.0:
                    # Admin requests go over the Unix socket (same user).
                    self.shm.checkpoint(str(self.checkpoints / f"c{i}"))
                    last_checkpoint = time.monotonic()
                self.rounds += 1
                self.stop.wait(0.1)
        except BaseException as e:  # noqa: BLE001 - reported by the tests, which then fail
            self.error = e

    def check(self) -> None:
        assert self.error is None, f"the load thread failed: {self.error!r}"
        assert self.thread.is_alive(), "the load thread stopped"


class Setup:
    prom: Prometheus
    load: Load
    units: List[Dict[str, Any]]
    metrics_base: int
    client_port: int


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    prometheus = os.environ.get("PROMETHEUS") or shutil.which("prometheus")
    assert prometheus, (
        "no prometheus server on PATH: ./scripts/test-prometheus installs it "
        "(Debian/Ubuntu: apt-get install prometheus)"
    )
    cli = pathlib.Path(sys.executable).parent / "stowage"
    assert cli.exists(), f"{cli}: missing; ./scripts/build-python installs the package"

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="stowage-prom-"))
    procs: List[Tuple[subprocess.Popen, str]] = []
    load: Optional[Load] = None
    server: Any = None

    def cleanup() -> None:
        """Stop what this test started, by pid, and remove its directory
        (idempotent: at the end, on SIGTERM, at exit)."""
        nonlocal load, server
        if load is not None:
            load.stop.set()
            if load.thread.is_alive():
                load.thread.join(timeout=30)
            load = None
        if server is not None:
            server.shutdown()
            server.server_close()
            server = None
        while procs:
            p, name = procs.pop()
            stop(p, name)
        shutil.rmtree(tmp, ignore_errors=True)

    # A SIGTERM (the script's trap, a CI timeout) stops everything first.
    def on_term(signum: int, frame: Any) -> None:
        cleanup()
        raise KeyboardInterrupt(f"signal {signum}")

    old_term = signal.signal(signal.SIGTERM, on_term)
    atexit.register(cleanup)
    try:
        # 1. Units, as an operator starts them: `stowage up` with a config
        # file whose [metrics] listen gives them fixed ports.
        base = free_ports(UNITS)
        config = tmp / "stowage.toml"
        config.write_text(
            f"""
[units]
count = {UNITS}
memory = "{MEMORY >> 20}MiB"
checkpoint_root = "{tmp}/checkpoints"

[units.disk]
root = "{tmp}/disk"
capacity = "64MiB"

[metrics]
listen = "127.0.0.1:{base}"
"""
        )
        directory = tmp / "dir.json"
        up_log = tmp / "up.log"
        with open(up_log, "wb") as log:
            up = subprocess.Popen(
                [str(cli), "up", "--config", str(config), "--directory", str(directory)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs.append((up, "stowage up"))

        def directory_written() -> Any:
            assert up.poll() is None, f"stowage up exited {up.returncode}:\n{tail(up_log)}"
            return directory.exists() and json.loads(directory.read_text())

        units = wait_for("stowage up writes its directory", START_TIMEOUT, directory_written)[
            "units"
        ]
        assert len(units) == UNITS, units
        for i, u in enumerate(units):
            assert u["metrics"] == f"http://127.0.0.1:{base + i}/metrics", (i, u)

        # 2. Clients under load; one serves its metrics the way
        # docs/metrics.md shows.
        load = Load(directory, tmp / "checkpoints")
        scope: Dict[str, Any] = {}
        exec(compile(client_metrics_snippet(), "docs/metrics.md", "exec"), scope)
        server = scope["serve_metrics"](load.shm, port=0)
        client_port = int(server.server_address[1])
        load.thread.start()

        # 3. Prometheus with the shipped configuration and rules: only the
        # intervals and the targets' ports differ.
        text = PROM_CONFIG.read_text()
        for old, new in [
            ("scrape_interval: 15s", f"scrape_interval: {SCRAPE}"),
            ("evaluation_interval: 15s", f"evaluation_interval: {SCRAPE}"),
            ("- 127.0.0.1:9464\n", f"- 127.0.0.1:{base}\n"),
            ("- 127.0.0.1:9465\n", f"- 127.0.0.1:{base + 1}\n"),
            ("- 127.0.0.1:9470\n", f"- 127.0.0.1:{client_port}\n"),
        ]:
            assert text.count(old) == 1, f"{PROM_CONFIG}: expected {old!r} once"
            text = text.replace(old, new)
        (tmp / "prometheus.yml").write_text(text)
        shutil.copy(PROM_RULES, tmp / PROM_RULES.name)
        prom_port = free_ports(1)
        prom_log = tmp / "prometheus.log"
        with open(prom_log, "wb") as log:
            prom_proc = subprocess.Popen(
                [
                    prometheus,
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                    "--log.level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp,
            )
        procs.append((prom_proc, "prometheus"))
        prom = Prometheus(f"http://127.0.0.1:{prom_port}")

        def ready() -> bool:
            assert prom_proc.poll() is None, (
                f"prometheus exited {prom_proc.returncode}:\n{tail(prom_log)}"
            )
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=5) as r:
                return r.status == 200

        wait_for("prometheus ready", START_TIMEOUT, ready)

        def targets_up() -> Any:
            active = prom.get("/api/v1/targets", state="active")["activeTargets"]
            healthy = [t for t in active if t["health"] == "up"]
            return len(healthy) == UNITS + 1 and active

        active = wait_for("every target up", START_TIMEOUT, targets_up)
        jobs = sorted((t["labels"]["job"], t["labels"]["instance"]) for t in active)
        assert jobs == sorted(
            [("stowage", f"127.0.0.1:{base + i}") for i in range(UNITS)]
            + [("stowage-client", f"127.0.0.1:{client_port}")]
        ), jobs

        s = Setup()
        s.prom, s.load, s.units, s.metrics_base, s.client_port = (
            prom,
            load,
            units,
            base,
            client_port,
        )
        yield s
        s.load.check()
    finally:
        cleanup()
        signal.signal(signal.SIGTERM, old_term)
        atexit.unregister(cleanup)


def test_scraped_values_are_the_units(setup: Setup) -> None:
    prom = setup.prom
    up = prom.vector('up{job="stowage"}')
    assert sorted(m["instance"] for m, _ in up) == [
        f"127.0.0.1:{setup.metrics_base + i}" for i in range(UNITS)
    ]
    assert all(v == 1 for _, v in up), up

    # Gauges match what the units report themselves.
    stats = setup.load.shm.stats()
    capacity = {m["unit"]: v for m, v in prom.vector('stowage_slab_capacity_bytes{job="stowage"}')}
    assert capacity == {f"unit-{i}": float(s["capacity"]) for i, s in enumerate(stats)}

    # The unit's own `instance` label (its instance id) would clash with
    # the target's: Prometheus keeps it as exported_instance.
    info = prom.vector('stowage_unit_info{job="stowage"}')
    ids = {m["unit"]: m["exported_instance"] for m, _ in info}
    assert sorted(ids) == [f"unit-{i}" for i in range(UNITS)], info
    for i, u in enumerate(setup.units):
        assert ids[f"unit-{i}"] == u["instance_id"], (ids, u)

    # Counters moved by the load, as Prometheus stored them.
    def moved(expr: str) -> float:
        return wait_for(expr, QUERY_TIMEOUT, lambda: max([v for _, v in prom.vector(expr)] or [0]))

    moved('sum(stowage_operations_total{job="stowage", op="commit", outcome="ok"})')
    moved('sum(stowage_operations_total{job="stowage", op="put", outcome="ok"})')
    moved('sum(stowage_transferred_bytes_total{job="stowage", transport="shm", direction="in"})')
    moved('sum(stowage_transferred_bytes_total{job="stowage", transport="tcp", direction="out"})')
    moved('sum(stowage_checkpoints_total{job="stowage", outcome="ok"})')
    moved('sum(stowage_client_operations_total{job="stowage-client", op="put", outcome="ok"})')
    moved('sum(stowage_client_bytes_total{job="stowage-client", direction="get"})')
    setup.load.check()


def dashboard() -> Dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panel_queries(panels: List[Dict[str, Any]]) -> Iterator[Tuple[str, str]]:
    for p in panels:
        yield from panel_queries(p.get("panels", []))
        for t in p.get("targets", []):
            if "expr" in t:
                yield p.get("title", "?"), t["expr"]


def regex_escape(value: str) -> str:
    """How Grafana escapes a variable's value for a Prometheus regex."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", value)


def variables(prom: Prometheus) -> Dict[str, str]:
    """Every template variable of the dashboard as Grafana expands "All":
    the values its label_values() query finds, as a regex alternation."""
    out: Dict[str, str] = {}
    for v in dashboard()["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["query"].strip())
        assert m, f"variable {v['name']}: not label_values(selector, label): {v['query']}"
        selector, label = m.groups()
        for name, value in out.items():
            selector = selector.replace(f"${name}", value)
        found = prom.get(f"/api/v1/label/{label}/values", **{"match[]": selector})
        assert found, f"variable {v['name']}: {v['query']} finds no values"
        out[v["name"]] = "(" + "|".join(regex_escape(x) for x in found) + ")"
    return out


def expand(expr: str, vars: Dict[str, str]) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    for name in sorted(vars, key=len, reverse=True):
        expr = expr.replace(f"${{{name}}}", vars[name]).replace(f"${name}", vars[name])
    assert "$" not in expr, f"a variable this test does not know: {expr}"
    return expr


def test_dashboard_variables_find_values(setup: Setup) -> None:
    vars = variables(setup.prom)
    assert vars["job"] == "(stowage)", vars
    assert vars["unit"] == "(" + "|".join(f"unit-{i}" for i in range(UNITS)) + ")", vars
    assert vars["client_job"] == r"(stowage-client)", vars


def test_every_dashboard_query_returns_data(setup: Setup) -> None:
    """Each query returns series with at least one finite value (a rate
    over a window with scrapes in it; a quantile over requests that
    happened), polled until its window holds data."""
    prom = setup.prom
    vars = variables(prom)
    queries = list(panel_queries(dashboard()["panels"]))
    assert len(queries) >= 20, queries
    pending = {expand(e, vars): title for title, e in queries}
    last: Dict[str, Any] = {}
    deadline = time.monotonic() + QUERY_TIMEOUT
    while pending and time.monotonic() < deadline:
        for expr in list(pending):
            data = prom.query(expr)
            values = [float(r["value"][1]) for r in data["result"]]
            last[expr] = data["result"]
            if any(math.isfinite(v) for v in values):
                del pending[expr]
        if pending:
            time.sleep(1)
    setup.load.check()
    assert not pending, "dashboard queries without data:\n" + "\n".join(
        f"  [{title}] {expr}\n    -> {last.get(expr)!r}" for expr, title in pending.items()
    )


def test_alert_rules_evaluate_and_stay_quiet(setup: Setup) -> None:
    """Prometheus loaded every shipped rule, evaluated each without error
    against the units' series, and none fires for a healthy plane."""
    prom = setup.prom

    def evaluated() -> Any:
        groups = prom.get("/api/v1/rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return all(r["health"] == "ok" for r in rules) and rules

    rules = wait_for("every rule evaluated", QUERY_TIMEOUT, evaluated)
    names = sorted(r["name"] for r in rules)
    shipped = re.findall(r"^\s*- alert: (\w+)", PROM_RULES.read_text(), re.M)
    assert names == sorted(shipped), (names, shipped)
    assert all(not r.get("lastError") for r in rules), rules
    alerts = prom.get("/api/v1/alerts")["alerts"]
    assert alerts == [], alerts


def test_readme_alerts_are_the_shipped_rules() -> None:
    """Each PromQL block of the README's "Operating" section is the
    expression of one shipped alert rule (the README shows them; Prometheus
    loads the file)."""
    readme = (ROOT / "README.md").read_text()
    operating = readme[readme.index("## Operating\n") :]
    operating = operating[: operating.index("\n## ", 1)]
    blocks = re.findall(r"```promql\n(.*?)```", operating, re.S)
    exprs = re.findall(r"^\s*expr: (?:\|\n((?:\s{10}.*\n)+)|(.*)\n)", PROM_RULES.read_text(), re.M)
    rules = {re.sub(r"\s+", "", a or b) for a, b in exprs}
    assert len(rules) == len(re.findall(r"^\s*- alert:", PROM_RULES.read_text(), re.M))
    shown = {re.sub(r"\s+", "", b) for b in blocks}
    assert shown == rules, shown ^ rules


def test_metrics_md_shows_the_shipped_scrape_configuration() -> None:
    """The YAML block of docs/metrics.md has the shipped file's jobs,
    targets and rule files."""
    import yaml  # PyYAML, which Ray (installed by ./scripts/build-python) requires

    def essentials(cfg: Dict[str, Any]) -> Any:
        return (
            cfg["rule_files"],
            [
                (j["job_name"], [t for s in j["static_configs"] for t in s["targets"]])
                for j in cfg["scrape_configs"]
            ],
        )

    blocks = re.findall(r"```yaml\n(.*?)```", METRICS_MD.read_text(), re.S)
    assert len(blocks) == 1, blocks
    shown = essentials(yaml.safe_load(blocks[0]))
    shipped = essentials(yaml.safe_load(PROM_CONFIG.read_text()))
    assert shown == shipped
    assert shipped[1][0][0] == "stowage", "the rules and the dashboard expect job=stowage"
