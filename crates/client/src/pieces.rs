//! Blobs and values in pieces of a unit's slab (protocol 9): where a
//! put's bytes go when the unit reserved its blob as several ranges, where
//! a get's split value lies, and the checks of what the unit named before
//! a one-sided transport (shm, nixl) writes or reads a byte there.
//!
//! Pure functions: the transports call them; no I/O.

use stowage_wire::Placed;

/// One piece's share of a put: the piece's slab offset and the parts of
/// the put's segments that fill it from there, back to back.
pub(crate) type PieceWrite<'s> = (u64, Vec<&'s [u8]>);

/// A range of the slab, as the unit names it: (slab offset, bytes).
pub(crate) type SlabRange = (u64, u64);

/// Check the pieces an Alloc of `nbytes` was answered with, in a slab of
/// `slab_len` bytes: every piece inside the slab, the pieces together at
/// least `nbytes`, no more pieces than `nbytes` can need (each piece is a
/// whole number of 64-byte units; a blob of 0 bytes still gets one), and
/// no two overlapping. Anything else is the unit's protocol error: nothing
/// is written.
pub(crate) fn check_pieces(pieces: &[SlabRange], nbytes: u64, slab_len: u64) -> Result<(), String> {
    let most = usize::try_from(nbytes.div_ceil(64).max(1)).unwrap_or(usize::MAX);
    if pieces.is_empty() || pieces.len() > most {
        return Err(format!(
            "{} pieces for a blob of {nbytes} bytes (1 to {most})",
            pieces.len()
        ));
    }
    let mut total = 0u64;
    for &(offset, len) in pieces {
        check_range(offset, len, slab_len)?;
        total = total.saturating_add(len);
    }
    if total < nbytes {
        return Err(format!(
            "pieces of {total} bytes for a blob of {nbytes} bytes"
        ));
    }
    no_overlap(pieces)
}

/// Check a value a Resolve found in the unit's memory, in a slab of
/// `slab_len` bytes: its range (or each of its parts) inside the slab, its
/// parts adding up to its length, no more parts than a value of its
/// length can have, none overlapping. Values only on the unit's disk are
/// not read through the slab and pass.
pub(crate) fn check_found(f: &Placed, slab_len: u64) -> Result<(), String> {
    check_place(f.on_disk, f.offset, f.len, &f.parts, slab_len)
}

/// [`check_found`] of a value's fields.
pub(crate) fn check_place(
    on_disk: bool,
    offset: u64,
    len: u64,
    parts: &[SlabRange],
    slab_len: u64,
) -> Result<(), String> {
    if on_disk {
        return Ok(());
    }
    if parts.is_empty() {
        return check_range(offset, len, slab_len);
    }
    // A value starting inside a piece: a partial first part, whole pieces
    // (64 bytes or more each), a partial last part.
    let most = usize::try_from(len.div_ceil(64).saturating_add(1)).unwrap_or(usize::MAX);
    if parts.len() > most {
        return Err(format!(
            "a value of {len} bytes in {} parts (at most {most})",
            parts.len()
        ));
    }
    let mut total = 0u64;
    for &(offset, len) in parts {
        check_range(offset, len, slab_len)?;
        total = total.saturating_add(len);
    }
    if total != len {
        return Err(format!(
            "a value of {len} bytes whose parts add up to {total}"
        ));
    }
    no_overlap(parts)
}

/// `len` bytes at `offset` lie inside a slab of `slab_len` bytes.
fn check_range(offset: u64, len: u64, slab_len: u64) -> Result<(), String> {
    match offset.checked_add(len) {
        Some(end) if end <= slab_len => Ok(()),
        _ => Err(format!(
            "range of {len} bytes at {offset} outside the slab of {slab_len} bytes"
        )),
    }
}

fn no_overlap(ranges: &[SlabRange]) -> Result<(), String> {
    if ranges.len() < 2 {
        return Ok(());
    }
    let mut sorted: Vec<SlabRange> = ranges.iter().copied().filter(|r| r.1 > 0).collect();
    sorted.sort_unstable();
    match sorted
        .windows(2)
        .find(|w| w[0].0.saturating_add(w[0].1) > w[1].0)
    {
        Some(w) => Err(format!(
            "ranges overlap: {} bytes at {} and {} bytes at {}",
            w[0].1, w[0].0, w[1].1, w[1].0
        )),
        None => Ok(()),
    }
}

