//! The disk tier: one owner-only, locked directory per unit, one file per
//! spilled blob, checked chunk by chunk.
//!
//! A blob file (format version 3; integers little-endian):
//!
//! ```text
//!  0       "STWB"  version: u32 = 3  byte count n: u64  chunk size c: u32  0: u32
//!  24      blob id: u128   unit instance: u128
//!  56      xxh3-64 of bytes 0..56
//!  64      the n bytes
//!  64 + n  ⌈n / c⌉ × xxh3-64, one per c-byte chunk of the bytes (the last
//!          chunk may be short); nothing else follows
//! ```
//!
//! Files are written under a temporary name, synced and renamed, so a file
//! that exists under its blob's name is complete. A read checks the header
//! (its checksum, that it names the blob asked for and, in a unit's own
//! directory, that unit's instance) and that the file's length is the one
//! it implies, then reads and checks only the chunks that overlap the range
//! asked for; it reports [`DiskError::Corrupt`] rather than ever returning
//! bytes that fail their chunk's checksum, or another blob's bytes (a file
//! swapped or copied in under another name).
//!
//! Older formats are read only from checkpoints
//! ([`FileEngine::checkpoint`]): version 2 (`STWB` · 2 · n · c · 0 · xxh3
//! of those 24 bytes, then as above) and version 1 (`STWB` · 1 · n · the
//! bytes · xxh3-64 of the bytes). Their headers name no blob; a checkpoint's
//! manifest holds each file's name with the xxh3 of its whole contents, and
//! a restore checks every file against it before reading, so a file moved
//! to another name there fails that check instead. A unit's own disk
//! directory holds only files it wrote itself: a file there in an older
//! format (or written by another instance) is `Corrupt`.
//!
//! Every file operation goes through a directory file descriptor opened
//! without following symbolic links (`openat2` with `RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS` where the kernel has it, else `openat` with
//! `O_NOFOLLOW`; names are single components): a directory renamed or
//! replaced by a symbolic link after it was opened does not lead the unit's
//! reads, writes or deletions anywhere else. The root itself must be owned
//! by the unit's user and writable by nobody else ([`open_private_root`]).
//!
//! The engine sits behind [`DiskEngine`] (plain pread/pwrite here; another
//! engine, e.g. io_uring, can take its place) with a failpoint seam
//! ([`Failpoints`]) for tests.

use std::ffi::{CStr, CString};
use std::fs::{self, File};
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, FileExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use rustix::fs::{AtFlags, FileType, FlockOperation, Mode, OFlags, RenameFlags, ResolveFlags};
use rustix::io::Errno;
use stowage_core::BlobId;
use xxhash_rust::xxh3::{xxh3_64, Xxh3Default};

const MAGIC: &[u8; 4] = b"STWB";
const VERSION: u32 = 3;
const HEADER: u64 = 64;
/// Version 2's header: no blob id, no instance.
const V2_HEADER: u64 = 32;
/// Bytes per checked chunk in the files this engine writes. A read of a
/// few bytes reads and checks one or two chunks; the table costs 8 bytes
/// per chunk on disk (0.012%) and in a writer's memory until `finish`.
pub const CHUNK: u32 = 64 << 10;
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

#[cfg(test)]
thread_local! {
    /// Bytes this thread's [`BlobReader`]s have read from their files
    /// (headers, data and sums), for tests that count passes over a file.
    pub(crate) static BYTES_READ: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// `read_exact_at`, counted in tests ([`BYTES_READ`]).
fn pread(file: &File, buf: &mut [u8], at: u64) -> io::Result<()> {
    file.read_exact_at(buf, at)?;
    #[cfg(test)]
    BYTES_READ.with(|n| n.set(n.get() + buf.len() as u64));
    Ok(())
}
/// Deepest directory nesting [`remove_tree`] descends into (a unit's
/// directory has none; anything deeper was not made by a unit).
const MAX_DEPTH: u32 = 16;

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

/// Named failpoints at the disk seam, for tests.
#[derive(Debug, Default)]
pub struct Failpoints {
    /// Every blob write fails with an I/O error.
    pub disk_write: AtomicBool,
    /// Every blob file's last step (its checksum table, sync and rename)
    /// fails: a put already answered Pending is lost.
    pub disk_sync: AtomicBool,
}

impl Failpoints {
    /// Parse `name` (`disk-write`, `disk-sync`) and turn it on.
    pub fn enable(&self, name: &str) -> Result<(), String> {
        match name {
            "disk-write" => self.disk_write.store(true, Ordering::SeqCst),
            "disk-sync" => self.disk_sync.store(true, Ordering::SeqCst),
            other => {
                return Err(format!(
                    "unknown failpoint {other:?} (known: disk-write, disk-sync)"
                ))
            }
        }
        Ok(())
    }
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
    /// The blob's file path (for messages, checkpoints and tests).
    fn path(&self, blob: BlobId) -> PathBuf;
}

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

/// A single path component: not empty, no `/`, not `.` or `..`, no NUL.
fn is_component(name: &[u8]) -> bool {
    !name.is_empty() && name != b"." && name != b".." && !name.iter().any(|&b| b == b'/' || b == 0)
}

/// Whether openat2 is missing (kernels before 5.6, or a seccomp filter).
static NO_OPENAT2: AtomicBool = AtomicBool::new(false);

/// Open `name`, one path component, in the directory `dir`, never
/// following a symbolic link: `openat2(RESOLVE_BENEATH |
/// RESOLVE_NO_SYMLINKS)` where the kernel has it, else `openat` with
/// `O_NOFOLLOW` (the same for one component). A symbolic link is `ELOOP`
/// (or `ENOTDIR` with `O_DIRECTORY`).
pub fn open_in<P: AsRef<[u8]> + ?Sized>(
    dir: BorrowedFd<'_>,
    name: &P,
    flags: OFlags,
    mode: Mode,
) -> io::Result<OwnedFd> {
    let name = name.as_ref();
    if !is_component(name) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{:?} is not a plain file name",
                String::from_utf8_lossy(name)
            ),
        ));
    }
    let name = CString::new(name).map_err(io::Error::other)?;
    let flags = flags | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    if !NO_OPENAT2.load(Ordering::Relaxed) {
        let resolve =
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        match rustix::fs::openat2(dir, name.as_c_str(), flags, mode, resolve) {
            Err(Errno::NOSYS) | Err(Errno::PERM) => NO_OPENAT2.store(true, Ordering::Relaxed),
            // A rename elsewhere raced the lookup: the plain open below
            // (one component, no `..`) cannot be misled by one.
            Err(Errno::AGAIN) => {}
            r => return r.map_err(io::Error::from),
        }
    }
    Ok(rustix::fs::openat(dir, name.as_c_str(), flags, mode)?)
}

