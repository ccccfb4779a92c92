//! Owner-local checkpoints: a unit writes its committed data and index to
//! a directory, and a unit started with `--restore` serves them again.
//!
//! Layout of a checkpoint directory (one per unit):
//!
//! ```text
//!  <blob>.blob   one per blob, the disk tier's format (bytes + xxh3 per chunk)
//!  index         postcard: every entry (namespace, row, field, blob, offset, len, meta)
//!  claims        postcard: every registered partition's tasks and consumption ([`claims`])
//!  MANIFEST      postcard: version, counts, each file's name, size and xxh3; then its own xxh3
//! ```
//!
//! The manifest is written last, synced, and renamed into place: a
//! directory without a valid manifest, or whose files do not match it, is
//! an incomplete checkpoint and is refused at restore.
//!
//! Consistency: the entries are taken from the core in one step (every put
//! that completed before the request is in, nothing half-committed is) and
//! their blobs are pinned while they are copied; committed blobs never
//! change, so no blob is torn. The claims state is taken in that same
//! step: a row is consumed in the checkpoint only if its entries are in it.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rustix::fs::{AtFlags, Mode, OFlags};
use serde::{Deserialize, Serialize};
use stowage_core::{Allocated, BlobId, Committed, EntrySpec, Key, Placement};
use stowage_wire::{CheckpointFile, CheckpointInfo};

use crate::disk::{self, DiskEngine, FileEngine};
use crate::handler;
use crate::shared::Shared;
use crate::tier::{cut, read_through, PieceWriter, COPY_CHUNK};

pub(crate) mod claims;
pub use claims::merge as merge_claims_states;
use claims::{CLAIMS, MAX_CLAIMS};
pub(crate) mod homes;
use homes::{Homes, Piece};

const MANIFEST: &str = "MANIFEST";
const MANIFEST_TMP: &str = "MANIFEST.tmp";
const INDEX: &str = "index";
const VERSION: u32 = 1;

/// Largest manifest a restore reads (about 60 bytes per file).
const MAX_MANIFEST: u64 = 256 << 20;
/// Largest index a restore reads.
const MAX_INDEX: u64 = 4 << 30;

#[derive(Serialize, Deserialize)]
struct IndexEntry {
    partition: String,
    row: u64,
    field: String,
    blob: BlobId,
    offset: u64,
    len: u64,
    meta: Vec<u8>,
}

#[derive(Serialize, Deserialize)]
struct Manifest {
    version: u32,
    rows: u64,
    entries: u64,
    bytes: u64,
    /// Blob files, then the index, then the claims (none in a checkpoint
    /// written before claims were kept).
    files: Vec<CheckpointFile>,
}

/// Why a checkpoint could not be written or restored.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint directory {0}: {1}")]
    Io(String, io::Error),
    #[error("incomplete or damaged checkpoint in {dir}: {reason}")]
    Incomplete { dir: String, reason: String },
    #[error("checkpoint abandoned: the unit is shutting down")]
    Abandoned,
    #[error("restoring: {0}")]
    Restore(String),
}

fn io_err(dir: &Path) -> impl Fn(io::Error) -> CheckpointError + '_ {
    move |e| CheckpointError::Io(dir.display().to_string(), e)
}

/// Create `name` in `dir` (it must not exist), write `bytes`, sync.
fn write_synced(dir: BorrowedFd<'_>, name: &str, bytes: &[u8]) -> io::Result<()> {
    let mut f = File::from(disk::open_in(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL,
        Mode::from_raw_mode(0o600),
    )?);
    f.write_all(bytes)?;
    f.sync_all()
}

/// A checkpoint directory a request named, under the unit's checkpoint
/// root: the root's descriptor and the names leading from it.
pub(crate) struct CheckpointDir {
    /// For messages.
    pub(crate) path: PathBuf,
    root: OwnedFd,
    names: Vec<String>,
}

