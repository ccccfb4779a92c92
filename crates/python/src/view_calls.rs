//! What the view calls of `_native.Client` share: pinning a view without
//! the GIL, and the numpy dtypes of a call's values.

use pyo3::prelude::*;
use stowage_client::{DType, Error as ClientError};

use crate::arrays::descr_for;
use crate::client::Client;
use crate::errors::{invalid, to_py};
use crate::read_sinks::ViewPins;
use crate::row_keys::row_keys;

/// How a view call pins its values: `Client::view` or `Client::packed_view`
/// and what is made of them, given the client, the keys, the fields'
/// names, the unit asked for and the deadline.
pub(crate) type Pin<'a, T> = dyn FnOnce(
        &std::sync::Arc<stowage_client::Client>,
        &[stowage_client::RowKey],
        &[&str],
        Option<usize>,
        std::time::Instant,
    ) -> Result<(stowage_client::View, T), ClientError>
    + Send
    + 'a;

impl Client {
    /// Pin `fields` of `keys` for a view (shm units only) with `pin`, all
    /// without the GIL; the pins as the Python object every array over the
    /// view keeps alive, and what `pin` made of them.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn view<'py, T: Send>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        fields: &[String],
        unit: Option<usize>,
        timeout: Option<f64>,
        pin: Box<Pin<'_, T>>,
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
            .detach(|| pin(&client, &keys, &names, unit, deadline))
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
