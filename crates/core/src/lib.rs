//! # stowage-core: the sans-I/O state machine of a storage unit
//!
//! A storage unit owns one slab of memory and an index of what lives in it.
//! This crate is that state, as plain data structures, with no sockets,
//! threads, clocks or randomness: the unit server (`stowage-unit`) feeds it
//! requests with the current time and applies the answers; tests drive it
//! directly with a virtual clock.
//!
//! ## Flow of a blob
//!
//! ```text
//!  alloc(blob, nbytes, n_entries) ──▶ Reserved ──commit(entries)──▶ Committed
//!                                       │  │                          │
//!                       abort, or its   │  └─ abort(in_flight), or    │ clear_rows / replace
//!                       holder's end ───┤     its tcp stream cut      ▼
//!                       (fencing.md)    │          │         freed once no entry and no pin holds it
//!                                       ▼          ▼
//!                                     freed    Quarantined ──quarantine ends──▶ freed
//! ```
//!
//! No timer takes a reservation: it ends with its commit, its abort, or
//! its holder's end as the fencing rules below say.
//!
//! * [`slab::SlabAllocator`] hands out aligned byte ranges of the slab.
//! * Every request comes from an [`Owner`]: a connection
//!   ([`input::Attach`]) of a **session** ([`input::OpenSession`],
//!   a client's connections to this unit). Reservations and pins belong to
//!   the connection that took them and its session; only that session may
//!   commit, abort or unpin them ([`CoreError::NotOwner`] otherwise).
//! * [`op::Alloc`] reserves a range for a client-chosen [`BlobId`];
//!   the client writes the bytes itself (shm) or the server streams them in
//!   (tcp); [`op::Commit`] publishes the blob's entries, each a
//!   [`Key`] → (offset, length) inside the blob. Commit is idempotent, so a
//!   client whose reply was lost asks again.
//! * [`op::Resolve`] turns keys into slab [`SlabRange`]s and pins the
//!   blobs that hold them, so their bytes neither move nor change until
//!   [`op::Unpin`].
//! * [`op::ClearRows`] clears whole rows of a partition
//!   ([`op::ClearPartition`] all of them); a blob's memory returns
//!   to the allocator once no entry and no pin refers to it, through one
//!   function that takes the range by value (a [`slab::Region`] is neither
//!   `Copy` nor `Clone`, so a range released twice does not compile).
//!
//! ## Driving the core
//!
//! As in quinn-proto, one entry point takes every input and every output
//! is polled:
//!
//! * [`UnitCore::handle`]`(now, input)` applies an [`Input`], one type
//!   per kind ([`mod@input`]): a connection's request ([`Request`] with an
//!   [`Op`], one of [`mod@op`]), a
//!   connection's end, a process's exit, a fence, a disk write or
//!   promotion that finished, or the passage of time ([`input::Timeout`]);
//!   it returns that input's own answer ([`Input::Answer`]: a
//!   [`input::Timeout`] answers the holds released, an [`op::Alloc`] an
//!   [`Allocated`]) or a [`CoreError`], so a driver never meets an answer
//!   it did not ask for.
//! * [`UnitCore::poll_action`] hands out what the driver must do for the
//!   core ([`Action`]: spill a blob, delete a file, watch a process); the
//!   driver reports the outcome as another input.
//! * [`UnitCore::poll_timeout`] is the next instant the core needs
//!   [`input::Timeout`]; between inputs the driver sleeps.
//! * Read-only queries ([`UnitCore::stats_at`], [`UnitCore::list`],
//!   [`UnitCore::partitions`], ...) take `&self`.
//!
//! ## Fencing: memory is reused only when no one can still touch it
//!
//! No timer ever takes a range from its holder: a process can be paused
//! (a debugger, a frozen cgroup, swap) for any length of time and then
//! resume its copy. A hold ends only when
//!
//! * its owner releases it (commit, abort, unpin);
//! * its connection ends because the peer closed it
//!   ([`ConnEnd::Closed`]: the peer finished or died; nothing of it copies
//!   any more), unless the peer moves bytes with one-sided transfers;
//! * its connection was cut by the unit ([`ConnEnd::Cut`]) and the peer
//!   never mapped the slab (a tcp peer: the unit's own thread did every
//!   copy and has stopped); a reservation then goes through quarantine;
//! * for a one-sided (nixl) peer ([`input::MakeOneSided`]), whose
//!   WRITEs and READs the unit never sees, and whose connection a network
//!   can end (a FIN or RST) while they run: once its connection ended,
//!   however, the driver fenced its endpoint ([`input::Fenced`]: it
//!   invalidated the peer's NIXL agent) and the nixl quarantine has then
//!   passed ([`input::Timeout`]) — the one hold a timer ends, and only
//!   after the fence;
//! * or the session's process is certainly gone
//!   ([`input::ProcessExited`], after the core asked the driver to watch
//!   it with [`Action::CheckProcess`]), for a peer that maps the slab and whose
//!   connection was cut, or a one-sided peer whose connection ended.
//!
//! A silent session keeps what it holds; [`UnitCore::stats_at`] shows each
//! session's held bytes and its oldest hold, and counts holds older than
//! [`CoreConfig::reservation_lease`] or [`CoreConfig::pin_lease`] as
//! overdue — a reporting threshold, reported and never reclaimed.
//!
//! Lack of space is an answer ([`CoreError::Full`], [`CoreError::Busy`]),
//! never a panic.

