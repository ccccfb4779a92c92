//! How units hold up as client connections grow: N = 1, 4, 16, 64,
//! 256 connections, each its own client session, 64 KiB put + get.
//!
//! ```text
//! cargo build --release -p stowage-cli --examples --bin stowage
//! target/release/examples/scale [--transport shm|tcp|both] [--rounds 3] [--seconds 2]
//!                               [--conns 1,4,16,64,256] [--stowage PATH] [--unit-arg ARG]...
//!                               [--client-spin-us 50] [--reuse-clients [--warmup 10]]
//!                               [--procs] [--units 1] [--value 65536] [--quiet-max 60]
//! ```
//!
//! `--units` `stowage unit` processes (default one; 1 GiB slab each). This
//! process runs N threads, each owning its own `stowage_client::Client`
//! (so its own session and its own connection to each unit: what N
//! independent workers look like to the units). The threads connect
//! first, then all start together and run for a fixed time.
//!
//! `--procs`: each point's N clients are N processes instead (this program
//! re-executed as a child, one client per process, as a job's worker
//! processes are); they connect, report ready, start together on a word
//! from this process, run for the same fixed time and send back their
//! counts and latencies. Not with `--reuse-clients`.
//!
//! With more than one unit, rows spread over them as a real job's do: each
//! op's unit is its row's (`row % units`), and a worker's rows are
//! consecutive, so its ops go round the units.
//!
//! By default every point connects fresh clients (so over shm every client
//! maps the slab anew and faults in the pages it touches: a cold start).
//! `--reuse-clients` connects the largest N once, warms them with one
//! untimed run of `--warmup` seconds at that N, and lets every point use
//! the first N of them (long-lived workers, whose mappings fill up).
//!
//! Each iteration puts a fresh value of `--value` bytes (default 64 KiB)
//! and gets it back (two ops); every 16 iterations a worker clears its 16
//! rows in one call (not counted, not timed). Reported per point: total
//! op/s, p50 and p99 of a single put or get, median [min-max] over the
//! rounds; rounds interleave the points. Before each point it waits (at
//! most `--quiet-max` seconds) for the shared machine to be 90% idle and
//! prints how idle it was. Ends with rate(64) / rate(16) and
//! rate(256) / rate(16) where those points ran.

#[path = "common/procs.rs"]
mod procs;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Barrier};
use std::time::{Duration, Instant};

use stowage_cli::bench::{median_min_max, wait_quiet};
use stowage_client::{Client, ClientConfig, Key, Secret, SliceSink, UnitAddr, DEFAULT_PARTITION};
use stowage_local::{LocalOptions, LocalPlane};

use procs::{reap, spawn_piped};

type Res<T> = Result<T, String>;

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

/// One worker: put + get of `size`-byte values until `stop`; (ops,
/// latencies in µs, errors).
fn worker(
    client: &Client,
    tid: u64,
    size: usize,
    start: &Barrier,
    stop: &AtomicBool,
) -> (u64, Vec<f32>, u64) {
    let value = vec![(tid % 251) as u8; size];
    let mut out = vec![0u8; size];
    let mut lat = Vec::with_capacity(1 << 14);
    let mut ops = 0u64;
    let mut errors = 0u64;
    // The first error of each worker is printed (stderr), the rest counted.
    let mut fail = |what: &str, e: stowage_client::Error| {
        if errors == 0 {
            eprintln!("scale: worker {tid}: {what}: {e}");
        }
        errors += 1;
    };
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
        if let Err(e) = put {
            fail("put", e);
        } else {
            ops += 1;
            lat.push((t1 - t0).as_secs_f32() * 1e6);
            let mut bufs = [&mut out[..]];
            let mut sink = SliceSink::new(&mut bufs);
            // A row lives on unit `row % units`.
            let unit = client.unit_of_row(key.row);
            let got = client.get_into(
                DEFAULT_PARTITION,
                &[(unit, key)],
                &mut sink,
                client.deadline(),
            );
            let t2 = Instant::now();
            match got {
                Ok(_) => {
                    ops += 1;
                    lat.push((t2 - t1).as_secs_f32() * 1e6);
                }
                Err(e) => fail("get", e),
            }
        }
        i += 1;
        pending += 1;
        if pending == CLEAR_EVERY {
            pending = 0;
            let rows: Vec<u64> = (base + i - CLEAR_EVERY..base + i).collect();
            if let Err(e) = client.clear_rows(&rows, client.deadline()) {
                fail("clear", e);
            }
        }
    }
    let rows: Vec<u64> = (base + i - pending..base + i).collect();
    if !rows.is_empty() {
        if let Err(e) = client.clear_rows(&rows, client.deadline()) {
            fail("clear", e);
        }
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

/// One client, its own session, with its connections made (and, over
/// shm, the slabs mapped) before any clock starts.
fn connect_one(
    addrs: &[UnitAddr],
    secret: Option<&Secret>,
    namespace: String,
    spin: Duration,
) -> Res<Client> {
    let mut cfg = ClientConfig::new(namespace, addrs.to_vec());
    cfg.timeout = Duration::from_secs(30);
    cfg.spin = spin;
    cfg.secret = secret.cloned();
    let c = Client::connect(cfg).map_err(|e| format!("connect: {e}"))?;
    for s in c.stats(c.deadline()) {
        s.map_err(|e| format!("stats: {e}"))?;
    }
    Ok(c)
}

/// Where the clients go and what they do.
struct Target<'a> {
    addrs: &'a [UnitAddr],
    secret: Option<&'a Secret>,
    spin: Duration,
    value: usize,
    unit_pids: &'a [u32],
}

