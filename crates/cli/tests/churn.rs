//! Client churn: every per-client resource of a unit ends with its client.
//! Hundreds of short-lived client processes — clean exits over shm, the
//! request ring and tcp, exits that skip every destructor while holding a
//! view, SIGKILLs in the middle of their puts and gets, and connections
//! that just close at each step of their handshake — leave the
//! unit with the file descriptors, threads and sessions it had before
//! them, and (within 2 MiB) its resident memory, and (within a few dozen)
//! its mappings.
//!
//! The clients are this test binary re-run as child processes
//! (`churn_child`), using the client library as a user would.
//! `STOWAGE_CHURN_CLIENTS=500` runs the 500 (the default is 200,
//! to keep CI cheap; see docs/scale.md for both figures).

mod common;

use std::io::Write;
use std::process::Child;
use std::time::{Duration, Instant};

use common::*;
use stowage_client::{ClientConfig, Column, DType, RowKey, Tensor, UnitAddr};
use stowage_wire::Request;

const MIB: u64 = 1 << 20;
/// One value.
const VALUE: usize = 4096;
/// Client processes running at once (and rows they write: row `i % AT_ONCE`).
const AT_ONCE: usize = 8;
/// Client processes per run unless `STOWAGE_CHURN_CLIENTS` says.
const DEFAULT_CLIENTS: usize = 500;
/// How the clients end, in turn.
const MODES: [&str; 6] = ["shm", "ring", "tcp", "exit", "kill", "raw"];

/// Not a test on its own: a short-lived client, run by the test below.
/// `STOWAGE_CHURN=mode,uds_addr,tcp_addr,row`. `raw` opens connections
/// that just close ([`raw_connections_that_just_close`]). Every other mode
/// puts and gets
/// a few values of row `row` (4 KiB each, the same bytes whoever writes
/// them) and views one; then `shm`, `ring` (requests through a request
/// ring from the first) and `tcp` drop the client and print `DONE`; `exit`
/// prints `DONE` and exits at once, destructors skipped, its view held;
/// `kill` prints `READY` and goes on putting, getting and viewing until it
/// is killed.
#[test]
#[ignore = "a helper process of the churn test"]
fn churn_child() {
    let spec = std::env::var("STOWAGE_CHURN").expect("run only by the churn test");
    let parts: Vec<&str> = spec.split(',').collect();
    let (mode, row) = (parts[0], parts[3].parse::<u64>().unwrap());
    if mode == "raw" {
        raw_connections_that_just_close(&parts[1].parse().unwrap(), &parts[2].parse().unwrap());
        println!("DONE");
        std::io::stdout().flush().unwrap();
        return;
    }
    if matches!(mode, "ring" | "exit" | "kill") {
        std::env::set_var("STOWAGE_RING_AFTER", "0");
    }
    let tcp = mode == "tcp";
    let addr: UnitAddr = parts[if tcp { 2 } else { 1 }].parse().unwrap();
    let mut cfg = ClientConfig::new("churn", vec![addr]);
    cfg.secret = common::child_secret();
    cfg.timeout = Duration::from_secs(20);
    cfg.shm = !tcp;
    let c = std::sync::Arc::new(stowage_client::Client::connect(cfg).unwrap());
    let v = pattern(row, 0, VALUE);
    let keys = [RowKey::Index(row)];
    let col = || Column::Dense(Tensor::new(DType::U8, vec![1, VALUE as u64], &v).unwrap());
    let round = || {
        c.put("churn", &keys, &[("f", col())], None, c.deadline())
            .unwrap();
        let got = c
            .get_tensors("churn", &keys, &["f"], None, c.deadline())
            .unwrap();
        assert_eq!(got[0][0].data, v);
    };
    let view = || {
        let view = c.view("churn", &keys, &["f"], None, c.deadline()).unwrap();
        assert_eq!(view.to_vec(&view.field(0)[0]), v);
        view
    };
    for _ in 0..4 {
        round();
    }
    let held = (!tcp).then(view);
    match mode {
        "kill" => {
            println!("READY");
            std::io::stdout().flush().unwrap();
            drop(held);
            loop {
                round();
                let _held = view();
            }
        }
        "exit" => {
            println!("DONE");
            std::io::stdout().flush().unwrap();
            std::process::exit(0);
        }
        _ => {
            drop(held);
            drop(c);
            println!("DONE");
            std::io::stdout().flush().unwrap();
        }
    }
}

