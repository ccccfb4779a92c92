//! The `stowage` command line, as a library function so that the binary
//! and the Python package (`python -m stowage ...`) run the same code.

use std::io::Read;
use std::process::ExitCode;
use std::time::Duration;

use crate::{bench, parse_duration, parse_size, workload};
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use stowage_client::{Client, ClientConfig, Secret, TransportChoice, UnitAddr, UnitDirectory};
use stowage_cluster::config::Config;
use stowage_local::{LocalOptions, LocalPlane};

#[derive(Parser)]
#[command(
    name = "stowage",
    version,
    about = "A data plane for RL post-training of LLMs"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Log lines as text (default) or JSON objects, one a line (also
    /// STOWAGE_LOG_FORMAT=json). The level comes from RUST_LOG (default:
    /// warnings, and the units' lifecycle at info).
    #[arg(long, global = true, value_enum, value_name = "FORMAT")]
    log_format: Option<LogFormat>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// What is logged when RUST_LOG is not set: warnings and errors, and the
/// lifecycle of units (start and stop, sessions opened and closed, spill
/// batches, checkpoints) at info; never a line per successful operation.
pub const DEFAULT_LOG_FILTER: &str = "warn,stowage_unit=info,stowage_cli=info";

/// Send `tracing` events to stderr: the level from RUST_LOG (else
/// [`DEFAULT_LOG_FILTER`]), as text or JSON lines (`json`, or
/// STOWAGE_LOG_FORMAT=json). Once per process; later calls do nothing.
pub fn init_logging(json: Option<bool>) {
    let json = json.unwrap_or_else(|| {
        std::env::var("STOWAGE_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"))
    });
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if json {
        b.json().with_current_span(false).try_init()
    } else {
        b.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init()
    };
}

#[derive(Clone, Copy, ValueEnum)]
enum TransportArg {
    Shm,
    Tcp,
}

/// The disk tier's settings (a unit's, or every unit's of a local plane).
#[derive(clap::Args, Clone, Debug)]
struct DiskArgs {
    /// Root directory of the disk tier (each unit works in its own
    /// owner-only, locked subdirectory). Without it, no disk tier.
    #[arg(long)]
    disk: Option<std::path::PathBuf>,
    /// Disk tier capacity per unit.
    #[arg(long, value_parser = parse_size, default_value = "20GiB")]
    disk_capacity: u64,
    /// Spill to disk past this fraction of the slab in use.
    #[arg(long, default_value_t = 0.9)]
    high_watermark: f64,
    /// Stop spilling below this fraction.
    #[arg(long, default_value_t = 0.8)]
    low_watermark: f64,
    /// Most heap a unit's reads from its disk tier take at once, all
    /// readers together: spilled values stream from file to socket (or
    /// into the slab) through buffers of at most 1 MiB taken from this;
    /// a reader finding none free waits within its deadline, then is
    /// answered Busy. At least 64KiB.
    #[arg(long, value_parser = parse_size, default_value = "8MiB")]
    disk_read_budget: u64,
}

impl DiskArgs {
    /// The same settings as `stowage unit` arguments.
    fn unit_args(&self) -> Vec<String> {
        let Some(dir) = &self.disk else {
            return Vec::new();
        };
        vec![
            "--disk".into(),
            dir.display().to_string(),
            "--disk-capacity".into(),
            self.disk_capacity.to_string(),
            "--high-watermark".into(),
            self.high_watermark.to_string(),
            "--low-watermark".into(),
            self.low_watermark.to_string(),
            "--disk-read-budget".into(),
            self.disk_read_budget.to_string(),
        ]
    }
}

/// Where the shared secret comes from (units and clients alike).
#[derive(clap::Args, Clone, Debug, Default)]
struct SecretArgs {
    /// A file holding the shared secret (owner-only, at least 16 bytes; a
    /// trailing line break is dropped). Without it, the environment
    /// variable STOWAGE_SECRET is used when set; with neither, no secret
    /// (a command given --directory proves the directory's, if it has one).
    #[arg(long, value_name = "PATH")]
    secret_file: Option<std::path::PathBuf>,
}

impl SecretArgs {
    /// The secret: `--secret-file` over `STOWAGE_SECRET`.
    fn secret(&self) -> Result<Option<Secret>, String> {
        match &self.secret_file {
            Some(p) => Secret::from_file(p).map(Some),
            None => Secret::from_env(),
        }
        .map_err(|e| e.to_string())
    }
}

/// The units a control command talks to: addresses, or a directory file.
#[derive(clap::Args, Clone, Debug)]
#[group(required = true, multiple = false)]
struct UnitsArgs {
    /// Unit addresses (unix:/path or tcp:host:port), in unit order.
    units: Vec<String>,
    /// A directory file (from `stowage up` or a launcher) instead of
    /// addresses: units on this host are reached through their Unix
    /// socket, others over TCP.
    #[arg(long, value_name = "FILE")]
    directory: Option<std::path::PathBuf>,
}

