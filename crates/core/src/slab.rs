//! Byte-range allocator for one unit's slab.
//!
//! The slab is cut into two **zones**: data at the bottom, and the **spare
//! zone** at the top (`spare_budget` bytes), where the reservations that
//! same-host clients keep for their next puts come from, so that idle
//! clients' spares never cut the data zone into pieces. Data may borrow the
//! spare zone's free ranges when its own zone has no room; spares never
//! leave theirs.
//!
//! Each zone keeps its free ranges in two ordered maps (by offset, to merge
//! neighbours on free; by size, for best fit), so its bookkeeping grows and
//! shrinks with the number of free ranges — bounded by memory, never by a
//! table sized at start. Every range starts on a 64-byte boundary.
//!
//! A [`Region`] is one or more **pieces**: when no single free range holds
//! a request, [`SlabAllocator::allocate`] gathers several (largest first,
//! so as few as it can), and the bytes of the region are its pieces in
//! order.

use std::collections::{BTreeMap, BTreeSet};

/// Every range starts on a multiple of this many bytes.
pub const ALIGN: u64 = 64;

/// Largest slab the allocator manages (the unit's configuration limit).
pub const MAX_CAPACITY: u64 = (u32::MAX as u64 - 1) * ALIGN;

/// Most pieces one region may have. A request that would need more (free
/// memory cut into that many tiny holes) is answered as if there were no
/// room; compaction makes larger ranges.
pub const MAX_PIECES: usize = 1 << 14;

/// A region handed out by [`SlabAllocator::allocate`]: the right to one or
/// more byte ranges of the slab. Neither `Copy` nor `Clone`: giving it back
/// ([`SlabAllocator::free`]) consumes it, so a range cannot be freed twice:
///
/// ```compile_fail,E0382
/// use stowage_core::slab::SlabAllocator;
/// let mut slab = SlabAllocator::new(4096, 0);
/// let r = slab.allocate(64).unwrap();
/// slab.free(r);
/// slab.free(r); // error[E0382]: use of moved value: `r`
/// ```
///
/// Freed once, it compiles:
///
/// ```
/// use stowage_core::slab::SlabAllocator;
/// let mut slab = SlabAllocator::new(4096, 0);
/// let r = slab.allocate(64).unwrap();
/// slab.free(r);
/// assert_eq!(slab.allocated(), 0);
/// ```
pub struct Region {
    /// Bytes reserved in all (each piece rounded up to [`ALIGN`]).
    pub len: u64,
    /// (slab offset, bytes) of each piece, in the order of the region's
    /// bytes. Never empty.
    pieces: Vec<(u64, u64)>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("len", &self.len)
            .field("pieces", &self.pieces)
            .finish()
    }
}

impl Region {
    /// (slab offset, bytes) of each piece, in order.
    pub fn pieces(&self) -> &[(u64, u64)] {
        &self.pieces
    }

    /// The slab offset of the region's first byte.
    pub fn start(&self) -> u64 {
        self.pieces[0].0
    }

    /// Whether the region is one range.
    pub fn is_contiguous(&self) -> bool {
        self.pieces.len() == 1
    }

    /// [`Region::locate`] of a range that lies in one piece, without a
    /// vector: its slab offset; `None` when it crosses pieces (or is
    /// empty, or past the region).
    #[inline]
    pub fn locate_one(&self, mut offset: u64, len: u64) -> Option<u64> {
        if len == 0 {
            return None;
        }
        for &(start, plen) in &self.pieces {
            if offset < plen {
                return (len <= plen - offset).then_some(start + offset);
            }
            offset -= plen;
        }
        None
    }

    /// Where bytes `offset..offset + len` of the region lie in the slab:
    /// (slab offset, bytes) of each part, in order (one part unless the
    /// range crosses a piece's end). Empty for `len == 0` (the range's
    /// start is then `self.start() + offset` clamped to the first piece).
    pub fn locate(&self, mut offset: u64, len: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut left = len;
        for &(start, plen) in &self.pieces {
            if left == 0 {
                break;
            }
            if offset >= plen {
                offset -= plen;
                continue;
            }
            let n = (plen - offset).min(left);
            out.push((start + offset, n));
            left -= n;
            offset = 0;
        }
        out
    }

