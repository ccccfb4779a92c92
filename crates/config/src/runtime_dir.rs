//! The per-user runtime directory where units put their Unix sockets by
//! default: `$XDG_RUNTIME_DIR/stowage/` when that variable names a
//! directory of this user, else `stowage-<uid>/` in the temporary
//! directory (`/tmp` unless `TMPDIR` says otherwise), else -- when that
//! name was taken first by another user, or is a symbolic link or not a
//! directory -- `$HOME/.stowage/run/`, with a warning naming the taken
//! path, else -- when there is no usable home either (a service account:
//! no `HOME`, or one that cannot be written) -- a private directory of its
//! own in the temporary directory, `stowage-<uid>-XXXXXX/` (random
//! suffix, made like `mkdtemp`), with a warning naming it. Units and
//! clients compute the same directory the same way: the last fallback is
//! the smallest-named such directory of this user (0700, not a link)
//! already there, and only when there is none is one made.
//!
//! A fixed name in a shared directory is a name another user can take
//! first: bind a socket there and hand clients a memory fd of its own, or
//! keep the unit from starting. This directory is made owner-only (0700)
//! and used only when it is a real directory (not a symbolic link) of this
//! user with exactly that mode. A taken name in the temporary directory
//! is never used (nothing is created in it): a fallback is. A random name
//! cannot be taken in advance, and names of the fallback's pattern that
//! belong to another user are passed over. A directory of this user with
//! another mode is refused with an error that says how to fix it. In a
//! sticky temporary directory nobody else can rename or replace this
//! user's directory.

use std::ffi::OsString;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

/// The most bytes a Unix socket path may have (`sun_path` holds 108, with
/// its terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// The runtime directory (created owner-only if missing, checked if not).
pub fn runtime_dir() -> io::Result<PathBuf> {
    resolve(
        std::env::var_os("XDG_RUNTIME_DIR"),
        std::env::temp_dir(),
        std::env::var_os("HOME"),
    )
}

/// [`runtime_dir`] from the values of `XDG_RUNTIME_DIR`, the temporary
/// directory and `HOME`.
fn resolve(xdg: Option<OsString>, tmp: PathBuf, home: Option<OsString>) -> io::Result<PathBuf> {
    let uid = rustix::process::geteuid();
    if let Some(x) = xdg.map(PathBuf::from) {
        if x.is_absolute() && owned_dir(&x, uid) {
            let d = x.join("stowage");
            ensure_private_dir(&d)?;
            return Ok(d);
        }
    }
    let shared = tmp.join(format!("stowage-{}", uid.as_raw()));
    let why = match check_private_dir(&shared) {
        Ok(()) => return Ok(shared),
        Err(Refused::Other(e) | Refused::Cannot(e)) => return Err(e),
        Err(Refused::Taken(why)) => why,
    };
    match home_fallback(home, &shared, &why) {
        Ok(run) => Ok(run),
        Err(Refused::Other(e)) => Err(e),
        Err(Refused::Taken(no_home) | Refused::Cannot(no_home)) => {
            temp_fallback(&tmp, &shared, &why, &no_home)
        }
    }
}

/// `$HOME/.stowage/run` (made owner-only, checked as every runtime
/// directory), used because `taken` was refused for `why`. Refused as
/// `Other` only for this user's own directory with another mode (for the
/// user to fix); any other reason (no absolute `HOME`, a home that cannot
/// be written, a name there that is not this user's directory) leaves
/// the next fallback.
fn home_fallback(
    home: Option<OsString>,
    taken: &Path,
    why: &io::Error,
) -> Result<PathBuf, Refused> {
    let uid = rustix::process::geteuid();
    let home = match home.map(PathBuf::from) {
        Some(h) if h.is_absolute() => h,
        _ => {
            return Err(Refused::Cannot(io::Error::new(
                io::ErrorKind::NotFound,
                "HOME is not an absolute path, so $HOME/.stowage/run cannot be used",
            )))
        }
    };
    let parent = home.join(".stowage");
    match rustix::fs::mkdir(&parent, Mode::from_raw_mode(0o700)) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
        Err(e) => {
            return Err(Refused::Cannot(io::Error::new(
                io::Error::from(e).kind(),
                format!("{} cannot be made ({e})", parent.display()),
            )))
        }
    }
    if !owned_dir(&parent, uid) {
        return Err(Refused::Taken(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a directory of this user (a symbolic link is refused)",
                parent.display()
            ),
        )));
    }
    let run = parent.join("run");
    check_private_dir(&run).map_err(|r| match r {
        Refused::Other(e) => Refused::Other(io::Error::new(
            e.kind(),
            format!("{why}; and the fallback: {e}"),
        )),
        r => r,
    })?;
    tracing::warn!(
        taken = %taken.display(),
        fallback = %run.display(),
        "{why}; the private runtime directory is {} instead",
        run.display()
    );
    Ok(run)
}

