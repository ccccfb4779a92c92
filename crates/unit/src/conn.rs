//! One client connection: read a frame, have the handler
//! ([`crate::handler`]) plan the request, carry the plan out (the bytes it
//! moves: [`transfer`]), reply; repeat until the client leaves or
//! misbehaves.

use std::io::{self, BufRead, BufReader, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use stowage_core::{BlobId, Owner};
use stowage_wire::io::{drain, read_header, read_prefix, ReadError, Socket, SpinReader};
use stowage_wire::{encode, ErrorCode, Request, Response, PROTOCOL_VERSION};

use crate::auth::{Gate, Verdict};
use crate::handler::{self, error_response, Asker, Plan};
use crate::Shared;

mod transfer;

/// Who is at the other end of a connection, as the kernel says
/// (SO_PEERCRED, Unix sockets only).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Peer {
    pub(crate) uid: Option<u32>,
    pub(crate) pid: Option<i32>,
}

struct Conn {
    shared: Arc<Shared>,
    reader: BufReader<SpinReader>,
    writer: Socket,
    peer: Peer,
    /// A Unix-socket peer: it may be handed the slab.
    direct: bool,
    /// May send admin requests (shutdown, checkpoint).
    admin: bool,
    namespace: Option<String>,
    owner: Option<Owner>,
    /// The handshake before Hello (the shared secret's challenge).
    gate: Gate,
    /// The handshake, up to the Hello, must be done by then: a peer that
    /// has not proved anything holds no connection for long.
    handshake_deadline: Instant,
    /// Its place in the handshake pool, until it proves itself.
    ticket: Option<crate::admit::Ticket>,
    /// Its slot among the served connections, once it proved itself.
    slot: Option<crate::Counted>,
    /// The send timeout set on the socket.
    write_timeout: Duration,
    out: Vec<u8>,
    scratch: Vec<u8>,
    /// The current request was answered with an error (for metrics).
    failed: bool,
    /// When the current request's frame began to arrive (its deadline's
    /// base, and its latency's start: one clock read for both).
    frame_start: Instant,
    /// What this connection's requests record (`None`: metrics are off).
    counters: Option<crate::metrics::ConnCounters>,
}

/// Header and reply buffers grown past this by one large request are
/// given back once it is answered (a connection keeps no 64 MiB buffer
/// for its idle life).
const KEEP_BUFFER: usize = 1 << 20;

