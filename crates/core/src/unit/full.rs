//! Full or Busy: when a put finds no room, whether what holds the memory
//! ends by itself (Busy: ask again shortly) or only when someone lets go
//! (Full, with what holds it).
//!
//! Ends by itself: reservations of puts under way (committed or aborted),
//! quarantined ranges, spills being written, cleared or replaced values
//! that only reads in flight or a checkpoint pin, a compaction move.
//! Does not: views of cleared or replaced values (a view lasts as long as
//! its holder wants), spares (their holders may be idle), live values.
//!
//! Reservations are the one hold whose end mostly gives nothing back: a
//! put under way that commits keeps its memory (only an abort, or a commit
//! that replaces values nothing else pins, frees any). Counted as they
//! come, they kept a put Busy for as long as some other put was under way
//! — on a unit that several writers keep nearly full, almost always (a
//! put asked again and again until its deadline, issue 37). So a put is
//! Busy only for the reservations that existed when it was first refused:
//! the unit remembers each put it answered Busy for memory by its blob id
//! (which the client's retry repeats), with the time of that first
//! refusal ([`FirstRefusals`]), and a reservation taken after it counts
//! as used. A put then waits at most until the puts that were under way
//! at its first refusal have committed or aborted (and the other holds
//! above have ended), and is answered Full, or goes in, after that. The
//! other holds are counted whenever they began: each one's end does give
//! memory back. The first refusal is forgotten once the put is reserved
//! or answered Full (a later refusal starts afresh), and past the
//! [`REMEMBERED_REFUSALS`] latest ones.

use super::*;

/// How many first refusals ([`FirstRefusals`]) a unit remembers: puts
/// answered Busy for memory and not asked again yet (or given up by their
/// clients). Past it, the oldest is forgotten: that put's next refusal
/// counts every reservation of its time again.
pub(super) const REMEMBERED_REFUSALS: usize = 4096;

/// Puts answered Busy for memory, by blob id, with the time of their
/// first refusal (see the module docs). At most [`REMEMBERED_REFUSALS`].
#[derive(Default)]
pub(super) struct FirstRefusals {
    at: Map<BlobId, Time>,
    /// In the order they were first refused; an id may linger here after
    /// it left `at` (its put went in or was answered Full): it only takes
    /// a place until it is popped.
    order: VecDeque<(BlobId, Time)>,
}

impl FirstRefusals {
    /// `blob`'s put was answered Busy at `now`: remembered, unless an
    /// earlier refusal is.
    fn remember(&mut self, blob: BlobId, now: Time) {
        if self.at.contains_key(&blob) {
            return;
        }
        while self.order.len() >= REMEMBERED_REFUSALS {
            if let Some((old, t)) = self.order.pop_front() {
                if self.at.get(&old) == Some(&t) {
                    self.at.remove(&old);
                }
            }
        }
        self.at.insert(blob, now);
        self.order.push_back((blob, now));
    }

    /// `blob`'s put was reserved or answered Full: its next refusal, if
    /// any, starts afresh.
    pub(super) fn forget(&mut self, blob: BlobId) {
        self.at.remove(&blob);
    }

    /// Puts remembered.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.at.len()
    }
}

impl UnitCore {
    /// The refusal of a put of `nbytes` (blob `blob`) by `owner` that no
    /// free range holds (the memory, however cut, is short): Busy when the
    /// holds that end by themselves will free enough (of reservations,
    /// those taken by the put's first refusal), else Full with what holds
    /// the memory.
    pub(super) fn short_of_memory(
        &mut self,
        owner: Owner,
        blob: BlobId,
        nbytes: u64,
        now: Time,
    ) -> CoreError {
        let capacity = self.slab.capacity();
        let free = capacity - self.slab.allocated();
        let len = SlabAllocator::rounded(nbytes);
        let (_, spares) = self.spares();
        let reservations = self.reserved_bytes - spares;
        // Reservations the put may wait for: those of puts under way at
        // its first refusal (spares are not waited for).
        let first = self.refusals.at.get(&blob).copied().unwrap_or(now);
        let waited: u64 = self
            .blobs
            .values()
            .filter_map(|b| match (&b.state, &b.region) {
                (
                    State::Reserved {
                        holder,
                        n_entries: Some(_),
                    },
                    Some(r),
                ) if holder.since <= first => Some(r.len),
                _ => None,
            })
            .sum();
        // Memory that spills under way will give back.
        let spilling: u64 = self
            .blobs
            .values()
            .filter(|b| b.disk == Disk::Writing)
            .filter_map(|b| b.region.as_ref().map(|r| r.len))
            .sum();
        let compaction = self
            .blobs
            .values()
            .filter_map(|b| b.moving.as_ref().map(|r| r.len))
            .sum::<u64>()
            + self.in_flight.moving_bytes();
        let (views, own_views, reads) = self.cleared_pinned(owner.session);
        let reclaimable = waited + self.quarantined.bytes + spilling + reads + compaction;
        if len <= capacity && free + reclaimable >= len && reclaimable > 0 {
            self.refusals.remember(blob, now);
            return CoreError::Busy {
                needed: nbytes,
                reclaimable,
            };
        }
        self.refusals.forget(blob);
        CoreError::Full {
            needed: nbytes,
            free,
            capacity,
            held: Held {
                views,
                own_views,
                reservations,
                spares,
                compaction,
            },
        }
    }

    /// Slab bytes of committed blobs no entry names any more (cleared or
    /// replaced) that only pins keep (those being spilled are counted as
    /// spilling): (held by views, of those by `session`'s own views, held
    /// by reads and checkpoints alone).
    fn cleared_pinned(&self, session: SessionId) -> (u64, u64, u64) {
        let cleared: HashMap<BlobId, u64> = self
            .blobs
            .iter()
            .filter(|(_, b)| matches!(b.state, State::Committed { live: 0, .. }))
            .filter(|(_, b)| b.disk != Disk::Writing)
            .filter_map(|(id, b)| b.region.as_ref().map(|r| (*id, r.len)))
            .collect();
        if cleared.is_empty() {
            return (0, 0, 0);
        }
        // Each cleared blob a view pins, and whether the asking session's.
        let mut viewed: HashMap<BlobId, bool> = HashMap::new();
        for pin in self.holds.pins.values() {
            if !pin.view || pin.holder.session == Owner::UNIT.session {
                continue;
            }
            let own = pin.holder.session == session;
            for id in pin.blobs.iter().filter(|id| cleared.contains_key(id)) {
                *viewed.entry(*id).or_default() |= own;
            }
        }
        let (mut views, mut own_views, mut reads) = (0, 0, 0);
        for (id, len) in &cleared {
            match viewed.get(id) {
                Some(own) => {
                    views += len;
                    if *own {
                        own_views += len;
                    }
                }
                None => reads += len,
            }
        }
        (views, own_views, reads)
    }
}
