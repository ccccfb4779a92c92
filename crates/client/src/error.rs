//! The client's errors, grouped by cause, with retryability in the type.

use stowage_wire::{BlobId, Key};

/// What went wrong with an operation. See [`Error::is_retryable`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The unit refused for lack of space (memory is taken by committed or
    /// pinned data). Clear rows, then retry.
    #[error("unit {unit} is full: {message}")]
    UnitFull { unit: usize, message: String },
    /// A transfer or a control call failed, but the unit still has whatever
    /// it had: the operation may be retried. `in_flight`: bytes of a put may
    /// still be travelling to the unit.
    #[error(
        "transfer to unit {unit} failed ({reason}); blobs {}{}",
        blob_list(blobs),
        if *in_flight { "; bytes may still be in flight" } else { "" }
    )]
    TransferFailed {
        unit: usize,
        blobs: Vec<BlobId>,
        reason: String,
        in_flight: bool,
    },
    /// The unit is gone (dead, or restarted with empty memory): the keys
    /// (and blobs) it held are lost. `named`: the keys as the caller named them
    /// (`"row@field"`, or `"uid@field"` for string row keys).
    #[error("unit {unit} is gone; lost {} keys and {} blobs", keys.len(), blobs.len())]
    LostKeys {
        unit: usize,
        blobs: Vec<BlobId>,
        keys: Vec<Key>,
        named: Vec<String>,
    },
    /// The deadline passed before the unit answered (or while it kept
    /// answering Busy).
    #[error("deadline passed waiting for {}: {what}", unit.map_or_else(|| "the units".to_owned(), |u| format!("unit {u}")))]
    Timeout { unit: Option<usize>, what: String },
    /// Keys that are not stored (every missing key is named; `named` as
    /// the caller named them).
    #[error("{} keys not found: {}", keys.len(), preview(named))]
    NotFound { keys: Vec<Key>, named: Vec<String> },
    /// The unit's disk copy of these keys' blob failed its checks (corrupt
    /// or truncated file): their bytes are not returned, never wrong.
    #[error("unit {unit}: stored copy of {} keys is corrupt: {}", keys.len(), preview(named))]
    Corrupt {
        unit: usize,
        keys: Vec<Key>,
        named: Vec<String>,
    },
    /// Two string row keys hash to the same row id, and a value asked for
    /// under `requested` was put under the other name, `stored` (`None`
    /// when that name is known only by its digest, being longer than
    /// [`crate::rows::MAX_TAGGED_NAME`] bytes); no byte of it is returned.
    /// Also: one put named both. A put of a colliding name replaces the
    /// other's values of the same fields; rename one of the two rows.
    #[error(
        "row key {requested:?} of partition {partition:?} shares a row with {} (hash collision); no value of one is given as the other's",
        stored.as_deref().map_or_else(|| "another name".to_owned(), |s| format!("{s:?}"))
    )]
    KeyCollision {
        partition: String,
        requested: String,
        stored: Option<String>,
    },
    /// Malformed input or a request the unit refused as invalid.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The connection was refused: the unit did not accept this client
    /// (a wrong or missing shared secret, another user, an admin request
    /// from a client that may not make it), or this client did not accept
    /// the unit (it did not prove the secret, it runs as another user).
    /// Authentication only: see [`Error::NotOwner`].
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    /// The unit accepted the connection but refused a request on something
    /// another session holds (a reservation or a pin it took).
    #[error("not the owner: {0}")]
    NotOwner(String),
    /// Nothing answered at a unit's address when the client connected (no
    /// process listens there, the host is unreachable, or it did not
    /// answer in time). Its data, if any, is not known to be lost: check
    /// the address, or that the unit runs.
    #[error("cannot reach unit {unit} at {addr}: {reason}")]
    Unreachable {
        unit: usize,
        addr: String,
        reason: String,
    },
    /// A local I/O failure that is none of the above.
    #[error("i/o: {0}")]
    Io(String),
}

fn blob_list(blobs: &[BlobId]) -> String {
    if blobs.is_empty() {
        return "none".into();
    }
    let mut s: Vec<String> = blobs.iter().take(4).map(|b| b.to_string()).collect();
    if blobs.len() > 4 {
        s.push(format!("… {} more", blobs.len() - 4));
    }
    s.join(", ")
}

fn preview(keys: &[String]) -> String {
    let mut s: Vec<String> = keys.iter().take(8).cloned().collect();
    if keys.len() > 8 {
        s.push(format!("… {} more", keys.len() - 8));
    }
    s.join(", ")
}

/// The text form of keys, `"row@field"`.
pub(crate) fn names(keys: &[Key]) -> Vec<String> {
    keys.iter().map(|k| k.to_string()).collect()
}

impl Error {
    /// The unit the error is about, where it names one.
    pub fn unit(&self) -> Option<usize> {
        match self {
            Error::UnitFull { unit, .. }
            | Error::TransferFailed { unit, .. }
            | Error::LostKeys { unit, .. }
            | Error::Corrupt { unit, .. }
            | Error::Unreachable { unit, .. } => Some(*unit),
            Error::Timeout { unit, .. } => *unit,
            _ => None,
        }
    }

    /// Whether the same call may succeed if made again (with the same blob
    /// ids: they make the retry idempotent).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::TransferFailed { .. }
                | Error::Timeout { .. }
                | Error::UnitFull { .. }
                | Error::Unreachable { .. }
        )
    }
}

pub type Result<T> = std::result::Result<T, Error>;
