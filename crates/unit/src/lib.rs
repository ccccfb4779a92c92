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
//! handed over. A unit refuses to listen on TCP (loopback included: every
//! local user reaches it) without a secret unless told
//! [`UnitConfig::insecure`].

#![forbid(unsafe_code)]

mod admit;
pub mod auth;
mod checkpoint;
mod conn;
pub mod disk;
mod drive;
pub mod handler;
mod http;
pub mod metrics;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use disk::DiskEngine;
use drive::{flusher, spiller, Timer};
pub(crate) use handler::unexpected;
use stowage_core::{Answer, CoreConfig, Input, UnitCore};
use stowage_shm::Slab;
use stowage_wire::io::Socket;
use stowage_wire::Limits;

pub use stowage_config::{runtime_dir, NixlConfig, UnitConfig, DEFAULT_DISK_READ_BUDGET};

/// A unit's NIXL side: its agent and registered slab, and the client
/// agents it knows.
pub(crate) struct NixlServe {
    pub(crate) metadata: Vec<u8>,
    pub(crate) slab_addr: u64,
    peers: Mutex<NixlPeers>,
    // Deregistered before the agent goes.
    _registration: stowage_nixl::SlabRegistration,
    agent: stowage_nixl::Agent,
}

/// Longest NIXL agent name a unit takes from a client.
const MAX_AGENT_NAME: usize = 256;
/// Most metadata bytes a unit loads of a client's agent (its connection
/// information takes a few KiB).
const MAX_AGENT_METADATA: usize = 1 << 20;

/// The client agents of a unit's nixl connections.
#[derive(Default)]
struct NixlPeers {
    /// Each open connection that asked `NixlInfo`: its client's agent, if
    /// the unit knows it (loaded its metadata).
    conns: std::collections::HashMap<stowage_core::Owner, Option<String>>,
    /// Each known agent: the sessions its connections belonged to.
    agents: std::collections::HashMap<String, std::collections::HashSet<stowage_core::SessionId>>,
    /// Each session with a nixl connection: its agent (one per session).
    sessions: std::collections::HashMap<stowage_core::SessionId, Option<String>>,
}

/// A unit's disk tier at run time.
pub(crate) struct DiskTier {
    pub(crate) engine: disk::FileEngine,
    pub(crate) dir: disk::OwnedDir,
    /// Blob files whose bytes are written, waiting to be synced and
    /// published.
    pub(crate) flush:
        Mutex<std::sync::mpsc::Sender<(stowage_core::BlobId, Box<dyn disk::BlobWriter>)>>,
    /// Batches of spill jobs the core handed out, for the spiller.
    pub(crate) spill: Mutex<std::sync::mpsc::Sender<Vec<stowage_core::SpillJob>>>,
    /// Held by the spiller and the flusher while they write files, so that
    /// teardown removes the directory only once they are idle.
    pub(crate) busy: Mutex<()>,
    /// I/O counters reported in stats.
    pub(crate) io: DiskIo,
    /// The heap that reads from disk may take (buffers).
    pub(crate) reads: ReadBudget,
    /// Puts answered Pending whose files then could not be made durable,
    /// newest last (1024 at most): a later Commit of one is told
    /// what happened instead of "unknown blob".
    pub(crate) failed_puts: Mutex<std::collections::VecDeque<FailedPut>>,
}

/// A put whose blob file failed after its Pending answer.
pub(crate) struct FailedPut {
    pub(crate) blob: stowage_core::BlobId,
    pub(crate) code: stowage_wire::ErrorCode,
    pub(crate) message: String,
}

/// Failed puts remembered (see [`DiskTier::failed_puts`]).
const FAILED_PUTS_KEPT: usize = 1024;

