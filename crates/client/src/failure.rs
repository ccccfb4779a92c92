//! Failures: everything that goes wrong below the public API is one
//! [`Failure`], from the connection (`conn`) through a transport's
//! operation to the pool; `Client::classify` (`classify.rs`) turns it
//! into the public [`Error`], once.

use std::io;
use stowage_wire::{ErrorCode, Response};

#[cfg(doc)]
use crate::{Client, Error};

/// Why a connection, one unit's operation or getting a connection failed,
/// before the client classifies it. (`pub` only because the public
/// [`Transport`](crate::Transport) trait returns it; it cannot be named
/// outside this crate.)
#[derive(Debug)]
pub enum Failure {
    /// The deadline passed.
    Timeout,
    /// The connection broke or could not be made.
    Broken(io::Error),
    /// The unit sent something this client cannot parse, or named
    /// something it will not act on (a range outside its slab, pieces that
    /// do not hold the blob): the connection goes, with what it holds.
    Protocol(String),
    /// The unit kept refusing the connection (Busy, or cut during its
    /// handshake) until the deadline: why, the last time.
    Refusing(String),
    /// The unit answered with an error, or turned the connection away
    /// (too many connections, another user, a session it refused).
    Refused(ErrorCode, String),
    /// A connection failure (one of the four above) while payload bytes
    /// may still be on their way to the unit.
    InFlight(Box<Failure>),
    /// The disk files of some values failed their checks: `positions` in
    /// the operation's key list. The connection is fine.
    Corrupt { positions: Vec<usize> },
    /// This client refused the caller's input or sink: a value does not
    /// fit its buffer, too many entries in one blob, a view of a unit not
    /// reached over shm. Reported as [`Error::InvalidRequest`].
    Invalid(String),
    /// This client does not trust the unit: it did not prove the shared
    /// secret, runs as another user, or handed over a slab this client
    /// cannot map. Reported as [`Error::Unauthorized`].
    Distrust(String),
    /// The client's own machinery is not ready (a nixl buffer still held
    /// by a transfer); the connection is fine and the call may be retried.
    /// Reported as [`Error::TransferFailed`].
    Busy(String),
    /// Every connection the pool's bound allows stayed in use until the
    /// deadline. Reported as [`Error::Timeout`].
    NoFreeConnection,
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Failure::Timeout,
            _ => Failure::Broken(e),
        }
    }
}

impl Failure {
    /// A refusal on this client's side of the caller's input or sink.
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Failure::Invalid(message.into())
    }

    /// The unit named something this client will not act on.
    pub(crate) fn protocol(message: impl Into<String>) -> Self {
        Failure::Protocol(message.into())
    }

    /// A reply that is not the one asked for: the unit's error, or a
    /// protocol failure.
    pub(crate) fn unexpected(r: Response) -> Self {
        match r {
            Response::Error { code, message } => Failure::Refused(code, message),
            other => Failure::Protocol(format!("unexpected reply {other:?}")),
        }
    }

    /// This failure, happening while payload bytes may still be on their
    /// way to the unit: a connection failure is marked so (a refusal or a
    /// local failure is not: nothing is travelling then).
    pub(crate) fn in_flight(self) -> Self {
        if self.is_connection() && !matches!(self, Failure::InFlight(_)) {
            Failure::InFlight(Box::new(self))
        } else {
            self
        }
    }

    /// Whether the connection failed (rather than the unit or this client
    /// refusing).
    pub(crate) fn is_connection(&self) -> bool {
        matches!(
            self,
            Failure::Timeout
                | Failure::Broken(_)
                | Failure::Protocol(_)
                | Failure::Refusing(_)
                | Failure::InFlight(_)
        )
    }

    /// Whether the unit answered Busy.
    pub(crate) fn is_busy(&self) -> bool {
        matches!(self, Failure::Refused(ErrorCode::Busy, _))
    }

    /// Whether the connection the operation failed on may serve the next
    /// one: the unit refused a valid request (its state is known), or the
    /// client's own machinery was not ready. Not after a broken connection,
    /// nor after an invalid request or a refused sink (what is left on the
    /// connection is not known).
    pub(crate) fn keeps_connection(&self) -> bool {
        match self {
            Failure::Refused(code, _) => *code != ErrorCode::InvalidRequest,
            Failure::Busy(_) => true,
            _ => false,
        }
    }

    /// A connection failure's words, and whether bytes may be in flight.
    pub(crate) fn connection_text(&self) -> (String, bool) {
        match self {
            Failure::InFlight(f) => (f.connection_text().0, true),
            Failure::Timeout => ("no answer before the deadline".into(), false),
            Failure::Broken(e) => (format!("connection failed: {e}"), false),
            Failure::Protocol(m) => (format!("protocol error: {m}"), false),
            Failure::Refusing(m) => (format!("the unit kept refusing connections: {m}"), false),
            other => (format!("{other:?}"), false),
        }
    }

    /// A connection failure's reason, as a transfer failure names it.
    pub(crate) fn reason(&self) -> String {
        match self {
            Failure::InFlight(f) => f.reason(),
            Failure::Broken(e) => e.to_string(),
            Failure::Protocol(m) | Failure::Refusing(m) => m.clone(),
            _ => "timeout".into(),
        }
    }

    /// Whether this is a connection failure that ran out of time or kept
    /// being refused (the unit answered, or may yet: no probe).
    pub(crate) fn timed_out(&self) -> bool {
        match self {
            Failure::InFlight(f) => f.timed_out(),
            Failure::Timeout | Failure::Refusing(_) => true,
            _ => false,
        }
    }
}
