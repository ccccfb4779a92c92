//! The exception hierarchy (`stowage.Error` and its subclasses) and the
//! mapping from [`stowage_client::Error`].

use std::collections::HashMap;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;
use stowage_client::rows::KEY_FIELD;
use stowage_client::{Error as ClientError, Key, RowKey};

create_exception!(
    stowage,
    Error,
    PyException,
    "Base class of every error raised by stowage. `retryable` tells whether the same call may succeed if made again."
);
create_exception!(
    stowage,
    UnitFull,
    Error,
    "A unit refused a put for lack of space (nothing stored is evicted); the message says what holds the memory (views of cleared or replaced values, and whether they are this client's own, reservations, spares, compaction). Clear rows or drop views, then retry. Attribute: unit."
);
create_exception!(
    stowage,
    TransferFailed,
    Error,
    "A transfer or a control call failed, but the unit still has what it had; the call may be retried. Attributes: unit, reason, in_flight (bytes of a put may still be travelling)."
);
create_exception!(
    stowage,
    LostKeys,
    Error,
    "A unit is gone (killed, or restarted with empty memory) and the keys it held are lost. Attributes: unit, keys (a list of (row, field) where row is the int or str key given)."
);
create_exception!(
    stowage,
    Timeout,
    Error,
    "The deadline passed before a unit answered (or while it kept answering Busy). Attribute: unit (None when unknown)."
);
create_exception!(
    stowage,
    NotFound,
    Error,
    "Keys that are not stored. Attribute: keys (a list of (row, field), every missing key)."
);
create_exception!(
    stowage,
    InvalidRequest,
    Error,
    "Malformed input (dtype, layout, counts, sizes) or a request a unit refused as invalid. Nothing was stored or changed."
);
create_exception!(
    stowage,
    Unreachable,
    Error,
    "Nothing answered at a unit's address when connecting (no unit runs there, its host is unreachable, or it did not answer in time); retryable. Attributes: unit, address, reason."
);
create_exception!(
    stowage,
    Unauthorized,
    Error,
    "A unit refused the connection (authentication: a wrong or missing secret, another user, an admin request this client may not make), or this client refused the unit."
);
create_exception!(
    stowage,
    NotOwner,
    Error,
    "A unit refused a request on a reservation or pin that another session holds (not an authentication failure: see Unauthorized)."
);
create_exception!(
    stowage,
    Corrupt,
    Error,
    "A unit's disk copy of these keys' values failed its checks (a corrupt or truncated file): their bytes are not returned, never wrong ones. Attributes: unit, keys (a list of (row, field))."
);
create_exception!(
    stowage,
    KeyCollision,
    Error,
    "Two string row keys hash to the same row: a value asked for under `requested` was put under the other name, `stored` (None when only its digest is known), or one put named both. No value of one is given as the other's; rename one of the two rows. Attributes: partition, requested, stored."
);
create_exception!(
    stowage,
    Io,
    Error,
    "A local I/O failure that is none of the other errors."
);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let base = py.get_type::<Error>();
    // Class-level defaults: errors raised from Python carry them too.
    base.setattr("retryable", false)?;
    base.setattr("unit", py.None())?;
    m.add("Error", base)?;
    m.add("UnitFull", py.get_type::<UnitFull>())?;
    m.add("TransferFailed", py.get_type::<TransferFailed>())?;
    m.add("LostKeys", py.get_type::<LostKeys>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    m.add("NotFound", py.get_type::<NotFound>())?;
    m.add("InvalidRequest", py.get_type::<InvalidRequest>())?;
    m.add("Unauthorized", py.get_type::<Unauthorized>())?;
    m.add("NotOwner", py.get_type::<NotOwner>())?;
    m.add("Unreachable", py.get_type::<Unreachable>())?;
    m.add("Corrupt", py.get_type::<Corrupt>())?;
    m.add("KeyCollision", py.get_type::<KeyCollision>())?;
    m.add("Io", py.get_type::<Io>())?;
    m.add_function(wrap_pyfunction!(_error_of, m)?)?;
    Ok(())
}

/// An `InvalidRequest` with `message`.
pub(crate) fn invalid(message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(|py| with_attrs(py.get_type::<InvalidRequest>(), message, false, &[]))
}

/// An exception of type `ty` with `message`, its `retryable` flag and
/// `attrs` set.
fn with_attrs(
    ty: Bound<'_, pyo3::types::PyType>,
    message: String,
    retryable: bool,
    attrs: &[(&str, Py<PyAny>)],
) -> PyErr {
    let py = ty.py();
    let err = PyErr::from_type(ty, message);
    let value = err.value(py);
    // Setting attributes on a fresh exception instance cannot fail short
    // of memory exhaustion; the error itself is still worth raising then.
    let _ = value.setattr("retryable", retryable);
    for (name, v) in attrs {
        let _ = value.setattr(*name, v.bind(py));
    }
    err
}

/// A Python object of `v` (ints, strings, bools: infallible).
fn obj<'py>(py: Python<'py>, v: impl IntoPyObjectExt<'py>) -> Py<PyAny> {
    v.into_py_any(py).unwrap_or_else(|_| py.None())
}

