//! What a unit records while it serves: per-thread path counters folded
//! into the unit's totals, histograms, and the unit-wide counters.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::NoLabelSet;
use stowage_wire::{ErrorCode, Request};

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
    Claim,
    Settle,
    ClaimControl,
    RepairControl,
    RepairPut,
    ForwardPut,
}

pub(super) const OPS: usize = 22;
/// The `op` label values. The clear requests keep the labels of the names
/// they had before (`release_rows`, `drop_partition`), so that dashboards
/// and alerts over them keep working.
pub(super) const OP_NAMES: [&str; OPS] = [
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
    "claim",
    "settle",
    "claim_control",
    "repair_control",
    "repair_put",
    "forward_put",
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
            Request::Resolve { .. } | Request::ResolveRows { .. } => Op::Resolve,
            Request::Unpin { .. } => Op::Unpin,
            Request::ClearRows { .. } => Op::ClearRows,
            Request::Put { .. } => Op::Put,
            Request::Read { .. } => Op::Read,
            Request::List { .. } => Op::List,
            Request::ClearPartition { .. } => Op::ClearPartition,
            Request::ListPartitions => Op::ListPartitions,
            Request::Stats => Op::Stats,
            Request::Checkpoint { .. }
            | Request::CheckpointHomes { .. }
            | Request::OpenRestore { .. }
            | Request::CloseRestore { .. } => Op::Checkpoint,
            Request::Shutdown { .. } => Op::Shutdown,
            // A claim is timed until it is planned: a wait for rows is not
            // the unit's time.
            Request::Claim { .. } => Op::Claim,
            Request::Settle { .. } => Op::Settle,
            Request::RegisterTasks { .. }
            | Request::ClaimStatus { .. }
            | Request::ClaimsState
            | Request::LoadClaims { .. } => Op::ClaimControl,
            Request::Auth { .. } | Request::Prove { .. } => Op::Auth,
            Request::OpenRepair { .. } | Request::CloseRepair { .. } => Op::RepairControl,
            Request::RepairPut { .. } => Op::RepairPut,
            Request::ForwardPut { .. } | Request::CopyReserved { .. } => Op::ForwardPut,
            Request::Fence { .. } => Op::Shutdown,
            Request::Epoch { .. } => Op::Hello,
            Request::SetView { .. } => Op::RepairControl,
        }
    }
}

pub(super) const CODES: usize = 10;
pub(super) const CODE_NAMES: [&str; CODES] = [
    "full",
    "busy",
    "unknown_blob",
    "invalid_request",
    "version_mismatch",
    "unauthorized",
    "internal",
    "not_owner",
    "fenced",
    "stale",
];