impl UnitsArgs {
    /// The addresses, and the secret to prove: `secret`'s (`--secret-file`,
    /// `STOWAGE_SECRET`), else the directory's.
    fn resolve(&self, secret: &SecretArgs) -> Result<(Vec<UnitAddr>, Option<Secret>), String> {
        let given = secret.secret()?;
        match &self.directory {
            Some(path) => {
                let d = UnitDirectory::from_file(path)?;
                let secret = match given {
                    Some(s) => Some(s),
                    None => d.secret()?,
                };
                Ok((
                    d.addrs(TransportChoice::Auto, &stowage_client::host_id())?,
                    secret,
                ))
            }
            None => Ok((parse_addrs(&self.units)?, given)),
        }
    }
}

/// Unit addresses as given on the command line.
fn parse_addrs(units: &[String]) -> Result<Vec<UnitAddr>, String> {
    units.iter().map(|u| u.parse::<UnitAddr>()).collect()
}

// Parsed once per process; boxing the unit's many options buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Run one storage unit.
    Unit {
        /// Take the unit's settings from this config file (docs/config.md);
        /// options given on the command line override it.
        #[arg(long, value_name = "FILE")]
        config: Option<std::path::PathBuf>,
        /// With --config: this unit's index (its name, its TCP port when
        /// the file names a base port, its socket in listen.unix_dir).
        #[arg(long, default_value_t = 0)]
        index: usize,
        /// Slab memory, e.g. 1GiB.
        #[arg(long, value_parser = parse_size, default_value = "1GiB")]
        memory: u64,
        /// Where to listen: unix:/path/unit.sock and/or tcp:127.0.0.1:PORT
        /// (repeatable; TCP needs a secret or --insecure). Default:
        /// unix:$XDG_RUNTIME_DIR/stowage/unit-0.sock, else
        /// unix:/tmp/stowage-UID/unit-0.sock (a private 0700 directory),
        /// else, when another user made that directory first (or it is a
        /// link), unix:$HOME/.stowage/run/unit-0.sock, with a warning.
        #[arg(long)]
        listen: Vec<String>,
        /// A name for logs.
        #[arg(long, default_value = "unit-0")]
        name: String,
        /// A pin held longer is reported as overdue in stats (never taken
        /// from its holder: a paused client may resume its copy).
        #[arg(long, value_parser = parse_duration, default_value = "30s")]
        pin_lease: Duration,
        /// An uncommitted reservation held longer is reported as overdue
        /// in stats (never taken from its holder).
        #[arg(long, value_parser = parse_duration, default_value = "30s")]
        reservation_lease: Duration,
        /// Quarantine of the range of a put stream the unit cut off.
        #[arg(long, value_parser = parse_duration, default_value = "5s")]
        quarantine: Duration,
        /// Checkpoints are written only under this directory (without it,
        /// the unit takes none).
        #[arg(long)]
        checkpoint_root: Option<std::path::PathBuf>,
        /// Accept Unix-socket clients of other users (default: only this
        /// user's; a client that connects maps the slab).
        #[arg(long)]
        allow_other_uids: bool,
        /// Accept admin requests (shutdown, checkpoint) over TCP too
        /// (default: only same-user clients on the Unix socket).
        #[arg(long)]
        admin: bool,
        /// Once a request frame has begun, the rest must arrive within this.
        #[arg(long, value_parser = parse_duration, default_value = "10s")]
        frame_timeout: Duration,
        /// Most connections served at once: those that proved the shared
        /// secret (or, without one, said Hello). Past it, a connection
        /// that proves itself is answered Busy.
        #[arg(long, default_value_t = 16384)]
        max_connections: usize,
        /// Most client sessions at once; past it, a new session is
        /// answered Busy.
        #[arg(long, default_value_t = 16_384)]
        max_sessions: usize,
        /// Threads that serve connections, each waiting on readiness
        /// events for its share of them (0: one per core).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Most threads for blocking work (a tcp put's or get's bytes,
        /// disk reads, checkpoints, nixl setup); idle ones exit.
        #[arg(long, default_value_t = 8)]
        io_threads: usize,
        /// Most connections at once that have not proved themselves yet;
        /// they never take a served connection's slot. Past it, a new
        /// connection cuts the oldest handshake of the source holding the
        /// most.
        #[arg(long, default_value_t = 128)]
        max_handshakes: usize,
        /// Most of those from one source (a local user, over the Unix
        /// socket or TCP from this host, loopback or a host address;
        /// otherwise an address, an IPv6 /64):
        /// past it, a new one cuts that source's oldest handshake.
        #[arg(long, default_value_t = 32)]
        max_handshakes_per_source: usize,
        /// A connection must prove the shared secret and say Hello within
        /// this of its accept, or it is cut.
        #[arg(long, value_parser = parse_duration, default_value = "1s")]
        handshake_timeout: Duration,
        /// Most connections of one client session.
        #[arg(long, default_value_t = 64)]
        max_session_connections: usize,
        /// Most reservations and pins one client session may hold at once.
        #[arg(long, default_value_t = 16384)]
        max_session_holds: usize,
        /// Bytes the key index may take (default: a quarter of the memory,
        /// at least 64 MiB); commits past it answer UnitFull.
        #[arg(long, value_parser = parse_size)]
        index_budget: Option<u64>,
        /// Bytes at the top of the slab that spares (reservations same-host
        /// clients keep for their next puts) come from; default 1/16 of
        /// the memory, at most half; 0: no spares.
        #[arg(long, value_parser = parse_size)]
        spare_budget: Option<u64>,
        /// Compaction's budget: bytes it may copy (moving blobs nobody can
        /// touch, to gather free memory into ranges) per byte stored; 0
        /// turns compaction off.
        #[arg(long, default_value_t = 0.25)]
        compaction_ratio: f64,
        /// Do not try to mlock the slab.
        #[arg(long)]
        no_mlock: bool,
        /// The slab's page mode: auto (hugetlb if the free huge pages hold
        /// the slab, else thp if shmem_enabled allows it, else 4k; never
        /// fails), hugetlb (MFD_HUGETLB: needs /proc/sys/vm/nr_hugepages;
        /// the slab rounds up to whole huge pages), thp (MADV_HUGEPAGE:
        /// needs /sys/kernel/mm/transparent_hugepage/shmem_enabled at
        /// advise or within_size) or 4k.
        #[arg(long, value_name = "MODE", default_value = "auto")]
        huge_pages: stowage_config::HugePages,
        /// Exit when standard input closes (the parent is gone).
        #[arg(long)]
        exit_with_stdin: bool,
        /// How long a serving thread polls for more requests after its
        /// last one before it sleeps in its readiness wait (0 disables
        /// adaptive polling). A same-host client's request ring stays
        /// polled this long, or four of that client's recent gaps between
        /// requests when that is longer (at most 500us), before it is
        /// parked.
        #[arg(long, value_parser = parse_duration, default_value = "50us")]
        spin: Duration,
        #[command(flatten)]
        disk: DiskArgs,
        /// Turn on a failpoint (tests): `disk-write` fails every disk write;
        /// `disk-sync` fails every blob file's last step (sync and rename),
        /// after a put to disk was answered Pending.
        #[arg(long)]
        failpoint: Vec<String>,
        /// Serve the checkpoint in this directory (a unit's own
        /// subdirectory of a checkpoint); refuses an incomplete one.
        #[arg(long)]
        restore: Option<std::path::PathBuf>,
        /// Every client must prove this shared secret at connect.
        #[command(flatten)]
        secret: SecretArgs,
        /// Serve TCP without a shared secret, loopback included (refused
        /// otherwise): every local user, and anyone who reaches the
        /// address, can then read, overwrite and clear every value.
        #[arg(long)]
        insecure: bool,
        /// Serve Prometheus metrics on http://ADDR/metrics (default
        /// 127.0.0.1:0: loopback, any free port, printed in the READY
        /// line); `off`: no endpoint.
        #[arg(long, value_name = "ADDR")]
        metrics_listen: Option<String>,
        /// Record no metrics at all (no endpoint; stats carry no traffic
        /// counters).
        #[arg(long)]
        no_metrics: bool,
        /// Serve one-sided NIXL transfers (UCX): register the slab with a
        /// NIXL agent and give clients its metadata (docs/nixl.md). Needs
        /// a build with the `nixl` feature and libnixl_capi.so on
        /// LD_LIBRARY_PATH; refused unless UCX_TLS holds UCX to RDMA
        /// transports, but see --nixl-allow-tcp.
        #[arg(long)]
        nixl: bool,
        /// With --nixl: let UCX move the bytes over tcp (tests, hosts
        /// without RDMA NICs); figures then say nothing of RDMA speed.
        #[arg(long, requires = "nixl")]
        nixl_allow_tcp: bool,
        /// With --nixl: what a nixl client held when its connection ended
        /// (a clean close included: a network can end it while the
        /// client's one-sided transfers still run) is released this long
        /// after the unit invalidated the client's NIXL agent, once that
        /// agent's last connection ended (docs/fencing.md).
        #[arg(long, requires = "nixl", value_parser = parse_duration, default_value = "5s")]
        nixl_quarantine: Duration,
    },
    /// Start a local data plane and run a workload against it.
    Local {
        /// Number of units.
        #[arg(long, default_value_t = 2)]
        units: usize,
        /// Memory per unit.
        #[arg(long, value_parser = parse_size, default_value = "256MiB")]
        memory: u64,
        /// Transport between the workload and the units.
        #[arg(long, value_enum, default_value = "shm")]
        transport: TransportArg,
        /// RL steps to run.
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// Rows (samples) per step.
        #[arg(long, default_value_t = 1024)]
        rows: usize,
        /// Shortest sequence, in tokens.
        #[arg(long, default_value_t = 512)]
        min_tokens: usize,
        /// Longest sequence, in tokens.
        #[arg(long, default_value_t = 4096)]
        max_tokens: usize,
        #[command(flatten)]
        disk: DiskArgs,
        /// The units get this shared secret (in an owner-only file, never
        /// on their command line) and the workload proves it. Default: a
        /// fresh one for this plane.
        #[command(flatten)]
        secret: SecretArgs,
    },
    /// Start the units a config file describes on this host (standalone,
    /// without Ray), write their directory for clients, and run until
    /// interrupted (Ctrl-C, SIGTERM, SIGHUP); then stop them with their
    /// teardown, within the config's stop timeout. The units exit by
    /// themselves if this process dies.
    Up {
        /// The config file (docs/config.md).
        #[arg(long, value_name = "FILE")]
        config: std::path::PathBuf,
        /// Where to write the directory (JSON) that clients connect by;
        /// removed at exit. It carries the units' secret when this command
        /// generated it (no auth.secret_file, no STOWAGE_SECRET, not
        /// auth.insecure), and is then owner-only (0600). Default: written
        /// in the plane's private directory, its path printed after the
        /// directory (without the secret) on standard output.
        #[arg(long, value_name = "FILE")]
        directory: Option<std::path::PathBuf>,
        /// Number of units (default: the config's units.count, else 2).
        #[arg(long)]
        units: Option<usize>,
        /// Also stop when standard input closes (for a parent process that
        /// holds a pipe to it).
        #[arg(long)]
        exit_with_stdin: bool,
    },
    /// Measure put/get against memcpy and raw TCP on this machine.
    Bench {
        /// A shorter run (a minute or less).
        #[arg(long)]
        quick: bool,
        /// Adaptive polling budget of the client and the units.
        #[arg(long, value_parser = parse_duration, default_value = "50us")]
        spin: Duration,
        /// Also measure the disk tier, in this directory (its filesystem is
        /// what the dd-style baseline measures).
        #[arg(long)]
        disk: Option<std::path::PathBuf>,
        /// Only the disk tier section (needs --disk).
        #[arg(long)]
        disk_only: bool,
        /// Start the units with --no-metrics (to measure what recording
        /// metrics costs).
        #[arg(long)]
        no_metrics: bool,
        /// Also measure stowage over nixl against raw NIXL transfers (a
        /// build with the `nixl` feature; see docs/nixl.md).
        #[arg(long)]
        nixl: bool,
    },
    /// Ask every unit to checkpoint to DIR/unit-<i> on its own host and
    /// print the metadata (restore with `stowage unit --restore DIR/unit-<i>`).
    Checkpoint {
        /// The checkpoint directory (must not hold a checkpoint already).
        dir: std::path::PathBuf,
        #[command(flatten)]
        units: UnitsArgs,
        #[arg(long, value_parser = parse_duration, default_value = "10m")]
        timeout: Duration,
        #[command(flatten)]
        secret: SecretArgs,
    },
    /// Stop units: each finishes or abandons a checkpoint within the
    /// timeout, removes its disk directory and exits. Reports problems;
    /// never fails.
    Shutdown {
        #[command(flatten)]
        units: UnitsArgs,
        #[arg(long, value_parser = parse_duration, default_value = "30s")]
        timeout: Duration,
        #[command(flatten)]
        secret: SecretArgs,
    },
    /// Every unit at a glance: state (up, busy, unreachable, restarted),
    /// memory and disk in use, rows, pins, operations and GB per second
    /// over the last interval, and a total.
    Status {
        /// Unit addresses (unix:/path or tcp:host:port), in unit order.
        units: Vec<String>,
        /// A directory file (from `stowage up` or a launcher): its units,
        /// and the instance each should be (another one is "restarted").
        #[arg(long, value_name = "FILE")]
        directory: Option<std::path::PathBuf>,
        /// A config file: its units on this host (`units.count`, sockets in
        /// `listen.unix_dir`, else unit-I.sock in the private runtime
        /// directory, as `stowage unit --config` puts them) unless
        /// addresses or --directory are given, and its secret.
        #[arg(long, value_name = "FILE")]
        config: Option<std::path::PathBuf>,
        /// Rates are over this interval (two samples this far apart).
        #[arg(long, value_parser = parse_duration, default_value = "1s")]
        interval: Duration,
        /// A unit that has not answered within this is unreachable.
        #[arg(long, value_parser = parse_duration, default_value = "2s")]
        timeout: Duration,
        /// Redraw every interval until interrupted.
        #[arg(long)]
        watch: bool,
        /// Print JSON (one object a line with --watch).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        secret: SecretArgs,
    },
    /// Print every unit's counters.
    Stats {
        #[command(flatten)]
        units: UnitsArgs,
        #[arg(long, default_value = "default")]
        namespace: String,
        #[command(flatten)]
        secret: SecretArgs,
    },
}

