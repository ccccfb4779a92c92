//! Repair windows: a repairer copies rows from a surviving copy into this
//! unit, and must neither bring back a row that a client cleared meanwhile
//! nor overwrite a newer value. It opens a window here
//! ([`op::OpenRepair`]) before it reads the other copy; from then on, the
//! clears of the window's namespace are remembered (a *tombstone* per
//! cleared row, or per cleared partition, with the clear's sequence
//! number), and a repair put through the window ([`op::RepairAlloc`],
//! [`op::RepairCommit`]) stores an entry only when the key has no value
//! here and neither its row nor its partition was cleared since the window
//! opened. The client sends every clear to the new copy again after it
//! reached the old one, so a value read from the old copy before its
//! clear is refused here, whichever of the two comes first.
//!
//! Nothing is remembered while no window is open, and only clears of
//! namespaces that have one; what no open window can need any more (older
//! than every open window, or of a namespace with none) is dropped when a
//! window closes, and all of it, with its maps' memory, when the last one
//! closes or a session's end closes it.
//!
//! Memory, counted against nothing else (neither the slab nor the index
//! budget): a row tombstone is a `u64 → u64` entry of a hash map, about
//! 40 bytes with the map's spare room; a partition remembered is its name
//! and about 100 bytes of map entry and header. The caps
//! ([`CoreConfig::repair_row_tombstones`], 2^20 rows ≈ 40 MiB, and
//! [`CoreConfig::repair_partitions`], 2^16 partitions ≈ 7 MiB and their
//! names) bound it: past the row cap a cleared row is remembered as its
//! whole partition (coarser: it refuses more, never less); past the
//! partition cap every open window *loses track* — everything remembered
//! is dropped and each open window's repair puts answer Busy, so its
//! repairer starts over with a new window. Each window costs its key and
//! scope and about 80 bytes; a unit holds at most [`MAX_REPAIR_WINDOWS`].

use super::input::apply_op;
use super::op::{CloseRepair, OpenRepair, RepairAlloc, RepairCommit, Repaired};
use super::*;

/// Most repair windows open at once on a unit; past it, Busy.
pub const MAX_REPAIR_WINDOWS: usize = 1 << 16;

apply_op!(OpenRepair => u64, |OpenRepair { scope, key }, core, now, owner| {
    core.open_repair(owner, scope, key, now)
});
apply_op!(CloseRepair => (), |CloseRepair { window }, core, _, owner| {
    core.close_repair(owner, window)
});
apply_op!(RepairAlloc => Allocated, |op, core, now, owner| {
    core.repair_window(owner, op.window, None)?;
    core.repair_window_used(op.window, now);
    match core.reserve(owner, op.blob, op.nbytes, Some(op.n_entries), false, now)? {
        // Only a blob a Put reserved on disk before (the same id): a
        // repair put's entries are filtered at its commit, in memory.
        Allocated::ToDisk => Err(CoreError::Invalid(format!(
            "blob {:?} is reserved on the disk tier by a Put; a repair put lies in the slab",
            op.blob
        ))),
        a => Ok(a),
    }
});
apply_op!(RepairCommit => Repaired, |op, core, now, owner| {
    let r = core.repair_commit(owner, op.window, &op.partition, op.blob, op.entries);
    core.repair_window_used(op.window, now);
    r
});

/// One open window.
#[derive(Debug)]
struct Window {
    session: SessionId,
    scope: String,
    key: String,
    /// The clear sequence when it opened: a tombstone above it was
    /// cleared since.
    opened: u64,
    /// It lost track of clears (the partition cap), or another session
    /// took it over: its repair puts answer Busy.
    lost: bool,
    /// When its session last opened it or sent a repair put through it.
    used: Time,
}

/// What is remembered of one partition.
#[derive(Debug, Default)]
pub(super) struct Cleared {
    /// The partition's last clear (a ClearPartition, or a ClearRows past
    /// the row cap).
    whole: Option<u64>,
    /// Each cleared row's last clear.
    rows: Map<u64, u64>,
}

