//! The key index: listing and clearing rows and partitions
//! ([`op::ClearRows`] and [`op::ClearPartition`] are applied here).

use super::input::apply_op;
use super::op::{ClearPartition, ClearRows};
use super::*;

// A clear is remembered for the open repair windows (`repair.rs`)
// whether or not this unit holds the rows.
apply_op!(ClearRows => u64, |ClearRows { partition, rows }, core, _, _| {
    core.repair_clear_rows(&partition, &rows);
    Ok(core.clear_rows(&partition, &rows))
});
apply_op!(ClearPartition => u64, |ClearPartition { partition }, core, _, _| {
    core.repair_clear_partition(&partition);
    Ok(core.clear_partition(&partition))
});

/// The key index: partition → row → field → entry, and what it costs
/// against [`CoreConfig::index_budget`].
#[derive(Default)]
pub(super) struct Index {
    pub(super) parts: Map<String, Rows>,
    /// Bytes the entries take (names, metadata, a fixed cost each).
    pub(super) bytes: u64,
    pub(super) entries: u64,
}

impl UnitCore {
    /// The rows of partition `partition` and the fields of each, rows ascending,
    /// fields sorted.
    pub fn list(&self, partition: &str) -> Vec<(u64, Vec<String>)> {
        let mut rows: Vec<(u64, Vec<String>)> = self
            .index
            .parts
            .get(partition)
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

    /// Partitions that hold entries and start with `prefix`, sorted.
    pub fn partitions(&self, prefix: &str) -> Vec<String> {
        let mut n: Vec<String> = self
            .index
            .parts
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect();
        n.sort();
        n
    }

    /// Remove every entry of the given rows of `partition`; returns how many.
    ///
    /// Fields whose name starts with NUL are a client's bookkeeping (the
    /// rows API keeps a string row's name there): they are removed with
    /// their row but not counted.
    pub(super) fn clear_rows(&mut self, partition: &str, rows: &[u64]) -> u64 {
        self.claims_cleared(partition, rows);
        let Some(index) = self.index.parts.get_mut(partition) else {
            return 0;
        };
        let mut dropped = Vec::new();
        let mut hidden = 0u64;
        for row in rows {
            if let Some(fields) = index.remove(row) {
                hidden += fields.keys().filter(|f| f.starts_with('\0')).count() as u64;
                for (field, e) in fields {
                    self.index.bytes -= entry_cost(&field, e.meta.len());
                    dropped.push(e.blob);
                }
            }
        }
        if index.is_empty() {
            self.index.parts.remove(partition);
        }
        self.index.entries -= dropped.len() as u64;
        let n = dropped.len() as u64 - hidden;
        for blob in dropped {
            self.drop_entry_ref(blob);
        }
        n
    }

    /// Remove every entry of `partition`, and its claims state (see
    /// `claims.rs`); returns how many.
    pub(super) fn clear_partition(&mut self, partition: &str) -> u64 {
        self.claims_drop_partition(partition);
        let rows: Vec<u64> = self
            .index
            .parts
            .get(partition)
            .map(|r| r.keys().copied().collect())
            .unwrap_or_default();
        self.clear_rows(partition, &rows)
    }

    pub(super) fn drop_entry_ref(&mut self, blob: BlobId) {
        if let Some(Blob {
            state: State::Committed { live, .. },
            ..
        }) = self.blobs.get_mut(&blob)
        {
            *live -= 1;
        }
        self.maybe_free(blob);
    }
}