/// Run the command line `args` (the first is the program name). Sets up
/// logging to stderr once per process.
pub fn main_with_args<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let parsed = Cli::command()
        .try_get_matches_from(args)
        .and_then(|m| Cli::from_arg_matches(&m).map(|c| (c, m)));
    let (cli, matches) = match parsed {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    init_logging(cli.log_format.map(|f| f == LogFormat::Json));
    match run(cli, &matches) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stowage: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli, matches: &ArgMatches) -> Result<(), String> {
    match cli.cmd {
        Cmd::Unit {
            config,
            index,
            memory,
            listen,
            name,
            pin_lease,
            reservation_lease,
            quarantine,
            no_mlock,
            huge_pages,
            exit_with_stdin,
            spin,
            disk,
            failpoint,
            restore,
            checkpoint_root,
            allow_other_uids,
            admin,
            frame_timeout,
            max_connections,
            max_sessions,
            threads,
            io_threads,
            max_handshakes,
            max_handshakes_per_source,
            handshake_timeout,
            max_session_connections,
            max_session_holds,
            index_budget,
            spare_budget,
            compaction_ratio,
            secret,
            insecure,
            metrics_listen,
            no_metrics,
            nixl,
            nixl_allow_tcp,
            nixl_quarantine,
        } => {
            let file = config
                .as_deref()
                .map(Config::from_file)
                .transpose()
                .map_err(|e| e.to_string())?;
            // Without a file every option applies (its default included);
            // with one, only those given on the command line.
            let unit_matches = matches.subcommand_matches("unit");
            let set = |id: &str| {
                file.is_none()
                    || unit_matches.and_then(|m| m.value_source(id))
                        == Some(ValueSource::CommandLine)
            };
            let mut cfg = match &file {
                Some(c) => {
                    let mut u = c
                        .unit_config(index, None, None)
                        .map_err(|e| e.to_string())?;
                    let port = match c.listen.tcp_port {
                        0 => 0,
                        p => u16::try_from(usize::from(p) + index).map_err(|_| {
                            format!("listen.tcp_port {p} + unit index {index} is past 65535")
                        })?,
                    };
                    u.tcp = Some(std::net::SocketAddr::new(c.resolve_listen_host(), port));
                    u.uds = Some(c.unit_socket(index).map_err(|e| e.to_string())?);
                    u
                }
                None => stowage_unit::UnitConfig::new(name.clone(), memory),
            };
            if set("name") {
                cfg.name = name;
            }
            if set("memory") {
                cfg.memory = memory;
            }
            if set("secret_file") {
                cfg.secret = secret.secret()?;
            }
            cfg.insecure |= insecure;
            if set("checkpoint_root") {
                cfg.checkpoint_root = checkpoint_root;
            }
            cfg.allow_other_uids = allow_other_uids;
            cfg.admin_tcp = admin;
            if set("frame_timeout") {
                cfg.frame_timeout = frame_timeout;
            }
            if set("max_connections") {
                cfg.max_connections = max_connections;
            }
            if set("max_sessions") {
                cfg.max_sessions = max_sessions;
            }
            if set("threads") {
                cfg.threads = threads;
            }
            if set("io_threads") {
                cfg.io_threads = io_threads.max(1);
            }
            if set("max_handshakes") {
                cfg.max_handshakes = max_handshakes;
            }
            if set("max_handshakes_per_source") {
                cfg.max_handshakes_per_source = max_handshakes_per_source;
            }
            if set("handshake_timeout") {
                cfg.handshake_timeout = handshake_timeout;
            }
            if set("max_session_connections") {
                cfg.max_session_connections = max_session_connections;
            }
            if set("max_session_holds") {
                cfg.max_session_holds = max_session_holds;
            }
            cfg.index_budget = index_budget;
            if set("spare_budget") {
                cfg.spare_budget = spare_budget;
            }
            if set("compaction_ratio") {
                cfg.compaction_ratio = compaction_ratio;
            }
            if set("pin_lease") {
                cfg.pin_lease = pin_lease;
            }
            if set("reservation_lease") {
                cfg.reservation_lease = reservation_lease;
            }
            cfg.quarantine = quarantine;
            cfg.mlock = !no_mlock;
            if set("huge_pages") {
                cfg.huge_pages = huge_pages;
            }
            cfg.spin = spin;
            if set("disk") {
                cfg.disk = disk.disk.map(|d| (d, disk.disk_capacity));
            } else if let (Some(d), true) = (&mut cfg.disk, set("disk_capacity")) {
                d.1 = disk.disk_capacity;
            }
            if set("high_watermark") {
                cfg.high_watermark = disk.high_watermark;
            }
            if set("low_watermark") {
                cfg.low_watermark = disk.low_watermark;
            }
            if set("disk_read_budget") {
                cfg.disk_read_budget = disk.disk_read_budget;
            }
            cfg.failpoints = failpoint;
            cfg.restore = restore;
            if no_metrics {
                cfg.metrics = false;
            }
            if nixl {
                cfg.nixl = Some(stowage_unit::NixlConfig {
                    require_rdma: !nixl_allow_tcp,
                    quarantine: nixl_quarantine,
                });
            }
            match metrics_listen.as_deref() {
                None => {}
                Some("off" | "none") => cfg.metrics_listen = None,
                Some(a) => {
                    cfg.metrics_listen = Some(a.parse().map_err(|_| {
                        format!(
                        "--metrics-listen {a:?}: not an address such as 127.0.0.1:9464 (or off)"
                    )
                    })?)
                }
            }
            if !listen.is_empty() {
                cfg.uds = None;
                cfg.tcp = None;
                for l in &listen {
                    match l.parse::<UnitAddr>()? {
                        UnitAddr::Unix(p) => cfg.uds = Some(p),
                        UnitAddr::Tcp(a) => cfg.tcp = Some(a),
                    }
                }
            } else if file.is_none() {
                cfg.uds =
                    Some(stowage_unit::runtime_dir::default_socket(0).map_err(|e| e.to_string())?);
            }
            let handle = stowage_unit::start(cfg).map_err(|e| e.to_string())?;
            // One line on stdout tells a launcher where the unit listens.
            println!(
                "READY uds={} tcp={} instance={:032x} metrics={}",
                handle
                    .uds
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                handle.tcp.map(|a| a.to_string()).unwrap_or_default(),
                handle.instance_id(),
                handle
                    .metrics
                    .map(|a| format!("http://{a}/metrics"))
                    .unwrap_or_default(),
            );
            let handle = std::sync::Arc::new(handle);
            if exit_with_stdin {
                let h = handle.clone();
                std::thread::spawn(move || {
                    let mut sink = [0u8; 256];
                    let mut stdin = std::io::stdin();
                    while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
                    tracing::info!("standard input closed; unit exiting");
                    h.request_exit();
                });
            }
            handle.wait_for_exit();
            handle.stop();
            Ok(())
        }
        Cmd::Local {
            units,
            memory,
            transport,
            steps,
            rows,
            min_tokens,
            max_tokens,
            disk,
            secret,
        } => {
            let secret = secret.secret()?;
            let exe = unit_command()?;
            println!(
                "starting a local data plane: {units} units x {}",
                bytesize::ByteSize(memory).display().iec()
            );
            let mut opts = LocalOptions::new(units, memory);
            opts.command = exe;
            opts.unit_args = disk.unit_args();
            opts.secret = secret.clone();
            let mut plane = LocalPlane::start(&opts)?;
            let addrs = match transport {
                TransportArg::Shm => plane.uds_addrs(),
                TransportArg::Tcp => plane.tcp_addrs(),
            };
            for (i, a) in addrs.iter().enumerate() {
                println!("  unit {i}: {a} (pid {})", plane.units[i].pid());
            }
            let mut cfg = ClientConfig::new("local", addrs);
            cfg.secret = plane.secret().cloned();
            let client = Client::connect(cfg).map_err(|e| e.to_string())?;
            if min_tokens > max_tokens {
                return Err("--min-tokens is larger than --max-tokens".into());
            }
            let w = workload::Workload {
                steps,
                rows,
                min_tokens,
                max_tokens,
            };
            println!(
                "workload: {steps} GRPO steps of {rows} rows, {min_tokens}-{max_tokens} tokens each: rollout put \
                 (input_ids i64, generation_logprobs bf16, token_mask i32), logprob read + write-back \
                 (prev_logprobs bf16), trainer read of all columns, clear; every byte checked"
            );
            let report = workload::run(&client, &w)?;
            report.print(match transport {
                TransportArg::Shm => "shm",
                TransportArg::Tcp => "tcp",
            });
            for (i, s) in client.stats(client.deadline()).into_iter().enumerate() {
                let s = s.map_err(|e| e.to_string())?;
                println!(
                    "  unit {i} after the run: {} entries, {} bytes of data, {} pins; {} bytes in spares, {} free (largest range {})",
                    s.entries, s.used, s.pins, s.spare_bytes, s.free_bytes, s.largest_free
                );
            }
            plane.stop();
            Ok(())
        }
        Cmd::Bench {
            quick,
            spin,
            disk,
            disk_only,
            no_metrics,
            nixl,
        } => {
            if !disk_only {
                bench::run(unit_command()?, quick, spin, no_metrics)?;
            }
            if nixl {
                bench::run_nixl(unit_command()?, quick)?;
            }
            match disk {
                Some(dir) => bench::run_disk(unit_command()?, &dir, quick),
                None if disk_only => Err("--disk-only needs --disk DIR".into()),
                None => Ok(()),
            }
        }
        Cmd::Up {
            config,
            directory,
            units,
            exit_with_stdin,
        } => up(&config, directory.as_deref(), units, exit_with_stdin),
        Cmd::Checkpoint {
            dir,
            units,
            timeout,
            secret,
        } => {
            let (addrs, secret) = units.resolve(&secret)?;
            let client = control_client(&addrs, timeout, secret)?;
            let infos = client
                .checkpoint(&dir, client.deadline())
                .map_err(|e| e.to_string())?;
            for (i, info) in infos.iter().enumerate() {
                println!(
                    "unit {i}: {} rows, {} entries, {} bytes, {} files, manifest xxh3 {:016x} -> {}",
                    info.rows,
                    info.entries,
                    info.bytes,
                    info.files.len(),
                    info.manifest_xxh3,
                    dir.join(format!("unit-{i}")).display()
                );
            }
            Ok(())
        }
        Cmd::Shutdown {
            units,
            timeout,
            secret,
        } => {
            let client = match units
                .resolve(&secret)
                .and_then(|(a, s)| control_client(&a, timeout, s))
            {
                Ok(c) => c,
                Err(e) => {
                    println!("nothing to shut down: {e}");
                    return Ok(());
                }
            };
            for (i, problems) in client.shutdown(timeout).into_iter().enumerate() {
                if problems.is_empty() {
                    println!("unit {i}: stopped");
                } else {
                    println!("unit {i}: {}", problems.join("; "));
                }
            }
            Ok(())
        }
        Cmd::Status {
            units,
            directory,
            config,
            interval,
            timeout,
            watch,
            json,
            secret,
        } => {
            let file = config
                .as_deref()
                .map(Config::from_file)
                .transpose()
                .map_err(|e| e.to_string())?;
            let mut expected = Vec::new();
            let mut dir_secret = None;
            let addrs: Vec<UnitAddr> = if let Some(d) = &directory {
                let dir = UnitDirectory::from_file(d)?;
                expected = dir.instances();
                dir_secret = dir.secret()?;
                dir.addrs(TransportChoice::Auto, &stowage_client::host_id())?
            } else if !units.is_empty() {
                parse_addrs(&units)?
            } else if let Some(c) = &file {
                (0..c.units.count.unwrap_or(2))
                    .map(|i| c.unit_socket(i).map(UnitAddr::Unix))
                    .collect::<Result<_, _>>()
                    .map_err(|e| e.to_string())?
            } else {
                return Err("give unit addresses, --directory FILE or --config FILE".into());
            };
            let secret = match (&secret.secret_file, &file) {
                (None, Some(c)) => c.secret().map_err(|e| e.to_string())?,
                _ => secret.secret()?,
            }
            .or(dir_secret);
            let opts = crate::status::StatusOptions {
                units: addrs,
                expected,
                secret,
                interval,
                timeout,
                watch,
                json,
            };
            crate::status::run(&opts, &mut std::io::stdout().lock())
        }
        Cmd::Stats {
            units,
            namespace,
            secret,
        } => {
            let (addrs, secret) = units.resolve(&secret)?;
            let mut cfg = ClientConfig::new(namespace, addrs.clone());
            cfg.shm = false;
            cfg.secret = secret;
            cfg.timeout = Duration::from_secs(5);
            let client = Client::connect(cfg).map_err(|e| e.to_string())?;
            // Fail at once on a unit that cannot be reached, as before
            // connecting was lazy.
            client
                .check_units(client.deadline())
                .map_err(|e| e.to_string())?;
            for (a, s) in addrs.iter().zip(client.stats(client.deadline())) {
                match s {
                    Ok(s) => {
                        println!(
                            "{a}: {}/{} bytes used by data ({} reserved, {} quarantined), {} blobs, {} entries, {} rows, {} pins; {} bytes held by sessions, {} holds overdue",
                            s.used, s.capacity, s.reserved_bytes, s.quarantined_bytes, s.blobs, s.entries, s.rows, s.pins, s.held_bytes, s.overdue_holds
                        );
                        println!(
                            "  {} partitions, {} bytes pinned, {} spares ({} bytes); since start: {} requests, {} bytes in, {} bytes out, {} busy answers",
                            s.partitions, s.pinned_bytes, s.spares, s.spare_bytes, s.ops, s.bytes_in, s.bytes_out, s.busy
                        );
                        println!(
                            "  {} bytes free, largest free range {}, {} blobs in pieces; compaction: {} moves, {} bytes; spare zone {} bytes",
                            s.free_bytes, s.largest_free, s.split_blobs, s.compaction_moves, s.compaction_bytes, s.spare_budget
                        );
                        for x in s
                            .sessions
                            .iter()
                            .filter(|x| x.held_bytes > 0 || x.orphaned > 0)
                        {
                            println!(
                                "  session {}: {} connections, {} reservations, {} pins, {} bytes held, oldest hold {} ms{}",
                                x.session,
                                x.connections,
                                x.reservations,
                                x.pins,
                                x.held_bytes,
                                x.oldest_hold_ms,
                                if x.orphaned > 0 {
                                    format!(", {} held by cut connections until its process exits", x.orphaned)
                                } else {
                                    String::new()
                                }
                            );
                        }
                    }
                    Err(e) => println!("{a}: {e}"),
                }
            }
            Ok(())
        }
    }
}