/// Serve one connection until it ends. `ticket`: its place in the
/// handshake pool; `accepted`: when it was accepted (its handshake's
/// deadline runs from there).
pub(crate) fn serve(
    shared: Arc<Shared>,
    stream: Socket,
    peer: Peer,
    ticket: crate::admit::Ticket,
    accepted: Instant,
) {
    let writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "cannot clone a connection's socket");
            return;
        }
    };
    let direct = matches!(stream, Socket::Unix(_));
    let admin = shared.admin_tcp || (direct && peer.uid == Some(shared.uid));
    // Replies that the peer does not take are cut off after this long.
    let write_timeout = shared.frame_timeout;
    let _ = writer.set_write_timeout(Some(write_timeout));
    let mut c = Conn {
        shared: shared.clone(),
        reader: BufReader::with_capacity(64 << 10, SpinReader::new(stream, shared.spin)),
        writer,
        peer,
        direct,
        admin,
        namespace: None,
        owner: None,
        gate: Gate::new(shared.secret.clone()),
        handshake_deadline: accepted + shared.handshake_timeout,
        ticket: Some(ticket),
        slot: None,
        write_timeout,
        out: Vec::with_capacity(4096),
        scratch: Vec::new(),
        failed: false,
        frame_start: Instant::now(),
        counters: crate::metrics::ConnCounters::attach(&shared),
    };
    // A panic while serving (a bug) ends the connection as the unit
    // cutting it would: what it holds is released by the same rules, and
    // its slots are given back.
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.run()));
    let end = match ran {
        Ok(Ok(())) => stowage_core::ConnEnd::Closed,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "connection ended");
            if e.is_cut() {
                stowage_core::ConnEnd::Cut
            } else {
                stowage_core::ConnEnd::Closed
            }
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(
                unit = %shared.name,
                panic = %what,
                "a connection's thread panicked; the connection is cut and what it holds released as for a cut connection"
            );
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
            let holds = core.detach(owner, end, now);
            (holds, !core.has_session(owner.session))
        };
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
                unit = %shared.name,
                session = owner.session.0,
                namespace = c.namespace.as_deref().unwrap_or(""),
                holds,
                cut = end == stowage_core::ConnEnd::Cut,
                "released the holds of an ended connection"
            );
        }
        if gone {
            tracing::info!(
                unit = %shared.name,
                session = owner.session.0,
                namespace = c.namespace.as_deref().unwrap_or(""),
                "session closed"
            );
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum EndReason {
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
    fn is_cut(&self) -> bool {
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
    fn run(&mut self) -> Result<(), EndReason> {
        let serving = self.shared.limits;
        let handshake = serving.handshake();
        loop {
            let open = self.gate.is_open();
            let limits = if open { serving } else { handshake };
            if open {
                if self.scratch.capacity() > KEEP_BUFFER {
                    self.scratch = Vec::new();
                }
                if self.out.capacity() > KEEP_BUFFER {
                    self.out = Vec::with_capacity(4096);
                }
                // An idle connection waits for its next frame as long as
                // it likes; once a frame has begun, the rest must come
                // within the frame timeout (a truncated frame never holds
                // a thread).
                self.reader.get_mut().deadline = None;
                if self.reader.fill_buf()?.is_empty() {
                    return Ok(());
                }
                self.frame_start = Instant::now();
                self.reader.get_mut().deadline = Some(self.frame_start + self.shared.frame_timeout);
            } else {
                // The handshake, from accept to Hello, within one frame
                // timeout.
                self.reader.get_mut().deadline = Some(self.handshake_deadline);
            }
            let prefix = match read_prefix(&mut self.reader, &limits) {
                Ok(Some(p)) => p,
                Ok(None) => return Ok(()),
                Err(ReadError::Io(e)) => return Err(e.into()),
                Err(ReadError::Wire(e)) if open => return self.refuse(0, e.to_string()),
                Err(ReadError::Wire(e)) => return self.pass_gate(0, Err(e)),
            };
            let env = match read_header::<_, Request>(&mut self.reader, &prefix, &mut self.scratch)
            {
                Ok(env) => env,
                Err(ReadError::Io(e)) => return Err(e.into()),
                Err(ReadError::Wire(e)) if open => return self.refuse(0, e.to_string()),
                Err(ReadError::Wire(e)) => return self.pass_gate(0, Err(e)),
            };
            if !open {
                // Handshake frames carry no payload (the limits say so).
                let frame = env.body.validate(&limits).map(|()| env.body);
                self.pass_gate(env.id, frame)?;
                continue;
            }
            if let Err(e) = env.body.validate(&limits) {
                return self.refuse(env.id, e.to_string());
            }
            let carries_payload = matches!(env.body, Request::Put { .. });
            if prefix.payload_len > 0 && !carries_payload {
                return self.refuse(env.id, "this request carries no payload".into());
            }
            self.handle(env.id, env.body, prefix.payload_len)?;
        }
    }

    /// A frame before the gate is open (see [`crate::auth`]).
    fn pass_gate(
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
                    tcp = !self.direct,
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
            let message = self.shared.cut_message(&t);
            let _ = self
                .writer
                .set_write_timeout(Some(Duration::from_millis(100)));
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

    /// Answer InvalidRequest and end the connection.
    fn refuse(&mut self, id: u64, message: String) -> Result<(), EndReason> {
        tracing::warn!(%message, "invalid request; closing the connection");
        let _ = self.reply(
            id,
            &Response::Error {
                code: ErrorCode::InvalidRequest,
                message: message.clone(),
            },
        );
        Err(EndReason::Invalid(message))
    }

    fn reply(&mut self, id: u64, r: &Response) -> io::Result<()> {
        if let Response::Error { code, message } = r {
            self.failed = true;
            if let Some(m) = &self.shared.metrics {
                m.error(*code);
            }
            if !matches!(code, ErrorCode::Busy | ErrorCode::Full) {
                tracing::debug!(unit = %self.shared.name, namespace = self.namespace.as_deref().unwrap_or(""), ?code, %message, "error answer");
            }
        }
        self.out.clear();
        encode(id, r, 0, &mut self.out).map_err(io::Error::other)?;
        self.writer.write_all(&self.out)
    }

    fn reply_error(&mut self, id: u64, code: ErrorCode, message: &str) -> Result<(), EndReason> {
        self.reply(
            id,
            &Response::Error {
                code,
                message: message.to_owned(),
            },
        )?;
        Ok(())
    }

    /// How long a transfer the request asks for may stall before the unit
    /// cuts it off: the caller's time left, within the unit's bounds.
    fn io_timeout(&self, timeout_ms: u64) -> Duration {
        if timeout_ms == 0 {
            return self.shared.frame_timeout;
        }
        Duration::from_millis(timeout_ms)
            .clamp(Duration::from_millis(10), self.shared.max_io_timeout)
    }

    fn set_write_timeout(&mut self, t: Duration) -> io::Result<()> {
        if t != self.write_timeout {
            self.writer.set_write_timeout(Some(t))?;
            self.write_timeout = t;
        }
        Ok(())
    }

    /// Handle one request, recording its kind, outcome and duration.
    fn handle(&mut self, id: u64, req: Request, payload_len: u64) -> Result<(), EndReason> {
        if self.counters.is_none() {
            return self.handle_request(id, req, payload_len);
        }
        let op = crate::metrics::Op::of(&req);
        // Before the gate opens, frames are not timed from their start.
        if !self.gate.is_open() {
            self.frame_start = Instant::now();
        }
        self.failed = false;
        let r = self.handle_request(id, req, payload_len);
        if let Some(m) = &self.counters {
            let ok = r.is_ok() && !self.failed;
            if op == crate::metrics::Op::Unpin {
                // A release the client sends and does not wait for
                // (same-host gets): counted, not timed.
                m.count(op, ok);
            } else {
                m.op(op, ok, self.frame_start.elapsed());
            }
        }
        r
    }

    /// Plan the request in the handler, then carry the plan out: this is
    /// where the bytes move.
    fn handle_request(
        &mut self,
        id: u64,
        req: Request,
        payload_len: u64,
    ) -> Result<(), EndReason> {
        let asker = Asker {
            hello: self.owner.zip(self.namespace.as_deref()),
            admin: self.admin,
            stopping: self.shared.stop.load(std::sync::atomic::Ordering::SeqCst),
        };
        let now = self.shared.now();
        let plan = handler::handle(|| self.shared.core(), &asker, req, payload_len, now);
        let resp = match plan {
            Plan::Reply(r) => r,
            Plan::Silent => return Ok(()),
            Plan::Committed {
                blob,
                reply,
                shm_bytes,
            } => self.committed(blob, reply, shm_bytes),
            Plan::Drain {
                len,
                put_timeout_ms,
                reply,
            } => {
                if let Some(t) = put_timeout_ms {
                    let timeout = self.io_timeout(t);
                    self.reader.get_mut().deadline = Some(Instant::now() + timeout);
                }
                drain(&mut self.reader, len)?;
                reply
            }
            Plan::Receive(put) => return self.receive(id, put),
            Plan::Resolved { pin, found } => self.resolved(pin, found),
            Plan::Send(read) => return self.send(id, read),
            Plan::Hello {
                namespace,
                want_fd,
                session,
            } => return self.hello(id, namespace, want_fd, session),
            Plan::Stats => Response::Stats(self.shared.stats()),
            Plan::NixlInfo {
                owner,
                agent,
                agent_metadata,
            } => match &self.shared.nixl {
                // From here on the peer's transfers touch the slab by
                // themselves: its holds outlive the connection's end,
                // however it ends, until its agent is invalidated and
                // the nixl quarantine has passed (docs/fencing.md).
                Some(n) => {
                    match self
                        .shared
                        .map_session(owner, self.peer, &agent, &agent_metadata)
                    {
                        Ok(()) => Response::NixlInfo {
                            metadata: n.metadata.clone(),
                            slab_addr: n.slab_addr,
                        },
                        Err(e) => handler::error_response(&e),
                    }
                }
                None => Response::Error {
                    code: ErrorCode::InvalidRequest,
                    message: "this unit does not serve nixl (start it with --nixl)".into(),
                },
            },
            Plan::Checkpoint { dir } => self.checkpoint(&dir),
            Plan::Shutdown { timeout } => {
                let problems = self.shared.shut_down(timeout);
                self.reply(id, &Response::ShutDown { problems })?;
                self.shared.request_exit();
                return Err(EndReason::Shutdown);
            }
            Plan::Close { reply, reason } => {
                self.reply(id, &reply)?;
                return Err(EndReason::Invalid(reason));
            }
            Plan::Refuse(message) => return self.refuse(id, message),
        };
        self.reply(id, &resp)?;
        Ok(())
    }

    /// A Commit's reply: a put answered Pending whose file then failed is
    /// gone from the core, so say what happened to it rather than "unknown
    /// blob"; bytes a client wrote through its mapping are counted once
    /// published.
    fn committed(&self, blob: BlobId, reply: Response, shm_bytes: u64) -> Response {
        let reply = match (&reply, &self.shared.disk) {
            (
                Response::Error {
                    code: ErrorCode::UnknownBlob,
                    ..
                },
                Some(d),
            ) => match d.failed_put(blob) {
                Some((code, message)) => Response::Error { code, message },
                None => reply,
            },
            _ => reply,
        };
        if shm_bytes > 0
            && matches!(
                reply,
                Response::Done | Response::Pending | Response::CommittedSpare { .. }
            )
        {
            if let Some(m) = &self.counters {
                m.bytes_in(crate::metrics::Transport::Shm, shm_bytes);
            }
        }
        reply
    }

    fn checkpoint(&mut self, dir: &str) -> Response {
        // (The handler checked that an admin asks, and that the unit was
        // not stopping then; it may have begun to since.)
        if self.shared.stop.load(std::sync::atomic::Ordering::SeqCst) {
            return Response::Error {
                code: ErrorCode::Internal,
                message: "the unit is shutting down".into(),
            };
        }
        let dir = match crate::checkpoint::resolve_dir(self.shared.checkpoint_root.as_deref(), dir)
        {
            Ok(d) => d,
            Err(message) => {
                return Response::Error {
                    code: ErrorCode::Unauthorized,
                    message,
                }
            }
        };
        self.shared
            .checkpoints
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let t0 = Instant::now();
        let r = crate::checkpoint::write(&self.shared, &dir);
        self.shared
            .checkpoints
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        if let Some(m) = &self.shared.metrics {
            m.checkpoint(r.is_ok(), t0.elapsed());
        }
        match &r {
            Ok(info) => tracing::info!(
                unit = %self.shared.name,
                dir = %dir.path.display(),
                rows = info.rows,
                entries = info.entries,
                bytes = info.bytes,
                seconds = t0.elapsed().as_secs_f64(),
                "checkpoint written"
            ),
            Err(e) => tracing::warn!(
                unit = %self.shared.name,
                dir = %dir.path.display(),
                error = %e,
                "checkpoint failed"
            ),
        }
        match r {
            Ok(info) => Response::Checkpointed(info),
            Err(e) => Response::Error {
                code: ErrorCode::Internal,
                message: e.to_string(),
            },
        }
    }

    /// A Hello of the right version: join (or open) the session, and hand
    /// a Unix-socket peer that wants it the slab's memfd with the reply.
    fn hello(
        &mut self,
        id: u64,
        namespace: String,
        want_fd: bool,
        session: Option<u128>,
    ) -> Result<(), EndReason> {
        // A peer that is handed the slab (now, or on an earlier connection
        // of its session) may copy by itself: its holds follow the rules
        // for direct peers.
        let maps = want_fd && self.direct;
        let (token, owner) = match self
            .shared
            .join_session(session, self.peer, maps, &namespace)
        {
            Ok(j) => j,
            Err(e) => {
                self.reply(id, &error_response(&e))?;
                return Err(EndReason::Invalid(format!("session refused: {e}")));
            }
        };
        self.owner = Some(owner);
        self.namespace = Some(namespace);
        let attach = want_fd && self.direct;
        let r = Response::Hello {
            version: PROTOCOL_VERSION,
            instance_id: self.shared.instance_id,
            slab_bytes: self.shared.slab.len(),
            fd_attached: attach,
            session: token,
        };
        self.out.clear();
        encode(id, &r, 0, &mut self.out).map_err(io::Error::other)?;
        match &self.writer {
            Socket::Unix(s) if attach => {
                let sent = stowage_shm::send_with_fd(s, &self.out, self.shared.slab.fd())?;
                let rest = self.out[sent..].to_vec();
                self.writer.write_all(&rest)?;
            }
            _ => {
                let out = std::mem::take(&mut self.out);
                self.writer.write_all(&out)?;
                self.out = out;
            }
        }
        Ok(())
    }
}
