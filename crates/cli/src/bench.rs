//! `stowage bench`: stowage's put/get throughput and latency next to the
//! machine's limits, measured in the same run, printed as ratios.
//!
//! * memcpy: a single-thread copy of the same size over a working set of
//!   the same size (what a one-sided shm copy cannot beat by much).
//! * raw TCP: a loopback stream doing the same request/reply pattern as a
//!   tcp put (send the bytes, wait for a small ack) and get (send a small
//!   request, read the bytes), with a plain buffer at the far end.
//! * stowage over shm and tcp, against two local unit processes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use stowage_client::{Client, ClientConfig, Key};

use stowage_local::{LocalOptions, LocalPlane};

/// One measured figure.
#[derive(Clone, Debug)]
pub struct Figure {
    pub name: String,
    pub bytes: usize,
    pub gbps: f64,
}

fn iterations(size: usize, quick: bool) -> usize {
    let budget: usize = if quick { 256 << 20 } else { 2 << 30 };
    (budget / size).clamp(8, 20_000)
}

/// Single-thread memcpy of `size` bytes, repeated over one working set.
pub fn memcpy_gbps(size: usize, iters: usize) -> f64 {
    let src = vec![0x5au8; size];
    let mut dst = vec![0u8; size];
    dst.copy_from_slice(&src); // fault the pages in
    let t = Instant::now();
    for i in 0..iters {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        std::hint::black_box(i);
    }
    (size * iters) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// Raw loopback TCP with the put pattern (bytes → 1-byte ack) and the get
/// pattern (1-byte request → bytes): (put GB/s, get GB/s).
pub fn raw_tcp_gbps(size: usize, iters: usize) -> std::io::Result<(f64, f64)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = l.accept()?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; size];
        for _ in 0..iters {
            s.read_exact(&mut buf)?;
            s.write_all(&[1])?;
        }
        let mut req = [0u8; 1];
        for _ in 0..iters {
            s.read_exact(&mut req)?;
            s.write_all(&buf)?;
        }
        Ok(())
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let mut buf = vec![7u8; size];
    let mut ack = [0u8; 1];
    let t = Instant::now();
    for _ in 0..iters {
        c.write_all(&buf)?;
        c.read_exact(&mut ack)?;
    }
    let put = (size * iters) as f64 / t.elapsed().as_secs_f64() / 1e9;
    let t = Instant::now();
    for _ in 0..iters {
        c.write_all(&[1])?;
        c.read_exact(&mut buf)?;
    }
    let get = (size * iters) as f64 / t.elapsed().as_secs_f64() / 1e9;
    server
        .join()
        .map_err(|_| std::io::Error::other("raw TCP server panicked"))??;
    Ok((put, get))
}

/// stowage put and get of one `size`-byte value per op: (put GB/s, get GB/s).
pub fn stowage_gbps(client: &Client, size: usize, iters: usize) -> Result<(f64, f64), String> {
    let value = vec![0xa5u8; size];
    let mut out = vec![0u8; size];
    let mut put_t = Duration::ZERO;
    let mut get_t = Duration::ZERO;
    let warmup = 2;
    for i in 0..iters + warmup {
        let key = Key::new(i as u64 * client.unit_count() as u64, "v");
        let t = Instant::now();
        client
            .put_rows(&[(key.clone(), &value)], client.deadline())
            .map_err(|e| e.to_string())?;
        let t1 = Instant::now();
        let mut bufs = [&mut out[..]];
        let mut sink = stowage_client::SliceSink::new(&mut bufs);
        client
            .get_into(
                stowage_client::DEFAULT_PARTITION,
                &[(0, key.clone())],
                &mut sink,
                client.deadline(),
            )
            .map_err(|e| e.to_string())?;
        let t2 = Instant::now();
        if i >= warmup {
            put_t += t1 - t;
            get_t += t2 - t1;
        }
        client
            .clear_rows(&[key.row], client.deadline())
            .map_err(|e| e.to_string())?;
    }
    if out != value {
        return Err("bench value read back wrong".into());
    }
    let bytes = (size * iters) as f64;
    Ok((
        bytes / put_t.as_secs_f64() / 1e9,
        bytes / get_t.as_secs_f64() / 1e9,
    ))
}

