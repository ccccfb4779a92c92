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
    read_header_bytes(r, prefix, buf)?;
    Ok(decode_header(buf)?)
}

/// [`read_header`] without decoding: the header's bytes in `buf`.
fn read_header_bytes<R: Read>(
    r: &mut R,
    prefix: &FramePrefix,
    buf: &mut Vec<u8>,
) -> Result<(), ReadError> {
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
    Ok(())
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

// ---- whether a waiting thread may spin ----
//
// A waiter polls (yielding between looks) only while it has a core to
// itself. Two signs say it has not: a yield that kept it off its core for
// longer than [`YIELD_SLOW`] (3 ms: a thread with work to do, not another
// poller, took the core), and then, looked up to confirm, more runnable
// threads on the host than this process has cores. Either alone would do
// worse: the host-wide count also counts pollers that give their core
// back at once (a unit lingering on a client's ring), and a slow yield
// may be the hypervisor's.

/// A yield that kept its thread off the core this long gave the core to a
/// thread with work to do (a poller gives it back within microseconds).
/// Shorter ones slept where yielding paid: up to 64 client processes on
/// an idle 2-core host pass the core among themselves within a few
/// hundred microseconds (docs/scale.md, `bench/client_procs.py`).
pub const YIELD_SLOW: Duration = Duration::from_millis(3);

/// How long a slow yield, and a look at the host's runnable count, hold:
/// reading `/proc/loadavg` costs a few microseconds, a wait about as much.
const CONTENDED_TTL: Duration = Duration::from_millis(10);

/// The decision: a thread waiting for a reply may spin (poll, yielding)
/// unless a recent yield of this process was slow (`yield_slow`) and the
/// host's runnable threads (`runnable`, the waiter among them) outnumber
/// the cores this process may use (`cores`): then every spinning waiter
/// holds a core another thread (the unit that would answer, another
/// client) needs, and it sleeps at once. Unknown figures (0) count as
/// outnumbered.
pub fn spin_fits(runnable: u32, cores: u32, yield_slow: bool) -> bool {
    !yield_slow || (runnable != 0 && cores != 0 && runnable <= cores)
}

/// The running count in `/proc/loadavg`'s text: its fourth field,
/// `running/total` (threads runnable at that instant, the reader among
/// them).
pub fn loadavg_running(text: &str) -> Option<u32> {
    let field = text.split_ascii_whitespace().nth(3)?;
    field.split_once('/')?.0.parse().ok()
}

fn cores() -> u32 {
    static CORES: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    // Affinity and cgroup quota both counted.
    *CORES.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(0, |n| u32::try_from(n.get()).unwrap_or(u32::MAX))
    })
}

fn runnable_now() -> u32 {
    let mut buf = [0u8; 128];
    let Ok(fd) = rustix::fs::open(
        "/proc/loadavg",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    ) else {
        return 0;
    };
    let n = rustix::io::read(&fd, &mut buf).unwrap_or(0);
    std::str::from_utf8(&buf[..n])
        .ok()
        .and_then(loadavg_running)
        .unwrap_or(0)
}

mod contention {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    static EPOCH: OnceLock<Instant> = OnceLock::new();
    /// Nanoseconds after EPOCH until which the last slow yield holds.
    static SLOW_UNTIL: AtomicU64 = AtomicU64::new(0);
    /// Until when the last look at the runnable count holds, and its answer.
    static LOOKED_UNTIL: AtomicU64 = AtomicU64::new(0);
    static FITS: AtomicBool = AtomicBool::new(true);

    fn nanos(d: Duration) -> u64 {
        u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
    }

    pub(super) fn now() -> u64 {
        nanos(EPOCH.get_or_init(Instant::now).elapsed())
    }

    pub(super) fn slow_yield(at: u64) {
        SLOW_UNTIL.store(
            at.saturating_add(nanos(super::CONTENDED_TTL)),
            Ordering::Relaxed,
        );
    }

    pub(super) fn yield_slow(at: u64) -> bool {
        at < SLOW_UNTIL.load(Ordering::Relaxed)
    }

    /// The host's runnable count against the cores, looked up at most
    /// every TTL by one thread (the others use the last answer).
    pub(super) fn cores_fit(at: u64) -> bool {
        let until = LOOKED_UNTIL.load(Ordering::Relaxed);
        if at < until
            || LOOKED_UNTIL
                .compare_exchange(
                    until,
                    at.saturating_add(nanos(super::CONTENDED_TTL)),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return FITS.load(Ordering::Relaxed);
        }
        let fits = super::spin_fits(super::runnable_now(), super::cores(), true);
        FITS.store(fits, Ordering::Relaxed);
        fits
    }
}

