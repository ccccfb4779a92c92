//! What a second copy of every row costs (`ClientConfig::replicas`,
//! docs/replication.md): puts and gets with 1 and with 2 copies, in one
//! run, as ratios.
//!
//! Starts two units (512 MiB each, the `stowage` binary beside this
//! example). Per transport (`shm`, `tcp` over loopback), value size and
//! round, 1 and 2 copies (2 copies twice: forwarded by the first copy's
//! unit — down a chain over tcp, slab to slab over shm — and sent by the
//! client to both; which goes first turns by round): a new writer process (this program
//! again) connects, fills a buffer of `--total` MiB (cold by the time it
//! is read: larger than the caches) and puts it, one value per put; then
//! a new reader process gets every value, one per get, into a buffer it
//! made before timing; then the rows are cleared. It prints each side's
//! GB/s (of the caller's bytes: a 2-copy put moves twice as many) and
//! the medians' ratio, 2 copies against 1.
//!
//! With `--netns` (root: `ip netns`), tcp only, between two network
//! namespaces: the units listen on one end of a veth pair in this
//! program's namespace, and the writer and reader run in a namespace the
//! program makes (`stowage-rc-<pid>`, removed at its end), on the pair's
//! other end.
//!
//! ```text
//! cargo build --release -p stowage-cli --bin stowage --example replica_cost
//! target/release/examples/replica_cost [--rounds 3] [--total 256] [--sizes 1,16] [--netns]
//! ```

use std::process::Command;
use std::time::{Duration, Instant};

use stowage_cli::bench::{arg, quantile};
use stowage_client::{
    Client, ClientConfig, Column, DType, RowKey, Secret, Sink, Tensor, TensorAsk, UnitAddr,
};
use stowage_local::{LocalOptions, LocalPlane};

const MIB: usize = 1 << 20;
const FIELD: &str = "tokens";

/// A writer or reader process: `child ROLE ADDRS SECRET_FILE SHM REPLICAS
/// SIZE TOTAL FORWARD`; prints the seconds its puts or gets took.
fn child(a: &[String]) {
    let (role, addrs, secret) = (&a[0], &a[1], &a[2]);
    let shm = a[3] == "shm";
    let replicas: usize = a[4].parse().unwrap();
    let size: usize = a[5].parse().unwrap();
    let total: usize = a[6].parse().unwrap();
    let forward = a[7] == "forward";
    let addrs: Vec<UnitAddr> = addrs.split(',').map(|s| s.parse().unwrap()).collect();
    let mut cfg = ClientConfig::new("replica-cost", addrs);
    cfg.secret = Some(Secret::from_file(std::path::Path::new(secret)).unwrap());
    cfg.shm = shm;
    cfg.replicas = replicas;
    cfg.forward = forward;
    cfg.timeout = Duration::from_secs(60);
    let c = Client::connect(cfg).unwrap();
    c.check_units(c.deadline()).unwrap();
    let n = total / size;
    let mut buf = vec![0u8; total];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i * 31 / 7) as u8;
    }
    let t0 = Instant::now();
    for (i, chunk) in buf.chunks_mut(size).enumerate().take(n) {
        let key = [RowKey::Index(i as u64)];
        if role == "put" {
            let t = Tensor {
                dtype: DType::U8,
                shape: vec![size as u64],
                data: chunk,
            };
            c.put(
                "p",
                &key,
                &[(FIELD, Column::Jagged(vec![t]))],
                None,
                c.deadline(),
            )
            .unwrap();
        } else {
            let mut into = Into(chunk);
            c.get_tensors_into("p", &key, &[FIELD], None, &mut into, c.deadline())
                .unwrap();
        }
    }
    println!("{}", t0.elapsed().as_secs_f64());
}

/// A get's sink: the value goes straight into the reader's buffer.
struct Into<'a>(&'a mut [u8]);

impl<'x> Sink<TensorAsk<'x>> for Into<'_> {
    fn slot(&mut self, ask: TensorAsk<'x>) -> Result<&mut [u8], String> {
        assert_eq!(ask.shape, [self.0.len() as u64]);
        Ok(&mut self.0[..])
    }
}

fn run_child(exe: &std::path::Path, netns: Option<&Netns>, args: &[String]) -> f64 {
    let mut cmd = match netns {
        Some(n) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &n.name]).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    let out = cmd.arg("child").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "child {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// A network namespace for the writer and reader, joined to this one by
/// a veth pair (`UNITS_IP` here, `CLIENT_IP` there); removed on drop.
struct Netns {
    name: String,
}

const UNITS_IP: &str = "10.79.0.1";
const CLIENT_IP: &str = "10.79.0.2";

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

