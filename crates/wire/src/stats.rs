//! The stats message: the core's counters and the unit server's own.

use serde::{Deserialize, Serialize};

/// Counters of a unit: the reply to [`crate::Request::Stats`]. The core's
/// counters ([`stowage_core::Stats`], one field, read through as if they
/// were this message's own: `stats.used`) and what the unit server keeps
/// beside them (disk I/O, traffic, compaction time, how it serves); fields
/// are only ever appended (to either part, with a new
/// [`crate::PROTOCOL_VERSION`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// What the core counts.
    pub core: stowage_core::Stats,
    /// Disk tier I/O since start, kept by the unit server: bytes written
    /// by spills and disk puts, and the time spent writing them; bytes
    /// read back, and the time.
    pub disk_write_bytes: u64,
    pub disk_write_micros: u64,
    pub disk_read_bytes: u64,
    pub disk_read_micros: u64,
    /// Traffic since start, kept by the unit server (0 in a unit started
    /// without metrics): requests answered, value bytes written into the
    /// unit (puts, commits) and read out of it (gets, resolves), and Busy
    /// answers. Two samples give rates (`stowage status`).
    pub ops: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub busy: u64,
    /// Whether the unit serves one-sided NIXL transfers (`--nixl`).
    pub serves_nixl: bool,
    /// The slab's page mode: `4k`, `thp` or `hugetlb`.
    pub page_mode: String,
    /// Time compaction spent copying since start, in microseconds.
    pub compaction_micros: u64,
    /// Bytes the unit holds outside its slab for its connections now
    /// (request headers being read, replies being written, their
    /// buffers), and the most it holds before their reads wait (its
    /// `--outside-slab-budget` and that budget's headroom for small
    /// frames).
    pub outside_slab_bytes: u64,
    pub outside_slab_limit: u64,
    /// Since start: times a connection's read waited for that budget, and
    /// connections cut because it was spent (the holder of the most
    /// stalled bytes first).
    pub outside_slab_waits: u64,
    pub outside_slab_cuts: u64,
}

impl std::ops::Deref for Stats {
    type Target = stowage_core::Stats;
    fn deref(&self) -> &stowage_core::Stats {
        &self.core
    }
}

impl std::ops::DerefMut for Stats {
    fn deref_mut(&mut self) -> &mut stowage_core::Stats {
        &mut self.core
    }
}

impl From<stowage_core::Stats> for Stats {
    /// The core's counters; the server's own start at their defaults, for
    /// the unit to fill.
    fn from(core: stowage_core::Stats) -> Self {
        Stats {
            core,
            ..Stats::default()
        }
    }
}
