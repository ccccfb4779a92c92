//! Repair from Python (docs/replication.md#repair): one pass now, the
//! rebuild after a one-copy restore, what newcomers lack, taking a unit
//! started again back in (rejoin), and the claims state a checkpoint with
//! copies loads into every unit. A client with copies also repairs
//! by itself in the background.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::time::Instant;

use stowage_client::{Client as Inner, Repaired};

use crate::client::Client;
use crate::errors::to_py;

fn repaired_dict<'py>(py: Python<'py>, r: Repaired) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("done", r.done)?;
    d.set_item("left", r.left)?;
    d.set_item("values", r.values)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("refused", r.skipped)?;
    d.set_item("errors", r.errors)?;
    Ok(d)
}

/// Run `call` on `client`'s native client without the GIL, reported as
/// [`repaired_dict`].
fn pass<'py>(
    py: Python<'py>,
    client: &Client,
    timeout: Option<f64>,
    call: impl FnOnce(&Inner, Instant) -> stowage_client::Result<Repaired> + Send,
) -> PyResult<Bound<'py, PyDict>> {
    let deadline = client.deadline(timeout)?;
    let c = client.client()?;
    let r = py
        .detach(|| call(&c, deadline))
        .map_err(|e| to_py(py, e, &[]))?;
    repaired_dict(py, r)
}

/// One repair pass of `client` (`Client::repair`): a dict of `done`,
/// `left`, `values`, `bytes`, `refused` and `errors`.
#[pyfunction]
#[pyo3(signature = (client, timeout = None))]
pub(crate) fn repair<'py>(
    py: Python<'py>,
    client: &Client,
    timeout: Option<f64>,
) -> PyResult<Bound<'py, PyDict>> {
    pass(py, client, timeout, |c, deadline| c.repair(deadline))
}

/// Every row's copies from whichever copy holds it
/// (`Client::rebuild_copies`), as [`repair`] reports it.
#[pyfunction]
#[pyo3(signature = (client, timeout = None))]
pub(crate) fn rebuild_copies<'py>(
    py: Python<'py>,
    client: &Client,
    timeout: Option<f64>,
) -> PyResult<Bound<'py, PyDict>> {
    pass(py, client, timeout, |c, deadline| {
        c.rebuild_copies(deadline)
    })
}

/// What each newcomer lacks (`Client::under_replicated`): dicts of
/// `unit`, `source`, `target`, `rows`, `values`.
#[pyfunction]
#[pyo3(signature = (client, timeout = None))]
pub(crate) fn under_replicated<'py>(
    py: Python<'py>,
    client: &Client,
    timeout: Option<f64>,
) -> PyResult<Bound<'py, PyList>> {
    let deadline = client.deadline(timeout)?;
    let c = client.client()?;
    let short = py
        .detach(|| c.under_replicated(deadline))
        .map_err(|e| to_py(py, e, &[]))?;
    let out = PyList::empty(py);
    for s in short {
        let d = PyDict::new(py);
        d.set_item("unit", s.unit)?;
        d.set_item("source", s.source)?;
        d.set_item("target", s.target)?;
        d.set_item("rows", s.rows)?;
        d.set_item("values", s.values)?;
        out.append(d)?;
    }
    Ok(out)
}

/// Take unit `unit` back into the plane as the instance started again at
/// its address (`Client::rejoin`, docs/replication.md#rejoining): a dict
/// of `unit`, `instance` (hex), `epoch`, `already`, `moved`, `unreached`
/// and `cleared`.
#[pyfunction]
#[pyo3(signature = (client, unit, timeout = None))]
pub(crate) fn rejoin<'py>(
    py: Python<'py>,
    client: &Client,
    unit: usize,
    timeout: Option<f64>,
) -> PyResult<Bound<'py, PyDict>> {
    let deadline = client.deadline(timeout)?;
    let c = client.client()?;
    let r = py
        .detach(|| c.rejoin(unit, deadline))
        .map_err(|e| to_py(py, e, &[]))?;
    let d = PyDict::new(py);
    d.set_item("unit", r.unit)?;
    d.set_item("instance", format!("{:032x}", r.instance))?;
    d.set_item("epoch", r.epoch)?;
    d.set_item("already", r.already)?;
    d.set_item("moved", r.moved)?;
    d.set_item("unreached", r.unreached)?;
    d.set_item("cleared", r.cleared)?;
    Ok(d)
}

/// One claims state for every unit of a plane with copies, from the
/// states (`Client.claims_state` bytes) of a checkpoint's parts
/// (`stowage_unit::merge_claims_states`): what a NeMo-RL checkpoint with
/// copies loads into each unit. `InvalidRequest` for bytes that are no
/// claims state, or parts that disagree on a partition's group size.
#[pyfunction]
pub(crate) fn merge_claims_states<'py>(
    py: Python<'py>,
    states: Vec<Vec<u8>>,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let views: Vec<&[u8]> = states.iter().map(Vec::as_slice).collect();
    let merged = stowage_unit::merge_claims_states(&views).map_err(crate::errors::invalid)?;
    Ok(pyo3::types::PyBytes::new(py, &merged))
}
