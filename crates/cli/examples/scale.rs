//! How one unit holds up as client connections grow: N = 1, 4, 16, 64,
//! 256 connections, each its own client session, 64 KiB put + get.
//!
//! ```text
//! cargo build --release -p stowage-cli --examples
//! target/release/examples/scale [--transport shm|tcp|both] [--rounds 3] [--seconds 2]
//!                               [--conns 1,4,16,64,256] [--stowage PATH] [--unit-arg ARG]...
//!                               [--client-spin-us 50] [--reuse-clients [--warmup 10]]
//! ```
//!
//! One `stowage unit` process (1 GiB slab). This process runs N threads,
//! each owning its own `stowage_client::Client` (so its own session and its
//! own connection to the unit: what N independent workers look like to the
//! unit). One thread of one process per connection keeps the client side
//! as simple as the unit's own thread-per-connection model; the threads
//! connect first, then all start together and run for a fixed time.
//!
//! By default every point connects fresh clients (so over shm every client
//! maps the slab anew and faults in the pages it touches: a cold start).
//! `--reuse-clients` connects the largest N once, warms them with one
//! untimed run of `--warmup` seconds at that N, and lets every point use
//! the first N of them (long-lived workers, whose mappings fill up).
//!
//! Each iteration puts a fresh 64 KiB value and gets it back (two ops);
//! every 16 iterations a thread clears its 16 rows in one call (not
//! counted, not timed). Reported per point: total op/s, p50 and p99 of a
//! single put or get, median [min-max] over the rounds; rounds interleave
//! the points. Ends with rate(256) / rate(16).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use stowage_cli::bench::{median_min_max, wait_quiet};
use stowage_client::{Client, ClientConfig, Key, SliceSink, UnitAddr, DEFAULT_PARTITION};
use stowage_local::{LocalOptions, LocalPlane};

type Res<T> = Result<T, String>;

const VALUE: usize = 64 << 10;
const CLEAR_EVERY: u64 = 16;

struct Point {
    ops_per_s: f64,
    /// CPU time per op (µs) of the unit process and of this process.
    unit_cpu_us: f64,
    client_cpu_us: f64,
    /// Minor page faults per op in this process (the clients' mappings).
    client_faults: f64,
    p50_us: f64,
    p99_us: f64,
    errors: u64,
}

fn quantile(v: &mut [f32], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    f64::from(v[((v.len() - 1) as f64 * q).round() as usize])
}

/// One worker: put + get until `stop`; (ops, latencies in µs, errors).
fn worker(client: &Client, tid: u64, start: &Barrier, stop: &AtomicBool) -> (u64, Vec<f32>, u64) {
    let value = vec![(tid % 251) as u8; VALUE];
    let mut out = vec![0u8; VALUE];
    let mut lat = Vec::with_capacity(1 << 14);
    let mut ops = 0u64;
    let mut errors = 0u64;
    let base = tid << 32;
    let mut i = 0u64;
    // Rows put since the last clear.
    let mut pending = 0u64;
    start.wait();
    while !stop.load(Ordering::Relaxed) {
        let key = Key::new(base + i, "v");
        let t0 = Instant::now();
        let put = client.put_rows(&[(key.clone(), &value)], client.deadline());
        let t1 = Instant::now();
        if put.is_err() {
            errors += 1;
        } else {
            ops += 1;
            lat.push((t1 - t0).as_secs_f32() * 1e6);
            let mut bufs = [&mut out[..]];
            let mut sink = SliceSink::new(&mut bufs);
            let got = client.get_into(DEFAULT_PARTITION, &[(0, key)], &mut sink, client.deadline());
            let t2 = Instant::now();
            match got {
                Ok(_) => {
                    ops += 1;
                    lat.push((t2 - t1).as_secs_f32() * 1e6);
                }
                Err(_) => errors += 1,
            }
        }
        i += 1;
        pending += 1;
        if pending == CLEAR_EVERY {
            pending = 0;
            let rows: Vec<u64> = (base + i - CLEAR_EVERY..base + i).collect();
            if client.clear_rows(&rows, client.deadline()).is_err() {
                errors += 1;
            }
        }
    }
    let rows: Vec<u64> = (base + i - pending..base + i).collect();
    if !rows.is_empty() && client.clear_rows(&rows, client.deadline()).is_err() {
        errors += 1;
    }
    if out[0] != value[0] && ops > 1 {
        errors += 1;
    }
    (ops, lat, errors)
}

/// (utime + stime in seconds, minor faults) of a process, from /proc.
fn proc_stat(pid: &str) -> (f64, f64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised command name.
    let rest = s.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    let tick = 100.0; // USER_HZ
                      // rest[0] is field 3 (state): minflt is field 10, utime 14, stime 15.
    match (f.get(7), f.get(11), f.get(12)) {
        (Some(minflt), Some(u), Some(st)) => ((u + st) / tick, *minflt),
        _ => (f64::NAN, f64::NAN),
    }
}

