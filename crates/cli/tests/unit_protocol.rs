//! A unit under misbehaving clients: bad frames, dead clients, leases, a
//! restart.

mod common;

use std::io::Write;

use std::time::Duration;

use common::{
    client, data_bytes, eventually, helper_child, pattern, plane, stdout_lines, wait_for_line,
    Kind, Raw,
};
use stowage_client::{Error, Key};
use stowage_wire::{encode, BlobId, EntrySpec, ErrorCode, Request, Response, PREFIX_LEN};

const MIB: u64 = 1 << 20;

fn stats(raw: &mut Raw) -> stowage_wire::Stats {
    match raw.call(&Request::Stats) {
        Response::Stats(s) => *s,
        other => panic!("expected Stats, got {other:?}"),
    }
}

fn expect_invalid_then_closed(mut r: Raw, what: &str) {
    let e = r
        .recv()
        .unwrap_or_else(|| panic!("{what}: no reply before the close"));
    match e.body {
        Response::Error {
            code: ErrorCode::InvalidRequest,
            ..
        } => {}
        other => panic!("{what}: expected InvalidRequest, got {other:?}"),
    }
    assert!(r.closed(), "{what}: connection left open");
}

#[test]
fn bad_frames_get_invalid_request_while_others_carry_on() {
    let (p, _) = plane(1, 16 * MIB, &[]);
    let sock = p.units[0].uds.clone();
    let c = client(&p, Kind::Shm, Duration::from_secs(10));
    let v = pattern(9, 9, 4096);
    c.put_rows(&[(Key::new(0, "kept"), &v)], c.deadline())
        .unwrap();

    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let worker = s.spawn(|| {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let k = Key::new(2 + n % 50, "busy");
                c.put_rows(&[(k.clone(), &v)], c.deadline()).unwrap();
                assert!(c.get_rows(&[k], c.deadline()).unwrap()[0] == v);
                n += 1;
            }
            n
        });

        // Garbage: a prefix that declares a small header full of noise.
        let mut r = Raw::hello(&sock, "test");
        let mut junk = vec![0u8; PREFIX_LEN];
        junk[..4].copy_from_slice(&20u32.to_le_bytes());
        junk.extend((0..20u8).map(|i| i.wrapping_mul(37) | 0x80));
        r.s.write_all(&junk).unwrap();
        expect_invalid_then_closed(r, "garbage");

        // Truncated: a real header with its tail cut off.
        let mut r = Raw::hello(&sock, "test");
        let mut frame = Vec::new();
        let keys = vec![Key::new(1, "a-long-field-name")];
        let req = Request::Resolve {
            partition: String::new(),
            keys,
            hold: false,
        };
        encode(7, &req, 0, &mut frame).unwrap();
        let cut = frame.len() - 6;
        let header_len = (cut - PREFIX_LEN) as u32;
        frame[..4].copy_from_slice(&header_len.to_le_bytes());
        r.s.write_all(&frame[..cut]).unwrap();
        expect_invalid_then_closed(r, "truncated");

        // Oversized: a header longer than the unit accepts (refused before
        // a byte of it is read or allocated).
        let mut r = Raw::hello(&sock, "test");
        let mut big = vec![0u8; PREFIX_LEN];
        big[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        r.s.write_all(&big).unwrap();
        expect_invalid_then_closed(r, "oversized header");

        // Oversized payload.
        let mut r = Raw::hello(&sock, "test");
        let mut big = vec![0u8; PREFIX_LEN];
        big[..4].copy_from_slice(&4u32.to_le_bytes());
        big[4..].copy_from_slice(&u64::MAX.to_le_bytes());
        r.s.write_all(&big).unwrap();
        expect_invalid_then_closed(r, "oversized payload");

        // A payload on a request that takes none.
        let mut r = Raw::hello(&sock, "test");
        let mut f = Vec::new();
        encode(3, &Request::Stats, 10, &mut f).unwrap();
        f.extend_from_slice(&[0u8; 10]);
        r.s.write_all(&f).unwrap();
        expect_invalid_then_closed(r, "stray payload");

        // Too many keys for the unit's limits is refused as well.
        let mut r = Raw::hello(&sock, "test");
        r.send(&Request::ClearRows {
            partition: String::new(),
            rows: (0..(1u64 << 20) + 1).collect(),
        });
        expect_invalid_then_closed(r, "too many rows");

        // Requests before Hello are refused.
        let mut r = Raw::connect(&sock);
        match r.call(&Request::Stats) {
            Response::Error {
                code: ErrorCode::Unauthorized,
                ..
            } => {}
            other => panic!("expected Unauthorized, got {other:?}"),
        }
        assert!(r.closed());

        // Another protocol version is refused.
        let mut r = Raw::connect(&sock);
        match r.call(&Request::Hello {
            version: 999,
            namespace: "x".into(),
            want_fd: false,
            session: None,
        }) {
            Response::Error {
                code: ErrorCode::VersionMismatch,
                ..
            } => {}
            other => panic!("expected VersionMismatch, got {other:?}"),
        }

        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let done = worker.join().unwrap();
        assert!(done > 0, "the well-behaved client made no progress");
    });
    // The unit is still up and its data intact.
    assert!(c.get_rows(&[Key::new(0, "kept")], c.deadline()).unwrap()[0] == v);
}

