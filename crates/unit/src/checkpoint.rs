//! Owner-local checkpoints: a unit writes its committed data and index to
//! a directory, and a unit started with `--restore` serves them again.
//!
//! Layout of a checkpoint directory (one per unit):
//!
//! ```text
//!  <blob>.blob   one per blob, the disk tier's format (bytes + xxh3 per chunk)
//!  index         postcard: every entry (namespace, row, field, blob, offset, len, meta)
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
//! change, so no blob is torn.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};
use stowage_core::{Allocated, BlobId, Committed, EntrySpec, Key, Place};
use stowage_wire::{CheckpointFile, CheckpointInfo};

use crate::disk::{DiskEngine, FileEngine};
use crate::Shared;

const MANIFEST: &str = "MANIFEST";
const INDEX: &str = "index";
const VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct IndexEntry {
    ns: String,
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
    /// Blob files, then the index.
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

fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Write the unit's committed data and index to `dir` (which must not
/// exist or be empty). Returns the metadata; no payload leaves the unit.
/// The directory a Checkpoint request names, if it lies under the unit's
/// checkpoint root: a relative name is taken under the root; an absolute
/// path must be inside it. `..` is refused, and symbolic links may not lead
/// out of the root (the nearest existing ancestor is resolved and checked).
pub(crate) fn resolve_dir(root: Option<&Path>, dir: &str) -> Result<std::path::PathBuf, String> {
    let Some(root) = root else {
        return Err("this unit takes no checkpoints: start it with --checkpoint-root DIR".into());
    };
    let root = root
        .canonicalize()
        .map_err(|e| format!("checkpoint root {}: {e}", root.display()))?;
    let asked = Path::new(dir);
    if asked
        .components()
        .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(format!("checkpoint path {dir:?} may not contain '..'"));
    }
    let path = if asked.is_absolute() {
        asked.to_path_buf()
    } else {
        root.join(asked)
    };
    let outside = || {
        format!(
            "checkpoint path {dir:?} is outside this unit's checkpoint root {}",
            root.display()
        )
    };
    // The nearest ancestor that exists, resolved, must be inside the root.
    let mut probe = path.as_path();
    loop {
        match probe.canonicalize() {
            Ok(real) => {
                if !real.starts_with(&root) {
                    return Err(outside());
                }
                break;
            }
            Err(_) => match probe.parent() {
                Some(p) => probe = p,
                None => return Err(outside()),
            },
        }
    }
    Ok(path)
}

pub(crate) fn write(shared: &Shared, dir: &Path) -> Result<CheckpointInfo, CheckpointError> {
    let ioe = io_err(dir);
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(&ioe)?;
    // Checked again once it exists: a component swapped for a symbolic link
    // since the request was checked must not lead the files out of the
    // root.
    if let Some(root) = &shared.checkpoint_root {
        let (root, real) = (root.canonicalize(), dir.canonicalize());
        if !matches!((&root, &real), (Ok(r), Ok(d)) if d.starts_with(r)) {
            return Err(CheckpointError::Io(
                dir.display().to_string(),
                io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "the checkpoint directory is outside the checkpoint root",
                ),
            ));
        }
    }
    if fs::read_dir(dir).map_err(&ioe)?.next().is_some() {
        return Err(CheckpointError::Io(
            dir.display().to_string(),
            io::Error::new(io::ErrorKind::AlreadyExists, "directory is not empty"),
        ));
    }
    let snap = shared.core().snapshot(shared.now());
    let result = write_snapshot(shared, dir, &snap);
    if let Some(pin) = snap.pin {
        let _ = shared.core().unpin(stowage_core::Owner::UNIT, pin);
    }
    result
}