/// Latency percentiles (µs) of single puts and gets of `size` bytes.
pub fn latency_us(
    client: &Client,
    size: usize,
    iters: usize,
) -> Result<(Vec<f64>, Vec<f64>), String> {
    let value = vec![1u8; size];
    let mut out = vec![0u8; size];
    let mut puts = Vec::with_capacity(iters);
    let mut gets = Vec::with_capacity(iters);
    for i in 0..iters + 50 {
        let key = Key::new(0, format!("lat{}", i % 64));
        let t = Instant::now();
        client
            .put_many(
                &[stowage_client::BlobPut {
                    unit: 0,
                    partition: stowage_client::DEFAULT_PARTITION,
                    blob: stowage_client::new_blob_id(),
                    segments: vec![&value],
                    entries: vec![stowage_client::EntrySpec {
                        key: key.clone(),
                        offset: 0,
                        len: size as u64,
                        meta: Vec::new(),
                    }],
                }],
                client.deadline(),
            )
            .map_err(|e| e.to_string())?;
        let t1 = Instant::now();
        let mut bufs = [&mut out[..]];
        let mut sink = stowage_client::SliceSink::new(&mut bufs);
        client
            .get_into(
                stowage_client::DEFAULT_PARTITION,
                &[(0, key)],
                &mut sink,
                client.deadline(),
            )
            .map_err(|e| e.to_string())?;
        let t2 = Instant::now();
        if i >= 50 {
            puts.push((t1 - t).as_secs_f64() * 1e6);
            gets.push((t2 - t1).as_secs_f64() * 1e6);
        }
    }
    client
        .clear_rows(&[0], client.deadline())
        .map_err(|e| e.to_string())?;
    Ok((puts, gets))
}

/// The value after `name` on an example's command line `args`, else
/// `default`.
pub fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

