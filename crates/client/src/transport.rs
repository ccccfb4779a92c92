//! Transports: how one unit's operations move bytes.
//!
//! Each operation on one unit is one `async` function that runs from its
//! first request to its last reply ([`Transport::put`], [`Transport::get`],
//! [`Transport::call`]), and lets the other units' parts run after each
//! request it sends (`fanout::turn`); the client runs every unit's part of
//! a call at once on the calling thread (`fanout::all_at_once`), so a call
//! waits for the slowest unit, not the sum of them.
//!
//! * `ShmTransport` (same host): put = Alloc → the client copies into the
//!   mapped slab → Commit; get = Resolve (pins) → copy out → Unpin (sent
//!   without awaiting a reply). A put's commit also reserves a *spare* of
//!   its size class for the connection's next put (`CommitSpare`): a put
//!   that finds a spare of its class copies into it at once and commits,
//!   one round trip in all. Its requests without payload go through the
//!   connection's request ring once it has one (`conn`'s module docs):
//!   the same `Conn::send` / `Conn::recv`, no system call while the unit
//!   is busy.
//! * [`TcpTransport`] (any host): put = one Put request carrying the bytes,
//!   which the unit reads straight into its slab; get = one Read request,
//!   whose reply streams the values straight into the caller's buffers.

use std::cell::RefCell;
use std::future::Future;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use stowage_shm::Slab;
use stowage_wire::io::Socket;
use stowage_wire::BlobId;
use stowage_wire::{EntrySpec, ErrorCode, FailedCopy, Hop, Key, Request, RequestRef, Response};

use crate::conn::Conn;
use crate::failure::Failure;
use crate::fanout::{pause_until, turn};
use crate::sink::{GetSink, ValueAsk};
use crate::BlobPut;

/// A get's sink, shared by the parts of the units it reads from: each
/// borrows it while it asks for and fills its values' buffers (never
/// across a turn).
pub type SharedSink<'s> = RefCell<&'s mut dyn GetSink>;

/// One unit's part of an operation, run by `fanout::all_at_once`.
pub type Op<'a, T> = Pin<Box<dyn Future<Output = Result<T, Failure>> + 'a>>;

/// What a finished get on one unit reports: the positions (in its own key
/// list) of keys it does not have.
pub type Missing = Vec<usize>;

/// One unit's side of the client: a connection, and what it holds for
/// the next operation (spares). Each operation is one part, run from its
/// first request to its end.
pub trait Transport: Send {
    fn name(&self) -> &'static str;
    /// The unit's instance id from the handshake.
    fn instance_id(&self) -> u128;
    /// The session the unit put this connection in.
    fn session(&self) -> u128;
    /// The view of the plane the connection speaks for.
    fn epoch(&self) -> u64;

    /// Write one blob; ends once it is committed (published).
    fn put<'a>(&'a mut self, put: &'a BlobPut<'_>, deadline: Instant) -> Op<'a, ()>;

    /// Write one blob here and have the unit forward it to the copies
    /// `to` (docs/replication.md#forwarding); ends once it is committed
    /// here, with the copies that are not committed (the caller writes
    /// them itself). A transport that does not forward puts the blob here
    /// and names every copy.
    fn forward_put<'a>(
        &'a mut self,
        put: &'a BlobPut<'_>,
        to: &'a [Hop],
        deadline: Instant,
    ) -> Op<'a, Vec<FailedCopy>> {
        Box::pin(async move {
            self.put(put, deadline).await?;
            Ok(not_forwarded(to, "this transport does not forward"))
        })
    }

    /// Read `keys` of `partition` into `sink`: `index_of[i]` is the
    /// call-wide index of `keys[i]`, passed to the sink. Returns the
    /// keys not found.
    fn get<'a>(
        &'a mut self,
        partition: &'a str,
        keys: &'a [Key],
        index_of: &'a [usize],
        sink: &'a SharedSink<'_>,
        deadline: Instant,
    ) -> Op<'a, Missing>;

    /// Send a control request (no payload) and await its reply.
    fn call<'a>(&'a mut self, req: &'a Request, deadline: Instant) -> Op<'a, Response>;

    /// [`Transport::call`] of a request that borrows its keys or entries
    /// (a view's Resolve).
    fn call_ref<'a>(&'a mut self, req: &'a RequestRef<'_>, deadline: Instant) -> Op<'a, Response>;

    /// Send a RepairPut carrying `put`'s bytes into repair window
    /// `window` (`repair.rs`), and take the unit's reply.
    fn repair_put<'a>(
        &'a mut self,
        window: u64,
        put: &'a BlobPut<'_>,
        deadline: Instant,
    ) -> Op<'a, Response>;

    /// Send a request the unit does not answer (an Unpin with
    /// `reply: false`).
    fn notify(&mut self, req: &Request, deadline: Instant) -> Result<(), Failure>;

    /// The unit's slab as this process maps it (shm transport only).
    fn slab(&self) -> Option<Arc<Slab>> {
        None
    }

    /// Another handle on the connection's socket, to cut a call waiting
    /// on it from another thread (a claim that waits on every unit).
    fn interrupter(&self) -> Option<Socket>;
}