impl DiskTier {
    /// Remember that `blob`'s put, answered Pending, failed with `e`.
    pub(crate) fn put_failed(&self, blob: stowage_core::BlobId, e: &io::Error) {
        let (code, message) = if disk::is_disk_full(e) {
            (
                stowage_wire::ErrorCode::Full,
                format!(
                    "the put of blob {blob:?} was answered Pending, but the unit's disk tier \
                     filled up ({e}) before its file was made durable: nothing of it is \
                     stored; put it again once there is room"
                ),
            )
        } else {
            (
                stowage_wire::ErrorCode::Internal,
                format!(
                    "the put of blob {blob:?} was answered Pending, but its file on the \
                     unit's disk tier could not be made durable ({e}): nothing of it is \
                     stored; put it again"
                ),
            )
        };
        let mut f = self.failed_puts.lock().unwrap_or_else(|p| p.into_inner());
        if f.len() >= FAILED_PUTS_KEPT {
            f.pop_front();
        }
        f.push_back(FailedPut {
            blob,
            code,
            message,
        });
    }

    /// What happened to `blob`'s put, if it failed after Pending.
    pub(crate) fn failed_put(
        &self,
        blob: stowage_core::BlobId,
    ) -> Option<(stowage_wire::ErrorCode, String)> {
        let f = self.failed_puts.lock().unwrap_or_else(|p| p.into_inner());
        f.iter()
            .rev()
            .find(|p| p.blob == blob)
            .map(|p| (p.code, p.message.clone()))
    }
}

/// Largest buffer one disk read takes from the [`ReadBudget`].
const READ_BUF: u64 = 1 << 20;
/// Smallest read budget (one buffer of this size).
const MIN_READ_BUDGET: u64 = 64 << 10;

/// The heap reads from the disk tier may take, as a pool of equal
/// buffers: a reader takes one for the whole of its transfer (a get
/// streams every spilled value it sends through it; a promotion copies a
/// blob into the slab through it), so however many readers there are, the
/// heap they take is at most the budget.
pub(crate) struct ReadBudget {
    buf_len: usize,
    /// Buffers not taken, and free buffers already allocated.
    free: Mutex<(usize, Vec<Vec<u8>>)>,
    returned: std::sync::Condvar,
}

impl ReadBudget {
    pub(crate) fn new(budget: u64) -> Self {
        let budget = budget.max(MIN_READ_BUDGET);
        let buf_len = budget.min(READ_BUF);
        Self {
            buf_len: buf_len as usize,
            free: Mutex::new(((budget / buf_len) as usize, Vec::new())),
            returned: std::sync::Condvar::new(),
        }
    }

    /// Take a buffer, waiting until `until` for one to be given back.
    pub(crate) fn take(&self, until: Instant) -> Option<ReadBuf<'_>> {
        let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if g.0 > 0 {
                g.0 -= 1;
                let buf = g.1.pop().unwrap_or_else(|| vec![0u8; self.buf_len]);
                return Some(ReadBuf { budget: self, buf });
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            g = self
                .returned
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A buffer of the [`ReadBudget`], given back on drop.
pub(crate) struct ReadBuf<'a> {
    budget: &'a ReadBudget,
    buf: Vec<u8>,
}

impl std::ops::Deref for ReadBuf<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl std::ops::DerefMut for ReadBuf<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

impl Drop for ReadBuf<'_> {
    fn drop(&mut self) {
        let mut g = self.budget.free.lock().unwrap_or_else(|p| p.into_inner());
        g.0 += 1;
        g.1.push(std::mem::take(&mut self.buf));
        self.budget.returned.notify_one();
    }
}

#[cfg(test)]
mod read_budget_tests {
    use super::*;

