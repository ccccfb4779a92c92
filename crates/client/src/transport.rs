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
use stowage_wire::BlobId;
use stowage_wire::{EntrySpec, ErrorCode, Key, PinId, Request, Response};

use crate::conn::Conn;
use crate::failure::Failure;
use crate::fanout::{pause_until, turn};
use crate::nixl::Lent;
use crate::pieces::{check_found, check_pieces, ranges_of, scatter, split_dst, PieceWrite, Places};
use crate::sink::{GetSink, ValueAsk};
use crate::{new_blob_id, BlobPut, SPARES};

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

    /// Write one blob; ends once it is committed (published).
    fn put<'a>(&'a mut self, put: &'a BlobPut<'_>, deadline: Instant) -> Op<'a, ()>;

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

    /// Send a request the unit does not answer (an Unpin with
    /// `reply: false`).
    fn notify(&mut self, req: &Request, deadline: Instant) -> Result<(), Failure>;

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

fn n_entries(entries: &[EntrySpec]) -> Result<u32, Failure> {
    u32::try_from(entries.len()).map_err(|_| Failure::invalid("more than 2^32 entries in one blob"))
}

/// Send `req` (no payload), let the other units' parts run, and take its
/// reply.
async fn call(conn: &mut Conn, req: &Request, deadline: Instant) -> Result<Response, Failure> {
    conn.call(req, deadline).await
}

