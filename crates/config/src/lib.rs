//! # stowage-config: the settings of a storage unit, below every crate that uses them
//!
//! [`UnitConfig`] is what a unit runs with: the server (`stowage-unit`)
//! takes it, and the launchers (`stowage-cluster`'s config file, the
//! command line, the Python package) build it without depending on the
//! server. [`runtime_dir`] says where a unit's socket goes by default, and
//! [`parse_size`] / [`parse_duration`] read the sizes and durations every
//! front end accepts (`256MiB`, `30s`). [`unit_settings_table!`] lists the
//! settings that are one field each, with their flag and config file key.

#![forbid(unsafe_code)]

pub mod runtime_dir;
mod settings;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub use stowage_shm::HugePages;
use stowage_wire::Limits;

/// The default budget for the bytes a unit holds outside its slab
/// ([`UnitConfig::outside_slab_budget`]) for a slab of `memory` bytes: a
/// quarter of it, at least 64 MiB, at most 1 GiB.
pub fn default_outside_slab_budget(memory: u64) -> u64 {
    (memory / 4).clamp(64 << 20, 1 << 30)
}

/// Parse a byte size: `1GiB`, `256MiB`, `64KiB`, `4096`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    s.trim()
        .parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| format!("not a size: {s:?} ({e}); use bytes or e.g. 256MiB or 1GiB"))
}

/// Parse a duration: `30s`, `500ms`, `2m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim())
        .map_err(|e| format!("not a duration: {s:?} ({e}); use e.g. 30s, 500ms or 2m"))
}

