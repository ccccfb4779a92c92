//! Forwarded puts (docs/replication.md#forwarding): this unit as a client
//! of the units that hold a put's other copies.
//!
//! A unit forwarding a [`Request::ForwardPut`] is, to each other copy's
//! unit, a client like any other: it proves the plane's shared secret,
//! says Hello in the put's namespace and holds its own session there, so
//! fencing applies to it as to any client (its reservation there ends
//! with its connection, never by a timer). It sends each copy a plain
//! [`RequestRef::Put`] whose payload it streams out of its own slab as the
//! bytes arrive from the client (`conn/transfer.rs`). On one host
//! ([`Request::CopyReserved`]) it connects to the next unit's Unix socket
//! instead, maps its slab as a client does, and copies the put's bytes
//! from its own slab into a reservation there ([`PeerConn::copy_in`]).
//! Connections are kept per (address, namespace) for the next forward, a
//! few each (with their mapping).

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use stowage_shm::{Piece, Slab};
use stowage_wire::auth::{fresh_nonce, Secret};
use stowage_wire::io::{read_header, read_prefix, ReadError};
use stowage_wire::{
    encode, BlobId, EntrySpec, Envelope, ErrorCode, FailedCopy, FramePrefix, Limits, Request,
    RequestRef, Response, PREFIX_LEN, PROTOCOL_VERSION,
};

/// Idle connections kept per (address, namespace), and in all.
const KEEP_IDLE: usize = 4;
const KEEP_IDLE_ALL: usize = 256;

/// The most a connection to the next unit (connect, handshake, Hello)
/// takes of a put's time: a unit that cannot reach the next one fails
/// that copy soon, and the client has the rest of its time to write it.
const CONNECT_MAX: Duration = Duration::from_secs(1);

/// Why a forward to one copy failed: its unit's answer, or what happened
/// on the way there.
#[derive(Debug)]
pub(crate) enum PeerError {
    /// The copy's unit answered this error.
    Refused(ErrorCode, String),
    /// Connecting, sending or receiving failed (the connection is not
    /// kept).
    Io(String),
}

impl PeerError {
    /// The failure as the client is told of it, for copy `unit`.
    pub(crate) fn of_copy(self, unit: u32) -> FailedCopy {
        match self {
            PeerError::Refused(code, message) => FailedCopy {
                unit,
                code,
                message,
            },
            PeerError::Io(message) => FailedCopy {
                unit,
                code: ErrorCode::Internal,
                message,
            },
        }
    }
}

impl From<io::Error> for PeerError {
    fn from(e: io::Error) -> Self {
        PeerError::Io(e.to_string())
    }
}

impl From<ReadError> for PeerError {
    fn from(e: ReadError) -> Self {
        PeerError::Io(e.to_string())
    }
}

/// The connections this unit keeps to other units, and the secret it
/// proves to them.
pub(crate) struct Peers {
    secret: Option<Secret>,
    idle: Mutex<HashMap<(String, String), Vec<PeerConn>>>,
}

/// Where a forward goes: the next unit's address, the namespace it says
/// Hello in, and the instance it must be (when the client knows it).
pub(crate) struct PeerKey<'a> {
    pub(crate) addr: &'a str,
    pub(crate) namespace: &'a str,
    pub(crate) instance: Option<u128>,
    /// The view of the plane the forward speaks for (its client's: epoch
    /// and digest).
    pub(crate) epoch: (u64, u64),
}

impl Peers {
    pub(crate) fn new(secret: Option<Secret>) -> Self {
        Self {
            secret,
            idle: Mutex::new(HashMap::new()),
        }
    }

    /// Whether this unit forwards puts: only with the plane's shared
    /// secret, which it proves to the next unit and checks it proves back
    /// (without one, a client could make it connect anywhere).
    pub(crate) fn forwards(&self) -> bool {
        self.secret.is_some()
    }