#[test]
fn a_silent_client_keeps_its_holds_visibly_until_it_closes() {
    let (p, _) = plane(
        1,
        16 * MIB,
        &[
            "--pin-lease",
            "1s",
            "--reservation-lease",
            "1s",
            "--quarantine",
            "200ms",
        ],
    );
    let sock = p.units[0].uds.clone();
    let mut r = Raw::hello(&sock, "ns");
    let blob = BlobId(42);
    assert!(matches!(
        r.call(&Request::Alloc {
            blob,
            nbytes: 100,
            n_entries: 1
        }),
        Response::Allocated { .. }
    ));
    let entries = vec![EntrySpec {
        key: Key::new(1, "f"),
        offset: 0,
        len: 100,
        meta: vec![],
    }];
    assert_eq!(
        r.call(&Request::Commit {
            blob,
            partition: String::new(),
            entries: entries.clone()
        }),
        Response::Done
    );
    // Commit is idempotent.
    assert_eq!(
        r.call(&Request::Commit {
            blob,
            partition: String::new(),
            entries
        }),
        Response::Done
    );
    let pinned = r.call(&Request::Resolve {
        partition: String::new(),
        keys: vec![Key::new(1, "f")],
        hold: false,
    });
    assert!(
        matches!(pinned, Response::Resolved { pin: Some(_), .. }),
        "{pinned:?}"
    );
    assert!(matches!(
        r.call(&Request::Alloc {
            blob: BlobId(43),
            nbytes: 1000,
            n_entries: 1
        }),
        Response::Allocated { .. }
    ));
    let mut watcher = Raw::hello(&sock, "ns");
    let s = stats(&mut watcher);
    assert_eq!((s.pins, s.reserved_bytes), (1, 1024), "{s:?}");
    // The client stays connected but silent, past every lease: a paused
    // process may resume its copy at any moment, so nothing is reclaimed.
    // Stats show what it holds, and that its holds are overdue.
    assert!(
        eventually(Duration::from_secs(5), || stats(&mut watcher).overdue_holds
            == 2),
        "{:?}",
        stats(&mut watcher)
    );
    let s = stats(&mut watcher);
    // Stored data is the pinned value's blob; the reservation is beside it.
    assert_eq!((s.pins, s.reserved_bytes, s.used), (1, 1024, 128), "{s:?}");
    assert_eq!(s.capacity - s.free_bytes, 1152, "{s:?}");
    let held: Vec<_> = s.sessions.iter().filter(|x| x.held_bytes > 0).collect();
    assert_eq!(held.len(), 1, "{s:?}");
    assert_eq!((held[0].reservations, held[0].pins), (1, 1));
    assert_eq!(held[0].held_bytes, 1024 + 100);
    assert!(held[0].oldest_hold_ms >= 1000, "{s:?}");
    // Its reservation is still its own: it can commit it now.
    assert_eq!(
        r.call(&Request::Commit {
            blob: BlobId(43),
            partition: String::new(),
            entries: vec![EntrySpec {
                key: Key::new(2, "f"),
                offset: 0,
                len: 1000,
                meta: vec![],
            }]
        }),
        Response::Done
    );
    r.call(&Request::Alloc {
        blob: BlobId(44),
        nbytes: 1000,
        n_entries: 1,
    });
    // Closing its connection releases the pin and the reservation at once.
    drop(r);
    assert!(
        eventually(Duration::from_secs(5), || {
            let s = stats(&mut watcher);
            s.pins == 0 && s.reserved_bytes == 0 && s.quarantined_bytes == 0
        }),
        "{:?}",
        stats(&mut watcher)
    );
    let s = stats(&mut watcher);
    assert_eq!((s.entries, s.used), (2, 128 + 1024));
}

