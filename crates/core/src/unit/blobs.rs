//! Reservations, spares and commits: the ops that reserve, commit or
//! abort a blob are applied here, with leaf helpers only.

use super::input::apply_op;
use super::op::{Abort, Alloc, Commit, CommitSpare, CommitWritten, NameSpare, ReserveSpare};
use super::*;

apply_op!(Alloc => Allocated, |Alloc { blob, nbytes, n_entries }, core, now, owner| {
    core.alloc(owner, blob, nbytes, n_entries, now)
});
apply_op!(ReserveSpare => Option<u64>, |ReserveSpare { blob, nbytes }, core, now, owner| {
    core.reserve_spare(owner, blob, nbytes, now)
});
apply_op!(NameSpare => bool, |NameSpare { spare, blob }, core, now, owner| {
    core.name_spare(owner, spare, blob, now)
});
apply_op!(Commit => Committed, |Commit { partition, blob, entries }, core, _, owner| {
    core.refuse_disk_reservation(owner, blob)?;
    core.commit(owner, &partition, blob, entries)
});
apply_op!(CommitWritten => Committed, |op, core, _, owner| {
    core.commit(owner, &op.partition, op.blob, op.entries)
});
apply_op!(CommitSpare => SpareCommitted, |op, core, now, owner| {
    core.refuse_disk_reservation(owner, op.blob)?;
    if !core.name_spare(owner, op.written, op.blob, now)? {
        return Ok(SpareCommitted::AlreadyCommitted);
    }
    Ok(match core.commit(owner, &op.partition, op.blob, op.entries)? {
        Committed::Pending => SpareCommitted::Pending,
        Committed::Done => SpareCommitted::Committed {
            spare: core.reserve_spare(owner, op.spare, op.spare_nbytes, now)?,
        },
    })
});
apply_op!(Abort => (), |Abort { blob, in_flight }, core, now, owner| {
    core.abort(owner, blob, in_flight, now)
});

impl UnitCore {
    /// Give up a reservation (any holder): free its range, or quarantine it
    /// when a transfer may still write (`in_flight`).
    pub(super) fn release_reservation(&mut self, blob: BlobId, in_flight: bool, now: Time) {
        let session = match self.blobs.get(&blob) {
            Some(Blob {
                state: State::Reserved { holder, .. },
                ..
            }) => holder.session,
            _ => return,
        };
        if let Some(s) = self.holds.sessions.get_mut(&session) {
            s.reservations.remove(&blob);
        }
        self.release_reservation_of(blob, in_flight, now);
    }

