//! How many live client sessions one unit holds, what they cost it, and
//! what a flood of connections that never prove anything does to it.
//!
//! ```text
//! cargo build --release -p stowage-cli --examples --bin stowage
//! target/release/examples/sessions [--procs 10] [--sessions 1000] [--transport tcp|shm]
//!                                  [--seconds 10] [--memory-mib 256] [--timeout 5]
//!                                  [--openers 32] [--stowage PATH] [--unit-arg ARG]...
//! target/release/examples/sessions --flood 1000 [--flood-uid UID] [--transport tcp|shm]
//!                                  [--seconds 10] ...
//! ```
//!
//! One `stowage unit` process (a local plane of one: its own private temp
//! directory, a 256 MiB slab, a Unix socket and a loopback TCP listener,
//! a fresh shared secret).
//!
//! **Sessions** (default). This program re-executes itself `--procs` times
//! as a child (`--child`, the secret on its stdin). Each child raises its
//! soft open-file limit to the hard one and opens `--sessions` separate
//! `stowage_client::Client`s (each its own session and connection), from
//! `--openers` threads, each client with a `--timeout` deadline (its
//! connect retries a Busy unit within it); each client that connected puts
//! one 4 KiB value and gets it back. The child reports how many sessions
//! succeeded and failed (with the first error), then holds its clients
//! idle until told to stop. Once every child has reported, a foreground
//! client in this process puts and gets 4 KiB values for `--seconds`
//! (every 16 rows cleared, not timed): op count, op/s, p50/p99 of one
//! put or get and of one put+get. Meanwhile the unit's
//! `/proc/PID/status` is sampled every 100 ms; reported: threads and RSS
//! over the slab (RssAnon + RssFile: the slab's own pages are RssShmem),
//! at the peak and once every session is held, against the targets:
//! threads <= 2 x cores + 16, RSS over the slab <= 5% of the slab + 64 MiB,
//! the foreground put+get p99 <= 2 ms.
//!
//! **Flood** (`--flood N`). After a control run of the foreground loop,
//! this process (or, with `--flood-uid UID`, a child run as that user
//! through `setpriv`: another source to the unit's handshake pool) opens N
//! TCP connections to the unit's port that never send a byte, and
//! re-opens each one the unit closes (what anyone who can reach the port
//! can do), then a real client
//! (`--timeout`, default 5 s, the Python default) connects, puts and gets
//! 4 KiB: whether it succeeded, its latency, then the foreground loop for
//! `--seconds` with the flood still on (p99), and the unit's RSS and
//! thread growth over its state before the flood (target: RSS < 64 MiB).
//!
//! Every child is stopped by its pid at the end, on error paths too (and
//! exits by itself when its stdin closes); every wait is bounded.
//!
//! The parts: `child.rs` (what each re-executed child runs),
//! `foreground.rs` (the timed put+get loop), `probe.rs` (the children by
//! their pids and the unit's `/proc/PID/status`), `flood.rs` (`--flood`);
//! here the options and the sessions run.

mod child;
mod flood;
mod foreground;
mod probe;
#[path = "../common/procs.rs"]
mod procs;

use std::io::{BufRead, BufReader, Write};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use stowage_client::{Client, ClientConfig, Key, Secret, SliceSink, UnitAddr, DEFAULT_PARTITION};
use stowage_local::{LocalOptions, LocalPlane};

use child::{child, fg_child, flood_child};
use flood::flood;
use foreground::foreground;
use probe::{Children, Sampler, Status};
use procs::spawn_piped;

type Res<T> = Result<T, String>;

const VALUE: usize = 4 << 10;
const CLEAR_EVERY: u64 = 16;
const NAMESPACE: &str = "sessions-bench";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("--child") => child(&args[1..]),
        Some("--fg-child") => fg_child(&args[1..]),
        Some("--flood-child") => flood_child(&args[1..]),
        _ => parent(&args),
    };
    if let Err(e) = r {
        eprintln!("sessions: {e}");
        std::process::exit(1);
    }
}

/// Raise this process's soft open-file limit to its hard limit; the new soft limit.
fn raise_nofile() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut l = getrlimit(Resource::Nofile);
    if l.maximum.is_some() && l.current != l.maximum {
        l.current = l.maximum;
        let _ = setrlimit(Resource::Nofile, l);
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

fn client_config(addrs: &[UnitAddr], secret: Option<&Secret>, timeout: Duration) -> ClientConfig {
    let mut cfg = ClientConfig::new(NAMESPACE, addrs.to_vec());
    cfg.timeout = timeout;
    cfg.secret = secret.cloned();
    cfg
}

/// One 4 KiB put of `row` and its get back, checked.
fn put_get(c: &Client, row: u64, value: &[u8], out: &mut [u8]) -> Res<()> {
    let key = Key::new(row, "v");
    c.put_rows(&[(key.clone(), value)], c.deadline())
        .map_err(|e| format!("put: {e}"))?;
    let mut bufs = [&mut out[..]];
    let mut sink = SliceSink::new(&mut bufs);
    // A row lives on unit `row % units`.
    let unit = c.unit_of_row(row);
    c.get_into(DEFAULT_PARTITION, &[(unit, key)], &mut sink, c.deadline())
        .map_err(|e| format!("get: {e}"))?;
    if out != value {
        return Err("get: the value read back differs".into());
    }
    Ok(())
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

// ---------------------------------------------------------------- parent

struct Opts {
    procs: usize,
    sessions: usize,
    transport: String,
    secs: f64,
    memory: u64,
    timeout: f64,
    openers: usize,
    flood: usize,
    flood_uid: Option<u32>,
    stowage: std::path::PathBuf,
    unit_args: Vec<String>,
}

/// The value after the flag `a`.
fn value<'a>(a: &str, it: &mut std::slice::Iter<'a, String>) -> Res<&'a String> {
    it.next().ok_or_else(|| format!("{a} needs a value"))
}

