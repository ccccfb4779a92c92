//! A unit's disk tier at run time: its file engine and directory, the
//! heap budget of reads from disk, I/O counters, puts whose files failed,
//! and how spilled values are brought back for a reader (promoted into
//! the slab, or checked and streamed from their files).

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Instant;

use crate::disk::{self};

/// A unit's disk tier at run time.
pub(crate) struct DiskTier {
    pub(crate) engine: disk::FileEngine,
    pub(crate) dir: disk::OwnedDir,
    /// Blob files whose bytes are written, waiting to be synced and
    /// published.
    pub(crate) flush:
        Mutex<std::sync::mpsc::Sender<(stowage_core::BlobId, Box<dyn disk::BlobWriter>)>>,
    /// Batches of spill jobs the core handed out, for the spiller.
    pub(crate) spill: Mutex<std::sync::mpsc::Sender<Vec<stowage_core::SpillJob>>>,
    /// Held by the spiller and the flusher while they write files, so that
    /// teardown removes the directory only once they are idle.
    pub(crate) busy: Mutex<()>,
    /// I/O counters reported in stats.
    pub(crate) io: DiskIo,
    /// The heap that reads from disk may take (buffers).
    pub(crate) reads: ReadBudget,
    /// Puts answered Pending whose files then could not be made durable,
    /// newest last (1024 at most): a later Commit of one is told
    /// what happened instead of "unknown blob".
    pub(crate) failed_puts: Mutex<std::collections::VecDeque<FailedPut>>,
}

/// A put whose blob file failed after its Pending answer.
pub(crate) struct FailedPut {
    pub(crate) blob: stowage_core::BlobId,
    pub(crate) code: stowage_wire::ErrorCode,
    pub(crate) message: String,
}

/// Failed puts remembered (see [`DiskTier::failed_puts`]).
const FAILED_PUTS_KEPT: usize = 1024;

impl DiskTier {
    /// Remember that `blob`'s put, answered Pending, failed with `e`.
    pub(crate) fn put_failed(&self, blob: stowage_core::BlobId, e: &io::Error) {
        let (code, message) = if disk::is_disk_full(e) {
            (
                stowage_wire::ErrorCode::Full,
                format!(
                    "the put of blob {blob:?} was answered Pending, but the unit's disk tier \
                     filled up ({e}) before its file was made durable: nothing of it is \
                     stored; put it again once there is room"
                ),
            )
        } else {
            (
                stowage_wire::ErrorCode::Internal,
                format!(
                    "the put of blob {blob:?} was answered Pending, but its file on the \
                     unit's disk tier could not be made durable ({e}): nothing of it is \
                     stored; put it again"
                ),
            )
        };
        let mut f = self.failed_puts.lock().unwrap_or_else(|p| p.into_inner());
        if f.len() >= FAILED_PUTS_KEPT {
            f.pop_front();
        }
        f.push_back(FailedPut {
            blob,
            code,
            message,
        });
    }

    /// What happened to `blob`'s put, if it failed after Pending.
    pub(crate) fn failed_put(
        &self,
        blob: stowage_core::BlobId,
    ) -> Option<(stowage_wire::ErrorCode, String)> {
        let f = self.failed_puts.lock().unwrap_or_else(|p| p.into_inner());
        f.iter()
            .rev()
            .find(|p| p.blob == blob)
            .map(|p| (p.code, p.message.clone()))
    }
}

/// Largest buffer one disk read takes from the [`ReadBudget`].
const READ_BUF: u64 = 1 << 20;
/// Smallest read budget (one buffer of this size).
const MIN_READ_BUDGET: u64 = 64 << 10;

/// The heap reads from the disk tier may take, as a pool of equal
/// buffers: a reader takes one for the whole of its transfer (a get
/// streams every spilled value it sends through it; a promotion copies a
/// blob into the slab through it), so however many readers there are, the
/// heap they take is at most the budget.
pub(crate) struct ReadBudget {
    buf_len: usize,
    /// Buffers not taken, and free buffers already allocated.
    free: Mutex<(usize, Vec<Vec<u8>>)>,
    returned: std::sync::Condvar,
}

impl ReadBudget {
    pub(crate) fn new(budget: u64) -> Self {
        let budget = budget.max(MIN_READ_BUDGET);
        let buf_len = budget.min(READ_BUF);
        Self {
            buf_len: buf_len as usize,
            free: Mutex::new(((budget / buf_len) as usize, Vec::new())),
            returned: std::sync::Condvar::new(),
        }
    }

    /// Take a buffer, waiting until `until` for one to be given back.
    pub(crate) fn take(&self, until: Instant) -> Option<ReadBuf<'_>> {
        let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if g.0 > 0 {
                g.0 -= 1;
                let buf = g.1.pop().unwrap_or_else(|| vec![0u8; self.buf_len]);
                return Some(ReadBuf { budget: self, buf });
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            g = self
                .returned
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A buffer of the [`ReadBudget`], given back on drop.
pub(crate) struct ReadBuf<'a> {
    budget: &'a ReadBudget,
    buf: Vec<u8>,
}

impl std::ops::Deref for ReadBuf<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl std::ops::DerefMut for ReadBuf<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

impl Drop for ReadBuf<'_> {
    fn drop(&mut self) {
        let mut g = self.budget.free.lock().unwrap_or_else(|p| p.into_inner());
        g.0 += 1;
        g.1.push(std::mem::take(&mut self.buf));
        self.budget.returned.notify_one();
    }
}

