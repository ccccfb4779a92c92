//! Moving a request's values: a Put's payload from the socket into the
//! slab or a blob file on the disk tier, a Read's values from the slab or
//! their files to the socket, a Resolve's spilled values back into the
//! slab. The answers around them are the handler's.

use std::io::{self, BufRead as _, Read as _};
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use stowage_core::input;
use stowage_shm::Piece;
use stowage_wire::io::drain;
use stowage_wire::{encode, ErrorCode, Response};

use super::forwarding::{forwarded_reply, none_forwarded};
use super::session::EndReason;
use super::state::Conn;
use crate::disk::{self, read_through, DiskEngine};
use crate::handler::{self, Dest, Put, Read};
use crate::shared::Shared;
use crate::tier::{cut, Served};

impl Conn {
    /// Take a Put's payload where the handler reserved it, within the
    /// Put's own time (a payload that stalls past it is cut off), and
    /// answer what the handler makes of it.
    pub(super) fn receive(&mut self, id: u64, mut put: Put) -> Result<(), EndReason> {
        let timeout = self.io_timeout(put.timeout_ms);
        self.reader.get_mut().deadline = Some(Instant::now() + timeout);
        match &put.into {
            Dest::Slab { pieces } => {
                let ranges = cut(pieces, put.nbytes);
                if put.forward.is_some() && self.shared.peers.forwards() {
                    self.put_forwarding(id, &mut put, &ranges)
                } else {
                    self.put_to_slab(id, &mut put, &ranges)
                }
            }
            Dest::Disk => self.put_to_disk(id, &mut put),
            Dest::Nowhere => {
                drain(&mut self.reader, put.nbytes)?;
                let mut resp = self.landed(&mut put);
                if put.forward.is_some() {
                    let failed = none_forwarded(&put, "the blob was committed here already");
                    resp = forwarded_reply(resp, failed);
                }
                self.reply(id, &resp)?;
                Ok(())
            }
        }
    }

    /// The payload goes straight from the socket into the slab `ranges`
    /// (the reserved pieces, cut to the payload's length), in order. This
    /// thread is their only writer while it reads.
    pub(super) fn put_to_slab(
        &mut self,
        id: u64,
        put: &mut Put,
        ranges: &[(u64, u64)],
    ) -> Result<(), EndReason> {
        let mut got = Ok(());
        for &(offset, len) in ranges {
            let len = usize::try_from(len).map_err(|_| io::Error::other("payload too large"))?;
            got = self.recv_payload(offset, len);
            if got.is_err() {
                break;
            }
        }
        if let Err(e) = got {
            return Err(self.abandon(put, e));
        }
        let mut resp = self.landed(put);
        if matches!(
            resp,
            Response::Done | Response::Pending | Response::Repaired { .. }
        ) {
            self.count_in(put.nbytes);
        }
        if put.forward.is_some() {
            // A ForwardPut this unit does not forward (`put_forwarding`
            // forwards the others): every other copy is the client's.
            let failed = none_forwarded(
                put,
                "this unit forwards only with the plane's shared secret",
            );
            resp = forwarded_reply(resp, failed);
        }
        self.reply(id, &resp)?;
        Ok(())
    }

    /// A put whose payload stopped coming (`e`): given up (its range
    /// quarantined when it was cut off at its deadline, for the bytes may
    /// still be on their way); the connection ends for `e`.
    pub(super) fn abandon(&self, put: &mut Put, e: io::Error) -> EndReason {
        let cut = matches!(
            e.kind(),
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
        );
        let _ = handler::put_abandoned(&mut self.shared.core(), put, cut, self.shared.now());
        e.into()
    }

    /// [`handler::put_landed`], with a repair put's values counted; a put
    /// of another view of the plane than the unit's now is abandoned.
    pub(super) fn landed(&mut self, put: &mut Put) -> Response {
        if self.stale() {
            // The plane's view changed while the bytes came: a put of the
            // old placement is not committed once the new one is served.
            let _ = handler::put_abandoned(&mut self.shared.core(), put, false, self.shared.now());
            return Response::Error {
                code: ErrorCode::Stale,
                message: handler::STALE.into(),
            };
        }
        let resp = handler::put_landed(&mut self.shared.core(), put);
        if let (Response::Repaired { stored, skipped }, Some(m)) = (&resp, &self.shared.metrics) {
            m.repaired(*stored, *skipped);
        }
        resp
    }

    /// How this connection streams bytes (for metrics).
    fn stream_transport(&self) -> crate::metrics::Transport {
        if self.unix {
            crate::metrics::Transport::Uds
        } else {
            crate::metrics::Transport::Tcp
        }
    }

    pub(super) fn count_in(&self, n: u64) {
        if let Some(m) = self.counters() {
            m.bytes_in(self.stream_transport(), n);
        }
    }

