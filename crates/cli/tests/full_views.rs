//! Full means full (issue 37): memory that views of cleared or replaced
//! values hold counts as used. A put that does not fit is answered
//! `UnitFull` at once — not Busy until its deadline — and the error names
//! the views (and says so when they are the caller's own); with
//! `wait_for_memory` the put waits, and goes in once the views are
//! dropped. Real processes: a unit, a viewer child (this binary re-run as
//! `viewer_child`), and the test as the writer.
//!
//! A put under way that commits keeps its memory: a refused put is Busy
//! only for the puts under way at its first refusal, and one that began
//! since counts as used (`a_put_is_busy_only_for_the_puts_under_way_at_its_first_refusal`:
//! a writer child, and the test as a raw client).
//!
//! Cost: one 64 MiB unit and one child per test, about 1 s each.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::memory::{value_of, wait_for_stdin_to_close, Helper};
use common::*;
use stowage_client::{Client, ClientConfig, Column, DType, Error, RowKey, Tensor, UnitAddr};
use stowage_wire::{BlobId, EntrySpec, Key, Request, Response};

const MIB: usize = 1 << 20;
const LEN: usize = 30 * MIB;

fn column(v: &[u8]) -> Column<'_> {
    Column::Dense(Tensor::new(DType::U8, vec![1, v.len() as u64], v).unwrap())
}

fn put(c: &Client, row: u64, v: &[u8]) -> Result<(), Error> {
    c.put(
        "p",
        &[RowKey::Index(row)],
        &[("v", column(v))],
        None,
        c.deadline(),
    )
}

/// A client of the unit at `addr` (the plane's secret: `secret`, or in a
/// helper child from its environment).
fn connect(
    addr: UnitAddr,
    secret: Option<stowage_wire::auth::Secret>,
    wait_for_memory: Option<Duration>,
) -> Client {
    let mut cfg = ClientConfig::new("full", vec![addr]);
    cfg.secret = secret.or_else(child_secret);
    cfg.timeout = Duration::from_secs(20);
    // Spares off: the slab holds nothing of a client but its data.
    cfg.spare_max = 0;
    cfg.wait_for_memory = wait_for_memory;
    Client::connect(cfg).expect("client connects")
}

/// Not a test on its own: the viewer (`STOWAGE_VIEWER=addr`). Puts 30 MiB
/// into row 0 and views it, replaces it (another 30 MiB) and views that
/// too, clears the row: its views keep 60 MiB of the unit's 64. Puts
/// 30 MiB itself (the first stall case: `OWN <error>`), prints
/// `VIEWING`; once stdin closes drops the views and prints `DROPPED`.
#[test]
#[ignore = "a helper process of the full-views tests"]
fn viewer_child() {
    let addr = std::env::var("STOWAGE_VIEWER").expect("run only by the full-views tests");
    let c = Arc::new(connect(addr.parse().unwrap(), None, None));
    let v = value_of(1, LEN);
    let view = || {
        c.view("p", &[RowKey::Index(0)], &["v"], None, c.deadline())
            .unwrap()
    };
    put(&c, 0, &v).unwrap();
    let replaced = view();
    put(&c, 0, &v).unwrap();
    let cleared = view();
    assert_eq!(c.clear("p", &[RowKey::Index(0)], None, c.deadline()), Ok(1));
    match put(&c, 1, &v) {
        Err(e @ Error::UnitFull { .. }) => println!("OWN {e}"),
        other => println!("OWN unexpected {other:?}"),
    }
    println!("VIEWING");
    wait_for_stdin_to_close(Duration::from_secs(120));
    drop((replaced, cleared));
    println!("DROPPED");
}

#[test]
fn a_put_short_of_memory_that_views_hold_is_full_at_once_and_waits_only_when_asked() {
    let (p, _) = plane(1, 64 * MIB as u64, &[]);
    let addr = p.uds_addrs().remove(0);
    let mut viewer = Helper::start(&p, "viewer_child", ("STOWAGE_VIEWER", &addr.to_string()));
    // The viewer's own put: UnitFull, naming its own views.
    let own = viewer.expect_line("OWN", Duration::from_secs(60));
    assert!(
        own.contains("is full") && own.contains("this client's own views"),
        "the viewer's own put: {own}"
    );
    viewer.expect_line("VIEWING", Duration::from_secs(60));

    // Another process's put: UnitFull (not Busy until its deadline), the
    // views named, not as its own.
    let writer = connect(addr.clone(), p.secret().cloned(), None);
    let v = value_of(2, LEN);
    match put(&writer, 2, &v) {
        Err(Error::UnitFull { message, .. }) => assert!(
            message.contains("bytes by views of cleared or replaced values")
                && !message.contains("own views"),
            "{message}"
        ),
        other => panic!("a put while views hold the memory: {other:?}"),
    }

    // With wait_for_memory: the put waits while the view is held…
    let waiting = connect(addr, p.secret().cloned(), Some(Duration::from_secs(20)));
    let (tx, rx) = std::sync::mpsc::channel();
    let writer = std::thread::spawn(move || {
        let r = put(&waiting, 2, &v);
        let _ = tx.send(r);
    });
    assert!(
        matches!(
            rx.recv_timeout(Duration::from_millis(500)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout)
        ),
        "the put went in (or failed) while the view held the memory"
    );
    // …and goes in once it is dropped.
    drop(viewer.child.stdin.take());
    viewer.expect_line("DROPPED", Duration::from_secs(60));
    let r = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the waiting put answers");
    assert_eq!(r, Ok(()), "the waiting put, once the view was dropped");
    writer.join().unwrap();
}