/// The value after the flag `a`, parsed.
fn arg<T: std::str::FromStr>(a: &str, it: &mut std::slice::Iter<'_, String>) -> Res<T>
where
    T::Err: std::fmt::Display,
{
    value(a, it)?.parse().map_err(|e| format!("{a}: {e}"))
}

fn parse(args: &[String]) -> Res<Opts> {
    let mut o = Opts {
        procs: 10,
        sessions: 1000,
        transport: "tcp".into(),
        secs: 10.0,
        memory: 256 << 20,
        timeout: 5.0,
        openers: 32,
        flood: 0,
        flood_uid: None,
        stowage: std::path::PathBuf::new(),
        unit_args: Vec::new(),
    };
    let mut stowage = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--procs" => o.procs = arg(a, &mut it)?,
            "--sessions" => o.sessions = arg(a, &mut it)?,
            "--transport" => {
                o.transport = value(a, &mut it)?.clone();
                if o.transport != "tcp" && o.transport != "shm" {
                    return Err(format!("--transport {:?}: tcp or shm", o.transport));
                }
            }
            "--seconds" => o.secs = arg(a, &mut it)?,
            "--memory-mib" => o.memory = arg::<u64>(a, &mut it)? << 20,
            "--timeout" => o.timeout = arg(a, &mut it)?,
            "--openers" => o.openers = arg(a, &mut it)?,
            "--flood" => o.flood = arg(a, &mut it)?,
            "--flood-uid" => o.flood_uid = Some(arg(a, &mut it)?),
            "--stowage" => stowage = Some(std::path::PathBuf::from(value(a, &mut it)?)),
            "--unit-arg" => o.unit_args.push(value(a, &mut it)?.clone()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    o.stowage = stowage_cli::bench::stowage_binary(stowage)?;
    Ok(o)
}

fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "MET"
    } else {
        "NOT MET"
    }
}

fn parent(args: &[String]) -> Res<()> {
    let o = parse(args)?;
    // The unit's warnings (one per refused connection) would bury the
    // figures; RUST_LOG set by the caller wins.
    if std::env::var_os("RUST_LOG").is_none() {
        std::env::set_var("RUST_LOG", "error");
    }
    let nofile = raise_nofile();
    let mut opts = LocalOptions::new(1, o.memory);
    opts.command = vec![o.stowage.clone().into_os_string(), "unit".into()];
    opts.unit_args = o.unit_args.clone();
    let mut plane = LocalPlane::start(&opts)?;
    let r = if o.flood > 0 {
        flood(&o, &plane)
    } else {
        sessions(&o, &plane, nofile)
    };
    plane.stop();
    r
}

fn header(o: &Opts, plane: &LocalPlane) -> u32 {
    let pid = plane.units[0].pid();
    // The unit faults its slab in on a thread of its own after it starts,
    // and the machine may be shared: start when it is quiet (or 20 s on).
    let idle = stowage_cli::bench::wait_quiet(Duration::from_secs(20));
    println!(
        "sessions: one unit (pid {pid}, {} MiB slab{}), {} cores, idle {:.0}% before the start, load {}",
        o.memory >> 20,
        if o.unit_args.is_empty() {
            String::new()
        } else {
            format!(", {}", o.unit_args.join(" "))
        },
        cores(),
        100.0 * idle,
        std::fs::read_to_string("/proc/loadavg")
            .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    );
    pid
}

fn unit_addr(o: &Opts, plane: &LocalPlane) -> UnitAddr {
    if o.transport == "shm" {
        plane.uds_addrs()[0].clone()
    } else {
        plane.tcp_addrs()[0].clone()
    }
}

