//! A unit's metrics: counters and histograms recorded on the request path,
//! and gauges read from the core at scrape time, exposed in the Prometheus
//! text format (`prometheus-client`'s encoder) on `GET /metrics`
//! (`http`). Every metric is listed in docs/metrics.md.
//!
//! Recording is a few relaxed atomic adds into arrays fixed at start: no
//! lock, no allocation, no label lookup per request. The registry holds
//! one [`Collector`] that encodes these atomics and the unit's
//! [`stowage_wire::Stats`] when scraped.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use stowage_wire::{ErrorCode, Request};

use crate::Shared;

/// A request kind, as the `op` label names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Hello,
    Alloc,
    Commit,
    Abort,
    Resolve,
    Unpin,
    ClearRows,
    Put,
    Read,
    List,
    ClearPartition,
    ListPartitions,
    Stats,
    Checkpoint,
    Shutdown,
    Auth,
}

const OPS: usize = 16;
/// The `op` label values. The clear requests keep the labels of the names
/// they had before (`release_rows`, `drop_partition`), so that dashboards
/// and alerts over them keep working.
const OP_NAMES: [&str; OPS] = [
    "hello",
    "alloc",
    "commit",
    "abort",
    "resolve",
    "unpin",
    "release_rows",
    "put",
    "get",
    "list",
    "drop_partition",
    "list_partitions",
    "stats",
    "checkpoint",
    "shutdown",
    "auth",
];

impl Op {
    pub(crate) fn of(req: &Request) -> Op {
        match req {
            // Connection set-up and control.
            Request::Hello { .. }
            | Request::NixlInfo { .. }
            | Request::OpenRing { .. }
            | Request::RingKick => Op::Hello,
            Request::Alloc { .. } => Op::Alloc,
            // A commit that also reserves the client's next spare.
            Request::Commit { .. } | Request::CommitSpare { .. } => Op::Commit,
            Request::Abort { .. } => Op::Abort,
            Request::Resolve { .. } => Op::Resolve,
            Request::Unpin { .. } => Op::Unpin,
            Request::ClearRows { .. } => Op::ClearRows,
            Request::Put { .. } => Op::Put,
            Request::Read { .. } => Op::Read,
            Request::List { .. } => Op::List,
            Request::ClearPartition { .. } => Op::ClearPartition,
            Request::ListPartitions => Op::ListPartitions,
            Request::Stats => Op::Stats,
            Request::Checkpoint { .. }
            | Request::OpenRestore { .. }
            | Request::CloseRestore { .. } => Op::Checkpoint,
            Request::Shutdown { .. } => Op::Shutdown,
            Request::Auth { .. } | Request::Prove { .. } => Op::Auth,
        }
    }
}

const CODES: usize = 8;
const CODE_NAMES: [&str; CODES] = [
    "full",
    "busy",
    "unknown_blob",
    "invalid_request",
    "version_mismatch",
    "unauthorized",
    "internal",
    "not_owner",
];

fn code_index(c: ErrorCode) -> usize {
    match c {
        ErrorCode::Full => 0,
        ErrorCode::Busy => 1,
        ErrorCode::UnknownBlob => 2,
        ErrorCode::InvalidRequest => 3,
        ErrorCode::VersionMismatch => 4,
        ErrorCode::Unauthorized => 5,
        ErrorCode::Internal => 6,
        ErrorCode::NotOwner => 7,
    }
}

/// How value bytes moved: copied by the client through its mapping of the
/// slab (`shm`), or streamed by the unit over the Unix socket (`uds`) or
/// TCP (`tcp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transport {
    Shm = 0,
    Uds = 1,
    Tcp = 2,
}
const TRANSPORT_NAMES: [&str; 3] = ["shm", "uds", "tcp"];

/// Why holds were released without their owner asking.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Reclaim {
    /// The peer closed its connection (it finished or died).
    Closed = 0,
    /// The unit cut a connection of a peer that never mapped the slab.
    Cut = 1,
    /// The process of a cut session exited.
    ProcessExited = 2,
}
const RECLAIM_NAMES: [&str; 3] = ["closed", "cut", "process_exited"];