    /// A connection to the unit of `key`: an idle one of that instance,
    /// or a new one (connect, handshake and Hello within a second, and
    /// within `deadline`), refused when another instance answers.
    pub(crate) fn checkout(
        &self,
        key: &PeerKey<'_>,
        deadline: Instant,
    ) -> Result<PeerConn, PeerError> {
        let kept = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let mut conns = idle.get_mut(&(key.addr.to_owned(), key.namespace.to_owned()));
            // Connections to another instance than the one asked for are
            // of a unit gone: dropped.
            let mut found = None;
            while let Some(c) = conns.as_deref_mut().and_then(Vec::pop) {
                if key.instance.is_none_or(|i| i == c.instance) && c.epoch == key.epoch {
                    found = Some(c);
                    break;
                }
            }
            found
        };
        if let Some(c) = kept {
            return Ok(c);
        }
        let connect_by = deadline.min(Instant::now() + CONNECT_MAX);
        let mut c = PeerConn::connect(key.addr, key.namespace, self.secret.as_ref(), connect_by)?;
        if key.epoch != crate::plane::Plane::first() {
            // Its requests speak for the client's view: a unit of another
            // refuses them Stale, and the client learns the view.
            let (epoch, digest) = key.epoch;
            match c.call(&Request::Epoch { epoch, digest }, connect_by)? {
                Response::View { .. } => {}
                other => return Err(refused(other, "Epoch")),
            }
        }
        c.epoch = key.epoch;
        match key.instance {
            Some(i) if i != c.instance => Err(PeerError::Io(format!(
                "another instance answers at {} ({:032x}, not {i:032x}): the unit was restarted",
                key.addr, c.instance
            ))),
            _ => Ok(c),
        }
    }

    /// Keep `conn` (whose last request was answered whole) for the next
    /// forward to `addr` in `namespace` (a few per address and namespace,
    /// and [`KEEP_IDLE_ALL`] in all).
    pub(crate) fn checkin(&self, addr: &str, namespace: &str, conn: PeerConn) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.values().map(Vec::len).sum::<usize>() >= KEEP_IDLE_ALL {
            return;
        }
        let kept = idle
            .entry((addr.to_owned(), namespace.to_owned()))
            .or_default();
        if kept.len() < KEEP_IDLE {
            kept.push(conn);
        }
    }
}

/// A connection's socket: tcp (a forward), or a Unix socket of this host
/// (a copy into the next unit's slab).
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Unix(s) => s.set_read_timeout(t),
        }
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(t),
            Stream::Unix(s) => s.set_write_timeout(t),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
        }
    }
}

/// One connection to another unit, which has said Hello.
pub(crate) struct PeerConn {
    /// The instance that answered its Hello.
    instance: u128,
    /// The view of the plane it speaks for.
    epoch: (u64, u64),
    writer: Stream,
    reader: BufReader<Stream>,
    /// The unit's slab, mapped (a connection over its Unix socket).
    slab: Option<Slab>,
    next_id: u64,
    out: Vec<u8>,
    scratch: Vec<u8>,
    limits: Limits,
}

