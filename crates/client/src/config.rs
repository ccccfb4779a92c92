//! A client's settings ([`ClientConfig`]) and their defaults.

use std::sync::Arc;
use std::time::Duration;

use std::sync::OnceLock;

use crate::conn::RING_AFTER;
use crate::nixl::Failpoints;
#[cfg(doc)]
use crate::{Client, Error, UnitDirectory, SPARES};
use crate::{Directory, NixlOptions, ProbeDirectory, Secret, UnitAddr};

/// The partition of the raw-bytes conveniences ([`Client::put_rows`] and
/// friends).
pub const DEFAULT_PARTITION: &str = "";

/// Settings of a client.
#[derive(Clone)]
pub struct ClientConfig {
    /// The namespace every request acts in (isolates runs sharing units).
    pub namespace: String,
    /// The units, in order: unit `i` is `units[i]`.
    pub units: Vec<UnitAddr>,
    /// Default deadline of an operation ([`Client::deadline`]). Default 30 s.
    pub timeout: Duration,
    /// Use the shm transport for Unix-socket units (default true); false
    /// streams bytes through the socket as the tcp transport does.
    pub shm: bool,
    /// Asked about a unit after a failure. Default [`ProbeDirectory`].
    pub directory: Arc<dyn Directory>,
    /// How long to poll for a reply before blocking (adaptive polling;
    /// costs CPU while polling). Default 50 µs; zero disables it.
    pub spin: Duration,
    /// A put that finds a unit full (memory and disk) waits up to this long
    /// — within its own deadline — for a clear, or views dropped, to make
    /// room, instead of failing with [`Error::UnitFull`] at once (it asks
    /// again after 5 ms, doubling to 20 ms: it goes in that soon after the
    /// memory is freed). Default `None` (fail).
    pub wait_for_memory: Option<Duration>,
    /// The instance each unit is expected to be (from a
    /// [`UnitDirectory`]); empty or `None`: whichever answers first. A unit
    /// found to be another instance is treated as restarted: the first
    /// operation on it reports its keys lost.
    pub instances: Vec<Option<u128>>,
    /// The shared secret of units started with one: every connection
    /// proves it, and the unit must prove it back (a client with a secret
    /// refuses a unit that has none). Default `None`.
    pub secret: Option<Secret>,
    /// Same-host puts of at most this many bytes keep *spares*: each
    /// commit also reserves the connection's next put of the same size
    /// class, which the client then writes before it asks the unit
    /// anything, so such a put costs one round trip (its commit) instead
    /// of two (alloc, commit). A connection holds at most [`SPARES`]
    /// spares (reserved memory, shown in the unit's `reserved` bytes) and
    /// gives them back when a put finds the unit full, and when it closes.
    /// Zero turns spares off. Default [`SPARE_MAX`].
    pub spare_max: u64,
    /// Move bytes with one-sided NIXL transfers to the units this client
    /// does not reach over shm, where the unit serves nixl (`stowage unit
    /// --nixl`; units that do not are reached over tcp). Needs a build
    /// with the `nixl` feature and libnixl_capi.so (docs/nixl.md).
    /// Default `None`: tcp.
    pub nixl: Option<NixlOptions>,
    /// Most connections this client holds open to one unit at a time,
    /// shared by every thread that uses the client: a thread that finds
    /// them all in use waits, within its deadline, for one to be checked
    /// in (and fails with [`Error::Timeout`] at the deadline) rather than
    /// opening another. Views pin through a connection of their own per
    /// unit, which is not counted. Zero is taken as one. Default
    /// [`MAX_UNIT_CONNS`].
    pub max_unit_conns: usize,
    /// Let same-host connections pass their requests without payload
    /// through a request ring (no system call while the unit is busy) once
    /// they have made [`ClientConfig::ring_after`] round trips. Default
    /// true; false when the environment says `STOWAGE_RINGS=0` (read once
    /// per process).
    pub rings: bool,
    /// Round trips a same-host connection makes before it asks for a
    /// request ring (a connection used a few times only never costs the
    /// unit one). Default 16, or `STOWAGE_RING_AFTER` (read once per
    /// process; tests and benchmarks set 0 to use rings from the first
    /// request).
    pub ring_after: u32,
    /// Copies of every row, each on another unit (docs/replication.md):
    /// a put is acknowledged once every copy is committed, a get reads
    /// the next copy when one is gone, a clear clears every live copy.
    /// Every client of a plane must use the same number. At least 1, at
    /// most the number of units. Default 1.
    pub replicas: usize,
    /// The host of each unit (its directory's `host`; empty or `None`:
    /// unknown). With [`ClientConfig::replicas`] over 1, a row's copies
    /// go on units of distinct hosts whenever there are enough of them.
    /// Default empty.
    pub hosts: Vec<Option<String>>,
    /// With [`ClientConfig::replicas`] over 1, a put whose copies are all
    /// on units this client reaches over tcp sends its bytes once, to the
    /// first copy's unit (unless [`ClientConfig::hosts`] puts that unit
    /// on this client's host), which forwards them to the others as they
    /// arrive (docs/replication.md#forwarding); a copy whose forward
    /// fails, the client writes itself. Default true; false when the
    /// environment says `STOWAGE_FORWARD=0` (read at each config made):
    /// the client writes every copy.
    pub forward: bool,
    /// Bytes per second a repair copies at most (docs/replication.md#repair);
    /// 0: as fast as it goes. Default 2 GB/s.
    pub repair_rate: u64,
    /// Test failpoints. Default: those `STOWAGE_FAILPOINTS` names.
    pub failpoints: Failpoints,
}

