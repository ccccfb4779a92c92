//! # stowage-client: put, get and clear on storage units
//!
//! A [`Client`] knows a list of units ([`UnitAddr`]: a Unix socket for the
//! same host, TCP otherwise) and keeps a small pool of connections to each,
//! shared by the threads that use the client. Connecting opens nothing: a
//! unit's first connection is opened by the first operation that touches
//! it ([`Client::check_units`] opens one to every unit now), and at most
//! [`ClientConfig::max_unit_conns`] are open to a unit at a time.
//! Each connection is a [`Transport`]: `ShmTransport` maps the
//! unit's slab (its memfd arrives at the handshake) and copies bytes
//! itself; [`transport::TcpTransport`] streams them through the socket.
//!
//! The blob API mirrors `UnitSlabStore`:
//!
//! * [`Client::put_many`] writes blobs: each unit's blobs one after
//!   another, every unit at once (a put waits for the slowest unit, not
//!   the sum). A unit answering Busy is asked again after 0.2 s, doubling to 2 s,
//!   inside the deadline. Blob ids ([`BlobId`], chosen by the caller, e.g.
//!   [`new_blob_id`]) make a retried put idempotent.
//! * [`Client::get_into`] resolves and reads every unit's keys at once,
//!   into buffers the caller's [`GetSink`] provides.
//! * [`Client::clear_placed_rows`] clears rows on every unit at once.
//!
//! Each call runs every unit's part as one straight `async` function, all
//! units at once on the calling thread (`fanout::all_at_once`: each part
//! lets the others run after every request it sends, and takes its reply
//! when its turn comes back): a put's part is, per blob, alloc → write →
//! commit ([`Transport::put`]); a get's, resolve → copy → unpin
//! ([`Transport::get`]); a control call's, request → reply
//! ([`Transport::call`]). The parts of a get share its sink.
//!
//! Every call takes a deadline. Failures are typed ([`Error`]). When a unit
//! fails, and only then, the [`Directory`] is asked whether it is dead or
//! restarted (its keys are lost: [`Error::LostKeys`]) or alive (the
//! failure is retryable: [`Error::TransferFailed`]).
//!
//! Convenience over the blob API, placing row `r` on unit `r % N`:
//! [`Client::put_rows`], [`Client::get_rows`], [`Client::clear_rows`].
//!
//! The rows × fields API ([`rows`]) is what RL frameworks call:
//!
//! ```no_run
//! use stowage_client::{Client, ClientConfig, Column, DType, RowKey, Tensor};
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let client = Client::connect(ClientConfig::new("run-1", vec!["unix:/tmp/u0.sock".parse()?]))?;
//!     let keys = [RowKey::Name("uid_g3".into()), RowKey::Index(7)];
//!     let ids = [1i64, 2, 3, 4, 5, 6];
//!     let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
//!     let col = Column::Dense(Tensor::new(DType::I64, vec![2, 3], &bytes)?);
//!     client.put("step-0", &keys, &[("input_ids", col)], None, client.deadline())?;
//!     let got = client.get_tensors("step-0", &keys, &["input_ids"], None, client.deadline())?;
//!     assert_eq!(got[0][1].shape, vec![3]);
//!     client.clear_partition("step-0", client.deadline())?;
//!     Ok(())
//! }
//! ```

#![forbid(unsafe_code)]

mod conn;
mod directory;
mod error;
mod fanout;
pub mod metrics;
mod nixl;
mod pieces;
pub mod rows;
pub mod sink;
pub mod transport;
pub mod unit_directory;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub use conn::UnitAddr;
pub use directory::{Directory, Liveness, ProbeDirectory};
pub use error::{Error, Result};
pub use nixl::{Lent, NixlOptions, RECV_POOL_MAX, ZERO_COPY_MIN};
pub use rows::{Column, DType, OwnedTensor, RowKey, Tensor, View, ViewTensor};
pub use sink::{GetSink, Sink, TensorAsk, TensorSink, ValueAsk};
pub use stowage_wire::auth::{Secret, SecretError, SECRET_ENV};
pub use stowage_wire::{BlobId, EntrySpec, Key, Stats};
pub use stowage_wire::{CheckpointFile, CheckpointInfo, RestoreReply, RestoreSource};
pub use transport::Transport;
pub use unit_directory::{host_id, TransportChoice, UnitDirectory, UnitEntry};

use conn::Conn;
use stowage_shm::Slab;
use stowage_wire::{ErrorCode, Request, Response};
use transport::{ConnFailure, LocalFailure, OpFailure, SharedSink, ShmTransport, TcpTransport};

/// The partition of the raw-bytes conveniences ([`Client::put_rows`] and
/// friends).
pub const DEFAULT_PARTITION: &str = "";

/// First Busy backoff.
pub const BUSY_RETRY: Duration = Duration::from_millis(200);
/// Largest Busy backoff.
pub const BUSY_RETRY_MAX: Duration = Duration::from_secs(2);

/// Settings of a client.
#[derive(Clone)]
pub struct ClientConfig {
    /// The namespace every request acts in (isolates runs sharing units).
    pub namespace: String,
    /// The units, in order: unit `i` is `units[i]`.
    pub units: Vec<UnitAddr>,
    /// Default deadline of an operation ([`Client::deadline`]). Default 30 s.
    pub timeout: Duration,
    /// Use the shm transport for Unix-socket units (default true); false
    /// streams bytes through the socket as the tcp transport does.
    pub shm: bool,
    /// Asked about a unit after a failure. Default [`ProbeDirectory`].
    pub directory: Arc<dyn Directory>,
    /// How long to poll for a reply before blocking (adaptive polling;
    /// costs CPU while polling). Default 50 µs; zero disables it.
    pub spin: Duration,
    /// A put that finds a unit full (memory and disk) waits up to this long
    /// — within its own deadline — for a clear to make room, instead of
    /// failing with [`Error::UnitFull`] at once. Default `None` (fail).
    pub wait_for_memory: Option<Duration>,
    /// The instance each unit is expected to be (from a
    /// [`UnitDirectory`]); empty or `None`: whichever answers first. A unit
    /// found to be another instance is treated as restarted: the first
    /// operation on it reports its keys lost.
    pub instances: Vec<Option<u128>>,
    /// The shared secret of units started with one: every connection
    /// proves it, and the unit must prove it back (a client with a secret
    /// refuses a unit that has none). Default `None`.
    pub secret: Option<Secret>,
    /// Same-host puts of at most this many bytes keep *spares*: each
    /// commit also reserves the connection's next put of the same size
    /// class, which the client then writes before it asks the unit
    /// anything, so such a put costs one round trip (its commit) instead
    /// of two (alloc, commit). A connection holds at most [`SPARES`]
    /// spares (reserved memory, shown in the unit's `reserved` bytes) and
    /// gives them back when a put finds the unit full, and when it closes.
    /// Zero turns spares off. Default [`SPARE_MAX`].
    pub spare_max: u64,
    /// Move bytes with one-sided NIXL transfers to the units this client
    /// does not reach over shm, where the unit serves nixl (`stowage unit
    /// --nixl`; units that do not are reached over tcp). Needs a build
    /// with the `nixl` feature and libnixl_capi.so (docs/nixl.md).
    /// Default `None`: tcp.
    pub nixl: Option<NixlOptions>,
    /// Most connections this client holds open to one unit at a time,
    /// shared by every thread that uses the client: a thread that finds
    /// them all in use waits, within its deadline, for one to be checked
    /// in (and fails with [`Error::Timeout`] at the deadline) rather than
    /// opening another. Views pin through a connection of their own per
    /// unit, which is not counted. Zero is taken as one. Default
    /// [`MAX_UNIT_CONNS`].
    pub max_unit_conns: usize,
}

/// Default [`ClientConfig::max_unit_conns`].
pub const MAX_UNIT_CONNS: usize = 4;