/// The directory a Checkpoint request names, if it lies under the unit's
/// checkpoint root: a relative name is taken under the root; an absolute
/// path must be inside it. `..` is refused, and so is a symbolic link
/// anywhere under the root on the way (the directories are opened one by
/// one from the root's descriptor, none followed; the root itself must be
/// owned by the unit's user and writable by nobody else).
pub(crate) fn resolve_dir(root: Option<&Path>, dir: &str) -> Result<CheckpointDir, String> {
    let Some(root) = root else {
        return Err("this unit takes no checkpoints: start it with --checkpoint-root DIR".into());
    };
    let root_fd = disk::open_private_root(root, "checkpoint root").map_err(|e| e.to_string())?;
    let real_root = root
        .canonicalize()
        .map_err(|e| format!("checkpoint root {}: {e}", root.display()))?;
    let asked = Path::new(dir);
    if asked
        .components()
        .any(|c| matches!(c, Component::ParentDir))
    {
        return Err(format!("checkpoint path {dir:?} may not contain '..'"));
    }
    let outside = || {
        format!(
            "checkpoint path {dir:?} is outside this unit's checkpoint root {}",
            real_root.display()
        )
    };
    let rel = if asked.is_absolute() {
        asked
            .strip_prefix(&real_root)
            .or_else(|_| asked.strip_prefix(root))
            .map_err(|_| outside())?
    } else {
        asked
    };
    let mut names = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => names.push(
                n.to_str()
                    .ok_or_else(|| format!("checkpoint path {dir:?} is not UTF-8"))?
                    .to_owned(),
            ),
            Component::CurDir => {}
            _ => return Err(outside()),
        }
    }
    if names.is_empty() {
        return Err(format!(
            "checkpoint path {dir:?} names the checkpoint root itself: give a directory under it"
        ));
    }
    // The part that exists now must hold no link (checked again as the
    // directories are opened to write).
    let mut cur = root_fd.try_clone().map_err(|e| e.to_string())?;
    for n in &names {
        match disk::open_dir_in(cur.as_fd(), n) {
            Ok(d) => cur = d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => break,
            Err(e) if disk::is_link_error(&e) => return Err(through_link(dir, n)),
            Err(e) => return Err(format!("checkpoint path {dir:?}: {e}")),
        }
    }
    let mut path = real_root;
    path.extend(&names);
    Ok(CheckpointDir {
        path,
        root: root_fd,
        names,
    })
}

fn through_link(dir: &str, name: &str) -> String {
    format!(
        "checkpoint path {dir:?} goes through {name:?}, which is a symbolic link (or not a \
         directory): the unit follows no link under its checkpoint root"
    )
}

/// Write the unit's committed data and index to `dir` (which must not
/// exist or be empty), every file through the directory's descriptor:
/// every row, or with `homes` only the rows of those homes ([`homes`]).
/// Returns the metadata; no payload leaves the unit.
pub(crate) fn write(
    shared: &Shared,
    dir: &CheckpointDir,
    homes: Option<&Homes>,
) -> Result<CheckpointInfo, CheckpointError> {
    let ioe = io_err(&dir.path);
    let mut cur = dir.root.try_clone().map_err(&ioe)?;
    for n in &dir.names {
        match rustix::fs::mkdirat(&cur, n.as_str(), Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(ioe(e.into())),
        }
        cur = disk::open_dir_in(cur.as_fd(), n).map_err(|e| {
            if disk::is_link_error(&e) {
                ioe(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    through_link(&dir.path.display().to_string(), n),
                ))
            } else {
                ioe(e)
            }
        })?;
    }
    if !disk::entries(cur.as_fd()).map_err(&ioe)?.is_empty() {
        return Err(ioe(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "directory is not empty",
        )));
    }
    let snap = match shared
        .core()
        .handle(shared.now(), stowage_core::input::TakeSnapshot)
    {
        Ok(snap) => snap,
        other => {
            return Err(ioe(io::Error::other(format!(
                "the unit's core answered a snapshot with {other:?}"
            ))))
        }
    };
    let result = match homes {
        None => write_snapshot(shared, Arc::new(cur), &dir.path, &snap, &Default::default()),
        Some(h) => {
            let (kept, pieces) = homes::keep(&snap, h);
            write_snapshot(shared, Arc::new(cur), &dir.path, &kept, &pieces)
        }
    };
    if let Some(pin) = snap.pin {
        let now = shared.now();
        let _ = handler::unpin(&mut shared.core(), stowage_core::Owner::UNIT, pin, now);
    }
    result.map(|info| CheckpointInfo {
        stored: dir.names.join("/"),
        ..info
    })
}

