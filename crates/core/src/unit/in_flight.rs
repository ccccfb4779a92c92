//! The driver's work still under way on blobs freed meanwhile: a file
//! being written, a promotion's range being filled, a move's copy. What it
//! reads or writes stays allocated (and a file stays counted) until it
//! reports back; one map holds all three, by blob.

use std::collections::HashMap;

use crate::slab::Region;
use crate::BlobId;

/// The driver's work on one freed blob that has not reported back.
#[derive(Debug, Default)]
pub(super) struct Orphan {
    /// Its file being written ([`super::input::DiskWritten`]): the file's
    /// bytes, and the slab range the writer reads (a spill's), if any.
    pub(super) write: Option<(u64, Option<Region>)>,
    /// The range a promotion fills ([`super::input::Promoted`]).
    pub(super) promotion: Option<Region>,
    /// A move's old range (if the blob still had one) and its new one
    /// ([`super::input::Moved`]).
    pub(super) moving: Option<(Option<Region>, Region)>,
}

impl Orphan {
    fn is_empty(&self) -> bool {
        self.write.is_none() && self.promotion.is_none() && self.moving.is_none()
    }
}

/// Freed blobs the driver still works on.
#[derive(Debug, Default)]
pub(super) struct InFlight(HashMap<BlobId, Orphan>);

impl InFlight {
    /// `blob` was freed while `work` was under way: keep each part until it
    /// reports back (a part replaces an earlier one of the same kind).
    pub(super) fn orphan(&mut self, blob: BlobId, work: Orphan) {
        if work.is_empty() {
            return;
        }
        let o = self.0.entry(blob).or_default();
        if work.write.is_some() {
            o.write = work.write;
        }
        if work.promotion.is_some() {
            o.promotion = work.promotion;
        }
        if work.moving.is_some() {
            o.moving = work.moving;
        }
    }

    /// The part `which` of `blob`'s orphaned work, which has reported back.
    pub(super) fn take<T>(
        &mut self,
        blob: BlobId,
        which: impl FnOnce(&mut Orphan) -> Option<T>,
    ) -> Option<T> {
        let o = self.0.get_mut(&blob)?;
        let part = which(o);
        if o.is_empty() {
            self.0.remove(&blob);
        }
        part
    }

    /// Slab bytes of moves whose blob was freed meanwhile (the old range
    /// and the new): given back when each move reports.
    pub(super) fn moving_bytes(&self) -> u64 {
        self.0
            .values()
            .filter_map(|o| o.moving.as_ref())
            .map(|(old, new)| old.as_ref().map_or(0, |r| r.len) + new.len)
            .sum()
    }

    /// Every slab range orphaned work still reads or writes.
    #[cfg(any(test, feature = "testing"))]
    pub(super) fn ranges(&self) -> impl Iterator<Item = &Region> {
        self.0.values().flat_map(|o| {
            let write = o.write.as_ref().and_then(|(_, r)| r.as_ref());
            let (old, new) = match &o.moving {
                Some((old, new)) => (old.as_ref(), Some(new)),
                None => (None, None),
            };
            o.promotion.iter().chain(write).chain(old).chain(new)
        })
    }
}