fn write_snapshot(
    shared: &Shared,
    dir: &Path,
    snap: &stowage_core::Snapshot,
) -> Result<CheckpointInfo, CheckpointError> {
    let ioe = io_err(dir);
    let out = FileEngine::new(dir.to_owned());
    let mut files = Vec::with_capacity(snap.blobs.len() + 1);
    let mut bytes = 0;
    for &(blob, nbytes, place) in &snap.blobs {
        if shared.stop.load(Ordering::SeqCst) {
            return Err(CheckpointError::Abandoned);
        }
        let len = usize::try_from(nbytes)
            .map_err(|_| CheckpointError::Restore("blob too large".into()))?;
        let mut w = out.create(blob, nbytes).map_err(&ioe)?;
        match place {
            // The snapshot's pin holds the range while it is copied.
            Place::Memory(l) => shared
                .slab
                .copy_out_chunked(l.offset, len, crate::COPY_CHUNK, |c| w.write(c))
                .map_err(|e| ioe(io::Error::other(e)))?
                .map_err(&ioe)?,
            Place::Disk { .. } => {
                let Some(d) = &shared.disk else {
                    return Err(CheckpointError::Restore(
                        "spilled blob without a disk tier".into(),
                    ));
                };
                let mut buf = vec![0u8; len.min(crate::COPY_CHUNK)];
                let mut at = 0usize;
                while at < len {
                    let n = (len - at).min(buf.len());
                    d.engine
                        .read_at(blob, at as u64, &mut buf[..n])
                        .map_err(|e| ioe(io::Error::other(e.to_string())))?;
                    w.write(&buf[..n]).map_err(&ioe)?;
                    at += n;
                }
            }
        }
        let xxh3 = w.finish().map_err(&ioe)?;
        let path = out.path(blob);
        files.push(CheckpointFile {
            name: file_name(&path),
            size: fs::metadata(&path).map_err(&ioe)?.len(),
            xxh3,
        });
        bytes += nbytes;
    }
    let index: Vec<IndexEntry> = snap
        .entries
        .iter()
        .map(|e| IndexEntry {
            ns: e.ns.clone(),
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
    write_synced(&dir.join(INDEX), &index_bytes).map_err(&ioe)?;
    files.push(CheckpointFile {
        name: INDEX.into(),
        size: index_bytes.len() as u64,
        xxh3: xxhash_rust::xxh3::xxh3_64(&index_bytes),
    });
    let rows = {
        let mut r: Vec<(&str, u64)> = snap
            .entries
            .iter()
            .map(|e| (e.ns.as_str(), e.key.row))
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
    let tmp = dir.join("MANIFEST.tmp");
    write_synced(&tmp, &m).map_err(&ioe)?;
    fs::rename(&tmp, dir.join(MANIFEST)).map_err(&ioe)?;
    File::open(dir).and_then(|d| d.sync_all()).map_err(&ioe)?;
    Ok(CheckpointInfo {
        rows: manifest.rows,
        entries: manifest.entries,
        bytes: manifest.bytes,
        files: manifest.files,
        manifest_xxh3: sum,
    })
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn xxh3_file(p: &Path) -> io::Result<u64> {
    Ok(xxhash_rust::xxh3::xxh3_64(&fs::read(p)?))
}

/// Load a checkpoint directory into a fresh unit, checking every file
/// against the manifest first.
pub(crate) fn restore(shared: &Shared, dir: &Path) -> Result<CheckpointInfo, CheckpointError> {
    let incomplete = |reason: String| CheckpointError::Incomplete {
        dir: dir.display().to_string(),
        reason,
    };
    let raw = fs::read(dir.join(MANIFEST)).map_err(|e| incomplete(format!("no manifest ({e})")))?;
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
    for f in &manifest.files {
        let p = dir.join(&f.name);
        let meta = fs::metadata(&p).map_err(|e| incomplete(format!("{} missing ({e})", f.name)))?;
        if meta.len() != f.size {
            return Err(incomplete(format!(
                "{} has {} bytes, manifest says {}",
                f.name,
                meta.len(),
                f.size
            )));
        }
        let sum = xxh3_file(&p).map_err(|e| incomplete(format!("{}: {e}", f.name)))?;
        if sum != f.xxh3 {
            return Err(incomplete(format!("{} checksum mismatch", f.name)));
        }
    }
    let index_bytes = fs::read(dir.join(INDEX)).map_err(|e| incomplete(format!("index: {e}")))?;
    let index: Vec<IndexEntry> = postcard::from_bytes(&index_bytes)
        .map_err(|e| incomplete(format!("index unreadable: {e}")))?;
    // Group entries by blob: one blob's entries come from one commit, so
    // one namespace.
    let mut by_blob: BTreeMap<BlobId, (String, Vec<EntrySpec>)> = BTreeMap::new();
    for e in index {
        by_blob
            .entry(e.blob)
            .or_insert_with(|| (e.ns.clone(), Vec::new()))
            .1
            .push(EntrySpec {
                key: Key::new(e.row, e.field),
                offset: e.offset,
                len: e.len,
                meta: e.meta,
            });
    }
    let src = FileEngine::new(dir.to_owned());
    for (blob, (ns, entries)) in by_blob {
        let size = src
            .blob_size(blob)
            .map_err(|e| incomplete(format!("blob {blob:?}: {e}")))?;
        let len = usize::try_from(size).map_err(|_| incomplete("blob too large".into()))?;
        let mut buf = vec![0u8; len];
        src.read(blob, &mut buf)
            .map_err(|e| incomplete(e.to_string()))?;
        let n = u32::try_from(entries.len()).map_err(|_| incomplete("too many entries".into()))?;
        let now = shared.now();
        let alloc = shared
            .core()
            .alloc(stowage_core::Owner::UNIT, blob, size, n, now)
            .map_err(|e| {
                CheckpointError::Restore(format!("the unit cannot hold the checkpoint: {e}"))
            })?;
        match alloc {
            Allocated::Reserved { offset } => {
                shared
                    .slab
                    .write(offset, &buf)
                    .map_err(|e| CheckpointError::Restore(e.to_string()))?;
            }
            Allocated::ToDisk => {
                let Some(d) = &shared.disk else {
                    return Err(CheckpointError::Restore("no room".into()));
                };
                let written = d.engine.create(blob, size).and_then(|mut w| {
                    w.write(&buf)?;
                    w.finish()
                });
                shared.core().disk_written(blob, written.is_ok());
                written.map_err(|e| CheckpointError::Restore(format!("disk tier: {e}")))?;
            }
            Allocated::AlreadyCommitted => continue,
        }
        match shared
            .core()
            .commit(stowage_core::Owner::UNIT, &ns, blob, &entries)
        {
            Ok(Committed::Done) => {}
            other => {
                return Err(CheckpointError::Restore(format!(
                    "committing {blob:?}: {other:?}"
                )))
            }
        }
    }
    Ok(CheckpointInfo {
        rows: manifest.rows,
        entries: manifest.entries,
        bytes: manifest.bytes,
        files: manifest.files,
        manifest_xxh3: u64::from_le_bytes(s),
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
            resolve_dir(Some(r), "run/unit-0").unwrap(),
            real.join("run/unit-0")
        );
        let abs = real.join("a/unit-1");
        assert_eq!(resolve_dir(Some(r), abs.to_str().unwrap()).unwrap(), abs);
        assert!(resolve_dir(Some(r), "/etc/cron.d").is_err());
        assert!(resolve_dir(Some(r), "../escape").is_err());
        assert!(resolve_dir(Some(r), &format!("{}/../x", real.display())).is_err());
        // A symbolic link inside the root that leads out of it.
        let out = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(out.path(), r.join("link")).unwrap();
        assert!(resolve_dir(Some(r), "link/unit-0").is_err());
    }
}
