//! The unit's parts and what ties them together ([`Shared`]): the owners
//! of the unit's state that no serving module owns alone — what it was
//! started with ([`Settings`]), its connections ([`Conns`]), its
//! checkpoints and restore units ([`Checkpoints`]), its lifecycle
//! ([`Lifecycle`]) — beside the parts owned below (the core's
//! [`Driver`], [`Sessions`], the disk tier, nixl, metrics).
//!
//! Layering (docs/architecture.md): this module imports only modules
//! below it (leaves and owners); the serving modules above take it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stowage_config::UnitConfig;
use stowage_shm::Slab;
use stowage_wire::Limits;

use crate::admit::{Counted, Cut, Handshakes, Ticket};
use crate::budget::Budget;
use crate::claims::Answers;
use crate::driver::Driver;
use crate::error::StartError;
use crate::forward::Peers;
use crate::metrics::UnitMetrics;
use crate::nixl_serve::NixlServe;
use crate::plane::Plane;
use crate::sessions::Sessions;
use crate::tier::DiskTier;

/// A unit's parts, each owning its state: what ties them together for
/// the serving modules above (see docs/architecture.md, "The unit
/// server"). It points only down: every part's type lives in a module
/// below this one.
pub(crate) struct Shared {
    /// What the unit was started with and never changes.
    pub(crate) settings: Settings,
    /// The core, and what drives it ([`Driver`]).
    pub(crate) driver: Driver,
    /// Sessions by token, and their processes ([`Sessions`]).
    pub(crate) sessions: Sessions,
    /// Connections served and in their handshake ([`Conns`]).
    pub(crate) conns: Conns,
    pub(crate) slab: Arc<Slab>,
    /// NIXL, when the unit serves it.
    pub(crate) nixl: Option<NixlServe>,
    pub(crate) disk: Option<DiskTier>,
    /// Checkpoints being written, and restore units ([`Checkpoints`]).
    pub(crate) checkpoints: Checkpoints,
    /// Connections to other units, for puts this unit forwards
    /// ([`Peers`]).
    pub(crate) peers: Peers,
    /// The bytes held outside the slab for connections ([`Budget`]).
    pub(crate) budget: Arc<Budget>,
    /// What the request path records (`None`: metrics are off).
    pub(crate) metrics: Option<Arc<UnitMetrics>>,
    /// Stopping and exiting.
    pub(crate) life: Lifecycle,
    /// The unit's view of the plane ([`Plane`]).
    pub(crate) plane: Plane,
}

/// What a unit was started with: fixed for its life.
pub(crate) struct Settings {
    /// The unit's name (logs, the metrics' `unit` label).
    pub(crate) name: String,
    pub(crate) started: Instant,
    pub(crate) instance_id: u128,
    pub(crate) limits: Limits,
    pub(crate) spin: Duration,
    /// This process's uid.
    pub(crate) uid: u32,
    pub(crate) allow_other_uids: bool,
    pub(crate) admin_tcp: bool,
    pub(crate) frame_timeout: Duration,
    pub(crate) max_io_timeout: Duration,
    pub(crate) checkpoint_root: Option<PathBuf>,
    pub(crate) max_connections: usize,
    /// Most sessions at once.
    pub(crate) max_sessions: usize,
    pub(crate) handshake_timeout: Duration,
    /// The shared secret clients must prove, if any.
    pub(crate) secret: Option<stowage_wire::auth::Secret>,
    /// The spill threshold, as a fraction of the slab.
    pub(crate) high_watermark: f64,
}

/// Whether the unit is stopping, and whether it was asked to exit.
pub(crate) struct Lifecycle {
    pub(crate) stop: AtomicBool,
    /// Set when a client fenced the unit (`Request::Fence`): every
    /// request is refused from then on, and the unit exits.
    pub(crate) fenced: AtomicBool,
    /// Set when the unit is asked to exit.
    pub(crate) exit: (Mutex<bool>, std::sync::Condvar),
}

/// The connections a unit serves: those past their handshake (counted
/// against `--max-connections`) and those still in it. (The reactor that
/// serves them is the listeners'.)
pub(crate) struct Conns {
    /// Connections being served (past their handshake).
    pub(crate) connections: Arc<std::sync::atomic::AtomicUsize>,
    /// Connections still in their handshake.
    pub(crate) handshakes: Arc<Handshakes>,
    /// Where the answers to claims that waited go.
    pub(crate) answers: Answers,
}

