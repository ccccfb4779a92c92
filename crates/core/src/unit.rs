//! The unit's state: blobs, the key index, pins and the disk tier.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use crate::slab::{Region, SlabAllocator};
use crate::{
    Allocated, BlobId, ConnId, CoreError, EntrySpec, Key, Location, PinId, SessionId, Time,
};

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
    /// stay after the driver fenced its endpoint ([`UnitCore::fence`]):
    /// time for transfers already posted to drain. Default 5 s.
    pub nixl_quarantine: Duration,
    /// Bytes the key index may take (names, metadata and a fixed cost per
    /// entry, [`ENTRY_OVERHEAD`]); a commit past it answers Full. Default:
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
        }
    }
}

/// Counters of a unit, as reported by the stats request.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stats {
    pub capacity: u64,
    /// Slab bytes held by any blob (reserved, committed or quarantined).
    pub used: u64,
    pub reserved_bytes: u64,
    pub quarantined_bytes: u64,
    pub blobs: u64,
    pub entries: u64,
    pub rows: u64,
    pub pins: u64,
    /// Bytes of the disk tier (0: off).
    pub disk_capacity: u64,
    /// Disk bytes held: files written or being written.
    pub disk_used: u64,
    /// Blobs whose bytes are only on disk.
    pub spilled_blobs: u64,
    /// Disk tier I/O since start, kept by the unit server (the core does
    /// no I/O and reports 0): bytes written by spills and disk puts, and
    /// the time spent writing them; bytes read back, and the time.
    pub disk_write_bytes: u64,
    pub disk_write_micros: u64,
    pub disk_read_bytes: u64,
    pub disk_read_micros: u64,
    /// Bytes the key index takes (see [`CoreConfig::index_budget`]).
    pub index_bytes: u64,
    /// Bytes held by sessions: reserved ranges and pinned blobs.
    pub held_bytes: u64,
    /// Reservations and pins older than their lease (reported, never
    /// reclaimed while their holder may still touch them).
    pub overdue_holds: u64,
    /// Every session that holds something or has a connection.
    pub sessions: Vec<SessionStats>,
    /// Traffic since start, kept by the unit server (the core reports 0;
    /// so does a unit started without metrics): requests answered, value
    /// bytes written into the unit (puts, commits) and read out of it
    /// (gets, resolves), and Busy answers. Two samples give rates
    /// (`stowage status`). Last in the message, so a client that predates
    /// them still reads the fields before.
    pub ops: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub busy: u64,
    /// Partitions that hold rows (over every namespace).
    pub partitions: u64,
    /// Bytes of pinned blobs (part of [`Stats::held_bytes`]).
    pub pinned_bytes: u64,
    /// Spares: reservations same-host clients hold for their next puts
    /// ([`UnitCore::reserve_spare`]; not counted in `blobs`, never
    /// overdue), and their bytes (part of `reserved_bytes` and `used`).
    pub spares: u64,
    pub spare_bytes: u64,
    /// Whether the unit serves one-sided NIXL transfers (`--nixl`; set by
    /// the unit server, the core reports false). Last in the message.
    pub serves_nixl: bool,
}

/// What one session holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SessionStats {
    pub session: u64,
    /// Open connections.
    pub connections: u32,
    pub reservations: u32,
    pub pins: u32,
    /// Reserved bytes plus the bytes of pinned blobs.
    pub held_bytes: u64,
    /// Age of its oldest reservation or pin, in milliseconds.
    pub oldest_hold_ms: u64,
    /// Holds whose connection the unit cut: kept until the session's
    /// process is gone.
    pub orphaned: u32,
    /// Of its reservations, the spares (held for its next puts; not in
    /// `oldest_hold_ms`).
    pub spares: u32,
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

/// Until when a hold whose connection ended is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kept {
    /// Its connection is open.
    Open,
    /// Until the session's process is gone ([`UnitCore::session_gone`]): a
    /// peer that maps the slab, whose connection the unit cut.
    UntilGone,
    /// A one-sided (nixl) peer's: until its process is gone, or its
    /// endpoint is fenced ([`UnitCore::fence`]) and then
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
        /// ([`UnitCore::reserve_spare`]): any count, and the blob shrinks
        /// to what the commit names.
        n_entries: Option<u32>,
    },
    /// A blob written to disk by the unit: its entries are published once
    /// its file is durable ([`UnitCore::disk_written`]).
    PendingDisk { ns: String, entries: Vec<EntrySpec> },
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
    /// A slab range being filled from disk ([`UnitCore::promote_begin`]).
    promoting: Option<Region>,
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
    meta: Box<[u8]>,
}

struct Pin {
    blobs: Vec<BlobId>,
    holder: Holder,
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

/// Where a found value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// In the slab.
    Memory(Location),
    /// Only in its blob's disk file, at `offset` from the blob's start.
    Disk { blob: BlobId, offset: u64, len: u64 },
}

impl Place {
    pub fn len(&self) -> u64 {
        match self {
            Place::Memory(l) => l.len,
            Place::Disk { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A found key: where its value is, and the metadata stored with it.
pub type Located = (Place, Vec<u8>);

/// What the driver must do with files on behalf of the core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// The blob is gone: remove its disk file.
    DeleteFile(BlobId),
}

/// A blob the driver should copy from the slab to its disk file, then
/// report with [`UnitCore::disk_written`]. If the blob is freed meanwhile,
/// its range may be reused at once (its bytes are not needed any more):
/// the driver reads the range only before reporting, and the file it wrote
/// is deleted through an [`Effect`] after it reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpillJob {
    pub blob: BlobId,
    /// Slab offset of its bytes (kept allocated until the write is done).
    pub offset: u64,
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
    pub ns: String,
    pub key: Key,
    pub blob: BlobId,
    pub offset: u64,
    pub len: u64,
    pub meta: Vec<u8>,
}

/// A consistent view of every committed entry, with the blobs that hold
/// them pinned (until [`UnitCore::unpin`] of `pin`).
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub pin: Option<PinId>,
    pub entries: Vec<SnapshotEntry>,
    /// Each blob once: its size and where its bytes are now.
    pub blobs: Vec<(BlobId, u64, Place)>,
}

/// The sans-I/O state machine of one storage unit. See the crate docs.
pub struct UnitCore {
    cfg: CoreConfig,
    slab: SlabAllocator,
    blobs: Map<BlobId, Blob>,
    /// namespace → row → field → entry.
    index: Map<String, Rows>,
    pins: Map<PinId, Pin>,
    /// Counter under the pin-id function.
    pin_counter: u64,
    /// Quarantined ranges by the time they may be reused.
    quarantined: BTreeMap<(Time, u64), Region>,
    quarantine_seq: u64,
    /// Holds of fenced one-sided peers by the time they are released
    /// ([`Kept::Until`]); an entry whose hold has gone or was taken over
    /// is skipped.
    fenced: BTreeMap<(Time, u64), (SessionId, Hold)>,
    sessions: HashMap<SessionId, Session>,
    next_session: u64,
    next_conn: u64,
    index_bytes: u64,
    entries: u64,
    reserved_bytes: u64,
    quarantined_bytes: u64,
    /// Ids of committed blobs freed lately (at most [`REMEMBERED_COMMITS`]),
    /// oldest first.
    freed_commits: VecDeque<BlobId>,
    freed_commit_set: HashSet<BlobId>,
    disk_used: u64,
    /// Blobs freed while their file was being written: the file goes, and
    /// the slab range the writer reads from is freed, once the write
    /// reports back.
    orphan_writes: HashMap<BlobId, (u64, Option<Region>)>,
    commit_seq: u64,
    effects: Vec<Effect>,
    /// Slab ranges of promotions whose blob was freed before the driver
    /// finished copying into them.
    orphan_promotions: HashMap<BlobId, Region>,
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
        if !(0.0 < cfg.low_watermark
            && cfg.low_watermark <= cfg.high_watermark
            && cfg.high_watermark <= 1.0)
        {
            return Err(CoreError::Invalid(format!(
                "watermarks must satisfy 0 < low ({}) <= high ({}) <= 1",
                cfg.low_watermark, cfg.high_watermark
            )));
        }
        let mut sessions = HashMap::new();
        sessions.insert(
            Owner::UNIT.session,
            Session {
                conns: HashMap::from([(Owner::UNIT.conn, Reach::default())]),
                reservations: HashSet::new(),
                pins: HashSet::new(),
            },
        );
        Ok(Self {
            slab: SlabAllocator::new(cfg.capacity),
            cfg,
            blobs: Map::default(),
            index: Map::default(),
            pins: Map::default(),
            pin_counter: 0,
            quarantined: BTreeMap::new(),
            quarantine_seq: 0,
            fenced: BTreeMap::new(),
            sessions,
            next_session: 1,
            next_conn: 1,
            index_bytes: 0,
            entries: 0,
            reserved_bytes: 0,
            quarantined_bytes: 0,
            freed_commits: VecDeque::new(),
            freed_commit_set: HashSet::new(),
            disk_used: 0,
            orphan_writes: HashMap::new(),
            commit_seq: 0,
            effects: Vec::new(),
            orphan_promotions: HashMap::new(),
        })
    }

    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// Slab bytes under management.
    pub fn capacity(&self) -> u64 {
        self.slab.capacity()
    }

    fn disk_on(&self) -> bool {
        self.cfg.disk_capacity > 0
    }

    fn disk_free(&self) -> u64 {
        self.cfg.disk_capacity.saturating_sub(self.disk_used)
    }

    /// A new session, with no connection yet.
    pub fn open_session(&mut self) -> SessionId {
        let id = SessionId(self.next_session);
        self.next_session += 1;
        self.sessions.insert(
            id,
            Session {
                conns: HashMap::new(),
                reservations: HashSet::new(),
                pins: HashSet::new(),
            },
        );
        id
    }

    /// Whether `session` exists (has a connection or holds something).
    pub fn has_session(&self, session: SessionId) -> bool {
        self.sessions.contains_key(&session)
    }

    /// A new connection of `session`. `direct`: its peer may map the slab
    /// and copy into or out of it (a Unix-socket peer). Busy when the
    /// session has [`CoreConfig::max_session_conns`] connections already.
    pub fn attach(&mut self, session: SessionId, direct: bool) -> Result<Owner, CoreError> {
        let max = self.cfg.max_session_conns;
        let Some(s) = self.sessions.get_mut(&session) else {
            return Err(CoreError::Invalid(format!("no session {}", session.0)));
        };
        if s.conns.len() >= max {
            return Err(CoreError::Busy {
                needed: 0,
                reclaimable: 0,
            });
        }
        let conn = ConnId(self.next_conn);
        self.next_conn += 1;
        s.conns.insert(
            conn,
            Reach {
                maps: direct,
                one_sided: false,
            },
        );
        Ok(Owner { session, conn })
    }

    /// The peer of `owner`'s connection touches the slab by itself from now
    /// on (it was told how to reach it for one-sided transfers): its holds
    /// follow the rules for direct connections.
    pub fn make_direct(&mut self, owner: Owner) -> Result<(), CoreError> {
        self.reach_mut(owner).map(|r| r.maps = true)
    }

    /// The peer of `owner`'s connection moves bytes with one-sided
    /// transfers (nixl) from now on: the unit never sees them end, and a
    /// network can end the connection while the peer still runs. So
    /// whatever the connection holds when it ends, however it ends, stays
    /// with its session until the session's process is gone
    /// ([`UnitCore::session_gone`]), or until the driver has fenced the
    /// peer's endpoint ([`UnitCore::fence`]) and then
    /// [`CoreConfig::nixl_quarantine`] has passed.
    pub fn make_one_sided(&mut self, owner: Owner) -> Result<(), CoreError> {
        self.reach_mut(owner).map(|r| r.one_sided = true)
    }