/// Settings of one unit.
#[derive(Clone, Debug)]
pub struct UnitConfig {
    /// A name for logs and the memfd.
    pub name: String,
    /// Slab bytes.
    pub memory: u64,
    /// Unix socket path (shm transport and control). `None`: no Unix socket.
    pub uds: Option<PathBuf>,
    /// TCP address (tcp transport). Loopback unless the operator says
    /// otherwise. `None`: no TCP listener.
    pub tcp: Option<SocketAddr>,
    /// A reservation held longer is reported as overdue (never taken from
    /// its holder). Default 30 s.
    pub reservation_lease: Duration,
    /// A pin held longer is reported as overdue. Default 30 s.
    pub pin_lease: Duration,
    /// Quarantine of the range of a put stream the unit cut off. Default 5 s.
    pub quarantine: Duration,
    /// Rows a claim leased and did not settle within this go back to the
    /// task. Default 30 s.
    pub claim_lease: Duration,
    /// A repair window idle this long may be taken over by another
    /// client's (docs/replication.md#repair). Default 30 s.
    pub repair_window_lease: Duration,
    /// Frame limits.
    pub limits: Limits,
    /// Try to mlock the slab. Default true.
    pub mlock: bool,
    /// The slab's page mode (`--huge-pages`, `units.huge_pages`): auto
    /// (default: hugetlb, else transparent huge pages, else 4 KiB, one log
    /// line says which and why), hugetlb, thp or 4k.
    pub huge_pages: HugePages,
    /// How long a connection thread polls for the next request before it
    /// blocks (adaptive polling: a blocking wake-up costs tens of µs on a
    /// VM; polling costs CPU while it lasts). Default 50 µs; zero disables
    /// it.
    pub spin: Duration,
    /// The disk tier: its root directory (the unit works in its own
    /// owner-only, locked subdirectory) and capacity. `None`: no disk tier.
    pub disk: Option<(PathBuf, u64)>,
    /// Spill past this fraction of the slab in use. Default 0.9.
    pub high_watermark: f64,
    /// Stop spilling below this fraction. Default 0.8.
    pub low_watermark: f64,
    /// Most bytes of heap that reads from the disk tier take at once, all
    /// readers together (values stream from their files to the socket, or
    /// into the slab, through buffers of at most 1 MiB taken from this
    /// budget; a reader that finds none free waits for one within its
    /// deadline, then is answered Busy). Default 8 MiB; at least 64 KiB.
    pub disk_read_budget: u64,
    /// Failpoints to turn on at start (`disk-write`), for tests.
    pub failpoints: Vec<String>,
    /// Load this checkpoint directory before serving.
    pub restore: Option<PathBuf>,
    /// Checkpoints are written only under this directory; `None`: the unit
    /// takes none.
    pub checkpoint_root: Option<PathBuf>,
    /// Accept Unix-socket clients of any uid (default: only this process's
    /// own uid).
    pub allow_other_uids: bool,
    /// Accept admin requests (shutdown, checkpoint) over TCP too (default:
    /// only from same-uid clients on the Unix socket).
    pub admin_tcp: bool,
    /// Once a frame has begun, the rest of it must arrive within this; a
    /// reply the peer does not take within it is cut off too. Default 10 s.
    pub frame_timeout: Duration,
    /// The longest a single transfer may stall when its request asks for
    /// more time. Default 10 min.
    pub max_io_timeout: Duration,
    /// Most connections served at once: connections that proved the
    /// shared secret (or, without one, said Hello). Default 16384.
    pub max_connections: usize,
    /// Most client sessions at once; past it a new session is answered
    /// Busy. Default 16384.
    pub max_sessions: usize,
    /// Threads that serve connections (each waits on readiness events for
    /// its share of them); 0: one per core. Default 0.
    pub threads: usize,
    /// Most threads for blocking work (a tcp put's or get's bytes, disk
    /// reads, checkpoints, nixl setup); they exit when idle. Default 8.
    pub io_threads: usize,
    /// Most connections at once that have not proved themselves yet (see
    /// the unit's `admit.rs`): they never take a served connection's slot. Past it,
    /// a new connection cuts the oldest handshake of the source holding
    /// the most. Default 128.
    pub max_handshakes: usize,
    /// Most of those from one source (a local user: a Unix-socket peer or
    /// a TCP peer on this host, over loopback or from the host address it
    /// dialled; otherwise the peer's address, an IPv6 peer's /64): past it, a new connection from that source cuts its oldest
    /// handshake. Default 32.
    pub max_handshakes_per_source: usize,
    /// A connection must prove itself (the shared secret's proof and its
    /// Hello) within this of its accept, or it is cut. Default 1 s.
    pub handshake_timeout: Duration,
    /// Most connections of one session. Default 64.
    pub max_session_connections: usize,
    /// Most reservations and pins of one session. Default 16384.
    pub max_session_holds: usize,
    /// Bytes the key index may take; `None`: a quarter of the slab, at
    /// least 64 MiB.
    pub index_budget: Option<u64>,
    /// Bytes at the top of the slab that spares come from (`--spare-budget`,
    /// `units.spare_budget`); `None`: 1/16 of the slab. At most half the
    /// slab is used; 0 turns spares off.
    pub spare_budget: Option<u64>,
    /// Bytes the unit may hold outside its slab on behalf of connections
    /// (`--outside-slab-budget`, `units.outside_slab_budget`): request
    /// headers being read, replies being written, per-connection buffers;
    /// `None`: [`default_outside_slab_budget`] of the slab. Small frames
    /// take a quarter of it again (its headroom); a frame's header up to
    /// the frame limit always fits.
    pub outside_slab_budget: Option<u64>,
    /// Compaction's budget (`--compaction-ratio`): bytes it may copy per
    /// byte stored; 0 turns it off. Default 0.25.
    pub compaction_ratio: f64,
    /// The shared secret every client must prove at connect, on every
    /// listener (see `stowage_unit::auth`). `None`: clients connect without one.
    pub secret: Option<stowage_wire::auth::Secret>,
    /// Listen on TCP (loopback included) without a secret. Without it such
    /// a unit refuses to start: every local user, and anyone who reaches
    /// the address, could read, overwrite and clear every value.
    pub insecure: bool,
    /// Record metrics (request counts, latencies, bytes; see
    /// docs/metrics.md). Default true. Off, the unit records nothing on
    /// the request path, serves no metrics endpoint, and its stats carry
    /// no traffic counters.
    pub metrics: bool,
    /// Serve the metrics in the Prometheus text format on
    /// `http://ADDR/metrics`. Default `127.0.0.1:0` (loopback, any free
    /// port: `UnitHandle::metrics` tells which); `None`: no endpoint
    /// (the metrics are still recorded for stats).
    pub metrics_listen: Option<SocketAddr>,
    /// A file holding the metrics endpoint's bearer token: with it, every
    /// scrape must send `Authorization: Bearer <token>` (others are
    /// answered 401) and a connection that showed it is never evicted
    /// for another. `None` (default): no token.
    pub metrics_token_file: Option<std::path::PathBuf>,
    /// Serve one-sided NIXL transfers (docs/nixl.md): the slab is
    /// registered with a NIXL agent at start and clients that ask
    /// (`NixlInfo`) get its metadata. Needs a build with the `nixl`
    /// feature and libnixl_capi.so. `None` (default): no NIXL.
    pub nixl: Option<NixlConfig>,
}