    /// The budget is a fixed number of buffers: a reader past it waits
    /// until its deadline (None), or until one is given back.
    #[test]
    fn readers_past_the_budget_wait_then_get_none() {
        let b = ReadBudget::new(3 << 20);
        let soon = || Instant::now() + Duration::from_millis(20);
        let held: Vec<_> = (0..3).map(|_| b.take(soon()).unwrap()).collect();
        assert!(held.iter().all(|h| h.len() == 1 << 20));
        assert!(b.take(soon()).is_none());
        std::thread::scope(|s| {
            let waiter = s.spawn(|| b.take(Instant::now() + Duration::from_secs(10)).is_some());
            std::thread::sleep(Duration::from_millis(50));
            drop(held);
            assert!(waiter.join().unwrap());
        });
        // A budget below one buffer still has one, of the budget's size.
        let small = ReadBudget::new(1);
        let one = small.take(soon()).unwrap();
        assert_eq!(one.len() as u64, MIN_READ_BUDGET);
        assert!(small.take(soon()).is_none());
    }
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

/// State shared by every thread of a unit.
pub(crate) struct Shared {
    pub(crate) core: Mutex<UnitCore>,
    /// When to wake the core, and which processes to watch.
    pub(crate) timer: Timer,
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
        peers: Mutex::new(NixlPeers::default()),
        _registration: registration,
        agent,
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
    /// A connection of this session asked for nixl: its peer moves bytes
    /// with one-sided transfers, and so may its other connections.
    pub(crate) one_sided: bool,
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
                let id = match core.handle(self.now(), Input::OpenSession)? {
                    Answer::Session(id) => id,
                    other => return Err(unexpected(&other)),
                };
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
                        one_sided: false,
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
        let now = self.now();
        let input = Input::Attach {
            session: rec.id,
            mapped: rec.mapped,
        };
        let owner = match core.handle(now, input)? {
            Answer::Attached(owner) => owner,
            other => return Err(unexpected(&other)),
        };
        if rec.one_sided {
            core.handle(now, Input::MakeOneSided(owner))?;
        }
        Ok((token, owner))
    }

    /// The peer of `owner`'s connection will touch the slab by itself with
    /// one-sided transfers (a nixl client, whose NIXL agent is `agent`
    /// with the metadata to reach it, when it told them): the connection
    /// and its session become one-sided ([`UnitCore::make_one_sided`]).
    /// The unit loads the agent's metadata, to invalidate it once the
    /// agent's last connection has ended ([`Shared::nixl_conn_ended`]).
    pub(crate) fn map_session(
        &self,
        owner: stowage_core::Owner,
        peer: conn::Peer,
        agent: &str,
        agent_metadata: &[u8],
    ) -> Result<(), stowage_core::CoreError> {
        let invalid = stowage_core::CoreError::Invalid;
        let Some(n) = &self.nixl else {
            return Err(invalid("this unit does not serve nixl".into()));
        };
        let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        let Some(rec) = sessions.values_mut().find(|r| r.id == owner.session) else {
            return Err(invalid("session vanished".into()));
        };
        let mut peers = n.peers.lock().unwrap_or_else(|p| p.into_inner());
        let mut told = (!agent.is_empty()).then(|| agent.to_owned());
        if agent.len() > MAX_AGENT_NAME || agent_metadata.len() > MAX_AGENT_METADATA {
            tracing::warn!(
                unit = %self.name,
                name_bytes = agent.len(),
                metadata_bytes = agent_metadata.len(),
                "a nixl client's agent is past the unit's bounds: not loaded; what its \
                 connections hold when they end waits out the nixl quarantine alone"
            );
            told = None;
        }
        if peers.conns.contains_key(&owner) {
            // Asked again on the same connection: the same answer.
            return if peers.sessions.get(&owner.session) == Some(&told) {
                Ok(())
            } else {
                Err(invalid(
                    "this connection asked for nixl already, as another agent".into(),
                ))
            };
        }
        if let Some(had) = peers.sessions.get(&owner.session) {
            if *had != told {
                return Err(invalid(format!(
                    "a session's nixl connections come from one NIXL agent: this one \
                     was {had:?}, now {told:?} (open a new session for another agent)"
                )));
            }
        }
        let known = match &told {
            Some(name) if peers.agents.contains_key(name) => Some(name.clone()),
            Some(name) => match n.agent.load_remote(agent_metadata) {
                Ok(loaded) if loaded == *name => {
                    tracing::debug!(unit = %self.name, agent = %loaded, metadata_bytes = agent_metadata.len(), "loaded a nixl client's agent");
                    Some(loaded)
                }
                Ok(loaded) => {
                    let _ = n.agent.invalidate_remote(&loaded);
                    return Err(invalid(format!(
                        "the NIXL metadata told is agent {loaded:?}'s, not {name:?}'s"
                    )));
                }
                Err(e) => {
                    tracing::warn!(
                        unit = %self.name,
                        agent = %name,
                        error = %e,
                        "cannot load a nixl client's agent: what its connections hold when \
                         they end waits out the nixl quarantine without an invalidation"
                    );
                    None
                }
            },
            None => None,
        };
        if rec.pidfd.is_none() {
            rec.pidfd = peer.pid.and_then(|pid| {
                let pid = rustix::process::Pid::from_raw(pid)?;
                rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
            });
        }
        rec.one_sided = true;
        self.core().handle(self.now(), Input::MakeOneSided(owner))?;
        if let Some(name) = &known {
            peers
                .agents
                .entry(name.clone())
                .or_default()
                .insert(owner.session);
        }
        peers.sessions.insert(owner.session, told);
        peers.conns.insert(owner, known);
        Ok(())
    }

