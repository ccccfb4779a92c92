//! Forwarded puts (docs/replication.md#forwarding), with real unit
//! processes: a client that reaches every copy over tcp sends a put's
//! bytes once, to the first copy's unit, which streams them on to the
//! other copy as they arrive; a copy whose forward fails (its unit killed,
//! paused) is written by the client, or the put fails within its deadline,
//! and no copy ever holds other bytes than the put's.

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
    for &r in &rows {
        put_row(&c, r, &data(r), c.deadline()).unwrap();
    }
    let committed: u64 = (0..3)
        .map(|u| metric_with(&p, u, "stowage_forwarded_copies", "committed"))
        .sum();
    let failed: u64 = (0..3)
        .map(|u| metric_with(&p, u, "stowage_forwarded_copies", "failed"))
        .sum();
    let bytes: u64 = (0..3)
        .map(|u| metric(&p, u, "stowage_forwarded_bytes"))
        .sum();
    assert_eq!(committed, rows.len() as u64, "one forward per put");
    assert_eq!(failed, 0);
    // Each put's blob is its value (and its metadata, padded): at least
    // the value's bytes went on, and not twice.
    let values: u64 = rows.iter().map(|&r| data(r).len() as u64).sum();
    assert!(
        bytes >= values && bytes < 2 * values,
        "{bytes} bytes forwarded for {values} bytes of values"
    );
    copies_hold(&p, &c, &[0, 1, 2], &rows, &data);

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
    // Rows whose first copy is unit 0 and second unit 1.
    let rows: Vec<u64> = (0..30)
        .filter(|&r| c.copies_of(c.unit_of_row(r)).as_slice() == [0, 1])
        .collect();
    assert!(!rows.is_empty());
    p.kill9(1);
    for &r in &rows {
        put_row(&c, r, &data(r), c.deadline()).unwrap();
    }
    assert!(
        metric_with(&p, 0, "stowage_forwarded_copies", "failed") > 0,
        "unit 0 never met the killed unit"
    );
    assert_eq!(
        c.copies_of(0).as_slice(),
        [0, 2],
        "unit 1 was not found gone"
    );
    copies_hold(&p, &c, &[0, 2], &rows, &data);
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
    let row = (0..30)
        .find(|&r| c.copies_of(c.unit_of_row(r)).as_slice() == [0, 1])
        .unwrap();
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
    let clean = eventually(Duration::from_secs(15), || {
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
    let row = (0..30)
        .find(|&r| c.copies_of(c.unit_of_row(r)).as_slice() == [0, 1])
        .unwrap();
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
    let clean = eventually(Duration::from_secs(20), || {
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

/// With 3 copies the bytes go down a chain: the first copy's unit
/// forwards them to the second's, which forwards them to the third's
/// (each counts one forward per put; the third none), and all three hold
/// them.
#[test]
fn three_copies_go_down_a_chain_each_unit_forwarding_once() {
    let (p, _) = plane(4, 64 * MIB, &[]);
    let data = |row: u64| pattern(row, 19, 200_000);
    let c = tcp_client_of(&p, 3, true, Duration::from_secs(10));
    let rows: Vec<u64> = (0..40)
        .filter(|&r| c.copies_of(c.unit_of_row(r)).as_slice() == [0, 1, 2])
        .collect();
    assert!(!rows.is_empty());
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
    let rows: Vec<u64> = (0..40)
        .filter(|&r| c.copies_of(c.unit_of_row(r)).as_slice() == [0, 1, 2])
        .collect();
    assert!(!rows.is_empty());
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
