//! The disk tier's directories: opening beneath a directory without
//! following links, the private root, and a unit's own locked directory
//! (made, and removed with the dead units' ones).

use std::ffi::{CStr, CString};
use std::fs::{self};
use std::io::{self};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use rustix::fs::{AtFlags, FileType, FlockOperation, Mode, OFlags, RenameFlags, ResolveFlags};
use rustix::io::Errno;

/// Deepest directory nesting [`remove_contents`] descends into (a unit's
/// directory has none; anything deeper was not made by a unit).
pub(super) const MAX_DEPTH: u32 = 16;

/// A single path component: not empty, no `/`, not `.` or `..`, no NUL.
pub(super) fn is_component(name: &[u8]) -> bool {
    !name.is_empty() && name != b"." && name != b".." && !name.iter().any(|&b| b == b'/' || b == 0)
}

/// Whether openat2 is missing (kernels before 5.6, or a seccomp filter).
pub(super) static NO_OPENAT2: AtomicBool = AtomicBool::new(false);

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
    pub(super) root: OwnedFd,
    pub(super) name: String,
    pub(super) dir: Arc<OwnedFd>,
    /// Holds the lock; closing it releases the lock.
    pub(super) _lock: OwnedFd,
}

/// Prefix of unit directories under the root.
pub(super) const DIR_PREFIX: &str = "stowage-unit-";
/// Prefix of a unit directory being made, before it is locked.
pub(super) const NEW_DIR_PREFIX: &str = "stowage-new-";
/// The lock file in a unit directory.
pub(super) const LOCK: &str = "lock";
/// How often a start makes a fresh temporary directory when concurrent
/// cleanups keep taking the one it made (each loss needs a cleanup to
/// see the directory in the microseconds between its lock file's creation
/// and its locking).
pub(super) const CREATE_TRIES: u32 = 16;

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

    /// The directory's file descriptor (for a [`super::FileEngine`]).
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
pub(super) fn make_locked(
    root: BorrowedFd<'_>,
    name: &str,
) -> io::Result<Option<(OwnedFd, OwnedFd)>> {
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
pub(super) fn try_lock(f: impl AsFd) -> io::Result<bool> {
    match rustix::fs::flock(f, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(Errno::WOULDBLOCK) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Whether the open file `f` is the entry `name` in `dir` (not one that
/// was unlinked or replaced since it was opened).
pub(super) fn is_at(f: impl AsFd, dir: BorrowedFd<'_>, name: &str) -> io::Result<bool> {
    let held = rustix::fs::fstat(f)?;
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(m) => Ok(m.st_dev == held.st_dev && m.st_ino == held.st_ino),
        Err(Errno::NOENT) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

pub(super) fn ignore_missing(r: rustix::io::Result<()>) -> io::Result<()> {
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
pub(super) fn remove_dir_at(
    parent: BorrowedFd<'_>,
    name: &str,
    dir: &OwnedFd,
    depth: u32,
) -> io::Result<()> {
    remove_contents(dir.as_fd(), depth)?;
    ignore_missing(rustix::fs::unlinkat(dir, LOCK, AtFlags::empty()))?;
    if is_at(dir, parent, name)? {
        ignore_missing(rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR))?;
    }
    Ok(())
}

/// Remove the entries of `dir` but its lock file (see [`remove_dir_at`]).
pub(super) fn remove_contents(dir: BorrowedFd<'_>, depth: u32) -> io::Result<()> {
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
pub(super) fn remove_entry(dir: BorrowedFd<'_>, name: &CStr, depth: u32) -> io::Result<()> {
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
pub(super) fn remove_dead_dirs(root_fd: BorrowedFd<'_>, root: &Path) -> io::Result<Vec<PathBuf>> {
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
