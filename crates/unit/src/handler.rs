//! The request handler past the frame decoder: every request a connection
//! reads is decided here, against the core, without a socket. [`handle`]
//! answers what is pure state (alloc, commit, unpin, list, ...) with a
//! reply, and turns a request that moves bytes into a [`Plan`] for the
//! connection (`conn`): take a Put's payload into the slab or the
//! blob's file, send a Read's values, bring a Resolve's spilled values
//! back. When the bytes have moved, the connection hands the outcome back
//! here ([`put_landed`], [`put_abandoned`], [`read_sent`]) and sends what
//! that answers. The connection only reads frames, moves bytes and writes
//! replies; the fuzz target `request_handler` drives these same functions
//! with request sequences from several sessions.

use std::ops::DerefMut;
use std::time::Duration;

use stowage_core::{
    op, Allocated, BlobId, Committed, CoreError, EntrySpec, Keys, Op, Owner, PinId, Placed,
    Placement, SpareCommitted, Time, UnitCore,
};
use stowage_wire::{ErrorCode, Request, Response, PARTITION_SEPARATOR};

mod claims;
mod put;
mod reply;

pub use claims::claimed;
pub use put::{put_abandoned, put_landed, CopyOut, Dest, Forward, Put};
pub use reply::{committed_reply, disk_put_failed};
pub(crate) use reply::{data_reply, resolved_reply, resolved_rows_reply};

/// Who sent a request, as the connection knows it.
#[derive(Clone, Copy, Debug)]
pub struct Asker<'a> {
    /// Once the connection said Hello: its session's connection, and the
    /// namespace it said (every partition it names lies in it).
    pub hello: Option<(Owner, &'a str)>,
    /// May send admin requests (shutdown, checkpoint).
    pub admin: bool,
    /// May send checkpoint requests (checkpoint, open and close a
    /// restore): an admin, or any client of a unit with a shared secret
    /// (every connection such a unit serves proved it).
    pub checkpoints: bool,
    /// The unit is shutting down: no new work is taken.
    pub stopping: bool,
    /// The unit was fenced: nothing is served.
    pub fenced: bool,
    /// The connection speaks for another view of the plane than the
    /// unit's (`Request::Epoch`): no row request is served.
    pub stale: bool,
}

