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

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use stowage_client::{Client, ClientConfig, Key, Secret, SliceSink, UnitAddr, DEFAULT_PARTITION};
use stowage_local::{LocalOptions, LocalPlane};

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

// ---------------------------------------------------------------- child

/// The secret's hex (or an empty line: none) from the first line of stdin.
fn read_secret(stdin: &mut impl BufRead) -> Res<Option<Secret>> {
    let mut line = String::new();
    stdin.read_line(&mut line).map_err(|e| e.to_string())?;
    match line.trim() {
        "" => Ok(None),
        hex => Secret::from_hex(hex, "the parent's secret")
            .map(Some)
            .map_err(|e| e.to_string()),
    }
}

/// `--child --addr ADDR [--addr ADDR].. --sessions N --tag T --openers K
/// --timeout SECS`; the secret's hex (or an empty line) on stdin. Each
/// session is one client of every unit given that puts and gets one value
/// on each (so it holds a session on each, lazy connects or not). Prints
/// one line `OPENED ok=.. failed=.. secs=.. nofile=.. first_error=..`,
/// then holds its clients until stdin says `stop` or closes.
fn child(args: &[String]) -> Res<()> {
    let mut addrs = Vec::new();
    let (mut sessions, mut tag, mut openers, mut timeout) = (1000usize, 0u64, 32usize, 5.0f64);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--addr" => addrs.push(val()?.parse::<UnitAddr>()?),
            "--sessions" => sessions = val()?.parse().map_err(|e| format!("{a}: {e}"))?,
            "--tag" => tag = val()?.parse().map_err(|e| format!("{a}: {e}"))?,
            "--openers" => openers = val()?.parse().map_err(|e| format!("{a}: {e}"))?,
            "--timeout" => timeout = val()?.parse().map_err(|e| format!("{a}: {e}"))?,
            o => return Err(format!("child: unknown argument {o:?}")),
        }
    }
    if addrs.is_empty() {
        return Err("child: --addr missing".into());
    }
    let units = addrs.len() as u64;
    let mut stdin = BufReader::new(std::io::stdin());
    let secret = read_secret(&mut stdin)?;
    let nofile = raise_nofile();
    let timeout = Duration::from_secs_f64(timeout);
    let next = AtomicUsize::new(0);
    let failed = AtomicU64::new(0);
    let first_error = Mutex::new(None::<String>);
    let held = Mutex::new(Vec::with_capacity(sessions));
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..openers.clamp(1, sessions.max(1)) {
            s.spawn(|| {
                let value = vec![(tag % 251) as u8; VALUE];
                let mut out = vec![0u8; VALUE];
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= sessions {
                        return;
                    }
                    // Rows `units` apart from each other's: one on each unit.
                    let first = ((tag + 1) << 32) + i as u64 * units;
                    let r = Client::connect(client_config(&addrs, secret.as_ref(), timeout))
                        .map_err(|e| format!("connect: {e}"))
                        .and_then(|c| {
                            (first..first + units)
                                .try_for_each(|row| put_get(&c, row, &value, &mut out))
                                .map(|()| c)
                        });
                    match r {
                        Ok(c) => held.lock().unwrap_or_else(|p| p.into_inner()).push(c),
                        Err(e) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            first_error
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .get_or_insert(e);
                        }
                    }
                }
            });
        }
    });
    let held = held.into_inner().unwrap_or_else(|p| p.into_inner());
    let first = first_error
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .unwrap_or_default();
    println!(
        "OPENED ok={} failed={} secs={:.1} nofile={nofile} first_error={}",
        held.len(),
        failed.load(Ordering::Relaxed),
        t.elapsed().as_secs_f64(),
        one_line(&first)
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    // Idle, holding every session, until told to stop (or the parent is gone).
    let mut line = String::new();
    loop {
        line.clear();
        match stdin.read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) if line.trim() == "stop" => break,
            Ok(_) => {}
        }
    }
    // The sockets close with the process.
    std::process::exit(0);
}

