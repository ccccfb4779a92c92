//! Compaction: moving committed blobs that nobody can touch, to gather
//! scattered free memory into ranges.
//!
//! A put never waits for compaction (it takes several free ranges when no
//! single one holds it); compaction keeps the free memory in few, large
//! ranges so that puts stay in one piece and values in one range (which
//! `get_view` can lend in place).
//!
//! **The fencing rule.** Only a blob nobody can touch moves: committed, in
//! memory, not pinned (no reader, no checkpoint, no tcp read in flight), not
//! reserved (no writer), not being spilled, promoted or moved already. A
//! move is one [`Action::Move`]: the driver copies the blob's bytes into a
//! range the core reserved for it, while the old range stays allocated, and
//! reports [`input::Moved`]. Only then, and only if the blob is still
//! committed and unpinned, does the blob switch to the new range (one step:
//! entries name the blob, not the slab) and the old range go back. A reader
//! that pinned the blob while it was copied read the old range, which the
//! move then leaves in place (the new one goes back instead).

use super::*;

/// A blob the driver should copy to another range of the slab
/// ([`Action::Move`]), then report with [`input::Moved`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoveJob {
    pub blob: BlobId,
    /// (slab offset, bytes) of each piece it is in now, in order.
    pub from: Vec<(u64, u64)>,
    /// Slab offset of the one range it moves to.
    pub to: u64,
    /// Bytes to copy (from the start of `from`, to `to`).
    pub nbytes: u64,
}

/// Candidates looked at per step, at most (the highest first).
const CANDIDATES: usize = 256;

/// After a look for a blob to move found none, the next look waits this
/// long (each scans every blob).
pub(super) const RESCAN: Duration = Duration::from_millis(20);

/// Compaction's state.
#[derive(Default)]
pub(super) struct Compactor {
    /// The blob being moved, if any (one move at a time).
    pub(super) moving: Option<BlobId>,
    /// Free memory may have become scattered since compaction last looked.
    pub(super) dirty: bool,
    /// The latest look for a blob to move that found none (such looks
    /// scan every blob: at most one per [`RESCAN`]).
    pub(super) fruitless_scan: Option<Time>,
    /// A put had to be stored in pieces: compaction runs until the largest
    /// free range holds this many bytes (or nothing more can move).
    pub(super) goal: u64,
    /// Bytes compaction may still copy ([`CoreConfig::compact_ratio`]).
    pub(super) credit: u64,
    /// Moves and their bytes since start.
    pub(super) moves: u64,
    pub(super) bytes: u64,
}

impl UnitCore {
    /// Whether compaction has work: the data zone's free memory is
    /// scattered (enough of it, its largest range under
    /// [`CoreConfig::compact_below`] of it), or the spare zone is three
    /// quarters full (committed spares are data: they move down to the
    /// data zone, so that spares keep their room).
    pub(super) fn scattered(&self) -> bool {
        let free = self.slab.data_free();
        let largest = self.slab.largest_data_free();
        let spare_zone_full = self.slab.spare_free() < self.slab.spare_budget() / 4;
        free >= self.cfg.compact_min_free
            && (spare_zone_full
                || largest < self.compactor.goal
                || (largest as f64) < self.cfg.compact_below * free as f64)
    }

    /// A put was stored in `len` bytes of pieces: no free range held it.
    /// Compaction works towards a range that would have.
    pub(super) fn wants_range(&mut self, len: u64) {
        self.compactor.goal = self.compactor.goal.max(len);
        self.compactor.dirty = true;
    }

    /// `nbytes` were stored: compaction earns its share of them.
    pub(super) fn earn_compaction(&mut self, nbytes: u64) {
        let earned = (nbytes as f64 * self.cfg.compact_ratio) as u64;
        let cap = self.slab.capacity() / 4;
        self.compactor.credit = self.compactor.credit.saturating_add(earned).min(cap);
    }

    /// Whether nobody can touch `b`: it may move.
    fn movable(b: &Blob, max: u64) -> bool {
        matches!(b.state, State::Committed { pins: 0, live } if live > 0)
            && b.disk != Disk::Writing
            && b.promoting.is_none()
            && b.moving.is_none()
            && b.region.as_ref().is_some_and(|r| r.len <= max)
    }