/// The last fallback: a private directory of this user's own in the
/// temporary directory `tmp`, `stowage-<uid>-XXXXXX`. The smallest-named
/// one already there (a directory of this user, mode 0700, not a link)
/// is used, so that a unit and its clients find the same; only when
/// there is none is one made, with a random suffix (another user cannot
/// take a name it cannot guess; a name found taken is retried). Used
/// because `taken` was refused for `why`, and the home for `no_home`.
fn temp_fallback(
    tmp: &Path,
    taken: &Path,
    why: &io::Error,
    no_home: &io::Error,
) -> io::Result<PathBuf> {
    let cannot = |e: io::Error| {
        io::Error::new(
            e.kind(),
            format!(
                "{why}; and {no_home}; and a private directory of its own in {} cannot be made \
                 ({e}): set XDG_RUNTIME_DIR to a private directory",
                tmp.display()
            ),
        )
    };
    let dir = match own_fallbacks(tmp).map_err(cannot)?.into_iter().next() {
        Some(d) => d,
        None => {
            let made = make_fallback(tmp).map_err(cannot)?;
            // Another process of this user may have made one at the same
            // time: the smallest name is the one (an empty loser is
            // removed).
            let first = own_fallbacks(tmp).map_err(cannot)?.into_iter().next();
            match first {
                Some(f) if f != made => {
                    let _ = std::fs::remove_dir(&made);
                    f
                }
                _ => made,
            }
        }
    };
    // Opened without following links, owner and mode checked again.
    ensure_private_dir(&dir).map_err(cannot)?;
    tracing::warn!(
        taken = %taken.display(),
        fallback = %dir.display(),
        "{why}; and {no_home}; the private runtime directory is {} instead (its own, made \
         once and found again by its name; set XDG_RUNTIME_DIR to choose one)",
        dir.display()
    );
    Ok(dir)
}

/// The prefix of the last fallback's names, `stowage-<uid>-`.
fn fallback_prefix() -> String {
    format!("stowage-{}-", rustix::process::geteuid().as_raw())
}

/// How many random characters end a fallback's name.
const FALLBACK_SUFFIX: usize = 6;

/// The directories in `tmp` named `stowage-<uid>-XXXXXX` that are this
/// user's (not links) with mode 0700, smallest name first.
fn own_fallbacks(tmp: &Path) -> io::Result<Vec<PathBuf>> {
    let prefix = fallback_prefix();
    let uid = rustix::process::geteuid();
    let mut found = Vec::new();
    for e in std::fs::read_dir(tmp)? {
        let e = e?;
        let name = e.file_name();
        let Some(suffix) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        if suffix.len() != FALLBACK_SUFFIX || !suffix.bytes().all(|b| b.is_ascii_alphanumeric()) {
            continue;
        }
        let p = e.path();
        let private = rustix::fs::lstat(&p).is_ok_and(|st| {
            rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory
                && st.st_uid == uid.as_raw()
                && st.st_mode & 0o7777 == 0o700
        });
        if private {
            found.push(p);
        }
    }
    found.sort();
    Ok(found)
}

