//! # stowage-unit: the storage-unit server
//!
//! One unit process owns one [`stowage_shm::Slab`] (a memfd, mlocked where
//! the OS allows) and drives one [`stowage_core::UnitCore`] over it. It
//! serves the control protocol of `stowage-wire` on a Unix socket (where
//! clients also receive the slab's fd and copy bytes themselves) and on TCP
//! (loopback unless told otherwise; bytes are streamed between the socket
//! and the slab with no intermediate buffer).
//!
//! Threads: one accept loop per listener, one thread per connection
//! (blocking reads keep the request path to a single wake-up), and one
//! ticker that ends quarantines and checks whether the processes of cut
//! sessions have exited. The core sits behind
//! one mutex that is never held across I/O.
//!
//! A connection that sends a malformed or oversized frame gets an
//! `InvalidRequest` error and is closed; everyone else carries on.
//!
//! Fencing (see `stowage-core`): a connection belongs to a session (given
//! at Hello); what it reserves and pins is released when its peer closes
//! it, or — when the unit cut it (a frame that stalled past the frame
//! timeout, a transfer past its request's deadline, an invalid request) —
//! at once for a tcp peer (the unit's own thread did the copying and has
//! stopped), and for a Unix-socket peer (which maps the slab) only once
//! its process is gone (a pidfd taken from SO_PEERCRED at accept). No
//! timer ever frees a range that someone may still touch.
//!
//! Local security: the Unix socket's file is owner-only and the unit
//! accepts only its own uid (SO_PEERCRED) unless started with
//! `allow_other_uids`; admin requests (shutdown, checkpoint) need a
//! same-uid Unix-socket client or `admin_tcp`; checkpoints are written only
//! under `checkpoint_root`. Connections are capped per unit and per
//! session; a connection counts against the unit's cap only once it
//! proved itself, and waits until then in a small pool of its own with a
//! short deadline (`admit.rs`). A unit raises its own open-file limit
//! (`RLIMIT_NOFILE`, process-wide) to the hard limit at start.
//!
//! Authentication: a unit given a shared secret ([`UnitConfig::secret`])
//! serves a connection, on either listener, only after the client proved
//! the secret ([`auth`]); before that no session exists and no fd is
//! handed over. A unit refuses to listen on TCP beyond loopback without a
//! secret unless told [`UnitConfig::insecure`].

#![forbid(unsafe_code)]

mod admit;
pub mod auth;
mod checkpoint;
mod conn;
pub mod disk;
pub mod handler;
mod http;
pub mod metrics;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use disk::DiskEngine;
use stowage_core::{CoreConfig, UnitCore};
use stowage_shm::Slab;
use stowage_wire::io::Socket;
use stowage_wire::Limits;

/// Settings of one unit.
#[derive(Clone, Debug)]
pub struct UnitConfig {
    /// A name for logs and the memfd.
    pub name: String,
    /// Slab bytes.
    pub memory: u64,
    /// Unix socket path (shm transport and control). `None`: no Unix socket.
    pub uds: Option<PathBuf>,
    /// TCP address (tcp transport). Loopback unless the operator says
    /// otherwise. `None`: no TCP listener.
    pub tcp: Option<SocketAddr>,
    /// A reservation held longer is reported as overdue (never taken from
    /// its holder). Default 30 s.
    pub reservation_lease: Duration,
    /// A pin held longer is reported as overdue. Default 30 s.
    pub pin_lease: Duration,
    /// Quarantine of the range of a put stream the unit cut off. Default 5 s.
    pub quarantine: Duration,
    /// Frame limits.
    pub limits: Limits,
    /// Try to mlock the slab. Default true.
    pub mlock: bool,
    /// How long a connection thread polls for the next request before it
    /// blocks (adaptive polling: a blocking wake-up costs tens of µs on a
    /// VM; polling costs CPU while it lasts). Default 50 µs; zero disables
    /// it.
    pub spin: Duration,
    /// The disk tier: its root directory (the unit works in its own
    /// owner-only, locked subdirectory) and capacity. `None`: no disk tier.
    pub disk: Option<(PathBuf, u64)>,
    /// Spill past this fraction of the slab in use. Default 0.9.
    pub high_watermark: f64,
    /// Stop spilling below this fraction. Default 0.8.
    pub low_watermark: f64,
    /// Failpoints to turn on at start (`disk-write`), for tests.
    pub failpoints: Vec<String>,
    /// Load this checkpoint directory before serving.
    pub restore: Option<PathBuf>,
    /// Checkpoints are written only under this directory; `None`: the unit
    /// takes none.
    pub checkpoint_root: Option<PathBuf>,
    /// Accept Unix-socket clients of any uid (default: only this process's
    /// own uid).
    pub allow_other_uids: bool,
    /// Accept admin requests (shutdown, checkpoint) over TCP too (default:
    /// only from same-uid clients on the Unix socket).
    pub admin_tcp: bool,
    /// Once a frame has begun, the rest of it must arrive within this; a
    /// reply the peer does not take within it is cut off too. Default 10 s.
    pub frame_timeout: Duration,
    /// The longest a single transfer may stall when its request asks for
    /// more time. Default 10 min.
    pub max_io_timeout: Duration,
    /// Most connections served at once: connections that proved the
    /// shared secret (or, without one, said Hello). Default 1024.
    pub max_connections: usize,
    /// Most connections at once that have not proved themselves yet (see
    /// `admit.rs`): they never take a served connection's slot. Past it,
    /// a new connection cuts the oldest handshake of the source holding
    /// the most. Default 128.
    pub max_handshakes: usize,
    /// Most of those from one source (a local user: a Unix-socket peer or
    /// a loopback TCP peer; otherwise the peer's address, an IPv6 peer's
    /// /64): past it, a new connection from that source cuts its oldest
    /// handshake. Default 32.
    pub max_handshakes_per_source: usize,
    /// A connection must prove itself (the shared secret's proof and its
    /// Hello) within this of its accept, or it is cut. Default 1 s.
    pub handshake_timeout: Duration,
    /// Most connections of one session. Default 64.
    pub max_session_connections: usize,
    /// Most reservations and pins of one session. Default 16384.
    pub max_session_holds: usize,
    /// Bytes the key index may take; `None`: a quarter of the slab, at
    /// least 64 MiB.
    pub index_budget: Option<u64>,
    /// The shared secret every client must prove at connect, on every
    /// listener (see [`auth`]). `None`: clients connect without one.
    pub secret: Option<stowage_wire::auth::Secret>,
    /// Listen on TCP beyond loopback without a secret. Without it such a
    /// unit refuses to start.
    pub insecure: bool,
    /// Record metrics (request counts, latencies, bytes; see
    /// docs/metrics.md). Default true. Off, the unit records nothing on
    /// the request path, serves no metrics endpoint, and its stats carry
    /// no traffic counters.
    pub metrics: bool,
    /// Serve the metrics in the Prometheus text format on
    /// `http://ADDR/metrics`. Default `127.0.0.1:0` (loopback, any free
    /// port: [`UnitHandle::metrics`] tells which); `None`: no endpoint
    /// (the metrics are still recorded for stats).
    pub metrics_listen: Option<SocketAddr>,
    /// Serve one-sided NIXL transfers (docs/nixl.md): the slab is
    /// registered with a NIXL agent at start and clients that ask
    /// (`NixlInfo`) get its metadata. Needs a build with the `nixl`
    /// feature and libnixl_capi.so. `None` (default): no NIXL.
    pub nixl: Option<NixlConfig>,
}

