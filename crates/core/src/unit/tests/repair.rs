//! Repair windows: what a repair put stores and skips, the clears a
//! window remembers, its caps, and who may use it.

use super::*;
use crate::unit::op::{
    ClearPartition, ClearRows, CloseRepair, OpenRepair, RepairAlloc, RepairCommit, Repaired,
};

const NS: &str = "ns\u{1f}";

fn part(p: &str) -> String {
    format!("{NS}{p}")
}

fn open(c: &mut UnitCore, o: Owner, key: &str) -> Result<u64, CoreError> {
    open_in(c, o, NS, key)
}

fn open_in(c: &mut UnitCore, o: Owner, scope: &str, key: &str) -> Result<u64, CoreError> {
    let op = OpenRepair {
        scope: scope.into(),
        key: key.into(),
    };
    c.handle(t(0), Request { owner: o, op })
}

fn close(c: &mut UnitCore, o: Owner, window: u64) -> Result<(), CoreError> {
    c.handle(
        t(0),
        Request {
            owner: o,
            op: CloseRepair { window },
        },
    )
}

/// A repair put of one 8-byte value per key of `keys` through `window`.
fn repair(
    c: &mut UnitCore,
    o: Owner,
    window: u64,
    partition: &str,
    blob: u128,
    keys: &[(u64, &str)],
) -> Result<Repaired, CoreError> {
    let entries: Vec<EntrySpec> = keys
        .iter()
        .enumerate()
        .map(|(i, (row, f))| entry(*row, f, 8 * i as u64, 8))
        .collect();
    let op = RepairAlloc {
        window,
        blob: BlobId(blob),
        nbytes: 8 * keys.len() as u64,
        n_entries: keys.len() as u32,
    };
    c.handle(t(0), Request { owner: o, op })?;
    let op = RepairCommit {
        window,
        partition: partition.into(),
        blob: BlobId(blob),
        entries,
    };
    c.handle(t(0), Request { owner: o, op })
}

fn put(c: &mut UnitCore, o: Owner, partition: &str, blob: u128, row: u64, field: &str) {
    c.alloc(o, BlobId(blob), 8, 1, t(0)).unwrap();
    let r = c.commit(o, partition, BlobId(blob), &[entry(row, field, 0, 8)]);
    assert_eq!(r, Ok(Committed::Done));
}

fn clear_rows(c: &mut UnitCore, o: Owner, partition: &str, rows: &[u64]) {
    let op = ClearRows {
        partition: partition.into(),
        rows: rows.to_vec(),
    };
    c.handle(t(0), Request { owner: o, op }).unwrap();
}

fn clear_partition(c: &mut UnitCore, o: Owner, partition: &str) {
    let op = ClearPartition {
        partition: partition.into(),
    };
    c.handle(t(0), Request { owner: o, op }).unwrap();
}

fn stored(n: u32, of: u32) -> Result<Repaired, CoreError> {
    Ok(Repaired {
        stored: n,
        skipped: of - n,
    })
}

fn has(c: &mut UnitCore, o: Owner, partition: &str, row: u64, field: &str) -> bool {
    let (pin, found) = c
        .resolve_places(o, partition, &[Key::new(row, field)], t(0))
        .unwrap();
    if let Some(p) = pin {
        c.unpin(o, p).unwrap();
    }
    found[0].is_some()
}

#[test]
fn stored_when_absent_skipped_when_present() {
    let mut c = core(1 << 20);
    let (a, r) = (own(&mut c), own(&mut c));
    let p = part("p");
    put(&mut c, a, &p, 1, 1, "x");
    let w = open(&mut c, r, "group 0").unwrap();
    let got = repair(&mut c, r, w, &p, 2, &[(1, "x"), (1, "y"), (2, "x")]);
    assert_eq!(got, stored(2, 3));
    assert!(has(&mut c, a, &p, 1, "y") && has(&mut c, a, &p, 2, "x"));
    assert_eq!(c.stats().entries, 3);
    // A key named twice in one repair put is stored once.
    let got = repair(&mut c, r, w, &p, 3, &[(5, "z"), (5, "z")]);
    assert_eq!(got, stored(1, 2));
    assert_eq!(c.stats().entries, 4);
}

