//! The blob file format (see the [module docs](super)): the reader that
//! checks a file chunk by chunk, the writer that makes one, and why a read
//! fails.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::AtFlags;
use stowage_core::BlobId;
use xxhash_rust::xxh3::{xxh3_64, Xxh3Default};

pub(super) const MAGIC: &[u8; 4] = b"STWB";
pub(super) const VERSION: u32 = 3;
pub(super) const HEADER: u64 = 64;
/// Version 2's header: no blob id, no instance.
pub(super) const V2_HEADER: u64 = 32;
/// Bytes per checked chunk in the files this engine writes. A read of a
/// few bytes reads and checks one or two chunks; the table costs 8 bytes
/// per chunk on disk (0.012%) and in a writer's memory until `finish`.
pub const CHUNK: u32 = 64 << 10;
/// Largest chunk size a file may declare (bounds a reader's buffer).
pub(super) const MAX_CHUNK: u32 = 64 << 20;
/// Size of a checksum in the chunk table.
pub(super) const SUM: u64 = 8;
/// Whole chunks are read with one pread of up to this many bytes and
/// hashed while they are still in cache.
pub(super) const READ_RUN: u64 = 256 << 10;
/// Chunk sums are read this many at a time.
pub(super) const SUMS_AT_ONCE: usize = 512;
/// Version 1: `STWB` · 1 · n · the bytes · xxh3-64 of the bytes.
pub(super) const V1_HEADER: u64 = 16;
pub(super) const V1_TRAILER: u64 = 8;

thread_local! {
    /// The chunk-sized buffer through which this thread reads a chunk of
    /// which only part is wanted (`BlobReader::read_at`: nearly every
    /// value read from the disk tier starts or ends inside a chunk). One
    /// per thread that reads, not an allocation per read: at 1,600 reads a
    /// second, a 64 KiB buffer each, the allocator kept megabytes of freed
    /// pages resident (docs/benchmarks.md, Soak). A read that fails leaves
    /// it to be made anew.
    static PARTIAL: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Where this thread's partial-chunk buffer is and how large (tests).
#[cfg(test)]
pub(super) fn partial_buffer() -> (usize, usize) {
    PARTIAL.with(|p| {
        let v = p.take();
        let at = (v.as_ptr() as usize, v.capacity());
        p.set(v);
        at
    })
}

#[cfg(test)]
thread_local! {
    /// Bytes this thread's [`BlobReader`]s have read from their files
    /// (headers, data and sums), for tests that count passes over a file.
    pub(crate) static BYTES_READ: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// `read_exact_at`, counted in tests ([`BYTES_READ`]).
pub(super) fn pread(file: &File, buf: &mut [u8], at: u64) -> io::Result<()> {
    file.read_exact_at(buf, at)?;
    #[cfg(test)]
    BYTES_READ.with(|n| n.set(n.get() + buf.len() as u64));
    Ok(())
}

/// Why a blob could not be read back.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The file is missing, short, not the blob's, or a checksum does not
    /// match.
    #[error("blob file {path} is corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    /// The range asked for is not inside the blob (the caller's mistake,
    /// or an index that does not match the file).
    #[error("blob file {path} holds {size} bytes; cannot read {len} at {offset}")]
    OutOfRange {
        path: PathBuf,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("disk i/o: {0}")]
    Io(#[from] io::Error),
}

/// Whether an I/O error means the disk (or the user's quota on it) is
/// full: ENOSPC or EDQUOT.
pub fn is_disk_full(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
    )
}

/// Where and how blob bytes are stored on disk.
/// A blob file being written.
pub trait BlobWriter: Send {
    /// Append bytes; any piece sizes, `nbytes` in all.
    fn write(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// Check the length, append the chunk checksums, sync, and give the
    /// file its final name. Returns the xxh3 of the whole file (for
    /// manifests). A disk that filled up is an error of kind
    /// `StorageFull` (see [`is_disk_full`]).
    fn finish(self: Box<Self>) -> io::Result<u64>;
}

pub(super) fn corrupt(path: &Path, reason: String) -> DiskError {
    DiskError::Corrupt {
        path: path.to_owned(),
        reason,
    }
}

pub(super) fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    u64::from_le_bytes(a)
}

pub(super) fn le_u128(b: &[u8]) -> u128 {
    let mut a = [0u8; 16];
    a.copy_from_slice(b);
    u128::from_le_bytes(a)
}

pub(super) fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(b);
    u32::from_le_bytes(a)
}

