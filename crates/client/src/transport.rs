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
//!   without awaiting a reply). A put's commit also reserves a *spare* of
//!   its size class for the connection's next put (`CommitSpare`): a put
//!   that finds a spare of its class copies into it at once and commits,
//!   one round trip in all.
//! * [`TcpTransport`] (any host): put = one Put request carrying the bytes,
//!   which the unit reads straight into its slab; get = one Read request,
//!   whose reply streams the values straight into the caller's buffers.

use std::io::IoSlice;
use std::sync::Arc;
use std::time::Instant;

use stowage_wire::{EntrySpec, Key, PinId};
use stowage_shm::Slab;
use stowage_wire::{ErrorCode, Request, Response};

use crate::conn::{Conn, ConnError};
use crate::nixl::Lent;
use crate::{new_blob_id, BlobPut, SPARES};
use stowage_wire::BlobId;

/// Why one unit's operation failed, before the client classifies it.
#[derive(Debug)]
pub enum OpFailure {
    /// The connection failed. `in_flight`: payload bytes may still be on
    /// their way to the unit.
    Conn { error: ConnFailure, in_flight: bool },
    /// The disk files of some values failed their checks: `positions` in
    /// the operation's key list. The connection is fine.
    Corrupt { positions: Vec<usize> },
    /// The unit answered with an error.
    Unit { code: ErrorCode, message: String },
}

/// A connection-level failure.
#[derive(Debug)]
pub enum ConnFailure {
    Timeout,
    Broken(String),
    Protocol(String),
    /// The unit kept refusing the connection until the deadline (why, the
    /// last time).
    Refusing(String),
}

impl std::fmt::Display for ConnFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnFailure::Timeout => f.write_str("no answer before the deadline"),
            ConnFailure::Broken(m) => write!(f, "connection failed: {m}"),
            ConnFailure::Protocol(m) => write!(f, "protocol error: {m}"),
            ConnFailure::Refusing(m) => write!(f, "the unit kept refusing connections: {m}"),
        }
    }
}