/// How a unit serves NIXL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NixlConfig {
    /// Refuse to start unless UCX is held to RDMA transports (`UCX_TLS`;
    /// see [`stowage_nixl::check_rdma`]). Default true; off for tests and
    /// hosts without RDMA NICs, where UCX moves the bytes over tcp.
    pub require_rdma: bool,
}

impl Default for NixlConfig {
    fn default() -> Self {
        Self { require_rdma: true }
    }
}

/// A unit's NIXL side: its agent and registered slab.
pub(crate) struct NixlServe {
    pub(crate) metadata: Vec<u8>,
    pub(crate) slab_addr: u64,
    // Deregistered before the agent goes.
    _registration: stowage_nixl::SlabRegistration,
    _agent: stowage_nixl::Agent,
}

impl UnitConfig {
    pub fn new(name: impl Into<String>, memory: u64) -> Self {
        Self {
            name: name.into(),
            memory,
            uds: None,
            tcp: None,
            reservation_lease: Duration::from_secs(30),
            pin_lease: Duration::from_secs(30),
            quarantine: Duration::from_secs(5),
            limits: Limits::default(),
            mlock: true,
            spin: Duration::from_micros(50),
            disk: None,
            high_watermark: 0.9,
            low_watermark: 0.8,
            failpoints: Vec::new(),
            restore: None,
            checkpoint_root: None,
            allow_other_uids: false,
            admin_tcp: false,
            frame_timeout: Duration::from_secs(10),
            max_io_timeout: Duration::from_secs(600),
            max_connections: 1024,
            max_handshakes: 128,
            max_handshakes_per_source: 32,
            handshake_timeout: Duration::from_secs(1),
            max_session_connections: 64,
            max_session_holds: 16384,
            index_budget: None,
            secret: None,
            insecure: false,
            metrics: true,
            metrics_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            nixl: None,
        }
    }
}

/// A unit's disk tier at run time.
pub(crate) struct DiskTier {
    pub(crate) engine: disk::FileEngine,
    pub(crate) dir: disk::OwnedDir,
    /// Blob files whose bytes are written, waiting to be synced and
    /// published.
    pub(crate) flush:
        Mutex<std::sync::mpsc::Sender<(stowage_core::BlobId, Box<dyn disk::BlobWriter>)>>,
    /// Wakes the spiller.
    pub(crate) wake: (Mutex<bool>, std::sync::Condvar),
    /// Held by the spiller and the flusher while they write files, so that
    /// teardown removes the directory only once they are idle.
    pub(crate) busy: Mutex<()>,
    /// I/O counters reported in stats.
    pub(crate) io: DiskIo,
}

/// Disk tier I/O counters.
#[derive(Default)]
pub(crate) struct DiskIo {
    pub(crate) write_bytes: std::sync::atomic::AtomicU64,
    pub(crate) write_micros: std::sync::atomic::AtomicU64,
    pub(crate) read_bytes: std::sync::atomic::AtomicU64,
    pub(crate) read_micros: std::sync::atomic::AtomicU64,
}

impl DiskIo {
    pub(crate) fn wrote(&self, bytes: u64, since: Instant) {
        self.write_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.write_micros
            .fetch_add(since.elapsed().as_micros() as u64, Ordering::Relaxed);
    }

    pub(crate) fn read(&self, bytes: u64, since: Instant) {
        self.read_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.read_micros
            .fetch_add(since.elapsed().as_micros() as u64, Ordering::Relaxed);
    }
}

impl DiskTier {
    pub(crate) fn wake_spiller(&self) {
        let mut w = self.wake.0.lock().unwrap_or_else(|p| p.into_inner());
        *w = true;
        self.wake.1.notify_one();
    }
}

/// State shared by every thread of a unit.
pub(crate) struct Shared {
    pub(crate) core: Mutex<UnitCore>,
    pub(crate) slab: Arc<Slab>,
    /// NIXL, when the unit serves it.
    pub(crate) nixl: Option<NixlServe>,
    pub(crate) started: Instant,
    pub(crate) instance_id: u128,
    pub(crate) limits: Limits,
    pub(crate) stop: AtomicBool,
    pub(crate) spin: Duration,
    pub(crate) disk: Option<DiskTier>,
    /// Checkpoints being written.
    pub(crate) checkpoints: std::sync::atomic::AtomicUsize,
    /// Set when the unit is asked to exit.
    pub(crate) exit: (Mutex<bool>, std::sync::Condvar),
    /// This process's uid.
    pub(crate) uid: u32,
    pub(crate) allow_other_uids: bool,
    pub(crate) admin_tcp: bool,
    pub(crate) frame_timeout: Duration,
    pub(crate) max_io_timeout: Duration,
    pub(crate) checkpoint_root: Option<PathBuf>,
    pub(crate) max_connections: usize,
    /// Connections being served (past their handshake).
    pub(crate) connections: std::sync::atomic::AtomicUsize,
    /// Connections still in their handshake.
    pub(crate) handshakes: admit::Handshakes,
    pub(crate) handshake_timeout: Duration,
    /// The shared secret clients must prove, if any.
    pub(crate) secret: Option<stowage_wire::auth::Secret>,
    /// Sessions by the token given at Hello.
    pub(crate) sessions: Mutex<std::collections::HashMap<u128, SessionRec>>,
    /// The unit's name (logs, the metrics' `unit` label).
    pub(crate) name: String,
    /// The spill threshold, as a fraction of the slab.
    pub(crate) high_watermark: f64,
    /// What the request path records (`None`: metrics are off).
    pub(crate) metrics: Option<metrics::UnitMetrics>,
}