/// The repair windows and the clears they remember.
#[derive(Debug, Default)]
pub(super) struct Repairs {
    windows: BTreeMap<u64, Window>,
    next_window: u64,
    /// Open windows that have not lost track, by scope: the namespaces
    /// whose clears are remembered.
    scopes: HashMap<String, usize>,
    /// Clears remembered, counted from 1.
    seq: u64,
    pub(super) partitions: Map<String, Cleared>,
    /// Row tombstones over all partitions.
    rows: usize,
}

impl Repairs {
    /// Whether `partition`'s clears are remembered now.
    fn watched(&self, partition: &str) -> bool {
        !self.scopes.is_empty()
            && self
                .scopes
                .keys()
                .any(|s| partition.starts_with(s.as_str()))
    }

    /// Whether `row` of `partition` (or the partition) was cleared after
    /// clear number `opened`.
    fn cleared_since(&self, partition: &str, row: u64, opened: u64) -> bool {
        self.partitions.get(partition).is_some_and(|c| {
            c.whole.is_some_and(|s| s > opened) || c.rows.get(&row).is_some_and(|&s| s > opened)
        })
    }

    /// Drop what no open window needs: every tombstone when no window
    /// tracks clears (the maps' memory too), else those not above the
    /// oldest tracking window's start and those of namespaces with no
    /// tracking window.
    fn prune(&mut self) {
        let oldest = self
            .windows
            .values()
            .filter(|w| !w.lost)
            .map(|w| w.opened)
            .min();
        let Some(oldest) = oldest else {
            self.partitions = Map::default();
            self.rows = 0;
            return;
        };
        let scopes = &self.scopes;
        let mut rows = 0;
        self.partitions.retain(|p, c| {
            if !scopes.keys().any(|s| p.starts_with(s.as_str())) {
                return false;
            }
            c.whole = c.whole.filter(|&s| s > oldest);
            c.rows.retain(|_, s| *s > oldest);
            rows += c.rows.len();
            c.whole.is_some() || !c.rows.is_empty()
        });
        self.rows = rows;
    }

    fn close(&mut self, id: u64) {
        if let Some(w) = self.windows.remove(&id) {
            if !w.lost {
                if let Some(n) = self.scopes.get_mut(&w.scope) {
                    *n -= 1;
                    if *n == 0 {
                        self.scopes.remove(&w.scope);
                    }
                }
            }
            self.prune();
        }
    }

    /// Window `id` loses track (another session took its key over): its
    /// repair puts answer Busy, and what only it needed is dropped.
    fn take_over(&mut self, id: u64) {
        let Some(w) = self.windows.get_mut(&id) else {
            return;
        };
        if w.lost {
            return;
        }
        w.lost = true;
        if let Some(n) = self.scopes.get_mut(&w.scope) {
            *n -= 1;
            if *n == 0 {
                self.scopes.remove(&w.scope);
            }
        }
        self.prune();
    }

    /// Every open window loses track of clears (the partition cap): all
    /// that is remembered goes.
    fn lose_track(&mut self) {
        for w in self.windows.values_mut() {
            w.lost = true;
        }
        self.scopes.clear();
        self.prune();
    }
}

