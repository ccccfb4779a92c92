"""The machine's limits, measured in the same run as the systems:

* memcpy: libc memcpy (through ctypes, GIL released) of the same value
  sizes and batches as a put/get cell, source and destination walking
  through pre-faulted buffers far larger than the last-level cache (cold),
  on one thread and on as many threads as stowage splits that copy over;
* Python socket, request/reply: a blocking Python socket pair over
  loopback, in two processes, default buffers, with the request/reply
  pattern of a put (the bytes, then a 1-byte ack) and of a get (a small
  request, then the bytes);
* tuned TCP stream: the same pair with 4 MiB socket buffers, each
  direction one continuous stream of large sends, one ack at the end;
* disk: sequential write with fsync, then read (page cache dropped for
  the file), on the filesystem of the disk tier.

    python bench/limits.py --tcp-server   # the far end of the raw TCP pair
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

from common import MiB, stop_pid  # noqa: E402

HEADER = struct.Struct("<QB")  # total bytes, op (0 put, 1 get, 2 bye)


def make_values(size: int, batch: int) -> list:
    return [np.full(size, (i * 37 + 11) & 0xFF, dtype=np.uint8) for i in range(batch)]


# ---------------------------------------------------------------------------
# memcpy: libc's, through ctypes (which releases the GIL for the call), on
# cold buffers


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.memcpy.restype = ctypes.c_void_p
_libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

# stowage splits a copy of at least this many bytes over min(4, cores)
# threads (stowage_shm::PARALLEL_COPY_MIN, crates/shm); smaller copies take
# one thread.
STOWAGE_SPLIT_BYTES = 8 * MiB


def stowage_copy_threads(size: int) -> int:
    return min(4, os.cpu_count() or 1) if size >= STOWAGE_SPLIT_BYTES else 1


def cold_pool(nbytes: int, fill: int) -> np.ndarray:
    """A page-aligned buffer of `nbytes`, every page written (pre-faulted),
    64-byte aligned."""
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    a = raw[off:off + nbytes]
    a.fill(fill)
    return a


def memcpy_gbps(size: int, batch: int, iters: int, threads: int = 1, pool: int = 512 * MiB) -> float:
    """libc memcpy of `batch` values of `size` bytes per iteration, source
    and destination each walking through a pre-faulted buffer of at least
    `pool` bytes (far larger than the last-level cache), so that no
    iteration finds its bytes cached. With threads > 1 each value is split
    into `threads` contiguous pieces copied at once (as stowage splits a
    large copy)."""
    n = size * batch
    # a batch at least as large as the pool is cold by itself (one slot)
    slots = max(1, pool // n) if n < pool else 1
    src = cold_pool(slots * n, 0x5A)
    dst = cold_pool(slots * n, 0)
    sbase, dbase = src.ctypes.data, dst.ctypes.data
    step = -(-size // threads)
    plan = []  # per iteration slot: per thread, [(dst, src, len)]
    for slot in range(slots):
        per = [[] for _ in range(threads)]
        for j in range(batch):
            off = slot * n + j * size
            for t in range(threads):
                a, b = t * step, min(size, (t + 1) * step)
                if b > a:
                    per[t].append((dbase + off + a, sbase + off + a, b - a))
        plan.append(per)
    memcpy = _libc.memcpy

    def run(pieces):
        for d, s_, k in pieces:
            memcpy(d, s_, k)

    if threads == 1:
        t0 = time.perf_counter()
        for it in range(iters):
            run(plan[it % slots][0])
        dt = time.perf_counter() - t0
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda _: None, range(threads)))  # threads started
            t0 = time.perf_counter()
            for it in range(iters):
                list(ex.map(run, plan[it % slots]))
            dt = time.perf_counter() - t0
    del src, dst
    return n * iters / dt / 1e9


def memcpy_latency_ns(size: int, iters: int, pool: int = 256 * MiB) -> list:
    """One libc memcpy of `size` bytes per sample, walking cold buffers."""
    slots = max(2, pool // size)
    src = cold_pool(slots * size, 0x5A)
    dst = cold_pool(slots * size, 0)
    memcpy = _libc.memcpy
    out = []
    for i in range(iters):
        off = (i % slots) * size
        d, s_ = dst.ctypes.data + off, src.ctypes.data + off
        t = time.perf_counter_ns()
        memcpy(d, s_, size)
        out.append(time.perf_counter_ns() - t)
    return out


def _recv_exact(sock, view) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


SOCK_BUF = 4 * MiB  # SO_SNDBUF / SO_RCVBUF of the tuned stream (net.core.[rw]mem_max here)
CHUNK = 16 * MiB  # the stream's receive / send buffer at the far end


def _tune(sock) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)


def tcp_server(tuned: bool = False) -> int:
    """The far end: a buffer that puts fill and gets read (ops 0, 1), or a
    stream sink / source (ops 3, 4: n bytes in CHUNK pieces, one ack at the
    end of a sink)."""
    lsock = socket.socket()
    if tuned:
        _tune(lsock)  # before listen: the window scale is agreed at connect
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    print(lsock.getsockname()[1], flush=True)
    lsock.settimeout(60)
    conn, _ = lsock.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(300)
    buf = bytearray(0)
    hdr = bytearray(HEADER.size)
    while True:
        _recv_exact(conn, memoryview(hdr))
        n, op = HEADER.unpack(hdr)
        if op == 2:
            break
        if op in (3, 4):
            if len(buf) < CHUNK:
                buf = bytearray(CHUNK)
            view = memoryview(buf)
            left = n
            while left > 0:
                k = min(left, CHUNK)
                if op == 3:
                    _recv_exact(conn, view[:k])
                else:
                    conn.sendall(view[:k])
                left -= k
            if op == 3:
                conn.sendall(b"\x01")
            continue
        if len(buf) < n:
            buf = bytearray(n)
        view = memoryview(buf)[:n]
        if op == 0:
            _recv_exact(conn, view)
            conn.sendall(b"\x01")
        else:
            conn.sendall(view)
    conn.close()
    return 0


class RawTcp:
    """A client of tcp_server in another process. Plain: blocking Python
    sockets with default buffers, request/reply per batch (gbps,
    latency_ns). tuned=True: 4 MiB socket buffers at both ends, for
    stream_gbps (one continuous stream, one ack at its end)."""

    def __init__(self, tuned: bool = False):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--tcp-server"] + (["--tuned"] if tuned else []),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        )
        port = int(self.proc.stdout.readline())
        self.sock = socket.socket()
        if tuned:
            _tune(self.sock)
        self.sock.settimeout(60)
        self.sock.connect(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(300)

    def gbps(self, size: int, batch: int, iters: int) -> tuple:
        src = make_values(size, batch)
        out = [np.empty_like(a) for a in src]
        total = size * batch
        ack = bytearray(1)

        def put():
            self.sock.sendall(HEADER.pack(total, 0))
            for a in src:
                self.sock.sendall(memoryview(a))
            _recv_exact(self.sock, memoryview(ack))

        def get():
            self.sock.sendall(HEADER.pack(total, 1))
            for a in out:
                _recv_exact(self.sock, memoryview(a))

        put(), get()  # warm-up: both ends fault their buffers in
        t = time.perf_counter()
        for _ in range(iters):
            put()
        put_gbps = total * iters / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for _ in range(iters):
            get()
        get_gbps = total * iters / (time.perf_counter() - t) / 1e9
        return put_gbps, get_gbps

    def stream_gbps(self, size: int, batch: int, iters: int) -> tuple:
        """`iters` batches sent as one stream (a sendall per value, no
        reply until the end), then received as one stream: (put, get)
        GB/s."""
        src = make_values(size, batch)
        out = [np.empty_like(a) for a in src]
        total = size * batch
        ack = bytearray(1)

        def put(k):
            self.sock.sendall(HEADER.pack(total * k, 3))
            for _ in range(k):
                for a in src:
                    self.sock.sendall(memoryview(a))
            _recv_exact(self.sock, memoryview(ack))

        def get(k):
            self.sock.sendall(HEADER.pack(total * k, 4))
            for _ in range(k):
                for a in out:
                    _recv_exact(self.sock, memoryview(a))

        put(1), get(1)  # warm-up
        t = time.perf_counter()
        put(iters)
        put_gbps = total * iters / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        get(iters)
        get_gbps = total * iters / (time.perf_counter() - t) / 1e9
        return put_gbps, get_gbps

    def latency_ns(self, size: int, iters: int) -> tuple:
        a = make_values(size, 1)[0]
        ack = bytearray(1)
        puts, gets = [], []
        for _ in range(iters):
            t = time.perf_counter_ns()
            self.sock.sendall(HEADER.pack(size, 0))
            self.sock.sendall(memoryview(a))
            _recv_exact(self.sock, memoryview(ack))
            t1 = time.perf_counter_ns()
            self.sock.sendall(HEADER.pack(size, 1))
            _recv_exact(self.sock, memoryview(a))
            t2 = time.perf_counter_ns()
            puts.append(t1 - t)
            gets.append(t2 - t1)
        return puts, gets

    def close(self) -> None:
        try:
            self.sock.sendall(HEADER.pack(0, 2))
            self.sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            stop_pid(self.proc)


def disk_gbps(directory: str, total: int, chunk: int = 4 * MiB) -> tuple:
    """Sequential write of `total` bytes with a final fsync, then a read of
    the file after dropping it from the page cache: (write, read) GB/s."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"limits-dd-{os.getpid()}")
    buf = np.full(chunk, 0x3C, dtype=np.uint8)
    try:
        t = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        left = total
        while left > 0:
            n = min(left, chunk)
            os.write(fd, memoryview(buf)[:n])
            left -= n
        os.fsync(fd)
        os.close(fd)
        write = total / (time.perf_counter() - t) / 1e9
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        rbuf = bytearray(chunk)
        t = time.perf_counter()
        while os.readv(fd, [rbuf]) > 0:
            pass
        read = total / (time.perf_counter() - t) / 1e9
        os.close(fd)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return write, read


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tcp-server"]:
        sys.exit(tcp_server(tuned="--tuned" in sys.argv[2:]))
    print(__doc__)
