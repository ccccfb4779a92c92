//! One client connection: read a frame, act on the core and the slab,
//! reply; repeat until the client leaves or misbehaves.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::fd::AsFd;
use stowage_core::{Allocated, BlobId, Committed, Owner};
use stowage_shm::Piece;
use stowage_wire::io::{drain, read_header, read_prefix, ReadError, Socket, SpinReader};
use stowage_wire::{encode, ErrorCode, Found, Item, Request, Response, PROTOCOL_VERSION};

use crate::auth::{Gate, Verdict};
use crate::disk::DiskEngine;
use crate::handler::{error_response, scope, Handled};
use crate::{Served, Shared};

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
            let holds = core.conn_ended(owner, end, now);
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
enum ConnEnd {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error("closed after an invalid request: {0}")]
    Invalid(String),
    #[error("the unit is shutting down")]
    Shutdown,
    #[error("turned away: {0}")]
    Busy(String),
}

impl ConnEnd {
    /// Whether the unit ended the connection (the peer may still be
    /// running) rather than the peer closing it.
    fn is_cut(&self) -> bool {
        match self {
            ConnEnd::Io(e) => matches!(
                e.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            ),
            ConnEnd::Invalid(_) | ConnEnd::Shutdown | ConnEnd::Busy(_) => true,
        }
    }
}