impl Netns {
    fn make() -> Netns {
        let name = format!("stowage-rc-{}", std::process::id());
        let (here, there) = (
            format!("rc{}h", std::process::id()),
            format!("rc{}c", std::process::id()),
        );
        ip(&["netns", "add", &name]);
        let n = Netns { name };
        ip(&["-n", &n.name, "link", "set", "lo", "up"]);
        ip(&[
            "link", "add", &here, "type", "veth", "peer", "name", &there, "netns", &n.name,
        ]);
        ip(&["addr", "add", &format!("{UNITS_IP}/24"), "dev", &here]);
        ip(&["link", "set", &here, "up"]);
        ip(&[
            "-n",
            &n.name,
            "addr",
            "add",
            &format!("{CLIENT_IP}/24"),
            "dev",
            &there,
        ]);
        ip(&["-n", &n.name, "link", "set", &there, "up"]);
        n
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Its end of the pair goes with it, and so the pair.
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("child") {
        return child(&args[2..]);
    }
    let rounds: usize = arg(&args, "--rounds", "3").parse().unwrap();
    let total = arg(&args, "--total", "256").parse::<usize>().unwrap() * MIB;
    let sizes: Vec<usize> = arg(&args, "--sizes", "1,16")
        .split(',')
        .map(|s| s.parse::<usize>().unwrap() * MIB)
        .collect();
    let netns = args.iter().any(|a| a == "--netns").then(Netns::make);
    let stowage = stowage_cli::bench::stowage_binary(None).unwrap_or_else(|e| panic!("{e}"));
    let mut opts = LocalOptions::new(2, 512 << 20);
    opts.command = vec![stowage.into(), "unit".into()];
    if netns.is_some() {
        opts.tcp_host = UNITS_IP.parse().unwrap();
    }
    let plane = LocalPlane::start(&opts).expect("starting two units");
    let secret = plane.private_dir().join("secret");
    let exe = std::env::current_exe().unwrap();
    let mut cfg = ClientConfig::new("replica-cost", plane.uds_addrs());
    cfg.secret = plane.secret().cloned();
    cfg.replicas = 2;
    let admin = Client::connect(cfg).unwrap();
    println!(
        "two units, {} MiB per round, values one per call; GB/s of the caller's bytes; median [min-max] over {rounds} rounds{}",
        total / MIB,
        if netns.is_some() {
            "; writer and reader in another network namespace (veth)"
        } else {
            ""
        }
    );
    let transports: &[&str] = if netns.is_some() {
        &["tcp"]
    } else {
        &["shm", "tcp"]
    };
    for &transport in transports {
        let addrs = if transport == "shm" {
            plane.uds_addrs()
        } else {
            plane.tcp_addrs()
        };
        let addrs: Vec<String> = addrs.iter().map(ToString::to_string).collect();
        let addrs = addrs.join(",");
        for &size in &sizes {
            // What is compared: 1 copy; 2 copies, the unit forwarding the
            // second (over tcp down a chain, over shm copying from its slab
            // into the other's); 2 copies, the client sending both.
            let variants: &[(usize, bool, &str)] = &[
                (1, true, "1 copy"),
                (2, true, "2 copies forwarded"),
                (2, false, "2 copies sent by the client"),
            ];
            // [variant][put, get] seconds per round.
            let mut secs = vec![[Vec::new(), Vec::new()]; variants.len()];
            for r in 0..rounds {
                // Which goes first turns from round to round.
                for k in 0..variants.len() {
                    let v = (r + k) % variants.len();
                    let (replicas, forward, _) = variants[v];
                    let common = |role: &str| {
                        vec![
                            role.to_string(),
                            addrs.clone(),
                            secret.display().to_string(),
                            transport.to_string(),
                            replicas.to_string(),
                            size.to_string(),
                            total.to_string(),
                            if forward { "forward" } else { "send" }.to_string(),
                        ]
                    };
                    let ns = netns.as_ref();
                    secs[v][0].push(run_child(&exe, ns, &common("put")));
                    secs[v][1].push(run_child(&exe, ns, &common("get")));
                    admin.clear_partition("p", admin.deadline()).expect("clear");
                }
            }
            let gbps = |s: &mut Vec<f64>| {
                let med = quantile(s, 0.5);
                let (lo, hi) = (s[0], s[s.len() - 1]);
                let g = |t: f64| total as f64 / t / 1e9;
                (med, format!("{:.2} [{:.2}-{:.2}]", g(med), g(hi), g(lo)))
            };
            let transport = if netns.is_some() {
                "tcp/netns"
            } else {
                transport
            };
            for (side, name) in [(0, "put"), (1, "get")] {
                let (one, one_s) = gbps(&mut secs[0][side]);
                let mut line = format!(
                    "{transport} {:>2} MiB {name}: 1 copy {one_s} GB/s",
                    size / MIB
                );
                for (v, &(_, _, label)) in variants.iter().enumerate().skip(1) {
                    let (t, t_s) = gbps(&mut secs[v][side]);
                    line += &format!("; {label} {t_s} GB/s, {:.2}x the time of 1", t / one);
                }
                println!("{line}");
            }
        }
    }
}
