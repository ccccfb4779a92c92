//! The `stowage` command line, as a library function so that the binary
//! and the Python package (`python -m stowage ...`) run the same code.

use std::process::ExitCode;
use std::time::Duration;

use crate::unit::{DiskArgs, UnitArgs};
use crate::{bench, parse_duration, parse_size, workload};
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

/// Where the shared secret comes from (units and clients alike).
#[derive(clap::Args, Clone, Debug, Default)]
pub(crate) struct SecretArgs {
    /// A file holding the shared secret (owner-only, at least 16 bytes; a
    /// trailing line break is dropped). Without it, the environment
    /// variable STOWAGE_SECRET is used when set; with neither, no secret
    /// (a command given --directory proves the directory's, if it has one).
    #[arg(long, value_name = "PATH")]
    secret_file: Option<std::path::PathBuf>,
}

impl SecretArgs {
    /// The secret: `--secret-file` over `STOWAGE_SECRET`.
    pub(crate) fn secret(&self) -> Result<Option<Secret>, String> {
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

    /// The directory's copies of every row and each unit's host (1 and
    /// none without a directory).
    fn copies(&self) -> Result<(usize, Vec<Option<String>>), String> {
        match &self.directory {
            Some(path) => {
                let d = UnitDirectory::from_file(path)?;
                Ok((d.replicas, d.units.iter().map(|u| u.host.clone()).collect()))
            }
            None => Ok((1, Vec::new())),
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
    Unit(UnitArgs),
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
        /// With copies and a unit down: the namespace whose rows short of
        /// a copy are counted.
        #[arg(long, default_value = "default")]
        namespace: String,
        #[command(flatten)]
        secret: SecretArgs,
    },
    /// With copies (a directory's `replicas` over 1): find the units that
    /// are dead or restarted, and give the rows that had a copy there
    /// their copies again on the units up (docs/replication.md#repair).
    /// Exits non-zero when repairs are left (another client holds their
    /// window past --within, or a unit failed).
    Repair {
        /// The plane's directory file (from `stowage up` or a launcher).
        #[arg(long, value_name = "FILE")]
        directory: std::path::PathBuf,
        /// The namespace whose rows are repaired.
        #[arg(long, default_value = "default")]
        namespace: String,
        /// Every row's copies from whichever copy holds it, not only the
        /// rows of dead units: after restarting units from a checkpoint
        /// that kept one copy, before the plane serves.
        #[arg(long)]
        rebuild: bool,
        /// Take unit UNIT back into the plane first: the instance started
        /// again at its address (empty, after it died or was fenced)
        /// rejoins, and the repair gives it the rows it held
        /// (docs/replication.md#rejoining). May be given more than once.
        #[arg(long, value_name = "UNIT")]
        rejoin: Vec<usize>,
        /// Keep trying, a second apart, for this long.
        #[arg(long, value_parser = parse_duration, default_value = "10m")]
        within: Duration,
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
        Cmd::Unit(args) => crate::unit::run(args, matches.subcommand_matches("unit")),
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
        } => up(&config, directory.as_deref(), units, exit_with_stdin)
            .inspect_err(|e| crate::unit::say_failed(e)),
        Cmd::Checkpoint {
            dir,
            units,
            timeout,
            secret,
        } => {
            let (addrs, secret) = units.resolve(&secret)?;
            let (replicas, hosts) = units.copies()?;
            let client = if replicas > 1 {
                // With copies, one copy of each row is written: a unit
                // down (found by asking every unit) writes nothing, its
                // rows' copies write them.
                let mut cfg = ClientConfig::new("default", addrs.clone());
                cfg.shm = false;
                cfg.secret = secret;
                cfg.timeout = timeout;
                cfg.replicas = replicas;
                cfg.hosts = hosts;
                let c = Client::connect(cfg).map_err(|e| e.to_string())?;
                let _ = c.stats(c.deadline());
                c
            } else {
                control_client(&addrs, timeout, secret)?
            };
            let infos = client
                .checkpoint(&dir, client.deadline())
                .map_err(|e| e.to_string())?;
            for (i, info) in infos.iter().enumerate() {
                if replicas > 1 && info.files.is_empty() && info.host.is_empty() {
                    println!("unit {i}: down, its rows written by their copies");
                    continue;
                }
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
            namespace,
            secret,
        } => {
            let file = config
                .as_deref()
                .map(Config::from_file)
                .transpose()
                .map_err(|e| e.to_string())?;
            let mut expected = Vec::new();
            let mut dir_secret = None;
            let (mut replicas, mut hosts) = (1, Vec::new());
            let addrs: Vec<UnitAddr> = if let Some(d) = &directory {
                let dir = UnitDirectory::from_file(d)?;
                expected = dir.instances();
                replicas = dir.replicas;
                hosts = dir.units.iter().map(|u| u.host.clone()).collect();
                dir_secret = dir.secret()?;
                dir.addrs(TransportChoice::Auto, &stowage_client::host_id())?
            } else if !units.is_empty() {
                parse_addrs(&units)?
            } else if let Some(c) = &file {
                replicas = c.units.replicas;
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
                replicas,
                hosts,
                namespace,
            };
            crate::status::run(&opts, &mut std::io::stdout().lock())
        }
        Cmd::Repair {
            directory,
            namespace,
            rebuild,
            rejoin,
            within,
            secret,
        } => {
            let opts = crate::repair::RepairOptions {
                directory: &directory,
                namespace: &namespace,
                secret: secret.secret()?,
                rebuild,
                rejoin,
                within,
            };
            match crate::repair::run(&opts, &mut std::io::stdout().lock())? {
                true => Ok(()),
                false => Err("repairs are left".into()),
            }
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

/// `stowage up`: the config's units on this host, until interrupted. It
/// prints `READY directory=…` once they serve, or (as a unit does)
/// `FAILED <reason>` when they cannot start: a unit that refuses to start
/// fails it at once with the unit's reason.
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
    c.units.check_replicas(n)?;
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
    let mut dir = plane.directory();
    dir.replicas = c.units.replicas;
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
        crate::unit::when_stdin_closes(move || {
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
