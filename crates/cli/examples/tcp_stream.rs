//! stowage tcp put/get next to the best raw loopback TCP stream this
//! machine achieves, all measured in the same run, in interleaved rounds.
//!
//! ```text
//! cargo build --release -p stowage-cli --examples
//! target/release/examples/tcp_stream [--rounds 5] [--quick] [--stowage PATH] [--no-iperf]
//! ```
//!
//! * raw: a sender process and a receiver process (this program re-run
//!   with a hidden role), loopback, TCP_NODELAY, moving messages of each
//!   size from a 512 MiB source buffer (walked, so every message comes from
//!   cold memory) into a 512 MiB destination (pre-faulted, walked the same
//!   way). Tried with socket buffers left to autotuning and set to 4 and
//!   16 MiB (SO_SNDBUF/SO_RCVBUF, FORCE variants past the sysctl limits),
//!   and with 256 KiB and 4 MiB writes; and with both ends busy-polling
//!   (non-blocking calls in a loop, no sleeps: what stowage's ends do for
//!   their first 50 us of every wait). Two patterns: `stream` (messages
//!   back to back, one ack at the very end: the limit) and `ack` (one
//!   1-byte ack per message: what a synchronous put can do at best).
//! * iperf3 (when installed): default, and `-w 2M` / `-w 4M`; its buffer
//!   is one warm 128 KiB block, so it is an upper bound, not like for like.
//! * stowage: one `stowage unit --listen tcp:127.0.0.1:0` process (1 GiB
//!   slab) and this process as a tcp client: put_rows of one value from the
//!   same kind of walked source, get_into the same kind of walked
//!   destination; a ring of live values (about 256 MiB) walks the slab.
//!
//! Prints every round, then medians with [min-max] and ratios to the best
//! raw stream.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use stowage_cli::bench::{median_min_max, wait_quiet};
use stowage_client::{Client, ClientConfig, Key, SliceSink, DEFAULT_PARTITION};
use stowage_local::{LocalOptions, LocalPlane};

const MIB: usize = 1 << 20;
/// Source and destination working sets: far larger than the 32 MiB LLC.
const WORKING_SET: usize = 512 * MIB;
/// Longest wait for a quiet machine before each figure.
const QUIET_MAX: Duration = Duration::from_secs(30);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let r = match args.get(1).map(String::as_str) {
        Some("__recv") => recv_role(&args[2..]),
        Some("__send") => send_role(&args[2..]),
        _ => orchestrate(&args[1..]),
    };
    if let Err(e) = r {
        eprintln!("tcp_stream: {e}");
        std::process::exit(1);
    }
}

type Res<T> = Result<T, String>;

fn err<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e}")
}

/// A buffer of `len` bytes, every page touched (faulted in before timing).
fn faulted(len: usize, fill: u8) -> Vec<u8> {
    // Not `vec![0; len]`: that is calloc'd fresh pages, untouched until the
    // first write (which would then be timed).
    let mut v = Vec::with_capacity(len);
    v.resize(len, fill);
    std::hint::black_box(&mut v);
    v
}

/// Where message `i` of `size` bytes lives in a working set.
fn slot(i: usize, size: usize) -> usize {
    let slots = (WORKING_SET / size).max(1);
    (i % slots) * size
}

/// Socket buffer setting: 0 = leave to autotuning.
fn set_buffers(fd: impl AsFd, bytes: usize, send: bool) -> Res<()> {
    use rustix::net::sockopt as so;
    if bytes == 0 {
        return Ok(());
    }
    let fd = fd.as_fd();
    // FORCE ignores net.core.{r,w}mem_max (needs CAP_NET_ADMIN); fall back
    // to the plain option, which the kernel caps.
    let r = if send {
        so::set_socket_send_buffer_size_force(fd, bytes)
            .or_else(|_| so::set_socket_send_buffer_size(fd, bytes))
    } else {
        so::set_socket_recv_buffer_size_force(fd, bytes)
            .or_else(|_| so::set_socket_recv_buffer_size(fd, bytes))
    };
    r.map_err(err("setting the socket buffer"))
}

fn effective_buffer(fd: impl AsFd, send: bool) -> usize {
    use rustix::net::sockopt as so;
    let r = if send {
        so::socket_send_buffer_size(fd)
    } else {
        so::socket_recv_buffer_size(fd)
    };
    r.unwrap_or(0)
}

