//! One client connection: read a frame, have the handler
//! ([`crate::handler`]) plan the request, carry the plan out (the bytes it
//! moves: a Put's payload from the socket into the slab or the blob's
//! file, a Read's values from the slab or their files to the socket, a
//! Resolve's spilled values back into the slab), reply; repeat until the
//! client leaves or misbehaves. How a connection starts, passes its
//! handshake and Hello, and ends: [`session`].

use std::io::{self, BufRead as _, Write};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stowage_core::BlobId;
use stowage_wire::io::{drain, ReadError};
use stowage_wire::{encode, ErrorCode, Request, Response};

use crate::handler::{self, Asker, Dest, Plan};

mod forwarding;
mod inbuf;
mod nixl;
mod ring;
mod session;
mod state;
mod transfer;

use inbuf::Next;
pub(crate) use session::EndReason;
pub(crate) use session::{finish, open, Ended};
pub(crate) use state::Conn;
use state::Parked;

pub(crate) use crate::sessions::Peer;

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
    /// Its next read waits for the unit's budget for memory outside the
    /// slab: try it again shortly (or when the deadline given comes).
    Starved(Option<Instant>),
    /// It ended.
    End(Result<(), EndReason>),
}

/// What a worker's turn on a connection's ring came to.
pub(crate) enum RingStep {
    /// It served this many requests (0: none was there).
    Served(usize),
    /// A request's next step blocks: hand it to the pool.
    Pool,
    /// The ring broke the rules; the connection ends.
    End(EndReason),
}

/// Room a request awaiting a reply needs in the reply ring: an
/// [`Response::OnSocket`] marker at least.
const ON_SOCKET_ROOM: usize = 64;

/// Header and reply buffers grown past this by one large request are
/// given back once it is answered (a connection keeps no 64 MiB buffer
/// for its idle life).
const KEEP_BUFFER: usize = 1 << 20;

/// A request read from the front of a buffer: its id, the request as
/// validated under the limits, the payload that follows it, and the
/// bytes its prefix and header took.
struct Decoded {
    id: u64,
    req: Result<Request, stowage_wire::WireError>,
    payload_len: u64,
    used: usize,
}

/// Decode and validate the request whose prefix and header are at the
/// front of `bytes` (a ring entry, or a socket's buffered bytes): the one
/// place either path turns bytes into a request. An `Io` error: they are
/// not whole there.
fn decode_request(bytes: &[u8], limits: &stowage_wire::Limits) -> Result<Decoded, ReadError> {
    use stowage_wire::{FramePrefix, PREFIX_LEN};
    let short = || io::Error::from(io::ErrorKind::UnexpectedEof);
    let p: &[u8; PREFIX_LEN] = bytes
        .get(..PREFIX_LEN)
        .and_then(|p| p.try_into().ok())
        .ok_or_else(short)?;
    let prefix = FramePrefix::parse(p, limits)?;
    let header = bytes[PREFIX_LEN..]
        .get(..prefix.header_len as usize)
        .ok_or_else(short)?;
    let env = stowage_wire::decode_header::<Request>(header)?;
    Ok(Decoded {
        id: env.id,
        req: env.body.validate(limits).map(|()| env.body),
        payload_len: prefix.payload_len,
        used: PREFIX_LEN + header.len(),
    })
}

impl Conn {
    /// What this thread records this connection's requests into (`None`:
    /// metrics are off).
    fn counters(&self) -> Option<Arc<crate::metrics::PathCounters>> {
        if !self.metrics {
            return None;
        }
        crate::metrics::thread_counters(self.shared.metrics.as_ref())
    }

    /// The bytes its buffers hold besides the input buffer (replies not
    /// taken, the ring's entry and reply scratch), plus `extra`.
    fn others(&self, extra: usize) -> usize {
        self.out.capacity() + self.scratch.capacity() + self.entry.capacity() + extra
    }

    /// Count what its buffers hold now (and `extra` bytes held outside
    /// them) against the budget: one atomic add per part that changed by
    /// a granule, none otherwise.
    pub(crate) fn settle(&mut self, extra: usize) {
        let bytes = self.reader.capacity().max(self.reserve) + self.others(extra);
        self.charge.set(bytes);
    }

