//! One connection to one unit: handshake, framed send and bounded receive.
//!
//! **Request rings.** A shm connection (it mapped the unit's slab over a
//! Unix socket) that has made [`RING_AFTER`] round trips asks the unit
//! once for a request ring ([`Request::OpenRing`]); a unit that serves
//! none answers an error and is never asked again on that connection.
//! From then on every request without payload whose frame fits the ring
//! goes through it ([`Ring::submit`], with a [`Request::RingKick`] on the
//! socket when the unit parked the ring) and its reply comes back through
//! it (a futex wait after the connection's spin), or on the socket where
//! the ring says [`Response::OnSocket`]. Set `STOWAGE_RINGS=0` in the
//! environment (read once per process) to keep every request on the
//! socket, for tests and benchmarks.

use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stowage_shm::ring::{Ring, RING_BYTES};
use stowage_shm::Slab;
use stowage_wire::auth::{fresh_nonce, Secret};
use stowage_wire::io::{
    may_spin, read_header, read_prefix, spin_yield, ReadError, Socket, SpinReader,
};
use stowage_wire::{
    decode_header, encode, Envelope, ErrorCode, FramePrefix, Limits, Request, RequestRef, Response,
    WireError, PREFIX_LEN, PROTOCOL_VERSION,
};

/// What a connection sends: a [`Request`], or a [`RequestRef`] that
/// encodes as one without copying a put's entries.
pub(crate) trait Outgoing: serde::Serialize {
    /// [`Request::may_wait`].
    fn may_wait(&self) -> bool;
}

impl Outgoing for Request {
    fn may_wait(&self) -> bool {
        Request::may_wait(self)
    }
}

impl Outgoing for RequestRef<'_> {
    /// A commit or a put never waits for other clients.
    fn may_wait(&self) -> bool {
        false
    }
}

/// First Busy backoff.
pub const BUSY_RETRY: Duration = Duration::from_millis(200);
/// Largest Busy backoff.
pub const BUSY_RETRY_MAX: Duration = Duration::from_secs(2);

/// Round trips a shm connection makes before it asks for a request ring
/// (a connection that is used a few times only never costs the unit one).
/// [`crate::ClientConfig::ring_after`]'s default.
pub(crate) const RING_AFTER: u32 = 16;

#[cfg(test)]
use crate::config::rings_from_env;
#[cfg(test)]
use crate::failure::Failure as ConnError;
use crate::failure::Failure;

/// How often a request waiting on its ring looks whether the unit's
/// socket has news (its end, or a reply there): a unit that dies is
/// noticed within this, not at the deadline.
const RING_SOCKET_CHECK: Duration = Duration::from_millis(20);

/// A connection's request ring.
enum RingState {
    /// None, and none to ask for: not a shm connection, rings turned off,
    /// or the unit refused one.
    Off,
    /// Round trips made so far; the ring is asked for at [`RING_AFTER`].
    Counting(u32),
    /// Requests without payload go through this ring.
    On(Arc<Ring>),
}

/// Where a unit listens.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum UnitAddr {
    /// A Unix socket: same host; the shm transport.
    Unix(PathBuf),
    /// A TCP address: any host; the tcp transport.
    Tcp(SocketAddr),
}

impl std::str::FromStr for UnitAddr {
    type Err = String;

    /// `unix:/path`, `tcp:host:port`, or a bare path (contains `/`) or
    /// `host:port`.
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(p) = s.strip_prefix("unix:") {
            return Ok(UnitAddr::Unix(p.into()));
        }
        let t = s.strip_prefix("tcp:").unwrap_or(s);
        if let Ok(a) = t.parse::<SocketAddr>() {
            return Ok(UnitAddr::Tcp(a));
        }
        if s.contains('/') {
            return Ok(UnitAddr::Unix(s.into()));
        }
        Err(format!(
            "not a unit address: {s:?} (use unix:/path or tcp:127.0.0.1:PORT)"
        ))
    }
}