    /// The slab offset of byte `offset` of the region (for a zero-length
    /// value, where it would start).
    pub fn slab_offset(&self, mut offset: u64) -> u64 {
        for &(start, plen) in &self.pieces {
            if offset < plen {
                return start + offset;
            }
            offset -= plen;
        }
        let (start, plen) = self.pieces[self.pieces.len() - 1];
        start + plen
    }
}

/// The free ranges of one zone.
#[derive(Default)]
struct Zone {
    start: u64,
    end: u64,
    /// Free ranges: offset → length.
    by_offset: BTreeMap<u64, u64>,
    /// The same ranges: (length, offset).
    by_size: BTreeSet<(u64, u64)>,
    free: u64,
}

impl Zone {
    fn new(start: u64, end: u64) -> Self {
        let mut z = Zone {
            start,
            end,
            ..Zone::default()
        };
        if end > start {
            z.insert(start, end - start);
        }
        z
    }

    fn insert(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
        self.free += len;
    }

    fn remove(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
        self.free -= len;
    }

    fn contains(&self, offset: u64) -> bool {
        self.start <= offset && offset < self.end
    }

    fn largest(&self) -> u64 {
        self.by_size.last().map_or(0, |&(l, _)| l)
    }

    /// Take `len` bytes from the free range at `offset` of length `flen`,
    /// from its start; the rest stays free.
    fn take(&mut self, offset: u64, flen: u64, len: u64) -> (u64, u64) {
        self.remove(offset, flen);
        if flen > len {
            self.insert(offset + len, flen - len);
        }
        (offset, len)
    }

    /// The smallest free range that holds `len` (lowest offset among equals).
    fn best_fit(&mut self, len: u64) -> Option<(u64, u64)> {
        let &(flen, off) = self.by_size.range((len, 0)..).next()?;
        Some(self.take(off, flen, len))
    }

    /// The lowest free range below `limit` that holds `len`.
    fn first_fit_below(&mut self, len: u64, limit: u64) -> Option<(u64, u64)> {
        let (&off, &flen) = self
            .by_offset
            .range(..limit)
            .find(|&(&off, &flen)| flen >= len && off + len <= limit)?;
        Some(self.take(off, flen, len))
    }

    /// Give a range back, merged with free neighbours.
    fn give(&mut self, mut offset: u64, mut len: u64) {
        if let Some((&prev, &plen)) = self.by_offset.range(..offset).next_back() {
            debug_assert!(prev + plen <= offset, "range freed twice");
            if prev + plen == offset {
                self.remove(prev, plen);
                offset = prev;
                len += plen;
            }
        }
        if let Some(&nlen) = self.by_offset.get(&(offset + len)) {
            self.remove(offset + len, nlen);
            len += nlen;
        }
        self.insert(offset, len);
    }
}

/// Hands out non-overlapping, aligned byte ranges of `[0, capacity)`.
pub struct SlabAllocator {
    data: Zone,
    spare: Zone,
    capacity: u64,
}

impl SlabAllocator {
    /// An allocator over `capacity` bytes (rounded down to [`ALIGN`]), the
    /// top `spare_budget` of them (rounded down too, at most half the slab)
    /// the spare zone.
    ///
    /// # Panics
    /// If `capacity` exceeds [`MAX_CAPACITY`]; the unit's config rejects such
    /// sizes before they get here.
    pub fn new(capacity: u64, spare_budget: u64) -> Self {
        assert!(capacity <= MAX_CAPACITY, "slab capacity over the limit");
        let capacity = capacity / ALIGN * ALIGN;
        let budget = (spare_budget / ALIGN * ALIGN).min(capacity / 2 / ALIGN * ALIGN);
        let split = capacity - budget;
        Self {
            data: Zone::new(0, split),
            spare: Zone::new(split, capacity),
            capacity,
        }
    }

    /// Bytes under management.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes of the spare zone.
    pub fn spare_budget(&self) -> u64 {
        self.spare.end - self.spare.start
    }

    /// Bytes currently handed out.
    pub fn allocated(&self) -> u64 {
        self.capacity - self.free_bytes()
    }

    /// Free bytes, both zones.
    pub fn free_bytes(&self) -> u64 {
        self.data.free + self.spare.free
    }

    /// Free bytes of the spare zone.
    pub fn spare_free(&self) -> u64 {
        self.spare.free
    }

