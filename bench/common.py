"""Shared pieces of the comparative benchmark: workload shapes, the GRPO
row data, timing and process helpers, and the progress protocol between a
system runner (bench/run_system.py) and the driver (bench/compare.py).

Every system sees the same data: values are generated from the row number
and field name only, so stowage, Mooncake Store and Ray move identical
bytes, and a read can be checked against a regeneration.
"""

from __future__ import annotations

import json
import os
import sys
import time

# numpy on this kind of VM misdetects the CPU under these overrides; they
# are dropped in the benchmark's own processes only.
for _var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
    os.environ.pop(_var, None)

import numpy as np  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# ---------------------------------------------------------------------------
# workload shapes


def size_grid(quick: bool) -> dict:
    """The `sizes` workload: value sizes x batch lengths, and how many
    repetitions each gets. A batch whose bytes exceed `max_batch_bytes` is
    not run (the `big-batch` workload moves a multi-GiB batch)."""
    return {
        "sizes": [64 * KiB, 1 * MiB, 16 * MiB] if quick else [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB],
        "batches": [1, 16],
        "max_batch_bytes": 256 * MiB,
        # bytes moved per (size, batch) cell and direction, and the bounds
        # on repetitions
        "budget": (64 * MiB) if quick else (128 * MiB),
        "min_iters": 3,
        "max_iters": 200 if quick else 500,
        # and at most this long per cell (wall clock), past min_iters: a
        # slow system's small-value cells would otherwise take minutes
        "max_seconds": 0.5 if quick else 0.8,
        # sources and destinations walk through buffers of at least this
        # size (far larger than the last-level cache), so that no
        # repetition finds its bytes cached: cold, as a user's are
        "pool": (256 * MiB) if quick else (512 * MiB),
    }


def big_batch(quick: bool) -> dict:
    """The `big-batch` workload: one put and one get of a multi-GiB batch
    (16 MiB values) in one call each."""
    return {"size": 16 * MiB, "batch": 32 if quick else 128, "iters": 2 if quick else 1}


def iters_for(grid: dict, size: int, batch: int) -> int:
    n = grid["budget"] // (size * batch)
    return int(max(grid["min_iters"], min(grid["max_iters"], n)))


def latency_iters(quick: bool) -> int:
    return 1000 if quick else 2000


def grpo_variants(quick: bool) -> list:
    """(name, rows, timed repetitions, (min tokens, max tokens)) of the
    `grpo-step` workload; `long-*` rows hold 32k-128k tokens each."""
    if quick:
        return [("grpo-1k", 1024, 1, (MIN_TOKENS, MAX_TOKENS)), ("long-16", 16, 1, (LONG_MIN, LONG_MAX))]
    return [("grpo-1k", 1024, 2, (MIN_TOKENS, MAX_TOKENS)), ("grpo-4k", 4096, 1, (MIN_TOKENS, MAX_TOKENS)),
            ("long-32", 32, 2, (LONG_MIN, LONG_MAX))]


def churn_shape(quick: bool) -> dict:
    return {"kept": 256, "factor": 3, "steps": 10}


def disk_rows(quick: bool) -> int:
    # a third of the step must still hold Ray's smallest object store (75 MiB)
    return 6144


def scaling_shape(quick: bool, system: str) -> dict:
    """The `scaling` workload: N client processes, each putting then
    getting 64 KiB values one op at a time. Ray and Mooncake clients are
    heavier processes (an actor each; a transfer engine each): on 2 cores
    they stop at 16."""
    ladder = [1, 4, 16, 64] if system == "stowage" else [1, 4, 16]
    if quick:
        ladder = [1, 4, 16] if system == "stowage" else [1, 4]
    return {"clients": ladder, "ops_total": 2048, "min_ops": 64, "size": 64 * KiB}


def partial_shape(quick: bool) -> dict:
    """The `partial` workload: rows of 5 fields, read 1 of them."""
    return {"rows": 512 if quick else 1024, "iters": 3 if quick else 5, "field": "advantages"}


def zero_copy_shape(quick: bool) -> dict:
    """The `zero-copy` workload: a GRPO batch (jagged rows x 3 fields) read
    without copying (stowage get_view; Ray's ray.get of numpy arrays)."""
    return {"rows": 1024, "iters": 5 if quick else 10,
            "fields": ["input_ids", "generation_logprobs", "token_mask"]}


def kill_shape(quick: bool) -> dict:
    return {"rows": 256}


def shapes(quick: bool) -> dict:
    """Every workload's parameters, for the report."""
    return {"sizes": size_grid(quick), "big-batch": big_batch(quick), "latency_iters": latency_iters(quick),
            "grpo-step": grpo_variants(quick), "dapo-churn": churn_shape(quick), "disk_rows": disk_rows(quick),
            "scaling": {s: scaling_shape(quick, s) for s in ("stowage", "mooncake", "ray")},
            "partial": partial_shape(quick), "zero-copy": zero_copy_shape(quick), "kill": kill_shape(quick)}


WORKERS = 4  # concurrent client processes of grpo-step / dapo-churn / disk
UNITS = 4  # storage units (memory-owning processes) of the same workloads
SIZES_UNITS = 2  # units of the sizes / latency workloads

# ---------------------------------------------------------------------------
# GRPO rows

MIN_TOKENS, MAX_TOKENS = 512, 4096
LONG_MIN, LONG_MAX = 32 * 1024, 128 * 1024  # the long-sequence rows