/// `n` clients, each its own session.
fn connect_clients(t: &Target<'_>, n: usize, tag: &str) -> Res<Vec<Client>> {
    (0..n)
        .map(|i| {
            connect_one(t.addrs, t.secret, format!("scale-{tag}-{i}"), t.spin)
                .map_err(|e| format!("{i}/{n}: {e}"))
        })
        .collect()
}

/// Run every client of `clients` on its own thread for `secs`.
fn point(clients: &[Client], secs: f64, t: &Target<'_>) -> Res<Point> {
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
                .spawn_scoped(scope, move || worker(c, i as u64, t.value, start, stop))
                .map_err(|e| format!("spawn: {e}"))?;
            handles.push(h);
        }
        measure(handles, &start, &stop, secs, t.unit_pids)
    })
}

type Handle<'s> = std::thread::ScopedJoinHandle<'s, (u64, Vec<f32>, u64)>;

fn measure(
    handles: Vec<Handle<'_>>,
    start: &Barrier,
    stop: &AtomicBool,
    secs: f64,
    unit_pids: &[u32],
) -> Res<Point> {
    let unit0 = units_cpu(unit_pids);
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
    let unit1 = units_cpu(unit_pids);
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
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = if args.first().map(String::as_str) == Some("--child") {
        child(&args[1..])
    } else {
        run(&args)
    };
    if let Err(e) = r {
        eprintln!("scale: {e}");
        std::process::exit(1);
    }
}

/// utime + stime (s) of the unit processes, together.
fn units_cpu(pids: &[u32]) -> f64 {
    pids.iter().map(|p| proc_stat(&p.to_string()).0).sum()
}

// ------------------------------------------------------------ --procs

/// A `--procs` child: `--child --addrs A,B --tid T --value V --seconds S
/// --spin-us U`, the secret's hex (or an empty line) on stdin. Connects one
/// client, prints `READY`, waits for `go` on stdin, runs the worker for S
/// seconds, prints `DONE ops errors cpu_s faults` and then one line of
/// latencies (µs), and exits.
fn child(args: &[String]) -> Res<()> {
    let (mut addrs, mut tid, mut value, mut secs, mut spin) =
        (Vec::new(), 0u64, 64usize << 10, 2.0f64, 50u64);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--addrs" => {
                addrs = val()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<Vec<UnitAddr>, String>>()?
            }
            "--tid" => tid = val()?.parse().map_err(|e| format!("{a}: {e}"))?,
            "--value" => value = val()?.parse().map_err(|e| format!("{a}: {e}"))?,
            "--seconds" => secs = val()?.parse().map_err(|e| format!("{a}: {e}"))?,
            "--spin-us" => spin = val()?.parse().map_err(|e| format!("{a}: {e}"))?,
            o => return Err(format!("child: unknown argument {o:?}")),
        }
    }
    let mut stdin = BufReader::new(std::io::stdin());
    let mut line = String::new();
    stdin.read_line(&mut line).map_err(|e| e.to_string())?;
    let secret = match line.trim() {
        "" => None,
        hex => Some(Secret::from_hex(hex, "the parent's secret").map_err(|e| e.to_string())?),
    };
    let client = connect_one(
        &addrs,
        secret.as_ref(),
        format!("scale-proc-{tid}"),
        Duration::from_micros(spin),
    )?;
    println!("READY");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    line.clear();
    stdin.read_line(&mut line).map_err(|e| e.to_string())?;
    if line.trim() != "go" {
        return Ok(());
    }
    let start = Barrier::new(1);
    let stop = AtomicBool::new(false);
    let (cpu0, faults0) = proc_stat("self");
    let (ops, lat, errors) = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_secs_f64(secs));
            stop.store(true, Ordering::Relaxed);
        });
        worker(&client, tid, value, &start, &stop)
    });
    let (cpu1, faults1) = proc_stat("self");
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let w = |e: std::io::Error| e.to_string();
    writeln!(
        out,
        "DONE {ops} {errors} {} {}",
        cpu1 - cpu0,
        faults1 - faults0
    )
    .map_err(w)?;
    for l in &lat {
        write!(out, "{l:.1} ").map_err(w)?;
    }
    writeln!(out).map_err(w)?;
    out.flush().map_err(w)?;
    Ok(())
}

