//! The stowage config file (TOML): units, placement, listen addresses,
//! auth, timeouts and client defaults in one place, read by the command
//! line and by Python (`stowage.config.load`). docs/config.md lists every
//! key with its default; examples/stowage.toml is a complete file.
//!
//! Every key is optional (an empty file is the default config); an unknown
//! key is an error that names it, as is a value out of range. Sizes are
//! ints (bytes) or strings such as `"4GiB"` or `"512MiB"`; durations are
//! strings such as `"30s"`, `"500ms"` or `"2m"`; paths must be absolute
//! (units on other nodes read them there).
//!
//! ```
//! use stowage_cluster::config::Config;
//!
//! let cfg = Config::from_toml_str("[units]\nmemory = \"4GiB\"\n[timeouts]\nop = \"1m\"\n")?;
//! assert_eq!(cfg.units.memory, 4 << 30);
//! assert_eq!(cfg.timeouts.op, std::time::Duration::from_secs(60));
//! # Ok::<(), stowage_cluster::config::ConfigError>(())
//! ```

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use stowage_config::UnitConfig;
use stowage_wire::auth::{Secret, SecretError};

use crate::placement::Placement;

mod values;
use values::{duration, huge_pages, opt_duration, opt_size, size};

/// The whole config file. `Config::default()` is what an empty file
/// gives.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub units: UnitsSection,
    pub placement: PlacementSection,
    pub listen: ListenSection,
    pub auth: AuthSection,
    pub timeouts: TimeoutsSection,
    pub client: ClientSection,
    pub metrics: MetricsSection,
}

/// `[metrics]`: each unit's Prometheus endpoint (docs/metrics.md).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSection {
    /// Record metrics and serve them. Default true.
    pub enabled: bool,
    /// Where unit `I` serves `GET /metrics`: this address with port
    /// `port + I`; port 0 (default): any free port. Default 127.0.0.1:0.
    pub listen: SocketAddr,
    /// A file holding the endpoint's bearer token (absolute path): every
    /// scrape must send `Authorization: Bearer <token>`. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
}

impl Default for MetricsSection {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            token_file: None,
        }
    }
}

/// `[units]`: how many storage units, and each one's settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UnitsSection {
    /// How many units; `None`: two per node of the selected clusters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<usize>,
    /// Copies of every row, each on another unit: every client of the
    /// plane uses this number (the plane's directory carries it). At
    /// least 1, at most the number of units. Default 1.
    pub replicas: usize,
    /// Slab memory of each unit, bytes. Default 1 GiB.
    #[serde(with = "size")]
    pub memory: u64,
    /// Ray CPUs each unit's actor reserves (fractions allowed; 0 reserves
    /// none). Default 0: a unit serves on its own threads, and a reserved
    /// CPU would be one that a small cluster's tasks wait for.
    pub cpus: f64,
    /// An uncommitted reservation held longer is reported as overdue
    /// (never taken from its holder). Default 30 s.
    #[serde(with = "duration")]
    pub reservation_lease: Duration,
    /// A pin held longer is reported as overdue. Default 30 s.
    #[serde(with = "duration")]
    pub pin_lease: Duration,
    /// Most connections a unit serves at once (past their handshake).
    /// Default 16384.
    pub max_connections: usize,
    /// Most client sessions a unit holds at once. Default 16384.
    pub max_sessions: usize,
    /// Threads that serve a unit's connections; 0: one per core of its
    /// host. Default 0.
    pub threads: usize,
    /// Most connections a unit holds at once that have not proved
    /// themselves yet; they never take a served connection's slot.
    /// Default 128.
    pub max_handshakes: usize,
    /// Most of those from one source (a local user; otherwise an
    /// address, an IPv6 /64). Default 32.
    pub max_handshakes_per_source: usize,
    /// Most connections of one client session. Default 64.
    pub max_session_connections: usize,
    /// Most reservations and pins one client session may hold. Default
    /// 16384.
    pub max_session_holds: usize,
    /// Checkpoints are written only under this directory; `None`: units
    /// refuse checkpoints.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_root: Option<PathBuf>,
    /// `[units.disk]`: the disk tier; `None`: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskSection>,
    /// Serve one-sided NIXL transfers (docs/nixl.md). Default false.
    pub nixl: bool,
    /// With `nixl`: refuse to start unless UCX is held to RDMA transports
    /// (`UCX_TLS`). Default true; false lets UCX run over tcp.
    pub require_rdma: bool,
    /// With `nixl`: how long what a nixl client held when its connection
    /// ended stays after the unit invalidated its agent (docs/fencing.md).
    /// Default 5 s.
    #[serde(with = "duration")]
    pub nixl_quarantine: Duration,
    /// The slab's page mode: auto (default), hugetlb, thp or 4k
    /// (`stowage unit --huge-pages`).
    #[serde(with = "huge_pages")]
    pub huge_pages: stowage_config::HugePages,
    /// Bytes at the top of each unit's slab that spares (reservations
    /// same-host clients keep for their next puts) come from
    /// (`stowage unit --spare-budget`); `None`: 1/16 of the slab; 0: no
    /// spares.
    #[serde(with = "opt_size", skip_serializing_if = "Option::is_none")]
    pub spare_budget: Option<u64>,
    /// Bytes each unit may hold outside its slab for its connections
    /// (`stowage unit --outside-slab-budget`); `None`: a quarter of the
    /// slab, at least 64 MiB, at most 1 GiB.
    #[serde(with = "opt_size", skip_serializing_if = "Option::is_none")]
    pub outside_slab_budget: Option<u64>,
}

