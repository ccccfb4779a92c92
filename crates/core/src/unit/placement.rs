//! Where a value is: its placement in the slab (or on disk), in the one
//! vocabulary the core and the wire share.

use crate::slab::Region;
use crate::{BlobId, SlabRange};

/// Where a value's bytes are: its placement, in one [`SlabRange`], in
/// several, or on disk. (The words: a value's **placement**, made of slab
/// ranges; a found key is **placed**, [`Placed`].)
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// In the slab, in one range.
    Memory(SlabRange),
    /// In the slab, in several ranges (its blob is made of pieces and the
    /// value crosses from one to the next): its bytes are these, in order.
    Split(Vec<SlabRange>),
    /// Only in its blob's disk file, at `offset` from the blob's start.
    Disk { blob: BlobId, offset: u64, len: u64 },
}

impl Placement {
    /// Where bytes `offset..offset + len` of `region` are. Inlined into a
    /// resolve's loop: its answer, returned through memory in narrower
    /// stores than the loop reads it with, stalled on store forwarding.
    #[inline]
    pub(super) fn of(region: &Region, offset: u64, len: u64) -> Placement {
        // Most values lie in one piece: no vector of parts for them.
        match region.locate_one(offset, len) {
            Some(at) => Placement::Memory(SlabRange { offset: at, len }),
            None => Placement::of_parts(region, offset, len),
        }
    }

    /// [`Placement::of`] of a range not in one piece (or empty).
    #[inline(never)]
    fn of_parts(region: &Region, offset: u64, len: u64) -> Placement {
        let parts = region.locate(offset, len);
        match parts.as_slice() {
            [] => Placement::Memory(SlabRange {
                offset: region.slab_offset(offset),
                len: 0,
            }),
            [(o, l)] => Placement::Memory(SlabRange {
                offset: *o,
                len: *l,
            }),
            _ => Placement::Split(
                parts
                    .into_iter()
                    .map(|(offset, len)| SlabRange { offset, len })
                    .collect(),
            ),
        }
    }

    pub fn len(&self) -> u64 {
        match self {
            Placement::Memory(l) => l.len,
            Placement::Split(parts) => parts.iter().map(|l| l.len).sum(),
            Placement::Disk { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A found key: its value's placement, and the metadata stored with it.
pub type Placed = (Placement, crate::Meta);