/// How to start a unit process from this process: this executable with the
/// `unit` subcommand, unless `STOWAGE_UNIT_COMMAND` names another command
/// (whitespace-separated, e.g. `python3 -m stowage unit`).
pub fn unit_command() -> Result<Vec<std::ffi::OsString>, String> {
    if let Ok(cmd) = std::env::var("STOWAGE_UNIT_COMMAND") {
        let parts: Vec<std::ffi::OsString> = cmd.split_whitespace().map(Into::into).collect();
        if parts.is_empty() {
            return Err("STOWAGE_UNIT_COMMAND is empty".into());
        }
        return Ok(parts);
    }
    let exe = std::env::current_exe().map_err(|e| format!("locating this executable: {e}"))?;
    Ok(vec![exe.into(), "unit".into()])
}

/// A client for control commands: no shm mapping, the given timeout,
/// every unit reached (a command fails at once on a unit it cannot reach,
/// as `shutdown`'s "nothing to shut down" relies on).
fn control_client(
    addrs: &[UnitAddr],
    timeout: Duration,
    secret: Option<Secret>,
) -> Result<Client, String> {
    let mut cfg = ClientConfig::new("default", addrs.to_vec());
    cfg.shm = false;
    cfg.secret = secret;
    cfg.timeout = timeout;
    let client = Client::connect(cfg).map_err(|e| e.to_string())?;
    client
        .check_units(client.deadline())
        .map_err(|e| e.to_string())?;
    Ok(client)
}