/// Write `snap`'s blobs, index and claims; a blob `compacted` names is
/// written as its pieces (its size in `snap` is theirs), any other whole.
fn write_snapshot(
    shared: &Shared,
    dir_fd: Arc<OwnedFd>,
    dir: &Path,
    snap: &stowage_core::Snapshot,
    compacted: &std::collections::HashMap<BlobId, Vec<Piece>>,
) -> Result<CheckpointInfo, CheckpointError> {
    let ioe = io_err(dir);
    let out = FileEngine::checkpoint(dir_fd.clone(), dir.to_owned(), shared.settings.instance_id);
    let mut files = Vec::with_capacity(snap.blobs.len() + 1);
    let mut bytes = 0;
    let mut buf = Vec::new();
    for (blob, nbytes, place) in &snap.blobs {
        let (blob, nbytes) = (*blob, *nbytes);
        if shared.life.stop.load(Ordering::SeqCst) {
            return Err(CheckpointError::Abandoned);
        }
        usize::try_from(nbytes).map_err(|_| CheckpointError::Restore("blob too large".into()))?;
        let mut w = out.create(blob, nbytes).map_err(&ioe)?;
        let whole = [Piece::Copy {
            from: 0,
            len: nbytes,
        }];
        let pieces = compacted.get(&blob).map_or(&whole[..], |p| &p[..]);
        for piece in pieces {
            let (from, len) = match *piece {
                Piece::Copy { from, len } => (from, len),
                Piece::Zeros(n) => {
                    buf.clear();
                    buf.resize((n as usize).min(COPY_CHUNK), 0);
                    let mut left = n as usize;
                    while left > 0 {
                        let k = left.min(buf.len());
                        w.write(&buf[..k]).map_err(&ioe)?;
                        left -= k;
                    }
                    continue;
                }
            };
            copy_range(shared, blob, place, from, len, &mut buf, &mut |c| {
                w.write(c)
            })?
            .map_err(&ioe)?;
        }
        let xxh3 = w.finish().map_err(&ioe)?;
        let name = file_name(&out.path(blob));
        let size = rustix::fs::statat(&dir_fd, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| ioe(e.into()))?
            .st_size as u64;
        files.push(CheckpointFile { name, size, xxh3 });
        bytes += nbytes;
    }
    let index: Vec<IndexEntry> = snap
        .entries
        .iter()
        .map(|e| IndexEntry {
            partition: e.partition.clone(),
            row: e.key.row,
            field: e.key.field.clone(),
            blob: e.blob,
            offset: e.offset,
            len: e.len,
            meta: e.meta.clone(),
        })
        .collect();
    let index_bytes =
        postcard::to_allocvec(&index).map_err(|e| CheckpointError::Restore(e.to_string()))?;
    write_synced(dir_fd.as_fd(), INDEX, &index_bytes).map_err(&ioe)?;
    files.push(CheckpointFile {
        name: INDEX.into(),
        size: index_bytes.len() as u64,
        xxh3: xxhash_rust::xxh3::xxh3_64(&index_bytes),
    });
    let claims_bytes =
        claims::encode(&snap.claims).map_err(|e| CheckpointError::Restore(e.to_string()))?;
    write_synced(dir_fd.as_fd(), CLAIMS, &claims_bytes).map_err(&ioe)?;
    files.push(CheckpointFile {
        name: CLAIMS.into(),
        size: claims_bytes.len() as u64,
        xxh3: xxhash_rust::xxh3::xxh3_64(&claims_bytes),
    });
    let rows = {
        let mut r: Vec<(&str, u64)> = snap
            .entries
            .iter()
            .map(|e| (e.partition.as_str(), e.key.row))
            .collect();
        r.sort_unstable();
        r.dedup();
        r.len() as u64
    };
    let manifest = Manifest {
        version: VERSION,
        rows,
        entries: snap.entries.len() as u64,
        bytes,
        files,
    };
    let mut m =
        postcard::to_allocvec(&manifest).map_err(|e| CheckpointError::Restore(e.to_string()))?;
    let sum = xxhash_rust::xxh3::xxh3_64(&m);
    m.extend_from_slice(&sum.to_le_bytes());
    write_synced(dir_fd.as_fd(), MANIFEST_TMP, &m).map_err(&ioe)?;
    rustix::fs::renameat(&dir_fd, MANIFEST_TMP, &dir_fd, MANIFEST).map_err(|e| ioe(e.into()))?;
    rustix::fs::fsync(&dir_fd).map_err(|e| ioe(e.into()))?;
    Ok(CheckpointInfo {
        rows: manifest.rows,
        entries: manifest.entries,
        bytes: manifest.bytes,
        files: manifest.files,
        manifest_xxh3: sum,
        host: host_name(),
        stored: String::new(),
    })
}

