//! What the view calls of `_native.Client` share: pinning a view without
//! the GIL, and the numpy dtypes of a call's values.

use pyo3::prelude::*;
use stowage_client::{DType, Error as ClientError};

use crate::arrays::descr_for;
use crate::client::Client;
use crate::errors::{invalid, to_py};
use crate::read_sinks::ViewPins;
use crate::row_keys::row_keys;

impl Client {
    /// Pin `fields` of `keys` for a view (shm units only) and run `then`
    /// on it, all without the GIL; the pins as the Python object every
    /// array over the view keeps alive.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn view<'py, T: Send>(
        &self,
        py: Python<'py>,
        partition: &str,
        keys: &Bound<'py, PyAny>,
        fields: &[String],
        unit: Option<usize>,
        timeout: Option<f64>,
        then: impl FnOnce(&stowage_client::View) -> Result<T, ClientError> + Send,
    ) -> PyResult<(Bound<'py, ViewPins>, T)> {
        if !self.shm {
            return Err(invalid(
                "get_view needs the shm transport (units on this host, reached through unix: addresses)",
            ));
        }
        let deadline = self.deadline(timeout)?;
        let keys = row_keys(keys)?;
        let names: Vec<&str> = fields.iter().map(String::as_str).collect();
        let client = self.client()?;
        let (view, got) = py
            .detach(|| {
                let view = client.view(partition, &keys, &names, unit, deadline)?;
                let got = then(&view)?;
                Ok((view, got))
            })
            .map_err(|e| to_py(py, e, &keys))?;
        Ok((Bound::new(py, ViewPins { view: Some(view) })?, got))
    }
}

/// numpy dtypes of the values of one call, looked up once per dtype met.
pub(crate) struct Descrs<'py> {
    raw_bf16: bool,
    last: Option<(DType, Bound<'py, numpy::PyArrayDescr>)>,
}

impl<'py> Descrs<'py> {
    pub(crate) fn new(raw_bf16: bool) -> Self {
        Self {
            raw_bf16,
            last: None,
        }
    }

    pub(crate) fn get(
        &mut self,
        py: Python<'py>,
        dtype: DType,
    ) -> PyResult<Bound<'py, numpy::PyArrayDescr>> {
        match &self.last {
            Some((d, descr)) if *d == dtype => Ok(descr.clone()),
            _ => {
                let descr = descr_for(py, dtype, self.raw_bf16)?;
                self.last = Some((dtype, descr.clone()));
                Ok(descr)
            }
        }
    }
}