/// Create the unit's NIXL agent and register its slab with it.
fn serve_nixl(
    name: &str,
    instance_id: u128,
    slab: &Arc<Slab>,
    cfg: NixlConfig,
) -> Result<NixlServe, StartError> {
    let refuse = |e: stowage_nixl::NixlError| StartError::Config(format!("--nixl: {e}"));
    if cfg.require_rdma {
        stowage_nixl::check_rdma(std::env::var("UCX_TLS").ok().as_deref()).map_err(refuse)?;
    }
    // Agent names must differ among the agents that meet: the unit's
    // instance id makes a restarted unit a new agent.
    let agent = stowage_nixl::Agent::new(
        &format!("stowage-unit-{name}-{instance_id:032x}"),
        Some(stowage_nixl::UNIT_PROGRESS),
    )
    .map_err(refuse)?;
    let registration = agent.register_slab(slab.clone()).map_err(refuse)?;
    let metadata = agent.metadata().map_err(refuse)?;
    tracing::info!(
        unit = name,
        agent = agent.name(),
        metadata_bytes = metadata.len(),
        require_rdma = cfg.require_rdma,
        "serving nixl"
    );
    Ok(NixlServe {
        metadata,
        slab_addr: slab.addr() as u64,
        _registration: registration,
        _agent: agent,
    })
}

/// A session as the server knows it: its id in the core and, for a
/// Unix-socket peer, its process (to learn when it is certainly gone).
pub(crate) struct SessionRec {
    pub(crate) id: stowage_core::SessionId,
    pub(crate) pid: Option<i32>,
    pub(crate) pidfd: Option<std::os::fd::OwnedFd>,
    /// The slab was handed to this session: its peer may copy by itself.
    pub(crate) mapped: bool,
}

impl Shared {
    /// Join the session `token` names (when it still exists and, for a
    /// Unix-socket peer, belongs to the same process) or start a new one;
    /// attach a connection to it. Returns the session's token and the
    /// connection's owner id.
    pub(crate) fn join_session(
        &self,
        token: Option<u128>,
        peer: conn::Peer,
        maps: bool,
        namespace: &str,
    ) -> Result<(u128, stowage_core::Owner), stowage_core::CoreError> {
        let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        let mut core = self.core();
        // Forget sessions the core has forgotten.
        sessions.retain(|_, r| core.has_session(r.id));
        let joined = token.filter(|t| sessions.get(t).is_some_and(|r| r.pid == peer.pid));
        let token = match joined {
            Some(t) => t,
            None => {
                let mut b = [0u8; 16];
                getrandom::fill(&mut b)
                    .map_err(|e| stowage_core::CoreError::Invalid(e.to_string()))?;
                let token = u128::from_le_bytes(b);
                let id = core.open_session();
                if let Some(m) = &self.metrics {
                    m.session_opened();
                }
                tracing::info!(unit = %self.name, session = id.0, namespace, pid = ?peer.pid, maps, "session opened");
                sessions.insert(
                    token,
                    SessionRec {
                        id,
                        pid: peer.pid,
                        pidfd: None,
                        mapped: false,
                    },
                );
                token
            }
        };
        let Some(rec) = sessions.get_mut(&token) else {
            return Err(stowage_core::CoreError::Invalid("session vanished".into()));
        };
        if maps && rec.pidfd.is_none() {
            // Taken while the peer is connected, so the pid is its own.
            rec.pidfd = peer.pid.and_then(|pid| {
                let pid = rustix::process::Pid::from_raw(pid)?;
                rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
            });
            if rec.pidfd.is_none() {
                tracing::warn!(
                    pid = ?peer.pid,
                    "no pidfd for a client that maps the slab: if the unit cuts its connection, what it holds is kept until the unit stops"
                );
            }
        }
        rec.mapped |= maps;
        let direct = rec.mapped;
        let owner = core.attach(rec.id, direct)?;
        Ok((token, owner))
    }

    /// The peer of `owner`'s connection will touch the slab by itself (a
    /// nixl client): the connection and its session become direct, as a
    /// peer that was handed the memfd is.
    pub(crate) fn map_session(
        &self,
        owner: stowage_core::Owner,
        peer: conn::Peer,
    ) -> Result<(), stowage_core::CoreError> {
        let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        let Some(rec) = sessions.values_mut().find(|r| r.id == owner.session) else {
            return Err(stowage_core::CoreError::Invalid("session vanished".into()));
        };
        if rec.pidfd.is_none() {
            rec.pidfd = peer.pid.and_then(|pid| {
                let pid = rustix::process::Pid::from_raw(pid)?;
                rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
            });
        }
        rec.mapped = true;
        self.core().make_direct(owner)
    }

    /// End the sessions whose connections were all cut and whose process
    /// has exited: nothing of them can touch the slab any more.
    pub(crate) fn reap_sessions(&self) {
        let orphaned = self.core().orphaned_sessions();
        if orphaned.is_empty() {
            return;
        }
        let gone: Vec<stowage_core::SessionId> = {
            let sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
            sessions
                .values()
                .filter(|r| orphaned.contains(&r.id))
                .filter(|r| r.pidfd.as_ref().is_some_and(process_exited))
                .map(|r| r.id)
                .collect()
        };
        if gone.is_empty() {
            return;
        }
        let now = self.now();
        let mut core = self.core();
        for id in gone {
            let holds = core.session_gone(id, now);
            if let Some(m) = &self.metrics {
                m.reclaimed(metrics::Reclaim::ProcessExited, holds);
            }
            tracing::info!(
                unit = %self.name,
                session = id.0,
                holds,
                "session closed: a cut session's process exited; released what it held"
            );
        }
    }