impl OpFailure {
    pub(crate) fn conn(e: ConnError, in_flight: bool) -> Self {
        let error = match e {
            ConnError::Timeout => ConnFailure::Timeout,
            ConnError::Broken(e) => ConnFailure::Broken(e.to_string()),
            ConnError::Protocol(m) => ConnFailure::Protocol(m),
            ConnError::Refused(code, message) => return OpFailure::Unit { code, message },
            ConnError::Refusing(m) => ConnFailure::Refusing(m),
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

    /// The buffers of many values at once, in the order of `asks`
    /// (`(index, len, meta)` as for [`GetSink::slot`], each index at most
    /// once), so that a transport can fill them together on several
    /// threads. `None` (the default): the sink hands out one buffer at a
    /// time through `slot`.
    fn slots(&mut self, asks: &[(usize, u64, &[u8])]) -> Option<Result<Vec<&mut [u8]>, String>> {
        let _ = asks;
        None
    }

    /// Zero-copy gets: whether the sink takes the values of `asks` (as for
    /// [`GetSink::slots`], checked as it would check them) in memory the
    /// transport lends it, filled by the transfer itself (a nixl READ into
    /// the client's registered receive pool). `Some(Ok(()))`: yes, and the
    /// transport then hands them over with [`GetSink::lent`]; `Some(Err)`:
    /// refused, as `slots` refuses; `None` (the default): the sink wants
    /// the values in buffers of its own.
    fn accept_lent(&mut self, asks: &[(usize, u64, &[u8])]) -> Option<Result<(), String>> {
        let _ = asks;
        None
    }

    /// The values `accept_lent` took, in the order of `asks`: value `i`
    /// is `buf[spans[i]]` (64-byte aligned). The sink owns `buf` from now
    /// on; nothing else reads or writes it.
    fn lent(
        &mut self,
        asks: &[(usize, u64, &[u8])],
        buf: Lent,
        spans: &[std::ops::Range<usize>],
    ) -> Result<(), String> {
        let _ = (asks, buf, spans);
        Err("this sink takes no lent memory".into())
    }
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
    /// The session the unit put this connection in.
    fn session(&self) -> u128;

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

/// The time left to `deadline`, as a request tells the unit (at least
/// 1 ms: a transfer the unit cuts off when the caller has given up).
fn timeout_ms(deadline: Instant) -> u64 {
    let left = deadline.saturating_duration_since(Instant::now());
    u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1)
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

/// Take a Data reply's values off the connection into `sink`: the
/// positions of missing and of corrupt keys (outer error: the connection
/// failed; inner error: the sink refused a value, the payload was still
/// read off so the connection stays usable).
fn read_data(
    conn: &mut Conn,
    reply: Response,
    keys: &[Key],
    index_of: &[usize],
    sink: &mut dyn GetSink,
    deadline: Instant,
) -> Result<Result<(Missing, Vec<usize>), OpFailure>, OpFailure> {
    let (items, corrupt) = match reply {
        Response::Data { items, corrupt } if items.len() == keys.len() => (items, corrupt),
        other => return Err(OpFailure::unexpected(other)),
    };
    let corrupt: Vec<usize> = corrupt.into_iter().map(|c| c as usize).collect();
    let mut missing = Vec::new();
    let mut sink_error = None;
    for (i, item) in items.iter().enumerate() {
        let Some(item) = item else {
            if !corrupt.contains(&i) {
                missing.push(i);
            }
            continue;
        };
        let slot = if sink_error.is_none() {
            match sink.slot(index_of[i], item.len, &item.meta) {
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
        }
        .map_err(|e| OpFailure::conn(e, false))?;
    }
    Ok(match sink_error {
        Some(message) => Err(OpFailure::Unit {
            code: ErrorCode::InvalidRequest,
            message,
        }),
        None => Ok((missing, corrupt)),
    })
}

/// The values of a Resolve's answer that are in the unit's memory, as a
/// sink is asked for them: (call-wide index, length, metadata).
fn asks_of<'f>(
    found: &'f [Option<stowage_wire::Found>],
    index_of: &[usize],
) -> Vec<(usize, u64, &'f [u8])> {
    found
        .iter()
        .enumerate()
        .filter_map(|(i, f)| {
            f.as_ref()
                .filter(|l| !l.on_disk)
                .map(|l| (index_of[i], l.len, l.meta.as_slice()))
        })
        .collect()
}

/// How a one-sided transport reaches a unit's slab: the shm transport
/// maps it ([`Slab`]), the nixl transport moves bytes with NIXL
/// ([`crate::nixl::NixlMover`]). Offsets are slab offsets.
pub(crate) trait Mover: Send {
    fn name(&self) -> &'static str;
    /// Copy `segments`, one after another, to `offset`.
    fn write(
        &mut self,
        offset: u64,
        segments: &[&[u8]],
        deadline: Instant,
    ) -> Result<(), OpFailure>;
    /// Bring the values at `ranges` (offset, len) within reach of
    /// [`Mover::read`] (nothing to do when the slab is mapped).
    fn fetch(&mut self, ranges: &[(u64, u64)], deadline: Instant) -> Result<(), OpFailure>;
    /// Whether fetched values can be lent to the caller instead of copied
    /// ([`Mover::take_lent`]): memory of the mover's that the transfer
    /// itself filled.
    fn lends(&self) -> bool {
        false
    }
    /// Start fetching `ranges`: `Ok(true)` when the transfer is still
    /// under way, to end with [`Mover::finish_fetch`]; `Ok(false)` when it
    /// is done (or there was nothing to do). `lend` (only where
    /// [`Mover::lends`]): into memory to lend, one span per range, instead
    /// of within reach of [`Mover::read`].
    fn start_fetch(
        &mut self,
        ranges: &[(u64, u64)],
        lend: bool,
        deadline: Instant,
    ) -> Result<bool, OpFailure> {
        let _ = lend;
        self.fetch(ranges, deadline).map(|()| false)
    }
    /// The memory a finished lending fetch filled, and where each of its
    /// ranges lies in it (in the order of the ranges).
    fn take_lent(&mut self) -> Option<(Lent, Vec<std::ops::Range<usize>>)> {
        None
    }
    /// Wait for the fetch [`Mover::start_fetch`] left under way.
    fn finish_fetch(&mut self, deadline: Instant) -> Result<(), OpFailure> {
        let _ = deadline;
        Ok(())
    }
    /// Copy the (fetched) value at `offset` into `dst`.
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), String>;
    /// Copy many (fetched) values, on several threads where that helps.
    fn read_scatter(&self, reads: Vec<(u64, &mut [u8])>) -> Result<(), String>;
    /// Whether a get of `total` bytes in several values should ask its
    /// sink for every buffer at once.
    fn batch(&self, total: usize) -> bool;
    /// A range is about to be written (a spare): prepare for it.
    fn prepare(&self, offset: u64, len: u64) {
        let _ = (offset, len);
    }
    fn slab(&self) -> Option<Arc<Slab>> {
        None
    }
    /// A transfer that failed while it may still be running: the caller
    /// keeps the connection open (and with it the ranges it holds) until
    /// it has ended.
    fn take_pending(&mut self) -> Option<Box<dyn Settle>> {
        None
    }
}

/// A transfer that may still be running.
pub(crate) trait Settle: Send {
    /// Whether it has ended (completed or failed).
    fn settled(&mut self) -> bool;
}

impl Mover for Arc<Slab> {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn write(
        &mut self,
        offset: u64,
        segments: &[&[u8]],
        _deadline: Instant,
    ) -> Result<(), OpFailure> {
        self.write_gather(offset, segments)
            .map_err(|e| OpFailure::conn(ConnError::Protocol(e.to_string()), false))
    }

    fn fetch(&mut self, _ranges: &[(u64, u64)], _deadline: Instant) -> Result<(), OpFailure> {
        Ok(())
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
        Slab::read(self, offset, dst).map_err(|e| e.to_string())
    }

    fn read_scatter(&self, reads: Vec<(u64, &mut [u8])>) -> Result<(), String> {
        Slab::read_scatter(self, reads).map_err(|e| e.to_string())
    }

    fn batch(&self, total: usize) -> bool {
        stowage_shm::copy_threads(total) > 1
    }

    fn prepare(&self, offset: u64, len: u64) {
        Slab::prepare(self, offset, len);
    }

    fn slab(&self) -> Option<Arc<Slab>> {
        Some(self.clone())
    }
}

/// The shm transport. See the module docs.
pub(crate) type ShmTransport = OneSided<Arc<Slab>>;

/// A transport that moves bytes itself between the caller's memory and
/// the unit's slab (shm, nixl): put = Alloc (or a spare) → write → Commit;
/// get = Resolve (pins) → read → Unpin.
pub(crate) struct OneSided<M: Mover> {
    conn: Conn,
    mover: M,
    awaiting: Option<u64>,
    put_state: PutState,
    /// The partition of the get in progress.
    get_partition: String,
    /// Reservations this connection holds for its next puts, oldest first.
    spares: Vec<Spare>,
    /// Puts up to this size use and keep spares (0: never).
    spare_max: u64,
    /// The blob the put in progress commits: its own, or a spare's.
    committing: BlobId,
    /// A get whose values are being fetched (a READ under way): what its
    /// Resolve answered, and whether the values are fetched to be lent.
    reading: Option<(Resolved, bool)>,
    /// The spare its CommitSpare asked for: (blob, bytes).
    asked: Option<(BlobId, u64)>,
}

/// A Resolve's answer: the pin, each key's value (if found), the corrupt
/// keys' positions.
type Resolved = (Option<PinId>, Vec<Option<stowage_wire::Found>>, Vec<u32>);

/// A spare reservation ([`Request::CommitSpare`]) held by one connection.
#[derive(Clone, Copy, Debug)]
struct Spare {
    blob: BlobId,
    offset: u64,
    len: u64,
}

/// The size class whose spares a put of `n` bytes uses: powers of two up
/// to 4 KiB, then eight classes per doubling (at most 1/8 of a spare goes
/// unused).
pub(crate) fn spare_class(n: u64) -> u64 {
    if n <= 4096 {
        return n.next_power_of_two().max(64);
    }
    let step = 1u64 << (63 - n.leading_zeros() - 3);
    n.div_ceil(step) * step
}

/// Where a put stands on one connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PutState {
    Idle,
    /// Awaiting the Alloc reply (shm).
    Allocating,
    /// Awaiting the reply to a Put that carries the bytes.
    Streaming,
    /// Awaiting the reply to a Commit.
    Committing,
}

/// How often a put whose blob goes to disk asks whether it is durable.
pub const PENDING_POLL: std::time::Duration = std::time::Duration::from_millis(10);

/// Send a Put carrying the blob's bytes (the unit reads them into its slab
/// or its disk tier).
fn send_stream(conn: &mut Conn, put: &BlobPut<'_>, deadline: Instant) -> Result<u64, OpFailure> {
    n_entries(&put.entries)?;
    let req = Request::Put {
        blob: put.blob,
        partition: put.partition.to_owned(),
        entries: put.entries.clone(),
        timeout_ms: timeout_ms(deadline),
    };
    let mut payload: Vec<IoSlice<'_>> = put.segments.iter().map(|s| IoSlice::new(s)).collect();
    conn.send(&req, &mut payload, deadline)
        .map_err(|e| OpFailure::conn(e, true))
}

/// Commit `blob` (the put's own, or the spare it was written into).
fn send_commit(
    conn: &mut Conn,
    put: &BlobPut<'_>,
    blob: BlobId,
    deadline: Instant,
) -> Result<u64, OpFailure> {
    let req = Request::Commit {
        blob,
        partition: put.partition.to_owned(),
        entries: put.entries.clone(),
    };
    conn.send(&req, &mut [], deadline)
        .map_err(|e| OpFailure::conn(e, false))
}

/// The reply to a Put or Commit: `Ok(true)` when published; on Pending,
/// wait a little and commit again (commit is idempotent).
fn after_commit_reply(
    conn: &mut Conn,
    state: &mut PutState,
    awaiting: &mut Option<u64>,
    put: &BlobPut<'_>,
    reply: Response,
    deadline: Instant,
) -> Result<bool, OpFailure> {
    match reply {
        Response::Done | Response::AlreadyCommitted => {
            *state = PutState::Idle;
            Ok(true)
        }
        Response::Pending => {
            let left = crate::conn::remaining(deadline).map_err(|e| OpFailure::conn(e, false))?;
            std::thread::sleep(PENDING_POLL.min(left));
            *awaiting = Some(send_commit(conn, put, put.blob, deadline)?);
            *state = PutState::Committing;
            Ok(false)
        }
        other => {
            *state = PutState::Idle;
            Err(OpFailure::unexpected(other))
        }
    }
}

impl ShmTransport {
    pub(crate) fn new(conn: Conn, spare_max: u64) -> Option<Self> {
        let slab = conn.slab.clone()?;
        Some(OneSided::with_mover(conn, slab, spare_max))
    }
}

impl<M: Mover> OneSided<M> {
    pub(crate) fn with_mover(conn: Conn, mover: M, spare_max: u64) -> Self {
        Self {
            conn,
            mover,
            awaiting: None,
            put_state: PutState::Idle,
            get_partition: String::new(),
            spares: Vec::new(),
            spare_max,
            committing: BlobId(0),
            asked: None,
            reading: None,
        }
    }

