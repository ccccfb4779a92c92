//! Full or Busy: when a put finds no room, whether what holds the memory
//! ends by itself (Busy: ask again shortly) or only when someone lets go
//! (Full, with what holds it).
//!
//! Ends by itself: reservations of puts under way (committed or aborted),
//! quarantined ranges, spills being written, cleared or replaced values
//! that only reads in flight or a checkpoint pin, a compaction move.
//! Does not: views of cleared or replaced values (a view lasts as long as
//! its holder wants), spares (their holders may be idle), live values.

use super::*;

impl UnitCore {
    /// The refusal of a put of `nbytes` by `owner` that no free range
    /// holds (the memory, however cut, is short): Busy when the holds that
    /// end by themselves will free enough, else Full with what holds the
    /// memory.
    pub(super) fn short_of_memory(&self, owner: Owner, nbytes: u64) -> CoreError {
        let capacity = self.slab.capacity();
        let free = capacity - self.slab.allocated();
        let len = SlabAllocator::rounded(nbytes);
        let (_, spares) = self.spares();
        let reservations = self.reserved_bytes - spares;
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
        let reclaimable = reservations + self.quarantined.bytes + spilling + reads + compaction;
        if len <= capacity && free + reclaimable >= len && reclaimable > 0 {
            return CoreError::Busy {
                needed: nbytes,
                reclaimable,
            };
        }
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
