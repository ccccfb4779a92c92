//! The unit's state: blobs, the key index, pins and the disk tier.
//!
//! One module per concern, each an `impl UnitCore` block over the shared
//! state defined here:
//!
//! * [`sessions`]: sessions, their connections, and how long a hold
//!   outlives its connection (the fencing rules);
//! * [`blobs`]: reservations, spares and commits;
//! * [`index`]: the key index, listing and clearing;
//! * [`pins`]: resolving keys, pins and snapshots;
//! * [`tier`]: the disk tier (spills, disk reservations, promotions);
//! * [`release`]: when a slab range is given back — the one place it is;
//! * [`claims`]: consumer tasks claiming ready rows, leases, waiting
//!   claims;
//! * [`repair`]: repair windows, the clears they remember and the repair
//!   puts they filter;
//! * [`stats`] — counters;
//! * [`drive`]: the one entry point ([`UnitCore::handle`]) and the polled
//!   outputs ([`UnitCore::poll_action`], [`UnitCore::poll_timeout`]).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use crate::slab::{Region, SlabAllocator};

mod blobs;
mod claims;
mod compact;
mod drive;
mod full;
mod in_flight;
mod index;
pub mod input;
#[cfg(any(test, feature = "testing"))]
mod introspect;
pub mod op;
mod pins;
mod placement;
mod release;
mod repair;
mod sessions;
mod stats;
#[cfg(test)]
mod tests;
mod tier;

#[cfg(test)]
use crate::SlabRange;
use crate::{
    Allocated, BlobId, ConnId, CoreError, EntrySpec, Held, Key, Keys, LeaseId, PinId, SessionId,
    Time,
};
pub use compact::MoveJob;
pub use drive::Action;
use in_flight::{InFlight, Orphan};
pub use input::{Input, Op, Request};
pub use op::{ClaimAnswer, ClaimReply, ClaimStatusAnswer, Lease, Resolved, SpareCommitted};
pub use placement::{Placed, Placement};
use release::Release;
pub use repair::MAX_REPAIR_WINDOWS;
pub use stats::{SessionStats, Stats};

/// How many freed committed blob ids a unit remembers, so that a retried
/// alloc or commit of a blob that was committed and has since been freed
/// still answers "already committed" instead of storing stale bytes again.
pub const REMEMBERED_COMMITS: usize = 1 << 16;

/// Settings of the core. Durations are measured on the driver's clock.
#[derive(Clone, Debug)]
pub struct CoreConfig {
    /// Slab bytes (rounded down to 64). At most [`crate::slab::MAX_CAPACITY`].
    pub capacity: u64,
    /// An uncommitted reservation older than this is reported as overdue
    /// in [`Stats`]. It is never taken from its holder. Default 30 s.
    pub reservation_lease: Duration,
    /// A pin older than this is reported as overdue. Default 30 s.
    pub pin_lease: Duration,
    /// How long a range stays unusable after an aborted in-flight transfer
    /// (a stream the unit cut off), before it is reused. Default 5 s.
    pub quarantine: Duration,
    /// How long the holds of a one-sided (nixl) peer whose connection ended
    /// stay after the driver fenced its endpoint ([`input::Fenced`]):
    /// time for transfers already posted to drain. Default 5 s.
    pub nixl_quarantine: Duration,
    /// Bytes the key index may take (names, metadata and a fixed cost per
    /// entry, 96 bytes); a commit past it answers Full. Default:
    /// a quarter of the slab, at least 64 MiB.
    pub index_budget: u64,
    /// Most connections one session may have at once. Default 64.
    pub max_session_conns: usize,
    /// Most reservations and pins one session may hold at once (each costs
    /// the unit some memory); past it, Busy. Default 16384.
    pub max_session_holds: usize,
    /// Key of the function that draws pin ids (the driver gives a random
    /// one; the core itself has no randomness).
    pub id_key: (u64, u64),
    /// Bytes of the disk tier; 0 turns it off. Default 0.
    pub disk_capacity: u64,
    /// Past this fraction of the slab in use, committed unpinned blobs spill
    /// to disk, oldest first. Default 0.9.
    pub high_watermark: f64,
    /// Spilling stops once use is below this fraction. Default 0.8.
    pub low_watermark: f64,
    /// Bytes at the top of the slab that spares come from (and only they,
    /// unless data has no room elsewhere): idle clients' spares can hold
    /// no more, and never cut the data zone into pieces. 0: no spares.
    /// Default: 1/16 of the slab.
    pub spare_budget: u64,
    /// Compaction runs while the largest free range is below this fraction
    /// of the free bytes (and at least [`CoreConfig::compact_min_free`] is
    /// free). Default 0.5.
    pub compact_below: f64,
    /// Free bytes under which compaction does not run (nothing worth
    /// gathering). Default: 1/64 of the slab, at least 64 KiB.
    pub compact_min_free: u64,
    /// Largest blob compaction moves in one step (bounds what one move
    /// costs). Default 64 MiB.
    pub compact_max_move: u64,
    /// Compaction's budget: it copies at most this many bytes per byte
    /// committed (it earns credit as data is stored, up to a quarter of
    /// the slab, and spends it on moves). 0 turns compaction off.
    /// Default 0.25.
    pub compact_ratio: f64,
    /// A claim's lease ([`op::Claim`]) not settled within this gives its
    /// rows back. Default 30 s.
    pub claim_lease: Duration,
    /// Cleared rows the repair windows may remember at once (about 40
    /// bytes each, `repair.rs`); past it a cleared row is remembered as
    /// its whole partition. Default 2^20.
    pub repair_row_tombstones: usize,
    /// Partitions the repair windows may remember at once (about 100
    /// bytes and the name each); past it every open window loses track of
    /// clears (its repair puts answer Busy). Default 2^16.
    pub repair_partitions: usize,
    /// A repair window whose session sent no repair request for this
    /// long may be taken over: another session's OpenRepair of the same
    /// key makes it lose track (its repair puts answer Busy, nothing of
    /// them is stored) and opens its own, so that a repairer stopped
    /// mid-repair (SIGSTOP, a host cut off) does not hold the repair up.
    /// Default 30 s.
    pub repair_window_lease: Duration,
}

