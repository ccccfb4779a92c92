//! A client's own counters: operations by kind and outcome, Busy retries
//! and the time spent waiting them out, waits for memory, value bytes put
//! and got, and each unit's latency. Recorded with relaxed atomic adds
//! (no lock, no allocation per operation); read with
//! [`crate::Client::metrics`] or registered into a `prometheus-client`
//! registry with [`crate::Client::register_metrics`].

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
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

/// [`BOUNDS`] in nanoseconds (observing compares integers).
const BOUNDS_NS: [u64; 19] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
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
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let i = BOUNDS_NS.partition_point(|&b| b < ns);
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Relaxed)).sum()
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

/// The clock of operation latencies: quanta's calibrated TSC reads cost
/// about half of `Instant::now` on the VMs measured (27 against 49 ns),
/// and only latencies use it (deadlines stay on `Instant`). Calibrated
/// once per process, in about a millisecond.
static CLOCK: LazyLock<quanta::Clock> = LazyLock::new(quanta::Clock::new);

/// One operation's timer: two clock reads for an operation on one unit,
/// one at the start and one at the unit's answer, which is also the
/// operation's end (an operation's latency runs from the call to the last
/// unit's answer, or to its failure if no unit answered). Shared by the
/// workers of an operation's units.
pub(crate) struct OpTimer {
    start: u64,
    /// The latest unit answer's clock reading (0: none yet).
    last: AtomicU64,
}

impl OpTimer {
    pub(crate) fn start() -> Self {
        Self {
            start: CLOCK.raw(),
            last: AtomicU64::new(0),
        }
    }

    /// Unit `unit` answered: its latency, from the operation's start.
    pub(crate) fn unit_done(&self, m: &ClientMetrics, unit: usize) {
        let now = CLOCK.raw();
        self.last.fetch_max(now, Relaxed);
        m.unit_latency(unit, CLOCK.delta(self.start, now));
    }

    /// The operation's latency.
    pub(crate) fn took(&self) -> Duration {
        let end = match self.last.load(Relaxed) {
            0 => CLOCK.raw(),
            last => last,
        };
        CLOCK.delta(self.start, end)
    }
}

/// Start the latency clock's calibration now rather than on the first
/// operation.
pub(crate) fn warm_clock() {
    LazyLock::force(&CLOCK);
}

/// A client's counters (shared by its threads).
#[derive(Debug)]
pub struct ClientMetrics {
    /// Failed calls; the others are their latency histogram's count less
    /// these (one atomic add fewer per call).
    op_errors: [AtomicU64; OPS],
    op_latency: [Histogram; OPS],
    busy_retries: AtomicU64,
    busy_wait_ns: AtomicU64,
    memory_waits: AtomicU64,
    memory_wait_ns: AtomicU64,
    bytes_put: AtomicU64,
    bytes_got: AtomicU64,
    units: Vec<(String, Histogram)>,
    /// Each unit's transport now (index into [`TRANSPORTS`] plus one; 0:
    /// not reached yet).
    unit_transport: Vec<std::sync::atomic::AtomicU8>,
    /// Copies of every row, units whose copies share a host, units found
    /// down (docs/replication.md).
    copies: [AtomicU64; 3],
    /// Repairs due, newcomers repaired, values stored and their bytes,
    /// values refused (`repair.rs`).
    repair: [AtomicU64; 5],
    /// Claimed rows whose consumption marks were not written to every
    /// copy (`claims.rs`).
    marks_failed: AtomicU64,
}

/// The transports a client reaches units by.
const TRANSPORTS: [&str; 3] = ["shm", "tcp", "nixl"];

impl ClientMetrics {
    pub(crate) fn new(units: &[crate::UnitAddr]) -> Self {
        Self {
            op_errors: Default::default(),
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
            unit_transport: units.iter().map(|_| Default::default()).collect(),
            copies: [AtomicU64::new(1), AtomicU64::new(0), AtomicU64::new(0)],
            repair: Default::default(),
            marks_failed: AtomicU64::new(0),
        }
    }

    /// Unit `unit` is reached over `transport` (`shm`, `tcp`, `nixl`).
    /// The client's copies: `replicas`, and the units whose copies share
    /// a host.
    pub(crate) fn copies(&self, replicas: usize, short_of_hosts: usize) {
        self.copies[0].store(replicas as u64, Relaxed);
        self.copies[1].store(short_of_hosts as u64, Relaxed);
    }