/// Set by [`spin_always`].
static SPIN_ALWAYS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Let every wait of this process spin whatever the host's load, as before
/// waits looked at it (for comparisons: the client's config sets it from
/// `STOWAGE_SPIN_ALWAYS=1`).
pub fn spin_always(on: bool) {
    SPIN_ALWAYS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a thread about to wait may spin now ([`spin_fits`]: no slow
/// yield in this process lately, or, after one, no more runnable threads
/// on the host than this process's cores), or always after
/// [`spin_always`].
pub fn may_spin() -> bool {
    if SPIN_ALWAYS.load(std::sync::atomic::Ordering::Relaxed) {
        return true;
    }
    let now = contention::now();
    !contention::yield_slow(now) || contention::cores_fit(now)
}

/// Give the core away between polls ([`std::thread::yield_now`]), timing
/// the yield: `false` when it was slow ([`YIELD_SLOW`]; noted for
/// [`may_spin`]) and the caller should stop polling and sleep.
pub fn spin_yield() -> bool {
    let t = Instant::now();
    std::thread::yield_now();
    let took = t.elapsed();
    if took < YIELD_SLOW {
        return true;
    }
    contention::slow_yield(contention::now());
    may_spin()
}

/// Adaptive polling: try to read from a socket without blocking, for up to
/// `budget`. `None` when nothing arrived in time (the caller then blocks).
/// No polling at all where the host has more runnable threads than this
/// process has cores ([`may_spin`]).
///
/// A blocking wake-up costs tens of microseconds on a VM; a reply that
/// comes within the budget is picked up without one. The budget bounds the
/// CPU a waiting thread burns, and it yields its core between polls.
pub fn spin_read(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    budget: Duration,
) -> Option<io::Result<usize>> {
    if budget.is_zero() || !may_spin() {
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
                // A slow yield: the core is wanted, stop polling.
                if !spin_yield() {
                    return None;
                }
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

    /// Shut both directions: a read blocked on the socket in another
    /// thread returns at once, and the peer sees the connection end.
    pub fn shutdown(&self) -> io::Result<()> {
        match self {
            Socket::Unix(s) => s.shutdown(std::net::Shutdown::Both),
            Socket::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
        }
    }

    /// [`write_all_vectored`] bounded as a whole by `deadline`: a write
    /// that sent part of its bytes is followed by one whose send timeout
    /// is the time left (`TimedOut` once it passes). The first write
    /// takes the timeout the socket has: the caller sets it to the time
    /// left. (A send timeout bounds one system call: a peer that takes a
    /// few bytes now and then would otherwise stretch a payload's write
    /// past its deadline, up to the timeout per call.) Returns whether it
    /// changed the socket's send timeout.
    pub fn write_all_until(
        &mut self,
        mut slices: &mut [IoSlice<'_>],
        deadline: std::time::Instant,
    ) -> io::Result<bool> {
        IoSlice::advance_slices(&mut slices, 0);
        let (mut first, mut first_only) = (true, true);
        while !slices.is_empty() {
            if !first {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                self.set_write_timeout(Some(left))?;
                first_only = false;
            }
            first = false;
            // Linux takes at most 1024 slices per writev.
            let n = slices.len().min(1024);
            match self.write_vectored(&slices[..n]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(written) => IoSlice::advance_slices(&mut slices, written),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(!first_only)
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
        loop {
            if self.deadline.is_some() || self.set_timeout.is_some() {
                self.apply_deadline()?;
            }
            match self.socket.read(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && self.deadline.is_some() => {
                    return Err(io::ErrorKind::TimedOut.into())
                }
                // A read with a timeout fails with EINTR when the process
                // was stopped (SIGSTOP) and resumed, even with no signal
                // handler (signal(7)): read again, within the deadline.
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    if self.deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(io::ErrorKind::TimedOut.into());
                    }
                }
                r => return r,
            }
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
    fn a_waiter_spins_only_with_a_core_to_itself() {
        // No slow yield lately: spin, whatever the host-wide count (it
        // counts pollers that give their core back at once).
        assert!(spin_fits(1, 2, false));
        assert!(spin_fits(66, 2, false));
        // After a slow yield: spin only while the runnable threads (the
        // waiter among them) are no more than the cores.
        assert!(spin_fits(1, 2, true));
        assert!(spin_fits(2, 2, true));
        assert!(spin_fits(16, 16, true));
        assert!(!spin_fits(3, 2, true));
        assert!(!spin_fits(66, 2, true));
        assert!(!spin_fits(2, 1, true));
        // Unknown figures after a slow yield: sleep.
        assert!(!spin_fits(0, 2, true));
        assert!(!spin_fits(5, 0, true));
    }

    #[test]
    fn the_running_count_is_read_from_loadavg() {
        assert_eq!(loadavg_running("0.52 0.61 0.70 3/512 12345\n"), Some(3));
        assert_eq!(loadavg_running("1.00 1.00 1.00 66/1024 7"), Some(66));
        assert_eq!(loadavg_running("0.00 0.00 0.00"), None);
        assert_eq!(loadavg_running("0.00 0.00 0.00 x/5 1"), None);
        // This host's own file parses, and counts this thread.
        let text = std::fs::read_to_string("/proc/loadavg").expect("/proc/loadavg");
        assert!(loadavg_running(&text).is_some_and(|n| n >= 1), "{text}");
    }

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
