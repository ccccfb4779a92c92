//! Blocking frame I/O over any `Read`/`Write` stream, shared by the unit
//! server and the client.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;

use crate::{decode_header, Envelope, FramePrefix, Limits, WireError, PREFIX_LEN};

/// Why reading a frame failed: the stream, or the bytes on it.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("connection: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Wire(#[from] WireError),
}

/// Read a frame prefix. `Ok(None)` on a clean end of stream before its
/// first byte; a stream that ends inside the prefix is `UnexpectedEof`.
pub fn read_prefix<R: Read>(r: &mut R, limits: &Limits) -> Result<Option<FramePrefix>, ReadError> {
    let mut p = [0u8; PREFIX_LEN];
    let mut got = 0;
    while got < PREFIX_LEN {
        match r.read(&mut p[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Some(FramePrefix::parse(&p, limits)?))
}

/// Read and decode the header that follows `prefix`, using `buf` as
/// scratch (its capacity is reused across frames). The buffer grows with
/// the bytes that actually arrive, never to the size the prefix claims up
/// front: a peer that announces a large header and sends nothing costs
/// nothing.
pub fn read_header<R: Read, T: DeserializeOwned>(
    r: &mut R,
    prefix: &FramePrefix,
    buf: &mut Vec<u8>,
) -> Result<Envelope<T>, ReadError> {
    const STEP: usize = 64 << 10;
    let want = prefix.header_len as usize;
    buf.clear();
    while buf.len() < want {
        let at = buf.len();
        let n = (want - at).min(STEP.max(at));
        buf.resize(at + n, 0);
        match r.read(&mut buf[at..]) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
            Ok(got) => buf.truncate(at + got),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => buf.truncate(at),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(decode_header(buf)?)
}

/// Write every byte of every slice, with as few syscalls as the stream
/// allows.
pub fn write_all_vectored<W: Write>(w: &mut W, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        // Linux takes at most 1024 slices per writev.
        let n = slices.len().min(1024);
        match w.write_vectored(&slices[..n]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => IoSlice::advance_slices(&mut slices, written),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Adaptive polling: try to read from a socket without blocking, for up to
/// `budget`. `None` when nothing arrived in time (the caller then blocks).
///
/// A blocking wake-up costs tens of microseconds on a VM; a reply that
/// comes within the budget is picked up without one. The budget bounds the
/// CPU a waiting thread burns, and it yields its core between polls.
pub fn spin_read(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    budget: Duration,
) -> Option<io::Result<usize>> {
    if budget.is_zero() {
        return None;
    }
    let end = Instant::now() + budget;
    loop {
        match rustix::net::recv(sock, &mut *buf, rustix::net::RecvFlags::DONTWAIT) {
            Ok((n, _)) => return Some(Ok(n)),
            Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {
                if Instant::now() >= end {
                    return None;
                }
                // Give the core to any other runnable thread between
                // polls (a no-op where none waits): with more pollers
                // than cores (units and clients on a small host), pure
                // spinning starved the thread that would answer, and
                // 64 KiB gets over two units took 66 us instead of 24.
                std::thread::yield_now();
            }
            Err(e) => return Some(Err(e.into())),
        }
    }
}

/// A connected stream socket: a Unix socket (same host) or TCP.
pub enum Socket {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Socket {
    pub fn try_clone(&self) -> io::Result<Socket> {
        Ok(match self {
            Socket::Unix(s) => Socket::Unix(s.try_clone()?),
            Socket::Tcp(s) => Socket::Tcp(s.try_clone()?),
        })
    }

    /// Bound blocking writes (`None`: unbounded).
    /// Shut both directions: a read blocked on the socket in another
    /// thread returns at once, and the peer sees the connection end.
    pub fn shutdown(&self) -> io::Result<()> {
        match self {
            Socket::Unix(s) => s.shutdown(std::net::Shutdown::Both),
            Socket::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
        }
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Unix(s) => s.set_write_timeout(t),
            Socket::Tcp(s) => s.set_write_timeout(t),
        }
    }

    /// Bound blocking reads and writes (`None`: unbounded).
    pub fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Unix(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Socket::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
        }
    }
}

impl AsFd for Socket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Socket::Unix(s) => s.as_fd(),
            Socket::Tcp(s) => s.as_fd(),
        }
    }
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Unix(s) => s.read(buf),
            Socket::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Unix(s) => s.write(buf),
            Socket::Tcp(s) => s.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Socket::Unix(s) => s.write_vectored(bufs),
            Socket::Tcp(s) => s.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A socket's read half that polls for `spin` before it blocks (see
/// [`spin_read`]), and fails reads with `TimedOut` past `deadline` when
/// one is set.
pub struct SpinReader {
    pub socket: Socket,
    pub spin: Duration,
    /// Reads that would block past this fail with `TimedOut`. `None`:
    /// block for as long as it takes (an idle connection).
    pub deadline: Option<Instant>,
    /// The receive timeout this reader last set on the socket.
    set_timeout: Option<Duration>,
}

impl SpinReader {
    pub fn new(socket: Socket, spin: Duration) -> Self {
        Self {
            socket,
            spin,
            deadline: None,
            set_timeout: None,
        }
    }

    /// Someone else changed the socket's receive timeout (e.g. a receive
    /// straight into a slab): bring it back in line at the next read.
    pub fn timeout_changed(&mut self) {
        self.set_timeout = Some(Duration::MAX);
    }

    /// Bring the socket's receive timeout in line with `deadline`,
    /// skipping the system call when it would change little (before a
    /// read that bypasses this reader).
    pub fn apply_deadline(&mut self) -> io::Result<()> {
        let want = match self.deadline {
            None => None,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                Some(left)
            }
        };
        let stale = match (self.set_timeout, want) {
            (None, None) => false,
            (Some(_), None) | (None, Some(_)) => true,
            // Refresh when the deadline moved later by more than a little,
            // or comes sooner than the socket's timeout.
            (Some(cur), Some(w)) => w < cur || w - cur > Duration::from_millis(20),
        };
        if stale {
            let sock: &dyn AsFd = &self.socket;
            rustix::net::sockopt::set_socket_timeout(
                sock.as_fd(),
                rustix::net::sockopt::Timeout::Recv,
                want,
            )?;
            self.set_timeout = want;
        }
        Ok(())
    }
}

impl Read for SpinReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // A peer that trickles bytes within the spin window is bounded by
        // the deadline too.
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(io::ErrorKind::TimedOut.into());
        }
        if let Some(r) = spin_read(self.socket.as_fd(), buf, self.spin) {
            return r;
        }
        if self.deadline.is_some() || self.set_timeout.is_some() {
            self.apply_deadline()?;
        }
        match self.socket.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && self.deadline.is_some() => {
                Err(io::ErrorKind::TimedOut.into())
            }
            r => r,
        }
    }
}