impl Default for UnitsSection {
    fn default() -> Self {
        let unit = UnitConfig::new("", 1 << 30);
        Self {
            count: None,
            replicas: 1,
            memory: unit.memory,
            cpus: 0.0,
            reservation_lease: unit.reservation_lease,
            pin_lease: unit.pin_lease,
            max_connections: unit.max_connections,
            max_sessions: unit.max_sessions,
            threads: unit.threads,
            max_handshakes: unit.max_handshakes,
            max_handshakes_per_source: unit.max_handshakes_per_source,
            max_session_connections: unit.max_session_connections,
            max_session_holds: unit.max_session_holds,
            checkpoint_root: None,
            disk: None,
            nixl: false,
            require_rdma: true,
            nixl_quarantine: stowage_config::NixlConfig::default().quarantine,
            huge_pages: unit.huge_pages,
            spare_budget: unit.spare_budget,
            outside_slab_budget: unit.outside_slab_budget,
        }
    }
}

impl UnitsSection {
    /// Whether a plane of `units` units can hold `replicas` copies of
    /// every row (each copy needs a unit of its own); the error names
    /// both numbers. Launchers ask before they start anything.
    pub fn check_replicas(&self, units: usize) -> Result<(), String> {
        if self.replicas > units {
            return Err(format!(
                "units.replicas = {} needs at least {} units, but the plane has {units}",
                self.replicas, self.replicas
            ));
        }
        Ok(())
    }
}

/// `[units.disk]`: each unit spills committed values to its own owner-only
/// subdirectory of `root` past `high_watermark` of its memory, oldest
/// first, down to `low_watermark`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskSection {
    /// The disk tier's root directory (required in this section).
    pub root: PathBuf,
    /// Disk capacity of each unit, bytes. Default 20 GiB.
    #[serde(with = "size", default = "default_disk_capacity")]
    pub capacity: u64,
    /// Default 0.9.
    #[serde(default = "default_high_watermark")]
    pub high_watermark: f64,
    /// Default 0.8.
    #[serde(default = "default_low_watermark")]
    pub low_watermark: f64,
    /// Most heap each unit's reads from disk take at once, bytes. Default
    /// 8 MiB.
    #[serde(with = "size", default = "default_disk_read_budget")]
    pub read_budget: u64,
}

fn default_disk_capacity() -> u64 {
    20 << 30
}
fn default_high_watermark() -> f64 {
    UnitConfig::new("", 0).high_watermark
}
fn default_disk_read_budget() -> u64 {
    stowage_config::DEFAULT_DISK_READ_BUDGET
}
fn default_low_watermark() -> f64 {
    UnitConfig::new("", 0).low_watermark
}

/// `[placement]`: which of the job's clusters hold units.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlacementSection {
    /// `"all"` (default) or a list of cluster names.
    pub clusters: Placement,
}

/// `[listen]`: where units listen.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ListenSection {
    /// The TCP listeners' address. Default 127.0.0.1 (this host only).
    pub host: ListenHost,
    /// The TCP port; 0 (default): any free port (a fixed port suits one
    /// unit per node).
    pub tcp_port: u16,
    /// Where the Unix sockets go; `None`: a private temporary directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unix_dir: Option<PathBuf>,
}

