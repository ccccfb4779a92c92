//! One unit's failure as the client classifies it into the public [`Error`].

use std::sync::atomic::Ordering;
use std::time::Instant;

use stowage_wire::{BlobId, ErrorCode, Key};

use crate::transport::{ConnFailure, LocalFailure, OpFailure};
use crate::{error, lock, Client, Error, Liveness};

/// How one unit's part of an operation ended.
pub(crate) enum Outcome {
    Failed(Error),
    Busy,
}

impl Client {
    /// The error of a connection to unit `unit` that could not be made,
    /// as connecting reports it: [`Error::Unreachable`] when nothing
    /// answered at its address, [`Error::Timeout`] when it did not answer
    /// in time or kept refusing, the unit's or this client's refusal
    /// otherwise.
    pub(crate) fn unreached_error(&self, unit: usize, f: OpFailure) -> Error {
        match f {
            OpFailure::Conn {
                error: error @ (ConnFailure::Refusing(_) | ConnFailure::Timeout),
                ..
            } => Error::Timeout {
                unit: Some(unit),
                what: error.to_string(),
            },
            OpFailure::Conn { error, .. } => Error::Unreachable {
                unit,
                addr: self.units[unit].addr.to_string(),
                reason: error.to_string(),
            },
            OpFailure::Unit { code, message } => unit_error(unit, code, message, vec![]),
            OpFailure::Local(l) => local_error(unit, l, vec![]),
            OpFailure::Corrupt { .. } => {
                Error::Io(format!("unit {unit}: unexpected reply at connect"))
            }
        }
    }

    /// The error of waiting in vain for one of unit `unit`'s connections.
    pub(crate) fn wait_error(&self, unit: usize) -> Error {
        Error::Timeout {
            unit: Some(unit),
            what: format!(
                "all {} connections to the unit stayed in use until the deadline",
                self.max_conns()
            ),
        }
    }

    /// Turn a unit's failure into an [`Error`], asking the directory when
    /// the connection broke. `blobs`/`keys`: what the operation touched.
    pub(crate) fn classify(
        &self,
        unit: usize,
        f: OpFailure,
        blobs: Vec<BlobId>,
        keys: Vec<Key>,
        deadline: Instant,
    ) -> Outcome {
        // A unit never reached: its first connection failed (nothing of
        // this client's can be lost there).
        if matches!(f, OpFailure::Conn { .. }) && !self.units[unit].reached.load(Ordering::Acquire)
        {
            return Outcome::Failed(self.unreached_error(unit, f));
        }
        match f {
            OpFailure::Unit {
                code: ErrorCode::Busy,
                ..
            } => Outcome::Busy,
            OpFailure::Unit { code, message } => {
                Outcome::Failed(unit_error(unit, code, message, blobs))
            }
            OpFailure::Local(l) => Outcome::Failed(local_error(unit, l, blobs)),
            OpFailure::Corrupt { positions } => {
                let keys: Vec<Key> = positions
                    .iter()
                    .filter_map(|&i| keys.get(i).cloned())
                    .collect();
                Outcome::Failed(Error::Corrupt {
                    unit,
                    named: error::names(&keys),
                    keys,
                })
            }
            OpFailure::Conn {
                error: ConnFailure::Timeout,
                ..
            } => Outcome::Failed(Error::Timeout {
                unit: Some(unit),
                what: "no answer before the deadline".into(),
            }),
            // It answered (refusals), so it is alive: no probe.
            OpFailure::Conn {
                error: error @ ConnFailure::Refusing(_),
                ..
            } => Outcome::Failed(Error::Timeout {
                unit: Some(unit),
                what: error.to_string(),
            }),
            OpFailure::Conn { error, in_flight } => {
                let known = lock(&self.units[unit].instance).current.unwrap_or(0);
                let reason = match &error {
                    ConnFailure::Broken(m)
                    | ConnFailure::Protocol(m)
                    | ConnFailure::Refusing(m) => m.clone(),
                    ConnFailure::Timeout => "timeout".into(),
                };
                match self
                    .cfg
                    .directory
                    .liveness(unit, &self.units[unit].addr, known, deadline)
                {
                    Liveness::Dead | Liveness::Restarted => {
                        // Connections to the old instance are useless now,
                        // and its slab mapping only holds dead memory.
                        self.forget_instance(unit, None);
                        {
                            let mut i = lock(&self.units[unit].instance);
                            i.current = None;
                            i.lost = None;
                        }
                        *lock(&self.units[unit].session) = None;
                        Outcome::Failed(Error::LostKeys {
                            unit,
                            blobs,
                            named: error::names(&keys),
                            keys,
                        })
                    }
                    Liveness::Alive => Outcome::Failed(Error::TransferFailed {
                        unit,
                        blobs,
                        reason,
                        in_flight,
                    }),
                    Liveness::Unresponsive => Outcome::Failed(Error::Timeout {
                        unit: Some(unit),
                        what: format!("connection failed ({reason}) and the unit does not answer"),
                    }),
                }
            }
        }
    }
}

pub(crate) fn unit_error(
    unit: usize,
    code: ErrorCode,
    message: String,
    blobs: Vec<BlobId>,
) -> Error {
    match code {
        ErrorCode::Full => Error::UnitFull { unit, message },
        ErrorCode::InvalidRequest | ErrorCode::VersionMismatch => Error::InvalidRequest(message),
        ErrorCode::Unauthorized => Error::Unauthorized(message),
        ErrorCode::NotOwner => Error::NotOwner(message),
        ErrorCode::Busy | ErrorCode::UnknownBlob | ErrorCode::Internal => Error::TransferFailed {
            unit,
            blobs,
            reason: message,
            in_flight: false,
        },
    }
}

/// The error of a failure on this client's own side.
pub(crate) fn local_error(unit: usize, l: LocalFailure, blobs: Vec<BlobId>) -> Error {
    match l {
        LocalFailure::Invalid(message) => Error::InvalidRequest(message),
        LocalFailure::Distrust(message) => Error::Unauthorized(message),
        LocalFailure::Busy(reason) => Error::TransferFailed {
            unit,
            blobs,
            reason,
            in_flight: false,
        },
    }
}
