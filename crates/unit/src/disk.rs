//! The disk tier: one owner-only, locked directory per unit, one file per
//! spilled blob, each with its checksum.
//!
//! A blob file is `STWB` · version · byte count · the bytes · xxh3-64 of
//! the bytes. Files are written under a temporary name, synced and renamed,
//! so a file that exists under its blob's name is complete; a read checks
//! its length and checksum and reports [`DiskError::Corrupt`] rather than
//! ever returning wrong bytes.
//!
//! The engine sits behind [`DiskEngine`] (plain pread/pwrite here; another
//! engine, e.g. io_uring, can take its place) with a failpoint seam
//! ([`Failpoints`]) for tests.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::FlockOperation;
use stowage_core::BlobId;
use xxhash_rust::xxh3::Xxh3Default;

const MAGIC: &[u8; 4] = b"STWB";
const VERSION: u32 = 1;
const HEADER: u64 = 16;
const TRAILER: u64 = 8;
/// Reads are checked in pieces of this size.
const READ_CHUNK: usize = 256 << 10;

/// Why a blob could not be read back.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The file is missing, short, or its checksum does not match.
    #[error("blob file {path} is corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
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
    /// Read the whole blob into `dst` (exactly its size), checking it.
    fn read(&self, blob: BlobId, dst: &mut [u8]) -> Result<(), DiskError>;
    /// Remove the blob's file (a missing file is not an error).
    fn delete(&self, blob: BlobId) -> io::Result<()>;
    /// The blob's file path (for checkpoints and tests).
    fn path(&self, blob: BlobId) -> PathBuf;
}

/// A blob file being written.
pub trait BlobWriter: Send {
    fn write(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// Check the length, append the checksum, sync, and give the file its
    /// final name. Returns the xxh3 of the whole file (for manifests).
    fn finish(self: Box<Self>) -> io::Result<u64>;
}

/// Files in one directory, with plain positioned I/O.
pub struct FileEngine {
    dir: PathBuf,
    pub failpoints: Failpoints,
}

impl FileEngine {
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            failpoints: Failpoints::default(),
        }
    }

    fn tmp_path(&self, blob: BlobId) -> PathBuf {
        self.dir.join(format!("{:032x}.tmp", blob.0))
    }
}

struct FileWriter {
    file: File,
    tmp: PathBuf,
    dst: PathBuf,
    expected: u64,
    written: u64,
    /// Of the data, for the trailer.
    hash: Xxh3Default,
    /// Of the whole file, header and trailer included.
    file_hash: Xxh3Default,
    fail: bool,
}

impl BlobWriter for FileWriter {
    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        if self.fail {
            return Err(io::Error::other("failpoint disk-write"));
        }
        self.file.write_all(bytes)?;
        self.hash.update(bytes);
        self.file_hash.update(bytes);
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> io::Result<u64> {
        if self.fail {
            let _ = fs::remove_file(&self.tmp);
            return Err(io::Error::other("failpoint disk-write"));
        }
        if self.written != self.expected {
            let _ = fs::remove_file(&self.tmp);
            return Err(io::Error::other(format!(
                "blob file got {} of {} bytes",
                self.written, self.expected
            )));
        }
        let sum = self.hash.digest().to_le_bytes();
        self.file_hash.update(&sum);
        let r = self
            .file
            .write_all(&sum)
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
        let fail = self.failpoints.disk_write.load(Ordering::SeqCst);
        let tmp = self.tmp_path(blob);
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        let mut header = [0u8; HEADER as usize];
        header[..4].copy_from_slice(MAGIC);
        header[4..8].copy_from_slice(&VERSION.to_le_bytes());
        header[8..16].copy_from_slice(&nbytes.to_le_bytes());
        file.write_all(&header)?;
        Ok(Box::new(FileWriter {
            file,
            tmp,
            dst: self.path(blob),
            expected: nbytes,
            written: 0,
            hash: Xxh3Default::new(),
            file_hash: {
                let mut h = Xxh3Default::new();
                h.update(&header);
                h
            },
            fail,
        }))
    }