/// `n` clients, each its own session, each with its connection made (and,
/// over shm, the slab mapped) before any clock starts.
fn connect_clients(addr: &UnitAddr, n: usize, tag: &str, spin: Duration) -> Res<Vec<Client>> {
    let mut clients = Vec::with_capacity(n);
    for i in 0..n {
        let mut cfg = ClientConfig::new(format!("scale-{tag}-{i}"), vec![addr.clone()]);
        cfg.timeout = Duration::from_secs(30);
        cfg.spin = spin;
        let c = Client::connect(cfg).map_err(|e| format!("connect {i}/{n}: {e}"))?;
        c.stats(c.deadline())
            .into_iter()
            .next()
            .ok_or("no unit")?
            .map_err(|e| format!("stats {i}/{n}: {e}"))?;
        clients.push(c);
    }
    Ok(clients)
}

/// Run every client of `clients` on its own thread for `secs`.
fn point(clients: &[Client], secs: f64, unit_pid: u32) -> Res<Point> {
    let n = clients.len();
    let start = Barrier::new(n + 1);
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(n);
        for (i, c) in clients.iter().enumerate() {
            let (start, stop) = (&start, &stop);
            let h = std::thread::Builder::new()
                .name(format!("w{i}"))
                .stack_size(256 << 10)
                .spawn_scoped(scope, move || worker(c, i as u64, start, stop))
                .map_err(|e| format!("spawn: {e}"))?;
            handles.push(h);
        }
        measure(handles, &start, &stop, secs, unit_pid)
    })
}

type Handle<'s> = std::thread::ScopedJoinHandle<'s, (u64, Vec<f32>, u64)>;

fn measure(
    handles: Vec<Handle<'_>>,
    start: &Barrier,
    stop: &AtomicBool,
    secs: f64,
    unit_pid: u32,
) -> Res<Point> {
    let unit_pid = unit_pid.to_string();
    let (unit0, _) = proc_stat(&unit_pid);
    let (self0, faults0) = proc_stat("self");
    start.wait();
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    stop.store(true, Ordering::Relaxed);
    let (mut ops, mut lat, mut errors) = (0u64, Vec::new(), 0u64);
    for h in handles {
        let (o, l, e) = h.join().map_err(|_| "a worker panicked")?;
        ops += o;
        lat.extend(l);
        errors += e;
    }
    // Ops finished by the stop flag count; the time runs until the last
    // thread's op ended (each is bounded by its 30 s deadline).
    let elapsed = t.elapsed().as_secs_f64();
    let (unit1, _) = proc_stat(&unit_pid);
    let (self1, faults1) = proc_stat("self");
    let per_op = |x: f64| x / ops.max(1) as f64;
    Ok(Point {
        ops_per_s: ops as f64 / elapsed,
        unit_cpu_us: per_op((unit1 - unit0) * 1e6),
        client_cpu_us: per_op((self1 - self0) * 1e6),
        client_faults: per_op(faults1 - faults0),
        p50_us: quantile(&mut lat, 0.5),
        p99_us: quantile(&mut lat, 0.99),
        errors,
    })
}

