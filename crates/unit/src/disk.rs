//! The disk tier: one owner-only, locked directory per unit, one file per
//! spilled blob, checked chunk by chunk.
//!
//! A blob file (format version 2; integers little-endian):
//!
//! ```text
//!  0       "STWB"  version: u32 = 2  byte count n: u64  chunk size c: u32  0: u32
//!  24      xxh3-64 of bytes 0..24
//!  32      the n bytes
//!  32 + n  ⌈n / c⌉ × xxh3-64, one per c-byte chunk of the bytes (the last
//!          chunk may be short); nothing else follows
//! ```
//!
//! Files are written under a temporary name, synced and renamed, so a file
//! that exists under its blob's name is complete. A read checks the header
//! and that the file's length is the one it implies, then reads and checks
//! only the chunks that overlap the range asked for; it reports
//! [`DiskError::Corrupt`] rather than ever returning bytes that fail their
//! chunk's checksum. Whole-blob reads also accept version 1 files
//! (`STWB` · 1 · n · the bytes · xxh3-64 of the bytes), which checkpoints
//! written before version 2 hold.
//!
//! The engine sits behind [`DiskEngine`] (plain pread/pwrite here; another
//! engine, e.g. io_uring, can take its place) with a failpoint seam
//! ([`Failpoints`]) for tests.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rustix::fs::FlockOperation;
use stowage_core::BlobId;
use xxhash_rust::xxh3::{xxh3_64, Xxh3Default};

const MAGIC: &[u8; 4] = b"STWB";
const VERSION: u32 = 2;
const HEADER: u64 = 32;
/// Bytes per checked chunk in the files this engine writes. A read of a
/// few bytes reads and checks one or two chunks; the table costs 8 bytes
/// per chunk on disk (0.012%) and in a writer's memory until `finish`.
const CHUNK: u32 = 64 << 10;
/// Largest chunk size a file may declare (bounds a reader's buffer).
const MAX_CHUNK: u32 = 64 << 20;
/// Size of a checksum in the chunk table.
const SUM: u64 = 8;
/// Whole chunks are read with one pread of up to this many bytes and
/// hashed while they are still in cache.
const READ_RUN: u64 = 256 << 10;
/// Chunk sums are read this many at a time.
const SUMS_AT_ONCE: usize = 512;
/// Version 1: `STWB` · 1 · n · the bytes · xxh3-64 of the bytes.
const V1_HEADER: u64 = 16;
const V1_TRAILER: u64 = 8;

/// Why a blob could not be read back.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The file is missing, short, or a checksum does not match.
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

/// Named failpoints at the disk seam, for tests.
#[derive(Debug, Default)]
pub struct Failpoints {
    /// Every blob write fails with an I/O error.
    pub disk_write: AtomicBool,
}

impl Failpoints {
    /// Parse `name` (`disk-write`) and turn it on.
    pub fn enable(&self, name: &str) -> Result<(), String> {
        match name {
            "disk-write" => self.disk_write.store(true, Ordering::SeqCst),
            other => return Err(format!("unknown failpoint {other:?} (known: disk-write)")),
        }
        Ok(())
    }
}

/// Where and how blob bytes are stored on disk.
pub trait DiskEngine: Send + Sync {
    /// Start writing `blob`'s file of `nbytes` bytes.
    fn create(&self, blob: BlobId, nbytes: u64) -> io::Result<Box<dyn BlobWriter>>;
    /// Read the whole blob into `dst` (exactly its size), checking all of
    /// it.
    fn read(&self, blob: BlobId, dst: &mut [u8]) -> Result<(), DiskError>;
    /// Read `dst.len()` bytes at `offset` in the blob into `dst`, reading
    /// and checking only the chunks that overlap them (so damage elsewhere
    /// in the file may go unnoticed; [`DiskEngine::read`] notices it). A
    /// range not inside the blob is [`DiskError::OutOfRange`]. On an
    /// error, `dst` holds unspecified bytes.
    fn read_at(&self, blob: BlobId, offset: u64, dst: &mut [u8]) -> Result<(), DiskError>;
    /// The blob's size in bytes, from its file's (checked) header.
    fn blob_size(&self, blob: BlobId) -> Result<u64, DiskError>;
    /// Remove the blob's file (a missing file is not an error).
    fn delete(&self, blob: BlobId) -> io::Result<()>;
    /// The blob's file path (for checkpoints and tests).
    fn path(&self, blob: BlobId) -> PathBuf;
}

