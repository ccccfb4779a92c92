//! When a blob's slab range is given back, and the one place it is:
//! [`UnitCore::release`]. Every range leaves through it — a reservation
//! given up, a quarantine ended, a freed or spilled blob, a spill or
//! promotion that reports back after its blob went — and it takes the
//! range by value: a [`Region`] is neither `Copy` nor `Clone`, so a range
//! released twice does not compile.

use super::*;

/// Why a slab range is given back (see [`UnitCore::release`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Release {
    /// A reservation given up while nothing can still write into it
    /// (abort, its connection's or process's end, an unneeded spare).
    Reservation,
    /// Its quarantine ended: a cut transfer can no longer land.
    QuarantineEnded,
    /// A committed blob that no entry and no pin refers to any more.
    BlobFreed,
    /// A blob whose bytes are durable on disk: its memory copy goes.
    Spilled,
    /// A spill whose blob was freed meanwhile finished reading the range.
    OrphanWrite,
    /// A promotion failed or was not needed, or its blob was freed
    /// while the driver copied into the range, which it no longer does.
    Promotion,
    /// Compaction moved the blob: its old range, which nobody could touch
    /// (it was unpinned when the copy ended) and the driver read last.
    Moved,
    /// A move that was not needed or not taken (its blob was pinned,
    /// freed or spilled meanwhile): the range it would have moved to.
    MoveAbandoned,
}

/// Ranges waiting out a quarantine before reuse.
#[derive(Default)]
pub(super) struct Quarantine {
    /// By the time they may be reused.
    pub(super) ranges: BTreeMap<(Time, u64), Region>,
    pub(super) seq: u64,
    pub(super) bytes: u64,
}

/// Ids of committed blobs freed lately (at most [`REMEMBERED_COMMITS`]),
/// oldest first: a retried alloc or commit of one answers "already
/// committed".
#[derive(Default)]
pub(super) struct FreedCommits {
    pub(super) order: VecDeque<BlobId>,
    pub(super) set: HashSet<BlobId>,
}

impl UnitCore {
    /// Give `region` back to the allocator: the one place a slab range
    /// becomes reusable.
    pub(super) fn release(&mut self, region: Region, why: Release) {
        if why == Release::QuarantineEnded {
            self.quarantined.bytes -= region.len;
        }
        self.slab.free(region);
        self.compactor.dirty = true;
    }

    /// Keep `r` unusable until the quarantine has passed (a transfer the
    /// unit cut may still land in it); [`UnitCore::expire`] releases it.
    pub(super) fn quarantine(&mut self, r: Region, now: Time) {
        let until = now + self.cfg.quarantine;
        self.quarantined.bytes += r.len;
        self.quarantined.seq += 1;
        self.quarantined
            .ranges
            .insert((until, self.quarantined.seq), r);
    }

    /// Free a committed blob that no entry and no pin refers to any more.
    pub(super) fn maybe_free(&mut self, blob: BlobId) {
        if let Some(Blob {
            state: State::Committed { live: 0, pins: 0 },
            ..
        }) = self.blobs.get(&blob)
        {
            if let Some(b) = self.blobs.remove(&blob) {
                // A spill still reads the range: it is released when the
                // write reports back (input::DiskWritten).
                let mut region = b.region;
                let mut work = Orphan::default();
                if let Some(to) = b.moving {
                    // A move still reads the old range and writes the new:
                    // both are released when it reports back
                    // (input::Moved). (A blob being spilled never moves.)
                    work.moving = Some((region.take(), to));
                } else if b.disk != Disk::Writing {
                    if let Some(r) = region.take() {
                        self.release(r, Release::BlobFreed);
                    }
                }
                // The driver may still be copying into a promotion's
                // range: it is released when it reports back
                // (input::Promoted).
                work.promotion = b.promoting;
                match b.disk {
                    Disk::None => {}
                    Disk::Durable => {
                        self.tier.disk_used -= b.nbytes;
                        self.actions.push_back(Action::DeleteFile(blob));
                    }
                    Disk::Writing => work.write = Some((b.nbytes, region)),
                }
                self.in_flight.orphan(blob, work);
                self.remember_commit(blob);
            }
        }
    }

    /// A spilled blob whose last pin went: its memory can go now.
    pub(super) fn maybe_release_memory(&mut self, blob: BlobId) {
        let past_low =
            self.slab.allocated() as f64 > self.cfg.low_watermark * self.slab.capacity() as f64;
        let Some(b) = self.blobs.get_mut(&blob) else {
            return;
        };
        if let (State::Committed { pins: 0, .. }, Disk::Durable, true, None) =
            (&b.state, b.disk, past_low, &b.moving)
        {
            if let Some(r) = b.region.take() {
                self.release(r, Release::Spilled);
            }
        }
    }

    pub(super) fn remember_commit(&mut self, blob: BlobId) {
        if self.freed.order.len() >= REMEMBERED_COMMITS {
            if let Some(old) = self.freed.order.pop_front() {
                self.freed.set.remove(&old);
            }
        }
        self.freed.order.push_back(blob);
        self.freed.set.insert(blob);
    }

    /// Release quarantined ranges whose quarantine ended by `now`, and
    /// the holds of fenced one-sided peers whose quarantine ended
    /// ([`input::Fenced`]); answer waiting claims whose `wait_until` came
    /// and give back the rows of expired claim leases (`claims.rs`; not
    /// holds). Nothing else is ever reclaimed by time. Returns the holds
    /// released.
    pub(super) fn expire(&mut self, now: Time) -> u64 {
        while let Some(entry) = self.quarantined.ranges.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let r = entry.remove();
            self.release(r, Release::QuarantineEnded);
        }
        self.claims_expire(now);
        let mut released = 0;
        while let Some((&(at, seq), &(session, hold))) = self.holds.fenced.first_key_value() {
            if at > now {
                break;
            }
            self.holds.fenced.remove(&(at, seq));
            if self.release_fenced(session, hold, at, now) {
                released += 1;
                self.maybe_forget_session(session);
            }
        }
        released
    }

    /// When [`UnitCore::expire`] next has something to do.
    pub(super) fn next_expiry(&self) -> Option<Time> {
        let q = self.quarantined.ranges.keys().next().map(|(t, _)| *t);
        let f = self
            .holds
            .fenced
            .iter()
            .find(|((at, _), (s, h))| self.fenced_until(*s, *h, *at))
            .map(|((at, _), _)| *at);
        match (q, f) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}