/// What the connection does for a request.
#[derive(Debug)]
pub enum Plan {
    /// Send this reply.
    Reply(Response),
    /// Make this connection a request ring of `bytes` and hand its memfd
    /// over with the reply (a connection that mapped the slab only).
    OpenRing { bytes: u32 },
    /// The client put requests in this connection's ring while the unit
    /// had stopped polling it: poll it again. No reply.
    RingKick,
    /// Send nothing (an Unpin with `reply: false`).
    Silent,
    /// Send nothing now: a claim waits for rows, and the core answers it
    /// later (`Action::Claimed`, delivered through the unit's answers).
    Wait,
    /// A Commit of bytes the client wrote through its mapping: send
    /// `reply`, or, when it is `UnknownBlob`, what the disk tier remembers
    /// of `blob`'s failed put; `shm_bytes` were published when it succeeds.
    Committed {
        blob: BlobId,
        reply: Response,
        shm_bytes: u64,
    },
    /// Take the request's `len` payload bytes and drop them, then send
    /// `reply`: a Put refused before its bytes. `put_timeout_ms`: the
    /// Put's own time for them (see [`Put::timeout_ms`]); `None`: within
    /// the frame's deadline.
    Drain {
        len: u64,
        put_timeout_ms: Option<u64>,
        reply: Response,
    },
    /// Take a Put's payload into [`Put::into`], then answer what
    /// [`put_landed`] says; a payload that stops midway goes to
    /// [`put_abandoned`] and ends the connection.
    Receive(Put),
    /// A Resolve, pinned: bring spilled values back where there is room,
    /// then answer where each value lies (the pin holds them; the client
    /// unpins).
    Resolved {
        pin: Option<PinId>,
        found: Vec<Option<Placed>>,
        /// The unit is short of memory: the client gives its spares back.
        spares_back: bool,
        /// Answered in columns ([`Response::ResolvedRows`]: the request was
        /// a ResolveRows), else as a [`Response::Resolved`].
        rows: bool,
    },
    /// A Read, pinned: send the values (a Data header, then their bytes),
    /// then [`read_sent`].
    Send(Read),
    /// A Hello of the right version: join (or open) the session.
    Hello {
        namespace: String,
        want_fd: bool,
        session: Option<u128>,
    },
    /// Answer the unit's statistics.
    Stats,
    /// Hand the peer the unit's nixl agent (its agent is `agent`).
    NixlInfo {
        owner: Owner,
        agent: String,
        agent_metadata: Vec<u8>,
    },
    /// Write a checkpoint into `dir` (an admin asked): every row, or the
    /// rows of `homes` ([`Request::CheckpointHomes`]).
    Checkpoint {
        dir: String,
        homes: Option<crate::checkpoint::homes::Homes>,
    },
    /// Start a restore unit serving the checkpoint in `dir`.
    OpenRestore { dir: String },
    /// Stop restore unit `id`.
    CloseRestore { id: u64 },
    /// Shut the unit down within `timeout`, answer, and end the connection
    /// (an admin asked).
    Shutdown { timeout: Duration },
    /// Stop serving for good and exit, this unit being `instance`
    /// (`Request::Fence`; the connection checks the instance).
    Fence { instance: u128 },
    /// This connection speaks for plane view `epoch`: answer the unit's
    /// view (`Request::Epoch`).
    Epoch { epoch: u64, digest: u64 },
    /// Copy a reserved blob into the other copies' units' slabs, and
    /// answer `Forwarded` (`Request::CopyReserved`).
    CopyOut(CopyOut),
    /// Take `view` if it is newer than the unit's; answer the unit's view
    /// (`Request::SetView`).
    SetView { view: stowage_wire::PlaneView },
    /// Send `reply`, then end the connection (cut by the unit): `reason`.
    Close { reply: Response, reason: String },
    /// An invalid request: answer `InvalidRequest` with this message, log
    /// it, and end the connection.
    Refuse(String),
}

/// A Read whose values the core pinned: they are sent, then unpinned.
#[derive(Debug)]
pub struct Read {
    pub owner: Owner,
    pub pin: Option<PinId>,
    pub found: Vec<Option<Placed>>,
    /// How long the client lets the reply take (as [`Put::timeout_ms`]).
    pub timeout_ms: u64,
}

impl Read {
    /// Whether a value is read from the disk tier.
    pub fn has_disk(&self) -> bool {
        has_disk(&self.found)
    }
}

/// Whether any found value lies on the disk tier.
pub fn has_disk(found: &[Option<Placed>]) -> bool {
    found
        .iter()
        .flatten()
        .any(|(p, _)| matches!(p, Placement::Disk { .. }))
}

