"""The machine's limits, measured in the same run as the systems:

* memcpy: numpy copies (np.copyto) of the same values over the same
  working set as a put/get cell, on one thread and on every core;
* raw TCP: a plain Python socket pair over loopback, in two processes,
  with the request/reply pattern of a put (the bytes, then a 1-byte ack)
  and of a get (a small request, then the bytes);
* disk: sequential write with fsync, then read (page cache dropped for
  the file), on the filesystem of the disk tier.

    python bench/limits.py --tcp-server   # the far end of the raw TCP pair
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

from common import MiB, stop_pid  # noqa: E402

HEADER = struct.Struct("<QB")  # total bytes, op (0 put, 1 get, 2 bye)


def make_values(size: int, batch: int) -> list:
    return [np.full(size, (i * 37 + 11) & 0xFF, dtype=np.uint8) for i in range(batch)]


def memcpy_gbps(size: int, batch: int, iters: int, threads: int = 1) -> float:
    src = make_values(size, batch)
    dst = [np.empty_like(a) for a in src]
    # the pieces each thread copies: whole values, or slices of one value
    pieces = []
    if batch >= threads:
        pieces = [list(zip(src[t::threads], dst[t::threads])) for t in range(threads)]
    else:
        step = -(-size // threads)
        pieces = [
            [(s[t * step:(t + 1) * step], d[t * step:(t + 1) * step]) for s, d in zip(src, dst)]
            for t in range(threads)
        ]
    for s, d in zip(src, dst):
        np.copyto(d, s)  # fault the pages in
    if threads == 1:
        t = time.perf_counter()
        for _ in range(iters):
            for s, d in pieces[0]:
                np.copyto(d, s)
        return size * batch * iters / (time.perf_counter() - t) / 1e9
    barrier = threading.Barrier(threads + 1)

    def run(mine):
        barrier.wait()
        for _ in range(iters):
            for s, d in mine:
                np.copyto(d, s)

    ts = [threading.Thread(target=run, args=(p,)) for p in pieces]
    for th in ts:
        th.start()
    barrier.wait()
    t = time.perf_counter()
    for th in ts:
        th.join(timeout=600)
    return size * batch * iters / (time.perf_counter() - t) / 1e9


def _recv_exact(sock, view) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


def tcp_server() -> int:
    """The far end: a buffer that puts fill and gets read."""
    lsock = socket.socket()
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
    """A client of tcp_server in another process."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--tcp-server"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        )
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
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
    if sys.argv[1:] == ["--tcp-server"]:
        sys.exit(tcp_server())
    print(__doc__)