#[test]
fn a_present_value_is_kept_not_overwritten() {
    let mut c = core(1 << 20);
    let (a, r) = (own(&mut c), own(&mut c));
    let p = part("p");
    put(&mut c, a, &p, 1, 1, "x");
    let where_ = |c: &mut UnitCore| {
        let (pin, found) = c.resolve_places(a, &p, &[Key::new(1, "x")], t(0)).unwrap();
        c.unpin(a, pin.unwrap()).unwrap();
        found[0].clone().unwrap()
    };
    let first = where_(&mut c);
    let before = c.stats();
    let w = open(&mut c, r, "g").unwrap();
    assert_eq!(repair(&mut c, r, w, &p, 2, &[(1, "x")]), stored(0, 1));
    assert_eq!(where_(&mut c), first, "still the first put's value");
    let s = c.stats();
    assert_eq!(
        (s.blobs, s.used, s.entries),
        (before.blobs, before.used, before.entries),
        "the skipped blob is freed"
    );
}

#[test]
fn skipped_when_the_row_was_cleared_after_the_window_opened() {
    let mut c = core(1 << 20);
    let (a, r) = (own(&mut c), own(&mut c));
    let p = part("p");
    let w = open(&mut c, r, "g").unwrap();
    // The row is not here at all: its clear is remembered anyway.
    clear_rows(&mut c, a, &p, &[1]);
    let got = repair(&mut c, r, w, &p, 1, &[(1, "x"), (1, "y"), (2, "x")]);
    assert_eq!(got, stored(1, 3));
    assert!(!has(&mut c, a, &p, 1, "x"));
    assert!(has(&mut c, a, &p, 2, "x"));
    // Another partition's row of the same number is not affected.
    let got = repair(&mut c, r, w, &part("q"), 2, &[(1, "x")]);
    assert_eq!(got, stored(1, 1));
}

#[test]
fn skipped_when_the_partition_was_cleared_after_the_window_opened() {
    let mut c = core(1 << 20);
    let (a, r) = (own(&mut c), own(&mut c));
    let p = part("p");
    put(&mut c, a, &p, 1, 9, "x");
    let w = open(&mut c, r, "g").unwrap();
    clear_partition(&mut c, a, &p);
    let got = repair(&mut c, r, w, &p, 2, &[(1, "x"), (9, "x")]);
    assert_eq!(got, stored(0, 2));
    assert_eq!(c.stats().entries, 0);
    assert_eq!(c.stats().used, 0);
}

#[test]
fn stored_when_cleared_before_the_window_opened() {
    let mut c = core(1 << 20);
    let (a, r) = (own(&mut c), own(&mut c));
    let p = part("p");
    // Cleared while another window was open (so it is remembered) and
    // before this one opened.
    let early = open(&mut c, r, "early").unwrap();
    clear_rows(&mut c, a, &p, &[1]);
    clear_partition(&mut c, a, &part("q"));
    let w = open(&mut c, r, "late").unwrap();
    let got = repair(&mut c, r, w, &p, 1, &[(1, "x")]);
    assert_eq!(got, stored(1, 1));
    let got = repair(&mut c, r, w, &part("q"), 2, &[(1, "x")]);
    assert_eq!(got, stored(1, 1));
    // The early window, open before the clears, refuses them.
    let got = repair(&mut c, r, early, &p, 3, &[(1, "y")]);
    assert_eq!(got, stored(0, 1));
    // And a clear with no window open at all is not remembered.
    close(&mut c, r, early).unwrap();
    close(&mut c, r, w).unwrap();
    clear_rows(&mut c, a, &p, &[7]);
    let w = open(&mut c, r, "later").unwrap();
    assert_eq!(repair(&mut c, r, w, &p, 4, &[(7, "x")]), stored(1, 1));
}

#[test]
fn a_clear_in_another_namespace_does_not_count() {
    let mut c = core(1 << 20);
    let (a, r) = (own(&mut c), own(&mut c));
    let w = open(&mut c, r, "g").unwrap();
    let other = "other\u{1f}p";
    clear_rows(&mut c, a, other, &[1]);
    clear_partition(&mut c, a, other);
    assert_eq!(
        c.repair_tombstones(),
        (1, 0, 0),
        "no window of that namespace: nothing remembered"
    );
    assert_eq!(
        repair(&mut c, r, w, &part("p"), 1, &[(1, "x")]),
        stored(1, 1)
    );
    // The same key names a separate window in another namespace.
    let w2 = open_in(&mut c, a, "other\u{1f}", "g").unwrap();
    assert_ne!(w, w2);
    // Nor may a window put into another namespace's partitions.
    assert!(matches!(
        repair(&mut c, r, w, other, 2, &[(1, "x")]),
        Err(CoreError::Invalid(_))
    ));
}