/// The `q`-quantile of `v` (sorted in place).
pub fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Run the whole benchmark and print it.
pub fn run(
    unit_command: Vec<std::ffi::OsString>,
    quick: bool,
    spin: Duration,
    no_metrics: bool,
) -> Result<(), String> {
    let sizes = [64usize << 10, 1 << 20, 16 << 20];
    let memory = 512u64 << 20;
    let mut opts = LocalOptions::new(2, memory);
    opts.command = unit_command;
    opts.unit_args = vec!["--spin".into(), format!("{}us", spin.as_micros())];
    if no_metrics {
        opts.unit_args.push("--no-metrics".into());
    }
    let mut plane = LocalPlane::start(&opts)?;
    let connect = |addrs| {
        let mut cfg = ClientConfig::new("bench", addrs);
        cfg.spin = spin;
        cfg.secret = plane.secret().cloned();
        Client::connect(cfg).map_err(|e| e.to_string())
    };
    let shm = connect(plane.uds_addrs())?;
    let tcp = connect(plane.tcp_addrs())?;
    println!(
        "stowage bench: 2 units x {} MiB, {} cores, adaptive polling {:?}, metrics {}",
        memory >> 20,
        cores(),
        spin,
        if no_metrics { "off" } else { "on" }
    );
    println!(
        "{:>8} | {:>8} | {:>8} {:>8} | {:>8} {:>8} | {:>8} {:>8} | {:>6} {:>6} {:>6} {:>6}",
        "size",
        "memcpy",
        "shm put",
        "shm get",
        "tcp raw>",
        "tcp raw<",
        "tcp put",
        "tcp get",
        "shmP/m",
        "shmG/m",
        "tcpP/r",
        "tcpG/r"
    );
    for &size in &sizes {
        let iters = iterations(size, quick);
        let m = memcpy_gbps(size, iters);
        let (raw_put, raw_get) = raw_tcp_gbps(size, iters.min(2000)).map_err(|e| e.to_string())?;
        let (sp, sg) = stowage_gbps(&shm, size, iters)?;
        let (tp, tg) = stowage_gbps(&tcp, size, iters.min(2000))?;
        println!(
            "{:>8} | {:>8.2} | {:>8.2} {:>8.2} | {:>8.2} {:>8.2} | {:>8.2} {:>8.2} | {:>6.2} {:>6.2} {:>6.2} {:>6.2}",
            bytesize::ByteSize(size as u64).display().iec_short().to_string(),
            m,
            sp,
            sg,
            raw_put,
            raw_get,
            tp,
            tg,
            sp / m,
            sg / m,
            tp / raw_put,
            tg / raw_get
        );
    }
    println!("(GB/s; ratios: shm vs single-thread memcpy, tcp vs raw loopback TCP with the same request/reply pattern)");
    let iters = if quick { 500 } else { 5000 };
    let (mut fastest_put, mut fastest_get) = (f64::INFINITY, f64::INFINITY);
    for (name, client) in [("shm", &shm), ("tcp", &tcp)] {
        let (mut p, mut g) = latency_us(client, 64 << 10, iters)?;
        let (pp, gp) = (quantile(&mut p, 0.5), quantile(&mut g, 0.5));
        fastest_put = fastest_put.min(pp);
        fastest_get = fastest_get.min(gp);
        println!(
            "64 KiB single op on {name}: put p50 {:.1} µs p99 {:.1} µs; get p50 {:.1} µs p99 {:.1} µs",
            pp,
            quantile(&mut p, 0.99),
            gp,
            quantile(&mut g, 0.99)
        );
    }
    // What metrics cost one operation: a put is two timed unit requests
    // (alloc, commit) and one client call; a get one timed request (plus
    // an untimed unpin on shm, one atomic add) and one client call.
    let unit_ns = stowage_unit::metrics::recording_cost(1_000_000).as_nanos() as f64;
    let client_ns = stowage_client::metrics::recording_cost(1_000_000).as_nanos() as f64;
    let put_us = (2.0 * unit_ns + client_ns) / 1e3;
    let get_us = (unit_ns + client_ns) / 1e3;
    println!(
        "metrics recording: {unit_ns:.0} ns per unit request, {client_ns:.0} ns per client call: \
         put {put_us:.2} µs = {:.2}% of the fastest 64 KiB put p50 above, \
         get {get_us:.2} µs = {:.2}% of the fastest get p50{}",
        100.0 * put_us / fastest_put,
        100.0 * get_us / fastest_get,
        if no_metrics {
            " (units started with --no-metrics)"
        } else {
            ""
        }
    );
    for u in &plane.units {
        if let Some(rss) = rss_bytes(u.pid()) {
            println!(
                "unit pid {} resident memory {} MiB for a {} MiB slab: {:.3}x (target <= 1.05x)",
                u.pid(),
                rss >> 20,
                memory >> 20,
                rss as f64 / memory as f64
            );
        }
    }
    plane.stop();
    Ok(())
}

/// VmRSS of a process, in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Sequential write (with a final fsync) and read of `total` bytes in
/// `chunk`-sized pieces, in `dir`: the dd-style limit of the disk tier's
/// filesystem. Returns (write GB/s, read GB/s).
pub fn dd_gbps(dir: &std::path::Path, total: usize, chunk: usize) -> std::io::Result<(f64, f64)> {
    let path = dir.join(format!("stowage-dd-{}", std::process::id()));
    let buf = vec![0x3cu8; chunk];
    let t = Instant::now();
    {
        let mut f = std::fs::File::create(&path)?;
        let mut left = total;
        while left > 0 {
            let n = left.min(chunk);
            f.write_all(&buf[..n])?;
            left -= n;
        }
        f.sync_all()?;
    }
    let write = total as f64 / t.elapsed().as_secs_f64() / 1e9;
    let mut rbuf = vec![0u8; chunk];
    let t = Instant::now();
    {
        let mut f = std::fs::File::open(&path)?;
        loop {
            let n = f.read(&mut rbuf)?;
            if n == 0 {
                break;
            }
        }
    }
    let read = total as f64 / t.elapsed().as_secs_f64() / 1e9;
    std::fs::remove_file(&path)?;
    Ok((write, read))
}

