"""The systems under test, each behind the same small interface.

A *backend* (one per system, in the runner process) starts and stops the
processes that own the memory (stowage units; Mooncake's master and the
processes that mount its segments; Ray's raylet with its object store) and
reports their pids. A *client* moves rows of fields:

    put_rows(part, rows, {field: [array per row]})
    get_into(part, rows, fields, {field: [preallocated array per row]})
    clear(part, rows, fields)

The runner process is the client of the single-client workloads (sizes,
latency); grpo-step, dapo-churn and disk start four client processes
(bench/worker.py), each with its own client. Ray has no such client: its
values are objects owned by the process that put them, so Ray runs the same
phases with ray.put in actors and ray.get + copy out in other actors (see
RayBackend).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

import numpy as np

from common import GiB, MiB, log, stop_pid, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))

# Before anything imports ray: without it, Ray moves _node_ip_address to
# the machine's other address and listens on every interface.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# stowage


class StowageClient:
    def __init__(self, dp):
        self.dp = dp

    def register(self, arrays) -> None:
        pass  # stowage moves any C-contiguous array; nothing to register

    def unregister(self, arrays) -> None:
        pass

    def put_rows(self, part: str, rows: List[int], cols: Dict[str, list], side: bool = False) -> None:
        self.dp.put(part, rows, cols)

    def get_into(self, part: str, rows: List[int], fields: List[str], outs: Dict[str, list], side=()) -> None:
        self.dp.get(part, rows, fields, out=outs)

    def clear(self, part: str, rows: List[int], fields: List[str]) -> int:
        return self.dp.clear(part, rows)

    def clear_partition(self, part: str, rows: List[int], fields: List[str]) -> int:
        return self.dp.clear_partition(part)

    def close(self) -> None:
        self.dp.close()


def stowage_connect(conn: dict) -> StowageClient:
    import stowage

    return StowageClient(stowage.connect(conn["units"], namespace=conn.get("namespace", "bench"), timeout=120.0,
                                         transport=conn.get("transport", "auto")))


class StowageBackend:
    name = "stowage"

    def __init__(self, layout=None):
        self.dp = None
        self.transport = "shm"

    def start(self, units: int, memory: int, transport: str = "shm", disk: Optional[dict] = None) -> None:
        import stowage

        import inspect

        kwargs = {}
        if disk:
            if "disk" in inspect.signature(stowage.local).parameters:
                kwargs = {"disk": disk["dir"], "disk_capacity": int(disk["capacity"])}
            else:  # an older package: the unit's own options
                kwargs = {"unit_args": ["--disk", disk["dir"], "--disk-capacity", str(disk["capacity"])]}
        self.transport = transport
        self.dp = stowage.local(
            units=units, memory=memory, transport=transport, namespace="bench",
            timeout=120.0, **kwargs,
        )
        self.client = StowageClient(self.dp)

    def conn(self) -> dict:
        # The directory carries the plane's generated secret (over the
        # workers' stdin pipe, never their argv).
        units = self.dp.directory if hasattr(self.dp, "directory") else self.dp.units
        return {"system": "stowage", "units": units, "namespace": "bench", "transport": self.transport}

    def memory_pids(self) -> List[int]:
        return list(self.dp.unit_pids)

    def used_bytes(self) -> Optional[int]:
        return sum(s.get("used", 0) for s in self.dp.stats())

    def stats(self):
        return self.dp.stats()

    def stop(self) -> None:
        if self.dp is not None:
            self.dp.close()
            self.dp = None

    @staticmethod
    def version() -> str:
        import stowage

        return stowage.__version__


# ---------------------------------------------------------------------------
# Mooncake Store


# Values per Mooncake batch call. One batch_upsert_from of 12,288 values
# (a worker's share of the 8,192-row step) stalls its TCP transfers for
# 60 s and fails a third of them with TRANSFER_FAIL (-800) on this machine;
# calls of 256 to 4,096 values do not (and take about as long as each other).
MOONCAKE_MAX_BATCH = int(os.environ.get("BENCH_MOONCAKE_MAX_BATCH", "2048"))


def mooncake_key(part: str, row, field: str) -> str:
    return f"{part}/{row}@{field}"


class MooncakeClient:
    """A Mooncake Store client that mounts no memory of its own (segment
    size 0): every value lives in a separate segment-owning process, as a
    data plane's values live in its units. Puts are upserts (a put to an
    existing key succeeds without writing) with a hard pin (or the store
    may evict acknowledged data); clears force-remove (reads hold leases)."""

    def __init__(self, master: str, local_buffer: int = 64 * MiB):
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, local_buffer, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"Mooncake client setup failed: {rc}")
        self.cfg = ReplicateConfig()
        self.cfg.replica_num = 1
        self.cfg.with_hard_pin = True
        self.registered = set()

    def register(self, arrays) -> None:
        """Register buffers once, outside any timed section (Mooncake's
        fastest path; registration per call costs far more)."""
        for a in arrays:
            key = (a.ctypes.data, a.nbytes)
            if key in self.registered or a.nbytes == 0:
                continue
            rc = self.store.register_buffer(a.ctypes.data, a.nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_buffer failed: {rc}")
            self.registered.add(key)

    def unregister(self, arrays) -> None:
        for a in arrays:
            key = (a.ctypes.data, a.nbytes)
            if key in self.registered:
                self.store.unregister_buffer(a.ctypes.data)
                self.registered.discard(key)

    def put_rows(self, part, rows, cols, side=False) -> None:
        keys, ptrs, sizes = [], [], []
        for f, arrs in cols.items():
            for r, a in zip(rows, arrs):
                keys.append(mooncake_key(part, r, f))
                ptrs.append(a.ctypes.data)
                sizes.append(a.nbytes)
        if len(keys) == 1:
            rcs = [self.store.upsert_from(keys[0], ptrs[0], sizes[0], self.cfg)]
        else:
            rcs = []
            for i in range(0, len(keys), MOONCAKE_MAX_BATCH):
                j = i + MOONCAKE_MAX_BATCH
                rcs += self.store.batch_upsert_from(keys[i:j], ptrs[i:j], sizes[i:j], self.cfg)
        bad = [(k, c) for k, c in zip(keys, rcs) if c != 0]
        if bad:
            why = " (-200: NO_AVAILABLE_HANDLE, no space left in any segment)" if any(c == -200 for _, c in bad) else ""
            raise RuntimeError(f"Mooncake upsert failed for {len(bad)} of {len(keys)} values, e.g. {bad[:3]}{why}")

    def get_into(self, part, rows, fields, outs, side=()) -> None:
        keys, ptrs, sizes = [], [], []
        for f in fields:
            for r, a in zip(rows, outs[f]):
                keys.append(mooncake_key(part, r, f))
                ptrs.append(a.ctypes.data)
                sizes.append(a.nbytes)
        if len(keys) == 1:
            got = [self.store.get_into(keys[0], ptrs[0], sizes[0])]
        else:
            got = []
            for i in range(0, len(keys), MOONCAKE_MAX_BATCH):
                j = i + MOONCAKE_MAX_BATCH
                got += self.store.batch_get_into(keys[i:j], ptrs[i:j], sizes[i:j])
        bad = [(k, g, s) for k, g, s in zip(keys, got, sizes) if g != s]
        if bad:
            raise RuntimeError(f"Mooncake get failed for {len(bad)} of {len(keys)} values, e.g. {bad[:3]}")

    def clear(self, part, rows, fields) -> int:
        keys = [mooncake_key(part, r, f) for r in rows for f in fields]
        if len(keys) == 1:
            rcs = [self.store.remove(keys[0], True)]
        else:
            rcs = self.store.batch_remove(keys, True)
        bad = [(k, c) for k, c in zip(keys, rcs) if c != 0]
        if bad:
            raise RuntimeError(f"Mooncake remove failed for {len(bad)} of {len(keys)} keys, e.g. {bad[:3]}")
        return len(keys)

    clear_partition = clear

    def close(self) -> None:
        self.store.close()


class MooncakeRowClient(MooncakeClient):
    """The layout a Mooncake expert would pick for rows of fields: one key
    per row holding all its fields (batch_put_from_multi_buffers /
    batch_get_into_multi_buffers, straight from and into the registered
    per-field arrays, no packing copy). A write-back of some fields (side)
    goes to a second key per row ("<row>#wb"): 0.3.13.post1 has no upsert
    for multi-buffer puts, and a put to an existing key returns success
    without writing. A read that must see the write-back takes those
    fields from "#wb" and the others from the row key by byte range
    (batch_get_into_multi_buffer_ranges, inside a get session)."""

    def _chunks(self, n):
        for i in range(0, n, MOONCAKE_MAX_BATCH):
            yield i, i + MOONCAKE_MAX_BATCH

    def put_rows(self, part, rows, cols, side=False) -> None:
        fields = list(cols)
        keys = [f"{part}/{r}" + ("#wb" if side else "") for r in rows]
        ptrs = [[cols[f][i].ctypes.data for f in fields] for i in range(len(rows))]
        sizes = [[cols[f][i].nbytes for f in fields] for i in range(len(rows))]
        rcs = []
        for i, j in self._chunks(len(keys)):
            rcs += self.store.batch_put_from_multi_buffers(keys[i:j], ptrs[i:j], sizes[i:j], self.cfg)
        bad = [(k, c) for k, c in zip(keys, rcs) if c != 0]
        if bad:
            raise RuntimeError(f"Mooncake multi-buffer put failed for {len(bad)} of {len(keys)} rows, e.g. {bad[:3]}")

    def get_into(self, part, rows, fields, outs, side=()) -> None:
        """`outs` holds every field the row key was put with (in the
        order they were put): the byte offsets of the wanted ones follow
        from their sizes."""
        side = [f for f in fields if f in side]
        main = [f for f in fields if f not in side]
        n = len(rows)
        jobs = []  # (keys, ptrs, sizes, offsets or None)
        if side:
            jobs.append(([f"{part}/{r}#wb" for r in rows],
                         [[outs[f][i].ctypes.data for f in side] for i in range(n)],
                         [[outs[f][i].nbytes for f in side] for i in range(n)], None))
        if main:
            allf = list(outs)
            keys = [f"{part}/{r}" for r in rows]
            if main == allf:
                jobs.append((keys, [[outs[f][i].ctypes.data for f in main] for i in range(n)],
                             [[outs[f][i].nbytes for f in main] for i in range(n)], None))
            else:
                ptrs, sizes, offs = [], [], []
                for i in range(n):
                    off, o = 0, {}
                    for f in allf:
                        o[f] = off
                        off += outs[f][i].nbytes
                    ptrs.append([outs[f][i].ctypes.data for f in main])
                    sizes.append([outs[f][i].nbytes for f in main])
                    offs.append([o[f] for f in main])
                jobs.append((keys, ptrs, sizes, offs))
        for keys, ptrs, sizes, offs in jobs:
            got = []
            for i, j in self._chunks(len(keys)):
                if offs is None:
                    got += self.store.batch_get_into_multi_buffers(keys[i:j], ptrs[i:j], sizes[i:j])
                else:  # ranged reads work inside a get session (replicas looked up once)
                    self.store.batch_get_session_start(keys[i:j])
                    try:
                        got += self.store.batch_get_into_multi_buffer_ranges(keys[i:j], ptrs[i:j], sizes[i:j], offs[i:j])
                    finally:
                        self.store.batch_get_session_end(keys[i:j])
            bad = [(k, g, sum(s)) for k, g, s in zip(keys, got, sizes) if g != sum(s)]
            if bad:
                raise RuntimeError(f"Mooncake multi-buffer get failed for {len(bad)} of {len(keys)} rows, e.g. {bad[:3]}")

    def clear(self, part, rows, fields) -> int:
        keys = [f"{part}/{r}" for r in rows]
        rcs = self.store.batch_remove(keys, True) if len(keys) > 1 else [self.store.remove(keys[0], True)]
        bad = [(k, c) for k, c in zip(keys, rcs) if c != 0]
        if bad:
            raise RuntimeError(f"Mooncake remove failed for {len(bad)} of {len(keys)} keys, e.g. {bad[:3]}")
        # the write-back keys, where there were any (a missing key is no error here)
        self.store.batch_remove([k + "#wb" for k in keys], True)
        return len(keys)

    clear_partition = clear


class MooncakeShmClient(MooncakeClient):
    """Mooncake's same-host path: a dummy client (setup_dummy) of a real
    client (the mooncake_client process, which owns the memory) on this
    host. The dummy moves values through memory it shares with the real
    client, so the arrays it puts from and reads into must be allocated
    from that shared pool (alloc_from_mem_pool) and registered whole;
    arrays from anywhere else are refused. One key per (row, field), as
    MooncakeClient."""

    def __init__(self, real: str, pool_bytes: int, local_buffer: int = 64 * MiB):
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.store = MooncakeDistributedStore()
        rc = self.store.setup_dummy(int(pool_bytes), local_buffer, real)
        if rc != 0:
            raise RuntimeError(f"Mooncake dummy client setup failed: {rc}")
        self.cfg = ReplicateConfig()
        self.cfg.replica_num = 1
        self.cfg.with_hard_pin = True
        self.registered = set()

    def alloc(self, nbytes: int) -> np.ndarray:
        import ctypes

        ptr = self.store.alloc_from_mem_pool(int(nbytes))
        if not ptr:
            raise RuntimeError(f"Mooncake alloc_from_mem_pool({nbytes}) failed: the dummy client's pool is full")
        return np.ctypeslib.as_array((ctypes.c_uint8 * int(nbytes)).from_address(ptr))


def mooncake_connect(conn: dict) -> MooncakeClient:
    if conn.get("layout") == "shm":
        return MooncakeShmClient(conn["real"], conn["pool"])
    cls = MooncakeRowClient if conn.get("layout") == "row" else MooncakeClient
    return cls(conn["master"])


class MooncakeBackend:
    """mooncake_master on 127.0.0.1 plus `units` processes that each mount
    a segment (bench/mooncake_owner.py). Runs inside the private network
    namespace that compare.py made for the whole Mooncake side."""

    name = "mooncake"

    def __init__(self, layout: str = "field"):
        self.layout = layout  # "field": one key per (row, field); "row": MooncakeRowClient
        self.master = None
        self.owners: List[subprocess.Popen] = []
        self.client: Optional[MooncakeClient] = None
        self.logdir = os.environ.get("BENCH_LOGDIR", "/tmp")

    def start(self, units: int, memory: int, transport: str = "tcp", disk: Optional[dict] = None) -> None:
        self.stop()
        bindir = os.path.dirname(sys.executable)
        master_bin = os.path.join(bindir, "mooncake_master")
        rpc, metrics = free_port(), free_port()
        self.metrics_port = metrics
        self.master_addr = f"127.0.0.1:{rpc}"
        mlog = open(os.path.join(self.logdir, "mooncake_master.log"), "ab")
        # INFO level for the master only: if it dies, its log says why.
        menv = dict(os.environ, GLOG_minloglevel="0")
        self.master = subprocess.Popen(
            [master_bin, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
             "--metrics_host=127.0.0.1", f"--metrics_port={metrics}",
             "--enable_http_metadata_server=false"] + (["--enable_offload=true"] if disk else []),
            stdin=subprocess.DEVNULL, stdout=mlog, stderr=mlog, env=menv,
        )
        wait_for(lambda: _port_open(rpc) or self._master_died(), 30, "mooncake_master to listen")
        if self.master.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {self.master.returncode}")
        olog = open(os.path.join(self.logdir, "mooncake_owners.log"), "ab")
        if self.layout == "shm":
            # one real client owns all the memory (as one object store per
            # node); every benchmark client is a dummy client of it
            self.real_port = free_port()
            self.pool = max(64 * MiB, units * memory // 2)
            self.owners.append(subprocess.Popen(
                [os.path.join(bindir, "mooncake_client"), f"--master_server_address={self.master_addr}",
                 "--host=127.0.0.1", f"--port={self.real_port}", f"--global_segment_size={units * memory >> 20}MB",
                 "--local_buffer_size=64MB", "--protocol=tcp", "--metadata_server=P2PHANDSHAKE"],
                stdin=subprocess.DEVNULL, stdout=olog, stderr=olog))
            wait_for(lambda: _port_open(self.real_port) or self.owners[0].poll() is not None, 60,
                     "mooncake_client (the real client) to listen")
            if self.owners[0].poll() is not None:
                raise RuntimeError(f"mooncake_client exited with {self.owners[0].returncode}")
            self.client = mooncake_connect(dict(self.conn(), pool=64 * MiB))
            return
        for _ in range(units):
            p = subprocess.Popen(
                [sys.executable, os.path.join(HERE, "mooncake_owner.py"), self.master_addr, str(memory)]
                + ([disk["dir"]] if disk else []),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=olog,
            )
            self.owners.append(p)
        for p in self.owners:
            try:
                line = _readline(p, 60)
            except TimeoutError as e:
                line = str(e).encode()
            if not line.startswith(b"READY"):
                master = "running" if self.master.poll() is None else f"exited with {self.master.returncode}"
                raise RuntimeError(f"Mooncake segment owner failed to start ({line!r}); mooncake_master {master}")
        self.client = mooncake_connect(self.conn())

    def _master_died(self):
        return self.master.poll() is not None

    def conn(self) -> dict:
        c = {"system": "mooncake", "master": self.master_addr, "layout": self.layout}
        if self.layout == "shm":
            c.update(real=f"127.0.0.1:{self.real_port}", pool=self.pool)
        return c

    def memory_pids(self) -> List[int]:
        return [p.pid for p in self.owners] + ([self.master.pid] if self.master else [])

    def used_bytes(self) -> Optional[int]:
        try:
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
                text = r.read().decode()
            for line in text.splitlines():
                if line.startswith("master_allocated_bytes") or line.startswith("master_mem_allocated_size"):
                    return int(float(line.split()[-1]))
        except Exception:  # noqa: BLE001 - optional figure
            return None
        return None

    def stop(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass
            self.client = None
        for p in self.owners:
            try:
                if p.stdin is not None:
                    p.stdin.close()  # an owner exits when its stdin closes
                else:
                    p.terminate()  # the real client (mooncake_client)
            except Exception:  # noqa: BLE001
                pass
        for p in self.owners:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                stop_pid(p)
        self.owners = []
        stop_pid(self.master)
        self.master = None

    @staticmethod
    def version() -> str:
        from importlib.metadata import version

        return version("mooncake-transfer-engine-non-cuda")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _readline(p: subprocess.Popen, timeout: float) -> bytes:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
            raise TimeoutError(f"no answer from pid {p.pid} within {timeout:.0f}s")
        chunk = os.read(p.stdout.fileno(), 1 << 16)
        if not chunk:
            break
        buf += chunk
    sel.close()
    return buf


# ---------------------------------------------------------------------------
# Ray


def _descendants(pids: set) -> set:
    """Every process whose ancestry reaches one of `pids` (/proc)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out = set()
    for p in parent:
        q, seen = p, 0
        while q in parent and seen < 64:
            if q in pids:
                out.add(p)
                break
            q, seen = parent[q], seen + 1
    return out


