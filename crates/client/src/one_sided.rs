//! The one-sided transport: the client moves a unit's bytes itself, by a
//! [`Mover`] of the unit's slab: the mapped slab (`ShmTransport`, same host)
//! or NIXL transfers (`nixl::NixlMover`). A put is Alloc → write →
//! Commit, or with a *spare* of its size class (reserved by the previous
//! commit, `CommitSpare`) write → commit; a get is Resolve (pins) → read →
//! Unpin (sent without awaiting a reply).

use std::sync::Arc;
use std::time::Instant;

use stowage_shm::Slab;
use stowage_wire::io::Socket;
use stowage_wire::{BlobId, ErrorCode, FailedCopy, Hop, Key, PinId, Request, RequestRef, Response};

use crate::conn::Conn;
use crate::failure::Failure;
use crate::fanout::turn;
use crate::lent::{spare_class, Lent};
use crate::pieces::{check_found, check_pieces, ranges_of, scatter, split_dst, PieceWrite, Places};
use crate::sink::ValueAsk;
use crate::transport::{
    abort, asks_of, n_entries, not_forwarded, notify, read_data, recommit, send_repair_put,
    stream_put, timeout_ms, total_len, Missing, Op, SharedSink, Transport,
};
use crate::{new_blob_id, BlobPut};