#[test]
fn a_window_is_its_sessions_only() {
    let mut c = core(1 << 20);
    let (a, r) = (own(&mut c), own(&mut c));
    let w = open(&mut c, r, "g").unwrap();
    assert!(matches!(open(&mut c, a, "g"), Err(CoreError::Busy { .. })));
    // Its own session may open the key again (a second window).
    let again = open(&mut c, r, "g").unwrap();
    assert_ne!(w, again);
    // Another connection of the same session uses it.
    let r2 = c.attach(r.session, false).unwrap();
    assert_eq!(
        repair(&mut c, r2, w, &part("p"), 1, &[(1, "x")]),
        stored(1, 1)
    );
    // Another session may neither use nor close it.
    assert!(matches!(
        repair(&mut c, a, w, &part("p"), 2, &[(2, "x")]),
        Err(CoreError::Invalid(_))
    ));
    assert!(matches!(close(&mut c, a, w), Err(CoreError::NotOwner(_))));
    assert_eq!(c.stats().entries, 1);
    close(&mut c, r, w).unwrap();
    close(&mut c, r, again).unwrap();
    assert!(open(&mut c, a, "g").is_ok(), "closed: the key is free");
}

#[test]
fn a_closed_window_is_refused() {
    let mut c = core(1 << 20);
    let r = own(&mut c);
    let w = open(&mut c, r, "g").unwrap();
    close(&mut c, r, w).unwrap();
    close(&mut c, r, w).unwrap(); // closing again is fine
    close(&mut c, r, 12345).unwrap(); // so is an unknown window
    assert!(matches!(
        repair(&mut c, r, w, &part("p"), 1, &[(1, "x")]),
        Err(CoreError::Invalid(_))
    ));
    let s = c.stats();
    assert_eq!((s.blobs, s.used, s.entries), (0, 0, 0), "nothing reserved");
}

#[test]
fn a_window_closed_between_alloc_and_commit_publishes_nothing() {
    let mut c = core(1 << 20);
    let r = own(&mut c);
    let w = open(&mut c, r, "g").unwrap();
    let op = RepairAlloc {
        window: w,
        blob: BlobId(1),
        nbytes: 8,
        n_entries: 1,
    };
    c.handle(t(0), Request { owner: r, op }).unwrap();
    close(&mut c, r, w).unwrap();
    let op = RepairCommit {
        window: w,
        partition: part("p"),
        blob: BlobId(1),
        entries: vec![entry(1, "x", 0, 8)],
    };
    let got = c.handle(t(0), Request { owner: r, op });
    assert!(matches!(got, Err(CoreError::Invalid(_))));
    assert_eq!(c.stats().entries, 0);
}

#[test]
fn the_end_of_the_session_closes_its_windows() {
    let mut c = core(1 << 20);
    let (a, r) = (own(&mut c), own(&mut c));
    open(&mut c, r, "g").unwrap();
    clear_rows(&mut c, a, &part("p"), &[1, 2]);
    assert_eq!(c.repair_tombstones(), (1, 2, 1));
    c.handle(
        t(0),
        input::ConnEnded {
            owner: r,
            end: ConnEnd::Closed,
        },
    )
    .unwrap();
    assert!(!c.has_session(r.session));
    assert_eq!(c.repair_tombstones(), (0, 0, 0));
    assert!(open(&mut c, a, "g").is_ok(), "the key is free again");
    // A session whose process exited, its connection cut, too.
    let mut c = core(1 << 20);
    let r = own(&mut c);
    open(&mut c, r, "g").unwrap();
    c.alloc(r, BlobId(1), 8, 1, t(0)).unwrap();
    c.handle(
        t(0),
        input::ConnEnded {
            owner: r,
            end: ConnEnd::Cut,
        },
    )
    .unwrap();
    assert_eq!(c.repair_tombstones().0, 1, "kept while the session is");
    c.handle(t(0), input::ProcessExited(r.session)).unwrap();
    assert_eq!(c.repair_tombstones(), (0, 0, 0));
}

#[test]
fn past_the_row_cap_a_cleared_row_counts_as_its_partition() {
    let mut cfg = CoreConfig::new(1 << 20);
    cfg.repair_row_tombstones = 3;
    let mut c = UnitCore::new(cfg).unwrap();
    let (a, r) = (own(&mut c), own(&mut c));
    let (p, q) = (part("p"), part("q"));
    let w = open(&mut c, r, "g").unwrap();
    clear_rows(&mut c, a, &p, &[1, 2]);
    assert_eq!(c.repair_tombstones(), (1, 2, 1));
    // Rows 3, 4 of q: one fits, then q is remembered whole.
    clear_rows(&mut c, a, &q, &[3, 4]);
    assert_eq!(c.repair_tombstones(), (1, 3, 2));
    assert_eq!(repair(&mut c, r, w, &p, 1, &[(3, "x")]), stored(1, 1));
    assert_eq!(
        repair(&mut c, r, w, &q, 2, &[(3, "x"), (4, "x"), (9, "x")]),
        stored(0, 3),
        "q counts as cleared whole: refuses more, never less"
    );
    // A row already remembered is remembered again, not coarsened.
    clear_rows(&mut c, a, &p, &[1]);
    assert_eq!(
        repair(&mut c, r, w, &p, 3, &[(2, "y"), (5, "y")]),
        stored(1, 2)
    );
}