    /// The core's counters, with the server's disk I/O counters.
    pub(crate) fn stats(&self) -> stowage_core::Stats {
        let now = self.now();
        let mut s = self.core().stats_at(now);
        if let Some(d) = &self.disk {
            s.disk_write_bytes = d.io.write_bytes.load(Ordering::Relaxed);
            s.disk_write_micros = d.io.write_micros.load(Ordering::Relaxed);
            s.disk_read_bytes = d.io.read_bytes.load(Ordering::Relaxed);
            s.disk_read_micros = d.io.read_micros.load(Ordering::Relaxed);
        }
        if let Some(m) = &self.metrics {
            (s.ops, s.bytes_in, s.bytes_out) = m.traffic();
            s.busy = m.busy_total();
        }
        s.serves_nixl = self.nixl.is_some();
        s
    }

    pub(crate) fn request_exit(&self) {
        let mut e = self.exit.0.lock().unwrap_or_else(|p| p.into_inner());
        *e = true;
        self.exit.1.notify_all();
    }

    /// Stop within `timeout`: refuse new work, let a checkpoint in progress
    /// finish or abandon it, remove the disk directory. Returns what could
    /// not be done.
    pub(crate) fn shut_down(&self, timeout: Duration) -> Vec<String> {
        let mut problems = Vec::new();
        self.stop.store(true, Ordering::SeqCst);
        let end = Instant::now() + timeout;
        while self.checkpoints.load(Ordering::SeqCst) > 0 {
            if Instant::now() >= end {
                problems.push("a checkpoint was still being written at the deadline".into());
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Some(d) = &self.disk {
            // Wait for the spiller and the flusher to put their pens down.
            let idle = loop {
                match d.busy.try_lock() {
                    Ok(g) => break Some(g),
                    Err(std::sync::TryLockError::Poisoned(p)) => break Some(p.into_inner()),
                    Err(std::sync::TryLockError::WouldBlock) if Instant::now() < end => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Err(std::sync::TryLockError::WouldBlock) => break None,
                }
            };
            if idle.is_none() {
                problems.push("a disk write was still running at the deadline".into());
            }
            let mut last = None;
            for _ in 0..5 {
                match d.dir.path.exists().then(|| d.dir.remove()) {
                    None | Some(Ok(())) => {
                        last = None;
                        break;
                    }
                    // A connection may have just created a file: try again.
                    Some(Err(e)) => {
                        last = Some(e);
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            if let Some(e) = last {
                problems.push(format!("could not remove {}: {e}", d.dir.path.display()));
            }
        }
        problems
    }
}

/// Whether the process of a pidfd has exited (the pidfd is readable).
fn process_exited(fd: &std::os::fd::OwnedFd) -> bool {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(fd, PollFlags::IN)];
    matches!(poll(&mut fds, Some(&rustix::event::Timespec::default())), Ok(n) if n > 0)
}

/// The core, locked. On release it applies the core's effects (removes
/// the files of freed blobs) and wakes the spiller when the slab is past
/// its high watermark — outside the lock.
pub(crate) struct CoreGuard<'a> {
    guard: Option<MutexGuard<'a, UnitCore>>,
    shared: &'a Shared,
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = UnitCore;
    fn deref(&self) -> &UnitCore {
        self.guard.as_deref().expect("the guard is held until drop")
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut UnitCore {
        self.guard
            .as_deref_mut()
            .expect("the guard is held until drop")
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        let Some(mut g) = self.guard.take() else {
            return;
        };
        let effects = g.take_effects();
        let spill = g.needs_spill();
        drop(g);
        if let Some(d) = &self.shared.disk {
            for e in effects {
                match e {
                    stowage_core::Effect::DeleteFile(blob) => {
                        if let Err(err) = d.engine.delete(blob) {
                            tracing::warn!(error = %err, ?blob, "could not remove a blob file");
                        }
                    }
                }
            }
            if spill {
                d.wake_spiller();
            }
        }
    }
}

impl Shared {
    pub(crate) fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// The core. A thread that panicked while holding the lock cannot have
    /// left the core half-updated in a way later calls rely on less than on
    /// the unit staying up, so a poisoned lock is taken over.
    pub(crate) fn core(&self) -> CoreGuard<'_> {
        CoreGuard {
            guard: Some(self.core.lock().unwrap_or_else(|p| p.into_inner())),
            shared: self,
        }
    }
}

/// A running unit (its threads run until the process exits or
/// [`UnitHandle::stop`]).
pub struct UnitHandle {
    shared: Arc<Shared>,
    /// The bound Unix socket path.
    pub uds: Option<PathBuf>,
    /// The bound TCP address (with the real port when 0 was asked).
    pub tcp: Option<SocketAddr>,
    /// The metrics endpoint's address (`http://ADDR/metrics`).
    pub metrics: Option<SocketAddr>,
    registry: Option<Arc<prometheus_client::registry::Registry>>,
}

impl UnitHandle {
    pub fn instance_id(&self) -> u128 {
        self.shared.instance_id
    }

    /// The unit's metrics in the Prometheus text format, as its endpoint
    /// serves them (`None`: metrics are off).
    pub fn metrics_text(&self) -> Option<String> {
        self.registry.as_deref().map(metrics::render)
    }

    /// Block until the unit is asked to exit (a Shutdown request, or
    /// [`UnitHandle::request_exit`]).
    pub fn wait_for_exit(&self) {
        let mut e = self.shared.exit.0.lock().unwrap_or_else(|p| p.into_inner());
        while !*e {
            e = self
                .shared
                .exit
                .1
                .wait(e)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    pub fn request_exit(&self) {
        self.shared.request_exit();
    }

    /// Stop accepting and remove the socket file. Connections already open
    /// end when their clients close them.
    pub fn stop(&self) {
        for p in self.shared.shut_down(Duration::from_secs(10)) {
            tracing::warn!(problem = %p, "shutting down");
        }
        if let Some(p) = &self.uds {
            let _ = std::fs::remove_file(p);
            // Wake the accept loop so it sees the flag.
            let _ = UnixStream::connect(p);
        }
        for a in self.tcp.iter().chain(&self.metrics) {
            let _ = std::net::TcpStream::connect_timeout(a, Duration::from_millis(100));
        }
        tracing::info!(unit = %self.shared.name, "unit stopped");
    }
}

/// Why a unit could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("creating the slab: {0}")]
    Slab(io::Error),
    #[error("binding {what}: {err}")]
    Bind { what: String, err: io::Error },
    #[error("{0}")]
    Restore(String),
}

/// Create the slab, bind the listeners and start serving.
pub fn start(cfg: UnitConfig) -> Result<UnitHandle, StartError> {
    if cfg.uds.is_none() && cfg.tcp.is_none() {
        return Err(StartError::Config(
            "no listener: give a Unix socket path or a TCP address".into(),
        ));
    }
    if let Some(addr) = cfg.tcp.filter(|a| !is_loopback(a)) {
        if cfg.secret.is_none() {
            if !cfg.insecure {
                return Err(StartError::Config(format!(
                    "refusing to listen on {addr}, beyond loopback, without a shared secret: \
                     anyone who reaches it could read and clear every value. Set STOWAGE_SECRET \
                     or --secret-file, or pass --insecure to serve without one"
                )));
            }
            tracing::warn!(%addr, "listening beyond loopback without a shared secret (--insecure): anyone who reaches this address can read and change every value");
        }
    }
    admit::raise_nofile(
        &cfg.name,
        admit::fds_needed(cfg.max_connections, cfg.max_handshakes),
    );
    let mut core_cfg = CoreConfig::new(cfg.memory);
    if let Some(b) = cfg.index_budget {
        core_cfg.index_budget = b;
    }
    core_cfg.max_session_conns = cfg.max_session_connections.max(1);
    core_cfg.max_session_holds = cfg.max_session_holds.max(1);
    let mut key = [0u8; 16];
    getrandom::fill(&mut key).map_err(|e| StartError::Slab(io::Error::other(e.to_string())))?;
    core_cfg.id_key = (
        u64::from_le_bytes(key[..8].try_into().unwrap_or_default()),
        u64::from_le_bytes(key[8..].try_into().unwrap_or_default()),
    );
    core_cfg.reservation_lease = cfg.reservation_lease;
    core_cfg.pin_lease = cfg.pin_lease;
    core_cfg.quarantine = cfg.quarantine;
    core_cfg.high_watermark = cfg.high_watermark;
    core_cfg.low_watermark = cfg.low_watermark;
    core_cfg.disk_capacity = cfg.disk.as_ref().map_or(0, |(_, c)| *c);
    let core = UnitCore::new(core_cfg).map_err(|e| StartError::Config(e.to_string()))?;
    if cfg.memory < 4096 {
        return Err(StartError::Config("memory must be at least 4 KiB".into()));
    }
    let slab = Arc::new(
        Slab::create(&format!("stowage-{}", cfg.name), cfg.memory).map_err(StartError::Slab)?,
    );
    let mut id = [0u8; 16];
    getrandom::fill(&mut id).map_err(|e| StartError::Slab(io::Error::other(e.to_string())))?;
    let instance_id = u128::from_le_bytes(id);
    let nixl = match cfg.nixl {
        None => None,
        Some(n) => Some(serve_nixl(&cfg.name, instance_id, &slab, n)?),
    };
    let (disk, flush_rx) = match &cfg.disk {
        None => (None, None),
        Some((root, capacity)) => {
            let (dir, removed) =
                disk::OwnedDir::create(root, &cfg.name, instance_id).map_err(|err| {
                    StartError::Bind {
                        what: format!("disk tier directory under {}", root.display()),
                        err,
                    }
                })?;
            for r in removed {
                tracing::info!(dir = %r.display(), "removed the disk directory of a unit that is gone");
            }
            tracing::info!(dir = %dir.path.display(), capacity, "disk tier");
            let engine = disk::FileEngine::new(dir.path.clone());
            for f in &cfg.failpoints {
                engine.failpoints.enable(f).map_err(StartError::Config)?;
            }
            let (tx, rx) = std::sync::mpsc::channel();
            (
                Some(DiskTier {
                    engine,
                    dir,
                    flush: Mutex::new(tx),
                    wake: (Mutex::new(false), std::sync::Condvar::new()),
                    busy: Mutex::new(()),
                    io: DiskIo::default(),
                }),
                Some(rx),
            )
        }
    };
    if disk.is_none() && !cfg.failpoints.is_empty() {
        return Err(StartError::Config("failpoints need a disk tier".into()));
    }
    let shared = Arc::new(Shared {
        core: Mutex::new(core),
        slab,
        nixl,
        started: Instant::now(),
        instance_id,
        limits: cfg.limits,
        stop: AtomicBool::new(false),
        spin: cfg.spin,
        disk,
        checkpoints: std::sync::atomic::AtomicUsize::new(0),
        exit: (Mutex::new(false), std::sync::Condvar::new()),
        uid: rustix::process::getuid().as_raw(),
        allow_other_uids: cfg.allow_other_uids,
        admin_tcp: cfg.admin_tcp,
        frame_timeout: cfg.frame_timeout,
        max_io_timeout: cfg.max_io_timeout,
        checkpoint_root: cfg.checkpoint_root.clone(),
        max_connections: cfg.max_connections.max(1),
        connections: std::sync::atomic::AtomicUsize::new(0),
        handshakes: admit::Handshakes::new(cfg.max_handshakes, cfg.max_handshakes_per_source),
        handshake_timeout: cfg.handshake_timeout,
        secret: cfg.secret.clone(),
        sessions: Mutex::new(std::collections::HashMap::new()),
        name: cfg.name.clone(),
        high_watermark: cfg.high_watermark,
        metrics: cfg.metrics.then(metrics::UnitMetrics::default),
    });
    if let Some(dir) = &cfg.restore {
        let info =
            checkpoint::restore(&shared, dir).map_err(|e| StartError::Restore(e.to_string()))?;
        tracing::info!(
            dir = %dir.display(),
            rows = info.rows,
            entries = info.entries,
            bytes = info.bytes,
            "restored a checkpoint"
        );
    }
    {
        // The slab's pages are faulted in (and mlocked) in the background:
        // the unit serves at once, and first-touch costs move off the
        // start (a 4 GiB slab took 2 s to lock here).
        let weak = Arc::downgrade(&shared);
        let (name, lock) = (cfg.name.clone(), cfg.mlock);
        std::thread::Builder::new()
            .name("slab-fault".into())
            .spawn(move || fault_in_slab(weak, &name, lock))
            .map_err(StartError::Slab)?;
    }
    if let Some(rx) = flush_rx {
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("flusher".into())
            .spawn(move || flusher(sh, rx))
            .map_err(StartError::Slab)?;
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("spiller".into())
            .spawn(move || spiller(sh))
            .map_err(StartError::Slab)?;
    }

    let mut handle = UnitHandle {
        shared: shared.clone(),
        uds: None,
        tcp: None,
        metrics: None,
        registry: None,
    };
    if cfg.metrics {
        let registry = Arc::new(metrics::registry(&shared, &cfg.name));
        if let Some(addr) = cfg.metrics_listen {
            let l = http::bind(addr).map_err(|err| StartError::Bind {
                what: format!("metrics endpoint {addr}"),
                err,
            })?;
            handle.metrics = Some(l.local_addr().map_err(StartError::Slab)?);
            let (sh, r) = (shared.clone(), registry.clone());
            std::thread::Builder::new()
                .name("metrics-accept".into())
                .spawn(move || http::accept(sh, l, r))
                .map_err(StartError::Slab)?;
        }
        handle.registry = Some(registry);
    }
    if let Some(path) = &cfg.uds {
        let l = bind_uds(path, cfg.allow_other_uids).map_err(|err| StartError::Bind {
            what: path.display().to_string(),
            err,
        })?;
        handle.uds = Some(path.clone());
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("uds-accept".into())
            .spawn(move || accept_uds(sh, l))
            .map_err(StartError::Slab)?;
    }
    if let Some(addr) = cfg.tcp {
        let l = admit::bind_tcp(addr).map_err(|err| StartError::Bind {
            what: addr.to_string(),
            err,
        })?;
        handle.tcp = Some(l.local_addr().map_err(StartError::Slab)?);
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("tcp-accept".into())
            .spawn(move || accept_tcp(sh, l))
            .map_err(StartError::Slab)?;
    }
    let sh = shared.clone();
    std::thread::Builder::new()
        .name("ticker".into())
        .spawn(move || {
            let mut n = 0u64;
            while !sh.stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(20));
                let now = sh.now();
                sh.core().tick(now);
                n += 1;
                if n.is_multiple_of(10) {
                    sh.reap_sessions();
                }
            }
        })
        .map_err(StartError::Slab)?;
    tracing::info!(
        unit = %cfg.name,
        memory = cfg.memory,
        uds = ?handle.uds,
        tcp = ?handle.tcp,
        metrics = ?handle.metrics,
        shared_secret = cfg.secret.is_some(),
        instance = format!("{:032x}", shared.instance_id),
        "unit serving"
    );
    Ok(handle)
}

/// Whether `addr` is a loopback address (127.0.0.0/8, ::1, or an IPv4
/// loopback address mapped into IPv6).
pub fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}

/// Sync and publish blob files written by connections (puts that went to
/// disk), in order.
fn flusher(
    shared: Arc<Shared>,
    rx: std::sync::mpsc::Receiver<(stowage_core::BlobId, Box<dyn disk::BlobWriter>)>,
) {
    while let Ok((blob, writer)) = rx.recv() {
        let Some(d) = &shared.disk else { return };
        let _busy = d.busy.lock().unwrap_or_else(|p| p.into_inner());
        let ok = match writer.finish() {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(error = %e, ?blob, "a put's blob file could not be made durable");
                false
            }
        };
        shared.core().disk_written(blob, ok);
    }
}