    /// A connection ended (after the core's [`UnitCore::detach`]). When it
    /// was a nixl connection and the last open one of its client's agent,
    /// the unit invalidates that agent (so that, where UCX can, no further
    /// transfer of it lands) and fences the sessions it served: what their
    /// ended connections hold is released once the nixl quarantine has
    /// passed. A connection whose agent the unit does not know fences its
    /// session at once: its holds wait out the quarantine alone.
    pub(crate) fn nixl_conn_ended(&self, owner: stowage_core::Owner) {
        let Some(n) = &self.nixl else {
            return;
        };
        let (fence, agent) = {
            let mut peers = n.peers.lock().unwrap_or_else(|p| p.into_inner());
            let Some(agent) = peers.conns.remove(&owner) else {
                return;
            };
            if !peers.conns.keys().any(|o| o.session == owner.session) {
                peers.sessions.remove(&owner.session);
            }
            match agent {
                None => (vec![owner.session], None),
                Some(name) if peers.conns.values().any(|a| a.as_ref() == Some(&name)) => {
                    (Vec::new(), None)
                }
                Some(name) => {
                    // Under the lock: a connection of the same agent that
                    // asks NixlInfo meanwhile loads it afresh, after this.
                    let sessions = peers.agents.remove(&name).unwrap_or_default();
                    let invalidated = n.agent.invalidate_remote(&name);
                    if let Err(e) = &invalidated {
                        tracing::warn!(unit = %self.name, agent = %name, error = %e, "cannot invalidate a nixl client's agent");
                    }
                    (sessions.into_iter().collect(), Some(name))
                }
            }
        };
        if fence.is_empty() {
            return;
        }
        let now = self.now();
        let held: u64 = {
            let mut core = self.core();
            fence
                .iter()
                .map(|s| match core.handle(now, Input::Fenced(*s)) {
                    Ok(Answer::Released(n)) => n,
                    _ => 0,
                })
                .sum()
        };
        if held > 0 {
            tracing::info!(
                unit = %self.name,
                agent = agent.as_deref().unwrap_or("(not told)"),
                holds = held,
                quarantine_ms = self.core().config().nixl_quarantine.as_millis() as u64,
                "a nixl client's connections ended: its holds are released after the nixl quarantine"
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
        self.timer.wake();
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
                match d.dir.remove() {
                    Ok(()) => {
                        last = None;
                        break;
                    }
                    // A connection may have just created a file: try again.
                    Err(e) => {
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

impl Shared {
    pub(crate) fn now(&self) -> Duration {
        self.started.elapsed()
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
    if let Some(n) = &cfg.nixl {
        core_cfg.nixl_quarantine = n.quarantine;
    }
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
    let shared = Arc::new(Shared {
        core: Mutex::new(core),
        timer: Timer::new(),
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
        .name("timer".into())
        .spawn(move || sh.run_timer())
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
    /// Only on disk: `len` bytes at `offset` into the blob, streamed from
    /// its file as the reply is written ([`read_through`]).
    Disk {
        blob: stowage_core::BlobId,
        offset: u64,
        len: u64,
        meta: Vec<u8>,
    },
    /// Its blob's file failed its checksum, is not that blob's, or could
    /// not be read.
    Corrupt,
}

/// Pieces of a slab range copied through the heap at a time (disk tier
/// and checkpoint I/O).
const COPY_CHUNK: usize = 1 << 20;

/// Read `len` bytes at `offset` of an open blob file through `buf`, piece
/// by piece (each checked; pieces end on the file's chunk boundaries where
/// they can, so no chunk is read twice), handing each piece to `sink`. The
/// outer error is the file's, the inner one the sink's.
pub(crate) fn read_through(
    reader: &disk::BlobReader,
    offset: u64,
    len: u64,
    buf: &mut [u8],
    mut sink: impl FnMut(&[u8]) -> io::Result<()>,
) -> Result<io::Result<()>, disk::DiskError> {
    let chunk = u64::from(disk::CHUNK);
    let end = offset
        .checked_add(len)
        .filter(|&e| e <= reader.size())
        .ok_or_else(|| disk::DiskError::OutOfRange {
            path: PathBuf::new(),
            offset,
            len,
            size: reader.size(),
        })?;
    let mut pos = offset;
    while pos < end {
        let mut stop = (pos + buf.len() as u64).min(end);
        let aligned = stop / chunk * chunk;
        if stop < end && aligned > pos {
            stop = aligned;
        }
        let piece = &mut buf[..(stop - pos) as usize];
        reader.read_at(pos, piece)?;
        if let Err(e) = sink(piece) {
            return Ok(Err(e));
        }
        pos = stop;
    }
    Ok(Ok(()))
}

impl Shared {
    /// Bring spilled values back for a reader that pinned them, through
    /// `buf` (a buffer of the disk tier's [`ReadBudget`]; without one,
    /// nothing is brought back): each spilled blob is promoted into the
    /// slab where there is room below the high watermark; with `verify`,
    /// the ranges asked for of the others are read and checked (nothing is
    /// kept: the reply streams them from their files afterwards), so that
    /// a damaged file, or one that is not its blob's, is answered Corrupt
    /// before the reply promises its bytes.
    pub(crate) fn bring_back(
        &self,
        found: Vec<Option<stowage_core::Located>>,
        mut buf: Option<&mut [u8]>,
        verify: bool,
    ) -> Vec<Option<Served>> {
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
        for (blob, mut wanted) in on_disk {
            let Some(d) = &self.disk else {
                corrupt.insert(blob);
                continue;
            };
            let Some(buf) = buf.as_deref_mut() else {
                continue;
            };
            let (slot, size) = {
                let mut c = self.core();
                let size = c.blob_size(blob);
                let slot = match c.handle(self.now(), Input::Promote(blob)) {
                    Ok(Answer::Promoting(slot)) => slot,
                    _ => None,
                };
                (slot, size)
            };
            let Some(size) = size else {
                if let Some(_slot) = slot {
                    let done = Input::Promoted { blob, ok: false };
                    let _ = self.core().handle(self.now(), done);
                }
                corrupt.insert(blob);
                continue;
            };
            let t0 = Instant::now();
            let reader = d.engine.reader(blob).and_then(|r| {
                if r.size() == size {
                    Ok(r)
                } else {
                    Err(disk::DiskError::Corrupt {
                        path: d.engine.path(blob),
                        reason: format!("holds {} bytes, expected {size}", r.size()),
                    })
                }
            });
            let read = match slot {
                Some(offset) => {
                    // This thread alone writes the promotion's range: the
                    // core keeps it allocated until it is reported.
                    let r = reader.and_then(|rd| {
                        let mut at = 0;
                        read_through(&rd, 0, size, buf, |piece| {
                            self.slab
                                .write(offset + at, piece)
                                .map_err(io::Error::other)?;
                            at += piece.len() as u64;
                            Ok(())
                        })?
                        .map_err(disk::DiskError::Io)
                    });
                    let done = Input::Promoted {
                        blob,
                        ok: r.is_ok(),
                    };
                    let _ = self.core().handle(self.now(), done);
                    if r.is_ok() {
                        promoted.insert(blob, offset);
                        if let Some(m) = &self.metrics {
                            m.promoted_bytes.fetch_add(size, Ordering::Relaxed);
                        }
                    }
                    r.map(|()| size)
                }
                None if verify => {
                    wanted.sort_unstable();
                    wanted.dedup();
                    reader.and_then(|rd| {
                        let mut bytes = 0;
                        for (offset, len) in wanted {
                            read_through(&rd, offset, len, buf, |_| Ok(()))??;
                            bytes += len;
                        }
                        Ok(bytes)
                    })
                }
                None => reader.map(|_| 0),
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
        found
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
            .collect()
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