    fn reach_mut(&mut self, owner: Owner) -> Result<&mut Reach, CoreError> {
        self.sessions
            .get_mut(&owner.session)
            .and_then(|s| s.conns.get_mut(&owner.conn))
            .ok_or_else(|| CoreError::Invalid(format!("no connection {}", owner.conn.0)))
    }

    /// What happens to a connection's holds when it ends: `None`, released
    /// now; else kept until the [`Kept`] says. The one place this is
    /// decided.
    fn keep_after(reach: Reach, end: ConnEnd) -> Option<Kept> {
        match (reach, end) {
            // A one-sided peer's transfers run without the unit, and a
            // connection's end (a clean close included: a FIN or RST from
            // the network) proves nothing of them. A peer that also maps
            // the slab may copy until its process is gone: never fenced.
            (
                Reach {
                    one_sided: true,
                    maps,
                },
                _,
            ) => Some(if maps {
                Kept::UntilGone
            } else {
                Kept::UntilFenced
            }),
            // The peer maps the slab and the unit cut it: it may still be
            // copying, until its process is gone.
            (Reach { maps: true, .. }, ConnEnd::Cut) => Some(Kept::UntilGone),
            // The peer closed it (it copies no more), or the unit's own
            // thread did the copying and has stopped.
            _ => None,
        }
    }

    /// A connection ended. What it holds is released when the peer closed
    /// it, or when the unit cut it and the peer does not map the slab
    /// (reservations then go through quarantine: a stream was cut). A
    /// direct peer's holds stay with its session until
    /// [`UnitCore::session_gone`] when the unit cut it; a one-sided peer's
    /// however it ended, until [`UnitCore::session_gone`] or
    /// [`UnitCore::fence`] and its quarantine ([`UnitCore::make_one_sided`]).
    ///
    /// Returns the holds (reservations and pins) released now.
    pub fn detach(&mut self, owner: Owner, end: ConnEnd, now: Time) -> u64 {
        if owner == Owner::UNIT {
            return 0;
        }
        let Some(s) = self.sessions.get_mut(&owner.session) else {
            return 0;
        };
        let Some(reach) = s.conns.remove(&owner.conn) else {
            return 0;
        };
        let held = |h: &Holder| h.conn == Some(owner.conn);
        let reservations: Vec<BlobId> = s
            .reservations
            .iter()
            .copied()
            .filter(|b| {
                matches!(self.blobs.get(b), Some(Blob { state: State::Reserved { holder, .. }, .. }) if held(holder))
            })
            .collect();
        let pins: Vec<PinId> = s
            .pins
            .iter()
            .copied()
            .filter(|p| self.pins.get(p).is_some_and(|p| held(&p.holder)))
            .collect();
        let keep = Self::keep_after(reach, end);
        let released = if keep.is_some() {
            0
        } else {
            (reservations.len() + pins.len()) as u64
        };
        for blob in reservations {
            if let Some(kept) = keep {
                if let Some(Blob {
                    state: State::Reserved { holder, .. },
                    ..
                }) = self.blobs.get_mut(&blob)
                {
                    holder.conn = None;
                    holder.kept = kept;
                }
            } else {
                self.release_reservation(blob, end == ConnEnd::Cut, now);
            }
        }
        for pin in pins {
            if let Some(kept) = keep {
                if let Some(p) = self.pins.get_mut(&pin) {
                    p.holder.conn = None;
                    p.holder.kept = kept;
                }
            } else {
                self.drop_pin(pin);
            }
        }
        self.maybe_forget_session(owner.session);
        released
    }

    /// The session's process is certainly gone (its pid exited): release
    /// everything it holds. Returns the holds released.
    pub fn session_gone(&mut self, session: SessionId, now: Time) -> u64 {
        if session == Owner::UNIT.session {
            return 0;
        }
        let Some(s) = self.sessions.remove(&session) else {
            return 0;
        };
        let released = (s.reservations.len() + s.pins.len()) as u64;
        for blob in s.reservations {
            // Only its own: nothing of the process runs any more, so no
            // quarantine is needed.
            let own = matches!(
                self.blobs.get(&blob),
                Some(Blob { state: State::Reserved { holder, .. }, .. }) if holder.session == session
            );
            if own {
                self.release_reservation_of(blob, false, now);
            }
        }
        for pin in s.pins {
            self.drop_pin(pin);
        }
        released
    }

    /// The one-sided endpoint of `session`'s peer is fenced: the driver has
    /// done what it can so that no transfer of it can start any more (it
    /// invalidated the peer's NIXL agent, or could not and says so). Every
    /// hold of the session whose connection ended is released once
    /// [`CoreConfig::nixl_quarantine`] has passed from `now` (time for
    /// transfers already posted to drain), by [`UnitCore::tick`]; holds of
    /// open connections are untouched. Returns the holds that now wait.
    pub fn fence(&mut self, session: SessionId, now: Time) -> u64 {
        let Some(s) = self.sessions.get(&session) else {
            return 0;
        };
        let until = now + self.cfg.nixl_quarantine;
        let mut holds: Vec<Hold> = Vec::new();
        for blob in &s.reservations {
            if let Some(Blob {
                state: State::Reserved { holder, .. },
                ..
            }) = self.blobs.get_mut(blob)
            {
                if holder.kept == Kept::UntilFenced {
                    holder.kept = Kept::Until(until);
                    holds.push(Hold::Reservation(*blob));
                }
            }
        }
        for pin in &s.pins {
            if let Some(p) = self.pins.get_mut(pin) {
                if p.holder.kept == Kept::UntilFenced {
                    p.holder.kept = Kept::Until(until);
                    holds.push(Hold::Pin(*pin));
                }
            }
        }
        let n = holds.len() as u64;
        for h in holds {
            self.quarantine_seq += 1;
            self.fenced
                .insert((until, self.quarantine_seq), (session, h));
        }
        n
    }

    /// Whether a fenced hold still waits for `at` (it has not gone, nor
    /// been taken over, since).
    fn fenced_until(&self, session: SessionId, hold: Hold, at: Time) -> bool {
        let due = |h: &Holder| h.session == session && h.kept == Kept::Until(at);
        match hold {
            Hold::Reservation(blob) => matches!(
                self.blobs.get(&blob),
                Some(Blob { state: State::Reserved { holder, .. }, .. }) if due(holder)
            ),
            Hold::Pin(pin) => self.pins.get(&pin).is_some_and(|p| due(&p.holder)),
        }
    }

    /// Release a fenced hold whose quarantine ended at `at`, unless it has
    /// gone or was taken over since.
    fn release_fenced(&mut self, session: SessionId, hold: Hold, at: Time, now: Time) -> bool {
        if !self.fenced_until(session, hold, at) {
            return false;
        }
        match hold {
            // Its quarantine has passed: nothing of it can land any more.
            Hold::Reservation(blob) => self.release_reservation(blob, false, now),
            Hold::Pin(pin) => self.drop_pin(pin),
        }
        true
    }

    /// Sessions that hold something although none of their connections is
    /// open (their connections were cut): the driver checks whether their
    /// processes are gone.
    pub fn orphaned_sessions(&self) -> Vec<SessionId> {
        self.sessions
            .iter()
            .filter(|(id, s)| {
                **id != Owner::UNIT.session
                    && s.conns.is_empty()
                    && (!s.reservations.is_empty() || !s.pins.is_empty())
            })
            .map(|(id, _)| *id)
            .collect()
    }

    fn maybe_forget_session(&mut self, session: SessionId) {
        if session == Owner::UNIT.session {
            return;
        }
        if self
            .sessions
            .get(&session)
            .is_some_and(|s| s.conns.is_empty() && s.reservations.is_empty() && s.pins.is_empty())
        {
            self.sessions.remove(&session);
        }
    }

    /// Busy when `session` holds as many reservations and pins as it may.
    fn check_holds(&self, session: SessionId, needed: u64) -> Result<(), CoreError> {
        match self.sessions.get(&session) {
            Some(s)
                if session != Owner::UNIT.session
                    && s.reservations.len() + s.pins.len() >= self.cfg.max_session_holds =>
            {
                Err(CoreError::Busy {
                    needed,
                    reclaimable: 0,
                })
            }
            _ => Ok(()),
        }
    }

    fn check_owner(&self, owner: Owner) -> Result<(), CoreError> {
        match self.sessions.get(&owner.session) {
            Some(s) if s.conns.contains_key(&owner.conn) => Ok(()),
            _ => Err(CoreError::NotOwner(format!(
                "connection {} of session {} is not attached",
                owner.conn.0, owner.session.0
            ))),
        }
    }

    /// Give up a reservation (any holder): free its range, or quarantine it
    /// when a transfer may still write (`in_flight`).
    fn release_reservation(&mut self, blob: BlobId, in_flight: bool, now: Time) {
        let session = match self.blobs.get(&blob) {
            Some(Blob {
                state: State::Reserved { holder, .. },
                ..
            }) => holder.session,
            _ => return,
        };
        if let Some(s) = self.sessions.get_mut(&session) {
            s.reservations.remove(&blob);
        }
        self.release_reservation_of(blob, in_flight, now);
    }

    /// [`Self::release_reservation`] once the session's record is handled.
    fn release_reservation_of(&mut self, blob: BlobId, in_flight: bool, now: Time) {
        if !matches!(
            self.blobs.get(&blob),
            Some(Blob {
                state: State::Reserved { .. },
                ..
            })
        ) {
            return;
        }
        match self.blobs.get(&blob).and_then(|b| b.region) {
            Some(r) => {
                self.blobs.remove(&blob);
                self.reserved_bytes -= r.len;
                if in_flight {
                    self.quarantine(r, now);
                } else {
                    self.slab.free(r);
                }
            }
            None => self.drop_disk_reservation(blob),
        }
    }

    /// The next pin id: a keyed hash of a counter, so ids are neither
    /// sequential nor guessable without the key.
    fn new_pin_id(&mut self) -> PinId {
        loop {
            self.pin_counter += 1;
            let mut h =
                siphasher::sip::SipHasher13::new_with_keys(self.cfg.id_key.0, self.cfg.id_key.1);
            std::hash::Hasher::write_u64(&mut h, self.pin_counter);
            let id = PinId(std::hash::Hasher::finish(&h));
            if id.0 != 0 && !self.pins.contains_key(&id) {
                return id;
            }
        }
    }

    /// What the driver must do now (file removals); drains the list.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// Reserve `nbytes` for `blob`, held by `owner` until it commits or
    /// aborts, or its connection ends.
    ///
    /// A retry of an alloc that already succeeded returns the same answer;
    /// one whose blob was committed since answers
    /// [`Allocated::AlreadyCommitted`]; one whose reservation was given up
    /// (its connection closed) reserves afresh. A reservation is never
    /// handed to two connections: while another open connection of the
    /// session holds it the answer is Busy (retry), and another session
    /// gets [`CoreError::NotOwner`]. When the slab has no room and the disk
    /// tier has, the blob is reserved on disk ([`Allocated::ToDisk`]): the
    /// driver writes its bytes to the blob's file.
    pub fn alloc(
        &mut self,
        owner: Owner,
        blob: BlobId,
        nbytes: u64,
        n_entries: u32,
        now: Time,
    ) -> Result<Allocated, CoreError> {
        self.reserve(owner, blob, nbytes, Some(n_entries), true, now)
    }