#[test]
fn past_the_partition_cap_every_window_loses_track() {
    let mut cfg = CoreConfig::new(1 << 20);
    cfg.repair_partitions = 2;
    let mut c = UnitCore::new(cfg).unwrap();
    let (a, r) = (own(&mut c), own(&mut c));
    let w = open(&mut c, r, "g").unwrap();
    let w2 = open(&mut c, a, "h").unwrap();
    clear_rows(&mut c, a, &part("p"), &[1]);
    clear_partition(&mut c, a, &part("q"));
    assert!(!c.repair_window_lost(w));
    clear_rows(&mut c, a, &part("s"), &[1]);
    assert!(c.repair_window_lost(w) && c.repair_window_lost(w2));
    assert_eq!(c.repair_tombstones(), (2, 0, 0), "all it kept is dropped");
    assert!(matches!(
        repair(&mut c, r, w, &part("z"), 1, &[(1, "x")]),
        Err(CoreError::Busy { .. })
    ));
    // Clears are not remembered for lost windows.
    clear_rows(&mut c, a, &part("t"), &[1]);
    assert_eq!(c.repair_tombstones(), (2, 0, 0));
    // A new window starts over and works.
    let fresh = open(&mut c, r, "g2").unwrap();
    clear_rows(&mut c, a, &part("p"), &[1]);
    assert_eq!(
        repair(&mut c, r, fresh, &part("p"), 2, &[(1, "x"), (2, "x")]),
        stored(1, 2)
    );
    close(&mut c, r, w).unwrap();
    assert_eq!(c.stats().blobs, 1);
}

#[test]
fn nothing_is_remembered_without_a_window() {
    let mut c = core(1 << 20);
    let (a, r) = (own(&mut c), own(&mut c));
    clear_rows(&mut c, a, &part("p"), &[1, 2, 3]);
    clear_partition(&mut c, a, &part("q"));
    assert_eq!(c.repair_tombstones(), (0, 0, 0));
    let w = open(&mut c, r, "g").unwrap();
    let w2 = open(&mut c, r, "h").unwrap();
    clear_rows(&mut c, a, &part("p"), &[1, 2, 3]);
    clear_partition(&mut c, a, &part("q"));
    assert_eq!(c.repair_tombstones(), (2, 3, 2));
    close(&mut c, r, w).unwrap();
    // w2 opened before the clears: it still needs them.
    assert_eq!(c.repair_tombstones(), (1, 3, 2));
    let w3 = open(&mut c, r, "k").unwrap();
    close(&mut c, r, w2).unwrap();
    // w3 opened after them: they can go.
    assert_eq!(c.repair_tombstones(), (1, 0, 0));
    clear_rows(&mut c, a, &part("p"), &[4]);
    assert_eq!(c.repair_tombstones(), (1, 1, 1));
    close(&mut c, r, w3).unwrap();
    assert_eq!(c.repair_tombstones(), (0, 0, 0));
    assert_eq!(
        c.repairs.partitions.capacity(),
        0,
        "the maps' memory is given back"
    );
    clear_rows(&mut c, a, &part("p"), &[5]);
    assert_eq!(c.repair_tombstones(), (0, 0, 0));
}

#[test]
fn a_blob_with_nothing_stored_is_freed_and_a_retry_stores_nothing() {
    let mut c = core(1 << 20);
    let (a, r) = (own(&mut c), own(&mut c));
    let p = part("p");
    put(&mut c, a, &p, 1, 1, "x");
    let before = c.stats();
    let w = open(&mut c, r, "g").unwrap();
    clear_rows(&mut c, a, &part("q"), &[2]);
    let got = repair(&mut c, r, w, &p, 7, &[(1, "x")]);
    assert_eq!(got, stored(0, 1));
    let got = repair(&mut c, r, w, &part("q"), 8, &[(2, "x"), (2, "y")]);
    assert_eq!(got, stored(0, 2));
    let s = c.stats();
    assert_eq!(
        (s.used, s.blobs, s.entries, s.reserved_bytes),
        (before.used, before.blobs, before.entries, 0),
        "no leak"
    );
    // A retry of a put that went: nothing stored again, every entry
    // counted skipped.
    let op = RepairAlloc {
        window: w,
        blob: BlobId(7),
        nbytes: 8,
        n_entries: 1,
    };
    assert_eq!(
        c.handle(t(0), Request { owner: r, op }),
        Ok(Allocated::AlreadyCommitted)
    );
    let op = RepairCommit {
        window: w,
        partition: part("z"),
        blob: BlobId(7),
        entries: vec![entry(1, "x", 0, 8)],
    };
    assert_eq!(c.handle(t(0), Request { owner: r, op }), stored(0, 1));
    assert_eq!(c.stats().entries, 1);
}