    /// Take `len` payload bytes into the slab at `offset`: what the reader
    /// has buffered already, then straight from the socket (bounded by the
    /// reader's deadline).
    pub(super) fn recv_payload(&mut self, offset: u64, len: usize) -> io::Result<()> {
        let buffered = self.reader.buffer();
        let n = buffered.len().min(len);
        self.shared
            .slab
            .write(offset, &buffered[..n])
            .map_err(io::Error::other)?;
        self.reader.consume(n);
        if n == len {
            return Ok(());
        }
        let r = self.reader.get_mut();
        let deadline = r.deadline;
        let got = self.shared.slab.recv_into(
            r.socket.as_fd(),
            offset + n as u64,
            len - n,
            self.shared.settings.spin,
            deadline,
        );
        if !matches!(got, Ok(false)) {
            r.timeout_changed();
        }
        got.map(|_| ())
    }

    /// The payload of a put that went to the disk tier: streamed into the
    /// blob's file; the flusher syncs it and publishes the entries.
    fn put_to_disk(&mut self, id: u64, put: &mut Put) -> Result<(), EndReason> {
        let (blob, nbytes) = (put.blob, put.nbytes);
        let abandon = |shared: &Shared| {
            let _ = handler::put_abandoned(&mut shared.core(), put, false, shared.now());
        };
        let Some(d) = &self.shared.disk else {
            drain(&mut self.reader, nbytes)?;
            abandon(&self.shared);
            return self.reply_error(id, ErrorCode::Internal, "disk tier missing");
        };
        let (mut writer, mut failure) = match d.engine.create(blob, nbytes) {
            Ok(w) => (Some(w), None),
            Err(e) => {
                tracing::warn!(error = %e, "cannot create a blob file");
                (None, Some(e))
            }
        };
        let mut left = nbytes;
        let mut buf = vec![0u8; (64 << 10).min(nbytes as usize).max(1)];
        while left > 0 {
            let n = (left as usize).min(buf.len());
            if let Err(e) = self.reader.read_exact(&mut buf[..n]) {
                abandon(&self.shared);
                return Err(e.into());
            }
            left -= n as u64;
            if let (Some(w), None) = (writer.as_mut(), &failure) {
                if let Err(e) = w.write(&buf[..n]) {
                    failure = Some(e);
                }
            }
        }
        if let Some(e) = failure {
            // Nothing of this put is kept; the client may retry.
            abandon(&self.shared);
            if let Some(w) = writer {
                let _ = w.finish();
            }
            let _ = d.engine.delete(blob);
            let (code, why) = handler::disk_put_failed(&e);
            return self.reply_error(id, code, &why);
        }
        if self.stale() {
            // The plane's view changed while the bytes came (as `landed`).
            abandon(&self.shared);
            if let Some(w) = writer {
                let _ = w.finish();
            }
            let _ = d.engine.delete(blob);
            return self.reply_error(id, ErrorCode::Stale, handler::STALE);
        }
        // (A repair put never lands on disk: plain put_landed.)
        let mut resp = handler::put_landed(&mut self.shared.core(), put);
        if matches!(resp, Response::Pending) {
            self.count_in(nbytes);
            if let Some(m) = &self.shared.metrics {
                m.disk_put_bytes
                    .fetch_add(nbytes, std::sync::atomic::Ordering::Relaxed);
            }
            if let Some(w) = writer {
                let sent = d
                    .flush
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .send((blob, w));
                if sent.is_err() {
                    self.shared
                        .core()
                        .disk_written(blob, false, self.shared.now());
                }
            }
        }
        if put.forward.is_some() {
            let failed = none_forwarded(put, "this unit's copy went to its disk tier");
            resp = forwarded_reply(resp, failed);
        }
        self.reply(id, &resp)?;
        Ok(())
    }

