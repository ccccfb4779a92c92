//! Each unit's connections: a bounded pool shared by the client's threads,
//! opened on first use (shm, nixl or tcp), checked out by an operation and
//! checked back in after it; what the client knows of each unit (its
//! instance, session and slab mapping).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use stowage_shm::Slab;
use stowage_wire::ErrorCode;

use crate::conn::Conn;
use crate::failure::Failure;
use crate::one_sided::{OneSided, ShmTransport};
use crate::transport::{TcpTransport, Transport};
use crate::{fanout, lock, nixl, Client, UnitAddr};

pub(crate) struct UnitSlot {
    pub(crate) addr: UnitAddr,
    /// The connections to the unit: idle ones, and how many are open.
    pub(crate) pool: Mutex<Pool>,
    /// Signalled when a connection is checked in or closed: a thread
    /// waiting for one to come free looks again.
    pub(crate) freed: Condvar,
    /// Whether a connection to the unit was ever made. Until then a
    /// failed connection is reported as connecting reports it
    /// ([`Error::Unreachable`]): this client has nothing there to lose.
    pub(crate) reached: AtomicBool,
    /// The slab mapping of the current instance, shared by its connections.
    pub(crate) slab: Mutex<Option<(u128, Arc<Slab>)>>,
    /// What this client knows of the unit: the instance it last met at
    /// this address, and whether a restart was seen and not yet reported.
    pub(crate) instance: Mutex<Instance>,
    /// The session this client's connections to the unit share.
    pub(crate) session: Mutex<Option<u128>>,
    /// The connection on which views pin their values. Each [`View`] keeps
    /// the connection it pinned on alive (a failure elsewhere never drops
    /// it); a broken one is replaced here for later views.
    pub(crate) view_conn: Mutex<Option<ViewConn>>,
    /// The connection a dropped view last sent its unpins on (they have no
    /// answer): a put refused for this client's own views waits for the
    /// unit to read them with a round trip on it. Weak: it keeps nothing
    /// open.
    pub(crate) unpinned_on: Mutex<Option<WeakViewConn>>,
    /// The transport of the last connection opened to it.
    pub(crate) transport: Mutex<Option<&'static str>>,
}

impl UnitSlot {
    /// A unit at `addr` not reached yet, expected to be `instance`.
    pub(crate) fn new(addr: UnitAddr, instance: Option<u128>) -> Self {
        UnitSlot {
            addr,
            pool: Mutex::new(Pool::default()),
            freed: Condvar::new(),
            reached: AtomicBool::new(false),
            slab: Mutex::new(None),
            instance: Mutex::new(Instance {
                current: instance,
                lost: None,
            }),
            session: Mutex::new(None),
            view_conn: Mutex::new(None),
            unpinned_on: Mutex::new(None),
            transport: Mutex::new(None),
        }
    }
}

/// The connections a client holds to one unit ([`Client::connections`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitConnections {
    /// Open: idle, in use by an operation, or being opened; at most
    /// [`ClientConfig::max_unit_conns`](crate::ClientConfig::max_unit_conns).
    pub open: usize,
    /// Open and in use by no operation.
    pub idle: usize,
}

/// A unit's pooled connections.
#[derive(Default)]
pub(crate) struct Pool {
    /// Connections no operation is using.
    pub(crate) idle: Vec<Box<dyn Transport>>,
    /// Connections open to the unit: idle, checked out, or being opened
    /// (at most [`ClientConfig::max_unit_conns`](crate::ClientConfig::max_unit_conns)).
    pub(crate) open: usize,
    /// Threads waiting on `freed` for a connection: only then does a
    /// connection given back wake one (a notify is a system call).
    pub(crate) waiters: usize,
}

/// A connection checked out of a unit's pool ([`Client::checkout`]): it
/// goes back with [`Client::checkin`]; dropped otherwise (a broken
/// connection), it is closed and its place in the unit's bound freed.
pub(crate) struct Lease<'a> {
    pub(crate) slot: &'a UnitSlot,
    /// `None` while it is being opened.
    pub(crate) t: Option<Box<dyn Transport>>,
    /// Checked in: still open, counted in the pool.
    pub(crate) pooled: bool,
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

/// A connection shared by the views that pinned through it.
pub(crate) type ViewConn = Arc<Mutex<Box<dyn Transport>>>;

/// A handle on a [`ViewConn`] that keeps nothing open.
pub(crate) type WeakViewConn = std::sync::Weak<Mutex<Box<dyn Transport>>>;

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Instance {
    pub(crate) current: Option<u128>,
    /// The instance before a restart this client saw, until an operation
    /// reports that restart (missing keys then are lost keys).
    pub(crate) lost: Option<u128>,
}

impl Client {
    /// [`ClientConfig::max_unit_conns`](crate::ClientConfig::max_unit_conns), at least one.
    pub(crate) fn max_conns(&self) -> usize {
        self.cfg.max_unit_conns.max(1)
    }