/// A blob file being written.
pub trait BlobWriter: Send {
    /// Append bytes; any piece sizes, `nbytes` in all.
    fn write(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// Check the length, append the chunk checksums, sync, and give the
    /// file its final name. Returns the xxh3 of the whole file (for
    /// manifests).
    fn finish(self: Box<Self>) -> io::Result<u64>;
}

/// Files in one directory, with plain positioned I/O.
pub struct FileEngine {
    dir: PathBuf,
    /// Chunk size of the files this engine writes.
    chunk: u32,
    pub failpoints: Failpoints,
}

impl FileEngine {
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            chunk: CHUNK,
            failpoints: Failpoints::default(),
        }
    }

    /// One that writes files with `chunk`-byte chunks (for tests).
    #[cfg(test)]
    fn with_chunk(dir: PathBuf, chunk: u32) -> Self {
        assert!((1..=MAX_CHUNK).contains(&chunk));
        Self {
            chunk,
            ..Self::new(dir)
        }
    }

    fn tmp_path(&self, blob: BlobId) -> PathBuf {
        self.dir.join(format!("{:032x}.tmp", blob.0))
    }

    /// Open `blob`'s file and check its header and length.
    fn open(&self, blob: BlobId) -> Result<BlobFile, DiskError> {
        let path = self.path(blob);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) => return Err(corrupt(&path, format!("cannot open: {e}"))),
        };
        let size = file.metadata()?.len();
        let mut head = [0u8; HEADER as usize];
        let got = usize::try_from(size.min(HEADER)).unwrap_or(head.len());
        file.read_exact_at(&mut head[..got], 0)?;
        if got < V1_HEADER as usize || &head[..4] != MAGIC {
            return Err(corrupt(&path, "bad header".into()));
        }
        let nbytes = le_u64(&head[8..16]);
        let (format, want) = match le_u32(&head[4..8]) {
            1 => (
                Format::V1,
                V1_HEADER
                    .checked_add(nbytes)
                    .and_then(|n| n.checked_add(V1_TRAILER)),
            ),
            VERSION => {
                if got < HEADER as usize || xxh3_64(&head[..24]) != le_u64(&head[24..32]) {
                    return Err(corrupt(&path, "header checksum mismatch".into()));
                }
                let chunk = le_u32(&head[16..20]);
                if !(1..=MAX_CHUNK).contains(&chunk) {
                    return Err(corrupt(&path, format!("chunk size {chunk}")));
                }
                let chunk = u64::from(chunk);
                let table = nbytes.div_ceil(chunk).checked_mul(SUM);
                (
                    Format::V2 { chunk },
                    table.and_then(|t| HEADER.checked_add(nbytes)?.checked_add(t)),
                )
            }
            v => return Err(corrupt(&path, format!("format version {v}"))),
        };
        if want != Some(size) {
            return Err(corrupt(
                &path,
                format!("{size} bytes, but its header says {nbytes} bytes of data"),
            ));
        }
        Ok(BlobFile {
            file,
            path,
            nbytes,
            format,
        })
    }
}

fn corrupt(path: &Path, reason: String) -> DiskError {
    DiskError::Corrupt {
        path: path.to_owned(),
        reason,
    }
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    u64::from_le_bytes(a)
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(b);
    u32::from_le_bytes(a)
}

/// The header of a version 2 file.
fn header(nbytes: u64, chunk: u32) -> [u8; HEADER as usize] {
    let mut h = [0u8; HEADER as usize];
    h[..4].copy_from_slice(MAGIC);
    h[4..8].copy_from_slice(&VERSION.to_le_bytes());
    h[8..16].copy_from_slice(&nbytes.to_le_bytes());
    h[16..20].copy_from_slice(&chunk.to_le_bytes());
    let sum = xxh3_64(&h[..24]);
    h[24..32].copy_from_slice(&sum.to_le_bytes());
    h
}

enum Format {
    V1,
    V2 { chunk: u64 },
}

/// An open blob file whose header and length have been checked.
struct BlobFile {
    file: File,
    path: PathBuf,
    nbytes: u64,
    format: Format,
}

impl BlobFile {
    /// Read `dst.len()` bytes at `offset` of the data, checked.
    fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), DiskError> {
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
            Format::V2 { chunk } => self.read_v2(chunk, offset, end, dst),
            Format::V1 => self.read_v1(offset, end, dst),
        }
    }

    /// Read and check the chunks overlapping `offset..end`: runs of whole
    /// chunks straight into `dst`, a partly wanted chunk (at either end)
    /// into one chunk-sized buffer.
    fn read_v2(&self, chunk: u64, offset: u64, end: u64, dst: &mut [u8]) -> Result<(), DiskError> {
        let mut sums = Sums {
            file: &self.file,
            at: HEADER + self.nbytes,
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
        let mut partial = Vec::new();
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
                self.file.read_exact_at(run, HEADER + pos)?;
                for (i, bytes) in run.chunks(chunk as usize).enumerate() {
                    check(c + i as u64, bytes, &mut sums)?;
                }
                pos = run_end;
            } else {
                partial.resize((stop - start) as usize, 0);
                self.file.read_exact_at(&mut partial, HEADER + start)?;
                check(c, &partial, &mut sums)?;
                let upto = stop.min(end);
                dst[ix(pos)..ix(upto)]
                    .copy_from_slice(&partial[(pos - start) as usize..(upto - start) as usize]);
                pos = upto;
            }
        }
        Ok(())
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
            self.file.read_exact_at(piece, V1_HEADER + at)?;
            hash.update(piece);
            let (lo, hi) = (offset.max(at), end.min(at + n));
            if lo < hi {
                dst[(lo - offset) as usize..(hi - offset) as usize]
                    .copy_from_slice(&piece[(lo - at) as usize..(hi - at) as usize]);
            }
            at += n;
        }
        let mut sum = [0u8; 8];
        self.file.read_exact_at(&mut sum, V1_HEADER + self.nbytes)?;
        if hash.digest() != u64::from_le_bytes(sum) {
            return Err(corrupt(&self.path, "checksum mismatch".into()));
        }
        Ok(())
    }
}

