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

use crate::local::{LocalOptions, LocalPlane};

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
) -> Result<(), String> {
    let sizes = [64usize << 10, 1 << 20, 16 << 20];
    let memory = 512u64 << 20;
    let mut opts = LocalOptions::new(2, memory);
    opts.command = unit_command;
    opts.unit_args = vec!["--spin".into(), format!("{}us", spin.as_micros())];
    let mut plane = LocalPlane::start(&opts)?;
    let connect = |addrs| {
        let mut cfg = ClientConfig::new("bench", addrs);
        cfg.spin = spin;
        Client::connect(cfg).map_err(|e| e.to_string())
    };
    let shm = connect(plane.uds_addrs())?;
    let tcp = connect(plane.tcp_addrs())?;
    println!(
        "stowage bench: 2 units x {} MiB, {} cores, adaptive polling {:?}",
        memory >> 20,
        cores(),
        spin
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
    for (name, client) in [("shm", &shm), ("tcp", &tcp)] {
        let (mut p, mut g) = latency_us(client, 64 << 10, iters)?;
        println!(
            "64 KiB single op on {name}: put p50 {:.1} µs p99 {:.1} µs; get p50 {:.1} µs p99 {:.1} µs",
            quantile(&mut p, 0.5),
            quantile(&mut p, 0.99),
            quantile(&mut g, 0.5),
            quantile(&mut g, 0.99)
        );
    }
    plane.stop();
    Ok(())
}

fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}
