//! The claims state in a checkpoint: what [`UnitCore::snapshot`] takes of
//! it ([`PartitionClaims`]) and how [`input::RestoreClaims`] puts it back.
//!
//! Saved per registered partition: its registration (tasks, samples,
//! group size), its rows in the order claims take them, and per task the
//! rows it consumed and its consumed counter. Not saved: leases (their
//! rows were not settled, so they are saved as *not* consumed and are
//! claimable again after a restore) and waiting claims (their connections
//! do not outlive the unit).

use super::*;

impl UnitCore {
    /// The claims state of every registered partition, by name.
    pub(in crate::unit) fn claims_snapshot(&self) -> Vec<PartitionClaims> {
        let mut out: Vec<PartitionClaims> = self
            .claims
            .parts
            .iter()
            .map(|(name, part)| {
                let mut units: Vec<(&u64, &Vec<u64>)> = part.units.iter().collect();
                units.sort_unstable_by_key(|(seq, _)| **seq);
                let order = units
                    .into_iter()
                    .flat_map(|(_, rows)| rows.iter().copied())
                    .collect();
                let tasks = part
                    .tasks
                    .iter()
                    .map(|t| {
                        let mut consumed: Vec<u64> = t.consumed.iter().copied().collect();
                        consumed.sort_unstable();
                        TaskClaims {
                            name: t.name.clone(),
                            consumed,
                            consumed_total: t.consumed_total,
                            by_home: {
                                let mut h: Vec<(u32, u64)> =
                                    t.by_home.iter().map(|(k, v)| (*k, *v)).collect();
                                h.sort_unstable();
                                h
                            },
                        }
                    })
                    .collect();
                PartitionClaims {
                    partition: name.clone(),
                    samples: part.samples,
                    group_size: part.group_size,
                    order,
                    tasks,
                }
            })
            .collect();
        out.sort_unstable_by(|a, b| a.partition.cmp(&b.partition));
        out
    }

    /// Put back the claims state of `parts`, as [`UnitCore::claims_snapshot`]
    /// took it, over the rows the index holds now (restore the entries
    /// first). A partition already registered loses its claims state
    /// first. The rows arrive in the saved order, then any other row of
    /// the index ascending; a consumed row the index does not hold stays
    /// consumed, for when it comes (with copies, a rebuild brings other
    /// homes' rows), and a clear of it forgets it. Checked whole before
    /// anything changes.
    pub(in crate::unit) fn restore_claims(
        &mut self,
        parts: Vec<PartitionClaims>,
    ) -> Result<(), CoreError> {
        for p in &parts {
            if p.tasks.len() > MAX_TASKS {
                return Err(CoreError::Invalid(format!(
                    "partition {:?} has {} tasks, more than {MAX_TASKS}",
                    p.partition,
                    p.tasks.len()
                )));
            }
            for (i, t) in p.tasks.iter().enumerate() {
                if t.name.is_empty() || p.tasks[..i].iter().any(|k| k.name == t.name) {
                    return Err(CoreError::Invalid(format!(
                        "partition {:?}: a task's name is empty or given twice",
                        p.partition
                    )));
                }
            }
        }
        let mut seen = HashSet::new();
        if let Some(p) = parts.iter().find(|p| !seen.insert(p.partition.as_str())) {
            return Err(CoreError::Invalid(format!(
                "partition {:?} is given twice",
                p.partition
            )));
        }
        for saved in parts {
            self.claims_drop_partition(&saved.partition);
            let mut part = Part::new(saved.group_size);
            part.samples = saved.samples;
            if let Some(rows) = self.index.parts.get(&saved.partition) {
                let group_of = |row: u64| {
                    rows[&row]
                        .keys()
                        .filter_map(|f| f.strip_prefix(GROUP_PREFIX))
                        .min()
                };
                for &row in &saved.order {
                    if rows.contains_key(&row) && !part.rows.contains_key(&row) {
                        part.add_row(row, group_of(row));
                    }
                }
                let mut rest: Vec<u64> = rows
                    .keys()
                    .copied()
                    .filter(|r| !part.rows.contains_key(r))
                    .collect();
                rest.sort_unstable();
                for row in rest {
                    part.add_row(row, group_of(row));
                }
            }
            for t in saved.tasks {
                // Kept also when the index does not hold the row (yet):
                // with copies a part holds its own homes' rows, and the
                // copies of others' come back with `rebuild_copies`,
                // consumed already (their marks not counted again).
                let consumed: Set<u64> = t.consumed.into_iter().collect();
                part.tasks.push(Task {
                    name: t.name,
                    consumed_total: t.consumed_total.max(consumed.len() as u64),
                    consumed,
                    leased: Map::default(),
                    cands: BTreeSet::new(),
                    by_home: t.by_home.into_iter().collect(),
                });
            }
            let seqs: Vec<u64> = part.units.keys().copied().collect();
            for seq in seqs {
                part.refresh_all(seq);
            }
            // Rows marked consumed by another copy's claimer are consumed
            // (counted already when the state was taken).
            for t in 0..part.tasks.len() {
                let counts = part.tasks[t].by_home.clone();
                part.learn_marks(t, self.index.parts.get(&saved.partition));
                part.tasks[t].by_home = counts;
            }
            self.claims.parts.insert(saved.partition, part);
        }
        Ok(())
    }
}