fn fmt3(v: &[f64], prec: usize) -> String {
    let (m, lo, hi) = median_min_max(v);
    format!("{m:.prec$} [{lo:.prec$}-{hi:.prec$}]")
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn main() {
    if let Err(e) = run() {
        eprintln!("scale: {e}");
        std::process::exit(1);
    }
}

fn run() -> Res<()> {
    let mut transports = vec!["shm", "tcp"];
    let mut rounds = 3usize;
    let mut secs = 2.0f64;
    let mut conns = vec![1usize, 4, 16, 64, 256];
    let mut stowage_bin = None;
    let mut unit_args = Vec::new();
    // The clients' adaptive polling budget (ClientConfig's default).
    let mut client_spin = Duration::from_micros(50);
    let mut reuse = false;
    let mut warmup = 10.0f64;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--transport" => {
                transports = match val()?.as_str() {
                    "shm" => vec!["shm"],
                    "tcp" => vec!["tcp"],
                    "both" => vec!["shm", "tcp"],
                    o => return Err(format!("--transport {o:?}: shm, tcp or both")),
                }
            }
            "--rounds" => rounds = val()?.parse().map_err(|e| format!("--rounds: {e}"))?,
            "--seconds" => secs = val()?.parse().map_err(|e| format!("--seconds: {e}"))?,
            "--conns" => {
                conns = val()?
                    .split(',')
                    .map(|s| s.parse().map_err(|e| format!("--conns: {e}")))
                    .collect::<Res<_>>()?
            }
            "--stowage" => stowage_bin = Some(std::path::PathBuf::from(val()?)),
            "--unit-arg" => unit_args.push(val()?.clone()),
            "--reuse-clients" => reuse = true,
            "--warmup" => warmup = val()?.parse().map_err(|e| format!("--warmup: {e}"))?,
            "--client-spin-us" => {
                client_spin = Duration::from_micros(
                    val()?
                        .parse()
                        .map_err(|e| format!("--client-spin-us: {e}"))?,
                )
            }
            o => return Err(format!("unknown argument {o:?}")),
        }
    }
    let stowage_bin = match stowage_bin {
        Some(p) => p,
        None => std::env::current_exe()
            .map_err(|e| e.to_string())?
            .parent()
            .and_then(|p| p.parent())
            .ok_or("no parent directory")?
            .join("stowage"),
    };
    if !stowage_bin.exists() {
        return Err(format!("{} not found", stowage_bin.display()));
    }
    let mut opts = LocalOptions::new(1, 1 << 30);
    opts.command = vec![stowage_bin.into_os_string(), "unit".into()];
    opts.unit_args = unit_args.clone();
    let mut plane = LocalPlane::start(&opts)?;
    println!(
        "scale: one unit (pid {}, 1 GiB{}), {} clients, client spin {client_spin:?}, {} cores, 64 KiB put+get, {secs} s per point, {rounds} rounds, load {}",
        plane.units[0].pid(),
        if unit_args.is_empty() {
            String::new()
        } else {
            format!(", {}", unit_args.join(" "))
        },
        if reuse { "long-lived" } else { "fresh" },
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        load()
    );
    for tr in &transports {
        let addr = match *tr {
            "shm" => plane.uds_addrs()[0].clone(),
            _ => plane.tcp_addrs()[0].clone(),
        };
        let mut rates = vec![Vec::new(); conns.len()];
        let mut p50 = vec![Vec::new(); conns.len()];
        let mut p99 = vec![Vec::new(); conns.len()];
        let mut errors = vec![0u64; conns.len()];
        let unit_pid = plane.units[0].pid();
        // Long-lived clients: connected once, warmed by one untimed run of
        // the largest point, then reused by every point (N = the first N).
        let long_lived = if reuse {
            let most = conns.iter().copied().max().unwrap_or(1);
            let c = connect_clients(&addr, most, tr, client_spin)?;
            let w = point(&c, warmup, unit_pid)?;
            println!(
                "  {tr} warm-up N={most} for {warmup} s: {:.0} op/s, client faults/op {:.2}",
                w.ops_per_s, w.client_faults
            );
            c
        } else {
            Vec::new()
        };
        for round in 0..rounds {
            for (k, &n) in conns.iter().enumerate() {
                let idle = wait_quiet(Duration::from_secs(60));
                let p = if reuse {
                    point(&long_lived[..n], secs, unit_pid)?
                } else {
                    let fresh =
                        connect_clients(&addr, n, &format!("{tr}-{round}-{n}"), client_spin)?;
                    point(&fresh, secs, unit_pid)?
                };
                println!(
                    "  {tr} round {round} N={n:>3}: {:>8.0} op/s p50 {:>8.1} us p99 {:>9.1} us; cpu/op unit {:>5.1} us client {:>5.1} us; client faults/op {:.2}; errors {} (idle before {:.0}%)",
                    p.ops_per_s,
                    p.p50_us,
                    p.p99_us,
                    p.unit_cpu_us,
                    p.client_cpu_us,
                    p.client_faults,
                    p.errors,
                    100.0 * idle
                );
                rates[k].push(p.ops_per_s);
                p50[k].push(p.p50_us);
                p99[k].push(p.p99_us);
                errors[k] += p.errors;
            }
        }
        println!("{tr}: median [min-max] over {rounds} rounds");
        println!(
            "{:>5} | {:>26} | {:>26} | {:>28} | {:>6}",
            "N", "op/s", "p50 us", "p99 us", "errors"
        );
        for (k, &n) in conns.iter().enumerate() {
            println!(
                "{:>5} | {:>26} | {:>26} | {:>28} | {:>6}",
                n,
                fmt3(&rates[k], 0),
                fmt3(&p50[k], 1),
                fmt3(&p99[k], 1),
                errors[k]
            );
        }
        let at = |n: usize| {
            conns
                .iter()
                .position(|&c| c == n)
                .map(|k| median_min_max(&rates[k]).0)
        };
        if let (Some(r16), Some(r256)) = (at(16), at(256)) {
            println!(
                "{tr}: rate(256)/rate(16) = {:.2} (target >= 0.5)",
                r256 / r16
            );
        }
    }
    plane.stop();
    Ok(())
}