/// Plan `req`, from `asker`, carrying `payload_len` payload bytes. The
/// core is taken (`core()`, e.g. its lock) only for a request that acts on
/// it, and held until the plan is made.
pub fn handle<G: DerefMut<Target = UnitCore>>(
    core: impl FnOnce() -> G,
    asker: &Asker<'_>,
    req: Request,
    payload_len: u64,
    now: Time,
) -> Plan {
    if asker.fenced {
        let reply = error(ErrorCode::Fenced, FENCED.into());
        if payload_len > 0 {
            return Plan::Drain {
                len: payload_len,
                put_timeout_ms: None,
                reply,
            };
        }
        return Plan::Close {
            reply,
            reason: "fenced".into(),
        };
    }
    if asker.stale && req.needs_view() {
        return refused(error(ErrorCode::Stale, STALE.into()), payload_len);
    }
    let ((owner, namespace), req) = match (asker.hello, req) {
        (
            None,
            Request::Hello {
                version,
                namespace,
                want_fd,
                session,
            },
        ) => {
            if version != stowage_wire::PROTOCOL_VERSION {
                return Plan::Close {
                    reply: error(
                        ErrorCode::VersionMismatch,
                        format!(
                            "unit speaks protocol {}, client {version}",
                            stowage_wire::PROTOCOL_VERSION
                        ),
                    ),
                    reason: "protocol version mismatch".into(),
                };
            }
            return Plan::Hello {
                namespace,
                want_fd,
                session,
            };
        }
        (Some(_), Request::Hello { .. }) => {
            return Plan::Refuse("Hello was already said on this connection".into())
        }
        (None, _) => {
            return Plan::Close {
                reply: error(ErrorCode::Unauthorized, crate::auth::HELLO_FIRST.into()),
                reason: "no Hello".into(),
            }
        }
        (Some(hello), req) => (hello, req),
    };
    // A put written into a spare starts with its commit: new work too.
    let writes = match &req {
        Request::Alloc { .. }
        | Request::Put { .. }
        | Request::RepairPut { .. }
        | Request::ForwardPut { .. }
        | Request::CopyReserved { .. }
        | Request::Checkpoint { .. }
        | Request::CheckpointHomes { .. }
        | Request::OpenRestore { .. } => true,
        Request::CommitSpare { blob, written, .. } => blob != written,
        _ => false,
    };
    if writes && asker.stopping {
        let reply = error(ErrorCode::Internal, "the unit is shutting down".into());
        return refused(reply, payload_len);
    }
    let answer = |r: Result<Response, CoreError>| match r {
        Ok(r) => Plan::Reply(r),
        Err(e) => Plan::Reply(error_response(&e)),
    };
    match req {
        Request::Alloc {
            blob,
            nbytes,
            n_entries,
        } => {
            let mut core = core();
            let spares_back = core.spares_short();
            answer(
                alloc(&mut core, owner, blob, nbytes, n_entries, now).map(|a| match a {
                    Allocated::Reserved { pieces } => Response::Allocated {
                        pieces,
                        spares_back,
                    },
                    Allocated::ToDisk => Response::ToDisk,
                    Allocated::AlreadyCommitted => Response::AlreadyCommitted,
                }),
            )
        }
        Request::Commit {
            blob,
            partition,
            entries,
        } => put::commit(
            &mut core(),
            owner,
            scope(namespace, &partition),
            blob,
            entries,
            now,
        ),
        // A put under way when the unit began to stop may finish; it gets
        // no spare for another.
        Request::CommitSpare {
            blob,
            partition,
            entries,
            ..
        } if asker.stopping => put::commit(
            &mut core(),
            owner,
            scope(namespace, &partition),
            blob,
            entries,
            now,
        ),
        Request::CommitSpare {
            blob,
            written,
            partition,
            entries,
            spare,
            spare_nbytes,
        } => {
            let shm_bytes = put::entry_bytes(&entries);
            let op = op::CommitSpare {
                written,
                blob,
                partition: scope(namespace, &partition),
                entries,
                spare,
                spare_nbytes,
            };
            let mut core = core();
            let reply = match request(&mut core, now, owner, op) {
                Ok(SpareCommitted::AlreadyCommitted) => Response::AlreadyCommitted,
                Ok(SpareCommitted::Pending) => Response::Pending,
                Ok(SpareCommitted::Committed { spare }) => Response::CommittedSpare {
                    spare,
                    spares_back: core.spares_short(),
                },
                Err(e) => error_response(&e),
            };
            drop(core);
            Plan::Committed {
                blob,
                shm_bytes,
                reply,
            }
        }
        Request::Abort { blob, in_flight } => answer(
            request(&mut core(), now, owner, op::Abort { blob, in_flight }).map(|_| Response::Done),
        ),
        Request::Put {
            blob,
            partition,
            entries,
            timeout_ms,
        } => put::put(
            &mut core(),
            owner,
            scope(namespace, &partition),
            blob,
            entries,
            payload_len,
            timeout_ms,
            None,
            now,
        ),
        Request::RepairPut {
            window,
            blob,
            partition,
            entries,
            timeout_ms,
        } => put::put(
            &mut core(),
            owner,
            scope(namespace, &partition),
            blob,
            entries,
            payload_len,
            timeout_ms,
            Some(window),
            now,
        ),
        Request::ForwardPut {
            blob,
            partition,
            entries,
            timeout_ms,
            to,
            hop,
        } => {
            let mut plan = put::put(
                &mut core(),
                owner,
                scope(namespace, &partition),
                blob,
                entries,
                payload_len,
                timeout_ms,
                None,
                now,
            );
            if let Plan::Receive(put) = &mut plan {
                put.forward = Some(Forward {
                    to,
                    hop,
                    partition,
                    namespace: namespace.to_owned(),
                });
            }
            plan
        }
        Request::CopyReserved {
            blob,
            partition,
            entries,
            timeout_ms,
            to,
        } => {
            let nbytes = entries.iter().map(|e| e.offset + e.len).max().unwrap_or(0);
            match core().reserved_pieces(owner, blob) {
                Ok(pieces) if pieces.iter().map(|p| p.1).sum::<u64>() >= nbytes => {
                    Plan::CopyOut(CopyOut {
                        pieces,
                        nbytes,
                        forward: Forward {
                            to,
                            hop: 0,
                            partition,
                            namespace: namespace.to_owned(),
                        },
                        entries,
                        timeout_ms,
                    })
                }
                Ok(_) => Plan::Reply(error(
                    ErrorCode::InvalidRequest,
                    format!("the entries of blob {blob:?} lie past its reservation"),
                )),
                Err(e) => Plan::Reply(error_response(&e)),
            }
        }
        Request::OpenRepair { key } => {
            let op = op::OpenRepair {
                scope: scope(namespace, ""),
                key: key.clone(),
            };
            Plan::Reply(match request(&mut core(), now, owner, op) {
                Ok(window) => Response::RepairOpened { window },
                Err(CoreError::Busy { .. }) => error(
                    ErrorCode::Busy,
                    format!(
                        "another session holds a repair window for {key:?} in this namespace \
                         (or the unit holds {} windows)",
                        stowage_core::MAX_REPAIR_WINDOWS
                    ),
                ),
                Err(e) => error_response(&e),
            })
        }
        Request::CloseRepair { window } => answer(
            request(&mut core(), now, owner, op::CloseRepair { window }).map(|()| Response::Done),
        ),
        Request::Resolve {
            partition,
            keys,
            hold,
        } => {
            let keys = keys.into();
            resolved(core, owner, scope(namespace, &partition), keys, hold, now)
        }
        Request::ResolveRows {
            partition,
            rows,
            fields,
            hold,
        } => resolved(
            core,
            owner,
            scope(namespace, &partition),
            Keys::Grid { rows, fields },
            hold,
            now,
        ),
        Request::Read {
            partition,
            keys,
            timeout_ms,
        } => match resolve(
            &mut core(),
            owner,
            scope(namespace, &partition),
            keys.into(),
            false,
            now,
        ) {
            Ok((pin, found)) => Plan::Send(Read {
                owner,
                pin,
                found,
                timeout_ms,
            }),
            Err(e) => Plan::Reply(error_response(&e)),
        },
        Request::Unpin { pin, reply } => match unpin(&mut core(), owner, pin, now) {
            Ok(()) if !reply => Plan::Silent,
            r => answer(r.map(|()| Response::Done)),
        },
        Request::ClearRows { partition, rows } => answer(cleared(
            &mut core(),
            now,
            owner,
            op::ClearRows {
                partition: scope(namespace, &partition),
                rows,
            },
        )),
        Request::List { partition } => Plan::Reply(Response::Listed {
            rows: core().list(&scope(namespace, &partition)),
        }),
        Request::ClearPartition { partition } => answer(cleared(
            &mut core(),
            now,
            owner,
            op::ClearPartition {
                partition: scope(namespace, &partition),
            },
        )),
        Request::ListPartitions => {
            let prefix = scope(namespace, "");
            let names = core()
                .partitions(&prefix)
                .into_iter()
                .map(|n| n[prefix.len()..].to_owned())
                .collect();
            Plan::Reply(Response::Partitions { names })
        }
        Request::Stats => Plan::Stats,
        Request::NixlInfo {
            agent,
            agent_metadata,
        } => Plan::NixlInfo {
            owner,
            agent,
            agent_metadata,
        },
        Request::Shutdown { .. } if !asker.admin => {
            Plan::Reply(error(ErrorCode::Unauthorized, NOT_ADMIN.into()))
        }
        Request::Checkpoint { .. }
        | Request::CheckpointHomes { .. }
        | Request::OpenRestore { .. }
        | Request::CloseRestore { .. }
        | Request::Fence { .. }
        | Request::SetView { .. }
            if !asker.checkpoints =>
        {
            Plan::Reply(error(ErrorCode::Unauthorized, NOT_ADMIN.into()))
        }
        Request::Checkpoint { dir } => Plan::Checkpoint { dir, homes: None },
        Request::CheckpointHomes { dir, units, homes } => {
            match crate::checkpoint::homes::Homes::new(units, &homes) {
                Ok(h) => Plan::Checkpoint {
                    dir,
                    homes: Some(h),
                },
                Err(message) => Plan::Reply(error(ErrorCode::InvalidRequest, message)),
            }
        }
        Request::OpenRestore { dir } => Plan::OpenRestore { dir },
        Request::CloseRestore { id } => Plan::CloseRestore { id },
        Request::Shutdown { timeout_ms } => Plan::Shutdown {
            timeout: Duration::from_millis(timeout_ms),
        },
        Request::Fence { instance } => Plan::Fence { instance },
        Request::Epoch { epoch, digest } => Plan::Epoch { epoch, digest },
        Request::SetView { view } => Plan::SetView { view },
        // A connection's request ring: made (and its memfd handed over)
        // by the connection; a kick wakes the unit's polling of it.
        Request::OpenRing { bytes } => Plan::OpenRing { bytes },
        Request::RingKick => Plan::RingKick,
        req @ (Request::RegisterTasks { .. }
        | Request::Claim { .. }
        | Request::Settle { .. }
        | Request::ClaimStatus { .. }
        | Request::ClaimsState
        | Request::LoadClaims { .. }) => claims::plan(&mut core(), owner, namespace, req, now),
        other @ (Request::Hello { .. } | Request::Auth { .. } | Request::Prove { .. }) => {
            Plan::Refuse(format!("unexpected request {other:?}"))
        }
    }
}

