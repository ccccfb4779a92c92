//! One client connection: read a frame, have the handler
//! ([`crate::handler`]) plan the request, carry the plan out (the bytes it
//! moves: a Put's payload from the socket into the slab or the blob's
//! file, a Read's values from the slab or their files to the socket, a
//! Resolve's spilled values back into the slab), reply; repeat until the
//! client leaves or misbehaves. How a connection starts, passes its
//! handshake and Hello, and ends: [`session`].

use std::io::{self, BufRead as _, Read as _, Write};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stowage_core::{BlobId, Owner};
use stowage_shm::Piece;
use stowage_wire::io::{drain, read_header, read_prefix, ReadError};
use stowage_wire::{encode, ErrorCode, Request, Response};

use crate::auth::Gate;
use crate::disk::DiskEngine;
use crate::handler::{self, Asker, Dest, Plan, Put, Read};
use crate::{Served, Shared};

mod inbuf;
mod ring;
mod session;

use inbuf::{InBuf, Next};
pub(crate) use ring::RingStep;
pub(crate) use session::EndReason;
pub(crate) use session::{finish, open, Ended};

pub(crate) use crate::sessions::Peer;

/// One connection's state between its requests; served by a worker of
/// the reactor ([`crate::reactor`]), and by the blocking pool for a step
/// that blocks ([`Conn::run_parked`]).
pub(crate) struct Conn {
    shared: Arc<Shared>,
    /// Its socket, and what was read from it and not yet served.
    reader: InBuf,
    peer: Peer,
    /// A Unix-socket peer: it may be handed the slab.
    unix: bool,
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
    /// Reply bytes the peer has not taken yet.
    out: Vec<u8>,
    /// Since when `out` has waited for the peer.
    out_since: Option<Instant>,
    scratch: Vec<u8>,
    /// The current request was answered with an error (for metrics).
    failed: bool,
    /// When the current request's frame began to arrive (its deadline's
    /// base, and its latency's start: one clock read for both).
    frame_start: Instant,
    /// Whether its requests are recorded (the unit keeps metrics).
    metrics: bool,
    /// Carried out by the blocking pool (its socket calls block, bounded
    /// by their deadlines); otherwise every socket call returns at once.
    blocking: bool,
    /// A planned request whose next step blocks: for the pool.
    parked: Option<Parked>,
    /// The connection's Hello mapped the slab (a request ring may be
    /// made for it).
    maps: bool,
    /// Its request ring, once it asked for one.
    ring: Option<stowage_shm::ring::Ring>,
    /// The request being served came through the ring: its reply goes
    /// back there.
    via_ring: bool,
    /// The client kicked the ring (the worker polls it again).
    kicked: bool,
    /// A ring entry, copied out before it is decoded.
    entry: Vec<u8>,
}

/// A request planned by a worker and carried out by the pool.
struct Parked {
    id: u64,
    plan: Plan,
    op: Option<crate::metrics::Op>,
    /// It came through the ring.
    via_ring: bool,
}

/// What a worker's turn on a connection came to.
pub(crate) enum Step {
    /// Waiting for its socket (bytes, or room for its reply), or for the
    /// deadline given.
    Wait(Option<Instant>),
    /// It served its quantum and may have more: serve it again after the
    /// others.
    Again,
    /// Its next step blocks: hand it to the pool ([`Conn::run_parked`]).
    Pool,
    /// It ended.
    End(Result<(), EndReason>),
}

/// Header and reply buffers grown past this by one large request are
/// given back once it is answered (a connection keeps no 64 MiB buffer
/// for its idle life).
const KEEP_BUFFER: usize = 1 << 20;

impl Conn {
    /// What this thread records this connection's requests into (`None`:
    /// metrics are off).
    fn counters(&self) -> Option<Arc<crate::metrics::PathCounters>> {
        if !self.metrics {
            return None;
        }
        crate::metrics::thread_counters(self.shared.metrics.as_ref())
    }