impl PeerConn {
    fn connect(
        addr: &str,
        namespace: &str,
        secret: Option<&Secret>,
        deadline: Instant,
    ) -> Result<PeerConn, PeerError> {
        let cannot = |e: io::Error| PeerError::Io(format!("cannot connect to {addr}: {e}"));
        // An absolute path: the Unix socket of a unit of this host, whose
        // slab the connection maps.
        let s = if addr.starts_with('/') {
            Stream::Unix(connect_unix(addr, deadline).map_err(cannot)?)
        } else {
            let sa: SocketAddr = addr
                .parse()
                .map_err(|_| PeerError::Io(format!("{addr} is not an ip:port address")))?;
            let s = TcpStream::connect_timeout(&sa, left(deadline)?).map_err(cannot)?;
            s.set_nodelay(true)?;
            Stream::Tcp(s)
        };
        let want_fd = matches!(s, Stream::Unix(_));
        let mut c = PeerConn {
            instance: 0,
            epoch: crate::plane::Plane::first(),
            reader: BufReader::with_capacity(16 << 10, s.try_clone()?),
            writer: s,
            slab: None,
            next_id: 1,
            out: Vec::new(),
            scratch: Vec::new(),
            limits: Limits::default(),
        };
        if let Some(secret) = secret {
            let client_nonce = fresh_nonce()?;
            match c.call(&Request::Auth { client_nonce }, deadline)? {
                Response::Challenge {
                    unit_nonce,
                    unit_proof,
                } => {
                    if !secret.verify_unit_proof(&client_nonce, &unit_nonce, &unit_proof) {
                        return Err(PeerError::Io(format!(
                            "the unit at {addr} did not prove the plane's secret"
                        )));
                    }
                    let client_proof = secret.client_proof(&client_nonce, &unit_nonce);
                    // Answered only when refused: the Hello's answer comes
                    // in its place otherwise.
                    c.send(&Request::Prove { client_proof }, 0, deadline)?;
                }
                other => return Err(refused(other, "Auth")),
            }
        }
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            namespace: namespace.to_owned(),
            want_fd,
            session: None,
        };
        let id = c.send(&hello, 0, deadline)?;
        let (answer, fd) = if want_fd {
            c.recv_with_fd(deadline)?
        } else {
            (c.recv_any(deadline)?, None)
        };
        match answer {
            Envelope {
                body:
                    Response::Hello {
                        instance_id,
                        slab_bytes,
                        ..
                    },
                id: got,
            } if got == id => {
                c.instance = instance_id;
                if want_fd {
                    let fd = fd.ok_or_else(|| {
                        PeerError::Io(format!("the unit at {addr} handed over no slab"))
                    })?;
                    let slab = Slab::open(fd, slab_bytes).map_err(|e| {
                        PeerError::Io(format!("cannot map the slab of {addr}: {e}"))
                    })?;
                    c.slab = Some(slab);
                }
                Ok(c)
            }
            Envelope { body, .. } => Err(refused(body, "Hello")),
        }
    }

    /// The reply to a Hello that asked for the slab: its frame, and the
    /// slab's memfd that rides on its first bytes.
    fn recv_with_fd(
        &mut self,
        deadline: Instant,
    ) -> Result<(Envelope<Response>, Option<std::os::fd::OwnedFd>), PeerError> {
        let Stream::Unix(s) = self.reader.get_ref() else {
            return Err(PeerError::Io("fd passing needs a Unix socket".into()));
        };
        s.set_read_timeout(Some(left(deadline)?))?;
        // Nothing was read past the handshake's last answer: the frame
        // starts at the socket.
        let mut prefix = [0u8; PREFIX_LEN];
        let (n, fd) = stowage_shm::recv_with_fd(s, &mut prefix)?;
        if n == 0 {
            return Err(PeerError::Io("the unit closed the connection".into()));
        }
        self.reader.read_exact(&mut prefix[n..])?;
        let prefix =
            FramePrefix::parse(&prefix, &self.limits).map_err(|e| PeerError::Io(e.to_string()))?;
        if prefix.payload_len > 0 {
            return Err(PeerError::Io("a reply with a payload".into()));
        }
        Ok((
            read_header(&mut self.reader, &prefix, &mut self.scratch)?,
            fd,
        ))
    }

    /// Copy the `nbytes` at `pieces` of `src` (this unit's slab; the caller
    /// holds their reservation) into a reservation on the unit at the other
    /// end (its slab mapped), and commit it there with `entries` in
    /// `partition`. A refusal is the unit's; a copy that fails midway gives
    /// the reservation back.
    pub(crate) fn copy_in(
        &mut self,
        src: &Slab,
        pieces: &[(u64, u64)],
        nbytes: u64,
        partition: &str,
        entries: &[EntrySpec],
        deadline: Instant,
    ) -> Result<(), PeerError> {
        if self.slab.is_none() {
            return Err(PeerError::Io("no slab mapped on this connection".into()));
        }
        let blob = fresh_blob()?;
        let n_entries =
            u32::try_from(entries.len()).map_err(|_| PeerError::Io("too many entries".into()))?;
        let to = match self.call(
            &Request::Alloc {
                blob,
                nbytes,
                n_entries,
            },
            deadline,
        )? {
            Response::Allocated { pieces, .. } => pieces,
            // Reserved on its disk tier (its slab has no room): given
            // back; the client writes this copy.
            Response::ToDisk => {
                let full = PeerError::Refused(
                    ErrorCode::Full,
                    "the unit's slab has no room (its disk tier has): the client writes this copy"
                        .into(),
                );
                return Err(self.give_back(blob, full));
            }
            other => return Err(refused(other, "Alloc")),
        };
        if let Err(e) = self.copy_pieces(src, pieces, &to, nbytes) {
            return Err(self.give_back(blob, e));
        }
        let commit = RequestRef::Commit {
            blob,
            partition,
            entries,
        };
        let id = self.send(&commit, 0, deadline)?;
        match self.recv(id, deadline)? {
            Response::Done | Response::AlreadyCommitted => Ok(()),
            other => {
                let e = refused(other, "Commit");
                Err(self.give_back(blob, e))
            }
        }
    }

    /// `e`, once reservation `blob` on this connection is given back
    /// (within a second of its own, the put's time perhaps spent); when
    /// it cannot be, `Io`: the connection is not kept, and its end gives
    /// the reservation back.
    fn give_back(&mut self, blob: BlobId, e: PeerError) -> PeerError {
        let abort = Request::Abort {
            blob,
            in_flight: false,
        };
        match self.call(&abort, Instant::now() + Duration::from_secs(1)) {
            Ok(Response::Done) => e,
            _ => PeerError::Io(format!(
                "{}; giving its reservation back failed: the connection closes",
                match e {
                    PeerError::Refused(code, m) => format!("{code:?}: {m}"),
                    PeerError::Io(m) => m,
                }
            )),
        }
    }

    /// Copy `nbytes` from `src`'s `from` pieces to this connection's slab's
    /// `to` pieces, both in order.
    fn copy_pieces(
        &self,
        src: &Slab,
        from: &[(u64, u64)],
        to: &[(u64, u64)],
        nbytes: u64,
    ) -> Result<(), PeerError> {
        let dst = self.slab.as_ref().expect("checked by copy_in");
        let (mut i, mut j, mut a, mut b, mut done) = (0, 0, 0u64, 0u64, 0u64);
        while done < nbytes {
            let (Some(&(fo, fl)), Some(&(to_o, tl))) = (from.get(i), to.get(j)) else {
                return Err(PeerError::Io(
                    "the pieces do not hold the blob's bytes".into(),
                ));
            };
            let n = (fl - a).min(tl - b).min(nbytes - done);
            let n_usize =
                usize::try_from(n).map_err(|_| PeerError::Io("piece too large".into()))?;
            src.copy_to(fo + a, dst, to_o + b, n_usize)
                .map_err(|e| PeerError::Io(format!("a piece outside a slab: {e}")))?;
            (a, b, done) = (a + n, b + n, done + n);
            if a == fl {
                (i, a) = (i + 1, 0);
            }
            if b == tl {
                (j, b) = (j + 1, 0);
            }
        }
        Ok(())
    }

    /// Send a request whose `payload_len` payload bytes follow; its id.
    pub(crate) fn send(
        &mut self,
        req: &impl serde::Serialize,
        payload_len: u64,
        deadline: Instant,
    ) -> Result<u64, PeerError> {
        let id = self.next_id;
        self.next_id += 1;
        self.out.clear();
        encode(id, req, payload_len, &mut self.out).map_err(|e| PeerError::Io(e.to_string()))?;
        self.writer.set_write_timeout(Some(left(deadline)?))?;
        self.writer.write_all(&self.out)?;
        Ok(id)
    }

    /// Send a Put's header; its payload follows through
    /// [`PeerConn::send_slab`].
    pub(crate) fn send_put(
        &mut self,
        put: &RequestRef<'_>,
        payload_len: u64,
        deadline: Instant,
    ) -> Result<u64, PeerError> {
        self.send(put, payload_len, deadline)
    }

    /// Send `len` bytes of `slab` at `offset` (the caller holds their
    /// reservation and wrote them) as payload.
    pub(crate) fn send_slab(
        &mut self,
        slab: &Slab,
        offset: u64,
        len: usize,
        deadline: Instant,
    ) -> Result<(), PeerError> {
        slab.send_pieces(
            self.writer.as_fd(),
            &[Piece::Slab { offset, len }],
            deadline,
        )?;
        Ok(())
    }

    /// The reply to request `id` (within `deadline`).
    pub(crate) fn recv(&mut self, id: u64, deadline: Instant) -> Result<Response, PeerError> {
        let env = self.recv_any(deadline)?;
        if env.id != id {
            return Err(PeerError::Io(format!(
                "a reply to request {} where {id} was awaited",
                env.id
            )));
        }
        Ok(env.body)
    }

    fn call(&mut self, req: &Request, deadline: Instant) -> Result<Response, PeerError> {
        let id = self.send(req, 0, deadline)?;
        self.recv(id, deadline)
    }

    fn recv_any(&mut self, deadline: Instant) -> Result<Envelope<Response>, PeerError> {
        self.reader
            .get_ref()
            .set_read_timeout(Some(left(deadline)?))?;
        let Some(prefix) = read_prefix(&mut self.reader, &self.limits)? else {
            return Err(PeerError::Io("the unit closed the connection".into()));
        };
        if prefix.payload_len > 0 {
            return Err(PeerError::Io("a reply with a payload".into()));
        }
        Ok(read_header(&mut self.reader, &prefix, &mut self.scratch)?)
    }
}

