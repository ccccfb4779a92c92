//! A checkpoint of some homes' rows ([`Request::CheckpointHomes`]): with
//! copies, every row is on several units, and each unit writes only the
//! rows whose home ([`stowage_wire::home_unit`]) it was asked for, so that
//! a checkpoint of the plane holds each row once.
//!
//! A blob may hold rows of several homes (a put sends one blob per unit,
//! with the rows of every set that unit belongs to). A blob whose entries
//! are all kept is written whole; one with only some kept is written
//! *compacted*: only the byte ranges of the kept entries, each range at
//! the same offset modulo [`ALIGN`] as before (zeros between), and the
//! kept entries' offsets moved to match. So the bytes written are (up to
//! the padding) one copy's.
//!
//! [`Request::CheckpointHomes`]: stowage_wire::Request::CheckpointHomes

use std::collections::{HashMap, HashSet};

use stowage_core::{BlobId, Snapshot, SnapshotEntry};

/// A compacted blob keeps each range's offset modulo this.
pub(crate) const ALIGN: u64 = 64;

/// Which homes' rows a checkpoint keeps, among how many units.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Homes {
    units: usize,
    keep: Vec<bool>,
}

impl Homes {
    /// The homes `homes` among `units` units; a message when `units` is 0
    /// or a home is not below it.
    pub(crate) fn new(units: u32, homes: &[u32]) -> Result<Homes, String> {
        if units == 0 {
            return Err("CheckpointHomes among 0 units: units must be at least 1".into());
        }
        let mut keep = vec![false; units as usize];
        for &h in homes {
            let Some(k) = keep.get_mut(h as usize) else {
                return Err(format!(
                    "CheckpointHomes: home {h} is not one of the {units} units"
                ));
            };
            *k = true;
        }
        Ok(Homes {
            units: units as usize,
            keep,
        })
    }
}

/// One piece of a blob as written: a range of the blob's bytes, or zeros.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Piece {
    /// `len` bytes from `from` in the blob.
    Copy {
        from: u64,
        len: u64,
    },
    Zeros(u64),
}

/// Whether a core partition (`namespace` + separator + name) is a
/// client's bookkeeping ([`stowage_wire::RESERVED_PARTITION_PREFIX`]: the
/// marks of repaired copies, true of this unit now, not data to restore).
fn reserved(partition: &str) -> bool {
    partition
        .split_once(stowage_wire::PARTITION_SEPARATOR)
        .is_some_and(|(_, name)| name.starts_with(stowage_wire::RESERVED_PARTITION_PREFIX))
}

/// What of a snapshot a checkpoint of `homes` writes: the snapshot of the
/// kept entries (offsets moved in compacted blobs) and blobs (with their
/// sizes as written), and the pieces of each compacted blob (a blob not
/// named there is written whole).
pub(crate) fn keep(snap: &Snapshot, homes: &Homes) -> (Snapshot, HashMap<BlobId, Vec<Piece>>) {
    // Every row's fields, by partition (namespace included) and row.
    let mut fields: HashMap<(&str, u64), Vec<&str>> = HashMap::new();
    for e in &snap.entries {
        fields
            .entry((e.partition.as_str(), e.key.row))
            .or_default()
            .push(e.key.field.as_str());
    }
    let kept_row: HashSet<(&str, u64)> = fields
        .into_iter()
        .filter(|((partition, row), f)| {
            !reserved(partition)
                && homes.keep[stowage_wire::home_unit(*row, f.iter().copied(), homes.units)]
        })
        .map(|(k, _)| k)
        .collect();
    let kept = |e: &SnapshotEntry| kept_row.contains(&(e.partition.as_str(), e.key.row));
    // Blobs with some entry left out.
    let mut whole: HashMap<BlobId, bool> = HashMap::new();
    for e in &snap.entries {
        let w = whole.entry(e.blob).or_insert(true);
        *w &= kept(e);
    }
    let mut ranges: HashMap<BlobId, Vec<(u64, u64)>> = HashMap::new();
    for e in snap.entries.iter().filter(|e| kept(e) && !whole[&e.blob]) {
        ranges.entry(e.blob).or_default().push((e.offset, e.len));
    }
    // Each compacted blob: its merged ranges, where each lands, its size.
    let mut pieces = HashMap::new();
    let mut moved: HashMap<BlobId, (Vec<Segment>, u64)> = HashMap::new();
    for (blob, mut r) in ranges {
        let (segments, size) = compact(&mut r);
        let mut p = Vec::with_capacity(segments.len() * 2);
        let mut at = 0;
        for &(from, to, len) in &segments {
            if to > at {
                p.push(Piece::Zeros(to - at));
            }
            p.push(Piece::Copy { from, len });
            at = to + len;
        }
        pieces.insert(blob, p);
        moved.insert(blob, (segments, size));
    }
    let entries = snap
        .entries
        .iter()
        .filter(|e| kept(e))
        .map(|e| {
            let mut e = e.clone();
            if let Some((segments, _)) = moved.get(&e.blob) {
                let i = segments.partition_point(|s| s.0 <= e.offset) - 1;
                let (from, to, _) = segments[i];
                e.offset = to + (e.offset - from);
            }
            e
        })
        .collect();
    let blobs = snap
        .blobs
        .iter()
        .filter(|(b, ..)| whole.get(b).is_some_and(|&w| w) || moved.contains_key(b))
        .map(|(b, n, place)| {
            let n = moved.get(b).map_or(*n, |(_, size)| *size);
            (*b, n, place.clone())
        })
        .collect();
    let out = Snapshot {
        pin: None,
        entries,
        blobs,
        claims: snap.claims.clone(),
    };
    (out, pieces)
}

