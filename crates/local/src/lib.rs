//! # stowage-local: a local data plane, N `stowage unit` child processes on this machine
//!
//! The `stowage` command (`stowage local`, `stowage bench`), the Python
//! package (`stowage.local()`) and the integration tests all start local
//! planes through this one crate.
//!
//! Each unit listens on a Unix socket in a private temporary directory and
//! on an ephemeral loopback TCP port, and exits when its stdin closes — so
//! units never outlive the process that started them, even when that
//! process is killed. Dropping a [`LocalPlane`] also kills and reaps them.
//!
//! Every plane has a shared secret (one given, else a fresh one per plane)
//! unless started `insecure`: loopback TCP is open to every local user.
//! The units get it in an owner-only file in the plane's private
//! directory, never on a command line or in the environment; the plane's
//! clients get it from [`LocalPlane::secret`] or its
//! [`LocalPlane::directory`].

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use rustix::process::{kill_process, Pid, Signal};
use stowage_client::{Secret, UnitAddr, UnitDirectory, UnitEntry, SECRET_ENV};

/// Settings of a local plane.
#[derive(Clone, Debug)]
pub struct LocalOptions {
    /// The command that runs one unit, without the unit's own arguments:
    /// e.g. `["/usr/bin/stowage", "unit"]`.
    pub command: Vec<std::ffi::OsString>,
    pub units: usize,
    /// Slab bytes per unit.
    pub memory: u64,
    /// Extra arguments for every `stowage unit` (e.g. `--pin-lease 1s`).
    pub unit_args: Vec<String>,
    /// The config file the units read: unit `i` gets `--config FILE
    /// --index i`, so that it takes its own place in the file (its metrics
    /// port is `metrics.listen`'s port + `i`). Options the plane passes
    /// (name, memory, listeners, secret) override the file's.
    pub config: Option<PathBuf>,
    /// How long to wait for each unit to report ready. Default 30 s.
    pub start_timeout: Duration,
    /// Start unit `i` from the checkpoint in `<restore>/unit-<i>`.
    pub restore: Option<PathBuf>,
    /// The shared secret the units require. It reaches them in an
    /// owner-only file in the plane's private directory (`--secret-file`),
    /// never on a command line or in their environment (`STOWAGE_SECRET`
    /// is not passed on). `None`: a fresh one for this plane
    /// ([`Secret::generate`]), unless `insecure`.
    pub secret: Option<Secret>,
    /// The address the units' TCP listeners bind (port: any free one).
    /// Default loopback.
    pub tcp_host: IpAddr,
    /// Units without a secret (`--insecure`): every local user, and anyone
    /// who reaches `tcp_host`, can read, overwrite and clear every value.
    pub insecure: bool,
    /// Unit `i` listens on TCP port `tcp_port_base + i`; 0: any free port.
    pub tcp_port_base: u16,
}

impl LocalOptions {
    pub fn new(units: usize, memory: u64) -> Self {
        Self {
            command: vec!["stowage".into(), "unit".into()],
            units,
            memory,
            unit_args: Vec::new(),
            config: None,
            start_timeout: Duration::from_secs(30),
            restore: None,
            secret: None,
            tcp_host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            insecure: false,
            tcp_port_base: 0,
        }
    }
}

/// The TCP port of unit `i`.
fn tcp_port(opts: &LocalOptions, i: usize) -> Result<u16, String> {
    match opts.tcp_port_base {
        0 => Ok(0),
        base => u16::try_from(usize::from(base) + i)
            .map_err(|_| format!("TCP port {base} + unit index {i} is past 65535")),
    }
}

/// What a starting unit's first telling line on stdout said.
enum Started {
    /// `READY uds=… tcp=… instance=… metrics=…`.
    Ready(String),
    /// `FAILED <reason>`: it refused to start, in its own words.
    Failed(String),
    /// Its stdout closed without either (it exited).
    Exited,
}

/// One running unit process.
pub struct LocalUnit {
    child: Child,
    pub uds: PathBuf,
    pub tcp: SocketAddr,
    /// The instance id it reported.
    pub instance: u128,
    /// Its metrics endpoint (`http://ADDR/metrics`), if it serves one.
    pub metrics: Option<String>,
}

impl LocalUnit {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Send a signal to the unit process.
    pub fn signal(&self, sig: Signal) -> std::io::Result<()> {
        let pid = Pid::from_child(&self.child);
        kill_process(pid, sig).map_err(Into::into)
    }
}

