//! Transports: how one unit's operations move bytes.
//!
//! Each operation is a small state machine driven in rounds by the client's
//! fan-out ([`crate::Client`]): `start_*` sends the first message, each
//! `advance_*` waits for one reply and sends the next message, until it
//! reports completion. Driving every unit's operation one round at a time
//! keeps all units working at once, so a call waits for the slowest unit,
//! not the sum of them.
//!
//! * [`ShmTransport`] (same host): put = Alloc → the client copies into the
//!   mapped slab → Commit; get = Resolve (pins) → copy out → Unpin (sent
//!   without awaiting a reply).
//! * [`TcpTransport`] (any host): put = one Put request carrying the bytes,
//!   which the unit reads straight into its slab; get = one Read request,
//!   whose reply streams the values straight into the caller's buffers.

use std::io::IoSlice;
use std::sync::Arc;
use std::time::Instant;

use stowage_core::{EntrySpec, Key, PinId};
use stowage_shm::Slab;
use stowage_wire::{ErrorCode, Request, Response};

use crate::conn::{Conn, ConnError};
use crate::BlobPut;

/// Why one unit's operation failed, before the client classifies it.
#[derive(Debug)]
pub enum OpFailure {
    /// The connection failed. `in_flight`: payload bytes may still be on
    /// their way to the unit.
    Conn { error: ConnFailure, in_flight: bool },
    /// The unit answered with an error.
    Unit { code: ErrorCode, message: String },
}

/// A connection-level failure.
#[derive(Debug)]
pub enum ConnFailure {
    Timeout,
    Broken(String),
    Protocol(String),
}

impl OpFailure {
    pub(crate) fn conn(e: ConnError, in_flight: bool) -> Self {
        let error = match e {
            ConnError::Timeout => ConnFailure::Timeout,
            ConnError::Broken(e) => ConnFailure::Broken(e.to_string()),
            ConnError::Protocol(m) => ConnFailure::Protocol(m),
        };
        OpFailure::Conn { error, in_flight }
    }

    fn unexpected(r: Response) -> Self {
        match r {
            Response::Error { code, message } => OpFailure::Unit { code, message },
            other => OpFailure::conn(
                ConnError::Protocol(format!("unexpected reply {other:?}")),
                false,
            ),
        }
    }
}

/// Where a get puts each value: asked once per found key with the value's
/// length, it returns the buffer of exactly that length to fill.
pub trait GetSink {
    /// `index` is the key's position in the call's key list; `meta` the
    /// metadata stored with the value.
    fn slot(&mut self, index: usize, len: u64, meta: &[u8]) -> Result<&mut [u8], String>;
}

/// What a finished get on one unit reports: the positions (in its own key
/// list) of keys it does not have.
pub type Missing = Vec<usize>;

/// One unit's side of the client: a connection plus the state of the
/// operation in progress on it.
pub trait Transport: Send {
    fn name(&self) -> &'static str;
    /// The unit's instance id from the handshake.
    fn instance_id(&self) -> u128;