/// Request latency bounds, in seconds.
pub(crate) const LATENCY_BOUNDS: [f64; 19] = [
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Checkpoint duration bounds, in seconds.
pub(crate) const CHECKPOINT_BOUNDS: [f64; 12] = [
    0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0,
];

/// A histogram of durations with fixed bounds: two relaxed atomic adds per
/// observation (its bucket and the sum; the count is the buckets' total).
/// Readers may see a bucket and the sum of slightly different moments (as
/// with any lock-free histogram).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    bounds_ns: Box<[u64]>,
    /// Per bucket (not cumulative); the last is +Inf.
    buckets: Box<[AtomicU64]>,
    sum_ns: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            bounds_ns: bounds.iter().map(|b| (b * 1e9) as u64).collect(),
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let i = self.bounds_ns.partition_point(|&b| b < ns);
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    /// Observe from this histogram's only writer: a plain load and store
    /// per value (no locked add; see [`PathCounters`]).
    fn observe_single_writer(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let i = self.bounds_ns.partition_point(|&b| b < ns);
        bump(&self.buckets[i], 1);
        bump(&self.sum_ns, ns);
    }

    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Relaxed)).sum()
    }

    /// Add this histogram's values into `into`'s.
    fn add_to(&self, into: &Histogram) {
        for (a, b) in self.buckets.iter().zip(into.buckets.iter()) {
            b.fetch_add(a.load(Relaxed), Relaxed);
        }
        into.sum_ns.fetch_add(self.sum_ns.load(Relaxed), Relaxed);
    }

    /// Encode as a Prometheus histogram (seconds).
    pub fn encode(&self, e: prometheus_client::encoding::MetricEncoder) -> fmt::Result {
        let per: Vec<u64> = self.buckets.iter().map(|b| b.load(Relaxed)).collect();
        encode_histogram(self.bounds, &per, self.sum_ns.load(Relaxed), e)
    }
}

/// Encode bucket counts (per bucket, the last +Inf) and a sum of
/// nanoseconds as a Prometheus histogram in seconds.
fn encode_histogram(
    bounds: &[f64],
    per: &[u64],
    sum_ns: u64,
    mut e: prometheus_client::encoding::MetricEncoder,
) -> fmt::Result {
    let buckets: Vec<(f64, u64)> = per
        .iter()
        .enumerate()
        .map(|(i, &c)| (bounds.get(i).copied().unwrap_or(f64::INFINITY), c))
        .collect();
    let count: u64 = per.iter().sum();
    e.encode_histogram::<NoLabelSet>(sum_ns as f64 / 1e9, count, &buckets, None)
}

/// Add `n` to a counter that only one thread writes: a plain load and
/// store (readers on other threads see the old or the new value).
#[inline]
fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Relaxed).wrapping_add(n), Relaxed);
}

/// What the request path records: latency per request kind, failed timed
/// requests, untimed requests by outcome, value bytes by transport.
///
/// Each connection owns one, written only by the thread serving it, so a
/// request records with plain loads and stores (about 1 ns each here,
/// against about 10 ns for an atomic add, and no cache line bounced
/// between the cores serving different connections); the unit sums the
/// live ones and those of closed connections when it is read.
#[derive(Debug)]
pub(crate) struct PathCounters {
    latency: [Histogram; OPS],
    /// Timed requests that failed; those that did not are their latency
    /// histogram's count less these.
    timed_errors: [AtomicU64; OPS],
    /// Untimed requests (unpin), by outcome: [ok, error].
    untimed: [[AtomicU64; 2]; OPS],
    /// Value bytes by transport: [in, out].
    bytes: [[AtomicU64; 2]; 3],
}

impl Default for PathCounters {
    fn default() -> Self {
        Self {
            latency: std::array::from_fn(|_| Histogram::new(&LATENCY_BOUNDS)),
            timed_errors: Default::default(),
            untimed: Default::default(),
            bytes: Default::default(),
        }
    }
}

impl PathCounters {
    /// A request of kind `op` was answered (`ok`: not with an error) in
    /// `took`. Only the owning thread calls this.
    #[inline]
    pub(crate) fn op(&self, op: Op, ok: bool, took: Duration) {
        if !ok {
            bump(&self.timed_errors[op as usize], 1);
        }
        self.latency[op as usize].observe_single_writer(took);
    }

    /// A request of kind `op` was answered, not timed.
    #[inline]
    pub(crate) fn count(&self, op: Op, ok: bool) {
        bump(&self.untimed[op as usize][usize::from(!ok)], 1);
    }