/// `--fg-child --addr ADDR [--addr ADDR].. --seconds S --timeout SECS`;
/// the secret's hex (or an empty line) on stdin. One client of every unit
/// given runs the foreground loop (rows spread over the units) and prints
/// `FG ops=.. secs=.. op_p50=.. op_p99=.. pair_p50=.. pair_p99=..
/// errors=.. first_error=..` (latencies in µs). For bench/scale_sim.py.
fn fg_child(args: &[String]) -> Res<()> {
    let (mut addrs, mut secs, mut timeout) = (Vec::new(), 5.0f64, 5.0f64);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--addr" => addrs.push(val()?.parse::<UnitAddr>()?),
            "--seconds" => secs = val()?.parse().map_err(|e| format!("{a}: {e}"))?,
            "--timeout" => timeout = val()?.parse().map_err(|e| format!("{a}: {e}"))?,
            o => return Err(format!("fg-child: unknown argument {o:?}")),
        }
    }
    if addrs.is_empty() {
        return Err("fg-child: --addr missing".into());
    }
    let secret = read_secret(&mut BufReader::new(std::io::stdin()))?;
    let timeout = Duration::from_secs_f64(timeout);
    let c = Client::connect(client_config(&addrs, secret.as_ref(), timeout))
        .map_err(|e| format!("connect: {e}"))?;
    let mut fg = foreground(&c, secs);
    println!(
        "FG ops={} secs={:.3} op_p50={:.1} op_p99={:.1} pair_p50={:.1} pair_p99={:.1} errors={} first_error={}",
        fg.ops,
        fg.secs,
        quantile(&mut fg.op_lat, 0.5),
        quantile(&mut fg.op_lat, 0.99),
        quantile(&mut fg.pair_lat, 0.5),
        quantile(&mut fg.pair_lat, 0.99),
        fg.errors,
        one_line(fg.first_error.as_deref().unwrap_or(""))
    );
    Ok(())
}

/// `--flood-child --tcp ADDR --conns N`: the flood (see `Flood::start`)
/// from this process; prints `FLOOD open=.. reopened=.. failed=..` every
/// 200 ms until stdin says `stop` or closes.
fn flood_child(args: &[String]) -> Res<()> {
    let (mut addr, mut n) = (None, 1000usize);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--tcp" => addr = Some(val()?.parse().map_err(|e| format!("{a}: {e}"))?),
            "--conns" => n = val()?.parse().map_err(|e| format!("{a}: {e}"))?,
            o => return Err(format!("flood-child: unknown argument {o:?}")),
        }
    }
    raise_nofile();
    let flood = Flood::start(addr.ok_or("flood-child: --tcp missing")?, n);
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    std::thread::spawn(move || {
        let mut line = String::new();
        loop {
            line.clear();
            match std::io::stdin().read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) if line.trim() == "stop" => break,
                Ok(_) => {}
            }
        }
        d.store(true, Ordering::Relaxed);
    });
    while !done.load(Ordering::Relaxed) {
        println!(
            "FLOOD open={} reopened={} failed={}",
            flood.open.load(Ordering::Relaxed),
            flood.reopened.load(Ordering::Relaxed),
            flood.connect_errors.load(Ordering::Relaxed)
        );
        if std::io::stdout().flush().is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(flood);
    Ok(())
}

// ---------------------------------------------------------------- parent

/// Children stopped by their pids when dropped (every path out).
struct Children(Vec<Child>);

