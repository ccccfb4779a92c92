//! # stowage-unit: the storage-unit server
//!
//! One unit process owns one [`stowage_shm::Slab`] (a memfd, mlocked where
//! the OS allows) and drives one [`stowage_core::UnitCore`] over it. It
//! serves the control protocol of `stowage-wire` on a Unix socket (where
//! clients also receive the slab's fd and copy bytes themselves) and on TCP
//! (loopback unless told otherwise; bytes are streamed between the socket
//! and the slab with no intermediate buffer).
//!
//! Threads: one accept loop per listener (`listen.rs`); the reactor
//! (`reactor.rs`): `--threads` workers that each wait on readiness events
//! for their share of the connections and serve the whole frames a
//! connection has without blocking (`conn.rs` moves the bytes and
//! serves a same-host client's request ring, `conn/ring.rs` makes it,
//! `handler.rs` plans each request against the core), and a bounded pool
//! (`--io-threads`) that carries out the steps that block; and the core's
//! driver (`drive.rs`): a timer that sleeps until the core's
//! `poll_timeout` and watches the processes of cut sessions, a spiller, a
//! flusher and a compactor. The core sits behind one mutex that is never
//! held across I/O; every release of it runs the core's pending actions.
//! `Shared` is the unit's parts, each owning its state (settings, the
//! core's driver, the session registry, connections, the disk tier,
//! checkpoints, metrics, lifecycle); see docs/architecture.md.
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
//! its process is gone (a pidfd taken from SO_PEERCRED at accept). A nixl
//! peer's holds outlive its connection's end, however it ends (a network
//! can close it while the peer's one-sided transfers run), until the unit
//! has invalidated the peer's NIXL agent (once the agent's last
//! connection ended) and `--nixl-quarantine` has then passed, or the
//! process is known gone. No other timer ever frees a range that someone
//! may still touch.
//!
//! Local security: the Unix socket's file is owner-only and the unit
//! accepts only its own uid (SO_PEERCRED) unless started with
//! `allow_other_uids`; admin requests (shutdown, checkpoint) need a
//! same-uid Unix-socket client or `admin_tcp`, and checkpoint requests
//! (checkpoint, restores: `restore.rs`) are also taken from any client of a
//! unit with a shared secret (every connection it serves proved it);
//! checkpoints are written and read back only under `checkpoint_root`. Connections are capped per unit and per
//! session; a connection counts against the unit's cap only once it
//! proved itself, and waits until then in a small pool of its own with a
//! short deadline (`admit.rs`). A unit raises its own open-file limit
//! (`RLIMIT_NOFILE`, process-wide) to the hard limit at start.
//!
//! Authentication: a unit given a shared secret ([`UnitConfig::secret`])
//! serves a connection, on either listener, only after the client proved
//! the secret ([`auth`]); before that no session exists and no fd is
//! handed over. A unit refuses to listen on TCP (loopback included: every
//! local user reaches it) without a secret unless told
//! [`UnitConfig::insecure`].

#![forbid(unsafe_code)]

// Layered (docs/architecture.md, "The unit server"): every import
// points down — the serving modules (listen, reactor, conn, restore,
// checkpoint, drive, http) above `shared`, which ties together the parts
// owned by the modules below it.
// Serving:
mod checkpoint;
mod conn;
mod drive;
mod http;
mod listen;
mod reactor;
mod restore;
// The parts, tied together:
mod shared;
// Owners and leaves:
mod admit;
pub mod auth;
mod budget;
mod claims;
pub mod disk;
mod driver;
mod error;
mod forward;
pub mod handler;
pub mod metrics;
mod nixl_serve;
mod plane;
mod sessions;
mod tier;

pub use checkpoint::merge_claims_states;
pub use error::StartError;
use listen::{accept_tcp, accept_uds, bind_uds};
use nixl_serve::serve_nixl;
use shared::{Checkpoints, Conns, Lifecycle, RestoreUnit, Settings, Shared};
use tier::{DiskIo, DiskTier, ReadBudget};

use std::io;
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use drive::{compactor, flusher, spiller};
use stowage_core::{CoreConfig, UnitCore};
use stowage_shm::Slab;

pub use stowage_config::{runtime_dir, NixlConfig, UnitConfig, DEFAULT_DISK_READ_BUDGET};

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
        self.shared.settings.instance_id
    }

    /// The unit's metrics in the Prometheus text format, as its endpoint
    /// serves them (`None`: metrics are off).
    pub fn metrics_text(&self) -> Option<String> {
        self.registry.as_deref().map(metrics::render)
    }

    /// Block until the unit is asked to exit (a Shutdown request, or
    /// [`UnitHandle::request_exit`]).
    pub fn wait_for_exit(&self) {
        let (exit, asked) = &self.shared.life.exit;
        let mut e = exit.lock().unwrap_or_else(|p| p.into_inner());
        while !*e {
            e = asked.wait(e).unwrap_or_else(|p| p.into_inner());
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
        tracing::info!(unit = %self.shared.settings.name, "unit stopped");
    }
}