/// The time left to `deadline`, as a request tells the unit (at least
/// 1 ms: a transfer the unit cuts off when the caller has given up).
pub(crate) fn timeout_ms(deadline: Instant) -> u64 {
    let left = deadline.saturating_duration_since(Instant::now());
    u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1)
}

pub(crate) fn total_len(put: &BlobPut<'_>) -> u64 {
    put.segments.iter().map(|s| s.len() as u64).sum()
}

pub(crate) fn n_entries(entries: &[EntrySpec]) -> Result<u32, Failure> {
    u32::try_from(entries.len()).map_err(|_| Failure::invalid("more than 2^32 entries in one blob"))
}

/// Send `req` without awaiting a reply (the unit sends none).
pub(crate) fn notify(conn: &mut Conn, req: &Request, deadline: Instant) -> Result<(), Failure> {
    conn.send(req, &mut [], deadline)?;
    Ok(())
}

/// Read `keys` of `partition` streamed over the connection (a Read, its
/// Data reply's values taken off the connection into `sink`): the
/// positions of missing and of corrupt keys (outer error: the connection
/// failed; inner error: the sink refused a value, the payload was still
/// read off so the connection stays usable).
pub(crate) async fn read_data(
    conn: &mut Conn,
    partition: &str,
    keys: &[Key],
    index_of: &[usize],
    sink: &SharedSink<'_>,
    deadline: Instant,
) -> Result<Result<(Missing, Vec<usize>), Failure>, Failure> {
    let req = Request::Read {
        partition: partition.to_owned(),
        keys: keys.to_vec(),
        timeout_ms: timeout_ms(deadline),
    };
    let (items, corrupt) = match conn.call(&req, deadline).await? {
        Response::Data { items, corrupt } if items.len() == keys.len() => (items, corrupt),
        other => return Err(Failure::unexpected(other)),
    };
    let corrupt: Vec<usize> = corrupt.into_iter().map(|c| c as usize).collect();
    let mut missing = Vec::new();
    let mut sink_error = None;
    let mut sink = sink.borrow_mut();
    for (i, item) in items.iter().enumerate() {
        let Some(item) = item else {
            if !corrupt.contains(&i) {
                missing.push(i);
            }
            continue;
        };
        let slot = if sink_error.is_none() {
            let ask = ValueAsk {
                index: index_of[i],
                len: item.len,
                meta: &item.meta,
            };
            match sink.slot(ask) {
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
            Some(dst) => conn.read_payload(dst, deadline),
            None => conn.skip_payload(item.len, deadline),
        }?;
    }
    Ok(match sink_error {
        Some(message) => Err(Failure::invalid(message)),
        None => Ok((missing, corrupt)),
    })
}

/// The values of a Resolve's answer that are in the unit's memory, as a
/// sink is asked for them.
pub(crate) fn asks_of<'f>(
    found: &'f [Option<stowage_wire::Placed>],
    index_of: &[usize],
) -> Vec<ValueAsk<'f>> {
    found
        .iter()
        .enumerate()
        .filter_map(|(i, f)| {
            f.as_ref().filter(|l| !l.on_disk).map(|l| ValueAsk {
                index: index_of[i],
                len: l.len,
                meta: l.meta.as_slice(),
            })
        })
        .collect()
}