/// How a unit serves NIXL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NixlConfig {
    /// Refuse to start unless UCX is held to RDMA transports (`UCX_TLS`;
    /// see `stowage_nixl::check_rdma`). Default true; off for tests and
    /// hosts without RDMA NICs, where UCX moves the bytes over tcp.
    pub require_rdma: bool,
    /// What a nixl client held when its connection ended (a clean close
    /// included) stays this long after the unit invalidated the client's
    /// NIXL agent (once the agent's last connection ended): time for
    /// transfers already posted to drain (docs/fencing.md). Default 5 s.
    pub quarantine: Duration,
}

impl Default for NixlConfig {
    fn default() -> Self {
        Self {
            require_rdma: true,
            quarantine: Duration::from_secs(5),
        }
    }
}

impl UnitConfig {
    pub fn new(name: impl Into<String>, memory: u64) -> Self {
        Self {
            name: name.into(),
            memory,
            uds: None,
            tcp: None,
            reservation_lease: Duration::from_secs(30),
            pin_lease: Duration::from_secs(30),
            claim_lease: Duration::from_secs(30),
            repair_window_lease: Duration::from_secs(30),
            quarantine: Duration::from_secs(5),
            limits: Limits::default(),
            mlock: true,
            huge_pages: HugePages::Auto,
            spin: Duration::from_micros(50),
            disk: None,
            high_watermark: 0.9,
            low_watermark: 0.8,
            disk_read_budget: DEFAULT_DISK_READ_BUDGET,
            failpoints: Vec::new(),
            restore: None,
            checkpoint_root: None,
            allow_other_uids: false,
            admin_tcp: false,
            frame_timeout: Duration::from_secs(10),
            max_io_timeout: Duration::from_secs(600),
            max_connections: 16384,
            max_sessions: 16_384,
            threads: 0,
            io_threads: 8,
            max_handshakes: 128,
            max_handshakes_per_source: 32,
            handshake_timeout: Duration::from_secs(1),
            max_session_connections: 64,
            max_session_holds: 16384,
            index_budget: None,
            spare_budget: None,
            outside_slab_budget: None,
            compaction_ratio: 0.25,
            secret: None,
            insecure: false,
            metrics: true,
            metrics_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            metrics_token_file: None,
            nixl: None,
        }
    }
}

/// Default [`UnitConfig::disk_read_budget`].
pub const DEFAULT_DISK_READ_BUDGET: u64 = 8 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_parse() {
        assert_eq!(parse_size("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("lots").is_err());
        assert_eq!(parse_duration("500ms").unwrap().as_millis(), 500);
        assert!(parse_duration("soon").is_err());
    }
}