    /// Copy the put's segments into the slab at `offset` (over shm split
    /// over threads when they are large in all, however small each one is;
    /// over nixl one WRITE).
    fn write_segments(
        &mut self,
        put: &BlobPut<'_>,
        offset: u64,
        deadline: Instant,
    ) -> Result<(), OpFailure> {
        self.mover.write(offset, &put.segments, deadline)
    }

    /// Commit the put (its bytes are in reservation `written`: its own, or
    /// a spare's); ask for a spare of the put's class when its size calls
    /// for one.
    fn commit(
        &mut self,
        put: &BlobPut<'_>,
        written: BlobId,
        deadline: Instant,
    ) -> Result<(), OpFailure> {
        self.committing = written;
        let n = total_len(put);
        self.asked = None;
        let id = if n > 0 && n <= self.spare_max {
            let spare = (new_blob_id(), spare_class(n));
            self.asked = Some(spare);
            let req = Request::CommitSpare {
                blob: put.blob,
                written,
                partition: put.partition.to_owned(),
                entries: put.entries.clone(),
                spare: spare.0,
                spare_nbytes: spare.1,
            };
            self.conn
                .send(&req, &mut [], deadline)
                .map_err(|e| OpFailure::conn(e, false))?
        } else {
            debug_assert_eq!(written, put.blob, "only CommitSpare commits a spare");
            send_commit(&mut self.conn, put, put.blob, deadline)?
        };
        self.awaiting = Some(id);
        self.put_state = PutState::Committing;
        Ok(())
    }