    /// A unit was found down (with copies: given no copy any more).
    pub(crate) fn unit_down(&self) {
        self.copies[2].fetch_add(1, Relaxed);
    }

    /// Repairs this client knows to be due now.
    pub(crate) fn repairs_pending(&self, n: usize) {
        self.repair[0].store(n as u64, Relaxed);
    }

    /// A newcomer was brought up to every row of a unit's.
    pub(crate) fn repaired_pair(&self) {
        self.repair[1].fetch_add(1, Relaxed);
    }

    /// A repair stored `values` values of `bytes` bytes and had `refused`
    /// refused.
    pub(crate) fn repaired(&self, values: u64, bytes: u64, refused: u64) {
        self.repair[2].fetch_add(values, Relaxed);
        self.repair[3].fetch_add(bytes, Relaxed);
        self.repair[4].fetch_add(refused, Relaxed);
    }

    /// The consumption marks of `rows` claimed rows were not written to
    /// every copy.
    pub(crate) fn marks_failed(&self, rows: usize) {
        self.marks_failed.fetch_add(rows as u64, Relaxed);
    }

    pub(crate) fn transport(&self, unit: usize, transport: &str) {
        if let (Some(slot), Some(i)) = (
            self.unit_transport.get(unit),
            TRANSPORTS.iter().position(|t| *t == transport),
        ) {
            slot.store(i as u8 + 1, Relaxed);
        }
    }

    pub(crate) fn op(&self, op: ClientOp, ok: bool, took: Duration) {
        if !ok {
            self.op_errors[op as usize].fetch_add(1, Relaxed);
        }
        self.op_latency[op as usize].observe(took);
    }

    /// A unit answered Busy (or full, while waiting for memory): the
    /// client waited `backoff` (as it passed) and asks again.
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
                    ok: self.op_latency[i]
                        .count()
                        .saturating_sub(self.op_errors[i].load(Relaxed)),
                    error: self.op_errors[i].load(Relaxed),
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
            repairs_pending: self.repair[0].load(Relaxed),
            repaired_newcomers: self.repair[1].load(Relaxed),
            repaired_values: self.repair[2].load(Relaxed),
            repaired_bytes: self.repair[3].load(Relaxed),
            repair_refused_values: self.repair[4].load(Relaxed),
            claim_marks_failed: self.marks_failed.load(Relaxed),
        }
    }
}

