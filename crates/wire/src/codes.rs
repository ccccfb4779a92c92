//! The error classes a unit reports.

use serde::{Deserialize, Serialize};

/// Error classes a unit reports. Only ever appended to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    /// Not enough memory, now or after pending reclamation.
    Full,
    /// Memory will free up shortly; retry with backoff.
    Busy,
    /// The blob is not reserved: never allocated, already committed or
    /// aborted, or given up when the session that held it ended (no timer
    /// takes a reservation away; docs/fencing.md).
    UnknownBlob,
    /// Malformed or contradictory request.
    InvalidRequest,
    /// The protocol versions differ.
    VersionMismatch,
    /// The connection did not say Hello first, did not prove the unit's
    /// shared secret, or was refused.
    Unauthorized,
    /// The unit failed internally (I/O); the request may be retried.
    Internal,
    /// The request names a reservation or pin that another session holds
    /// (the connection itself is accepted: see [`ErrorCode::Unauthorized`]).
    NotOwner,
    /// The unit was fenced ([`crate::Request::Fence`]): a client took it
    /// as down, and it serves nothing any more (it is exiting).
    Fenced,
    /// The connection speaks for another view of the plane than the
    /// unit's ([`crate::Request::Epoch`]): the placement of copies changed
    /// (a unit rejoined). Ask for the unit's view, take it (or, when
    /// the unit's is older, give it the newer), and ask again.
    Stale,
}