#[test]
fn a_repair_put_never_goes_to_the_disk_tier() {
    let mut c = tier::disk_core(4096, 1 << 20);
    let (a, r) = (own(&mut c), own(&mut c));
    let w = open(&mut c, r, "g").unwrap();
    c.alloc(a, BlobId(1), 4096, 1, t(0)).unwrap();
    let op = RepairAlloc {
        window: w,
        blob: BlobId(2),
        nbytes: 1024,
        n_entries: 1,
    };
    let got = c.handle(t(0), Request { owner: r, op });
    assert!(
        matches!(got, Err(CoreError::Full { .. } | CoreError::Busy { .. })),
        "{got:?}"
    );
    // A plain put of the same size goes to disk.
    assert_eq!(
        c.alloc(a, BlobId(3), 1024, 1, t(0)).unwrap(),
        Allocated::ToDisk
    );
    // A repair commit of a blob a Put reserved on disk is refused.
    c.alloc(r, BlobId(4), 1024, 1, t(0)).unwrap();
    let op = RepairAlloc {
        window: w,
        blob: BlobId(4),
        nbytes: 1024,
        n_entries: 1,
    };
    assert!(matches!(
        c.handle(t(0), Request { owner: r, op }),
        Err(CoreError::Invalid(_))
    ));
    let op = RepairCommit {
        window: w,
        partition: part("p"),
        blob: BlobId(4),
        entries: vec![entry(1, "x", 0, 8)],
    };
    assert!(matches!(
        c.handle(t(0), Request { owner: r, op }),
        Err(CoreError::Invalid(_))
    ));
}

/// A repair put through `window` at `at` (one 8-byte value for `row`).
fn repair_at(
    c: &mut UnitCore,
    o: Owner,
    at: Time,
    window: u64,
    blob: u128,
    row: u64,
) -> Result<Repaired, CoreError> {
    let op = RepairAlloc {
        window,
        blob: BlobId(blob),
        nbytes: 8,
        n_entries: 1,
    };
    c.handle(at, Request { owner: o, op })?;
    let op = RepairCommit {
        window,
        partition: part("p"),
        blob: BlobId(blob),
        entries: vec![entry(row, "x", 0, 8)],
    };
    c.handle(at, Request { owner: o, op })
}

#[test]
fn a_window_idle_past_its_lease_is_taken_over_and_its_puts_refused() {
    let mut c = core(1 << 20);
    let (a, r) = (own(&mut c), own(&mut c));
    let lease = c.config().repair_window_lease;
    let open_at = |c: &mut UnitCore, o: Owner, at: Time| {
        let op = OpenRepair {
            scope: NS.into(),
            key: "g".into(),
        };
        c.handle(at, Request { owner: o, op })
    };
    let w = open_at(&mut c, r, t(0)).unwrap();
    // A repair put keeps it in use: a lease after the open but not after
    // the put, another session is still refused.
    let used = t(10_000);
    assert_eq!(repair_at(&mut c, r, used, w, 1, 1), stored(1, 1));
    assert!(matches!(
        open_at(&mut c, a, used + lease - t(1)),
        Err(CoreError::Busy { .. })
    ));
    // Idle a whole lease: another session takes the key over.
    let late = used + lease;
    let w2 = open_at(&mut c, a, late).unwrap();
    // The first window's puts are refused from now on, its session's
    // stored nothing more; the new one stores, and remembers clears.
    assert!(matches!(
        repair_at(&mut c, r, late, w, 2, 2),
        Err(CoreError::Busy { .. })
    ));
    assert_eq!(repair_at(&mut c, a, late, w2, 3, 3), stored(1, 1));
    clear_rows(&mut c, a, &part("p"), &[4]);
    assert_eq!(repair_at(&mut c, a, late, w2, 4, 4), stored(0, 1));
    assert_eq!(c.stats().entries, 2);
    // The first session's window, lost, blocks nobody; closing it is fine.
    close(&mut c, r, w).unwrap();
    close(&mut c, a, w2).unwrap();
    assert_eq!(c.repair_tombstones(), (0, 0, 0));
}
