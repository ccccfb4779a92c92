//! Byte-range allocator for one unit's slab.
//!
//! A thin layer over `offset-allocator` (a two-level segregated-fit
//! allocator with O(1) alloc/free): the slab is counted in 64-byte units so
//! that every blob starts on a cache-line boundary and a `u32` unit count
//! covers slabs up to 256 GiB.

use offset_allocator::{Allocation, Allocator};

/// Every blob starts on a multiple of this many bytes.
pub const ALIGN: u64 = 64;

/// Largest slab the allocator can address (`u32::MAX` units of [`ALIGN`]).
pub const MAX_CAPACITY: u64 = (u32::MAX as u64 - 1) * ALIGN;

/// A region handed out by [`SlabAllocator::allocate`]: the right to one
/// byte range of the slab. Neither `Copy` nor `Clone`: giving it back
/// ([`SlabAllocator::free`]) consumes it, so a range cannot be freed twice:
///
/// ```compile_fail,E0382
/// use stowage_core::slab::SlabAllocator;
/// let mut slab = SlabAllocator::new(4096);
/// let r = slab.allocate(64).unwrap();
/// slab.free(r);
/// slab.free(r); // error[E0382]: use of moved value: `r`
/// ```
///
/// Freed once, it compiles:
///
/// ```
/// use stowage_core::slab::SlabAllocator;
/// let mut slab = SlabAllocator::new(4096);
/// let r = slab.allocate(64).unwrap();
/// slab.free(r);
/// assert_eq!(slab.allocated(), 0);
/// ```
pub struct Region {
    /// Byte offset in the slab (a multiple of [`ALIGN`]).
    pub offset: u64,
    /// Bytes reserved (the request rounded up to [`ALIGN`], at least one unit).
    pub len: u64,
    handle: Allocation,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

/// Hands out non-overlapping, aligned byte ranges of `[0, capacity)`.
pub struct SlabAllocator {
    inner: Allocator,
    capacity: u64,
    allocated: u64,
}

impl SlabAllocator {
    /// An allocator over `capacity` bytes (rounded down to [`ALIGN`]).
    ///
    /// # Panics
    /// If `capacity` exceeds [`MAX_CAPACITY`]; the unit's config rejects such
    /// sizes before they get here.
    pub fn new(capacity: u64) -> Self {
        assert!(capacity <= MAX_CAPACITY, "slab capacity over the limit");
        let units = (capacity / ALIGN) as u32;
        // One node per live allocation (about 28 bytes each, allocated up
        // front). A blob is at least one unit, but a blob is a whole put's
        // share of a unit, far larger in practice: one node per 4 KiB keeps
        // the table under 1% of the slab (the unit's resident memory target
        // is slab + 5%).
        let max_allocs = (units / 64).clamp(1024, 4 * 1024 * 1024);
        Self {
            inner: Allocator::with_max_allocs(units.max(1), max_allocs),
            capacity: u64::from(units) * ALIGN,
            allocated: 0,
        }
    }

    /// Bytes under management.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes currently handed out.
    pub fn allocated(&self) -> u64 {
        self.allocated
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

    /// Reserve `nbytes`, or `None` when no free range is large enough.
    pub fn allocate(&mut self, nbytes: u64) -> Option<Region> {
        let len = Self::rounded(nbytes);
        if len > self.capacity - self.allocated {
            return None;
        }
        let units = u32::try_from(len / ALIGN).ok()?;
        let handle = self.inner.allocate(units)?;
        self.allocated += len;
        Some(Region {
            offset: u64::from(handle.offset) * ALIGN,
            len,
            handle,
        })
    }

    /// Give a region back. It is consumed, so each is freed at most once;
    /// the unit core gives every range back through one function
    /// (`UnitCore::release`, with the reason).
    pub fn free(&mut self, region: Region) {
        self.allocated -= region.len;
        self.inner.free(region.handle);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_aligned_and_disjoint() {
        let mut a = SlabAllocator::new(1 << 20);
        let r1 = a.allocate(1).unwrap();
        let r2 = a.allocate(100).unwrap();
        assert_eq!(r1.len, 64);
        assert_eq!(r2.len, 128);
        assert_eq!(r1.offset % ALIGN, 0);
        assert_eq!(r2.offset % ALIGN, 0);
        assert!(r1.offset + r1.len <= r2.offset || r2.offset + r2.len <= r1.offset);
        assert_eq!(a.allocated(), 192);
        a.free(r1);
        a.free(r2);
        assert_eq!(a.allocated(), 0);
    }

    #[test]
    fn full_is_none_and_free_makes_room() {
        let mut a = SlabAllocator::new(4096);
        let r = a.allocate(4096).unwrap();
        assert!(a.allocate(1).is_none());
        a.free(r);
        assert!(a.allocate(4096).is_some());
    }
}