impl Default for ListenSection {
    fn default() -> Self {
        Self {
            host: ListenHost::Addr(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            tcp_port: 0,
            unix_dir: None,
        }
    }
}

/// A listen host: an IP address, or `"node-ip"` (see [`node_ip`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListenHost {
    /// The node's own address, found when a unit starts ([`node_ip`]).
    NodeIp,
    Addr(IpAddr),
}

impl ListenHost {
    /// The address to bind: this one, or [`node_ip`] for `"node-ip"`.
    pub fn resolve(self) -> IpAddr {
        match self {
            ListenHost::Addr(a) => a,
            ListenHost::NodeIp => node_ip(),
        }
    }
}

impl std::str::FromStr for ListenHost {
    type Err = String;

    /// `"node-ip"` or an IP address.
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "node-ip" {
            return Ok(ListenHost::NodeIp);
        }
        s.parse().map(ListenHost::Addr).map_err(|_| {
            format!(
                "not a listen host: {s:?}; use an IP address such as \"127.0.0.1\" or \"0.0.0.0\", \
                 or \"node-ip\" (this node's own address)"
            )
        })
    }
}

impl<'de> Deserialize<'de> for ListenHost {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl Serialize for ListenHost {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ListenHost::NodeIp => s.serialize_str("node-ip"),
            ListenHost::Addr(a) => s.collect_str(a),
        }
    }
}

impl std::fmt::Display for ListenHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenHost::NodeIp => f.write_str("node-ip"),
            ListenHost::Addr(a) => a.fmt(f),
        }
    }
}

/// `[auth]`: the shared secret clients and units prove to each other.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthSection {
    /// A file holding the secret; `None`: the `STOWAGE_SECRET` environment
    /// variable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<PathBuf>,
    /// Serve TCP without a secret, loopback included: every local user,
    /// and anyone who can reach a unit, may read, overwrite and clear every
    /// value. Default false: a unit with no secret refuses TCP.
    pub insecure: bool,
}

/// `[timeouts]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutsSection {
    /// A client call's default deadline. Default 30 s.
    #[serde(with = "duration")]
    pub op: Duration,
    /// A unit must be up (listening) within this. Default 2 min.
    #[serde(with = "duration")]
    pub start: Duration,
    /// Stopping the units (a checkpoint in progress finishes or is
    /// abandoned) takes at most this. Default 30 s.
    #[serde(with = "duration")]
    pub stop: Duration,
    /// Once a frame has begun, the rest of it must arrive within this (the
    /// unit's frame timeout). Default 10 s.
    #[serde(with = "duration")]
    pub frame: Duration,
    /// A connection must prove the shared secret and say Hello within
    /// this of its accept (the unit's handshake timeout). Default 1 s.
    #[serde(with = "duration")]
    pub handshake: Duration,
}

impl Default for TimeoutsSection {
    fn default() -> Self {
        Self {
            op: Duration::from_secs(30),
            start: Duration::from_secs(120),
            stop: Duration::from_secs(30),
            frame: UnitConfig::new("", 0).frame_timeout,
            handshake: UnitConfig::new("", 0).handshake_timeout,
        }
    }
}

/// `[client]`: defaults of the clients that connect to the units.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientSection {
    /// The namespace requests act in (isolates runs sharing units).
    /// Default `"default"`.
    pub namespace: String,
    /// How bytes travel. Default auto.
    pub transport: Transport,
    /// A put that finds a unit full waits up to this (within its deadline)
    /// for a clear to make room; `None` (default): it fails at once.
    #[serde(
        with = "opt_duration",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub wait_for_memory: Option<Duration>,
}

impl Default for ClientSection {
    fn default() -> Self {
        Self {
            namespace: "default".into(),
            transport: Transport::Auto,
            wait_for_memory: None,
        }
    }
}

/// How a client moves bytes to and from a unit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Shared memory with the units on the client's own host, TCP with the
    /// others.
    #[default]
    Auto,
    /// Shared memory only (every unit on the client's host).
    Shm,
    /// TCP only.
    Tcp,
}