/// Most spares one same-host connection holds.
pub const SPARES: usize = 4;

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
    /// Copy many (fetched) ranges, on several threads where that helps
    /// (one after another unless the mover knows better).
    fn read_scatter(&self, reads: Vec<(u64, &mut [u8])>) -> Result<(), String> {
        reads.into_iter().try_for_each(|(o, d)| self.read(o, d))
    }
    /// Whether a get of `total` bytes in several values should ask its
    /// sink for every buffer at once (yes, unless the mover knows better).
    fn batch(&self, total: usize) -> bool {
        let _ = total;
        true
    }
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
    Vec<Option<stowage_wire::Placed>>,
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
            Some((spare, spare_nbytes)) => RequestRef::CommitSpare {
                blob: put.blob,
                written,
                partition: put.partition,
                entries: &put.entries,
                spare,
                spare_nbytes,
            },
            None => {
                debug_assert_eq!(written, put.blob, "only CommitSpare commits a spare");
                RequestRef::Commit {
                    blob: put.blob,
                    partition: put.partition,
                    entries: &put.entries,
                }
            }
        };
        let mut reply = self.conn.call(&req, deadline).await?;
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

    /// A put (Alloc, or a spare, → write → commit) whose other copies `to`,
    /// when given, the unit copies from its slab into theirs before the
    /// commit (`CopyReserved`, docs/replication.md#forwarding): the
    /// copies that are not committed, which the caller writes itself.
    async fn put_copying(
        &mut self,
        put: &BlobPut<'_>,
        to: Option<&[Hop]>,
        deadline: Instant,
    ) -> Result<Vec<FailedCopy>, Failure> {
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
                let failed = self.copy_reserved(put, spare.blob, to, deadline).await?;
                self.commit(put, spare.blob, deadline).await?;
                return Ok(failed);
            }
        }
        let alloc = Request::Alloc {
            blob: put.blob,
            nbytes: n,
            n_entries,
        };
        let none = |why: &str| to.map_or_else(Vec::new, |to| not_forwarded(to, why));
        loop {
            match self.conn.call(&alloc, deadline).await? {
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
                    let failed = self.copy_reserved(put, put.blob, to, deadline).await?;
                    self.commit(put, put.blob, deadline).await?;
                    return Ok(failed);
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
                    stream_put(&mut self.conn, put, deadline, Some(put.blob)).await?;
                    return Ok(none("the blob went to the unit's disk tier"));
                }
                Response::AlreadyCommitted => {
                    return Ok(none("the blob was committed here already"))
                }
                other => return Err(Failure::unexpected(other)),
            }
        }
    }

    /// Ask the unit to copy reservation `written` (holding `put`'s bytes)
    /// into the slabs of the other copies' units `to` (none: nothing to
    /// ask); the copies that failed. A refusal gives the reservation back,
    /// as a refused commit does.
    async fn copy_reserved(
        &mut self,
        put: &BlobPut<'_>,
        written: BlobId,
        to: Option<&[Hop]>,
        deadline: Instant,
    ) -> Result<Vec<FailedCopy>, Failure> {
        let Some(to) = to else {
            return Ok(Vec::new());
        };
        let ask = RequestRef::CopyReserved {
            blob: written,
            partition: put.partition,
            entries: &put.entries,
            timeout_ms: timeout_ms(deadline),
            to,
        };
        match self.conn.call(&ask, deadline).await? {
            Response::Forwarded { failed, .. } => Ok(failed),
            Response::Error { code, message } => {
                abort(&mut self.conn, written, deadline).await?;
                Err(Failure::Refused(code, message))
            }
            other => Err(Failure::unexpected(other)),
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

    /// [`Transport::call`], [`Transport::call_ref`].
    async fn call_any(
        &mut self,
        req: &impl crate::conn::Outgoing,
        deadline: Instant,
    ) -> Result<Response, Failure> {
        let reply = self.conn.call(req, deadline).await?;
        // A Resolve of a view: the unit may ask for spares back there
        // too (a view connection never puts, so it holds none).
        let spares_back = match &reply {
            Response::Resolved { spares_back, .. } => *spares_back,
            Response::ResolvedRows(r) => r.spares_back,
            _ => false,
        };
        if spares_back {
            self.clear_spares(deadline).await?;
        }
        Ok(reply)
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
        found: &[Option<stowage_wire::Placed>],
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
            match read_data(
                &mut self.conn,
                partition,
                &disk_keys,
                &disk_index,
                sink,
                deadline,
            )
            .await?
            {
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

    fn epoch(&self) -> u64 {
        self.conn.epoch
    }

    fn repair_put<'a>(
        &'a mut self,
        window: u64,
        put: &'a BlobPut<'_>,
        deadline: Instant,
    ) -> Op<'a, Response> {
        Box::pin(send_repair_put(&mut self.conn, window, put, deadline))
    }

    fn put<'a>(&'a mut self, put: &'a BlobPut<'_>, deadline: Instant) -> Op<'a, ()> {
        Box::pin(async move { self.put_copying(put, None, deadline).await.map(drop) })
    }

    fn forward_put<'a>(
        &'a mut self,
        put: &'a BlobPut<'_>,
        to: &'a [Hop],
        deadline: Instant,
    ) -> Op<'a, Vec<FailedCopy>> {
        Box::pin(self.put_copying(put, Some(to), deadline))
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
            let req = RequestRef::Resolve {
                partition,
                keys,
                hold: false,
            };
            let (pin, found, corrupt, spares_back): Resolved =
                match self.conn.call(&req, deadline).await? {
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
        Box::pin(self.call_any(req, deadline))
    }

    fn call_ref<'a>(&'a mut self, req: &'a RequestRef<'_>, deadline: Instant) -> Op<'a, Response> {
        Box::pin(self.call_any(req, deadline))
    }

    fn notify(&mut self, req: &Request, deadline: Instant) -> Result<(), Failure> {
        notify(&mut self.conn, req, deadline)
    }

    fn interrupter(&self) -> Option<Socket> {
        self.conn.keep_open()
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
    }

    /// A value of `len` bytes at `parts` (the first part's offset is the
    /// value's).
    fn placed(len: u64, parts: Vec<(u64, u64)>) -> stowage_wire::Placed {
        stowage_wire::Placed {
            offset: parts[0].0,
            len,
            meta: Default::default(),
            on_disk: false,
            parts,
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
        let fa = placed(100, vec![(8192, 64), (256, 36)]);
        let fb = placed(130, vec![(320, 64), (40960, 66)]);
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