impl CoreConfig {
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            reservation_lease: Duration::from_secs(30),
            pin_lease: Duration::from_secs(30),
            quarantine: Duration::from_secs(5),
            nixl_quarantine: Duration::from_secs(5),
            index_budget: (capacity / 4).max(64 << 20),
            max_session_conns: 64,
            max_session_holds: 16384,
            id_key: (0x5157_0a6e, 0x9e37_79b9),
            disk_capacity: 0,
            high_watermark: 0.9,
            low_watermark: 0.8,
            spare_budget: capacity / 16,
            compact_below: 0.5,
            compact_min_free: (capacity / 64).max(64 << 10),
            compact_max_move: 64 << 20,
            compact_ratio: 0.25,
            claim_lease: Duration::from_secs(30),
            repair_row_tombstones: 1 << 20,
            repair_partitions: 1 << 16,
            repair_window_lease: Duration::from_secs(30),
        }
    }
}

/// Index bytes an entry costs beyond its field name and metadata.
pub const ENTRY_OVERHEAD: u64 = 96;

fn entry_cost(field: &str, meta_len: usize) -> u64 {
    ENTRY_OVERHEAD + field.len() as u64 + meta_len as u64
}

/// Who makes a request: a connection of a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Owner {
    pub session: SessionId,
    pub conn: ConnId,
}

impl Owner {
    /// The unit itself (checkpoints): never detached.
    pub const UNIT: Owner = Owner {
        session: SessionId(0),
        conn: ConnId(0),
    };
}

/// How a connection ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnEnd {
    /// The peer closed it (or died): it touches nothing any more.
    Closed,
    /// The unit cut it (a timeout, an invalid request, shutdown): the peer
    /// may still be running.
    Cut,
}

/// Who holds a reservation or pin. `conn` is `None` once the connection
/// that took it ended while its peer may still touch the range: the
/// session keeps the hold, until `kept` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    session: SessionId,
    conn: Option<ConnId>,
    since: Time,
    kept: Kept,
}

impl Holder {
    /// The one ownership check of a hold: only the session that took it
    /// may use or end it; any other gets [`CoreError::NotOwner`] with
    /// `refusal`.
    fn check(&self, owner: Owner, refusal: impl FnOnce() -> String) -> Result<(), CoreError> {
        if self.session == owner.session {
            Ok(())
        } else {
            Err(CoreError::NotOwner(refusal()))
        }
    }
}

