//! Forwarded puts (docs/replication.md#forwarding): this unit as a client
//! of the units that hold a put's other copies.
//!
//! A unit forwarding a [`Request::ForwardPut`] is, to each other copy's
//! unit, a client like any other: it proves the plane's shared secret,
//! says Hello in the put's namespace and holds its own session there, so
//! fencing applies to it as to any client (its reservation there ends
//! with its connection, never by a timer). It sends each copy a plain
//! [`RequestRef::Put`] whose payload it streams out of its own slab as the
//! bytes arrive from the client (`conn/transfer.rs`). Connections are
//! kept per (address, namespace) for the next forward, a few each.

use std::collections::HashMap;
use std::io::{self, BufReader, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use stowage_shm::{Piece, Slab};
use stowage_wire::auth::{fresh_nonce, Secret};
use stowage_wire::io::{read_header, read_prefix, ReadError};
use stowage_wire::{
    encode, Envelope, ErrorCode, FailedCopy, Limits, Request, RequestRef, Response,
    PROTOCOL_VERSION,
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
    /// The view of the plane the forward speaks for (its client's).
    pub(crate) epoch: u64,
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
        if key.epoch != 0 {
            // Its requests speak for the client's view: a unit of another
            // refuses them Stale, and the client writes that copy itself.
            match c.call(&Request::Epoch { epoch: key.epoch }, connect_by)? {
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

/// One connection to another unit, which has said Hello.
pub(crate) struct PeerConn {
    /// The instance that answered its Hello.
    instance: u128,
    /// The view of the plane it speaks for.
    epoch: u64,
    writer: TcpStream,
    reader: BufReader<TcpStream>,
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
        let sa: SocketAddr = addr
            .parse()
            .map_err(|_| PeerError::Io(format!("{addr} is not an ip:port address")))?;
        let left = left(deadline)?;
        let s = TcpStream::connect_timeout(&sa, left)
            .map_err(|e| PeerError::Io(format!("cannot connect to {addr}: {e}")))?;
        s.set_nodelay(true)?;
        let mut c = PeerConn {
            instance: 0,
            epoch: 0,
            reader: BufReader::with_capacity(16 << 10, s.try_clone()?),
            writer: s,
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
            want_fd: false,
            session: None,
        };
        let id = c.send(&hello, 0, deadline)?;
        match c.recv_any(deadline)? {
            Envelope {
                body: Response::Hello { instance_id, .. },
                id: got,
            } if got == id => {
                c.instance = instance_id;
                Ok(c)
            }
            Envelope { body, .. } => Err(refused(body, "Hello")),
        }
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

/// A handshake reply other than the one awaited.
fn refused(r: Response, to: &str) -> PeerError {
    match r {
        Response::Error { code, message } => PeerError::Refused(code, message),
        _ => PeerError::Io(format!("an unexpected reply to {to}")),
    }
}