/// Pass bytes `from..from + len` of blob `blob`, at `place`, to `sink`
/// (through `buf`, in pieces of at most [`COPY_CHUNK`]).
fn copy_range(
    shared: &Shared,
    blob: BlobId,
    place: &Placement,
    from: u64,
    len: u64,
    buf: &mut Vec<u8>,
    sink: &mut dyn FnMut(&[u8]) -> io::Result<()>,
) -> Result<io::Result<()>, CheckpointError> {
    let bounds = |e| CheckpointError::Restore(format!("blob {blob:?}: {e}"));
    let ranges = match place {
        // The snapshot's pin holds the ranges while they are copied.
        Placement::Memory(l) => vec![(l.offset + from, len)],
        // A blob in pieces: the ones the range lies in, in turn.
        Placement::Split(parts) => {
            let parts: Vec<(u64, u64)> = parts.iter().map(|l| (l.offset, l.len)).collect();
            homes::within(&parts, from, len)
        }
        Placement::Disk { .. } => {
            let Some(d) = &shared.disk else {
                return Err(CheckpointError::Restore(
                    "spilled blob without a disk tier".into(),
                ));
            };
            buf.resize((len as usize).min(COPY_CHUNK), 0);
            return match d
                .engine
                .reader(blob)
                .and_then(|r| read_through(&r, from, len, buf, sink))
            {
                Ok(r) => Ok(r),
                Err(e) => Ok(Err(io::Error::other(e.to_string()))),
            };
        }
    };
    for (offset, n) in ranges {
        buf.resize((n as usize).min(COPY_CHUNK), 0);
        let r = shared
            .slab
            .copy_out_chunked(offset, n as usize, buf, &mut *sink)
            .map_err(bounds)?;
        if r.is_err() {
            return Ok(r);
        }
    }
    Ok(Ok(()))
}

/// This host's name (`/proc/sys/kernel/hostname`; empty if unreadable).
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// A checkpoint directory a restore asked for, under the unit's
/// checkpoint root.
pub(crate) enum Found {
    /// It is there: its descriptor (opened from the root's, no link
    /// followed), its path (for messages) and its names under the root.
    Dir {
        fd: OwnedFd,
        path: PathBuf,
        stored: String,
    },
    /// Nothing there: its path and what is missing.
    Missing { path: PathBuf, missing: String },
}

/// The existing checkpoint directory `dir` names under the unit's
/// checkpoint root (as [`resolve_dir`] takes it: a relative name under the
/// root, or an absolute path inside it; no `..`), each directory opened
/// from the root's descriptor with no symbolic link followed. A name that
/// does not exist is [`Found::Missing`]; a link or a path outside the root
/// is an error.
pub(crate) fn find_dir(root: Option<&Path>, dir: &str) -> Result<Found, String> {
    let d = resolve_dir(root, dir)?;
    let mut cur = d.root;
    let mut here = d.path.clone();
    for _ in &d.names {
        here.pop();
    }
    for n in &d.names {
        here.push(n);
        match disk::open_dir_in(cur.as_fd(), n) {
            Ok(next) => cur = next,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(Found::Missing {
                    missing: format!("no directory {}", here.display()),
                    path: d.path,
                })
            }
            Err(e) if disk::is_link_error(&e) => return Err(through_link(dir, n)),
            Err(e) => return Err(format!("checkpoint path {dir:?}: {e}")),
        }
    }
    if let Err(e) = disk::open_in(cur.as_fd(), MANIFEST, OFlags::RDONLY, Mode::empty()) {
        if e.kind() == io::ErrorKind::NotFound {
            return Ok(Found::Missing {
                missing: format!("no {MANIFEST} in {}", d.path.display()),
                path: d.path,
            });
        }
    }
    Ok(Found::Dir {
        fd: cur,
        stored: d.names.join("/"),
        path: d.path,
    })
}