    /// Its socket's descriptor (for the worker to watch).
    pub(crate) fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.reader.src.socket.as_fd().as_raw_fd()
    }

    fn limits(&self) -> stowage_wire::Limits {
        if self.gate.is_open() {
            self.shared.settings.limits
        } else {
            self.shared.settings.limits.handshake()
        }
    }

    /// When the worker must end this connection if nothing changes: its
    /// handshake's deadline; a frame begun and not finished, or a reply
    /// not taken, within the frame timeout. An idle connection waits for
    /// its next frame as long as it likes.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        if !self.gate.is_open() {
            return Some(self.handshake_deadline);
        }
        let mut d = self
            .out_since
            .map(|t| t + self.shared.settings.frame_timeout);
        if !self.reader.buffer().is_empty() {
            let f = self.frame_start + self.shared.settings.frame_timeout;
            d = Some(d.map_or(f, |d| d.min(f)));
        }
        d
    }

    /// Serve what the socket has now, without blocking: at most `quantum`
    /// frames.
    pub(crate) fn pump(&mut self, quantum: usize) -> Step {
        let mut served = 0;
        loop {
            match self.flush_ready() {
                Ok(true) => {}
                Ok(false) => return Step::Wait(self.deadline()),
                Err(e) => return Step::End(Err(e.into())),
            }
            if served >= quantum {
                return Step::Again;
            }
            let limits = self.limits();
            match self.reader.next(&limits) {
                Next::Frame => {}
                next => {
                    let was_empty = matches!(next, Next::Empty);
                    match self.reader.recv_ready(self.reader.lacking(&limits)) {
                        Ok(0) if was_empty => return Step::End(Ok(())),
                        Ok(0) => {
                            return Step::End(Err(
                                io::Error::from(io::ErrorKind::UnexpectedEof).into()
                            ))
                        }
                        Ok(_) => {
                            if was_empty {
                                self.frame_start = Instant::now();
                            }
                            continue;
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            if was_empty {
                                self.go_idle();
                            }
                            return Step::Wait(self.deadline());
                        }
                        Err(e) => return Step::End(Err(e.into())),
                    }
                }
            }
            if let Err(e) = self.serve_frame() {
                return Step::End(Err(e));
            }
            served += 1;
            if self.parked.is_some() {
                return Step::Pool;
            }
            if !self.reader.buffer().is_empty() {
                // The next frame came with this one.
                self.frame_start = Instant::now();
            }
        }
    }

    /// Nothing buffered, nothing to send: give the buffers back.
    fn go_idle(&mut self) {
        self.reader.release_if_empty();
        if self.out.is_empty() && self.out.capacity() > 0 {
            self.out = Vec::new();
        }
        if self.scratch.capacity() > 0 {
            self.scratch = Vec::new();
        }
    }

    /// Carry out the parked request's blocking step (on the pool).
    pub(crate) fn run_parked(&mut self) -> Result<(), EndReason> {
        let Some(p) = self.parked.take() else {
            return Ok(());
        };
        self.blocking = true;
        // A payload not sent whole with its header must come within the
        // frame's time, as it always had to.
        self.reader.get_mut().deadline =
            Some(self.frame_start + self.shared.settings.frame_timeout);
        self.via_ring = p.via_ring;
        let r = self
            .flush_blocking()
            .map_err(EndReason::from)
            .and_then(|()| {
                let r = self.execute(p.id, p.plan);
                self.record(p.op, &r);
                r
            });
        self.via_ring = false;
        self.reader.get_mut().deadline = None;
        self.blocking = false;
        r
    }

    /// Read and serve one frame that is whole in the buffer.
    fn serve_frame(&mut self) -> Result<(), EndReason> {
        let open = self.gate.is_open();
        let limits = self.limits();
        if open {
            if self.scratch.capacity() > KEEP_BUFFER {
                self.scratch = Vec::new();
            }
            if self.out.capacity() > KEEP_BUFFER && self.out.is_empty() {
                self.out = Vec::new();
            }
        }
        let prefix = match read_prefix(&mut self.reader, &limits) {
            Ok(Some(p)) => p,
            Ok(None) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
            Err(ReadError::Io(e)) => return Err(e.into()),
            Err(ReadError::Wire(e)) if open => return self.refuse(0, e.to_string()),
            Err(ReadError::Wire(e)) => return self.pass_gate(0, Err(e)),
        };
        let env = match read_header::<_, Request>(&mut self.reader, &prefix, &mut self.scratch) {
            Ok(env) => env,
            Err(ReadError::Io(e)) => return Err(e.into()),
            Err(ReadError::Wire(e)) if open => return self.refuse(0, e.to_string()),
            Err(ReadError::Wire(e)) => return self.pass_gate(0, Err(e)),
        };
        if !open {
            // Handshake frames carry no payload (the limits say so).
            let frame = env.body.validate(&limits).map(|()| env.body);
            return self.pass_gate(env.id, frame);
        }
        if let Err(e) = env.body.validate(&limits) {
            return self.refuse(env.id, e.to_string());
        }
        let carries_payload = matches!(env.body, Request::Put { .. });
        if prefix.payload_len > 0 && !carries_payload {
            return self.refuse(env.id, "this request carries no payload".into());
        }
        self.handle(env.id, env.body, prefix.payload_len)
    }

    /// Send what waits in `out` without blocking; whether all of it went.
    fn flush_ready(&mut self) -> io::Result<bool> {
        let mut sent = 0;
        while sent < self.out.len() {
            let r = rustix::net::send(
                self.reader.src.socket.as_fd(),
                &self.out[sent..],
                rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
            );
            match r {
                Ok(n) => sent += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => break,
                Err(e) => return Err(e.into()),
            }
        }
        self.out.drain(..sent);
        if self.out.is_empty() {
            self.out_since = None;
            Ok(true)
        } else {
            self.out_since.get_or_insert_with(Instant::now);
            Ok(false)
        }
    }

    /// Send what waits in `out`, blocking within the send timeout.
    fn flush_blocking(&mut self) -> io::Result<()> {
        if !self.out.is_empty() {
            self.reader.src.socket.write_all(&self.out)?;
            self.out.clear();
        }
        self.out_since = None;
        Ok(())
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
                tracing::debug!(unit = %self.shared.settings.name, namespace = self.namespace.as_deref().unwrap_or(""), ?code, %message, "error answer");
            }
        }
        if self.via_ring {
            return self.reply_to_ring(id, r);
        }
        if self.blocking {
            self.out.clear();
            encode(id, r, 0, &mut self.out).map_err(io::Error::other)?;
            return self.flush_blocking();
        }
        // Queued behind what the peer has not taken yet; sent now as far
        // as the socket takes it.
        encode(id, r, 0, &mut self.out).map_err(io::Error::other)?;
        self.flush_ready().map(|_| ())
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
            return self.shared.settings.frame_timeout;
        }
        Duration::from_millis(timeout_ms).clamp(
            Duration::from_millis(10),
            self.shared.settings.max_io_timeout,
        )
    }

    fn set_write_timeout(&mut self, t: Duration) -> io::Result<()> {
        if t != self.write_timeout {
            self.reader.src.socket.set_write_timeout(Some(t))?;
            self.write_timeout = t;
        }
        Ok(())
    }

    /// Handle one request, recording its kind, outcome and duration.
    fn handle(&mut self, id: u64, req: Request, payload_len: u64) -> Result<(), EndReason> {
        let op = self.metrics.then(|| crate::metrics::Op::of(&req));
        // Before the gate opens, frames are not timed from their start.
        if !self.gate.is_open() {
            self.frame_start = Instant::now();
        }
        self.failed = false;
        let r = self.handle_request(id, req, payload_len);
        match &mut self.parked {
            // Recorded once the pool has carried it out.
            Some(p) => p.op = op,
            None => self.record(op, &r),
        }
        r
    }

    /// Record a request of kind `op` that ended `r`.
    fn record(&self, op: Option<crate::metrics::Op>, r: &Result<(), EndReason>) {
        if let (Some(m), Some(op)) = (self.counters(), op) {
            let ok = r.is_ok() && !self.failed;
            if op == crate::metrics::Op::Unpin {
                // A release the client sends and does not wait for
                // (same-host gets): counted, not timed.
                m.count(op, ok);
            } else {
                m.op(op, ok, self.frame_start.elapsed());
            }
        }
    }

    /// Whether carrying `plan` out may block on the socket, the disk or
    /// a long task: the pool does it, unless this is the pool already.
    fn blocks(&self, plan: &Plan) -> bool {
        if self.blocking {
            return false;
        }
        // A payload that came whole with its header is taken from the
        // buffer.
        let buffered = self.reader.buffer().len() as u64;
        match plan {
            Plan::Drain { len, .. } => buffered < *len,
            Plan::Receive(put) => match put.into {
                Dest::Slab { .. } | Dest::Nowhere => buffered < put.nbytes,
                Dest::Disk => true,
            },
            Plan::Resolved { found, .. } => self.shared.disk.is_some() && handler::has_disk(found),
            Plan::Send(_) => true,
            // Its memfd rides on the reply.
            Plan::OpenRing { .. } => true,
            // The slab's memfd rides on the reply.
            Plan::Hello { want_fd, .. } => *want_fd && self.unix,
            Plan::NixlInfo { .. }
            | Plan::Checkpoint { .. }
            | Plan::OpenRestore { .. }
            | Plan::CloseRestore { .. }
            | Plan::Shutdown { .. } => true,
            Plan::Reply(_)
            | Plan::Silent
            | Plan::Committed { .. }
            | Plan::Stats
            | Plan::Close { .. }
            | Plan::Refuse(_)
            | Plan::RingKick => false,
        }
    }

    /// Plan the request in the handler, then carry the plan out (here, or
    /// on the pool when it blocks).
    fn handle_request(&mut self, id: u64, req: Request, payload_len: u64) -> Result<(), EndReason> {
        let asker = Asker {
            hello: self.owner.zip(self.namespace.as_deref()),
            admin: self.admin,
            checkpoints: self.admin || self.shared.settings.secret.is_some(),
            stopping: self
                .shared
                .life
                .stop
                .load(std::sync::atomic::Ordering::SeqCst),
        };
        let now = self.shared.now();
        let plan = handler::handle(|| self.shared.core(), &asker, req, payload_len, now);
        if self.blocks(&plan) {
            self.parked = Some(Parked {
                id,
                plan,
                op: None,
                via_ring: self.via_ring,
            });
            return Ok(());
        }
        self.execute(id, plan)
    }

    /// Carry a plan out: this is where the bytes move.
    fn execute(&mut self, id: u64, plan: Plan) -> Result<(), EndReason> {
        let resp = match plan {
            Plan::Reply(r) => r,
            Plan::Silent => return Ok(()),
            Plan::RingKick => {
                self.kicked = true;
                return Ok(());
            }
            Plan::OpenRing { bytes } => return self.open_ring(id, bytes),
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
            Plan::Resolved {
                pin,
                found,
                spares_back,
            } => self.resolved(pin, found, spares_back),
            Plan::Send(read) => return self.send(id, read),
            Plan::Hello {
                namespace,
                want_fd,
                session,
            } => return self.hello(id, namespace, want_fd, session),
            Plan::Stats => Response::Stats(Box::new(self.shared.stats())),
            Plan::NixlInfo {
                owner,
                agent,
                agent_metadata,
            } => handler::nixl_info(
                self.shared
                    .nixl
                    .as_ref()
                    .map(|n| (&n.metadata, n.slab_addr)),
                // From here on the peer's transfers touch the slab by
                // themselves: its holds outlive the connection's end,
                // however it ends, until its agent is invalidated and
                // the nixl quarantine has passed (docs/fencing.md).
                || {
                    self.shared
                        .map_session(owner, self.peer, &agent, &agent_metadata)
                },
            ),
            Plan::Checkpoint { dir } => self.checkpoint(&dir),
            Plan::OpenRestore { dir } => crate::restore::open(&self.shared, &dir),
            Plan::CloseRestore { id } => {
                crate::restore::close(&self.shared, id);
                Response::Done
            }
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
        let reply = handler::committed_reply(reply, || {
            self.shared.disk.as_ref().and_then(|d| d.failed_put(blob))
        });
        if shm_bytes > 0
            && matches!(
                reply,
                Response::Done | Response::Pending | Response::CommittedSpare { .. }
            )
        {
            if let Some(m) = self.counters() {
                m.bytes_in(crate::metrics::Transport::Shm, shm_bytes);
            }
        }
        reply
    }

    fn checkpoint(&mut self, dir: &str) -> Response {
        // (The handler checked that an admin asks, and that the unit was
        // not stopping then; it may have begun to since.)
        if self
            .shared
            .life
            .stop
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return Response::Error {
                code: ErrorCode::Internal,
                message: "the unit is shutting down".into(),
            };
        }
        let dir = match crate::checkpoint::resolve_dir(
            self.shared.settings.checkpoint_root.as_deref(),
            dir,
        ) {
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
            .writing
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let t0 = Instant::now();
        let r = crate::checkpoint::write(&self.shared, &dir);
        self.shared
            .checkpoints
            .writing
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        if let Some(m) = &self.shared.metrics {
            m.checkpoint(r.is_ok(), t0.elapsed());
        }
        match &r {
            Ok(info) => tracing::info!(
                unit = %self.shared.settings.name,
                dir = %dir.path.display(),
                rows = info.rows,
                entries = info.entries,
                bytes = info.bytes,
                seconds = t0.elapsed().as_secs_f64(),
                "checkpoint written"
            ),
            Err(e) => tracing::warn!(
                unit = %self.shared.settings.name,
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
}

impl Conn {
    /// Take a Put's payload where the handler reserved it, within the
    /// Put's own time (a payload that stalls past it is cut off), and
    /// answer what the handler makes of it.
    fn receive(&mut self, id: u64, mut put: Put) -> Result<(), EndReason> {
        let timeout = self.io_timeout(put.timeout_ms);
        self.reader.get_mut().deadline = Some(Instant::now() + timeout);
        match &put.into {
            Dest::Slab { pieces } => {
                let ranges = crate::cut(pieces, put.nbytes);
                self.put_to_slab(id, &mut put, &ranges)
            }
            Dest::Disk => self.put_to_disk(id, &mut put),
            Dest::Nowhere => {
                drain(&mut self.reader, put.nbytes)?;
                let resp = handler::put_landed(&mut self.shared.core(), &mut put);
                self.reply(id, &resp)?;
                Ok(())
            }
        }
    }

    /// The payload goes straight from the socket into the slab `ranges`
    /// (the reserved pieces, cut to the payload's length), in order. This
    /// thread is their only writer while it reads.
    fn put_to_slab(
        &mut self,
        id: u64,
        put: &mut Put,
        ranges: &[(u64, u64)],
    ) -> Result<(), EndReason> {
        let mut got = Ok(());
        for &(offset, len) in ranges {
            let len = usize::try_from(len).map_err(|_| io::Error::other("payload too large"))?;
            got = self.recv_payload(offset, len);
            if got.is_err() {
                break;
            }
        }
        if let Err(e) = got {
            let cut = matches!(
                e.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            );
            let _ = handler::put_abandoned(&mut self.shared.core(), put, cut, self.shared.now());
            return Err(e.into());
        }
        let resp = handler::put_landed(&mut self.shared.core(), put);
        if matches!(resp, Response::Done | Response::Pending) {
            self.count_in(put.nbytes);
        }
        self.reply(id, &resp)?;
        Ok(())
    }

    /// How this connection streams bytes (for metrics).
    fn stream_transport(&self) -> crate::metrics::Transport {
        if self.unix {
            crate::metrics::Transport::Uds
        } else {
            crate::metrics::Transport::Tcp
        }
    }

    fn count_in(&self, n: u64) {
        if let Some(m) = self.counters() {
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
            self.shared.settings.spin,
            deadline,
        );
        if !matches!(got, Ok(false)) {
            r.timeout_changed();
        }
        got.map(|_| ())
    }

    /// The payload of a put that went to the disk tier: streamed into the
    /// blob's file; the flusher syncs it and publishes the entries.
    fn put_to_disk(&mut self, id: u64, put: &mut Put) -> Result<(), EndReason> {
        let (blob, nbytes) = (put.blob, put.nbytes);
        let abandon = |shared: &Shared| {
            let _ = handler::put_abandoned(&mut shared.core(), put, false, shared.now());
        };
        let Some(d) = &self.shared.disk else {
            drain(&mut self.reader, nbytes)?;
            abandon(&self.shared);
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
                abandon(&self.shared);
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
            abandon(&self.shared);
            if let Some(w) = writer {
                let _ = w.finish();
            }
            let _ = d.engine.delete(blob);
            let (code, why) = handler::disk_put_failed(&e);
            return self.reply_error(id, code, &why);
        }
        let resp = handler::put_landed(&mut self.shared.core(), put);
        if matches!(resp, Response::Pending) {
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
                    self.shared
                        .core()
                        .disk_written(blob, false, self.shared.now());
                }
            }
        }
        self.reply(id, &resp)?;
        Ok(())
    }

    /// Send a Read's pinned values: straight from the slab (or a spilled
    /// blob's checked file) to the socket, within the Read's own time (a
    /// reader that stalls past it is cut off); only then does the pin go.
    fn send(&mut self, id: u64, mut read: Read) -> Result<(), EndReason> {
        if std::mem::take(&mut self.via_ring) {
            // Its values follow the reply on the socket (and so does a
            // Busy answer).
            self.on_socket(id)?;
        }
        let timeout = self.io_timeout(read.timeout_ms);
        let until = Instant::now() + timeout;
        // Spilled values stream through one buffer of the unit's disk-read
        // budget, taken for the whole reply: a reader that finds none free
        // waits for one (most of its time), then is answered Busy.
        let shared = self.shared.clone();
        let mut buf = None;
        if let (true, Some(d)) = (read.has_disk(), &shared.disk) {
            buf = d.reads.take(Instant::now() + timeout.mul_f64(0.9));
            if buf.is_none() {
                handler::read_sent(&mut self.shared.core(), &read, self.shared.now());
                return self.reply_error(
                    id,
                    ErrorCode::Busy,
                    "every buffer of the unit's disk-read budget is taken by other readers \
                     of spilled values (--disk-read-budget); try again",
                );
            }
        }
        let found = std::mem::take(&mut read.found);
        let served = shared.bring_back(found, buf.as_deref_mut(), true);
        let (header_reply, total) = handler::data_reply(&served);
        // (On the pool: `out` was sent before this began.)
        let mut header = std::mem::take(&mut self.out);
        header.clear();
        encode(id, &header_reply, total, &mut header).map_err(io::Error::other)?;
        let sent = self.send_served(&header, &served, buf.as_deref_mut(), until);
        drop(buf);
        header.clear();
        self.out = header;
        handler::read_sent(&mut self.shared.core(), &read, self.shared.now());
        let sent = sent?;
        if let Some(m) = self.counters() {
            m.bytes_out(self.stream_transport(), total);
        }
        if sent {
            // The send set its own timeout: back to the frame timeout.
            self.write_timeout = Duration::ZERO;
            self.set_write_timeout(self.shared.settings.frame_timeout)?;
        }
        Ok(())
    }

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
    ) -> Result<bool, EndReason> {
        let slab = &self.shared.slab;
        let fd = self.reader.src.socket.as_fd();
        let mut changed = false;
        let mut pieces = Vec::with_capacity(served.len() + 1);
        pieces.push(Piece::Heap(header));
        for s in served.iter().flatten() {
            match s {
                Served::Memory(l, _) => pieces.push(Piece::Slab {
                    offset: l.offset,
                    len: l.len as usize,
                }),
                Served::Split(parts, _) => pieces.extend(parts.iter().map(|l| Piece::Slab {
                    offset: l.offset,
                    len: l.len as usize,
                })),
                Served::Disk {
                    blob, offset, len, ..
                } => {
                    changed |= slab.send_pieces(fd, &pieces, until)?;
                    pieces.clear();
                    let (Some(d), Some(buf)) = (&self.shared.disk, buf.as_deref_mut()) else {
                        return Err(EndReason::Invalid(
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
                            return Err(EndReason::Invalid(format!(
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

    /// A Resolve's reply: spilled values are brought back into the slab
    /// where there is room (the pin holds them meanwhile). Promotion copies
    /// through a buffer of the read budget; when none is free soon, the
    /// values stay on disk and the client reads them with a Read, which
    /// waits for one.
    fn resolved(
        &mut self,
        pin: Option<stowage_core::PinId>,
        found: Vec<Option<stowage_core::Located>>,
        spares_back: bool,
    ) -> Response {
        let mut buf = match &self.shared.disk {
            Some(d) if handler::has_disk(&found) => {
                d.reads.take(Instant::now() + Duration::from_millis(50))
            }
            _ => None,
        };
        let served = self.shared.bring_back(found, buf.as_deref_mut(), false);
        drop(buf);
        let (reply, bytes) = handler::resolved_reply(pin, served, spares_back);
        if let Some(m) = self.counters() {
            m.bytes_out(crate::metrics::Transport::Shm, bytes);
        }
        reply
    }
}
