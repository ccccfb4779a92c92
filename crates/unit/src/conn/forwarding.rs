//! Serving a ForwardPut (docs/replication.md#forwarding): the payload
//! goes into this unit's slab and, a chunk at a time as it arrives, on to
//! the next copy's unit (`forward.rs`: this unit as its client), with the
//! rest of the chain for it to forward to; the answer, once this unit
//! committed and the chain answered or failed, names the copies that
//! failed. And a CopyReserved: a blob its client wrote into this unit's
//! slab, copied into the slabs of the other copies' units on this host.

use std::io;
use std::time::Instant;

use stowage_wire::{ErrorCode, FailedCopy, RequestRef, Response};

use super::session::EndReason;
use super::state::Conn;
use crate::forward::{PeerConn, PeerError, PeerKey};
use crate::handler::{CopyOut, Put};

/// The bytes received before they go on to the copies: small enough that
/// the copies receive while this unit still does, large enough to take
/// few system calls.
const CHUNK: usize = 256 << 10;

/// The next unit of a chain a forward is under way to: its unit,
/// address, the connection and the id of its request.
struct Next {
    unit: u32,
    addr: String,
    conn: PeerConn,
    id: u64,
}

/// Every copy of `put`'s forward, failed for `why` (the client writes
/// them itself).
pub(super) fn none_forwarded(put: &Put, why: &str) -> Vec<FailedCopy> {
    put.forward.as_ref().map_or_else(Vec::new, |f| {
        f.to.iter()
            .map(|h| FailedCopy {
                unit: h.unit,
                code: ErrorCode::Internal,
                message: format!("not forwarded: {why}"),
            })
            .collect()
    })
}

/// The reply to a ForwardPut once this unit's copy landed as `landed`:
/// committed (or pending) with the copies `failed`, or this unit's own
/// refusal.
pub(super) fn forwarded_reply(landed: Response, failed: Vec<FailedCopy>) -> Response {
    match landed {
        Response::Done => Response::Forwarded {
            pending: false,
            failed,
        },
        Response::Pending => Response::Forwarded {
            pending: true,
            failed,
        },
        other => other,
    }
}