fn sessions(o: &Opts, plane: &LocalPlane, nofile: u64) -> Res<()> {
    let pid = header(o, plane);
    let addr = unit_addr(o, plane);
    let secret_hex = plane.secret().map(Secret::to_hex).unwrap_or_default();
    std::thread::sleep(Duration::from_millis(300));
    let before = Status::read(pid).ok_or("the unit is gone")?;
    println!(
        "  {} processes x {} sessions over {} ({} openers each, {} s deadline each; this process's open-file limit {nofile})",
        o.procs, o.sessions, o.transport, o.openers, o.timeout
    );
    println!("  unit before: {}", before.show());
    let sampler = Sampler::start(pid);
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut kids = Children(Vec::with_capacity(o.procs));
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let t = Instant::now();
    for i in 0..o.procs {
        let mut c = Command::new(&exe);
        c.arg("--child")
            .args(["--addr", &addr.to_string()])
            .args(["--sessions", &o.sessions.to_string()])
            .args(["--tag", &i.to_string()])
            .args(["--openers", &o.openers.to_string()])
            .args(["--timeout", &o.timeout.to_string()]);
        let (c, stdout) = spawn_piped(&mut c, &format!("starting child {i}"))?;
        kids.0.push(c);
        let stdin = kids.0[i].stdin.as_mut().ok_or("child stdin missing")?;
        writeln!(stdin, "{secret_hex}").map_err(|e| format!("child {i}: {e}"))?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(l) if l.starts_with("OPENED ") => {
                        let _ = tx.send((i, l));
                        return;
                    }
                    Ok(_) => {}
                    Err(_) => return,
                }
            }
        });
    }
    drop(tx);
    // Bounded: each opener's share of sessions, each within its deadline,
    // plus slack for a busy machine.
    let per_opener = o.sessions.div_ceil(o.openers.max(1)) as f64;
    let bound = Duration::from_secs_f64(per_opener * (o.timeout * 2.0 + 1.0) + 60.0);
    let end = Instant::now() + bound;
    let (mut ok, mut failed, mut first) = (0u64, 0u64, None::<String>);
    let mut reported = 0;
    while reported < o.procs {
        let left = end.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((i, l)) => {
                reported += 1;
                let field = |k: &str| {
                    l.split_whitespace()
                        .find_map(|w| w.strip_prefix(k))
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0)
                };
                ok += field("ok=");
                failed += field("failed=");
                let err = l.split_once("first_error=").map(|(_, e)| e.trim());
                if let Some(e) = err.filter(|e| !e.is_empty()) {
                    first.get_or_insert_with(|| format!("child {i}: {e}"));
                }
                println!("  child {i}: {}", l.trim_start_matches("OPENED "));
            }
            Err(_) => {
                return Err(format!(
                    "only {reported} of {} children reported within {bound:?}",
                    o.procs
                ))
            }
        }
    }
    let opened_in = t.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(300));
    let held = Status::read(pid).ok_or("the unit is gone")?;
    println!(
        "  sessions: {ok} succeeded, {failed} failed of {} in {opened_in:.1} s{}",
        o.procs * o.sessions,
        first
            .as_ref()
            .map(|e| format!("; first error: {e}"))
            .unwrap_or_default()
    );
    println!("  unit holding them: {}", held.show());
    let timeout = Duration::from_secs_f64(o.timeout);
    let mut fg = match Client::connect(client_config(
        std::slice::from_ref(&addr),
        plane.secret(),
        timeout,
    )) {
        Ok(c) => Some(foreground(&c, o.secs)),
        Err(e) => {
            println!(
                "  foreground client: connect failed: {}",
                one_line(&e.to_string())
            );
            None
        }
    };
    if let Some(fg) = fg.as_mut() {
        println!("  foreground client, 4 KiB put+get: {}", fg.show());
    }
    let after = Status::read(pid).ok_or("the unit is gone")?;
    let peak = sampler.peak();
    drop(sampler);
    println!("  unit after the foreground run: {}", after.show());
    println!(
        "  unit peak (each field at its own moment): {}",
        peak.show()
    );
    kids.stop(Duration::from_secs(10));
    // Targets.
    let slab_mib = (o.memory >> 20) as f64;
    let thread_cap = 2 * cores() as u64 + 16;
    let rss_cap = 0.05 * slab_mib + 64.0;
    let all = ok == (o.procs * o.sessions) as u64;
    println!("targets:");
    println!(
        "  all sessions succeed: {ok}/{} -> {}",
        o.procs * o.sessions,
        verdict(all)
    );
    println!(
        "  unit threads <= 2 x {} cores + 16 = {thread_cap}: peak {} -> {}",
        cores(),
        peak.threads,
        verdict(peak.threads <= thread_cap)
    );
    println!(
        "  unit RSS over the slab <= 5% of {slab_mib:.0} MiB + 64 MiB = {rss_cap:.1} MiB: peak {:.1} MiB ({:.1} KiB per held session over the unit before) -> {}",
        peak.over_mib(),
        (held.anon + held.file).saturating_sub(before.anon + before.file) as f64 / ok.max(1) as f64,
        verdict(peak.over_mib() <= rss_cap)
    );
    match fg.as_mut() {
        Some(fg) => {
            let p99 = fg.pair_p99_ms();
            println!(
                "  foreground 4 KiB put+get p99 <= 2 ms: {p99:.3} ms, {} errors -> {}",
                fg.errors,
                verdict(p99 <= 2.0 && fg.errors == 0)
            )
        }
        None => println!("  foreground 4 KiB put+get p99 <= 2 ms: no connection -> NOT MET"),
    }
    Ok(())
}