    /// Ask the budget for what the next read takes (its buffer's growth,
    /// or the whole frame once its prefix says it is large): the read's
    /// plan, or `None` when it must wait (counted once per wait; past the
    /// grace, the unit cuts the holder of the most stalled bytes).
    fn admit_read(&mut self, limits: &stowage_wire::Limits) -> Option<(usize, usize)> {
        let frame = self.reader.frame_len(limits);
        let plan = self.reader.plan_read(self.reader.lacking(limits), frame);
        let reserve = if frame > crate::budget::GRANULE {
            frame
        } else {
            0
        };
        let bytes = plan.1.max(reserve) + self.others(0);
        if bytes > self.charge.held() && !self.charge.try_hold(bytes) {
            match self.starved {
                None => {
                    self.starved = Some(Instant::now());
                    self.shared.budget.waited();
                }
                Some(since) if since.elapsed() >= crate::budget::GRACE => {
                    self.shared.budget.cut_stalled(self.shared.now());
                }
                Some(_) => {}
            }
            return None;
        }
        if let Some(since) = self.starved.take() {
            self.frame_paused += since.elapsed();
            // Its wait was the unit's: its bytes are stalled only from now.
            self.charge.progressed();
        }
        self.reserve = reserve;
        Some(plan)
    }

    /// Whether the budget chose to cut it.
    pub(crate) fn budget_cut(&self) -> bool {
        self.charge.is_cut()
    }

    /// It was chosen for a cut while away on the pool: it may be chosen
    /// again.
    pub(crate) fn spare_cut(&self) {
        self.charge.spare();
    }

    /// Make it a candidate for the budget's cuts: `wake` asks its serving
    /// thread to cut it.
    pub(crate) fn register_charge(&self, wake: Box<dyn Fn() + Send + Sync>) {
        self.charge.register(wake);
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
        // While it waits for the budget its frame's time stands still.
        if !self.reader.buffer().is_empty() && self.starved.is_none() {
            let f = self.frame_start + self.frame_paused + self.shared.settings.frame_timeout;
            d = Some(d.map_or(f, |d| d.min(f)));
        }
        d
    }

    /// Serve what the socket has now, without blocking: at most `quantum`
    /// frames.
    pub(crate) fn pump(&mut self, quantum: usize) -> Step {
        let step = self.pump_frames(quantum);
        self.settle(0);
        if matches!(step, Step::Wait(_) | Step::Starved(_)) {
            let shared = &self.shared;
            self.charge.quiet(|| shared.now());
        }
        step
    }