/// Open a subdirectory of `dir` (one component), not following a symbolic
/// link.
pub(crate) fn open_dir_in<P: AsRef<[u8]> + ?Sized>(
    dir: BorrowedFd<'_>,
    name: &P,
) -> io::Result<OwnedFd> {
    open_in(dir, name, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())
}

/// Whether an error of [`open_in`] means "a symbolic link (or not a
/// directory) is there".
pub(crate) fn is_link_error(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(c) if c == Errno::LOOP.raw_os_error() || c == Errno::NOTDIR.raw_os_error()
    )
}

/// Open `path` as a directory for the disk tier's or checkpoints' root
/// (`what` names it in errors), creating it (0700, with missing parents)
/// when it does not exist, and refuse it unless it is a real directory
/// (not a symbolic link) owned by this process's user and writable by
/// nobody else: anyone who can write in it could plant, swap or link files
/// under the names the unit uses.
pub fn open_private_root(path: &Path, what: &str) -> io::Result<OwnedFd> {
    if let Err(e) = fs::symlink_metadata(path) {
        if e.kind() != io::ErrorKind::NotFound {
            return Err(e);
        }
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)?;
    }
    let uid = rustix::process::getuid().as_raw();
    let refuse = |why: String| io::Error::new(io::ErrorKind::PermissionDenied, why);
    let fd = match rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::LOOP) | Err(Errno::NOTDIR)
            if fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) =>
        {
            return Err(refuse(format!(
                "{what} {} is a symbolic link; the unit does not follow links there \
                 (one could be re-pointed underneath it): give the directory itself, \
                 owned by uid {uid} and writable only by it (chmod 700)",
                path.display()
            )));
        }
        Err(e) => {
            return Err(io::Error::new(
                io::Error::from(e).kind(),
                format!("{what} {}: {e}", path.display()),
            ))
        }
    };
    let st = rustix::fs::fstat(&fd)?;
    if st.st_uid != uid {
        return Err(refuse(format!(
            "{what} {} is owned by uid {}, not by this unit's uid {uid}: its owner \
             could swap or link the unit's files there. Use a directory of your own \
             (mkdir -m 700 DIR), or `chown {uid} {}` and `chmod 700 {}`",
            path.display(),
            st.st_uid,
            path.display(),
            path.display()
        )));
    }
    let mode = st.st_mode & 0o7777;
    if mode & 0o022 != 0 {
        return Err(refuse(format!(
            "{what} {} is writable by {} (mode {mode:04o}): another user could plant, \
             swap or link files where the unit keeps its own. Use a directory only you \
             can write: `mkdir -m 700 {}/stowage-$USER` and give that, or `chmod 700 {}` \
             if nothing else needs to write there",
            path.display(),
            match (mode & 0o002 != 0, mode & 0o020 != 0) {
                (true, true) => "others and its group",
                (true, false) => "others",
                _ => "its group",
            },
            path.display(),
            path.display()
        )));
    }
    Ok(fd)
}

/// Files in one directory (held by its file descriptor), with plain
/// positioned I/O.
pub struct FileEngine {
    dir: Arc<OwnedFd>,
    /// The directory's path, for messages.
    dir_path: PathBuf,
    /// Chunk size of the files this engine writes.
    chunk: u32,
    /// Written into every file's header.
    instance: u128,
    /// Reads insist on `instance` (a unit's own directory) or take any
    /// (a checkpoint's, written by another instance).
    check_instance: bool,
    /// Reads take format 1 and 2 files (checkpoints only: see the module
    /// docs).
    accept_old: bool,
    pub failpoints: Failpoints,
}