/// Not a test on its own: run by `pins_of_a_killed_client_are_reclaimed`
/// in a child process, where it pins a key and then waits to be killed.
#[test]
#[ignore = "a helper process of pins_of_a_killed_client_are_reclaimed"]
fn pin_holder_child() {
    let sock = std::env::var("STOWAGE_TEST_PIN_HOLDER")
        .expect("run only by pins_of_a_killed_client_are_reclaimed");
    let mut r = Raw::hello(std::path::Path::new(&sock), "ns");
    let resp = r.call(&Request::Resolve {
        partition: String::new(),
        keys: vec![Key::new(0, "v")],
        hold: false,
    });
    assert!(matches!(resp, Response::Resolved { pin: Some(_), .. }));
    println!("PINNED");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn pins_of_a_killed_client_are_reclaimed() {
    let (p, _) = plane(1, 16 * MIB, &["--pin-lease", "2s"]);
    let sock = p.units[0].uds.clone();
    let mut cfg = stowage_client::ClientConfig::new("ns", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(10);
    let c = stowage_client::Client::connect(cfg).unwrap();
    c.put_rows(&[(Key::new(0, "v"), &pattern(0, 0, 1000))], c.deadline())
        .unwrap();

    let sock_str = sock.display().to_string();
    let mut child = helper_child("pin_holder_child", ("STOWAGE_TEST_PIN_HOLDER", &sock_str));
    let lines = stdout_lines(&mut child);
    let pinned = wait_for_line(&lines, "PINNED", Duration::from_secs(30));
    let mut watcher = Raw::hello(&sock, "ns");
    let pins_before = stats(&mut watcher).pins;
    // Stop the child by its pid before asserting anything.
    let _ = child.kill();
    let _ = child.wait();
    assert!(pinned, "the pin holder never pinned");
    assert_eq!(pins_before, 1);
    // The pin is gone once the dead process's connection closes.
    assert!(eventually(Duration::from_secs(4), || stats(&mut watcher)
        .pins
        == 0));
    // And the value can be cleared and its memory freed.
    c.clear_rows(&[0], c.deadline()).unwrap();
    assert_eq!(data_bytes(&stats(&mut watcher)), 0);
}

#[test]
fn a_restarted_unit_is_told_apart_from_the_one_that_held_the_blobs() {
    let (mut p, opts) = plane(2, 16 * MIB, &[]);
    let c = client(&p, Kind::Shm, Duration::from_secs(10));
    let v = pattern(1, 1, 2000);
    c.put_rows(
        &[(Key::new(0, "a"), &v), (Key::new(1, "a"), &v)],
        c.deadline(),
    )
    .unwrap();
    p.restart(0, &opts).unwrap();
    // The same socket path answers, with empty memory: the keys are lost,
    // not merely missing.
    match c.get_rows(&[Key::new(0, "a")], c.deadline()) {
        Err(Error::LostKeys { unit: 0, keys, .. }) => assert_eq!(keys, vec![Key::new(0, "a")]),
        other => panic!("expected LostKeys, got {:?}", other.map(|_| ())),
    }
    assert!(c.get_rows(&[Key::new(1, "a")], c.deadline()).unwrap()[0] == v);
    // The new instance takes puts.
    c.put_rows(&[(Key::new(2, "a"), &v)], c.deadline()).unwrap();
    assert!(c.get_rows(&[Key::new(2, "a")], c.deadline()).unwrap()[0] == v);
}

#[test]
fn busy_backs_off_until_the_holder_lets_go_or_the_deadline_passes() {
    let (p, _) = plane(
        1,
        4 * MIB,
        &["--reservation-lease", "1s", "--quarantine", "100ms"],
    );
    let sock = p.units[0].uds.clone();
    // A client reserves the whole slab and goes silent (but stays connected).
    let mut hog = Raw::hello(&sock, "test");
    assert!(matches!(
        hog.call(&Request::Alloc {
            blob: BlobId(1),
            nbytes: 4 * MIB,
            n_entries: 0
        }),
        Response::Allocated { .. }
    ));
    let v = pattern(0, 0, MIB as usize);
    // A short deadline: Busy until it passes, then Timeout.
    let c = client(&p, Kind::Shm, Duration::from_millis(300));
    let t = std::time::Instant::now();
    let r = c.put_rows(&[(Key::new(0, "v"), &v)], c.deadline());
    assert!(
        matches!(r, Err(Error::Timeout { unit: Some(0), .. })),
        "{r:?}"
    );
    assert!(t.elapsed() < Duration::from_millis(300 + 1500));
    // Both sides count the Busy answers: the client its retries and the
    // time it backed off, the unit its answers.
    let m = c.metrics();
    assert!(m.busy_retries >= 1, "{m:?}");
    assert!(m.busy_wait_seconds > 0.0, "{m:?}");
    assert_eq!(m.memory_waits, 0, "{m:?}");
    let put = &m.operations[0];
    assert_eq!((put.op, put.ok, put.error), ("put", 0, 1), "{m:?}");
    let busy = c.stats(c.deadline())[0].as_ref().unwrap().busy;
    assert!(busy >= m.busy_retries, "unit counted {busy} Busy answers");
    // No lease takes the silent hog's reservation (1 s passes). A long
    // deadline: the hog lets go after a while (its connection closes), and
    // a retry after backoff gets the memory.
    let c = client(&p, Kind::Shm, Duration::from_secs(10));
    let t = std::time::Instant::now();
    let letting_go = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        drop(hog);
    });
    c.put_rows(&[(Key::new(0, "v"), &v)], c.deadline()).unwrap();
    letting_go.join().unwrap();
    assert!(
        t.elapsed() >= Duration::from_millis(1500),
        "put did not wait for the reservation"
    );
    assert!(c.get_rows(&[Key::new(0, "v")], c.deadline()).unwrap()[0] == v);
}

