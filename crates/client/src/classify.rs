//! Failure classification: a [`Failure`] becomes the public [`Error`]
//! here and nowhere else, asking the unit's [`crate::Directory`] whether it
//! is dead, restarted or alive when a connection broke.

use std::sync::atomic::Ordering;
use std::time::Instant;

use std::collections::HashMap;

use stowage_wire::{BlobId, ErrorCode, Key, Response};

use crate::failure::Failure;
use crate::values::RowKey;
use crate::{error, lock, Client, Error, Liveness};

impl Client {
    /// The error of a connection to unit `unit` that could not be made,
    /// as connecting reports it: [`Error::Unreachable`] when nothing
    /// answered at its address, [`Error::Timeout`] when it did not answer
    /// in time or kept refusing, the unit's or this client's refusal
    /// otherwise.
    pub(crate) fn unreached_error(&self, unit: usize, f: Failure) -> Error {
        if f.is_connection() {
            let (text, _) = f.connection_text();
            return if f.timed_out() {
                Error::Timeout {
                    unit: Some(unit),
                    what: text,
                }
            } else {
                Error::Unreachable {
                    unit,
                    addr: self.units[unit].addr.to_string(),
                    reason: text,
                }
            };
        }
        match f {
            Failure::Corrupt { .. } => {
                Error::Io(format!("unit {unit}: unexpected reply at connect"))
            }
            other => self.refusal_error(unit, other, vec![]),
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
    /// (Busy is the caller's to retry: here it is a transfer failure.)
    pub(crate) fn classify(
        &self,
        unit: usize,
        f: Failure,
        blobs: Vec<BlobId>,
        keys: Vec<Key>,
        deadline: Instant,
    ) -> Error {
        // A unit never reached: its first connection failed (nothing of
        // this client's can be lost there).
        if f.is_connection() && !self.units[unit].reached.load(Ordering::Acquire) {
            // With copies, a unit other clients may have put copies on:
            // one found dead is gone for this client too (its copies go
            // to the next unit up), and what it held is lost.
            if self.replicas() > 1 {
                let dead = if f.timed_out() {
                    self.cfg.directory.says_dead(unit)
                } else {
                    let addr = &self.units[unit].addr;
                    self.cfg.directory.liveness(unit, addr, 0, deadline) == Liveness::Dead
                };
                if dead {
                    self.take_down_on_word(unit, deadline);
                    return Error::LostKeys {
                        unit,
                        blobs,
                        named: error::names(&keys),
                        keys,
                    };
                }
            }
            return self.unreached_error(unit, f);
        }
        if !f.is_connection() {
            return match f {
                // The unit has another view of the plane (a unit rejoined):
                // learn it; the operation, asked again, goes where the
                // copies are now.
                Failure::Refused(ErrorCode::Stale, message) => {
                    self.view_refused(unit, deadline);
                    Error::TransferFailed {
                        unit,
                        blobs,
                        reason: message,
                        in_flight: false,
                    }
                }
                // Fenced by another client: gone as a dead unit is.
                Failure::Refused(ErrorCode::Fenced, _) => {
                    self.unit_down(unit);
                    self.gone_error(unit, blobs, keys)
                }
                Failure::Corrupt { positions } => {
                    let keys: Vec<Key> = positions
                        .iter()
                        .filter_map(|&i| keys.get(i).cloned())
                        .collect();
                    Error::Corrupt {
                        unit,
                        named: error::names(&keys),
                        keys,
                    }
                }
                other => self.refusal_error(unit, other, blobs),
            };
        }
        // It answered (refusals), or ran out of time: no probe. With
        // copies, a unit that ran out of time which the directory's word
        // says is dead (Ray's, for a host lost) is gone: fenced once it
        // answers, and nothing waits for it.
        if f.timed_out() {
            if self.replicas() > 1 && self.cfg.directory.says_dead(unit) {
                self.take_down_on_word(unit, deadline);
                return self.gone_error(unit, blobs, keys);
            }
            return Error::Timeout {
                unit: Some(unit),
                what: f.connection_text().0,
            };
        }
        let (_, in_flight) = f.connection_text();
        let reason = f.reason();
        let known = lock(&self.units[unit].instance).current.unwrap_or(0);
        match self
            .cfg
            .directory
            .liveness(unit, &self.units[unit].addr, known, deadline)
        {
            live @ (Liveness::Dead | Liveness::Restarted) => {
                // With copies, nothing goes there any more: a unit said
                // dead that may still serve is fenced first.
                if live == Liveness::Dead {
                    self.take_down_on_word(unit, deadline);
                } else {
                    self.unit_down(unit);
                }
                self.gone_error(unit, blobs, keys)
            }
            Liveness::Alive => Error::TransferFailed {
                unit,
                blobs,
                reason,
                in_flight,
            },
            Liveness::Unresponsive => Error::Timeout {
                unit: Some(unit),
                what: format!("connection failed ({reason}) and the unit does not answer"),
            },
        }
    }

    /// A unit gone (dead, restarted, fenced): its keys `keys` are lost
    /// there. Connections to its old instance are useless, and its slab
    /// mapping only holds dead memory: both go.
    fn gone_error(&self, unit: usize, blobs: Vec<BlobId>, keys: Vec<Key>) -> Error {
        self.forget_instance(unit, None);
        {
            let mut i = lock(&self.units[unit].instance);
            i.current = None;
            i.lost = None;
        }
        *lock(&self.units[unit].session) = None;
        Error::LostKeys {
            unit,
            blobs,
            named: error::names(&keys),
            keys,
        }
    }

    /// The error of a refusal, by the unit or by this client (a failure
    /// that is not the connection's).
    fn refusal_error(&self, unit: usize, f: Failure, blobs: Vec<BlobId>) -> Error {
        match f {
            Failure::Refused(code, message) => unit_error(unit, code, message, blobs),
            Failure::Invalid(message) => Error::InvalidRequest(message),
            Failure::Distrust(message) => Error::Unauthorized(message),
            Failure::Busy(reason) => Error::TransferFailed {
                unit,
                blobs,
                reason,
                in_flight: false,
            },
            Failure::NoFreeConnection => self.wait_error(unit),
            other => Error::Io(format!("unit {unit}: {other:?}")),
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
        ErrorCode::Fenced => Error::Unreachable {
            unit,
            addr: String::new(),
            reason: message,
        },
        ErrorCode::Busy | ErrorCode::UnknownBlob | ErrorCode::Internal | ErrorCode::Stale => {
            Error::TransferFailed {
                unit,
                blobs,
                reason: message,
                in_flight: false,
            }
        }
    }
}

/// A unit named a value this client will not read (outside its slab, or
/// parts that are not the value).
pub(crate) fn unexpected_found(unit: usize, message: String) -> Error {
    Error::TransferFailed {
        unit,
        blobs: vec![],
        reason: format!("protocol error: Resolved: {message}"),
        in_flight: false,
    }
}

pub(crate) fn unexpected(unit: usize, r: Response) -> Error {
    match r {
        Response::Error { code, message } => {
            crate::classify::unit_error(unit, code, message, vec![])
        }
        other => Error::TransferFailed {
            unit,
            blobs: vec![],
            reason: format!("unexpected reply {other:?}"),
            in_flight: false,
        },
    }
}

/// Rename wire keys in an error to the caller's row keys.
pub(crate) fn name_keys(e: Error, keys: &[RowKey]) -> Error {
    let names: HashMap<u64, &RowKey> = keys
        .iter()
        .filter_map(|k| k.row_id().ok().map(|r| (r, k)))
        .collect();
    let rename = |ks: &[Key]| -> Vec<String> {
        ks.iter()
            .map(|k| match names.get(&k.row) {
                Some(rk) => format!("{rk}@{}", k.field),
                None => k.to_string(),
            })
            .collect()
    };
    match e {
        Error::NotFound { keys: ks, .. } => Error::NotFound {
            named: rename(&ks),
            keys: ks,
        },
        Error::LostKeys {
            unit,
            blobs,
            keys: ks,
            ..
        } => Error::LostKeys {
            unit,
            blobs,
            named: rename(&ks),
            keys: ks,
        },
        Error::Corrupt { unit, keys: ks, .. } => Error::Corrupt {
            unit,
            named: rename(&ks),
            keys: ks,
        },
        other => other,
    }
}