pub(super) fn code_index(c: ErrorCode) -> usize {
    match c {
        ErrorCode::Full => 0,
        ErrorCode::Busy => 1,
        ErrorCode::UnknownBlob => 2,
        ErrorCode::InvalidRequest => 3,
        ErrorCode::VersionMismatch => 4,
        ErrorCode::Unauthorized => 5,
        ErrorCode::Internal => 6,
        ErrorCode::NotOwner => 7,
        ErrorCode::Fenced => 8,
        ErrorCode::Stale => 9,
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
pub(super) const TRANSPORT_NAMES: [&str; 3] = ["shm", "uds", "tcp"];

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
pub(super) const RECLAIM_NAMES: [&str; 3] = ["closed", "cut", "process_exited"];

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
    pub(super) bounds: &'static [f64],
    pub(super) bounds_ns: Box<[u64]>,
    /// Per bucket (not cumulative); the last is +Inf.
    pub(super) buckets: Box<[AtomicU64]>,
    pub(super) sum_ns: AtomicU64,
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
pub(super) fn encode_histogram(
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
pub(super) fn bump(c: &AtomicU64, n: u64) {
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
    pub(super) latency: [Histogram; OPS],
    /// Timed requests that failed; those that did not are their latency
    /// histogram's count less these.
    pub(super) timed_errors: [AtomicU64; OPS],
    /// Untimed requests (unpin), by outcome: [ok, error].
    pub(super) untimed: [[AtomicU64; 2]; OPS],
    /// Value bytes by transport: [in, out].
    pub(super) bytes: [[AtomicU64; 2]; 3],
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
    pub(super) fn add_to(&self, into: &PathCounters) {
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
    pub(super) metrics: Arc<UnitMetrics>,
    pub(super) counters: Arc<PathCounters>,
}

impl std::ops::Deref for ThreadCounters {
    type Target = PathCounters;
    fn deref(&self) -> &PathCounters {
        &self.counters
    }
}

impl ThreadCounters {
    /// New counters for a connection of the unit whose metrics are `m`.
    pub(crate) fn attach(m: &Arc<UnitMetrics>) -> Self {
        let counters = Arc::new(PathCounters::default());
        lock(&m.live).push(counters.clone());
        Self {
            metrics: m.clone(),
            counters,
        }
    }
}

impl Drop for ThreadCounters {
    fn drop(&mut self) {
        let m = &self.metrics;
        // Under the lock readers take: a reader sees these counters
        // either live or folded in, never both or neither.
        let mut live = lock(&m.live);
        self.counters.add_to(&m.closed);
        live.retain(|c| !Arc::ptr_eq(c, &self.counters));
    }
}

/// The [`PathCounters`] the calling thread records into for the unit of
/// `metrics` (`None`: metrics are off). A serving or pool thread serves
/// one connection at a time, so each thread's counters have one writer; a
/// thread's are folded into the unit's totals when it exits. (Per thread,
/// not per connection: ten thousand idle sessions cost no counters.)
pub(crate) fn thread_counters(metrics: Option<&Arc<UnitMetrics>>) -> Option<Arc<PathCounters>> {
    let metrics = metrics?;
    thread_local! {
        static MINE: std::cell::RefCell<Vec<ThreadCounters>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    MINE.with(|mine| {
        let mut mine = mine.borrow_mut();
        if let Some(c) = mine.iter().find(|c| Arc::ptr_eq(&c.metrics, metrics)) {
            return Some(c.counters.clone());
        }
        let c = ThreadCounters::attach(metrics);
        let counters = c.counters.clone();
        mine.push(c);
        Some(counters)
    })
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The request path's counters summed over a unit's connections.
pub(super) struct PathTotals {
    /// Per op: per-bucket counts and the sum in nanoseconds.
    pub(super) latency: Vec<(Vec<u64>, u64)>,
    /// Per op: [ok, error].
    pub(super) answered: Vec<[u64; 2]>,
    pub(super) bytes: [[u64; 2]; 3],
}

/// The counters and histograms a unit records while it serves.
#[derive(Debug)]
pub struct UnitMetrics {
    /// The request path's counters of open connections ...
    pub(super) live: Mutex<Vec<Arc<PathCounters>>>,
    /// ... and of closed ones.
    pub(super) closed: PathCounters,
    pub(super) errors: [AtomicU64; CODES],
    pub(super) busy: AtomicU64,
    pub(super) turned_away: AtomicU64,
    /// Handshakes cut, by [`HANDSHAKE_CUT_NAMES`].
    pub(super) handshakes_cut: [AtomicU64; 3],
    pub(super) reclaimed: [AtomicU64; 3],
    pub(super) sessions_opened: AtomicU64,
    /// Request rings made, and requests served through them.
    pub(super) rings_opened: AtomicU64,
    pub(crate) ring_requests: AtomicU64,
    pub(crate) spilled_bytes: AtomicU64,
    pub(crate) spill_batches: AtomicU64,
    pub(crate) disk_put_bytes: AtomicU64,
    pub(crate) promoted_bytes: AtomicU64,
    pub(crate) disk_streamed_bytes: AtomicU64,
    /// Values of repair puts: [stored, skipped].
    pub(super) repaired: [AtomicU64; 2],
    /// Copies of forwarded puts this unit sent on to the next unit of
    /// their chain: [committed, failed], and the bytes sent to the
    /// committed ones.
    pub(super) forwarded: [AtomicU64; 2],
    pub(super) forwarded_bytes: AtomicU64,
    pub(super) checkpoints: [AtomicU64; 2],
    pub(super) checkpoint_seconds: Histogram,
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
            repaired: Default::default(),
            forwarded: Default::default(),
            forwarded_bytes: AtomicU64::new(0),
            checkpoints: Default::default(),
            checkpoint_seconds: Histogram::new(&CHECKPOINT_BOUNDS),
        }
    }
}

impl UnitMetrics {
    /// The request path's counters summed over open and closed
    /// connections.
    pub(super) fn path_totals(&self) -> PathTotals {
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
    pub(crate) fn handshake_cut(&self, why: Cut) {
        let i = match why {
            Cut::Source => 0,
            Cut::Pool => 1,
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

    /// A forwarded put's copies this unit sent on: `committed` (each sent
    /// `bytes`) and `failed`.
    pub(crate) fn forwarded(&self, committed: u64, failed: u64, bytes: u64) {
        self.forwarded[0].fetch_add(committed, Relaxed);
        self.forwarded[1].fetch_add(failed, Relaxed);
        self.forwarded_bytes
            .fetch_add(committed.saturating_mul(bytes), Relaxed);
    }

    /// A repair put stored `stored` values and skipped `skipped`.
    pub(crate) fn repaired(&self, stored: u32, skipped: u32) {
        self.repaired[0].fetch_add(u64::from(stored), Relaxed);
        self.repaired[1].fetch_add(u64::from(skipped), Relaxed);
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
pub(super) const HANDSHAKE_CUT_NAMES: [&str; 3] = ["source_limit", "pool_full", "timeout"];

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

/// Why a handshake was cut before it finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Cut {
    /// Its source opened more connections than its share.
    Source = 1,
    /// The pool was full and its source held the most.
    Pool = 2,
}