# (field, dtype of stowage's column, stand-in dtype for peers without bf16)
FIELDS = [
    ("input_ids", "int64", "int64"),
    ("generation_logprobs", "bfloat16", "uint16"),
    ("prev_logprobs", "bfloat16", "uint16"),
    ("reference_policy_logprobs", "bfloat16", "uint16"),
    ("advantages", "bfloat16", "uint16"),
    ("token_mask", "int32", "int32"),
]
FIELD_NAMES = [f for f, _, _ in FIELDS]
WRITEBACK = ["prev_logprobs", "advantages"]
BYTES_PER_TOKEN = 8 + 2 * 4 + 4


def lengths(rows: int, seed: int = 0, lo: int = MIN_TOKENS, hi: int = MAX_TOKENS) -> np.ndarray:
    """Sequence lengths, uniform in [lo, hi] tokens (512-4,096 unless
    told), the same for every system (seeded)."""
    return np.random.default_rng(seed).integers(lo, hi + 1, size=rows)


def step_bytes(lens: np.ndarray) -> int:
    return int(lens.sum()) * BYTES_PER_TOKEN


def value(row: int, field: int, length: int, dtype: str, version: int = 0) -> np.ndarray:
    """The value of (row, field): cheap to make, different for every row,
    field and version, so that a misplaced or stale read is caught."""
    item = np.dtype("uint16" if dtype == "bfloat16" else dtype).itemsize
    words = np.arange(length * item // 2, dtype=np.uint16)
    words += np.uint16((row * 7919 + field * 104729 + version * 15485863) & 0xFFFF)
    arr = words.view(np.uint8).view("uint16" if dtype == "bfloat16" else dtype)
    if dtype == "bfloat16":
        try:
            import ml_dtypes

            arr = arr.view(ml_dtypes.bfloat16)
        except ImportError:
            pass
    return arr


def bf16_dtype():
    try:
        import ml_dtypes

        return ml_dtypes.bfloat16
    except ImportError:
        return np.uint16


def shard_rows(rows: int, workers: int, role: str, w: int) -> list:
    """Rows handled by worker `w` in a phase: writers take rows w, w+W, ...;
    the first reader group takes contiguous blocks; the second takes the
    rows written by the previous writer. No reader reads what its own
    process wrote, as across the processes of an RL step."""
    if role == "writer":
        return list(range(w, rows, workers))
    if role == "reader1":
        per = -(-rows // workers)
        return list(range(w * per, min(rows, (w + 1) * per)))
    if role == "reader2":
        return list(range((w - 1) % workers, rows, workers))
    raise ValueError(role)


# ---------------------------------------------------------------------------
# measuring


def now() -> float:
    return time.perf_counter()


def quantiles_us(samples_ns: list) -> dict:
    a = np.sort(np.asarray(samples_ns, dtype=np.float64)) / 1e3
    if a.size == 0:
        return {}

    def q(p):
        return float(a[min(a.size - 1, int(round((a.size - 1) * p)))])

    return {
        "ops_per_s": float(1e6 / a.mean()),
        "p50_us": q(0.5),
        "p99_us": q(0.99),
        "p999_us": q(0.999),
        "mean_us": float(a.mean()),
        "n": int(a.size),
    }


def rss_bytes(pid: int) -> dict:
    """VmRSS (and its shared-memory part) of a process, in bytes."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssShmem:", "RssAnon:", "RssFile:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def shm_bytes(pids: list) -> int:
    """Memory allocated to the shared-memory files (memfd, /dev/shm) that
    the processes map, each file counted once, whoever touched its pages:
    stowage's slabs, Ray's plasma store. (VmRSS counts a shared page only
    in the processes that faulted it in.)"""
    seen = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.readlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(None, 5)
            if len(parts) < 6 or "s" not in parts[1] or parts[4] == "0":
                continue
            path = parts[5].strip()
            if not (path.startswith("/dev/shm/") or path.startswith("/memfd:")):
                continue
            try:
                st = os.stat(f"/proc/{pid}/map_files/{parts[0]}")
            except OSError:
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sum(seen.values())


def sum_rss(pids: list) -> dict:
    total = {"VmRSS": 0, "RssShmem": 0, "RssAnon": 0, "RssFile": 0}
    for p in pids:
        for k, v in rss_bytes(p).items():
            total[k] = total.get(k, 0) + v
    total["shm_alloc"] = shm_bytes(pids)
    return total


def wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    """Poll `pred` until it returns a true value; bounded by `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def stop_pid(proc, grace: float = 5.0) -> None:
    """Stop a child (subprocess.Popen) by its pid: SIGTERM, then SIGKILL
    after `grace` seconds; always reaped."""
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.terminate()
        proc.wait(timeout=grace)
    except Exception:  # noqa: BLE001 - escalate whatever went wrong
        try:
            proc.kill()
            proc.wait(timeout=grace)
        except Exception:  # noqa: BLE001
            pass


# ---------------------------------------------------------------------------
# the runner -> driver protocol: one JSON object per stdout line

_out = sys.stdout


def emit(ev: str, **kw) -> None:
    kw["ev"] = ev
    _out.write(json.dumps(kw) + "\n")
    _out.flush()


def progress(workload: str, frac: float, what: str = "") -> None:
    emit("progress", workload=workload, frac=round(min(1.0, max(0.0, frac)), 4), what=what)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