/// The disk tier: one unit whose memory holds a third of what is put.
/// Prints put throughput while spilling, the unit's spill write throughput
/// and the read-back throughput of spilled values, against dd-style
/// sequential write/read of the same bytes on the same filesystem.
pub fn run_disk(
    unit_command: Vec<std::ffi::OsString>,
    dir: &std::path::Path,
    quick: bool,
) -> Result<(), String> {
    let memory: u64 = if quick { 128 << 20 } else { 512 << 20 };
    let value = 4usize << 20;
    let total = 3 * memory as usize;
    let (dd_w, dd_r) =
        dd_gbps(dir, total, value).map_err(|e| format!("dd baseline in {}: {e}", dir.display()))?;
    let mut opts = LocalOptions::new(1, memory);
    opts.command = unit_command;
    opts.unit_args = [
        "--disk",
        &dir.display().to_string(),
        "--disk-capacity",
        &(4 * memory).to_string(),
        "--high-watermark",
        "0.6",
        "--low-watermark",
        "0.4",
    ]
    .map(String::from)
    .to_vec();
    let mut plane = LocalPlane::start(&opts)?;
    let mut cfg = ClientConfig::new("bench-disk", plane.uds_addrs());
    cfg.secret = plane.secret().cloned();
    let client = Client::connect(cfg).map_err(|e| e.to_string())?;
    let data = vec![0x5au8; value];
    let n = total / value;
    let t = Instant::now();
    for i in 0..n {
        client
            .put_rows(&[(Key::new(i as u64, "v"), &data)], client.deadline())
            .map_err(|e| e.to_string())?;
    }
    let put = total as f64 / t.elapsed().as_secs_f64() / 1e9;
    // Let the spiller settle, then read everything back (most of it from disk).
    std::thread::sleep(Duration::from_millis(500));
    let before = unit_stats(&client)?;
    let mut out = vec![0u8; value];
    let t = Instant::now();
    for i in 0..n {
        let mut bufs = [&mut out[..]];
        let mut sink = stowage_client::SliceSink::new(&mut bufs);
        client
            .get_into(
                stowage_client::DEFAULT_PARTITION,
                &[(0, Key::new(i as u64, "v"))],
                &mut sink,
                client.deadline(),
            )
            .map_err(|e| e.to_string())?;
    }
    let get = total as f64 / t.elapsed().as_secs_f64() / 1e9;
    let after = unit_stats(&client)?;
    plane.stop();
    let rate = |b: u64, us: u64| b as f64 / (us.max(1) as f64 * 1e3);
    let spill = rate(before.disk_write_bytes, before.disk_write_micros);
    let unit_read = rate(
        after.disk_read_bytes - before.disk_read_bytes,
        after.disk_read_micros - before.disk_read_micros,
    );
    println!(
        "disk tier ({}; unit memory {} MiB, {} MiB put in {} MiB values):",
        dir.display(),
        memory >> 20,
        total >> 20,
        value >> 20
    );
    println!("  dd-style sequential write {dd_w:.2} GB/s, read {dd_r:.2} GB/s");
    println!(
        "  spill write {spill:.2} GB/s ({:.2}x dd write; {} MiB spilled)",
        spill / dd_w,
        before.disk_write_bytes >> 20
    );
    println!(
        "  read-back of spilled values: unit disk read {unit_read:.2} GB/s ({:.2}x dd read), end to end get {get:.2} GB/s",
        unit_read / dd_r
    );
    println!("  put throughput while spilling {put:.2} GB/s");
    Ok(())
}

fn unit_stats(c: &Client) -> Result<stowage_client::Stats, String> {
    c.stats(c.deadline())
        .into_iter()
        .next()
        .ok_or("no unit")?
        .map_err(|e| e.to_string())
}