impl Children {
    /// Ask each to stop (stdin), give them `grace` in all, then SIGKILL
    /// whatever is left by its pid and reap it.
    fn stop(&mut self, grace: Duration) {
        for c in &mut self.0 {
            if let Some(mut s) = c.stdin.take() {
                let _ = s.write_all(b"stop\n");
            }
        }
        let end = Instant::now() + grace;
        for mut c in self.0.drain(..) {
            loop {
                match c.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < end => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    _ => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                }
            }
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// Fields of /proc/PID/status, in KiB (threads: a count).
#[derive(Clone, Copy, Debug, Default)]
struct Status {
    threads: u64,
    vm_rss: u64,
    anon: u64,
    file: u64,
    shmem: u64,
}

impl Status {
    fn read(pid: u32) -> Option<Status> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let mut s = Status::default();
        for l in text.lines() {
            let mut w = l.split_whitespace();
            let (Some(k), Some(v)) = (w.next(), w.next()) else {
                continue;
            };
            let v: u64 = v.parse().unwrap_or(0);
            match k {
                "Threads:" => s.threads = v,
                "VmRSS:" => s.vm_rss = v,
                "RssAnon:" => s.anon = v,
                "RssFile:" => s.file = v,
                "RssShmem:" => s.shmem = v,
                _ => {}
            }
        }
        Some(s)
    }

    /// RSS over the slab (RssAnon + RssFile), MiB.
    fn over_mib(&self) -> f64 {
        (self.anon + self.file) as f64 / 1024.0
    }

    fn show(&self) -> String {
        format!(
            "threads {}, VmRSS {:.0} MiB (RssAnon {:.0} + RssFile {:.0} = {:.0} MiB over the slab; RssShmem {:.0} MiB)",
            self.threads,
            self.vm_rss as f64 / 1024.0,
            self.anon as f64 / 1024.0,
            self.file as f64 / 1024.0,
            self.over_mib(),
            self.shmem as f64 / 1024.0
        )
    }
}

/// Samples a process's status every 100 ms until dropped: the peak of
/// threads and of RSS over the slab (each at its own moment).
struct Sampler {
    stop: Arc<AtomicBool>,
    peak: Arc<Mutex<Status>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(pid: u32) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(Mutex::new(Status::read(pid).unwrap_or_default()));
        let (s, p) = (stop.clone(), peak.clone());
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(now) = Status::read(pid) {
                    let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
                    p.threads = p.threads.max(now.threads);
                    if now.anon + now.file > p.anon + p.file {
                        (p.anon, p.file) = (now.anon, now.file);
                    }
                    p.vm_rss = p.vm_rss.max(now.vm_rss);
                    p.shmem = p.shmem.max(now.shmem);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Sampler {
            stop,
            peak,
            handle: Some(handle),
        }
    }