    /// Send a Read's pinned values: straight from the slab (or a spilled
    /// blob's checked file) to the socket, within the Read's own time (a
    /// reader that stalls past it is cut off); only then does the pin go.
    pub(super) fn send(&mut self, id: u64, mut read: Read) -> Result<(), EndReason> {
        if std::mem::take(&mut self.via_ring) {
            // Its values follow the reply on the socket (and so does a
            // Busy answer).
            self.on_socket(id)?;
        }
        let timeout = self.io_timeout(read.timeout_ms);
        let until = Instant::now() + timeout;
        // Spilled values stream through one buffer of the unit's disk-read
        // budget, taken for the whole reply: a reader that finds none free
        // waits for one (most of its time), then is answered Busy.
        let shared = self.shared.clone();
        let mut buf = None;
        if let (true, Some(d)) = (read.has_disk(), &shared.disk) {
            buf = d.reads.take(Instant::now() + timeout.mul_f64(0.9));
            if buf.is_none() {
                handler::read_sent(&mut self.shared.core(), &read, self.shared.now());
                return self.reply_error(
                    id,
                    ErrorCode::Busy,
                    "every buffer of the unit's disk-read budget is taken by other readers \
                     of spilled values (--disk-read-budget); try again",
                );
            }
        }
        let found = std::mem::take(&mut read.found);
        let served = shared.bring_back(found, buf.as_deref_mut(), true);
        let (header_reply, total) = handler::data_reply(&served);
        // (On the pool: `out` was sent before this began.)
        let mut header = std::mem::take(&mut self.out);
        header.clear();
        encode(id, &header_reply, total, &mut header).map_err(io::Error::other)?;
        // The reply's header is counted while it is sent.
        self.settle(header.capacity());
        let sent = self.send_served(&header, &served, buf.as_deref_mut(), until);
        drop(buf);
        header.clear();
        if header.capacity() > super::KEEP_BUFFER {
            header = Vec::new();
        }
        self.out = header;
        self.settle(0);
        handler::read_sent(&mut self.shared.core(), &read, self.shared.now());
        let sent = sent?;
        if let Some(m) = self.counters() {
            m.bytes_out(self.stream_transport(), total);
        }
        if sent {
            // The send set its own timeout: back to the frame timeout.
            self.write_timeout = Duration::ZERO;
            self.set_write_timeout(self.shared.settings.frame_timeout)?;
        }
        Ok(())
    }