/// The machine's idle fraction over `over` (from /proc/stat).
pub fn idle_fraction(over: Duration) -> f64 {
    let read = || -> (f64, f64) {
        let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let f: Vec<f64> = s
            .lines()
            .next()
            .unwrap_or("")
            .split_whitespace()
            .skip(1)
            .map(|x| x.parse().unwrap_or(0.0))
            .collect();
        let idle = f.get(3).copied().unwrap_or(0.0) + f.get(4).copied().unwrap_or(0.0);
        (idle, f.iter().sum())
    };
    let (i0, t0) = read();
    std::thread::sleep(over);
    let (i1, t1) = read();
    if t1 > t0 {
        (i1 - i0) / (t1 - t0)
    } else {
        f64::NAN
    }
}

/// Wait (at most `max`) until the machine is at least 90% idle over half
/// a second: the host is shared, and a round run next to a compiler measures
/// the compiler. Returns the idle fraction seen last.
pub fn wait_quiet(max: Duration) -> f64 {
    let end = Instant::now() + max;
    loop {
        let idle = idle_fraction(Duration::from_millis(500));
        if idle >= 0.9 || Instant::now() >= end {
            return idle;
        }
    }
}

/// Median, min and max of `v` (NaN for each when it is empty).
pub fn median_min_max(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    if s.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let med = if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    };
    (med, s[0], s[s.len() - 1])
}