impl FileEngine {
    /// A unit's own disk directory: files are written and read with
    /// `instance` in their header.
    pub fn new(dir: Arc<OwnedFd>, dir_path: PathBuf, instance: u128) -> Self {
        Self {
            dir,
            dir_path,
            chunk: CHUNK,
            instance,
            check_instance: true,
            accept_old: false,
            failpoints: Failpoints::default(),
        }
    }

    /// A checkpoint directory: files are written with the writing unit's
    /// `instance`, and read whatever instance wrote them (the blob id must
    /// still match), in any format version.
    pub fn checkpoint(dir: Arc<OwnedFd>, dir_path: PathBuf, instance: u128) -> Self {
        Self {
            check_instance: false,
            accept_old: true,
            ..Self::new(dir, dir_path, instance)
        }
    }

    /// One that writes files with `chunk`-byte chunks (for tests).
    #[cfg(test)]
    fn with_chunk(dir: Arc<OwnedFd>, dir_path: PathBuf, chunk: u32) -> Self {
        assert!((1..=MAX_CHUNK).contains(&chunk));
        Self {
            chunk,
            ..Self::new(dir, dir_path, 1)
        }
    }

    /// The directory's file descriptor.
    pub fn dir_fd(&self) -> BorrowedFd<'_> {
        self.dir.as_fd()
    }

    fn name(blob: BlobId) -> String {
        format!("{:032x}.blob", blob.0)
    }

    fn tmp_name(blob: BlobId) -> String {
        format!("{:032x}.tmp", blob.0)
    }

    /// Open `blob`'s file and check its header and length.
    pub fn reader(&self, blob: BlobId) -> Result<BlobReader, DiskError> {
        let path = self.path(blob);
        let file = match open_in(
            self.dir.as_fd(),
            &Self::name(blob),
            OFlags::RDONLY | OFlags::NONBLOCK,
            Mode::empty(),
        ) {
            Ok(f) => File::from(f),
            Err(e) => return Err(corrupt(&path, format!("cannot open: {e}"))),
        };
        let meta = file.metadata()?;
        if !meta.file_type().is_file() {
            return Err(corrupt(&path, "not a regular file".into()));
        }
        let size = meta.len();
        let mut head = [0u8; HEADER as usize];
        let got = usize::try_from(size.min(HEADER)).unwrap_or(head.len());
        pread(&file, &mut head[..got], 0)?;
        if got < V1_HEADER as usize || &head[..4] != MAGIC {
            return Err(corrupt(&path, "bad header".into()));
        }
        let nbytes = le_u64(&head[8..16]);
        let version = le_u32(&head[4..8]);
        if version != VERSION && !self.accept_old && matches!(version, 1 | 2) {
            return Err(corrupt(
                &path,
                format!(
                    "format version {version}, which names no blob: a unit's disk \
                     directory holds only version {VERSION} files it wrote itself"
                ),
            ));
        }
        let (format, want) = match version {
            1 => (
                Format::V1,
                V1_HEADER
                    .checked_add(nbytes)
                    .and_then(|n| n.checked_add(V1_TRAILER)),
            ),
            2 | VERSION => {
                let at = if version == 2 { V2_HEADER } else { HEADER };
                let sum_at = at as usize - 8;
                if got < at as usize
                    || xxh3_64(&head[..sum_at]) != le_u64(&head[sum_at..at as usize])
                {
                    return Err(corrupt(&path, "header checksum mismatch".into()));
                }
                if version == VERSION {
                    let (id, inst) = (le_u128(&head[24..40]), le_u128(&head[40..56]));
                    if id != blob.0 {
                        return Err(corrupt(
                            &path,
                            format!(
                                "the file holds blob {id:032x}, not {:032x} (a file moved or \
                                 copied under another blob's name)",
                                blob.0
                            ),
                        ));
                    }
                    if self.check_instance && inst != self.instance {
                        return Err(corrupt(
                            &path,
                            format!(
                                "the file was written by unit instance {inst:032x}, not by \
                                 this one ({:032x})",
                                self.instance
                            ),
                        ));
                    }
                }
                let chunk = le_u32(&head[16..20]);
                if !(1..=MAX_CHUNK).contains(&chunk) {
                    return Err(corrupt(&path, format!("chunk size {chunk}")));
                }
                let chunk = u64::from(chunk);
                let table = nbytes.div_ceil(chunk).checked_mul(SUM);
                (
                    Format::Chunked { chunk, data: at },
                    table.and_then(|t| at.checked_add(nbytes)?.checked_add(t)),
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
        Ok(BlobReader {
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

fn le_u128(b: &[u8]) -> u128 {
    let mut a = [0u8; 16];
    a.copy_from_slice(b);
    u128::from_le_bytes(a)
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(b);
    u32::from_le_bytes(a)
}

/// The header of a version 3 file.
fn header(nbytes: u64, chunk: u32, blob: BlobId, instance: u128) -> [u8; HEADER as usize] {
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

enum Format {
    V1,
    /// Versions 2 and 3: the bytes start at `data`.
    Chunked {
        chunk: u64,
        data: u64,
    },
}

/// An open blob file whose header and length have been checked.
pub struct BlobReader {
    file: File,
    path: PathBuf,
    nbytes: u64,
    format: Format,
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
                pread(&self.file, run, data + pos)?;
                for (i, bytes) in run.chunks(chunk as usize).enumerate() {
                    check(c + i as u64, bytes, &mut sums)?;
                }
                pos = run_end;
            } else {
                partial.resize((stop - start) as usize, 0);
                pread(&self.file, &mut partial, data + start)?;
                check(c, &partial, &mut sums)?;
                let upto = stop.min(end);
                dst[ix(pos)..ix(upto)]
                    .copy_from_slice(&partial[(pos - start) as usize..(upto - start) as usize]);
                pos = upto;
            }
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
            return crate::read_through(self, 0, self.nbytes, buf, sink);
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

struct FileWriter {
    file: File,
    dir: Arc<OwnedFd>,
    tmp: String,
    dst: String,
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
    /// Set by a failpoint, or by a write that failed (the file may then
    /// hold part of its bytes): every later call fails, with the same
    /// kind of error (a full disk stays a full disk).
    failed: Option<(io::ErrorKind, String)>,
    /// The disk-sync failpoint.
    fail_finish: bool,
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

impl DiskEngine for FileEngine {
    fn create(&self, blob: BlobId, nbytes: u64) -> io::Result<Box<dyn BlobWriter>> {
        let failed = self
            .failpoints
            .disk_write
            .load(Ordering::SeqCst)
            .then(|| (io::ErrorKind::Other, "failpoint disk-write".to_string()));
        let tmp = Self::tmp_name(blob);
        let mut file = File::from(open_in(
            self.dir.as_fd(),
            &tmp,
            OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC,
            Mode::from_raw_mode(0o600),
        )?);
        let header = header(nbytes, self.chunk, blob, self.instance);
        if let Err(e) = file.write_all(&header) {
            let _ = rustix::fs::unlinkat(self.dir.as_fd(), tmp.as_str(), AtFlags::empty());
            return Err(e);
        }
        let mut file_hash = Xxh3Default::new();
        file_hash.update(&header);
        let chunk = u64::from(self.chunk);
        Ok(Box::new(FileWriter {
            file,
            dir: self.dir.clone(),
            tmp,
            dst: Self::name(blob),
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
            fail_finish: self.failpoints.disk_sync.load(Ordering::SeqCst),
        }))
    }

    fn read(&self, blob: BlobId, dst: &mut [u8]) -> Result<(), DiskError> {
        let f = self.reader(blob)?;
        if f.nbytes != dst.len() as u64 {
            return Err(corrupt(
                &f.path,
                format!("holds {} bytes, expected {}", f.nbytes, dst.len()),
            ));
        }
        f.read_at(0, dst)
    }

    fn read_at(&self, blob: BlobId, offset: u64, dst: &mut [u8]) -> Result<(), DiskError> {
        self.reader(blob)?.read_at(offset, dst)
    }

    fn blob_size(&self, blob: BlobId) -> Result<u64, DiskError> {
        Ok(self.reader(blob)?.nbytes)
    }

    fn delete(&self, blob: BlobId) -> io::Result<()> {
        for name in [Self::name(blob), Self::tmp_name(blob)] {
            match rustix::fs::unlinkat(self.dir.as_fd(), name.as_str(), AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn path(&self, blob: BlobId) -> PathBuf {
        self.dir_path.join(Self::name(blob))
    }
}

/// A unit's own directory under the disk tier's root: created owner-only
/// (0700) and locked (flock) for the unit's life, and used only through
/// its file descriptor.
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
///
/// Lock files are opened non-blocking and without following links, and
/// used only when they are regular files: a FIFO or device planted as a
/// lock file leaves its directory alone rather than hanging the start.
pub struct OwnedDir {
    pub path: PathBuf,
    /// The root's file descriptor, and this directory's name in it.
    root: OwnedFd,
    name: String,
    dir: Arc<OwnedFd>,
    /// Holds the lock; closing it releases the lock.
    _lock: OwnedFd,
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
    /// Create and lock a fresh directory for unit `name` under `root`
    /// (which must pass [`open_private_root`]), after removing directories
    /// of units that are gone (their lock is free). A live unit's
    /// directory is never touched.
    pub fn create(root: &Path, name: &str, instance: u128) -> io::Result<(Self, Vec<PathBuf>)> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let root_fd = open_private_root(root, "disk root")?;
        let removed = remove_dead_dirs(root_fd.as_fd(), root)?;
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
        let final_name = format!("{DIR_PREFIX}{base}");
        for _ in 0..CREATE_TRIES {
            let seq = SEQ.fetch_add(1, Ordering::Relaxed);
            let tmp = format!("{NEW_DIR_PREFIX}{base}-{seq}");
            let Some((dir, lock)) = make_locked(root_fd.as_fd(), &tmp)? else {
                continue;
            };
            // We hold the lock of the directory at `tmp`, so no cleanup
            // removes it; after the rename the same lock guards the final
            // name. An existing entry there makes the rename fail rather
            // than replace it.
            if let Err(e) = rustix::fs::renameat_with(
                &root_fd,
                tmp.as_str(),
                &root_fd,
                final_name.as_str(),
                RenameFlags::NOREPLACE,
            ) {
                let _ = remove_dir_at(root_fd.as_fd(), &tmp, &dir, 0);
                return Err(e.into());
            }
            return Ok((
                Self {
                    path: root.join(&final_name),
                    root: root_fd,
                    name: final_name,
                    dir: Arc::new(dir),
                    _lock: lock,
                },
                removed,
            ));
        }
        Err(io::Error::other(format!(
            "could not make a locked directory under {} in {CREATE_TRIES} tries: \
             concurrent cleanups kept taking it",
            root.display()
        )))
    }

    /// The directory's file descriptor (for a [`FileEngine`]).
    pub fn fd(&self) -> Arc<OwnedFd> {
        self.dir.clone()
    }

    /// Remove everything in the directory (through its own descriptor,
    /// wherever it has been moved), then the directory's name in the root
    /// if that name is still this directory. Never follows a link.
    pub fn remove(&self) -> io::Result<()> {
        remove_dir_at(self.root.as_fd(), &self.name, &self.dir, 0)
    }
}

/// Make directory `name` (0700) in `root` with a lock file in it, and lock
/// that. `None` when a concurrent cleanup took the directory or its lock
/// first (then the caller tries another name).
fn make_locked(root: BorrowedFd<'_>, name: &str) -> io::Result<Option<(OwnedFd, OwnedFd)>> {
    match rustix::fs::mkdirat(root, name, Mode::from_raw_mode(0o700)) {
        Err(Errno::EXIST) => return Ok(None),
        r => r?,
    }
    let dir = match open_dir_in(root, name) {
        Ok(d) => d,
        // Removed (or replaced) by a cleanup meanwhile.
        Err(e) if e.kind() == io::ErrorKind::NotFound || is_link_error(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    let lock = match open_in(
        dir.as_fd(),
        LOCK,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NONBLOCK,
        Mode::from_raw_mode(0o600),
    ) {
        Ok(f) => f,
        // A cleanup removed the (still empty) directory.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            let _ = rustix::fs::unlinkat(root, name, AtFlags::REMOVEDIR);
            return Err(e);
        }
    };
    // A cleanup that locked it first is removing the directory; one that
    // locked it, removed it and let go leaves a lock file that is no
    // longer in the directory (or a directory no longer in the root).
    if !try_lock(&lock)? || !is_at(&lock, dir.as_fd(), LOCK)? || !is_at(&dir, root, name)? {
        return Ok(None);
    }
    Ok(Some((dir, lock)))
}

/// Take `f`'s exclusive flock without waiting; `false` if someone holds it.
fn try_lock(f: impl AsFd) -> io::Result<bool> {
    match rustix::fs::flock(f, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(Errno::WOULDBLOCK) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Whether the open file `f` is the entry `name` in `dir` (not one that
/// was unlinked or replaced since it was opened).
fn is_at(f: impl AsFd, dir: BorrowedFd<'_>, name: &str) -> io::Result<bool> {
    let held = rustix::fs::fstat(f)?;
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(m) => Ok(m.st_dev == held.st_dev && m.st_ino == held.st_ino),
        Err(Errno::NOENT) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

fn ignore_missing(r: rustix::io::Result<()>) -> io::Result<()> {
    match r {
        Err(Errno::NOENT) => Ok(()),
        r => Ok(r?),
    }
}

/// The names in the directory `dir`, but `.` and `..`.
pub(crate) fn entries(dir: BorrowedFd<'_>) -> io::Result<Vec<(CString, FileType)>> {
    let mut out = Vec::new();
    for e in rustix::fs::Dir::read_from(dir)? {
        let e = e?;
        let name = e.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        out.push((name.to_owned(), e.file_type()));
    }
    Ok(out)
}

/// Remove everything in the open directory `dir`, its lock file last (so
/// a removal that fails half-way leaves a directory still guarded by its
/// lock), then the entry `name` in `parent` if it is still that directory
/// (a name swapped meanwhile is left alone). Every step goes through a
/// directory's descriptor with `unlinkat`; a symbolic link is removed,
/// never followed; subdirectories are opened with `O_NOFOLLOW`, so one
/// swapped for a link between the check and the open is not entered.
/// Entries another cleanup removed first are no error.
fn remove_dir_at(parent: BorrowedFd<'_>, name: &str, dir: &OwnedFd, depth: u32) -> io::Result<()> {
    remove_contents(dir.as_fd(), depth)?;
    ignore_missing(rustix::fs::unlinkat(dir, LOCK, AtFlags::empty()))?;
    if is_at(dir, parent, name)? {
        ignore_missing(rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR))?;
    }
    Ok(())
}

/// Remove the entries of `dir` but its lock file (see [`remove_dir_at`]).
fn remove_contents(dir: BorrowedFd<'_>, depth: u32) -> io::Result<()> {
    if depth > MAX_DEPTH {
        return Err(io::Error::other(format!(
            "directories nested more than {MAX_DEPTH} deep: not a unit's, left alone"
        )));
    }
    for (name, _) in entries(dir)? {
        if name.as_bytes() == LOCK.as_bytes() {
            continue;
        }
        remove_entry(dir, &name, depth)?;
    }
    Ok(())
}

/// Remove `name` in `dir`: a file or link by unlinking it, a directory by
/// emptying it through its own descriptor first.
fn remove_entry(dir: BorrowedFd<'_>, name: &CStr, depth: u32) -> io::Result<()> {
    // A few rounds: an entry swapped between a file and a directory
    // meanwhile is looked at again.
    for _ in 0..4 {
        match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => return Ok(()),
            Err(Errno::ISDIR) | Err(Errno::PERM) => {}
            Err(e) => return Err(e.into()),
        }
        let sub = match open_dir_in(dir, name.to_bytes()) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if is_link_error(&e) => continue,
            Err(e) => return Err(e),
        };
        let name = name.to_str().map_err(io::Error::other)?;
        return remove_dir_at(dir, name, &sub, depth + 1);
    }
    Err(io::Error::other(format!(
        "{name:?} kept changing while being removed"
    )))
}

/// Remove unit directories under `root` (open as `root_fd`) whose lock
/// nobody holds, and temporary ones left by starts that died. Directories
/// whose lock file cannot be opened (another user's), is not a regular file
/// or is a link are left alone.
fn remove_dead_dirs(root_fd: BorrowedFd<'_>, root: &Path) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for (name, kind) in entries(root_fd)? {
        let Ok(name) = name.into_string() else {
            continue;
        };
        let temporary = name.starts_with(NEW_DIR_PREFIX);
        if !temporary && !name.starts_with(DIR_PREFIX) {
            continue;
        }
        if kind != FileType::Directory && kind != FileType::Unknown {
            continue;
        }
        let dir = match open_dir_in(root_fd, &name) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound || is_link_error(&e) => continue,
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => continue,
            Err(e) => return Err(e),
        };
        let path = root.join(&name);
        let lock = match open_in(
            dir.as_fd(),
            LOCK,
            OFlags::RDONLY | OFlags::NONBLOCK,
            Mode::empty(),
        ) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if temporary {
                    // Its maker may be about to create the lock file: only
                    // an empty directory goes, and rmdir checks that
                    // atomically. (Its maker then starts over.)
                    if rustix::fs::unlinkat(root_fd, name.as_str(), AtFlags::REMOVEDIR).is_ok() {
                        removed.push(path);
                    }
                } else {
                    // A unit directory gets its name with its lock file
                    // already in it and locked, and only a holder of the
                    // lock removes that file: this one's removal was cut
                    // short (or is finishing now).
                    remove_dir_at(root_fd, &name, &dir, 0)?;
                    removed.push(path);
                }
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied || is_link_error(&e) => {
                tracing::warn!(dir = %path.display(), error = %e, "a unit directory's lock file cannot be opened; left alone");
                continue;
            }
            Err(e) => return Err(e),
        };
        if rustix::fs::fstat(&lock).map(|s| FileType::from_raw_mode(s.st_mode))?
            != FileType::RegularFile
        {
            tracing::warn!(
                dir = %path.display(),
                "a unit directory's lock file is not a regular file (a FIFO or device \
                 planted there?); the directory is left alone"
            );
            continue;
        }
        // Held: its unit is alive (or another cleanup is removing it).
        // Free but no longer the directory's lock file: another cleanup
        // removed the directory after we opened it.
        if !try_lock(&lock)? || !is_at(&lock, dir.as_fd(), LOCK)? {
            continue;
        }
        // Its owner is gone. Keep holding the lock while removing, so no
        // start can take this directory for its own meanwhile.
        remove_dir_at(root_fd, &name, &dir, 0)?;
        removed.push(path);
        drop(lock);
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn dirfd(p: &Path) -> Arc<OwnedFd> {
        Arc::new(rustix::fs::open(p, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap())
    }

    fn engine(p: &Path) -> FileEngine {
        FileEngine::new(dirfd(p), p.to_owned(), 1)
    }

    #[test]
    fn blob_files_round_trip_and_detect_damage() {
        let dir = tempfile::tempdir().unwrap();
        let e = engine(dir.path());
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
            let e = FileEngine::with_chunk(dirfd(dir.path()), dir.path().to_owned(), chunk);
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
        let e = engine(dir.path());
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
        let e = FileEngine::with_chunk(dirfd(dir.path()), dir.path().to_owned(), 2);
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
        let e = engine(dir.path());
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
        let e = FileEngine::with_chunk(dirfd(dir.path()), dir.path().to_owned(), 16);
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
        let e = FileEngine::checkpoint(dirfd(dir.path()), dir.path().to_owned(), 1);
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

    /// `copy_all` reads a version 1 file once, whole, however small the
    /// pieces it hands on; and reports a damaged one after its last piece.
    #[test]
    fn version_1_files_are_copied_in_one_pass() {
        let dir = tempfile::tempdir().unwrap();
        let e = FileEngine::checkpoint(dirfd(dir.path()), dir.path().to_owned(), 1);
        let n = (8 << 20) + 5;
        let bytes = data(n, 4);
        let mut file = Vec::new();
        file.extend_from_slice(MAGIC);
        file.extend_from_slice(&1u32.to_le_bytes());
        file.extend_from_slice(&(n as u64).to_le_bytes());
        file.extend_from_slice(&bytes);
        file.extend_from_slice(&xxh3_64(&bytes).to_le_bytes());
        let p = e.path(BlobId(1));
        fs::write(&p, &file).unwrap();
        let copy = |buf: &mut [u8]| {
            let before = BYTES_READ.with(|b| b.get());
            let mut got = Vec::new();
            let mut most = 0;
            let r = e.reader(BlobId(1)).and_then(|r| {
                r.copy_all(buf, |piece| {
                    most = most.max(piece.len());
                    got.extend_from_slice(piece);
                    Ok(())
                })
            });
            (r, got, most, BYTES_READ.with(|b| b.get()) - before)
        };
        let mut buf = vec![0u8; 1 << 20];
        let (r, got, most, read) = copy(&mut buf);
        r.unwrap().unwrap();
        assert!(got == bytes);
        assert_eq!(most, 1 << 20, "pieces of the buffer's size");
        assert!(
            read <= 2 * file.len() as u64,
            "read {read} bytes to copy a file of {}",
            file.len()
        );
        flip(&p, V1_HEADER as usize + n / 2);
        let (r, got, _, _) = copy(&mut buf);
        assert!(matches!(r, Err(DiskError::Corrupt { .. })), "{:?}", r.err());
        assert_eq!(got.len(), n, "pieces reach the sink before the check");
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
        let mut removed = remove_dead_dirs(dirfd(r).as_fd(), r).unwrap();
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
        assert!(remove_dead_dirs(dirfd(r).as_fd(), r).unwrap().is_empty());
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
                        if let Err(e) = remove_dead_dirs(dirfd(root).as_fd(), root) {
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

    /// Two files of equal size swapped (or one copied over another, or
    /// one written by another unit instance): every read of either is
    /// Corrupt, never the other blob's bytes.
    #[test]
    fn a_file_under_another_blobs_name_is_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let e = engine(dir.path());
        put(&e, BlobId(1), &data(1000, 1), &[1000]);
        put(&e, BlobId(2), &data(1000, 2), &[1000]);
        let (a, b) = (e.path(BlobId(1)), e.path(BlobId(2)));
        let tmp = dir.path().join("t");
        fs::rename(&a, &tmp).unwrap();
        fs::rename(&b, &a).unwrap();
        fs::rename(&tmp, &b).unwrap();
        for blob in [BlobId(1), BlobId(2)] {
            assert!(corrupt_at(&e, blob, 0, 10));
            assert!(e.blob_size(blob).is_err());
            let err = e.read(blob, &mut vec![0u8; 1000]).unwrap_err().to_string();
            assert!(err.contains("another blob's name"), "{err}");
        }
        // Another instance's file under the right name.
        let other = FileEngine::new(dirfd(dir.path()), dir.path().to_owned(), 2);
        put(&other, BlobId(3), &data(10, 3), &[10]);
        let err = e.read(BlobId(3), &mut [0u8; 10]).unwrap_err().to_string();
        assert!(err.contains("instance"), "{err}");
        // A checkpoint reads any instance's files, still by blob id.
        let ck = FileEngine::checkpoint(dirfd(dir.path()), dir.path().to_owned(), 9);
        let mut got = [0u8; 10];
        ck.read(BlobId(3), &mut got).unwrap();
        assert!(got[..] == data(10, 3)[..]);
        assert!(ck.read(BlobId(1), &mut vec![0u8; 1000]).is_err());
    }

    /// A version 2 file (no blob id) is read from checkpoints only.
    #[test]
    fn version_2_files_are_read_from_checkpoints_only() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = data(100, 4);
        let mut h = [0u8; V2_HEADER as usize];
        h[..4].copy_from_slice(MAGIC);
        h[4..8].copy_from_slice(&2u32.to_le_bytes());
        h[8..16].copy_from_slice(&100u64.to_le_bytes());
        h[16..20].copy_from_slice(&64u32.to_le_bytes());
        let sum = xxh3_64(&h[..24]);
        h[24..32].copy_from_slice(&sum.to_le_bytes());
        let mut file = h.to_vec();
        file.extend_from_slice(&bytes);
        file.extend_from_slice(&xxh3_64(&bytes[..64]).to_le_bytes());
        file.extend_from_slice(&xxh3_64(&bytes[64..]).to_le_bytes());
        let live = engine(dir.path());
        fs::write(live.path(BlobId(5)), &file).unwrap();
        let mut got = vec![0u8; 100];
        let err = live.read(BlobId(5), &mut got).unwrap_err().to_string();
        assert!(err.contains("format version 2"), "{err}");
        let ck = FileEngine::checkpoint(dirfd(dir.path()), dir.path().to_owned(), 1);
        ck.read(BlobId(5), &mut got).unwrap();
        assert!(got == bytes);
    }

    /// Names are single components; a link in the directory is never
    /// followed by a read, a write or a delete.
    #[test]
    fn links_in_the_directory_are_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let e = engine(dir.path());
        put(
            &elsewhere_engine(elsewhere.path()),
            BlobId(1),
            b"theirs",
            &[6],
        );
        std::os::unix::fs::symlink(
            elsewhere.path().join(FileEngine::name(BlobId(1))),
            e.path(BlobId(1)),
        )
        .unwrap();
        assert!(corrupt_at(&e, BlobId(1), 0, 1));
        // A tmp name linked elsewhere: the write fails rather than follow.
        let target = elsewhere.path().join("victim");
        fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join(FileEngine::tmp_name(BlobId(2))))
            .unwrap();
        assert!(e.create(BlobId(2), 1).is_err());
        e.delete(BlobId(2)).unwrap();
        e.delete(BlobId(1)).unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"keep");
        assert!(elsewhere.path().join(FileEngine::name(BlobId(1))).exists());
        assert!(open_in(
            dirfd(dir.path()).as_fd(),
            "../x",
            OFlags::RDONLY,
            Mode::empty()
        )
        .is_err());
    }

    fn elsewhere_engine(p: &Path) -> FileEngine {
        FileEngine::new(dirfd(p), p.to_owned(), 1)
    }

    /// Removing a unit's directory empties it through its descriptor: a
    /// link in it (to a directory, or the directory itself swapped for a
    /// link) is removed or left, never followed.
    #[test]
    fn removal_follows_no_link() {
        let root = tempfile::tempdir().unwrap();
        let victim = tempfile::tempdir().unwrap();
        fs::write(victim.path().join("keep"), b"x").unwrap();
        fs::create_dir(victim.path().join("sub")).unwrap();
        fs::write(victim.path().join("sub/keep"), b"y").unwrap();
        let (d, _) = OwnedDir::create(root.path(), "a", 1).unwrap();
        std::os::unix::fs::symlink(victim.path(), d.path.join("link")).unwrap();
        fs::create_dir(d.path.join("nested")).unwrap();
        std::os::unix::fs::symlink(victim.path(), d.path.join("nested/link")).unwrap();
        fs::write(d.path.join("nested/file"), b"z").unwrap();
        d.remove().unwrap();
        assert!(!d.path.exists());
        // The directory swapped for a link before removal.
        let (d, _) = OwnedDir::create(root.path(), "b", 2).unwrap();
        fs::write(d.path.join("0.blob"), b"z").unwrap();
        let moved = root.path().join("moved");
        fs::rename(&d.path, &moved).unwrap();
        std::os::unix::fs::symlink(victim.path(), &d.path).unwrap();
        d.remove().unwrap();
        assert_eq!(
            fs::read_dir(&moved).unwrap().count(),
            0,
            "its own files went"
        );
        assert!(fs::symlink_metadata(&d.path)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(fs::read(victim.path().join("keep")).unwrap(), b"x");
        assert_eq!(fs::read(victim.path().join("sub/keep")).unwrap(), b"y");
        // A dead unit's directory that is a link, or holds one: the
        // cleanup removes the links and its own files only.
        fs::remove_file(&d.path).unwrap();
        let dead = root.path().join("stowage-unit-dead-1-00000001");
        fs::create_dir(&dead).unwrap();
        fs::write(dead.join(LOCK), b"").unwrap();
        std::os::unix::fs::symlink(victim.path(), dead.join("link")).unwrap();
        std::os::unix::fs::symlink(victim.path(), root.path().join("stowage-unit-l-1-00000002"))
            .unwrap();
        let r = root.path();
        remove_dead_dirs(dirfd(r).as_fd(), r).unwrap();
        assert!(!dead.exists());
        assert_eq!(fs::read(victim.path().join("keep")).unwrap(), b"x");
        assert_eq!(fs::read(victim.path().join("sub/keep")).unwrap(), b"y");
    }

    /// A FIFO (or any non-regular file) as a lock file is opened without
    /// blocking and its directory left alone.
    #[test]
    fn a_fifo_lock_file_is_skipped_without_blocking() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let dead = r.join("stowage-unit-x-1-00000001");
        fs::create_dir(&dead).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            dead.join(LOCK),
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert!(remove_dead_dirs(dirfd(r).as_fd(), r).unwrap().is_empty());
        assert!(dead.exists());
        let (d, _) = OwnedDir::create(r, "y", 2).unwrap();
        d.remove().unwrap();
    }

    /// A root that is a link, or writable by group or others, is refused
    /// with the fix; a missing one is made 0700.
    #[test]
    fn only_a_private_root_is_taken() {
        use std::os::unix::fs::PermissionsExt;
        let base = tempfile::tempdir().unwrap();
        let fresh = base.path().join("a/b");
        open_private_root(&fresh, "disk root").unwrap();
        let mode = fs::metadata(&fresh).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        for m in [0o777, 0o770, 0o702, 0o1777] {
            fs::set_permissions(&fresh, fs::Permissions::from_mode(m)).unwrap();
            let err = open_private_root(&fresh, "disk root")
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("writable by") && err.contains("chmod 700"),
                "{m:o}: {err}"
            );
        }
        fs::set_permissions(&fresh, fs::Permissions::from_mode(0o755)).unwrap();
        open_private_root(&fresh, "disk root").unwrap();
        let link = base.path().join("link");
        std::os::unix::fs::symlink(&fresh, &link).unwrap();
        let err = open_private_root(&link, "disk root")
            .unwrap_err()
            .to_string();
        assert!(err.contains("symbolic link"), "{err}");
    }
}