impl UnitCore {
    fn open_repair(
        &mut self,
        owner: Owner,
        scope: String,
        key: String,
        now: Time,
    ) -> Result<u64, CoreError> {
        self.check_owner(owner)?;
        let lease = self.cfg.repair_window_lease;
        let r = &mut self.repairs;
        let mut taken = false;
        let mut idle = Vec::new();
        for (&id, w) in &r.windows {
            if w.session == owner.session || w.scope != scope || w.key != key || w.lost {
                continue;
            }
            if now.saturating_sub(w.used) >= lease {
                idle.push(id);
            } else {
                taken = true;
            }
        }
        if !taken {
            // Another session's window of the key, idle past the lease:
            // it loses track (nothing more of it is stored) and this
            // session repairs instead.
            for id in idle {
                r.take_over(id);
            }
        }
        if taken || r.windows.len() >= MAX_REPAIR_WINDOWS {
            return Err(CoreError::Busy {
                needed: 0,
                reclaimable: 0,
            });
        }
        r.next_window += 1;
        let id = r.next_window;
        *r.scopes.entry(scope.clone()).or_default() += 1;
        r.windows.insert(
            id,
            Window {
                session: owner.session,
                scope,
                key,
                opened: r.seq,
                lost: false,
                used: now,
            },
        );
        Ok(id)
    }

    /// Window `window` was used now (a repair put through it).
    fn repair_window_used(&mut self, window: u64, now: Time) {
        if let Some(w) = self.repairs.windows.get_mut(&window) {
            w.used = now;
        }
    }

