//! Full means full (issue 37): memory that views of cleared or replaced
//! values hold counts as used. A put that does not fit is answered
//! `UnitFull` at once — not Busy until its deadline — and the error names
//! the views (and says so when they are the caller's own); with
//! `wait_for_memory` the put waits, and goes in once the views are
//! dropped. Real processes: a unit, a viewer child (this binary re-run as
//! `viewer_child`), and the test as the writer.
//!
//! Cost: one 64 MiB unit, one child, about 1 s.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::memory::{value_of, wait_for_stdin_to_close, Helper};
use common::*;
use stowage_client::{Client, ClientConfig, Column, DType, Error, RowKey, Tensor, UnitAddr};

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