/// Default [`ClientConfig::spare_max`].
pub const SPARE_MAX: u64 = 4 << 20;
/// Most spares one same-host connection holds.
pub const SPARES: usize = 4;

impl ClientConfig {
    pub fn new(namespace: impl Into<String>, units: Vec<UnitAddr>) -> Self {
        Self {
            namespace: namespace.into(),
            units,
            timeout: Duration::from_secs(30),
            shm: true,
            directory: Arc::new(ProbeDirectory::default()),
            spin: Duration::from_micros(50),
            wait_for_memory: None,
            instances: Vec::new(),
            secret: None,
            spare_max: SPARE_MAX,
            nixl: None,
            max_unit_conns: MAX_UNIT_CONNS,
        }
    }
}

/// One blob to write: its bytes are the concatenation of `segments`;
/// `entries` name sub-ranges of it.
#[derive(Clone, Debug)]
pub struct BlobPut<'a> {
    pub unit: usize,
    /// The partition whose keys the entries are.
    pub partition: &'a str,
    pub blob: BlobId,
    pub segments: Vec<&'a [u8]>,
    pub entries: Vec<EntrySpec>,
}

/// A fresh blob id: unique across processes and hosts, and not
/// guessable (a put whose id another client committed first would be
/// answered as already committed).
///
/// A keyed hash (SipHash-1-3, 128 bits) of a counter, under a random key
/// each thread draws once, and draws again in a child after a fork (so a
/// child never repeats its parent's ids): one system call per thread
/// instead of one per id, as the unit draws its pin ids. Per thread, not
/// per process behind a lock: a fork while another thread held that lock
/// would leave it held in the child. The fork is told by the process id,
/// read from a page the kernel wipes in a child
/// ([`stowage_shm::fork::process_id`]): a load, not a `getpid` per id.
pub fn new_blob_id() -> BlobId {
    thread_local! {
        static IDS: std::cell::Cell<Option<(u32, [u8; 16], u64)>> =
            const { std::cell::Cell::new(None) };
    }
    let pid = stowage_shm::fork::process_id();
    IDS.with(|ids| {
        let (key, n) = match ids.get() {
            Some((p, key, n)) if p == pid => (key, n + 1),
            _ => (random_key(pid), 1),
        };
        ids.set(Some((pid, key, n)));
        let mut h = siphasher::sip128::SipHasher13::new_with_key(&key);
        std::hash::Hasher::write_u64(&mut h, n);
        BlobId(siphasher::sip128::Hasher128::finish128(&h).as_u128())
    })
}

/// A random key; without an OS entropy source, one made of the clock, the
/// pid and a count of the keys drawn (ids then stay unique, if guessable).
fn random_key(pid: u32) -> [u8; 16] {
    static DRAWN: AtomicU32 = AtomicU32::new(0);
    let mut b = [0u8; 16];
    if getrandom::fill(&mut b).is_ok() {
        return b;
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let drawn = DRAWN.fetch_add(1, Ordering::Relaxed);
    ((u128::from(t) << 64) | (u128::from(pid) << 32) | u128::from(drawn)).to_le_bytes()
}

struct UnitSlot {
    addr: UnitAddr,
    /// The connections to the unit: idle ones, and how many are open.
    pool: Mutex<Pool>,
    /// Signalled when a connection is checked in or closed: a thread
    /// waiting for one to come free looks again.
    freed: Condvar,
    /// Whether a connection to the unit was ever made. Until then a
    /// failed connection is reported as connecting reports it
    /// ([`Error::Unreachable`]): this client has nothing there to lose.
    reached: AtomicBool,
    /// The slab mapping of the current instance, shared by its connections.
    slab: Mutex<Option<(u128, Arc<Slab>)>>,
    /// What this client knows of the unit: the instance it last met at
    /// this address, and whether a restart was seen and not yet reported.
    instance: Mutex<Instance>,
    /// The session this client's connections to the unit share.
    session: Mutex<Option<u128>>,
    /// The connection on which views pin their values. Each [`View`] keeps
    /// the connection it pinned on alive (a failure elsewhere never drops
    /// it); a broken one is replaced here for later views.
    view_conn: Mutex<Option<ViewConn>>,
    /// The transport of the last connection opened to it.
    transport: Mutex<Option<&'static str>>,
}

/// The connections a client holds to one unit ([`Client::connections`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitConnections {
    /// Open: idle, in use by an operation, or being opened; at most
    /// [`ClientConfig::max_unit_conns`].
    pub open: usize,
    /// Open and in use by no operation.
    pub idle: usize,
}

/// A unit's pooled connections.
#[derive(Default)]
struct Pool {
    /// Connections no operation is using.
    idle: Vec<Box<dyn Transport>>,
    /// Connections open to the unit: idle, checked out, or being opened
    /// (at most [`ClientConfig::max_unit_conns`]).
    open: usize,
    /// Threads waiting on `freed` for a connection: only then does a
    /// connection given back wake one (a notify is a system call).
    waiters: usize,
}

/// A connection checked out of a unit's pool ([`Client::checkout`]): it
/// goes back with [`Client::checkin`]; dropped otherwise (a broken
/// connection), it is closed and its place in the unit's bound freed.
struct Lease<'a> {
    slot: &'a UnitSlot,
    /// `None` while it is being opened.
    t: Option<Box<dyn Transport>>,
    /// Checked in: still open, counted in the pool.
    pooled: bool,
}

impl std::ops::Deref for Lease<'_> {
    type Target = dyn Transport;
    fn deref(&self) -> &Self::Target {
        self.t.as_deref().expect("a lease holds its connection")
    }
}

impl std::ops::DerefMut for Lease<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.t.as_deref_mut().expect("a lease holds its connection")
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if self.pooled {
            return;
        }
        // Closed before its place is given up: never more open than the bound.
        drop(self.t.take());
        let mut p = lock(&self.slot.pool);
        p.open = p.open.saturating_sub(1);
        let wake = p.waiters > 0;
        drop(p);
        if wake {
            self.slot.freed.notify_one();
        }
    }
}

/// Why [`Client::checkout`] got no connection.
enum NoConn {
    /// Opening one failed.
    Open(OpFailure),
    /// Every connection the bound allows stayed in use until the deadline.
    Wait,
}

/// A connection shared by the views that pinned through it.
pub(crate) type ViewConn = Arc<Mutex<Box<dyn Transport>>>;

#[derive(Clone, Copy, Debug, Default)]
struct Instance {
    current: Option<u128>,
    /// The instance before a restart this client saw, until an operation
    /// reports that restart (missing keys then are lost keys).
    lost: Option<u128>,
}

/// A connection-pooling client of a set of units. Cheap to share between
/// threads (`&Client` is enough for every operation).
pub struct Client {
    cfg: ClientConfig,
    units: Vec<UnitSlot>,
    metrics: Arc<metrics::ClientMetrics>,
    nixl: Option<nixl::NixlClient>,
}

/// A sink that counts the bytes it is handed (for metrics).
struct Counting<'a> {
    inner: &'a mut dyn GetSink,
    bytes: u64,
}

impl Sink<ValueAsk<'_>> for Counting<'_> {
    fn slot(&mut self, ask: ValueAsk<'_>) -> std::result::Result<&mut [u8], String> {
        self.bytes += ask.len;
        self.inner.slot(ask)
    }

