//! The unit's memory outside its slab stays within its budget
//! (`--outside-slab-budget`, docs/config.md): real unit processes with a
//! secret on loopback TCP, raw authenticated connections that stall in
//! the middle of a maximal request header or never read their replies,
//! and an honest client beside them.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use stowage_client::Key;
use stowage_wire::{encode, Request, Response, PREFIX_LEN};

const MIB: u64 = 1 << 20;
/// The largest request header a unit reads (the wire's limit).
const MAX_HEADER: u64 = 64 << 20;
/// What a unit may take beyond its slab and its outside-slab budget (and
/// that budget's headroom): its threads, the allocator's slack, the
/// decoded requests in hand, the key index of the honest client's puts.
const OVERHEAD: u64 = 48 * MIB;

/// What these tests ask of a raw connection besides common's.
trait Closed {
    fn closed_within(&mut self, within: Duration) -> bool;
}

impl Closed for RawTcp {
    /// Whether the unit closed it (an end of stream or a reset within
    /// `within`); false when it is still open.
    fn closed_within(&mut self, within: Duration) -> bool {
        self.s.set_read_timeout(Some(within)).unwrap();
        let mut b = [0u8; 1];
        match self.s.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

fn tcp_addr(p: &stowage_local::LocalPlane) -> SocketAddr {
    let stowage_client::UnitAddr::Tcp(addr) = p.tcp_addrs()[0] else {
        unreachable!("a tcp address")
    };
    addr
}

/// A connection that sends the prefix of a frame announcing a
/// `header`-byte header, then all of that header but its last `short`
/// bytes, then waits, on a thread of its own: the thread ends when the
/// bytes went (`true`) or the unit cut the connection (`false`).
struct Staller {
    s: TcpStream,
    sent: std::thread::JoinHandle<bool>,
}

impl Staller {
    fn start(mut t: RawTcp, header: u64, short: u64) -> Staller {
        let s = t.s.try_clone().unwrap();
        let sent = std::thread::spawn(move || {
            let mut prefix = [0u8; PREFIX_LEN];
            prefix[..4].copy_from_slice(&(header as u32).to_le_bytes());
            if t.s.write_all(&prefix).is_err() {
                return false;
            }
            let chunk = vec![0u8; MIB as usize];
            let mut left = header - short;
            while left > 0 {
                let n = left.min(MIB) as usize;
                if t.s.write_all(&chunk[..n]).is_err() {
                    return false;
                }
                left -= n as u64;
            }
            true
        });
        Staller { s, sent }
    }

    /// Close it (its thread's write, if any, fails) and wait for its
    /// thread.
    fn stop(self) -> bool {
        let _ = self.s.shutdown(Shutdown::Both);
        self.sent.join().unwrap()
    }
}

fn rss_kib(pid: u32) -> u64 {
    proc_status(pid, "VmRSS")
}

/// 32 authenticated connections each stall 1 KiB short of the end of a
/// maximal header against a 64 MiB unit: the unit holds them to its
/// budget (their reads wait), an honest client's small put+get keeps
/// completing meanwhile, and the unit's memory comes back once they
/// leave.
#[test]
fn stalled_maximal_headers_stay_within_the_budget_and_honest_clients_keep_going() {
    // A frame timeout longer than the test: the budget bounds them, not it.
    let (p, _) = plane(
        1,
        64 * MIB,
        &["--frame-timeout", "120s", "--handshake-timeout", "10s"],
    );
    let pid = p.units[0].pid();
    let addr = tcp_addr(&p);
    let honest = client(&p, Kind::Tcp, Duration::from_secs(10));
    let v = vec![5u8; 4096];
    honest
        .put_rows(&[(Key::new(0, "f"), &v)], honest.deadline())
        .unwrap();
    let mut watcher = RawTcp::hello_proving(addr, p.secret());
    let Response::Stats(s) = watcher.call(&Request::Stats) else {
        panic!("stats")
    };
    // The default budget of a 64 MiB slab: 64 MiB (and a header of 64 MiB
    // at least), with a quarter of it again for small frames.
    let limit_kib = s.outside_slab_limit / 1024;
    assert!(
        s.outside_slab_limit >= MAX_HEADER + MAX_HEADER / 4
            && s.outside_slab_limit <= 2 * MAX_HEADER,
        "{s:?}"
    );
    let before = rss_kib(pid);

    let stallers: Vec<Staller> = (0..32)
        .map(|_| Staller::start(RawTcp::hello_proving(addr, p.secret()), MAX_HEADER, 1024))
        .collect();
    // The honest client's 4 KiB put+get, again and again while they
    // stall: every one completes (within the client's deadline).
    let mut peak = before;
    let started = Instant::now();
    let mut ops = 0;
    while started.elapsed() < Duration::from_secs(6) {
        let key = Key::new(1 + ops, "f");
        honest
            .put_rows(&[(key.clone(), &v)], honest.deadline())
            .unwrap();
        assert_eq!(
            honest.get_rows(&[key], honest.deadline()).unwrap(),
            vec![v.clone()]
        );
        ops += 1;
        peak = peak.max(rss_kib(pid));
        std::thread::sleep(Duration::from_millis(20));
    }
    let Response::Stats(during) = watcher.call(&Request::Stats) else {
        panic!("stats")
    };
    assert!(
        during.outside_slab_waits > 0,
        "32 maximal headers never waited for the budget: {during:?}"
    );
    let grown = peak.saturating_sub(before);
    assert!(
        grown <= limit_kib + OVERHEAD / 1024,
        "32 stalled maximal headers grew the unit by {grown} KiB (budget and headroom {limit_kib} KiB)"
    );
    for s in stallers {
        s.stop();
    }
    // Their memory comes back once they leave.
    assert!(
        eventually(Duration::from_secs(10), || {
            let Response::Stats(s) = watcher.call(&Request::Stats) else {
                return false;
            };
            s.outside_slab_bytes <= 4 * MIB
        }),
        "the budget's bytes did not come back"
    );
    let after = rss_kib(pid);
    assert!(
        after <= before + 32 * 1024,
        "the unit stayed {} KiB above its start after the stallers left",
        after.saturating_sub(before)
    );
    assert_eq!(
        honest
            .get_rows(&[Key::new(0, "f")], honest.deadline())
            .unwrap(),
        vec![v]
    );
}

/// When a connection has waited for the spent budget past the grace, the
/// unit cuts the connection holding the most stalled bytes, and only
/// that one; the next cut takes the next largest.
#[test]
fn the_budget_cuts_the_holder_of_the_most_stalled_bytes_first() {
    // The smallest budget there is: one maximal header (64 MiB, and a
    // granule).
    let (p, _) = plane(
        1,
        64 * MIB,
        &[
            "--frame-timeout",
            "120s",
            "--handshake-timeout",
            "10s",
            "--outside-slab-budget",
            "1MiB",
        ],
    );
    let addr = tcp_addr(&p);
    let mut watcher = RawTcp::hello_proving(addr, p.secret());
    let mut a = Staller::start(RawTcp::hello_proving(addr, p.secret()), 40 * MIB, 1024);
    let mut b = Staller::start(RawTcp::hello_proving(addr, p.secret()), 20 * MIB, 1024);
    // Both fit the budget: their bytes all go.
    for s in [&mut a, &mut b] {
        let done = eventually(Duration::from_secs(20), || s.sent.is_finished());
        assert!(done, "a header that fits the budget did not go");
    }
    // A third that does not fit waits, then the unit cuts the holder of
    // the most stalled bytes: A (40 MiB), not B (20 MiB).
    let c = Staller::start(RawTcp::hello_proving(addr, p.secret()), 30 * MIB, 1024);
    let mut ra = RawTcp {
        s: a.s.try_clone().unwrap(),
        next: 0,
    };
    assert!(
        ra.closed_within(Duration::from_secs(10)),
        "the largest stalled holder was not cut"
    );
    assert!(eventually(Duration::from_secs(20), || c.sent.is_finished()));
    assert!(a.stop(), "A's bytes went before it stalled");
    let mut rb = RawTcp {
        s: b.s.try_clone().unwrap(),
        next: 0,
    };
    assert!(
        !rb.closed_within(Duration::from_millis(300)),
        "a smaller holder was cut before the largest"
    );
    // A fourth that does not fit: now C (30 MiB) goes, B (20 MiB) stays.
    let d = Staller::start(RawTcp::hello_proving(addr, p.secret()), 30 * MIB, 1024);
    let mut rc = RawTcp {
        s: c.s.try_clone().unwrap(),
        next: 0,
    };
    assert!(
        rc.closed_within(Duration::from_secs(10)),
        "the largest stalled holder was not cut"
    );
    assert!(eventually(Duration::from_secs(20), || d.sent.is_finished()));
    assert!(
        !rb.closed_within(Duration::from_millis(300)),
        "a smaller holder was cut before the largest"
    );
    let Response::Stats(s) = watcher.call(&Request::Stats) else {
        panic!("stats")
    };
    assert_eq!(s.outside_slab_cuts, 2, "{s:?}");
    assert!(s.outside_slab_waits >= 2, "{s:?}");
    assert!(c.stop(), "C's header went whole before it was cut");
    assert!(b.stop(), "B's header went whole");
    assert!(d.stop(), "D's header went whole");
}

/// 32 connections that ask for large replies and never read them: the
/// unit stops reading from each once its replies wait (the socket's
/// buffers hold them), its memory stays within its slab, budget and
/// overhead, an honest client keeps going, and the memory comes back
/// once they leave.
#[test]
fn clients_that_never_read_their_replies_hold_the_unit_to_its_budget() {
    let (p, _) = plane(
        1,
        64 * MIB,
        &["--frame-timeout", "120s", "--handshake-timeout", "10s"],
    );
    let pid = p.units[0].pid();
    let addr = tcp_addr(&p);
    let honest = client(&p, Kind::Tcp, Duration::from_secs(10));
    let v = vec![9u8; 4096];
    let mut watcher = RawTcp::hello_proving(addr, p.secret());
    let Response::Stats(s) = watcher.call(&Request::Stats) else {
        panic!("stats")
    };
    let limit_kib = s.outside_slab_limit / 1024;
    let before = rss_kib(pid);
    // Each asks to resolve 2^15 keys that are not there, 16 times over,
    // without reading a reply.
    let keys: Vec<Key> = (0..1u64 << 15).map(|r| Key::new(r, "missing")).collect();
    let mut frame = Vec::new();
    for id in 0..16 {
        encode(
            id,
            &Request::Resolve {
                partition: String::new(),
                keys: keys.clone(),
                hold: false,
            },
            0,
            &mut frame,
        )
        .unwrap();
    }
    let frame = std::sync::Arc::new(frame);
    let deaf: Vec<Staller> = (0..32)
        .map(|_| {
            let mut t = RawTcp::hello_proving(addr, p.secret());
            let s = t.s.try_clone().unwrap();
            let frame = frame.clone();
            let sent = std::thread::spawn(move || t.s.write_all(&frame).is_ok());
            Staller { s, sent }
        })
        .collect();
    let mut peak = before;
    let started = Instant::now();
    let mut ops = 0;
    while started.elapsed() < Duration::from_secs(5) {
        let key = Key::new(ops, "f");
        honest
            .put_rows(&[(key.clone(), &v)], honest.deadline())
            .unwrap();
        assert_eq!(
            honest.get_rows(&[key], honest.deadline()).unwrap(),
            vec![v.clone()]
        );
        ops += 1;
        peak = peak.max(rss_kib(pid));
        std::thread::sleep(Duration::from_millis(20));
    }
    let grown = peak.saturating_sub(before);
    assert!(
        grown <= limit_kib + OVERHEAD / 1024,
        "32 clients that never read grew the unit by {grown} KiB (budget and headroom {limit_kib} KiB)"
    );
    for d in deaf {
        d.stop();
    }
    assert!(
        eventually(Duration::from_secs(10), || {
            let Response::Stats(s) = watcher.call(&Request::Stats) else {
                return false;
            };
            s.outside_slab_bytes <= 4 * MIB
        }),
        "the budget's bytes did not come back"
    );
    let after = rss_kib(pid);
    assert!(
        after <= before + 32 * 1024,
        "the unit stayed {} KiB above its start after the deaf clients left",
        after.saturating_sub(before)
    );
}