    /// Keep the spare the unit reserved: fill its page tables now (one
    /// call, instead of a fault per page in the next put), and give back
    /// the oldest past [`SPARES`].
    fn keep_spare(&mut self, offset: u64, deadline: Instant) -> Result<(), OpFailure> {
        let Some((blob, len)) = self.asked.take() else {
            return Ok(());
        };
        self.mover.prepare(offset, len);
        self.spares.push(Spare { blob, offset, len });
        if self.spares.len() > SPARES {
            let old = self.spares.remove(0);
            self.abort(old.blob, deadline)?;
        }
        Ok(())
    }

    /// Give up a reservation this connection holds, and wait for the answer.
    fn abort(&mut self, blob: BlobId, deadline: Instant) -> Result<(), OpFailure> {
        self.send(
            &Request::Abort {
                blob,
                in_flight: false,
            },
            deadline,
        )?;
        self.recv(deadline)?;
        Ok(())
    }

    /// Give every spare back (the unit is short of memory).
    fn clear_spares(&mut self, deadline: Instant) -> Result<(), OpFailure> {
        while let Some(s) = self.spares.pop() {
            self.abort(s.blob, deadline)?;
        }
        Ok(())
    }

    fn send_alloc(&mut self, put: &BlobPut<'_>, deadline: Instant) -> Result<(), OpFailure> {
        let req = Request::Alloc {
            blob: put.blob,
            nbytes: total_len(put),
            n_entries: n_entries(&put.entries)?,
        };
        self.send(&req, deadline)?;
        self.put_state = PutState::Allocating;
        Ok(())
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

impl<M: Mover> Transport for OneSided<M> {
    fn name(&self) -> &'static str {
        self.mover.name()
    }

    fn instance_id(&self) -> u128 {
        self.conn.instance_id
    }

    fn session(&self) -> u128 {
        self.conn.session
    }

    fn start_put(&mut self, put: &BlobPut<'_>, deadline: Instant) -> Result<(), OpFailure> {
        n_entries(&put.entries)?;
        let n = total_len(put);
        if n > 0 && n <= self.spare_max {
            let class = spare_class(n);
            if let Some(i) = self.spares.iter().position(|s| s.len == class) {
                // This connection holds the spare's reservation: write,
                // then one round trip to publish it.
                let spare = self.spares.remove(i);
                self.write_segments(put, spare.offset, deadline)?;
                return self.commit(put, spare.blob, deadline);
            }
        }
        self.send_alloc(put, deadline)
    }

    fn advance_put(&mut self, put: &BlobPut<'_>, deadline: Instant) -> Result<bool, OpFailure> {
        match self.put_state {
            PutState::Idle => Ok(true),
            PutState::Allocating => match self.recv(deadline)? {
                Response::Allocated { offset } => {
                    self.write_segments(put, offset, deadline)?;
                    self.commit(put, put.blob, deadline)?;
                    Ok(false)
                }
                // Short of memory while this connection holds spares:
                // give them back and ask again.
                Response::Error {
                    code: ErrorCode::Full | ErrorCode::Busy,
                    ..
                } if !self.spares.is_empty() => {
                    self.clear_spares(deadline)?;
                    self.send_alloc(put, deadline)?;
                    Ok(false)
                }
                // No room in the slab, room on disk: send the bytes along.
                Response::ToDisk => {
                    self.awaiting = Some(send_stream(&mut self.conn, put, deadline)?);
                    self.put_state = PutState::Streaming;
                    Ok(false)
                }
                Response::AlreadyCommitted => {
                    self.put_state = PutState::Idle;
                    Ok(true)
                }
                other => {
                    self.put_state = PutState::Idle;
                    Err(OpFailure::unexpected(other))
                }
            },
            PutState::Streaming | PutState::Committing => {
                // A Put's bytes may still be on their way when its reply
                // fails to come (as over tcp).
                let in_flight = self.put_state == PutState::Streaming;
                let id = self.awaiting.take().unwrap_or(0);
                let reply = self
                    .conn
                    .recv(id, deadline)
                    .map_err(|e| OpFailure::conn(e, in_flight))?;
                if self.put_state == PutState::Committing {
                    match reply {
                        Response::Error { code, message } => {
                            // The commit was refused (e.g. the index is
                            // full): give the reservation back rather than
                            // hold it for as long as this connection lives.
                            // (A spare may have taken the put's id before
                            // the refusal: give up both.)
                            self.put_state = PutState::Idle;
                            self.asked = None;
                            self.abort(put.blob, deadline)?;
                            if self.committing != put.blob {
                                self.abort(self.committing, deadline)?;
                            }
                            return Err(OpFailure::Unit { code, message });
                        }
                        Response::CommittedSpare { spare } => {
                            self.put_state = PutState::Idle;
                            match spare {
                                Some(offset) => self.keep_spare(offset, deadline)?,
                                None => self.asked = None,
                            }
                            return Ok(true);
                        }
                        _ => {}
                    }
                }
                after_commit_reply(
                    &mut self.conn,
                    &mut self.put_state,
                    &mut self.awaiting,
                    put,
                    reply,
                    deadline,
                )
            }
        }
    }

    fn start_get(
        &mut self,
        partition: &str,
        keys: &[Key],
        deadline: Instant,
    ) -> Result<(), OpFailure> {
        self.get_partition = partition.to_owned();
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
        let in_memory_ranges = |found: &[Option<stowage_wire::Found>]| -> Vec<(u64, u64)> {
            found
                .iter()
                .flatten()
                .filter(|l| !l.on_disk)
                .map(|l| (l.offset, l.len))
                .collect()
        };
        let mut result = Ok(());
        // Over nixl: one READ of every value, into memory lent to the
        // sink when it takes that (zero-copy), else into the staging
        // buffer; left under way while the other units start theirs.
        // Failing, the connection goes: its end unpins (or, if the READ may
        // still be running, the connection stays open until it has ended,
        // and the READ keeps its buffer).
        let (pin, found, corrupt, ranges, lend) = match self.reading.take() {
            Some(((pin, found, corrupt), lend)) => {
                self.mover.finish_fetch(deadline)?;
                let ranges = in_memory_ranges(&found);
                (pin, found, corrupt, ranges, lend)
            }
            None => {
                let (pin, found, corrupt) = match self.recv(deadline)? {
                    Response::Resolved {
                        pin,
                        found,
                        corrupt,
                    } if found.len() == keys.len() => (pin, found, corrupt),
                    other => return Err(OpFailure::unexpected(other)),
                };
                let ranges = in_memory_ranges(&found);
                let mut lend = false;
                if !ranges.is_empty() && self.mover.lends() {
                    match sink.accept_lent(&asks_of(&found, index_of)) {
                        Some(Ok(())) => lend = true,
                        Some(Err(message)) => {
                            result = Err(OpFailure::Unit {
                                code: ErrorCode::InvalidRequest,
                                message,
                            })
                        }
                        None => {}
                    }
                }
                if result.is_ok() && self.mover.start_fetch(&ranges, lend, deadline)? {
                    self.reading = Some(((pin, found, corrupt), lend));
                    return Ok(None);
                }
                (pin, found, corrupt, ranges, lend)
            }
        };
        let mut corrupt: Vec<usize> = corrupt.into_iter().map(|c| c as usize).collect();
        let mut missing = Vec::new();
        let mut on_disk = Vec::new();
        // Many values, large in all: ask the sink for all their buffers
        // and fill them together on the cores (one by one otherwise).
        let in_memory = || found.iter().flatten().filter(|l| !l.on_disk);
        let batched = ranges.len() > 1
            && self
                .mover
                .batch(ranges.iter().map(|&(_, len)| len as usize).sum());
        let mut copied_all = result.is_err();
        if lend && result.is_ok() {
            let asks = asks_of(&found, index_of);
            let handed = match self.mover.take_lent() {
                Some((buf, spans)) => sink.lent(&asks, buf, &spans),
                None => Err("the fetched values were not kept".into()),
            };
            if let Err(message) = handed {
                result = Err(OpFailure::Unit {
                    code: ErrorCode::InvalidRequest,
                    message,
                });
            }
            copied_all = true;
        } else if batched && result.is_ok() {
            let asks = asks_of(&found, index_of);
            match sink.slots(&asks) {
                Some(Ok(bufs)) => {
                    let reads: Vec<(u64, &mut [u8])> =
                        in_memory().map(|l| l.offset).zip(bufs).collect();
                    if let Err(message) = self.mover.read_scatter(reads) {
                        result = Err(OpFailure::Unit {
                            code: ErrorCode::InvalidRequest,
                            message,
                        });
                    }
                    copied_all = true;
                }
                Some(Err(m)) => {
                    result = Err(OpFailure::Unit {
                        code: ErrorCode::InvalidRequest,
                        message: m,
                    });
                    copied_all = true;
                }
                None => {}
            }
        }
        for (i, f) in found.iter().enumerate() {
            match f {
                None if corrupt.contains(&i) => {}
                None => missing.push(i),
                Some(l) if l.on_disk => on_disk.push(i),
                Some(_) if copied_all => {}
                Some(l) => {
                    let copied = sink
                        .slot(index_of[i], l.len, &l.meta)
                        .and_then(|dst| self.mover.read(l.offset, dst));
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
        // Values only on the unit's disk (no room to bring them back into
        // the slab): one streamed read, while the pin holds their blobs.
        if result.is_ok() && !on_disk.is_empty() {
            let disk_keys: Vec<Key> = on_disk.iter().map(|&i| keys[i].clone()).collect();
            let disk_index: Vec<usize> = on_disk.iter().map(|&i| index_of[i]).collect();
            let req = Request::Read {
                partition: std::mem::take(&mut self.get_partition),
                keys: disk_keys.clone(),
                timeout_ms: timeout_ms(deadline),
            };
            self.send(&req, deadline)?;
            let reply = self.recv(deadline)?;
            match read_data(
                &mut self.conn,
                reply,
                &disk_keys,
                &disk_index,
                sink,
                deadline,
            )? {
                Ok((miss, bad)) => {
                    missing.extend(miss.into_iter().map(|j| on_disk[j]));
                    corrupt.extend(bad.into_iter().map(|j| on_disk[j]));
                }
                Err(f) => result = Err(f),
            }
        }
        if let Some(pin) = pin {
            self.unpin(pin, deadline)?;
        }
        result?;
        if !corrupt.is_empty() {
            return Err(OpFailure::Corrupt { positions: corrupt });
        }
        Ok(Some(missing))
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
        self.mover.slab()
    }
}

impl<M: Mover> Drop for OneSided<M> {
    fn drop(&mut self) {
        // A transfer that failed while it may still be running: the unit
        // must not reuse what this connection holds until it has ended, so
        // the connection stays open (another handle on its socket) until
        // then: held by a thread that polls the transfer.
        let Some(mut pending) = self.mover.take_pending() else {
            return;
        };
        let keep = self.conn.keep_open();
        let spawned = std::thread::Builder::new()
            .name("stowage-settle".into())
            .spawn(move || {
                while !pending.settled() {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                drop(keep);
            });
        if let Err(e) = spawned {
            // No thread: keep the socket open for the process's life.
            tracing::warn!(error = %e, "cannot start a thread to wait out a transfer; its connection stays open");
            std::mem::forget(self.conn.keep_open());
        }
    }
}

impl<M: Mover> OneSided<M> {
    fn unpin(&mut self, pin: PinId, deadline: Instant) -> Result<(), OpFailure> {
        // No reply: an unpin lost with its connection is covered by the
        // connection's end, which releases what it held.
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
    put_state: PutState,
}

impl TcpTransport {
    pub(crate) fn new(conn: Conn) -> Self {
        Self {
            conn,
            awaiting: None,
            put_state: PutState::Idle,
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

    fn session(&self) -> u128 {
        self.conn.session
    }

    fn start_put(&mut self, put: &BlobPut<'_>, deadline: Instant) -> Result<(), OpFailure> {
        self.awaiting = Some(send_stream(&mut self.conn, put, deadline)?);
        self.put_state = PutState::Streaming;
        Ok(())
    }

    fn advance_put(&mut self, put: &BlobPut<'_>, deadline: Instant) -> Result<bool, OpFailure> {
        if self.put_state == PutState::Idle {
            return Ok(true);
        }
        let in_flight = self.put_state == PutState::Streaming;
        let reply = self.recv(deadline, in_flight)?;
        after_commit_reply(
            &mut self.conn,
            &mut self.put_state,
            &mut self.awaiting,
            put,
            reply,
            deadline,
        )
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
            timeout_ms: timeout_ms(deadline),
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
        let reply = self.recv(deadline, false)?;
        let (missing, corrupt) = read_data(&mut self.conn, reply, keys, index_of, sink, deadline)??;
        if !corrupt.is_empty() {
            return Err(OpFailure::Corrupt { positions: corrupt });
        }
        Ok(Some(missing))
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
