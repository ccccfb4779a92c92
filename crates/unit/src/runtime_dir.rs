//! The per-user runtime directory where units put their Unix sockets by
//! default: `$XDG_RUNTIME_DIR/stowage/` when that variable names a
//! directory of this user, else `stowage-<uid>/` in the temporary
//! directory (`/tmp` unless `TMPDIR` says otherwise).
//!
//! A fixed name in a shared directory is a name another user can take
//! first: bind a socket there and hand clients a memory fd of its own, or
//! keep the unit from starting. This directory is made owner-only (0700)
//! and used only when it is a real directory (not a symbolic link) of this
//! user with exactly that mode; anything else is refused with an error that
//! says what was found and how to fix it. In a sticky temporary directory
//! nobody else can then rename or replace it.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

/// The runtime directory (created owner-only if missing, checked if not).
pub fn runtime_dir() -> io::Result<PathBuf> {
    let uid = rustix::process::geteuid();
    let base = match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        Some(x) if x.is_absolute() && owned_dir(&x, uid) => x.join("stowage"),
        _ => std::env::temp_dir().join(format!("stowage-{}", uid.as_raw())),
    };
    ensure_private_dir(&base)?;
    Ok(base)
}

/// Unit `index`'s default Unix socket: `unit-<index>.sock` in
/// [`runtime_dir`].
pub fn default_socket(index: usize) -> io::Result<PathBuf> {
    Ok(runtime_dir()?.join(format!("unit-{index}.sock")))
}

/// Whether `path` is a directory (not a link) of `uid`.
fn owned_dir(path: &Path, uid: rustix::fs::Uid) -> bool {
    rustix::fs::lstat(path).is_ok_and(|st| {
        rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory
            && st.st_uid == uid.as_raw()
    })
}

/// Make `path` an owner-only directory of this user, or check that it is
/// one already: refuses a symbolic link, another user's directory, or one
/// that others may enter.
pub fn ensure_private_dir(path: &Path) -> io::Result<()> {
    let created = match rustix::fs::mkdir(path, Mode::from_raw_mode(0o700)) {
        Ok(()) => true,
        Err(rustix::io::Errno::EXIST) => false,
        Err(e) => {
            return Err(io::Error::new(
                io::Error::from(e).kind(),
                format!(
                    "creating the private runtime directory {}: {e}",
                    path.display()
                ),
            ))
        }
    };
    let shown = path.display();
    let fd: OwnedFd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| {
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{shown} is not a directory of this user ({e}; a symbolic link or a file is refused): \
                 remove it, or set XDG_RUNTIME_DIR to a private directory"
            ),
        )
    })?;
    if created {
        // The umask may have taken bits off; exactly 0700.
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o700))?;
    }
    let st = rustix::fs::fstat(&fd)?;
    let uid = rustix::process::geteuid().as_raw();
    if st.st_uid != uid {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the runtime directory {shown} belongs to uid {}, not to this user (uid {uid}): \
                 another user may have made it first; remove it, or set XDG_RUNTIME_DIR to a \
                 private directory",
                st.st_uid
            ),
        ));
    }
    let mode = st.st_mode & 0o7777;
    if mode != 0o700 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the runtime directory {shown} has mode {mode:04o}, not 0700: others could \
                 reach or replace the sockets in it; make it owner-only: chmod 700 {shown}"
            ),
        ));
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
}
