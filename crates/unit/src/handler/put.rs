//! A put's way through the handler: [`handle`](super::handle) reserves its
//! blob ([`put`], or [`commit`] for bytes a same-host client wrote through
//! the mapping) and plans where the payload goes ([`Put`], [`Dest`]); once
//! the connection has moved the bytes it hands the put back here, to be
//! committed ([`put_landed`], a RepairPut's through its window) or given
//! back ([`put_abandoned`]).

use stowage_core::{op, Allocated, BlobId, Committed, CoreError, EntrySpec, Owner, Time, UnitCore};
use stowage_wire::{ErrorCode, Response};

use super::{alloc, commit_written, error, error_response, request, Plan};

/// A Put whose slab range or file is reserved: its payload goes to `into`.
/// A RepairPut is one with a `repair` window.
#[derive(Debug)]
pub struct Put {
    pub owner: Owner,
    /// The core partition (the connection's namespace and the request's
    /// partition, see [`scope`](super::scope)).
    pub partition: String,
    pub blob: BlobId,
    pub entries: Vec<EntrySpec>,
    /// The payload's length.
    pub nbytes: u64,
    /// How long the client lets the payload take (0: the unit's frame
    /// timeout; the connection bounds it).
    pub timeout_ms: u64,
    pub into: Dest,
    /// When it was reserved.
    pub now: Time,
    /// A RepairPut's window: its commit publishes only what the window
    /// lets through, answered [`Response::Repaired`] (its blob lies in the
    /// slab, never on the disk tier).
    pub repair: Option<u64>,
    /// A ForwardPut's other copies: its payload goes on to them as it
    /// arrives, answered [`Response::Forwarded`].
    pub forward: Option<Forward>,
}

/// Where a ForwardPut's bytes go besides this unit: on to the first of
/// `to`, which forwards them to the rest.
#[derive(Debug)]
pub struct Forward {
    pub to: Vec<stowage_wire::Hop>,
    /// This unit's place in the chain (0: the client's first copy).
    pub hop: u8,
    /// The request's partition (not scoped: each copy's unit scopes it).
    pub partition: String,
    /// The connection's namespace, said in Hello to the copies' units.
    pub namespace: String,
}

/// A reserved blob this unit copies into the slabs of the other copies'
/// units on its host (`Request::CopyReserved`).
#[derive(Debug)]
pub struct CopyOut {
    /// The reservation's (slab offset, bytes) pieces, in order.
    pub pieces: Vec<(u64, u64)>,
    /// The blob's bytes (where its last entry ends).
    pub nbytes: u64,
    /// The copies (`to`: Unix socket paths), and the partition and
    /// namespace they are committed in.
    pub forward: Forward,
    pub entries: Vec<stowage_wire::EntrySpec>,
    pub timeout_ms: u64,
}

/// Where a Put's payload goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dest {
    /// The slab, in these (offset, bytes) pieces in order: this connection
    /// is their only writer.
    Slab { pieces: Vec<(u64, u64)> },
    /// The blob's file on the disk tier (the slab is full); the flusher
    /// syncs it and publishes the entries.
    Disk,
    /// Nowhere: the blob is committed already (a retry); its bytes are
    /// dropped.
    Nowhere,
}

/// Commit `entries` of `blob`, reserved in the slab by `owner` and written
/// through the mapping, into `partition`.
pub(super) fn commit(
    core: &mut UnitCore,
    owner: Owner,
    partition: String,
    blob: BlobId,
    entries: Vec<EntrySpec>,
    now: Time,
) -> Plan {
    let shm_bytes = entry_bytes(&entries);
    let op = op::Commit {
        partition,
        blob,
        entries,
    };
    let reply = match request(core, now, owner, op) {
        Ok(Committed::Done) => Response::Done,
        Ok(Committed::Pending) => Response::Pending,
        Err(e) => error_response(&e),
    };
    Plan::Committed {
        blob,
        shm_bytes,
        reply,
    }
}

/// The bytes a commit's entries name (0 when their sum overflows: the
/// core refuses those).
pub(super) fn entry_bytes(entries: &[EntrySpec]) -> u64 {
    entries
        .iter()
        .try_fold(0u64, |sum, e| sum.checked_add(e.len))
        .unwrap_or(0)
}