/// A request refused before it acts with `reply`: its `payload_len`
/// payload bytes, if any, are taken and dropped first.
fn refused(reply: Response, payload_len: u64) -> Plan {
    if payload_len > 0 {
        return Plan::Drain {
            len: payload_len,
            put_timeout_ms: None,
            reply,
        };
    }
    Plan::Reply(reply)
}

/// What a unit answers a row request on a connection of another view of
/// the plane than its own.
pub const STALE: &str = "this connection speaks for another view of the plane than the unit's (a unit rejoined): take the unit's view (Epoch) and ask again";

/// What a fenced unit answers every request.
pub const FENCED: &str = "this unit was fenced: a client took it as down (its directory says it is dead), and it serves nothing any more";

/// Who may send admin requests, for those who may not.
pub const NOT_ADMIN: &str = "admin requests (shutdown, checkpoint) need a same-user client on the unit's Unix socket, or a unit started with --admin; checkpoints (and restores) are also taken from any client of a unit with a shared secret";

/// One request from `owner` to the core, through its one entry point. The
/// typed shorthands below are the ones the unit's request path and its
/// checkpoints use.
pub(crate) fn request<O: Op>(
    core: &mut UnitCore,
    now: Time,
    owner: Owner,
    op: O,
) -> Result<O::Answer, CoreError> {
    core.handle(now, stowage_core::Request { owner, op })
}

