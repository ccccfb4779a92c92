//! The invariants checked after every step (the list in `main.rs`).

use super::*;

impl H {
    pub(crate) fn check(&self) {
        let st: Stats = self.core.stats_at(self.now);
        let cap = self.core.capacity();
        assert_eq!(st.capacity, cap);

        // 1. Disjoint, aligned ranges inside the slab; what is not free is
        //    their sum.
        let regions: Vec<(BlobId, u64, u64)> = self.core.regions().collect();
        let held = self.core.held_ranges();
        let mut all: Vec<(u64, u64)> = regions
            .iter()
            .map(|(_, o, l)| (*o, *l))
            .chain(held.iter().copied())
            .collect();
        all.sort_unstable();
        let mut end = 0u64;
        let mut sum = 0u64;
        for &(off, len) in &all {
            assert!(
                len > 0 && off % ALIGN == 0 && len % ALIGN == 0,
                "range {off}+{len}"
            );
            assert!(
                off.checked_add(len).is_some_and(|e| e <= cap),
                "range {off}+{len} outside the slab"
            );
            assert!(
                off >= end,
                "ranges overlap at {off} (previous ends at {end}): {all:?}"
            );
            end = off + len;
            sum += len;
        }
        assert_eq!(
            st.capacity - st.free_bytes,
            sum,
            "allocated bytes vs the sum of live and held ranges"
        );
        // The free ranges: the gaps, cut at the spare zone's start.
        let split = cap - st.spare_budget;
        let mut largest = 0u64;
        let mut at = 0u64;
        for &(off, len) in all.iter().chain(std::iter::once(&(cap, 0))) {
            if off > at {
                let gap = if at < split && off > split {
                    (split - at).max(off - split)
                } else {
                    off - at
                };
                largest = largest.max(gap);
            }
            at = at.max(off + len);
        }
        assert_eq!(st.largest_free, largest, "the largest free range");
        // `used` is stored data: the live ranges that are neither
        // reservations nor a promotion's or a move's target.
        let targets: u64 = regions
            .iter()
            .filter(|(b, o, l)| {
                self.core.move_under_way() == Some((*b, *o))
                    || self.promos.iter().any(|(pb, po, bytes)| {
                        pb == b && po == o && rounded(bytes.len() as u64) == *l
                    })
            })
            .map(|r| r.2)
            .sum();
        let live: u64 = regions.iter().map(|r| r.2).sum();
        assert_eq!(
            st.used,
            live - st.reserved_bytes - targets,
            "used vs the stored blobs' ranges"
        );
        let quarantine_ok = st.quarantined_bytes <= held.iter().map(|r| r.1).sum::<u64>();
        assert!(quarantine_ok, "quarantined bytes exceed the held ranges");
        let reserved: u64 = self
            .res
            .values()
            .filter(|r| r.at.is_some())
            .map(|r| rounded(r.nbytes))
            .sum();
        assert_eq!(
            st.reserved_bytes, reserved,
            "reserved bytes vs the reservations handed out"
        );
        assert_eq!(
            st.pins,
            self.pins.len() as u64,
            "pins vs the pins handed out"
        );
        let entries: u64 = self
            .keys
            .values()
            .flat_map(|r| r.values())
            .map(|f| f.len() as u64)
            .sum();
        let rows: u64 = self.keys.values().map(|r| r.len() as u64).sum();
        let index: u64 = self
            .keys
            .values()
            .flat_map(|r| r.values())
            .flat_map(|f| f.iter())
            // The core's ENTRY_OVERHEAD (96) per entry, plus name and metadata.
            .map(|(name, v)| 96 + name.len() as u64 + v.meta.len() as u64)
            .sum();
        assert_eq!(
            (st.entries, st.rows, st.index_bytes),
            (entries, rows, index),
            "entries, rows, index bytes"
        );

        // Each shadow reservation in the slab is still its blob's range.
        for (b, r) in &self.res {
            if let Some(pieces) = &r.at {
                assert_eq!(
                    self.core.blob_pieces(*b).as_ref(),
                    Some(pieces),
                    "{b:?}, reserved by {:?} in {pieces:?}, is no longer its allocation",
                    r.session
                );
            }
        }

        // 2. Sessions: what the core says each holds, and fencing.
        let mut orphaned = Vec::new();
        let mut live_ranges = Vec::new();
        for slot in &self.slots {
            let Some(s) = slot.session else { continue };
            let my_res: Vec<&Res> = self.res.values().filter(|r| r.session == s).collect();
            let my_pins: Vec<&PinRec> = self.pins.values().filter(|p| p.session == s).collect();
            let holds = !my_res.is_empty() || !my_pins.is_empty();
            assert!(
                self.core.has_session(s),
                "session {s:?} ({} conns, holds: {holds}) forgotten",
                slot.conns.len()
            );
            if slot.conns.is_empty() && holds {
                orphaned.push(s);
            }
            let ss = st
                .sessions
                .iter()
                .find(|x| x.session == s.0)
                .unwrap_or_else(|| panic!("session {s:?} missing from stats"));
            let o = my_res.iter().filter(|r| r.conn.is_none()).count()
                + my_pins.iter().filter(|p| p.conn.is_none()).count();
            assert_eq!(
                (
                    ss.connections as usize,
                    ss.reservations as usize,
                    ss.pins as usize,
                    ss.orphaned as usize
                ),
                (slot.conns.len(), my_res.len(), my_pins.len(), o),
                "session {s:?}: (connections, reservations, pins, orphaned holds)"
            );
            let ranges = self.core.session_ranges(s);
            for &(off, len) in &ranges {
                assert!(
                    regions.iter().any(|&(_, o, l)| o == off && l == len),
                    "session {s:?} may touch {off}+{len}, which is no live blob's range"
                );
            }
            let covered = |off: u64, len: u64| {
                len == 0 || ranges.iter().any(|&(o, l)| o <= off && off + len <= o + l)
            };
            for r in &my_res {
                for &(off, len) in r.at.iter().flatten() {
                    assert!(
                        covered(off, len),
                        "session {s:?}'s reservation at {off}+{len} not held for it"
                    );
                }
            }
            for p in &my_pins {
                for (place, _) in &p.reads {
                    let parts = match place {
                        Placement::Memory(l) => vec![*l],
                        Placement::Split(parts) => parts.clone(),
                        Placement::Disk { .. } => Vec::new(),
                    };
                    for l in parts {
                        assert!(
                            covered(l.offset, l.len),
                            "session {s:?}'s pinned {l:?} not held for it"
                        );
                    }
                }
            }
            live_ranges.push((s, ranges));
        }
        for (b, r) in &self.res {
            for &(off, len) in r.at.iter().flatten() {
                for (t, ranges) in &live_ranges {
                    if *t == r.session {
                        continue;
                    }
                    for &(o, l) in ranges {
                        assert!(
                            o + l <= off || off + len <= o,
                            "{b:?} reserved by {:?} at {off}+{len} overlaps {o}+{l} that {t:?} may touch",
                            r.session
                        );
                    }
                }
            }
        }
        let mut core_orphans = self.core.orphaned_sessions();
        core_orphans.sort_unstable();
        orphaned.sort_unstable();
        assert_eq!(core_orphans, orphaned, "orphaned sessions");
        // The driver was asked to watch each one's process.
        let watched: Vec<SessionId> = self.watched.iter().copied().collect();
        assert_eq!(watched, orphaned, "sessions whose process is watched");

        // The core needs waking exactly while a range is quarantined (no
        // peer here is one-sided, so no fenced hold waits).
        assert_eq!(
            self.core.poll_timeout().is_some(),
            st.quarantined_bytes > 0,
            "poll_timeout {:?} with {} bytes quarantined",
            self.core.poll_timeout(),
            st.quarantined_bytes
        );

        // 3. Pinned bytes never change until unpinned.
        for (id, p) in &self.pins {
            for (place, bytes) in &p.reads {
                assert!(
                    &self.read_place(place) == bytes,
                    "bytes at {place:?} pinned by {id:?} of {:?} changed",
                    p.session
                );
            }
        }
    }
}