    /// The next move, when free memory is scattered and a blob can move to
    /// a lower range (or, cut into pieces itself, into one range). One
    /// move at a time: [`UnitCore::poll_action`] asks only while
    /// [`Compactor::dirty`] and no move is under way.
    pub(super) fn next_move(&mut self) -> Option<MoveJob> {
        if !self.scattered() {
            self.compactor.dirty = false;
            self.compactor.goal = 0;
            return None;
        }
        if self
            .compactor
            .fruitless_scan
            .is_some_and(|t| self.last_input.saturating_sub(t) < RESCAN)
        {
            // Stays dirty: a later input looks again.
            return None;
        }
        self.compactor.dirty = false;
        // Within its budget: what storing data has earned.
        let max = self.cfg.compact_max_move.min(self.compactor.credit);
        // Blobs in pieces first, then the highest: moving them down
        // leaves the top free in one range.
        let mut candidates: Vec<(bool, u64, BlobId)> = self
            .blobs
            .iter()
            .filter(|(_, b)| Self::movable(b, max))
            .filter_map(|(id, b)| {
                let r = b.region.as_ref()?;
                Some((!r.is_contiguous(), r.start(), *id))
            })
            .collect();
        candidates.sort_unstable_by(|a, b| b.cmp(a));
        // With a disk tier, a move never takes the slab past its high
        // watermark (its target is held beside the blob until it reports):
        // compaction must not make the unit spill.
        let room = if self.disk_on() {
            let high = (self.cfg.high_watermark * self.slab.capacity() as f64) as u64;
            high.saturating_sub(self.slab.allocated())
        } else {
            u64::MAX
        };
        for (split, start, id) in candidates.into_iter().take(CANDIDATES) {
            let nbytes = self.blobs.get(&id)?.nbytes;
            if SlabAllocator::rounded(nbytes) > room {
                continue;
            }
            let to = if split {
                match self.slab.allocate(nbytes) {
                    Some(r) if r.is_contiguous() => Some(r),
                    Some(r) => {
                        self.release(r, Release::MoveAbandoned);
                        None
                    }
                    None => None,
                }
            } else {
                self.slab.allocate_below(nbytes, start)
            };
            let Some(to) = to else { continue };
            let b = self.blobs.get_mut(&id)?;
            let job = MoveJob {
                blob: id,
                from: b.region.as_ref().map(|r| r.pieces().to_vec())?,
                to: to.start(),
                nbytes,
            };
            b.moving = Some(to);
            self.compactor.moving = Some(id);
            self.compactor.fruitless_scan = None;
            return Some(job);
        }
        // Nothing more can move: the goal is out of reach for now.
        self.compactor.fruitless_scan = Some(self.last_input);
        self.compactor.goal = 0;
        None
    }

    /// The driver copied (or, `ok == false`, failed to copy) the blob of
    /// a [`MoveJob`]: switch the blob to its new range if nobody touched it
    /// meanwhile, else give the new range back.
    pub(super) fn moved(&mut self, blob: BlobId, ok: bool) {
        if self.compactor.moving == Some(blob) {
            self.compactor.moving = None;
        }
        self.compactor.dirty = true;
        if let Some((old, new)) = self.in_flight.take(blob, |o| o.moving.take()) {
            if let Some(old) = old {
                self.release(old, Release::BlobFreed);
            }
            self.release(new, Release::MoveAbandoned);
            return;
        }
        let Some(b) = self.blobs.get_mut(&blob) else {
            return;
        };
        let Some(to) = b.moving.take() else { return };
        let untouched = ok
            && matches!(b.state, State::Committed { pins: 0, .. })
            && b.disk != Disk::Writing
            && b.region.is_some();
        if !untouched {
            self.release(to, Release::MoveAbandoned);
            return;
        }
        let nbytes = b.nbytes;
        if let Some(old) = b.region.replace(to) {
            self.compactor.moves += 1;
            self.compactor.bytes += nbytes;
            self.compactor.credit = self.compactor.credit.saturating_sub(nbytes);
            self.release(old, Release::Moved);
        }
    }
}
