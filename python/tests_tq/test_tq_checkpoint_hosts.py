"""TransferQueue checkpoints across hosts with no shared directory
(issue 26).

Three "hosts" on one machine: network namespaces made by this test (the
pattern of crates/cli/tests/netns.rs), a unit in each of ``a`` and ``b``
and the client in ``c``, joined by veth pairs with private addresses. Each
unit's checkpoint root is the same path, ``<tmp>/root``, but a bind mount
private to its own mount namespace over a directory of its own host
(``<tmp>/host-a``, ``<tmp>/host-b``): the client sees neither, and no
directory is shared. The client drives the storage manager's checkpoint
functions (``stowage.tq._save_checkpoint`` / ``_load_checkpoint``) over a
plane of the two units (TransferQueue's controller is not on the data
path), renames the checkpoint directory on its own host as TransferQueue
does, clears everything, loads it back and reads every row exactly; then
one unit's part is deleted on its host, and a load is refused naming that
part, its unit and host, with nothing changed.

Skipped, saying why, where namespaces cannot be made (not root, no ``ip``).
The namespaces and every process are removed at the end, also on failure.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

pytest.importorskip(
    "transfer_queue",
    reason="transferqueue is not installed: these tests need `pip install 'stowage-rl[tq]'` "
    "(scripts/test-tq runs them in a venv that has it)",
)

import stowage

ADDR_A = "10.78.1.2:7200"
ADDR_B = "10.78.2.2:7200"


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class _Hosts:
    """Network namespaces and the processes in them; close() kills the
    processes (by pid) and removes the namespaces."""

    def __init__(self, tag: str):
        self.tag = tag
        self.names: list = []
        self.procs: list = []

    def make(self) -> None:
        for h in "abc":
            name = f"{self.tag}{h}"
            _ip("netns", "add", name)
            self.names.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        for peer, net in (("a", 1), ("b", 2)):
            c_end, p_end = f"{self.tag}c{peer}", f"{self.tag}{peer}c"
            _ip(
                "link", "add", c_end, "netns", f"{self.tag}c", "type", "veth",
                "peer", "name", p_end, "netns", f"{self.tag}{peer}",
            )  # fmt: skip
            _ip("-n", f"{self.tag}c", "addr", "add", f"10.78.{net}.1/24", "dev", c_end)
            _ip("-n", f"{self.tag}{peer}", "addr", "add", f"10.78.{net}.2/24", "dev", p_end)
            _ip("-n", f"{self.tag}c", "link", "set", c_end, "up")
            _ip("-n", f"{self.tag}{peer}", "link", "set", p_end, "up")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        for n in self.names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)


@pytest.fixture
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    h = _Hosts(f"stq{os.getpid() % 100000}")
    try:
        h.make()
    except (RuntimeError, OSError) as e:
        h.close()
        pytest.skip(f"cannot create network namespaces here: {e}")
    try:
        yield h
    finally:
        h.close()


def _start_unit(hosts: _Hosts, host: str, addr: str, own: str, root: str, secret: str):
    """A unit in namespace ``host`` whose checkpoint root ``root`` is, in
    its own mount namespace only, a bind mount of ``own``."""
    ns = f"{hosts.tag}{host}"
    # `ip netns exec` gives the command a mount namespace of its own (its
    # mounts do not reach the parent's): the bind mount is this host's.
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    cmd = [
        "ip", "netns", "exec", ns, "sh", "-c", script, "sh", own, root,
        *stowage.unit_command(),
        "--no-mlock", "--memory", "64MiB", "--name", f"unit-{host}",
        "--listen", f"tcp:{addr}", "--secret-file", secret, "--checkpoint-root", root,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "STOWAGE_SECRET"}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    hosts.procs.append(p)
    ready = threading.Event()
    seen: list = []

    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            seen.append(line)
            if "READY" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(60), f"the unit in {ns} never reported ready: {seen}"


# The client, in host c: a plane of both units over tcp with the secret.
_CLIENT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import stowage, stowage.tq as stq
    from stowage import _tq_cells

    phase, root, secret_file = sys.argv[1], sys.argv[2], sys.argv[3]
    NS = "transfer_queue"
    with open(secret_file, "rb") as f:
        secret = f.read().strip()
    plane = stowage.connect(["tcp:%s", "tcp:%s"], namespace=NS, secret=secret, timeout=60)
    key = plane._client.cell_key()

    def expected():
        rows = {}
        for r in range(12):
            ids = np.arange(r + 3, dtype=np.int64) * (r + 1)
            reward = np.array(r / 4, dtype=np.float32)
            text = {"sample": r, "words": ["w"] * r}
            rows[("train", r)] = {"ids": ids, "reward": reward, "text": text}
        for r in range(100, 105):
            rows[("val", r)] = {"x": np.full((2, 3), r, dtype=np.float16)}
        return rows

    def put_all(rows):
        for (p, r), cols in rows.items():
            vals = {}
            for f, v in cols.items():
                if isinstance(v, np.ndarray):
                    vals[f] = [v]
                else:
                    vals[f] = [_tq_cells.seal(key, NS, p, r, f, v)]
            plane.put(p, [r], vals)

    def read_all(rows):
        got = {}
        for (p, r), cols in rows.items():
            fields = sorted(cols)
            vals = plane._client.get(p, [r], fields, None, None, True)
            got[(p, r)] = {}
            for f, v in zip(fields, vals):
                v = v[0]
                if not isinstance(cols[f], np.ndarray):
                    v = _tq_cells.open_cell(key, NS, p, r, f, v)
                got[(p, r)][f] = v
        return got

    def same(a, b):
        if isinstance(a, np.ndarray):
            return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape \\
                and np.array_equal(a, b)
        return a == b

    step = os.path.join(root, "step-1")
    if phase == "save-load":
        rows = expected()
        put_all(rows)
        # TransferQueue saves into <dir>.tmp and renames it on its own host.
        stq._save_checkpoint(plane, NS, step + ".tmp")
        os.rename(step + ".tmp", step)
        record = json.load(open(os.path.join(step, "stowage_checkpoint.json")))
        for u in record["units"]:
            assert not os.path.exists(os.path.join(step, u["dir"])), "a part is on the client"
        print("RECORD " + json.dumps(record), flush=True)
        # Clear everything, and write rows the load must remove.
        for p in plane.partitions():
            plane.clear_partition(p)
        assert plane.partitions() == []
        plane.put("junk", [5], {"y": [np.ones(3, np.uint8)]})
        plane.put("train", [1], {"ids": [np.zeros(1, np.int64)]})
        cells = stq._RestoredCells(key, NS, None, False)
        stq._load_checkpoint(plane, cells, step, 60.0)
        assert sorted(plane.partitions()) == ["train", "val"], plane.partitions()
        got = read_all(rows)
        for k, cols in rows.items():
            for f, v in cols.items():
                assert same(v, got[k][f]), (k, f, v, got[k][f])
        listed = {p: sorted(plane.list(p)) for p in ("train", "val")}
        assert listed == {"train": list(range(12)), "val": list(range(100, 105))}, listed
        print("ROUNDTRIP-OK", flush=True)
    else:
        plane.put("train", [0], {"ids": [np.full(2, 7, np.int64)]})
        cells = stq._RestoredCells(key, NS, None, False)
        try:
            stq._load_checkpoint(plane, cells, step, 60.0)
        except stq.CheckpointRefused as e:
            print("REFUSED " + json.dumps(str(e)), flush=True)
        else:
            print("LOADED", flush=True)
        got = plane._client.get("train", [0], ["ids"], None, None, True)[0][0]
        assert np.array_equal(got, np.full(2, 7, np.int64)), got
        assert sorted(plane.partitions()) == ["train", "val"]
        print("UNCHANGED", flush=True)
    plane.close()
    """
    % (ADDR_A, ADDR_B)
)


