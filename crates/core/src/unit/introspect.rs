//! Test-only views of the slab ranges the core holds (feature `testing`).

use super::*;

impl UnitCore {
    /// Every piece of every blob's slab ranges (its region, a promotion's
    /// or a move's target), for invariant checks in tests.
    pub fn regions(&self) -> impl Iterator<Item = (BlobId, u64, u64)> + '_ {
        self.blobs.iter().flat_map(|(id, b)| {
            b.region
                .iter()
                .chain(b.promoting.iter())
                .chain(b.moving.iter())
                .flat_map(|r| r.pieces().iter())
                .map(move |&(o, l)| (*id, o, l))
        })
    }

    /// (slab offset, bytes) of each piece of `blob`'s region, if in memory.
    pub fn blob_pieces(&self, blob: BlobId) -> Option<Vec<(u64, u64)>> {
        Some(self.blobs.get(&blob)?.region.as_ref()?.pieces().to_vec())
    }

    /// The blob compaction is moving and the range it moves to, if any.
    pub fn move_under_way(&self) -> Option<(BlobId, u64)> {
        let id = self.compactor.moving?;
        let to = self
            .blobs
            .get(&id)
            .and_then(|b| b.moving.as_ref())
            .map(|r| r.start());
        Some((id, to.unwrap_or(u64::MAX)))
    }

    /// Every slab range still allocated but not a live blob's: quarantined
    /// ranges, ranges a finished spill or promotion still reads or writes.
    /// For invariant checks in tests.
    pub fn held_ranges(&self) -> Vec<(u64, u64)> {
        self.quarantined
            .ranges
            .values()
            .chain(self.in_flight.ranges())
            .flat_map(|r| r.pieces().iter().copied())
            .collect()
    }

    /// The slab ranges `session` may touch directly: its reservations and
    /// the blobs it has pinned. For invariant checks in tests.
    pub fn session_ranges(&self, session: SessionId) -> Vec<(u64, u64)> {
        let Some(s) = self.holds.sessions.get(&session) else {
            return Vec::new();
        };
        let reserved = s
            .reservations
            .iter()
            .filter_map(|b| self.blobs.get(b)?.region.as_ref());
        let pinned = s
            .pins
            .iter()
            .filter_map(|p| self.holds.pins.get(p))
            .flat_map(|p| p.blobs.iter())
            .filter_map(|b| self.blobs.get(b)?.region.as_ref());
        reserved
            .chain(pinned)
            .flat_map(|r| r.pieces().iter().copied())
            .collect()
    }

    /// Sessions that hold something although none of their connections is
    /// open (their connections were cut): the core has asked the
    /// driver to watch their processes ([`Action::CheckProcess`]).
    pub fn orphaned_sessions(&self) -> Vec<SessionId> {
        self.holds
            .sessions
            .iter()
            .filter(|(id, s)| {
                **id != Owner::UNIT.session
                    && s.conns.is_empty()
                    && (!s.reservations.is_empty() || !s.pins.is_empty())
            })
            .map(|(id, _)| *id)
            .collect()
    }
}