    /// Reserve a *spare*: `nbytes` of slab memory for a blob whose size and
    /// entries are not known yet, held by `owner` like any reservation
    /// (until its commit or abort, or its connection's end; never taken
    /// from a live session). A client keeps a spare to write its next put
    /// into before it says anything to the unit, so that put costs one
    /// round trip (its commit) instead of two. Its commit may name any
    /// number of entries within `nbytes`; the blob then shrinks to the
    /// bytes they cover (its range stays reserved whole until freed).
    ///
    /// Memory only: `Ok(None)` when the slab has no room now (no disk
    /// reservation, no Full or Busy: a spare is an offer, not a need).
    /// A retry for the same blob answers the same offset.
    pub fn reserve_spare(
        &mut self,
        owner: Owner,
        blob: BlobId,
        nbytes: u64,
        now: Time,
    ) -> Result<Option<u64>, CoreError> {
        match self.reserve(owner, blob, nbytes, None, false, now) {
            Ok(Allocated::Reserved { offset }) => Ok(Some(offset)),
            Ok(Allocated::AlreadyCommitted | Allocated::ToDisk) => Ok(None),
            Err(CoreError::Full { .. } | CoreError::Busy { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Give the spare `spare` (held by `owner`'s session) the id `blob`
    /// of the put whose bytes were written into it, so that the put is
    /// committed under its own id: a retry of that put (same id) is then
    /// recognised as committed. Answers false, and gives the spare up, when
    /// `blob` was committed already (by an earlier try): nothing is to be
    /// published.
    pub fn name_spare(
        &mut self,
        owner: Owner,
        spare: BlobId,
        blob: BlobId,
        now: Time,
    ) -> Result<bool, CoreError> {
        if spare == blob {
            return Ok(true);
        }
        match self.blobs.get(&spare) {
            Some(Blob {
                state:
                    State::Reserved {
                        holder,
                        n_entries: None,
                    },
                ..
            }) if holder.session == owner.session => {}
            Some(Blob {
                state: State::Reserved { holder, .. },
                ..
            }) if holder.session == owner.session => {
                return Err(CoreError::Invalid(format!(
                    "{spare:?} was reserved by Alloc, not as a spare"
                )))
            }
            Some(Blob {
                state: State::Reserved { .. },
                ..
            }) => {
                return Err(CoreError::NotOwner(format!(
                    "{spare:?} is reserved by another session"
                )))
            }
            _ => return Err(CoreError::UnknownBlob(spare)),
        }
        if self.freed_commit_set.contains(&blob)
            || matches!(
                self.blobs.get(&blob),
                Some(Blob {
                    state: State::Committed { .. } | State::PendingDisk { .. },
                    ..
                })
            )
        {
            self.release_reservation(spare, false, now);
            return Ok(false);
        }
        if self.blobs.contains_key(&blob) {
            return Err(CoreError::Invalid(format!(
                "blob {blob:?} is reserved already; its bytes cannot come from a spare"
            )));
        }
        if let Some(b) = self.blobs.remove(&spare) {
            self.blobs.insert(blob, b);
        }
        if let Some(s) = self.sessions.get_mut(&owner.session) {
            s.reservations.remove(&spare);
            s.reservations.insert(blob);
        }
        Ok(true)
    }

    fn reserve(
        &mut self,
        owner: Owner,
        blob: BlobId,
        nbytes: u64,
        n_entries: Option<u32>,
        to_disk: bool,
        now: Time,
    ) -> Result<Allocated, CoreError> {
        self.check_owner(owner)?;
        if let Some(b) = self.blobs.get_mut(&blob) {
            return match &mut b.state {
                State::Reserved {
                    holder,
                    n_entries: n,
                } if b.nbytes == nbytes && *n == n_entries => {
                    if holder.session != owner.session {
                        return Err(CoreError::NotOwner(format!(
                            "blob {blob:?} is reserved by another session"
                        )));
                    }
                    match holder.conn {
                        Some(c) if c != owner.conn => {
                            return Err(CoreError::Busy {
                                needed: nbytes,
                                reclaimable: 0,
                            })
                        }
                        // Its connection ended and the session kept it:
                        // the retry takes it over.
                        _ => {
                            holder.conn = Some(owner.conn);
                            holder.kept = Kept::Open;
                        }
                    }
                    Ok(match b.region {
                        Some(r) => Allocated::Reserved { offset: r.offset },
                        None => Allocated::ToDisk,
                    })
                }
                State::Reserved { .. } => Err(CoreError::Invalid(format!(
                    "blob {blob:?} is already reserved with another size or entry count"
                ))),
                State::Committed { .. } | State::PendingDisk { .. } => {
                    Ok(Allocated::AlreadyCommitted)
                }
            };
        }
        if self.freed_commit_set.contains(&blob) {
            return Ok(Allocated::AlreadyCommitted);
        }
        self.check_holds(owner.session, nbytes)?;
        let capacity = self.slab.capacity();
        let fits_disk = to_disk && self.disk_on() && nbytes <= self.disk_free();
        let region = if SlabAllocator::rounded(nbytes) <= capacity {
            self.slab.allocate(nbytes)
        } else {
            None
        };
        let region = match region {
            Some(r) => Some(r),
            None if fits_disk => None,
            None => {
                let free = capacity - self.slab.allocated();
                // Memory that spills under way will give back counts too.
                let spilling: u64 = self
                    .blobs
                    .values()
                    .filter(|b| b.disk == Disk::Writing)
                    .filter_map(|b| b.region.map(|r| r.len))
                    .sum();
                // Cleared blobs that only pins keep: freed at unpin (those
                // being spilled are counted above already).
                let unpinning: u64 = self
                    .blobs
                    .values()
                    .filter(|b| matches!(b.state, State::Committed { live: 0, .. }))
                    .filter(|b| b.disk != Disk::Writing)
                    .filter_map(|b| b.region.map(|r| r.len))
                    .sum();
                let reclaimable =
                    self.reserved_bytes + self.quarantined_bytes + spilling + unpinning;
                let could_fit = SlabAllocator::rounded(nbytes) <= capacity;
                return Err(
                    if could_fit
                        && free + reclaimable >= SlabAllocator::rounded(nbytes)
                        && reclaimable > 0
                    {
                        CoreError::Busy {
                            needed: nbytes,
                            reclaimable,
                        }
                    } else {
                        CoreError::Full {
                            needed: nbytes,
                            free,
                            capacity,
                        }
                    },
                );
            }
        };
        let (disk, answer) = match region {
            Some(r) => {
                self.reserved_bytes += r.len;
                (Disk::None, Allocated::Reserved { offset: r.offset })
            }
            None => {
                self.disk_used += nbytes;
                (Disk::Writing, Allocated::ToDisk)
            }
        };
        self.blobs.insert(
            blob,
            Blob {
                region,
                promoting: None,
                nbytes,
                state: State::Reserved {
                    holder: Holder {
                        session: owner.session,
                        conn: Some(owner.conn),
                        since: now,
                        kept: Kept::Open,
                    },
                    n_entries,
                },
                disk,
                seq: 0,
            },
        );
        if let Some(s) = self.sessions.get_mut(&owner.session) {
            s.reservations.insert(blob);
        }
        Ok(answer)
    }

    /// Publish the entries of a reserved blob in namespace `ns`.
    ///
    /// Idempotent: committing a committed blob again succeeds without
    /// change. A key that already has a value is replaced atomically (the
    /// old value stays readable to whoever pinned it). A blob reserved on
    /// disk answers [`Committed::Pending`] until its file is durable.
    pub fn commit(
        &mut self,
        owner: Owner,
        ns: &str,
        blob: BlobId,
        entries: &[EntrySpec],
    ) -> Result<Committed, CoreError> {
        let Some(b) = self.blobs.get(&blob) else {
            return if self.freed_commit_set.contains(&blob) {
                Ok(Committed::Done)
            } else {
                Err(CoreError::UnknownBlob(blob))
            };
        };
        let nbytes = b.nbytes;
        match b.state {
            State::Committed { .. } => return Ok(Committed::Done),
            State::PendingDisk { .. } => return Ok(Committed::Pending),
            State::Reserved { holder, n_entries } => {
                if holder.session != owner.session {
                    return Err(CoreError::NotOwner(format!(
                        "blob {blob:?} is reserved by another session"
                    )));
                }
                if let Some(n_entries) = n_entries.filter(|&n| entries.len() != n as usize) {
                    return Err(CoreError::Invalid(format!(
                        "blob {blob:?} was reserved for {n_entries} entries, commit names {}",
                        entries.len()
                    )));
                }
            }
        }
        for e in entries {
            if e.offset.checked_add(e.len).is_none_or(|end| end > nbytes) {
                return Err(CoreError::Invalid(format!(
                    "entry {} at {}+{} lies outside blob of {nbytes} bytes",
                    e.key, e.offset, e.len
                )));
            }
        }
        // The index's byte budget: a flood of tiny entries answers Full.
        let cost: u64 = entries
            .iter()
            .map(|e| entry_cost(&e.key.field, e.meta.len()))
            .sum();
        if self.index_bytes.saturating_add(cost) > self.cfg.index_budget {
            return Err(CoreError::Full {
                needed: cost,
                free: self.cfg.index_budget.saturating_sub(self.index_bytes),
                capacity: self.cfg.index_budget,
            });
        }
        let spare = matches!(
            b.state,
            State::Reserved {
                n_entries: None,
                ..
            }
        );
        if let Some(s) = self.sessions.get_mut(&owner.session) {
            s.reservations.remove(&blob);
        }
        let (in_memory, durable) = (b.region.is_some(), b.disk == Disk::Durable);
        if spare {
            // A spare holds what its commit names (spills, checkpoints and
            // promotions move those bytes only).
            let used = entries.iter().map(|e| e.offset + e.len).max().unwrap_or(0);
            if let Some(b) = self.blobs.get_mut(&blob) {
                b.nbytes = used;
            }
        }
        if !in_memory {
            if durable {
                self.publish(ns, blob, entries);
                return Ok(Committed::Done);
            }
            // On disk: published once the driver reports the file durable.
            if let Some(b) = self.blobs.get_mut(&blob) {
                b.state = State::PendingDisk {
                    ns: ns.to_owned(),
                    entries: entries.to_vec(),
                };
            }
            return Ok(Committed::Pending);
        }
        self.publish(ns, blob, entries);
        Ok(Committed::Done)
    }

    fn publish(&mut self, ns: &str, blob: BlobId, entries: &[EntrySpec]) {
        self.commit_seq += 1;
        let seq = self.commit_seq;
        if let Some(b) = self.blobs.get_mut(&blob) {
            if let (State::Reserved { .. }, Some(r)) = (&b.state, b.region) {
                self.reserved_bytes -= r.len;
            }
            b.state = State::Committed { live: 0, pins: 0 };
            b.seq = seq;
        }
        let rows = self.index.entry(ns.to_owned()).or_default();
        let mut replaced = Vec::new();
        let mut live = 0u32;
        for e in entries {
            let entry = Entry {
                blob,
                offset: e.offset,
                len: e.len,
                meta: e.meta.clone().into_boxed_slice(),
            };
            self.index_bytes += entry_cost(&e.key.field, e.meta.len());
            let old = rows
                .entry(e.key.row)
                .or_default()
                .insert(e.key.field.clone(), entry);
            if let Some(old) = &old {
                self.index_bytes -= entry_cost(&e.key.field, old.meta.len());
            }
            match old {
                Some(old) if old.blob == blob => {} // a duplicate key in this blob: last wins
                Some(old) => {
                    replaced.push(old.blob);
                    live += 1;
                }
                None => {
                    live += 1;
                    self.entries += 1;
                }
            }
        }
        if let Some(Blob {
            state: State::Committed { live: l, .. },
            ..
        }) = self.blobs.get_mut(&blob)
        {
            *l = live;
        }
        for old in replaced {
            self.drop_entry_ref(old);
        }
        self.maybe_free(blob);
    }

    /// Give up a reservation. With `in_flight` (a transfer may still write
    /// into it) the range is quarantined before reuse. A committed or
    /// unknown blob is left alone: the client aborts after failures whose
    /// outcome it does not know. Only the holding session may abort.
    pub fn abort(
        &mut self,
        owner: Owner,
        blob: BlobId,
        in_flight: bool,
        now: Time,
    ) -> Result<(), CoreError> {
        if let Some(Blob {
            state: State::Reserved { holder, .. },
            ..
        }) = self.blobs.get(&blob)
        {
            if holder.session != owner.session {
                return Err(CoreError::NotOwner(format!(
                    "blob {blob:?} is reserved by another session"
                )));
            }
            self.release_reservation(blob, in_flight, now);
        }
        Ok(())
    }

    /// Forget a blob reserved on disk (never published): its file goes.
    /// The driver must not report a write for it afterwards (the unit
    /// server hands a put's file to its flusher only once commit answered
    /// Pending, and a blob in that state is never forgotten here).
    fn drop_disk_reservation(&mut self, blob: BlobId) {
        if let Some(b) = self.blobs.remove(&blob) {
            self.disk_used -= b.nbytes;
            self.effects.push(Effect::DeleteFile(blob));
        }
    }

    fn quarantine(&mut self, r: Region, now: Time) {
        let until = now + self.cfg.quarantine;
        self.quarantined_bytes += r.len;
        self.quarantine_seq += 1;
        self.quarantined.insert((until, self.quarantine_seq), r);
    }

    /// Where `keys` of namespace `ns` live; pins the blobs holding the found
    /// ones for `owner` (until it unpins, or its connection ends). Missing
    /// keys are `None`. The pin is `None` when no key was found.
    #[allow(clippy::type_complexity)]
    pub fn resolve(
        &mut self,
        owner: Owner,
        ns: &str,
        keys: &[Key],
        now: Time,
    ) -> Result<(Option<PinId>, Vec<Option<Place>>), CoreError> {
        let (pin, found) = self.resolve_with_meta(owner, ns, keys, now)?;
        Ok((pin, found.into_iter().map(|f| f.map(|(p, _)| p)).collect()))
    }

    /// [`UnitCore::resolve`], with each found key's metadata.
    #[allow(clippy::type_complexity)]
    pub fn resolve_with_meta(
        &mut self,
        owner: Owner,
        ns: &str,
        keys: &[Key],
        now: Time,
    ) -> Result<(Option<PinId>, Vec<Option<Located>>), CoreError> {
        self.check_owner(owner)?;
        self.check_holds(owner.session, 0)?;
        let rows = self.index.get(ns);
        let blobs_map = &self.blobs;
        let mut blobs = Vec::new();
        let found = keys
            .iter()
            .map(|k| {
                let e = rows?.get(&k.row)?.get(&k.field)?;
                let b = blobs_map.get(&e.blob)?;
                blobs.push(e.blob);
                let place = match b.region {
                    Some(r) => Place::Memory(Location {
                        offset: r.offset + e.offset,
                        len: e.len,
                    }),
                    None => Place::Disk {
                        blob: e.blob,
                        offset: e.offset,
                        len: e.len,
                    },
                };
                Some((place, e.meta.to_vec()))
            })
            .collect();
        if blobs.is_empty() {
            return Ok((None, found));
        }
        Ok((Some(self.pin_blobs(owner, blobs, now)), found))
    }

    fn pin_blobs(&mut self, owner: Owner, mut blobs: Vec<BlobId>, now: Time) -> PinId {
        blobs.sort_unstable();
        blobs.dedup();
        for id in &blobs {
            if let Some(Blob {
                state: State::Committed { pins, .. },
                ..
            }) = self.blobs.get_mut(id)
            {
                *pins += 1;
            }
        }
        let pin = self.new_pin_id();
        self.pins.insert(
            pin,
            Pin {
                blobs,
                holder: Holder {
                    session: owner.session,
                    conn: Some(owner.conn),
                    since: now,
                    kept: Kept::Open,
                },
            },
        );
        if let Some(s) = self.sessions.get_mut(&owner.session) {
            s.pins.insert(pin);
        }
        pin
    }

    /// The rows of namespace `ns` and the fields of each, rows ascending,
    /// fields sorted.
    pub fn list(&self, ns: &str) -> Vec<(u64, Vec<String>)> {
        let mut rows: Vec<(u64, Vec<String>)> = self
            .index
            .get(ns)
            .map(|r| {
                r.iter()
                    .map(|(row, fields)| {
                        let mut f: Vec<String> = fields.keys().cloned().collect();
                        f.sort();
                        (*row, f)
                    })
                    .collect()
            })
            .unwrap_or_default();
        rows.sort_by_key(|(r, _)| *r);
        rows
    }

    /// Namespaces that hold entries and start with `prefix`, sorted.
    pub fn namespaces(&self, prefix: &str) -> Vec<String> {
        let mut n: Vec<String> = self
            .index
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect();
        n.sort();
        n
    }

    /// Every committed entry of every namespace, with their blobs pinned
    /// (held) so that their bytes stay while a checkpoint copies them.
    pub fn snapshot(&mut self, now: Time) -> Snapshot {
        let mut entries = Vec::with_capacity(self.entries as usize);
        let mut blob_ids = Vec::new();
        for (ns, rows) in &self.index {
            for (row, fields) in rows {
                for (field, e) in fields {
                    entries.push(SnapshotEntry {
                        ns: ns.clone(),
                        key: Key::new(*row, field.clone()),
                        blob: e.blob,
                        offset: e.offset,
                        len: e.len,
                        meta: e.meta.to_vec(),
                    });
                    blob_ids.push(e.blob);
                }
            }
        }
        blob_ids.sort_unstable();
        blob_ids.dedup();
        let blobs = blob_ids
            .iter()
            .filter_map(|id| {
                let b = self.blobs.get(id)?;
                let place = match b.region {
                    Some(r) => Place::Memory(Location {
                        offset: r.offset,
                        len: b.nbytes,
                    }),
                    None => Place::Disk {
                        blob: *id,
                        offset: 0,
                        len: b.nbytes,
                    },
                };
                Some((*id, b.nbytes, place))
            })
            .collect();
        let pin = (!blob_ids.is_empty()).then(|| self.pin_blobs(Owner::UNIT, blob_ids, now));
        Snapshot {
            pin,
            entries,
            blobs,
        }
    }

    /// Drop a pin. Unknown pins (already dropped) are ignored; another
    /// session's pin is refused.
    pub fn unpin(&mut self, owner: Owner, pin: PinId) -> Result<(), CoreError> {
        match self.pins.get(&pin) {
            None => Ok(()),
            Some(p) if p.holder.session != owner.session => Err(CoreError::NotOwner(
                "the pin belongs to another session".into(),
            )),
            Some(_) => {
                if let Some(s) = self.sessions.get_mut(&owner.session) {
                    s.pins.remove(&pin);
                }
                self.drop_pin(pin);
                Ok(())
            }
        }
    }

    /// Drop a pin whose session record is handled by the caller.
    fn drop_pin(&mut self, pin: PinId) {
        if let Some(p) = self.pins.remove(&pin) {
            if let Some(s) = self.sessions.get_mut(&p.holder.session) {
                s.pins.remove(&pin);
            }
            for blob in p.blobs {
                if let Some(Blob {
                    state: State::Committed { pins, .. },
                    ..
                }) = self.blobs.get_mut(&blob)
                {
                    *pins -= 1;
                }
                self.maybe_free(blob);
                self.maybe_release_memory(blob);
            }
        }
    }

    /// Remove every entry of the given rows of `ns`; returns how many.
    ///
    /// Fields whose name starts with NUL are a client's bookkeeping (the
    /// rows API keeps a string row's name there): they are removed with
    /// their row but not counted.
    pub fn release_rows(&mut self, ns: &str, rows: &[u64]) -> u64 {
        let Some(index) = self.index.get_mut(ns) else {
            return 0;
        };
        let mut dropped = Vec::new();
        let mut hidden = 0u64;
        for row in rows {
            if let Some(fields) = index.remove(row) {
                hidden += fields.keys().filter(|f| f.starts_with('\0')).count() as u64;
                for (field, e) in fields {
                    self.index_bytes -= entry_cost(&field, e.meta.len());
                    dropped.push(e.blob);
                }
            }
        }
        if index.is_empty() {
            self.index.remove(ns);
        }
        self.entries -= dropped.len() as u64;
        let n = dropped.len() as u64 - hidden;
        for blob in dropped {
            self.drop_entry_ref(blob);
        }
        n
    }

    /// Remove every entry of `ns`; returns how many.
    pub fn drop_namespace(&mut self, ns: &str) -> u64 {
        let rows: Vec<u64> = self
            .index
            .get(ns)
            .map(|r| r.keys().copied().collect())
            .unwrap_or_default();
        self.release_rows(ns, &rows)
    }

    fn drop_entry_ref(&mut self, blob: BlobId) {
        if let Some(Blob {
            state: State::Committed { live, .. },
            ..
        }) = self.blobs.get_mut(&blob)
        {
            *live -= 1;
        }
        self.maybe_free(blob);
    }

    fn maybe_free(&mut self, blob: BlobId) {
        if let Some(Blob {
            state: State::Committed { live: 0, pins: 0 },
            ..
        }) = self.blobs.get(&blob)
        {
            if let Some(b) = self.blobs.remove(&blob) {
                // A spill still reads the range: it is freed when the
                // write reports back (disk_written).
                let mut region = b.region;
                if b.disk != Disk::Writing {
                    if let Some(r) = region.take() {
                        self.slab.free(r);
                    }
                }
                if let Some(r) = b.promoting {
                    // The driver may still be copying into it: the range
                    // is freed when it reports back (promote_done).
                    self.orphan_promotions.insert(blob, r);
                }
                match b.disk {
                    Disk::None => {}
                    Disk::Durable => {
                        self.disk_used -= b.nbytes;
                        self.effects.push(Effect::DeleteFile(blob));
                    }
                    Disk::Writing => {
                        self.orphan_writes.insert(blob, (b.nbytes, region));
                    }
                }
                self.remember_commit(blob);
            }
        }
    }

    /// A spilled blob whose last pin went: its memory can go now.
    fn maybe_release_memory(&mut self, blob: BlobId) {
        if let Some(b) = self.blobs.get_mut(&blob) {
            if let (State::Committed { pins: 0, .. }, Disk::Durable, true) = (
                &b.state,
                b.disk,
                self.slab.allocated() as f64 > self.cfg.low_watermark * self.slab.capacity() as f64,
            ) {
                if let Some(r) = b.region.take() {
                    self.slab.free(r);
                }
            }
        }
    }

    fn remember_commit(&mut self, blob: BlobId) {
        if self.freed_commits.len() >= REMEMBERED_COMMITS {
            if let Some(old) = self.freed_commits.pop_front() {
                self.freed_commit_set.remove(&old);
            }
        }
        self.freed_commits.push_back(blob);
        self.freed_commit_set.insert(blob);
    }

    /// Blobs to copy to disk now: past the high watermark, committed blobs
    /// in memory and not pinned, oldest first, until use would fall below
    /// the low watermark (or the disk tier is full). Each is marked as being
    /// written; its memory stays until [`UnitCore::disk_written`].
    pub fn spill_jobs(&mut self) -> Vec<SpillJob> {
        if !self.disk_on() {
            return Vec::new();
        }
        let cap = self.slab.capacity() as f64;
        let used = self.slab.allocated();
        if (used as f64) <= self.cfg.high_watermark * cap {
            return Vec::new();
        }
        let target = (self.cfg.low_watermark * cap) as u64;
        // Bytes whose spill is under way count as freed already.
        let in_flight: u64 = self
            .blobs
            .values()
            .filter(|b| b.disk == Disk::Writing)
            .filter_map(|b| b.region.map(|r| r.len))
            .sum();
        let mut candidates: Vec<(u64, BlobId)> = self
            .blobs
            .iter()
            .filter(|(_, b)| {
                matches!(b.state, State::Committed { pins: 0, .. }) && b.region.is_some()
            })
            .map(|(id, b)| (b.seq, *id))
            .collect();
        candidates.sort_unstable();
        let mut freed = in_flight;
        let mut jobs = Vec::new();
        for (_, id) in candidates {
            if used - freed <= target {
                break;
            }
            let Some(b) = self.blobs.get_mut(&id) else {
                continue;
            };
            let Some(r) = b.region else { continue };
            match b.disk {
                // Already on disk (promoted earlier): drop the memory copy.
                Disk::Durable => {
                    b.region = None;
                    self.slab.free(r);
                    freed += r.len;
                }
                Disk::Writing => {}
                Disk::None => {
                    if b.nbytes > self.cfg.disk_capacity.saturating_sub(self.disk_used) {
                        continue;
                    }
                    b.disk = Disk::Writing;
                    self.disk_used += b.nbytes;
                    freed += r.len;
                    jobs.push(SpillJob {
                        blob: id,
                        offset: r.offset,
                        nbytes: b.nbytes,
                    });
                }
            }
        }
        jobs
    }

    /// Whether [`UnitCore::spill_jobs`] would find work: the disk tier is
    /// on and the slab is past its high watermark.
    pub fn needs_spill(&self) -> bool {
        self.disk_on()
            && self.slab.allocated() as f64 > self.cfg.high_watermark * self.slab.capacity() as f64
    }

    /// Whether `blob` is reserved on the disk tier and not yet committed:
    /// its bytes must come with a Put (the server writes its file), so a
    /// bare Commit of it would wait for a file that nobody writes.
    /// (Only for `session`'s own reservations: another session's commit is
    /// refused as not the owner's.)
    pub fn is_disk_reservation(&self, session: SessionId, blob: BlobId) -> bool {
        matches!(
            self.blobs.get(&blob),
            Some(Blob {
                state: State::Reserved { holder, .. },
                region: None,
                ..
            }) if holder.session == session
        )
    }

    /// A blob's size in bytes.
    pub fn blob_size(&self, blob: BlobId) -> Option<u64> {
        self.blobs.get(&blob).map(|b| b.nbytes)
    }

    /// The driver finished writing `blob`'s file (`ok`: complete and
    /// synced). For a spill, the memory copy is freed (once unpinned); for a
    /// blob reserved on disk, its entries are published.
    pub fn disk_written(&mut self, blob: BlobId, ok: bool) {
        if let Some((nbytes, region)) = self.orphan_writes.remove(&blob) {
            self.disk_used -= nbytes;
            if let Some(r) = region {
                self.slab.free(r);
            }
            self.effects.push(Effect::DeleteFile(blob));
            return;
        }
        let Some(b) = self.blobs.get_mut(&blob) else {
            return;
        };
        if b.disk != Disk::Writing {
            return;
        }
        let unpublished = matches!(b.state, State::PendingDisk { .. } | State::Reserved { .. });
        if !ok {
            if unpublished {
                // A put whose bytes did not reach the disk: it never existed,
                // and its session (if it was still reserved) holds it no more.
                let holder = match &b.state {
                    State::Reserved { holder, .. } => Some(holder.session),
                    _ => None,
                };
                if let Some(s) = holder.and_then(|h| self.sessions.get_mut(&h)) {
                    s.reservations.remove(&blob);
                }
                self.drop_disk_reservation(blob);
                if let Some(h) = holder {
                    self.maybe_forget_session(h);
                }
            } else {
                b.disk = Disk::None;
                self.disk_used -= b.nbytes;
                self.effects.push(Effect::DeleteFile(blob));
            }
            return;
        }
        b.disk = Disk::Durable;
        if matches!(b.state, State::PendingDisk { .. }) {
            if let State::PendingDisk { ns, entries } =
                std::mem::replace(&mut b.state, State::Committed { live: 0, pins: 0 })
            {
                self.publish(&ns, blob, &entries);
            }
            return;
        }
        if let State::Committed { pins: 0, .. } = b.state {
            if let Some(r) = b.region.take() {
                self.slab.free(r);
            }
        }
    }

    /// Start bringing a spilled, pinned-by-the-caller blob back into the
    /// slab: reserves its range (if the slab has room below the high
    /// watermark) for the driver to fill from the file. `None`: read it
    /// from disk instead.
    pub fn promote_begin(&mut self, blob: BlobId) -> Option<u64> {
        let cap = self.slab.capacity() as f64;
        let b = self.blobs.get(&blob)?;
        if b.region.is_some()
            || b.promoting.is_some()
            || b.disk != Disk::Durable
            || !matches!(b.state, State::Committed { .. })
        {
            return None;
        }
        let len = SlabAllocator::rounded(b.nbytes);
        if (self.slab.allocated() + len) as f64 > self.cfg.high_watermark * cap {
            return None;
        }
        let r = self.slab.allocate(b.nbytes)?;
        if let Some(b) = self.blobs.get_mut(&blob) {
            b.promoting = Some(r);
        }
        Some(r.offset)
    }

    /// The driver filled (or, `ok == false`, failed to fill) the range from
    /// [`UnitCore::promote_begin`].
    pub fn promote_done(&mut self, blob: BlobId, ok: bool) {
        if let Some(r) = self.orphan_promotions.remove(&blob) {
            self.slab.free(r);
            return;
        }
        let Some(b) = self.blobs.get_mut(&blob) else {
            return;
        };
        let Some(r) = b.promoting.take() else { return };
        if ok && b.region.is_none() {
            b.region = Some(r);
        } else {
            self.slab.free(r);
        }
    }

    /// Reuse quarantined ranges whose quarantine ended by `now`, and
    /// release the holds of fenced one-sided peers whose quarantine ended
    /// ([`UnitCore::fence`]). Nothing else is ever reclaimed by time.
    /// Returns the holds released.
    pub fn tick(&mut self, now: Time) -> u64 {
        while let Some((&(at, seq), &r)) = self.quarantined.first_key_value() {
            if at > now {
                break;
            }
            self.quarantined.remove(&(at, seq));
            self.quarantined_bytes -= r.len;
            self.slab.free(r);
        }
        let mut released = 0;
        while let Some((&(at, seq), &(session, hold))) = self.fenced.first_key_value() {
            if at > now {
                break;
            }
            self.fenced.remove(&(at, seq));
            if self.release_fenced(session, hold, at, now) {
                released += 1;
                self.maybe_forget_session(session);
            }
        }
        released
    }

    /// When `tick` next has something to do.
    pub fn next_deadline(&self) -> Option<Time> {
        let q = self.quarantined.keys().next().map(|(t, _)| *t);
        let f = self
            .fenced
            .iter()
            .find(|((at, _), (s, h))| self.fenced_until(*s, *h, *at))
            .map(|((at, _), _)| *at);
        match (q, f) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Counters, with what each session holds at `now`.
    pub fn stats_at(&self, now: Time) -> Stats {
        let mut s = self.stats();
        let mut overdue = 0u64;
        let mut held_total = 0u64;
        let mut pinned_total = 0u64;
        let mut sessions: Vec<SessionStats> = Vec::new();
        for (id, sess) in &self.sessions {
            if sess.reservations.is_empty() && sess.pins.is_empty() && sess.conns.is_empty() {
                continue;
            }
            if *id == Owner::UNIT.session && sess.pins.is_empty() {
                continue;
            }
            let mut st = SessionStats {
                session: id.0,
                connections: if *id == Owner::UNIT.session {
                    0
                } else {
                    sess.conns.len() as u32
                },
                ..SessionStats::default()
            };
            let mut oldest: Option<Time> = None;
            let mut note = |h: &Holder, lease: Duration, st: &mut SessionStats| {
                oldest = Some(oldest.map_or(h.since, |o| o.min(h.since)));
                if now.saturating_sub(h.since) > lease {
                    overdue += 1;
                }
                if h.conn.is_none() {
                    st.orphaned += 1;
                }
            };
            for blob in &sess.reservations {
                if let Some(Blob {
                    state: State::Reserved { holder, n_entries },
                    region,
                    ..
                }) = self.blobs.get(blob)
                {
                    st.reservations += 1;
                    st.held_bytes += region.map_or(0, |r| r.len);
                    if n_entries.is_none() {
                        // Held on purpose, for as long as its connection.
                        st.spares += 1;
                    } else {
                        note(holder, self.cfg.reservation_lease, &mut st);
                    }
                }
            }
            for pin in &sess.pins {
                if let Some(p) = self.pins.get(pin) {
                    st.pins += 1;
                    let bytes = p
                        .blobs
                        .iter()
                        .filter_map(|b| self.blobs.get(b))
                        .map(|b| b.nbytes)
                        .sum::<u64>();
                    st.held_bytes += bytes;
                    pinned_total += bytes;
                    note(&p.holder, self.cfg.pin_lease, &mut st);
                }
            }
            st.oldest_hold_ms = oldest.map_or(0, |o| now.saturating_sub(o).as_millis() as u64);
            held_total += st.held_bytes;
            sessions.push(st);
        }
        sessions.sort_by_key(|s| s.session);
        s.held_bytes = held_total;
        s.pinned_bytes = pinned_total;
        s.overdue_holds = overdue;
        s.sessions = sessions;
        s
    }

    pub fn stats(&self) -> Stats {
        let (spares, spare_bytes) = self
            .blobs
            .values()
            .filter(|b| {
                matches!(
                    b.state,
                    State::Reserved {
                        n_entries: None,
                        ..
                    }
                )
            })
            .fold((0, 0), |(n, bytes), b| {
                (n + 1, bytes + b.region.map_or(0, |r| r.len))
            });
        Stats {
            capacity: self.slab.capacity(),
            used: self.slab.allocated(),
            reserved_bytes: self.reserved_bytes,
            quarantined_bytes: self.quarantined_bytes,
            blobs: self.blobs.len() as u64 - spares,
            spares,
            spare_bytes,
            serves_nixl: false,
            entries: self.entries,
            rows: self.index.values().map(|r| r.len() as u64).sum(),
            pins: self.pins.len() as u64,
            disk_capacity: self.cfg.disk_capacity,
            disk_used: self.disk_used,
            spilled_blobs: self
                .blobs
                .values()
                .filter(|b| b.region.is_none() && b.disk == Disk::Durable)
                .count() as u64,
            index_bytes: self.index_bytes,
            partitions: self.index.values().filter(|r| !r.is_empty()).count() as u64,
            ..Stats::default()
        }
    }

    /// Every blob's slab range, for invariant checks in tests.
    pub fn regions(&self) -> impl Iterator<Item = (BlobId, u64, u64)> + '_ {
        self.blobs.iter().flat_map(|(id, b)| {
            b.region
                .iter()
                .chain(b.promoting.iter())
                .map(move |r| (*id, r.offset, r.len))
        })
    }

    /// Every slab range still allocated but not a live blob's: quarantined
    /// ranges, ranges a finished spill or promotion still reads or writes.
    /// For invariant checks in tests.
    pub fn held_ranges(&self) -> Vec<(u64, u64)> {
        self.quarantined
            .values()
            .chain(self.orphan_promotions.values())
            .chain(self.orphan_writes.values().filter_map(|(_, r)| r.as_ref()))
            .map(|r| (r.offset, r.len))
            .collect()
    }

    /// The slab ranges `session` may touch directly: its reservations and
    /// the blobs it has pinned. For invariant checks in tests.
    pub fn session_ranges(&self, session: SessionId) -> Vec<(u64, u64)> {
        let Some(s) = self.sessions.get(&session) else {
            return Vec::new();
        };
        let reserved = s
            .reservations
            .iter()
            .filter_map(|b| self.blobs.get(b)?.region);
        let pinned = s
            .pins
            .iter()
            .filter_map(|p| self.pins.get(p))
            .flat_map(|p| p.blobs.iter())
            .filter_map(|b| self.blobs.get(b)?.region);
        reserved.chain(pinned).map(|r| (r.offset, r.len)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own(c: &mut UnitCore) -> Owner {
        let s = c.open_session();
        c.attach(s, true).unwrap()
    }

    fn core(cap: u64) -> UnitCore {
        UnitCore::new(CoreConfig::new(cap)).unwrap()
    }

    fn t(ms: u64) -> Time {
        Duration::from_millis(ms)
    }

    fn entry(row: u64, field: &str, offset: u64, len: u64) -> EntrySpec {
        EntrySpec {
            key: Key::new(row, field),
            offset,
            len,
            meta: vec![row as u8],
        }
    }

    #[test]
    fn alloc_is_idempotent_and_commit_publishes() {
        let mut c = core(1 << 20);
        let o = own(&mut c);
        let b = BlobId(7);
        let Allocated::Reserved { offset } = c.alloc(o, b, 100, 2, t(0)).unwrap() else {
            panic!("expected a reservation");
        };
        assert_eq!(
            c.alloc(o, b, 100, 2, t(1)).unwrap(),
            Allocated::Reserved { offset }
        );
        c.commit(o, "ns", b, &[entry(1, "a", 0, 40), entry(1, "b", 40, 60)])
            .unwrap();
        c.commit(o, "ns", b, &[]).unwrap(); // idempotent, whatever it names
        assert_eq!(
            c.alloc(o, b, 100, 2, t(2)).unwrap(),
            Allocated::AlreadyCommitted
        );
        let (pin, locs) = c
            .resolve(o, "ns", &[Key::new(1, "b"), Key::new(2, "a")], t(3))
            .unwrap();
        assert_eq!(
            locs[0],
            Some(Place::Memory(Location {
                offset: offset + 40,
                len: 60
            }))
        );
        assert_eq!(locs[1], None);
        c.unpin(o, pin.unwrap()).unwrap();
        assert_eq!(c.stats().entries, 2);
        assert_eq!(c.release_rows("ns", &[1]), 2);
        assert_eq!(c.stats().used, 0);
        assert_eq!(
            c.alloc(o, b, 100, 2, t(4)).unwrap(),
            Allocated::AlreadyCommitted
        );
        c.commit(o, "ns", b, &[entry(9, "a", 0, 1)]).unwrap();
        assert_eq!(
            c.stats().entries,
            0,
            "a late commit retry publishes nothing"
        );
    }

    #[test]
    fn metadata_listing_and_held_pins() {
        let mut c = core(1 << 20);
        let o = own(&mut c);
        c.alloc(o, BlobId(1), 16, 3, t(0)).unwrap();
        c.commit(
            o,
            "p",
            BlobId(1),
            &[
                entry(5, "b", 0, 8),
                entry(5, "a", 8, 8),
                entry(2, "a", 0, 0),
            ],
        )
        .unwrap();
        assert_eq!(
            c.list("p"),
            vec![
                (2, vec!["a".to_string()]),
                (5, vec!["a".to_string(), "b".to_string()])
            ]
        );
        assert_eq!(c.namespaces(""), vec!["p".to_string()]);
        let (pin, found) = c
            .resolve_with_meta(o, "p", &[Key::new(5, "a")], t(0))
            .unwrap();
        assert_eq!(found[0].as_ref().map(|(_, m)| m.clone()), Some(vec![5]));
        c.release_rows("p", &[5, 2]);
        // A held pin outlives any lease, and keeps the blob.
        c.tick(t(3_600_000));
        assert_eq!(c.stats().pins, 1);
        assert_eq!(c.stats().blobs, 1);
        c.unpin(o, pin.unwrap()).unwrap();
        assert_eq!(c.stats().used, 0);
    }

    #[test]
    fn a_spare_takes_the_puts_id_and_shrinks_to_its_entries() {
        let mut c = core(1 << 20);
        let o = own(&mut c);
        let spare = BlobId(100);
        let offset = c.reserve_spare(o, spare, 4096, t(0)).unwrap().unwrap();
        assert_eq!(c.reserve_spare(o, spare, 4096, t(1)).unwrap(), Some(offset));
        assert_eq!(c.stats().reserved_bytes, 4096);
        // The put's own id, with any number of entries within the spare.
        let put = BlobId(7);
        assert!(c.name_spare(o, spare, put, t(2)).unwrap());
        let r = c
            .commit(
                o,
                "ns",
                put,
                &[entry(1, "a", 0, 1000), entry(2, "a", 1000, 500)],
            )
            .unwrap();
        assert_eq!(r, Committed::Done);
        assert_eq!(
            c.blob_size(put),
            Some(1500),
            "spills and checkpoints move 1,500 bytes"
        );
        assert_eq!(c.blob_size(spare), None);
        assert_eq!(c.stats().reserved_bytes, 0);
        assert_eq!(
            c.stats().used,
            4096,
            "the whole range stays held until freed"
        );
        let (pin, locs) = c.resolve(o, "ns", &[Key::new(2, "a")], t(3)).unwrap();
        assert_eq!(
            locs[0],
            Some(Place::Memory(Location {
                offset: offset + 1000,
                len: 500
            }))
        );
        c.unpin(o, pin.unwrap()).unwrap();
        // A retry of the put (same id) finds it committed.
        assert_eq!(
            c.alloc(o, put, 1500, 2, t(4)).unwrap(),
            Allocated::AlreadyCommitted
        );
        assert_eq!(c.release_rows("ns", &[1, 2]), 2);
        assert_eq!(c.stats().used, 0);
    }

    #[test]
    fn a_spare_is_memory_only_and_never_an_error_for_want_of_room() {
        let mut c = disk_core(1 << 16, 1 << 20);
        let o = own(&mut c);
        c.alloc(o, BlobId(1), 1 << 16, 1, t(0)).unwrap();
        // The slab is full and the disk has room: a put would go to disk,
        // a spare is simply not given.
        assert_eq!(c.reserve_spare(o, BlobId(2), 4096, t(0)).unwrap(), None);
        assert_eq!(c.stats().disk_used, 0);
        assert_eq!(c.stats().reserved_bytes, 1 << 16);
    }

    #[test]
    fn only_its_session_names_a_spare_and_a_committed_put_gives_it_up() {
        let mut c = core(1 << 20);
        let (a, b) = (own(&mut c), own(&mut c));
        c.reserve_spare(a, BlobId(10), 4096, t(0)).unwrap().unwrap();
        assert!(matches!(
            c.name_spare(b, BlobId(10), BlobId(11), t(0)),
            Err(CoreError::NotOwner(_))
        ));
        assert!(matches!(
            c.name_spare(a, BlobId(99), BlobId(11), t(0)),
            Err(CoreError::UnknownBlob(_))
        ));
        // An Alloc reservation is not a spare.
        c.alloc(a, BlobId(12), 64, 1, t(0)).unwrap();
        assert!(matches!(
            c.name_spare(a, BlobId(12), BlobId(13), t(0)),
            Err(CoreError::Invalid(_))
        ));
        // The put's id is reserved already: refused, nothing moves.
        assert!(matches!(
            c.name_spare(a, BlobId(10), BlobId(12), t(0)),
            Err(CoreError::Invalid(_))
        ));
        // The put was committed by an earlier try: the spare is given up.
        c.commit(a, "ns", BlobId(12), &[entry(1, "f", 0, 64)])
            .unwrap();
        let before = c.stats().reserved_bytes;
        assert!(!c.name_spare(a, BlobId(10), BlobId(12), t(1)).unwrap());
        assert_eq!(c.stats().reserved_bytes, before - 4096);
        assert_eq!(c.stats().entries, 1);
    }

    #[test]
    fn a_cut_peer_keeps_its_spares_until_its_session_is_gone() {
        let mut c = core(1 << 20);
        let o = own(&mut c);
        let offset = c.reserve_spare(o, BlobId(5), 8192, t(0)).unwrap().unwrap();
        // The unit cut the connection of a peer that maps the slab: it may
        // still be writing into its spare, so the range is not reused.
        c.detach(o, ConnEnd::Cut, t(1));
        assert_eq!(c.stats().reserved_bytes, 8192);
        let o2 = own(&mut c);
        for i in 0..15 {
            if let Some(off) = c.reserve_spare(o2, BlobId(200 + i), 8192, t(2)).unwrap() {
                assert!(
                    off + 8192 <= offset || off >= offset + 8192,
                    "overlaps the kept spare"
                );
            }
        }
        c.session_gone(o.session, t(3));
        assert_eq!(c.stats().reserved_bytes, 15 * 8192);
        // A connection the peer closed gives its spares back at once.
        c.detach(o2, ConnEnd::Closed, t(4));
        assert_eq!(c.stats().reserved_bytes, 0);
        assert_eq!(c.stats().used, 0);
    }

    fn disk_core(cap: u64, disk: u64) -> UnitCore {
        let mut cfg = CoreConfig::new(cap);
        cfg.disk_capacity = disk;
        cfg.high_watermark = 0.5;
        cfg.low_watermark = 0.25;
        UnitCore::new(cfg).unwrap()
    }

    fn put(c: &mut UnitCore, o: Owner, id: u128, row: u64, n: u64) -> Allocated {
        let a = c.alloc(o, BlobId(id), n, 1, t(0)).unwrap();
        let r = c
            .commit(o, "ns", BlobId(id), &[entry(row, "f", 0, n)])
            .unwrap();
        if a == Allocated::ToDisk {
            assert_eq!(r, Committed::Pending);
        } else {
            assert_eq!(r, Committed::Done);
        }
        a
    }

    #[test]
    fn spill_oldest_first_then_promote() {
        let mut c = disk_core(4096, 1 << 20);
        let o = own(&mut c);
        put(&mut c, o, 1, 1, 1024);
        put(&mut c, o, 2, 2, 1024);
        assert!(
            c.spill_jobs().is_empty(),
            "at the high watermark, not past it"
        );
        put(&mut c, o, 3, 3, 1024);
        let jobs = c.spill_jobs();
        // 3 KiB used of 4: spill the oldest until at most 1 KiB remains.
        assert_eq!(
            jobs.iter().map(|j| j.blob).collect::<Vec<_>>(),
            vec![BlobId(1), BlobId(2)]
        );
        assert!(c.spill_jobs().is_empty(), "already being written");
        // Until written, reads are served from memory.
        let (pin, p) = c.resolve(o, "ns", &[Key::new(1, "f")], t(0)).unwrap();
        assert!(matches!(p[0], Some(Place::Memory(_))));
        c.disk_written(BlobId(1), true);
        assert_eq!(c.stats().used, 3072, "pinned: memory kept");
        c.unpin(o, pin.unwrap()).unwrap();
        assert_eq!(c.stats().used, 2048, "unpinned: memory freed");
        c.disk_written(BlobId(2), true);
        let s = c.stats();
        assert_eq!((s.used, s.disk_used, s.spilled_blobs), (1024, 2048, 2));
        let (pin, p) = c.resolve(o, "ns", &[Key::new(1, "f")], t(0)).unwrap();
        assert_eq!(
            p[0],
            Some(Place::Disk {
                blob: BlobId(1),
                offset: 0,
                len: 1024
            })
        );
        let off = c
            .promote_begin(BlobId(1))
            .expect("room below the watermark");
        assert_eq!(c.promote_begin(BlobId(1)), None, "one promotion at a time");
        c.promote_done(BlobId(1), true);
        let (_, p) = c.resolve(o, "ns", &[Key::new(1, "f")], t(0)).unwrap();
        assert_eq!(
            p[0],
            Some(Place::Memory(Location {
                offset: off,
                len: 1024
            }))
        );
        c.unpin(o, pin.unwrap()).unwrap();
        // Clearing a spilled row removes its file.
        assert!(c.take_effects().is_empty());
        c.release_rows("ns", &[2]);
        assert_eq!(c.take_effects(), vec![Effect::DeleteFile(BlobId(2))]);
        assert_eq!(c.stats().disk_used, 1024);
    }

    #[test]
    fn puts_without_memory_go_to_disk_and_publish_when_durable() {
        let mut c = disk_core(2048, 4096);
        let o = own(&mut c);
        put(&mut c, o, 1, 1, 2048);
        assert_eq!(put(&mut c, o, 2, 2, 1000), Allocated::ToDisk);
        assert_eq!(
            c.resolve(o, "ns", &[Key::new(2, "f")], t(0)).unwrap().1,
            vec![None],
            "not yet durable"
        );
        assert_eq!(
            c.commit(o, "ns", BlobId(2), &[]).unwrap(),
            Committed::Pending
        );
        c.disk_written(BlobId(2), true);
        assert_eq!(c.commit(o, "ns", BlobId(2), &[]).unwrap(), Committed::Done);
        assert!(matches!(
            c.resolve(o, "ns", &[Key::new(2, "f")], t(0)).unwrap().1[0],
            Some(Place::Disk { .. })
        ));
        // A failed disk write: the put never happened, its file goes.
        assert_eq!(put(&mut c, o, 3, 3, 1000), Allocated::ToDisk);
        c.disk_written(BlobId(3), false);
        assert_eq!(c.take_effects(), vec![Effect::DeleteFile(BlobId(3))]);
        assert_eq!(
            c.commit(o, "ns", BlobId(3), &[]),
            Err(CoreError::UnknownBlob(BlobId(3)))
        );
        // Memory and disk both full: Full, nothing evicted.
        assert_eq!(put(&mut c, o, 4, 4, 3000), Allocated::ToDisk);
        c.disk_written(BlobId(4), true);
        assert!(matches!(
            c.alloc(o, BlobId(5), 200, 1, t(0)),
            Err(CoreError::Full { .. })
        ));
        assert_eq!(c.stats().entries, 3);
        // A blob freed while its file is written: the file goes afterwards.
        c.release_rows("ns", &[4]);
        assert_eq!(c.take_effects(), vec![Effect::DeleteFile(BlobId(4))]);
        assert_eq!(put(&mut c, o, 6, 6, 3000), Allocated::ToDisk);
        c.disk_written(BlobId(6), true);
        c.release_rows("ns", &[6]);
        assert_eq!(c.take_effects(), vec![Effect::DeleteFile(BlobId(6))]);
        assert_eq!(put(&mut c, o, 8, 8, 3000), Allocated::ToDisk);
        c.disk_written(BlobId(8), true);
        c.release_rows("ns", &[8]);
        assert_eq!(c.take_effects(), vec![Effect::DeleteFile(BlobId(8))]);
        assert_eq!(c.stats().disk_used, 1000);
        // A reservation on disk outlives any lease; its connection's end
        // drops it with its file.
        assert_eq!(
            c.alloc(o, BlobId(7), 100, 1, t(0)).unwrap(),
            Allocated::ToDisk
        );
        c.tick(t(60_000));
        assert!(c.take_effects().is_empty());
        c.detach(o, ConnEnd::Closed, t(60_000));
        assert_eq!(c.take_effects(), vec![Effect::DeleteFile(BlobId(7))]);
    }

    #[test]
    fn snapshots_pin_every_committed_blob() {
        let mut c = disk_core(4096, 1 << 20);
        let o = own(&mut c);
        put(&mut c, o, 1, 1, 100);
        put(&mut c, o, 2, 2, 100);
        let snap = c.snapshot(t(0));
        assert_eq!(snap.entries.len(), 2);
        assert_eq!(snap.blobs.len(), 2);
        c.release_rows("ns", &[1, 2]);
        assert_eq!(c.stats().blobs, 2, "pinned by the snapshot");
        assert!(c.unpin(o, snap.pin.unwrap()).is_err(), "the unit's pin");
        c.unpin(Owner::UNIT, snap.pin.unwrap()).unwrap();
        assert_eq!(c.stats().blobs, 0);
    }

    #[test]
    fn namespaces_are_isolated() {
        let mut c = core(1 << 20);
        let o = own(&mut c);
        c.alloc(o, BlobId(1), 8, 1, t(0)).unwrap();
        c.commit(o, "a", BlobId(1), &[entry(0, "x", 0, 8)]).unwrap();
        assert_eq!(
            c.resolve(o, "b", &[Key::new(0, "x")], t(0)).unwrap().1,
            vec![None]
        );
        assert_eq!(c.release_rows("b", &[0]), 0);
        assert_eq!(c.stats().entries, 1);
    }

    #[test]
    fn full_and_busy_are_answers() {
        let mut c = core(4096);
        let o = own(&mut c);
        assert!(matches!(
            c.alloc(o, BlobId(1), 8192, 0, t(0)),
            Err(CoreError::Full { .. })
        ));
        c.alloc(o, BlobId(2), 4096, 0, t(0)).unwrap();
        // The reservation will expire: retrying makes sense.
        assert!(matches!(
            c.alloc(o, BlobId(3), 64, 0, t(0)),
            Err(CoreError::Busy { .. })
        ));
        c.commit(o, "ns", BlobId(2), &[]).unwrap(); // no entries: freed at once
        c.alloc(o, BlobId(3), 4096, 1, t(0)).unwrap();
        c.commit(o, "ns", BlobId(3), &[entry(0, "f", 0, 4096)])
            .unwrap();
        assert!(matches!(
            c.alloc(o, BlobId(4), 64, 0, t(0)),
            Err(CoreError::Full { .. })
        ));
    }

    #[test]
    fn replace_keeps_pinned_old_value_until_unpinned() {
        let mut c = core(1 << 20);
        let o = own(&mut c);
        c.alloc(o, BlobId(1), 8, 1, t(0)).unwrap();
        c.commit(o, "ns", BlobId(1), &[entry(0, "f", 0, 8)])
            .unwrap();
        let (pin, old) = c.resolve(o, "ns", &[Key::new(0, "f")], t(0)).unwrap();
        c.alloc(o, BlobId(2), 8, 1, t(0)).unwrap();
        c.commit(o, "ns", BlobId(2), &[entry(0, "f", 0, 8)])
            .unwrap();
        assert_eq!(c.stats().entries, 1);
        assert_eq!(c.stats().blobs, 2, "old blob still pinned");
        let (_, new) = c.resolve(o, "ns", &[Key::new(0, "f")], t(0)).unwrap();
        assert_ne!(old, new);
        c.unpin(o, pin.unwrap()).unwrap();
        assert!(c.regions().all(|(id, _, _)| id != BlobId(1)));
    }

    #[test]
    fn no_timer_takes_a_hold_only_its_connection_or_session_ends_it() {
        let mut c = core(1 << 20);
        let o = own(&mut c);
        c.alloc(o, BlobId(1), 100, 1, t(0)).unwrap();
        c.alloc(o, BlobId(2), 100, 1, t(0)).unwrap();
        c.commit(o, "ns", BlobId(2), &[entry(0, "f", 0, 100)])
            .unwrap();
        c.resolve(o, "ns", &[Key::new(0, "f")], t(0)).unwrap();
        c.release_rows("ns", &[0]);
        // A paused client: an hour later its holds are all still there,
        // reported as overdue.
        c.tick(t(3_600_000));
        let s = c.stats_at(t(3_600_000));
        assert_eq!((s.pins, s.blobs, s.used), (1, 2, 256));
        assert_eq!(s.overdue_holds, 2);
        assert_eq!(s.sessions.len(), 1);
        assert_eq!(s.sessions[0].held_bytes, 228);
        assert_eq!(s.sessions[0].oldest_hold_ms, 3_600_000);
        // Cut by the unit, the peer maps the slab: the session keeps them.
        c.detach(o, ConnEnd::Cut, t(3_600_000));
        assert_eq!(c.stats().used, 256);
        assert_eq!(c.orphaned_sessions(), vec![o.session]);
        // The same session reconnects and takes its reservation over.
        let o2 = c.attach(o.session, true).unwrap();
        assert!(matches!(
            c.alloc(o2, BlobId(1), 100, 1, t(1)),
            Ok(Allocated::Reserved { .. })
        ));
        c.detach(o2, ConnEnd::Cut, t(1));
        // Its process is gone: everything goes, with no quarantine.
        c.session_gone(o.session, t(3_600_000));
        assert_eq!(c.stats().used, 0);
        assert_eq!(
            c.commit(o, "ns", BlobId(1), &[entry(0, "f", 0, 1)]),
            Err(CoreError::UnknownBlob(BlobId(1)))
        );
        assert!(c.orphaned_sessions().is_empty());
        assert_eq!(c.next_deadline(), None);
    }

    /// A one-sided (nixl) peer's holds outlive its connection's end, a
    /// clean close included, until the driver fenced its endpoint and the
    /// nixl quarantine then passed; or until its process is gone. A peer
    /// that also maps the slab is never released by a timer.
    #[test]
    fn one_sided_holds_wait_for_the_fence_and_its_quarantine() {
        let mut cfg = CoreConfig::new(1 << 20);
        cfg.nixl_quarantine = Duration::from_secs(3);
        let mut c = UnitCore::new(cfg).unwrap();
        for (i, end) in [(0, ConnEnd::Closed), (10, ConnEnd::Cut)] {
            let s = c.open_session();
            let o = c.attach(s, false).unwrap();
            c.make_one_sided(o).unwrap();
            c.alloc(o, BlobId(i + 1), 100, 1, t(0)).unwrap();
            c.alloc(o, BlobId(i + 2), 100, 1, t(0)).unwrap();
            c.commit(o, "ns", BlobId(i + 2), &[entry(0, "f", 0, 100)])
                .unwrap();
            c.resolve(o, "ns", &[Key::new(0, "f")], t(0)).unwrap();
            c.release_rows("ns", &[0]);
            // The connection ends (a FIN or RST from the network reads
            // as a close): nothing is released, by any time.
            assert_eq!(c.detach(o, end, t(10)), 0, "{end:?}");
            c.tick(t(3_600_000));
            let st = c.stats_at(t(3_600_000));
            assert_eq!(
                (st.pins, st.used, st.reserved_bytes),
                (1, 256, 128),
                "{end:?}"
            );
            assert_eq!(st.sessions[0].orphaned, 2);
            assert_eq!(c.orphaned_sessions(), vec![s]);
            assert_eq!(c.next_deadline(), None);
            // Fenced: released once the nixl quarantine has passed.
            assert_eq!(c.fence(s, t(3_600_000)), 2);
            assert_eq!(c.next_deadline(), Some(t(3_603_000)));
            assert_eq!(c.tick(t(3_602_999)), 0);
            assert_eq!(c.stats().used, 256);
            assert_eq!(c.tick(t(3_603_000)), 2);
            let st = c.stats();
            assert_eq!((st.pins, st.used, st.reserved_bytes), (0, 0, 0), "{end:?}");
            assert!(!c.has_session(s) && c.orphaned_sessions().is_empty());
            assert_eq!(c.next_deadline(), None);
        }

        // Taken over by a retry of the same session before the quarantine
        // ends: the hold is its again, and the fence's timer skips it.
        let s = c.open_session();
        let o = c.attach(s, false).unwrap();
        c.make_one_sided(o).unwrap();
        c.alloc(o, BlobId(3), 100, 1, t(0)).unwrap();
        c.detach(o, ConnEnd::Closed, t(0));
        c.fence(s, t(0));
        let o2 = c.attach(s, false).unwrap();
        c.make_one_sided(o2).unwrap();
        assert!(matches!(
            c.alloc(o2, BlobId(3), 100, 1, t(1)),
            Ok(Allocated::Reserved { .. })
        ));
        assert_eq!(c.tick(t(10_000)), 0);
        assert_eq!(c.stats().reserved_bytes, 128);
        // Its process gone: released at once, fenced or not.
        c.detach(o2, ConnEnd::Closed, t(10_000));
        assert_eq!(c.stats().reserved_bytes, 128);
        assert_eq!(c.session_gone(s, t(10_000)), 1);
        assert_eq!(c.stats().used, 0);

        // A one-sided peer that also maps the slab: a fence never
        // releases what it holds, only its process's end.
        let s = c.open_session();
        let o = c.attach(s, true).unwrap();
        c.make_one_sided(o).unwrap();
        c.alloc(o, BlobId(4), 100, 1, t(0)).unwrap();
        c.detach(o, ConnEnd::Closed, t(0));
        assert_eq!(c.fence(s, t(0)), 0);
        c.tick(t(3_600_000));
        assert_eq!(c.stats().reserved_bytes, 128);
        c.session_gone(s, t(3_600_000));
        assert_eq!(c.stats().used, 0);

        // Without make_one_sided, a closed connection's holds go at once.
        let s = c.open_session();
        let o = c.attach(s, false).unwrap();
        c.alloc(o, BlobId(5), 100, 1, t(0)).unwrap();
        assert_eq!(c.detach(o, ConnEnd::Closed, t(0)), 1);
        assert_eq!(c.stats().used, 0);
    }

    #[test]
    fn ownership_is_enforced() {
        let mut c = core(1 << 20);
        let a = own(&mut c);
        let b = own(&mut c);
        let a2 = c.attach(a.session, true).unwrap();
        c.alloc(a, BlobId(1), 64, 1, t(0)).unwrap();
        // Another session may neither take, commit nor abort it.
        assert!(matches!(
            c.alloc(b, BlobId(1), 64, 1, t(0)),
            Err(CoreError::NotOwner(_))
        ));
        assert!(matches!(
            c.commit(b, "ns", BlobId(1), &[entry(0, "f", 0, 64)]),
            Err(CoreError::NotOwner(_))
        ));
        assert!(matches!(
            c.abort(b, BlobId(1), false, t(0)),
            Err(CoreError::NotOwner(_))
        ));
        // Another open connection of the same session waits (Busy).
        assert!(matches!(
            c.alloc(a2, BlobId(1), 64, 1, t(0)),
            Err(CoreError::Busy { .. })
        ));
        c.commit(a, "ns", BlobId(1), &[entry(0, "f", 0, 64)])
            .unwrap();
        let (pin, _) = c.resolve(a, "ns", &[Key::new(0, "f")], t(0)).unwrap();
        let pin = pin.unwrap();
        assert!(matches!(c.unpin(b, pin), Err(CoreError::NotOwner(_))));
        assert_eq!(c.stats().pins, 1);
        // Pin ids are not sequential.
        let (p2, _) = c.resolve(a, "ns", &[Key::new(0, "f")], t(0)).unwrap();
        let p2 = p2.unwrap();
        assert!(p2.0.abs_diff(pin.0) > 1 << 20, "{pin:?} then {p2:?}");
        // A detached connection can do nothing.
        c.detach(b, ConnEnd::Closed, t(0));
        assert!(matches!(
            c.alloc(b, BlobId(9), 64, 1, t(0)),
            Err(CoreError::NotOwner(_))
        ));
        // The peer closing its connection releases what it held.
        c.detach(a, ConnEnd::Closed, t(0));
        assert_eq!(c.stats().pins, 0);
    }

    #[test]
    fn a_cut_stream_is_quarantined_and_its_blob_id_reusable() {
        let mut c = core(1 << 20);
        let s = c.open_session();
        let tcp = c.attach(s, false).unwrap();
        c.alloc(tcp, BlobId(1), 100, 1, t(0)).unwrap();
        c.detach(tcp, ConnEnd::Cut, t(0));
        assert_eq!(c.stats().quarantined_bytes, 128);
        // A session with no connection and no hold is forgotten; the
        // retry, on a new connection of a new session, reserves afresh.
        assert!(!c.has_session(s));
        let s2 = c.open_session();
        let tcp2 = c.attach(s2, false).unwrap();
        assert!(matches!(
            c.alloc(tcp2, BlobId(1), 100, 1, t(1)),
            Ok(Allocated::Reserved { .. })
        ));
        c.commit(tcp2, "ns", BlobId(1), &[entry(0, "f", 0, 100)])
            .unwrap();
        c.tick(t(5_000));
        assert_eq!(c.stats().used, 128);
    }

    #[test]
    fn index_budget_answers_full() {
        let mut cfg = CoreConfig::new(1 << 20);
        cfg.index_budget = 3 * (ENTRY_OVERHEAD + 1);
        let mut c = UnitCore::new(cfg).unwrap();
        let o = own(&mut c);
        c.alloc(o, BlobId(1), 0, 4, t(0)).unwrap();
        let four: Vec<EntrySpec> = (0..4)
            .map(|r| EntrySpec {
                key: Key::new(r, "f"),
                offset: 0,
                len: 0,
                meta: vec![],
            })
            .collect();
        assert!(matches!(
            c.commit(o, "ns", BlobId(1), &four),
            Err(CoreError::Full { .. })
        ));
        c.abort(o, BlobId(1), false, t(0)).unwrap();
        c.alloc(o, BlobId(2), 0, 3, t(0)).unwrap();
        c.commit(o, "ns", BlobId(2), &four[..3]).unwrap();
        assert_eq!(c.stats().index_bytes, 3 * (ENTRY_OVERHEAD + 1));
        c.release_rows("ns", &[0, 1, 2]);
        assert_eq!(c.stats().index_bytes, 0);
    }

    #[test]
    fn session_holds_are_capped() {
        let mut cfg = CoreConfig::new(1 << 20);
        cfg.max_session_holds = 3;
        let mut c = UnitCore::new(cfg).unwrap();
        let o = own(&mut c);
        let other = own(&mut c);
        c.alloc(o, BlobId(1), 64, 1, t(0)).unwrap();
        c.commit(o, "ns", BlobId(1), &[entry(0, "f", 0, 64)])
            .unwrap();
        c.alloc(o, BlobId(2), 64, 1, t(0)).unwrap();
        c.resolve(o, "ns", &[Key::new(0, "f")], t(0)).unwrap();
        c.resolve(o, "ns", &[Key::new(0, "f")], t(0)).unwrap();
        assert!(matches!(
            c.resolve(o, "ns", &[Key::new(0, "f")], t(0)),
            Err(CoreError::Busy { .. })
        ));
        assert!(matches!(
            c.alloc(o, BlobId(3), 64, 1, t(0)),
            Err(CoreError::Busy { .. })
        ));
        // A retry of a reservation it already holds is not a new hold.
        assert!(c.alloc(o, BlobId(2), 64, 1, t(0)).is_ok());
        // Another session is not affected.
        c.resolve(other, "ns", &[Key::new(0, "f")], t(0)).unwrap();
    }

    #[test]
    fn session_connections_are_capped() {
        let mut cfg = CoreConfig::new(1 << 20);
        cfg.max_session_conns = 2;
        let mut c = UnitCore::new(cfg).unwrap();
        let s = c.open_session();
        let a = c.attach(s, true).unwrap();
        c.attach(s, true).unwrap();
        assert!(matches!(c.attach(s, true), Err(CoreError::Busy { .. })));
        c.detach(a, ConnEnd::Closed, t(0));
        c.attach(s, true).unwrap();
    }

    #[test]
    fn abort_in_flight_quarantines() {
        let mut c = core(1 << 20);
        let o = own(&mut c);
        c.alloc(o, BlobId(1), 100, 0, t(0)).unwrap();
        c.abort(o, BlobId(1), true, t(0)).unwrap();
        assert_eq!(c.stats().quarantined_bytes, 128);
        c.alloc(o, BlobId(2), 100, 0, t(0)).unwrap();
        c.abort(o, BlobId(2), false, t(0)).unwrap();
        assert_eq!(c.stats().used, 128);
        c.tick(t(5_000));
        assert_eq!(c.stats().used, 0);
    }

    #[test]
    fn absurd_sizes_are_full_not_a_wrap() {
        let mut c = core(1 << 20);
        let o = own(&mut c);
        for n in [u64::MAX, u64::MAX - 63, 1 << 63] {
            assert!(matches!(
                c.alloc(o, BlobId(1), n, 1, t(0)),
                Err(CoreError::Full { .. })
            ));
        }
        assert_eq!(c.stats().used, 0);
    }

    #[test]
    fn bad_commits_are_invalid() {
        let mut c = core(1 << 20);
        let o = own(&mut c);
        c.alloc(o, BlobId(1), 10, 1, t(0)).unwrap();
        assert!(matches!(
            c.commit(o, "ns", BlobId(1), &[entry(0, "f", 5, 6)]),
            Err(CoreError::Invalid(_))
        ));
        assert!(matches!(
            c.commit(o, "ns", BlobId(1), &[]),
            Err(CoreError::Invalid(_))
        ));
        assert!(matches!(
            c.commit(o, "ns", BlobId(9), &[]),
            Err(CoreError::UnknownBlob(_))
        ));
        c.commit(o, "ns", BlobId(1), &[entry(0, "f", 0, 10)])
            .unwrap();
    }
}