/// A raw connection over either transport, for the repair requests.
trait RawConn {
    fn write(&mut self, bytes: &[u8]);
    fn read(&mut self) -> Option<stowage_wire::Envelope<Response>>;
}

impl RawConn for Raw {
    fn write(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).unwrap();
    }
    fn read(&mut self) -> Option<stowage_wire::Envelope<Response>> {
        self.recv()
    }
}

impl RawConn for common::RawTcp {
    fn write(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).unwrap();
    }
    fn read(&mut self) -> Option<stowage_wire::Envelope<Response>> {
        self.recv()
    }
}

/// Send `req` with `payload` and read its reply (bounded by the
/// connection's read timeout).
fn call_raw(c: &mut dyn RawConn, req: &Request, payload: &[u8]) -> Response {
    let mut buf = Vec::new();
    encode(77, req, payload.len() as u64, &mut buf).unwrap();
    buf.extend_from_slice(payload);
    c.write(&buf);
    let e = c.read().expect("a reply");
    assert_eq!(e.id, 77);
    e.body
}

/// A RepairPut of 4 bytes per row of `rows` (field "x"), in partition
/// `part`.
fn repair_put(c: &mut dyn RawConn, window: u64, blob: u128, part: &str, rows: &[u64]) -> Response {
    let entries = rows
        .iter()
        .enumerate()
        .map(|(i, &row)| EntrySpec {
            key: Key::new(row, "x"),
            offset: 4 * i as u64,
            len: 4,
            meta: vec![],
        })
        .collect();
    let payload: Vec<u8> = rows
        .iter()
        .flat_map(|r| (*r as u32).to_le_bytes())
        .collect();
    let req = Request::RepairPut {
        window,
        blob: BlobId(blob),
        partition: part.into(),
        entries,
        timeout_ms: 10_000,
    };
    call_raw(c, &req, &payload)
}

