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

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rustix::fs::{AtFlags, Mode, OFlags};
use rustix::io::Errno;
use stowage_core::BlobId;
use xxhash_rust::xxh3::{xxh3_64, Xxh3Default};

mod format;
mod root;

#[cfg(test)]
pub(crate) use format::BYTES_READ;
use format::*;
pub use format::{is_disk_full, read_through, BlobReader, BlobWriter, DiskError, CHUNK};
pub(crate) use root::{entries, is_link_error, open_dir_in};
pub use root::{open_in, open_private_root, OwnedDir};
#[cfg(test)]
mod tests;

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