/// Read and discard `n` bytes.
pub fn drain<R: Read>(r: &mut R, n: u64) -> io::Result<()> {
    let copied = io::copy(&mut r.take(n), &mut io::sink())?;
    if copied < n {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{encode, Request};

    #[test]
    fn frames_read_back_from_a_stream() {
        let mut buf = Vec::new();
        encode(1, &Request::Stats, 0, &mut buf).unwrap();
        encode(
            2,
            &Request::ClearRows {
                partition: String::new(),
                rows: vec![4],
            },
            5,
            &mut buf,
        )
        .unwrap();
        buf.extend_from_slice(b"12345");
        let mut r = &buf[..];
        let limits = Limits::default();
        let mut scratch = Vec::new();
        let p = read_prefix(&mut r, &limits).unwrap().unwrap();
        let e: Envelope<Request> = read_header(&mut r, &p, &mut scratch).unwrap();
        assert_eq!(
            e,
            Envelope {
                id: 1,
                body: Request::Stats
            }
        );
        let p = read_prefix(&mut r, &limits).unwrap().unwrap();
        let e: Envelope<Request> = read_header(&mut r, &p, &mut scratch).unwrap();
        assert_eq!(e.id, 2);
        drain(&mut r, p.payload_len).unwrap();
        assert!(read_prefix(&mut r, &limits).unwrap().is_none());
        let mut cut = &buf[..5];
        assert!(matches!(
            read_prefix(&mut cut, &limits),
            Err(ReadError::Io(_))
        ));
    }

    #[test]
    fn vectored_writes_write_everything() {
        let a = vec![1u8; 3000];
        let b = vec![2u8; 5];
        let mut out = Vec::new();
        let mut slices = vec![IoSlice::new(&a), IoSlice::new(&[]), IoSlice::new(&b)];
        write_all_vectored(&mut out, &mut slices).unwrap();
        assert_eq!(out.len(), 3005);
        assert_eq!(out[3004], 2);
    }
}
