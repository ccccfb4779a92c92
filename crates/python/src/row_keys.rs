//! Row keys between Python and [`stowage_client::RowKey`].

use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString};
use stowage_client::RowKey;

use crate::errors::invalid;

/// Row keys from a list of ints and strs or a 1-D integer numpy array.
pub(crate) fn row_keys(ob: &Bound<'_, PyAny>) -> PyResult<Vec<RowKey>> {
    const HINT: &str = "row keys are ints in [0, 2**63) or strs";
    if ob.is_instance_of::<PyString>() {
        return Err(invalid(
            "keys must be a list of keys (or an int array), not one str",
        ));
    }
    let list;
    let ob = if let Ok(a) = ob.cast::<PyUntypedArray>() {
        let kind = a.dtype().kind();
        if a.ndim() != 1 || !(kind == b'i' || kind == b'u') {
            return Err(invalid(format!(
                "a key array must be 1-D of integers, not {}-D {}",
                a.ndim(),
                a.dtype()
            )));
        }
        list = a.call_method0("tolist")?;
        &list
    } else {
        ob
    };
    let iter = ob
        .try_iter()
        .map_err(|_| invalid(format!("keys must be a list: {HINT}")))?;
    let mut keys = Vec::with_capacity(ob.len().unwrap_or(0));
    for item in iter {
        let item = item?;
        if let Ok(s) = item.cast::<PyString>() {
            keys.push(RowKey::Name(s.to_string()));
            continue;
        }
        if item.is_instance_of::<PyBool>() {
            return Err(invalid(format!("bad key {item}: {HINT}, not bools")));
        }
        match item.extract::<u64>() {
            Ok(i) if i < 1 << 63 => keys.push(RowKey::Index(i)),
            _ => return Err(invalid(format!("bad key {item}: {HINT}"))),
        }
    }
    Ok(keys)
}

pub(crate) fn key_object<'py>(py: Python<'py>, k: &RowKey) -> PyResult<Bound<'py, PyAny>> {
    Ok(match k {
        RowKey::Index(i) => i.into_pyobject(py)?.into_any(),
        RowKey::Name(n) => PyString::new(py, n).into_any(),
    })
}
