//! A connection's requests, one type each, sent in a [`Request`](crate::Request) and
//! answered with [`Op::Answer`]. Each is applied by the module that owns what it
//! changes (`blobs.rs`: reservations and commits; `pins.rs`: resolving
//! and unpinning; `index.rs`: clearing), so that a request goes from
//! [`UnitCore::handle`] into that one module and back.

use super::*;
use crate::home::Homes;

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
    pub keys: Keys,
    /// A view: the pin lasts as long as its holder wants (not a read that
    /// copies out and unpins). The memory of a cleared or replaced value a
    /// view pins counts as used ([`crate::CoreError::Full`], naming it);
    /// a read's, as ending by itself ([`crate::CoreError::Busy`]).
    pub view: bool,
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

/// Declare the consumer tasks of `partition` (applied in `claims.rs`).
/// Idempotent: registering again adds tasks. `samples` is the expected
/// total of rows over all units, stored and reported back by
/// [`ClaimStatus`] (0: not given; a non-zero value replaces the stored
/// one). `group_size` 0 or 1: no groups; a non-zero size other than the
/// registered one is [`CoreError::Invalid`]. Task names are non-empty, at
/// most 64 per partition.
#[derive(Clone, Debug)]
pub struct RegisterTasks {
    pub partition: String,
    pub tasks: Vec<String>,
    pub samples: u64,
    pub group_size: u32,
}

/// Lease up to `want` rows of `partition` that are ready for `task` (an
/// entry for every name of `fields`) and neither consumed by nor leased
/// under it, oldest first (by the arrival of the row's first entry).
/// With groups (`group_size` g > 1) only whole groups of g rows are taken.
/// When none is ready and `wait_until` lies ahead, the claim waits
/// ([`ClaimAnswer::Waiting`]) and is answered later through
/// [`Action::Claimed`] with `tag`: once rows are ready (a lease), at
/// `wait_until` (an empty lease), or never if its connection ends first.
#[derive(Clone, Debug)]
pub struct Claim {
    pub partition: String,
    pub task: String,
    pub fields: Vec<String>,
    pub want: u32,
    pub wait_until: Option<Time>,
    pub tag: u64,
    /// With copies: claim only the rows of these homes (the unit holds
    /// copies of other units' rows, which their own claimers claim).
    pub homes: Option<Homes>,
}

/// Settle a lease: the rows of `keep` still leased under it are consumed
/// by its task for good (the answer); its other rows are given back.
/// An unknown or expired lease answers nothing; another connection's
/// lease is [`CoreError::NotOwner`].
#[derive(Clone, Debug)]
pub struct Settle {
    pub lease: LeaseId,
    pub keep: Vec<u64>,
}

/// Where `task` of `partition` stands on this unit.
#[derive(Clone, Debug)]
pub struct ClaimStatus {
    pub partition: String,
    pub task: String,
    /// With copies: count the consumption of these homes' rows only.
    pub homes: Option<Homes>,
}

/// Rows leased to a connection: `rows` in claim order (oldest first; a
/// group's rows ascending, together). An empty lease has id `LeaseId(0)`
/// and is recorded nowhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub id: LeaseId,
    pub rows: Vec<u64>,
    /// With [`Claim::homes`]: the home of each row, in `rows`' order
    /// (else empty).
    pub homes: Vec<u32>,
}

/// The answer to [`Claim`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimAnswer {
    /// Rows leased now (empty when none was ready and the claim does not wait).
    Leased(Lease),
    /// Nothing ready: the claim waits, answered by an [`Action::Claimed`].
    Waiting,
}

/// The later answer to a claim that waited, for the driver to send to
/// `owner`'s connection: `tag` is the claim's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimReply {
    pub owner: Owner,
    pub tag: u64,
    pub lease: Lease,
}

/// The answer to [`ClaimStatus`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimStatusAnswer {
    /// The task is registered for the partition.
    pub registered: bool,
    pub samples: u64,
    pub group_size: u32,
    /// Rows settled (kept) for the task on this unit since the partition
    /// was registered; clearing a consumed row does not lower it. With
    /// [`ClaimStatus::homes`]: the rows of those homes consumed, settled
    /// here or marked consumed by a claimer of another copy
    /// ([`crate::home::CONSUMED_FIELD_PREFIX`]), counted the same way.
    pub consumed: u64,
    /// Rows leased under the task now.
    pub leased: u64,
    /// Rows of the partition on this unit.
    pub rows: u64,
}

/// Open a repair window (applied in `repair.rs`): from now until
/// [`CloseRepair`] or the end of the session, every row and partition
/// cleared in the namespace whose partitions start with `scope` is
/// remembered, so that a [`RepairCommit`] through the window refuses what
/// was cleared after this point. `key` names what is repaired (the
/// window is the only one of that `key` in `scope`: another session's
/// open window of the same key answers [`CoreError::Busy`]). Answers the
/// window's id.
#[derive(Clone, Debug)]
pub struct OpenRepair {
    /// The prefix of every partition of the window's namespace (the
    /// namespace and its separator).
    pub scope: String,
    pub key: String,
}

/// Close a window of the session (an unknown one is ignored; another
/// session's is [`CoreError::NotOwner`]).
#[derive(Clone, Debug)]
pub struct CloseRepair {
    pub window: u64,
}

/// [`Alloc`] for a repair put through `window`: reserved in the slab
/// only (never on the disk tier: a slab with no room answers Full or
/// Busy as an alloc does). Invalid when `window` is not an open window of
/// the session; Busy when it lost track of clears.
#[derive(Clone, Debug)]
pub struct RepairAlloc {
    pub window: u64,
    pub blob: BlobId,
    pub nbytes: u64,
    pub n_entries: u32,
}

/// [`CommitWritten`] of a blob reserved by [`RepairAlloc`] that publishes
/// only the entries whose key has no value here and whose row and
/// partition were not cleared since `window` opened; the others are
/// skipped (their bytes stay unreferenced in the blob, which is freed at
/// once when nothing of it is published). Answers how many of each. A
/// blob committed already (a retry) publishes nothing and answers every
/// entry skipped.
#[derive(Clone, Debug)]
pub struct RepairCommit {
    pub window: u64,
    pub partition: String,
    pub blob: BlobId,
    pub entries: Vec<EntrySpec>,
}

/// The answer to [`RepairCommit`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Repaired {
    pub stored: u32,
    pub skipped: u32,
}