/// Bytes of the regular files directly in directory `dir` (no link
/// followed).
pub(crate) fn files_bytes(dir: BorrowedFd<'_>) -> io::Result<u64> {
    let mut sum = 0u64;
    for (name, _) in disk::entries(dir)? {
        let st = rustix::fs::statat(dir, name.as_c_str(), AtFlags::SYMLINK_NOFOLLOW)?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            continue;
        }
        sum = sum.saturating_add(u64::try_from(st.st_size).unwrap_or(0));
    }
    Ok(sum)
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Whether `name` is one a checkpoint holds: the index, the claims, or a
/// blob file (`<32 hex digits>.blob`), a plain name in the checkpoint's
/// directory.
fn is_checkpoint_name(name: &str) -> bool {
    name == INDEX
        || name == CLAIMS
        || name.strip_suffix(".blob").is_some_and(|h| {
            h.len() == 32
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
}

/// Open `name` in the checkpoint directory: a regular file, not a link.
fn open_file(dir: BorrowedFd<'_>, name: &str) -> io::Result<(File, u64)> {
    let f = File::from(disk::open_in(
        dir,
        name,
        OFlags::RDONLY | OFlags::NONBLOCK,
        Mode::empty(),
    )?);
    let m = f.metadata()?;
    if !m.file_type().is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    Ok((f, m.len()))
}

/// Read all of `name` in `dir`, refusing one larger than `max` bytes.
fn read_file(dir: BorrowedFd<'_>, name: &str, max: u64) -> io::Result<Vec<u8>> {
    let (mut f, len) = open_file(dir, name)?;
    if len > max {
        return Err(io::Error::other(format!(
            "{len} bytes, more than a checkpoint's {name} may hold ({max})"
        )));
    }
    let mut v = Vec::with_capacity(len as usize);
    Read::by_ref(&mut f).take(max).read_to_end(&mut v)?;
    Ok(v)
}

/// Load a checkpoint directory into a fresh unit, checking every file
/// against the manifest first. The manifest may name only files of the
/// checkpoint's own directory (the index and `<blob>.blob` files), each
/// opened there without following links; every blob the index names must
/// be listed in it, and each blob file's header must name the blob it is
/// restored as; sizes are checked before anything is allocated.
pub(crate) fn restore(shared: &Shared, dir: &Path) -> Result<CheckpointInfo, CheckpointError> {
    let dfd = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| CheckpointError::Incomplete {
        dir: dir.display().to_string(),
        reason: format!("cannot open the directory ({e})"),
    })?;
    restore_from(shared, dfd, dir)
}

/// [`restore`] from the directory open at `dfd` (`dir`: its path, for
/// messages).
pub(crate) fn restore_from(
    shared: &Shared,
    dfd: OwnedFd,
    dir: &Path,
) -> Result<CheckpointInfo, CheckpointError> {
    let incomplete = |reason: String| CheckpointError::Incomplete {
        dir: dir.display().to_string(),
        reason,
    };
    let raw = read_file(dfd.as_fd(), MANIFEST, MAX_MANIFEST)
        .map_err(|e| incomplete(format!("no manifest ({e})")))?;
    if raw.len() < 8 {
        return Err(incomplete("manifest truncated".into()));
    }
    let (body, sum) = raw.split_at(raw.len() - 8);
    let mut s = [0u8; 8];
    s.copy_from_slice(sum);
    if xxhash_rust::xxh3::xxh3_64(body) != u64::from_le_bytes(s) {
        return Err(incomplete("manifest checksum mismatch".into()));
    }
    let manifest: Manifest =
        postcard::from_bytes(body).map_err(|e| incomplete(format!("manifest unreadable: {e}")))?;
    if manifest.version != VERSION {
        return Err(incomplete(format!(
            "checkpoint version {} (this build reads {VERSION})",
            manifest.version
        )));
    }
    let mut listed = HashSet::new();
    let mut index_size = None;
    let mut buf = vec![0u8; COPY_CHUNK];
    for f in &manifest.files {
        if !is_checkpoint_name(&f.name) {
            return Err(incomplete(format!(
                "the manifest names {:?}, which is no file of a checkpoint (only {INDEX}, \
                 {CLAIMS} and <32 hex digits>.blob, in the checkpoint's own directory): refused",
                f.name
            )));
        }
        if !listed.insert(f.name.as_str()) {
            return Err(incomplete(format!("the manifest lists {} twice", f.name)));
        }
        if f.name == INDEX {
            index_size = Some(f.size);
        }
        let (mut file, len) = open_file(dfd.as_fd(), &f.name)
            .map_err(|e| incomplete(format!("{} missing ({e})", f.name)))?;
        if len != f.size {
            return Err(incomplete(format!(
                "{} has {len} bytes, manifest says {}",
                f.name, f.size
            )));
        }
        let mut h = xxhash_rust::xxh3::Xxh3Default::new();
        loop {
            let n = file
                .read(&mut buf)
                .map_err(|e| incomplete(format!("{}: {e}", f.name)))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        if h.digest() != f.xxh3 {
            return Err(incomplete(format!("{} checksum mismatch", f.name)));
        }
    }
    let Some(index_size) = index_size else {
        return Err(incomplete("the manifest does not list the index".into()));
    };
    let index_bytes = read_file(dfd.as_fd(), INDEX, index_size.min(MAX_INDEX))
        .map_err(|e| incomplete(format!("index: {e}")))?;
    if xxhash_rust::xxh3::xxh3_64(&index_bytes)
        != manifest
            .files
            .iter()
            .find(|f| f.name == INDEX)
            .map_or(0, |f| f.xxh3)
    {
        return Err(incomplete("index changed while it was read".into()));
    }
    let index: Vec<IndexEntry> = postcard::from_bytes(&index_bytes)
        .map_err(|e| incomplete(format!("index unreadable: {e}")))?;
    // Read and checked before any blob is stored; put back after them.
    let claims = match manifest.files.iter().find(|f| f.name == CLAIMS) {
        None => Vec::new(),
        Some(f) => {
            let bytes = read_file(dfd.as_fd(), CLAIMS, f.size.min(MAX_CLAIMS))
                .map_err(|e| incomplete(format!("{CLAIMS}: {e}")))?;
            if xxhash_rust::xxh3::xxh3_64(&bytes) != f.xxh3 {
                return Err(incomplete(format!("{CLAIMS} changed while it was read")));
            }
            claims::decode(&bytes).map_err(incomplete)?
        }
    };
    // Group entries by blob: one blob's entries come from one commit, so
    // one namespace.
    let mut by_blob: BTreeMap<BlobId, (String, Vec<EntrySpec>)> = BTreeMap::new();
    for e in index {
        by_blob
            .entry(e.blob)
            .or_insert_with(|| (e.partition.clone(), Vec::new()))
            .1
            .push(EntrySpec {
                key: Key::new(e.row, e.field),
                offset: e.offset,
                len: e.len,
                meta: e.meta,
            });
    }
    let src = FileEngine::checkpoint(Arc::new(dfd), dir.to_owned(), 0);
    for (blob, (partition, entries)) in by_blob {
        let name = file_name(&src.path(blob));
        if !listed.contains(name.as_str()) {
            return Err(incomplete(format!(
                "the index names blob {blob:?}, whose file {name} the manifest does not list"
            )));
        }
        // The header names the blob (checked here) and its size, which
        // matches the file's length (checked too) and so the manifest's.
        let reader = src
            .reader(blob)
            .map_err(|e| incomplete(format!("blob {blob:?}: {e}")))?;
        let size = reader.size();
        for e in &entries {
            if e.offset.checked_add(e.len).is_none_or(|end| end > size) {
                return Err(incomplete(format!(
                    "the index puts {} bytes at {} of blob {blob:?}, which holds {size}",
                    e.len, e.offset
                )));
            }
        }
        let n = u32::try_from(entries.len()).map_err(|_| incomplete("too many entries".into()))?;
        let now = shared.now();
        let alloc = handler::alloc(
            &mut shared.core(),
            stowage_core::Owner::UNIT,
            blob,
            size,
            n,
            now,
        )
        .map_err(|e| {
            CheckpointError::Restore(format!("the unit cannot hold the checkpoint: {e}"))
        })?;
        let bad = |e: disk::DiskError| incomplete(e.to_string());
        match alloc {
            Allocated::Reserved { pieces } => {
                // Reserved space is no client's to read until the commit
                // below, which a failed check (a version 1 file is checked
                // only after all of it was copied) never reaches.
                let mut into = PieceWriter::new(&shared.slab, cut(&pieces, size));
                reader
                    .copy_all(&mut buf, |piece| into.write(piece))
                    .map_err(bad)?
                    .map_err(|e| CheckpointError::Restore(e.to_string()))?;
            }
            Allocated::ToDisk => {
                let Some(d) = &shared.disk else {
                    return Err(CheckpointError::Restore("no room".into()));
                };
                let mut w = d
                    .engine
                    .create(blob, size)
                    .map_err(|e| CheckpointError::Restore(format!("disk tier: {e}")))?;
                // The file is published by `finish` only, after the whole
                // copy was checked.
                let copied = reader.copy_all(&mut buf, |p| w.write(p));
                let written = match copied {
                    Ok(Ok(())) => w.finish().map(|_| ()),
                    Ok(Err(e)) => Err(e),
                    Err(e) => {
                        shared.core().disk_written(blob, false, shared.now());
                        return Err(bad(e));
                    }
                };
                shared
                    .core()
                    .disk_written(blob, written.is_ok(), shared.now());
                written.map_err(|e| CheckpointError::Restore(format!("disk tier: {e}")))?;
            }
            Allocated::AlreadyCommitted => continue,
        }
        match handler::commit_written(
            &mut shared.core(),
            stowage_core::Owner::UNIT,
            partition,
            blob,
            entries,
            now,
        ) {
            Ok(Committed::Done) => {}
            other => {
                return Err(CheckpointError::Restore(format!(
                    "committing {blob:?}: {other:?}"
                )))
            }
        }
    }
    shared
        .core()
        .handle(shared.now(), stowage_core::input::RestoreClaims(claims))
        .map_err(|e| CheckpointError::Restore(format!("the claims: {e}")))?;
    Ok(CheckpointInfo {
        rows: manifest.rows,
        entries: manifest.entries,
        bytes: manifest.bytes,
        files: manifest.files,
        manifest_xxh3: u64::from_le_bytes(s),
        host: host_name(),
        stored: String::new(),
    })
}

#[cfg(test)]
mod root_tests {
    use super::resolve_dir;

    #[test]
    fn checkpoints_stay_under_the_root() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let real = r.canonicalize().unwrap();
        assert!(resolve_dir(None, "x").is_err(), "no root: no checkpoints");
        assert_eq!(
            resolve_dir(Some(r), "run/unit-0").unwrap().path,
            real.join("run/unit-0")
        );
        let abs = real.join("a/unit-1");
        assert_eq!(
            resolve_dir(Some(r), abs.to_str().unwrap()).unwrap().path,
            abs
        );
        assert!(resolve_dir(Some(r), "/etc/cron.d").is_err());
        assert!(resolve_dir(Some(r), "../escape").is_err());
        assert!(resolve_dir(Some(r), &format!("{}/../x", real.display())).is_err());
        // A symbolic link inside the root that leads out of it.
        let out = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(out.path(), r.join("link")).unwrap();
        assert!(resolve_dir(Some(r), "link/unit-0").is_err());
    }
}

#[cfg(test)]
mod v1_restore_tests {
    use super::*;
    use crate::disk::BYTES_READ;

    /// A checkpoint of one blob of `n` bytes in a version 1 file (one
    /// xxh3 over all the bytes), with `damage` applied to the file's data
    /// before the manifest is written (so that the manifest still matches
    /// the file, and only the file's own checksum can catch it). Returns
    /// the blob file's size.
    fn v1_checkpoint(dir: &Path, n: usize, damage: bool) -> u64 {
        let bytes: Vec<u8> = (0..n).map(|i| (i * 31 + i / 4099) as u8).collect();
        let mut file = Vec::new();
        file.extend_from_slice(b"STWB");
        file.extend_from_slice(&1u32.to_le_bytes());
        file.extend_from_slice(&(n as u64).to_le_bytes());
        file.extend_from_slice(&bytes);
        file.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(&bytes).to_le_bytes());
        if damage {
            file[16 + n / 2] ^= 1;
        }
        let blob = BlobId(7);
        let name = format!("{:032x}.blob", blob.0);
        std::fs::write(dir.join(&name), &file).unwrap();
        let index = postcard::to_allocvec(&vec![IndexEntry {
            partition: "p".into(),
            row: 0,
            field: "f".into(),
            blob,
            offset: 0,
            len: n as u64,
            meta: Vec::new(),
        }])
        .unwrap();
        std::fs::write(dir.join(INDEX), &index).unwrap();
        let entry = |name: &str, bytes: &[u8]| CheckpointFile {
            name: name.into(),
            size: bytes.len() as u64,
            xxh3: xxhash_rust::xxh3::xxh3_64(bytes),
        };
        let mut manifest = postcard::to_allocvec(&Manifest {
            version: VERSION,
            rows: 1,
            entries: 1,
            bytes: n as u64,
            files: vec![entry(&name, &file), entry(INDEX, &index)],
        })
        .unwrap();
        let sum = xxhash_rust::xxh3::xxh3_64(&manifest);
        manifest.extend_from_slice(&sum.to_le_bytes());
        std::fs::write(dir.join(MANIFEST), &manifest).unwrap();
        file.len() as u64
    }

    /// Start a unit restoring `dir`: with `disk`, a unit whose 4 MiB slab
    /// cannot hold the blob, which goes to its disk tier under `disk`.
    fn start_restoring(
        dir: &Path,
        sock: &Path,
        disk: Option<&Path>,
    ) -> Result<crate::UnitHandle, crate::StartError> {
        let mut cfg = crate::UnitConfig::new("v1", if disk.is_some() { 4 << 20 } else { 32 << 20 });
        cfg.mlock = false;
        cfg.metrics_listen = None;
        cfg.uds = Some(sock.to_owned());
        cfg.restore = Some(dir.to_owned());
        cfg.disk = disk.map(|d| (d.to_owned(), 64 << 20));
        crate::start(cfg)
    }

    /// A version 1 blob (one checksum over the whole file) is restored,
    /// into the slab or onto the disk tier, in one pass over its file, not
    /// one pass per 1 MiB piece; and a damaged one fails the restore.
    #[test]
    fn a_version_1_blob_is_restored_in_one_pass() {
        let sock = tempfile::tempdir().unwrap();
        let n = (12 << 20) + 5;
        for to_disk in [false, true] {
            let tier = tempfile::tempdir().unwrap();
            let disk = to_disk.then_some(tier.path());
            let dir = tempfile::tempdir().unwrap();
            let size = v1_checkpoint(dir.path(), n, false);
            let before = BYTES_READ.with(|b| b.get());
            // The restore runs on this thread, before `start` returns.
            let unit =
                start_restoring(dir.path(), &sock.path().join("u.sock"), disk).expect("restored");
            let read = BYTES_READ.with(|b| b.get()) - before;
            let stats = unit.shared.stats();
            unit.stop();
            assert_eq!(stats.entries, 1, "{stats:?}");
            if to_disk {
                assert_eq!(stats.spilled_blobs, 1, "{stats:?}");
            } else {
                assert!(stats.used >= n as u64, "{stats:?}");
            }
            assert!(
                read >= n as u64 && read <= 2 * size,
                "the restore read {read} bytes of blob files for one file of {size} \
                 (to disk: {to_disk})"
            );

            let dir = tempfile::tempdir().unwrap();
            v1_checkpoint(dir.path(), n, true);
            let e = start_restoring(dir.path(), &sock.path().join("v.sock"), disk)
                .err()
                .expect("a damaged version 1 file fails the restore")
                .to_string();
            assert!(e.contains("checksum mismatch"), "{e}");
        }
    }
}