/// Bytes of the slab faulted in (or locked) per step of [`fault_in_slab`].
const FAULT_CHUNK: u64 = 64 << 20;

/// Fault in the whole slab, a chunk at a time, pinning it with `lock`
/// where the process may (else only faulting it in); stops when the unit
/// stops. Contents never change, so this runs while clients use the slab.
fn fault_in_slab(shared: std::sync::Weak<Shared>, name: &str, lock: bool) {
    let started = Instant::now();
    let mut lock = lock;
    let mut offset = 0;
    loop {
        let Some(sh) = shared.upgrade() else { return };
        if sh.stop.load(Ordering::Relaxed) {
            return;
        }
        let len = sh.slab.len();
        if offset >= len {
            break;
        }
        if let Err(e) = sh.slab.fault_in(offset, FAULT_CHUNK, lock) {
            if lock {
                tracing::warn!(
                    unit = %name,
                    error = %e,
                    "could not mlock the slab (raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK); running unlocked"
                );
                lock = false;
                continue;
            }
            // No MADV_POPULATE_WRITE (kernel before 5.14): pages fault in
            // on first touch instead.
            tracing::debug!(unit = %name, error = %e, "cannot fault the slab in ahead");
            return;
        }
        offset += FAULT_CHUNK;
    }
    tracing::info!(
        unit = %name,
        locked = lock,
        seconds = started.elapsed().as_secs_f64(),
        "slab faulted in"
    );
}