/// Send `req` without awaiting a reply (the unit sends none).
fn notify(conn: &mut Conn, req: &Request, deadline: Instant) -> Result<(), Failure> {
    conn.send(req, &mut [], deadline)?;
    Ok(())
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
    sink: &SharedSink<'_>,
    deadline: Instant,
) -> Result<Result<(Missing, Vec<usize>), Failure>, Failure> {
    let (items, corrupt) = match reply {
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
fn asks_of<'f>(found: &'f [Option<stowage_wire::Found>], index_of: &[usize]) -> Vec<ValueAsk<'f>> {
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
async fn stream_put(
    conn: &mut Conn,
    put: &BlobPut<'_>,
    deadline: Instant,
    refused: Option<BlobId>,
) -> Result<(), Failure> {
    n_entries(&put.entries)?;
    let req = Request::Put {
        blob: put.blob,
        partition: put.partition.to_owned(),
        entries: put.entries.clone(),
        timeout_ms: timeout_ms(deadline),
    };
    let mut payload: Vec<IoSlice<'_>> = put.segments.iter().map(|s| IoSlice::new(s)).collect();
    let id = conn
        .send(&req, &mut payload, deadline)
        .map_err(Failure::in_flight)?;
    drop(payload);
    turn().await;
    // The Put's bytes may still be on their way when its reply fails to
    // come.
    let mut reply = conn.recv(id, deadline).map_err(Failure::in_flight)?;
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

/// The blob is not durable yet (Pending): wait a little, commit it again
/// (commit is idempotent) and return the reply.
async fn recommit(
    conn: &mut Conn,
    put: &BlobPut<'_>,
    deadline: Instant,
) -> Result<Response, Failure> {
    let left = crate::conn::remaining(deadline)?;
    pause_until(Instant::now() + PENDING_POLL.min(left)).await;
    let req = Request::Commit {
        blob: put.blob,
        partition: put.partition.to_owned(),
        entries: put.entries.clone(),
    };
    call(conn, &req, deadline).await
}

/// Give up reservation `blob`, and wait for the answer.
async fn abort(conn: &mut Conn, blob: BlobId, deadline: Instant) -> Result<(), Failure> {
    let req = Request::Abort {
        blob,
        in_flight: false,
    };
    call(conn, &req, deadline).await.map(drop)
}

/// How a one-sided transport reaches a unit's slab: the shm transport
/// maps it ([`Slab`]), the nixl transport moves bytes with NIXL
/// ([`crate::nixl::NixlMover`]). Offsets are slab offsets.
pub(crate) trait Mover: Send {
    fn name(&self) -> &'static str;
    /// Copy each piece's segments, one after another, to the piece's
    /// offset (a put's bytes scattered over its blob's pieces,
    /// [`crate::pieces::scatter`]; checked against the slab before).
    fn write(&mut self, writes: &[PieceWrite<'_>], deadline: Instant) -> Result<(), Failure>;
    /// Start bringing the values at `places` within reach of
    /// [`Mover::read`] (nothing to do when the slab is mapped): every
    /// range of every value (a split value's parts are ranges of their
    /// own). `Ok(true)` when the transfer is still under way, to end with
    /// [`Mover::finish_fetch`]; `Ok(false)` when it is done (or there was
    /// nothing to do). `lend` (only where [`Mover::lends`]): into memory
    /// to lend instead ([`Mover::take_lent`]), one span per value (a
    /// split value's parts back to back in it).
    fn start_fetch(&mut self, places: &Places, lend: bool) -> Result<bool, Failure> {
        let _ = (places, lend);
        Ok(false)
    }
    /// Wait for the fetch [`Mover::start_fetch`] left under way.
    fn finish_fetch(&mut self, deadline: Instant) -> Result<(), Failure> {
        let _ = deadline;
        Ok(())
    }
    /// Whether fetched values can be lent to the caller instead of copied
    /// ([`Mover::take_lent`]): memory of the mover's that the transfer
    /// itself filled.
    fn lends(&self) -> bool {
        false
    }
    /// The memory a finished lending fetch filled, and where each of its
    /// values lies in it (in the order of the values).
    fn take_lent(&mut self) -> Option<(Lent, Vec<std::ops::Range<usize>>)> {
        None
    }
    /// Copy the (fetched) range at `offset` into `dst` (a value in one
    /// range, or one part of a split value).
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), String>;
    /// Copy many (fetched) ranges, on several threads where that helps.
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

    fn write(&mut self, writes: &[PieceWrite<'_>], _deadline: Instant) -> Result<(), Failure> {
        for (offset, segments) in writes {
            self.write_gather(*offset, segments)
                .map_err(|e| Failure::protocol(e.to_string()))?;
        }
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
    /// Reservations this connection holds for its next puts, oldest first.
    spares: Vec<Spare>,
    /// Puts up to this size use and keep spares (0: never).
    spare_max: u64,
    /// The slab's length (from Hello): every range the unit names is
    /// checked against it before a byte moves.
    slab_len: u64,
}

/// A Resolve's answer: the pin, each key's value (if found), the corrupt
/// keys' positions, whether the unit asks for spares back.
type Resolved = (
    Option<PinId>,
    Vec<Option<stowage_wire::Found>>,
    Vec<u32>,
    bool,
);

/// Copy one (fetched) value, in one range or in parts (`ranges`, checked
/// to add up to its length), into `dst`.
fn read_value<M: Mover>(mover: &M, ranges: &[(u64, u64)], dst: &mut [u8]) -> Result<(), String> {
    match ranges {
        [(offset, _)] => mover.read(*offset, dst),
        parts => split_dst(dst, parts)?
            .into_iter()
            .try_for_each(|(offset, d)| mover.read(offset, d)),
    }
}

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

impl ShmTransport {
    pub(crate) fn new(conn: Conn, spare_max: u64) -> Option<Self> {
        let slab = conn.slab.clone()?;
        Some(OneSided::with_mover(conn, slab, spare_max))
    }
}

impl<M: Mover> OneSided<M> {
    pub(crate) fn with_mover(conn: Conn, mover: M, spare_max: u64) -> Self {
        let slab_len = conn.slab_bytes;
        Self {
            conn,
            mover,
            spares: Vec::new(),
            spare_max,
            slab_len,
        }
    }

    /// Whether a put of `n` bytes uses and keeps spares.
    fn spares_for(&self, n: u64) -> bool {
        n > 0 && n <= self.spare_max
    }

    /// Commit the put, whose bytes are in reservation `written` (its own,
    /// or a spare's), and await until it is published; ask for a spare of
    /// the put's class when its size calls for one.
    async fn commit(
        &mut self,
        put: &BlobPut<'_>,
        written: BlobId,
        deadline: Instant,
    ) -> Result<(), Failure> {
        let n = total_len(put);
        let asked = self.spares_for(n).then(|| (new_blob_id(), spare_class(n)));
        let req = match asked {
            Some((spare, spare_nbytes)) => Request::CommitSpare {
                blob: put.blob,
                written,
                partition: put.partition.to_owned(),
                entries: put.entries.clone(),
                spare,
                spare_nbytes,
            },
            None => {
                debug_assert_eq!(written, put.blob, "only CommitSpare commits a spare");
                Request::Commit {
                    blob: put.blob,
                    partition: put.partition.to_owned(),
                    entries: put.entries.clone(),
                }
            }
        };
        let mut reply = call(&mut self.conn, &req, deadline).await?;
        loop {
            match reply {
                Response::Done | Response::AlreadyCommitted => return Ok(()),
                Response::CommittedSpare { spare, spares_back } => {
                    if let (Some(offset), Some((blob, len))) = (spare, asked) {
                        let spare = Spare { blob, offset, len };
                        if spares_back {
                            // Short of memory: not kept (the unit should
                            // not have reserved it then).
                            abort(&mut self.conn, blob, deadline).await?;
                        } else {
                            self.keep_spare(spare, deadline).await?;
                        }
                    }
                    if spares_back {
                        self.clear_spares(deadline).await?;
                    }
                    return Ok(());
                }
                Response::Pending => reply = recommit(&mut self.conn, put, deadline).await?,
                Response::Error { code, message } => {
                    // The commit was refused (e.g. the index is full):
                    // give the reservation back rather than hold it for as
                    // long as this connection lives. (A spare may have
                    // taken the put's id before the refusal: give up both.)
                    abort(&mut self.conn, put.blob, deadline).await?;
                    if written != put.blob {
                        abort(&mut self.conn, written, deadline).await?;
                    }
                    return Err(Failure::Refused(code, message));
                }
                other => return Err(Failure::unexpected(other)),
            }
        }
    }

    /// Keep the spare the unit reserved: fill its page tables now (one
    /// call, instead of a fault per page in the next put), and give back
    /// the oldest past [`SPARES`].
    async fn keep_spare(&mut self, spare: Spare, deadline: Instant) -> Result<(), Failure> {
        check_pieces(&[(spare.offset, spare.len)], spare.len, self.slab_len)
            .map_err(|m| Failure::protocol(format!("spare: {m}")))?;
        self.mover.prepare(spare.offset, spare.len);
        self.spares.push(spare);
        if self.spares.len() > SPARES {
            let old = self.spares.remove(0);
            abort(&mut self.conn, old.blob, deadline).await?;
        }
        Ok(())
    }

    /// Give every spare back (the unit is short of memory: it said so with
    /// `spares_back`, or refused an Alloc while this connection held
    /// spares).
    async fn clear_spares(&mut self, deadline: Instant) -> Result<(), Failure> {
        while let Some(s) = self.spares.pop() {
            abort(&mut self.conn, s.blob, deadline).await?;
        }
        Ok(())
    }

    /// Copy out what a Resolve found, into `sink`: the values in the
    /// unit's memory through the mover, those only on its disk with one
    /// streamed Read (while the pin holds their blobs). The missing and
    /// the corrupt keys' positions (outer error: the connection failed;
    /// inner error: the sink refused, the connection is still usable).
    #[allow(clippy::too_many_arguments)]
    async fn copy_out(
        &mut self,
        partition: &str,
        keys: &[Key],
        index_of: &[usize],
        found: &[Option<stowage_wire::Found>],
        mut corrupt: Vec<usize>,
        sink: &SharedSink<'_>,
        deadline: Instant,
    ) -> Result<Result<(Missing, Vec<usize>), Failure>, Failure> {
        let in_memory = || found.iter().flatten().filter(|l| !l.on_disk);
        // Each value's ranges: one, or the parts of a value split across
        // pieces of the slab (its bytes are the parts back to back).
        let mut places = Places::default();
        in_memory().for_each(|l| places.push(l));
        // Over nixl: one READ of every value, into memory lent to the sink
        // when it takes that (zero-copy), else into the staging buffer.
        // Failing, the connection goes: its end unpins (or, if the READ
        // may still be running, the connection stays open until it has
        // ended, and the READ keeps its buffer).
        let mut lend = false;
        if !places.is_empty() && self.mover.lends() {
            let accepted = sink.borrow_mut().accept_lent(&asks_of(found, index_of));
            match accepted {
                Some(Ok(())) => lend = true,
                Some(Err(message)) => return Ok(Err(Failure::invalid(message))),
                None => {}
            }
        }
        // Left under way while the other units start theirs.
        if self.mover.start_fetch(&places, lend)? {
            turn().await;
            self.mover.finish_fetch(deadline)?;
        }
        let mut missing = Vec::new();
        let mut on_disk = Vec::new();
        {
            let mut sink = sink.borrow_mut();
            let refused = |m: String| Ok(Err(Failure::invalid(m)));
            // Many values, large in all: ask the sink for all their
            // buffers and fill them together on the cores (one by one
            // otherwise).
            let batched = places.len() > 1
                && self
                    .mover
                    .batch(usize::try_from(places.total()).unwrap_or(usize::MAX));
            let mut copied_all = false;
            if lend {
                let asks = asks_of(found, index_of);
                let handed = match self.mover.take_lent() {
                    Some((buf, spans)) => sink.lent(&asks, buf, &spans),
                    None => Err("the fetched values were not kept".into()),
                };
                if let Err(m) = handed {
                    return refused(m);
                }
                copied_all = true;
            } else if batched {
                let asks = asks_of(found, index_of);
                match sink.slots(&asks) {
                    Some(Ok(bufs)) => {
                        // One read per range: a split value's buffer cut
                        // into one sub-slice per part.
                        let mut reads: Vec<(u64, &mut [u8])> =
                            Vec::with_capacity(places.ranges().len());
                        for (ranges, buf) in places.values().zip(bufs) {
                            if let [(offset, _)] = ranges {
                                reads.push((*offset, buf));
                                continue;
                            }
                            match split_dst(buf, ranges) {
                                Ok(parts) => reads.extend(parts),
                                Err(m) => return refused(m),
                            }
                        }
                        if let Err(m) = self.mover.read_scatter(reads) {
                            return refused(m);
                        }
                        copied_all = true;
                    }
                    Some(Err(m)) => return refused(m),
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
                        let ask = ValueAsk {
                            index: index_of[i],
                            len: l.len,
                            meta: &l.meta,
                        };
                        let copied = sink
                            .slot(ask)
                            .and_then(|dst| read_value(&self.mover, &ranges_of(l), dst));
                        if let Err(m) = copied {
                            return refused(m);
                        }
                    }
                }
            }
        }
        // Values only on the unit's disk (no room to bring them back into
        // the slab): one streamed read, while the pin holds their blobs.
        if !on_disk.is_empty() {
            let disk_keys: Vec<Key> = on_disk.iter().map(|&i| keys[i].clone()).collect();
            let disk_index: Vec<usize> = on_disk.iter().map(|&i| index_of[i]).collect();
            let req = Request::Read {
                partition: partition.to_owned(),
                keys: disk_keys.clone(),
                timeout_ms: timeout_ms(deadline),
            };
            let reply = call(&mut self.conn, &req, deadline).await?;
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
                Err(f) => return Ok(Err(f)),
            }
        }
        Ok(Ok((missing, corrupt)))
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

    fn put<'a>(&'a mut self, put: &'a BlobPut<'_>, deadline: Instant) -> Op<'a, ()> {
        Box::pin(async move {
            let n_entries = n_entries(&put.entries)?;
            let n = total_len(put);
            if self.spares_for(n) {
                let class = spare_class(n);
                if let Some(i) = self.spares.iter().position(|s| s.len == class) {
                    // This connection holds the spare's reservation: write,
                    // then one round trip to publish it.
                    let spare = self.spares.remove(i);
                    // One range, checked when it was kept (its class holds
                    // the put).
                    self.mover
                        .write(&[(spare.offset, put.segments.clone())], deadline)?;
                    return self.commit(put, spare.blob, deadline).await;
                }
            }
            let alloc = Request::Alloc {
                blob: put.blob,
                nbytes: n,
                n_entries,
            };
            loop {
                match call(&mut self.conn, &alloc, deadline).await? {
                    Response::Allocated {
                        pieces,
                        spares_back,
                    } => {
                        // Never a byte outside the slab, nor a blob the
                        // pieces do not hold: the connection goes (and
                        // with it the reservation).
                        let writes = check_pieces(&pieces, n, self.slab_len)
                            .and_then(|()| scatter(&put.segments, &pieces))
                            .map_err(|m| Failure::protocol(format!("Allocated: {m}")))?;
                        if spares_back {
                            self.clear_spares(deadline).await?;
                        }
                        self.mover.write(&writes, deadline)?;
                        return self.commit(put, put.blob, deadline).await;
                    }
                    // Short of memory while this connection holds spares:
                    // give them back and ask again.
                    Response::Error {
                        code: ErrorCode::Full | ErrorCode::Busy,
                        ..
                    } if !self.spares.is_empty() => self.clear_spares(deadline).await?,
                    // No room in the slab, room on disk: send the bytes
                    // along.
                    Response::ToDisk => {
                        return stream_put(&mut self.conn, put, deadline, Some(put.blob)).await
                    }
                    Response::AlreadyCommitted => return Ok(()),
                    other => return Err(Failure::unexpected(other)),
                }
            }
        })
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
            let req = Request::Resolve {
                partition: partition.to_owned(),
                keys: keys.to_vec(),
                hold: false,
            };
            let (pin, found, corrupt, spares_back): Resolved =
                match call(&mut self.conn, &req, deadline).await? {
                    Response::Resolved {
                        pin,
                        found,
                        corrupt,
                        spares_back,
                    } if found.len() == keys.len() => (pin, found, corrupt, spares_back),
                    other => return Err(Failure::unexpected(other)),
                };
            // Never a read outside the slab, nor a split value whose parts
            // are not its length: the connection goes (its end unpins).
            for f in found.iter().flatten() {
                check_found(f, self.slab_len)
                    .map_err(|m| Failure::protocol(format!("Resolved: {m}")))?;
            }
            let corrupt = corrupt.into_iter().map(|c| c as usize).collect();
            // A failed connection goes, and its end unpins: no Unpin then.
            let copied = self
                .copy_out(partition, keys, index_of, &found, corrupt, sink, deadline)
                .await?;
            if let Some(pin) = pin {
                // No reply: an unpin lost with its connection is covered by
                // the connection's end, which releases what it held.
                notify(
                    &mut self.conn,
                    &Request::Unpin { pin, reply: false },
                    deadline,
                )?;
            }
            if spares_back {
                self.clear_spares(deadline).await?;
            }
            let (missing, corrupt) = copied?;
            if !corrupt.is_empty() {
                return Err(Failure::Corrupt { positions: corrupt });
            }
            Ok(missing)
        })
    }

    fn call<'a>(&'a mut self, req: &'a Request, deadline: Instant) -> Op<'a, Response> {
        Box::pin(async move {
            let reply = call(&mut self.conn, req, deadline).await?;
            // A Resolve of a view: the unit may ask for spares back there
            // too (a view connection never puts, so it holds none).
            if matches!(
                reply,
                Response::Resolved {
                    spares_back: true,
                    ..
                }
            ) {
                self.clear_spares(deadline).await?;
            }
            Ok(reply)
        })
    }

    fn notify(&mut self, req: &Request, deadline: Instant) -> Result<(), Failure> {
        notify(&mut self.conn, req, deadline)
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

    fn put<'a>(&'a mut self, put: &'a BlobPut<'_>, deadline: Instant) -> Op<'a, ()> {
        Box::pin(stream_put(&mut self.conn, put, deadline, None))
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
            let req = Request::Read {
                partition: partition.to_owned(),
                keys: keys.to_vec(),
                timeout_ms: timeout_ms(deadline),
            };
            let reply = call(&mut self.conn, &req, deadline).await?;
            let (missing, corrupt) =
                read_data(&mut self.conn, reply, keys, index_of, sink, deadline)??;
            if !corrupt.is_empty() {
                return Err(Failure::Corrupt { positions: corrupt });
            }
            Ok(missing)
        })
    }

    fn call<'a>(&'a mut self, req: &'a Request, deadline: Instant) -> Op<'a, Response> {
        Box::pin(call(&mut self.conn, req, deadline))
    }

    fn notify(&mut self, req: &Request, deadline: Instant) -> Result<(), Failure> {
        notify(&mut self.conn, req, deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A "slab" in plain memory, for what the transports do with ranges.
    struct Memory(Vec<u8>);

    impl Mover for Memory {
        fn name(&self) -> &'static str {
            "memory"
        }

        fn write(&mut self, writes: &[PieceWrite<'_>], _: Instant) -> Result<(), Failure> {
            for (offset, segs) in writes {
                let mut at = *offset as usize;
                for s in segs {
                    self.0[at..at + s.len()].copy_from_slice(s);
                    at += s.len();
                }
            }
            Ok(())
        }

        fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
            let o = offset as usize;
            let src = self.0.get(o..o + dst.len()).ok_or("outside")?;
            dst.copy_from_slice(src);
            Ok(())
        }

        fn read_scatter(&self, reads: Vec<(u64, &mut [u8])>) -> Result<(), String> {
            reads.into_iter().try_for_each(|(o, d)| self.read(o, d))
        }

        fn batch(&self, _: usize) -> bool {
            true
        }
    }

    /// A put scattered over its pieces reads back, value by value, as
    /// split values' parts: the bytes that were put.
    #[test]
    fn a_blob_in_pieces_reads_back_by_parts() {
        let mut m = Memory(vec![0; 1 << 16]);
        let a: Vec<u8> = (0..100u8).collect();
        let b: Vec<u8> = (100..230u8).collect();
        // The blob: a at 0..100, padding to 128, b at 128..258.
        let pad = [0u8; 28];
        let segs: Vec<&[u8]> = vec![&a, &pad, &b];
        let pieces = [(8192, 64), (256, 128), (40960, 128)];
        check_pieces(&pieces, 258, 1 << 16).unwrap();
        let writes = scatter(&segs, &pieces).unwrap();
        m.write(&writes, Instant::now()).unwrap();
        // a: 64 bytes in the first piece, 36 in the second; b: from byte
        // 64 of the second piece (64 bytes), then 66 in the third.
        let fa = stowage_wire::Found {
            offset: 8192,
            len: 100,
            meta: vec![],
            on_disk: false,
            parts: vec![(8192, 64), (256, 36)],
        };
        let fb = stowage_wire::Found {
            offset: 320,
            len: 130,
            meta: vec![],
            on_disk: false,
            parts: vec![(320, 64), (40960, 66)],
        };
        for (f, want) in [(&fa, &a), (&fb, &b)] {
            check_found(f, 1 << 16).unwrap();
            let mut got = vec![0u8; want.len()];
            read_value(&m, &ranges_of(f), &mut got).unwrap();
            assert_eq!(&got, want);
        }
        // A buffer of the wrong size is refused, not overrun.
        let mut short = vec![0u8; 99];
        assert!(read_value(&m, &ranges_of(&fa), &mut short).is_err());
    }
}
