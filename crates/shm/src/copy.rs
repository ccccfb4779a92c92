//! Large copies split over threads of one pool.

use crate::PARALLEL_COPY_MIN;

/// Copy `src` into `dst` (equal lengths) the way the slab's copies go:
/// split over [`copy_threads`] threads of the same pool, or over `threads`
/// when given. For benchmarks: the memcpy limit at the thread count stowage
/// copies with, without a thread started per copy.
pub fn copy_split(dst: &mut [u8], src: &[u8], threads: Option<usize>) {
    assert_eq!(dst.len(), src.len(), "copy_split needs equal lengths");
    let threads = threads.unwrap_or_else(|| copy_threads(src.len())).max(1);
    if threads == 1 {
        dst.copy_from_slice(src);
        return;
    }
    let chunk = src.len().div_ceil(threads).div_ceil(4096).max(1) * 4096;
    rayon::scope(|s| {
        for (d, c) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
            s.spawn(move |_| d.copy_from_slice(c));
        }
    });
}

/// How many threads a copy of `total` bytes is split over.
pub fn copy_threads(total: usize) -> usize {
    if total >= PARALLEL_COPY_MIN {
        rayon::current_num_threads().clamp(1, 4)
    } else {
        1
    }
}

/// Run `copy(offset, len)` over `[0, total)`: inline for small sizes, split
/// over the available cores (at most 4) for large ones, on rayon's pool
/// (no thread started per copy: that cost 20-40 us here).
pub(crate) fn parallel_chunks(total: usize, copy: impl Fn(usize, usize) + Sync) {
    let threads = copy_threads(total);
    if threads <= 1 {
        copy(0, total);
        return;
    }
    // Chunks aligned to 4 KiB so threads do not share pages at the seams.
    let chunk = total.div_ceil(threads).div_ceil(4096) * 4096;
    rayon::scope(|s| {
        let copy = &copy;
        for i in 1..threads {
            let off = i * chunk;
            if off < total {
                s.spawn(move |_| copy(off, chunk.min(total - off)));
            }
        }
        copy(0, chunk.min(total));
    });
}
