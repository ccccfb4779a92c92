//! Directories from Python: [`host_id`], [`resolve_directory`],
//! [`directory_replicas`], [`directory_hosts`], and
//! [`PyLiveness`], a [`Directory`] that asks a Python callable (the Ray
//! launcher's liveness check) whether a unit is dead — only after an
//! operation on it failed, never on the operation path.

use std::sync::Arc;
use std::time::Instant;

use pyo3::prelude::*;
use stowage_client::{
    Directory, Liveness, ProbeDirectory, Secret, TransportChoice, UnitAddr, UnitDirectory,
};

use crate::errors::invalid;

/// This process's host as directories name it (boot id and namespaces):
/// a unit with the same host id is reached through shared memory.
#[pyfunction]
pub(crate) fn host_id() -> String {
    stowage_client::host_id()
}

/// Check a directory (JSON text) and pick each unit's address for this
/// process: `transport` is "auto" (shared memory on this host, tcp
/// elsewhere), "shm" or "tcp". Returns `(addresses, instance ids)`, the
/// instance ids as 32 hex digits or None.
#[pyfunction]
#[pyo3(signature = (json, transport = "auto"))]
pub(crate) fn resolve_directory(
    json: &str,
    transport: &str,
) -> PyResult<(Vec<String>, Vec<Option<String>>)> {
    let choice: TransportChoice = transport.parse().map_err(invalid)?;
    let d = UnitDirectory::parse(json).map_err(invalid)?;
    let addrs = d
        .addrs(choice, &stowage_client::host_id())
        .map_err(invalid)?;
    Ok((
        addrs.iter().map(|a| a.to_string()).collect(),
        d.units.iter().map(|u| u.instance_id.clone()).collect(),
    ))
}

/// The host of each unit of the directory (JSON text), as listed (None:
/// not said).
#[pyfunction]
pub(crate) fn directory_hosts(json: &str) -> PyResult<Vec<Option<String>>> {
    let d = UnitDirectory::parse(json).map_err(invalid)?;
    Ok(d.units.iter().map(|u| u.host.clone()).collect())
}

/// The number of copies of every row a client of the directory (JSON
/// text) uses: the directory's (1 when it does not say), or `given`,
/// which must then be the directory's: every client of a plane uses the
/// same number.
#[pyfunction]
#[pyo3(signature = (json, given = None))]
pub(crate) fn directory_replicas(json: &str, given: Option<i64>) -> PyResult<usize> {
    let d = UnitDirectory::parse(json).map_err(invalid)?;
    match given {
        Some(n) if usize::try_from(n).ok() != Some(d.replicas) => Err(invalid(format!(
            "replicas={n} was given, but the plane's directory says {}: every client of a \
             plane must use the plane's number (leave replicas out to take it)",
            d.replicas
        ))),
        _ => Ok(d.replicas),
    }
}

/// Instance ids (32 hex digits each, or None) as a client expects them,
/// one for each of `units` units.
pub(crate) fn instance_ids(ids: &[Option<String>], units: usize) -> PyResult<Vec<Option<u128>>> {
    if ids.len() != units {
        return Err(invalid(format!(
            "{} instance ids for {units} units",
            ids.len()
        )));
    }
    ids.iter()
        .map(|s| {
            s.as_deref()
                .map(|h| {
                    u128::from_str_radix(h, 16)
                        .map_err(|_| invalid(format!("instance id {h:?} is not 32 hex digits")))
                })
                .transpose()
        })
        .collect()
}

/// A fresh shared secret for a data plane (64 hex digits, as bytes): what
/// the launchers generate when given none.
#[pyfunction]
pub(crate) fn generate_secret(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyBytes>> {
    let s = Secret::generate()
        .map_err(|e| PyErr::new::<crate::errors::Error, _>(format!("generating a secret: {e}")))?;
    Ok(pyo3::types::PyBytes::new(py, s.expose()))
}

/// The directory in the file at `path`, as JSON text: checked, and
/// refused when it holds a secret but group or others may read it.
#[pyfunction]
pub(crate) fn read_directory_file(path: std::path::PathBuf) -> PyResult<String> {
    Ok(UnitDirectory::from_file(&path).map_err(invalid)?.to_json())
}

/// Write a directory (JSON text) to `path`: owner-only (0600) when it
/// holds a secret, created new and renamed into place.
#[pyfunction]
pub(crate) fn write_directory_file(json: &str, path: std::path::PathBuf) -> PyResult<()> {
    let d = UnitDirectory::parse(json).map_err(invalid)?;
    d.write_file(&path).map_err(|e| {
        PyErr::new::<crate::errors::Error, _>(format!(
            "writing the directory to {}: {e}",
            path.display()
        ))
    })
}

/// The shared secret a directory (JSON text) carries, as bytes; None
/// without one.
#[pyfunction]
pub(crate) fn directory_secret<'py>(
    py: Python<'py>,
    json: &str,
) -> PyResult<Option<Bound<'py, pyo3::types::PyBytes>>> {
    let d = UnitDirectory::parse(json).map_err(invalid)?;
    Ok(d.secret()
        .map_err(invalid)?
        .map(|s| pyo3::types::PyBytes::new(py, s.expose())))
}

/// Liveness from a Python callable `f(unit_index) -> "dead" | "alive" |
/// "unknown"`, combined with a probe of the unit's address: "dead" is
/// believed at once; otherwise the probe tells a restarted instance from
/// the same one, and a unit the callable says is alive is never declared
/// dead by a probe that found nothing listening (it is reported slow).
pub(crate) struct PyLiveness {
    pub(crate) callable: Arc<Py<PyAny>>,
    pub(crate) probe: Arc<dyn Directory>,
}

impl PyLiveness {
    pub(crate) fn new(callable: Py<PyAny>) -> Self {
        Self {
            callable: Arc::new(callable),
            probe: Arc::new(ProbeDirectory::default()),
        }
    }
}

impl Directory for PyLiveness {
    fn liveness(
        &self,
        unit: usize,
        addr: &UnitAddr,
        instance: u128,
        deadline: Instant,
    ) -> Liveness {
        let said = ask(&self.callable, unit);
        if said == "dead" {
            return Liveness::Dead;
        }
        match self.probe.liveness(unit, addr, instance, deadline) {
            Liveness::Dead if said == "alive" => Liveness::Unresponsive,
            other => other,
        }
    }

    fn says_dead(&self, unit: usize) -> bool {
        ask(&self.callable, unit) == "dead"
    }

    fn with_secret(&self, secret: &Secret) -> Option<Arc<dyn Directory>> {
        // The probe proves the client's secret, as the client does.
        let probe = self.probe.with_secret(secret)?;
        Some(Arc::new(PyLiveness {
            callable: self.callable.clone(),
            probe,
        }))
    }
}

/// What the callable says of `unit`; "unknown" when it fails.
fn ask(callable: &Py<PyAny>, unit: usize) -> String {
    Python::attach(|py| {
        let r = callable.call1(py, (unit,));
        match r.and_then(|v| v.extract::<String>(py)) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(unit, "the liveness check failed: {e}");
                "unknown".into()
            }
        }
    })
}