/// Turn a client error into its Python exception. `keys`: the row keys of
/// the call, so that lost or missing keys are reported as the caller named
/// them (an int or a str) rather than as internal row numbers.
pub(crate) fn to_py(py: Python<'_>, e: ClientError, keys: &[RowKey]) -> PyErr {
    let message = e.to_string();
    let retryable = e.is_retryable();
    let raise = |ty, attrs: &[(&str, Py<PyAny>)]| with_attrs(ty, message, retryable, attrs);
    match e {
        ClientError::UnitFull { unit, .. } => {
            raise(py.get_type::<UnitFull>(), &[("unit", obj(py, unit))])
        }
        ClientError::TransferFailed {
            unit,
            reason,
            in_flight,
            ..
        } => raise(
            py.get_type::<TransferFailed>(),
            &[
                ("unit", obj(py, unit)),
                ("reason", obj(py, reason)),
                ("in_flight", obj(py, in_flight)),
            ],
        ),
        ClientError::LostKeys {
            unit, keys: lost, ..
        } => raise(
            py.get_type::<LostKeys>(),
            &[("unit", obj(py, unit)), ("keys", key_list(py, &lost, keys))],
        ),
        ClientError::Timeout { unit, .. } => {
            raise(py.get_type::<Timeout>(), &[("unit", obj(py, unit))])
        }
        ClientError::NotFound { keys: missing, .. } => raise(
            py.get_type::<NotFound>(),
            &[("keys", key_list(py, &missing, keys))],
        ),
        ClientError::InvalidRequest(_) => raise(py.get_type::<InvalidRequest>(), &[]),
        ClientError::Unauthorized(_) => raise(py.get_type::<Unauthorized>(), &[]),
        ClientError::NotOwner(_) => raise(py.get_type::<NotOwner>(), &[]),
        ClientError::Unreachable { unit, addr, reason } => raise(
            py.get_type::<Unreachable>(),
            &[
                ("unit", obj(py, unit)),
                ("address", obj(py, addr)),
                ("reason", obj(py, reason)),
            ],
        ),
        ClientError::Corrupt {
            unit, keys: bad, ..
        } => raise(
            py.get_type::<Corrupt>(),
            &[("unit", obj(py, unit)), ("keys", key_list(py, &bad, keys))],
        ),
        ClientError::KeyCollision {
            partition,
            requested,
            stored,
        } => raise(
            py.get_type::<KeyCollision>(),
            &[
                ("partition", obj(py, partition)),
                ("requested", obj(py, requested)),
                ("stored", obj(py, stored)),
            ],
        ),
        ClientError::Io(_) => raise(py.get_type::<Io>(), &[]),
        // A variant added to the client's error later: the base class
        // until it gets its own (`_error_of` lists every variant).
        _ => raise(py.get_type::<Error>(), &[]),
    }
}

/// The exception [`to_py`] makes of an example of each variant of
/// [`stowage_client::Error`], by the variant's name: the tests check that
/// every variant has its own class, including those Python cannot provoke
/// (a hash collision of two row keys, a local I/O failure).
#[pyfunction]
fn _error_of(py: Python<'_>, variant: &str) -> PyResult<Py<PyAny>> {
    let unit = 0;
    let key = || vec![Key::new(1, "f")];
    let e = match variant {
        "UnitFull" => ClientError::UnitFull {
            unit,
            message: "full".into(),
        },
        "TransferFailed" => ClientError::TransferFailed {
            unit,
            blobs: vec![],
            reason: "cut".into(),
            in_flight: false,
        },
        "LostKeys" => ClientError::LostKeys {
            unit,
            blobs: vec![],
            keys: key(),
            named: vec![],
        },
        "Timeout" => ClientError::Timeout {
            unit: Some(unit),
            what: "a reply".into(),
        },
        "NotFound" => ClientError::NotFound {
            keys: key(),
            named: vec![],
        },
        "Corrupt" => ClientError::Corrupt {
            unit,
            keys: key(),
            named: vec![],
        },
        "KeyCollision" => ClientError::KeyCollision {
            partition: "p".into(),
            requested: "a".into(),
            stored: Some("b".into()),
        },
        "InvalidRequest" => ClientError::InvalidRequest("bad".into()),
        "Unauthorized" => ClientError::Unauthorized("who".into()),
        "NotOwner" => ClientError::NotOwner("theirs".into()),
        "Unreachable" => ClientError::Unreachable {
            unit,
            addr: "tcp:127.0.0.1:1".into(),
            reason: "refused".into(),
        },
        "Io" => ClientError::Io("disk".into()),
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "no variant {other:?} of stowage_client::Error"
            )))
        }
    };
    Ok(to_py(py, e, &[]).into_value(py).into_any())
}

/// `[(row, field), ...]` with each row as the caller named it.
fn key_list(py: Python<'_>, lost: &[Key], request: &[RowKey]) -> Py<PyAny> {
    let names: HashMap<u64, &RowKey> = request
        .iter()
        .filter_map(|k| k.row_id().ok().map(|r| (r, k)))
        .collect();
    let items: Vec<(Py<PyAny>, Py<PyAny>)> = lost
        .iter()
        // A string row's name is an entry of its own: not the caller's.
        .filter(|k| k.field != KEY_FIELD)
        .map(|k| {
            let row = match names.get(&k.row) {
                Some(RowKey::Name(n)) => obj(py, n.as_str()),
                _ => obj(py, k.row),
            };
            (row, obj(py, k.field.as_str()))
        })
        .collect();
    obj(py, items)
}