/// Make a new `stowage-<uid>-XXXXXX` in `tmp`, 0700 (`mkdtemp`'s way: a
/// random suffix, another on a name already there).
fn make_fallback(tmp: &Path) -> io::Result<PathBuf> {
    use std::hash::{BuildHasher, Hasher};
    const CHARS: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let prefix = fallback_prefix();
    for attempt in 0u32..100 {
        // std's RandomState is keyed from the OS's random source.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(attempt);
        let mut r = h.finish();
        let mut name = prefix.clone();
        for _ in 0..FALLBACK_SUFFIX {
            name.push(CHARS[(r % CHARS.len() as u64) as usize] as char);
            r /= CHARS.len() as u64;
        }
        let p = tmp.join(name);
        match rustix::fs::mkdir(&p, Mode::from_raw_mode(0o700)) {
            Ok(()) => {
                // The umask may have taken bits off; exactly 0700.
                let fd = rustix::fs::open(
                    &p,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )?;
                rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o700))?;
                return Ok(p);
            }
            Err(rustix::io::Errno::EXIST) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        "100 random names were all taken",
    ))
}

/// Unit `index`'s default Unix socket: `unit-<index>.sock` in
/// [`runtime_dir`]; an error if that path is longer than a Unix socket
/// path can be ([`MAX_SOCKET_PATH`]).
pub fn default_socket(index: usize) -> io::Result<PathBuf> {
    socket_in(&runtime_dir()?, index)
}

fn socket_in(dir: &Path, index: usize) -> io::Result<PathBuf> {
    let p = dir.join(format!("unit-{index}.sock"));
    let n = p.as_os_str().len();
    if n > MAX_SOCKET_PATH {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "the default socket path {} is {n} bytes, more than the {MAX_SOCKET_PATH} a Unix \
                 socket path may have: set XDG_RUNTIME_DIR (or listen.unix_dir, or --listen \
                 unix:PATH) to a shorter private directory",
                p.display()
            ),
        ));
    }
    Ok(p)
}

/// Whether `path` is a directory (not a link) of `uid`.
fn owned_dir(path: &Path, uid: rustix::fs::Uid) -> bool {
    rustix::fs::lstat(path).is_ok_and(|st| {
        rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory
            && st.st_uid == uid.as_raw()
    })
}

/// Why a runtime directory was refused.
enum Refused {
    /// Not a directory of this user (another user's, a symbolic link, a
    /// file): in a shared directory, a name someone else may have taken.
    Taken(io::Error),
    /// Anything else (this user's directory with another mode): for the
    /// user to fix.
    Other(io::Error),
    /// It could not be made (its parent is missing or not writable).
    Cannot(io::Error),
}

/// Make `path` an owner-only directory of this user, or check that it is
/// one already: refuses a symbolic link, another user's directory, or one
/// that others may enter.
pub fn ensure_private_dir(path: &Path) -> io::Result<()> {
    check_private_dir(path).map_err(|r| match r {
        Refused::Taken(e) | Refused::Other(e) | Refused::Cannot(e) => e,
    })
}