/// Not a test on its own: a writer (`STOWAGE_WRITER=addr`) that puts 24 MiB
/// into row 9 (a 20 s deadline) and prints `RESULT <outcome>`.
#[test]
#[ignore = "a helper process of the full-views tests"]
fn writer_child() {
    let addr = std::env::var("STOWAGE_WRITER").expect("run only by the full-views tests");
    let c = connect(addr.parse().unwrap(), None, None);
    match put(&c, 9, &value_of(3, 24 * MIB)) {
        Ok(()) => println!("RESULT ok"),
        Err(e) => println!("RESULT {e:?}"),
    }
}

/// Reserve `nbytes` for `blob` on the raw connection `r`.
fn reserve(r: &mut Raw, blob: u128, nbytes: usize) {
    let resp = r.call(&Request::Alloc {
        blob: BlobId(blob),
        nbytes: nbytes as u64,
        n_entries: 1,
    });
    assert!(matches!(resp, Response::Allocated { .. }), "{resp:?}");
}

/// Commit `blob` as row `row` of partition "p" (its whole `nbytes`).
fn commit(r: &mut Raw, blob: u128, row: u64, nbytes: usize) {
    let resp = r.call(&Request::Commit {
        blob: BlobId(blob),
        partition: "p".into(),
        entries: vec![EntrySpec {
            key: Key::new(row, "v"),
            offset: 0,
            len: nbytes as u64,
            meta: vec![],
        }],
    });
    assert_eq!(resp, Response::Done);
}

/// Issue 37, the churn case: on a unit that other writers keep nearly
/// full, a put that did not fit was answered Busy for as long as some
/// other put was under way (its reservation counted as memory about to
/// come back, though a commit keeps it), so it waited until its deadline.
/// Here a writer child's put of 24 MiB finds 16 MiB free and a put of
/// 16 MiB under way (Busy); while the writer is stopped, that put commits,
/// a row is cleared and a new put takes the room (32 MiB); the writer,
/// resumed, is answered UnitFull, naming the reservation (with every
/// reservation counted: Busy until its deadline, then Timeout).
#[test]
fn a_put_is_busy_only_for_the_puts_under_way_at_its_first_refusal() {
    let (p, _) = plane(1, 64 * MIB as u64, &[]);
    let sock = p.units[0].uds.clone();
    let mut other = Raw::hello(&sock, "full");
    reserve(&mut other, 1, 32 * MIB);
    commit(&mut other, 1, 0, 32 * MIB);
    reserve(&mut other, 2, 16 * MIB);
    let busy_before = stats(&mut other).busy;
    let addr = p.uds_addrs().remove(0);
    let writer = Helper::start(&p, "writer_child", ("STOWAGE_WRITER", &addr.to_string()));
    assert!(
        eventually(Duration::from_secs(60), || stats(&mut other).busy
            > busy_before),
        "the writer's put was never answered Busy"
    );
    // Stopped, and every ask it sent answered (the unit's Busy count
    // stands still).
    writer.pause();
    let mut last = stats(&mut other).busy;
    assert!(
        eventually(Duration::from_secs(30), || {
            std::thread::sleep(Duration::from_millis(200));
            let now = stats(&mut other).busy;
            std::mem::replace(&mut last, now) == now
        }),
        "the unit kept answering Busy while the writer was stopped"
    );
    // The put under way commits (its memory stays used), row 0 is
    // cleared, and a new put takes the 32 MiB.
    commit(&mut other, 2, 1, 16 * MIB);
    let cleared = other.call(&Request::ClearRows {
        partition: "p".into(),
        rows: vec![0],
    });
    assert!(matches!(cleared, Response::Cleared { .. }), "{cleared:?}");
    reserve(&mut other, 3, 32 * MIB);
    writer.signal("-CONT");
    let r = writer.expect_line("RESULT", Duration::from_secs(60));
    assert!(
        r.contains("UnitFull") && r.contains("in reservations of puts under way"),
        "the writer's put once the put under way at its first refusal committed: {r}"
    );
}
