//! Test-only views of the slab ranges the core holds (feature `testing`).

use super::*;

impl UnitCore {
    /// Every blob's slab range, for invariant checks in tests.
    pub fn regions(&self) -> impl Iterator<Item = (BlobId, u64, u64)> + '_ {
        self.blobs.iter().flat_map(|(id, b)| {
            b.region
                .iter()
                .chain(b.promoting.iter())
                .map(move |r| (*id, r.offset, r.len))
        })
    }

    /// Every slab range still allocated but not a live blob's: quarantined
    /// ranges, ranges a finished spill or promotion still reads or writes.
    /// For invariant checks in tests.
    pub fn held_ranges(&self) -> Vec<(u64, u64)> {
        self.quarantined
            .values()
            .chain(self.orphan_promotions.values())
            .chain(self.orphan_writes.values().filter_map(|(_, r)| r.as_ref()))
            .map(|r| (r.offset, r.len))
            .collect()
    }

    /// The slab ranges `session` may touch directly: its reservations and
    /// the blobs it has pinned. For invariant checks in tests.
    pub fn session_ranges(&self, session: SessionId) -> Vec<(u64, u64)> {
        let Some(s) = self.sessions.get(&session) else {
            return Vec::new();
        };
        let reserved = s
            .reservations
            .iter()
            .filter_map(|b| self.blobs.get(b)?.region.as_ref());
        let pinned = s
            .pins
            .iter()
            .filter_map(|p| self.pins.get(p))
            .flat_map(|p| p.blobs.iter())
            .filter_map(|b| self.blobs.get(b)?.region.as_ref());
        reserved.chain(pinned).map(|r| (r.offset, r.len)).collect()
    }

    /// Sessions that hold something although none of their connections is
    /// open (their connections were cut): the core has asked the
    /// driver to watch their processes ([`Action::CheckProcess`]).
    pub fn orphaned_sessions(&self) -> Vec<SessionId> {
        self.sessions
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