def ray_env() -> None:
    if "ray" in sys.modules and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        raise RuntimeError("ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


class RayBackend:
    name = "ray"

    def __init__(self, layout=None):
        self.started = False
        self.pids: List[int] = []

    def start(self, units: int, memory: int, transport: str = "shm", disk: Optional[dict] = None) -> None:
        """One local Ray instance whose object store holds twice `units *
        memory` bytes (Ray has one object store per node, and frees an
        object some time after its last reference goes: a store sized to
        one batch would push the next batch's put to its disk fallback).
        With a disk tier, exactly `units * memory`, so that it spills."""
        ray_env()
        import ray

        self.stop()
        kwargs = {}
        if disk:
            kwargs["object_spilling_directory"] = disk["dir"]
        ray.init(
            # always a new local instance: without it ray.init joins any
            # cluster another user of this machine started with `ray start`
            address="local",
            num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
            object_store_memory=int(units * memory * (1 if disk else 2)), log_to_driver=False,
            configure_logging=False, **kwargs,
        )
        self.started = True
        node = ray._private.worker._global_node
        self.popens = [pi.process for v in node.all_processes.values() for pi in v]
        self.procs = {k: [pi.process.pid for pi in v] for k, v in node.all_processes.items()}
        self.raylet = self.procs.get("raylet", [])
        self.check_loopback()

    def check_loopback(self) -> None:
        """Every TCP listener of this process and of Ray's processes must be
        on loopback (ss -ltnp); otherwise stop."""
        ours = {os.getpid()} | {p for v in self.procs.values() for p in v}
        ours |= _descendants(ours)  # Ray's workers and agents are children of its processes
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
        bad = []
        for line in out.splitlines():
            cols = line.split()
            if len(cols) < 4:
                continue
            local = cols[3]
            pids = {int(x.split("=")[1]) for x in line.split(",") if x.startswith("pid=")}
            if not pids & ours:  # another user's processes (their own Ray, say) are not ours to judge
                continue
            host = local.rsplit(":", 1)[0].strip("[]")
            if host not in ("127.0.0.1", "::ffff:127.0.0.1", "::1"):
                bad.append(line)
        if bad:
            self.stop()
            raise RuntimeError("Ray listens beyond loopback: " + "; ".join(bad))

    def memory_pids(self) -> List[int]:
        return list(self.raylet)  # plasma, the object store, lives in the raylet

    def used_bytes(self) -> Optional[int]:
        # ray.internal memory_summary needs grpc (ray[default]); the plasma
        # file's allocation is in the shm_alloc figure instead.
        return None

    def stop(self) -> None:
        if self.started:
            import ray

            ray.shutdown()
            self.started = False
            # ray.shutdown stops its processes; make sure, by pid (these
            # are this process's children, so a reused pid is never hit).
            for p in getattr(self, "popens", []):
                stop_pid(p, grace=2.0)
            self.popens = []

    @staticmethod
    def version() -> str:
        import ray

        return ray.__version__


BACKENDS = {"stowage": StowageBackend, "mooncake": MooncakeBackend, "ray": RayBackend}
CONNECT = {"stowage": stowage_connect, "mooncake": mooncake_connect}
