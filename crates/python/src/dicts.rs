//! Rust answers as Python dicts: a unit's counters, a checkpoint's
//! metadata.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use stowage_client::Stats;

/// Set each named field of `$s` as the item of the same name in dict `$d`.
macro_rules! set_fields {
    ($d:expr, $s:expr; $($f:ident),* $(,)?) => {
        $($d.set_item(stringify!($f), &$s.$f)?;)*
    };
}

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
    set_fields!(d, s;
        capacity, used, reserved_bytes, quarantined_bytes, blobs, entries, rows, pins,
        disk_capacity, disk_used, spilled_blobs, disk_write_bytes, disk_write_micros,
        disk_read_bytes, disk_read_micros, index_bytes, held_bytes, overdue_holds,
        pinned_bytes, spares, spare_bytes, serves_nixl, page_mode, free_bytes, largest_free,
        spare_budget, compaction_moves, compaction_bytes, split_blobs, compaction_micros,
        partitions, ops, bytes_in, bytes_out, busy, outside_slab_bytes, outside_slab_limit,
        outside_slab_waits, outside_slab_cuts
    );
    let sessions = PyList::empty(py);
    for x in &s.sessions {
        let e = PyDict::new(py);
        set_fields!(e, x;
            session, connections, reservations, pins, held_bytes, oldest_hold_ms, orphaned,
            spares
        );
        sessions.append(e)?;
    }
    d.set_item("sessions", sessions)?;
    Ok(d)
}