/// Read exactly `buf.len()` bytes: blocking, or (`poll`) busy-polling with
/// non-blocking receives, as a receiver that keeps its core awake does.
fn read_full(s: &mut TcpStream, buf: &mut [u8], poll: bool) -> std::io::Result<()> {
    if !poll {
        return s.read_exact(buf);
    }
    let mut got = 0;
    while got < buf.len() {
        match rustix::net::recv(&*s, &mut buf[got..], rustix::net::RecvFlags::DONTWAIT) {
            Ok((0, _)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok((n, _)) => got += n,
            Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => std::hint::spin_loop(),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Write all of `buf`: blocking, or (`poll`) busy-polling non-blocking sends.
fn write_full(s: &mut TcpStream, buf: &[u8], poll: bool) -> std::io::Result<()> {
    if !poll {
        return s.write_all(buf);
    }
    let mut sent = 0;
    while sent < buf.len() {
        match rustix::net::send(&*s, &buf[sent..], rustix::net::SendFlags::DONTWAIT) {
            Ok(n) => sent += n,
            Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => std::hint::spin_loop(),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- roles

/// `__recv RCVBUF POLL`: listen on 127.0.0.1:0, print `PORT p`, serve one
/// sender: per phase a 24-byte header (size, count, ack), then `count`
/// messages of `size` bytes into the walked destination; a 1-byte ack per
/// message when `ack`, and one at the end of every phase. Size 0 ends.
fn recv_role(args: &[String]) -> Res<()> {
    use rustix::net::{AddressFamily, SocketType};
    let rcvbuf: usize = args
        .first()
        .ok_or("rcvbuf missing")?
        .parse()
        .map_err(err("rcvbuf"))?;
    let poll = args.get(1).is_some_and(|p| p == "1");
    let fd = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None)
        .map_err(err("socket"))?;
    // Before listen: the window scale is fixed at the handshake.
    set_buffers(&fd, rcvbuf, false)?;
    rustix::net::bind(&fd, &SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)).map_err(err("bind"))?;
    rustix::net::listen(&fd, 4).map_err(err("listen"))?;
    let listener = TcpListener::from(fd);
    let port = listener.local_addr().map_err(err("local addr"))?.port();
    let mut dst = faulted(WORKING_SET, 0);
    println!("PORT {port}");
    std::io::stdout().flush().map_err(err("stdout"))?;
    let (mut s, _) = listener.accept().map_err(err("accept"))?;
    s.set_nodelay(true).map_err(err("nodelay"))?;
    eprintln!("receiver SO_RCVBUF {}", effective_buffer(&s, false));
    loop {
        let mut h = [0u8; 24];
        read_full(&mut s, &mut h, poll).map_err(err("header"))?;
        let word = |i: usize| u64::from_le_bytes(h[i * 8..i * 8 + 8].try_into().unwrap()) as usize;
        let (size, count, ack) = (word(0), word(1), word(2) != 0);
        if size == 0 {
            return Ok(());
        }
        for i in 0..count {
            let at = slot(i, size);
            read_full(&mut s, &mut dst[at..at + size], poll).map_err(err("payload"))?;
            if ack {
                write_full(&mut s, &[1], poll).map_err(err("ack"))?;
            }
        }
        std::hint::black_box(&mut dst);
        write_full(&mut s, &[2], poll).map_err(err("final ack"))?;
    }
}

/// `__send PORT SNDBUF CHUNK ACK BYTES POLL SIZE...`: connect, and per size send
/// BYTES worth of messages in CHUNK-byte writes; prints `RESULT size GB/s`
/// (first byte sent to the receiver's final ack).
fn send_role(args: &[String]) -> Res<()> {
    use rustix::net::{AddressFamily, SocketType};
    let num = |i: usize| -> Res<usize> {
        args.get(i)
            .ok_or_else(|| format!("argument {i} missing"))?
            .parse()
            .map_err(|e| format!("argument {i}: {e}"))
    };
    let (port, sndbuf, chunk, ack, bytes) = (num(0)?, num(1)?, num(2)?, num(3)? != 0, num(4)?);
    let poll = num(5)? != 0;
    let sizes: Vec<usize> = (6..args.len()).map(num).collect::<Res<_>>()?;
    let fd = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None)
        .map_err(err("socket"))?;
    set_buffers(&fd, sndbuf, true)?;
    rustix::net::connect(&fd, &SocketAddrV4::new(Ipv4Addr::LOCALHOST, port as u16))
        .map_err(err("connect"))?;
    let mut s = TcpStream::from(fd);
    s.set_nodelay(true).map_err(err("nodelay"))?;
    eprintln!("sender SO_SNDBUF {}", effective_buffer(&s, true));
    let src = faulted(WORKING_SET, 0x5a);
    let mut one = [0u8; 1];
    // An untimed first phase (256 MiB in 1 MiB messages): the connection's
    // windows and buffers grow before anything is timed.
    let phases = std::iter::once((MIB, 256, false))
        .chain(sizes.iter().map(|&s| (s, (bytes / s).max(4), true)));
    for (size, count, timed) in phases {
        let mut h = [0u8; 24];
        h[..8].copy_from_slice(&(size as u64).to_le_bytes());
        h[8..16].copy_from_slice(&(count as u64).to_le_bytes());
        h[16..].copy_from_slice(&u64::from(ack).to_le_bytes());
        s.write_all(&h).map_err(err("header"))?;
        let t = Instant::now();
        for i in 0..count {
            let at = slot(i, size);
            for piece in src[at..at + size].chunks(chunk.max(1)) {
                write_full(&mut s, piece, poll).map_err(err("payload"))?;
            }
            if ack {
                read_full(&mut s, &mut one, poll).map_err(err("ack"))?;
            }
        }
        read_full(&mut s, &mut one, poll).map_err(err("final ack"))?;
        let gbps = (size * count) as f64 / t.elapsed().as_secs_f64() / 1e9;
        if timed {
            println!("RESULT {size} {gbps}");
        }
    }
    s.write_all(&[0u8; 24]).map_err(err("end"))?;
    Ok(())
}

// --------------------------------------------------------- orchestrator

/// A child process stopped by pid when dropped (bounded: kill, then wait).
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// Wait for a child to exit, at most `limit`; killed past it.
fn wait_bounded(p: &mut Proc, limit: Duration) -> Res<()> {
    let end = Instant::now() + limit;
    loop {
        match p.0.try_wait().map_err(err("wait"))? {
            Some(st) if st.success() => return Ok(()),
            Some(st) => return Err(format!("child exited with {st}")),
            None if Instant::now() >= end => {
                let _ = p.0.kill();
                return Err(format!("child still running after {limit:?}; killed"));
            }
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct RawConfig {
    buf: usize,
    chunk: usize,
    ack: bool,
    /// Busy-poll with non-blocking calls instead of blocking.
    poll: bool,
}

impl RawConfig {
    fn label(&self) -> String {
        let buf = match self.buf {
            0 => "auto".to_string(),
            b => format!("{}M", b / MIB),
        };
        format!(
            "{} buf={buf} write={}K{}",
            if self.ack { "ack   " } else { "stream" },
            self.chunk >> 10,
            if self.poll { " poll" } else { "" }
        )
    }
}

/// One raw measurement: a receiver and a sender process; GB/s per size.
fn raw_once(cfg: RawConfig, sizes: &[usize], bytes: usize) -> Res<Vec<f64>> {
    let exe = std::env::current_exe().map_err(err("current exe"))?;
    let mut recv = Proc(
        Command::new(&exe)
            .args([
                "__recv",
                &cfg.buf.to_string(),
                if cfg.poll { "1" } else { "0" },
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(err("starting the receiver"))?,
    );
    let out = recv.0.stdout.take().ok_or("receiver stdout")?;
    let mut line = String::new();
    BufReader::new(out)
        .read_line(&mut line)
        .map_err(err("receiver port"))?;
    let port = line
        .trim()
        .strip_prefix("PORT ")
        .ok_or_else(|| format!("receiver said {line:?}"))?
        .to_string();
    let mut sargs = vec![
        "__send".to_string(),
        port,
        cfg.buf.to_string(),
        cfg.chunk.to_string(),
        u8::from(cfg.ack).to_string(),
        bytes.to_string(),
        u8::from(cfg.poll).to_string(),
    ];
    sargs.extend(sizes.iter().map(|s| s.to_string()));
    let send = Command::new(&exe)
        .args(&sargs)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(err("starting the sender"))?;
    let mut send = Proc(send);
    let sout = send.0.stdout.take().ok_or("sender stdout")?;
    let mut results = Vec::new();
    for l in BufReader::new(sout).lines() {
        let l = l.map_err(err("sender output"))?;
        if let Some(r) = l.strip_prefix("RESULT ") {
            let g: f64 = r
                .split_whitespace()
                .nth(1)
                .ok_or("result")?
                .parse()
                .map_err(err("result"))?;
            results.push(g);
        }
    }
    wait_bounded(&mut send, Duration::from_secs(60))?;
    wait_bounded(&mut recv, Duration::from_secs(10))?;
    if results.len() != sizes.len() {
        return Err(format!("raw run gave {} results", results.len()));
    }
    Ok(results)
}

/// One iperf3 run (server `-s -1 -B 127.0.0.1`, client `-c 127.0.0.1`):
/// received GB/s.
fn iperf_once(window: Option<&str>, secs: u32, port: u16) -> Res<f64> {
    let mut server = Proc(
        Command::new("iperf3")
            .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(err("starting iperf3 -s"))?,
    );
    std::thread::sleep(Duration::from_millis(300));
    let mut c = Command::new("timeout");
    c.args(["30", "iperf3", "-c", "127.0.0.1", "-p", &port.to_string()])
        .args(["-t", &secs.to_string(), "-J"]);
    if let Some(w) = window {
        c.args(["-w", w]);
    }
    let out = c.output().map_err(err("running iperf3 -c"))?;
    wait_bounded(&mut server, Duration::from_secs(10))?;
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(err("iperf3 JSON output"))?;
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .ok_or_else(|| format!("iperf3 failed: {}", v["error"]))?;
    Ok(bps / 8e9)
}

/// stowage tcp put and get of one value per op: (put GB/s, get GB/s).
fn stowage_once(
    client: &Client,
    src: &[u8],
    dst: &mut [u8],
    size: usize,
    bytes: usize,
    row_base: &mut u64,
) -> Res<(f64, f64)> {
    let ops = (bytes / size).max(4);
    let live = ((256 * MIB) / size).max(2) as u64;
    let warmup = 2;
    let (mut put_t, mut get_t) = (Duration::ZERO, Duration::ZERO);
    let first = *row_base;
    for i in 0..ops + warmup {
        let row = *row_base;
        *row_base += 1;
        let at = slot(i, size);
        let key = Key::new(row, "v");
        let t0 = Instant::now();
        client
            .put_rows(&[(key.clone(), &src[at..at + size])], client.deadline())
            .map_err(|e| format!("put: {e}"))?;
        let t1 = Instant::now();
        {
            let mut bufs = [&mut dst[at..at + size]];
            let mut sink = SliceSink::new(&mut bufs);
            client
                .get_into(DEFAULT_PARTITION, &[(0, key)], &mut sink, client.deadline())
                .map_err(|e| format!("get: {e}"))?;
        }
        let t2 = Instant::now();
        if i >= warmup {
            put_t += t1 - t0;
            get_t += t2 - t1;
        }
        if row >= first + live {
            client
                .clear_rows(&[row - live], client.deadline())
                .map_err(|e| format!("clear: {e}"))?;
        }
        if i + 1 == ops + warmup && dst[at..at + size] != src[at..at + size] {
            return Err("a value read back wrong".into());
        }
    }
    let rows: Vec<u64> = (first.max(row_base.saturating_sub(live))..*row_base).collect();
    client
        .clear_rows(&rows, client.deadline())
        .map_err(|e| format!("clear: {e}"))?;
    let b = (size * ops) as f64;
    Ok((b / put_t.as_secs_f64() / 1e9, b / get_t.as_secs_f64() / 1e9))
}

fn fmt3(v: &[f64]) -> String {
    let (m, lo, hi) = median_min_max(v);
    format!("{m:6.2} [{lo:5.2}-{hi:5.2}]")
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn orchestrate(args: &[String]) -> Res<()> {
    let mut rounds = 5usize;
    let mut quick = false;
    let mut iperf = true;
    let mut only_stowage = false;
    let mut sizes = vec![MIB, 16 * MIB, 64 * MIB];
    let mut stowage_bin = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--rounds" => {
                rounds = it
                    .next()
                    .ok_or("--rounds N")?
                    .parse()
                    .map_err(err("--rounds"))?
            }
            "--quick" => quick = true,
            "--no-iperf" => iperf = false,
            // For profiling: stowage only (no raw, no iperf3), given sizes.
            "--only-stowage" => only_stowage = true,
            "--sizes-mib" => {
                sizes = it
                    .next()
                    .ok_or("--sizes-mib 1,16,64")?
                    .split(',')
                    .map(|x| {
                        x.parse::<usize>()
                            .map(|m| m * MIB)
                            .map_err(|e| e.to_string())
                    })
                    .collect::<Res<_>>()?
            }
            "--stowage" => stowage_bin = Some(it.next().ok_or("--stowage PATH")?.clone()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let stowage_bin =
        stowage_cli::bench::stowage_binary(stowage_bin.map(std::path::PathBuf::from))?;
    let bytes = if quick { 256 * MIB } else { 1024 * MIB };
    let mut configs = Vec::new();
    for ack in [false, true] {
        for buf in [0, 4 * MIB, 16 * MIB] {
            for chunk in [256 << 10, 4 * MIB] {
                configs.push(RawConfig {
                    buf,
                    chunk,
                    ack,
                    poll: false,
                });
            }
        }
        // Busy-polling ends (stowage's client and unit poll for 50 us
        // before they block; a raw program may as well poll throughout).
        for buf in [0, 4 * MIB] {
            configs.push(RawConfig {
                buf,
                chunk: 4 * MIB,
                ack,
                poll: true,
            });
        }
    }
    if only_stowage {
        configs.clear();
    }
    let iperf = iperf
        && !only_stowage
        && Command::new("iperf3")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    // -w past net.core.rmem_max (4 MiB here) makes iperf3 refuse to run
    // ("socket buffer size not set correctly"): iperf3 has no FORCE.
    let windows: [Option<&str>; 3] = [None, Some("2M"), Some("4M")];

    let mut opts = LocalOptions::new(1, 1 << 30);
    opts.command = vec![stowage_bin.into_os_string(), "unit".into()];
    let mut plane = LocalPlane::start(&opts)?;
    let client = Client::connect(ClientConfig::new("tcp-stream", plane.tcp_addrs()))
        .map_err(|e| format!("connect: {e}"))?;
    let src = faulted(WORKING_SET, 0xa5);
    let mut dst = faulted(WORKING_SET, 0);
    let mut row_base = 0u64;

    println!(
        "tcp_stream: {} cores, {rounds} rounds, {} MiB per size per figure, working sets {} MiB, load {}",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        bytes / MIB,
        WORKING_SET / MIB,
        load()
    );
    // raw[config][size] -> per-round values
    let mut raw = vec![vec![Vec::new(); sizes.len()]; configs.len()];
    let mut ip = vec![Vec::new(); windows.len()];
    let mut put = vec![Vec::new(); sizes.len()];
    let mut get = vec![Vec::new(); sizes.len()];
    for round in 0..rounds {
        let t = Instant::now();
        let mut idle: Vec<f64> = Vec::new();
        // Interleave: stowage first on even rounds, raw first on odd ones.
        let mut do_stowage =
            |put: &mut Vec<Vec<f64>>, get: &mut Vec<Vec<f64>>, idle: &mut Vec<f64>| -> Res<()> {
                for (k, &size) in sizes.iter().enumerate() {
                    idle.push(wait_quiet(QUIET_MAX));
                    let (p, g) = stowage_once(&client, &src, &mut dst, size, bytes, &mut row_base)?;
                    put[k].push(p);
                    get[k].push(g);
                }
                Ok(())
            };
        if round % 2 == 0 {
            do_stowage(&mut put, &mut get, &mut idle)?;
        }
        for (c, cfg) in configs.iter().enumerate() {
            idle.push(wait_quiet(QUIET_MAX));
            let r = raw_once(*cfg, &sizes, bytes)?;
            for (k, g) in r.into_iter().enumerate() {
                raw[c][k].push(g);
            }
        }
        if iperf {
            for (w, win) in windows.iter().enumerate() {
                idle.push(wait_quiet(QUIET_MAX));
                match iperf_once(*win, if quick { 1 } else { 2 }, 5201 + round as u16) {
                    Ok(g) => ip[w].push(g),
                    Err(e) => eprintln!("iperf3 {win:?}: {e}"),
                }
            }
        }
        if round % 2 == 1 {
            do_stowage(&mut put, &mut get, &mut idle)?;
        }
        let last = |v: &Vec<Vec<f64>>| -> String {
            v.iter()
                .map(|s| format!("{:.2}", s.last().copied().unwrap_or(f64::NAN)))
                .collect::<Vec<_>>()
                .join("/")
        };
        let best_stream: Vec<String> = (0..sizes.len())
            .map(|k| {
                let b = configs
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| !c.ack)
                    .map(|(c, _)| *raw[c][k].last().unwrap())
                    .fold(0.0, f64::max);
                format!("{b:.2}")
            })
            .collect();
        println!(
            "round {round}: {:.0} s, idle before each figure {:.0}-{:.0}%: stowage put {} get {} GB/s; best raw stream {} (1/16/64 MiB)",
            t.elapsed().as_secs_f64(),
            100.0 * idle.iter().copied().fold(f64::INFINITY, f64::min),
            100.0 * idle.iter().copied().fold(0.0, f64::max),
            last(&put),
            last(&get),
            best_stream.join("/")
        );
    }
    plane.stop();
    if only_stowage {
        for (k, s) in sizes.iter().enumerate() {
            println!(
                "{:>4} MiB: stowage put {} get {} GB/s (--only-stowage)",
                s / MIB,
                fmt3(&put[k]),
                fmt3(&get[k])
            );
        }
        return Ok(());
    }

    println!();
    println!("raw loopback TCP, GB/s, median [min-max] over {rounds} rounds:");
    print!("{:<32}", "config");
    for s in &sizes {
        print!(" | {:>20}", format!("{} MiB", s / MIB));
    }
    println!();
    for (cfg, per_size) in configs.iter().zip(&raw) {
        print!("{:<32}", cfg.label());
        for v in per_size {
            print!(" | {:>20}", fmt3(v));
        }
        println!();
    }
    // The limit: the config with the best median, per size.
    let best = |ack: bool, k: usize| -> (usize, f64) {
        configs
            .iter()
            .enumerate()
            .filter(|(_, c)| c.ack == ack)
            .map(|(c, _)| (c, median_min_max(&raw[c][k]).0))
            .fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a })
    };
    if iperf {
        println!();
        println!("iperf3 (one warm 128 KiB buffer), GB/s, median [min-max]:");
        for (w, win) in windows.iter().enumerate() {
            println!(
                "  iperf3 -c 127.0.0.1 {:<8} {}",
                win.map(|w| format!("-w {w}")).unwrap_or_default(),
                fmt3(&ip[w])
            );
        }
    }
    println!();
    println!(
        "stowage tcp (client process -> unit process), GB/s, median [min-max], ratio of medians:"
    );
    println!(
        "{:>7} | {:>20} | {:>20} | {:>20} | {:>20} | {:>7} {:>7} | {:>7} {:>7}",
        "size",
        "best raw stream",
        "best raw ack",
        "stowage put",
        "stowage get",
        "put/str",
        "get/str",
        "put/ack",
        "get/ack"
    );
    for (k, s) in sizes.iter().enumerate() {
        let (bs, bsv) = best(false, k);
        let (ba, bav) = best(true, k);
        let (pm, _, _) = median_min_max(&put[k]);
        let (gm, _, _) = median_min_max(&get[k]);
        println!(
            "{:>7} | {:>20} | {:>20} | {:>20} | {:>20} | {:>7.2} {:>7.2} | {:>7.2} {:>7.2}",
            format!("{} MiB", s / MIB),
            fmt3(&raw[bs][k]),
            fmt3(&raw[ba][k]),
            fmt3(&put[k]),
            fmt3(&get[k]),
            pm / bsv,
            gm / bsv,
            pm / bav,
            gm / bav
        );
        println!(
            "{:>7}   best stream: {}; best ack: {}",
            "",
            configs[bs].label().trim(),
            configs[ba].label().trim()
        );
    }
    println!("(target: stowage put and get >= 0.90x the best raw stream, for 1 MiB and larger)");

    Ok(())
}