/// What recording one call costs the client, on average over `iters`
/// calls (one thread): its two clock reads, its kind, outcome and
/// latency, one unit's latency and its bytes. `stowage bench` prints it.
pub fn recording_cost(iters: u32) -> Duration {
    let m = ClientMetrics::new(&[crate::UnitAddr::Unix("/u".into())]);
    let iters = iters.max(1);
    warm_clock();
    let t0 = std::time::Instant::now();
    for i in 0..iters {
        let timer = OpTimer::start();
        m.put_bytes(std::hint::black_box(65536 + u64::from(i & 1)));
        timer.unit_done(&m, 0);
        m.op(ClientOp::Put, true, timer.took());
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
    /// Repairs (docs/replication.md#repair): due now, newcomers repaired,
    /// values stored and their bytes, values refused.
    pub repairs_pending: u64,
    pub repaired_newcomers: u64,
    pub repaired_values: u64,
    pub repaired_bytes: u64,
    pub repair_refused_values: u64,
    /// Claimed rows whose consumption marks were not written to every
    /// copy (docs/replication.md#claims).
    pub claim_marks_failed: u64,
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
                let errors = m.op_errors[i].load(Relaxed);
                let ok = m.op_latency[i].count().saturating_sub(errors);
                for (outcome, v) in [("ok", ok), ("error", errors)] {
                    let labels = [("op", *name), ("outcome", outcome)];
                    ConstCounter::new(v).encode(d.encode_family(&labels)?)?;
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
        for (i, (name, help)) in [
            (
                "stowage_client_copies",
                "Copies of every row this client keeps (replicas).",
            ),
            (
                "stowage_client_copies_short_of_hosts",
                "Units whose rows' copies share a host (the plane has fewer hosts than copies).",
            ),
            (
                "stowage_client_units_down",
                "Units this client found dead or restarted; with copies, they are given no copy any more.",
            ),
        ]
        .into_iter()
        .enumerate()
        {
            ConstGauge::new(m.copies[i].load(Relaxed) as i64).encode(e.encode_descriptor(
                name,
                help,
                None,
                MetricType::Gauge,
            )?)?;
        }
        ConstGauge::new(m.repair[0].load(Relaxed) as i64).encode(e.encode_descriptor(
            "stowage_client_repairs_pending",
            "Repairs this client knows to be due: pairs of a unit whose copies moved to a newcomer, and the newcomer, not repaired yet.",
            None,
            MetricType::Gauge,
        )?)?;
        for (i, (name, help)) in [
            (
                "stowage_client_repaired_newcomers",
                "Newcomers this client brought up to every row of a unit's.",
            ),
            (
                "stowage_client_repaired_values",
                "Values this client's repairs stored on newcomers.",
            ),
            (
                "stowage_client_repaired_bytes",
                "Bytes of the values this client's repairs stored on newcomers.",
            ),
            (
                "stowage_client_repair_refused_values",
                "Values newcomers refused from this client's repairs: already there, or cleared since the repair read them.",
            ),
        ]
        .into_iter()
        .enumerate()
        {
            ConstCounter::new(m.repair[i + 1].load(Relaxed)).encode(e.encode_descriptor(
                name,
                help,
                None,
                MetricType::Counter,
            )?)?;
        }
        ConstCounter::new(m.marks_failed.load(Relaxed)).encode(e.encode_descriptor(
            "stowage_client_claim_marks_failed",
            "Claimed rows whose consumption marks this client could not write to every copy: until a later mark, the unit that claims them after their claimer's death may serve them again.",
            None,
            MetricType::Counter,
        )?)?;
        {
            let mut d = e.encode_descriptor(
                "stowage_client_unit_transport",
                "The transport this client reaches each unit by (1 for the one in use).",
                None,
                MetricType::Gauge,
            )?;
            for (i, ((addr, _), t)) in m.units.iter().zip(&m.unit_transport).enumerate() {
                let Some(transport) = (t.load(Relaxed) as usize)
                    .checked_sub(1)
                    .and_then(|t| TRANSPORTS.get(t))
                else {
                    continue;
                };
                let index = i.to_string();
                let labels = [
                    ("unit", index.as_str()),
                    ("address", addr.as_str()),
                    ("transport", transport),
                ];
                ConstGauge::new(1i64).encode(d.encode_family(&labels)?)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_in_nanoseconds_match_the_exported_bounds() {
        for (s, ns) in BOUNDS.iter().zip(BOUNDS_NS) {
            assert_eq!((s * 1e9).round() as u64, ns);
        }
    }

    #[test]
    fn each_units_transport_is_exported_once_known() {
        let m = Arc::new(ClientMetrics::new(&[
            crate::UnitAddr::Unix("/u0".into()),
            crate::UnitAddr::Unix("/u1".into()),
        ]));
        m.transport(1, "nixl");
        let mut r = prometheus_client::registry::Registry::default();
        r.register_collector(Box::new(ClientCollector(m.clone())));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("stowage_client_unit_transport{"))
            .collect();
        assert_eq!(lines.len(), 1, "{text}");
        assert!(
            lines[0].contains(r#"unit="1""#) && lines[0].contains(r#"transport="nixl""#),
            "{}",
            lines[0]
        );
        m.transport(1, "tcp");
        text.clear();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
        assert!(text.contains(r#"transport="tcp""#) && !text.contains(r#"transport="nixl""#));
    }

    #[test]
    fn outcomes_come_from_the_histogram_and_the_errors() {
        let m = ClientMetrics::new(&[crate::UnitAddr::Unix("/u".into())]);
        m.op(ClientOp::Get, true, Duration::from_micros(10));
        m.op(ClientOp::Get, true, Duration::from_micros(11));
        m.op(ClientOp::Get, false, Duration::from_secs(60));
        let get = &m.snapshot().operations[ClientOp::Get as usize];
        assert_eq!((get.ok, get.error), (2, 1));
        let le = |bound: f64| get.latency.buckets.iter().find(|b| b.0 == bound).unwrap().1;
        assert_eq!((le(10e-6), le(25e-6), le(f64::INFINITY)), (1, 2, 3));
        let timer = OpTimer::start();
        timer.unit_done(&m, 0);
        assert_eq!(
            timer.took(),
            timer.took(),
            "a call's end is its last unit's answer"
        );
        assert_eq!(m.snapshot().units[0].latency.count, 1);
    }
}