/// Ask a unit over its Unix socket how to reach its slab over nixl:
/// (agent metadata, slab address), proving the plane's `secret` first.
fn nixl_info(
    sock: &std::path::Path,
    secret: Option<&stowage_client::Secret>,
) -> Result<(Vec<u8>, u64), String> {
    use std::os::unix::net::UnixStream;
    use stowage_wire::{decode_header, encode, FramePrefix, Limits, Request, Response, PREFIX_LEN};
    let mut s = UnixStream::connect(sock).map_err(|e| format!("{}: {e}", sock.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    fn send(s: &mut UnixStream, id: u64, req: &Request) -> Result<(), String> {
        let mut buf = Vec::new();
        encode(id, req, 0, &mut buf).map_err(|e| e.to_string())?;
        s.write_all(&buf).map_err(|e| e.to_string())
    }
    fn call(s: &mut UnixStream, id: u64, req: &Request) -> Result<Response, String> {
        send(s, id, req)?;
        let mut p = [0u8; PREFIX_LEN];
        s.read_exact(&mut p).map_err(|e| e.to_string())?;
        let prefix = FramePrefix::parse(&p, &Limits::default()).map_err(|e| e.to_string())?;
        let mut h = vec![0u8; prefix.header_len as usize];
        s.read_exact(&mut h).map_err(|e| e.to_string())?;
        let mut payload = vec![0u8; prefix.payload_len as usize];
        s.read_exact(&mut payload).map_err(|e| e.to_string())?;
        Ok(decode_header::<Response>(&h)
            .map_err(|e| e.to_string())?
            .body)
    }
    if let Some(secret) = secret {
        let client_nonce = stowage_wire::auth::fresh_nonce().map_err(|e| e.to_string())?;
        match call(&mut s, 10, &Request::Auth { client_nonce })? {
            Response::Challenge {
                unit_nonce,
                unit_proof,
            } if secret.verify_unit_proof(&client_nonce, &unit_nonce, &unit_proof) => {
                let client_proof = secret.client_proof(&client_nonce, &unit_nonce);
                send(&mut s, 11, &Request::Prove { client_proof })?;
            }
            _ => return Err("the unit did not prove the plane's secret".into()),
        }
    }
    call(
        &mut s,
        1,
        &Request::Hello {
            version: stowage_wire::PROTOCOL_VERSION,
            namespace: "bench-raw".into(),
            want_fd: false,
            session: None,
        },
    )?;
    // Its raw agent is not told: the unit holds nothing of this connection.
    let ask = Request::NixlInfo {
        agent: String::new(),
        agent_metadata: Vec::new(),
    };
    match call(&mut s, 2, &ask)? {
        Response::NixlInfo {
            metadata,
            slab_addr,
        } => Ok((metadata, slab_addr)),
        other => Err(format!("the unit does not serve nixl: {other:?}")),
    }
}

/// Raw NIXL WRITE and READ of `size` bytes between this process's
/// registered buffer and a unit's registered slab of `slab_len` bytes
/// (nothing of stowage's protocol, one transfer per op, as a NIXL user
/// would): (write GB/s, read GB/s). `spread`: each op goes to the next
/// `size` bytes of the slab, round the slab, as a store's values land;
/// otherwise every op goes to its first `size` bytes, as a benchmark that
/// reuses its buffers (cache-hot at 1 MiB).
fn raw_nixl_gbps(
    agent: &stowage_nixl::Agent,
    peer: &str,
    (slab_addr, slab_len): (u64, u64),
    size: usize,
    iters: usize,
    spread: bool,
) -> Result<(f64, f64), String> {
    use stowage_nixl::{Op, Range, Staging};
    let staging = std::sync::Arc::new(Staging::new(agent, size).map_err(|e| e.to_string())?);
    let slots = if spread {
        (slab_len / size as u64).max(1)
    } else {
        1
    };
    let run = |op: Op| -> Result<f64, String> {
        let mut took = Duration::ZERO;
        for i in 0..iters + 2 {
            let range = [Range {
                local: 0,
                remote: slab_addr + (i as u64 % slots) * size as u64,
                len: size,
            }];
            let t = Instant::now();
            agent
                .post(op, &staging, &range, peer)
                .map_err(|e| e.to_string())?
                .wait(Instant::now() + Duration::from_secs(30))
                .map_err(|e| e.to_string())?;
            if i >= 2 {
                took += t.elapsed();
            }
        }
        Ok((size * iters) as f64 / took.as_secs_f64() / 1e9)
    };
    Ok((run(Op::Write)?, run(Op::Read)?))
}

/// stowage over nixl, one value per op: (put, get, get into the caller's
/// buffer) GB/s. `get` returns the value in memory lent from the client's
/// registered receive pool (what a get into new arrays does), dropped
/// before the next op; `get out=` fills the caller's buffer, a copy out of
/// the staging buffer.
fn stowage_nixl_gbps(client: &Client, size: usize, iters: usize) -> Result<[f64; 3], String> {
    let value = vec![0xa5u8; size];
    let mut out = vec![0u8; size];
    let mut took = [Duration::ZERO; 3];
    let warmup = 2;
    for i in 0..iters + warmup {
        let key = Key::new(i as u64 * client.unit_count() as u64, "v");
        let placed = [(0, key.clone())];
        let t0 = Instant::now();
        client
            .put_rows(&[(key.clone(), &value)], client.deadline())
            .map_err(|e| e.to_string())?;
        let t1 = Instant::now();
        let got = client
            .get_values(
                stowage_client::DEFAULT_PARTITION,
                &placed,
                client.deadline(),
            )
            .map_err(|e| e.to_string())?;
        let t2 = Instant::now();
        if !matches!(got.first(), Some(stowage_client::Value::Lent(..))) {
            return Err("a get over nixl did not lend its value".into());
        }
        if got[0][..] != value[..] {
            return Err("bench value read back wrong".into());
        }
        drop(got);
        let t3 = Instant::now();
        let mut bufs = [&mut out[..]];
        let mut sink = stowage_client::SliceSink::new(&mut bufs);
        client
            .get_into(
                stowage_client::DEFAULT_PARTITION,
                &placed,
                &mut sink,
                client.deadline(),
            )
            .map_err(|e| e.to_string())?;
        let t4 = Instant::now();
        if i >= warmup {
            took[0] += t1 - t0;
            took[1] += t2 - t1;
            took[2] += t4 - t3;
        }
        client
            .clear_rows(&[key.row], client.deadline())
            .map_err(|e| e.to_string())?;
    }
    if out != value {
        return Err("bench value read back wrong".into());
    }
    let bytes = (size * iters) as f64;
    Ok(took.map(|t| bytes / t.as_secs_f64() / 1e9))
}

/// The cost of registering a touched `size`-byte buffer (and deregistering
/// it), against copying it into a registered buffer: median µs of 9 each.
fn registration_us(agent: &stowage_nixl::Agent, size: usize) -> Result<(f64, f64), String> {
    let src = vec![0x42u8; size];
    let mut staging = stowage_nixl::Staging::new(agent, size).map_err(|e| e.to_string())?;
    let (mut reg, mut copy) = (Vec::new(), Vec::new());
    for _ in 0..9 {
        let t = Instant::now();
        {
            // Registered, then deregistered as it goes out of scope.
            let _registered = agent.register(&src).map_err(|e| e.to_string())?;
        }
        reg.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        staging.as_mut_slice()[..size].copy_from_slice(&src);
        std::hint::black_box(staging.as_slice());
        copy.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok((median_min_max(&reg).0, median_min_max(&copy).0))
}

/// stowage over nixl against raw NIXL transfers of the same sizes, in the
/// same run: two units serving nixl for stowage, a third whose slab the
/// raw transfers use (nothing is stored in it).
pub fn run_nixl(unit_command: Vec<std::ffi::OsString>, quick: bool) -> Result<(), String> {
    let tls = std::env::var("UCX_TLS").ok();
    let rdma = stowage_nixl::check_rdma(tls.as_deref()).is_ok();
    let memory = 512u64 << 20;
    let mut opts = LocalOptions::new(3, memory);
    opts.command = unit_command;
    opts.unit_args = vec!["--nixl".into()];
    if !rdma {
        opts.unit_args.push("--nixl-allow-tcp".into());
    }
    let mut plane = LocalPlane::start(&opts)?;
    // The units fault their slabs in on threads of their own after they
    // start: measure after that, not against it.
    wait_quiet(Duration::from_secs(20));
    let mut cfg = ClientConfig::new("bench-nixl", plane.tcp_addrs()[..2].to_vec());
    cfg.secret = plane.secret().cloned();
    cfg.nixl = Some(stowage_client::NixlOptions {
        require_rdma: rdma,
        ..Default::default()
    });
    let client = Client::connect(cfg).map_err(|e| e.to_string())?;
    // Reach the units now: their transport is known once reached.
    client
        .check_units(client.deadline())
        .map_err(|e| e.to_string())?;
    if client.transport(0) != Some("nixl") {
        return Err(format!(
            "the units are reached over {:?}, not nixl",
            client.transport(0)
        ));
    }
    // Configured as stowage's clients are (no progress thread: it polls).
    let agent =
        stowage_nixl::Agent::new(&format!("stowage-bench-raw-{}", std::process::id()), None)
            .map_err(|e| e.to_string())?;
    let (md, slab_addr) = nixl_info(&plane.units[2].uds, plane.secret())?;
    let peer = agent.load_remote(&md).map_err(|e| e.to_string())?;
    println!(
        "nixl: stowage over nixl (client process -> 2 unit processes) against raw NIXL WRITE/READ \
         (this process -> a unit process's registered slab); UCX_TLS={}{}",
        tls.as_deref().unwrap_or("(unset)"),
        if rdma {
            ""
        } else {
            " -- UCX over tcp/cma: these figures say nothing of RDMA speed"
        }
    );
    const ROUNDS: usize = 5;
    let gb = |v: &[f64]| format!("{:.2}", median_min_max(v).0);
    let ratio = |v: &[f64]| {
        let (m, lo, hi) = median_min_max(v);
        format!("{m:.2} [{lo:.2}-{hi:.2}]")
    };
    let mut ratios = Vec::new();
    println!(
        "GB/s, median of {ROUNDS} interleaved rounds (each: raw hot, raw spread, stowage put, \
         get, get out=)"
    );
    println!(
        "{:>6} | {:>9} {:>9} | {:>9} {:>9} | {:>6} {:>6} {:>8} | {:>6} {:>7}",
        "size",
        "write hot",
        "spread",
        "read hot",
        "spread",
        "put",
        "get",
        "get out=",
        "reg us",
        "copy us"
    );
    for size in [64usize << 10, 1 << 20, 16 << 20, 64 << 20] {
        let iters = (iterations(size, quick).min(2000) / ROUNDS).max(4);
        // [write hot, write spread, read hot, read spread, put, get, get out=]
        let mut runs: [Vec<f64>; 7] = Default::default();
        for _ in 0..ROUNDS {
            let (wh, rh) = raw_nixl_gbps(&agent, &peer, (slab_addr, memory), size, iters, false)?;
            let (ws, rs) = raw_nixl_gbps(&agent, &peer, (slab_addr, memory), size, iters, true)?;
            let [p, g, o] = stowage_nixl_gbps(&client, size, iters)?;
            for (run, v) in runs.iter_mut().zip([wh, ws, rh, rs, p, g, o]) {
                run.push(v);
            }
        }
        let (reg, copy) = registration_us(&agent, size)?;
        let label = bytesize::ByteSize(size as u64)
            .display()
            .iec_short()
            .to_string();
        println!(
            "{:>6} | {:>9} {:>9} | {:>9} {:>9} | {:>6} {:>6} {:>8} | {:>6.1} {:>7.1}",
            label,
            gb(&runs[0]),
            gb(&runs[1]),
            gb(&runs[2]),
            gb(&runs[3]),
            gb(&runs[4]),
            gb(&runs[5]),
            gb(&runs[6]),
            reg,
            copy
        );
        // Each round's ratio to the raw transfers of the same round.
        let per_round = |ours: usize, raw: usize| -> Vec<f64> {
            runs[ours]
                .iter()
                .zip(&runs[raw])
                .map(|(a, b)| a / b)
                .collect()
        };
        ratios.push((
            label,
            [
                per_round(4, 0),
                per_round(4, 1),
                per_round(5, 2),
                per_round(5, 3),
                per_round(6, 2),
                per_round(6, 3),
            ],
        ));
    }
    println!("ratios to raw NIXL of the same round, median [min-max] of {ROUNDS} rounds");
    println!(
        "{:>6} | {:>17} {:>17} | {:>17} {:>17} | {:>17} {:>17}",
        "size",
        "put/write hot",
        "put/write spread",
        "get/read hot",
        "get/read spread",
        "out=/read hot",
        "out=/read spread"
    );
    for (label, r) in &ratios {
        println!(
            "{:>6} | {:>17} {:>17} | {:>17} {:>17} | {:>17} {:>17}",
            label,
            ratio(&r[0]),
            ratio(&r[1]),
            ratio(&r[2]),
            ratio(&r[3]),
            ratio(&r[4]),
            ratio(&r[5])
        );
    }
    println!(
        "(one value per op, hot source buffers on both sides. Target: put and get >= 0.9x raw for \
         1 MiB and larger. raw hot: every op to the same region of the unit's slab (as a benchmark \
         reusing its buffers: at 1 MiB it stays in cache); raw spread: each op to the next region, \
         round the 512 MiB slab, as a store's values land. get: into memory lent from the \
         client's registered receive pool, zero-copy, as a get into new arrays; get out=: into \
         the caller's buffer, READ into the staging buffer then copied, since a READ that misses \
         its deadline must never land in memory the caller got back. reg us: registering and \
         deregistering a touched buffer of that size, median of 9, what a zero-copy put pays per \
         value; copy us: copying it into a registered staging buffer, what a staged put pays; \
         puts of {} and more go zero-copy)",
        bytesize::ByteSize(stowage_client::ZERO_COPY_MIN)
            .display()
            .iec_short()
    );
    plane.stop();
    Ok(())
}

/// The `stowage` binary a benchmark example runs its units with: `given`
/// (its `--stowage PATH`), else the one beside the example's directory
/// (`target/<profile>/examples/NAME` → `target/<profile>/stowage`);
/// an error naming how to build it when it is not there.
pub fn stowage_binary(given: Option<std::path::PathBuf>) -> Result<std::path::PathBuf, String> {
    let bin = match given {
        Some(p) => p,
        None => std::env::current_exe()
            .map_err(|e| format!("this program's path: {e}"))?
            .parent()
            .and_then(|p| p.parent())
            .ok_or("no parent directory")?
            .join("stowage"),
    };
    if !bin.exists() {
        return Err(format!(
            "{} not found: cargo build --release -p stowage-cli --bins --examples (or --stowage PATH)",
            bin.display()
        ));
    }
    Ok(bin)
}