pub(crate) fn alloc(
    core: &mut UnitCore,
    owner: Owner,
    blob: BlobId,
    nbytes: u64,
    n_entries: u32,
    now: Time,
) -> Result<Allocated, CoreError> {
    let op = op::Alloc {
        blob,
        nbytes,
        n_entries,
    };
    request(core, now, owner, op)
}

/// The commit of a blob whose bytes the unit wrote (a Put's payload, a
/// restored checkpoint's blob).
pub(crate) fn commit_written(
    core: &mut UnitCore,
    owner: Owner,
    partition: String,
    blob: BlobId,
    entries: Vec<EntrySpec>,
    now: Time,
) -> Result<Committed, CoreError> {
    let op = op::CommitWritten {
        partition,
        blob,
        entries,
    };
    request(core, now, owner, op)
}

pub(crate) fn unpin(
    core: &mut UnitCore,
    owner: Owner,
    pin: PinId,
    now: Time,
) -> Result<(), CoreError> {
    request(core, now, owner, op::Unpin { pin }).map(|_| ())
}

/// A Resolve's plan: its values found and pinned (`view`: the client
/// keeps the pin as long as its caller wants, not a get that copies out
/// and unpins), or the core's refusal. The values of a grid of rows and
/// fields are answered in columns.
fn resolved<G: DerefMut<Target = UnitCore>>(
    core: impl FnOnce() -> G,
    owner: Owner,
    partition: String,
    keys: Keys,
    view: bool,
    now: Time,
) -> Plan {
    let mut core = core();
    let rows = matches!(keys, Keys::Grid { .. });
    match resolve(&mut core, owner, partition, keys, view, now) {
        Ok((pin, found)) => Plan::Resolved {
            pin,
            found,
            spares_back: core.spares_short(),
            rows,
        },
        Err(e) => Plan::Reply(error_response(&e)),
    }
}