/// Copy blobs to disk while the slab is past its high watermark.
fn spiller(shared: Arc<Shared>) {
    let Some(d) = &shared.disk else { return };
    let mut failing = false;
    while !shared.stop.load(Ordering::Relaxed) {
        {
            let w = d.wake.0.lock().unwrap_or_else(|p| p.into_inner());
            let (mut w, _) = d
                .wake
                .1
                .wait_timeout_while(w, Duration::from_millis(100), |woken| !*woken)
                .unwrap_or_else(|p| p.into_inner());
            *w = false;
        }
        let _busy = d.busy.lock().unwrap_or_else(|p| p.into_inner());
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let jobs = shared.core().spill_jobs();
        let batch_start = Instant::now();
        let (n_jobs, mut spilled) = (jobs.len(), 0u64);
        for job in jobs {
            let t0 = Instant::now();
            // The core keeps the range allocated until disk_written, even
            // if the blob is freed meanwhile: this thread reads it alone.
            let written = d.engine.create(job.blob, job.nbytes).and_then(|mut w| {
                shared
                    .slab
                    .copy_out_chunked(job.offset, job.nbytes as usize, COPY_CHUNK, |c| w.write(c))
                    .map_err(std::io::Error::other)??;
                w.finish()
            });
            match &written {
                Ok(_) => {
                    d.io.wrote(job.nbytes, t0);
                    spilled += job.nbytes;
                    if let Some(m) = &shared.metrics {
                        m.spilled_bytes.fetch_add(job.nbytes, Ordering::Relaxed);
                    }
                    failing = false
                }
                Err(e) if !failing => {
                    tracing::warn!(error = %e, "spilling to disk failed; data stays in memory");
                    failing = true;
                }
                Err(_) => {}
            }
            shared.core().disk_written(job.blob, written.is_ok());
        }
        if n_jobs > 0 {
            if let Some(m) = &shared.metrics {
                m.spill_batches.fetch_add(1, Ordering::Relaxed);
            }
            tracing::info!(
                unit = %shared.name,
                blobs = n_jobs,
                bytes = spilled,
                seconds = batch_start.elapsed().as_secs_f64(),
                "spill batch"
            );
        }
        if failing {
            // Do not spin on a failing disk.
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Bind a Unix socket, replacing a stale socket file (one nobody listens
/// on) but never a live unit's.
fn bind_uds(path: &Path, allow_other_uids: bool) -> io::Result<UnixListener> {
    let l = bind_uds_file(path)?;
    // Only the owner may connect (unless other users are let in).
    let mode = if allow_other_uids { 0o666 } else { 0o600 };
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))?;
    Ok(l)
}

fn bind_uds_file(path: &Path) -> io::Result<UnixListener> {
    match UnixListener::bind(path) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            if UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "another unit is serving on this socket",
                ));
            }
            std::fs::remove_file(path)?;
            UnixListener::bind(path)
        }
        Err(e) => Err(e),
    }
}