impl Conn {
    /// A ForwardPut whose payload goes into the slab `ranges` (the
    /// reserved pieces, cut to the payload's length), and on down its
    /// chain. The payload's deadline is the reader's.
    pub(super) fn put_forwarding(
        &mut self,
        id: u64,
        put: &mut Put,
        ranges: &[(u64, u64)],
    ) -> Result<(), EndReason> {
        let deadline = self
            .reader
            .get_mut()
            .deadline
            .unwrap_or_else(|| Instant::now() + self.shared.settings.frame_timeout);
        // (Validation leaves every ForwardPut a copy to forward to.)
        let to: Vec<stowage_wire::Hop> =
            put.forward.as_ref().map_or_else(Vec::new, |f| f.to.clone());
        let Some(first) = to.first().map(|h| h.unit) else {
            return self.put_to_slab(id, put, ranges);
        };
        let mut failed = Vec::new();
        let mut next = match self.open_next(put, deadline) {
            Ok(c) => Some(c),
            Err(e) => {
                failed = chain_failed(&to, e.of_copy(first));
                None
            }
        };
        let mut got = Ok(());
        'ranges: for &(offset, len) in ranges {
            let Ok(len) = usize::try_from(len) else {
                got = Err(io::Error::other("payload too large"));
                break;
            };
            let mut done = 0usize;
            while done < len {
                let n = (len - done).min(CHUNK);
                let at = offset + done as u64;
                got = self.recv_payload(at, n);
                if got.is_err() {
                    break 'ranges;
                }
                if let Some(c) = &mut next {
                    if let Err(e) = c.conn.send_slab(&self.shared.slab, at, n, deadline) {
                        failed = chain_failed(&to, e.of_copy(c.unit));
                        next = None;
                    }
                }
                done += n;
            }
        }
        if let Err(e) = got {
            // The next unit's connection closes with `next`: it gives up
            // what it reserved for this put, and so on down the chain.
            return Err(self.abandon(put, e));
        }
        let landed = self.landed(put);
        if matches!(landed, Response::Done | Response::Pending) {
            self.count_in(put.nbytes);
        }
        if let Some(c) = next {
            failed = self.chain_answer(c, put, &to, deadline);
        }
        if let Some(m) = &self.shared.metrics {
            let next_failed = failed.iter().any(|f| f.unit == first);
            m.forwarded(u64::from(!next_failed), u64::from(next_failed), put.nbytes);
        }
        failed.sort_by_key(|f| f.unit);
        let resp = forwarded_reply(landed, failed);
        self.reply(id, &resp)?;
        Ok(())
    }

    /// A CopyReserved: the reserved blob's bytes copied into each other
    /// copy's unit's slab (mapped over its Unix socket) and committed there,
    /// one unit after the other; answered `Forwarded` with the copies
    /// that failed (the client writes them, then commits its own).
    pub(super) fn copy_out(&mut self, id: u64, c: CopyOut) -> Result<(), EndReason> {
        // Half the put's time: a copy whose unit does not answer (paused,
        // its connection kept from an earlier put) fails in time for the
        // client to write it itself, or to find that unit down.
        let deadline = Instant::now() + self.io_timeout(c.timeout_ms) / 2;
        let failed: Vec<FailedCopy> = if self.shared.peers.forwards() {
            c.forward
                .to
                .iter()
                .filter_map(|hop| {
                    let key = PeerKey {
                        addr: &hop.addr,
                        namespace: &c.forward.namespace,
                        instance: hop.instance,
                        epoch: self.epoch,
                    };
                    let mut conn = match self.shared.peers.checkout(&key, deadline) {
                        Ok(conn) => conn,
                        Err(e) => return Some(e.of_copy(hop.unit)),
                    };
                    let copied = conn.copy_in(
                        &self.shared.slab,
                        &c.pieces,
                        c.nbytes,
                        &c.forward.partition,
                        &c.entries,
                        deadline,
                    );
                    // A refusal leaves the connection as it was.
                    if !matches!(copied, Err(PeerError::Io(_))) {
                        self.shared
                            .peers
                            .checkin(&hop.addr, &c.forward.namespace, conn);
                    }
                    copied.err().map(|e| e.of_copy(hop.unit))
                })
                .collect()
        } else {
            c.forward
                .to
                .iter()
                .map(|h| FailedCopy {
                    unit: h.unit,
                    code: ErrorCode::Internal,
                    message: "not copied: this unit forwards only with the plane's shared secret"
                        .into(),
                })
                .collect()
        };
        if let Some(m) = &self.shared.metrics {
            let n = c.forward.to.len() as u64;
            let bad = failed.len() as u64;
            m.forwarded(n - bad, bad, c.nbytes);
        }
        self.reply(
            id,
            &Response::Forwarded {
                pending: false,
                failed,
            },
        )?;
        Ok(())
    }

    /// A connection to the next unit of the chain, sent the header of a
    /// ForwardPut of the rest of the chain (a plain Put when it is the
    /// last).
    fn open_next(&self, put: &Put, deadline: Instant) -> Result<Next, PeerError> {
        let Some(fwd) = &put.forward else {
            return Err(PeerError::Io("nothing to forward".into()));
        };
        let (first, rest) = fwd
            .to
            .split_first()
            .ok_or_else(|| PeerError::Io("nothing to forward".into()))?;
        let key = PeerKey {
            addr: &first.addr,
            namespace: &fwd.namespace,
            instance: first.instance,
            epoch: self.epoch,
        };
        let mut conn = self.shared.peers.checkout(&key, deadline)?;
        let left = deadline.saturating_duration_since(Instant::now());
        let timeout_ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1);
        let req = if rest.is_empty() {
            RequestRef::Put {
                blob: put.blob,
                partition: &fwd.partition,
                entries: &put.entries,
                timeout_ms,
            }
        } else {
            RequestRef::ForwardPut {
                blob: put.blob,
                partition: &fwd.partition,
                entries: &put.entries,
                timeout_ms,
                to: rest,
                hop: fwd.hop.saturating_add(1),
            }
        };
        let id = conn.send_put(&req, put.nbytes, deadline)?;
        Ok(Next {
            unit: first.unit,
            addr: first.addr.clone(),
            conn,
            id,
        })
    }

    /// The chain's answer, from its next unit: the copies down it that
    /// failed (the next unit's connection kept for the next forward when
    /// its answer came whole).
    fn chain_answer(
        &self,
        mut c: Next,
        put: &Put,
        to: &[stowage_wire::Hop],
        deadline: Instant,
    ) -> Vec<FailedCopy> {
        let namespace = put.forward.as_ref().map_or("", |f| f.namespace.as_str());
        let answer = match c.conn.recv(c.id, deadline) {
            Ok(a) => a,
            Err(e) => return chain_failed(to, e.of_copy(c.unit)),
        };
        // The reply came whole: the connection serves the next forward.
        self.shared.peers.checkin(&c.addr, namespace, c.conn);
        let refused = |e: PeerError| chain_failed(to, e.of_copy(c.unit));
        match answer {
            Response::Done | Response::AlreadyCommitted => Vec::new(),
            Response::Forwarded {
                pending: false,
                failed,
            } => failed,
            // On that unit's disk tier, not yet durable: the client
            // writes that copy itself, as for any other failure.
            Response::Pending
            | Response::Forwarded {
                pending: true,
                failed: _,
            } => {
                let mut f = match answer {
                    Response::Forwarded { failed, .. } => failed,
                    _ => Vec::new(),
                };
                f.push(
                    PeerError::Refused(
                        ErrorCode::Busy,
                        "the copy went to its unit's disk tier and is not durable yet".into(),
                    )
                    .of_copy(c.unit),
                );
                f
            }
            Response::Error { code, message } => refused(PeerError::Refused(code, message)),
            _ => refused(PeerError::Io(
                "an unexpected reply to a forwarded put".into(),
            )),
        }
    }
}

/// Every copy of the chain `to` failed: the first (the next unit) for
/// `first`'s reason, the rest because the chain broke before them.
fn chain_failed(to: &[stowage_wire::Hop], first: FailedCopy) -> Vec<FailedCopy> {
    let why = format!(
        "not forwarded: the copy of unit {} before it failed",
        first.unit
    );
    let mut out = vec![first];
    out.extend(to.iter().skip(1).map(|h| FailedCopy {
        unit: h.unit,
        code: ErrorCode::Internal,
        message: why.clone(),
    }));
    out
}