    /// Send a Data reply: `header`, then each served value, from the slab
    /// or streamed from its spilled blob's file through `buf` (checked
    /// chunk by chunk as it goes; the file was checked whole just before,
    /// so a mismatch now means it changed underneath: the connection is
    /// cut rather than a wrong byte sent). Returns whether a send changed
    /// the socket's timeout.
    fn send_served(
        &self,
        header: &[u8],
        served: &[Option<Served>],
        mut buf: Option<&mut [u8]>,
        until: Instant,
    ) -> Result<bool, EndReason> {
        let slab = &self.shared.slab;
        let fd = self.reader.src.socket.as_fd();
        let mut changed = false;
        let mut pieces = Vec::with_capacity(served.len() + 1);
        pieces.push(Piece::Heap(header));
        for s in served.iter().flatten() {
            match s {
                Served::Memory(l, _) => pieces.push(Piece::Slab {
                    offset: l.offset,
                    len: l.len as usize,
                }),
                Served::Split(parts, _) => pieces.extend(parts.iter().map(|l| Piece::Slab {
                    offset: l.offset,
                    len: l.len as usize,
                })),
                Served::Disk {
                    blob, offset, len, ..
                } => {
                    changed |= slab.send_pieces(fd, &pieces, until)?;
                    pieces.clear();
                    let (Some(d), Some(buf)) = (&self.shared.disk, buf.as_deref_mut()) else {
                        return Err(EndReason::Invalid(
                            "a spilled value without a disk-read buffer".into(),
                        ));
                    };
                    let t0 = Instant::now();
                    let streamed = d.engine.reader(*blob).and_then(|r| {
                        read_through(&r, *offset, *len, buf, |piece| {
                            changed |= slab.send_pieces(fd, &[Piece::Heap(piece)], until)?;
                            Ok(())
                        })
                    });
                    match streamed {
                        Ok(Ok(())) => {
                            d.io.read(*len, t0);
                            if let Some(m) = &self.shared.metrics {
                                m.disk_streamed_bytes
                                    .fetch_add(*len, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                        Ok(Err(e)) => return Err(e.into()),
                        Err(e) => {
                            tracing::error!(error = %e, ?blob, "a spilled blob's file changed while it was sent; the connection is cut");
                            return Err(EndReason::Invalid(format!(
                                "a spilled value's file failed its check while it was sent: {e}"
                            )));
                        }
                    }
                }
                Served::Corrupt => {}
            }
        }
        changed |= slab.send_pieces(fd, &pieces, until)?;
        Ok(changed)
    }

    /// A Resolve's reply: spilled values are brought back into the slab
    /// where there is room (the pin holds them meanwhile). Promotion copies
    /// through a buffer of the read budget; when none is free soon, the
    /// values stay on disk and the client reads them with a Read, which
    /// waits for one.
    pub(super) fn resolved(
        &mut self,
        pin: Option<stowage_core::PinId>,
        found: Vec<Option<stowage_core::Placed>>,
        spares_back: bool,
        rows: bool,
    ) -> Response {
        let mut buf = match &self.shared.disk {
            Some(d) if handler::has_disk(&found) => {
                d.reads.take(Instant::now() + Duration::from_millis(50))
            }
            _ => None,
        };
        let served = self.shared.bring_back(found, buf.as_deref_mut(), false);
        drop(buf);
        let (reply, bytes) = if rows {
            handler::resolved_rows_reply(pin, served, spares_back)
        } else {
            handler::resolved_reply(pin, served, spares_back)
        };
        if let Some(m) = self.counters() {
            m.bytes_out(crate::metrics::Transport::Shm, bytes);
        }
        reply
    }
}

impl Shared {
    /// Bring spilled values back for a reader that pinned them, through
    /// `buf` (a buffer of the disk tier's [`ReadBudget`]; without one,
    /// nothing is brought back): each spilled blob is promoted into the
    /// slab where there is room below the high watermark; with `verify`,
    /// the ranges asked for of the others are read and checked (nothing is
    /// kept: the reply streams them from their files afterwards), so that
    /// a damaged file, or one that is not its blob's, is answered Corrupt
    /// before the reply promises its bytes.
    pub(crate) fn bring_back(
        &self,
        found: Vec<Option<stowage_core::Placed>>,
        mut buf: Option<&mut [u8]>,
        verify: bool,
    ) -> Vec<Option<Served>> {
        use std::collections::{BTreeMap, HashMap, HashSet};
        use stowage_core::{Placement, SlabRange};
        // Each spilled blob, with the ranges of it that were asked for.
        let mut on_disk: BTreeMap<stowage_core::BlobId, Vec<(u64, u64)>> = BTreeMap::new();
        for (p, _) in found.iter().flatten() {
            if let Placement::Disk { blob, offset, len } = p {
                on_disk.entry(*blob).or_default().push((*offset, *len));
            }
        }
        let mut promoted = HashMap::new();
        let mut corrupt = HashSet::new();
        for (blob, mut wanted) in on_disk {
            let Some(d) = &self.disk else {
                corrupt.insert(blob);
                continue;
            };
            let Some(buf) = buf.as_deref_mut() else {
                continue;
            };
            let (slot, size) = {
                let mut c = self.core();
                let size = c.blob_size(blob);
                let slot = c.handle(self.now(), input::Promote(blob)).unwrap_or(None);
                (slot, size)
            };
            let Some(size) = size else {
                if let Some(_slot) = slot {
                    let done = input::Promoted { blob, ok: false };
                    let _ = self.core().handle(self.now(), done);
                }
                corrupt.insert(blob);
                continue;
            };
            let t0 = Instant::now();
            let reader = d.engine.reader(blob).and_then(|r| {
                if r.size() == size {
                    Ok(r)
                } else {
                    Err(disk::DiskError::Corrupt {
                        path: d.engine.path(blob),
                        reason: format!("holds {} bytes, expected {size}", r.size()),
                    })
                }
            });
            let read = match slot {
                Some(offset) => {
                    // This thread alone writes the promotion's range: the
                    // core keeps it allocated until it is reported.
                    let r = reader.and_then(|rd| {
                        let mut at = 0;
                        read_through(&rd, 0, size, buf, |piece| {
                            self.slab
                                .write(offset + at, piece)
                                .map_err(io::Error::other)?;
                            at += piece.len() as u64;
                            Ok(())
                        })?
                        .map_err(disk::DiskError::Io)
                    });
                    let done = input::Promoted {
                        blob,
                        ok: r.is_ok(),
                    };
                    let _ = self.core().handle(self.now(), done);
                    if r.is_ok() {
                        promoted.insert(blob, offset);
                        if let Some(m) = &self.metrics {
                            m.promoted_bytes.fetch_add(size, Ordering::Relaxed);
                        }
                    }
                    r.map(|()| size)
                }
                None if verify => {
                    wanted.sort_unstable();
                    wanted.dedup();
                    reader.and_then(|rd| {
                        let mut bytes = 0;
                        for (offset, len) in wanted {
                            read_through(&rd, offset, len, buf, |_| Ok(()))??;
                            bytes += len;
                        }
                        Ok(bytes)
                    })
                }
                None => reader.map(|_| 0),
            };
            match read {
                Ok(0) => {}
                Ok(n) => d.io.read(n, t0),
                Err(e) => {
                    tracing::error!(error = %e, ?blob, "a spilled blob could not be read back; its keys fail");
                    corrupt.insert(blob);
                }
            }
        }
        found
            .into_iter()
            .map(|f| {
                f.map(|(place, meta)| match place {
                    Placement::Memory(l) => Served::Memory(l, meta),
                    Placement::Split(parts) => Served::Split(parts, meta),
                    Placement::Disk { blob, .. } if corrupt.contains(&blob) => Served::Corrupt,
                    Placement::Disk { blob, offset, len } => match promoted.get(&blob) {
                        Some(base) => Served::Memory(
                            SlabRange {
                                offset: base + offset,
                                len,
                            },
                            meta,
                        ),
                        None => Served::Disk {
                            blob,
                            offset,
                            len,
                            meta,
                        },
                    },
                })
            })
            .collect()
    }
}