/// How often a put whose blob goes to disk asks whether it is durable.
pub const PENDING_POLL: std::time::Duration = std::time::Duration::from_millis(10);

/// Send a Put carrying the blob's bytes (the unit reads them into its slab
/// or its disk tier) and await until it is published. `refused`: a
/// reservation to give back when a later Commit (after Pending) is
/// refused, before the refusal is returned.
pub(crate) async fn stream_put(
    conn: &mut Conn,
    put: &BlobPut<'_>,
    deadline: Instant,
    refused: Option<BlobId>,
) -> Result<(), Failure> {
    n_entries(&put.entries)?;
    let req = RequestRef::Put {
        blob: put.blob,
        partition: put.partition,
        entries: &put.entries,
        timeout_ms: timeout_ms(deadline),
    };
    let mut reply = send_with_blob(conn, &req, put, deadline).await?;
    let mut recommitted = false;
    loop {
        match reply {
            Response::Done | Response::AlreadyCommitted => return Ok(()),
            Response::Pending => {
                reply = recommit(conn, put, deadline).await?;
                recommitted = true;
            }
            Response::Error { code, message } if recommitted => {
                if let Some(blob) = refused {
                    abort(conn, blob, deadline).await?;
                }
                return Err(Failure::Refused(code, message));
            }
            other => return Err(Failure::unexpected(other)),
        }
    }
}

/// Every copy of `to`, failed for `why`.
pub(crate) fn not_forwarded(to: &[Hop], why: &str) -> Vec<FailedCopy> {
    to.iter()
        .map(|h| FailedCopy {
            unit: h.unit,
            code: ErrorCode::Internal,
            message: why.to_owned(),
        })
        .collect()
}

/// [`Transport::forward_put`] over a connection: a ForwardPut carrying
/// the blob's bytes, answered once this unit committed them and every
/// copy answered.
pub(crate) async fn stream_forward_put(
    conn: &mut Conn,
    put: &BlobPut<'_>,
    to: &[Hop],
    deadline: Instant,
) -> Result<Vec<FailedCopy>, Failure> {
    n_entries(&put.entries)?;
    let req = RequestRef::ForwardPut {
        blob: put.blob,
        partition: put.partition,
        entries: &put.entries,
        timeout_ms: timeout_ms(deadline),
        to,
        hop: 0,
    };
    match send_with_blob(conn, &req, put, deadline).await? {
        Response::Forwarded { pending, failed } => {
            if pending {
                // Durable here later, as a Put's Pending.
                let mut reply = recommit(conn, put, deadline).await?;
                while matches!(reply, Response::Pending) {
                    reply = recommit(conn, put, deadline).await?;
                }
                match reply {
                    Response::Done | Response::AlreadyCommitted => {}
                    Response::Error { code, message } => {
                        return Err(Failure::Refused(code, message))
                    }
                    other => return Err(Failure::unexpected(other)),
                }
            }
            Ok(failed)
        }
        Response::Error { code, message } => Err(Failure::Refused(code, message)),
        other => Err(Failure::unexpected(other)),
    }
}

/// [`Transport::repair_put`] over a connection.
pub(crate) async fn send_repair_put(
    conn: &mut Conn,
    window: u64,
    put: &BlobPut<'_>,
    deadline: Instant,
) -> Result<Response, Failure> {
    n_entries(&put.entries)?;
    let req = RequestRef::RepairPut {
        window,
        blob: put.blob,
        partition: put.partition,
        entries: &put.entries,
        timeout_ms: timeout_ms(deadline),
    };
    send_with_blob(conn, &req, put, deadline).await
}

