//! The stats message: the core's counters and the unit server's own.

use serde::{Deserialize, Serialize};
use stowage_core::SessionStats;

/// Counters of a unit: the reply to [`crate::Request::Stats`]. The core's
/// counters ([`stowage_core::Stats`], converted with `From`) and what the
/// unit server keeps beside them (disk I/O, traffic, compaction time, how
/// it serves); fields are only ever appended.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    pub capacity: u64,
    /// Slab bytes of stored data: committed blobs in memory (cleared ones
    /// that a reader still pins included). Reservations, spares and
    /// quarantined ranges are reported beside it.
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
    /// Bytes the key index takes (see `CoreConfig::index_budget`).
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
    /// Partitions that hold rows (over every connection namespace).
    pub partitions: u64,
    /// Bytes of pinned blobs (part of [`Stats::held_bytes`]).
    pub pinned_bytes: u64,
    /// Spares: reservations same-host clients hold for their next puts
    /// (`ReserveSpare`; not counted in `blobs`, never
    /// overdue), and their bytes (part of `reserved_bytes` and `used`).
    pub spares: u64,
    pub spare_bytes: u64,
    /// Whether the unit serves one-sided NIXL transfers (`--nixl`; set by
    /// the unit server). Last in the message.
    pub serves_nixl: bool,
    /// The slab's page mode: `4k`, `thp` or `hugetlb` (set by the unit
    /// server, the core reports "").
    pub page_mode: String,
    /// Free slab bytes (both zones), and the largest free range: a value
    /// larger than it is stored in pieces.
    pub free_bytes: u64,
    pub largest_free: u64,
    /// Bytes of the spare zone (`CoreConfig::spare_budget`).
    pub spare_budget: u64,
    /// Compaction since start: blobs moved and their bytes.
    pub compaction_moves: u64,
    pub compaction_bytes: u64,
    /// Blobs stored in more than one piece.
    pub split_blobs: u64,
    /// Time compaction spent copying since start, in microseconds (kept by
    /// the unit server; the core reports 0). Last in the message.
    pub compaction_micros: u64,
}

impl From<stowage_core::Stats> for Stats {
    /// The core's counters; the server's own start at their defaults, for
    /// the unit to fill.
    fn from(s: stowage_core::Stats) -> Self {
        Stats {
            capacity: s.capacity,
            used: s.used,
            reserved_bytes: s.reserved_bytes,
            quarantined_bytes: s.quarantined_bytes,
            blobs: s.blobs,
            entries: s.entries,
            rows: s.rows,
            pins: s.pins,
            disk_capacity: s.disk_capacity,
            disk_used: s.disk_used,
            spilled_blobs: s.spilled_blobs,
            index_bytes: s.index_bytes,
            held_bytes: s.held_bytes,
            overdue_holds: s.overdue_holds,
            sessions: s.sessions,
            partitions: s.partitions,
            pinned_bytes: s.pinned_bytes,
            spares: s.spares,
            spare_bytes: s.spare_bytes,
            free_bytes: s.free_bytes,
            largest_free: s.largest_free,
            spare_budget: s.spare_budget,
            compaction_moves: s.compaction_moves,
            compaction_bytes: s.compaction_bytes,
            split_blobs: s.split_blobs,
            ..Stats::default()
        }
    }
}
