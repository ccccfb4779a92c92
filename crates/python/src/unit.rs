//! `_native.Unit`: a storage unit inside the calling process.
//!
//! [`stowage_unit::start`] runs the server on its own Rust threads (accept
//! loops, one thread per connection, the ticker, the disk tier's spiller
//! and flusher), so the Python thread that made the unit returns at once
//! and keeps serving whatever else the process does: a Ray actor answers
//! Ray calls while its unit serves clients.
//!
//! Teardown is explicit ([`Unit::stop`]): the unit's own admin request
//! (Shutdown, over its Unix socket) stops it within the caller's timeout
//! and reports what could not be done, then the listeners close and the
//! socket's private directory is removed. A process killed without it
//! leaves its disk directory behind, locked by nothing; the next unit
//! started under the same disk root removes it.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::PyDict;
use stowage_client::{Client as Inner, ClientConfig, Secret, UnitAddr};
use stowage_unit::{UnitConfig, UnitHandle};

use crate::client::secret_arg;
use crate::dicts::stats_dict;
use crate::errors::{invalid, to_py, Error};
use crate::local::size_arg;

/// How long `stop` waits for the listeners to close when the Shutdown
/// request used up the whole timeout (the unit has stopped taking work by
/// then; closing the listeners takes microseconds).
const CLOSE_FLOOR: Duration = Duration::from_millis(500);

/// A unit running on threads of this process. `stop()` (or dropping the
/// object) tears it down; a process that exits without it leaves its disk
/// directory for the next unit under the same root to remove.
#[pyclass(module = "stowage._native", frozen)]
pub(crate) struct Unit {
    running: Mutex<Option<Running>>,
    /// The shared secret, which its own admin client proves too.
    secret: Option<Secret>,
    instance_id: u128,
    uds: PathBuf,
    tcp: Option<std::net::SocketAddr>,
    metrics: Option<std::net::SocketAddr>,
}

struct Running {
    handle: Arc<UnitHandle>,
    /// The private directory of the Unix socket, when the unit made it.
    socket_dir: Option<tempfile::TempDir>,
}

/// Seconds as a duration, for a keyword argument called `what`.
fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| invalid(format!("{what} must be a non-negative number of seconds")))
}

/// An address given as `tcp:host:port` or `host:port`.
fn tcp_arg(s: &str) -> PyResult<std::net::SocketAddr> {
    match s.parse::<UnitAddr>() {
        Ok(UnitAddr::Tcp(a)) => Ok(a),
        _ => Err(invalid(format!(
            "tcp must be an address such as '127.0.0.1:0' (port 0: any free port), not {s:?}"
        ))),
    }
}