/// A window onto a file's table of chunk sums, read as the reader moves.
struct Sums<'a> {
    file: &'a File,
    /// Where the table starts in the file.
    at: u64,
    /// Sums in the table.
    count: u64,
    /// The window: sums `first..first + n`.
    first: u64,
    n: u64,
    buf: [u8; SUMS_AT_ONCE * SUM as usize],
}

impl Sums<'_> {
    fn get(&mut self, c: u64) -> io::Result<u64> {
        if c < self.first || c >= self.first + self.n {
            let n = (self.count - c).min(SUMS_AT_ONCE as u64);
            self.file
                .read_exact_at(&mut self.buf[..(n * SUM) as usize], self.at + c * SUM)?;
            (self.first, self.n) = (c, n);
        }
        let i = ((c - self.first) * SUM) as usize;
        Ok(le_u64(&self.buf[i..i + SUM as usize]))
    }
}

struct FileWriter {
    file: File,
    tmp: PathBuf,
    dst: PathBuf,
    expected: u64,
    written: u64,
    chunk: u64,
    /// Bytes of the current chunk so far, and their hash.
    in_chunk: u64,
    chunk_hash: Xxh3Default,
    /// The table of chunk sums so far, as it goes into the file.
    sums: Vec<u8>,
    /// Of the whole file, header and table included.
    file_hash: Xxh3Default,
    /// Set by the failpoint, or by a write that failed (the file may then
    /// hold part of its bytes): every later call fails.
    failed: Option<String>,
}

impl FileWriter {
    fn fail(&mut self, why: String) -> io::Error {
        self.failed = Some(why.clone());
        io::Error::other(why)
    }
}

impl BlobWriter for FileWriter {
    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        if let Some(why) = &self.failed {
            return Err(io::Error::other(why.clone()));
        }
        if bytes.len() as u64 > self.expected - self.written {
            return Err(self.fail(format!(
                "blob file given more than its {} bytes",
                self.expected
            )));
        }
        if let Err(e) = self.file.write_all(bytes) {
            return Err(self.fail(format!("writing the blob file: {e}")));
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
        if let Some(why) = &self.failed {
            let _ = fs::remove_file(&self.tmp);
            return Err(io::Error::other(why.clone()));
        }
        if self.written != self.expected {
            let _ = fs::remove_file(&self.tmp);
            return Err(io::Error::other(format!(
                "blob file got {} of {} bytes",
                self.written, self.expected
            )));
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
            .and_then(|()| fs::rename(&self.tmp, &self.dst));
        if r.is_err() {
            let _ = fs::remove_file(&self.tmp);
        }
        r.map(|()| self.file_hash.digest())
    }
}

impl DiskEngine for FileEngine {
    fn create(&self, blob: BlobId, nbytes: u64) -> io::Result<Box<dyn BlobWriter>> {
        let failed = self
            .failpoints
            .disk_write
            .load(Ordering::SeqCst)
            .then(|| "failpoint disk-write".to_string());
        let tmp = self.tmp_path(blob);
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        let header = header(nbytes, self.chunk);
        file.write_all(&header)?;
        let mut file_hash = Xxh3Default::new();
        file_hash.update(&header);
        let chunk = u64::from(self.chunk);
        Ok(Box::new(FileWriter {
            file,
            tmp,
            dst: self.path(blob),
            expected: nbytes,
            written: 0,
            chunk,
            in_chunk: 0,
            chunk_hash: Xxh3Default::new(),
            sums: Vec::with_capacity(
                usize::try_from(nbytes.div_ceil(chunk) * SUM)
                    .unwrap_or(0)
                    .min(1 << 20),
            ),
            file_hash,
            failed,
        }))
    }

    fn read(&self, blob: BlobId, dst: &mut [u8]) -> Result<(), DiskError> {
        let f = self.open(blob)?;
        if f.nbytes != dst.len() as u64 {
            return Err(corrupt(
                &f.path,
                format!("holds {} bytes, expected {}", f.nbytes, dst.len()),
            ));
        }
        f.read_at(0, dst)
    }

    fn read_at(&self, blob: BlobId, offset: u64, dst: &mut [u8]) -> Result<(), DiskError> {
        self.open(blob)?.read_at(offset, dst)
    }

    fn blob_size(&self, blob: BlobId) -> Result<u64, DiskError> {
        Ok(self.open(blob)?.nbytes)
    }

