//! The disk tier: spills, blobs reserved on disk, promotions.

use super::*;

/// The disk tier's use.
#[derive(Default)]
pub(super) struct Tier {
    /// Disk bytes held: files written or being written.
    pub(super) disk_used: u64,
    /// An input came since spills were last worked out.
    pub(super) spill_dirty: bool,
}

impl UnitCore {
    /// Forget a blob reserved on disk (never published): its file goes.
    /// The driver must not report a write for it afterwards (the unit
    /// server hands a put's file to its flusher only once commit answered
    /// Pending, and a blob in that state is never forgotten here).
    pub(super) fn drop_disk_reservation(&mut self, blob: BlobId) {
        if let Some(b) = self.blobs.remove(&blob) {
            self.disk_reservation_gone(blob, b.nbytes);
        }
    }

    /// The bookkeeping of [`UnitCore::drop_disk_reservation`] once the
    /// blob's record is removed.
    pub(super) fn disk_reservation_gone(&mut self, blob: BlobId, nbytes: u64) {
        self.tier.disk_used -= nbytes;
        self.actions.push_back(Action::DeleteFile(blob));
    }

    /// Blobs to copy to disk now: past the high watermark, committed blobs
    /// in memory and not pinned, oldest first, until use would fall below
    /// the low watermark (or the disk tier is full). Each is marked as being
    /// written; its memory stays until [`input::DiskWritten`].
    pub(super) fn spill_jobs(&mut self) -> Vec<SpillJob> {
        if !self.disk_on() {
            return Vec::new();
        }
        let cap = self.slab.capacity() as f64;
        let used = self.slab.allocated();
        if (used as f64) <= self.cfg.high_watermark * cap {
            return Vec::new();
        }
        let target = (self.cfg.low_watermark * cap) as u64;
        // Bytes whose spill is under way count as freed already.
        let in_flight: u64 = self
            .blobs
            .values()
            .filter(|b| b.disk == Disk::Writing)
            .filter_map(|b| b.region.as_ref().map(|r| r.len))
            .sum();
        let mut candidates: Vec<(u64, BlobId)> = self
            .blobs
            .iter()
            .filter(|(_, b)| {
                matches!(b.state, State::Committed { pins: 0, .. })
                    && b.region.is_some()
                    && b.moving.is_none()
            })
            .map(|(id, b)| (b.seq, *id))
            .collect();
        candidates.sort_unstable();
        let mut freed = in_flight;
        let mut jobs = Vec::new();
        for (_, id) in candidates {
            if used - freed <= target {
                break;
            }
            let Some(b) = self.blobs.get_mut(&id) else {
                continue;
            };
            let Some(r) = &b.region else { continue };
            match b.disk {
                // Already on disk (promoted earlier): drop the memory copy.
                Disk::Durable => {
                    if let Some(r) = b.region.take() {
                        freed += r.len;
                        self.release(r, Release::Spilled);
                    }
                }
                Disk::Writing => {}
                Disk::None => {
                    if b.nbytes > self.cfg.disk_capacity.saturating_sub(self.tier.disk_used) {
                        continue;
                    }
                    b.disk = Disk::Writing;
                    self.tier.disk_used += b.nbytes;
                    freed += r.len;
                    jobs.push(SpillJob {
                        blob: id,
                        pieces: r.pieces().to_vec(),
                        nbytes: b.nbytes,
                    });
                }
            }
        }
        jobs
    }

    /// Whether spill jobs ([`Action::Spill`]) would find work: the disk tier is
    /// on and the slab is past its high watermark.
    pub(super) fn needs_spill(&self) -> bool {
        self.disk_on()
            && self.slab.allocated() as f64 > self.cfg.high_watermark * self.slab.capacity() as f64
    }

    /// A blob's size in bytes.
    pub fn blob_size(&self, blob: BlobId) -> Option<u64> {
        self.blobs.get(&blob).map(|b| b.nbytes)
    }