/// Refuse a connection before serving it: one error frame, then close.
fn turn_away(mut s: impl io::Write, code: stowage_wire::ErrorCode, message: &str) {
    let mut out = Vec::new();
    let r = stowage_wire::Response::Error {
        code,
        message: message.to_owned(),
    };
    if stowage_wire::encode(0, &r, 0, &mut out).is_ok() {
        let _ = s.write_all(&out);
    }
}

/// Count a connection while it is served (past its handshake).
pub(crate) struct Counted(Arc<Shared>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Shared {
    /// The connection of `ticket` proved itself: it leaves the handshake
    /// pool and takes a served connection's slot. `Err`: the Busy answer
    /// it gets instead (its handshake was cut meanwhile, or the unit
    /// serves `max_connections` already).
    pub(crate) fn prove(self: &Arc<Self>, ticket: &admit::Ticket) -> Result<Counted, String> {
        if !self.handshakes.prove(ticket) {
            return Err(self.cut_message(ticket));
        }
        if self.connections.fetch_add(1, Ordering::SeqCst) >= self.max_connections {
            self.connections.fetch_sub(1, Ordering::SeqCst);
            if let Some(m) = &self.metrics {
                m.turned_away();
            }
            return Err(format!(
                "the unit has too many connections ({}, its --max-connections); try again later",
                self.max_connections
            ));
        }
        Ok(Counted(self.clone()))
    }

    /// What a connection whose handshake was cut is told.
    pub(crate) fn cut_message(&self, ticket: &admit::Ticket) -> String {
        match ticket.cut() {
            Some(admit::Cut::Source) => format!(
                "too many connections waiting for their handshake from {} ({}, the unit's \
                 --max-handshakes-per-source): the oldest was cut; try again",
                ticket.source, self.handshakes.per_source
            ),
            _ => format!(
                "too many connections waiting for their handshake ({}, the unit's \
                 --max-handshakes): the oldest of the source holding the most was cut; try again",
                self.handshakes.max
            ),
        }
    }
}

/// Serve `stream` on its own thread. It waits in the handshake pool
/// until it proves itself (see `admit.rs`): taking its place there may
/// cut the oldest handshake of its source, or of the source holding the
/// most.
fn spawn_conn(
    shared: &Arc<Shared>,
    stream: Socket,
    peer: conn::Peer,
    source: admit::Source,
    name: &str,
) {
    let Some((ticket, cut)) = shared.handshakes.admit(shared, source, &stream) else {
        tracing::warn!(%source, "out of file descriptors: a connection was turned away");
        if let Some(m) = &shared.metrics {
            m.turned_away();
        }
        return;
    };
    if let Some((why, from)) = cut {
        if let Some(m) = &shared.metrics {
            m.handshake_cut(why);
        }
        tracing::debug!(source = %from, reason = ?why, "cut a handshake to admit a new connection");
    }
    let sh = shared.clone();
    let accepted = Instant::now();
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || conn::serve(sh, stream, peer, ticket, accepted));
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start a connection thread");
    }
}

