//! Serving a connection's request ring: the same-host client's requests
//! come through shared memory instead of the socket (the reactor polls the
//! ring while it is busy and parks it when idle); replies go back through
//! the ring, or on the socket after a marker when they do not fit.

use std::io;

use stowage_wire::{encode, ErrorCode, Response};

use super::session::EndReason;
use super::state::Conn;

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
