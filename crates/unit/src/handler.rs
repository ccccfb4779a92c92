//! The request handler past the frame decoder, for the requests that are
//! pure state changes of the core: no socket, no slab bytes, no disk. The
//! connection loop ([`crate::conn`]) calls it for those requests, and the
//! fuzz target drives it directly with request sequences from several
//! sessions.

use stowage_core::{Allocated, Committed, CoreError, Located, Owner, PinId, Time, UnitCore};
use stowage_wire::{ErrorCode, Request, Response, PARTITION_SEPARATOR};

/// What the handler made of a request.
pub enum Handled {
    /// Send this reply.
    Reply(Response),
    /// Send nothing (an Unpin with `reply: false`).
    Silent,
    /// A Resolve: the core pinned what it found; the connection brings
    /// spilled values back and replies.
    Resolved(Option<PinId>, Vec<Option<Located>>),
    /// Not a pure core request (Hello, Put, Read, Stats, Checkpoint,
    /// Shutdown): the connection handles it.
    Other(Request),
}

/// Apply `req` from `owner`, whose connection acts in namespace `ns`.
pub fn handle(core: &mut UnitCore, owner: Owner, ns: &str, req: Request, now: Time) -> Handled {
    let answer = |r: Result<Response, CoreError>| match r {
        Ok(r) => Handled::Reply(r),
        Err(e) => Handled::Reply(error_response(&e)),
    };
    match req {
        Request::Alloc {
            blob,
            nbytes,
            n_entries,
        } => answer(
            core.alloc(owner, blob, nbytes, n_entries, now)
                .map(|a| match a {
                    Allocated::Reserved { offset } => Response::Allocated { offset },
                    Allocated::ToDisk => Response::ToDisk,
                    Allocated::AlreadyCommitted => Response::AlreadyCommitted,
                }),
        ),
        Request::Commit { blob, .. } | Request::CommitSpare { blob, .. }
            if core.is_disk_reservation(owner.session, blob) =>
        {
            Handled::Reply(Response::Error {
                code: ErrorCode::InvalidRequest,
                message: format!(
                    "blob {blob:?} is reserved on the disk tier: send its bytes with Put"
                ),
            })
        }
        Request::Commit {
            blob,
            partition,
            entries,
        } => answer(
            core.commit(owner, &scope(ns, &partition), blob, &entries)
                .map(|c| match c {
                    Committed::Done => Response::Done,
                    Committed::Pending => Response::Pending,
                }),
        ),
        Request::CommitSpare {
            blob,
            written,
            partition,
            entries,
            spare,
            spare_nbytes,
        } => answer(
            core.name_spare(owner, written, blob, now)
                .and_then(|named| {
                    if !named {
                        return Ok(Response::AlreadyCommitted);
                    }
                    match core.commit(owner, &scope(ns, &partition), blob, &entries)? {
                        Committed::Pending => Ok(Response::Pending),
                        Committed::Done => core
                            .reserve_spare(owner, spare, spare_nbytes, now)
                            .map(|spare| Response::CommittedSpare { spare }),
                    }
                }),
        ),
        Request::Abort { blob, in_flight } => answer(
            core.abort(owner, blob, in_flight, now)
                .map(|()| Response::Done),
        ),
        Request::Resolve {
            partition, keys, ..
        } => match core.resolve_with_meta(owner, &scope(ns, &partition), &keys, now) {
            Ok((pin, found)) => Handled::Resolved(pin, found),
            Err(e) => Handled::Reply(error_response(&e)),
        },
        Request::Unpin { pin, reply } => match core.unpin(owner, pin) {
            Ok(()) if !reply => Handled::Silent,
            r => answer(r.map(|()| Response::Done)),
        },
        Request::ReleaseRows { partition, rows } => Handled::Reply(Response::Released {
            entries: core.release_rows(&scope(ns, &partition), &rows),
        }),
        Request::List { partition } => Handled::Reply(Response::Listed {
            rows: core.list(&scope(ns, &partition)),
        }),
        Request::DropPartition { partition } => Handled::Reply(Response::Released {
            entries: core.drop_namespace(&scope(ns, &partition)),
        }),
        Request::ListPartitions => {
            let prefix = scope(ns, "");
            let names = core
                .namespaces(&prefix)
                .into_iter()
                .map(|n| n[prefix.len()..].to_owned())
                .collect();
            Handled::Reply(Response::Partitions { names })
        }
        other => Handled::Other(other),
    }
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
    Response::Error {
        code,
        message: e.to_string(),
    }
}

/// The core namespace of a partition of a connection's namespace.
pub fn scope(ns: &str, partition: &str) -> String {
    let mut s = String::with_capacity(ns.len() + 1 + partition.len());
    s.push_str(ns);
    s.push(PARTITION_SEPARATOR);
    s.push_str(partition);
    s
}