#[cfg(test)]
mod read_budget_tests {
    use super::*;
    use std::time::Duration;

    /// The budget is a fixed number of buffers: a reader past it waits
    /// until its deadline (None), or until one is given back.
    #[test]
    fn readers_past_the_budget_wait_then_get_none() {
        let b = ReadBudget::new(3 << 20);
        let soon = || Instant::now() + Duration::from_millis(20);
        let held: Vec<_> = (0..3).map(|_| b.take(soon()).unwrap()).collect();
        assert!(held.iter().all(|h| h.len() == 1 << 20));
        assert!(b.take(soon()).is_none());
        std::thread::scope(|s| {
            let waiter = s.spawn(|| b.take(Instant::now() + Duration::from_secs(10)).is_some());
            std::thread::sleep(Duration::from_millis(50));
            drop(held);
            assert!(waiter.join().unwrap());
        });
        // A budget below one buffer still has one, of the budget's size.
        let small = ReadBudget::new(1);
        let one = small.take(soon()).unwrap();
        assert_eq!(one.len() as u64, MIN_READ_BUDGET);
        assert!(small.take(soon()).is_none());
    }
}

/// Disk tier I/O counters.
#[derive(Default)]
pub(crate) struct DiskIo {
    pub(crate) write_bytes: std::sync::atomic::AtomicU64,
    pub(crate) write_micros: std::sync::atomic::AtomicU64,
    pub(crate) read_bytes: std::sync::atomic::AtomicU64,
    pub(crate) read_micros: std::sync::atomic::AtomicU64,
}

impl DiskIo {
    pub(crate) fn wrote(&self, bytes: u64, since: Instant) {
        self.write_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.write_micros
            .fetch_add(since.elapsed().as_micros() as u64, Ordering::Relaxed);
    }

    pub(crate) fn read(&self, bytes: u64, since: Instant) {
        self.read_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.read_micros
            .fetch_add(since.elapsed().as_micros() as u64, Ordering::Relaxed);
    }
}

/// A found value as a connection serves it.
pub(crate) enum Served {
    /// In the slab (possibly just brought back from disk).
    Memory(stowage_core::SlabRange, stowage_core::Meta),
    /// In the slab, across pieces: its bytes are these ranges, in order.
    Split(Vec<stowage_core::SlabRange>, stowage_core::Meta),
    /// Only on disk: `len` bytes at `offset` into the blob, streamed from
    /// its file as the reply is written ([`read_through`]).
    Disk {
        blob: stowage_core::BlobId,
        offset: u64,
        len: u64,
        meta: stowage_core::Meta,
    },
    /// Its blob's file failed its checksum, is not that blob's, or could
    /// not be read.
    Corrupt,
}

/// Pieces of a slab range copied through the heap at a time (disk tier
/// and checkpoint I/O).
pub(crate) const COPY_CHUNK: usize = 1 << 20;

pub(crate) use crate::disk::read_through;

/// The first `len` bytes of a region made of `pieces` ((slab offset,
/// bytes) each, in order): the ranges they lie in, in order.
pub(crate) fn cut(pieces: &[(u64, u64)], len: u64) -> Vec<(u64, u64)> {
    let mut left = len;
    let mut out = Vec::with_capacity(pieces.len());
    for &(offset, n) in pieces {
        if left == 0 {
            break;
        }
        let n = n.min(left);
        out.push((offset, n));
        left -= n;
    }
    out
}

/// Writes a stream of bytes into the slab ranges `ranges`, in order (a
/// blob in pieces, filled from a file or a checkpoint).
pub(crate) struct PieceWriter<'a> {
    slab: &'a stowage_shm::Slab,
    ranges: Vec<(u64, u64)>,
    at: usize,
    done: u64,
}

impl<'a> PieceWriter<'a> {
    pub(crate) fn new(slab: &'a stowage_shm::Slab, ranges: Vec<(u64, u64)>) -> Self {
        Self {
            slab,
            ranges,
            at: 0,
            done: 0,
        }
    }

    /// Write `bytes` next; past the last range is an error.
    pub(crate) fn write(&mut self, mut bytes: &[u8]) -> std::io::Result<()> {
        while !bytes.is_empty() {
            let Some(&(offset, len)) = self.ranges.get(self.at) else {
                return Err(std::io::Error::other(
                    "more bytes than the blob's ranges hold",
                ));
            };
            let n = ((len - self.done) as usize).min(bytes.len());
            self.slab
                .write(offset + self.done, &bytes[..n])
                .map_err(std::io::Error::other)?;
            self.done += n as u64;
            bytes = &bytes[n..];
            if self.done == len {
                self.at += 1;
                self.done = 0;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod piece_tests {
    use super::cut;

    #[test]
    fn cut_stops_at_the_length() {
        assert_eq!(cut(&[(0, 64), (640, 128)], 100), vec![(0, 64), (640, 36)]);
        assert_eq!(cut(&[(0, 64), (640, 128)], 64), vec![(0, 64)]);
        assert_eq!(cut(&[(0, 64)], 0), Vec::<(u64, u64)>::new());
    }
}