    fn read(&self, blob: BlobId, dst: &mut [u8]) -> Result<(), DiskError> {
        let path = self.path(blob);
        let corrupt = |reason: String| DiskError::Corrupt {
            path: path.clone(),
            reason,
        };
        let file = File::open(&path).map_err(|e| corrupt(format!("cannot open: {e}")))?;
        let size = file.metadata()?.len();
        let want = HEADER + dst.len() as u64 + TRAILER;
        if size != want {
            return Err(corrupt(format!("{size} bytes, expected {want}")));
        }
        let mut header = [0u8; HEADER as usize];
        file.read_exact_at(&mut header, 0)?;
        let mut n = [0u8; 8];
        n.copy_from_slice(&header[8..16]);
        if &header[..4] != MAGIC || u64::from_le_bytes(n) != dst.len() as u64 {
            return Err(corrupt("bad header".into()));
        }
        // Read and hash chunk by chunk, so each chunk is hashed while it is
        // still in cache.
        let mut hash = Xxh3Default::new();
        let mut at = 0;
        for chunk in dst.chunks_mut(READ_CHUNK) {
            file.read_exact_at(chunk, HEADER + at)?;
            hash.update(chunk);
            at += chunk.len() as u64;
        }
        let mut sum = [0u8; 8];
        file.read_exact_at(&mut sum, HEADER + dst.len() as u64)?;
        if hash.digest() != u64::from_le_bytes(sum) {
            return Err(corrupt("checksum mismatch".into()));
        }
        Ok(())
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
pub struct OwnedDir {
    pub path: PathBuf,
    /// Holds the lock; closing it releases the lock.
    _lock: File,
}

/// Prefix of unit directories under the root.
const DIR_PREFIX: &str = "stowage-unit-";

impl OwnedDir {
    /// Create and lock a fresh directory for unit `name` under `root`,
    /// after removing directories of units that are gone (their lock is
    /// free). A live unit's directory is never touched.
    pub fn create(root: &Path, name: &str, instance: u128) -> io::Result<(Self, Vec<PathBuf>)> {
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
        let path = root.join(format!(
            "{DIR_PREFIX}{safe}-{}-{:08x}",
            std::process::id(),
            instance as u32
        ));
        fs::DirBuilder::new().mode(0o700).create(&path)?;
        let lock = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path.join("lock"))?;
        rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive)?;
        Ok((Self { path, _lock: lock }, removed))
    }

    /// Remove the directory and everything in it.
    pub fn remove(&self) -> io::Result<()> {
        fs::remove_dir_all(&self.path)
    }
}

/// Remove unit directories under `root` whose lock nobody holds.
fn remove_dead_dirs(root: &Path) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for entry in fs::read_dir(root)? {
        let entry = entry?;
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with(DIR_PREFIX) || !entry.file_type()?.is_dir() {
            continue;
        }
        let dir = entry.path();
        let lock = match OpenOptions::new().write(true).open(dir.join("lock")) {
            Ok(f) => f,
            // No lock file: a unit died between mkdir and creating it.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::remove_dir_all(&dir)?;
                removed.push(dir);
                continue;
            }
            Err(e) => return Err(e),
        };
        if rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive).is_ok() {
            // Nobody holds it: its owner is gone.
            fs::remove_dir_all(&dir)?;
            removed.push(dir);
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        // Flip a byte of the data.
        let p = e.path(BlobId(7));
        let mut bytes = fs::read(&p).unwrap();
        bytes[HEADER as usize + 3] ^= 1;
        fs::write(&p, &bytes).unwrap();
        assert!(matches!(
            e.read(BlobId(7), &mut out),
            Err(DiskError::Corrupt { .. })
        ));
        // Truncate it.
        fs::write(&p, &bytes[..12]).unwrap();
        assert!(matches!(
            e.read(BlobId(7), &mut out),
            Err(DiskError::Corrupt { .. })
        ));
        e.delete(BlobId(7)).unwrap();
        e.delete(BlobId(7)).unwrap();
        assert!(matches!(
            e.read(BlobId(7), &mut out),
            Err(DiskError::Corrupt { .. })
        ));
        // Short writes and the failpoint leave no file.
        let mut w = e.create(BlobId(8), 10).unwrap();
        w.write(b"short").unwrap();
        assert!(w.finish().is_err());
        e.failpoints.enable("disk-write").unwrap();
        let mut w = e.create(BlobId(9), 1).unwrap();
        assert!(w.write(b"x").is_err());
        assert!(w.finish().is_err());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
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
}