    /// [`Self::release_reservation`] once the session's record is handled.
    pub(super) fn release_reservation_of(&mut self, blob: BlobId, in_flight: bool, now: Time) {
        if !matches!(
            self.blobs.get(&blob),
            Some(Blob {
                state: State::Reserved { .. },
                ..
            })
        ) {
            return;
        }
        let Some(b) = self.blobs.remove(&blob) else {
            return;
        };
        match b.region {
            Some(r) => {
                self.reserved_bytes -= r.len;
                if in_flight {
                    self.quarantine(r, now);
                } else {
                    self.release(r, Release::Reservation);
                }
            }
            None => self.disk_reservation_gone(blob, b.nbytes),
        }
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
    pub(super) fn alloc(
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
    pub(super) fn reserve_spare(
        &mut self,
        owner: Owner,
        blob: BlobId,
        nbytes: u64,
        now: Time,
    ) -> Result<Option<u64>, CoreError> {
        match self.reserve(owner, blob, nbytes, None, false, now) {
            Ok(Allocated::Reserved { pieces }) => Ok(pieces.first().map(|p| p.0)),
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
    pub(super) fn name_spare(
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
                state: State::Reserved { holder, n_entries },
                ..
            }) => {
                holder.check(owner, || {
                    format!("{spare:?} is reserved by another session")
                })?;
                if n_entries.is_some() {
                    return Err(CoreError::Invalid(format!(
                        "{spare:?} was reserved by Alloc, not as a spare"
                    )));
                }
            }
            _ => return Err(CoreError::UnknownBlob(spare)),
        }
        if self.freed.set.contains(&blob)
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
        if let Some(s) = self.holds.sessions.get_mut(&owner.session) {
            s.reservations.remove(&spare);
            s.reservations.insert(blob);
        }
        Ok(true)
    }

    pub(super) fn reserve(
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
                    holder.check(owner, || reserved_elsewhere(blob))?;
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
                    Ok(match &b.region {
                        Some(r) => Allocated::Reserved {
                            pieces: r.pieces().to_vec(),
                        },
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
        if self.freed.set.contains(&blob) {
            return Ok(Allocated::AlreadyCommitted);
        }
        self.check_holds(owner.session, nbytes)?;
        let capacity = self.slab.capacity();
        let fits_disk = to_disk && self.disk_on() && nbytes <= self.disk_free();
        let spare = n_entries.is_none();
        let region = if spare {
            // Spares come from the spare zone only, and none while memory
            // is short: they are an offer, never a reason a put waits.
            if self.spares_short() {
                None
            } else {
                self.slab.allocate_spare(nbytes)
            }
        } else if SlabAllocator::rounded(nbytes) <= capacity {
            self.slab.allocate(nbytes)
        } else {
            None
        };
        let region = match region {
            Some(r) => Some(r),
            None if spare => {
                return Err(CoreError::Full {
                    needed: nbytes,
                    free: self.slab.spare_free(),
                    capacity: self.slab.spare_budget(),
                    held: Held::default(),
                })
            }
            None if fits_disk => None,
            None => {
                let free = capacity - self.slab.allocated();
                if free >= SlabAllocator::rounded(nbytes) {
                    // Room enough, cut into more pieces than a blob may
                    // have: compaction gathers it.
                    self.wants_range(SlabAllocator::rounded(nbytes));
                    return Err(CoreError::Busy {
                        needed: nbytes,
                        reclaimable: 0,
                    });
                }
                // Full or Busy, by what holds the memory (`full.rs`).
                return Err(self.short_of_memory(owner, blob, nbytes, now));
            }
        };
        if region.as_ref().is_some_and(|r| !r.is_contiguous()) {
            self.wants_range(SlabAllocator::rounded(nbytes));
        }
        let (disk, answer) = match &region {
            Some(r) => {
                self.reserved_bytes += r.len;
                (
                    Disk::None,
                    Allocated::Reserved {
                        pieces: r.pieces().to_vec(),
                    },
                )
            }
            None => {
                self.tier.disk_used += nbytes;
                (Disk::Writing, Allocated::ToDisk)
            }
        };
        self.blobs.insert(
            blob,
            Blob {
                region,
                promoting: None,
                moving: None,
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
        if let Some(s) = self.holds.sessions.get_mut(&owner.session) {
            s.reservations.insert(blob);
        }
        self.refusals.forget(blob);
        Ok(answer)
    }

    /// Whether memory is short for spares: the data zone's free bytes are
    /// under an eighth of the slab (or under the spare budget). The unit
    /// then offers none, and tells sessions that hold some to give them
    /// back on their next call.
    pub fn spares_short(&self) -> bool {
        self.slab.data_free() < (self.slab.capacity() / 8).max(self.slab.spare_budget())
    }

    /// The slab pieces of blob `blob`, reserved by `owner` and not
    /// committed: what its client wrote, for the unit to copy on to the
    /// other copies' units (`Request::CopyReserved`). Its reservation
    /// keeps the range where it is (compaction never moves a reserved
    /// blob) until its commit or abort.
    pub fn reserved_pieces(
        &self,
        owner: Owner,
        blob: BlobId,
    ) -> Result<Vec<(u64, u64)>, CoreError> {
        match self.blobs.get(&blob) {
            Some(Blob {
                state: State::Reserved { holder, .. },
                region: Some(region),
                ..
            }) => {
                holder.check(owner, || reserved_elsewhere(blob))?;
                Ok(region.pieces().to_vec())
            }
            Some(Blob {
                state: State::Reserved { .. },
                ..
            }) => Err(CoreError::Invalid(format!(
                "blob {blob:?} is reserved on the disk tier: there is nothing in the slab to copy"
            ))),
            _ => Err(CoreError::UnknownBlob(blob)),
        }
    }

    /// Refuse a bare commit of a blob reserved on the disk tier and not
    /// yet committed: its bytes must come with a put (the driver writes
    /// its file, [`op::CommitWritten`]), so a bare commit would wait for a
    /// file that nobody writes. (Only for the owner's session's own
    /// reservations: another session's commit is refused as not the
    /// owner's.)
    pub(super) fn refuse_disk_reservation(
        &self,
        owner: Owner,
        blob: BlobId,
    ) -> Result<(), CoreError> {
        match self.blobs.get(&blob) {
            Some(Blob {
                state: State::Reserved { holder, .. },
                region: None,
                ..
            }) if holder.session == owner.session => Err(CoreError::Invalid(format!(
                "blob {blob:?} is reserved on the disk tier: send its bytes with Put"
            ))),
            _ => Ok(()),
        }
    }

    /// Publish the entries of a reserved blob in partition `partition`.
    ///
    /// Idempotent: committing a committed blob again succeeds without
    /// change. A key that already has a value is replaced atomically (the
    /// old value stays readable to whoever pinned it). A blob reserved on
    /// disk answers [`Committed::Pending`] until its file is durable.
    pub(super) fn commit(
        &mut self,
        owner: Owner,
        partition: &str,
        blob: BlobId,
        entries: impl Into<Vec<EntrySpec>>,
    ) -> Result<Committed, CoreError> {
        let entries = entries.into();
        let Some(b) = self.blobs.get(&blob) else {
            return if self.freed.set.contains(&blob) {
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
                holder.check(owner, || reserved_elsewhere(blob))?;
                if let Some(n_entries) = n_entries.filter(|&n| entries.len() != n as usize) {
                    return Err(CoreError::Invalid(format!(
                        "blob {blob:?} was reserved for {n_entries} entries, commit names {}",
                        entries.len()
                    )));
                }
            }
        }
        for e in &entries {
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
        if self.index.bytes.saturating_add(cost) > self.cfg.index_budget {
            return Err(CoreError::Full {
                needed: cost,
                free: self.cfg.index_budget.saturating_sub(self.index.bytes),
                capacity: self.cfg.index_budget,
                held: Held::default(),
            });
        }
        let spare = matches!(
            b.state,
            State::Reserved {
                n_entries: None,
                ..
            }
        );
        if let Some(s) = self.holds.sessions.get_mut(&owner.session) {
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
                self.publish(partition, blob, entries);
                return Ok(Committed::Done);
            }
            // On disk: published once the driver reports the file durable.
            if let Some(b) = self.blobs.get_mut(&blob) {
                b.state = State::PendingDisk {
                    partition: partition.to_owned(),
                    entries,
                };
            }
            return Ok(Committed::Pending);
        }
        self.publish(partition, blob, entries);
        Ok(Committed::Done)
    }

    ///
    /// The entries' field names and metadata move into the index (a put of
    /// many values allocates nothing more per value here).
    pub(super) fn publish(&mut self, partition: &str, blob: BlobId, entries: Vec<EntrySpec>) {
        self.commit_seq += 1;
        let seq = self.commit_seq;
        let mut stored = 0;
        if let Some(b) = self.blobs.get_mut(&blob) {
            if let (State::Reserved { .. }, Some(r)) = (&b.state, &b.region) {
                self.reserved_bytes -= r.len;
            }
            stored = b.nbytes;
            b.state = State::Committed { live: 0, pins: 0 };
            b.seq = seq;
        }
        // The claims of the partition, if any, learn of the rows after
        // the index has them: their keys are kept for that.
        let claimed = self.claims_track(partition).then(|| entries.clone());
        let rows = self.index.parts.entry(partition.to_owned()).or_default();
        let mut replaced = Vec::new();
        let mut live = 0u32;
        for e in entries {
            let field_len = e.key.field.len();
            self.index.bytes += entry_cost(&e.key.field, e.meta.len());
            let entry = Entry {
                blob,
                offset: e.offset,
                len: e.len,
                meta: crate::Meta::from(e.meta),
            };
            let old = rows
                .entry(e.key.row)
                .or_default()
                .insert(e.key.field, entry);
            if let Some(old) = &old {
                // entry_cost of the same field name with the old metadata.
                self.index.bytes -= ENTRY_OVERHEAD + field_len as u64 + old.meta.len() as u64;
            }
            match old {
                Some(old) if old.blob == blob => {} // a duplicate key in this blob: last wins
                Some(old) => {
                    replaced.push(old.blob);
                    live += 1;
                }
                None => {
                    live += 1;
                    self.index.entries += 1;
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
        self.earn_compaction(stored);
        if let Some(entries) = claimed {
            self.claims_published(partition, &entries);
        }
        if live == 0 {
            // Nothing of it was published (no entries, or each replaced by
            // a later one of the same blob): it goes now.
            self.maybe_free(blob);
        }
    }

    /// Give up a reservation. With `in_flight` (a transfer may still write
    /// into it) the range is quarantined before reuse. A committed or
    /// unknown blob is left alone: the client aborts after failures whose
    /// outcome it does not know. Only the holding session may abort.
    pub(super) fn abort(
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
            holder.check(owner, || reserved_elsewhere(blob))?;
            self.release_reservation(blob, in_flight, now);
        }
        Ok(())
    }
}

/// Why another session may not use `blob`'s reservation.
fn reserved_elsewhere(blob: BlobId) -> String {
    format!("blob {blob:?} is reserved by another session")
}