fn accept_uds(shared: Arc<Shared>, l: UnixListener) {
    for stream in l.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        match stream {
            Ok(s) => {
                let cred = rustix::net::sockopt::socket_peercred(&s).ok();
                let peer = conn::Peer {
                    uid: cred.map(|c| c.uid.as_raw()),
                    pid: cred.map(|c| c.pid.as_raw_nonzero().get()),
                };
                if !shared.allow_other_uids && peer.uid != Some(shared.uid) {
                    tracing::warn!(uid = ?peer.uid, pid = ?peer.pid, "refused a client of another user");
                    let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
                    turn_away(
                        s,
                        stowage_wire::ErrorCode::Unauthorized,
                        "this unit accepts only its own user's clients",
                    );
                    continue;
                }
                // Same-user peers prove themselves too before they are
                // served; a peer without credentials counts as one user.
                let source = admit::Source::Uid(peer.uid.unwrap_or(u32::MAX));
                spawn_conn(&shared, Socket::Unix(s), peer, source, "conn-uds");
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept on the Unix socket failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn accept_tcp(shared: Arc<Shared>, l: TcpListener) {
    let local = l.local_addr().ok();
    for stream in l.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        match stream {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                let source = match s.peer_addr() {
                    // The accepted socket's own address: a listener on
                    // 0.0.0.0 answers on the address the peer dialled.
                    Ok(p) => admit::Source::of_tcp(p, s.local_addr().ok().or(local)),
                    Err(_) => continue, // already gone
                };
                spawn_conn(
                    &shared,
                    Socket::Tcp(s),
                    conn::Peer::default(),
                    source,
                    "conn-tcp",
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept on TCP failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// A found value as a connection serves it.
pub(crate) enum Served {
    /// In the slab (possibly just brought back from disk).
    Memory(stowage_core::Location, Vec<u8>),
    /// Only on disk: `offset` into the blob. With `load`, its bytes are in
    /// the buffers [`Shared::bring_back`] returns, under (blob, offset,
    /// len).
    Disk {
        blob: stowage_core::BlobId,
        offset: u64,
        len: u64,
        meta: Vec<u8>,
    },
    /// Its blob's file failed its checksum or could not be read.
    Corrupt,
}

/// Values read from the disk tier, by (blob, offset, len).
pub(crate) type DiskBuffers = std::collections::HashMap<(stowage_core::BlobId, u64, u64), Vec<u8>>;

/// Pieces of a slab range copied through the heap at a time (disk tier
/// and checkpoint I/O).
const COPY_CHUNK: usize = 1 << 20;

impl Shared {
    /// Bring spilled values back for a reader that pinned them: each
    /// spilled blob is promoted into the slab where there is room below
    /// the high watermark; otherwise, with `load`, only the values asked
    /// for are read from its file (checked chunk by chunk).
    pub(crate) fn bring_back(
        &self,
        found: Vec<Option<stowage_core::Located>>,
        load: bool,
    ) -> (Vec<Option<Served>>, DiskBuffers) {
        use std::collections::{BTreeMap, HashMap, HashSet};
        use stowage_core::{Location, Place};
        // Each spilled blob, with the ranges of it that were asked for.
        let mut on_disk: BTreeMap<stowage_core::BlobId, Vec<(u64, u64)>> = BTreeMap::new();
        for (p, _) in found.iter().flatten() {
            if let Place::Disk { blob, offset, len } = p {
                on_disk.entry(*blob).or_default().push((*offset, *len));
            }
        }
        let mut promoted = HashMap::new();
        let mut corrupt = HashSet::new();
        let mut buffers = DiskBuffers::new();
        for (blob, wanted) in on_disk {
            let Some(d) = &self.disk else {
                corrupt.insert(blob);
                continue;
            };
            let (slot, size) = {
                let mut c = self.core();
                let size = c.blob_size(blob);
                (c.promote_begin(blob), size)
            };
            let Some(size) = size.and_then(|s| usize::try_from(s).ok()) else {
                corrupt.insert(blob);
                continue;
            };
            let t0 = Instant::now();
            let read = match slot {
                Some(offset) => {
                    // This thread alone writes the promotion's range: the
                    // core keeps it allocated until promote_done.
                    let r = self
                        .slab
                        .copy_in_chunked(offset, size, COPY_CHUNK, |at, buf| {
                            d.engine.read_at(blob, at, buf)
                        })
                        .map_err(|e| disk::DiskError::Io(std::io::Error::other(e)))
                        .and_then(|r| r);
                    self.core().promote_done(blob, r.is_ok());
                    if r.is_ok() {
                        promoted.insert(blob, offset);
                        if let Some(m) = &self.metrics {
                            m.promoted_bytes.fetch_add(size as u64, Ordering::Relaxed);
                        }
                    }
                    r.map(|()| size as u64)
                }
                None if load => {
                    let mut bytes = 0;
                    let mut r = Ok(());
                    for (offset, len) in wanted {
                        if buffers.contains_key(&(blob, offset, len)) {
                            continue;
                        }
                        let mut buf = vec![0u8; len as usize];
                        r = d.engine.read_at(blob, offset, &mut buf);
                        if r.is_err() {
                            break;
                        }
                        bytes += len;
                        if let Some(m) = &self.metrics {
                            m.disk_streamed_bytes.fetch_add(len, Ordering::Relaxed);
                        }
                        buffers.insert((blob, offset, len), buf);
                    }
                    r.map(|()| bytes)
                }
                None => Ok(0),
            };
            match read {
                Ok(0) => {}
                Ok(n) => d.io.read(n, t0),
                Err(e) => {
                    tracing::error!(error = %e, ?blob, "a spilled blob could not be read back; its keys fail");
                    corrupt.insert(blob);
                }
            }
        }
        let served = found
            .into_iter()
            .map(|f| {
                f.map(|(place, meta)| match place {
                    Place::Memory(l) => Served::Memory(l, meta),
                    Place::Disk { blob, .. } if corrupt.contains(&blob) => Served::Corrupt,
                    Place::Disk { blob, offset, len } => match promoted.get(&blob) {
                        Some(base) => Served::Memory(
                            Location {
                                offset: base + offset,
                                len,
                            },
                            meta,
                        ),
                        None => Served::Disk {
                            blob,
                            offset,
                            len,
                            meta,
                        },
                    },
                })
            })
            .collect();
        (served, buffers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_addresses_count_as_loopback() {
        for a in [
            "127.0.0.1:1",
            "127.8.9.10:1",
            "[::1]:1",
            "[::ffff:127.0.0.1]:1",
        ] {
            assert!(is_loopback(&a.parse().unwrap()), "{a}");
        }
        for a in ["0.0.0.0:1", "10.0.0.1:1", "[::]:1", "[::ffff:10.0.0.1]:1"] {
            assert!(!is_loopback(&a.parse().unwrap()), "{a}");
        }
    }

    #[test]
    fn a_unit_beyond_loopback_needs_a_secret_or_insecure() {
        let mut cfg = UnitConfig::new("t", 1 << 20);
        cfg.mlock = false;
        cfg.tcp = Some("0.0.0.0:0".parse().unwrap());
        let e = start(cfg.clone()).err().expect("refused");
        assert!(e.to_string().contains("--insecure"), "{e}");
        cfg.secret = Some(stowage_wire::auth::Secret::from_bytes(*b"0123456789abcdef").unwrap());
        start(cfg.clone()).expect("with a secret").stop();
        cfg.secret = None;
        cfg.insecure = true;
        start(cfg).expect("with --insecure").stop();
    }
}
