//! Memfds: refusing an fd that is not a sealed memfd of the announced
//! size, and passing fds over Unix sockets (SCM_RIGHTS).

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::SealFlags;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Refuse an fd that is not a unit's slab: a memfd (a shared-memory file
/// that takes seals) of `len` bytes sealed against shrinking, growing and
/// further sealing.
pub(crate) fn check_slab_fd(fd: &OwnedFd, len: u64) -> io::Result<()> {
    check_memfd(fd, len, "slab")
}

/// Refuse anything but a memfd of exactly `len` bytes sealed against
/// shrinking, growing and further sealing (`what`: the unit's slab or a
/// ring, for the error).
pub(crate) fn check_memfd(fd: &OwnedFd, len: u64, what: &str) -> io::Result<()> {
    let refuse = |why: String| {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("the unit's {what} fd is refused: {why}"),
        ))
    };
    let st = rustix::fs::fstat(fd)?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return refuse("it is not a memfd (not a regular file)".into());
    }
    // Only shared-memory files (memfd) take seals; any other file answers
    // EINVAL.
    let seals = match rustix::fs::fcntl_get_seals(fd) {
        Ok(s) => s,
        Err(e) => return refuse(format!("it is not a sealed memfd ({e})")),
    };
    let want = SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
    if !seals.contains(want) {
        return refuse(format!(
            "its seals are {seals:?}, not SHRINK | GROW | SEAL: it could shrink under this mapping"
        ));
    }
    if u64::try_from(st.st_size).ok() != Some(len) {
        return refuse(format!(
            "it holds {} bytes, not the {len} the unit announced",
            st.st_size
        ));
    }
    Ok(())
}

/// Send `bytes` with `fd` attached (SCM_RIGHTS). Returns the bytes sent,
/// which may be fewer than `bytes.len()` on a stream socket.
pub fn send_with_fd(sock: impl AsFd, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<usize> {
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("control buffer too small for one fd"));
    }
    loop {
        match rustix::net::sendmsg(
            &sock,
            &[io::IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            // EINTR after a stop and resume, as in `recv_with_fd`.
            Err(rustix::io::Errno::INTR) => continue,
            r => return Ok(r?),
        }
    }
}

/// Receive into `buf`, taking the first fd that rides along, if any.
pub fn recv_with_fd(sock: impl AsFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        match rustix::net::recvmsg(
            &sock,
            &mut [io::IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            // A receive with a timeout fails with EINTR when the process
            // was stopped (SIGSTOP) and resumed, even with no signal
            // handler (signal(7)): receive again.
            Err(rustix::io::Errno::INTR) => continue,
            r => break r?,
        }
    };
    let mut fd = None;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for f in fds {
                // Keep the first; any extra fd is closed as it drops.
                if fd.is_none() {
                    fd = Some(f);
                }
            }
        }
    }
    Ok((msg.bytes, fd))
}
