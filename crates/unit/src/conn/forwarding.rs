//! Serving a ForwardPut (docs/replication.md#forwarding): the payload
//! goes into this unit's slab and, a chunk at a time as it arrives, on to
//! the unit of every other copy (`forward.rs`: this unit as their
//! client); the answer, once this unit committed and every copy answered
//! or failed, names the copies that failed.

use std::io;
use std::time::Instant;

use stowage_wire::{ErrorCode, FailedCopy, RequestRef, Response};

use super::session::EndReason;
use super::state::Conn;
use crate::forward::{PeerConn, PeerError};
use crate::handler::{self, Put};

/// The bytes received before they go on to the copies: small enough that
/// the copies receive while this unit still does, large enough to take
/// few system calls.
const CHUNK: usize = 256 << 10;

/// A copy a forward is under way to: its unit, address, the connection
/// and the id of its Put.
struct Copy {
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
    /// reserved pieces, cut to the payload's length), and on to its
    /// copies. The payload's deadline is the reader's.
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
        let (copies, mut failed) = self.open_copies(put, deadline);
        let mut copies: Vec<Option<Copy>> = copies.into_iter().map(Some).collect();
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
                for slot in &mut copies {
                    let Some(c) = slot else { continue };
                    if let Err(e) = c.conn.send_slab(&self.shared.slab, at, n, deadline) {
                        failed.push(e.of_copy(c.unit));
                        *slot = None;
                    }
                }
                done += n;
            }
        }
        if let Err(e) = got {
            // The copies' connections close with `copies`: their units
            // give up what they reserved for it.
            let cut = matches!(
                e.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            );
            let _ = handler::put_abandoned(&mut self.shared.core(), put, cut, self.shared.now());
            return Err(e.into());
        }
        let landed = handler::put_landed(&mut self.shared.core(), put);
        if matches!(landed, Response::Done | Response::Pending) {
            self.count_in(put.nbytes);
        }
        let mut committed = 0u64;
        for c in copies.into_iter().flatten() {
            match self.copy_answer(c, put, deadline) {
                Ok(()) => committed += 1,
                Err(f) => failed.push(f),
            }
        }
        if let Some(m) = &self.shared.metrics {
            m.forwarded(committed, failed.len() as u64, put.nbytes);
        }
        failed.sort_by_key(|f| f.unit);
        let resp = forwarded_reply(landed, failed);
        self.reply(id, &resp)?;
        Ok(())
    }

    /// A connection to each copy's unit, each sent the Put's header; the
    /// copies that could not be reached or sent to are failed.
    fn open_copies(&self, put: &Put, deadline: Instant) -> (Vec<Copy>, Vec<FailedCopy>) {
        let (mut open, mut failed) = (Vec::new(), Vec::new());
        let Some(fwd) = &put.forward else {
            return (open, failed);
        };
        for hop in &fwd.to {
            let started = self
                .shared
                .peers
                .checkout(&hop.addr, &fwd.namespace, deadline)
                .and_then(|mut conn| {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let req = RequestRef::Put {
                        blob: put.blob,
                        partition: &fwd.partition,
                        entries: &put.entries,
                        timeout_ms: u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1),
                    };
                    let id = conn.send_put(&req, put.nbytes, deadline)?;
                    Ok((conn, id))
                });
            match started {
                Ok((conn, id)) => open.push(Copy {
                    unit: hop.unit,
                    addr: hop.addr.clone(),
                    conn,
                    id,
                }),
                Err(e) => failed.push(e.of_copy(hop.unit)),
            }
        }
        (open, failed)
    }

    /// Copy `c`'s answer to its Put: committed (its connection kept for
    /// the next forward), or why not.
    fn copy_answer(&self, mut c: Copy, put: &Put, deadline: Instant) -> Result<(), FailedCopy> {
        let namespace = put.forward.as_ref().map_or("", |f| f.namespace.as_str());
        let answer = c.conn.recv(c.id, deadline);
        let failure = match answer {
            Ok(Response::Done | Response::AlreadyCommitted) => None,
            // On that unit's disk tier, not yet durable: the client
            // writes this copy itself, as for any other failure.
            Ok(Response::Pending) => Some(PeerError::Refused(
                ErrorCode::Busy,
                "the copy went to its unit's disk tier and is not durable yet".into(),
            )),
            Ok(Response::Error { code, message }) => Some(PeerError::Refused(code, message)),
            Ok(_) => Some(PeerError::Io("an unexpected reply to a Put".into())),
            Err(e) => return Err(e.of_copy(c.unit)),
        };
        // The reply came whole: the connection serves the next forward.
        self.shared.peers.checkin(&c.addr, namespace, c.conn);
        match failure {
            None => Ok(()),
            Some(e) => Err(e.of_copy(c.unit)),
        }
    }
}