fn is_error(r: &Response, want: ErrorCode) -> bool {
    matches!(r, Response::Error { code, .. } if *code == want)
}

#[test]
fn repair_windows_over_unix_and_tcp() {
    let (p, _) = plane(1, 16 * MIB, &[]);
    let sock = p.units[0].uds.clone();
    let connect = |tcp: bool| -> Box<dyn RawConn> {
        if tcp {
            Box::new(common::RawTcp::hello_proving(p.units[0].tcp, p.secret()))
        } else {
            Box::new(Raw::hello(&sock, "ns"))
        }
    };
    let mut watcher = Raw::hello(&sock, "ns");
    for (tcp, base) in [(false, 100u128), (true, 200)] {
        let what = if tcp { "tcp" } else { "unix" };
        let part = format!("p-{what}");
        let key = format!("group {what}");
        let (mut a, mut b) = (connect(tcp), connect(tcp));
        let open = |c: &mut dyn RawConn, key: &str| {
            call_raw(c, &Request::OpenRepair { key: key.into() }, &[])
        };
        let Response::RepairOpened { window } = open(&mut *a, &key) else {
            panic!("{what}: no window");
        };
        // Another session, the same key: Busy; another key: its own window.
        let r = open(&mut *b, &key);
        assert!(is_error(&r, ErrorCode::Busy), "{what}: {r:?}");
        let Response::RepairOpened { window: other } = open(&mut *b, "another") else {
            panic!("{what}: no second window");
        };
        assert_ne!(window, other);
        // Stored when absent.
        let r = repair_put(&mut *a, window, base, &part, &[1, 2]);
        assert_eq!(
            r,
            Response::Repaired {
                stored: 2,
                skipped: 0
            },
            "{what}"
        );
        // Row 3 cleared after the window opened (not here at all); row 1
        // present: only row 4 is stored.
        let clear = Request::ClearRows {
            partition: part.clone(),
            rows: vec![3],
        };
        assert_eq!(
            call_raw(&mut *b, &clear, &[]),
            Response::Cleared { entries: 0 }
        );
        let r = repair_put(&mut *a, window, base + 1, &part, &[1, 3, 4]);
        assert_eq!(
            r,
            Response::Repaired {
                stored: 1,
                skipped: 2
            },
            "{what}"
        );
        let listed = call_raw(
            &mut *b,
            &Request::List {
                partition: part.clone(),
            },
            &[],
        );
        let Response::Listed { rows } = listed else {
            panic!("{what}: {listed:?}");
        };
        let rows: Vec<u64> = rows.into_iter().map(|(r, _)| r).collect();
        assert_eq!(rows, vec![1, 2, 4], "{what}");
        // A window of another session is refused (its payload drained, the
        // connection kept).
        let r = repair_put(&mut *a, other, base + 2, &part, &[9]);
        assert!(is_error(&r, ErrorCode::InvalidRequest), "{what}: {r:?}");
        // Closed (and an unknown window closes fine): refused too.
        let close =
            |c: &mut dyn RawConn, window| call_raw(c, &Request::CloseRepair { window }, &[]);
        assert_eq!(close(&mut *a, window), Response::Done);
        assert_eq!(close(&mut *a, u64::MAX), Response::Done);
        let r = repair_put(&mut *a, window, base + 3, &part, &[9]);
        assert!(is_error(&r, ErrorCode::InvalidRequest), "{what}: {r:?}");
        // Closed: the key is free for the other session.
        assert!(
            matches!(open(&mut *b, &key), Response::RepairOpened { .. }),
            "{what}"
        );
        assert_eq!(close(&mut *b, other), Response::Done);
        // The end of a session closes its windows.
        drop(b);
        assert!(
            eventually(Duration::from_secs(5), || matches!(
                open(&mut *a, &key),
                Response::RepairOpened { .. }
            )),
            "{what}: the ended session's window stays open"
        );
        let s = stats(&mut watcher);
        assert_eq!(s.reserved_bytes, 0, "{what}: {s:?}");
    }
    let s = stats(&mut watcher);
    assert_eq!(s.entries, 6, "{s:?}");
}