impl std::fmt::Display for UnitAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UnitAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            UnitAddr::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

impl From<ReadError> for Failure {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Io(e) => e.into(),
            ReadError::Wire(e) => Failure::Protocol(e.to_string()),
        }
    }
}

/// Connect to a Unix socket within `deadline`: a unit that is stopped with
/// its listen backlog full makes a blocking connect wait for ever, so the
/// connect does not block and is retried until the deadline.
fn connect_unix(path: &std::path::Path, deadline: Instant) -> Result<UnixStream, Failure> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let addr = SocketAddrUnix::new(path).map_err(io::Error::from)?;
    let mut wait = Duration::from_micros(100);
    loop {
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
        .map_err(io::Error::from)?;
        match rustix::net::connect(&fd, &addr) {
            Ok(()) => {
                let s = UnixStream::from(fd);
                s.set_nonblocking(false)?;
                return Ok(s);
            }
            // The backlog is full: ask again until the deadline.
            Err(rustix::io::Errno::AGAIN) => {
                remaining(deadline)?;
                std::thread::sleep(wait.min(remaining(deadline)?));
                wait = (wait * 2).min(Duration::from_millis(20));
            }
            Err(e) => return Err(io::Error::from(e).into()),
        }
    }
}

/// Without a shared secret nothing proves who listens on a Unix socket:
/// refuse a unit of another user (one that bound the path first would
/// otherwise be handed this client's data, and hand it memory of its own).
fn check_peer_uid(s: &UnixStream, path: &std::path::Path) -> Result<(), Failure> {
    let mine = rustix::process::geteuid();
    let cred = rustix::net::sockopt::socket_peercred(s).map_err(io::Error::from)?;
    if cred.uid != mine {
        return Err(Failure::Distrust(format!(
            "the process serving {} runs as uid {}, not as this client's uid {}: without a \
                 shared secret a client talks only to units of its own user (give the units' \
                 secret, or use a socket in a private directory)",
            path.display(),
            cred.uid.as_raw(),
            mine.as_raw()
        )));
    }
    Ok(())
}

/// A reply's kind, for error messages (never its contents: a Challenge
/// carries a proof).
fn variant_name(r: &Response) -> &'static str {
    match r {
        Response::Hello { .. } => "Hello",
        Response::Allocated { .. } => "Allocated",
        Response::ToDisk => "ToDisk",
        Response::Pending => "Pending",
        Response::AlreadyCommitted => "AlreadyCommitted",
        Response::Done => "Done",
        Response::Resolved { .. } => "Resolved",
        Response::Cleared { .. } => "Cleared",
        Response::Stats(_) => "Stats",
        Response::Data { .. } => "Data",
        Response::Listed { .. } => "Listed",
        Response::Partitions { .. } => "Partitions",
        Response::Checkpointed(_) => "Checkpointed",
        Response::ShutDown { .. } => "ShutDown",
        Response::Error { .. } => "Error",
        Response::Challenge { .. } => "Challenge",
        Response::CommittedSpare { .. } => "CommittedSpare",
        Response::NixlInfo { .. } => "NixlInfo",
        Response::Ring { .. } => "Ring",
        Response::OnSocket => "OnSocket",
        Response::Restore(_) => "Restore",
        Response::Claimed { .. } => "Claimed",
        Response::Settled { .. } => "Settled",
        Response::ClaimStatus(_) => "ClaimStatus",
        Response::ClaimsState { .. } => "ClaimsState",
        Response::ResolvedRows(_) => "ResolvedRows",
        Response::RepairOpened { .. } => "RepairOpened",
        Response::View { .. } => "View",
        Response::Repaired { .. } => "Repaired",
        Response::Forwarded { .. } => "Forwarded",
    }
}

/// How long a reply whose bytes were there when its deadline passed may
/// take to be read whole ([`Conn::recv`]).
const REPLY_GRACE: Duration = Duration::from_millis(250);

