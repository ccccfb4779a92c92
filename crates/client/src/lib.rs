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
//!   the sum). A unit answering Busy is asked again after 5 ms, doubling to 20 ms,
//!   inside the deadline (short of memory, the unit counts other puts'
//!   reservations as holds that end only if they existed at this put's
//!   first refusal; over tcp, where each ask carries the blob, the pause
//!   doubles to 2 s); a full one is `UnitFull` at once (or, with
//!   `wait_for_memory`, asked again every 5 ms doubling to 20 ms until that
//!   wait ends). Blob ids ([`BlobId`], chosen by the caller, e.g.
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
//! [`Client::put_rows`], [`Client::get_rows`], [`Client::clear_rows`], each
//! taking the same keys ([`Key`]: row and field; a clear clears their rows).
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

mod admin;
mod blobs;
mod claims;
mod classify;
mod config;
mod conn;
mod copies;
mod directory;
mod error;
mod failure;
mod fanout;
mod fence;
mod lent;
pub mod metrics;
mod nixl;
mod one_sided;
mod packed;
mod pieces;
mod pool;
mod put;
mod rejoin;
mod repair;
mod row_meta;
pub mod rows;
pub mod sink;
pub mod transport;
pub mod unit_directory;
mod values;
mod views;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use blobs::RowOf;
pub use config::{ClientConfig, DEFAULT_PARTITION, MAX_UNIT_CONNS, REPAIR_RATE, SPARE_MAX};
pub use conn::{UnitAddr, BUSY_RETRY, BUSY_RETRY_MAX};
pub use copies::copy_sets;
pub use directory::{Directory, Liveness, ProbeDirectory};
pub use error::{Error, Result};
pub use lent::{Lent, RECV_POOL_MAX};
pub use nixl::{Failpoints, NixlOptions, ZERO_COPY_MIN};
pub use one_sided::SPARES;
pub use pool::UnitConnections;
pub use rejoin::Rejoined;
pub use repair::{repair_in_background, Repaired, Shortfall};
pub use rows::{
    Column, DType, OwnedTensor, PackedChunk, PackedField, RowKey, Shape, Tensor, View, ViewTensor,
};
pub use sink::{GetSink, Sink, SliceSink, TensorAsk, TensorSink, Value, ValueAsk};
pub use stowage_wire::auth::{Secret, SecretError, SECRET_ENV};
pub use stowage_wire::{BlobId, ClaimProgress, EntrySpec, Key, Stats, GROUP_FIELD_PREFIX};
pub use stowage_wire::{CheckpointFile, CheckpointInfo, RestoreReply, RestoreSource};
pub use transport::Transport;
pub use unit_directory::{host_id, TransportChoice, UnitDirectory, UnitEntry};

use pool::UnitSlot;

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

/// A connection-pooling client of a set of units. Cheap to share between
/// threads (`&Client` is enough for every operation).
pub struct Client {
    cfg: ClientConfig,
    units: Vec<UnitSlot>,
    metrics: Arc<metrics::ClientMetrics>,
    nixl: Option<nixl::NixlClient>,
    /// With copies: the units of each unit's copies, copy 0 first.
    copies: copies::Copies,
    /// This process's host ([`host_id`]), when the units' hosts are known
    /// (`ClientConfig::hosts`): a put is not forwarded from a unit of this
    /// host (`put.rs`).
    host: Option<String>,
    /// The view of the plane this client speaks for (`rejoin.rs`).
    plane: rejoin::Plane,
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
        if cfg.replicas == 0 || cfg.replicas > cfg.units.len() {
            return Err(Error::InvalidRequest(format!(
                "replicas = {} for {} units: each copy needs a unit of its own (1 to {})",
                cfg.replicas,
                cfg.units.len(),
                cfg.units.len()
            )));
        }
        if !cfg.hosts.is_empty() && cfg.hosts.len() != cfg.units.len() {
            return Err(Error::InvalidRequest(format!(
                "{} hosts for {} units",
                cfg.hosts.len(),
                cfg.units.len()
            )));
        }
        let copies = copies::Copies::place(cfg.units.len(), cfg.replicas, &cfg.hosts);
        if copies.short_of_hosts > 0 {
            tracing::warn!(
                "replicas = {}: {} of {} units have copies on a host that holds another copy of the same rows (too few hosts); a host's loss may take every copy of their rows",
                cfg.replicas,
                copies.short_of_hosts,
                cfg.units.len()
            );
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
            .map(|(i, a)| UnitSlot::new(a.clone(), cfg.instances.get(i).copied().flatten()))
            .collect();
        metrics::warm_clock();
        let metrics = Arc::new(metrics::ClientMetrics::new(&cfg.units));
        metrics.copies(cfg.replicas, copies.short_of_hosts);
        let failpoints = cfg.failpoints;
        let nixl = cfg.nixl.map(|o| nixl::NixlClient::new(o, failpoints));
        // The agent (its UCX backend takes tens of milliseconds to make) is
        // made here, not by the first operation: a setup that cannot run
        // fails the connect, and no operation's deadline pays for it.
        if let Some(n) = &nixl {
            n.agent()
                .map_err(|e| Error::InvalidRequest(format!("nixl: {e}")))?;
        }
        let host = (cfg.replicas > 1 && cfg.hosts.iter().any(Option::is_some)).then(host_id);
        Ok(Client {
            cfg,
            units,
            metrics,
            nixl,
            copies,
            host,
            plane: Default::default(),
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
                Some(Err(f)) => return Err(self.unreached_error(u, f)),
                None => {}
            }
        }
        Ok(())
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

    /// The instance id unit `unit` answered with last (`None`: not reached
    /// yet, or found dead).
    pub fn instance_id(&self, unit: usize) -> Option<u128> {
        self.units.get(unit).and_then(|u| lock(&u.instance).current)
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
    use crate::pool::Lease;
    use std::time::Duration;

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