/// The header of a version 3 file.
pub(super) fn header(
    nbytes: u64,
    chunk: u32,
    blob: BlobId,
    instance: u128,
) -> [u8; HEADER as usize] {
    let mut h = [0u8; HEADER as usize];
    h[..4].copy_from_slice(MAGIC);
    h[4..8].copy_from_slice(&VERSION.to_le_bytes());
    h[8..16].copy_from_slice(&nbytes.to_le_bytes());
    h[16..20].copy_from_slice(&chunk.to_le_bytes());
    h[24..40].copy_from_slice(&blob.0.to_le_bytes());
    h[40..56].copy_from_slice(&instance.to_le_bytes());
    let sum = xxh3_64(&h[..56]);
    h[56..64].copy_from_slice(&sum.to_le_bytes());
    h
}

pub(super) enum Format {
    V1,
    /// Versions 2 and 3: the bytes start at `data`.
    Chunked {
        chunk: u64,
        data: u64,
    },
}

/// An open blob file whose header and length have been checked.
pub struct BlobReader {
    pub(super) file: File,
    pub(super) path: PathBuf,
    pub(super) nbytes: u64,
    pub(super) format: Format,
}

impl BlobReader {
    /// The blob's size in bytes.
    pub fn size(&self) -> u64 {
        self.nbytes
    }

    /// Read `dst.len()` bytes at `offset` of the data, checked.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), DiskError> {
        let len = dst.len() as u64;
        let end = match offset.checked_add(len) {
            Some(end) if end <= self.nbytes => end,
            _ => {
                return Err(DiskError::OutOfRange {
                    path: self.path.clone(),
                    offset,
                    len,
                    size: self.nbytes,
                })
            }
        };
        match self.format {
            Format::Chunked { chunk, data } => self.read_chunked(chunk, data, offset, end, dst),
            Format::V1 => self.read_v1(offset, end, dst),
        }
    }

    /// Read and check the chunks overlapping `offset..end`: runs of whole
    /// chunks straight into `dst`, a partly wanted chunk (at either end)
    /// into one chunk-sized buffer.
    fn read_chunked(
        &self,
        chunk: u64,
        data: u64,
        offset: u64,
        end: u64,
        dst: &mut [u8],
    ) -> Result<(), DiskError> {
        let mut sums = Sums {
            file: &self.file,
            at: data + self.nbytes,
            count: self.nbytes.div_ceil(chunk),
            first: 0,
            n: 0,
            buf: [0u8; SUMS_AT_ONCE * SUM as usize],
        };
        let check = |c: u64, bytes: &[u8], sums: &mut Sums| -> Result<(), DiskError> {
            if xxh3_64(bytes) == sums.get(c)? {
                Ok(())
            } else {
                Err(corrupt(&self.path, format!("chunk {c} checksum mismatch")))
            }
        };
        // Index into `dst` of data offset `at`.
        let ix = |at: u64| (at - offset) as usize;
        // A partly wanted chunk goes through this thread's buffer (a chunk
        // of another size, through its own).
        let mut own = Vec::new();
        let mut kept = (chunk <= u64::from(CHUNK))
            .then(|| PARTIAL.try_with(|p| p.take()).ok())
            .flatten();
        let partial = kept.as_mut().unwrap_or(&mut own);
        let mut pos = offset;
        while pos < end {
            let c = pos / chunk;
            let start = c * chunk;
            let stop = (start + chunk).min(self.nbytes);
            if pos == start && stop <= end {
                // Whole chunks from here to the last one that ends by `end`.
                let mut run_end = if end == self.nbytes {
                    end
                } else {
                    end / chunk * chunk
                };
                run_end = run_end.min(pos + (READ_RUN / chunk).max(1) * chunk);
                let run = &mut dst[ix(pos)..ix(run_end)];
                pread(&self.file, run, data + pos)?;
                for (i, bytes) in run.chunks(chunk as usize).enumerate() {
                    check(c + i as u64, bytes, &mut sums)?;
                }
                pos = run_end;
            } else {
                partial.resize((stop - start) as usize, 0);
                pread(&self.file, partial, data + start)?;
                check(c, partial, &mut sums)?;
                let upto = stop.min(end);
                dst[ix(pos)..ix(upto)]
                    .copy_from_slice(&partial[(pos - start) as usize..(upto - start) as usize]);
                pos = upto;
            }
        }
        if let Some(buf) = kept {
            let _ = PARTIAL.try_with(|p| p.replace(buf));
        }
        Ok(())
    }

    /// Pass all the blob's bytes to `sink`, in order, in pieces of at most
    /// `buf.len()` bytes, reading the file once; a sink error is returned
    /// inside `Ok`, and stops the copy.
    ///
    /// Versions 2 and 3 go through `read_through`: each piece is
    /// checked before `sink` sees it. A version 1 file has one checksum for
    /// all its data, known only once all of it is read: its pieces reach
    /// `sink` BEFORE they are checked, and a mismatch is reported as
    /// [`DiskError::Corrupt`] after the last one. So the caller must keep
    /// what `sink` got out of every client's reach until this returns
    /// `Ok(Ok(()))`, and drop it otherwise. (Reading such a file through
    /// [`Self::read_at`] piece by piece would read and hash the whole file
    /// for every piece.)
    pub fn copy_all(
        &self,
        buf: &mut [u8],
        mut sink: impl FnMut(&[u8]) -> io::Result<()>,
    ) -> Result<io::Result<()>, DiskError> {
        let Format::V1 = self.format else {
            return read_through(self, 0, self.nbytes, buf, sink);
        };
        assert!(!buf.is_empty() || self.nbytes == 0, "an empty buffer");
        let mut hash = Xxh3Default::new();
        let mut at = 0;
        while at < self.nbytes {
            let n = (self.nbytes - at).min(buf.len() as u64);
            let piece = &mut buf[..n as usize];
            pread(&self.file, piece, V1_HEADER + at)?;
            hash.update(piece);
            if let Err(e) = sink(piece) {
                return Ok(Err(e));
            }
            at += n;
        }
        let mut sum = [0u8; 8];
        pread(&self.file, &mut sum, V1_HEADER + self.nbytes)?;
        if hash.digest() != u64::from_le_bytes(sum) {
            return Err(corrupt(&self.path, "checksum mismatch".into()));
        }
        Ok(Ok(()))
    }

    /// A version 1 file has one checksum for all its data: read all of it
    /// through a buffer, keeping the wanted range.
    fn read_v1(&self, offset: u64, end: u64, dst: &mut [u8]) -> Result<(), DiskError> {
        let mut hash = Xxh3Default::new();
        let mut buf = vec![0u8; self.nbytes.min(READ_RUN) as usize];
        let mut at = 0;
        while at < self.nbytes {
            let n = (self.nbytes - at).min(READ_RUN);
            let piece = &mut buf[..n as usize];
            pread(&self.file, piece, V1_HEADER + at)?;
            hash.update(piece);
            let (lo, hi) = (offset.max(at), end.min(at + n));
            if lo < hi {
                dst[(lo - offset) as usize..(hi - offset) as usize]
                    .copy_from_slice(&piece[(lo - at) as usize..(hi - at) as usize]);
            }
            at += n;
        }
        let mut sum = [0u8; 8];
        pread(&self.file, &mut sum, V1_HEADER + self.nbytes)?;
        if hash.digest() != u64::from_le_bytes(sum) {
            return Err(corrupt(&self.path, "checksum mismatch".into()));
        }
        Ok(())
    }
}