/// A checkpoint of some homes' rows: refused among 0 units or for a home
/// past them (the connection kept), kept to its root like a Checkpoint,
/// and written with only the rows of its homes (their bytes alone).
#[test]
fn a_checkpoint_of_some_homes_checks_them_and_keeps_only_their_rows() {
    let ckpt = tempfile::tempdir().unwrap();
    let root = ckpt.path().display().to_string();
    let (p, _) = plane(1, 16 * MIB, &["--checkpoint-root", &root]);
    let mut r = Raw::hello(&p.units[0].uds, "ns");
    // Rows 0..4 in one blob, 4 bytes each: homes 0, 1, 0, 1 of 2 units.
    let entries = (0..4u64)
        .map(|row| EntrySpec {
            key: Key::new(row, "x"),
            offset: 4 * row,
            len: 4,
            meta: vec![],
        })
        .collect();
    let put = Request::Put {
        blob: BlobId(7),
        partition: "p".into(),
        entries,
        timeout_ms: 10_000,
    };
    assert_eq!(call_raw(&mut r, &put, &[7; 16]), Response::Done);
    let homes = |dir: &str, units, homes: &[u32]| Request::CheckpointHomes {
        dir: dir.into(),
        units,
        homes: homes.to_vec(),
    };
    for (units, h) in [(0, &[][..]), (0, &[0][..]), (4, &[4][..]), (2, &[1, 2][..])] {
        let got = r.call(&homes("bad", units, h));
        assert!(
            is_error(&got, ErrorCode::InvalidRequest),
            "{units} units, homes {h:?}: {got:?}"
        );
    }
    assert!(!ckpt.path().join("bad").exists());
    // Outside the root: refused as a Checkpoint is.
    let got = r.call(&homes("/tmp/elsewhere", 2, &[0]));
    assert!(is_error(&got, ErrorCode::Unauthorized), "{got:?}");
    // Home 1 of 2: rows 1 and 3, their 8 bytes (row 3's at 12 % 64 after
    // row 1's 4 at 4 % 64: 16 bytes written).
    let Response::Checkpointed(info) = r.call(&homes("odd", 2, &[1])) else {
        panic!("no checkpoint");
    };
    assert_eq!(
        (info.rows, info.entries, info.bytes),
        (2, 2, 16),
        "{info:?}"
    );
    assert_eq!(info.stored, "odd");
    // No home: an empty part, written all the same.
    let Response::Checkpointed(info) = r.call(&homes("none", 2, &[])) else {
        panic!("no checkpoint");
    };
    assert_eq!((info.rows, info.entries, info.bytes), (0, 0, 0), "{info:?}");
    assert!(ckpt.path().join("none/MANIFEST").exists());
    // Every home: what a Checkpoint writes.
    let Response::Checkpointed(all) = r.call(&homes("all", 2, &[0, 1])) else {
        panic!("no checkpoint");
    };
    let Response::Checkpointed(plain) = r.call(&Request::Checkpoint {
        dir: "plain".into(),
    }) else {
        panic!("no checkpoint");
    };
    assert_eq!((all.rows, all.entries, all.bytes), (4, 4, 16), "{all:?}");
    assert_eq!(
        (all.rows, all.entries, all.bytes, all.files.len()),
        (plain.rows, plain.entries, plain.bytes, plain.files.len())
    );
}