    fn pump_frames(&mut self, quantum: usize) -> Step {
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
                    let Some(plan) = self.admit_read(&limits) else {
                        return Step::Starved(self.deadline());
                    };
                    match self.reader.recv_ready(plan) {
                        Ok(0) if was_empty => return Step::End(Ok(())),
                        Ok(0) => {
                            return Step::End(Err(
                                io::Error::from(io::ErrorKind::UnexpectedEof).into()
                            ))
                        }
                        Ok(_) => {
                            self.charge.progressed();
                            if was_empty {
                                self.frame_start = Instant::now();
                                self.frame_paused = Duration::ZERO;
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
            // The frame is whole: what it holds is its buffer's.
            self.reserve = 0;
            if let Err(e) = self.serve_frame() {
                return Step::End(Err(e));
            }
            served += 1;
            if self.parked.is_some() {
                return Step::Pool;
            }
            self.reader.shrink(KEEP_BUFFER);
            if !self.reader.buffer().is_empty() {
                // The next frame came with this one.
                self.frame_start = Instant::now();
                self.frame_paused = Duration::ZERO;
            }
        }
    }

    /// Serve at most `quantum` requests from the ring, without blocking.
    /// Every entry is copied out, then decoded and checked as a socket
    /// frame is; a ring that breaks its layout, an entry that is not one
    /// whole frame without payload, or more requests awaiting replies than
    /// its reply ring holds end the connection as cut (the client broke
    /// the protocol; a same-host client's holds stay until its process
    /// exits, as for any cut connection).
    pub(crate) fn pump_ring(&mut self, quantum: usize) -> RingStep {
        if let Err(e) = self.flush_ready() {
            return RingStep::End(e.into());
        }
        let mut served = 0;
        let mut entry = std::mem::take(&mut self.entry);
        let step = loop {
            if served >= quantum {
                break RingStep::Served(served);
            }
            let Some(ring) = &self.ring else {
                break RingStep::Served(served);
            };
            match ring.take_request(&mut entry) {
                Ok(true) => {}
                Ok(false) => break RingStep::Served(served),
                Err(e) => break RingStep::End(EndReason::Invalid(format!("request ring: {e}"))),
            }
            let limits = self.shared.settings.limits;
            let (id, req) = match decode_request(&entry, &limits) {
                Ok(d) if d.used == entry.len() && d.payload_len == 0 => match d.req {
                    Ok(req) => (d.id, req),
                    Err(e) => break RingStep::End(EndReason::Invalid(e.to_string())),
                },
                Ok(_) | Err(ReadError::Io(_)) => {
                    break RingStep::End(EndReason::Invalid(
                        "a ring entry is one whole frame without payload".into(),
                    ))
                }
                Err(ReadError::Wire(e)) => {
                    break RingStep::End(EndReason::Invalid(format!("ring entry: {e}")))
                }
            };
            if req.expects_reply() && ring.reply_room() < ON_SOCKET_ROOM {
                // A client waits for one reply at a time per connection:
                // one whose reply ring is full and asks more is flooding.
                break RingStep::End(EndReason::Invalid(
                    "requests past the room in the reply ring".into(),
                ));
            }
            self.frame_start = Instant::now();
            self.via_ring = true;
            let r = self.handle(id, req, 0);
            self.via_ring = false;
            if let Err(e) = r {
                break RingStep::End(e);
            }
            served += 1;
            if let Some(m) = &self.shared.metrics {
                m.ring_requests
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            if self.parked.is_some() {
                break RingStep::Pool;
            }
        };
        entry.clear();
        if entry.capacity() <= 64 << 10 {
            self.entry = entry;
        }
        if self.scratch.capacity() > KEEP_BUFFER {
            self.scratch = Vec::new();
        }
        self.settle(0);
        step
    }

    /// Post a reply to the ring; one that does not fit goes on the socket,
    /// after a marker saying so.
    pub(super) fn reply_to_ring(&mut self, id: u64, r: &Response) -> io::Result<()> {
        // Encoded in the header buffer (free once a request is decoded):
        // no allocation per reply.
        let mut frame = std::mem::take(&mut self.scratch);
        frame.clear();
        let encoded = encode(id, r, 0, &mut frame).map_err(io::Error::other);
        let posted = encoded.and_then(|()| match &self.ring {
            Some(ring) => Ok(frame.len() <= ring.reply_room() && ring.post_reply(&frame).is_ok()),
            None => Err(io::Error::other("a ring reply without a ring")),
        });
        self.scratch = frame;
        if posted? {
            return Ok(());
        }
        self.on_socket(id)?;
        self.via_ring = false;
        let sent = self.reply(id, r);
        self.via_ring = true;
        sent
    }

    /// Tell the ring that the reply to `id` comes on the socket.
    pub(super) fn on_socket(&mut self, id: u64) -> io::Result<()> {
        let Some(ring) = &self.ring else {
            return Ok(());
        };
        let mut marker = Vec::new();
        encode(id, &Response::OnSocket, 0, &mut marker).map_err(io::Error::other)?;
        ring.post_reply(&marker)
            .map_err(|_| io::Error::other("no room in the reply ring for a marker"))
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

    /// The place in its chain of a parked step that forwards a put to
    /// other units (`None`: it forwards nothing). Each place runs on a
    /// pool of its own, never on the one that serves the plain puts the
    /// last units of chains get: a step waits only on steps further down
    /// its chain, so two units forwarding to each other cannot each wait
    /// on the other's full pool.
    pub(crate) fn parked_forwards(&self) -> Option<u8> {
        match &self.parked {
            Some(p) => match &p.plan {
                Plan::Receive(put) => put.forward.as_ref().map(|f| f.hop),
                // A copy into another unit's slab waits on that unit's
                // Hello, Alloc and Commit only, never on a forward.
                Plan::CopyOut(_) => Some(0),
                _ => None,
            },
            None => None,
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
        self.reader.shrink(KEEP_BUFFER);
        if self.scratch.capacity() > KEEP_BUFFER {
            self.scratch = Vec::new();
        }
        self.settle(0);
        self.charge.progressed();
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
        // The buffer holds the frame's prefix and header whole (or a
        // prefix the limits refuse): they are decoded in place.
        let d = match decode_request(self.reader.buffer(), &limits) {
            Ok(d) => d,
            Err(ReadError::Io(e)) => return Err(e.into()),
            Err(ReadError::Wire(e)) if open => return self.refuse(0, e.to_string()),
            Err(ReadError::Wire(e)) => return self.pass_gate(0, Err(e)),
        };
        self.reader.consume(d.used);
        if !open {
            // Handshake frames carry no payload (the limits say so).
            return self.pass_gate(d.id, d.req);
        }
        let req = match d.req {
            Ok(req) => req,
            Err(e) => return self.refuse(d.id, e.to_string()),
        };
        if d.payload_len > 0 && !req.carries_payload() {
            return self.refuse(d.id, "this request carries no payload".into());
        }
        self.handle(d.id, req, d.payload_len)
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
        if sent > 0 {
            self.charge.progressed();
        }
        if self.out.is_empty() {
            self.out_since = None;
            if self.out.capacity() > KEEP_BUFFER {
                // A large reply went: its buffer goes with it.
                self.out = Vec::new();
            }
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

    /// A claim of this connection began to wait: the worker leaves a
    /// mailbox for its answer (once).
    pub(crate) fn take_wait_started(&mut self) -> Option<stowage_core::ConnId> {
        if std::mem::take(&mut self.wait_started) {
            self.owner.map(|o| o.conn)
        } else {
            None
        }
    }

    /// The answer to the claim that waited, sent as far as the socket
    /// takes it (the rest with the connection's next turn).
    pub(crate) fn deliver(&mut self, r: Response) -> io::Result<()> {
        let Some(id) = self.waiting.take() else {
            return Ok(());
        };
        // On the socket, whatever the last request came through.
        let ring = std::mem::replace(&mut self.via_ring, false);
        let sent = self.reply(id, &r);
        self.via_ring = ring;
        sent
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
            // A forward waits on the other copies' units.
            Plan::Receive(put) if put.forward.is_some() => true,
            Plan::Receive(put) => match put.into {
                Dest::Slab { .. } | Dest::Nowhere => buffered < put.nbytes,
                Dest::Disk => true,
            },
            Plan::Resolved { found, .. } => self.shared.disk.is_some() && handler::has_disk(found),
            Plan::Send(_) | Plan::CopyOut(_) => true,
            // Its memfd rides on the reply.
            Plan::OpenRing { .. } => true,
            // The slab's memfd rides on the reply.
            Plan::Hello { want_fd, .. } => *want_fd && self.unix,
            Plan::NixlInfo { .. }
            | Plan::Checkpoint { .. }
            | Plan::OpenRestore { .. }
            | Plan::CloseRestore { .. }
            | Plan::Shutdown { .. } => true,
            // Set at once, never behind slow steps on the pool: the
            // fencer's answer must not wait on them.
            Plan::Fence { .. }
            | Plan::Epoch { .. }
            | Plan::SetView { .. }
            | Plan::Reply(_)
            | Plan::Silent
            | Plan::Wait
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
            fenced: self
                .shared
                .life
                .fenced
                .load(std::sync::atomic::Ordering::SeqCst),
            stale: self.stale(),
        };
        if req.may_wait() && (self.via_ring || self.waiting.is_some()) {
            return self.refuse(
                id,
                "a claim that waits goes on the socket, one at a time per connection".into(),
            );
        }
        let now = self.shared.now();
        let plan = handler::handle(self.shared.core_on_call(), &asker, req, payload_len, now);
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
            Plan::Wait => {
                // Answered later, through the unit's Answers, into the
                // mailbox the worker leaves (`take_wait_started`).
                self.waiting = Some(id);
                self.wait_started = true;
                return Ok(());
            }
            Plan::RingKick => {
                self.kicked = true;
                return Ok(());
            }
            Plan::OpenRing { bytes } => return self.open_ring(id, bytes),
            Plan::CopyOut(copy) => return self.copy_out(id, copy),
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
                rows,
            } => self.resolved(pin, found, spares_back, rows),
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
            Plan::Checkpoint { dir, homes } => self.checkpoint(&dir, homes.as_ref()),
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
            Plan::Fence { instance } => {
                let me = self.shared.settings.instance_id;
                if instance != me {
                    return self.reply_error(
                        id,
                        ErrorCode::InvalidRequest,
                        &format!("this unit is instance {me:032x}, not {instance:032x}"),
                    );
                }
                // Every request from here on, on any connection, is
                // refused: nothing is served once the fencer hears Done.
                // (Not `stop`: a unit inside another process that lives on
                // keeps refusing Hellos with `Fenced`, the proof clients
                // take it down on.)
                let life = &self.shared.life;
                life.fenced.store(true, std::sync::atomic::Ordering::SeqCst);
                tracing::error!(
                    "fenced: a client took this unit as down (its directory says it is dead); it serves nothing more and exits"
                );
                self.reply(id, &Response::Done)?;
                self.shared.request_exit();
                return Err(EndReason::Shutdown);
            }
            Plan::Epoch { epoch, digest } => {
                self.epoch = (epoch, digest);
                Response::View {
                    view: self.shared.plane.view(),
                }
            }
            Plan::SetView { view } => Response::View {
                view: self.shared.plane.offer(view),
            },
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

    fn checkpoint(
        &mut self,
        dir: &str,
        homes: Option<&crate::checkpoint::homes::Homes>,
    ) -> Response {
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
        let r = crate::checkpoint::write(&self.shared, &dir, homes);
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