impl Shared {
    /// The connection of `ticket` proved itself: it leaves the handshake
    /// pool and takes a served connection's slot. `Err`: the Busy answer
    /// it gets instead (its handshake was cut meanwhile, or the unit
    /// serves `max_connections` already).
    pub(crate) fn prove(self: &Arc<Self>, ticket: &Ticket) -> Result<Counted, String> {
        if !self.conns.handshakes.prove(ticket) {
            return Err(self.cut_message(ticket));
        }
        if self.conns.connections.fetch_add(1, Ordering::SeqCst) >= self.settings.max_connections {
            self.conns.connections.fetch_sub(1, Ordering::SeqCst);
            if let Some(m) = &self.metrics {
                m.turned_away();
            }
            return Err(format!(
                "the unit has too many connections ({}, its --max-connections); try again later",
                self.settings.max_connections
            ));
        }
        Ok(Counted(self.conns.connections.clone()))
    }

    /// What a connection whose handshake was cut is told.
    pub(crate) fn cut_message(&self, ticket: &Ticket) -> String {
        match ticket.cut() {
            Some(Cut::Source) => format!(
                "too many connections waiting for their handshake from {} ({}, the unit's \
                 --max-handshakes-per-source): the oldest was cut; try again",
                ticket.source, self.conns.handshakes.per_source
            ),
            _ => format!(
                "too many connections waiting for their handshake ({}, the unit's \
                 --max-handshakes): the oldest of the source holding the most was cut; try again",
                self.conns.handshakes.max
            ),
        }
    }
}

/// A restore unit as the unit that started it sees it (a
/// `crate::UnitHandle`).
pub(crate) trait RestoreUnit: Send + Sync {
    /// Stop it ([`crate::UnitHandle::stop`]).
    fn stop(&self);
    /// Its TCP address, if it listens on TCP.
    fn tcp(&self) -> Option<SocketAddr>;
    /// Its Unix socket's path, if it listens on one.
    fn uds(&self) -> Option<&Path>;
    /// The connections it serves now.
    fn connections(&self) -> usize;
}

/// Start a restore unit of `cfg`, restored from the checkpoint directory
/// open at the descriptor (its path, for messages); also returns what was
/// restored.
pub(crate) type StartRestore =
    fn(
        UnitConfig,
        OwnedFd,
        PathBuf,
    ) -> Result<(Arc<dyn RestoreUnit>, Option<stowage_wire::CheckpointInfo>), StartError>;

impl Checkpoints {
    /// No checkpoint written, no restore unit; restore units are started
    /// with `start`.
    pub(crate) fn new(start: StartRestore) -> Self {
        Self {
            writing: AtomicUsize::new(0),
            config: std::sync::OnceLock::new(),
            restores: Mutex::default(),
            start,
        }
    }
}

/// Checkpoints being written, and what restores are made from.
pub(crate) struct Checkpoints {
    /// Checkpoints being written.
    pub(crate) writing: std::sync::atomic::AtomicUsize,
    /// The unit's configuration with its bound listeners (what its restore
    /// units are made from).
    pub(crate) config: std::sync::OnceLock<UnitConfig>,
    /// The restore units this unit started (`restore.rs`).
    pub(crate) restores: Mutex<Restores>,
    /// How a restore unit is started (`crate::start_with`, handed down).
    pub(crate) start: StartRestore,
}

/// The restore units a unit started, by id.
#[derive(Default)]
pub(crate) struct Restores {
    pub(crate) next: u64,
    pub(crate) open: HashMap<u64, Arc<dyn RestoreUnit>>,
}

impl Shared {
    /// Time since the unit started: the core's clock.
    pub(crate) fn now(&self) -> Duration {
        self.settings.started.elapsed()
    }

    /// Ask the unit to exit (wakes [`crate::UnitHandle::wait_for_exit`]).
    pub(crate) fn request_exit(&self) {
        let mut e = self.life.exit.0.lock().unwrap_or_else(|p| p.into_inner());
        *e = true;
        self.life.exit.1.notify_all();
    }
}