/// A window onto a file's table of chunk sums, read as the reader moves.
pub(super) struct Sums<'a> {
    pub(super) file: &'a File,
    /// Where the table starts in the file.
    pub(super) at: u64,
    /// Sums in the table.
    pub(super) count: u64,
    /// The window: sums `first..first + n`.
    pub(super) first: u64,
    pub(super) n: u64,
    pub(super) buf: [u8; SUMS_AT_ONCE * SUM as usize],
}

impl Sums<'_> {
    fn get(&mut self, c: u64) -> io::Result<u64> {
        if c < self.first || c >= self.first + self.n {
            let n = (self.count - c).min(SUMS_AT_ONCE as u64);
            pread(
                self.file,
                &mut self.buf[..(n * SUM) as usize],
                self.at + c * SUM,
            )?;
            (self.first, self.n) = (c, n);
        }
        let i = ((c - self.first) * SUM) as usize;
        Ok(le_u64(&self.buf[i..i + SUM as usize]))
    }
}

pub(super) struct FileWriter {
    pub(super) file: File,
    pub(super) dir: Arc<OwnedFd>,
    pub(super) tmp: String,
    pub(super) dst: String,
    pub(super) expected: u64,
    pub(super) written: u64,
    pub(super) chunk: u64,
    /// Bytes of the current chunk so far, and their hash.
    pub(super) in_chunk: u64,
    pub(super) chunk_hash: Xxh3Default,
    /// The table of chunk sums so far, as it goes into the file.
    pub(super) sums: Vec<u8>,
    /// Of the whole file, header and table included.
    pub(super) file_hash: Xxh3Default,
    /// Set by a failpoint, or by a write that failed (the file may then
    /// hold part of its bytes): every later call fails, with the same
    /// kind of error (a full disk stays a full disk).
    pub(super) failed: Option<(io::ErrorKind, String)>,
    /// The disk-sync failpoint.
    pub(super) fail_finish: bool,
}