    /// The largest free range, either zone.
    pub fn largest_free(&self) -> u64 {
        self.data.largest().max(self.spare.largest())
    }

    /// The largest free range of the data zone.
    pub fn largest_data_free(&self) -> u64 {
        self.data.largest()
    }

    /// Free bytes of the data zone.
    pub fn data_free(&self) -> u64 {
        self.data.free
    }

    /// How many free ranges there are (both zones).
    pub fn free_ranges(&self) -> usize {
        self.data.by_offset.len() + self.spare.by_offset.len()
    }

    /// Bytes that a request for `nbytes` occupies.
    /// Saturates at the largest multiple of the alignment (never wraps, so
    /// an absurd size is simply too large).
    pub fn rounded(nbytes: u64) -> u64 {
        nbytes
            .div_ceil(ALIGN)
            .max(1)
            .checked_mul(ALIGN)
            .unwrap_or(u64::MAX - (u64::MAX % ALIGN))
    }

    /// Reserve `nbytes` for data: one range when a free range holds it (the
    /// data zone first, best fit), else pieces of several (largest first,
    /// data zone then spare zone); `None` when the free bytes of both zones
    /// together are fewer, or it would take over [`MAX_PIECES`] pieces.
    pub fn allocate(&mut self, nbytes: u64) -> Option<Region> {
        let len = Self::rounded(nbytes);
        if len > self.free_bytes() {
            return None;
        }
        for zone in [&mut self.data, &mut self.spare] {
            if let Some(p) = zone.best_fit(len) {
                return Some(Region {
                    len,
                    pieces: vec![p],
                });
            }
        }
        // Scattered: gather the largest ranges until the request is covered;
        // the last piece is the best fit for what is left.
        let mut pieces = Vec::new();
        let mut left = len;
        while left > 0 {
            let zone = if self.data.free > 0 {
                &mut self.data
            } else {
                &mut self.spare
            };
            let piece = match zone.best_fit(left) {
                Some(p) => p,
                None => match zone.by_size.last() {
                    Some(&(flen, off)) => zone.take(off, flen, flen),
                    None => break, // not reached: `len` <= the free bytes
                },
            };
            left -= piece.1;
            pieces.push(piece);
            if pieces.len() > MAX_PIECES {
                break;
            }
        }
        if left > 0 {
            for (off, l) in pieces {
                self.give(off, l);
            }
            return None;
        }
        Some(Region { len, pieces })
    }

    /// Reserve `nbytes` in the spare zone, one range, or `None`.
    pub fn allocate_spare(&mut self, nbytes: u64) -> Option<Region> {
        let len = Self::rounded(nbytes);
        let p = self.spare.best_fit(len)?;
        Some(Region {
            len,
            pieces: vec![p],
        })
    }

    /// Reserve one range of `nbytes` of the data zone lying wholly below
    /// slab offset `limit` (the lowest that holds it): where compaction
    /// moves a blob to (data that borrowed the spare zone moves back).
    pub fn allocate_below(&mut self, nbytes: u64, limit: u64) -> Option<Region> {
        let len = Self::rounded(nbytes);
        let p = self.data.first_fit_below(len, limit)?;
        Some(Region {
            len,
            pieces: vec![p],
        })
    }

    fn give(&mut self, offset: u64, len: u64) {
        if self.spare.contains(offset) {
            self.spare.give(offset, len);
        } else {
            self.data.give(offset, len);
        }
    }

