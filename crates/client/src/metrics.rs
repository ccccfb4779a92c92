//! A client's own counters: operations by kind and outcome, Busy retries
//! and the time spent waiting them out, waits for memory, value bytes put
//! and got, and each unit's latency. Recorded with relaxed atomic adds
//! (no lock, no allocation per operation); read with
//! [`crate::Client::metrics`] or registered into a `prometheus-client`
//! registry with [`crate::Client::register_metrics`].

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;
use serde::Serialize;

/// An operation of the client, as the `op` label names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientOp {
    Put = 0,
    Get = 1,
    Clear = 2,
    View = 3,
    Control = 4,
}

const OPS: usize = 5;
const OP_NAMES: [&str; OPS] = ["put", "get", "clear", "view", "control"];

/// Latency bounds, seconds.
const BOUNDS: [f64; 19] = [
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A lock-free histogram of durations over [`BOUNDS`].
#[derive(Debug)]
struct Histogram {
    buckets: [AtomicU64; BOUNDS.len() + 1],
    sum_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BOUNDS.partition_point(|&b| b < s);
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_ns
            .fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }

    fn snapshot(&self) -> LatencySnapshot {
        let per: Vec<u64> = self.buckets.iter().map(|b| b.load(Relaxed)).collect();
        let mut cum = 0;
        let buckets = BOUNDS
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(&per)
            .map(|(le, n)| {
                cum += n;
                (le, cum)
            })
            .collect();
        LatencySnapshot {
            count: cum,
            sum_seconds: self.sum_ns.load(Relaxed) as f64 / 1e9,
            buckets,
        }
    }
}

/// A client's counters (shared by its threads).
#[derive(Debug)]
pub struct ClientMetrics {
    ops: [[AtomicU64; 2]; OPS],
    op_latency: [Histogram; OPS],
    busy_retries: AtomicU64,
    busy_wait_ns: AtomicU64,
    memory_waits: AtomicU64,
    memory_wait_ns: AtomicU64,
    bytes_put: AtomicU64,
    bytes_got: AtomicU64,
    units: Vec<(String, Histogram)>,
}

impl ClientMetrics {
    pub(crate) fn new(units: &[crate::UnitAddr]) -> Self {
        Self {
            ops: Default::default(),
            op_latency: Default::default(),
            busy_retries: AtomicU64::new(0),
            busy_wait_ns: AtomicU64::new(0),
            memory_waits: AtomicU64::new(0),
            memory_wait_ns: AtomicU64::new(0),
            bytes_put: AtomicU64::new(0),
            bytes_got: AtomicU64::new(0),
            units: units
                .iter()
                .map(|a| (a.to_string(), Histogram::default()))
                .collect(),
        }
    }

    pub(crate) fn op(&self, op: ClientOp, ok: bool, took: Duration) {
        self.ops[op as usize][usize::from(!ok)].fetch_add(1, Relaxed);
        self.op_latency[op as usize].observe(took);
    }

    /// A unit answered Busy (or full, while waiting for memory): the
    /// client waits `backoff` and asks again.
    pub(crate) fn retry(&self, memory: bool, backoff: Duration) {
        let ns = u64::try_from(backoff.as_nanos()).unwrap_or(u64::MAX);
        if memory {
            self.memory_waits.fetch_add(1, Relaxed);
            self.memory_wait_ns.fetch_add(ns, Relaxed);
        } else {
            self.busy_retries.fetch_add(1, Relaxed);
            self.busy_wait_ns.fetch_add(ns, Relaxed);
        }
    }

    pub(crate) fn put_bytes(&self, n: u64) {
        self.bytes_put.fetch_add(n, Relaxed);
    }

    pub(crate) fn got_bytes(&self, n: u64) {
        self.bytes_got.fetch_add(n, Relaxed);
    }

    /// Unit `unit`'s part of an operation took `took`.
    pub(crate) fn unit_latency(&self, unit: usize, took: Duration) {
        if let Some((_, h)) = self.units.get(unit) {
            h.observe(took);
        }
    }

    /// The counters now.
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            operations: OP_NAMES
                .iter()
                .enumerate()
                .map(|(i, name)| OpSnapshot {
                    op: name,
                    ok: self.ops[i][0].load(Relaxed),
                    error: self.ops[i][1].load(Relaxed),
                    latency: self.op_latency[i].snapshot(),
                })
                .collect(),
            busy_retries: self.busy_retries.load(Relaxed),
            busy_wait_seconds: self.busy_wait_ns.load(Relaxed) as f64 / 1e9,
            memory_waits: self.memory_waits.load(Relaxed),
            memory_wait_seconds: self.memory_wait_ns.load(Relaxed) as f64 / 1e9,
            bytes_put: self.bytes_put.load(Relaxed),
            bytes_got: self.bytes_got.load(Relaxed),
            units: self
                .units
                .iter()
                .enumerate()
                .map(|(i, (a, h))| UnitSnapshot {
                    index: i,
                    address: a.clone(),
                    latency: h.snapshot(),
                })
                .collect(),
        }
    }
}

/// What recording one call costs the client, on average over `iters`
/// calls (one thread): the clock reads, its kind, outcome and latency,
/// one unit's latency and its bytes. `stowage bench` prints it.
pub fn recording_cost(iters: u32) -> Duration {
    let m = ClientMetrics::new(&[crate::UnitAddr::Unix("/u".into())]);
    let iters = iters.max(1);
    let t0 = std::time::Instant::now();
    for i in 0..iters {
        let start = std::time::Instant::now();
        m.put_bytes(std::hint::black_box(65536 + u64::from(i & 1)));
        m.unit_latency(0, start.elapsed());
        m.op(ClientOp::Put, true, start.elapsed());
    }
    std::hint::black_box(&m);
    t0.elapsed() / iters
}

