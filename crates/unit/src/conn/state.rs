//! A connection's state ([`Conn`]): what the files of `conn` work on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use stowage_core::Owner;

use super::inbuf::InBuf;
use crate::admit::{Counted, Ticket};
use crate::auth::Gate;
use crate::budget::Charge;
use crate::handler::Plan;
use crate::metrics::Op;
use crate::sessions::Peer;
use crate::shared::Shared;

/// One connection's state between its requests; served by a worker of
/// the reactor ([`crate::reactor`]), and by the blocking pool for a step
/// that blocks ([`Conn::run_parked`]).
pub(crate) struct Conn {
    pub(super) shared: Arc<Shared>,
    /// Its socket, and what was read from it and not yet served.
    pub(super) reader: InBuf,
    pub(super) peer: Peer,
    /// A Unix-socket peer: it may be handed the slab.
    pub(super) unix: bool,
    /// May send admin requests (shutdown, checkpoint).
    pub(super) admin: bool,
    pub(super) namespace: Option<String>,
    pub(super) owner: Option<Owner>,
    /// The handshake before Hello (the shared secret's challenge).
    pub(super) gate: Gate,
    /// The handshake, up to the Hello, must be done by then: a peer that
    /// has not proved anything holds no connection for long.
    pub(super) handshake_deadline: Instant,
    /// Its place in the handshake pool, until it proves itself.
    pub(super) ticket: Option<Ticket>,
    /// Its slot among the served connections, once it proved itself.
    pub(super) slot: Option<Counted>,
    /// The send timeout set on the socket.
    pub(super) write_timeout: Duration,
    /// Reply bytes the peer has not taken yet.
    pub(super) out: Vec<u8>,
    /// Since when `out` has waited for the peer.
    pub(super) out_since: Option<Instant>,
    pub(super) scratch: Vec<u8>,
    /// The current request was answered with an error (for metrics).
    pub(super) failed: bool,
    /// When the current request's frame began to arrive (its deadline's
    /// base, and its latency's start: one clock read for both).
    pub(super) frame_start: Instant,
    /// Whether its requests are recorded (the unit keeps metrics).
    pub(super) metrics: bool,
    /// Carried out by the blocking pool (its socket calls block, bounded
    /// by their deadlines); otherwise every socket call returns at once.
    pub(super) blocking: bool,
    /// A planned request whose next step blocks: for the pool.
    pub(super) parked: Option<Parked>,
    /// The connection's Hello mapped the slab (a request ring may be
    /// made for it).
    pub(super) maps: bool,
    /// Its request ring, once it asked for one.
    pub(super) ring: Option<stowage_shm::ring::Ring>,
    /// The request being served came through the ring: its reply goes
    /// back there.
    pub(super) via_ring: bool,
    /// The client kicked the ring (the worker polls it again).
    pub(super) kicked: bool,
    /// A ring entry, copied out before it is decoded.
    pub(super) entry: Vec<u8>,
    /// The id of its claim that waits for rows (answered through the
    /// unit's `Answers`), and whether the worker has yet to leave a
    /// mailbox for it.
    pub(super) waiting: Option<u64>,
    pub(super) wait_started: bool,
    /// Its share of the unit's budget for memory outside the slab: what
    /// its buffers hold, or the frame it reads when that is more.
    pub(super) charge: Charge,
    /// The whole frame being read, reserved from the budget as soon as
    /// its prefix said how large it is (0: a small one, or none).
    pub(super) reserve: usize,
    /// Since when it waits for the budget to read its next bytes.
    pub(super) starved: Option<Instant>,
    /// Time the current frame waited for the budget: its deadline moves
    /// by as much (a peer is not cut for the unit's own wait).
    pub(super) frame_paused: Duration,
    /// The view of the plane it speaks for, epoch and digest
    /// (`Request::Epoch`; the first view until it says): its row requests
    /// are served only while it is the unit's.
    pub(super) epoch: (u64, u64),
}

impl Conn {
    /// Whether the connection speaks for another view of the plane than
    /// the unit's.
    pub(super) fn stale(&self) -> bool {
        !self.shared.plane.serves(self.epoch)
    }
}

/// A request planned by a worker and carried out by the pool.
pub(super) struct Parked {
    pub(super) id: u64,
    pub(super) plan: Plan,
    pub(super) op: Option<Op>,
    /// It came through the ring.
    pub(super) via_ring: bool,
}