/// Scatter a put's `segments` (its bytes, back to back) over `pieces`, in
/// order: the first pieces filled whole, the last one partly; a segment
/// that crosses a piece's end is cut there. Pieces left with nothing to
/// hold (past the put's bytes) and empty segments are left out. Err when
/// the pieces hold fewer bytes than the segments (see [`check_pieces`]).
pub(crate) fn scatter<'s>(
    segments: &[&'s [u8]],
    pieces: &[SlabRange],
) -> Result<Vec<PieceWrite<'s>>, String> {
    let mut out: Vec<PieceWrite<'s>> = Vec::with_capacity(pieces.len().min(segments.len() + 1));
    let mut pieces_left = pieces.iter();
    // The piece being filled: its offset, and the bytes it still takes.
    let mut current: Option<(u64, u64)> = None;
    for seg in segments {
        let mut rest: &'s [u8] = seg;
        while !rest.is_empty() {
            let (offset, room) = match current {
                Some(c) if c.1 > 0 => c,
                _ => {
                    let Some(&(offset, len)) = pieces_left.next() else {
                        return Err(format!(
                            "pieces of {} bytes for {} bytes",
                            pieces.iter().fold(0u64, |a, p| a.saturating_add(p.1)),
                            segments.iter().map(|s| s.len() as u64).sum::<u64>()
                        ));
                    };
                    if len == 0 {
                        continue;
                    }
                    out.push((offset, Vec::new()));
                    (offset, len)
                }
            };
            let take = usize::try_from(room).unwrap_or(usize::MAX).min(rest.len());
            let (head, tail) = rest.split_at(take);
            if let Some(last) = out.last_mut() {
                last.1.push(head);
            }
            current = Some((offset, room - take as u64));
            rest = tail;
        }
    }
    Ok(out)
}

/// Cut `dst` (the buffer of one value) into one sub-slice per range of
/// `ranges` (the value's parts, in order), each paired with its range's
/// slab offset. Err unless the ranges add up to `dst`'s length.
pub(crate) fn split_dst<'d>(
    mut dst: &'d mut [u8],
    ranges: &[SlabRange],
) -> Result<Vec<(u64, &'d mut [u8])>, String> {
    let total = ranges.iter().try_fold(0u64, |acc, r| acc.checked_add(r.1));
    if total != Some(dst.len() as u64) {
        return Err(format!(
            "parts of {} bytes for a buffer of {} bytes",
            total.map_or_else(|| "too many".to_string(), |t| t.to_string()),
            dst.len()
        ));
    }
    let mut out = Vec::with_capacity(ranges.len());
    for &(offset, len) in ranges {
        // `len` fits: the lengths add up to `dst.len()`.
        let (head, tail) = std::mem::take(&mut dst).split_at_mut(len as usize);
        out.push((offset, head));
        dst = tail;
    }
    Ok(out)
}

/// A found value's ranges in the slab: its parts, or its one range.
pub(crate) fn ranges_of(f: &Placed) -> RangesOf<'_> {
    if f.parts.is_empty() {
        RangesOf::One([(f.offset, f.len)])
    } else {
        RangesOf::Parts(&f.parts)
    }
}

/// See [`ranges_of`]: a slice of ranges without an allocation for the
/// usual value in one range.
pub(crate) enum RangesOf<'f> {
    One([SlabRange; 1]),
    Parts(&'f [SlabRange]),
}

impl std::ops::Deref for RangesOf<'_> {
    type Target = [SlabRange];
    fn deref(&self) -> &[SlabRange] {
        match self {
            RangesOf::One(r) => r,
            RangesOf::Parts(p) => p,
        }
    }
}

/// Where a get's values in the unit's memory lie, in the order of the
/// values: each value's ranges (one, or its parts in order) back to back.
#[derive(Debug, Default)]
pub(crate) struct Places {
    ranges: Vec<SlabRange>,
    /// Value `i`'s ranges are `ranges[ends[i - 1]..ends[i]]`.
    ends: Vec<usize>,
}

impl Places {
    pub(crate) fn push(&mut self, f: &Placed) {
        self.ranges.extend_from_slice(&ranges_of(f));
        self.ends.push(self.ranges.len());
    }

    /// How many values.
    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Every range of every value, in order.
    pub(crate) fn ranges(&self) -> &[SlabRange] {
        &self.ranges
    }

