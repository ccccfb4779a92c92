//! `_native.LocalPlane`: unit processes on this machine
//! ([`stowage_local::LocalPlane`]), started with a command the Python
//! side chooses (`[sys.executable, "-m", "stowage", "unit"]`).

use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use stowage_local::{LocalOptions, LocalPlane as Plane};

use crate::errors::{invalid, Error};

/// Unit processes on this machine. Each listens on a Unix socket in a
/// private temporary directory and on a loopback TCP port, and exits when
/// its stdin (a pipe from this process) closes, so units never outlive
/// this process. `stop()` kills and reaps them. The plane has a shared
/// secret (the one given, else a fresh one) unless started `insecure`.
#[pyclass(module = "stowage._native", frozen)]
pub(crate) struct LocalPlane {
    plane: Mutex<Option<Plane>>,
    uds: Vec<String>,
    tcp: Vec<String>,
    pids: Vec<u32>,
    /// The units' instance ids (32 hex digits), as they reported them.
    instances: Vec<String>,
    secret: Option<stowage_client::Secret>,
    generated: bool,
}

/// A byte size: an int, or a string such as "256MiB".
pub(crate) fn size_arg(ob: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(n) = ob.extract::<u64>() {
        return Ok(n);
    }
    let s: String = ob
        .extract()
        .map_err(|_| invalid("a size is an int (bytes) or a str such as '256MiB'"))?;
    stowage_config::parse_size(&s).map_err(invalid)
}

#[pymethods]
impl LocalPlane {
    /// Start `units` units of `memory` bytes each, running `command` plus
    /// the unit's own arguments (`--memory`, `--listen`, `--exit-with-stdin`
    /// and `unit_args`). Waits up to `start_timeout` seconds for each to
    /// report ready. `secret` (bytes or str): the units' shared secret,
    /// handed to them in an owner-only file (never on their command line);
    /// default a fresh one for this plane (`secret` tells it), unless
    /// `insecure` (units without a secret: every local user can use their
    /// TCP listeners).
    #[new]
    #[pyo3(signature = (command, units, memory, unit_args = Vec::new(), start_timeout = 30.0, secret = None, insecure = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        command: Vec<String>,
        units: usize,
        memory: &Bound<'_, PyAny>,
        unit_args: Vec<String>,
        start_timeout: f64,
        secret: Option<&Bound<'_, PyAny>>,
        insecure: bool,
    ) -> PyResult<Self> {
        crate::logbridge::install();
        if units == 0 {
            return Err(invalid("a local plane needs at least one unit"));
        }
        let mut opts = LocalOptions::new(units, size_arg(memory)?);
        opts.command = command.into_iter().map(Into::into).collect();
        opts.unit_args = unit_args;
        opts.secret = secret.map(crate::client::secret_arg).transpose()?;
        opts.insecure = insecure;
        opts.start_timeout = Duration::try_from_secs_f64(start_timeout)
            .map_err(|_| invalid("start_timeout must be a non-negative number of seconds"))?;
        let plane = py
            .detach(|| Plane::start(&opts))
            .map_err(PyErr::new::<Error, _>)?;
        Ok(Self {
            uds: plane.uds_addrs().iter().map(|a| a.to_string()).collect(),
            tcp: plane.tcp_addrs().iter().map(|a| a.to_string()).collect(),
            pids: plane.units.iter().map(|u| u.pid()).collect(),
            instances: plane
                .units
                .iter()
                .map(|u| stowage_client::unit_directory::instance_hex(u.instance))
                .collect(),
            secret: plane.secret().cloned(),
            generated: plane.directory().secret_hex.is_some(),
            plane: Mutex::new(Some(plane)),
        })
    }

    /// The units' Unix-socket addresses (`unix:/path`; the shm transport).
    #[getter]
    fn uds_addrs(&self) -> Vec<String> {
        self.uds.clone()
    }

    /// The units' TCP addresses (`tcp:127.0.0.1:port`).
    #[getter]
    fn tcp_addrs(&self) -> Vec<String> {
        self.tcp.clone()
    }

    /// The units' shared secret (bytes), which this plane's clients prove;
    /// None for an insecure plane. Never print or log it.
    #[getter]
    fn secret<'py>(&self, py: Python<'py>) -> Option<Bound<'py, pyo3::types::PyBytes>> {
        self.secret
            .as_ref()
            .map(|s| pyo3::types::PyBytes::new(py, s.expose()))
    }

    /// Whether the plane generated its secret (then its directory carries
    /// it: no one else has it).
    #[getter]
    fn secret_generated(&self) -> bool {
        self.generated
    }

    /// The units' process ids.
    #[getter]
    fn pids(&self) -> Vec<u32> {
        self.pids.clone()
    }

    /// The units' instance ids (32 hex digits): a directory names them, so
    /// that a client tells a unit started again from the one it replaced.
    #[getter]
    fn instance_ids(&self) -> Vec<String> {
        self.instances.clone()
    }

    /// Whether the units are running (`stop()` not called yet).
    #[getter]
    fn running(&self) -> bool {
        lock(&self.plane).is_some()
    }

    /// Kill every unit (SIGKILL) and reap it. Idempotent.
    fn stop(&self, py: Python<'_>) {
        let plane = lock(&self.plane).take();
        if let Some(mut p) = plane {
            py.detach(move || p.stop());
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
