//! A connection's life around its requests: from accept, through the
//! handshake gate ([`crate::auth`]) and Hello (which joins it to its
//! session), to its end, when what it holds is released by the core's
//! rules for how it ended ([`EndReason`]).

use std::io;
use std::sync::Arc;
use std::time::Instant;

use stowage_wire::io::{Socket, SpinReader};
use stowage_wire::{encode, ErrorCode, Request, Response, PROTOCOL_VERSION};

use super::inbuf::InBuf;
use super::state::Conn;
use crate::auth::{Gate, Verdict};
use crate::sessions;
use crate::sessions::Peer;
use crate::shared::Shared;

/// A connection, from accept: its state, waiting in the handshake pool
/// (`ticket`) until it proves itself; `accepted`: when it was accepted
/// (its handshake's deadline runs from there).
pub(crate) fn open(
    shared: Arc<Shared>,
    stream: Socket,
    peer: Peer,
    ticket: crate::admit::Ticket,
    accepted: Instant,
) -> Box<Conn> {
    let unix = matches!(stream, Socket::Unix(_));
    let admin = shared.settings.admin_tcp || (unix && peer.uid == Some(shared.settings.uid));
    // Replies that the peer does not take are cut off after this long
    // (the pool's sends; the workers' never wait).
    let write_timeout = shared.settings.frame_timeout;
    let _ = stream.set_write_timeout(Some(write_timeout));
    Box::new(Conn {
        shared: shared.clone(),
        reader: InBuf::new(SpinReader::new(stream, shared.settings.spin)),
        peer,
        unix,
        admin,
        namespace: None,
        owner: None,
        gate: Gate::new(shared.settings.secret.clone()),
        handshake_deadline: accepted + shared.settings.handshake_timeout,
        ticket: Some(ticket),
        slot: None,
        write_timeout,
        out: Vec::new(),
        out_since: None,
        scratch: Vec::new(),
        failed: false,
        frame_start: Instant::now(),
        metrics: shared.metrics.is_some(),
        blocking: false,
        parked: None,
        maps: false,
        ring: None,
        via_ring: false,
        kicked: false,
        waiting: None,
        wait_started: false,
        entry: Vec::new(),
        charge: shared.budget.charge(),
        reserve: 0,
        starved: None,
        frame_paused: std::time::Duration::ZERO,
        epoch: crate::plane::Plane::first(),
    })
}

/// How serving a connection ended.
pub(crate) enum Ended {
    Ran(Result<(), EndReason>),
    /// Serving it panicked (a bug), with this message.
    Panicked(String),
}

impl Ended {
    pub(crate) fn panicked(panic: Box<dyn std::any::Any + Send>) -> Ended {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Ended::Panicked(what)
    }
}

