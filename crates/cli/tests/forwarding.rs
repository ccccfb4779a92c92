//! Forwarded puts (docs/replication.md#forwarding), with real unit
//! processes: a client that reaches every copy over tcp sends a put's
//! bytes once, to the first copy's unit, which streams them on to the
//! other copy as they arrive; over shm the client writes the first copy's
//! slab, and that unit copies the bytes into the other copies' slabs. A
//! copy whose forward fails (its unit killed, paused) is written by the
//! client, or the put fails within its deadline, and no copy ever holds
//! other bytes than the put's.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::*;
use stowage_client::{Client, ClientConfig, Column, DType, RowKey, Tensor};
use stowage_local::LocalPlane;

const MIB: u64 = 1 << 20;

/// A tcp client of `p` keeping 2 copies; `forward` as configured.
fn tcp_client(p: &LocalPlane, forward: bool, timeout: Duration) -> Client {
    tcp_client_of(p, 2, forward, timeout)
}

/// A tcp client of `p` keeping `replicas` copies.
fn tcp_client_of(p: &LocalPlane, replicas: usize, forward: bool, timeout: Duration) -> Client {
    let mut cfg = ClientConfig::new("test", p.tcp_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = timeout;
    cfg.replicas = replicas;
    cfg.forward = forward;
    Client::connect(cfg).unwrap()
}

fn forwarded(p: &LocalPlane, u: usize, outcome: &str) -> u64 {
    metric_with(p, u, "stowage_forwarded_copies", outcome)
}

/// An shm client of `p` keeping 2 copies; `forward` as configured.
fn shm_client(p: &LocalPlane, forward: bool, timeout: Duration) -> Client {
    let mut cfg = ClientConfig::new("test", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = timeout;
    cfg.replicas = 2;
    cfg.forward = forward;
    Client::connect(cfg).unwrap()
}

/// A client of unit `u` of `p` alone (one copy, over its Unix socket):
/// what that unit holds.
fn unit_alone(p: &LocalPlane, u: usize) -> Client {
    let mut cfg = ClientConfig::new("test", vec![p.uds_addrs()[u].clone()]);
    cfg.secret = p.secret().cloned();
    Client::connect(cfg).unwrap()
}

fn put_row(c: &Client, row: u64, data: &[u8], deadline: Instant) -> stowage_client::Result<()> {
    let t = Tensor {
        dtype: DType::U8,
        shape: vec![data.len() as u64],
        data,
    };
    c.put(
        "p",
        &[RowKey::Index(row)],
        &[("x", Column::Jagged(vec![t]))],
        None,
        deadline,
    )
}

/// Each live unit's rows of partition `p` and their bytes, read from
/// that unit alone.
fn held(p: &LocalPlane, live: &[usize]) -> BTreeMap<u64, BTreeMap<usize, Vec<u8>>> {
    let mut out: BTreeMap<u64, BTreeMap<usize, Vec<u8>>> = BTreeMap::new();
    for &u in live {
        let one = unit_alone(p, u);
        for (key, _) in one.list("p", one.deadline()).unwrap() {
            let RowKey::Index(row) = key else {
                panic!("unit {u}: a named row {key:?}")
            };
            let got = one
                .get_tensors("p", &[key], &["x"], None, one.deadline())
                .unwrap();
            out.entry(row)
                .or_default()
                .insert(u, got[0][0].data.clone());
        }
    }
    out
}

/// The rows below `below` whose copies are on `units`, in that order
/// (at least one).
fn rows_with_copies(c: &Client, units: &[usize], below: u64) -> Vec<u64> {
    let rows: Vec<u64> = (0..below)
        .filter(|&r| c.copies_of(c.unit_of_row(r)).as_slice() == units)
        .collect();
    assert!(
        !rows.is_empty(),
        "no row below {below} has copies on {units:?}"
    );
    rows
}

/// Within `within`, no unit `c` reaches holds a reservation other than
/// its clients' spares.
fn no_reservation_outlives_the_puts(c: &Client, within: Duration) {
    let clean = eventually(within, || {
        c.stats(c.deadline())
            .iter()
            .all(|s| s.as_ref().is_ok_and(|s| s.reserved_bytes == s.spare_bytes))
    });
    assert!(
        clean,
        "a reservation outlived the puts: {:?}",
        c.stats(c.deadline())
    );
}

/// Every row of `rows` is on exactly the units of its copies, with the
/// bytes `data(row)` on each.
fn copies_hold(
    p: &LocalPlane,
    c: &Client,
    live: &[usize],
    rows: &[u64],
    data: &dyn Fn(u64) -> Vec<u8>,
) {
    let held = held(p, live);
    for &row in rows {
        let want: BTreeSet<usize> = c.copies_of(c.unit_of_row(row)).into_iter().collect();
        let on = held
            .get(&row)
            .unwrap_or_else(|| panic!("row {row} is on no unit"));
        let got: BTreeSet<usize> = on.keys().copied().collect();
        assert_eq!(got, want, "row {row}: on units {got:?}");
        for (u, bytes) in on {
            assert!(*bytes == data(row), "row {row}: other bytes on unit {u}");
        }
    }
}

/// `c` (2 copies, forwarding on) puts `rows` of 3-unit plane `p`: each
/// put's second copy is forwarded exactly once (counted committed on the
/// unit that made it, none failed), the bytes forwarded are the blobs'
/// (each a value, its metadata and padding: at least the value, never
/// twice), and every copy holds the put's bytes. The forwards counted.
fn every_put_forwarded_once(
    p: &LocalPlane,
    c: &Client,
    rows: &[u64],
    data: &dyn Fn(u64) -> Vec<u8>,
) -> u64 {
    for &r in rows {
        put_row(c, r, &data(r), c.deadline()).unwrap();
    }
    let committed: u64 = (0..3).map(|u| forwarded(p, u, "committed")).sum();
    let failed: u64 = (0..3).map(|u| forwarded(p, u, "failed")).sum();
    let bytes: u64 = (0..3)
        .map(|u| metric(p, u, "stowage_forwarded_bytes"))
        .sum();
    assert_eq!(committed, rows.len() as u64, "one forward per put");
    assert_eq!(failed, 0);
    let values: u64 = rows.iter().map(|&r| data(r).len() as u64).sum();
    assert!(
        bytes >= values && bytes < 2 * values,
        "{bytes} bytes forwarded for {values} bytes of values"
    );
    copies_hold(p, c, &[0, 1, 2], rows, data);
    committed
}

/// Puts over tcp with 2 copies go to one unit each, which forwards the
/// other copy: every forward is counted committed on the unit that made
/// it, the bytes forwarded are the bytes put, and both copies hold them.
/// With forwarding off, no unit forwards and the copies are the same.
#[test]
fn a_put_over_tcp_is_sent_once_and_its_first_copy_forwards_the_other() {
    let (p, _) = plane(3, 64 * MIB, &[]);
    let rows: Vec<u64> = (0..12).collect();
    let data = |row: u64| pattern(row, 7, 100_000 + row as usize * 4099);
    let c = tcp_client(&p, true, Duration::from_secs(10));
    let committed = every_put_forwarded_once(&p, &c, &rows, &data);

    // Forwarding off: the client writes both copies; nothing more is
    // forwarded, and the copies are the same.
    let off = tcp_client(&p, false, Duration::from_secs(10));
    let more: Vec<u64> = (100..106).collect();
    for &r in &more {
        put_row(&off, r, &data(r), off.deadline()).unwrap();
    }
    let after: u64 = (0..3)
        .map(|u| metric_with(&p, u, "stowage_forwarded_copies", "committed"))
        .sum();
    assert_eq!(
        after, committed,
        "a client with forwarding off had a put forwarded"
    );
    copies_hold(&p, &c, &[0, 1, 2], &more, &data);
}

/// The unit of a put's second copy is killed (SIGKILL): the first copy's
/// forward to it fails, the client then finds the unit gone, places the
/// copies anew and puts again; every put is acknowledged, and every row is
/// on the units of its copies now, with its bytes.
#[test]
fn a_forward_to_a_killed_unit_fails_and_the_put_goes_to_the_copies_left() {
    let (mut p, _) = plane(3, 64 * MIB, &[]);
    let data = |row: u64| pattern(row, 11, 300_000);
    let c = tcp_client(&p, true, Duration::from_secs(10));
    forward_to_a_killed_unit(&mut p, &c, &data);
}

/// Unit 1 of `p` (3 units) is killed after `c` put a row with copies on
/// units 0 and 1 (the forwarding unit keeps its connection): unit 0's
/// forwards to it fail, the client finds it gone and puts again where
/// the copies are now; every row is then on the units of its copies.
fn forward_to_a_killed_unit(p: &mut LocalPlane, c: &Client, data: &dyn Fn(u64) -> Vec<u8>) {
    // Rows whose first copy is unit 0 and second unit 1.
    let rows: Vec<u64> = rows_with_copies(c, &[0, 1], 30);
    put_row(c, rows[0], &data(rows[0]), c.deadline()).unwrap();
    p.kill9(1);
    for &r in &rows {
        put_row(c, r, &data(r), c.deadline()).unwrap();
    }
    assert!(
        forwarded(p, 0, "failed") > 0,
        "unit 0 never met the killed unit"
    );
    assert_eq!(
        c.copies_of(0).as_slice(),
        [0, 2],
        "unit 1 was not found gone"
    );
    copies_hold(p, c, &[0, 2], &rows, data);
}

/// The unit of a put's second copy is paused (SIGSTOP) past the put's
/// deadline: the put fails within it (a typed error, never acknowledged),
/// and the unit forwarding gives up its connection. Continued, the unit
/// takes the put again, and both copies hold exactly its bytes; no
/// reservation outlives the puts on any unit.
#[test]
fn a_paused_copy_unit_fails_the_put_in_its_deadline_and_holds_nothing_wrong() {
    let (p, _) = plane(3, 64 * MIB, &[]);
    let data = |row: u64| pattern(row, 13, 4 << 20);
    let c = tcp_client(&p, true, Duration::from_secs(2));
    let row = rows_with_copies(&c, &[0, 1], 30)[0];
    let victim = &p.units[1];
    victim.signal(rustix::process::Signal::STOP).unwrap();
    assert!(eventually(Duration::from_secs(5), || is_stopped(
        victim.pid()
    )));
    let started = Instant::now();
    let r = put_row(&c, row, &data(row), Instant::now() + Duration::from_secs(2));
    let took = started.elapsed();
    victim.signal(rustix::process::Signal::CONT).unwrap();
    assert!(
        r.is_err(),
        "a put acknowledged while a copy's unit was paused"
    );
    assert!(took < Duration::from_secs(5), "the put took {took:?}");
    // Continued: the put goes in, on both copies, with its bytes.
    let c = tcp_client(&p, true, Duration::from_secs(10));
    put_row(&c, row, &data(row), c.deadline()).unwrap();
    copies_hold(&p, &c, &[0, 1, 2], &[row], &data);
    // What the failed put reserved on either unit is given back.
    no_reservation_outlives_the_puts(&c, Duration::from_secs(15));
}

/// The unit forwarding a put (its first copy) is paused mid-payload past
/// the put's deadline: the put ends within its deadline, and if it was
/// acknowledged (the unit answered before it stopped) both copies hold its
/// bytes; continued, no reservation outlives the put on either unit, and
/// a new put of the row goes in with exactly its bytes on both copies.
#[test]
fn a_forwarding_unit_paused_mid_put_leaves_nothing_reserved_or_wrong() {
    let (p, _) = plane(3, 256 * MIB, &[]);
    let data = |row: u64| pattern(row, 17, 96 << 20);
    let c = tcp_client(&p, true, Duration::from_secs(3));
    let row = rows_with_copies(&c, &[0, 1], 30)[0];
    let bytes = data(row);
    let forwarder = p.units[0].pid();
    let (r, took) = std::thread::scope(|s| {
        let put = s.spawn(|| {
            let started = Instant::now();
            let r = put_row(&c, row, &bytes, Instant::now() + Duration::from_secs(3));
            (r, started.elapsed())
        });
        // Once the forward is under way (unit 1 reserved its copy).
        let one = unit_alone(&p, 1);
        eventually(Duration::from_secs(3), || {
            one.stats(one.deadline())[0]
                .as_ref()
                .is_ok_and(|s| s.reserved_bytes > s.spare_bytes)
        });
        p.units[0].signal(rustix::process::Signal::STOP).unwrap();
        assert!(eventually(Duration::from_secs(5), || is_stopped(forwarder)));
        let ended = put.join().unwrap();
        std::thread::sleep(Duration::from_millis(500));
        p.units[0].signal(rustix::process::Signal::CONT).unwrap();
        ended
    });
    eprintln!(
        "the put: {:?} in {took:?}",
        r.as_ref().map_err(ToString::to_string)
    );
    assert!(took < Duration::from_secs(6), "the put took {took:?}");
    let c = tcp_client(&p, true, Duration::from_secs(20));
    if r.is_ok() {
        copies_hold(&p, &c, &[0, 1, 2], &[row], &data);
    }
    put_row(&c, row, &bytes, c.deadline()).unwrap();
    copies_hold(&p, &c, &[0, 1, 2], &[row], &data);
    no_reservation_outlives_the_puts(&c, Duration::from_secs(20));
}

/// With 3 copies the bytes go down a chain: the first copy's unit
/// forwards them to the second's, which forwards them to the third's
/// (each counts one forward per put; the third none), and all three hold
/// them.
#[test]
fn three_copies_go_down_a_chain_each_unit_forwarding_once() {
    let (p, _) = plane(4, 64 * MIB, &[]);
    let data = |row: u64| pattern(row, 19, 200_000);
    let c = tcp_client_of(&p, 3, true, Duration::from_secs(10));
    let rows: Vec<u64> = rows_with_copies(&c, &[0, 1, 2], 40);
    for &r in &rows {
        put_row(&c, r, &data(r), c.deadline()).unwrap();
    }
    let n = rows.len() as u64;
    assert_eq!(
        forwarded(&p, 0, "committed"),
        n,
        "unit 0 forwards once per put"
    );
    assert_eq!(
        forwarded(&p, 1, "committed"),
        n,
        "unit 1 forwards once per put"
    );
    assert_eq!(
        forwarded(&p, 2, "committed"),
        0,
        "the chain's last unit forwards nothing"
    );
    copies_hold(&p, &c, &[0, 1, 2, 3], &rows, &data);
}

/// The middle unit of a 3-copy chain is killed: the first copy's unit
/// names it and the copy after it failed, the client finds it gone,
/// places the copies anew and puts again; every row is on the units of
/// its copies now, with its bytes.
#[test]
fn a_chain_whose_middle_unit_is_killed_puts_again_where_the_copies_are_now() {
    let (mut p, _) = plane(4, 64 * MIB, &[]);
    let data = |row: u64| pattern(row, 23, 150_000);
    let c = tcp_client_of(&p, 3, true, Duration::from_secs(10));
    let rows: Vec<u64> = rows_with_copies(&c, &[0, 1, 2], 40);
    p.kill9(1);
    for &r in &rows {
        put_row(&c, r, &data(r), c.deadline()).unwrap();
    }
    assert!(
        forwarded(&p, 0, "failed") > 0,
        "unit 0 never met the killed unit"
    );
    assert_eq!(c.copies_of(0).as_slice(), [0, 2, 3]);
    copies_hold(&p, &c, &[0, 2, 3], &rows, &data);
}

/// The client's directory names another instance for unit 1 than the one
/// at its address (a unit restarted there): the copy forwarded to it is
/// failed by the unit forwarding (it checks the instance, as the client's
/// own put would), the client's own put of it finds the unit restarted,
/// takes it as down and the put goes to the next unit. Every row is on
/// units 0 and 2, with its bytes. (Without the check, every put was
/// acknowledged with its second copy on the other instance, which no
/// other client reads, and the client never took unit 1 as down.)
#[test]
fn a_forward_to_another_instance_than_the_client_knows_is_failed_and_goes_around_it() {
    let (p, _) = plane(4, 16 * MIB, &[]);
    let mut cfg = ClientConfig::new("test", p.tcp_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(10);
    cfg.replicas = 2;
    cfg.instances = p
        .units
        .iter()
        .enumerate()
        .map(|(i, u)| {
            Some(if i == 1 {
                u.instance ^ 0xdead
            } else {
                u.instance
            })
        })
        .collect();
    let c = Client::connect(cfg).unwrap();
    let rows: Vec<u64> = rows_with_copies(&c, &[0, 1], 40);
    let data = |row: u64| pattern(row, 29, 10_000);
    for &r in &rows {
        put_row(&c, r, &data(r), c.deadline()).unwrap();
    }
    assert!(
        forwarded(&p, 0, "failed") > 0,
        "no forward met the other instance"
    );
    assert_eq!(
        c.copies_of(0).as_slice(),
        [0, 2],
        "unit 1 was not taken as down"
    );
    // At most the copy of the put that found the restart (the client's
    // own put of it, as without forwarding), which no client reads.
    let other = unit_alone(&p, 1);
    let strays = other.stats(other.deadline())[0].as_ref().unwrap().rows;
    assert!(strays <= 1, "{strays} copies went to the other instance");
    let held = held(&p, &[0, 2, 3]);
    for &row in &rows {
        let on: BTreeSet<usize> = held[&row].keys().copied().collect();
        assert_eq!(on, BTreeSet::from([0, 2]), "row {row}");
        assert!(held[&row].values().all(|b| *b == data(row)), "row {row}");
    }
}

/// Two units with one blocking thread each (`--io-threads=1`) forward to
/// each other at once: 8 clients put rows whose first copies are on
/// either unit. Every put goes in (a forward runs on a pool of its own
/// place in the chain: on the one pool, each unit's forwards waited on
/// the other's until every put's deadline).
#[test]
fn units_forwarding_to_each_other_with_one_io_thread_never_wait_on_each_other() {
    let (p, _) = plane(2, 512 * MIB, &["--io-threads=1"]);
    let probe = tcp_client(&p, true, Duration::from_secs(5));
    let first_on = |u: usize| -> Vec<u64> {
        (0..200)
            .filter(|&r| probe.copies_of(probe.unit_of_row(r))[0] == u)
            .take(4)
            .collect()
    };
    let rows: Vec<u64> = first_on(0).into_iter().chain(first_on(1)).collect();
    let data = vec![7u8; 4 << 20];
    let failed = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for &r in &rows {
            let c = tcp_client(&p, true, Duration::from_secs(5));
            let (data, failed) = (&data, &failed);
            s.spawn(move || {
                for _ in 0..5 {
                    if let Err(e) = put_row(&c, r, data, c.deadline()) {
                        eprintln!("row {r}: {e}");
                        failed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                }
            });
        }
    });
    assert_eq!(failed.load(std::sync::atomic::Ordering::SeqCst), 0);
    let forwards: u64 = (0..2).map(|u| forwarded(&p, u, "committed")).sum();
    assert_eq!(forwards, rows.len() as u64 * 5, "every put was forwarded");
}

/// The second copy's unit is full (another client filled it): it refuses
/// the forwarded copy, the client's own put of that copy is refused too,
/// and the put fails `UnitFull`: never acknowledged with one copy.
#[test]
fn a_copy_refused_by_a_full_unit_fails_the_put() {
    let (p, _) = plane(3, 16 * MIB, &[]);
    let c = tcp_client(&p, true, Duration::from_secs(5));
    let row = rows_with_copies(&c, &[0, 1], 40)[0];
    // Unit 1 filled by a one-copy client, its rows named to it.
    let mut cfg = ClientConfig::new("filler", p.tcp_addrs());
    cfg.secret = p.secret().cloned();
    let filler = Client::connect(cfg).unwrap();
    let block = vec![1u8; 1 << 20];
    let mut filled = 0;
    for r in 1000.. {
        let t = Tensor {
            dtype: DType::U8,
            shape: vec![block.len() as u64],
            data: &block,
        };
        let put = filler.put(
            "p",
            &[RowKey::Index(r)],
            &[("x", Column::Jagged(vec![t]))],
            Some(1),
            filler.deadline(),
        );
        match put {
            Ok(()) => filled += 1,
            Err(stowage_client::Error::UnitFull { .. }) => break,
            Err(e) => panic!("{e}"),
        }
        assert!(filled < 64, "unit 1 never filled");
    }
    let r = put_row(&c, row, &pattern(row, 31, 2 << 20), c.deadline());
    assert!(
        matches!(r, Err(stowage_client::Error::UnitFull { unit: 1, .. })),
        "{r:?}"
    );
    assert!(forwarded(&p, 0, "failed") > 0, "unit 0 did not forward");
}

/// Units whose hosts the client knows: a put whose first copy's unit is
/// on the client's own host is not forwarded (its bytes would leave this
/// host all the same, one local hop later), and one whose first copy's
/// unit is on another host is.
#[test]
fn a_put_is_forwarded_only_from_a_unit_on_another_host() {
    let (p, _) = plane(3, 16 * MIB, &[]);
    let here = stowage_client::host_id();
    let mut cfg = ClientConfig::new("test", p.tcp_addrs());
    cfg.secret = p.secret().cloned();
    cfg.replicas = 2;
    // Unit 0 on this host, units 1 and 2 elsewhere (as a directory says).
    cfg.hosts = vec![Some(here), Some("host-b".into()), Some("host-c".into())];
    let c = Client::connect(cfg).unwrap();
    let data = |row: u64| pattern(row, 41, 30_000);
    let here_rows = rows_with_copies(&c, &[0, 1], 30);
    let there_rows = rows_with_copies(&c, &[1, 2], 30);
    for &r in here_rows.iter().chain(&there_rows) {
        put_row(&c, r, &data(r), c.deadline()).unwrap();
    }
    assert_eq!(
        forwarded(&p, 0, "committed"),
        0,
        "unit 0 is on the client's host"
    );
    assert_eq!(forwarded(&p, 1, "committed"), there_rows.len() as u64);
    copies_hold(&p, &c, &[0, 1, 2], &here_rows, &data);
    copies_hold(&p, &c, &[0, 1, 2], &there_rows, &data);
}

/// More copies than a chain holds (`MAX_HOPS` + 1 = 8): the client sends
/// every copy itself, and the put goes in.
#[test]
fn nine_copies_over_tcp_are_sent_by_the_client() {
    let (p, _) = plane(9, 16 * MIB, &[]);
    let c = tcp_client_of(&p, 9, true, Duration::from_secs(10));
    let data = |row: u64| pattern(row, 37, 50_000);
    put_row(&c, 1, &data(1), c.deadline()).unwrap();
    let all: Vec<usize> = (0..9).collect();
    copies_hold(&p, &c, &all, &[1], &data);
}

/// A unit without a shared secret forwards nothing (a client could
/// otherwise make it connect anywhere): a ForwardPut it gets lands here,
/// its other copies are named failed for the client to write, and no
/// connection is made to the address named.
#[test]
fn a_unit_without_a_secret_forwards_nothing_and_connects_nowhere() {
    use std::io::Write as _;
    use stowage_wire::{encode, EntrySpec, Hop, Key, Request, Response};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("unit.sock");
    let mut cfg = stowage_config::UnitConfig::new("insecure", 16 * MIB);
    cfg.mlock = false;
    cfg.metrics_listen = None;
    cfg.insecure = true;
    cfg.uds = Some(path.clone());
    let unit = stowage_unit::start(cfg).unwrap();
    let elsewhere = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    elsewhere.set_nonblocking(true).unwrap();
    let mut r = Raw::hello(&path, "ns");
    let value = vec![5u8; 4096];
    let req = Request::ForwardPut {
        blob: stowage_wire::BlobId(77),
        partition: "p".into(),
        entries: vec![EntrySpec {
            key: Key::new(3, "x"),
            offset: 0,
            len: value.len() as u64,
            meta: Vec::new(),
        }],
        timeout_ms: 5_000,
        to: vec![Hop {
            unit: 1,
            addr: elsewhere.local_addr().unwrap().to_string(),
            instance: None,
        }],
        hop: 0,
    };
    let mut frame = Vec::new();
    encode(9, &req, value.len() as u64, &mut frame).unwrap();
    frame.extend_from_slice(&value);
    r.s.write_all(&frame).unwrap();
    match r.recv().map(|e| e.body) {
        Some(Response::Forwarded {
            pending: false,
            failed,
        }) => {
            assert_eq!(failed.len(), 1, "{failed:?}");
            assert_eq!(failed[0].unit, 1);
            assert!(failed[0].message.contains("secret"), "{failed:?}");
        }
        other => panic!("{other:?}"),
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        elsewhere.accept().is_err(),
        "the unit connected to the address a client named"
    );
    unit.stop();
}

/// Puts over shm with 2 copies: the client writes the first copy's slab
/// only, and asks its unit to copy the bytes into the second copy's slab
/// (mapped over its Unix socket) before committing: every copy is counted
/// forwarded on the unit that made it, its bytes are the blob's, and both
/// copies hold the put's bytes. With forwarding off, the client writes
/// both copies and nothing more is forwarded.
#[test]
fn a_put_over_shm_is_written_once_and_its_first_copy_unit_copies_it_slab_to_slab() {
    let (p, _) = plane(3, 64 * MIB, &[]);
    let rows: Vec<u64> = (0..12).collect();
    // Small values and values past a spare's size, in one or more pieces.
    let data = |row: u64| pattern(row, 43, 1000 + (row % 12) as usize * 700_001);
    let c = shm_client(&p, true, Duration::from_secs(10));
    let committed = every_put_forwarded_once(&p, &c, &rows, &data);
    no_reservation_outlives_the_puts(&c, Duration::from_secs(5));

    let off = shm_client(&p, false, Duration::from_secs(10));
    let more: Vec<u64> = (100..106).collect();
    for &r in &more {
        put_row(&off, r, &data(r), off.deadline()).unwrap();
    }
    let after: u64 = (0..3).map(|u| forwarded(&p, u, "committed")).sum();
    assert_eq!(after, committed, "a put was copied with forwarding off");
    copies_hold(&p, &c, &[0, 1, 2], &more, &data);
}

/// Over shm, the unit of a put's second copy is killed: the first copy's
/// unit cannot copy there, the client finds the unit gone and puts again
/// where the copies are now; every put is acknowledged and every row is
/// on the units of its copies, with its bytes.
#[test]
fn a_copy_over_shm_to_a_killed_unit_fails_and_the_put_goes_to_the_copies_left() {
    let (mut p, _) = plane(3, 64 * MIB, &[]);
    let data = |row: u64| pattern(row, 47, 300_000);
    let c = shm_client(&p, true, Duration::from_secs(10));
    forward_to_a_killed_unit(&mut p, &c, &data);
}

/// Over shm, the unit copying a put into the next copy's slab is paused
/// (SIGSTOP) while it holds the reservation it copies into there, past
/// every lease: that unit keeps the range (no timer takes it; another
/// put never gets it), and once the copying unit is killed, the range is
/// given back. The put is never acknowledged with other bytes on a copy.
#[test]
fn a_unit_paused_mid_copy_over_shm_keeps_its_range_on_the_next_unit_until_it_ends() {
    // Two values never fit one slab at once.
    const VALUE: usize = 96 << 20;
    let (mut p, _) = plane(
        2,
        160 * MIB,
        &["--reservation-lease", "200ms", "--quarantine", "100ms"],
    );
    let data = |row: u64| pattern(row, 53, VALUE);
    let next = unit_alone(&p, 1);
    let reserved = |c: &Client| -> u64 {
        c.stats(c.deadline())[0]
            .as_ref()
            .map_or(0, |s| s.reserved_bytes - s.spare_bytes)
    };
    let mut caught = None;
    for attempt in 0..5 {
        let c = shm_client(&p, true, Duration::from_secs(5));
        let row = rows_with_copies(&c, &[0, 1], 30)[attempt];
        let bytes = data(row);
        let stopped = std::thread::scope(|s| {
            let put = s.spawn(|| put_row(&c, row, &bytes, c.deadline()));
            // Unit 1 holds unit 0's reservation while unit 0 copies.
            let end = Instant::now() + Duration::from_secs(5);
            while reserved(&next) < VALUE as u64 && Instant::now() < end && !put.is_finished() {}
            let mid = reserved(&next) >= VALUE as u64;
            if mid {
                p.units[0].signal(rustix::process::Signal::STOP).unwrap();
            }
            let mid = mid && eventually(Duration::from_secs(5), || is_stopped(p.units[0].pid()));
            // Stopped before unit 0 committed there: the range is held.
            let held = mid && reserved(&next) >= VALUE as u64;
            if mid && !held {
                p.units[0].signal(rustix::process::Signal::CONT).unwrap();
            }
            let r = put.join().unwrap();
            (held, r)
        });
        match stopped {
            (true, r) => {
                caught = Some((row, r));
                break;
            }
            (false, _) => {
                let c = shm_client(&p, true, Duration::from_secs(10));
                c.clear("p", &[RowKey::Index(row)], None, c.deadline())
                    .unwrap();
            }
        }
    }
    let (row, r) = caught.expect("never caught unit 0 mid-copy");
    assert!(
        r.is_err(),
        "a put acknowledged while its copy was under way"
    );
    // Past every lease and quarantine: still held, and another put to
    // unit 1 alone does not get the range (the slab holds one such value).
    std::thread::sleep(Duration::from_millis(800));
    assert!(
        reserved(&next) >= VALUE as u64,
        "the paused unit's range was taken"
    );
    let big = vec![9u8; VALUE];
    let t = Tensor {
        dtype: DType::U8,
        shape: vec![big.len() as u64],
        data: &big,
    };
    let other = next.put(
        "p",
        &[RowKey::Index(999)],
        &[("x", Column::Jagged(vec![t]))],
        None,
        Instant::now() + Duration::from_secs(3),
    );
    assert!(
        matches!(
            other,
            Err(stowage_client::Error::UnitFull { .. } | stowage_client::Error::Timeout { .. })
        ),
        "{other:?}"
    );
    // Killed: its connection ends, and unit 1 gives the range back.
    p.kill9(0);
    assert!(
        eventually(Duration::from_secs(10), || reserved(&next) == 0),
        "the killed unit's range on unit 1 was never given back"
    );
    let held = held(&p, &[1]);
    assert!(
        !held.contains_key(&row),
        "the unfinished copy was committed"
    );
}