#![forbid(unsafe_code)]

pub mod home;
mod meta;
pub mod slab;
mod unit;

pub use meta::Meta;

pub use unit::{
    input, op, Action, ClaimAnswer, ClaimReply, ClaimStatusAnswer, Committed, ConnEnd, CoreConfig,
    Input, Lease, MoveJob, Op, Owner, PartitionClaims, Placed, Placement, Request, Resolved,
    SessionStats, Snapshot, SnapshotEntry, SpareCommitted, SpillJob, Stats, TaskClaims, UnitCore,
    MAX_REPAIR_WINDOWS,
};

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Time as the driver measures it: the duration since an epoch of its
/// choosing (the server uses its start; tests use a virtual clock).
pub type Time = Duration;

/// A blob's id, chosen by the client so that a retried alloc or commit is
/// recognised as the same blob.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlobId(pub u128);

impl std::fmt::Display for BlobId {
    /// 32 hex digits, as logs and directories write ids.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// A pin taken by [`op::Resolve`]. Not guessable: drawn from a keyed
/// pseudo-random function ([`CoreConfig::id_key`]), never sequential.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PinId(pub u64);

/// A lease of rows claimed for a consumer task ([`op::Claim`]), settled
/// with [`op::Settle`]. `LeaseId(0)` is never a lease: it names the empty
/// answer of a claim that found nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LeaseId(pub u64);

/// A session: a client's connections to one unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SessionId(pub u64);

/// One connection of a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ConnId(pub u64);

/// One value's name: a row and a field of it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Key {
    pub row: u64,
    pub field: String,
}

impl Key {
    pub fn new(row: u64, field: impl Into<String>) -> Self {
        Self {
            row,
            field: field.into(),
        }
    }
}

/// The keys of a resolve: a list, or every field of some rows (a view
/// of thousands of values names each field once).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Keys {
    List(Vec<Key>),
    /// Field-major: `fields[0]` of every row, then `fields[1]`...
    Grid {
        rows: Vec<u64>,
        fields: Vec<String>,
    },
}

impl Keys {
    /// How many keys.
    pub fn len(&self) -> usize {
        match self {
            Keys::List(k) => k.len(),
            Keys::Grid { rows, fields } => rows.len().saturating_mul(fields.len()),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `i`-th key's row and field.
    pub fn get(&self, i: usize) -> Option<(u64, &str)> {
        match self {
            Keys::List(k) => k.get(i).map(|k| (k.row, k.field.as_str())),
            Keys::Grid { rows, fields } => {
                let n = rows.len();
                let f = fields.get(i.checked_div(n)?)?;
                Some((rows[i % n], f.as_str()))
            }
        }
    }
}

impl From<Vec<Key>> for Keys {
    fn from(keys: Vec<Key>) -> Self {
        Keys::List(keys)
    }
}

impl std::fmt::Display for Key {
    /// TransferQueue's text form, `"{row}@{field}"`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.row, self.field)
    }
}

/// An entry of a blob being committed: `key` is the `len` bytes at `offset`
/// from the blob's start. `meta` is opaque to the unit and handed back with
/// every read of the key (the rows API keeps dtype and shape there).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntrySpec {
    pub key: Key,
    pub offset: u64,
    pub len: u64,
    pub meta: Vec<u8>,
}

