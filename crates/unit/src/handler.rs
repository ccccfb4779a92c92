//! The request handler past the frame decoder, for the requests that are
//! pure state changes of the core: no socket, no slab bytes, no disk. The
//! connection loop ([`crate::conn`]) calls it for those requests, and the
//! fuzz target drives it directly with request sequences from several
//! sessions.

use stowage_core::{
    Allocated, Answer, Committed, CoreError, Input, Located, Op, Owner, PinId, SpareCommitted,
    Time, UnitCore,
};

use crate::unexpected;
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
    let mut op = |op: Op| core.handle(now, Input::Request { owner, op });
    let answer = |r: Result<Answer, CoreError>, f: &dyn Fn(Answer) -> Option<Response>| match r {
        Ok(a) => Handled::Reply(f(a.clone()).unwrap_or_else(|| error_response(&unexpected(&a)))),
        Err(e) => Handled::Reply(error_response(&e)),
    };
    match req {
        Request::Alloc {
            blob,
            nbytes,
            n_entries,
        } => answer(
            op(Op::Alloc {
                blob,
                nbytes,
                n_entries,
            }),
            &|a| match a {
                Answer::Allocated(Allocated::Reserved { offset }) => {
                    Some(Response::Allocated { offset })
                }
                Answer::Allocated(Allocated::ToDisk) => Some(Response::ToDisk),
                Answer::Allocated(Allocated::AlreadyCommitted) => Some(Response::AlreadyCommitted),
                _ => None,
            },
        ),
        Request::Commit {
            blob,
            partition,
            entries,
        } => answer(
            op(Op::Commit {
                partition: scope(ns, &partition),
                blob,
                entries,
            }),
            &|a| match a {
                Answer::Committed(Committed::Done) => Some(Response::Done),
                Answer::Committed(Committed::Pending) => Some(Response::Pending),
                _ => None,
            },
        ),
        Request::CommitSpare {
            blob,
            written,
            partition,
            entries,
            spare,
            spare_nbytes,
        } => answer(
            op(Op::CommitSpare {
                written,
                blob,
                partition: scope(ns, &partition),
                entries,
                spare,
                spare_nbytes,
            }),
            &|a| match a {
                Answer::SpareCommitted(SpareCommitted::AlreadyCommitted) => {
                    Some(Response::AlreadyCommitted)
                }
                Answer::SpareCommitted(SpareCommitted::Pending) => Some(Response::Pending),
                Answer::SpareCommitted(SpareCommitted::Committed { spare }) => {
                    Some(Response::CommittedSpare { spare })
                }
                _ => None,
            },
        ),
        Request::Abort { blob, in_flight } => {
            answer(op(Op::Abort { blob, in_flight }), &|_| Some(Response::Done))
        }
        Request::Resolve {
            partition, keys, ..
        } => match op(Op::Resolve {
            partition: scope(ns, &partition),
            keys,
        }) {
            Ok(Answer::Resolved { pin, found }) => Handled::Resolved(pin, found),
            Ok(other) => Handled::Reply(error_response(&unexpected(&other))),
            Err(e) => Handled::Reply(error_response(&e)),
        },
        Request::Unpin { pin, reply } => match op(Op::Unpin { pin }) {
            Ok(_) if !reply => Handled::Silent,
            r => answer(r, &|_| Some(Response::Done)),
        },
        Request::ReleaseRows { partition, rows } => answer(
            op(Op::ClearRows {
                partition: scope(ns, &partition),
                rows,
            }),
            &|a| match a {
                Answer::Cleared(entries) => Some(Response::Released { entries }),
                _ => None,
            },
        ),
        Request::List { partition } => Handled::Reply(Response::Listed {
            rows: core.list(&scope(ns, &partition)),
        }),
        Request::DropPartition { partition } => answer(
            op(Op::ClearPartition {
                partition: scope(ns, &partition),
            }),
            &|a| match a {
                Answer::Cleared(entries) => Some(Response::Released { entries }),
                _ => None,
            },
        ),
        Request::ListPartitions => {
            let prefix = scope(ns, "");
            let names = core
                .partitions(&prefix)
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
        CoreError::NotOwner(_) => ErrorCode::Unauthorized,
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