impl Conn {
    fn run(&mut self) -> Result<(), ConnEnd> {
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
    ) -> Result<(), ConnEnd> {
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
                    return Err(ConnEnd::Busy(message));
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
                Err(ConnEnd::Invalid(why))
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
    fn refuse(&mut self, id: u64, message: String) -> Result<(), ConnEnd> {
        tracing::warn!(%message, "invalid request; closing the connection");
        let _ = self.reply(
            id,
            &Response::Error {
                code: ErrorCode::InvalidRequest,
                message: message.clone(),
            },
        );
        Err(ConnEnd::Invalid(message))
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

    fn reply_error(&mut self, id: u64, code: ErrorCode, message: &str) -> Result<(), ConnEnd> {
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
    fn handle(&mut self, id: u64, req: Request, payload_len: u64) -> Result<(), ConnEnd> {
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

    fn handle_request(&mut self, id: u64, req: Request, payload_len: u64) -> Result<(), ConnEnd> {
        let (ns, owner) = match (&self.namespace, self.owner, &req) {
            (None, _, Request::Hello { .. }) => {
                let Request::Hello {
                    version,
                    namespace,
                    want_fd,
                    session,
                } = req
                else {
                    unreachable!("matched a Hello");
                };
                return self.hello(id, version, namespace, want_fd, session);
            }
            (Some(_), _, Request::Hello { .. }) => {
                return self.refuse(id, "Hello was already said on this connection".into())
            }
            (Some(ns), Some(owner), _) => (ns.clone(), owner),
            _ => {
                self.reply_error(id, ErrorCode::Unauthorized, crate::auth::HELLO_FIRST)?;
                return Err(ConnEnd::Invalid("no Hello".into()));
            }
        };
        let now = self.shared.now();
        // A put written into a spare starts with its commit: new work too.
        let writes = match &req {
            Request::Alloc { .. } | Request::Put { .. } | Request::Checkpoint { .. } => true,
            Request::CommitSpare { blob, written, .. } => blob != written,
            _ => false,
        };
        let stopping = self.shared.stop.load(std::sync::atomic::Ordering::SeqCst);
        if writes && stopping {
            if payload_len > 0 {
                drain(&mut self.reader, payload_len)?;
            }
            return self.reply_error(id, ErrorCode::Internal, "the unit is shutting down");
        }
        // A put under way when the unit began to stop may finish; it gets
        // no spare for another.
        let req = match req {
            Request::CommitSpare {
                blob,
                partition,
                entries,
                ..
            } if stopping => Request::Commit {
                blob,
                partition,
                entries,
            },
            other => other,
        };
        // Bytes a client wrote through its mapping, published by a commit.
        let committed_bytes = match (&self.shared.metrics, &req) {
            // Checked: lengths are validated against the blob only by the
            // core, below (the frame's validation bounds their sum too).
            (Some(_), Request::Commit { entries, .. } | Request::CommitSpare { entries, .. }) => {
                entries
                    .iter()
                    .try_fold(0u64, |sum, e| sum.checked_add(e.len))
                    .unwrap_or(0)
            }
            _ => 0,
        };
        let committing = match &req {
            Request::Commit { blob, .. } | Request::CommitSpare { blob, .. } => Some(*blob),
            _ => None,
        };
        let mut handled = {
            let mut core = self.shared.core();
            crate::handler::handle(&mut core, owner, &ns, req, now)
        };
        // A put answered Pending whose file then failed is gone from the
        // core: say what happened to it rather than "unknown blob".
        if let (
            Some(blob),
            Some(d),
            Handled::Reply(Response::Error {
                code: ErrorCode::UnknownBlob,
                ..
            }),
        ) = (committing, &self.shared.disk, &handled)
        {
            if let Some((code, message)) = d.failed_put(blob) {
                handled = Handled::Reply(Response::Error { code, message });
            }
        }
        let resp = match handled {
            Handled::Reply(r) => {
                if committed_bytes > 0
                    && matches!(
                        r,
                        Response::Done | Response::Pending | Response::CommittedSpare { .. }
                    )
                {
                    if let Some(m) = &self.counters {
                        m.bytes_in(crate::metrics::Transport::Shm, committed_bytes);
                    }
                }
                r
            }
            Handled::Silent => return Ok(()),
            Handled::Resolved(pin, found) => self.resolved(pin, found),
            Handled::Other(req) => match req {
                Request::Stats => Response::Stats(self.shared.stats()),
                Request::NixlInfo {
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
                            Err(e) => error_response(&e),
                        }
                    }
                    None => Response::Error {
                        code: ErrorCode::InvalidRequest,
                        message: "this unit does not serve nixl (start it with --nixl)".into(),
                    },
                },
                Request::Put {
                    blob,
                    partition,
                    entries,
                    timeout_ms,
                } => {
                    let t = self.io_timeout(timeout_ms);
                    return self.put(
                        id,
                        owner,
                        &scope(&ns, &partition),
                        blob,
                        entries,
                        payload_len,
                        t,
                    );
                }
                Request::Read {
                    partition,
                    keys,
                    timeout_ms,
                } => {
                    let t = self.io_timeout(timeout_ms);
                    return self.read(id, owner, &scope(&ns, &partition), keys, t);
                }
                Request::Checkpoint { dir } => self.checkpoint(&dir),
                Request::Shutdown { timeout_ms } => {
                    if !self.admin {
                        return self.reply_error(id, ErrorCode::Unauthorized, NOT_ADMIN);
                    }
                    let problems = self
                        .shared
                        .shut_down(std::time::Duration::from_millis(timeout_ms));
                    self.reply(id, &Response::ShutDown { problems })?;
                    self.shared.request_exit();
                    return Err(ConnEnd::Shutdown);
                }
                other => {
                    return self.refuse(id, format!("unexpected request {other:?}"));
                }
            },
        };
        self.reply(id, &resp)?;
        Ok(())
    }

    fn checkpoint(&mut self, dir: &str) -> Response {
        if !self.admin {
            return Response::Error {
                code: ErrorCode::Unauthorized,
                message: NOT_ADMIN.into(),
            };
        }
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

    /// A Resolve's reply: spilled values are brought back into the slab
    /// where there is room (the pin holds them meanwhile).
    fn resolved(
        &mut self,
        pin: Option<stowage_core::PinId>,
        found: Vec<Option<stowage_core::Located>>,
    ) -> Response {
        // Promotion copies through a buffer of the read budget; when none
        // is free soon, the values stay on disk and the client reads them
        // with a Read, which waits for one.
        let has_disk = found
            .iter()
            .flatten()
            .any(|(p, _)| matches!(p, stowage_core::Place::Disk { .. }));
        let mut buf = match &self.shared.disk {
            Some(d) if has_disk => d.reads.take(Instant::now() + Duration::from_millis(50)),
            _ => None,
        };
        let found = self.shared.bring_back(found, buf.as_deref_mut(), false);
        drop(buf);
        if let Some(m) = &self.counters {
            let bytes = found
                .iter()
                .map(|f| match f {
                    Some(Served::Memory(l, _)) => l.len,
                    _ => 0,
                })
                .sum();
            m.bytes_out(crate::metrics::Transport::Shm, bytes);
        }
        let mut bad = Vec::new();
        let found = found
            .into_iter()
            .enumerate()
            .map(|(i, f)| match f? {
                Served::Memory(l, meta) => Some(Found {
                    offset: l.offset,
                    len: l.len,
                    meta,
                    on_disk: false,
                }),
                Served::Disk { len, meta, .. } => Some(Found {
                    offset: 0,
                    len,
                    meta,
                    on_disk: true,
                }),
                Served::Corrupt => {
                    bad.push(i as u32);
                    None
                }
            })
            .collect();
        Response::Resolved {
            pin,
            found,
            corrupt: bad,
        }
    }

    fn hello(
        &mut self,
        id: u64,
        version: u16,
        namespace: String,
        want_fd: bool,
        session: Option<u128>,
    ) -> Result<(), ConnEnd> {
        if version != PROTOCOL_VERSION {
            self.reply_error(
                id,
                ErrorCode::VersionMismatch,
                &format!("unit speaks protocol {PROTOCOL_VERSION}, client {version}"),
            )?;
            return Err(ConnEnd::Invalid("protocol version mismatch".into()));
        }
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
                return Err(ConnEnd::Invalid(format!("session refused: {e}")));
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

    /// Fused alloc + bytes + commit: the payload goes straight from the
    /// socket into the slab — or, when the slab is full and the disk tier
    /// has room, into the blob's file, answered Pending until it is synced.
    /// This thread holds the reservation while it reads: no lease can free
    /// it underneath; a payload that stalls past `timeout` is cut off and
    /// its range quarantined.
    #[allow(clippy::too_many_arguments)]
    fn put(
        &mut self,
        id: u64,
        owner: Owner,
        ns: &str,
        blob: BlobId,
        entries: Vec<stowage_core::EntrySpec>,
        nbytes: u64,
        timeout: Duration,
    ) -> Result<(), ConnEnd> {
        let now = self.shared.now();
        self.reader.get_mut().deadline = Some(Instant::now() + timeout);
        let Ok(n_entries) = u32::try_from(entries.len()) else {
            drain(&mut self.reader, nbytes)?;
            return self.reply_error(id, ErrorCode::InvalidRequest, "too many entries");
        };
        let alloc = self
            .shared
            .core()
            .alloc(owner, blob, nbytes, n_entries, now);
        let offset = match alloc {
            Ok(Allocated::Reserved { offset }) => offset,
            Ok(Allocated::ToDisk) => return self.put_to_disk(id, owner, ns, blob, entries, nbytes),
            Ok(Allocated::AlreadyCommitted) => {
                drain(&mut self.reader, nbytes)?;
                // Still being made durable, or done.
                let r = self
                    .shared
                    .core()
                    .commit_written(owner, ns, blob, entries, now);
                let resp = match r {
                    Ok(Committed::Pending) => Response::Pending,
                    _ => Response::Done,
                };
                self.reply(id, &resp)?;
                return Ok(());
            }
            Err(e) => {
                drain(&mut self.reader, nbytes)?;
                self.reply(id, &error_response(&e))?;
                return Ok(());
            }
        };
        let len = usize::try_from(nbytes).map_err(|_| io::Error::other("payload too large"))?;
        let filled = self.recv_payload(offset, len);
        if let Err(e) = filled {
            // This thread was the only writer, and it has stopped; a cut
            // stream's range still goes through quarantine.
            let cut = matches!(
                e.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            );
            let _ = self
                .shared
                .core()
                .abort(owner, blob, cut, self.shared.now());
            return Err(e.into());
        }
        let r = self
            .shared
            .core()
            .commit_written(owner, ns, blob, entries, now);
        let resp = match r {
            Ok(Committed::Done) => Response::Done,
            Ok(Committed::Pending) => Response::Pending,
            Err(e) => {
                let _ = self.shared.core().abort(owner, blob, false, now);
                error_response(&e)
            }
        };
        if matches!(resp, Response::Done | Response::Pending) {
            self.count_in(nbytes);
        }
        self.reply(id, &resp)?;
        Ok(())
    }

    /// How this connection streams bytes (for metrics).
    fn stream_transport(&self) -> crate::metrics::Transport {
        if self.direct {
            crate::metrics::Transport::Uds
        } else {
            crate::metrics::Transport::Tcp
        }
    }

    fn count_in(&self, n: u64) {
        if let Some(m) = &self.counters {
            m.bytes_in(self.stream_transport(), n);
        }
    }

    /// Take `len` payload bytes into the slab at `offset`: what the reader
    /// has buffered already, then straight from the socket (bounded by the
    /// reader's deadline).
    fn recv_payload(&mut self, offset: u64, len: usize) -> io::Result<()> {
        let buffered = self.reader.buffer();
        let n = buffered.len().min(len);
        self.shared
            .slab
            .write(offset, &buffered[..n])
            .map_err(io::Error::other)?;
        self.reader.consume(n);
        if n == len {
            return Ok(());
        }
        let r = self.reader.get_mut();
        let deadline = r.deadline;
        let got = self.shared.slab.recv_into(
            r.socket.as_fd(),
            offset + n as u64,
            len - n,
            self.shared.spin,
            deadline,
        );
        if !matches!(got, Ok(false)) {
            r.timeout_changed();
        }
        got.map(|_| ())
    }

    /// The payload of a put that went to the disk tier: streamed into the
    /// blob's file; the flusher syncs it and publishes the entries.
    fn put_to_disk(
        &mut self,
        id: u64,
        owner: Owner,
        ns: &str,
        blob: BlobId,
        entries: Vec<stowage_core::EntrySpec>,
        nbytes: u64,
    ) -> Result<(), ConnEnd> {
        let now = self.shared.now();
        let abort = |shared: &Shared| {
            let _ = shared.core().abort(owner, blob, false, shared.now());
        };
        let Some(d) = &self.shared.disk else {
            drain(&mut self.reader, nbytes)?;
            abort(&self.shared);
            return self.reply_error(id, ErrorCode::Internal, "disk tier missing");
        };
        let (mut writer, mut failure) = match d.engine.create(blob, nbytes) {
            Ok(w) => (Some(w), None),
            Err(e) => {
                tracing::warn!(error = %e, "cannot create a blob file");
                (None, Some(e))
            }
        };
        let mut left = nbytes;
        let mut buf = vec![0u8; (64 << 10).min(nbytes as usize).max(1)];
        while left > 0 {
            let n = (left as usize).min(buf.len());
            if let Err(e) = self.reader.read_exact(&mut buf[..n]) {
                abort(&self.shared);
                return Err(e.into());
            }
            left -= n as u64;
            if let (Some(w), None) = (writer.as_mut(), &failure) {
                if let Err(e) = w.write(&buf[..n]) {
                    failure = Some(e);
                }
            }
        }
        if let Some(e) = failure {
            // Nothing of this put is kept; the client may retry.
            abort(&self.shared);
            if let Some(w) = writer {
                let _ = w.finish();
            }
            let _ = d.engine.delete(blob);
            // A full disk is a full unit (the client may wait for room or
            // go elsewhere), not a failed transfer.
            let (code, why) = if crate::disk::is_disk_full(&e) {
                (
                    ErrorCode::Full,
                    format!(
                        "the unit's memory is full and its disk tier has no space left \
                         ({e}); nothing of this put is kept: clear rows, or give the disk \
                         tier room"
                    ),
                )
            } else {
                (
                    ErrorCode::Internal,
                    format!("the put's blob file on the disk tier failed: {e}"),
                )
            };
            return self.reply_error(id, code, &why);
        }
        let r = self
            .shared
            .core()
            .commit_written(owner, ns, blob, entries, now);
        let resp = match r {
            Ok(Committed::Pending) => {
                self.count_in(nbytes);
                if let Some(m) = &self.shared.metrics {
                    m.disk_put_bytes
                        .fetch_add(nbytes, std::sync::atomic::Ordering::Relaxed);
                }
                if let Some(w) = writer {
                    let sent = d
                        .flush
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .send((blob, w));
                    if sent.is_err() {
                        self.shared.core().disk_written(blob, false, now);
                    }
                }
                Response::Pending
            }
            Ok(Committed::Done) => Response::Done,
            Err(e) => {
                let _ = self.shared.core().abort(owner, blob, false, now);
                error_response(&e)
            }
        };
        self.reply(id, &resp)?;
        Ok(())
    }

    /// Fused resolve + bytes + unpin: the values go straight from the slab
    /// (or a spilled blob's checked file) to the socket. This thread holds
    /// the pin while it sends; a reader that stalls past `timeout` is cut
    /// off, and only then is the pin dropped.
    fn read(
        &mut self,
        id: u64,
        owner: Owner,
        ns: &str,
        keys: Vec<stowage_core::Key>,
        timeout: Duration,
    ) -> Result<(), ConnEnd> {
        let now = self.shared.now();
        let resolved = self.shared.core().resolve(owner, ns, &keys, now);
        let (pin, found) = match resolved {
            Ok(r) => r,
            Err(e) => {
                self.reply(id, &error_response(&e))?;
                return Ok(());
            }
        };
        let until = Instant::now() + timeout;
        // Spilled values stream through one buffer of the unit's disk-read
        // budget, taken for the whole reply: a reader that finds none free
        // waits for one (most of its time), then is answered Busy.
        let has_disk = found
            .iter()
            .flatten()
            .any(|(p, _)| matches!(p, stowage_core::Place::Disk { .. }));
        let shared = self.shared.clone();
        let mut buf = None;
        if let (true, Some(d)) = (has_disk, &shared.disk) {
            buf = d.reads.take(Instant::now() + timeout.mul_f64(0.9));
            if buf.is_none() {
                if let Some(p) = pin {
                    let _ = self.shared.core().unpin(owner, p, self.shared.now());
                }
                return self.reply_error(
                    id,
                    ErrorCode::Busy,
                    "every buffer of the unit's disk-read budget is taken by other readers \
                     of spilled values (--disk-read-budget); try again",
                );
            }
        }
        let served = shared.bring_back(found, buf.as_deref_mut(), true);
        let mut corrupt = Vec::new();
        let items: Vec<Option<Item>> = served
            .iter()
            .enumerate()
            .map(|(i, s)| match s.as_ref()? {
                Served::Memory(l, meta) => Some(Item {
                    len: l.len,
                    meta: meta.clone(),
                }),
                Served::Disk { len, meta, .. } => Some(Item {
                    len: *len,
                    meta: meta.clone(),
                }),
                Served::Corrupt => {
                    corrupt.push(i as u32);
                    None
                }
            })
            .collect();
        let total: u64 = items.iter().flatten().map(|it| it.len).sum();
        self.out.clear();
        encode(id, &Response::Data { items, corrupt }, total, &mut self.out)
            .map_err(io::Error::other)?;
        let header = std::mem::take(&mut self.out);
        let sent = self.send_served(&header, &served, buf.as_deref_mut(), until);
        drop(buf);
        self.out = header;
        // This thread has stopped reading the ranges: the pin may go.
        if let Some(p) = pin {
            let _ = self.shared.core().unpin(owner, p, self.shared.now());
        }
        let sent = sent?;
        if let Some(m) = &self.counters {
            m.bytes_out(self.stream_transport(), total);
        }
        if sent {
            // The send set its own timeout: back to the frame timeout.
            self.write_timeout = Duration::ZERO;
            self.set_write_timeout(self.shared.frame_timeout)?;
        }
        Ok(())
    }
}

impl Conn {
    /// Send a Data reply: `header`, then each served value, from the slab
    /// or streamed from its spilled blob's file through `buf` (checked
    /// chunk by chunk as it goes; the file was checked whole just before,
    /// so a mismatch now means it changed underneath: the connection is
    /// cut rather than a wrong byte sent). Returns whether a send changed
    /// the socket's timeout.
    fn send_served(
        &self,
        header: &[u8],
        served: &[Option<Served>],
        mut buf: Option<&mut [u8]>,
        until: Instant,
    ) -> Result<bool, ConnEnd> {
        let slab = &self.shared.slab;
        let fd = self.writer.as_fd();
        let mut changed = false;
        let mut pieces = Vec::with_capacity(served.len() + 1);
        pieces.push(Piece::Heap(header));
        for s in served.iter().flatten() {
            match s {
                Served::Memory(l, _) => pieces.push(Piece::Slab {
                    offset: l.offset,
                    len: l.len as usize,
                }),
                Served::Disk {
                    blob, offset, len, ..
                } => {
                    changed |= slab.send_pieces(fd, &pieces, until)?;
                    pieces.clear();
                    let (Some(d), Some(buf)) = (&self.shared.disk, buf.as_deref_mut()) else {
                        return Err(ConnEnd::Invalid(
                            "a spilled value without a disk-read buffer".into(),
                        ));
                    };
                    let t0 = Instant::now();
                    let streamed = d.engine.reader(*blob).and_then(|r| {
                        crate::read_through(&r, *offset, *len, buf, |piece| {
                            changed |= slab.send_pieces(fd, &[Piece::Heap(piece)], until)?;
                            Ok(())
                        })
                    });
                    match streamed {
                        Ok(Ok(())) => {
                            d.io.read(*len, t0);
                            if let Some(m) = &self.shared.metrics {
                                m.disk_streamed_bytes
                                    .fetch_add(*len, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                        Ok(Err(e)) => return Err(e.into()),
                        Err(e) => {
                            tracing::error!(error = %e, ?blob, "a spilled blob's file changed while it was sent; the connection is cut");
                            return Err(ConnEnd::Invalid(format!(
                                "a spilled value's file failed its check while it was sent: {e}"
                            )));
                        }
                    }
                }
                Served::Corrupt => {}
            }
        }
        changed |= slab.send_pieces(fd, &pieces, until)?;
        Ok(changed)
    }
}

const NOT_ADMIN: &str = "admin requests (shutdown, checkpoint) need a same-user client on the unit's Unix socket, or a unit started with --admin";