/// `stowage up`: the config's units on this host, until interrupted.
fn up(
    config: &std::path::Path,
    directory: Option<&std::path::Path>,
    units: Option<usize>,
    exit_with_stdin: bool,
) -> Result<(), String> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let c = Config::from_file(config).map_err(|e| e.to_string())?;
    let n = units.or(c.units.count).unwrap_or(2);
    if n == 0 {
        return Err("--units must be at least 1".into());
    }
    // Watch for the signals before any unit starts: an early Ctrl-C still
    // stops them properly.
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .map_err(|e| format!("installing signal handlers: {e}"))?;
    let config = std::path::absolute(config).map_err(|e| e.to_string())?;
    let mut opts = LocalOptions::new(n, c.units.memory);
    opts.command = unit_command()?;
    // Each unit reads the file as unit `i` (`--index i`): its metrics
    // port is `metrics.listen`'s + i.
    opts.config = Some(config);
    opts.secret = c.secret().map_err(|e| e.to_string())?;
    opts.insecure = c.auth.insecure;
    opts.tcp_host = c.resolve_listen_host();
    opts.tcp_port_base = c.listen.tcp_port;
    opts.start_timeout = c.timeouts.start;
    let mut plane = LocalPlane::start(&opts)?;
    let dir = plane.directory();
    let write = |path: &std::path::Path| {
        dir.write_file(path)
            .map_err(|e| format!("writing the directory to {}: {e}", path.display()))
    };
    match directory {
        Some(path) => {
            write(path)?;
            println!("READY directory={}", path.display());
        }
        None => {
            // The secret stays off standard output (logs, terminals):
            // the full directory is in the plane's private directory.
            let path = plane.private_dir().join("directory.json");
            write(&path)?;
            let shown = UnitDirectory {
                secret_hex: None,
                ..dir.clone()
            };
            println!("{}\nREADY directory={}", shown.to_json(), path.display());
        }
    }
    // Until a signal, or (when asked) until standard input closes.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    if exit_with_stdin {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut sink = [0u8; 256];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            let _ = tx.send("standard input closed".into());
        });
    }
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            let _ = tx.send(format!("signal {sig}"));
        }
    });
    let why = rx.recv().unwrap_or_default();
    eprintln!("stowage up: {why}; stopping {n} units");
    plane.stop_within(c.timeouts.stop);
    if let Some(path) = directory {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}