/// One range of the slab: `len` bytes at slab offset `offset` (a piece of
/// a value's [`Placement`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlabRange {
    /// Byte offset in the slab.
    pub offset: u64,
    pub len: u64,
}

/// Why the core refused a request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// Not enough memory now nor once the holds that end by themselves
    /// have ended. `held`: what holds the memory that is not free (views
    /// of cleared or replaced values count as used: a view lasts as long
    /// as its holder wants).
    #[error("unit full: {needed} bytes requested, {free} free of {capacity}{held}")]
    Full {
        needed: u64,
        free: u64,
        capacity: u64,
        held: Held,
    },
    /// Not enough free memory now, but holds that end by themselves will
    /// free enough: puts under way (reservations; of those, only the ones
    /// taken by the refused put's first refusal: a retry of the same blob
    /// is not kept Busy by puts that began since), quarantined ranges,
    /// spills being written, cleared values only reads in flight or a
    /// checkpoint pin, a compaction move. Ask again shortly.
    #[error("unit busy: {needed} bytes requested, {reclaimable} bytes awaiting reclamation")]
    Busy { needed: u64, reclaimable: u64 },
    /// The blob is not reserved (never allocated, or aborted).
    #[error("unknown blob {0:?} (never allocated, or aborted)")]
    UnknownBlob(BlobId),
    /// The reservation or pin belongs to another session.
    #[error("not the owner: {0}")]
    NotOwner(String),
    /// The request contradicts itself or the unit's state.
    #[error("invalid request: {0}")]
    Invalid(String),
}

/// What holds a unit's memory that a refused put could not have
/// ([`CoreError::Full`]); written into the error's message in words.
/// Bytes are slab bytes (whole allocation units).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Values cleared or replaced (no entry names them any more) that
    /// views still pin (`op::Resolve` with `view`): freed when the views
    /// are dropped, not before.
    pub views: u64,
    /// Of `views`, the bytes the asking session's own views pin (its
    /// process holds them: dropping them frees the memory).
    pub own_views: u64,
    /// Reservations of puts under way (their holders commit or abort).
    pub reservations: u64,
    /// Spares: reservations kept for a session's next put.
    pub spares: u64,
    /// Compaction: a move's target range (and, for a blob freed while it
    /// moved, its old range), given back when the move reports.
    pub compaction: u64,
}

impl std::fmt::Display for Held {
    /// Nothing when nothing is held; else `"; held: …"`, naming the
    /// caller's own views first.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == Held::default() {
            return Ok(());
        }
        let mut parts = Vec::new();
        if self.views > 0 {
            let mut v = format!(
                "{} bytes by views of cleared or replaced values",
                self.views
            );
            if self.own_views > 0 {
                v += &format!(
                    " ({} of them by this client's own views: drop them to free the memory)",
                    self.own_views
                );
            }
            parts.push(v);
        }
        for (bytes, what) in [
            (self.reservations, "in reservations of puts under way"),
            (self.spares, "in spares"),
            (self.compaction, "by compaction"),
        ] {
            if bytes > 0 {
                parts.push(format!("{bytes} bytes {what}"));
            }
        }
        write!(f, "; held: {}", parts.join(", "))
    }
}

/// The answer to an alloc.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Allocated {
    /// Reserved (or already reserved by an earlier try): write the bytes
    /// into these (slab offset, bytes) pieces, in order — one piece unless
    /// no free range held the blob whole.
    Reserved { pieces: Vec<(u64, u64)> },
    /// The blob was committed by an earlier try: nothing to write.
    AlreadyCommitted,
    /// The slab has no room but the disk tier has: the blob is reserved on
    /// disk, and its bytes must be streamed to the unit, which writes them
    /// to the blob's file.
    ToDisk,
}
