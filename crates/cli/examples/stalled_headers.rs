//! A unit's memory outside its slab while connections stall mid-header
//! (issue 40, item 1): starts one `stowage unit` with a 64 MiB slab and a
//! secret on loopback TCP, opens `--stallers` (32) authenticated
//! connections that each send a maximal (64 MiB) request header but its
//! last KiB and then wait, runs an honest client's 4 KiB put+get for
//! `--seconds` meanwhile, then closes the stallers and prints: the unit's
//! peak RSS over its start, the honest put+get's p50/p99/worst, the
//! budget's waits and cuts, and the unit's RSS after they left.
//!
//! ```text
//! cargo build --release -p stowage-cli --examples --bin stowage
//! target/release/examples/stalled_headers [--stallers 32] [--seconds 10]
//!     [--stowage PATH] [--unit-arg ARG]...
//! ```

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use stowage_client::{Client, ClientConfig, Key, UnitAddr};
use stowage_local::{LocalOptions, LocalPlane};
use stowage_wire::{
    decode_header, encode, FramePrefix, Limits, Request, Response, Stats, PREFIX_LEN,
    PROTOCOL_VERSION,
};

const MIB: u64 = 1 << 20;

fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap()
        / 1024.0
}

fn call(s: &mut TcpStream, id: u64, req: &Request) -> Response {
    let mut buf = Vec::new();
    encode(id, req, 0, &mut buf).unwrap();
    s.write_all(&buf).unwrap();
    let mut p = [0u8; PREFIX_LEN];
    s.read_exact(&mut p).unwrap();
    let prefix = FramePrefix::parse(&p, &Limits::default()).unwrap();
    let mut h = vec![0u8; prefix.header_len as usize + prefix.payload_len as usize];
    s.read_exact(&mut h).unwrap();
    decode_header(&h[..prefix.header_len as usize])
        .unwrap()
        .body
}

/// An authenticated raw connection that said Hello.
fn raw(addr: SocketAddr, secret: Option<&stowage_wire::auth::Secret>) -> TcpStream {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(120))).unwrap();
    if let Some(secret) = secret {
        let client_nonce = stowage_wire::auth::fresh_nonce().unwrap();
        let Response::Challenge { unit_nonce, .. } =
            call(&mut s, 1, &Request::Auth { client_nonce })
        else {
            panic!("no challenge")
        };
        let client_proof = secret.client_proof(&client_nonce, &unit_nonce);
        let mut buf = Vec::new();
        encode(2, &Request::Prove { client_proof }, 0, &mut buf).unwrap();
        s.write_all(&buf).unwrap();
    }
    let h = call(
        &mut s,
        3,
        &Request::Hello {
            version: PROTOCOL_VERSION,
            namespace: "ns".into(),
            want_fd: false,
            session: None,
        },
    );
    assert!(matches!(h, Response::Hello { .. }), "{h:?}");
    s
}

fn stats(s: &mut TcpStream) -> Stats {
    match call(s, 9, &Request::Stats) {
        Response::Stats(s) => *s,
        other => panic!("{other:?}"),
    }
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut stallers = 32usize;
    let mut seconds = 10u64;
    let mut stowage_bin = None;
    let mut unit_args: Vec<String> =
        vec!["--no-mlock".into(), "--frame-timeout".into(), "120s".into()];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--stallers" => stallers = args.next().ok_or("--stallers N")?.parse()?,
            "--seconds" => seconds = args.next().ok_or("--seconds N")?.parse()?,
            "--stowage" => stowage_bin = Some(args.next().ok_or("--stowage PATH")?),
            "--unit-arg" => unit_args.push(args.next().ok_or("--unit-arg ARG")?),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let bin = stowage_cli::bench::stowage_binary(stowage_bin.map(Into::into))?;
    let mut opts = LocalOptions::new(1, 64 * MIB);
    opts.command = vec![bin.into_os_string(), "unit".into()];
    opts.unit_args = unit_args.clone();
    let mut plane = LocalPlane::start(&opts)?;
    let pid = plane.units[0].pid();
    let UnitAddr::Tcp(addr) = plane.tcp_addrs()[0] else {
        return Err("no tcp address".into());
    };
    let secret = plane.secret().cloned();
    let mut cfg = ClientConfig::new("ns", plane.tcp_addrs());
    cfg.secret = secret.clone();
    cfg.timeout = Duration::from_secs(30);
    let honest = Client::connect(cfg)?;
    let v = vec![5u8; 4096];
    honest.put_rows(&[(Key::new(0, "f"), &v)], honest.deadline())?;
    let mut watcher = raw(addr, secret.as_ref());
    let limit = stats(&mut watcher).outside_slab_limit;
    let start = rss_mib(pid);

    let mut held = Vec::new();
    let mut threads = Vec::new();
    for _ in 0..stallers {
        let mut s = raw(addr, secret.as_ref());
        held.push(s.try_clone()?);
        threads.push(std::thread::spawn(move || {
            let header = 64u64 << 20;
            let mut prefix = [0u8; PREFIX_LEN];
            prefix[..4].copy_from_slice(&(header as u32).to_le_bytes());
            let chunk = vec![0u8; MIB as usize];
            let mut left = header - 1024;
            if s.write_all(&prefix).is_err() {
                return;
            }
            while left > 0 {
                let n = left.min(MIB) as usize;
                if s.write_all(&chunk[..n]).is_err() {
                    return;
                }
                left -= n as u64;
            }
            // Stall: hold the connection until closed.
            let mut b = [0u8; 1];
            let _ = s.read(&mut b);
        }));
    }
    let mut peak = start;
    let mut lat = Vec::new();
    let t0 = Instant::now();
    let mut i = 1u64;
    while t0.elapsed() < Duration::from_secs(seconds) {
        let key = Key::new(i, "f");
        let t = Instant::now();
        honest.put_rows(&[(key.clone(), &v)], honest.deadline())?;
        let got = honest.get_rows(&[key], honest.deadline())?;
        lat.push(t.elapsed());
        assert_eq!(got[0], v);
        peak = peak.max(rss_mib(pid));
        i += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    let during = stats(&mut watcher);
    for s in &held {
        let _ = s.shutdown(Shutdown::Both);
    }
    for t in threads {
        let _ = t.join();
    }
    let settle = Instant::now();
    while stats(&mut watcher).outside_slab_bytes > 4 * MIB
        && settle.elapsed() < Duration::from_secs(10)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(200));
    let after = rss_mib(pid);
    lat.sort();
    println!(
        "stalled_headers: {stallers} connections each 1 KiB short of a 64 MiB header, unit --memory 64MiB, \
         budget+headroom {} MiB, {seconds} s, {} cores",
        limit / MIB,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "  unit RSS: start {start:.0} MiB, peak {peak:.0} MiB (+{:.0} MiB), after {after:.0} MiB (+{:.0} MiB)",
        peak - start,
        after - start
    );
    println!(
        "  honest 4 KiB put+get: n={} p50 {:.2} ms, p99 {:.2} ms, worst {:.2} ms",
        lat.len(),
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        lat.last().map_or(0.0, |d| d.as_secs_f64() * 1e3)
    );
    println!(
        "  budget: waits {}, cuts {} (during the run), held at the end of the run {} MiB",
        during.outside_slab_waits,
        during.outside_slab_cuts,
        during.outside_slab_bytes / MIB
    );
    plane.stop();
    Ok(())
}