impl Transport {
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
        }
    }
}

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{}: cannot read the config file: {error}", file.display())]
    Read {
        file: PathBuf,
        #[source]
        error: std::io::Error,
    },
    /// The file is not valid TOML, has an unknown key, or a value is of
    /// the wrong kind or out of range.
    #[error("{file}{}: {}{message}", line.map(|(l, c)| format!(":{l}:{c}")).unwrap_or_default(), key.as_ref().map(|k| format!("{k}: ")).unwrap_or_default())]
    Invalid {
        /// The file's path, or `<config text>` for a string.
        file: String,
        /// The dotted key (`units.disk.capacity`), when the error is about
        /// one.
        key: Option<String>,
        /// Line and column (from 1), when known.
        line: Option<(usize, usize)>,
        message: String,
    },
}

impl ConfigError {
    /// The dotted key the error is about, if any.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { key, .. } => key.as_deref(),
            ConfigError::Read { .. } => None,
        }
    }
}

/// What a config given as a string is called in errors.
pub const TEXT_SOURCE: &str = "<config text>";

impl Config {
    /// Parse and check a config file's text.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        Self::parse(text, TEXT_SOURCE)
    }

    /// Read, parse and check the config file at `path`; errors name it.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            file: path.to_path_buf(),
            error,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parse and check `text`; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Self, ConfigError> {
        let invalid = |key: Option<String>, e: toml::de::Error| ConfigError::Invalid {
            file: file.to_string(),
            key,
            line: e.span().map(|s| line_col(text, s.start)),
            message: e.message().trim_end().to_string(),
        };
        let de = toml::Deserializer::parse(text).map_err(|e| invalid(None, e))?;
        let cfg: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            let key = (key != ".").then_some(key);
            invalid(key, e.into_inner())
        })?;
        cfg.check().map_err(|(key, message)| ConfigError::Invalid {
            file: file.to_string(),
            key: Some(key.to_string()),
            line: value_span(text, key).map(|start| line_col(text, start)),
            message,
        })?;
        Ok(cfg)
    }

    /// Check a config built in code as a file is checked.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check().map_err(|(key, message)| ConfigError::Invalid {
            file: "<config>".into(),
            key: Some(key.to_string()),
            line: None,
            message,
        })
    }

    /// The config as TOML (every key that has a value; sizes in bytes).
    pub fn to_toml_string(&self) -> String {
        // Every value serializes (sizes fit an i64 once checked; strings
        // and paths are UTF-8 or were read from UTF-8 text).
        toml::to_string(self).unwrap_or_else(|e| format!("# not representable in TOML: {e}\n"))
    }

    fn check(&self) -> Result<(), (&'static str, String)> {
        let u = &self.units;
        if u.count == Some(0) {
            return Err((
                "units.count",
                "must be at least 1 (omit it for two units per node)".into(),
            ));
        }
        if u.replicas == 0 {
            return Err((
                "units.replicas",
                "must be at least 1 (1: one copy of every row)".into(),
            ));
        }
        if let Some(count) = u.count.filter(|&c| c < u.replicas) {
            return Err((
                "units.replicas",
                format!(
                    "{} copies of every row need at least {} units, but units.count is {count}",
                    u.replicas, u.replicas
                ),
            ));
        }
        if u.memory == 0 {
            return Err(("units.memory", "must be more than 0 bytes".into()));
        }
        check_i64("units.memory", u.memory)?;
        if !(u.cpus.is_finite() && u.cpus >= 0.0) {
            return Err(("units.cpus", format!("must be 0 or more, got {}", u.cpus)));
        }
        positive("units.reservation_lease", u.reservation_lease)?;
        positive("units.pin_lease", u.pin_lease)?;
        for (key, v) in [
            ("units.max_connections", u.max_connections),
            ("units.max_sessions", u.max_sessions),
            ("units.max_handshakes", u.max_handshakes),
            (
                "units.max_handshakes_per_source",
                u.max_handshakes_per_source,
            ),
            ("units.max_session_connections", u.max_session_connections),
            ("units.max_session_holds", u.max_session_holds),
        ] {
            if v == 0 {
                return Err((key, "must be at least 1".into()));
            }
        }
        absolute("units.checkpoint_root", u.checkpoint_root.as_deref())?;
        if let Some(d) = &u.disk {
            absolute("units.disk.root", Some(&d.root))?;
            if d.capacity == 0 {
                return Err(("units.disk.capacity", "must be more than 0 bytes".into()));
            }
            check_i64("units.disk.capacity", d.capacity)?;
            for (key, w) in [
                ("units.disk.high_watermark", d.high_watermark),
                ("units.disk.low_watermark", d.low_watermark),
            ] {
                if !(w > 0.0 && w <= 1.0) {
                    return Err((key, format!("must be in (0, 1], got {w}")));
                }
            }
            if d.low_watermark >= d.high_watermark {
                return Err((
                    "units.disk.low_watermark",
                    format!(
                        "must be below units.disk.high_watermark ({}), got {}",
                        d.high_watermark, d.low_watermark
                    ),
                ));
            }
        }
        self.placement
            .clusters
            .validate()
            .map_err(|e| ("placement.clusters", e.to_string()))?;
        if let Placement::Names(names) = &self.placement.clusters {
            if names.iter().any(|n| n.is_empty()) {
                return Err((
                    "placement.clusters",
                    "a cluster name must not be empty".into(),
                ));
            }
        }
        absolute("listen.unix_dir", self.listen.unix_dir.as_deref())?;
        absolute("auth.secret_file", self.auth.secret_file.as_deref())?;
        absolute("metrics.token_file", self.metrics.token_file.as_deref())?;
        if self.auth.insecure && self.auth.secret_file.is_some() {
            return Err((
                "auth.insecure",
                "cannot be true together with auth.secret_file: run with a secret or without one"
                    .into(),
            ));
        }
        let t = &self.timeouts;
        positive("timeouts.op", t.op)?;
        positive("timeouts.start", t.start)?;
        positive("timeouts.stop", t.stop)?;
        positive("timeouts.frame", t.frame)?;
        positive("timeouts.handshake", t.handshake)?;
        if self.client.namespace.is_empty() {
            return Err(("client.namespace", "must not be empty".into()));
        }
        Ok(())
    }

    /// The settings of unit `index` (named `unit-<index>`), listening on
    /// `tcp` and `uds`: those with a config file key in
    /// [`stowage_config::unit_settings_table!`] (memory, leases,
    /// connection caps, checkpoint root, page mode, spares, frame and
    /// handshake timeouts, `auth.insecure`, `metrics.enabled`), the disk
    /// tier and its watermarks, NIXL, the metrics endpoint and the secret
    /// come from this config; everything else keeps [`UnitConfig::new`]'s
    /// defaults.
    pub fn unit_config(
        &self,
        index: usize,
        tcp: Option<SocketAddr>,
        uds: Option<PathBuf>,
    ) -> Result<UnitConfig, ConfigError> {
        let u = &self.units;
        let mut c = UnitConfig::new(format!("unit-{index}"), u.memory);
        c.tcp = tcp;
        c.uds = uds;
        self.apply_unit_settings(&mut c);
        if let Some(d) = &u.disk {
            c.disk = Some((d.root.clone(), d.capacity));
            c.high_watermark = d.high_watermark;
            c.low_watermark = d.low_watermark;
            c.disk_read_budget = d.read_budget;
        }
        if u.nixl {
            c.nixl = Some(stowage_config::NixlConfig {
                require_rdma: u.require_rdma,
                quarantine: u.nixl_quarantine,
            });
        }
        let mut m = self.metrics.listen;
        if m.port() != 0 {
            let port =
                u16::try_from(usize::from(m.port()) + index).map_err(|_| ConfigError::Invalid {
                    file: "<config>".into(),
                    key: Some("metrics.listen".into()),
                    line: None,
                    message: format!("port {} + unit index {index} is past 65535", m.port()),
                })?;
            m.set_port(port);
        }
        c.metrics_listen = Some(m);
        c.secret = self.secret()?;
        Ok(c)
    }

    /// The shared secret: the contents of `auth.secret_file` (owner-only),
    /// else the `STOWAGE_SECRET` environment variable; none when
    /// `auth.insecure` is set or neither is there.
    pub fn secret(&self) -> Result<Option<Secret>, ConfigError> {
        if self.auth.insecure {
            return Ok(None);
        }
        let bad = |e: SecretError| ConfigError::Invalid {
            file: "<config>".into(),
            key: Some("auth.secret_file".into()),
            line: None,
            message: e.to_string(),
        };
        match &self.auth.secret_file {
            Some(f) => Secret::from_file(f).map(Some).map_err(bad),
            None => Secret::from_env().map_err(bad),
        }
    }

    /// The address units bind their TCP listeners to: `listen.host`, with
    /// `"node-ip"` resolved on this node by [`node_ip`].
    pub fn resolve_listen_host(&self) -> IpAddr {
        self.listen.host.resolve()
    }

    /// The Unix socket of unit `index` started from this file:
    /// `listen.unix_dir/unit-<index>.sock`, else `unit-<index>.sock` in
    /// this user's private runtime directory
    /// ([`stowage_config::runtime_dir::runtime_dir`]: `$XDG_RUNTIME_DIR/stowage`,
    /// else `/tmp/stowage-<uid>`, else `$HOME/.stowage/run` when another
    /// user took that name, else `/tmp/stowage-<uid>-XXXXXX` of its own
    /// when there is no usable home; 0700), which fails when that
    /// directory is not this user's own.
    pub fn unit_socket(&self, index: usize) -> std::io::Result<PathBuf> {
        match &self.listen.unix_dir {
            Some(d) => Ok(d.join(format!("unit-{index}.sock"))),
            None => stowage_config::runtime_dir::default_socket(index),
        }
    }
}