/// A client's counters at one moment ([`ClientMetrics::snapshot`]).
#[derive(Clone, Debug, Serialize)]
pub struct MetricsSnapshot {
    /// Per operation kind: put, get, clear, view, control.
    pub operations: Vec<OpSnapshot>,
    /// Busy answers that were waited out and asked again.
    pub busy_retries: u64,
    pub busy_wait_seconds: f64,
    /// Full answers waited on (`wait_for_memory`), and the time.
    pub memory_waits: u64,
    pub memory_wait_seconds: f64,
    /// Value bytes written by successful puts and read by successful gets.
    pub bytes_put: u64,
    pub bytes_got: u64,
    pub units: Vec<UnitSnapshot>,
}

#[derive(Clone, Debug, Serialize)]
pub struct OpSnapshot {
    pub op: &'static str,
    pub ok: u64,
    pub error: u64,
    pub latency: LatencySnapshot,
}

/// A unit's part of puts and gets.
#[derive(Clone, Debug, Serialize)]
pub struct UnitSnapshot {
    pub index: usize,
    pub address: String,
    pub latency: LatencySnapshot,
}

/// A latency histogram: cumulative counts per upper bound (seconds; the
/// last is +Inf).
#[derive(Clone, Debug, Serialize)]
pub struct LatencySnapshot {
    pub count: u64,
    pub sum_seconds: f64,
    pub buckets: Vec<(f64, u64)>,
}

/// Encodes a client's metrics into a `prometheus-client` registry
/// ([`crate::Client::register_metrics`]).
#[derive(Debug)]
pub(crate) struct ClientCollector(pub(crate) Arc<ClientMetrics>);

fn encode_hist(h: &Histogram, mut e: prometheus_client::encoding::MetricEncoder) -> fmt::Result {
    let per: Vec<(f64, u64)> = BOUNDS
        .iter()
        .copied()
        .chain([f64::INFINITY])
        .zip(h.buckets.iter().map(|b| b.load(Relaxed)))
        .collect();
    let count = per.iter().map(|(_, n)| n).sum();
    e.encode_histogram::<NoLabelSet>(h.sum_ns.load(Relaxed) as f64 / 1e9, count, &per, None)
}

impl Collector for ClientCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
        let m = &self.0;
        {
            let mut d = e.encode_descriptor(
                "stowage_client_operations",
                "Client operations, by kind (op) and outcome.",
                None,
                MetricType::Counter,
            )?;
            for (i, name) in OP_NAMES.iter().enumerate() {
                for (j, outcome) in ["ok", "error"].iter().enumerate() {
                    let labels = [("op", *name), ("outcome", *outcome)];
                    ConstCounter::new(m.ops[i][j].load(Relaxed))
                        .encode(d.encode_family(&labels)?)?;
                }
            }
        }
        {
            let mut d = e.encode_descriptor(
                "stowage_client_operation_duration_seconds",
                "Client operations' duration, by kind (all units' parts, retries included).",
                None,
                MetricType::Histogram,
            )?;
            for (i, name) in OP_NAMES.iter().enumerate() {
                encode_hist(&m.op_latency[i], d.encode_family(&[("op", *name)])?)?;
            }
        }
        for (name, help, v) in [
            (
                "stowage_client_busy_retries",
                "Busy answers the client waited out and asked again.",
                m.busy_retries.load(Relaxed),
            ),
            (
                "stowage_client_memory_waits",
                "UnitFull answers a put waited on (wait_for_memory) and asked again.",
                m.memory_waits.load(Relaxed),
            ),
        ] {
            ConstCounter::new(v).encode(e.encode_descriptor(
                name,
                help,
                None,
                MetricType::Counter,
            )?)?;
        }
        for (name, help, ns) in [
            (
                "stowage_client_busy_wait_seconds",
                "Time spent backing off after Busy answers.",
                m.busy_wait_ns.load(Relaxed),
            ),
            (
                "stowage_client_memory_wait_seconds",
                "Time puts spent waiting for memory (wait_for_memory).",
                m.memory_wait_ns.load(Relaxed),
            ),
        ] {
            ConstCounter::new(ns as f64 / 1e9).encode(e.encode_descriptor(
                name,
                help,
                None,
                MetricType::Counter,
            )?)?;
        }
        {
            let mut d = e.encode_descriptor(
                "stowage_client_bytes",
                "Value bytes of successful puts (put) and gets (get).",
                None,
                MetricType::Counter,
            )?;
            for (dir, v) in [("put", &m.bytes_put), ("get", &m.bytes_got)] {
                ConstCounter::new(v.load(Relaxed))
                    .encode(d.encode_family(&[("direction", dir)])?)?;
            }
        }
        let mut d = e.encode_descriptor(
            "stowage_client_unit_duration_seconds",
            "Time until each unit's part of a put or get was done, by unit.",
            None,
            MetricType::Histogram,
        )?;
        for (i, (addr, h)) in m.units.iter().enumerate() {
            let index = i.to_string();
            let labels = [("unit", index.as_str()), ("address", addr.as_str())];
            encode_hist(h, d.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