    pub(crate) fn open(
        &self,
        unit: usize,
        deadline: Instant,
    ) -> std::result::Result<Box<dyn Transport>, Failure> {
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
        };
        // The first connection (no session yet) is made under the session's
        // lock, so that threads opening at once join one session rather
        // than each start their own.
        let mut known = lock(&slot.session);
        let mut conn = match *known {
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
        let view = self.plane_epoch();
        self.speak_for_view(unit, &mut conn, deadline)?;
        if self.plane_epoch() != view {
            // The plane's view changed as this connection opened: the
            // operation opening it was placed in the old one. It is asked
            // again where the copies are now (a copy written here would be
            // one no client reads).
            return Err(Failure::Refused(
                ErrorCode::Stale,
                "the plane's view changed as the connection opened (a unit rejoined)".into(),
            ));
        }
        conn.ring_when(self.cfg.rings.then_some(self.cfg.ring_after));
        slot.reached.store(true, Ordering::Release);
        self.met_instance(unit, conn.instance_id);
        if let Some(s) = &conn.slab {
            *lock(&slot.slab) = Some((conn.instance_id, s.clone()));
        }
        let t: Box<dyn Transport> = match (&self.nixl, want_fd) {
            (_, true) => match ShmTransport::new(conn, self.cfg.spare_max) {
                Some(t) => Box::new(t),
                None => return Err(Failure::Protocol("the unit handed over no slab".into())),
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
    pub(crate) fn open_nixl(
        &self,
        unit: usize,
        n: &nixl::NixlClient,
        mut conn: Conn,
        deadline: Instant,
    ) -> std::result::Result<Box<dyn Transport>, Failure> {
        // The unit learns this client's agent, to invalidate it once this
        // client's last connection to it has ended. Without an agent (NIXL
        // cannot run here) the unit's answer still tells whether it serves
        // nixl: the mover then fails, or the connection is tcp.
        let (agent, agent_metadata) = n.introduction().unwrap_or_default();
        let ask = stowage_wire::Request::NixlInfo {
            agent,
            agent_metadata,
        };
        let id = conn.send(&ask, &mut [], deadline)?;
        match conn.recv(id, deadline)? {
            stowage_wire::Response::NixlInfo {
                metadata,
                slab_addr,
            } => {
                let mover = n
                    .mover(&metadata, slab_addr)
                    .map_err(|e| Failure::invalid(format!("nixl: {e}")))?;
                Ok(Box::new(OneSided::with_mover(
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
            stowage_wire::Response::Error { code, message } => Err(Failure::Refused(code, message)),
            other => Err(Failure::Protocol(format!(
                "unexpected reply to NixlInfo: {other:?}"
            ))),
        }
    }

    /// A connection reached `instance` at unit `unit`'s address. A new
    /// instance means the old one is gone with its memory: its pooled
    /// connections and slab mapping are dropped, and the restart is noted
    /// for the next operation to report.
    pub(crate) fn met_instance(&self, unit: usize, instance: u128) {
        let slot = &self.units[unit];
        let mut i = lock(&slot.instance);
        match i.current {
            Some(c) if c != instance => {
                i.lost = Some(c);
                i.current = Some(instance);
                drop(i);
                self.unit_down(unit);
                self.forget_instance(unit, Some(instance));
            }
            Some(_) => {}
            None => i.current = Some(instance),
        }
    }

    /// Drop everything this client holds of unit `unit` other than
    /// `keep` (an instance): pooled connections and the slab mapping, so a
    /// dead unit's memory is unmapped. Views keep their own mapping.
    pub(crate) fn forget_instance(&self, unit: usize, keep: Option<u128>) {
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
    pub(crate) fn take_restart(&self, unit: usize) -> bool {
        lock(&self.units[unit].instance).lost.take().is_some()
    }

    /// A connection to unit `unit`: an idle one from its pool, else a new
    /// one while fewer than [`ClientConfig::max_unit_conns`](crate::ClientConfig::max_unit_conns) are open,
    /// else the first to come free before `deadline`. While it waits, the
    /// other units' parts of the call go on (a part alone blocks), so
    /// threads holding connections to several units never wait on each
    /// other in a cycle.
    pub(crate) async fn checkout(
        &self,
        unit: usize,
        deadline: Instant,
    ) -> std::result::Result<Lease<'_>, Failure> {
        let slot = &self.units[unit];
        let mut nap = Duration::from_micros(50);
        loop {
            let now = Instant::now();
            // Whether to open one (its place taken), else to let the other
            // parts run a while; the pool's lock is never held across that.
            let open_one = {
                let mut p = lock(&slot.pool);
                // A connection of an older view of the plane is closed:
                // its row requests would be refused.
                let epoch = self.plane_epoch();
                while let Some(t) = p.idle.pop() {
                    if t.epoch() == epoch {
                        return Ok(Lease {
                            slot,
                            t: Some(t),
                            pooled: false,
                        });
                    }
                    p.open = p.open.saturating_sub(1);
                }
                if p.open < self.max_conns() {
                    p.open += 1;
                    true
                } else if now >= deadline {
                    return Err(Failure::NoFreeConnection);
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
                lease.t = Some(self.open(unit, deadline)?);
                return Ok(lease);
            }
            fanout::pause_until((now + nap).min(deadline)).await;
            nap = (nap * 2).min(Duration::from_millis(5));
        }
    }

    pub(crate) fn checkin(&self, unit: usize, mut lease: Lease<'_>) {
        // A connection to an instance this client has since seen replaced
        // is not pooled again (it is closed): its next failure would be
        // judged against the new instance.
        let current = lock(&self.units[unit].instance).current;
        let Some(t) = lease.t.take() else { return };
        if current.is_some_and(|c| c != t.instance_id()) || t.epoch() != self.plane_epoch() {
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
}