/// The remaining time, or Timeout when none is left.
pub(crate) fn remaining(deadline: Instant) -> Result<Duration, Failure> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(Failure::Timeout)
    } else {
        Ok(left)
    }
}

pub(crate) struct Conn {
    reader: BufReader<SpinReader>,
    writer: Socket,
    pub(crate) instance_id: u128,
    /// The session this connection belongs to (the unit's token).
    pub(crate) session: u128,
    /// The view of the plane it speaks for (`Request::Epoch`; 0 until it
    /// says).
    pub(crate) epoch: u64,
    pub(crate) slab: Option<Arc<Slab>>,
    /// The slab's length as the unit's Hello announced it: the bound of
    /// every range the unit names (checked before a one-sided transport
    /// writes or reads one).
    pub(crate) slab_bytes: u64,
    next_id: u64,
    out: Vec<u8>,
    scratch: Vec<u8>,
    limits: Limits,
    /// The read timeout last set, to skip redundant setsockopt calls.
    read_timeout: Option<Duration>,
    ring: RingState,
    /// The id of the last request sent through the ring: its reply comes
    /// there.
    ring_sent: Option<u64>,
    /// A ring entry taken, decoded from here.
    ring_entry: Vec<u8>,
    /// How long a reply is polled for before the caller sleeps.
    spin: Duration,
    /// Round trips before the connection asks for a ring
    /// ([`Conn::ring_when`]).
    ring_after: u32,
}

impl Conn {
    /// When a shm connection asks for a request ring: after `after` round
    /// trips (default [`RING_AFTER`]), or never (`None`). Set before its
    /// first request.
    pub(crate) fn ring_when(&mut self, after: Option<u32>) {
        match after {
            Some(n) => self.ring_after = n,
            None => {
                if matches!(self.ring, RingState::Counting(_)) {
                    self.ring = RingState::Off;
                }
            }
        }
    }

    /// Another handle on this connection's socket: the unit sees the
    /// connection end only once both are closed (a transfer that may still
    /// be running keeps what the connection holds).
    pub(crate) fn keep_open(&self) -> Option<Socket> {
        self.writer.try_clone().ok()
    }