/// Child processes, killed by their pids and reaped when dropped.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        let end = Instant::now() + Duration::from_secs(5);
        for mut c in self.0.drain(..) {
            drop(c.stdin.take());
            reap(&mut c, end, Duration::from_millis(5));
        }
    }
}

/// What one child sent back.
enum Report {
    Ready,
    Done(u64, u64, f64, f64, Vec<f32>),
    Failed(String),
}

/// One point with `n` child processes, one client each.
fn point_procs(n: usize, secs: f64, t: &Target<'_>) -> Res<Point> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let addrs = t
        .addrs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let secret = t.secret.map(Secret::to_hex).unwrap_or_default();
    let mut kids = Children(Vec::with_capacity(n));
    let (tx, rx) = mpsc::channel::<(usize, Report)>();
    for i in 0..n {
        let (c, stdout) = spawn_piped(
            Command::new(&exe)
                .arg("--child")
                .args(["--addrs", &addrs])
                .args(["--tid", &i.to_string()])
                .args(["--value", &t.value.to_string()])
                .args(["--seconds", &secs.to_string()])
                .args(["--spin-us", &t.spin.as_micros().to_string()]),
            &format!("starting child {i}"),
        )?;
        kids.0.push(c);
        let stdin = kids.0[i].stdin.as_mut().ok_or("child stdin missing")?;
        writeln!(stdin, "{secret}").map_err(|e| format!("child {i}: {e}"))?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let mut next = || lines.next().and_then(Result::ok);
            match next().as_deref() {
                Some("READY") => {
                    let _ = tx.send((i, Report::Ready));
                }
                _ => {
                    let _ = tx.send((i, Report::Failed("no READY".into())));
                    return;
                }
            }
            let done = next();
            let lat = next();
            let parsed = done.as_deref().and_then(|d| {
                let f: Vec<&str> = d.strip_prefix("DONE ")?.split_whitespace().collect();
                Some((
                    f.first()?.parse().ok()?,
                    f.get(1)?.parse().ok()?,
                    f.get(2)?.parse().ok()?,
                    f.get(3)?.parse().ok()?,
                ))
            });
            let r = match parsed {
                Some((ops, errors, cpu, faults)) => {
                    let lat = lat
                        .unwrap_or_default()
                        .split_whitespace()
                        .filter_map(|x| x.parse().ok())
                        .collect();
                    Report::Done(ops, errors, cpu, faults, lat)
                }
                None => Report::Failed(format!("bad report {done:?}")),
            };
            let _ = tx.send((i, r));
        });
    }
    drop(tx);
    // Every child connected (bounded: each client's connect has 30 s).
    let end = Instant::now() + Duration::from_secs(60);
    for _ in 0..n {
        match rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok((_, Report::Ready)) => {}
            Ok((i, Report::Failed(e))) => return Err(format!("child {i}: {e}")),
            Ok((i, Report::Done(..))) => return Err(format!("child {i}: done before go")),
            Err(_) => return Err("the children did not all connect within 60 s".into()),
        }
    }
    let unit0 = units_cpu(t.unit_pids);
    let start = Instant::now();
    for (i, c) in kids.0.iter_mut().enumerate() {
        let stdin = c.stdin.as_mut().ok_or("child stdin missing")?;
        writeln!(stdin, "go").map_err(|e| format!("child {i}: {e}"))?;
    }
    let (mut ops, mut errors, mut cpu, mut faults, mut lat) = (0u64, 0u64, 0.0, 0.0, Vec::new());
    // Each op is bounded by its 30 s deadline.
    let end = Instant::now() + Duration::from_secs_f64(secs + 60.0);
    for _ in 0..n {
        match rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok((_, Report::Done(o, e, c, f, l))) => {
                ops += o;
                errors += e;
                cpu += c;
                faults += f;
                lat.extend(l);
            }
            Ok((i, Report::Failed(e))) => return Err(format!("child {i}: {e}")),
            Ok((i, Report::Ready)) => return Err(format!("child {i}: ready twice")),
            Err(_) => return Err("the children did not all finish in time".into()),
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let unit1 = units_cpu(t.unit_pids);
    drop(kids);
    let per_op = |x: f64| x / ops.max(1) as f64;
    Ok(Point {
        ops_per_s: ops as f64 / elapsed,
        unit_cpu_us: per_op((unit1 - unit0) * 1e6),
        client_cpu_us: per_op(cpu * 1e6),
        client_faults: per_op(faults),
        p50_us: quantile(&mut lat, 0.5),
        p99_us: quantile(&mut lat, 0.99),
        errors,
    })
}