    fn slots(
        &mut self,
        asks: &[ValueAsk<'_>],
    ) -> Option<std::result::Result<Vec<&mut [u8]>, String>> {
        let r = self.inner.slots(asks);
        if matches!(r, Some(Ok(_))) {
            self.bytes += asks.iter().map(|a| a.len).sum::<u64>();
        }
        r
    }

    fn accept_lent(&mut self, asks: &[ValueAsk<'_>]) -> Option<std::result::Result<(), String>> {
        self.inner.accept_lent(asks)
    }

    fn lent(
        &mut self,
        asks: &[ValueAsk<'_>],
        buf: Lent,
        spans: &[std::ops::Range<usize>],
    ) -> std::result::Result<(), String> {
        self.inner.lent(asks, buf, spans)?;
        self.bytes += asks.iter().map(|a| a.len).sum::<u64>();
        Ok(())
    }
}

/// A value a get returned ([`Client::get_values`]): a vector of its own,
/// or its span of memory the transport lent the call (zero-copy over
/// nixl; the values one unit sent share it, and it goes back to the
/// client's receive pool when the last of them is dropped).
#[derive(Debug)]
pub enum Value {
    Owned(Vec<u8>),
    Lent(Arc<Lent>, std::ops::Range<usize>),
}

impl std::ops::Deref for Value {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Value::Owned(v) => v,
            Value::Lent(buf, span) => &buf[span.clone()],
        }
    }
}

/// A new zeroed vector of `len` bytes for a value a sink collects.
fn zeroed(len: u64) -> std::result::Result<Vec<u8>, String> {
    let len = usize::try_from(len).map_err(|_| "value larger than memory".to_string())?;
    Ok(vec![0u8; len])
}

/// A sink that collects values into [`Value`]s, taking lent memory.
struct ValueSink(Vec<Option<Value>>);

impl Sink<ValueAsk<'_>> for ValueSink {
    fn slot(&mut self, ask: ValueAsk<'_>) -> std::result::Result<&mut [u8], String> {
        let fresh = zeroed(ask.len)?;
        let v = self.0.get_mut(ask.index).ok_or("key index out of range")?;
        match v.insert(Value::Owned(fresh)) {
            Value::Owned(v) => Ok(v.as_mut_slice()),
            Value::Lent(..) => Err("a lent value".into()),
        }
    }

    fn accept_lent(&mut self, asks: &[ValueAsk<'_>]) -> Option<std::result::Result<(), String>> {
        let n = self.0.len();
        Some(match asks.iter().find(|a| a.index >= n) {
            Some(_) => Err("key index out of range".into()),
            None => Ok(()),
        })
    }

    fn lent(
        &mut self,
        asks: &[ValueAsk<'_>],
        buf: Lent,
        spans: &[std::ops::Range<usize>],
    ) -> std::result::Result<(), String> {
        let buf = Arc::new(buf);
        for (a, span) in asks.iter().zip(spans) {
            let v = self.0.get_mut(a.index).ok_or("key index out of range")?;
            *v = Some(Value::Lent(buf.clone(), span.clone()));
        }
        Ok(())
    }
}

/// A sink that collects values into fresh vectors.
struct VecSink(Vec<Option<Vec<u8>>>);

impl Sink<ValueAsk<'_>> for VecSink {
    fn slot(&mut self, ask: ValueAsk<'_>) -> std::result::Result<&mut [u8], String> {
        let fresh = zeroed(ask.len)?;
        let v = self.0.get_mut(ask.index).ok_or("key index out of range")?;
        Ok(v.insert(fresh).as_mut_slice())
    }
}

/// A sink over caller buffers: value `i` goes to the front of `bufs[i]`,
/// its length to `lens[i]`.
pub struct SliceSink<'a, 'b> {
    pub bufs: &'a mut [&'b mut [u8]],
    pub lens: Vec<u64>,
}

impl<'a, 'b> SliceSink<'a, 'b> {
    pub fn new(bufs: &'a mut [&'b mut [u8]]) -> Self {
        let n = bufs.len();
        Self {
            bufs,
            lens: vec![0; n],
        }
    }
}

impl Sink<ValueAsk<'_>> for SliceSink<'_, '_> {
    fn slot(&mut self, ask: ValueAsk<'_>) -> std::result::Result<&mut [u8], String> {
        let ValueAsk { index, len, .. } = ask;
        let buf = self.bufs.get_mut(index).ok_or("key index out of range")?;
        let n = usize::try_from(len).map_err(|_| "value larger than memory".to_string())?;
        if n > buf.len() {
            return Err(format!(
                "value {index} is {len} bytes, its buffer only {}",
                buf.len()
            ));
        }
        self.lens[index] = len;
        Ok(&mut buf[..n])
    }
}

/// How one unit's part of an operation ended.
enum Outcome {
    Failed(Error),
    Busy,
}

impl Client {
    /// A client of `cfg.units`. Checks the config and opens nothing: each
    /// unit's first connection is opened by the first operation that
    /// touches it, and a unit that cannot be reached fails that operation
    /// ([`Error::Unreachable`], [`Error::Timeout`], [`Error::Unauthorized`],
    /// as [`Client::check_units`] reports them). A client of thousands of
    /// units costs nothing until it uses them. Call
    /// [`Client::check_units`] to reach every unit now.
    pub fn connect(mut cfg: ClientConfig) -> Result<Client> {
        if cfg.units.is_empty() {
            return Err(Error::InvalidRequest("no units given".into()));
        }
        if !cfg.instances.is_empty() && cfg.instances.len() != cfg.units.len() {
            return Err(Error::InvalidRequest(format!(
                "{} expected instances for {} units",
                cfg.instances.len(),
                cfg.units.len()
            )));
        }
        // The directory's probes prove the client's secret too.
        if let Some(d) = cfg
            .secret
            .as_ref()
            .and_then(|s| cfg.directory.with_secret(s))
        {
            cfg.directory = d;
        }
        let units = cfg
            .units
            .iter()
            .enumerate()
            .map(|(i, a)| UnitSlot {
                addr: a.clone(),
                pool: Mutex::new(Pool::default()),
                freed: Condvar::new(),
                reached: AtomicBool::new(false),
                slab: Mutex::new(None),
                instance: Mutex::new(Instance {
                    current: cfg.instances.get(i).copied().flatten(),
                    lost: None,
                }),
                session: Mutex::new(None),
                view_conn: Mutex::new(None),
                transport: Mutex::new(None),
            })
            .collect();
        metrics::warm_clock();
        let metrics = Arc::new(metrics::ClientMetrics::new(&cfg.units));
        let nixl = cfg.nixl.map(nixl::NixlClient::new);
        // The agent (its UCX backend takes tens of milliseconds to make) is
        // made here, not by the first operation: a setup that cannot run
        // fails the connect, and no operation's deadline pays for it.
        if let Some(n) = &nixl {
            n.agent()
                .map_err(|e| Error::InvalidRequest(format!("nixl: {e}")))?;
        }
        Ok(Client {
            cfg,
            units,
            metrics,
            nixl,
        })
    }

    /// Open (and pool) one connection to every unit, in unit order, and
    /// fail as the first unit that cannot be reached fails: for callers
    /// that want every unit checked before they start (connecting does
    /// not). A unit this client already holds an idle connection to is
    /// taken as reached.
    pub fn check_units(&self, deadline: Instant) -> Result<()> {
        for u in 0..self.units.len() {
            let got = fanout::all_at_once([self.checkout(u, deadline)]);
            match got.into_iter().next() {
                Some(Ok(t)) => self.checkin(u, t),
                Some(Err(NoConn::Open(f))) => return Err(self.unreached_error(u, f)),
                Some(Err(NoConn::Wait)) => return Err(self.wait_error(u)),
                None => {}
            }
        }
        Ok(())
    }

    /// The error of a connection to unit `unit` that could not be made,
    /// as connecting reports it: [`Error::Unreachable`] when nothing
    /// answered at its address, [`Error::Timeout`] when it did not answer
    /// in time or kept refusing, the unit's or this client's refusal
    /// otherwise.
    fn unreached_error(&self, unit: usize, f: OpFailure) -> Error {
        match f {
            OpFailure::Conn {
                error: error @ (ConnFailure::Refusing(_) | ConnFailure::Timeout),
                ..
            } => Error::Timeout {
                unit: Some(unit),
                what: error.to_string(),
            },
            OpFailure::Conn { error, .. } => Error::Unreachable {
                unit,
                addr: self.units[unit].addr.to_string(),
                reason: error.to_string(),
            },
            OpFailure::Unit { code, message } => unit_error(unit, code, message, vec![]),
            OpFailure::Local(l) => local_error(unit, l, vec![]),
            OpFailure::Corrupt { .. } => {
                Error::Io(format!("unit {unit}: unexpected reply at connect"))
            }
        }
    }