#[pymethods]
impl Unit {
    /// Start a unit of `memory` bytes (an int or e.g. "1GiB") in this
    /// process. It listens on a Unix socket (`uds`: its path; default one
    /// in a fresh owner-only directory that `stop` removes) and, with
    /// `tcp` (e.g. "127.0.0.1:0"), on TCP as well. `disk`: the disk
    /// tier's root (the unit works in its own locked subdirectory, removed
    /// at stop). Leases, `frame_timeout` and `handshake_timeout` in
    /// seconds; connection, session, handshake and hold limits default to
    /// the unit's. `threads`: the unit's serving threads (default 0: one
    /// per core). `checkpoint_root`: checkpoints are
    /// written only under it (without it the unit refuses them).
    /// `huge_pages`: the slab's page mode, "auto" (default), "hugetlb",
    /// "thp" or "4k" (see `stowage unit --huge-pages`). `spare_budget`
    /// (bytes or a size string): the slab's spare zone, where the
    /// reservations same-host clients keep for their next puts come from
    /// (default 1/16 of `memory`; 0: no spares).
    /// `secret` (bytes or str) or `secret_file` (an owner-only file, read
    /// here): the shared secret every client must prove (the environment
    /// is not read here). With `tcp` and neither, a fresh secret is
    /// generated (the `secret` attribute tells it) unless `insecure=True`,
    /// which serves TCP without one: every local user, and anyone who
    /// reaches the address, can then read, overwrite and clear every
    /// value.
    #[new]
    #[pyo3(signature = (
        memory,
        *,
        name = "unit".to_string(),
        tcp = None,
        uds = None,
        disk = None,
        disk_capacity = None,
        high_watermark = 0.9,
        low_watermark = 0.8,
        reservation_lease = 30.0,
        pin_lease = 30.0,
        checkpoint_root = None,
        mlock = true,
        huge_pages = "auto".to_string(),
        spare_budget = None,
        max_connections = None,
        max_sessions = None,
        threads = None,
        max_handshakes = None,
        max_handshakes_per_source = None,
        max_session_connections = None,
        max_session_holds = None,
        frame_timeout = None,
        handshake_timeout = None,
        secret = None,
        secret_file = None,
        insecure = false,
        metrics = true,
        metrics_listen = None,
        nixl = false,
        require_rdma = true,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        memory: &Bound<'_, PyAny>,
        name: String,
        tcp: Option<String>,
        uds: Option<String>,
        disk: Option<PathBuf>,
        disk_capacity: Option<&Bound<'_, PyAny>>,
        high_watermark: f64,
        low_watermark: f64,
        reservation_lease: f64,
        pin_lease: f64,
        checkpoint_root: Option<PathBuf>,
        mlock: bool,
        huge_pages: String,
        spare_budget: Option<&Bound<'_, PyAny>>,
        max_connections: Option<usize>,
        max_sessions: Option<usize>,
        threads: Option<usize>,
        max_handshakes: Option<usize>,
        max_handshakes_per_source: Option<usize>,
        max_session_connections: Option<usize>,
        max_session_holds: Option<usize>,
        frame_timeout: Option<f64>,
        handshake_timeout: Option<f64>,
        secret: Option<&Bound<'_, PyAny>>,
        secret_file: Option<PathBuf>,
        insecure: bool,
        metrics: bool,
        metrics_listen: Option<String>,
        nixl: bool,
        require_rdma: bool,
    ) -> PyResult<Self> {
        crate::logbridge::install();
        let mut cfg = UnitConfig::new(name, size_arg(memory)?);
        if nixl {
            cfg.nixl = Some(stowage_unit::NixlConfig {
                require_rdma,
                ..Default::default()
            });
        }
        cfg.metrics = metrics;
        if !metrics {
            cfg.metrics_listen = None;
        }
        match metrics_listen.as_deref() {
            None => {}
            Some("off") => cfg.metrics_listen = None,
            Some(a) => {
                cfg.metrics_listen = Some(a.parse().map_err(|_| {
                    invalid(format!(
                    "metrics_listen {a:?}: not an address such as \"127.0.0.1:9464\" (or \"off\")"
                ))
                })?)
            }
        }
        cfg.tcp = tcp.as_deref().map(tcp_arg).transpose()?;
        cfg.reservation_lease = seconds("reservation_lease", reservation_lease)?;
        cfg.pin_lease = seconds("pin_lease", pin_lease)?;
        cfg.high_watermark = high_watermark;
        cfg.low_watermark = low_watermark;
        cfg.checkpoint_root = checkpoint_root;
        cfg.mlock = mlock;
        cfg.huge_pages = huge_pages.parse().map_err(invalid)?;
        cfg.spare_budget = spare_budget.map(size_arg).transpose()?;
        if let Some(n) = max_connections {
            cfg.max_connections = n;
        }
        if let Some(n) = max_sessions {
            cfg.max_sessions = n;
        }
        if let Some(n) = threads {
            cfg.threads = n;
        }
        if let Some(n) = max_session_connections {
            cfg.max_session_connections = n;
        }
        if let Some(n) = max_session_holds {
            cfg.max_session_holds = n;
        }
        if let Some(t) = frame_timeout {
            cfg.frame_timeout = seconds("frame_timeout", t)?;
        }
        if let Some(n) = max_handshakes {
            cfg.max_handshakes = n;
        }
        if let Some(n) = max_handshakes_per_source {
            cfg.max_handshakes_per_source = n;
        }
        if let Some(t) = handshake_timeout {
            cfg.handshake_timeout = seconds("handshake_timeout", t)?;
        }
        cfg.secret = match (secret, secret_file) {
            (Some(_), Some(_)) => {
                return Err(invalid("give secret or secret_file, not both"));
            }
            (Some(s), None) => Some(secret_arg(s)?),
            (None, Some(path)) => {
                Some(Secret::from_file(&path).map_err(|e| invalid(e.to_string()))?)
            }
            (None, None) if cfg.tcp.is_some() && !insecure => {
                // Loopback TCP is open to every local user.
                Some(Secret::generate().map_err(|e| {
                    PyErr::new::<Error, _>(format!("generating the unit's secret: {e}"))
                })?)
            }
            (None, None) => None,
        };
        if insecure && cfg.secret.is_some() {
            return Err(invalid("insecure means no secret: give one or the other"));
        }
        cfg.insecure = insecure;
        let capacity = match disk_capacity {
            Some(c) => size_arg(c)?,
            None => 20 << 30,
        };
        cfg.disk = disk.map(|root| (root, capacity));
        let (uds, socket_dir) = match uds {
            Some(p) => (PathBuf::from(p.strip_prefix("unix:").unwrap_or(&p)), None),
            None => {
                use std::os::unix::fs::PermissionsExt;
                // Owner-only: the socket is the unit's door.
                let dir = tempfile::Builder::new()
                    .prefix("stowage-unit-")
                    .permissions(std::fs::Permissions::from_mode(0o700))
                    .tempdir()
                    .map_err(|e| {
                        PyErr::new::<Error, _>(format!("creating a socket directory: {e}"))
                    })?;
                (dir.path().join("unit.sock"), Some(dir))
            }
        };
        cfg.uds = Some(uds);
        let secret_for_admin = cfg.secret.clone();
        let handle = py
            .detach(move || stowage_unit::start(cfg))
            .map_err(|e| PyErr::new::<Error, _>(format!("the unit could not start: {e}")))?;
        Ok(Self {
            secret: secret_for_admin,
            metrics: handle.metrics,
            instance_id: handle.instance_id(),
            uds: handle
                .uds
                .clone()
                .ok_or_else(|| PyErr::new::<Error, _>("the unit has no Unix socket"))?,
            tcp: handle.tcp,
            running: Mutex::new(Some(Running {
                handle: Arc::new(handle),
                socket_dir,
            })),
        })
    }

    /// The shared secret every client proves (bytes; given or generated),
    /// or None. Never print or log it.
    #[getter]
    fn secret<'py>(&self, py: Python<'py>) -> Option<Bound<'py, pyo3::types::PyBytes>> {
        self.secret
            .as_ref()
            .map(|s| pyo3::types::PyBytes::new(py, s.expose()))
    }

    /// The instance id (32 hex digits): a restarted unit has another.
    #[getter]
    fn instance_id(&self) -> String {
        format!("{:032x}", self.instance_id)
    }

    /// The Unix-socket address, `unix:/path` (shm transport; admin).
    #[getter]
    fn uds_addr(&self) -> String {
        UnitAddr::Unix(self.uds.clone()).to_string()
    }

    /// The TCP address with the port actually bound, `tcp:ip:port`; None
    /// without a TCP listener.
    #[getter]
    fn tcp_addr(&self) -> Option<String> {
        self.tcp.map(|a| UnitAddr::Tcp(a).to_string())
    }

    /// The metrics endpoint, `http://ip:port/metrics`; None without one.
    #[getter]
    fn metrics_url(&self) -> Option<String> {
        self.metrics.map(|a| format!("http://{a}/metrics"))
    }

    /// The unit's metrics in the Prometheus text format (what its
    /// endpoint serves); None once stopped.
    fn metrics_text(&self) -> Option<String> {
        lock(&self.running)
            .as_ref()
            .and_then(|r| r.handle.metrics_text())
    }

    /// The id of the process the unit runs in (this one).
    #[getter]
    fn pid(&self) -> u32 {
        std::process::id()
    }

    /// Whether `stop()` has not been called yet.
    #[getter]
    fn running(&self) -> bool {
        lock(&self.running).is_some()
    }

    /// The unit's counters (as `DataPlane.stats()` gives per unit), asked
    /// over its own Unix socket.
    #[pyo3(signature = (timeout = 10.0))]
    fn stats<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        if !self.running() {
            return Err(PyErr::new::<Error, _>("the unit is stopped"));
        }
        let t = seconds("timeout", timeout)?;
        let cfg = self.admin_config(t);
        let got = py.detach(move || {
            let client = Inner::connect(cfg)?;
            client
                .stats(Instant::now() + t)
                .pop()
                .unwrap_or_else(|| Err(stowage_client::Error::Io("no reply".into())))
        });
        let s = got.map_err(|e| to_py(py, e, &[]))?;
        stats_dict(py, &s)
    }

    /// Tear the unit down within about `timeout` seconds (plus at most a
    /// second of slack): it stops taking work, a checkpoint in progress
    /// finishes or is abandoned, its disk directory is removed, its
    /// listeners close, the socket's private directory is removed.
    /// Connections already open end as their clients notice. Never raises;
    /// returns what could not be done. Idempotent (a second call returns
    /// nothing).
    #[pyo3(signature = (timeout = 30.0))]
    fn stop(&self, py: Python<'_>, timeout: f64) -> Vec<String> {
        let Some(running) = lock(&self.running).take() else {
            return Vec::new();
        };
        let t = Duration::try_from_secs_f64(timeout).unwrap_or(Duration::from_secs(30));
        let cfg = self.admin_config(t);
        py.detach(move || teardown(running, cfg, t))
    }

    fn __repr__(&self) -> String {
        let state = if self.running() { "running" } else { "stopped" };
        format!(
            "<stowage Unit {} {} {}>",
            self.uds_addr(),
            self.tcp_addr().unwrap_or_default(),
            state
        )
    }
}

