//! A connection's requests, one type each, sent in a [`Request`](crate::Request) and
//! answered with [`Op::Answer`]. Each is applied by the module that owns what it
//! changes (`blobs.rs`: reservations and commits; `pins.rs`: resolving
//! and unpinning; `index.rs`: clearing), so that a request goes from
//! [`UnitCore::handle`] into that one module and back.

use super::*;

/// Reserve `nbytes` for `blob`, held by the connection until it commits
/// or aborts, or its connection ends. A retry answers the same; a blob
/// committed since answers [`Allocated::AlreadyCommitted`]. When the
/// slab has no room and the disk tier has, the blob is reserved on disk
/// ([`Allocated::ToDisk`]): its bytes must come with the request
/// ([`CommitWritten`]).
#[derive(Clone, Debug)]
pub struct Alloc {
    pub blob: BlobId,
    pub nbytes: u64,
    pub n_entries: u32,
}

/// Reserve a spare: `nbytes` of slab memory for a put whose size and
/// entries are not known yet. Answers its offset, or `None` when the
/// slab has no room now — a spare is an offer, never an error for want
/// of room.
#[derive(Clone, Debug)]
pub struct ReserveSpare {
    pub blob: BlobId,
    pub nbytes: u64,
}

/// Give the spare `spare` the id `blob` of the put written into it.
/// Answers whether it took the id (false, and the spare given up, when
/// `blob` was committed by an earlier try).
#[derive(Clone, Debug)]
pub struct NameSpare {
    pub spare: BlobId,
    pub blob: BlobId,
}

/// Publish the entries of a reserved blob whose bytes the client
/// wrote itself (or that were committed already). A blob reserved on
/// the disk tier is refused: its bytes must come with a put.
#[derive(Clone, Debug)]
pub struct Commit {
    pub partition: String,
    pub blob: BlobId,
    pub entries: Vec<EntrySpec>,
}

/// [`Commit`] of a blob whose bytes the driver wrote (a put whose
/// payload it streamed into the slab or the blob's file, a restored
/// checkpoint): a blob reserved on disk answers [`Committed::Pending`]
/// until its file is durable.
#[derive(Clone, Debug)]
pub struct CommitWritten {
    pub partition: String,
    pub blob: BlobId,
    pub entries: Vec<EntrySpec>,
}

/// A put written into the spare `written`, committed as `blob`, and a
/// new spare `spare` of `spare_nbytes` for the next put, in one step.
#[derive(Clone, Debug)]
pub struct CommitSpare {
    pub written: BlobId,
    pub blob: BlobId,
    pub partition: String,
    pub entries: Vec<EntrySpec>,
    pub spare: BlobId,
    pub spare_nbytes: u64,
}

/// Give up a reservation; with `in_flight` (a transfer may still write
/// into it) its range is quarantined before reuse.
#[derive(Clone, Debug)]
pub struct Abort {
    pub blob: BlobId,
    pub in_flight: bool,
}

/// Where `keys` of `partition` live, with their metadata; pins the
/// blobs holding the found ones.
#[derive(Clone, Debug)]
pub struct Resolve {
    pub partition: String,
    pub keys: Vec<Key>,
}

/// Drop a pin (an unknown one is ignored).
#[derive(Clone, Debug)]
pub struct Unpin {
    pub pin: PinId,
}

/// Remove every entry of the given rows. Answers the entries removed
/// (a client's NUL-prefixed bookkeeping fields not counted).
#[derive(Clone, Debug)]
pub struct ClearRows {
    pub partition: String,
    pub rows: Vec<u64>,
}

/// Remove every entry of `partition`. Answers the entries removed.
#[derive(Clone, Debug)]
pub struct ClearPartition {
    pub partition: String,
}

/// The answer to [`Resolve`].
#[derive(Clone, Debug)]
pub struct Resolved {
    /// The pin, none when no key was found.
    pub pin: Option<PinId>,
    /// Each key's placement and metadata, in the order asked.
    pub found: Vec<Option<Placed>>,
}

/// The answer to [`CommitSpare`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpareCommitted {
    /// `blob` was committed by an earlier try: nothing was published, and
    /// the spare written into was given up.
    AlreadyCommitted,
    /// The blob's file is still being made durable: ask again.
    Pending,
    /// Published; the next spare's offset (none for want of room).
    Committed { spare: Option<u64> },
}