impl FileWriter {
    fn fail(&mut self, kind: io::ErrorKind, why: String) -> io::Error {
        self.failed = Some((kind, why.clone()));
        io::Error::new(kind, why)
    }

    fn remove_tmp(&self) {
        let _ = rustix::fs::unlinkat(self.dir.as_fd(), self.tmp.as_str(), AtFlags::empty());
    }
}

impl BlobWriter for FileWriter {
    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        if let Some((kind, why)) = &self.failed {
            return Err(io::Error::new(*kind, why.clone()));
        }
        if bytes.len() as u64 > self.expected - self.written {
            return Err(self.fail(
                io::ErrorKind::InvalidInput,
                format!("blob file given more than its {} bytes", self.expected),
            ));
        }
        if let Err(e) = self.file.write_all(bytes) {
            return Err(self.fail(e.kind(), format!("writing the blob file: {e}")));
        }
        self.file_hash.update(bytes);
        let mut rest = bytes;
        while !rest.is_empty() {
            let room = (self.chunk - self.in_chunk) as usize;
            let (now, later) = rest.split_at(room.min(rest.len()));
            self.chunk_hash.update(now);
            self.written += now.len() as u64;
            self.in_chunk += now.len() as u64;
            if self.in_chunk == self.chunk {
                self.in_chunk = 0;
                self.sums
                    .extend_from_slice(&self.chunk_hash.digest().to_le_bytes());
                self.chunk_hash.reset();
            }
            rest = later;
        }
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> io::Result<u64> {
        if let Some((kind, why)) = &self.failed {
            self.remove_tmp();
            return Err(io::Error::new(*kind, why.clone()));
        }
        if self.written != self.expected {
            self.remove_tmp();
            return Err(io::Error::other(format!(
                "blob file got {} of {} bytes",
                self.written, self.expected
            )));
        }
        if self.fail_finish {
            self.remove_tmp();
            return Err(io::Error::other("failpoint disk-sync"));
        }
        if self.in_chunk > 0 {
            let last = self.chunk_hash.digest().to_le_bytes();
            self.sums.extend_from_slice(&last);
        }
        self.file_hash.update(&self.sums);
        let r = self
            .file
            .write_all(&self.sums)
            .and_then(|()| self.file.sync_data())
            .and_then(|()| {
                Ok(rustix::fs::renameat(
                    self.dir.as_fd(),
                    self.tmp.as_str(),
                    self.dir.as_fd(),
                    self.dst.as_str(),
                )?)
            });
        if r.is_err() {
            self.remove_tmp();
        }
        r.map(|()| self.file_hash.digest())
    }
}

/// Read `len` bytes at `offset` of an open blob file through `buf`, piece
/// by piece (each checked; pieces end on the file's chunk boundaries where
/// they can, so no chunk is read twice), handing each piece to `sink`. The
/// outer error is the file's, the inner one the sink's.
pub fn read_through(
    reader: &BlobReader,
    offset: u64,
    len: u64,
    buf: &mut [u8],
    mut sink: impl FnMut(&[u8]) -> io::Result<()>,
) -> Result<io::Result<()>, DiskError> {
    let chunk = u64::from(CHUNK);
    let end = offset
        .checked_add(len)
        .filter(|&e| e <= reader.size())
        .ok_or_else(|| DiskError::OutOfRange {
            path: PathBuf::new(),
            offset,
            len,
            size: reader.size(),
        })?;
    let mut pos = offset;
    while pos < end {
        let mut stop = (pos + buf.len() as u64).min(end);
        let aligned = stop / chunk * chunk;
        if stop < end && aligned > pos {
            stop = aligned;
        }
        let piece = &mut buf[..(stop - pos) as usize];
        reader.read_at(pos, piece)?;
        if let Err(e) = sink(piece) {
            return Ok(Err(e));
        }
        pos = stop;
    }
    Ok(Ok(()))
}