    fn close_repair(&mut self, owner: Owner, window: u64) -> Result<(), CoreError> {
        match self.repairs.windows.get(&window) {
            Some(w) if w.session != owner.session => Err(CoreError::NotOwner(format!(
                "repair window {window} is another session's"
            ))),
            Some(_) => {
                self.repairs.close(window);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// The session ended: its windows close.
    pub(super) fn repair_session_ended(&mut self, session: SessionId) {
        let mine: Vec<u64> = self
            .repairs
            .windows
            .iter()
            .filter(|(_, w)| w.session == session)
            .map(|(id, _)| *id)
            .collect();
        for id in mine {
            self.repairs.close(id);
        }
    }

    /// Where `window` started (its clear sequence), if it is an open
    /// window of `owner`'s session that has not lost track (Busy when it
    /// has), and `partition` (when given) lies in its namespace.
    fn repair_window(
        &self,
        owner: Owner,
        window: u64,
        partition: Option<&str>,
    ) -> Result<u64, CoreError> {
        let w = match self.repairs.windows.get(&window) {
            Some(w) if w.session == owner.session => w,
            _ => {
                return Err(CoreError::Invalid(format!(
                    "repair window {window} is not open in this session"
                )))
            }
        };
        if w.lost {
            return Err(CoreError::Busy {
                needed: 0,
                reclaimable: 0,
            });
        }
        if partition.is_some_and(|p| !p.starts_with(w.scope.as_str())) {
            return Err(CoreError::Invalid(format!(
                "repair window {window} is another namespace's"
            )));
        }
        Ok(w.opened)
    }

    /// Whether `window` is open and lost track of clears (its repair puts
    /// answer Busy).
    pub fn repair_window_lost(&self, window: u64) -> bool {
        self.repairs.windows.get(&window).is_some_and(|w| w.lost)
    }

    /// Open repair windows, and the row and partition tombstones they
    /// keep now.
    pub fn repair_tombstones(&self) -> (usize, usize, usize) {
        let r = &self.repairs;
        (r.windows.len(), r.rows, r.partitions.len())
    }

    /// Remember a ClearRows of `rows` of `partition` for the open windows
    /// (before the index forgets them: a row this unit does not hold is
    /// remembered as well).
    pub(super) fn repair_clear_rows(&mut self, partition: &str, rows: &[u64]) {
        if !self.repairs.watched(partition) {
            return;
        }
        let cap = self.cfg.repair_row_tombstones;
        let Some(seq) = self.repair_clear(partition) else {
            return;
        };
        let r = &mut self.repairs;
        let Some(c) = r.partitions.get_mut(partition) else {
            return;
        };
        for row in rows {
            if r.rows >= cap && !c.rows.contains_key(row) {
                // Coarser: the whole partition counts as cleared now.
                c.whole = Some(seq);
                break;
            }
            if c.rows.insert(*row, seq).is_none() {
                r.rows += 1;
            }
        }
    }

    /// Remember a ClearPartition of `partition` for the open windows.
    pub(super) fn repair_clear_partition(&mut self, partition: &str) {
        if !self.repairs.watched(partition) {
            return;
        }
        if let Some(seq) = self.repair_clear(partition) {
            if let Some(c) = self.repairs.partitions.get_mut(partition) {
                c.whole = Some(seq);
            }
        }
    }

    /// The next clear's number, with `partition`'s record made; `None`
    /// when the partition cap was reached (every window lost track).
    fn repair_clear(&mut self, partition: &str) -> Option<u64> {
        let r = &mut self.repairs;
        if !r.partitions.contains_key(partition) {
            if r.partitions.len() >= self.cfg.repair_partitions {
                r.lose_track();
                return None;
            }
            r.partitions
                .insert(partition.to_owned(), Cleared::default());
        }
        r.seq += 1;
        Some(r.seq)
    }

    /// Publish the entries of a blob reserved by [`op::RepairAlloc`] that
    /// have no value here and were not cleared since `window` opened
    /// ([`op::RepairCommit`]).
    fn repair_commit(
        &mut self,
        owner: Owner,
        window: u64,
        partition: &str,
        blob: BlobId,
        entries: Vec<EntrySpec>,
    ) -> Result<Repaired, CoreError> {
        let opened = self.repair_window(owner, window, Some(partition))?;
        let all = u32::try_from(entries.len()).unwrap_or(u32::MAX);
        let retried = Repaired {
            stored: 0,
            skipped: all,
        };
        let nbytes = match self.blobs.get(&blob) {
            None if self.freed.set.contains(&blob) => return Ok(retried),
            None => return Err(CoreError::UnknownBlob(blob)),
            Some(Blob {
                state: State::Committed { .. } | State::PendingDisk { .. },
                ..
            }) => return Ok(retried),
            Some(Blob {
                state: State::Reserved { holder, n_entries },
                region,
                nbytes,
                ..
            }) => {
                holder.check(owner, || {
                    format!("blob {blob:?} is reserved by another session")
                })?;
                if region.is_none() || *n_entries != Some(all) {
                    return Err(CoreError::Invalid(format!(
                        "blob {blob:?} was not reserved in the slab for a repair put of {all} entries"
                    )));
                }
                *nbytes
            }
        };
        if let Some(e) = entries
            .iter()
            .find(|e| e.offset.checked_add(e.len).is_none_or(|end| end > nbytes))
        {
            return Err(CoreError::Invalid(format!(
                "entry {} at {}+{} lies outside blob of {nbytes} bytes",
                e.key, e.offset, e.len
            )));
        }
        let rows = self.index.parts.get(partition);
        let mut seen = HashSet::with_capacity(entries.len());
        let keep: Vec<bool> = entries
            .iter()
            .map(|e| {
                let (row, field) = (e.key.row, e.key.field.as_str());
                let present = rows
                    .and_then(|r| r.get(&row))
                    .is_some_and(|f| f.contains_key(field));
                // A key named twice: the first is stored.
                !present
                    && !self.repairs.cleared_since(partition, row, opened)
                    && seen.insert((row, field))
            })
            .collect();
        let kept: Vec<EntrySpec> = entries
            .into_iter()
            .zip(keep)
            .filter_map(|(e, keep)| keep.then_some(e))
            .collect();
        let stored = kept.len() as u32;
        if let Some(Blob {
            state: State::Reserved { n_entries, .. },
            ..
        }) = self.blobs.get_mut(&blob)
        {
            *n_entries = Some(stored);
        }
        match self.commit(owner, partition, blob, kept)? {
            Committed::Done => Ok(Repaired {
                stored,
                skipped: all.saturating_sub(stored),
            }),
            // A slab reservation is published at once.
            Committed::Pending => Err(CoreError::Invalid(format!(
                "blob {blob:?} of a repair put went to the disk tier"
            ))),
        }
    }
}