/// A range of a compacted blob: `(from, to, len)`, `len` bytes from
/// `from` in the blob written at `to`.
type Segment = (u64, u64, u64);

/// The ranges `(offset, len)` merged where they overlap or touch, in
/// order, each placed after the one before at its offset modulo
/// [`ALIGN`]: `(from, to, len)` each, and the size of them all.
fn compact(ranges: &mut [(u64, u64)]) -> (Vec<Segment>, u64) {
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for &(off, len) in ranges.iter() {
        let end = off + len;
        match merged.last_mut() {
            Some((_, e)) if off <= *e => *e = (*e).max(end),
            _ => merged.push((off, end)),
        }
    }
    let mut at = 0u64;
    let segments = merged
        .into_iter()
        .map(|(start, end)| {
            let to = at + (start % ALIGN + ALIGN - at % ALIGN) % ALIGN;
            at = to + (end - start);
            (start, to, end - start)
        })
        .collect();
    (segments, at)
}

/// The slab ranges of `len` bytes from `from` in a region made of `parts`
/// ((slab offset, bytes) each, in order).
pub(crate) fn within(parts: &[(u64, u64)], from: u64, len: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let (mut skip, mut left) = (from, len);
    for &(offset, n) in parts {
        if left == 0 {
            break;
        }
        if skip >= n {
            skip -= n;
            continue;
        }
        let take = (n - skip).min(left);
        out.push((offset + skip, take));
        left -= take;
        skip = 0;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_core::{Key, Placement, SlabRange};

    fn entry(
        partition: &str,
        row: u64,
        field: &str,
        blob: u128,
        offset: u64,
        len: u64,
    ) -> SnapshotEntry {
        SnapshotEntry {
            partition: partition.into(),
            key: Key::new(row, field),
            blob: BlobId(blob),
            offset,
            len,
            meta: vec![],
        }
    }

    fn place() -> Placement {
        Placement::Memory(SlabRange { offset: 0, len: 0 })
    }

    #[test]
    fn no_units_or_a_home_past_them_is_refused() {
        assert!(Homes::new(0, &[]).is_err());
        assert!(Homes::new(4, &[4]).is_err());
        assert!(Homes::new(4, &[0, 9]).is_err());
        assert!(Homes::new(4, &[]).is_ok());
        assert!(Homes::new(4, &[3, 0]).is_ok());
    }

    #[test]
    fn a_clients_bookkeeping_partitions_are_never_written() {
        let snap = Snapshot {
            pin: None,
            entries: vec![
                entry("ns\u{1f}p", 0, "a", 1, 0, 8),
                entry("ns\u{1f}\0stowage:repaired", 0, "whole", 2, 0, 1),
            ],
            blobs: vec![(BlobId(1), 8, place()), (BlobId(2), 1, place())],
            claims: vec![],
        };
        let (kept, _) = keep(&snap, &Homes::new(2, &[0, 1]).unwrap());
        let parts: Vec<&str> = kept.entries.iter().map(|e| e.partition.as_str()).collect();
        assert_eq!(parts, ["ns\u{1f}p"]);
        assert_eq!(kept.blobs.len(), 1, "the mark's blob is not written");
    }

    #[test]
    fn rows_of_other_homes_are_left_out_and_mixed_blobs_compacted() {
        // Blob 1 holds rows 0 (home 0) and 1 (home 1) of 2 units; blob 2
        // only row 2 (home 0); blob 3 only row 3 (home 1).
        let snap = Snapshot {
            pin: None,
            entries: vec![
                entry("ns\u{1f}p", 0, "a", 1, 0, 10),
                entry("ns\u{1f}p", 1, "a", 1, 64, 100),
                entry("ns\u{1f}p", 0, "b", 1, 200, 8),
                entry("ns\u{1f}p", 2, "a", 2, 0, 5),
                entry("ns\u{1f}p", 3, "a", 3, 0, 5),
                // Row 5 named onto unit 0.
                entry("ns\u{1f}p", 5, "\0u:0", 3, 5, 0),
                entry("ns\u{1f}p", 5, "x", 3, 8, 4),
            ],
            blobs: vec![
                (BlobId(1), 208, place()),
                (BlobId(2), 5, place()),
                (BlobId(3), 12, place()),
            ],
            claims: vec![],
        };
        let (out, pieces) = keep(&snap, &Homes::new(2, &[0]).unwrap());
        let rows: Vec<(u64, &str, u128, u64)> = out
            .entries
            .iter()
            .map(|e| (e.key.row, e.key.field.as_str(), e.blob.0, e.offset))
            .collect();
        assert_eq!(
            rows,
            [
                (0, "a", 1, 0),
                // 200 % 64 == 8: after the first range's end (10), at 72.
                (0, "b", 1, 72),
                (2, "a", 2, 0),
                (5, "\0u:0", 3, 5),
                (5, "x", 3, 8),
            ]
        );
        let sizes: Vec<(u128, u64)> = out.blobs.iter().map(|(b, n, _)| (b.0, *n)).collect();
        assert_eq!(sizes, [(1, 80), (2, 5), (3, 12)]);
        assert_eq!(
            pieces[&BlobId(1)],
            [
                Piece::Copy { from: 0, len: 10 },
                Piece::Zeros(62),
                Piece::Copy { from: 200, len: 8 }
            ]
        );
        // Blob 3 holds row 3 (home 1) too: row 5's ranges alone.
        assert_eq!(
            pieces[&BlobId(3)],
            [
                Piece::Zeros(5),
                Piece::Copy { from: 5, len: 0 },
                Piece::Zeros(3),
                Piece::Copy { from: 8, len: 4 }
            ]
        );
        assert_eq!(pieces.len(), 2);

        // Home 1: row 1 alone of blob 1, and blob 3 compacted to row 3.
        let (out, pieces) = keep(&snap, &Homes::new(2, &[1]).unwrap());
        let rows: Vec<(u64, u64)> = out.entries.iter().map(|e| (e.key.row, e.offset)).collect();
        assert_eq!(rows, [(1, 0), (3, 0)]);
        assert_eq!(pieces[&BlobId(1)], [Piece::Copy { from: 64, len: 100 }]);
        assert_eq!(pieces[&BlobId(3)], [Piece::Copy { from: 0, len: 5 }]);
        // Both homes: everything, whole.
        let (out, pieces) = keep(&snap, &Homes::new(2, &[0, 1]).unwrap());
        assert_eq!(out.entries.len(), snap.entries.len());
        assert_eq!(out.blobs.len(), 3);
        assert!(pieces.is_empty());
        // No home: nothing.
        let (out, _) = keep(&snap, &Homes::new(2, &[]).unwrap());
        assert!(out.entries.is_empty() && out.blobs.is_empty());
    }

    #[test]
    fn overlapping_ranges_are_merged() {
        let mut r = [(10, 20), (0, 5), (15, 30), (45, 5), (200, 1)];
        let (segments, size) = compact(&mut r);
        assert_eq!(segments, [(0, 0, 5), (10, 10, 40), (200, 72, 1)]);
        assert_eq!(size, 73);
        let mut r = [(130, 4)];
        assert_eq!(compact(&mut r), (vec![(130, 2, 4)], 6));
    }

    #[test]
    fn ranges_within_parts() {
        let parts = [(1000, 10), (5000, 10), (9000, 10)];
        assert_eq!(within(&parts, 0, 30), parts);
        assert_eq!(within(&parts, 5, 10), [(1005, 5), (5000, 5)]);
        assert_eq!(within(&parts, 12, 15), [(5002, 8), (9000, 7)]);
        assert_eq!(within(&parts, 20, 0), []);
    }
}