/// A set of units on this machine, stopped on drop.
pub struct LocalPlane {
    pub units: Vec<LocalUnit>,
    dir: tempfile::TempDir,
    /// The units' shared secret (`None` only when started `insecure`).
    secret: Option<Secret>,
    /// Whether this plane made its secret (then its directory carries it:
    /// nobody else has it; a secret given is its giver's to hand out).
    generated: bool,
}

impl LocalPlane {
    /// Start `opts.units` units with `opts.command`, one after another,
    /// each within `opts.start_timeout`. A unit that refuses to start (it
    /// prints `FAILED <reason>` and exits) fails this at once with `unit
    /// <i> refused to start: <reason>`, in the unit's own words; one that
    /// exits without a word fails it at once too.
    pub fn start(opts: &LocalOptions) -> Result<Self, String> {
        if opts.command.is_empty() {
            return Err("no command to start a unit with".into());
        }
        let dir = tempfile::Builder::new()
            .prefix("stowage-local-")
            .tempdir()
            .map_err(|e| format!("creating a socket directory: {e}"))?;
        // Owner-only: the sockets and the secret file live here.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .map_err(|e| format!("making the socket directory owner-only: {e}"))?;
        if opts.insecure && opts.secret.is_some() {
            return Err("insecure means units without a secret, but a secret was given".into());
        }
        let secret = match (&opts.secret, opts.insecure) {
            (Some(s), _) => Some(s.clone()),
            (None, false) => Some(
                Secret::generate().map_err(|e| format!("generating the plane's secret: {e}"))?,
            ),
            (None, true) => None,
        };
        let mut plane = LocalPlane {
            units: Vec::new(),
            dir,
            secret,
            generated: opts.secret.is_none() && !opts.insecure,
        };
        if let Some(secret) = &plane.secret {
            write_secret(&plane.secret_path(), secret)
                .map_err(|e| format!("writing the units' secret file: {e}"))?;
        }
        for i in 0..opts.units {
            let u = plane.spawn(i, opts)?;
            plane.units.push(u);
        }
        Ok(plane)
    }