/// Until when a hold whose connection ended is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kept {
    /// Its connection is open.
    Open,
    /// Until the session's process is gone ([`input::ProcessExited`]): a
    /// peer that maps the slab, whose connection the unit cut.
    UntilGone,
    /// A one-sided (nixl) peer's: until its process is gone, or its
    /// endpoint is fenced ([`input::Fenced`]) and then
    /// [`CoreConfig::nixl_quarantine`] has passed.
    UntilFenced,
    /// Fenced: released at this time, or when the process is gone.
    Until(Time),
}

/// How a connection's peer reaches the slab.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
struct Reach {
    /// It maps the slab (a Unix-socket peer handed the memfd).
    maps: bool,
    /// It moves bytes with one-sided transfers the unit never sees (nixl).
    one_sided: bool,
}

struct Session {
    /// Open connections, and how each one's peer reaches the slab.
    conns: HashMap<ConnId, Reach>,
    reservations: HashSet<BlobId>,
    pins: HashSet<PinId>,
}

#[derive(Debug)]
enum State {
    Reserved {
        holder: Holder,
        /// The entry count the commit must name; `None` for a spare
        /// ([`op::ReserveSpare`]): any count, and the blob shrinks
        /// to what the commit names.
        n_entries: Option<u32>,
    },
    /// A blob written to disk by the unit: its entries are published once
    /// its file is durable ([`input::DiskWritten`]).
    PendingDisk {
        partition: String,
        entries: Vec<EntrySpec>,
    },
    Committed {
        /// Entries of the index that point into this blob.
        live: u32,
        /// Pins that hold this blob.
        pins: u32,
    },
}

/// Where a blob's bytes are on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Disk {
    None,
    /// The driver is writing its file.
    Writing,
    /// Its file is complete and synced.
    Durable,
}

#[derive(Debug)]
struct Blob {
    /// Its slab range; `None` while it lives only on disk.
    region: Option<Region>,
    /// A slab range being filled from disk ([`input::Promote`]).
    promoting: Option<Region>,
    /// The range compaction is copying the blob to ([`Action::Move`]).
    moving: Option<Region>,
    nbytes: u64,
    state: State,
    disk: Disk,
    /// Commit order: spilling takes the oldest first.
    seq: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    blob: BlobId,
    /// Offset in the blob (the blob may move between slab and disk).
    offset: u64,
    len: u64,
    /// Inline up to 32 bytes (a rows value's is a few): a resolve of thousands
    /// of values reads no other memory per value.
    meta: crate::Meta,
}

struct Pin {
    blobs: Vec<BlobId>,
    holder: Holder,
    /// Taken for a view ([`op::Resolve::view`]): held as long as its
    /// holder wants, so what it keeps counts as used.
    view: bool,
}

/// A reservation or a pin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hold {
    Reservation(BlobId),
    Pin(PinId),
}

/// The maps on every put's and get's path, keyed by what clients send:
/// hashed with foldhash (seeded per process) rather than SipHash, whose
/// cost showed in the profile of a 3,072-value put.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

type Rows = Map<u64, Map<String, Entry>>;

/// A blob the driver should copy from the slab to its disk file
/// ([`Action::Spill`]), then report with [`input::DiskWritten`]. If the
/// blob is freed meanwhile, its range stays allocated until the report
/// (the driver reads it alone), and the file it wrote is deleted through
/// an [`Action::DeleteFile`] after it reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpillJob {
    pub blob: BlobId,
    /// (slab offset, bytes) of each piece of its bytes, in order (kept
    /// allocated until the write is done); they add up to at least `nbytes`.
    pub pieces: Vec<(u64, u64)>,
    pub nbytes: u64,
}

/// The answer to a commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Committed {
    /// The entries are published.
    Done,
    /// The blob's file is still being made durable: ask again.
    Pending,
}

/// One entry of a [`Snapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotEntry {
    pub partition: String,
    pub key: Key,
    pub blob: BlobId,
    pub offset: u64,
    pub len: u64,
    pub meta: Vec<u8>,
}

/// A consistent view of every committed entry, with the blobs that hold
/// them pinned (until [`op::Unpin`] of `pin`).
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub pin: Option<PinId>,
    pub entries: Vec<SnapshotEntry>,
    /// Each blob once: its size and where its bytes are now.
    pub blobs: Vec<(BlobId, u64, Placement)>,
    /// The claims state of every registered partition, by name, taken in
    /// the same step as the entries ([`input::RestoreClaims`] puts it
    /// back).
    pub claims: Vec<PartitionClaims>,
}