    /// Connect, prove `secret` (when given; the unit must prove it too)
    /// and say Hello. `cached_slab`: a mapping of this unit's slab from an
    /// earlier connection, reused when the instance is the same.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn connect(
        addr: &UnitAddr,
        namespace: &str,
        want_fd: bool,
        session: Option<u128>,
        cached_slab: Option<(u128, Arc<Slab>)>,
        spin: Duration,
        secret: Option<&Secret>,
        deadline: Instant,
    ) -> Result<Conn, Failure> {
        let left = remaining(deadline)?;
        let (reader, writer) = match addr {
            UnitAddr::Unix(p) => {
                let s = connect_unix(p, deadline)?;
                if secret.is_none() {
                    check_peer_uid(&s, p)?;
                }
                (Socket::Unix(s.try_clone()?), Socket::Unix(s))
            }
            UnitAddr::Tcp(a) => {
                let s = TcpStream::connect_timeout(a, left)?;
                s.set_nodelay(true)?;
                (Socket::Tcp(s.try_clone()?), Socket::Tcp(s))
            }
        };
        let want_fd = want_fd && matches!(writer, Socket::Unix(_));
        let mut c = Conn {
            reader: BufReader::with_capacity(64 << 10, SpinReader::new(reader, spin)),
            writer,
            instance_id: 0,
            epoch: 0,
            session: 0,
            slab: None,
            slab_bytes: 0,
            next_id: 1,
            out: Vec::with_capacity(4096),
            scratch: Vec::new(),
            limits: Limits::default(),
            read_timeout: None,
            ring: RingState::Off,
            ring_sent: None,
            ring_entry: Vec::new(),
            spin,
            ring_after: RING_AFTER,
        };
        // The id of the proof, whose refusal may come in place of the
        // Hello's reply.
        let mut prove_id = None;
        if let Some(secret) = secret {
            let client_nonce = fresh_nonce()?;
            let id = c.send_first(&Request::Auth { client_nonce }, deadline)?;
            match c.recv(id, deadline)? {
                Response::Challenge {
                    unit_nonce,
                    unit_proof,
                } => {
                    if !secret.verify_unit_proof(&client_nonce, &unit_nonce, &unit_proof) {
                        return Err(Failure::Distrust(
                            "the unit did not prove the shared secret: its secret is not this client's"
                                .into(),
                        ));
                    }
                    let client_proof = secret.client_proof(&client_nonce, &unit_nonce);
                    prove_id = Some(c.send_first(&Request::Prove { client_proof }, deadline)?);
                }
                Response::Error { code, message } => return Err(Failure::Refused(code, message)),
                other => {
                    return Err(Failure::Protocol(format!(
                        "unexpected reply to Auth: {}",
                        variant_name(&other)
                    )))
                }
            }
        }
        let id = c.send_first(
            &Request::Hello {
                version: PROTOCOL_VERSION,
                namespace: namespace.to_owned(),
                want_fd,
                session,
            },
            deadline,
        )?;
        let (resp, fd) = if want_fd {
            c.recv_hello_with_fd(deadline)?
        } else {
            let ids = [id, prove_id.unwrap_or(id)];
            (c.recv_for(&ids, deadline)?, None)
        };
        match resp {
            Response::Hello {
                instance_id,
                fd_attached,
                session,
                slab_bytes,
                ..
            } => {
                c.instance_id = instance_id;
                c.session = session;
                c.slab_bytes = slab_bytes;
                if want_fd {
                    if !fd_attached {
                        return Err(Failure::Protocol("unit did not hand over its slab".into()));
                    }
                    c.slab = match (cached_slab, fd) {
                        (Some((inst, slab)), _) if inst == instance_id => Some(slab),
                        (_, Some(fd)) => {
                            // Mapped without filling its page tables: the
                            // unit faults the pages in after it starts, and
                            // large copies fill their regions' tables (see
                            // `Slab::open`). Filling them all at connect took
                            // 2 s for a 4 GiB slab here, for every client.
                            Some(Arc::new(
                                Slab::open(fd, slab_bytes)
                                    .map_err(|e| Failure::Distrust(e.to_string()))?,
                            ))
                        }
                        (_, None) => {
                            return Err(Failure::Protocol("slab fd missing from Hello".into()))
                        }
                    };
                    c.ring = RingState::Counting(0);
                }
                Ok(c)
            }
            Response::Error { code, message } => Err(Failure::Refused(code, message)),
            other => Err(Failure::Protocol(format!(
                "unexpected reply to Hello: {}",
                variant_name(&other)
            ))),
        }
    }

    /// Send a handshake request. A unit that turns a connection away (too
    /// many connections, another user, no proof of the secret) answers
    /// and closes: when the send finds the connection closed, its answer
    /// is read rather than a broken connection reported.
    fn send_first(&mut self, req: &Request, deadline: Instant) -> Result<u64, Failure> {
        match self.send(req, &mut [], deadline) {
            Ok(id) => Ok(id),
            Err(Failure::Broken(e)) => {
                let sent: Vec<u64> = (1..self.next_id).collect();
                Err(match self.recv_for(&sent, deadline) {
                    Ok(Response::Error { code, message }) => Failure::Refused(code, message),
                    _ => Failure::Broken(e),
                })
            }
            Err(e) => Err(e),
        }
    }

    /// The Hello reply with its SCM_RIGHTS fd: the fd arrives with the
    /// first bytes, so the first read must be a recvmsg.
    fn recv_hello_with_fd(
        &mut self,
        deadline: Instant,
    ) -> Result<(Response, Option<std::os::fd::OwnedFd>), Failure> {
        let Socket::Unix(s) = &self.reader.get_ref().socket else {
            return Err(Failure::Protocol("fd passing needs a Unix socket".into()));
        };
        s.set_read_timeout(Some(remaining(deadline)?))?;
        let mut buf = vec![0u8; 4096];
        let (mut n, fd) = stowage_shm::recv_with_fd(s, &mut buf)?;
        if n == 0 {
            return Err(Failure::Broken(io::ErrorKind::UnexpectedEof.into()));
        }
        loop {
            match stowage_wire::decode_frame::<Response>(&buf[..n], &self.limits) {
                Ok(Some((f, _))) => return Ok((f.envelope.body, fd)),
                Ok(None) if n < buf.len() => {
                    let m = self.reader.get_mut().read(&mut buf[n..])?;
                    if m == 0 {
                        return Err(Failure::Broken(io::ErrorKind::UnexpectedEof.into()));
                    }
                    n += m;
                }
                Ok(None) => return Err(Failure::Protocol("Hello reply too long".into())),
                Err(e) => return Err(Failure::Protocol(e.to_string())),
            }
        }
    }

    fn set_timeouts(&mut self, deadline: Instant) -> Result<(), Failure> {
        let left = remaining(deadline)?;
        // Only tighten or refresh when it matters: a stale longer timeout is
        // refreshed, a slightly shorter one is close enough to the deadline.
        let stale = match self.read_timeout {
            Some(t) => t > left || left.saturating_sub(t) > Duration::from_millis(50),
            None => true,
        };
        if stale {
            self.writer.set_timeouts(Some(left))?;
            self.read_timeout = Some(left);
        }
        Ok(())
    }

    /// Send a request and its payload; returns its id. A request without
    /// payload goes through the connection's ring when it has one and the
    /// frame fits (a full ring: on the socket).
    pub(crate) fn send(
        &mut self,
        req: &impl Outgoing,
        payload: &mut [IoSlice<'_>],
        deadline: Instant,
    ) -> Result<u64, Failure> {
        remaining(deadline)?;
        if payload.is_empty() {
            self.open_ring_when_due(deadline)?;
        }
        let id = self.next_id;
        self.next_id += 1;
        let payload_len: u64 = payload.iter().map(|s| s.len() as u64).sum();
        self.out.clear();
        encode(id, req, payload_len, &mut self.out)
            .map_err(|e| Failure::Protocol(e.to_string()))?;
        // A request whose answer may wait for other clients stays off the
        // ring, whose replies come back in order.
        if payload.is_empty() && !req.may_wait() {
            if let RingState::On(ring) = &self.ring {
                if self.out.len() <= ring.max_entry() {
                    if let Ok(parked) = ring.submit(&self.out) {
                        self.ring_sent = Some(id);
                        if parked {
                            self.kick(deadline)?;
                        }
                        return Ok(id);
                    }
                }
            }
        }
        self.set_timeouts(deadline)?;
        if payload.is_empty() {
            self.writer.write_all(&self.out)?;
        } else {
            let mut all = Vec::with_capacity(payload.len() + 1);
            all.push(IoSlice::new(&self.out));
            all.extend(payload.iter().map(|s| IoSlice::new(s)));
            match self.writer.write_all_until(&mut all, deadline) {
                // The send timeout stands as `set_timeouts` left it.
                Ok(false) => {}
                // Re-armed for a later write: refreshed by the next
                // `set_timeouts`.
                Ok(true) => self.read_timeout = None,
                Err(e) => {
                    self.read_timeout = None;
                    return Err(e.into());
                }
            }
        }
        Ok(id)
    }

    /// Send a request without payload, let the other units' parts of the
    /// call run (`fanout::turn`), and take its reply (its payload, if any,
    /// is left on the stream for [`Conn::read_payload`]).
    pub(crate) async fn call(
        &mut self,
        req: &impl Outgoing,
        deadline: Instant,
    ) -> Result<Response, Failure> {
        let id = self.send(req, &mut [], deadline)?;
        crate::fanout::turn().await;
        self.recv(id, deadline)
    }

    /// Receive the reply to request `id` (its payload, if any, is left on
    /// the stream for [`Conn::read_payload`]).
    pub(crate) fn recv(&mut self, id: u64, deadline: Instant) -> Result<Response, Failure> {
        let reply = match &self.ring {
            RingState::On(ring) if self.ring_sent == Some(id) => {
                let ring = ring.clone();
                self.recv_ring(&ring, id, deadline)?
            }
            _ => self.recv_for(&[id], deadline)?,
        };
        if let RingState::Counting(n) = &mut self.ring {
            *n += 1;
        }
        Ok(reply)
    }

    /// Tell the unit, which parked the ring, that it has requests.
    fn kick(&mut self, deadline: Instant) -> Result<(), Failure> {
        self.set_timeouts(deadline)?;
        let id = self.next_id;
        self.next_id += 1;
        self.out.clear();
        encode(id, &Request::RingKick, 0, &mut self.out)
            .map_err(|e| Failure::Protocol(e.to_string()))?;
        self.writer.write_all(&self.out)?;
        Ok(())
    }

    /// Ask for a ring once the connection has made its [`RING_AFTER`]
    /// round trips (and has nothing left unread): map it on
    /// [`Response::Ring`]; on an error (a unit that serves no rings), or a
    /// ring this process cannot map, never ask again.
    fn open_ring_when_due(&mut self, deadline: Instant) -> Result<(), Failure> {
        match self.ring {
            RingState::Counting(n) if n >= self.ring_after && self.reader.buffer().is_empty() => {}
            _ => return Ok(()),
        }
        self.ring = RingState::Off;
        let asked = RING_BYTES as u32;
        self.set_timeouts(deadline)?;
        let id = self.next_id;
        self.next_id += 1;
        self.out.clear();
        encode(id, &Request::OpenRing { bytes: asked }, 0, &mut self.out)
            .map_err(|e| Failure::Protocol(e.to_string()))?;
        self.writer.write_all(&self.out)?;
        let (reply, fd) = self.recv_frame_with_fd(id)?;
        match reply {
            Response::Ring { bytes } => {
                let Some(fd) = fd else {
                    return Err(Failure::Protocol("ring fd missing from its reply".into()));
                };
                match Ring::open(fd, bytes as usize) {
                    Ok(ring) => self.ring = RingState::On(Arc::new(ring)),
                    // The unit keeps a ring nobody uses until the
                    // connection ends; requests stay on the socket.
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot map the unit's request ring; requests stay on the socket")
                    }
                }
            }
            Response::Error { code, message } => {
                tracing::debug!(?code, %message, "the unit serves no request rings");
            }
            other => {
                return Err(Failure::Protocol(format!(
                    "unexpected reply to OpenRing: {}",
                    variant_name(&other)
                )))
            }
        }
        Ok(())
    }

    /// Receive the reply to `id` with the fd that may ride on its first
    /// byte (SCM_RIGHTS), reading exactly that frame (no payload), within
    /// the socket's timeouts.
    fn recv_frame_with_fd(
        &mut self,
        id: u64,
    ) -> Result<(Response, Option<std::os::fd::OwnedFd>), Failure> {
        let Socket::Unix(s) = &self.reader.get_ref().socket else {
            return Err(Failure::Protocol("fd passing needs a Unix socket".into()));
        };
        let mut prefix = [0u8; PREFIX_LEN];
        let (n, fd) = stowage_shm::recv_with_fd(s, &mut prefix)?;
        if n == 0 {
            return Err(Failure::Broken(io::ErrorKind::UnexpectedEof.into()));
        }
        self.reader.read_exact(&mut prefix[n..])?;
        let prefix = FramePrefix::parse(&prefix, &self.limits)
            .map_err(|e| Failure::Protocol(e.to_string()))?;
        let env: Envelope<Response> = read_header(&mut self.reader, &prefix, &mut self.scratch)?;
        if env.id != id && env.id != 0 {
            return Err(Failure::Protocol(format!(
                "reply for request {} while waiting for {id}",
                env.id
            )));
        }
        if prefix.payload_len != 0 {
            return Err(Failure::Protocol(format!(
                "a {} reply with a payload",
                variant_name(&env.body)
            )));
        }
        Ok((env.body, fd))
    }

    /// Receive the reply to `id`, sent through `ring`: from the ring, or
    /// from the socket where the ring says so ([`Response::OnSocket`]) or
    /// where the socket has something to say (the unit's end, an error).
    fn recv_ring(&mut self, ring: &Ring, id: u64, deadline: Instant) -> Result<Response, Failure> {
        // Spin only with a core to spare; else sleep on the futex at once.
        let mut spin = if may_spin() {
            self.spin
        } else {
            Duration::ZERO
        };
        let mut socket_ready = false;
        loop {
            let taken = ring
                .take_reply(&mut self.ring_entry)
                .map_err(|e| Failure::Protocol(e.to_string()))?;
            if taken {
                let env = decode_entry(&self.ring_entry, &self.limits)?;
                match env.body {
                    Response::OnSocket if env.id == id => return self.recv_for(&[id], deadline),
                    // Announced after its reply was read off the socket
                    // (see below): nothing left to do for it.
                    Response::OnSocket if env.id < id => continue,
                    body if env.id == id || env.id == 0 => return Ok(body),
                    _ => {
                        return Err(Failure::Protocol(format!(
                            "ring reply for request {} while waiting for {id}",
                            env.id
                        )))
                    }
                }
            }
            // The socket became readable after the ring was found empty:
            // whatever the unit put in the ring before writing there is
            // seen by the look above, so what is on the socket is this
            // request's reply, an error, or the unit's end.
            if socket_ready {
                return self.recv_for(&[id], deadline);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Failure::Timeout);
            }
            if ring.wait_reply_with(deadline.min(now + RING_SOCKET_CHECK), spin, spin_yield) {
                continue;
            }
            spin = Duration::ZERO;
            socket_ready = self.socket_readable()?;
        }
    }

    /// The deadline to read a reply by: `deadline`, or, once it has
    /// passed while the reply's bytes are there already, [`REPLY_GRACE`]
    /// from now. A call's parts run on one thread (`fanout.rs`): while one
    /// unit's part waited out the deadline, another unit's reply came, and
    /// that unit did answer in time.
    fn reply_deadline(&self, deadline: Instant) -> Result<Instant, Failure> {
        let now = Instant::now();
        if now < deadline {
            Ok(deadline)
        } else if self.socket_readable()? {
            Ok(now + REPLY_GRACE)
        } else {
            Err(Failure::Timeout)
        }
    }

    /// Whether the socket has bytes (or its end) to read, without waiting.
    fn socket_readable(&self) -> Result<bool, Failure> {
        if !self.reader.buffer().is_empty() {
            return Ok(true);
        }
        use rustix::event::{PollFd, PollFlags};
        let sock = &self.reader.get_ref().socket;
        let mut fds = [PollFd::new(sock, PollFlags::IN)];
        let zero = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match rustix::event::poll(&mut fds, Some(&zero)) {
            Ok(_) => Ok(!fds[0].revents().is_empty()),
            Err(rustix::io::Errno::INTR) => Ok(false),
            Err(e) => Err(io::Error::from(e).into()),
        }
    }

    /// Receive a reply to one of the requests `ids` (or one with id 0,
    /// sent before any request was read).
    fn recv_for(&mut self, ids: &[u64], deadline: Instant) -> Result<Response, Failure> {
        let deadline = self.reply_deadline(deadline)?;
        self.set_timeouts(deadline)?;
        let prefix = read_prefix(&mut self.reader, &self.limits)?
            .ok_or_else(|| Failure::Broken(io::ErrorKind::UnexpectedEof.into()))?;
        let env: Envelope<Response> = read_header(&mut self.reader, &prefix, &mut self.scratch)?;
        if !ids.contains(&env.id) && env.id != 0 {
            let id = ids.first().copied().unwrap_or(0);
            return Err(Failure::Protocol(format!(
                "reply for request {} while waiting for {id}",
                env.id
            )));
        }
        Ok(env.body)
    }

    /// Read payload bytes of the last reply straight into `dst`.
    pub(crate) fn read_payload(
        &mut self,
        dst: &mut [u8],
        deadline: Instant,
    ) -> Result<(), Failure> {
        let deadline = self.reply_deadline(deadline)?;
        self.set_timeouts(deadline)?;
        self.reader.read_exact(dst)?;
        Ok(())
    }

    /// Discard payload bytes of the last reply.
    pub(crate) fn skip_payload(&mut self, n: u64, deadline: Instant) -> Result<(), Failure> {
        let deadline = self.reply_deadline(deadline)?;
        self.set_timeouts(deadline)?;
        stowage_wire::io::drain(&mut self.reader, n)?;
        Ok(())
    }
}