/// Send `req` with `put`'s bytes as its payload, let the other units'
/// parts run, and take the reply. The bytes may still be on their way
/// when the reply fails to come: failures are in flight.
async fn send_with_blob(
    conn: &mut Conn,
    req: &RequestRef<'_>,
    put: &BlobPut<'_>,
    deadline: Instant,
) -> Result<Response, Failure> {
    let mut payload: Vec<IoSlice<'_>> = put.segments.iter().map(|s| IoSlice::new(s)).collect();
    let id = conn
        .send(req, &mut payload, deadline)
        .map_err(Failure::in_flight)?;
    drop(payload);
    turn().await;
    conn.recv(id, deadline).map_err(Failure::in_flight)
}

/// The blob is not durable yet (Pending): wait a little, commit it again
/// (commit is idempotent) and return the reply.
pub(crate) async fn recommit(
    conn: &mut Conn,
    put: &BlobPut<'_>,
    deadline: Instant,
) -> Result<Response, Failure> {
    let left = crate::conn::remaining(deadline)?;
    pause_until(Instant::now() + PENDING_POLL.min(left)).await;
    let req = RequestRef::Commit {
        blob: put.blob,
        partition: put.partition,
        entries: &put.entries,
    };
    conn.call(&req, deadline).await
}

/// Give up reservation `blob`, and wait for the answer.
pub(crate) async fn abort(conn: &mut Conn, blob: BlobId, deadline: Instant) -> Result<(), Failure> {
    let req = Request::Abort {
        blob,
        in_flight: false,
    };
    conn.call(&req, deadline).await.map(drop)
}

/// The tcp transport. See the module docs.
pub struct TcpTransport {
    conn: Conn,
}

impl TcpTransport {
    pub(crate) fn new(conn: Conn) -> Self {
        Self { conn }
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn instance_id(&self) -> u128 {
        self.conn.instance_id
    }

    fn session(&self) -> u128 {
        self.conn.session
    }

    fn epoch(&self) -> u64 {
        self.conn.epoch
    }

    fn put<'a>(&'a mut self, put: &'a BlobPut<'_>, deadline: Instant) -> Op<'a, ()> {
        Box::pin(stream_put(&mut self.conn, put, deadline, None))
    }

    fn forward_put<'a>(
        &'a mut self,
        put: &'a BlobPut<'_>,
        to: &'a [Hop],
        deadline: Instant,
    ) -> Op<'a, Vec<FailedCopy>> {
        Box::pin(stream_forward_put(&mut self.conn, put, to, deadline))
    }

    fn get<'a>(
        &'a mut self,
        partition: &'a str,
        keys: &'a [Key],
        index_of: &'a [usize],
        sink: &'a SharedSink<'_>,
        deadline: Instant,
    ) -> Op<'a, Missing> {
        Box::pin(async move {
            let (missing, corrupt) =
                read_data(&mut self.conn, partition, keys, index_of, sink, deadline).await??;
            if !corrupt.is_empty() {
                return Err(Failure::Corrupt { positions: corrupt });
            }
            Ok(missing)
        })
    }

    fn call<'a>(&'a mut self, req: &'a Request, deadline: Instant) -> Op<'a, Response> {
        Box::pin(self.conn.call(req, deadline))
    }

    fn call_ref<'a>(&'a mut self, req: &'a RequestRef<'_>, deadline: Instant) -> Op<'a, Response> {
        Box::pin(self.conn.call(req, deadline))
    }

    fn repair_put<'a>(
        &'a mut self,
        window: u64,
        put: &'a BlobPut<'_>,
        deadline: Instant,
    ) -> Op<'a, Response> {
        Box::pin(send_repair_put(&mut self.conn, window, put, deadline))
    }

    fn notify(&mut self, req: &Request, deadline: Instant) -> Result<(), Failure> {
        notify(&mut self.conn, req, deadline)
    }

    fn interrupter(&self) -> Option<Socket> {
        self.conn.keep_open()
    }
}
