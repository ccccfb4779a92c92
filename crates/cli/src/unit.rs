//! `stowage unit`: its options, the [`UnitConfig`] they make (over a config
//! file's, when one is given), and the run of one unit.
//!
//! Each setting that goes straight into a [`UnitConfig`] field is written
//! once, in [`stowage_config::unit_settings_table!`]: its flag (name,
//! help, default), the field it sets and its config file key, which
//! [`unit_settings!`] makes options of. The options that are more than a
//! field (the listeners, the secret, the disk tier, metrics, NIXL, the
//! config file) are [`UnitArgs`]' own.

use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::ArgMatches;
use stowage_client::UnitAddr;
use stowage_cluster::config::Config;
#[cfg(test)]
use stowage_config::HugePages;
use stowage_config::UnitConfig;

use crate::cli::SecretArgs;
use crate::{parse_duration, parse_size};

/// The options of `stowage unit` that each set one [`UnitConfig`]
/// field, from the table both they and the config file's keys come from
/// ([`stowage_config::unit_settings_table!`]): each entry is a field of
/// [`UnitSettings`] (its doc comment is the flag's help, its `#[arg]` the
/// flag and its default) and the config field it sets. With `--config`,
/// only those given on the command line are applied over the file's
/// settings; without it, every one is (its default included).
macro_rules! unit_settings {
    ($($(#[$attr:meta])* $flag:ident: $ty:ty => $field:ident $(= |$v:ident| $set:expr)?
        $(, file $section:ident.$key:ident)?;)*) => {
        /// The options of `stowage unit` that each set one [`UnitConfig`]
        /// setting.
        #[derive(clap::Args, Clone, Debug)]
        pub(crate) struct UnitSettings {
            $($(#[$attr])* $flag: $ty,)*
        }

        impl UnitSettings {
            /// Set `cfg`'s settings from those options for which
            /// `applies(id)` (`id`: the field's name, clap's id of it).
            fn apply(self, cfg: &mut UnitConfig, applies: impl Fn(&str) -> bool) {
                $(if applies(stringify!($flag)) {
                    let value = self.$flag;
                    $(let value = { let $v = value; $set };)?
                    cfg.$field = value;
                })*
            }
        }
    };
}

stowage_config::unit_settings_table!(unit_settings);

/// The disk tier's settings (a unit's, or every unit's of a local plane).
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct DiskArgs {
    /// Root directory of the disk tier (each unit works in its own
    /// owner-only, locked subdirectory). Without it, no disk tier.
    #[arg(long)]
    disk: Option<PathBuf>,
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
    pub(crate) fn unit_args(&self) -> Vec<String> {
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

    /// Set `cfg`'s disk tier from those options for which `applies(id)`;
    /// a capacity alone resizes the disk tier `cfg` already has.
    fn apply(self, cfg: &mut UnitConfig, applies: impl Fn(&str) -> bool) {
        if applies("disk") {
            cfg.disk = self.disk.map(|d| (d, self.disk_capacity));
        } else if let (Some(d), true) = (&mut cfg.disk, applies("disk_capacity")) {
            d.1 = self.disk_capacity;
        }
        if applies("high_watermark") {
            cfg.high_watermark = self.high_watermark;
        }
        if applies("low_watermark") {
            cfg.low_watermark = self.low_watermark;
        }
        if applies("disk_read_budget") {
            cfg.disk_read_budget = self.disk_read_budget;
        }
    }
}

/// `stowage unit`'s options.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct UnitArgs {
    /// Take the unit's settings from this config file (docs/config.md);
    /// options given on the command line override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// With --config: this unit's index (its name, its TCP port when
    /// the file names a base port, its socket in listen.unix_dir).
    #[arg(long, default_value_t = 0)]
    index: usize,
    /// Where to listen: unix:/path/unit.sock and/or tcp:127.0.0.1:PORT
    /// (repeatable; TCP needs a secret or --insecure). Default:
    /// unix:$XDG_RUNTIME_DIR/stowage/unit-0.sock, else
    /// unix:/tmp/stowage-UID/unit-0.sock (a private 0700 directory),
    /// else, when another user made that directory first (or it is a
    /// link), unix:$HOME/.stowage/run/unit-0.sock, else (no usable HOME)
    /// unix:/tmp/stowage-UID-XXXXXX/unit-0.sock, a private directory of
    /// its own; a warning names the fallback.
    #[arg(long)]
    listen: Vec<String>,
    #[command(flatten)]
    settings: UnitSettings,
    /// Exit when standard input closes (the parent is gone).
    #[arg(long)]
    exit_with_stdin: bool,
    #[command(flatten)]
    disk: DiskArgs,
    /// Every client must prove this shared secret at connect.
    #[command(flatten)]
    secret: SecretArgs,
    /// Serve Prometheus metrics on http://ADDR/metrics (default
    /// 127.0.0.1:0: loopback, any free port, printed in the READY
    /// line); `off`: no endpoint.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
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
}

/// Run one unit until it is asked to exit. A unit that cannot start
/// prints `FAILED <reason>` (one line) on stdout for its launcher, which
/// waits for `READY …` there, and fails with that reason.
pub(crate) fn run(args: UnitArgs, matches: Option<&ArgMatches>) -> Result<(), String> {
    let exit_with_stdin = args.exit_with_stdin;
    let given =
        |id: &str| matches.and_then(|m| m.value_source(id)) == Some(ValueSource::CommandLine);
    let handle = match unit_config(args, given)
        .and_then(|c| stowage_unit::start(c).map_err(|e| e.to_string()))
    {
        Ok(h) => h,
        Err(e) => {
            say_failed(&e);
            return Err(e);
        }
    };
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
        when_stdin_closes(move || {
            tracing::info!("standard input closed; unit exiting");
            h.request_exit();
        });
    }
    handle.wait_for_exit();
    handle.stop();
    Ok(())
}

/// Run `then` on a thread of its own once standard input closes (the
/// parent that holds its other end is gone).
pub(crate) fn when_stdin_closes(then: impl FnOnce() + Send + 'static) {
    std::thread::spawn(move || {
        let mut sink = [0u8; 256];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
        then();
    });
}

/// Tell a launcher waiting for `READY …` on stdout why this process will
/// not serve: one line, `FAILED <reason>`.
pub(crate) fn say_failed(reason: &str) {
    println!("FAILED {}", reason.replace('\n', " "));
}

/// The unit's settings: the config file's (unit `index` of it) when one
/// is given, with the options `given(id)` on the command line over them;
/// without a file, every option's (its default included).
fn unit_config(args: UnitArgs, given: impl Fn(&str) -> bool) -> Result<UnitConfig, String> {
    let file = args
        .config
        .as_deref()
        .map(Config::from_file)
        .transpose()
        .map_err(|e| e.to_string())?;
    let applies = |id: &str| file.is_none() || given(id);
    let index = args.index;
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
        None => UnitConfig::new(args.settings.name.clone(), args.settings.memory),
    };
    args.settings.apply(&mut cfg, applies);
    if applies("secret_file") {
        cfg.secret = args.secret.secret()?;
    }
    args.disk.apply(&mut cfg, applies);
    if args.nixl {
        cfg.nixl = Some(stowage_unit::NixlConfig {
            require_rdma: !args.nixl_allow_tcp,
            quarantine: args.nixl_quarantine,
        });
    }
    match args.metrics_listen.as_deref() {
        None => {}
        Some("off" | "none") => cfg.metrics_listen = None,
        Some(a) => {
            cfg.metrics_listen = Some(a.parse().map_err(|_| {
                format!("--metrics-listen {a:?}: not an address such as 127.0.0.1:9464 (or off)")
            })?)
        }
    }
    if !args.listen.is_empty() {
        cfg.uds = None;
        cfg.tcp = None;
        for l in &args.listen {
            match l.parse::<UnitAddr>()? {
                UnitAddr::Unix(p) => cfg.uds = Some(p),
                UnitAddr::Tcp(a) => cfg.tcp = Some(a),
            }
        }
    } else if file.is_none() {
        cfg.uds = Some(stowage_unit::runtime_dir::default_socket(0).map_err(|e| e.to_string())?);
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches};

    #[derive(clap::Parser)]
    struct Unit {
        #[command(flatten)]
        args: UnitArgs,
    }

    /// The settings of `stowage unit ARGS` (no config file).
    fn settings(args: &[&str]) -> UnitConfig {
        let m = Unit::command()
            .try_get_matches_from(std::iter::once("unit").chain(args.iter().copied()))
            .unwrap();
        let u = Unit::from_arg_matches(&m).unwrap();
        unit_config(u.args, |id| {
            m.value_source(id) == Some(ValueSource::CommandLine)
        })
        .unwrap()
    }

    /// Without options a unit runs with [`UnitConfig::new`]'s settings:
    /// the flags' defaults are the config's.
    #[test]
    fn the_flags_defaults_are_the_configs() {
        let got = settings(&["--listen", "unix:/nonexistent/u.sock"]);
        let mut want = UnitConfig::new("unit-0", 1 << 30);
        want.uds = Some("/nonexistent/u.sock".into());
        assert_eq!(format!("{got:?}"), format!("{want:?}"));
    }

    /// Every option of the table sets its field.
    #[test]
    fn each_option_sets_its_field() {
        let c = settings(&[
            "--memory=2MiB",
            "--name=u",
            "--pin-lease=1s",
            "--reservation-lease=2s",
            "--quarantine=3s",
            "--checkpoint-root=/ck",
            "--allow-other-uids",
            "--admin",
            "--frame-timeout=4s",
            "--max-connections=5",
            "--max-sessions=6",
            "--threads=7",
            "--io-threads=0",
            "--max-handshakes=9",
            "--max-handshakes-per-source=10",
            "--handshake-timeout=11s",
            "--max-session-connections=12",
            "--max-session-holds=13",
            "--index-budget=14",
            "--spare-budget=15",
            "--compaction-ratio=0.5",
            "--no-mlock",
            "--huge-pages=4k",
            "--spin=0s",
            "--failpoint=disk-write",
            "--restore=/r",
            "--insecure",
            "--no-metrics",
            "--metrics-token-file=/t",
        ]);
        let s = Duration::from_secs;
        assert_eq!((c.memory, c.name.as_str()), (2 << 20, "u"));
        assert_eq!(
            (c.pin_lease, c.reservation_lease, c.quarantine),
            (s(1), s(2), s(3))
        );
        assert_eq!(c.checkpoint_root, Some("/ck".into()));
        assert!(c.allow_other_uids && c.admin_tcp && c.insecure);
        assert!(!c.mlock && !c.metrics);
        assert_eq!(c.metrics_token_file, Some("/t".into()));
        assert_eq!((c.frame_timeout, c.handshake_timeout), (s(4), s(11)));
        assert_eq!(
            [c.max_connections, c.max_sessions, c.threads, c.io_threads],
            [5, 6, 7, 1]
        );
        assert_eq!([c.max_handshakes, c.max_handshakes_per_source], [9, 10]);
        assert_eq!([c.max_session_connections, c.max_session_holds], [12, 13]);
        assert_eq!((c.index_budget, c.spare_budget), (Some(14), Some(15)));
        assert_eq!(c.compaction_ratio, 0.5);
        assert_eq!(c.huge_pages, HugePages::Off);
        assert_eq!(c.spin, Duration::ZERO);
        assert_eq!(c.failpoints, ["disk-write"]);
        assert_eq!(c.restore, Some("/r".into()));
    }
}