    #[inline]
    pub(crate) fn bytes_in(&self, t: Transport, n: u64) {
        bump(&self.bytes[t as usize][0], n);
    }

    #[inline]
    pub(crate) fn bytes_out(&self, t: Transport, n: u64) {
        bump(&self.bytes[t as usize][1], n);
    }

    /// Add everything into `into` (atomic adds: `into` has many writers).
    fn add_to(&self, into: &PathCounters) {
        for (a, b) in self.latency.iter().zip(&into.latency) {
            a.add_to(b);
        }
        let pairs = self
            .timed_errors
            .iter()
            .zip(&into.timed_errors)
            .chain(
                self.untimed
                    .iter()
                    .flatten()
                    .zip(into.untimed.iter().flatten()),
            )
            .chain(self.bytes.iter().flatten().zip(into.bytes.iter().flatten()));
        for (a, b) in pairs {
            b.fetch_add(a.load(Relaxed), Relaxed);
        }
    }
}

/// A thread's [`PathCounters`] ([`thread_counters`]), registered with the
/// unit's metrics for as long as the thread lives; dropping it folds them
/// into the unit's totals.
pub(crate) struct ThreadCounters {
    shared: Arc<Shared>,
    counters: Arc<PathCounters>,
}

impl std::ops::Deref for ThreadCounters {
    type Target = PathCounters;
    fn deref(&self) -> &PathCounters {
        &self.counters
    }
}

impl ThreadCounters {
    /// New counters for a connection of the unit of `shared` (`None`:
    /// metrics are off).
    pub(crate) fn attach(shared: &Arc<Shared>) -> Option<Self> {
        let m = shared.metrics.as_ref()?;
        let counters = Arc::new(PathCounters::default());
        lock(&m.live).push(counters.clone());
        Some(Self {
            shared: shared.clone(),
            counters,
        })
    }
}

impl Drop for ThreadCounters {
    fn drop(&mut self) {
        if let Some(m) = &self.shared.metrics {
            // Under the lock readers take: a reader sees these counters
            // either live or folded in, never both or neither.
            let mut live = lock(&m.live);
            self.counters.add_to(&m.closed);
            live.retain(|c| !Arc::ptr_eq(c, &self.counters));
        }
    }
}