    fn delete(&self, blob: BlobId) -> io::Result<()> {
        for p in [self.path(blob), self.tmp_path(blob)] {
            match fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn path(&self, blob: BlobId) -> PathBuf {
        self.dir.join(format!("{:032x}.blob", blob.0))
    }
}

/// A unit's own directory under the disk tier's root: created owner-only
/// (0700) and locked (flock) for the unit's life.
///
/// Many units may share one root and start at the same moment, each
/// removing the directories of units that are gone. So that no start ever
/// takes a live unit's directory for a dead one:
///
/// - a directory is made under a temporary name (`stowage-new-…`), its
///   lock file created and locked inside it, and only then renamed to its
///   unit name (`stowage-unit-…`): a unit directory is locked from the
///   moment it is visible;
/// - a cleanup removes a directory only while holding its lock (taken
///   without waiting, so a held lock means "live, skip"), after checking
///   that the lock file it holds is still the one in the directory;
/// - a temporary directory without a lock file may be one whose maker is
///   about to create it: a cleanup only `rmdir`s it, which fails if the
///   lock file appeared meanwhile, and the maker, finding its directory
///   gone or its lock taken, starts over under a fresh name.
pub struct OwnedDir {
    pub path: PathBuf,
    /// Holds the lock; closing it releases the lock.
    _lock: File,
}

/// Prefix of unit directories under the root.
const DIR_PREFIX: &str = "stowage-unit-";
/// Prefix of a unit directory being made, before it is locked.
const NEW_DIR_PREFIX: &str = "stowage-new-";
/// The lock file in a unit directory.
const LOCK: &str = "lock";
/// How often a start makes a fresh temporary directory when concurrent
/// cleanups keep taking the one it made (each loss needs a cleanup to
/// see the directory in the microseconds between its lock file's creation
/// and its locking).
const CREATE_TRIES: u32 = 16;

impl OwnedDir {
    /// Create and lock a fresh directory for unit `name` under `root`,
    /// after removing directories of units that are gone (their lock is
    /// free). A live unit's directory is never touched.
    pub fn create(root: &Path, name: &str, instance: u128) -> io::Result<(Self, Vec<PathBuf>)> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        fs::DirBuilder::new().recursive(true).create(root)?;
        let removed = remove_dead_dirs(root)?;
        let safe: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let base = format!("{safe}-{}-{:08x}", std::process::id(), instance as u32);
        let path = root.join(format!("{DIR_PREFIX}{base}"));
        for _ in 0..CREATE_TRIES {
            let seq = SEQ.fetch_add(1, Ordering::Relaxed);
            let tmp = root.join(format!("{NEW_DIR_PREFIX}{base}-{seq}"));
            let Some(lock) = make_locked(&tmp)? else {
                continue;
            };
            // We hold the lock of the directory at `tmp`, so no cleanup
            // removes it; after the rename the same lock guards `path`. An
            // existing `path` that is not empty (only a live unit's can
            // be) makes the rename fail rather than be replaced.
            if let Err(e) = fs::rename(&tmp, &path) {
                let _ = remove_tree(&tmp);
                return Err(e);
            }
            return Ok((Self { path, _lock: lock }, removed));
        }
        Err(io::Error::other(format!(
            "could not make a locked directory under {} in {CREATE_TRIES} tries: \
             concurrent cleanups kept taking it",
            root.display()
        )))
    }

    /// Remove the directory and everything in it.
    pub fn remove(&self) -> io::Result<()> {
        remove_tree(&self.path)
    }
}

/// Make `dir` (0700) with a lock file in it, and lock that. `None` when a
/// concurrent cleanup took the directory or its lock first (then the
/// caller tries another name).
fn make_locked(dir: &Path) -> io::Result<Option<File>> {
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(None),
        r => r?,
    }
    let lock_path = dir.join(LOCK);
    let lock = match OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&lock_path)
    {
        Ok(f) => f,
        // A cleanup removed the (still empty) directory.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            let _ = fs::remove_dir(dir);
            return Err(e);
        }
    };
    // A cleanup that locked it first is removing the directory; one that
    // locked it, removed it and let go leaves a lock file that is no
    // longer in the directory.
    if !try_lock(&lock)? || !is_at(&lock, &lock_path)? {
        return Ok(None);
    }
    Ok(Some(lock))
}