/// Connections that close at each step of their start, no client
/// library: tcp and Unix-socket connections that send nothing, one that
/// proved the secret and said nothing more, and sessions that asked for
/// the slab (its fd dropped unread) or not, each closed after its Hello.
fn raw_connections_that_just_close(uds: &UnitAddr, tcp: &UnitAddr) {
    let (UnitAddr::Unix(path), UnitAddr::Tcp(addr)) = (uds, tcp) else {
        panic!("a Unix socket and a tcp address: {uds}, {tcp}");
    };
    drop(std::net::TcpStream::connect(addr).unwrap());
    drop(Raw::connect_unproven(path));
    drop(Raw::connect(path));
    for want_fd in [false, true] {
        let mut r = Raw::connect(path);
        let resp = r.call(&Request::Hello {
            version: stowage_wire::PROTOCOL_VERSION,
            namespace: "churn".into(),
            want_fd,
            session: None,
        });
        assert!(
            matches!(resp, stowage_wire::Response::Hello { .. }),
            "{resp:?}"
        );
    }
}

/// What the unit process holds, as /proc says.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Levels {
    fds: u64,
    threads: u64,
    /// VmRSS, KiB.
    rss_kib: u64,
    /// RssAnon, KiB: the unit's heap (and stacks); it reports no heap
    /// figure of its own.
    anon_kib: u64,
    /// Mappings (/proc/PID/maps lines): a request ring's is one.
    maps: u64,
}

impl Levels {
    fn of(pid: u32) -> Levels {
        Levels {
            fds: std::fs::read_dir(format!("/proc/{pid}/fd"))
                .expect("the unit's fds")
                .count() as u64,
            threads: proc_status(pid, "Threads"),
            rss_kib: proc_status(pid, "VmRSS"),
            anon_kib: proc_status(pid, "RssAnon"),
            maps: std::fs::read_to_string(format!("/proc/{pid}/maps"))
                .expect("the unit's mappings")
                .lines()
                .count() as u64,
        }
    }
}

/// Run churn client `i` (its mode `MODES[i % 6]`) to its end: a clean
/// one must print `DONE` and exit 0; a `kill` one is SIGKILLed a few
/// milliseconds after its `READY`. Every wait is bounded; the child is
/// killed and reaped whatever happens.
fn run_client(p: &stowage_local::LocalPlane, uds: &UnitAddr, tcp: &UnitAddr, i: usize) {
    let mode = MODES[i % MODES.len()];
    let spec = format!("{mode},{uds},{tcp},{}", i % AT_ONCE);
    let mut child: Child = helper_child_of(p, "churn_child", ("STOWAGE_CHURN", &spec));
    let lines = stdout_lines(&mut child);
    let mut child = Reap(child);
    if mode == "kill" {
        assert!(
            wait_for_line(&lines, "READY", Duration::from_secs(30)),
            "churn client {i} ({mode}) never got going"
        );
        // Somewhere in its next puts, gets and views.
        std::thread::sleep(Duration::from_millis((i as u64 * 7) % 20));
        child.0.kill().unwrap();
        child.0.wait().unwrap();
        return;
    }
    assert!(
        wait_for_line(&lines, "DONE", Duration::from_secs(30)),
        "churn client {i} ({mode}) did not finish"
    );
    let end = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < end,
            "churn client {i} ({mode}) did not exit"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(status.success(), "churn client {i} ({mode}): {status}");
}