    fn peak(&self) -> Status {
        *self.peak.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

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
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        let bad = |e: std::num::ParseIntError| format!("{a}: {e}");
        let badf = |e: std::num::ParseFloatError| format!("{a}: {e}");
        match a.as_str() {
            "--procs" => o.procs = val()?.parse().map_err(bad)?,
            "--sessions" => o.sessions = val()?.parse().map_err(bad)?,
            "--transport" => {
                o.transport = val()?.clone();
                if o.transport != "tcp" && o.transport != "shm" {
                    return Err(format!("--transport {:?}: tcp or shm", o.transport));
                }
            }
            "--seconds" => o.secs = val()?.parse().map_err(badf)?,
            "--memory-mib" => o.memory = val()?.parse::<u64>().map_err(bad)? << 20,
            "--timeout" => o.timeout = val()?.parse().map_err(badf)?,
            "--openers" => o.openers = val()?.parse().map_err(bad)?,
            "--flood" => o.flood = val()?.parse().map_err(bad)?,
            "--flood-uid" => o.flood_uid = Some(val()?.parse().map_err(bad)?),
            "--stowage" => stowage = Some(std::path::PathBuf::from(val()?)),
            "--unit-arg" => o.unit_args.push(val()?.clone()),
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

fn quantile(v: &mut [f32], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    f64::from(v[((v.len() - 1) as f64 * q).round() as usize])
}

/// What the foreground loop saw.
struct Fg {
    ops: u64,
    secs: f64,
    /// One put or one get, µs.
    op_lat: Vec<f32>,
    /// One put and its get, µs.
    pair_lat: Vec<f32>,
    errors: u64,
    first_error: Option<String>,
}

impl Fg {
    fn show(&mut self) -> String {
        format!(
            "{} ops in {:.1} s ({:.0} op/s); one op p50 {:.1} us p99 {:.1} us; put+get p50 {:.1} us p99 {:.1} us; errors {}{}",
            self.ops,
            self.secs,
            self.ops as f64 / self.secs,
            quantile(&mut self.op_lat, 0.5),
            quantile(&mut self.op_lat, 0.99),
            quantile(&mut self.pair_lat, 0.5),
            quantile(&mut self.pair_lat, 0.99),
            self.errors,
            self.first_error
                .as_ref()
                .map(|e| format!(" (first: {})", one_line(e)))
                .unwrap_or_default()
        )
    }

    fn pair_p99_ms(&mut self) -> f64 {
        quantile(&mut self.pair_lat, 0.99) / 1e3
    }
}

/// 4 KiB put + get on `c` for `secs`, every 16 rows cleared (untimed).
fn foreground(c: &Client, secs: f64) -> Fg {
    let value = vec![0x5au8; VALUE];
    let mut out = vec![0u8; VALUE];
    let mut fg = Fg {
        ops: 0,
        secs: 0.0,
        op_lat: Vec::with_capacity(1 << 16),
        pair_lat: Vec::with_capacity(1 << 15),
        errors: 0,
        first_error: None,
    };
    let fail = |fg: &mut Fg, e: String| {
        fg.errors += 1;
        fg.first_error.get_or_insert(e);
    };
    let t = Instant::now();
    let mut row = 0u64;
    while t.elapsed().as_secs_f64() < secs {
        let key = Key::new(row, "fg");
        let t0 = Instant::now();
        match c.put_rows(&[(key.clone(), &value)], c.deadline()) {
            Err(e) => fail(&mut fg, format!("put: {e}")),
            Ok(()) => {
                let t1 = Instant::now();
                fg.ops += 1;
                fg.op_lat.push((t1 - t0).as_secs_f32() * 1e6);
                let mut bufs = [&mut out[..]];
                let mut sink = SliceSink::new(&mut bufs);
                let unit = c.unit_of_row(row);
                match c.get_into(DEFAULT_PARTITION, &[(unit, key)], &mut sink, c.deadline()) {
                    Err(e) => fail(&mut fg, format!("get: {e}")),
                    Ok(_) => {
                        let t2 = Instant::now();
                        fg.ops += 1;
                        fg.op_lat.push((t2 - t1).as_secs_f32() * 1e6);
                        fg.pair_lat.push((t2 - t0).as_secs_f32() * 1e6);
                    }
                }
            }
        }
        row += 1;
        if row.is_multiple_of(CLEAR_EVERY) {
            let rows: Vec<u64> = (row - CLEAR_EVERY..row).collect();
            if let Err(e) = c.clear_rows(&rows, c.deadline()) {
                fail(&mut fg, format!("clear: {e}"));
            }
        }
    }
    fg.secs = t.elapsed().as_secs_f64();
    let rows: Vec<u64> = (row - row % CLEAR_EVERY..row).collect();
    if !rows.is_empty() {
        let _ = c.clear_rows(&rows, c.deadline());
    }
    fg
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
        let mut c = Command::new(&exe)
            .arg("--child")
            .args(["--addr", &addr.to_string()])
            .args(["--sessions", &o.sessions.to_string()])
            .args(["--tag", &i.to_string()])
            .args(["--openers", &o.openers.to_string()])
            .args(["--timeout", &o.timeout.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting child {i}: {e}"))?;
        let stdout = c.stdout.take().ok_or("child stdout missing")?;
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

/// Connections to `addr` that never send a byte; each one the unit closes
/// is opened again. Stops (closing them all) when dropped.
struct Flood {
    stop: Arc<AtomicBool>,
    open: Arc<AtomicUsize>,
    reopened: Arc<AtomicU64>,
    connect_errors: Arc<AtomicU64>,
    handle: Option<std::thread::JoinHandle<()>>,
    /// With `--flood-uid`: the child process that holds the connections.
    child: Option<Children>,
}

impl Flood {
    fn start(addr: std::net::SocketAddr, n: usize) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let open = Arc::new(AtomicUsize::new(0));
        let reopened = Arc::new(AtomicU64::new(0));
        let connect_errors = Arc::new(AtomicU64::new(0));
        let (s, op, re, ce) = (
            stop.clone(),
            open.clone(),
            reopened.clone(),
            connect_errors.clone(),
        );
        let handle = std::thread::spawn(move || {
            let connect = || {
                let c = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
                c.set_nonblocking(true).ok()?;
                Some(c)
            };
            let mut conns: Vec<Option<TcpStream>> = Vec::with_capacity(n);
            for _ in 0..n {
                if s.load(Ordering::Relaxed) {
                    return;
                }
                let c = connect();
                if c.is_none() {
                    ce.fetch_add(1, Ordering::Relaxed);
                }
                conns.push(c);
            }
            let mut buf = [0u8; 64];
            while !s.load(Ordering::Relaxed) {
                let mut live = 0;
                for slot in conns.iter_mut() {
                    let closed = match slot {
                        None => true,
                        Some(c) => match c.read(&mut buf) {
                            Ok(0) => true,
                            Ok(_) => false,
                            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                        },
                    };
                    if closed {
                        *slot = connect();
                        if slot.is_some() {
                            re.fetch_add(1, Ordering::Relaxed);
                        } else {
                            ce.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    live += usize::from(slot.is_some());
                    if s.load(Ordering::Relaxed) {
                        return;
                    }
                }
                op.store(live, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Flood {
            stop,
            open,
            reopened,
            connect_errors,
            handle: Some(handle),
            child: None,
        }
    }

    /// The flood from a child process running as user `uid` (through
    /// `setpriv`): another source than this process's clients, as an
    /// attacker on the machine is. Its counts come back on its stdout.
    fn start_as(addr: std::net::SocketAddr, n: usize, uid: u32) -> Res<Flood> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut c = Command::new("setpriv")
            .args(["--reuid", &uid.to_string(), "--regid", &uid.to_string()])
            .args(["--clear-groups", "--"])
            .arg(&exe)
            .arg("--flood-child")
            .args(["--tcp", &addr.to_string(), "--conns", &n.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("setpriv (util-linux) for --flood-uid: {e}"))?;
        let stdout = c.stdout.take().ok_or("flood child stdout missing")?;
        let stop = Arc::new(AtomicBool::new(false));
        let open = Arc::new(AtomicUsize::new(0));
        let reopened = Arc::new(AtomicU64::new(0));
        let connect_errors = Arc::new(AtomicU64::new(0));
        let (op, re, ce) = (open.clone(), reopened.clone(), connect_errors.clone());
        // Ends when the child's stdout closes (it is stopped on drop).
        let handle = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(l) = line else { return };
                let field = |k: &str| {
                    l.split_whitespace()
                        .find_map(|w| w.strip_prefix(k))
                        .and_then(|v| v.parse::<u64>().ok())
                };
                if let (Some(o), Some(r), Some(e)) =
                    (field("open="), field("reopened="), field("failed="))
                {
                    op.store(o as usize, Ordering::Relaxed);
                    re.store(r, Ordering::Relaxed);
                    ce.store(e, Ordering::Relaxed);
                }
            }
        });
        Ok(Flood {
            stop,
            open,
            reopened,
            connect_errors,
            handle: Some(handle),
            child: Some(Children(vec![c])),
        })
    }

    fn show(&self) -> String {
        format!(
            "{} open, {} re-opened after the unit closed them, {} connects failed",
            self.open.load(Ordering::Relaxed),
            self.reopened.load(Ordering::Relaxed),
            self.connect_errors.load(Ordering::Relaxed)
        )
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(mut c) = self.child.take() {
            c.stop(Duration::from_secs(2));
        }
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn flood(o: &Opts, plane: &LocalPlane) -> Res<()> {
    let pid = header(o, plane);
    let addr = unit_addr(o, plane);
    let tcp = plane.units[0].tcp;
    let timeout = Duration::from_secs_f64(o.timeout);
    // The control: the same foreground loop, same unit, no flood.
    let mut control = {
        let c = Client::connect(client_config(
            std::slice::from_ref(&addr),
            plane.secret(),
            timeout,
        ))
        .map_err(|e| format!("the control client: {e}"))?;
        foreground(&c, o.secs)
    };
    println!(
        "  foreground client before the flood (control), 4 KiB put+get: {}",
        control.show()
    );
    std::thread::sleep(Duration::from_millis(300));
    let before = Status::read(pid).ok_or("the unit is gone")?;
    println!(
        "  flood: {} TCP connections to {tcp} that never send a byte, each re-opened when the unit closes it, from {}; the real client over {} with a {} s deadline",
        o.flood,
        o.flood_uid
            .map(|u| format!("a child process of uid {u}"))
            .unwrap_or_else(|| "this process (the real client's own user)".into()),
        o.transport,
        o.timeout
    );
    println!("  unit before: {}", before.show());
    let sampler = Sampler::start(pid);
    let flood = match o.flood_uid {
        Some(uid) => Flood::start_as(tcp, o.flood, uid)?,
        None => Flood::start(tcp, o.flood),
    };
    // Bounded: every connect has a 1 s timeout; wait for the whole flood
    // to be up (or 30 s), then one more second for the unit to take it in.
    let end = Instant::now() + Duration::from_secs(30);
    while flood.open.load(Ordering::Relaxed) < o.flood && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));
    let during = Status::read(pid).ok_or("the unit is gone")?;
    println!("  flood up: {}", flood.show());
    println!("  unit under the flood: {}", during.show());
    let value = vec![0x33u8; VALUE];
    let mut out = vec![0u8; VALUE];
    let t = Instant::now();
    let probe = Client::connect(client_config(
        std::slice::from_ref(&addr),
        plane.secret(),
        timeout,
    ))
    .map_err(|e| format!("connect: {e}"))
    .and_then(|c| put_get(&c, 1 << 40, &value, &mut out).map(|()| c));
    let took = t.elapsed();
    let ok = probe.is_ok();
    match &probe {
        Ok(_) => println!(
            "  real client: connect + 4 KiB put + get succeeded in {:.1} ms",
            took.as_secs_f64() * 1e3
        ),
        Err(e) => println!(
            "  real client: FAILED after {:.1} ms: {}",
            took.as_secs_f64() * 1e3,
            one_line(e)
        ),
    }
    let mut fg = probe.ok().map(|c| foreground(&c, o.secs));
    if let Some(fg) = fg.as_mut() {
        println!(
            "  foreground client under the flood, 4 KiB put+get: {}",
            fg.show()
        );
    }
    println!("  flood at the end: {}", flood.show());
    let after = Status::read(pid).ok_or("the unit is gone")?;
    let peak = sampler.peak();
    drop(sampler);
    drop(flood);
    println!("  unit at the end of the flood: {}", after.show());
    println!(
        "  unit peak (each field at its own moment): {}",
        peak.show()
    );
    let grow = |a: u64, b: u64| (a as f64 - b as f64) / 1024.0;
    // Over the slab: the slab's pages (RssShmem) are the unit's from its
    // start, whatever comes.
    let rss_growth = peak.over_mib() - before.over_mib();
    println!("targets:");
    println!(
        "  the real client's put succeeds within its {} s deadline: {} -> {}",
        o.timeout,
        if ok { "yes" } else { "no" },
        verdict(ok)
    );
    println!(
        "  unit RSS growth < 64 MiB: peak RSS over the slab - before = {rss_growth:.1} MiB (VmRSS: {:.1} MiB); threads {} -> peak {} (+{}) -> {}",
        grow(peak.vm_rss, before.vm_rss),
        before.threads,
        peak.threads,
        peak.threads.saturating_sub(before.threads),
        verdict(rss_growth < 64.0)
    );
    if let Some(fg) = fg.as_mut() {
        println!(
            "  (foreground put+get p99 under the flood: {:.3} ms, {} errors; {:.0} op/s; without it: {:.3} ms, {:.0} op/s)",
            fg.pair_p99_ms(),
            fg.errors,
            fg.ops as f64 / fg.secs,
            control.pair_p99_ms(),
            control.ops as f64 / control.secs
        );
    }
    Ok(())
}
