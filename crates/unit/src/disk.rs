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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

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