/// Run clients `range`, `AT_ONCE` at a time.
fn churn(p: &stowage_local::LocalPlane, range: std::ops::Range<usize>) {
    let (uds, tcp) = (p.uds_addrs()[0].clone(), p.tcp_addrs()[0].clone());
    std::thread::scope(|s| {
        for lane in 0..AT_ONCE {
            let (uds, tcp, range) = (&uds, &tcp, range.clone());
            s.spawn(move || {
                for i in range.skip(lane).step_by(AT_ONCE) {
                    run_client(p, uds, tcp, i);
                }
            });
        }
    });
}

/// Short-lived client processes, a sixth of each kind (clean shm, ring
/// and tcp exits, exits that skip destructors holding a view, SIGKILLs,
/// raw connections that just close):
/// once the unit has seen them go, its fds, threads and sessions are back
/// where they were after a warm-up, and its RSS and anonymous memory
/// within 2 MiB.
#[test]
fn short_lived_clients_leave_nothing_behind() {
    let n: usize = std::env::var("STOWAGE_CHURN_CLIENTS")
        .ok()
        .map(|v| v.parse().expect("STOWAGE_CHURN_CLIENTS is a count"))
        .unwrap_or(DEFAULT_CLIENTS);
    let (p, _) = plane(1, 64 * MIB, &[]);
    let pid = p.units[0].pid();
    let mut watcher = Raw::hello(&p.units[0].uds, "ns");
    // Sessions, and what they hold: reservations, pins, spares.
    let holds = |w: &mut Raw| {
        let s = stats(w);
        (
            s.sessions.len(),
            s.reserved_bytes,
            s.held_bytes,
            s.pins,
            s.spares,
        )
    };
    // Warm-up: what the unit makes lazily (pools, rings' first memfds,
    // allocator arenas) exists before the levels are taken.
    let warm = 4 * MODES.len();
    churn(&p, 0..warm);
    // The watcher's own session, holding nothing.
    let settled = |w: &mut Raw| holds(w) == (1, 0, 0, 0, 0);
    assert!(
        eventually(Duration::from_secs(30), || settled(&mut watcher)),
        "the warm-up's sessions never ended: {:?}",
        holds(&mut watcher)
    );
    let start = Levels::of(pid);
    let ops = stats(&mut watcher).ops;
    let t0 = Instant::now();
    churn(&p, warm..warm + n);
    let ran = t0.elapsed();
    let ops = stats(&mut watcher).ops - ops;
    // Five in six put four values and got them back.
    assert!(ops >= 6 * n as u64, "{n} clients made only {ops} requests");
    // The unit notices exits through closed sockets and pidfds: bounded.
    let mut now = Levels::of(pid);
    let back = eventually(Duration::from_secs(30), || {
        now = Levels::of(pid);
        now.fds <= start.fds && now.threads <= start.threads && settled(&mut watcher)
    });
    eprintln!(
        "{n} client processes ({ops} requests) in {:.1} s; unit before {start:?}, \
         after {now:?}",
        ran.as_secs_f64()
    );
    assert!(
        back,
        "after {n} client processes the unit holds {} fds (was {}), {} threads (was {}), \
         (sessions, reserved bytes, held bytes, pins, spares) {:?} (was (1, 0, 0, 0, 0))",
        now.fds,
        start.fds,
        now.threads,
        start.threads,
        holds(&mut watcher)
    );
    // A request ring is one mapping; thread stacks and allocator arenas
    // come and go by a few dozen.
    assert!(
        now.maps <= start.maps + 64,
        "after {n} client processes the unit has {} mappings (was {})",
        now.maps,
        start.maps
    );
    assert!(
        now.rss_kib <= start.rss_kib + 2048 && now.anon_kib <= start.anon_kib + 2048,
        "after {n} client processes the unit's RSS is {} KiB (was {}), anonymous {} KiB (was {})",
        now.rss_kib,
        start.rss_kib,
        now.anon_kib,
        start.anon_kib
    );
    // Still serving.
    assert!(matches!(
        watcher.call(&Request::List {
            partition: "churn".into()
        }),
        stowage_wire::Response::Listed { .. }
    ));
}