/// The [`PathCounters`] the calling thread records into for the unit of
/// `shared` (`None`: metrics are off). A serving or pool thread serves
/// one connection at a time, so each thread's counters have one writer; a
/// thread's are folded into the unit's totals when it exits. (Per thread,
/// not per connection: ten thousand idle sessions cost no counters.)
pub(crate) fn thread_counters(shared: &Arc<Shared>) -> Option<Arc<PathCounters>> {
    shared.metrics.as_ref()?;
    thread_local! {
        static MINE: std::cell::RefCell<Vec<ThreadCounters>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    MINE.with(|mine| {
        let mut mine = mine.borrow_mut();
        if let Some(c) = mine.iter().find(|c| Arc::ptr_eq(&c.shared, shared)) {
            return Some(c.counters.clone());
        }
        let c = ThreadCounters::attach(shared)?;
        let counters = c.counters.clone();
        mine.push(c);
        Some(counters)
    })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The request path's counters summed over a unit's connections.
struct PathTotals {
    /// Per op: per-bucket counts and the sum in nanoseconds.
    latency: Vec<(Vec<u64>, u64)>,
    /// Per op: [ok, error].
    answered: Vec<[u64; 2]>,
    bytes: [[u64; 2]; 3],
}

/// The counters and histograms a unit records while it serves.
#[derive(Debug)]
pub struct UnitMetrics {
    /// The request path's counters of open connections ...
    live: Mutex<Vec<Arc<PathCounters>>>,
    /// ... and of closed ones.
    closed: PathCounters,
    errors: [AtomicU64; CODES],
    busy: AtomicU64,
    turned_away: AtomicU64,
    /// Handshakes cut, by [`HANDSHAKE_CUT_NAMES`].
    handshakes_cut: [AtomicU64; 3],
    reclaimed: [AtomicU64; 3],
    sessions_opened: AtomicU64,
    /// Request rings made, and requests served through them.
    rings_opened: AtomicU64,
    pub(crate) ring_requests: AtomicU64,
    pub(crate) spilled_bytes: AtomicU64,
    pub(crate) spill_batches: AtomicU64,
    pub(crate) disk_put_bytes: AtomicU64,
    pub(crate) promoted_bytes: AtomicU64,
    pub(crate) disk_streamed_bytes: AtomicU64,
    checkpoints: [AtomicU64; 2],
    checkpoint_seconds: Histogram,
}

impl Default for UnitMetrics {
    fn default() -> Self {
        Self {
            live: Mutex::new(Vec::new()),
            closed: PathCounters::default(),
            errors: Default::default(),
            busy: AtomicU64::new(0),
            turned_away: AtomicU64::new(0),
            handshakes_cut: Default::default(),
            reclaimed: Default::default(),
            sessions_opened: AtomicU64::new(0),
            rings_opened: AtomicU64::new(0),
            ring_requests: AtomicU64::new(0),
            spilled_bytes: AtomicU64::new(0),
            spill_batches: AtomicU64::new(0),
            disk_put_bytes: AtomicU64::new(0),
            promoted_bytes: AtomicU64::new(0),
            disk_streamed_bytes: AtomicU64::new(0),
            checkpoints: Default::default(),
            checkpoint_seconds: Histogram::new(&CHECKPOINT_BOUNDS),
        }
    }
}

impl UnitMetrics {
    /// The request path's counters summed over open and closed
    /// connections.
    fn path_totals(&self) -> PathTotals {
        let live = lock(&self.live);
        let all = || std::iter::once(&self.closed).chain(live.iter().map(|c| &**c));
        let sum = |f: &dyn Fn(&PathCounters) -> &AtomicU64| -> u64 {
            all().map(|c| f(c).load(Relaxed)).sum()
        };
        let latency = (0..OPS)
            .map(|i| {
                let per = (0..=LATENCY_BOUNDS.len())
                    .map(|b| sum(&|c| &c.latency[i].buckets[b]))
                    .collect::<Vec<u64>>();
                (per, sum(&|c| &c.latency[i].sum_ns))
            })
            .collect::<Vec<_>>();
        let answered = (0..OPS)
            .map(|i| {
                let errors = sum(&|c| &c.timed_errors[i]);
                let timed: u64 = latency[i].0.iter().sum();
                [
                    sum(&|c| &c.untimed[i][0]) + timed.saturating_sub(errors),
                    sum(&|c| &c.untimed[i][1]) + errors,
                ]
            })
            .collect();
        let bytes = std::array::from_fn(|t| std::array::from_fn(|d| sum(&|c| &c.bytes[t][d])));
        PathTotals {
            latency,
            answered,
            bytes,
        }
    }

    /// An error answer.
    #[inline]
    pub(crate) fn error(&self, code: ErrorCode) {
        self.errors[code_index(code)].fetch_add(1, Relaxed);
        if code == ErrorCode::Busy {
            self.busy.fetch_add(1, Relaxed);
        }
    }

    /// A connection refused at accept because the unit had too many.
    pub(crate) fn turned_away(&self) {
        self.turned_away.fetch_add(1, Relaxed);
        self.busy.fetch_add(1, Relaxed);
    }

    /// A connection made its request ring.
    pub(crate) fn ring_opened(&self) {
        self.rings_opened.fetch_add(1, Relaxed);
    }

    /// A connection's handshake was cut to admit a newer one.
    pub(crate) fn handshake_cut(&self, why: crate::admit::Cut) {
        let i = match why {
            crate::admit::Cut::Source => 0,
            crate::admit::Cut::Pool => 1,
        };
        self.handshakes_cut[i].fetch_add(1, Relaxed);
    }

    /// A connection's handshake ran past the handshake timeout.
    pub(crate) fn handshake_timed_out(&self) {
        self.handshakes_cut[2].fetch_add(1, Relaxed);
    }

    pub(crate) fn reclaimed(&self, why: Reclaim, holds: u64) {
        if holds > 0 {
            self.reclaimed[why as usize].fetch_add(holds, Relaxed);
        }
    }

    pub(crate) fn session_opened(&self) {
        self.sessions_opened.fetch_add(1, Relaxed);
    }

    pub(crate) fn checkpoint(&self, ok: bool, took: Duration) {
        self.checkpoints[usize::from(!ok)].fetch_add(1, Relaxed);
        self.checkpoint_seconds.observe(took);
    }

    /// Requests answered so far, and value bytes in and out: one pass
    /// over the connections' counters.
    pub(crate) fn traffic(&self) -> (u64, u64, u64) {
        let t = self.path_totals();
        let bytes = |dir: usize| t.bytes.iter().map(|b| b[dir]).sum();
        (t.answered.iter().flatten().sum(), bytes(0), bytes(1))
    }

    pub(crate) fn busy_total(&self) -> u64 {
        self.busy.load(Relaxed)
    }
}

/// Reasons a handshake was cut, as labelled.
const HANDSHAKE_CUT_NAMES: [&str; 3] = ["source_limit", "pool_full", "timeout"];

/// What recording one request costs, on average over `iters` requests
/// (one thread): the clock read at its end, its kind, outcome
/// and latency, and its bytes — what the request path does with metrics
/// on. `stowage bench` prints it next to the latencies it measures.
pub fn recording_cost(iters: u32) -> Duration {
    let m = PathCounters::default();
    let iters = iters.max(1);
    let t0 = std::time::Instant::now();
    for i in 0..iters {
        // A request's start is the clock read its frame deadline takes
        // anyway: recording adds the read at its end.
        m.bytes_in(
            Transport::Tcp,
            std::hint::black_box(65536 + u64::from(i & 1)),
        );
        m.op(Op::Put, true, t0.elapsed());
    }
    std::hint::black_box(&m);
    t0.elapsed() / iters
}

/// The registry of a unit: its metrics under the `stowage_` prefix, each
/// with the label `unit` (the unit's name).
pub(crate) fn registry(shared: &Arc<Shared>, name: &str) -> Registry {
    let mut r = Registry::with_prefix_and_labels(
        "stowage",
        [(
            std::borrow::Cow::Borrowed("unit"),
            std::borrow::Cow::Owned(name.to_owned()),
        )]
        .into_iter(),
    );
    r.register_collector(Box::new(UnitCollector {
        shared: Arc::downgrade(shared),
    }));
    r
}

/// Encodes a unit's metrics at scrape time. Holds the unit weakly: a
/// stopped unit's registry encodes nothing.
#[derive(Debug)]
struct UnitCollector {
    shared: Weak<Shared>,
}

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(name, help, None, MetricType::Counter)?)
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: f64) -> fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