fn run(args: &[String]) -> Res<()> {
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
    let mut procs = false;
    let mut units = 1usize;
    let mut value = 64usize << 10;
    let mut quiet_max = 60.0f64;
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
            "--procs" => procs = true,
            "--units" => units = val()?.parse().map_err(|e| format!("--units: {e}"))?,
            "--value" => value = val()?.parse().map_err(|e| format!("--value: {e}"))?,
            "--quiet-max" => quiet_max = val()?.parse().map_err(|e| format!("--quiet-max: {e}"))?,
            o => return Err(format!("unknown argument {o:?}")),
        }
    }
    if procs && reuse {
        return Err(
            "--procs starts fresh processes for every point: not with --reuse-clients".into(),
        );
    }
    if units == 0 || value == 0 {
        return Err("--units and --value must be at least 1".into());
    }
    let stowage_bin = stowage_cli::bench::stowage_binary(stowage_bin)?;
    let mut opts = LocalOptions::new(units, 1 << 30);
    opts.command = vec![stowage_bin.into_os_string(), "unit".into()];
    opts.unit_args = unit_args.clone();
    let mut plane = LocalPlane::start(&opts)?;
    let unit_pids: Vec<u32> = plane.units.iter().map(|u| u.pid()).collect();
    println!(
        "scale: {units} unit{} (pid {}, 1 GiB each{}), {} clients {}, client spin {client_spin:?}, {} cores, {} B put+get, {secs} s per point, {rounds} rounds, load {}",
        if units == 1 { "" } else { "s" },
        unit_pids
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(","),
        if unit_args.is_empty() {
            String::new()
        } else {
            format!(", {}", unit_args.join(" "))
        },
        if reuse { "long-lived" } else { "fresh" },
        if procs {
            "in processes of their own"
        } else {
            "on threads of this process"
        },
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        value,
        load()
    );
    for tr in &transports {
        let addrs = match *tr {
            "shm" => plane.uds_addrs(),
            _ => plane.tcp_addrs(),
        };
        let target = Target {
            addrs: &addrs,
            secret: plane.secret(),
            spin: client_spin,
            value,
            unit_pids: &unit_pids,
        };
        let mut rates = vec![Vec::new(); conns.len()];
        let mut p50 = vec![Vec::new(); conns.len()];
        let mut p99 = vec![Vec::new(); conns.len()];
        let mut errors = vec![0u64; conns.len()];
        // Long-lived clients: connected once, warmed by one untimed run of
        // the largest point, then reused by every point (N = the first N).
        let long_lived = if reuse {
            let most = conns.iter().copied().max().unwrap_or(1);
            let c = connect_clients(&target, most, tr)?;
            let w = point(&c, warmup, &target)?;
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
                let idle = wait_quiet(Duration::from_secs_f64(quiet_max));
                let p = if reuse {
                    point(&long_lived[..n], secs, &target)?
                } else if procs {
                    point_procs(n, secs, &target)?
                } else {
                    let fresh = connect_clients(&target, n, &format!("{tr}-{round}-{n}"))?;
                    point(&fresh, secs, &target)?
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
        if let (Some(r16), Some(r64)) = (at(16), at(64)) {
            println!(
                "{tr}: rate(64)/rate(16) = {:.2} (issue 24's target >= 0.8)",
                r64 / r16
            );
        }
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
