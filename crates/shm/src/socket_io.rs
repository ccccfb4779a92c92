//! The slab to and from sockets: a stream received straight into a range
//! of the slab ([`Slab::recv_into`]) and a message of heap bytes and slab
//! ranges sent without a copy ([`Slab::send_pieces`]).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use rustix::net::sockopt::Timeout;

use crate::Slab;

/// `TimedOut` once `deadline` has passed; else, when `blocking`, the time
/// left set as `sock`'s `which` timeout. Whether it set one.
fn bound_by(
    sock: BorrowedFd<'_>,
    deadline: std::time::Instant,
    which: Timeout,
    blocking: bool,
) -> io::Result<bool> {
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    if blocking {
        rustix::net::sockopt::set_socket_timeout(sock, which, Some(left))?;
    }
    Ok(blocking)
}

impl Slab {
    /// Receive exactly `len` bytes from the stream socket `sock` straight
    /// into the slab at `offset` (no intermediate buffer). Blocking, and
    /// bounded as a whole by `deadline` (`TimedOut` once it passes: each
    /// blocking receive gets the time left as the socket's receive timeout,
    /// so a peer that trickles bytes cannot stretch it); `UnexpectedEof`
    /// when the peer closes first. Returns whether it changed the socket's
    /// receive timeout (only before a receive that would block). The caller must
    /// hold the range's reservation, and is the only one that writes it.
    ///
    /// Adaptive polling: when no bytes are waiting, it polls without
    /// blocking for up to `spin` before it blocks (a blocking wake-up costs
    /// tens of microseconds on a VM, and a stream arrives in many pieces).
    pub fn recv_into(
        &self,
        sock: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        spin: std::time::Duration,
        deadline: Option<std::time::Instant>,
    ) -> io::Result<bool> {
        let start = self.check(offset, len).map_err(io::Error::other)?;
        let mut changed = false;
        let base = self.map.as_mut_ptr() as usize + start;
        let mut done = 0usize;
        let mut polling_since: Option<std::time::Instant> = None;
        while done < len {
            let poll = !spin.is_zero() && polling_since.is_none_or(|t| t.elapsed() < spin);
            let flags = if poll { libc::MSG_DONTWAIT } else { 0 };
            if let Some(d) = deadline {
                changed |= bound_by(sock, d, Timeout::Recv, !poll)?;
            }
            // SAFETY: [start + done, start + len) lies inside the mapping
            // (`check`), which lives as long as `self` and never shrinks.
            // The kernel writes through the raw pointer; no Rust reference
            // to the shared memory is made, so a misbehaving process that
            // also maps it can corrupt bytes but not this program.
            let n = unsafe {
                libc::recv(
                    sock.as_raw_fd(),
                    (base + done) as *mut libc::c_void,
                    len - done,
                    flags,
                )
            };
            match n {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                n if n > 0 => {
                    done += n as usize;
                    polling_since = None;
                }
                _ => {
                    let e = io::Error::last_os_error();
                    match e.kind() {
                        io::ErrorKind::Interrupted => {}
                        io::ErrorKind::WouldBlock if poll => {
                            polling_since.get_or_insert_with(std::time::Instant::now);
                            std::hint::spin_loop();
                        }
                        io::ErrorKind::WouldBlock if deadline.is_some() => {
                            return Err(io::ErrorKind::TimedOut.into())
                        }
                        _ => return Err(e),
                    }
                }
            }
        }
        // Whether the socket's receive timeout was changed.
        Ok(changed)
    }

    /// Send `pieces` (heap bytes and slab ranges, in order) on the stream
    /// socket `sock` with as few vectored writes as possible, each bounded
    /// by the time left to `deadline` (`TimedOut` once it passes). Slab
    /// ranges go from the mapping to the kernel by raw pointer. The caller
    /// must hold pins of the slab ranges. Returns whether it changed the
    /// socket's send timeout (only when a send had to wait).
    pub fn send_pieces(
        &self,
        sock: BorrowedFd<'_>,
        pieces: &[Piece<'_>],
        deadline: std::time::Instant,
    ) -> io::Result<bool> {
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(pieces.len());
        for p in pieces {
            let (ptr, len) = match *p {
                Piece::Heap(b) => (b.as_ptr() as usize, b.len()),
                Piece::Slab { offset, len } => {
                    let start = self.check(offset, len).map_err(io::Error::other)?;
                    (self.map.as_ptr() as usize + start, len)
                }
            };
            if len > 0 {
                iov.push(libc::iovec {
                    iov_base: ptr as *mut libc::c_void,
                    iov_len: len,
                });
            }
        }
        let mut first = 0usize;
        // The first send does not wait (what fits in the socket's buffer
        // goes at once, with no timeout to set); later ones block, each
        // bounded by the time left.
        let mut blocking = false;
        let mut changed = false;
        while first < iov.len() {
            changed |= bound_by(sock, deadline, Timeout::Send, blocking)?;
            let n = (iov.len() - first).min(1024);
            // SAFETY: every iovec names either a caller's slice, borrowed
            // for this call, or a range inside the mapping (`check`), which
            // lives as long as `self`; the kernel only reads them. The
            // message header points at those iovecs and nothing else.
            let sent = unsafe {
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = iov[first..].as_mut_ptr();
                msg.msg_iovlen = n as _;
                let flags = libc::MSG_NOSIGNAL | if blocking { 0 } else { libc::MSG_DONTWAIT };
                libc::sendmsg(sock.as_raw_fd(), &msg, flags)
            };
            if sent < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock if !blocking => {
                        blocking = true;
                        continue;
                    }
                    io::ErrorKind::WouldBlock => return Err(io::ErrorKind::TimedOut.into()),
                    _ => return Err(e),
                }
            }
            blocking = true;
            if sent == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            let mut sent = sent as usize;
            while sent > 0 && first < iov.len() {
                let v = &mut iov[first];
                if sent >= v.iov_len {
                    sent -= v.iov_len;
                    first += 1;
                } else {
                    v.iov_base = (v.iov_base as usize + sent) as *mut libc::c_void;
                    v.iov_len -= sent;
                    sent = 0;
                }
            }
        }
        // Whether the socket's send timeout was changed.
        Ok(changed)
    }
}

/// A piece of a message [`Slab::send_pieces`] sends.
#[derive(Clone, Copy, Debug)]
pub enum Piece<'a> {
    /// Bytes of the caller's.
    Heap(&'a [u8]),
    /// A range of the slab.
    Slab { offset: u64, len: usize },
}