/// The config file's side of [`stowage_config::unit_settings_table!`]:
/// `Config::apply_unit_settings` sets each field that has a file key
/// (`file section.key`) to that key's value; the flags' side is
/// `stowage-cli`'s.
macro_rules! file_settings {
    ($($(#[$attr:meta])* $flag:ident: $ty:ty => $field:ident $(= |$v:ident| $set:expr)?
        $(, file $section:ident.$key:ident)?;)*) => {
        impl Config {
            /// Set `c`'s fields that the config file has keys for.
            fn apply_unit_settings(&self, c: &mut UnitConfig) {
                $($(c.$field = Clone::clone(&self.$section.$key);)?)*
            }
        }
    };
}

stowage_config::unit_settings_table!(file_settings);

/// This node's address as other nodes reach it: the local address of a UDP
/// socket "connected" to a public address (`8.8.8.8:53`, else
/// `[2001:4860:4860::8888]:53`), which is the address of the interface the
/// default route leaves by. Connecting a UDP socket sends nothing; it only
/// asks the kernel for a route. This is how Ray finds a node's IP
/// (`ray.util.get_node_ip_address`). 127.0.0.1 when there is no route.
pub fn node_ip() -> IpAddr {
    let probes: [(SocketAddr, SocketAddr); 2] = [
        (
            (Ipv4Addr::UNSPECIFIED, 0).into(),
            (Ipv4Addr::new(8, 8, 8, 8), 53).into(),
        ),
        (
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
            (
                std::net::Ipv6Addr::new(0x2001, 0x4860, 0x4860, 0, 0, 0, 0, 0x8888),
                53,
            )
                .into(),
        ),
    ];
    for (local, remote) in probes {
        let found = UdpSocket::bind(local)
            .and_then(|s| s.connect(remote).map(|()| s))
            .and_then(|s| s.local_addr());
        if let Ok(a) = found {
            if !a.ip().is_unspecified() {
                return a.ip();
            }
        }
    }
    IpAddr::V4(Ipv4Addr::LOCALHOST)
}

fn positive(key: &'static str, d: Duration) -> Result<(), (&'static str, String)> {
    if d.is_zero() {
        return Err((key, "must be longer than 0".into()));
    }
    Ok(())
}

fn check_i64(key: &'static str, v: u64) -> Result<(), (&'static str, String)> {
    if i64::try_from(v).is_err() {
        return Err((key, format!("{v} bytes is too large")));
    }
    Ok(())
}

fn absolute(key: &'static str, p: Option<&Path>) -> Result<(), (&'static str, String)> {
    match p {
        Some(p) if !p.is_absolute() => Err((
            key,
            format!(
                "must be an absolute path (units on other nodes read it there), got {:?}",
                p.display().to_string()
            ),
        )),
        _ => Ok(()),
    }
}

/// Where the value of the dotted `key` starts in `text`, if the text sets
/// it (a key the file leaves out has no position).
fn value_span(text: &str, key: &str) -> Option<usize> {
    let doc = toml::de::DeTable::parse(text).ok()?;
    let mut table = doc.get_ref();
    let mut segments = key.split('.').peekable();
    while let Some(seg) = segments.next() {
        let (_, value) = table.iter().find(|(k, _)| k.get_ref().as_ref() == seg)?;
        if segments.peek().is_none() {
            return Some(value.span().start);
        }
        match value.get_ref() {
            toml::de::DeValue::Table(t) => table = t,
            _ => return None,
        }
    }
    None
}

/// Line and column (from 1, in characters) of byte `offset` of `text`.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

pub use stowage_config::{parse_duration, parse_size};

#[cfg(test)]
mod tests;