/// The connection ended: what it holds is released by the core's rules
/// for how it ended ([`EndReason::is_cut`]); a panic while serving it (a
/// bug) ends it as the unit cutting it would, and its slots are given
/// back.
pub(crate) fn finish(mut c: Box<Conn>, ended: Ended) {
    let shared = c.shared.clone();
    let end = match ended {
        Ended::Ran(Ok(())) => stowage_core::ConnEnd::Closed,
        Ended::Ran(Err(e)) => {
            tracing::debug!(error = %e, "connection ended");
            if e.is_cut() {
                stowage_core::ConnEnd::Cut
            } else {
                stowage_core::ConnEnd::Closed
            }
        }
        Ended::Panicked(what) => {
            tracing::error!(
                unit = %shared.settings.name,
                panic = %what,
                "serving a connection panicked; the connection is cut and what it holds released as for a cut connection"
            );
            c.blocking = false;
            let _ = c.reply(
                0,
                &Response::Error {
                    code: ErrorCode::Internal,
                    message: "the unit failed serving this connection and cut it".into(),
                },
            );
            stowage_core::ConnEnd::Cut
        }
    };
    c.end_handshake(&end);
    if let Some(owner) = c.owner {
        let now = shared.now();
        let (holds, gone) = {
            let mut core = shared.core();
            let holds = core.conn_ended(owner, end, now);
            (holds, !core.has_session(owner.session))
        };
        // Its waiting claim was dropped by the core: nothing is answered.
        shared.conns.answers.forget(owner.conn);
        // A nixl connection's holds outlive it: fenced once its client's
        // agent has no connection left.
        shared.nixl_conn_ended(owner);
        if let Some(m) = &shared.metrics {
            let why = match end {
                stowage_core::ConnEnd::Closed => crate::metrics::Reclaim::Closed,
                stowage_core::ConnEnd::Cut => crate::metrics::Reclaim::Cut,
            };
            m.reclaimed(why, holds);
        }
        if holds > 0 {
            tracing::info!(
                unit = %shared.settings.name,
                session = owner.session.0,
                namespace = c.namespace.as_deref().unwrap_or(""),
                holds,
                cut = end == stowage_core::ConnEnd::Cut,
                "released the holds of an ended connection"
            );
        }
        if gone {
            tracing::info!(
                unit = %shared.settings.name,
                session = owner.session.0,
                namespace = c.namespace.as_deref().unwrap_or(""),
                "session closed"
            );
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum EndReason {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error("closed after an invalid request: {0}")]
    Invalid(String),
    #[error("the unit is shutting down")]
    Shutdown,
    #[error("turned away: {0}")]
    Busy(String),
}

impl EndReason {
    /// Whether the unit ended the connection (the peer may still be
    /// running) rather than the peer closing it.
    pub(super) fn is_cut(&self) -> bool {
        match self {
            EndReason::Io(e) => matches!(
                e.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            ),
            EndReason::Invalid(_) | EndReason::Shutdown | EndReason::Busy(_) => true,
        }
    }
}

impl Conn {
    /// A frame before the gate is open (see [`crate::auth`]).
    pub(super) fn pass_gate(
        &mut self,
        id: u64,
        frame: Result<Request, stowage_wire::WireError>,
    ) -> Result<(), EndReason> {
        let verdict = self.gate.step(frame, stowage_wire::auth::fresh_nonce);
        if self.ticket.is_some() && (self.gate.proven() || self.gate.is_open()) {
            // Proved (the secret, or without one its Hello): from the
            // handshake pool to the served connections, before anything is
            // served.
            let proved = match &self.ticket {
                Some(t) => self.shared.prove(t),
                None => unreachable!("checked above"),
            };
            match proved {
                Ok(slot) => {
                    self.slot = Some(slot);
                    self.ticket = None;
                }
                Err(message) => {
                    let _ = self.reply(
                        id,
                        &Response::Error {
                            code: ErrorCode::Busy,
                            message: message.clone(),
                        },
                    );
                    self.ticket = None;
                    return Err(EndReason::Busy(message));
                }
            }
        }
        match verdict {
            Verdict::Reply(r) => Ok(self.reply(id, &r)?),
            Verdict::Next => Ok(()),
            Verdict::Serve(req) => self.handle(id, req, 0),
            Verdict::Refuse(r) => {
                let why = match &r {
                    Response::Error { message, .. } => message.clone(),
                    _ => String::new(),
                };
                tracing::warn!(
                    uid = ?self.peer.uid,
                    pid = ?self.peer.pid,
                    tcp = !self.unix,
                    reason = %why,
                    "refused a connection before its Hello"
                );
                let _ = self.reply(id, &r);
                Err(EndReason::Invalid(why))
            }
        }
    }

    /// The connection ended (`end`) with its handshake unfinished: tell a
    /// peer whose handshake was cut to admit another why, and count a
    /// handshake that ran out of time.
    fn end_handshake(&mut self, end: &stowage_core::ConnEnd) {
        let Some(t) = self.ticket.take() else {
            return;
        };
        if t.cut().is_some() {
            // Told as far as its socket takes it now; nobody waits on it.
            let message = self.shared.cut_message(&t);
            self.blocking = false;
            let _ = self.reply(
                0,
                &Response::Error {
                    code: ErrorCode::Busy,
                    message,
                },
            );
        } else if *end == stowage_core::ConnEnd::Cut && Instant::now() >= self.handshake_deadline {
            if let Some(m) = &self.shared.metrics {
                m.handshake_timed_out();
            }
        }
    }

    /// A Hello of the right version: join (or open) the session, and hand
    /// a Unix-socket peer that wants it the slab's memfd with the reply.
    pub(super) fn hello(
        &mut self,
        id: u64,
        namespace: String,
        want_fd: bool,
        session: Option<u128>,
    ) -> Result<(), EndReason> {
        // A peer that is handed the slab (now, or on an earlier connection
        // of its session) may copy by itself: its holds follow the rules
        // for mapped peers.
        let maps = want_fd && self.unix;
        let (token, owner) = match self
            .shared
            .join_session(session, self.peer, maps, &namespace)
        {
            Ok(j) => j,
            Err(r) => {
                self.reply(id, &r)?;
                let why = match r {
                    Response::Error { message, .. } => message,
                    _ => String::new(),
                };
                return Err(EndReason::Invalid(format!("session refused: {why}")));
            }
        };
        self.owner = Some(owner);
        self.namespace = Some(namespace);
        self.maps = maps;
        let attach = want_fd && self.unix;
        let r = Response::Hello {
            version: PROTOCOL_VERSION,
            instance_id: self.shared.settings.instance_id,
            slab_bytes: self.shared.slab.len(),
            fd_attached: attach,
            session: token,
        };
        if !attach {
            return Ok(self.reply(id, &r)?);
        }
        // (On the pool: everything before it was sent.)
        let mut out = Vec::new();
        encode(id, &r, 0, &mut out).map_err(io::Error::other)?;
        let sent = match &self.reader.src.socket {
            Socket::Unix(s) => stowage_shm::send_with_fd(s, &out, self.shared.slab.fd())?,
            Socket::Tcp(_) => 0,
        };
        self.out.extend_from_slice(&out[sent..]);
        if self.blocking {
            self.flush_blocking()?;
        } else {
            self.flush_ready()?;
        }
        Ok(())
    }
}

impl Shared {
    /// Join the session `token` names, or start a new one, and attach a
    /// connection to it ([`sessions::Sessions::join`]).
    pub(crate) fn join_session(
        &self,
        token: Option<u128>,
        peer: Peer,
        maps: bool,
        namespace: &str,
    ) -> Result<(u128, stowage_core::Owner), stowage_wire::Response> {
        let ctx = sessions::JoinCtx {
            max_sessions: self.settings.max_sessions,
            name: &self.settings.name,
            metrics: self.metrics.as_deref(),
            now: self.now(),
        };
        self.sessions
            .join(|| self.core(), &ctx, token, peer, maps, namespace)
    }
}
