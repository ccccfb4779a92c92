//! A hostile client of a unit's metrics endpoint, and the owner's
//! scrapes against it: shared by `tests/other_user.rs` (the flood run as
//! another uid) and `examples/metrics_flood.rs` (the figure in
//! docs/benchmarks.md).
//!
//! The flood opens connections as fast as it can and sends each a part of
//! a request head ("GET /metr"), never the rest; it keeps the newest
//! `HELD` of them open per thread (the endpoint may cut them; a cut one is
//! simply replaced by the next connect), so that every place the endpoint
//! has is always taken by a silent connection.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Connections each flood thread keeps open.
pub const HELD: usize = 128;

/// Flood `addr` from `threads` threads until `until` (or `stop`),
/// counting connects in `connects`; `progress` is called about every
/// 500 ms meanwhile.
pub fn flood(
    addr: SocketAddr,
    threads: usize,
    until: Instant,
    stop: &AtomicBool,
    connects: &AtomicU64,
    mut progress: impl FnMut(u64),
) {
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let mut held = VecDeque::with_capacity(HELD + 1);
                while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1))
                    else {
                        continue;
                    };
                    let _ = s.write_all(b"GET /metr");
                    held.push_back(s);
                    if held.len() > HELD {
                        held.pop_front();
                    }
                    connects.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        while Instant::now() < until && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(500));
            progress(connects.load(Ordering::Relaxed));
        }
    });
}

/// One scrape of `addr`'s `/metrics` within `within` (connect, request
/// and the whole answer): the body, when the answer is a 200 whose body
/// is the unit's metrics text.
pub fn scrape(addr: SocketAddr, within: Duration) -> Result<String, String> {
    let end = Instant::now() + within;
    let mut s = TcpStream::connect_timeout(&addr, within).map_err(|e| format!("connect: {e}"))?;
    let left = || {
        end.saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    s.set_write_timeout(Some(left()))
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: stowage\r\n\r\n")
        .map_err(|e| format!("sending the request: {e}"))?;
    let mut answer = Vec::new();
    let mut buf = [0u8; 16 << 10];
    loop {
        if Instant::now() >= end {
            return Err("no whole answer in time".into());
        }
        s.set_read_timeout(Some(left()))
            .map_err(|e| e.to_string())?;
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) => return Err(format!("reading the answer: {e}")),
        }
    }
    let text = String::from_utf8_lossy(&answer).into_owned();
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return Err(format!("no answer head: {text:?}"));
    };
    if !head.starts_with("HTTP/1.1 200 ") {
        return Err(format!("answered {head:?}"));
    }
    // Real metrics text: the unit's gauges, with their type lines.
    if !(body.contains("# TYPE stowage_") && body.contains("\nstowage_rows{")) {
        return Err(format!("not the unit's metrics: {body:?}"));
    }
    Ok(body.to_string())
}

/// `n` scrapes, `gap` apart, each within `within`: how many succeeded,
/// and why the others failed.
pub fn scrapes(
    addr: SocketAddr,
    n: usize,
    within: Duration,
    gap: Duration,
) -> (usize, Vec<String>) {
    let mut ok = 0;
    let mut failed = Vec::new();
    for _ in 0..n {
        match scrape(addr, within) {
            Ok(_) => ok += 1,
            Err(e) => failed.push(e),
        }
        std::thread::sleep(gap);
    }
    (ok, failed)
}