/// Take `f`'s exclusive flock without waiting; `false` if someone holds it.
fn try_lock(f: &File) -> io::Result<bool> {
    match rustix::fs::flock(f, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::WOULDBLOCK) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Whether the open file `f` is the file at `path` (not one that was
/// unlinked or replaced since it was opened).
fn is_at(f: &File, path: &Path) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let held = f.metadata()?;
    match fs::symlink_metadata(path) {
        Ok(m) => Ok(m.dev() == held.dev() && m.ino() == held.ino()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

fn ignore_missing(r: io::Result<()>) -> io::Result<()> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Remove `dir` and everything in it, its lock file last (so a removal
/// that fails half-way leaves a directory still guarded by its lock), and
/// without failing on entries another cleanup removed first.
fn remove_tree(dir: &Path) -> io::Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(it) => it,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if entry.file_name() == LOCK {
            continue;
        }
        let p = entry.path();
        ignore_missing(match entry.file_type() {
            Ok(t) if t.is_dir() => remove_tree(&p),
            Ok(_) => fs::remove_file(&p),
            Err(e) => Err(e),
        })?;
    }
    ignore_missing(fs::remove_file(dir.join(LOCK)))?;
    ignore_missing(fs::remove_dir(dir))
}

/// Remove unit directories under `root` whose lock nobody holds, and
/// temporary ones left by starts that died. Directories whose lock file
/// cannot be opened (another user's) are left alone.
fn remove_dead_dirs(root: &Path) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for entry in fs::read_dir(root)? {
        let entry = match entry {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let temporary = name.starts_with(NEW_DIR_PREFIX);
        if !temporary && !name.starts_with(DIR_PREFIX) {
            continue;
        }
        match entry.file_type() {
            Ok(t) if t.is_dir() => {}
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        }
        let dir = entry.path();
        let lock_path = dir.join(LOCK);
        let lock = match File::open(&lock_path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if temporary {
                    // Its maker may be about to create the lock file: only
                    // an empty directory goes, and rmdir checks that
                    // atomically. (Its maker then starts over.)
                    if fs::remove_dir(&dir).is_ok() {
                        removed.push(dir);
                    }
                } else {
                    // A unit directory gets its name with its lock file
                    // already in it and locked, and only a holder of the
                    // lock removes that file: this one's removal was cut
                    // short (or is finishing now).
                    remove_tree(&dir)?;
                    removed.push(dir);
                }
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => continue,
            Err(e) => return Err(e),
        };
        // Held: its unit is alive (or another cleanup is removing it).
        // Free but no longer the directory's lock file: another cleanup
        // removed the directory after we opened it.
        if !try_lock(&lock)? || !is_at(&lock, &lock_path)? {
            continue;
        }
        // Its owner is gone. Keep holding the lock while removing, so no
        // start can take this directory for its own meanwhile.
        remove_tree(&dir)?;
        removed.push(dir);
        drop(lock);
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn blob_files_round_trip_and_detect_damage() {
        let dir = tempfile::tempdir().unwrap();
        let e = FileEngine::new(dir.path().to_owned());
        let mut w = e.create(BlobId(7), 10).unwrap();
        w.write(b"hello").unwrap();
        w.write(b"world").unwrap();
        let file_sum = w.finish().unwrap();
        assert_eq!(
            file_sum,
            xxhash_rust::xxh3::xxh3_64(&fs::read(e.path(BlobId(7))).unwrap())
        );
        let mut out = [0u8; 10];
        e.read(BlobId(7), &mut out).unwrap();
        assert_eq!(&out, b"helloworld");
        let mut part = [0u8; 4];
        e.read_at(BlobId(7), 3, &mut part).unwrap();
        assert_eq!(&part, b"lowo");
        assert_eq!(e.blob_size(BlobId(7)).unwrap(), 10);
        // Flip a byte of the data.
        let p = e.path(BlobId(7));
        let mut bytes = fs::read(&p).unwrap();
        bytes[HEADER as usize + 3] ^= 1;
        fs::write(&p, &bytes).unwrap();
        assert!(matches!(
            e.read(BlobId(7), &mut out),
            Err(DiskError::Corrupt { .. })
        ));
        assert!(matches!(
            e.read_at(BlobId(7), 3, &mut part[..1]),
            Err(DiskError::Corrupt { .. })
        ));
        // Truncate it, within the header and after it.
        for keep in [12, bytes.len() - 1] {
            fs::write(&p, &bytes[..keep]).unwrap();
            assert!(matches!(
                e.read(BlobId(7), &mut out),
                Err(DiskError::Corrupt { .. })
            ));
            assert!(matches!(
                e.read_at(BlobId(7), 0, &mut part[..1]),
                Err(DiskError::Corrupt { .. })
            ));
        }
        e.delete(BlobId(7)).unwrap();
        e.delete(BlobId(7)).unwrap();
        assert!(matches!(
            e.read(BlobId(7), &mut out),
            Err(DiskError::Corrupt { .. })
        ));
        assert!(matches!(
            e.read_at(BlobId(7), 0, &mut []),
            Err(DiskError::Corrupt { .. })
        ));
        // Short and long writes and the failpoint leave no file.
        let mut w = e.create(BlobId(8), 10).unwrap();
        w.write(b"short").unwrap();
        assert!(w.finish().is_err());
        let mut w = e.create(BlobId(8), 10).unwrap();
        w.write(b"eight by").unwrap();
        assert!(w.write(b"tes").is_err());
        assert!(w.write(b"te").is_err(), "a refused write poisons the file");
        assert!(w.finish().is_err());
        e.failpoints.enable("disk-write").unwrap();
        let mut w = e.create(BlobId(9), 1).unwrap();
        assert!(w.write(b"x").is_err());
        assert!(w.finish().is_err());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    /// Bytes that differ from chunk to chunk (so reading the wrong chunk
    /// cannot pass).
    fn data(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Write `bytes` as `blob`, in pieces of the sizes in `pieces` (in
    /// turn); returns what `finish` does.
    fn put(e: &FileEngine, blob: BlobId, bytes: &[u8], pieces: &[usize]) -> u64 {
        let mut w = e.create(blob, bytes.len() as u64).unwrap();
        let mut rest = bytes;
        for &n in pieces.iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let (now, later) = rest.split_at(n.min(rest.len()));
            w.write(now).unwrap();
            rest = later;
        }
        w.finish().unwrap()
    }

    fn corrupt_at(e: &FileEngine, blob: BlobId, offset: u64, len: usize) -> bool {
        matches!(
            e.read_at(blob, offset, &mut vec![0u8; len]),
            Err(DiskError::Corrupt { .. })
        )
    }

    fn flip(path: &Path, at: usize) {
        let mut bytes = fs::read(path).unwrap();
        bytes[at] ^= 0x10;
        fs::write(path, &bytes).unwrap();
    }

    /// Every range of small blobs, with chunks smaller than, equal to and
    /// larger than the blob, written in uneven pieces: exactly the range.
    #[test]
    fn read_at_returns_exactly_every_range() {
        let dir = tempfile::tempdir().unwrap();
        for chunk in [1u32, 7, 16, 50, 64] {
            let e = FileEngine::with_chunk(dir.path().to_owned(), chunk);
            for n in [0usize, 1, 15, 16, 17, 50] {
                let blob = BlobId(u128::from(chunk) << 32 | n as u128);
                let bytes = data(n, blob.0 as u64);
                let file_sum = put(&e, blob, &bytes, &[1, 2, 5, 3, 16]);
                let file = fs::read(e.path(blob)).unwrap();
                assert_eq!(file_sum, xxh3_64(&file));
                let chunks = (n as u64).div_ceil(u64::from(chunk));
                assert_eq!(file.len() as u64, HEADER + n as u64 + chunks * SUM);
                assert_eq!(e.blob_size(blob).unwrap(), n as u64);
                let mut whole = vec![0u8; n];
                e.read(blob, &mut whole).unwrap();
                assert_eq!(whole, bytes);
                for offset in 0..=n {
                    for len in 0..=n - offset {
                        let mut got = vec![0xAAu8; len];
                        e.read_at(blob, offset as u64, &mut got).unwrap();
                        assert_eq!(
                            got,
                            &bytes[offset..offset + len],
                            "chunk {chunk}, blob of {n}, {len} bytes at {offset}"
                        );
                    }
                }
            }
        }
    }

    /// The real chunk size: ranges at and around chunk boundaries, within
    /// a chunk, across several (more than one read's worth), to the end.
    #[test]
    fn read_at_chunk_boundaries() {
        let dir = tempfile::tempdir().unwrap();
        let e = FileEngine::new(dir.path().to_owned());
        let c = CHUNK as usize;
        let n = 10 * c + 123;
        let bytes = data(n, 42);
        put(&e, BlobId(1), &bytes, &[1, c - 1, c + 5, 100_000, 3 * c]);
        let points = [
            0,
            1,
            c - 1,
            c,
            c + 1,
            2 * c,
            4 * c - 1,
            4 * c,
            5 * c + 7,
            10 * c,
            n - 1,
            n,
        ];
        for (i, &a) in points.iter().enumerate() {
            for &b in &points[i..] {
                let mut got = vec![0u8; b - a];
                e.read_at(BlobId(1), a as u64, &mut got).unwrap();
                assert!(got == bytes[a..b], "{} bytes at {a}", b - a);
            }
        }
        let mut whole = vec![0u8; n];
        e.read(BlobId(1), &mut whole).unwrap();
        assert!(whole == bytes);
    }

    /// More chunks than one read of the sum table holds: the sums are
    /// read window by window, each chunk checked against its own.
    #[test]
    fn many_chunks_are_checked_against_their_own_sums() {
        let dir = tempfile::tempdir().unwrap();
        let e = FileEngine::with_chunk(dir.path().to_owned(), 2);
        let n = 4 * SUMS_AT_ONCE + 3;
        let bytes = data(n, 5);
        put(&e, BlobId(1), &bytes, &[333]);
        let mut whole = vec![0u8; n];
        e.read(BlobId(1), &mut whole).unwrap();
        assert!(whole == bytes);
        for (a, b) in [(1, n - 1), (2 * SUMS_AT_ONCE - 1, n), (1500, 1501)] {
            let mut got = vec![0u8; b - a];
            e.read_at(BlobId(1), a as u64, &mut got).unwrap();
            assert!(got == bytes[a..b], "{} bytes at {a}", b - a);
        }
        // Damage to a chunk far into the table is found by reads that
        // start far before it.
        flip(&e.path(BlobId(1)), HEADER as usize + n - 2);
        assert!(corrupt_at(&e, BlobId(1), 0, n));
        assert!(corrupt_at(&e, BlobId(1), 1, n - 2));
        let mut got = vec![0u8; n - 3];
        e.read_at(BlobId(1), 0, &mut got).unwrap();
    }

    /// read_at checks the chunks it reads (and may miss damage in others,
    /// which read finds); damage to a chunk's sum, to the header or to
    /// the length is caught too.
    #[test]
    fn read_at_is_checked_where_it_reads() {
        let dir = tempfile::tempdir().unwrap();
        let e = FileEngine::new(dir.path().to_owned());
        let c = u64::from(CHUNK);
        let n = 10 * c + 123;
        let bytes = data(n as usize, 7);
        put(&e, BlobId(1), &bytes, &[65_536]);
        let p = e.path(BlobId(1));
        let clean = fs::read(&p).unwrap();
        let mut whole = vec![0u8; n as usize];

        // A flipped byte in chunk 3.
        flip(&p, (HEADER + 3 * c + 10) as usize);
        assert!(corrupt_at(&e, BlobId(1), 3 * c + 10, 1));
        assert!(corrupt_at(&e, BlobId(1), 3 * c + 11, 5), "same chunk");
        assert!(corrupt_at(&e, BlobId(1), 2 * c, c as usize + 1));
        assert!(corrupt_at(&e, BlobId(1), 0, n as usize));
        let mut got = vec![0u8; 3 * c as usize];
        e.read_at(BlobId(1), 0, &mut got).unwrap();
        assert!(got == bytes[..3 * c as usize], "chunks 0-2 are intact");
        e.read_at(BlobId(1), 4 * c, &mut got[..10]).unwrap();
        assert!(got[..10] == bytes[4 * c as usize..][..10]);
        assert!(matches!(
            e.read(BlobId(1), &mut whole),
            Err(DiskError::Corrupt { .. })
        ));

        // A flipped byte in the last (short) chunk.
        fs::write(&p, &clean).unwrap();
        flip(&p, (HEADER + n - 1) as usize);
        assert!(corrupt_at(&e, BlobId(1), n - 1, 1));
        e.read_at(BlobId(1), 0, &mut got).unwrap();

        // A flipped byte in chunk 5's sum.
        fs::write(&p, &clean).unwrap();
        flip(&p, (HEADER + n + 5 * SUM + 2) as usize);
        assert!(corrupt_at(&e, BlobId(1), 5 * c + 1, 1));
        e.read_at(BlobId(1), 4 * c, &mut got[..c as usize]).unwrap();
        assert!(matches!(
            e.read(BlobId(1), &mut whole),
            Err(DiskError::Corrupt { .. })
        ));

        // Any flipped header byte (magic, version, size, chunk size,
        // padding, the header's own sum) fails every read.
        for at in 0..HEADER as usize {
            fs::write(&p, &clean).unwrap();
            flip(&p, at);
            assert!(corrupt_at(&e, BlobId(1), 0, 0), "header byte {at}");
            assert!(corrupt_at(&e, BlobId(1), c, 1), "header byte {at}");
            assert!(e.blob_size(BlobId(1)).is_err(), "header byte {at}");
        }

        // One byte short, one byte long.
        fs::write(&p, &clean[..clean.len() - 1]).unwrap();
        assert!(corrupt_at(&e, BlobId(1), 0, 1));
        let mut long = clean.clone();
        long.push(0);
        fs::write(&p, &long).unwrap();
        assert!(corrupt_at(&e, BlobId(1), 0, 1));

        fs::write(&p, &clean).unwrap();
        e.read(BlobId(1), &mut whole).unwrap();
        assert!(whole == bytes);
    }

    /// Ranges not inside the blob are errors, never panics; empty ranges
    /// inside it are fine; a blob of no bytes works.
    #[test]
    fn read_at_out_of_range_empty_and_empty_blobs() {
        let dir = tempfile::tempdir().unwrap();
        let e = FileEngine::with_chunk(dir.path().to_owned(), 16);
        put(&e, BlobId(1), &data(40, 1), &[40]);
        let out_of_range = |offset: u64, len: usize| {
            matches!(
                e.read_at(BlobId(1), offset, &mut vec![0u8; len]),
                Err(DiskError::OutOfRange { size: 40, .. })
            )
        };
        assert!(out_of_range(41, 0));
        assert!(out_of_range(39, 2));
        assert!(out_of_range(0, 41));
        assert!(out_of_range(40, 1));
        assert!(out_of_range(u64::MAX, 1), "offset + len overflows");
        assert!(out_of_range(u64::MAX, 0));
        for offset in [0, 15, 16, 40] {
            e.read_at(BlobId(1), offset, &mut []).unwrap();
        }
        // The whole-blob read wants exactly the blob's size.
        assert!(matches!(
            e.read(BlobId(1), &mut [0u8; 39]),
            Err(DiskError::Corrupt { .. })
        ));

        put(&e, BlobId(2), &[], &[1]);
        assert_eq!(fs::metadata(e.path(BlobId(2))).unwrap().len(), HEADER);
        assert_eq!(e.blob_size(BlobId(2)).unwrap(), 0);
        e.read(BlobId(2), &mut []).unwrap();
        e.read_at(BlobId(2), 0, &mut []).unwrap();
        assert!(matches!(
            e.read_at(BlobId(2), 0, &mut [0u8; 1]),
            Err(DiskError::OutOfRange { size: 0, .. })
        ));
        assert!(matches!(
            e.read_at(BlobId(2), 1, &mut []),
            Err(DiskError::OutOfRange { .. })
        ));
        // A missing blob.
        assert!(corrupt_at(&e, BlobId(3), 0, 0));
    }

    /// Files of format version 1 (in checkpoints written before chunk
    /// sums) still read, whole or in part, and are still checked.
    #[test]
    fn version_1_files_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let e = FileEngine::new(dir.path().to_owned());
        let n = 3 * READ_RUN as usize + 5;
        let bytes = data(n, 3);
        let mut file = Vec::new();
        file.extend_from_slice(MAGIC);
        file.extend_from_slice(&1u32.to_le_bytes());
        file.extend_from_slice(&(n as u64).to_le_bytes());
        file.extend_from_slice(&bytes);
        file.extend_from_slice(&xxh3_64(&bytes).to_le_bytes());
        let p = e.path(BlobId(1));
        fs::write(&p, &file).unwrap();
        assert_eq!(e.blob_size(BlobId(1)).unwrap(), n as u64);
        let mut whole = vec![0u8; n];
        e.read(BlobId(1), &mut whole).unwrap();
        assert!(whole == bytes);
        for (a, b) in [
            (0, 0),
            (0, 1),
            (READ_RUN as usize - 1, READ_RUN as usize + 1),
            (n - 5, n),
        ] {
            let mut got = vec![0u8; b - a];
            e.read_at(BlobId(1), a as u64, &mut got).unwrap();
            assert!(got == bytes[a..b], "{} bytes at {a}", b - a);
        }
        flip(&p, V1_HEADER as usize + n - 1);
        assert!(corrupt_at(&e, BlobId(1), 0, 1), "one sum covers all");
        assert!(matches!(
            e.read(BlobId(1), &mut whole),
            Err(DiskError::Corrupt { .. })
        ));
        fs::write(&p, &file[..file.len() - 1]).unwrap();
        assert!(corrupt_at(&e, BlobId(1), 0, 1));
    }

    #[test]
    fn dead_units_directories_are_removed_live_ones_kept() {
        let root = tempfile::tempdir().unwrap();
        let (live, _) = OwnedDir::create(root.path(), "a", 1).unwrap();
        let (dead, _) = OwnedDir::create(root.path(), "b", 2).unwrap();
        let dead_path = dead.path.clone();
        drop(dead); // releases the lock, as a killed process would
        let (fresh, removed) = OwnedDir::create(root.path(), "c", 3).unwrap();
        assert_eq!(removed, vec![dead_path.clone()]);
        assert!(!dead_path.exists());
        assert!(live.path.exists());
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(&fresh.path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        fresh.remove().unwrap();
        assert!(!fresh.path.exists());
    }

    #[test]
    fn leftovers_of_dead_starts_are_removed_a_live_start_is_kept() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let mk = |name: &str| {
            let d = r.join(name);
            fs::create_dir(&d).unwrap();
            d
        };
        // A start that died before creating its lock file.
        let empty = mk("stowage-new-x-1-00000001-0");
        // One that died after creating it.
        let unlocked = mk("stowage-new-x-1-00000002-1");
        fs::write(unlocked.join(LOCK), b"").unwrap();
        // One in progress: its lock is held.
        let starting = mk("stowage-new-x-1-00000003-2");
        let held = File::create(starting.join(LOCK)).unwrap();
        assert!(try_lock(&held).unwrap());
        // A unit directory whose removal was cut short after its lock file.
        let half_removed = mk("stowage-unit-x-1-00000004");
        fs::write(half_removed.join("0.blob"), b"x").unwrap();
        // Not ours.
        let other = mk("something-else");
        let mut removed = remove_dead_dirs(r).unwrap();
        removed.sort();
        let mut expect = vec![empty, unlocked, half_removed];
        expect.sort();
        assert_eq!(removed, expect);
        assert!(expect.iter().all(|d| !d.exists()));
        assert!(starting.join(LOCK).exists() && other.exists());
        // A temporary directory that is not empty but has no lock file is
        // left alone: its maker may be about to create the lock file.
        let odd = mk("stowage-new-x-1-00000005-3");
        fs::write(odd.join("x"), b"").unwrap();
        assert!(remove_dead_dirs(r).unwrap().is_empty());
        assert!(odd.exists());
    }

    /// The lock file at `dir/lock` is the one held by a live owner: a
    /// fresh open of it cannot take the lock.
    fn held(dir: &Path) -> bool {
        match File::open(dir.join("lock")) {
            Ok(f) => rustix::fs::flock(&f, FlockOperation::NonBlockingLockExclusive).is_err(),
            Err(_) => false,
        }
    }

    /// Units starting at once on one root, each cleaning up after dead
    /// ones, while others clean up too: every start succeeds and every
    /// live directory keeps its locked lock file. (With the directory
    /// made under its final name and locked afterwards, a cleanup saw it
    /// without a lock file, or with a free one, and removed it: this test
    /// failed hundreds of times per run.)
    #[test]
    fn concurrent_starts_and_cleanups_never_remove_a_live_directory() {
        let root = tempfile::tempdir().unwrap();
        let root = root.path();
        let next = AtomicU64::new(1);
        let stop = AtomicBool::new(false);
        let failures = Mutex::new(Vec::<String>::new());
        let fail = |what: String| failures.lock().unwrap().push(what);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    while !stop.load(Ordering::SeqCst) {
                        if let Err(e) = remove_dead_dirs(root) {
                            fail(format!("cleanup failed: {e}"));
                        }
                    }
                });
            }
            let creators: Vec<_> = (0..3)
                .map(|t| {
                    let (next, fail) = (&next, &fail);
                    s.spawn(move || {
                        // A few live directories at a time; older ones are
                        // dropped (their owner "dies"), giving the cleaners
                        // dead directories to remove meanwhile.
                        let mut live = std::collections::VecDeque::new();
                        for _ in 0..300 {
                            let id = next.fetch_add(1, Ordering::SeqCst);
                            match OwnedDir::create(root, &format!("t{t}"), id.into()) {
                                Ok((d, _)) => live.push_back(d),
                                Err(e) => fail(format!("create failed: {e}")),
                            }
                            if live.len() > 3 {
                                live.pop_front();
                            }
                            for d in &live {
                                if !held(&d.path) {
                                    fail(format!(
                                        "live {} lost its locked lock file",
                                        d.path.display()
                                    ));
                                }
                            }
                        }
                        live
                    })
                })
                .collect();
            let joined: Vec<_> = creators.into_iter().map(|h| h.join()).collect();
            // Stop the cleaners before anything can panic, or the scope
            // would wait for them forever.
            stop.store(true, Ordering::SeqCst);
            let live: Vec<_> = joined.into_iter().flat_map(|r| r.unwrap()).collect();
            for d in &live {
                if !held(&d.path) {
                    fail(format!(
                        "live {} lost its locked lock file",
                        d.path.display()
                    ));
                }
            }
        });
        let failures = failures.into_inner().unwrap();
        assert!(
            failures.is_empty(),
            "{} failures, first: {:?}",
            failures.len(),
            &failures[..failures.len().min(5)]
        );
    }
}