impl Conn {
    /// [`Conn::connect`], asked again while the unit refuses for now: a
    /// unit that answers Busy (it serves its most connections, or cut the
    /// handshake to admit another) or resets the connection during the
    /// handshake is asked again with the Busy backoff (0.2 s doubling to
    /// 2 s) within the deadline; at the deadline the error says why it
    /// refused ([`Failure::Refusing`]). A refused TCP connect or a
    /// missing socket file is not retried: nothing listens there (the
    /// unit is gone, which the caller must learn at once).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn connect_retrying(
        addr: &UnitAddr,
        namespace: &str,
        want_fd: bool,
        session: Option<u128>,
        cached_slab: Option<(u128, Arc<Slab>)>,
        spin: Duration,
        secret: Option<&Secret>,
        deadline: Instant,
    ) -> Result<Conn, Failure> {
        let mut wait = BUSY_RETRY;
        loop {
            let tried = Self::connect(
                addr,
                namespace,
                want_fd,
                session,
                cached_slab.clone(),
                spin,
                secret,
                deadline,
            );
            let why = match tried {
                Err(Failure::Refused(ErrorCode::Busy, message)) => message,
                Err(Failure::Broken(e)) if cut_in_handshake(&e) => {
                    format!("the unit cut the connection during its handshake ({e})")
                }
                other => return other,
            };
            if Instant::now() + wait >= deadline {
                return Err(Failure::Refusing(why));
            }
            tracing::debug!(%addr, reason = %why, retry_in = ?wait, "the unit refused a connection; asking again");
            std::thread::sleep(wait);
            wait = (wait * 2).min(BUSY_RETRY_MAX);
        }
    }
}

/// A ring entry as a reply: exactly one frame, without payload.
fn decode_entry(entry: &[u8], limits: &Limits) -> Result<Envelope<Response>, Failure> {
    let bad = |e: WireError| Failure::Protocol(format!("a ring entry: {e}"));
    let header = entry
        .get(..PREFIX_LEN)
        .and_then(|p| <&[u8; PREFIX_LEN]>::try_from(p).ok())
        .map(|p| FramePrefix::parse(p, limits))
        .transpose()
        .map_err(bad)?
        .filter(|p| p.payload_len == 0)
        .and_then(|p| {
            entry
                .get(PREFIX_LEN..)
                .filter(|h| h.len() == p.header_len as usize)
        });
    let Some(header) = header else {
        return Err(Failure::Protocol(format!(
            "a ring entry of {} bytes is not one frame without payload",
            entry.len()
        )));
    };
    decode_header(header).map_err(bad)
}

/// Whether a connection that was made broke the way a unit's cutting a
/// handshake breaks it (reset, or closed before its answer).
fn cut_in_handshake(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
    )
}

#[cfg(test)]
mod tests;