    fn start_put(&mut self, put: &BlobPut<'_>, deadline: Instant) -> Result<(), OpFailure>;
    /// `Ok(true)` once the blob is committed.
    fn advance_put(&mut self, put: &BlobPut<'_>, deadline: Instant) -> Result<bool, OpFailure>;

    fn start_get(
        &mut self,
        partition: &str,
        keys: &[Key],
        deadline: Instant,
    ) -> Result<(), OpFailure>;
    /// `index_of[i]` is the call-wide index of `keys[i]`, passed to `sink`.
    /// `Ok(Some(missing))` once every value has been delivered.
    fn advance_get(
        &mut self,
        keys: &[Key],
        index_of: &[usize],
        sink: &mut dyn GetSink,
        deadline: Instant,
    ) -> Result<Option<Missing>, OpFailure>;

    /// Send a control request (no payload) without waiting.
    fn start_call(&mut self, req: &Request, deadline: Instant) -> Result<(), OpFailure>;
    /// Send a request the unit does not answer (an Unpin with
    /// `reply: false`).
    fn notify(&mut self, req: &Request, deadline: Instant) -> Result<(), OpFailure>;
    /// Await the reply to `start_call`.
    fn finish_call(&mut self, deadline: Instant) -> Result<Response, OpFailure>;

    /// The unit's slab as this process maps it (shm transport only).
    fn slab(&self) -> Option<Arc<Slab>> {
        None
    }
}

fn total_len(put: &BlobPut<'_>) -> u64 {
    put.segments.iter().map(|s| s.len() as u64).sum()
}

fn n_entries(entries: &[EntrySpec]) -> Result<u32, OpFailure> {
    u32::try_from(entries.len()).map_err(|_| OpFailure::Unit {
        code: ErrorCode::InvalidRequest,
        message: "more than 2^32 entries in one blob".into(),
    })
}

/// The shm transport. See the module docs.
pub struct ShmTransport {
    conn: Conn,
    slab: Arc<Slab>,
    awaiting: Option<u64>,
    put_state: ShmPut,
}

enum ShmPut {
    Idle,
    Allocating,
    Committing,
}

impl ShmTransport {
    pub(crate) fn new(conn: Conn) -> Option<Self> {
        let slab = conn.slab.clone()?;
        Some(Self {
            conn,
            slab,
            awaiting: None,
            put_state: ShmPut::Idle,
        })
    }

    fn send(&mut self, req: &Request, deadline: Instant) -> Result<(), OpFailure> {
        let id = self
            .conn
            .send(req, &mut [], deadline)
            .map_err(|e| OpFailure::conn(e, false))?;
        self.awaiting = Some(id);
        Ok(())
    }

    fn recv(&mut self, deadline: Instant) -> Result<Response, OpFailure> {
        let id = self.awaiting.take().unwrap_or(0);
        self.conn
            .recv(id, deadline)
            .map_err(|e| OpFailure::conn(e, false))
    }
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn instance_id(&self) -> u128 {
        self.conn.instance_id
    }

    fn start_put(&mut self, put: &BlobPut<'_>, deadline: Instant) -> Result<(), OpFailure> {
        let req = Request::Alloc {
            blob: put.blob,
            nbytes: total_len(put),
            n_entries: n_entries(&put.entries)?,
        };
        self.send(&req, deadline)?;
        self.put_state = ShmPut::Allocating;
        Ok(())
    }

    fn advance_put(&mut self, put: &BlobPut<'_>, deadline: Instant) -> Result<bool, OpFailure> {
        match self.put_state {
            ShmPut::Idle => Ok(true),
            ShmPut::Allocating => match self.recv(deadline)? {
                Response::Allocated { offset } => {
                    let mut at = offset;
                    for seg in &put.segments {
                        self.slab.write(at, seg).map_err(|e| {
                            OpFailure::conn(ConnError::Protocol(e.to_string()), false)
                        })?;
                        at += seg.len() as u64;
                    }
                    let req = Request::Commit {
                        blob: put.blob,
                        partition: put.partition.to_owned(),
                        entries: put.entries.clone(),
                    };
                    self.send(&req, deadline)?;
                    self.put_state = ShmPut::Committing;
                    Ok(false)
                }
                Response::AlreadyCommitted => {
                    self.put_state = ShmPut::Idle;
                    Ok(true)
                }
                other => {
                    self.put_state = ShmPut::Idle;
                    Err(OpFailure::unexpected(other))
                }
            },
            ShmPut::Committing => {
                self.put_state = ShmPut::Idle;
                match self.recv(deadline)? {
                    Response::Done => Ok(true),
                    other => Err(OpFailure::unexpected(other)),
                }
            }
        }
    }

    fn start_get(
        &mut self,
        partition: &str,
        keys: &[Key],
        deadline: Instant,
    ) -> Result<(), OpFailure> {
        let req = Request::Resolve {
            partition: partition.to_owned(),
            keys: keys.to_vec(),
            hold: false,
        };
        self.send(&req, deadline)
    }

    fn advance_get(
        &mut self,
        keys: &[Key],
        index_of: &[usize],
        sink: &mut dyn GetSink,
        deadline: Instant,
    ) -> Result<Option<Missing>, OpFailure> {
        let (pin, found) = match self.recv(deadline)? {
            Response::Resolved { pin, found } if found.len() == keys.len() => (pin, found),
            other => return Err(OpFailure::unexpected(other)),
        };
        let mut missing = Vec::new();
        let mut result = Ok(());
        for (i, f) in found.iter().enumerate() {
            match f {
                None => missing.push(i),
                Some(l) => {
                    let copied = sink
                        .slot(index_of[i], l.len, &l.meta)
                        .and_then(|dst| self.slab.read(l.offset, dst).map_err(|e| e.to_string()));
                    if let Err(m) = copied {
                        result = Err(OpFailure::Unit {
                            code: ErrorCode::InvalidRequest,
                            message: m,
                        });
                        break;
                    }
                }
            }
        }
        if let Some(pin) = pin {
            self.unpin(pin, deadline)?;
        }
        result.map(|()| Some(missing))
    }

    fn start_call(&mut self, req: &Request, deadline: Instant) -> Result<(), OpFailure> {
        self.send(req, deadline)
    }

    fn finish_call(&mut self, deadline: Instant) -> Result<Response, OpFailure> {
        self.recv(deadline)
    }

    fn notify(&mut self, req: &Request, deadline: Instant) -> Result<(), OpFailure> {
        self.conn
            .send(req, &mut [], deadline)
            .map_err(|e| OpFailure::conn(e, false))?;
        Ok(())
    }

    fn slab(&self) -> Option<Arc<Slab>> {
        Some(self.slab.clone())
    }
}

impl ShmTransport {
    fn unpin(&mut self, pin: PinId, deadline: Instant) -> Result<(), OpFailure> {
        // No reply: the pin's lease covers a lost unpin.
        self.conn
            .send(&Request::Unpin { pin, reply: false }, &mut [], deadline)
            .map_err(|e| OpFailure::conn(e, false))?;
        Ok(())
    }
}

/// The tcp transport. See the module docs.
pub struct TcpTransport {
    conn: Conn,
    awaiting: Option<u64>,
}

impl TcpTransport {
    pub(crate) fn new(conn: Conn) -> Self {
        Self {
            conn,
            awaiting: None,
        }
    }

    fn recv(&mut self, deadline: Instant, in_flight: bool) -> Result<Response, OpFailure> {
        let id = self.awaiting.take().unwrap_or(0);
        self.conn
            .recv(id, deadline)
            .map_err(|e| OpFailure::conn(e, in_flight))
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn instance_id(&self) -> u128 {
        self.conn.instance_id
    }

    fn start_put(&mut self, put: &BlobPut<'_>, deadline: Instant) -> Result<(), OpFailure> {
        n_entries(&put.entries)?;
        let req = Request::Put {
            blob: put.blob,
            partition: put.partition.to_owned(),
            entries: put.entries.clone(),
        };
        let mut payload: Vec<IoSlice<'_>> = put.segments.iter().map(|s| IoSlice::new(s)).collect();
        let id = self
            .conn
            .send(&req, &mut payload, deadline)
            .map_err(|e| OpFailure::conn(e, true))?;
        self.awaiting = Some(id);
        Ok(())
    }

    fn advance_put(&mut self, _put: &BlobPut<'_>, deadline: Instant) -> Result<bool, OpFailure> {
        match self.recv(deadline, true)? {
            Response::Done => Ok(true),
            other => Err(OpFailure::unexpected(other)),
        }
    }

    fn start_get(
        &mut self,
        partition: &str,
        keys: &[Key],
        deadline: Instant,
    ) -> Result<(), OpFailure> {
        let req = Request::Read {
            partition: partition.to_owned(),
            keys: keys.to_vec(),
        };
        let id = self
            .conn
            .send(&req, &mut [], deadline)
            .map_err(|e| OpFailure::conn(e, false))?;
        self.awaiting = Some(id);
        Ok(())
    }

    fn advance_get(
        &mut self,
        keys: &[Key],
        index_of: &[usize],
        sink: &mut dyn GetSink,
        deadline: Instant,
    ) -> Result<Option<Missing>, OpFailure> {
        let items = match self.recv(deadline, false)? {
            Response::Data { items } if items.len() == keys.len() => items,
            other => return Err(OpFailure::unexpected(other)),
        };
        let mut missing = Vec::new();
        let mut sink_error = None;
        for (i, item) in items.iter().enumerate() {
            let Some(item) = item else {
                missing.push(i);
                continue;
            };
            let len = item.len;
            // After a sink error the rest of the payload is still read, so
            // the connection stays usable.
            let slot = if sink_error.is_none() {
                match sink.slot(index_of[i], len, &item.meta) {
                    Ok(s) => Some(s),
                    Err(m) => {
                        sink_error = Some(m);
                        None
                    }
                }
            } else {
                None
            };
            match slot {
                Some(dst) => self.conn.read_payload(dst, deadline),
                None => self.conn.skip_payload(len, deadline),
            }
            .map_err(|e| OpFailure::conn(e, false))?;
        }
        match sink_error {
            Some(message) => Err(OpFailure::Unit {
                code: ErrorCode::InvalidRequest,
                message,
            }),
            None => Ok(Some(missing)),
        }
    }

    fn start_call(&mut self, req: &Request, deadline: Instant) -> Result<(), OpFailure> {
        let id = self
            .conn
            .send(req, &mut [], deadline)
            .map_err(|e| OpFailure::conn(e, false))?;
        self.awaiting = Some(id);
        Ok(())
    }

    fn finish_call(&mut self, deadline: Instant) -> Result<Response, OpFailure> {
        self.recv(deadline, false)
    }

    fn notify(&mut self, req: &Request, deadline: Instant) -> Result<(), OpFailure> {
        self.conn
            .send(req, &mut [], deadline)
            .map_err(|e| OpFailure::conn(e, false))?;
        Ok(())
    }
}