    fn spawn(&self, i: usize, opts: &LocalOptions) -> Result<LocalUnit, String> {
        let uds = self.dir.path().join(format!("unit-{i}.sock"));
        let mut child = Command::new(&opts.command[0])
            .args(&opts.command[1..])
            .arg("--name")
            .arg(format!("unit-{i}"))
            .arg("--memory")
            .arg(opts.memory.to_string())
            .arg("--listen")
            .arg(format!("unix:{}", uds.display()))
            .arg("--listen")
            .arg(format!(
                "tcp:{}",
                SocketAddr::new(opts.tcp_host, tcp_port(opts, i)?)
            ))
            .args(opts.insecure.then_some("--insecure"))
            .arg("--exit-with-stdin")
            .args(&opts.unit_args)
            .args(opts.config.iter().flat_map(|c| {
                [
                    std::ffi::OsString::from("--config"),
                    c.clone().into_os_string(),
                    std::ffi::OsString::from("--index"),
                    i.to_string().into(),
                ]
            }))
            .args(opts.restore.iter().flat_map(|r| {
                [
                    std::ffi::OsString::from("--restore"),
                    r.join(format!("unit-{i}")).into_os_string(),
                ]
            }))
            .args(self.secret.iter().flat_map(|_| {
                [
                    std::ffi::OsString::from("--secret-file"),
                    self.secret_path().into_os_string(),
                ]
            }))
            .env_remove(SECRET_ENV)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            // A process group of its own: a Ctrl-C at the terminal stops
            // the parent, which stops its units with their teardown
            // (closing their stdin), instead of killing them mid-write.
            .process_group(0)
            .spawn()
            .map_err(|e| format!("starting {:?}: {e}", opts.command))?;
        let stdout = child.stdout.take().ok_or("unit stdout missing")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            while let Some(Ok(line)) = lines.next() {
                if line.starts_with("READY ") {
                    let _ = tx.send(Started::Ready(line));
                    return;
                }
                if let Some(why) = line.strip_prefix("FAILED ") {
                    let _ = tx.send(Started::Failed(why.to_owned()));
                    return;
                }
            }
            let _ = tx.send(Started::Exited);
        });
        let line = match rx.recv_timeout(opts.start_timeout) {
            Ok(Started::Ready(l)) => l,
            other => {
                // Refused (its reason), gone (its stderr said why) or too
                // slow: either way it is stopped and reaped now.
                let _ = child.kill();
                let status = child.wait();
                return Err(match other {
                    Ok(Started::Failed(why)) => format!("unit {i} refused to start: {why}"),
                    Ok(_) => format!(
                        "unit {i} exited before reporting ready ({}); its standard error says why",
                        status.map_or_else(|e| e.to_string(), |s| s.to_string())
                    ),
                    Err(_) => format!(
                        "unit {i} did not report ready within {:?}",
                        opts.start_timeout
                    ),
                });
            }
        };
        let tcp = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("tcp="))
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("unit {i} reported no TCP address: {line}"))?;
        let instance = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("instance="))
            .and_then(|a| u128::from_str_radix(a, 16).ok())
            .ok_or_else(|| format!("unit {i} reported no instance id: {line}"))?;
        let metrics = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("metrics="))
            .filter(|m| !m.is_empty())
            .map(str::to_owned);
        Ok(LocalUnit {
            child,
            uds,
            tcp,
            instance,
            metrics,
        })
    }

    /// The units' secret file (written only when the plane has a secret).
    fn secret_path(&self) -> PathBuf {
        self.dir.path().join("secret")
    }

    /// The units' shared secret, which every client of this plane proves
    /// (`None` only for a plane started `insecure`).
    pub fn secret(&self) -> Option<&Secret> {
        self.secret.as_ref()
    }

    /// The plane's private (0700) directory: its sockets and secret file.
    pub fn private_dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Start unit `i` again (after it was killed) on the same addresses'
    /// socket path; its TCP port changes.
    pub fn restart(&mut self, i: usize, opts: &LocalOptions) -> Result<(), String> {
        let u = &mut self.units[i];
        let _ = u.child.kill();
        let _ = u.child.wait();
        let fresh = self.spawn(i, opts)?;
        self.units[i] = fresh;
        Ok(())
    }

    /// The units' Unix-socket addresses (shm transport).
    pub fn uds_addrs(&self) -> Vec<UnitAddr> {
        self.units
            .iter()
            .map(|u| UnitAddr::Unix(u.uds.clone()))
            .collect()
    }

    /// The plane's directory: what another process, on this host or
    /// another, passes to connect. It carries the plane's secret when the
    /// plane generated it: write it with [`UnitDirectory::write_file`]
    /// (then owner-only). It says one copy of every row (`replicas`); a
    /// launcher that starts the plane for more sets its own number.
    pub fn directory(&self) -> UnitDirectory {
        let host = stowage_client::host_id();
        UnitDirectory {
            stowage_directory: stowage_client::unit_directory::DIRECTORY_VERSION,
            units: self
                .units
                .iter()
                .enumerate()
                .map(|(i, u)| UnitEntry {
                    index: i,
                    node: None,
                    host: Some(host.clone()),
                    uds: Some(UnitAddr::Unix(u.uds.clone()).to_string()),
                    tcp: Some(UnitAddr::Tcp(u.tcp).to_string()),
                    instance_id: Some(stowage_client::unit_directory::instance_hex(u.instance)),
                    pid: Some(u.pid()),
                    extra: u
                        .metrics
                        .iter()
                        .map(|m| ("metrics".to_string(), serde_json::Value::from(m.as_str())))
                        .collect(),
                })
                .collect(),
            replicas: 1,
            secret_hex: self
                .secret
                .as_ref()
                .filter(|_| self.generated)
                .map(Secret::to_hex),
        }
    }

    /// The units' TCP addresses (tcp transport).
    pub fn tcp_addrs(&self) -> Vec<UnitAddr> {
        self.units.iter().map(|u| UnitAddr::Tcp(u.tcp)).collect()
    }

    /// Kill unit `i` with SIGKILL and reap it.
    pub fn kill9(&mut self, i: usize) {
        let u = &mut self.units[i];
        let _ = u.child.kill();
        let _ = u.child.wait();
    }

    /// Stop every unit: close its stdin (it then removes its disk
    /// directory and exits), wait up to `grace` for all of them, then
    /// SIGKILL whatever is left, and reap them. Bounded, never fails.
    pub fn stop_within(&mut self, grace: Duration) {
        for u in &mut self.units {
            let _ = u.signal(Signal::CONT);
            drop(u.child.stdin.take());
        }
        let end = std::time::Instant::now() + grace;
        for u in &mut self.units {
            loop {
                match u.child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if std::time::Instant::now() < end => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    _ => {
                        let _ = u.child.kill();
                        let _ = u.child.wait();
                        break;
                    }
                }
            }
        }
    }

    /// [`LocalPlane::stop_within`] two seconds.
    pub fn stop(&mut self) {
        self.stop_within(Duration::from_secs(2));
    }
}

/// Write `secret` to a new owner-only file at `path`.
fn write_secret(path: &std::path::Path, secret: &Secret) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(secret.expose())?;
    f.sync_all()
}

impl Drop for LocalPlane {
    fn drop(&mut self) {
        self.stop();
    }
}