/// Default [`ClientConfig::repair_rate`]: 2 GB/s.
pub const REPAIR_RATE: u64 = 2_000_000_000;

/// The failpoints `STOWAGE_FAILPOINTS` names (comma-separated; read at
/// each call).
fn failpoints_from_env() -> Failpoints {
    let set = std::env::var("STOWAGE_FAILPOINTS").unwrap_or_default();
    let has = |name: &str| set.split(',').any(|f| f.trim() == name);
    Failpoints {
        nixl_write_in_flight: has("nixl-write-in-flight"),
        nixl_read_in_flight: has("nixl-read-in-flight"),
        repair_gate: set
            .split(',')
            .find_map(|f| f.trim().strip_prefix("repair-gate=")?.parse().ok()),
    }
}

/// `STOWAGE_RINGS` and `STOWAGE_RING_AFTER`, read by the first config made
/// in the process: `(rings, ring_after)`; and `STOWAGE_SPIN_ALWAYS=1`,
/// which lets every wait of the process spin whatever the host's load
/// (`stowage_wire::io::spin_always`, for comparisons).
fn ring_switches() -> (bool, u32) {
    static SWITCHES: OnceLock<(bool, u32)> = OnceLock::new();
    *SWITCHES.get_or_init(|| {
        if std::env::var("STOWAGE_SPIN_ALWAYS").is_ok_and(|v| v.trim() == "1") {
            stowage_wire::io::spin_always(true);
        }
        let rings = rings_from_env(std::env::var("STOWAGE_RINGS").ok().as_deref());
        let after = std::env::var("STOWAGE_RING_AFTER")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(RING_AFTER);
        (rings, after)
    })
}

/// What `STOWAGE_RINGS` (or `STOWAGE_FORWARD`) says: on unless it is `0`.
pub(crate) fn rings_from_env(v: Option<&str>) -> bool {
    v.is_none_or(|v| v.trim() != "0")
}

/// Default [`ClientConfig::max_unit_conns`].
pub const MAX_UNIT_CONNS: usize = 4;

/// Default [`ClientConfig::spare_max`].
pub const SPARE_MAX: u64 = 4 << 20;

impl ClientConfig {
    /// The defaults, with the switches the environment sets
    /// (`STOWAGE_RINGS`, `STOWAGE_RING_AFTER`, `STOWAGE_FAILPOINTS`,
    /// `STOWAGE_SPIN_ALWAYS`, `STOWAGE_FORWARD`).
    pub fn new(namespace: impl Into<String>, units: Vec<UnitAddr>) -> Self {
        let (rings, ring_after) = ring_switches();
        Self {
            namespace: namespace.into(),
            units,
            timeout: Duration::from_secs(30),
            shm: true,
            directory: Arc::new(ProbeDirectory::default()),
            spin: Duration::from_micros(50),
            wait_for_memory: None,
            instances: Vec::new(),
            secret: None,
            spare_max: SPARE_MAX,
            nixl: None,
            max_unit_conns: MAX_UNIT_CONNS,
            rings,
            ring_after,
            replicas: 1,
            hosts: Vec::new(),
            forward: rings_from_env(std::env::var("STOWAGE_FORWARD").ok().as_deref()),
            repair_rate: REPAIR_RATE,
            failpoints: failpoints_from_env(),
        }
    }
}