fn check_private_dir(path: &Path) -> Result<(), Refused> {
    let created = match rustix::fs::mkdir(path, Mode::from_raw_mode(0o700)) {
        Ok(()) => true,
        Err(rustix::io::Errno::EXIST) => false,
        Err(e) => {
            return Err(Refused::Cannot(io::Error::new(
                io::Error::from(e).kind(),
                format!(
                    "creating the private runtime directory {}: {e}",
                    path.display()
                ),
            )))
        }
    };
    let shown = path.display();
    let fd: OwnedFd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| {
        Refused::Taken(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{shown} is not a directory of this user ({e}; a symbolic link or a file is refused): \
                 remove it, or set XDG_RUNTIME_DIR to a private directory"
            ),
        ))
    })?;
    let other = |e: rustix::io::Errno| Refused::Other(e.into());
    if created {
        // The umask may have taken bits off; exactly 0700.
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o700)).map_err(other)?;
    }
    let st = rustix::fs::fstat(&fd).map_err(other)?;
    let uid = rustix::process::geteuid().as_raw();
    if st.st_uid != uid {
        return Err(Refused::Taken(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the runtime directory {shown} belongs to uid {}, not to this user (uid {uid}): \
                 another user may have made it first; remove it, or set XDG_RUNTIME_DIR to a \
                 private directory",
                st.st_uid
            ),
        )));
    }
    let mode = st.st_mode & 0o7777;
    if mode != 0o700 {
        return Err(Refused::Other(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the runtime directory {shown} has mode {mode:04o}, not 0700: others could \
                 reach or replace the sockets in it; make it owner-only: chmod 700 {shown}"
            ),
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_private_dir_is_made_0700_and_anything_else_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("rt");
        ensure_private_dir(&d).unwrap();
        let m = std::fs::metadata(&d).unwrap().permissions().mode() & 0o7777;
        assert_eq!(m, 0o700);
        // Again: found as it should be.
        ensure_private_dir(&d).unwrap();
        // Opened up: refused, naming the fix.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = ensure_private_dir(&d).unwrap_err().to_string();
        assert!(e.contains("0755") && e.contains("chmod 700"), "{e}");
        // A symbolic link to a private directory: refused.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        let l = t.path().join("link");
        std::os::unix::fs::symlink(&d, &l).unwrap();
        let e = ensure_private_dir(&l).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        // A file: refused.
        let f = t.path().join("file");
        std::fs::write(&f, b"x").unwrap();
        assert!(ensure_private_dir(&f).is_err());
    }

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    /// A temporary directory shared as /tmp is (1777), and a home.
    fn shared_tmp_and_home() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let t = tempfile::tempdir().unwrap();
        let tmp = t.path().join("tmp");
        std::fs::create_dir(&tmp).unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let home = t.path().join("home");
        std::fs::create_dir(&home).unwrap();
        (t, tmp, home)
    }

    fn taken_name(tmp: &Path) -> PathBuf {
        tmp.join(format!("stowage-{}", rustix::process::geteuid().as_raw()))
    }

    #[test]
    fn the_temporary_directory_is_used_when_free() {
        let (_t, tmp, home) = shared_tmp_and_home();
        let d = resolve(None, tmp.clone(), Some(home.clone().into())).unwrap();
        assert_eq!(d, taken_name(&tmp));
        assert_eq!(mode(&d), 0o700);
        assert!(!home.join(".stowage").exists());
    }

    #[test]
    fn a_name_another_user_took_first_falls_back_to_home() {
        // Playing the other user needs chown: root only.
        if !rustix::process::geteuid().is_root() {
            return;
        }
        let (_t, tmp, home) = shared_tmp_and_home();
        let taken = taken_name(&tmp);
        std::fs::create_dir(&taken).unwrap();
        std::fs::set_permissions(&taken, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::os::unix::fs::chown(&taken, Some(65534), Some(65534)).unwrap();
        let d = resolve(None, tmp.clone(), Some(home.clone().into())).unwrap();
        assert_eq!(d, home.join(".stowage").join("run"));
        assert_eq!(mode(&d), 0o700);
        // The same again (a client computes what the unit did).
        assert_eq!(
            resolve(None, tmp.clone(), Some(home.clone().into())).unwrap(),
            d
        );
        assert_eq!(std::fs::read_dir(&taken).unwrap().count(), 0);
        // Without a home to fall back to: a private directory of its own.
        let own = resolve(None, tmp.clone(), None).unwrap();
        assert_is_a_fallback(&tmp, &own);
        assert_eq!(std::fs::read_dir(&taken).unwrap().count(), 0);
        // A fallback's name another user made first is passed over.
        let theirs = tmp.join(format!("{}000000", fallback_prefix()));
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        assert!(theirs < own);
        assert_eq!(resolve(None, tmp.clone(), None).unwrap(), own);
    }

    /// `d` is a fallback in `tmp`: `stowage-<uid>-XXXXXX`, 0700, this
    /// user's.
    fn assert_is_a_fallback(tmp: &Path, d: &Path) {
        assert_eq!(d.parent(), Some(tmp));
        let name = d.file_name().unwrap().to_str().unwrap();
        let suffix = name.strip_prefix(&fallback_prefix()).expect(name);
        assert_eq!(suffix.len(), FALLBACK_SUFFIX, "{name}");
        assert!(suffix.bytes().all(|b| b.is_ascii_alphanumeric()), "{name}");
        assert_eq!(mode(d), 0o700);
        let st = std::fs::symlink_metadata(d).unwrap();
        assert!(st.is_dir());
        assert_eq!(
            std::os::unix::fs::MetadataExt::uid(&st),
            rustix::process::geteuid().as_raw()
        );
    }

    #[test]
    fn without_a_usable_home_a_taken_name_falls_back_to_a_directory_of_its_own() {
        let (t, tmp, _home) = shared_tmp_and_home();
        let taken = taken_name(&tmp);
        let elsewhere = t.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &taken).unwrap();
        // No HOME (a service account).
        let d = resolve(None, tmp.clone(), None).unwrap();
        assert_is_a_fallback(&tmp, &d);
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
        // Computed again (a client of that unit), with no HOME, a relative
        // one, or one that cannot be written: the same directory, and no
        // other made.
        let file = t.path().join("not-a-dir");
        std::fs::write(&file, b"x").unwrap();
        for home in [None, Some("relative".into()), Some(file.into_os_string())] {
            assert_eq!(resolve(None, tmp.clone(), home).unwrap(), d);
        }
        let prefix = fallback_prefix();
        let count = || {
            std::fs::read_dir(&tmp)
                .unwrap()
                .filter(|e| {
                    let n = e.as_ref().unwrap().file_name();
                    n.to_str().unwrap().starts_with(&prefix)
                })
                .count()
        };
        assert_eq!(count(), 1);
        // Names of its pattern that are not a private directory of this
        // user (a link to one, one open to others, a file) are passed
        // over, even the smallest.
        std::fs::remove_dir(&d).unwrap();
        let link = tmp.join(format!("{prefix}000000"));
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        let open = tmp.join(format!("{prefix}000001"));
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(tmp.join(format!("{prefix}000002")), b"x").unwrap();
        let d2 = resolve(None, tmp.clone(), None).unwrap();
        assert_is_a_fallback(&tmp, &d2);
        assert!(![&link, &open].contains(&&d2), "{}", d2.display());
        assert_eq!(mode(&open), 0o755);
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
        // Of two of its own, the smallest name is the one.
        let first = tmp.join(format!("{prefix}00000A"));
        std::fs::create_dir(&first).unwrap();
        std::fs::set_permissions(&first, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(first < d2);
        assert_eq!(resolve(None, tmp.clone(), None).unwrap(), first);
        // HOME usable again: the home fallback comes first.
        let home = t.path().join("home2");
        std::fs::create_dir(&home).unwrap();
        assert_eq!(
            resolve(None, tmp, Some(home.clone().into())).unwrap(),
            home.join(".stowage").join("run")
        );
    }

    #[test]
    fn a_link_or_a_file_in_its_place_falls_back_to_home() {
        let (t, tmp, home) = shared_tmp_and_home();
        let taken = taken_name(&tmp);
        let elsewhere = t.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &taken).unwrap();
        let d = resolve(None, tmp.clone(), Some(home.clone().into())).unwrap();
        assert_eq!(d, home.join(".stowage").join("run"));
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
        std::fs::remove_file(&taken).unwrap();
        std::fs::write(&taken, b"x").unwrap();
        assert_eq!(resolve(None, tmp, Some(home.into())).unwrap(), d);
    }

    #[test]
    fn this_users_directory_with_another_mode_is_refused_not_replaced() {
        let (_t, tmp, home) = shared_tmp_and_home();
        let mine = taken_name(&tmp);
        std::fs::create_dir(&mine).unwrap();
        std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = resolve(None, tmp, Some(home.clone().into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("0755") && e.contains("chmod 700"), "{e}");
        assert!(!home.join(".stowage").exists());
    }

    #[test]
    fn a_private_xdg_runtime_dir_comes_first() {
        let (t, tmp, home) = shared_tmp_and_home();
        let xdg = t.path().join("xdg");
        std::fs::create_dir(&xdg).unwrap();
        let d = resolve(Some(xdg.clone().into()), tmp.clone(), Some(home.into())).unwrap();
        assert_eq!(d, xdg.join("stowage"));
        assert!(!taken_name(&tmp).exists());
    }

    #[test]
    fn a_socket_path_too_long_is_an_error_naming_the_fix() {
        let long = PathBuf::from(format!("/{}", "d".repeat(100)));
        let e = socket_in(&long, 0).unwrap_err().to_string();
        assert!(e.contains("107") && e.contains("XDG_RUNTIME_DIR"), "{e}");
        let p = socket_in(Path::new("/run/user/0/stowage"), 3).unwrap();
        assert_eq!(p, Path::new("/run/user/0/stowage/unit-3.sock"));
    }
}