def _client(hosts: _Hosts, tmp_path, phase: str, root: str, secret: str) -> str:
    script = tmp_path / "client.py"
    script.write_text(_CLIENT)
    env = {k: v for k, v in os.environ.items() if k != "STOWAGE_SECRET"}
    p = subprocess.Popen(
        ["ip", "netns", "exec", f"{hosts.tag}c", sys.executable, str(script), phase, root, secret],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    hosts.procs.append(p)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, f"the client ({phase}) failed:\n{out}\n{err}"
    return out


def test_checkpoint_across_hosts_without_a_shared_directory(hosts, tmp_path):
    secret = tmp_path / "secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    root = tmp_path / "root"
    own = {h: tmp_path / f"host-{h}" for h in "ab"}
    for d in (root, *own.values()):
        d.mkdir(mode=0o700)
    _start_unit(hosts, "a", ADDR_A, str(own["a"]), str(root), str(secret))
    _start_unit(hosts, "b", ADDR_B, str(own["b"]), str(root), str(secret))

    out = _client(hosts, tmp_path, "save-load", str(root), str(secret))
    assert "ROUNDTRIP-OK" in out, out
    record = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RECORD "))[7:])
    # The manifest says which host holds which part, and each part is on
    # its own host only, under the name its unit wrote it at.
    assert [u["address"] for u in record["units"]] == [f"tcp:{ADDR_A}", f"tcp:{ADDR_B}"]
    for u, h in zip(record["units"], "ab"):
        assert u["host"], u
        assert u["stored"] == f"step-1.tmp/{u['dir']}", u
        assert (own[h] / u["stored"] / "MANIFEST").is_file()
        other = own["b" if h == "a" else "a"]
        assert not (other / u["stored"]).exists()
        assert not (root / "step-1" / u["dir"]).exists()
    # The client's host holds the record only.
    assert os.listdir(root) == ["step-1"]
    assert os.listdir(root / "step-1") == ["stowage_checkpoint.json"]

    # A part lost on its host: refused, naming the part, its unit and host,
    # and nothing changes.
    lost = record["units"][0]
    shutil.rmtree(own["a"] / lost["stored"])
    out = _client(hosts, tmp_path, "missing", str(root), str(secret))
    assert "UNCHANGED" in out, out
    refused = [ln for ln in out.splitlines() if ln.startswith("REFUSED ")]
    assert refused, out
    msg = json.loads(refused[0][8:])
    assert "part 0" in msg and f"tcp:{ADDR_A}" in msg and repr(lost["host"]) in msg, msg
    assert lost["stored"] in msg and "is missing" in msg and "no directory" in msg, msg
    # Every unit was asked, and said what it lacks.
    assert f"unit 0 (tcp:{ADDR_A}" in msg and f"unit 1 (tcp:{ADDR_B}" in msg, msg