/// The claims state of one registered partition, as a checkpoint keeps
/// it: its registration, its rows in the order claims take them, and what
/// each task consumed. Rows leased at the time are not consumed (a
/// restore gives them back); waiting claims are not kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionClaims {
    pub partition: String,
    pub samples: u64,
    pub group_size: u32,
    /// The partition's rows in the order claims take them (the rows of
    /// one unit of claiming, a row or a group, together), each once.
    pub order: Vec<u64>,
    /// Its tasks, in the order they were registered.
    pub tasks: Vec<TaskClaims>,
}

/// What one task of a [`PartitionClaims`] consumed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskClaims {
    pub name: String,
    /// The rows settled for the task and still stored, ascending.
    pub consumed: Vec<u64>,
    /// Rows ever settled for the task (never lowered).
    pub consumed_total: u64,
    /// With copies: rows ever consumed per home, settled here or marked
    /// consumed (never lowered), by home, ascending.
    pub by_home: Vec<(u32, u64)>,
}

/// The sans-I/O state machine of one storage unit. See the crate docs.
pub struct UnitCore {
    cfg: CoreConfig,
    slab: SlabAllocator,
    blobs: Map<BlobId, Blob>,
    reserved_bytes: u64,
    /// The key index and its byte budget's use.
    index: index::Index,
    /// Sessions, their connections and what they hold.
    holds: sessions::Holds,
    /// Ranges waiting out a quarantine.
    quarantined: release::Quarantine,
    /// Committed blobs freed lately.
    freed: release::FreedCommits,
    /// Puts answered Busy for memory: when each was first refused.
    refusals: full::FirstRefusals,
    /// The disk tier's use.
    tier: tier::Tier,
    /// The driver's work on blobs freed meanwhile (a file being written,
    /// a promotion, a move): what it touches is released once it reports.
    in_flight: InFlight,
    commit_seq: u64,
    /// What the driver must do for the core ([`UnitCore::poll_action`]).
    actions: VecDeque<Action>,
    /// Compaction's state.
    compactor: compact::Compactor,
    /// Consumer tasks, their leases and waiting claims.
    claims: claims::Claims,
    /// Repair windows and the clears they remember.
    repairs: repair::Repairs,
    /// The time of the latest input.
    last_input: Time,
}

impl UnitCore {
    /// A unit with an empty slab of `cfg.capacity` bytes.
    pub fn new(cfg: CoreConfig) -> Result<Self, CoreError> {
        if cfg.capacity > crate::slab::MAX_CAPACITY {
            return Err(CoreError::Invalid(format!(
                "capacity {} exceeds the maximum of {} bytes",
                cfg.capacity,
                crate::slab::MAX_CAPACITY
            )));
        }
        if !(0.0..=16.0).contains(&cfg.compact_ratio) {
            return Err(CoreError::Invalid(format!(
                "the compaction ratio must lie in 0..=16, not {}",
                cfg.compact_ratio
            )));
        }
        if !(0.0 < cfg.low_watermark
            && cfg.low_watermark <= cfg.high_watermark
            && cfg.high_watermark <= 1.0)
        {
            return Err(CoreError::Invalid(format!(
                "watermarks must satisfy 0 < low ({}) <= high ({}) <= 1",
                cfg.low_watermark, cfg.high_watermark
            )));
        }
        Ok(Self {
            slab: SlabAllocator::new(cfg.capacity, cfg.spare_budget),
            cfg,
            blobs: Map::default(),
            reserved_bytes: 0,
            index: index::Index::default(),
            holds: sessions::Holds::new(),
            quarantined: release::Quarantine::default(),
            freed: release::FreedCommits::default(),
            refusals: full::FirstRefusals::default(),
            tier: tier::Tier::default(),
            in_flight: InFlight::default(),
            commit_seq: 0,
            actions: VecDeque::new(),
            compactor: compact::Compactor::default(),
            claims: claims::Claims::default(),
            repairs: repair::Repairs::default(),
            last_input: Time::ZERO,
        })
    }

    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// Slab bytes under management.
    pub fn capacity(&self) -> u64 {
        self.slab.capacity()
    }

    pub(super) fn disk_on(&self) -> bool {
        self.cfg.disk_capacity > 0
    }

    pub(super) fn disk_free(&self) -> u64 {
        self.cfg.disk_capacity.saturating_sub(self.tier.disk_used)
    }
}