    /// Each value's ranges, in order.
    pub(crate) fn values(&self) -> impl Iterator<Item = &[SlabRange]> + '_ {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(self.ends.iter().copied())
            .map(|(a, b)| &self.ranges[a..b])
    }

    /// The bytes of all values.
    pub(crate) fn total(&self) -> u64 {
        self.ranges.iter().fold(0, |acc, r| acc.saturating_add(r.1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn found(offset: u64, len: u64, parts: Vec<SlabRange>) -> Placed {
        Placed {
            offset,
            len,
            meta: Default::default(),
            on_disk: false,
            parts,
        }
    }

    /// The bytes `writes` put where, as (slab offset, byte) pairs.
    fn placed(writes: &[PieceWrite<'_>]) -> Vec<(u64, u8)> {
        let mut out = Vec::new();
        for (offset, segs) in writes {
            let mut at = *offset;
            for s in segs {
                for &b in *s {
                    out.push((at, b));
                    at += 1;
                }
            }
        }
        out
    }

    /// Where byte `i` of a blob laid over `pieces` in order belongs.
    fn expected_at(pieces: &[SlabRange], mut i: u64) -> u64 {
        for &(o, l) in pieces {
            if i < l {
                return o + i;
            }
            i -= l;
        }
        panic!("byte {i} beyond the pieces");
    }

    #[test]
    fn scatter_one_piece_keeps_the_segments() {
        let (a, b) = (vec![1u8; 10], vec![2u8; 5]);
        let w = scatter(&[&a, &b], &[(640, 64)]).unwrap();
        assert_eq!(w, vec![(640, vec![&a[..], &b[..]])]);
    }

    #[test]
    fn scatter_cuts_a_segment_at_a_piece_boundary() {
        let a: Vec<u8> = (0..100).collect();
        let b: Vec<u8> = (100..130).collect();
        let w = scatter(&[&a, &b], &[(0, 64), (4096, 64), (8192, 64)]).unwrap();
        assert_eq!(
            w,
            vec![
                (0, vec![&a[..64]]),
                (4096, vec![&a[64..], &b[..28]]),
                (8192, vec![&b[28..]]),
            ]
        );
    }

    #[test]
    fn scatter_segment_ending_on_a_boundary_starts_the_next_piece_clean() {
        let a = vec![7u8; 64];
        let b = vec![8u8; 3];
        let w = scatter(&[&a, &b], &[(128, 64), (0, 64)]).unwrap();
        assert_eq!(w, vec![(128, vec![&a[..]]), (0, vec![&b[..]])]);
    }

    #[test]
    fn scatter_leaves_out_empty_segments_and_unused_pieces() {
        let a = vec![1u8; 70];
        let w = scatter(&[&[], &a, &[]], &[(0, 64), (64, 0), (256, 64), (1024, 64)]).unwrap();
        assert_eq!(w, vec![(0, vec![&a[..64]]), (256, vec![&a[64..]])]);
        assert_eq!(scatter(&[], &[(0, 64)]).unwrap(), vec![]);
    }

    #[test]
    fn scatter_refuses_too_few_bytes() {
        let a = vec![1u8; 129];
        assert!(scatter(&[&a], &[(0, 64), (64, 64)]).is_err());
        assert!(scatter(&[&a], &[]).is_err());
    }

    #[test]
    fn pieces_checked_against_the_slab_and_the_blob() {
        let slab = 1 << 20;
        assert!(check_pieces(&[(0, 64)], 64, slab).is_ok());
        assert!(check_pieces(&[(0, 64)], 0, slab).is_ok());
        assert!(check_pieces(&[(4096, 128), (0, 64)], 150, slab).is_ok());
        assert!(check_pieces(&[(slab - 64, 64)], 64, slab).is_ok());
        // Outside the slab, or wrapping around.
        assert!(check_pieces(&[(slab - 64, 128)], 100, slab).is_err());
        assert!(check_pieces(&[(u64::MAX - 10, 64)], 64, slab).is_err());
        // Too few bytes.
        assert!(check_pieces(&[(0, 64), (128, 64)], 129, slab).is_err());
        // None, or more than the blob can need.
        assert!(check_pieces(&[], 0, slab).is_err());
        assert!(check_pieces(&[(0, 64), (128, 64)], 64, slab).is_err());
        // Overlapping.
        assert!(check_pieces(&[(0, 128), (64, 64)], 192, slab).is_err());
    }

    #[test]
    fn found_checked_against_the_slab_and_its_length() {
        let slab = 1 << 20;
        assert!(check_found(&found(64, 100, vec![]), slab).is_ok());
        assert!(check_found(&found(slab - 10, 100, vec![]), slab).is_err());
        assert!(check_found(&found(64, 100, vec![(64, 36), (4096, 64)]), slab).is_ok());
        // Parts that do not add up to the value.
        assert!(check_found(&found(64, 100, vec![(64, 36), (4096, 60)]), slab).is_err());
        assert!(check_found(&found(64, 100, vec![(64, 36), (4096, 65)]), slab).is_err());
        // A part outside the slab.
        assert!(check_found(&found(64, 100, vec![(64, 36), (slab - 32, 64)]), slab).is_err());
        // Overlapping parts.
        assert!(check_found(&found(0, 100, vec![(0, 64), (32, 36)]), slab).is_err());
        // Far too many parts.
        let many: Vec<SlabRange> = (0..10).map(|i| (i * 64, 1)).collect();
        assert!(check_found(&found(0, 10, many), slab).is_err());
        // On disk: not read through the slab.
        let mut d = found(u64::MAX, 100, vec![]);
        d.on_disk = true;
        assert!(check_found(&d, slab).is_ok());
    }

    #[test]
    fn split_dst_cuts_a_buffer_by_parts() {
        let mut buf = vec![0u8; 100];
        let parts = split_dst(&mut buf, &[(64, 36), (4096, 64)]).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!((parts[0].0, parts[0].1.len()), (64, 36));
        assert_eq!((parts[1].0, parts[1].1.len()), (4096, 64));
        assert!(split_dst(&mut buf, &[(64, 36)]).is_err());
        assert!(split_dst(&mut buf, &[(64, 36), (0, 65)]).is_err());
        assert!(split_dst(&mut buf, &[(64, u64::MAX), (0, 101)]).is_err());
    }

    #[test]
    fn places_group_each_values_ranges() {
        let mut p = Places::default();
        p.push(&found(0, 10, vec![]));
        p.push(&found(64, 100, vec![(64, 36), (4096, 64)]));
        p.push(&found(8192, 0, vec![]));
        assert_eq!(p.len(), 3);
        assert_eq!(p.ranges(), &[(0, 10), (64, 36), (4096, 64), (8192, 0)]);
        let v: Vec<&[SlabRange]> = p.values().collect();
        assert_eq!(
            v,
            vec![
                &[(0, 10)][..],
                &[(64, 36), (4096, 64)][..],
                &[(8192, 0)][..]
            ]
        );
        assert_eq!(p.total(), 110);
    }

    /// Segment lengths and piece lengths (multiples of 64) covering them.
    fn layout() -> impl Strategy<Value = (Vec<usize>, Vec<SlabRange>)> {
        (
            proptest::collection::vec(0usize..300, 0..8),
            proptest::collection::vec(1u64..6, 1..8),
        )
            .prop_map(|(segs, units)| {
                let total: u64 = segs.iter().map(|&l| l as u64).sum();
                // Pieces of the given sizes (64-byte units), then one more
                // to cover what is left; placed apart, in descending
                // order, as a scattered slab hands them out.
                let mut pieces = Vec::new();
                let mut covered = 0u64;
                let mut at = 1u64 << 30;
                for u in units {
                    if covered >= total && !pieces.is_empty() {
                        break;
                    }
                    let len = u * 64;
                    at -= len + 4096;
                    pieces.push((at, len));
                    covered += len;
                }
                if covered < total {
                    let len = (total - covered).next_multiple_of(64);
                    pieces.push((64, len));
                }
                (segs, pieces)
            })
    }

    proptest! {
        /// Every byte of the put lands where the blob's layout over its
        /// pieces puts it, once, inside its piece.
        #[test]
        fn scatter_places_every_byte((segs, pieces) in layout()) {
            let mut n = 0u8;
            let data: Vec<Vec<u8>> = segs
                .iter()
                .map(|&l| (0..l).map(|_| { n = n.wrapping_add(1); n }).collect())
                .collect();
            let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
            let nbytes: u64 = segs.iter().map(|&l| l as u64).sum();
            prop_assert!(check_pieces(&pieces, nbytes, 1 << 30).is_ok());
            let w = scatter(&refs, &pieces).unwrap();
            let got = placed(&w);
            let want: Vec<(u64, u8)> = data
                .concat()
                .into_iter()
                .enumerate()
                .map(|(i, b)| (expected_at(&pieces, i as u64), b))
                .collect();
            prop_assert_eq!(got, want);
            for (offset, s) in &w {
                let len: usize = s.iter().map(|s| s.len()).sum();
                prop_assert!(len > 0);
                prop_assert!(s.iter().all(|s| !s.is_empty()));
                let piece = pieces.iter().find(|p| p.0 == *offset).unwrap();
                prop_assert!(len as u64 <= piece.1);
            }
        }

        /// Splitting a value's buffer by its parts and reading each part
        /// into its sub-slice gives the value's bytes in order.
        #[test]
        fn split_dst_reassembles(lens in proptest::collection::vec(0u64..200, 1..6)) {
            // A "slab" whose parts are far apart and in reverse order.
            let mut slab = vec![0u8; 8192];
            let mut parts = Vec::new();
            let mut at = 8192u64;
            let mut want = Vec::new();
            let mut n = 0u8;
            for &l in &lens {
                at -= l + 64;
                for i in 0..l {
                    n = n.wrapping_add(1);
                    slab[(at + i) as usize] = n;
                    want.push(n);
                }
                parts.push((at, l));
            }
            let total: u64 = lens.iter().sum();
            let mut buf = vec![0u8; total as usize];
            for (offset, d) in split_dst(&mut buf, &parts).unwrap() {
                let o = offset as usize;
                d.copy_from_slice(&slab[o..o + d.len()]);
            }
            prop_assert_eq!(buf, want);
        }
    }
}