/// Fused alloc + bytes + commit: reserve the Put's blob; its payload goes
/// straight from the socket into the slab, or, when the slab is full and
/// the disk tier has room, into the blob's file. The connection's thread
/// holds the reservation while it reads, and no timer takes it away
/// meanwhile (docs/fencing.md); a payload that stalls past its timeout is
/// cut off, and the range of a cut one goes through quarantine. A
/// RepairPut (`repair`: its window) reserves in the slab only.
#[allow(clippy::too_many_arguments)]
pub(super) fn put(
    core: &mut UnitCore,
    owner: Owner,
    partition: String,
    blob: BlobId,
    entries: Vec<EntrySpec>,
    nbytes: u64,
    timeout_ms: u64,
    repair: Option<u64>,
    now: Time,
) -> Plan {
    let refuse = |reply| Plan::Drain {
        len: nbytes,
        put_timeout_ms: Some(timeout_ms),
        reply,
    };
    let Ok(n_entries) = u32::try_from(entries.len()) else {
        return refuse(error(ErrorCode::InvalidRequest, "too many entries".into()));
    };
    let reserved = match repair {
        None => alloc(core, owner, blob, nbytes, n_entries, now),
        Some(window) => {
            let op = op::RepairAlloc {
                window,
                blob,
                nbytes,
                n_entries,
            };
            request(core, now, owner, op)
        }
    };
    let into = match reserved {
        Ok(Allocated::Reserved { pieces }) => Dest::Slab { pieces },
        Ok(Allocated::ToDisk) => Dest::Disk,
        Ok(Allocated::AlreadyCommitted) => Dest::Nowhere,
        Err(e) => return refuse(repair_error(core, repair, &e)),
    };
    Plan::Receive(Put {
        owner,
        partition,
        blob,
        entries,
        nbytes,
        timeout_ms,
        into,
        now,
        repair,
        forward: None,
    })
}

/// A Put's payload has all arrived into [`Put::into`]: commit it. The
/// reply. A slab or disk put that the core refuses is aborted.
pub fn put_landed(core: &mut UnitCore, put: &mut Put) -> Response {
    if let Some(window) = put.repair {
        return repair_landed(core, put, window);
    }
    // The commit takes the entries; the put keeps its blob and size.
    let r = commit_written(
        core,
        put.owner,
        std::mem::take(&mut put.partition),
        put.blob,
        std::mem::take(&mut put.entries),
        put.now,
    );
    match (&put.into, r) {
        // Still being made durable, or done.
        (Dest::Nowhere, Ok(Committed::Pending)) => Response::Pending,
        (Dest::Nowhere, _) => Response::Done,
        (_, Ok(Committed::Done)) => Response::Done,
        (_, Ok(Committed::Pending)) => Response::Pending,
        (_, Err(e)) => {
            let _ = abort(core, put, false, put.now);
            error_response(&e)
        }
    }
}

/// [`put_landed`] of a RepairPut: the repair commit (a retry of a blob
/// committed already stores nothing and counts every entry skipped).
fn repair_landed(core: &mut UnitCore, put: &mut Put, window: u64) -> Response {
    let op = op::RepairCommit {
        window,
        partition: std::mem::take(&mut put.partition),
        blob: put.blob,
        entries: std::mem::take(&mut put.entries),
    };
    match request(core, put.now, put.owner, op) {
        Ok(r) => Response::Repaired {
            stored: r.stored,
            skipped: r.skipped,
        },
        Err(e) => {
            if put.into != Dest::Nowhere {
                let _ = abort(core, put, false, put.now);
            }
            repair_error(core, Some(window), &e)
        }
    }
}

/// The wire form of a refusal of a put through `repair` (a RepairPut's
/// window): Busy says so when the window lost track of clears.
fn repair_error(core: &UnitCore, repair: Option<u64>, e: &CoreError) -> Response {
    match (repair, e) {
        (Some(window), CoreError::Busy { .. }) if core.repair_window_lost(window) => error(
            ErrorCode::Busy,
            format!(
                "repair window {window} lost track of clears (the unit remembers a bounded \
                 number): open a new window and repair again"
            ),
        ),
        _ => error_response(e),
    }
}

/// A Put's payload stopped midway (`cut`: it stalled past its time), or
/// its file failed: nothing of it is kept. The connection's thread was the
/// only writer of its range and has stopped; a cut stream's range still
/// goes through quarantine (a file has none). The core's answer, which the
/// unit ignores.
pub fn put_abandoned(
    core: &mut UnitCore,
    put: &Put,
    cut: bool,
    now: Time,
) -> Result<(), CoreError> {
    match put.into {
        Dest::Slab { .. } => abort(core, put, cut, now),
        Dest::Disk => abort(core, put, false, now),
        Dest::Nowhere => Ok(()),
    }
}

fn abort(core: &mut UnitCore, put: &Put, in_flight: bool, now: Time) -> Result<(), CoreError> {
    let op = op::Abort {
        blob: put.blob,
        in_flight,
    };
    request(core, now, put.owner, op).map(|_| ())
}