    /// The driver finished writing `blob`'s file (`ok`: complete and
    /// synced). For a spill, the memory copy is freed (once unpinned); for a
    /// blob reserved on disk, its entries are published.
    pub(super) fn disk_written(&mut self, blob: BlobId, ok: bool) {
        if let Some((nbytes, region)) = self.in_flight.take(blob, |o| o.write.take()) {
            self.tier.disk_used -= nbytes;
            if let Some(r) = region {
                self.release(r, Release::OrphanWrite);
            }
            self.actions.push_back(Action::DeleteFile(blob));
            return;
        }
        let Some(b) = self.blobs.get_mut(&blob) else {
            return;
        };
        if b.disk != Disk::Writing {
            return;
        }
        let unpublished = matches!(b.state, State::PendingDisk { .. } | State::Reserved { .. });
        if !ok {
            if unpublished {
                // A put whose bytes did not reach the disk: it never existed,
                // and its session (if it was still reserved) holds it no more.
                let holder = match &b.state {
                    State::Reserved { holder, .. } => Some(holder.session),
                    _ => None,
                };
                if let Some(s) = holder.and_then(|h| self.holds.sessions.get_mut(&h)) {
                    s.reservations.remove(&blob);
                }
                self.drop_disk_reservation(blob);
                if let Some(h) = holder {
                    self.maybe_forget_session(h);
                }
            } else {
                b.disk = Disk::None;
                self.tier.disk_used -= b.nbytes;
                self.actions.push_back(Action::DeleteFile(blob));
            }
            return;
        }
        b.disk = Disk::Durable;
        if matches!(b.state, State::PendingDisk { .. }) {
            if let State::PendingDisk { partition, entries } =
                std::mem::replace(&mut b.state, State::Committed { live: 0, pins: 0 })
            {
                self.publish(&partition, blob, entries);
            }
            return;
        }
        if let State::Committed { pins: 0, .. } = b.state {
            if let Some(r) = b.region.take() {
                self.release(r, Release::Spilled);
            }
        }
    }

    /// Start bringing a spilled, pinned-by-the-caller blob back into the
    /// slab: reserves its range (if the slab has room below the high
    /// watermark) for the driver to fill from the file. `None`: read it
    /// from disk instead.
    pub(super) fn promote_begin(&mut self, blob: BlobId) -> Option<u64> {
        let cap = self.slab.capacity() as f64;
        let b = self.blobs.get(&blob)?;
        if b.region.is_some()
            || b.promoting.is_some()
            || b.disk != Disk::Durable
            || !matches!(b.state, State::Committed { .. })
        {
            return None;
        }
        let len = SlabAllocator::rounded(b.nbytes);
        if (self.slab.allocated() + len) as f64 > self.cfg.high_watermark * cap {
            return None;
        }
        // One range only: a promoted blob is read in place, so a slab cut
        // into pieces serves it from disk instead.
        let r = self.slab.allocate(b.nbytes)?;
        if !r.is_contiguous() {
            self.release(r, Release::Promotion);
            return None;
        }
        let offset = r.start();
        match self.blobs.get_mut(&blob) {
            Some(b) => b.promoting = Some(r),
            None => self.release(r, Release::Promotion),
        }
        Some(offset)
    }

    /// The driver filled (or, `ok == false`, failed to fill) the range from
    /// [`input::Promote`].
    pub(super) fn promote_done(&mut self, blob: BlobId, ok: bool) {
        if let Some(r) = self.in_flight.take(blob, |o| o.promotion.take()) {
            self.release(r, Release::Promotion);
            return;
        }
        let Some(b) = self.blobs.get_mut(&blob) else {
            return;
        };
        let Some(r) = b.promoting.take() else { return };
        if ok && b.region.is_none() {
            b.region = Some(r);
        } else {
            self.release(r, Release::Promotion);
        }
    }
}