    /// Give a region back. It is consumed, so each is freed at most once;
    /// the unit core gives every range back through one function
    /// (`UnitCore::release`, with the reason).
    pub fn free(&mut self, region: Region) {
        for (off, len) in region.pieces {
            self.give(off, len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn regions_are_aligned_and_disjoint() {
        let mut a = SlabAllocator::new(1 << 20, 0);
        let r1 = a.allocate(1).unwrap();
        let r2 = a.allocate(100).unwrap();
        assert_eq!(r1.len, 64);
        assert_eq!(r2.len, 128);
        assert_eq!(r1.start() % ALIGN, 0);
        assert_eq!(r2.start() % ALIGN, 0);
        assert!(r1.start() + r1.len <= r2.start() || r2.start() + r2.len <= r1.start());
        assert_eq!(a.allocated(), 192);
        a.free(r1);
        a.free(r2);
        assert_eq!(a.allocated(), 0);
        assert_eq!(a.free_ranges(), 1);
    }

    #[test]
    fn locating_in_one_piece_agrees_with_locating_in_parts() {
        let r = Region {
            len: 448,
            pieces: vec![(1024, 128), (64, 64), (4096, 256)],
        };
        for offset in 0..=460 {
            for len in 0..=460 {
                let parts = r.locate(offset, len);
                let one = match parts.as_slice() {
                    [(at, n)] if *n == len && len > 0 => Some(*at),
                    _ => None,
                };
                assert_eq!(r.locate_one(offset, len), one, "{offset}+{len}: {parts:?}");
            }
        }
    }

    #[test]
    fn full_is_none_and_free_makes_room() {
        let mut a = SlabAllocator::new(4096, 0);
        let r = a.allocate(4096).unwrap();
        assert!(a.allocate(1).is_none());
        a.free(r);
        assert!(a.allocate(4096).is_some());
    }

    #[test]
    fn holes_are_gathered_into_pieces() {
        let mut a = SlabAllocator::new(64 * 1024, 0);
        let mut rs: Vec<_> = (0..64).map(|_| a.allocate(1024).unwrap()).collect();
        let mut kept = Vec::new();
        for (i, r) in rs.drain(..).enumerate() {
            if i % 2 == 0 {
                a.free(r);
            } else {
                kept.push(r);
            }
        }
        assert_eq!(a.largest_free(), 1024);
        let big = a.allocate(10 * 1024).expect("32 KiB free in 1 KiB holes");
        assert_eq!(big.pieces().len(), 10);
        assert_eq!(
            big.locate(1000, 100),
            vec![(big.pieces()[0].0 + 1000, 24), (big.pieces()[1].0, 76)]
        );
        assert!(a.allocate(23 * 1024).is_none(), "22 KiB left");
    }

    #[test]
    fn small_blobs_are_bounded_by_memory_only() {
        let mut a = SlabAllocator::new(16 << 20, 0);
        let rs: Vec<_> = (0..(16 << 20) / 64)
            .map(|_| a.allocate(64).unwrap())
            .collect();
        assert!(a.allocate(1).is_none());
        assert_eq!(rs.len(), 262_144);
    }

    #[test]
    fn spares_stay_in_their_zone() {
        let mut a = SlabAllocator::new(1 << 20, 1 << 16);
        assert_eq!(a.spare_budget(), 1 << 16);
        let s = a.allocate_spare(4096).unwrap();
        assert!(s.start() >= (1 << 20) - (1 << 16));
        assert!(a.allocate_spare(1 << 16).is_none());
        let d = a.allocate(4096).unwrap();
        assert!(d.start() < (1 << 20) - (1 << 16));
        a.free(s);
        a.free(d);
        assert_eq!(a.free_ranges(), 2);
    }

    proptest! {
        /// Random allocations and frees: pieces never overlap, the free count
        /// adds up, and freeing all leaves one range per zone.
        #[test]
        fn never_overlaps(ops in proptest::collection::vec((0u8..3, 1u64..20_000), 1..200)) {
            let cap = 1 << 20;
            let mut a = SlabAllocator::new(cap, 1 << 16);
            let mut live: Vec<Region> = Vec::new();
            for (op, n) in ops {
                match op {
                    0 | 1 => {
                        let r = if op == 0 { a.allocate(n) } else { a.allocate_spare(n) };
                        if let Some(r) = r {
                            prop_assert_eq!(r.pieces().iter().map(|p| p.1).sum::<u64>(), r.len);
                            live.push(r);
                        }
                    }
                    _ if !live.is_empty() => {
                        let r = live.swap_remove(n as usize % live.len());
                        a.free(r);
                    }
                    _ => {}
                }
                let mut spans: Vec<(u64, u64)> =
                    live.iter().flat_map(|r| r.pieces().to_vec()).collect();
                spans.sort_unstable();
                for w in spans.windows(2) {
                    prop_assert!(w[0].0 + w[0].1 <= w[1].0);
                }
                let held: u64 = live.iter().map(|r| r.len).sum();
                prop_assert_eq!(a.allocated(), held);
            }
            for r in live {
                a.free(r);
            }
            prop_assert_eq!(a.free_ranges(), 2);
        }
    }
}
