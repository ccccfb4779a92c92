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
//! ticker that lets the core reclaim expired leases. The core sits behind
//! one mutex that is never held across I/O.
//!
//! A connection that sends a malformed or oversized frame gets an
//! `InvalidRequest` error and is closed; everyone else carries on. A
//! connection that ends (a client died) gives back its pins and aborts its
//! uncommitted reservations (quarantined, since a one-sided writer may still
//! be copying).

#![forbid(unsafe_code)]

mod conn;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use stowage_core::{CoreConfig, UnitCore};
use stowage_shm::{LockOutcome, Slab};
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
    /// Lease of uncommitted reservations. Default 30 s.
    pub reservation_lease: Duration,
    /// Lease of pins. Default 30 s.
    pub pin_lease: Duration,
    /// Quarantine of aborted in-flight or expired ranges. Default 5 s.
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
        }
    }
}

/// State shared by every thread of a unit.
pub(crate) struct Shared {
    pub(crate) core: Mutex<UnitCore>,
    pub(crate) slab: Slab,
    pub(crate) started: Instant,
    pub(crate) instance_id: u128,
    pub(crate) limits: Limits,
    pub(crate) stop: AtomicBool,
    pub(crate) spin: Duration,
}

impl Shared {
    pub(crate) fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// The core. A thread that panicked while holding the lock cannot have
    /// left the core half-updated in a way later calls rely on less than on
    /// the unit staying up, so a poisoned lock is taken over.
    pub(crate) fn core(&self) -> MutexGuard<'_, UnitCore> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
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
}

impl UnitHandle {
    pub fn instance_id(&self) -> u128 {
        self.shared.instance_id
    }

    /// Stop accepting and remove the socket file. Connections already open
    /// end when their clients close them.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(p) = &self.uds {
            let _ = std::fs::remove_file(p);
            // Wake the accept loop so it sees the flag.
            let _ = UnixStream::connect(p);
        }
        if let Some(a) = self.tcp {
            let _ = std::net::TcpStream::connect_timeout(&a, Duration::from_millis(100));
        }
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
}

/// Create the slab, bind the listeners and start serving.
pub fn start(cfg: UnitConfig) -> Result<UnitHandle, StartError> {
    if cfg.uds.is_none() && cfg.tcp.is_none() {
        return Err(StartError::Config(
            "no listener: give a Unix socket path or a TCP address".into(),
        ));
    }
    let mut core_cfg = CoreConfig::new(cfg.memory);
    core_cfg.reservation_lease = cfg.reservation_lease;
    core_cfg.pin_lease = cfg.pin_lease;
    core_cfg.quarantine = cfg.quarantine;
    let core = UnitCore::new(core_cfg).map_err(|e| StartError::Config(e.to_string()))?;
    if cfg.memory < 4096 {
        return Err(StartError::Config("memory must be at least 4 KiB".into()));
    }
    let slab =
        Slab::create(&format!("stowage-{}", cfg.name), cfg.memory).map_err(StartError::Slab)?;
    if cfg.mlock {
        match slab.lock() {
            LockOutcome::Locked => {
                tracing::info!(unit = %cfg.name, bytes = cfg.memory, "slab mlocked")
            }
            LockOutcome::NotLocked(e) => tracing::warn!(
                unit = %cfg.name,
                error = %e,
                "could not mlock the slab (raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK); running unlocked"
            ),
        }
    }
    let mut id = [0u8; 16];
    getrandom::fill(&mut id).map_err(|e| StartError::Slab(io::Error::other(e.to_string())))?;
    let shared = Arc::new(Shared {
        core: Mutex::new(core),
        slab,
        started: Instant::now(),
        instance_id: u128::from_le_bytes(id),
        limits: cfg.limits,
        stop: AtomicBool::new(false),
        spin: cfg.spin,
    });

    let mut handle = UnitHandle {
        shared: shared.clone(),
        uds: None,
        tcp: None,
    };
    if let Some(path) = &cfg.uds {
        let l = bind_uds(path).map_err(|err| StartError::Bind {
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
        let l = TcpListener::bind(addr).map_err(|err| StartError::Bind {
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
            while !sh.stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(20));
                let now = sh.now();
                sh.core().tick(now);
            }
        })
        .map_err(StartError::Slab)?;
    tracing::info!(
        unit = %cfg.name,
        memory = cfg.memory,
        uds = ?handle.uds,
        tcp = ?handle.tcp,
        instance = format!("{:032x}", shared.instance_id),
        "unit serving"
    );
    Ok(handle)
}

/// Bind a Unix socket, replacing a stale socket file (one nobody listens
/// on) but never a live unit's.
fn bind_uds(path: &Path) -> io::Result<UnixListener> {
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

fn accept_uds(shared: Arc<Shared>, l: UnixListener) {
    for stream in l.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        match stream {
            Ok(s) => {
                let sh = shared.clone();
                let _ = std::thread::Builder::new()
                    .name("conn-uds".into())
                    .spawn(move || conn::serve(sh, Socket::Unix(s)));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept on the Unix socket failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn accept_tcp(shared: Arc<Shared>, l: TcpListener) {
    for stream in l.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        match stream {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                let sh = shared.clone();
                let _ = std::thread::Builder::new()
                    .name("conn-tcp".into())
                    .spawn(move || conn::serve(sh, Socket::Tcp(s)));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept on TCP failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}
