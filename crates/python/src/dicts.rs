//! Rust answers as Python dicts: a unit's counters, a checkpoint's
//! metadata.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use stowage_client::Stats;

/// A checkpoint's metadata as a dict (rows, entries, bytes, files as
/// (name, size, xxh3), manifest_xxh3, host, stored).
pub(crate) fn checkpoint_dict(
    py: Python<'_>,
    info: stowage_client::CheckpointInfo,
) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("rows", info.rows)?;
    d.set_item("entries", info.entries)?;
    d.set_item("bytes", info.bytes)?;
    let files = PyList::empty(py);
    for f in info.files {
        files.append((f.name, f.size, f.xxh3))?;
    }
    d.set_item("files", files)?;
    d.set_item("manifest_xxh3", info.manifest_xxh3)?;
    d.set_item("host", info.host)?;
    d.set_item("stored", info.stored)?;
    Ok(d)
}

/// A unit's counters as a dict (`stats()` of a client and of an in-process
/// unit).
pub(crate) fn stats_dict<'py>(py: Python<'py>, s: &Stats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("capacity", s.capacity)?;
    d.set_item("used", s.used)?;
    d.set_item("reserved_bytes", s.reserved_bytes)?;
    d.set_item("quarantined_bytes", s.quarantined_bytes)?;
    d.set_item("blobs", s.blobs)?;
    d.set_item("entries", s.entries)?;
    d.set_item("rows", s.rows)?;
    d.set_item("pins", s.pins)?;
    d.set_item("disk_capacity", s.disk_capacity)?;
    d.set_item("disk_used", s.disk_used)?;
    d.set_item("spilled_blobs", s.spilled_blobs)?;
    d.set_item("disk_write_bytes", s.disk_write_bytes)?;
    d.set_item("disk_write_micros", s.disk_write_micros)?;
    d.set_item("disk_read_bytes", s.disk_read_bytes)?;
    d.set_item("disk_read_micros", s.disk_read_micros)?;
    d.set_item("index_bytes", s.index_bytes)?;
    d.set_item("held_bytes", s.held_bytes)?;
    d.set_item("overdue_holds", s.overdue_holds)?;
    d.set_item("pinned_bytes", s.pinned_bytes)?;
    d.set_item("spares", s.spares)?;
    d.set_item("spare_bytes", s.spare_bytes)?;
    d.set_item("serves_nixl", s.serves_nixl)?;
    d.set_item("page_mode", &s.page_mode)?;
    d.set_item("free_bytes", s.free_bytes)?;
    d.set_item("largest_free", s.largest_free)?;
    d.set_item("spare_budget", s.spare_budget)?;
    d.set_item("compaction_moves", s.compaction_moves)?;
    d.set_item("compaction_bytes", s.compaction_bytes)?;
    d.set_item("split_blobs", s.split_blobs)?;
    d.set_item("compaction_micros", s.compaction_micros)?;
    d.set_item("partitions", s.partitions)?;
    d.set_item("ops", s.ops)?;
    d.set_item("bytes_in", s.bytes_in)?;
    d.set_item("bytes_out", s.bytes_out)?;
    d.set_item("busy", s.busy)?;
    let sessions = PyList::empty(py);
    for x in &s.sessions {
        let e = PyDict::new(py);
        e.set_item("session", x.session)?;
        e.set_item("connections", x.connections)?;
        e.set_item("reservations", x.reservations)?;
        e.set_item("pins", x.pins)?;
        e.set_item("held_bytes", x.held_bytes)?;
        e.set_item("oldest_hold_ms", x.oldest_hold_ms)?;
        e.set_item("orphaned", x.orphaned)?;
        e.set_item("spares", x.spares)?;
        sessions.append(e)?;
    }
    d.set_item("sessions", sessions)?;
    Ok(d)
}