/// The time left to `deadline`, at least a millisecond; `Io` once it
/// passed.
fn left(deadline: Instant) -> Result<std::time::Duration, PeerError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(PeerError::Io("the put's time ran out".into()));
    }
    Ok(left.max(std::time::Duration::from_millis(1)))
}

/// Connect to the Unix socket at `path` by `deadline`: a listener whose
/// backlog is full (its unit paused, taking no connection) is asked again
/// until then, never waited on without end (a blocking connect would).
fn connect_unix(path: &str, deadline: Instant) -> io::Result<UnixStream> {
    use rustix::io::Errno;
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let addr = SocketAddrUnix::new(path)?;
    loop {
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
            None,
        )?;
        match rustix::net::connect(&fd, &addr) {
            Ok(()) => {
                rustix::io::ioctl_fionbio(&fd, false)?;
                return Ok(UnixStream::from(fd));
            }
            Err(Errno::AGAIN) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(Errno::AGAIN) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "its socket took no connection in time (its backlog is full)",
                ))
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// A fresh blob id for a copy's reservation (random, as a client's).
fn fresh_blob() -> Result<BlobId, PeerError> {
    let n = fresh_nonce()?;
    let mut b = [0u8; 16];
    b.copy_from_slice(&n[..16]);
    Ok(BlobId(u128::from_le_bytes(b)))
}

/// A handshake reply other than the one awaited.
fn refused(r: Response, to: &str) -> PeerError {
    match r {
        Response::Error { code, message } => PeerError::Refused(code, message),
        _ => PeerError::Io(format!("an unexpected reply to {to}")),
    }
}