impl RestoreUnit for UnitHandle {
    fn stop(&self) {
        UnitHandle::stop(self);
    }

    fn tcp(&self) -> Option<SocketAddr> {
        self.tcp
    }

    fn uds(&self) -> Option<&std::path::Path> {
        self.uds.as_deref()
    }

    fn connections(&self) -> usize {
        self.shared.conns.connections.load(Ordering::SeqCst)
    }
}

/// [`start_with`] for a restore unit (the [`shared::StartRestore`] a unit
/// hands down to `restore.rs`).
fn start_restore(
    cfg: UnitConfig,
    fd: std::os::fd::OwnedFd,
    dir: PathBuf,
) -> Result<(Arc<dyn RestoreUnit>, Option<stowage_wire::CheckpointInfo>), StartError> {
    let (h, info) = start_with(cfg, Some((fd, dir)))?;
    Ok((Arc::new(h), info))
}

/// Create the slab, bind the listeners and start serving.
pub fn start(cfg: UnitConfig) -> Result<UnitHandle, StartError> {
    start_with(cfg, None).map(|(h, _)| h)
}

/// [`start`], restoring the checkpoint in the directory open at the given
/// descriptor (its path, for messages) instead of `cfg.restore`; also
/// returns what was restored.
pub(crate) fn start_with(
    cfg: UnitConfig,
    restore_from: Option<(std::os::fd::OwnedFd, PathBuf)>,
) -> Result<(UnitHandle, Option<stowage_wire::CheckpointInfo>), StartError> {
    // What restore units are made from (they serve no nixl).
    let template = UnitConfig {
        nixl: None,
        restore: None,
        ..cfg.clone()
    };
    if cfg.uds.is_none() && cfg.tcp.is_none() {
        return Err(StartError::Config(
            "no listener: give a Unix socket path or a TCP address".into(),
        ));
    }
    if let (Some(addr), None) = (cfg.tcp, &cfg.secret) {
        // Loopback is not private: every local user reaches it, and TCP
        // tells nothing of who connects.
        if !cfg.insecure {
            return Err(StartError::Config(format!(
                "refusing to listen on tcp:{addr} without a shared secret: every local user{} \
                 could read, overwrite and clear every value. Give one (--secret-file FILE or \
                 STOWAGE_SECRET; launchers generate one), listen on a Unix socket only, or pass \
                 --insecure to serve TCP without one",
                if is_loopback(&addr) {
                    ""
                } else {
                    ", and anyone who reaches this address,"
                }
            )));
        }
        tracing::warn!(%addr, "serving TCP without a shared secret (--insecure): every local user, and anyone who reaches this address, can read, overwrite and clear every value");
    }
    admit::raise_nofile(
        &cfg.name,
        admit::fds_needed(cfg.max_connections, cfg.max_handshakes),
    );
    if cfg.memory < 4096 {
        return Err(StartError::Config("memory must be at least 4 KiB".into()));
    }
    let (slab, why) =
        Slab::create_paged(&format!("stowage-{}", cfg.name), cfg.memory, cfg.huge_pages)
            .map_err(StartError::Slab)?;
    tracing::info!(unit = %cfg.name, mode = %slab.page_mode(), asked = %cfg.huge_pages, "slab pages: {why}");
    let slab = Arc::new(slab);
    // With hugetlb the slab is whole huge pages: all of it is the unit's.
    let mut core_cfg = CoreConfig::new(slab.len());
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
    core_cfg.claim_lease = cfg.claim_lease;
    core_cfg.repair_window_lease = cfg.repair_window_lease;
    core_cfg.quarantine = cfg.quarantine;
    if let Some(n) = &cfg.nixl {
        core_cfg.nixl_quarantine = n.quarantine;
    }
    core_cfg.high_watermark = cfg.high_watermark;
    core_cfg.low_watermark = cfg.low_watermark;
    core_cfg.disk_capacity = cfg.disk.as_ref().map_or(0, |(_, c)| *c);
    if let Some(b) = cfg.spare_budget {
        core_cfg.spare_budget = b;
    }
    core_cfg.compact_ratio = cfg.compaction_ratio;
    let core = UnitCore::new(core_cfg).map_err(|e| StartError::Config(e.to_string()))?;
    let mut id = [0u8; 16];
    getrandom::fill(&mut id).map_err(|e| StartError::Slab(io::Error::other(e.to_string())))?;
    let instance_id = u128::from_le_bytes(id);
    let nixl = match cfg.nixl {
        None => None,
        Some(n) => Some(serve_nixl(&cfg.name, instance_id, &slab, n)?),
    };
    let (disk, disk_rx) = match &cfg.disk {
        None => (None, None),
        Some((root, capacity)) => {
            let (dir, removed) =
                disk::OwnedDir::create(root, &cfg.name, instance_id).map_err(|err| {
                    root_error(err, format!("disk tier directory under {}", root.display()))
                })?;
            for r in removed {
                tracing::info!(dir = %r.display(), "removed the disk directory of a unit that is gone");
            }
            tracing::info!(dir = %dir.path.display(), capacity, "disk tier");
            let engine = disk::FileEngine::new(dir.fd(), dir.path.clone(), instance_id);
            for f in &cfg.failpoints {
                engine.failpoints.enable(f).map_err(StartError::Config)?;
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let (spill_tx, spill_rx) = std::sync::mpsc::channel();
            (
                Some(DiskTier {
                    engine,
                    dir,
                    flush: Mutex::new(tx),
                    spill: Mutex::new(spill_tx),
                    busy: Mutex::new(()),
                    io: DiskIo::default(),
                    reads: ReadBudget::new(cfg.disk_read_budget),
                    failed_puts: Mutex::new(std::collections::VecDeque::new()),
                }),
                Some((rx, spill_rx)),
            )
        }
    };
    if let Some(root) = &cfg.checkpoint_root {
        // Refused now rather than at the first checkpoint.
        disk::open_private_root(root, "checkpoint root")
            .map_err(|err| root_error(err, format!("checkpoint root {}", root.display())))?;
    }
    if disk.is_none() && !cfg.failpoints.is_empty() {
        return Err(StartError::Config("failpoints need a disk tier".into()));
    }
    let (moves_tx, moves_rx) = std::sync::mpsc::channel();
    let shared = Arc::new(Shared {
        settings: Settings {
            name: cfg.name.clone(),
            started: Instant::now(),
            instance_id,
            limits: cfg.limits,
            spin: cfg.spin,
            uid: rustix::process::getuid().as_raw(),
            allow_other_uids: cfg.allow_other_uids,
            admin_tcp: cfg.admin_tcp,
            frame_timeout: cfg.frame_timeout,
            max_io_timeout: cfg.max_io_timeout,
            checkpoint_root: cfg.checkpoint_root.clone(),
            max_connections: cfg.max_connections.max(1),
            max_sessions: cfg.max_sessions.max(1),
            handshake_timeout: cfg.handshake_timeout,
            secret: cfg.secret.clone(),
            high_watermark: cfg.high_watermark,
        },
        driver: driver::Driver::new(core, moves_tx),
        sessions: sessions::Sessions::default(),
        conns: Conns {
            answers: Default::default(),
            connections: Arc::default(),
            handshakes: Arc::new(admit::Handshakes::new(
                cfg.max_handshakes,
                cfg.max_handshakes_per_source,
            )),
        },
        slab,
        nixl,
        disk,
        checkpoints: Checkpoints::new(start_restore),
        peers: forward::Peers::new(cfg.secret.clone()),
        budget: budget::Budget::new(
            cfg.outside_slab_budget
                .unwrap_or_else(|| stowage_config::default_outside_slab_budget(cfg.memory)),
            stowage_wire::PREFIX_LEN + cfg.limits.max_header as usize,
        ),
        metrics: cfg.metrics.then(Default::default),
        life: Lifecycle {
            stop: AtomicBool::new(false),
            fenced: AtomicBool::new(false),
            exit: (Mutex::new(false), std::sync::Condvar::new()),
        },
        plane: plane::Plane::new(instance_id),
    });
    let restored = match (restore_from, &cfg.restore) {
        (Some((fd, dir)), _) => Some((checkpoint::restore_from(&shared, fd, &dir), dir)),
        (None, Some(dir)) => Some((checkpoint::restore(&shared, dir), dir.clone())),
        (None, None) => None,
    };
    let restored = match restored {
        None => None,
        Some((r, dir)) => {
            let info = r.map_err(|e| StartError::Restore(e.to_string()))?;
            tracing::info!(
                dir = %dir.display(),
                rows = info.rows,
                entries = info.entries,
                bytes = info.bytes,
                "restored a checkpoint"
            );
            Some(info)
        }
    };
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
    {
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("compactor".into())
            .spawn(move || compactor(sh, moves_rx))
            .map_err(StartError::Slab)?;
    }
    if let Some((rx, spill_rx)) = disk_rx {
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("flusher".into())
            .spawn(move || flusher(sh, rx))
            .map_err(StartError::Slab)?;
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("spiller".into())
            .spawn(move || spiller(sh, spill_rx))
            .map_err(StartError::Slab)?;
    }

    let reactor = Arc::new(
        reactor::Reactor::start(&shared, cfg.threads, cfg.io_threads).map_err(StartError::Slab)?,
    );

    let mut handle = UnitHandle {
        shared: shared.clone(),
        uds: None,
        tcp: None,
        metrics: None,
        registry: None,
    };
    if cfg.metrics {
        let weak = Arc::downgrade(&shared);
        let source: metrics::Source = Box::new(move || {
            let sh = weak.upgrade()?;
            Some(metrics::Scrape {
                stats: sh.stats(),
                high_watermark: sh.settings.high_watermark,
                connections: sh.conns.connections.load(Ordering::Relaxed),
                handshakes: sh.conns.handshakes.len(),
                metrics: sh.metrics.clone(),
                started: sh.settings.started,
                instance_id: sh.settings.instance_id,
            })
        });
        let registry = Arc::new(metrics::registry(source, &cfg.name));
        if let Some(addr) = cfg.metrics_listen {
            let token = cfg
                .metrics_token_file
                .as_deref()
                .map(http::read_token)
                .transpose()
                .map_err(StartError::Config)?;
            let l = http::bind(addr).map_err(|err| StartError::Bind {
                what: format!("metrics endpoint {addr}"),
                err,
            })?;
            handle.metrics = Some(l.local_addr().map_err(StartError::Slab)?);
            let (sh, r) = (shared.clone(), registry.clone());
            std::thread::Builder::new()
                .name("metrics-accept".into())
                .spawn(move || http::accept(|| sh.life.stop.load(Ordering::SeqCst), l, r, token))
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
        let (sh, r) = (shared.clone(), reactor.clone());
        std::thread::Builder::new()
            .name("uds-accept".into())
            .spawn(move || accept_uds(sh, &r, l))
            .map_err(StartError::Slab)?;
    }
    if let Some(addr) = cfg.tcp {
        let l = admit::bind_tcp(addr).map_err(|err| StartError::Bind {
            what: addr.to_string(),
            err,
        })?;
        handle.tcp = Some(l.local_addr().map_err(StartError::Slab)?);
        let (sh, r) = (shared.clone(), reactor.clone());
        std::thread::Builder::new()
            .name("tcp-accept".into())
            .spawn(move || accept_tcp(sh, &r, l))
            .map_err(StartError::Slab)?;
    }
    let sh = shared.clone();
    std::thread::Builder::new()
        .name("timer".into())
        .spawn(move || sh.run_timer())
        .map_err(StartError::Slab)?;
    let _ = shared.checkpoints.config.set(UnitConfig {
        tcp: handle.tcp,
        uds: handle.uds.clone(),
        ..template
    });
    tracing::info!(
        unit = %cfg.name,
        memory = shared.slab.len(),
        uds = ?handle.uds,
        tcp = ?handle.tcp,
        metrics = ?handle.metrics,
        shared_secret = cfg.secret.is_some(),
        instance = format!("{:032x}", shared.settings.instance_id),
        "unit serving"
    );
    Ok((handle, restored))
}

/// A disk or checkpoint root refused as unsafe is a configuration error
/// (its message says why and how to fix it); other failures to set it up
/// are I/O errors with `what`.
fn root_error(err: io::Error, what: String) -> StartError {
    if err.kind() == io::ErrorKind::PermissionDenied {
        StartError::Config(err.to_string())
    } else {
        StartError::Bind { what, err }
    }
}

/// Whether `addr` is a loopback address (127.0.0.0/8, ::1, or an IPv4
/// loopback address mapped into IPv6).
pub fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
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
        if sh.life.stop.load(Ordering::Relaxed) {
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
    fn a_unit_on_tcp_needs_a_secret_or_insecure_loopback_included() {
        for addr in ["0.0.0.0:0", "127.0.0.1:0"] {
            let mut cfg = UnitConfig::new("t", 1 << 20);
            cfg.mlock = false;
            cfg.metrics_listen = None;
            cfg.tcp = Some(addr.parse().unwrap());
            let e = start(cfg.clone()).err().expect("refused");
            let e = e.to_string();
            assert!(
                e.contains("--insecure")
                    && e.contains("STOWAGE_SECRET")
                    && e.contains("--secret-file"),
                "{e}"
            );
            cfg.secret =
                Some(stowage_wire::auth::Secret::from_bytes(*b"0123456789abcdef").unwrap());
            start(cfg.clone()).expect("with a secret").stop();
            cfg.secret = None;
            cfg.insecure = true;
            start(cfg).expect("with --insecure").stop();
        }
    }
}