    /// The error of waiting in vain for one of unit `unit`'s connections.
    fn wait_error(&self, unit: usize) -> Error {
        Error::Timeout {
            unit: Some(unit),
            what: format!(
                "all {} connections to the unit stayed in use until the deadline",
                self.max_conns()
            ),
        }
    }

    /// [`ClientConfig::max_unit_conns`], at least one.
    fn max_conns(&self) -> usize {
        self.cfg.max_unit_conns.max(1)
    }

    /// The transport this client reaches unit `unit` by: `shm`, `nixl` or
    /// `tcp` (`None`: not reached yet).
    pub fn transport(&self, unit: usize) -> Option<&'static str> {
        self.units.get(unit).and_then(|u| *lock(&u.transport))
    }

    /// The connections this client holds to unit `unit` now (`None`: no
    /// such unit). Its view connection is not among them.
    pub fn connections(&self, unit: usize) -> Option<UnitConnections> {
        let p = lock(&self.units.get(unit)?.pool);
        Some(UnitConnections {
            open: p.open,
            idle: p.idle.len(),
        })
    }

    /// Number of units.
    pub fn unit_count(&self) -> usize {
        self.units.len()
    }

    /// The unit of integer row `row`: `row % N`.
    pub fn unit_of_row(&self, row: u64) -> usize {
        (row % self.units.len() as u64) as usize
    }

    /// Now plus the configured default timeout.
    pub fn deadline(&self) -> Instant {
        Instant::now() + self.cfg.timeout
    }

    pub fn config(&self) -> &ClientConfig {
        &self.cfg
    }

    /// This client's counters now: operations, Busy retries and waits,
    /// bytes, each unit's latency.
    pub fn metrics(&self) -> metrics::MetricsSnapshot {
        self.metrics.snapshot()
    }

    /// Add this client's metrics (`stowage_client_…`, see docs/metrics.md)
    /// to `registry`: every scrape of it reads them then.
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register_collector(Box::new(metrics::ClientCollector(self.metrics.clone())));
    }

    /// Run `f` as one operation of kind `op` (counted, timed from here to
    /// the last unit's answer). `f` gets the operation's timer, to record
    /// each unit's answer with.
    pub(crate) fn timed<T>(
        &self,
        op: metrics::ClientOp,
        f: impl FnOnce(&metrics::OpTimer) -> Result<T>,
    ) -> Result<T> {
        let timer = metrics::OpTimer::start();
        let r = f(&timer);
        self.metrics.op(op, r.is_ok(), timer.took());
        r
    }

    /// The instance id unit `unit` answered with last (`None`: not reached
    /// yet, or found dead).
    pub fn instance_id(&self, unit: usize) -> Option<u128> {
        self.units.get(unit).and_then(|u| lock(&u.instance).current)
    }

    fn open(
        &self,
        unit: usize,
        deadline: Instant,
    ) -> std::result::Result<Box<dyn Transport>, OpFailure> {
        let slot = &self.units[unit];
        let want_fd = self.cfg.shm && matches!(slot.addr, UnitAddr::Unix(_));
        let cached = lock(&slot.slab).clone();
        let connect = |session| {
            Conn::connect_retrying(
                &slot.addr,
                &self.cfg.namespace,
                want_fd,
                session,
                cached.clone(),
                self.cfg.spin,
                self.cfg.secret.as_ref(),
                deadline,
            )
            .map_err(|e| OpFailure::conn(e, false))
        };
        // The first connection (no session yet) is made under the session's
        // lock, so that threads opening at once join one session rather
        // than each start their own.
        let mut known = lock(&slot.session);
        let conn = match *known {
            None => {
                let c = connect(None)?;
                *known = Some(c.session);
                drop(known);
                c
            }
            Some(t) => {
                drop(known);
                let c = connect(Some(t))?;
                if c.session != t {
                    // The unit had forgotten that session: a new one.
                    *lock(&slot.session) = Some(c.session);
                }
                c
            }
        };
        slot.reached.store(true, Ordering::Release);
        self.met_instance(unit, conn.instance_id);
        if let Some(s) = &conn.slab {
            *lock(&slot.slab) = Some((conn.instance_id, s.clone()));
        }
        let t: Box<dyn Transport> = match (&self.nixl, want_fd) {
            (_, true) => match ShmTransport::new(conn, self.cfg.spare_max) {
                Some(t) => Box::new(t),
                None => {
                    return Err(OpFailure::conn(
                        conn::ConnError::Protocol("the unit handed over no slab".into()),
                        false,
                    ))
                }
            },
            (Some(n), false) => self.open_nixl(unit, n, conn, deadline)?,
            (None, false) => Box::new(TcpTransport::new(conn)),
        };
        *lock(&slot.transport) = Some(t.name());
        self.metrics.transport(unit, t.name());
        Ok(t)
    }

    /// Ask the unit how to reach its slab over nixl and make the
    /// connection's transport: nixl, or tcp when the unit does not serve
    /// nixl.
    fn open_nixl(
        &self,
        unit: usize,
        n: &nixl::NixlClient,
        mut conn: Conn,
        deadline: Instant,
    ) -> std::result::Result<Box<dyn Transport>, OpFailure> {
        // The unit learns this client's agent, to invalidate it once this
        // client's last connection to it has ended. Without an agent (NIXL
        // cannot run here) the unit's answer still tells whether it serves
        // nixl: the mover then fails, or the connection is tcp.
        let (agent, agent_metadata) = n.introduction().unwrap_or_default();
        let ask = stowage_wire::Request::NixlInfo {
            agent,
            agent_metadata,
        };
        let id = conn
            .send(&ask, &mut [], deadline)
            .map_err(|e| OpFailure::conn(e, false))?;
        match conn
            .recv(id, deadline)
            .map_err(|e| OpFailure::conn(e, false))?
        {
            stowage_wire::Response::NixlInfo {
                metadata,
                slab_addr,
            } => {
                let mover = n
                    .mover(&metadata, slab_addr)
                    .map_err(|e| OpFailure::invalid(format!("nixl: {e}")))?;
                Ok(Box::new(transport::OneSided::with_mover(
                    conn,
                    mover,
                    self.cfg.spare_max,
                )))
            }
            stowage_wire::Response::Error {
                code: ErrorCode::InvalidRequest,
                message,
            } => {
                tracing::debug!(unit, %message, "the unit does not serve nixl: tcp");
                Ok(Box::new(TcpTransport::new(conn)))
            }
            stowage_wire::Response::Error { code, message } => {
                Err(OpFailure::Unit { code, message })
            }
            other => Err(OpFailure::conn(
                conn::ConnError::Protocol(format!("unexpected reply to NixlInfo: {other:?}")),
                false,
            )),
        }
    }

    /// A connection reached `instance` at unit `unit`'s address. A new
    /// instance means the old one is gone with its memory: its pooled
    /// connections and slab mapping are dropped, and the restart is noted
    /// for the next operation to report.
    fn met_instance(&self, unit: usize, instance: u128) {
        let slot = &self.units[unit];
        let mut i = lock(&slot.instance);
        match i.current {
            Some(c) if c != instance => {
                i.lost = Some(c);
                i.current = Some(instance);
                drop(i);
                self.forget_instance(unit, Some(instance));
            }
            Some(_) => {}
            None => i.current = Some(instance),
        }
    }

    /// Drop everything this client holds of unit `unit` other than
    /// `keep` (an instance): pooled connections and the slab mapping, so a
    /// dead unit's memory is unmapped. Views keep their own mapping.
    fn forget_instance(&self, unit: usize, keep: Option<u128>) {
        let slot = &self.units[unit];
        let mut p = lock(&slot.pool);
        let before = p.idle.len();
        p.idle.retain(|t| Some(t.instance_id()) == keep);
        let closed = before - p.idle.len();
        p.open = p.open.saturating_sub(closed);
        drop(p);
        if closed > 0 {
            slot.freed.notify_all();
        }
        let mut s = lock(&slot.slab);
        if s.as_ref().is_some_and(|(i, _)| Some(*i) != keep) {
            *s = None;
        }
        drop(s);
        let mut v = lock(&slot.view_conn);
        if v.as_ref()
            .is_some_and(|c| Some(lock(c).instance_id()) != keep)
        {
            *v = None;
        }
    }

    /// Whether a restart of unit `unit` was seen and not yet reported;
    /// reporting it clears it.
    fn take_restart(&self, unit: usize) -> bool {
        lock(&self.units[unit].instance).lost.take().is_some()
    }

    /// A connection to unit `unit`: an idle one from its pool, else a new
    /// one while fewer than [`ClientConfig::max_unit_conns`] are open,
    /// else the first to come free before `deadline`. While it waits, the
    /// other units' parts of the call go on (a part alone blocks), so
    /// threads holding connections to several units never wait on each
    /// other in a cycle.
    async fn checkout(
        &self,
        unit: usize,
        deadline: Instant,
    ) -> std::result::Result<Lease<'_>, NoConn> {
        let slot = &self.units[unit];
        let mut nap = Duration::from_micros(50);
        loop {
            let now = Instant::now();
            // Whether to open one (its place taken), else to let the other
            // parts run a while; the pool's lock is never held across that.
            let open_one = {
                let mut p = lock(&slot.pool);
                if let Some(t) = p.idle.pop() {
                    return Ok(Lease {
                        slot,
                        t: Some(t),
                        pooled: false,
                    });
                }
                if p.open < self.max_conns() {
                    p.open += 1;
                    true
                } else if now >= deadline {
                    return Err(NoConn::Wait);
                } else if fanout::alone() {
                    p.waiters += 1;
                    let (mut p, _) = slot
                        .freed
                        .wait_timeout(p, deadline - now)
                        .unwrap_or_else(|e| e.into_inner());
                    p.waiters -= 1;
                    drop(p);
                    continue;
                } else {
                    false
                }
            };
            if open_one {
                // Its place is given back if opening fails.
                let mut lease = Lease {
                    slot,
                    t: None,
                    pooled: false,
                };
                lease.t = Some(self.open(unit, deadline).map_err(NoConn::Open)?);
                return Ok(lease);
            }
            fanout::pause_until((now + nap).min(deadline)).await;
            nap = (nap * 2).min(Duration::from_millis(5));
        }
    }

    fn checkin(&self, unit: usize, mut lease: Lease<'_>) {
        // A connection to an instance this client has since seen replaced
        // is not pooled again (it is closed): its next failure would be
        // judged against the new instance.
        let current = lock(&self.units[unit].instance).current;
        let Some(t) = lease.t.take() else { return };
        if current.is_some_and(|c| c != t.instance_id()) {
            return;
        }
        let slot = &self.units[unit];
        let wake = {
            let mut p = lock(&slot.pool);
            p.idle.push(t);
            p.waiters > 0
        };
        lease.pooled = true;
        if wake {
            slot.freed.notify_one();
        }
    }

    /// Turn a unit's failure into an [`Error`], asking the directory when
    /// the connection broke. `blobs`/`keys`: what the operation touched.
    fn classify(
        &self,
        unit: usize,
        f: OpFailure,
        blobs: Vec<BlobId>,
        keys: Vec<Key>,
        deadline: Instant,
    ) -> Outcome {
        // A unit never reached: its first connection failed (nothing of
        // this client's can be lost there).
        if matches!(f, OpFailure::Conn { .. }) && !self.units[unit].reached.load(Ordering::Acquire)
        {
            return Outcome::Failed(self.unreached_error(unit, f));
        }
        match f {
            OpFailure::Unit {
                code: ErrorCode::Busy,
                ..
            } => Outcome::Busy,
            OpFailure::Unit { code, message } => {
                Outcome::Failed(unit_error(unit, code, message, blobs))
            }
            OpFailure::Local(l) => Outcome::Failed(local_error(unit, l, blobs)),
            OpFailure::Corrupt { positions } => {
                let keys: Vec<Key> = positions
                    .iter()
                    .filter_map(|&i| keys.get(i).cloned())
                    .collect();
                Outcome::Failed(Error::Corrupt {
                    unit,
                    named: error::names(&keys),
                    keys,
                })
            }
            OpFailure::Conn {
                error: ConnFailure::Timeout,
                ..
            } => Outcome::Failed(Error::Timeout {
                unit: Some(unit),
                what: "no answer before the deadline".into(),
            }),
            // It answered (refusals), so it is alive: no probe.
            OpFailure::Conn {
                error: error @ ConnFailure::Refusing(_),
                ..
            } => Outcome::Failed(Error::Timeout {
                unit: Some(unit),
                what: error.to_string(),
            }),
            OpFailure::Conn { error, in_flight } => {
                let known = lock(&self.units[unit].instance).current.unwrap_or(0);
                let reason = match &error {
                    ConnFailure::Broken(m)
                    | ConnFailure::Protocol(m)
                    | ConnFailure::Refusing(m) => m.clone(),
                    ConnFailure::Timeout => "timeout".into(),
                };
                match self
                    .cfg
                    .directory
                    .liveness(unit, &self.units[unit].addr, known, deadline)
                {
                    Liveness::Dead | Liveness::Restarted => {
                        // Connections to the old instance are useless now,
                        // and its slab mapping only holds dead memory.
                        self.forget_instance(unit, None);
                        {
                            let mut i = lock(&self.units[unit].instance);
                            i.current = None;
                            i.lost = None;
                        }
                        *lock(&self.units[unit].session) = None;
                        Outcome::Failed(Error::LostKeys {
                            unit,
                            blobs,
                            named: error::names(&keys),
                            keys,
                        })
                    }
                    Liveness::Alive => Outcome::Failed(Error::TransferFailed {
                        unit,
                        blobs,
                        reason,
                        in_flight,
                    }),
                    Liveness::Unresponsive => Outcome::Failed(Error::Timeout {
                        unit: Some(unit),
                        what: format!("connection failed ({reason}) and the unit does not answer"),
                    }),
                }
            }
        }
    }

    /// Write blobs: each unit's blobs one after another, every unit at
    /// once. Returns once every blob is committed, or with the first
    /// unit's error (in unit order) (blobs committed on other
    /// units stay committed; retrying with the same ids is idempotent).
    pub fn put_many(&self, blobs: &[BlobPut<'_>], deadline: Instant) -> Result<()> {
        self.timed(metrics::ClientOp::Put, |timer| {
            self.put_blobs(blobs, deadline, timer)?;
            let bytes = blobs
                .iter()
                .flat_map(|b| b.segments.iter())
                .map(|s| s.len() as u64)
                .sum();
            self.metrics.put_bytes(bytes);
            Ok(())
        })
    }

    fn put_blobs(
        &self,
        blobs: &[BlobPut<'_>],
        deadline: Instant,
        timer: &metrics::OpTimer,
    ) -> Result<()> {
        let mut queues: BTreeMap<usize, Vec<&BlobPut<'_>>> = BTreeMap::new();
        for b in blobs {
            if b.unit >= self.units.len() {
                return Err(Error::InvalidRequest(format!(
                    "unit {} does not exist ({} units)",
                    b.unit,
                    self.units.len()
                )));
            }
            queues.entry(b.unit).or_default().push(b);
        }
        let wait_until = self
            .cfg
            .wait_for_memory
            .map(|w| (Instant::now() + w).min(deadline));
        let results = fanout::all_at_once(
            queues
                .iter()
                .map(|(&unit, queue)| self.put_unit(unit, queue, deadline, wait_until, timer)),
        );
        // The first unit's error (in unit order); what other units
        // committed stays committed.
        results.into_iter().collect::<Result<Vec<()>>>().map(drop)
    }

    /// One unit's part of a put: its blobs one after another, each
    /// written and committed ([`Transport::put`]). A unit that answers
    /// Busy (or, with [`ClientConfig::wait_for_memory`], Full) is asked
    /// again after [`BUSY_RETRY`], doubling to [`BUSY_RETRY_MAX`], within
    /// the deadline.
    async fn put_unit(
        &self,
        unit: usize,
        queue: &[&BlobPut<'_>],
        deadline: Instant,
        wait_until: Option<Instant>,
        timer: &metrics::OpTimer,
    ) -> Result<()> {
        let mut backoff: Option<Duration> = None;
        for &put in queue {
            loop {
                // A full unit is waited on like a busy one, when asked to.
                let (full, outcome) = match self.put_one(unit, put, deadline).await {
                    Ok(()) => {
                        timer.unit_done(&self.metrics, unit);
                        backoff = None;
                        break;
                    }
                    Err(Outcome::Failed(Error::UnitFull { .. }))
                        if wait_until.is_some_and(|w| Instant::now() < w) =>
                    {
                        (true, Outcome::Busy)
                    }
                    Err(o) => (false, o),
                };
                match outcome {
                    Outcome::Busy => {
                        let step = backoff
                            .map(|d| (d * 2).min(BUSY_RETRY_MAX))
                            .unwrap_or(BUSY_RETRY);
                        let at = Instant::now() + step;
                        if at >= deadline {
                            return Err(Error::Timeout {
                                unit: Some(unit),
                                what: "the unit kept answering Busy".into(),
                            });
                        }
                        self.metrics.retry(full, step);
                        backoff = Some(step);
                        fanout::pause_until(at).await;
                    }
                    Outcome::Failed(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// Write one blob on a pooled connection to its unit.
    async fn put_one(
        &self,
        unit: usize,
        put: &BlobPut<'_>,
        deadline: Instant,
    ) -> std::result::Result<(), Outcome> {
        let failed = |f: OpFailure| {
            let keys = put.entries.iter().map(|e| e.key.clone()).collect();
            self.classify(unit, f, vec![put.blob], keys, deadline)
        };
        let mut t = match self.checkout(unit, deadline).await {
            Ok(t) => t,
            Err(NoConn::Open(f)) => return Err(failed(f)),
            Err(NoConn::Wait) => return Err(Outcome::Failed(self.wait_error(unit))),
        };
        match t.put(put, deadline).await {
            Ok(()) => {
                self.checkin(unit, t);
                Ok(())
            }
            Err(f) => {
                if f.keeps_connection() {
                    self.checkin(unit, t);
                }
                Err(failed(f))
            }
        }
    }

    /// Read `keys` (each with its unit): one resolve and one read per unit,
    /// every unit at once. Every value is handed to `sink` under its index
    /// in `keys`. Keys that are not stored fail the call with
    /// [`Error::NotFound`] naming each of them.
    pub fn get_into(
        &self,
        partition: &str,
        keys: &[(usize, Key)],
        sink: &mut dyn GetSink,
        deadline: Instant,
    ) -> Result<()> {
        self.timed(metrics::ClientOp::Get, |timer| {
            let mut counting = Counting {
                inner: sink,
                bytes: 0,
            };
            self.get_from_units(partition, keys, &mut counting, deadline, timer)?;
            self.metrics.got_bytes(counting.bytes);
            Ok(())
        })
    }

    fn get_from_units(
        &self,
        partition: &str,
        keys: &[(usize, Key)],
        sink: &mut dyn GetSink,
        deadline: Instant,
        timer: &metrics::OpTimer,
    ) -> Result<()> {
        let mut by_unit: BTreeMap<usize, (Vec<Key>, Vec<usize>)> = BTreeMap::new();
        for (i, (unit, key)) in keys.iter().enumerate() {
            if *unit >= self.units.len() {
                return Err(Error::InvalidRequest(format!("unit {unit} does not exist")));
            }
            let e = by_unit.entry(*unit).or_default();
            e.0.push(key.clone());
            e.1.push(i);
        }
        let sink: SharedSink<'_> = std::cell::RefCell::new(sink);
        let results = fanout::all_at_once(by_unit.iter().map(|(&unit, (ks, idx))| {
            self.get_unit(partition, unit, ks, idx, &sink, deadline, timer)
        }));
        let mut missing: Vec<Key> = Vec::new();
        for r in results {
            missing.extend(r?);
        }
        if !missing.is_empty() {
            return Err(Error::NotFound {
                named: error::names(&missing),
                keys: missing,
            });
        }
        Ok(())
    }

    /// One unit's part of a get ([`Transport::get`]): the keys it does
    /// not have.
    #[allow(clippy::too_many_arguments)]
    async fn get_unit(
        &self,
        partition: &str,
        unit: usize,
        keys: &[Key],
        index_of: &[usize],
        sink: &SharedSink<'_>,
        deadline: Instant,
        timer: &metrics::OpTimer,
    ) -> Result<Vec<Key>> {
        let mut t = match self.checkout(unit, deadline).await {
            Ok(t) => t,
            Err(NoConn::Open(f)) => return Err(self.failed_get(unit, f, keys, deadline)),
            Err(NoConn::Wait) => return Err(self.wait_error(unit)),
        };
        match t.get(partition, keys, index_of, sink, deadline).await {
            Ok(miss) => {
                timer.unit_done(&self.metrics, unit);
                let restarted = !miss.is_empty() && self.take_restart(unit);
                self.checkin(unit, t);
                let miss: Vec<Key> = miss.into_iter().map(|i| keys[i].clone()).collect();
                if restarted {
                    return Err(Error::LostKeys {
                        unit,
                        blobs: vec![],
                        named: error::names(&miss),
                        keys: miss,
                    });
                }
                Ok(miss)
            }
            Err(f) => {
                if f.keeps_connection() {
                    self.checkin(unit, t);
                }
                Err(self.failed_get(unit, f, keys, deadline))
            }
        }
    }

    fn failed_get(&self, unit: usize, f: OpFailure, keys: &[Key], deadline: Instant) -> Error {
        match self.classify(unit, f, vec![], keys.to_vec(), deadline) {
            Outcome::Failed(e) => e,
            Outcome::Busy => Error::TransferFailed {
                unit,
                blobs: vec![],
                reason: "unit busy".into(),
                in_flight: false,
            },
        }
    }

    /// Read `keys` into fresh vectors, in order.
    pub fn get(
        &self,
        partition: &str,
        keys: &[(usize, Key)],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>> {
        let mut sink = VecSink(vec![None; keys.len()]);
        self.get_into(partition, keys, &mut sink, deadline)?;
        Ok(sink.0.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// Read `keys` into [`Value`]s, in order: over nixl each unit's values
    /// land, without a copy, in one buffer of the client's registered
    /// receive pool that the values share ([`Value::Lent`]); over shm and
    /// tcp each is a vector of its own.
    pub fn get_values(
        &self,
        partition: &str,
        keys: &[(usize, Key)],
        deadline: Instant,
    ) -> Result<Vec<Value>> {
        let mut sink = ValueSink((0..keys.len()).map(|_| None).collect());
        self.get_into(partition, keys, &mut sink, deadline)?;
        Ok(sink
            .0
            .into_iter()
            .map(|v| v.unwrap_or(Value::Owned(Vec::new())))
            .collect())
    }

    /// Clear whole rows (each with its unit): one awaited ClearRows per
    /// unit, all units at once. Rows on a dead unit are already gone, so
    /// clearing them succeeds; a live unit that does not answer fails the
    /// call (retryable). Returns the number of entries removed.
    pub fn clear_placed_rows(
        &self,
        partition: &str,
        rows: &[(usize, u64)],
        deadline: Instant,
    ) -> Result<u64> {
        self.timed(metrics::ClientOp::Clear, |_| {
            self.clear_rows_of_units(partition, rows, deadline)
        })
    }

    fn clear_rows_of_units(
        &self,
        partition: &str,
        rows: &[(usize, u64)],
        deadline: Instant,
    ) -> Result<u64> {
        let mut by_unit: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
        for &(unit, row) in rows {
            if unit >= self.units.len() {
                return Err(Error::InvalidRequest(format!("unit {unit} does not exist")));
            }
            by_unit.entry(unit).or_default().push(row);
        }
        let mut removed = 0;
        let replies = self.call_units(
            by_unit
                .into_iter()
                .map(|(u, rows)| {
                    (
                        u,
                        Request::ClearRows {
                            partition: partition.to_owned(),
                            rows,
                        },
                    )
                })
                .collect(),
            deadline,
        );
        for (unit, r) in replies {
            match r {
                Ok(Response::Cleared { entries }) => removed += entries,
                Ok(other) => {
                    return Err(Error::TransferFailed {
                        unit,
                        blobs: vec![],
                        reason: format!("unexpected reply {other:?}"),
                        in_flight: false,
                    })
                }
                Err(Error::LostKeys { .. }) => {} // a dead unit's rows are gone already
                Err(e) => return Err(e),
            }
        }
        Ok(removed)
    }

    /// Every unit's counters.
    pub fn stats(&self, deadline: Instant) -> Vec<Result<Stats>> {
        let timer = metrics::OpTimer::start();
        let reqs = (0..self.units.len()).map(|u| (u, Request::Stats)).collect();
        let all = self
            .call_units(reqs, deadline)
            .into_iter()
            .map(|(unit, r)| match r? {
                Response::Stats(s) => Ok(*s),
                other => Err(Error::TransferFailed {
                    unit,
                    blobs: vec![],
                    reason: format!("unexpected reply {other:?}"),
                    in_flight: false,
                }),
            })
            .collect::<Vec<_>>();
        let ok = all.iter().all(|r| r.is_ok());
        self.metrics
            .op(metrics::ClientOp::Control, ok, timer.took());
        all
    }

    /// Ask every unit to write a checkpoint of everything it holds to
    /// `dir/unit-<i>` on its own host (bytes never pass through this
    /// client). Returns each unit's metadata, in unit order; a unit started
    /// with `--restore dir/unit-<i>` serves the same keys.
    pub fn checkpoint(
        &self,
        dir: &std::path::Path,
        deadline: Instant,
    ) -> Result<Vec<CheckpointInfo>> {
        let reqs = (0..self.units.len())
            .map(|u| {
                let d = dir.join(format!("unit-{u}"));
                (
                    u,
                    Request::Checkpoint {
                        dir: d.to_string_lossy().into_owned(),
                    },
                )
            })
            .collect();
        let mut out = Vec::with_capacity(self.units.len());
        for (unit, r) in self.call_units(reqs, deadline) {
            match r? {
                Response::Checkpointed(info) => out.push(info),
                other => {
                    return Err(Error::TransferFailed {
                        unit,
                        blobs: vec![],
                        reason: format!("unexpected reply {other:?}"),
                        in_flight: false,
                    })
                }
            }
        }
        Ok(out)
    }

    /// Ask unit `unit` to serve the checkpoint in `dir` (on the unit's
    /// host, under its checkpoint root) from a restore unit it starts in
    /// its own process (a checkpoint request: this client must be an admin
    /// of the unit, or the unit must have a shared secret). The reply says
    /// where the restore unit listens ([`Client::restore_address`]) and
    /// what it serves, or, with `opened` `None`, what is missing there.
    /// Close it with [`Client::close_restore`] (it also stops by itself
    /// after a while without connections, and with its unit).
    pub fn open_restore(&self, unit: usize, dir: &str, deadline: Instant) -> Result<RestoreReply> {
        let req = Request::OpenRestore { dir: dir.into() };
        match self.call_one(unit, req, deadline)? {
            Response::Restore(r) => Ok(*r),
            other => Err(Error::TransferFailed {
                unit,
                blobs: vec![],
                reason: format!("unexpected reply {other:?}"),
                in_flight: false,
            }),
        }
    }

    /// Stop restore unit `id` of unit `unit` ([`Client::open_restore`]).
    pub fn close_restore(&self, unit: usize, id: u64, deadline: Instant) -> Result<()> {
        match self.call_one(unit, Request::CloseRestore { id }, deadline)? {
            Response::Done => Ok(()),
            other => Err(Error::TransferFailed {
                unit,
                blobs: vec![],
                reason: format!("unexpected reply {other:?}"),
                in_flight: false,
            }),
        }
    }

    /// Where this client reaches restore unit `src` of unit `unit`: its
    /// Unix socket when this client reaches the unit by its own, else its
    /// TCP port at the host this client reaches the unit at (the restore
    /// unit listens where the unit does).
    pub fn restore_address(&self, unit: usize, src: &RestoreSource) -> Result<UnitAddr> {
        let own = &self
            .units
            .get(unit)
            .ok_or_else(|| Error::InvalidRequest(format!("no unit {unit}")))?
            .addr;
        if let (UnitAddr::Unix(_), Some(p)) = (own, &src.uds) {
            return Ok(UnitAddr::Unix(p.into()));
        }
        let tcp: std::net::SocketAddr = src
            .tcp
            .as_deref()
            .ok_or_else(|| {
                Error::InvalidRequest(format!(
                    "unit {unit}'s restore unit listens on no address this client can reach"
                ))
            })?
            .parse()
            .map_err(|e| Error::InvalidRequest(format!("restore unit address: {e}")))?;
        let ip = match own {
            UnitAddr::Tcp(a) => a.ip(),
            UnitAddr::Unix(_) if tcp.ip().is_unspecified() => {
                std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
            }
            UnitAddr::Unix(_) => tcp.ip(),
        };
        Ok(UnitAddr::Tcp(std::net::SocketAddr::new(ip, tcp.port())))
    }

    /// A client of `units` in `namespace` with this client's secret,
    /// timeout and transport settings (e.g. of restore units).
    pub fn sibling(&self, units: Vec<UnitAddr>, namespace: &str) -> Result<Client> {
        let mut cfg = ClientConfig::new(namespace, units);
        cfg.timeout = self.cfg.timeout;
        cfg.shm = self.cfg.shm;
        cfg.spin = self.cfg.spin;
        cfg.secret = self.cfg.secret.clone();
        cfg.max_unit_conns = self.cfg.max_unit_conns;
        Client::connect(cfg)
    }

    /// One control request to unit `unit`.
    fn call_one(&self, unit: usize, req: Request, deadline: Instant) -> Result<Response> {
        if unit >= self.units.len() {
            return Err(Error::InvalidRequest(format!(
                "no unit {unit}: the client has {}",
                self.units.len()
            )));
        }
        let timer = metrics::OpTimer::start();
        let r = self
            .call_units(vec![(unit, req)], deadline)
            .pop()
            .map(|(_, r)| r)
            .unwrap_or_else(|| Err(Error::Io("no reply".into())));
        self.metrics
            .op(metrics::ClientOp::Control, r.is_ok(), timer.took());
        r
    }

    /// Stop every unit within `timeout`: a unit abandons a checkpoint that
    /// does not finish in time, removes its disk directory and exits.
    /// Never fails: returns, per unit, what could not be done (a unit that
    /// is already gone reports nothing).
    pub fn shutdown(&self, timeout: Duration) -> Vec<Vec<String>> {
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let deadline = Instant::now() + timeout + Duration::from_secs(1);
        let reqs = (0..self.units.len())
            .map(|u| (u, Request::Shutdown { timeout_ms: ms }))
            .collect();
        let mut out = vec![Vec::new(); self.units.len()];
        for (unit, r) in self.call_units(reqs, deadline) {
            out[unit] = match r {
                Ok(Response::ShutDown { problems }) => problems,
                Ok(other) => vec![format!("unexpected reply {other:?}")],
                Err(Error::LostKeys { .. }) => Vec::new(),
                Err(e) => vec![e.to_string()],
            };
            self.forget_instance(unit, None);
        }
        out
    }

    /// Send one control request per unit and await its reply, all units
    /// at once. The replies in unit order (as `reqs`).
    fn call_units(
        &self,
        reqs: Vec<(usize, Request)>,
        deadline: Instant,
    ) -> Vec<(usize, Result<Response>)> {
        let results = fanout::all_at_once(
            reqs.iter()
                .map(|(unit, req)| self.call_unit(*unit, req, deadline)),
        );
        reqs.iter().map(|(unit, _)| *unit).zip(results).collect()
    }

    /// One unit's part of a control call.
    async fn call_unit(&self, unit: usize, req: &Request, deadline: Instant) -> Result<Response> {
        let mut t = match self.checkout(unit, deadline).await {
            Ok(t) => t,
            Err(NoConn::Open(f)) => return Err(self.failed_get(unit, f, &[], deadline)),
            Err(NoConn::Wait) => return Err(self.wait_error(unit)),
        };
        match t.call(req, deadline).await {
            Ok(Response::Error { code, message }) => {
                self.checkin(unit, t);
                Err(unit_error(unit, code, message, vec![]))
            }
            Ok(r) => {
                self.checkin(unit, t);
                Ok(r)
            }
            Err(f) => Err(self.failed_get(unit, f, &[], deadline)),
        }
    }

    /// Put raw values by key in the default partition, one blob per unit
    /// (row `r` on unit `r % N`), all units at once.
    pub fn put_rows(&self, values: &[(Key, &[u8])], deadline: Instant) -> Result<()> {
        let mut by_unit: BTreeMap<usize, BlobPut<'_>> = BTreeMap::new();
        let mut sizes: HashMap<usize, u64> = HashMap::new();
        for (key, bytes) in values {
            let unit = self.unit_of_row(key.row);
            let b = by_unit.entry(unit).or_insert_with(|| BlobPut {
                unit,
                partition: DEFAULT_PARTITION,
                blob: new_blob_id(),
                segments: Vec::new(),
                entries: Vec::new(),
            });
            let off = sizes.entry(unit).or_insert(0);
            b.entries.push(EntrySpec {
                key: key.clone(),
                offset: *off,
                len: bytes.len() as u64,
                meta: Vec::new(),
            });
            b.segments.push(bytes);
            *off += bytes.len() as u64;
        }
        let blobs: Vec<BlobPut<'_>> = by_unit.into_values().collect();
        self.put_many(&blobs, deadline)
    }

    /// Get raw values by key from the default partition (row `r` on unit
    /// `r % N`), in order.
    pub fn get_rows(&self, keys: &[Key], deadline: Instant) -> Result<Vec<Vec<u8>>> {
        let placed: Vec<(usize, Key)> = keys
            .iter()
            .map(|k| (self.unit_of_row(k.row), k.clone()))
            .collect();
        self.get(DEFAULT_PARTITION, &placed, deadline)
    }

    /// Clear rows of the default partition (row `r` on unit `r % N`).
    pub fn clear_rows(&self, rows: &[u64], deadline: Instant) -> Result<u64> {
        let placed: Vec<(usize, u64)> = rows.iter().map(|&r| (self.unit_of_row(r), r)).collect();
        self.clear_placed_rows(DEFAULT_PARTITION, &placed, deadline)
    }
}

fn unit_error(unit: usize, code: ErrorCode, message: String, blobs: Vec<BlobId>) -> Error {
    match code {
        ErrorCode::Full => Error::UnitFull { unit, message },
        ErrorCode::InvalidRequest | ErrorCode::VersionMismatch => Error::InvalidRequest(message),
        ErrorCode::Unauthorized => Error::Unauthorized(message),
        ErrorCode::NotOwner => Error::NotOwner(message),
        ErrorCode::Busy | ErrorCode::UnknownBlob | ErrorCode::Internal => Error::TransferFailed {
            unit,
            blobs,
            reason: message,
            in_flight: false,
        },
    }
}

/// The error of a failure on this client's own side.
fn local_error(unit: usize, l: LocalFailure, blobs: Vec<BlobId>) -> Error {
    match l {
        LocalFailure::Invalid(message) => Error::InvalidRequest(message),
        LocalFailure::Distrust(message) => Error::Unauthorized(message),
        LocalFailure::Busy(reason) => Error::TransferFailed {
            unit,
            blobs,
            reason,
            in_flight: false,
        },
    }
}

/// Lock a mutex; a panic elsewhere while holding it leaves only a pool or
/// cache behind, which stays usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client of one unit where nothing listens, with `max` connections
    /// a unit.
    fn nowhere(max: usize) -> Client {
        let addr = "unix:/nonexistent-stowage-dir/unit.sock".parse().unwrap();
        let mut cfg = ClientConfig::new("pool", vec![addr]);
        cfg.max_unit_conns = max;
        Client::connect(cfg).unwrap()
    }

    fn get(c: &Client, deadline: Instant) -> Result<Vec<Vec<u8>>> {
        c.get("", &[(0, Key::new(0, "a"))], deadline)
    }

    #[test]
    fn blob_ids_are_distinct_across_threads_and_not_sequential() {
        let per_thread: Vec<Vec<BlobId>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| s.spawn(|| (0..10_000).map(|_| new_blob_id()).collect::<Vec<_>>()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let all: std::collections::HashSet<u128> =
            per_thread.iter().flatten().map(|b| b.0).collect();
        assert_eq!(all.len(), 40_000, "a blob id repeated");
        // Consecutive ids of one thread are not a counter.
        let ids = &per_thread[0];
        let steps: std::collections::HashSet<u128> = ids
            .windows(2)
            .map(|w| w[1].0.wrapping_sub(w[0].0))
            .collect();
        assert!(steps.len() > 9_000, "ids advance by a few fixed steps");
    }

    #[test]
    fn a_call_waits_for_a_held_connection_until_its_deadline() {
        let c = nowhere(2);
        // Two connections out (being opened, say): the bound is reached.
        lock(&c.units[0].pool).open = 2;
        match get(&c, Instant::now() + Duration::from_millis(200)) {
            Err(Error::Timeout {
                unit: Some(0),
                what,
            }) => assert!(what.contains("stayed in use"), "{what}"),
            other => panic!("expected a Timeout waiting for a connection: {other:?}"),
        }
        // It opened none of its own.
        assert_eq!(c.connections(0), Some(UnitConnections { open: 2, idle: 0 }));
    }

    #[test]
    fn a_dropped_connection_frees_its_place_for_a_waiting_call() {
        let c = nowhere(1);
        lock(&c.units[0].pool).open = 1;
        let held = Lease {
            slot: &c.units[0],
            t: None,
            pooled: false,
        };
        let got = std::thread::scope(|s| {
            let waiter = s.spawn(|| get(&c, Instant::now() + Duration::from_secs(30)));
            // Let the call start waiting (it is right either way).
            std::thread::sleep(Duration::from_millis(100));
            drop(held);
            waiter.join().unwrap()
        });
        // The freed place let it open a connection of its own, which found
        // nothing at the address: the error connecting reports, not a wait's
        // timeout.
        assert!(
            matches!(got, Err(Error::Unreachable { unit: 0, .. })),
            "{got:?}"
        );
        // The failed opening gave its place back too.
        assert_eq!(c.connections(0), Some(UnitConnections { open: 0, idle: 0 }));
    }

    #[test]
    fn check_units_reports_the_first_unit_it_cannot_reach() {
        let c = nowhere(4);
        match c.check_units(Instant::now() + Duration::from_secs(5)) {
            Err(Error::Unreachable { unit: 0, addr, .. }) => {
                assert_eq!(addr, "unix:/nonexistent-stowage-dir/unit.sock")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(c.transport(0), None);
        assert_eq!(c.connections(0).unwrap().open, 0);
    }
}
