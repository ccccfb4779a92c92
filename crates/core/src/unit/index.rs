//! The key index: listing and clearing rows and partitions.

use super::*;

impl UnitCore {
    /// The rows of partition `partition` and the fields of each, rows ascending,
    /// fields sorted.
    pub fn list(&self, partition: &str) -> Vec<(u64, Vec<String>)> {
        let mut rows: Vec<(u64, Vec<String>)> = self
            .index
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
        let Some(index) = self.index.get_mut(partition) else {
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
            self.index.remove(partition);
        }
        self.entries -= dropped.len() as u64;
        let n = dropped.len() as u64 - hidden;
        for blob in dropped {
            self.drop_entry_ref(blob);
        }
        n
    }

    /// Remove every entry of `partition`; returns how many.
    pub(super) fn clear_partition(&mut self, partition: &str) -> u64 {
        let rows: Vec<u64> = self
            .index
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