fn resolve(
    core: &mut UnitCore,
    owner: Owner,
    partition: String,
    keys: Keys,
    view: bool,
    now: Time,
) -> Result<(Option<PinId>, Vec<Option<Placed>>), CoreError> {
    let op = op::Resolve {
        partition,
        keys,
        view,
    };
    let r = request(core, now, owner, op)?;
    Ok((r.pin, r.found))
}

/// A clear (rows or a partition): how many entries went.
fn cleared<O: Op<Answer = u64>>(
    core: &mut UnitCore,
    now: Time,
    owner: Owner,
    op: O,
) -> Result<Response, CoreError> {
    let entries = request(core, now, owner, op)?;
    Ok(Response::Cleared { entries })
}

/// A Read's values were sent (or their sending failed): the connection's
/// thread has stopped reading their ranges, so the pin may go.
pub fn read_sent(core: &mut UnitCore, read: &Read, now: Time) {
    if let Some(p) = read.pin {
        let _ = unpin(core, read.owner, p, now);
    }
}

fn error(code: ErrorCode, message: String) -> Response {
    Response::Error { code, message }
}

/// The wire form of a core refusal.
pub fn error_response(e: &CoreError) -> Response {
    let code = match e {
        CoreError::Full { .. } => ErrorCode::Full,
        CoreError::Busy { .. } => ErrorCode::Busy,
        CoreError::UnknownBlob(_) => ErrorCode::UnknownBlob,
        CoreError::Invalid(_) => ErrorCode::InvalidRequest,
        CoreError::NotOwner(_) => ErrorCode::NotOwner,
    };
    // The code says what kind of error it is; the client's error says
    // it again.
    let message = match e {
        CoreError::Invalid(m) => m.clone(),
        e => e.to_string(),
    };
    Response::Error { code, message }
}

/// The core partition of a request's `partition` in a connection's
/// `namespace`.
pub fn scope(namespace: &str, partition: &str) -> String {
    let mut s = String::with_capacity(namespace.len() + 1 + partition.len());
    s.push_str(namespace);
    s.push(PARTITION_SEPARATOR);
    s.push_str(partition);
    s
}

/// The answer to a NixlInfo: the unit's NIXL agent metadata and slab
/// address (`serving`; `None`: the unit serves no nixl) once `map_session`
/// made the asker's session one that moves bytes by itself.
pub fn nixl_info(
    serving: Option<(&Vec<u8>, u64)>,
    map_session: impl FnOnce() -> Result<(), CoreError>,
) -> Response {
    match serving {
        Some((metadata, slab_addr)) => match map_session() {
            Ok(()) => Response::NixlInfo {
                metadata: metadata.clone(),
                slab_addr,
            },
            Err(e) => error_response(&e),
        },
        None => Response::Error {
            code: ErrorCode::InvalidRequest,
            message: "this unit does not serve nixl (start it with --nixl)".into(),
        },
    }
}