impl Unit {
    /// A client of this unit alone, over its Unix socket (where the unit
    /// takes admin requests from its own user), streaming bytes rather
    /// than mapping the slab.
    fn admin_config(&self, timeout: Duration) -> ClientConfig {
        let mut cfg = ClientConfig::new("stowage-admin", vec![UnitAddr::Unix(self.uds.clone())]);
        cfg.timeout = timeout;
        cfg.shm = false;
        cfg.secret = self.secret.clone();
        cfg
    }
}

impl Drop for Unit {
    fn drop(&mut self) {
        if let Some(running) = lock(&self.running).take() {
            let t = Duration::from_secs(5);
            for p in teardown(running, self.admin_config(t), t) {
                tracing::warn!(problem = %p, "stopping a dropped unit");
            }
        }
    }
}

/// Shut the unit down through its own admin request (which reports what
/// could not be done within `timeout`), then close its listeners and
/// remove the socket directory; the listeners' closing is bounded too.
fn teardown(running: Running, admin: ClientConfig, timeout: Duration) -> Vec<String> {
    let end = Instant::now() + timeout;
    let mut problems = match Inner::connect(admin) {
        Ok(client) => client.shutdown(timeout).pop().unwrap_or_default(),
        Err(e) => vec![format!("asking the unit to shut down: {e}")],
    };
    // `UnitHandle::stop` runs the same teardown again (immediate once the
    // request above has done it) and then closes the listeners; it gives a
    // checkpoint that outlived the request more time than the caller's,
    // so it runs on its own thread and is waited for only until `end`.
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = running.handle.clone();
    let spawned = std::thread::Builder::new()
        .name("unit-stop".into())
        .spawn(move || {
            handle.stop();
            let _ = tx.send(());
        });
    match spawned {
        Ok(_) => {
            let wait = end
                .saturating_duration_since(Instant::now())
                .max(CLOSE_FLOOR);
            if rx.recv_timeout(wait).is_err() {
                problems.push(format!(
                    "the unit's listeners were still closing after {:.1} s",
                    timeout.as_secs_f64()
                ));
            }
        }
        Err(e) => problems.push(format!("cannot start the teardown thread: {e}")),
    }
    if let Some(dir) = running.socket_dir {
        let path = dir.path().to_path_buf();
        if let Err(e) = dir.close() {
            problems.push(format!("could not remove {}: {e}", path.display()));
        }
    }
    problems
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
