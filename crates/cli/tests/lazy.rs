//! Clients connect lazily and share their connections: connecting to
//! thousands of units opens nothing; a unit's first connection is opened by
//! the first operation that touches it (and fails as connecting did); the
//! threads of one client share at most `max_unit_conns` connections per
//! unit, waiting within their deadline for one to come free.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{eventually, is_stopped, pattern, plane, Kind};
use rustix::process::Signal;
use stowage_client::{Client, ClientConfig, Error, Key, UnitAddr, UnitConnections, MAX_UNIT_CONNS};

/// File descriptors this process has open now.
fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// A 127.0.0.1 port nobody listens on (bound, then let go).
fn dead_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Counting the whole process's file descriptors is sound only where no
/// other test runs beside this one: `cargo test` runs a binary's tests in
/// threads of one process (nextest runs each in its own). So the test
/// re-runs itself, alone, in a child process of this test binary.
#[test]
fn a_client_of_2000_units_opens_nothing_until_used() {
    let mut child = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "fd_counting_alone_a_client_of_2000_units_opens_nothing_until_used",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the child test starts");
    let out = child.stdout.take().expect("stdout is piped");
    let reader = std::thread::spawn(move || std::io::read_to_string(out).unwrap_or_default());
    let done = eventually(Duration::from_secs(120), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    if !done {
        let _ = child.kill();
    }
    let status = child.wait().expect("the child test is reaped");
    let out = reader.join().expect("the child's output is read");
    assert!(done, "the child test did not finish within 120 s:\n{out}");
    assert!(status.success(), "the child test failed:\n{out}");
    // A filter that matched nothing passes too: the test must have run.
    assert!(out.contains("1 passed"), "the child ran no test:\n{out}");
}

/// [`a_client_of_2000_units_opens_nothing_until_used`]'s body, run alone in
/// a process of its own (ignored: that test runs it).
#[test]
#[ignore = "run alone in a child process by a_client_of_2000_units_opens_nothing_until_used"]
fn fd_counting_alone_a_client_of_2000_units_opens_nothing_until_used() {
    let port = dead_port();
    let units: Vec<UnitAddr> = (0..2000)
        .map(|i| {
            if i < 1000 {
                UnitAddr::Unix(format!("/nonexistent-stowage-lazy/u{i}.sock").into())
            } else {
                UnitAddr::Tcp(format!("127.0.0.1:{port}").parse().unwrap())
            }
        })
        .collect();
    let mut cfg = ClientConfig::new("lazy", units);
    cfg.timeout = Duration::from_secs(5);
    let before = fds();
    let c = Client::connect(cfg).expect("connecting checks only the config");
    assert_eq!(fds(), before, "connecting opened file descriptors");
    for u in [0, 999, 1000, 1999] {
        assert_eq!(c.transport(u), None);
        assert_eq!(c.connections(u), Some(UnitConnections { open: 0, idle: 0 }));
    }

    // The first operation on a unit reaches it, and fails as connecting
    // used to: nothing at a Unix path, ...
    match c.get_rows(&[Key::new(7, "a")], c.deadline()) {
        Err(Error::Unreachable {
            unit: 7,
            addr,
            reason,
        }) => {
            assert_eq!(addr, "unix:/nonexistent-stowage-lazy/u7.sock");
            assert!(reason.contains("No such file or directory"), "{reason}");
        }
        other => panic!("expected Unreachable for unit 7: {other:?}"),
    }
    // ... and nobody listening at a tcp port.
    match c.put_rows(&[(Key::new(1500, "a"), b"x".as_slice())], c.deadline()) {
        Err(Error::Unreachable {
            unit: 1500, reason, ..
        }) => {
            assert!(reason.contains("refused"), "{reason}")
        }
        other => panic!("expected Unreachable for unit 1500: {other:?}"),
    }
    assert_eq!(fds(), before, "a failed connection stayed open");
    assert_eq!(c.connections(7).unwrap().open, 0);
    assert_eq!(c.connections(1500).unwrap().open, 0);

    // The eager check connecting made before: the first unit that fails.
    match c.check_units(c.deadline()) {
        Err(Error::Unreachable { unit: 0, .. }) => {}
        other => panic!("expected Unreachable for unit 0: {other:?}"),
    }
}

fn sixteen_threads_share_at_most_max_unit_conns(kind: Kind) {
    let (p, _) = plane(1, 64 << 20, &[]);
    let c = common::client(&p, kind, Duration::from_secs(30));
    assert_eq!(c.config().max_unit_conns, MAX_UNIT_CONNS);
    assert_eq!(c.connections(0).unwrap().open, 0, "connecting opened one");
    // The unit's own count, through a client of its own (one session, one
    // connection).
    let observer = common::client(&p, kind, Duration::from_secs(30));
    let unit_side = || -> u32 {
        let s = observer.stats(observer.deadline()).pop().unwrap().unwrap();
        s.sessions.iter().map(|x| x.connections).max().unwrap_or(0)
    };
    let done = AtomicBool::new(false);
    let most_open = AtomicUsize::new(0);
    let most_unit_side = AtomicUsize::new(0);
    let ok = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            while !done.load(Ordering::Acquire) {
                most_open.fetch_max(c.connections(0).unwrap().open, Ordering::Relaxed);
                most_unit_side.fetch_max(unit_side() as usize, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        let workers: Vec<_> = (0..16u64)
            .map(|t| {
                let (c, ok) = (&c, &ok);
                s.spawn(move || {
                    for i in 0..40u64 {
                        let key = Key::new(t * 1000 + i, "v");
                        let v = pattern(key.row, 3, 4096);
                        c.put_rows(&[(key.clone(), &v)], c.deadline()).unwrap();
                        let got = c.get_rows(&[key], c.deadline()).unwrap();
                        assert!(got[0] == v, "thread {t} row {i} read back wrong bytes");
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Release);
        sampler.join().unwrap();
    });
    assert_eq!(ok.load(Ordering::Relaxed), 16 * 40);
    let open = c.connections(0).unwrap();
    eprintln!(
        "{kind:?}: at most {} connections open at once (unit side: {}); after: {open:?}",
        most_open.load(Ordering::Relaxed),
        most_unit_side.load(Ordering::Relaxed)
    );
    assert!(open.open >= 1 && open.open <= MAX_UNIT_CONNS, "{open:?}");
    assert_eq!(open.idle, open.open, "a connection was not checked in");
    assert!(most_open.load(Ordering::Relaxed) <= MAX_UNIT_CONNS);
    assert!(most_unit_side.load(Ordering::Relaxed) <= MAX_UNIT_CONNS);
    // The unit agrees, now that every call is done.
    assert!(unit_side() as usize <= MAX_UNIT_CONNS);
    assert!(unit_side() >= 1);
}

#[test]
fn sixteen_threads_share_at_most_max_unit_conns_shm() {
    sixteen_threads_share_at_most_max_unit_conns(Kind::Shm)
}

#[test]
fn sixteen_threads_share_at_most_max_unit_conns_tcp() {
    sixteen_threads_share_at_most_max_unit_conns(Kind::Tcp)
}

#[test]
fn a_call_waits_for_a_held_connection_and_a_broken_one_frees_its_place() {
    let (p, _) = plane(1, 16 << 20, &[]);
    let mut cfg = ClientConfig::new("held", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(30);
    cfg.max_unit_conns = 1;
    let c = Client::connect(cfg).unwrap();
    c.check_units(c.deadline()).unwrap();
    assert_eq!(c.connections(0), Some(UnitConnections { open: 1, idle: 1 }));
    assert_eq!(c.transport(0), Some("shm"));
    let key = Key::new(0, "a");
    let v = pattern(0, 1, 1000);
    c.put_rows(&[(key.clone(), &v)], c.deadline()).unwrap();

    // The unit stops: a get takes the only connection and waits for an
    // answer that does not come.
    let pid = p.units[0].pid();
    p.units[0].signal(Signal::STOP).expect("SIGSTOP");
    assert!(eventually(Duration::from_secs(5), || is_stopped(pid)));
    let stuck = std::thread::scope(|s| {
        let holder = s.spawn(|| {
            c.get_rows(
                std::slice::from_ref(&key),
                Instant::now() + Duration::from_secs(3),
            )
        });
        assert!(
            eventually(Duration::from_secs(5), || c.connections(0).unwrap().idle
                == 0),
            "the first get never took the connection"
        );
        // Another call finds it held and the bound reached: it waits, and
        // fails at its deadline, having opened nothing.
        match c.get_rows(
            std::slice::from_ref(&key),
            Instant::now() + Duration::from_millis(500),
        ) {
            Err(Error::Timeout {
                unit: Some(0),
                what,
            }) => {
                assert!(what.contains("stayed in use"), "{what}")
            }
            other => panic!("expected a Timeout waiting for the connection: {other:?}"),
        }
        assert_eq!(c.connections(0).unwrap().open, 1);
        holder.join().unwrap()
    });
    assert!(
        matches!(stuck, Err(Error::Timeout { unit: Some(0), .. })),
        "{stuck:?}"
    );
    // The connection that timed out is dropped, and its place with it.
    assert_eq!(c.connections(0), Some(UnitConnections { open: 0, idle: 0 }));
    p.units[0].signal(Signal::CONT).expect("SIGCONT");
    // So the next call opens a fresh one.
    let got = c.get_rows(&[key], c.deadline()).unwrap();
    assert!(got[0] == v);
    assert_eq!(c.connections(0), Some(UnitConnections { open: 1, idle: 1 }));
}

/// Threads whose calls each use both units, one connection a unit, each
/// call putting two blobs per unit (so a call comes back for a unit while
/// it holds the other): nobody waits on anybody in a cycle, every call
/// succeeds.
#[test]
fn calls_over_several_units_share_one_connection_each_without_a_cycle() {
    let (p, _) = plane(2, 64 << 20, &[]);
    let mut cfg = ClientConfig::new("cycle", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(60);
    cfg.max_unit_conns = 1;
    let c = Client::connect(cfg).unwrap();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..8u64)
            .map(|t| {
                let c = &c;
                s.spawn(move || {
                    for i in 0..20u64 {
                        let values: Vec<(u64, Vec<u8>)> = (0..4u64)
                            .map(|b| {
                                let row = t * 10_000 + i * 10 + b;
                                (row, pattern(row, 5, 2048))
                            })
                            .collect();
                        let blobs: Vec<stowage_client::BlobPut<'_>> = values
                            .iter()
                            .map(|(row, v)| stowage_client::BlobPut {
                                unit: (*row % 2) as usize,
                                partition: stowage_client::DEFAULT_PARTITION,
                                blob: stowage_client::new_blob_id(),
                                segments: vec![v.as_slice()],
                                entries: vec![stowage_client::EntrySpec {
                                    key: Key::new(*row, "v"),
                                    offset: 0,
                                    len: v.len() as u64,
                                    meta: Vec::new(),
                                }],
                            })
                            .collect();
                        c.put_many(&blobs, c.deadline()).unwrap();
                        let keys: Vec<Key> =
                            values.iter().map(|(row, _)| Key::new(*row, "v")).collect();
                        let got = c.get_rows(&keys, c.deadline()).unwrap();
                        for ((row, v), g) in values.iter().zip(&got) {
                            assert!(g == v, "row {row} read back wrong bytes");
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
    });
    for u in 0..2 {
        assert_eq!(c.connections(u), Some(UnitConnections { open: 1, idle: 1 }));
    }
}
