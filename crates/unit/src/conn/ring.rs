//! Serving a connection's request ring: the same-host client's requests
//! come through shared memory instead of the socket (the reactor polls the
//! ring while it is busy and parks it when idle); replies go back through
//! the ring, or on the socket after a marker when they do not fit.

use std::io;
use std::time::Instant;

use stowage_wire::{encode, ErrorCode, Request, Response};

use super::session::EndReason;
use super::state::Conn;

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

impl Conn {
    /// Whether the client kicked its ring since the last call.
    pub(crate) fn take_kick(&mut self) -> bool {
        std::mem::take(&mut self.kicked)
    }

    /// Whether it has a request ring.
    pub(crate) fn has_ring(&self) -> bool {
        self.ring.is_some()
    }

    /// The worker stops polling the ring: true when it may (the client
    /// kicks it for its next request), false when requests came.
    pub(crate) fn park_ring(&self) -> bool {
        self.ring.as_ref().is_none_or(|r| r.park())
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
            let (id, req) = match stowage_wire::decode_frame::<Request>(&entry, &limits) {
                Ok(Some((f, used))) if used == entry.len() && f.payload.is_empty() => {
                    (f.envelope.id, f.envelope.body)
                }
                Ok(_) => {
                    break RingStep::End(EndReason::Invalid(
                        "a ring entry is one whole frame without payload".into(),
                    ))
                }
                Err(e) => break RingStep::End(EndReason::Invalid(format!("ring entry: {e}"))),
            };
            if let Err(e) = req.validate(&limits) {
                break RingStep::End(EndReason::Invalid(e.to_string()));
            }
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

    /// Make this connection's request ring and hand its memfd over with
    /// the reply (on the pool: the socket may block).
    pub(super) fn open_ring(&mut self, id: u64, bytes: u32) -> Result<(), EndReason> {
        if !self.maps {
            return self.reply_error(
                id,
                ErrorCode::InvalidRequest,
                "a request ring is for a connection that mapped the slab (Hello with want_fd on the Unix socket)",
            );
        }
        if self.ring.is_some() || self.via_ring {
            return self.reply_error(
                id,
                ErrorCode::InvalidRequest,
                "this connection has a request ring already",
            );
        }
        let (ring, fd) = match stowage_shm::ring::Ring::create(bytes as usize) {
            Ok(r) => r,
            Err(e) => {
                return self.reply_error(
                    id,
                    ErrorCode::Internal,
                    &format!("cannot make a request ring: {e}"),
                )
            }
        };
        // Parked from the start: the client's first request kicks it.
        ring.park();
        let mut out = Vec::new();
        encode(id, &Response::Ring { bytes }, 0, &mut out).map_err(io::Error::other)?;
        let sent = match &self.reader.src.socket {
            stowage_wire::io::Socket::Unix(s) => {
                stowage_shm::send_with_fd(s, &out, std::os::fd::AsFd::as_fd(&fd))?
            }
            stowage_wire::io::Socket::Tcp(_) => 0,
        };
        self.out.extend_from_slice(&out[sent..]);
        self.flush_blocking()?;
        self.ring = Some(ring);
        if let Some(m) = &self.shared.metrics {
            m.ring_opened();
        }
        Ok(())
    }
}