/// One gauge family with one label.
fn gauges(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &str,
    values: &[(&str, f64)],
) -> fmt::Result {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (l, v) in values {
        let labels = [(label, *l)];
        ConstGauge::new(*v).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// One counter family with one label.
fn counters(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &str,
    values: &[(&str, u64)],
) -> fmt::Result {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (l, v) in values {
        let labels = [(label, *l)];
        ConstCounter::new(*v).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for UnitCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
        let Some(sh) = self.shared.upgrade() else {
            return Ok(());
        };
        let s = sh.stats();
        let cap = s.capacity as f64;
        let f = |v: u64| v as f64;

        // Memory.
        gauge(
            &mut e,
            "slab_capacity_bytes",
            "Bytes of the unit's slab.",
            cap,
        )?;
        gauges(
            &mut e,
            "slab_bytes",
            "Slab bytes by state: used (stored data: committed blobs), reserved (puts being written), spares (reservations clients keep for their next puts), quarantined, free; pinned (stored data someone reads, part of used).",
            "state",
            &[
                ("used", f(s.used)),
                ("reserved", f(s.reserved_bytes.saturating_sub(s.spare_bytes))),
                ("spares", f(s.spare_bytes)),
                ("quarantined", f(s.quarantined_bytes)),
                ("pinned", f(s.pinned_bytes)),
                ("free", f(s.free_bytes)),
            ],
        )?;
        gauge(
            &mut e,
            "slab_largest_free_bytes",
            "The largest free range of the slab: a put's part larger than it is stored in pieces.",
            f(s.largest_free),
        )?;
        gauge(
            &mut e,
            "slab_spare_budget_bytes",
            "Bytes of the slab's spare zone, where spares come from.",
            f(s.spare_budget),
        )?;
        gauge(
            &mut e,
            "slab_split_blobs",
            "Blobs stored in more than one piece of the slab.",
            f(s.split_blobs),
        )?;
        counter(
            &mut e,
            "compaction_moves",
            "Blobs compaction moved to gather free memory into ranges.",
            s.compaction_moves,
        )?;
        counter(
            &mut e,
            "compaction_bytes",
            "Bytes compaction copied.",
            s.compaction_bytes,
        )?;
        counter(
            &mut e,
            "compaction_micros",
            "Time compaction spent copying, in microseconds.",
            s.compaction_micros,
        )?;
        let mode = s.page_mode.as_str();
        gauges(
            &mut e,
            "slab_page_mode",
            "The slab's page mode: 1 for the mode in effect (4k, thp: transparent huge pages, hugetlb), 0 for the others.",
            "mode",
            &stowage_shm::PageMode::ALL.map(|m| (m.name(), f(u64::from(m.name() == mode)))),
        )?;
        gauge(
            &mut e,
            "slab_high_watermark_bytes",
            "Past this many used slab bytes the unit spills committed blobs to its disk tier.",
            sh.high_watermark * cap,
        )?;
        gauge(
            &mut e,
            "index_bytes",
            "Bytes the key index takes (commits past the index budget answer UnitFull).",
            f(s.index_bytes),
        )?;
        // Disk tier.
        gauge(
            &mut e,
            "disk_capacity_bytes",
            "Bytes of the disk tier (0: no disk tier).",
            f(s.disk_capacity),
        )?;
        gauges(
            &mut e,
            "disk_bytes",
            "Disk tier bytes: used (files written or being written) and free.",
            "state",
            &[
                ("used", f(s.disk_used)),
                ("free", f(s.disk_capacity.saturating_sub(s.disk_used))),
            ],
        )?;
        // Contents.
        gauge(
            &mut e,
            "blobs",
            "Blobs (reserved, committed, spilled).",
            f(s.blobs),
        )?;
        gauge(
            &mut e,
            "spilled_blobs",
            "Blobs whose bytes are only on the disk tier.",
            f(s.spilled_blobs),
        )?;
        gauge(&mut e, "entries", "Committed values (keys).", f(s.entries))?;
        gauge(&mut e, "rows", "Rows holding values.", f(s.rows))?;
        gauge(
            &mut e,
            "partitions",
            "Partitions holding rows (over every namespace).",
            f(s.partitions),
        )?;
        // Holds.
        let (reservations, pins, orphaned) = s.sessions.iter().fold((0u64, 0u64, 0u64), |a, x| {
            (
                a.0 + u64::from(x.reservations),
                a.1 + u64::from(x.pins),
                a.2 + u64::from(x.orphaned),
            )
        });
        gauge(&mut e, "pins", "Pins held (blobs being read).", f(s.pins))?;
        gauges(
            &mut e,
            "holds",
            "Reservations and pins held by client sessions.",
            "kind",
            &[("reservation", f(reservations)), ("pin", f(pins))],
        )?;
        gauge(
            &mut e,
            "held_bytes",
            "Bytes held by client sessions: reserved ranges and pinned blobs.",
            f(s.held_bytes),
        )?;
        let oldest = s
            .sessions
            .iter()
            .map(|x| x.oldest_hold_ms)
            .max()
            .unwrap_or(0);
        gauge(
            &mut e,
            "oldest_hold_age_seconds",
            "Age of the oldest reservation or pin of any session (0: none).",
            oldest as f64 / 1e3,
        )?;
        gauge(
            &mut e,
            "overdue_holds",
            "Holds older than their lease: reported, never reclaimed while their holder may touch them.",
            f(s.overdue_holds),
        )?;
        gauge(
            &mut e,
            "orphaned_holds",
            "Holds of cut connections of clients that map the slab, kept until their process exits.",
            f(orphaned),
        )?;
        // Sessions and connections.
        gauge(
            &mut e,
            "sessions",
            "Client sessions with at least one open connection.",
            s.sessions.iter().filter(|x| x.connections > 0).count() as f64,
        )?;
        gauge(
            &mut e,
            "connections",
            "Connections being served (past their handshake).",
            sh.connections.load(Relaxed) as f64,
        )?;
        gauge(
            &mut e,
            "handshakes",
            "Connections waiting to prove themselves (see --max-handshakes).",
            sh.handshakes.len() as f64,
        )?;
        let Some(m) = sh.metrics.as_ref() else {
            return Ok(());
        };
        counter(
            &mut e,
            "sessions_opened",
            "Client sessions opened since start.",
            m.sessions_opened.load(Relaxed),
        )?;
        let path = m.path_totals();
        // Requests.
        {
            let mut d = e.encode_descriptor(
                "operations",
                "Requests answered, by kind (op) and outcome (ok, error).",
                None,
                MetricType::Counter,
            )?;
            for (i, name) in OP_NAMES.iter().enumerate() {
                let answered = path.answered[i];
                for (j, outcome) in ["ok", "error"].iter().enumerate() {
                    let v = answered[j];
                    let labels = [("op", *name), ("outcome", *outcome)];
                    ConstCounter::new(v).encode(d.encode_family(&labels)?)?;
                }
            }
        }
        {
            let mut d = e.encode_descriptor(
                "operation_duration_seconds",
                "Time from a request's first byte to its answer (for puts and gets, the whole transfer), by kind; unpin is not timed.",
                None,
                MetricType::Histogram,
            )?;
            for (i, name) in OP_NAMES.iter().enumerate() {
                let labels = [("op", *name)];
                let (per, sum_ns) = &path.latency[i];
                encode_histogram(&LATENCY_BOUNDS, per, *sum_ns, d.encode_family(&labels)?)?;
            }
        }
        let errors: Vec<(&str, u64)> = CODE_NAMES
            .iter()
            .zip(&m.errors)
            .map(|(n, c)| (*n, c.load(Relaxed)))
            .collect();
        counters(
            &mut e,
            "errors",
            "Error answers, by kind (the wire error code).",
            "kind",
            &errors,
        )?;
        counter(
            &mut e,
            "busy_answers",
            "Busy answers: requests told to retry shortly, and connections refused past the connection cap.",
            m.busy.load(Relaxed),
        )?;
        counter(
            &mut e,
            "connections_refused",
            "Connections refused Busy once they proved themselves because the unit served --max-connections already or held --max-sessions sessions (or, at accept, for want of file descriptors).",
            m.turned_away.load(Relaxed),
        )?;
        counter(
            &mut e,
            "rings_opened",
            "Request rings made: same-host connections that pass requests and replies through shared memory instead of their socket.",
            m.rings_opened.load(Relaxed),
        )?;
        counter(
            &mut e,
            "ring_requests",
            "Requests served through request rings.",
            m.ring_requests.load(Relaxed),
        )?;
        let cut: Vec<(&str, u64)> = HANDSHAKE_CUT_NAMES
            .iter()
            .zip(&m.handshakes_cut)
            .map(|(n, c)| (*n, c.load(Relaxed)))
            .collect();
        counters(
            &mut e,
            "handshakes_cut",
            "Connections cut before they proved themselves, by reason (source_limit: their source opened more than --max-handshakes-per-source; pool_full: --max-handshakes were waiting and their source held the most; timeout: no proof within --handshake-timeout).",
            "reason",
            &cut,
        )?;
        {
            let mut d = e.encode_descriptor(
                "transferred_bytes",
                "Value bytes moved, by transport (shm: copied by the client through its mapping of the slab; uds, tcp: streamed by the unit) and direction (in: put, out: get).",
                None,
                MetricType::Counter,
            )?;
            for (i, t) in TRANSPORT_NAMES.iter().enumerate() {
                for (j, dir) in ["in", "out"].iter().enumerate() {
                    let labels = [("transport", *t), ("direction", *dir)];
                    ConstCounter::new(path.bytes[i][j]).encode(d.encode_family(&labels)?)?;
                }
            }
        }
        let reclaimed: Vec<(&str, u64)> = RECLAIM_NAMES
            .iter()
            .zip(&m.reclaimed)
            .map(|(n, c)| (*n, c.load(Relaxed)))
            .collect();
        counters(
            &mut e,
            "reclaimed_holds",
            "Reservations and pins released because their holder went away, by how (closed: the peer closed its connection or died; cut: the unit cut a tcp peer; process_exited: a cut shm peer's process exited).",
            "reason",
            &reclaimed,
        )?;
        // Disk tier traffic.
        counter(
            &mut e,
            "spilled_bytes",
            "Bytes copied from the slab to the disk tier past the high watermark.",
            m.spilled_bytes.load(Relaxed),
        )?;
        counter(
            &mut e,
            "spill_batches",
            "Spill batches written (each a run of the spiller past the high watermark).",
            m.spill_batches.load(Relaxed),
        )?;
        counter(
            &mut e,
            "disk_put_bytes",
            "Bytes of puts written straight to the disk tier (the slab had no room).",
            m.disk_put_bytes.load(Relaxed),
        )?;
        counter(
            &mut e,
            "promoted_bytes",
            "Bytes of spilled blobs brought back into the slab for a reader.",
            m.promoted_bytes.load(Relaxed),
        )?;
        counter(
            &mut e,
            "disk_streamed_bytes",
            "Bytes read from the disk tier for a get without bringing them back into the slab.",
            m.disk_streamed_bytes.load(Relaxed),
        )?;
        counters(
            &mut e,
            "disk_io_bytes",
            "Disk tier I/O bytes, by direction.",
            "direction",
            &[("write", s.disk_write_bytes), ("read", s.disk_read_bytes)],
        )?;
        {
            let mut d = e.encode_descriptor(
                "disk_io_seconds",
                "Time spent in disk tier I/O, by direction.",
                None,
                MetricType::Counter,
            )?;
            for (dir, us) in [("write", s.disk_write_micros), ("read", s.disk_read_micros)] {
                let labels = [("direction", dir)];
                ConstCounter::new(us as f64 / 1e6).encode(d.encode_family(&labels)?)?;
            }
        }
        // Checkpoints.
        counters(
            &mut e,
            "checkpoints",
            "Checkpoints written, by outcome.",
            "outcome",
            &[
                ("ok", m.checkpoints[0].load(Relaxed)),
                ("error", m.checkpoints[1].load(Relaxed)),
            ],
        )?;
        m.checkpoint_seconds.encode(e.encode_descriptor(
            "checkpoint_duration_seconds",
            "Time to write a checkpoint.",
            None,
            MetricType::Histogram,
        )?)?;
        gauge(
            &mut e,
            "uptime_seconds",
            "Seconds since the unit started.",
            sh.started.elapsed().as_secs_f64(),
        )?;
        let instance = format!("{:032x}", sh.instance_id);
        let mut d = e.encode_descriptor(
            "unit",
            "The unit's instance id (a new one after every restart).",
            None,
            MetricType::Info,
        )?;
        d.encode_info(&[("instance", instance.as_str())])?;
        Ok(())
    }
}

/// The registry in the Prometheus text format.
pub(crate) fn render(r: &Registry) -> String {
    let mut out = String::with_capacity(16 << 10);
    if prometheus_client::encoding::prometheus_text::encode(&mut out, r).is_err() {
        out.clear();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_by_upper_bound() {
        let h = Histogram::new(&LATENCY_BOUNDS);
        h.observe(Duration::from_micros(10)); // le 10 µs
        h.observe(Duration::from_micros(11)); // le 25 µs
        h.observe(Duration::from_secs(60)); // +Inf
        assert_eq!(h.buckets[0].load(Relaxed), 1);
        assert_eq!(h.buckets[1].load(Relaxed), 1);
        assert_eq!(h.buckets[LATENCY_BOUNDS.len()].load(Relaxed), 1);
        assert_eq!(h.count(), 3);
    }

    #[test]
    fn totals_count_open_and_closed_connections_once() {
        let m = UnitMetrics::default();
        let c = Arc::new(PathCounters::default());
        lock(&m.live).push(c.clone());
        c.op(Op::Put, true, Duration::from_micros(10));
        c.op(Op::Put, false, Duration::from_micros(30));
        c.count(Op::Unpin, true);
        c.bytes_in(Transport::Shm, 5);
        c.bytes_out(Transport::Tcp, 7);
        let check = |m: &UnitMetrics| {
            let t = m.path_totals();
            assert_eq!(t.answered[Op::Put as usize], [1, 1]);
            assert_eq!(t.answered[Op::Unpin as usize], [1, 0]);
            assert_eq!(t.latency[Op::Put as usize].0[..3], [1, 0, 1]);
            assert_eq!(t.latency[Op::Put as usize].1, 40_000);
            assert_eq!(m.traffic(), (3, 5, 7));
        };
        check(&m);
        // What a thread ending does (ThreadCounters::drop).
        {
            let mut live = lock(&m.live);
            c.add_to(&m.closed);
            live.retain(|x| !Arc::ptr_eq(x, &c));
        }
        check(&m);
    }

    #[test]
    fn every_op_has_a_name() {
        assert_eq!(Op::Auth as usize, OPS - 1);
        assert_eq!(OP_NAMES.len(), OPS);
        assert_eq!(code_index(ErrorCode::NotOwner), CODES - 1);
    }
}
