//! Claims with copies (docs/replication.md#claims), with real unit
//! processes: a 4-unit plane keeping 2 copies of every row. Each row is
//! claimed at most once per task across clients, also when the unit that
//! claims its home is killed (SIGKILL) between claims, with a lease of its
//! own unsettled; after a repair and a second unit's death the newcomer
//! that claims a dead unit's rows knows which were consumed; and the
//! consumption counts add up to every row.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::*;
use stowage_client::{Client, ClientConfig, Column, DType, RowKey, Tensor};
use stowage_local::LocalPlane;
use stowage_wire::{Homes, Request, Response};

const MIB: u64 = 1 << 20;
const UNITS: usize = 4;
const TASK: &str = "train";

/// A shm client of `p` keeping 2 copies.
fn copies_client(p: &LocalPlane) -> Client {
    let mut cfg = ClientConfig::new("test", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(10);
    cfg.replicas = 2;
    Client::connect(cfg).unwrap()
}

fn names(range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("s{i}")).collect()
}

/// Rows `names` of `partition`, field "x" (8 bytes), in groups of
/// `group` rows when `group` is above 1.
fn put(c: &Client, partition: &str, names: &[String], group: usize) {
    put_field(c, partition, names, "x", group);
}

/// [`put`] of field `field`.
fn put_field(c: &Client, partition: &str, names: &[String], field: &str, group: usize) {
    let keys: Vec<RowKey> = names.iter().map(|n| RowKey::Name(n.clone())).collect();
    let v = [7u8; 8];
    let col: Vec<Tensor<'_>> = names
        .iter()
        .map(|_| Tensor {
            dtype: DType::U8,
            shape: vec![8],
            data: &v,
        })
        .collect();
    let groups: Vec<String> = (0..names.len()).map(|i| (i / group).to_string()).collect();
    c.put_grouped(
        partition,
        &keys,
        (group > 1).then_some(&groups[..]),
        &[(field, Column::Jagged(col))],
        None,
        c.deadline(),
    )
    .unwrap();
}

/// Claim `want` rows of `partition` at most (no wait): their names.
fn claim(c: &Client, partition: &str, want: u32) -> Vec<String> {
    c.claim(
        partition,
        TASK,
        &["x".to_owned()],
        want,
        false,
        c.deadline(),
    )
    .unwrap()
    .into_iter()
    .map(|k| match k {
        RowKey::Name(n) => n,
        other => panic!("a claim answered {other:?}"),
    })
    .collect()
}

/// Claim with `c` until a claim gets nothing (bounded).
fn claim_rest(c: &Client, partition: &str, want: u32) -> Vec<String> {
    let until = Instant::now() + Duration::from_secs(60);
    let mut all = Vec::new();
    loop {
        let got = claim(c, partition, want);
        if got.is_empty() {
            return all;
        }
        all.extend(got);
        assert!(Instant::now() < until, "claims never ran dry");
    }
}

/// Every row of `all` claimed exactly once over `claimed`.
fn each_once(all: &[String], claimed: &[&[String]]) {
    let mut times: BTreeMap<&str, usize> = all.iter().map(|n| (n.as_str(), 0)).collect();
    for c in claimed {
        for n in c.iter() {
            *times
                .get_mut(n.as_str())
                .unwrap_or_else(|| panic!("claimed {n}, never put")) += 1;
        }
    }
    let wrong: Vec<_> = times.iter().filter(|(_, &t)| t != 1).collect();
    assert!(wrong.is_empty(), "rows not claimed exactly once: {wrong:?}");
}

/// A lease of unit `unit`'s own rows (raw protocol), never settled:
/// its rows.
fn lease_unsettled(p: &LocalPlane, unit: usize, partition: &str) -> (Raw, Vec<u64>) {
    let mut raw = Raw::hello(&p.units[unit].uds, "test");
    let rows = match raw.call(&Request::Claim {
        partition: partition.into(),
        task: TASK.into(),
        fields: vec!["x".into()],
        want: 3,
        wait_ms: 0,
        homes: Some(Homes {
            units: UNITS as u32,
            of: vec![unit as u32],
        }),
    }) {
        Response::Claimed { rows, homes, .. } => {
            assert!(homes.iter().all(|&h| h == unit as u32), "{homes:?}");
            rows
        }
        other => panic!("{other:?}"),
    };
    (raw, rows)
}

#[test]
fn each_row_is_claimed_once_across_a_killed_claimer_a_repair_and_a_second_death() {
    let (mut p, _) = plane(UNITS, 32 * MIB, &[]);
    let (a, b) = (copies_client(&p), copies_client(&p));
    let all = names(0..96);
    a.register_tasks("p", &[TASK.to_owned()], all.len() as u64, 1, a.deadline())
        .unwrap();
    put(&a, "p", &all, 1);
    // Both clients claim; then unit 0 holds a lease it never settles.
    // (A claim keeps whole leases of units while they fit in what it
    // asked, the first unit's first: it may get fewer rows than rows are
    // ready.)
    let a1 = claim(&a, "p", 12);
    let b1 = claim(&b, "p", 6);
    assert!(!a1.is_empty() && !b1.is_empty());
    let home = |n: &String| a.unit_of(n);
    assert!(
        a1.iter().chain(&b1).any(|n| home(n) == 0),
        "no row of unit 0 claimed before it dies"
    );
    let (_held, leased) = lease_unsettled(&p, 0, "p");
    assert!(!leased.is_empty());
    let progress = |c: &Client| c.claim_status("p", TASK, c.deadline()).unwrap();
    assert_eq!(progress(&a).consumed, (a1.len() + b1.len()) as u64);

    // Unit 0, the claimer of its own rows, dies: its copy (unit 1)
    // claims them now, knowing which were consumed (marks), and its
    // lease's rows come back. The marks of what it claims now reach the
    // newcomer (unit 2) before the repair brings their rows.
    p.kill9(0);
    let a2 = claim(&a, "p", 16);
    let b2 = claim(&b, "p", 16);
    assert!(!a2.is_empty() && !b2.is_empty());
    assert!(
        a2.iter().chain(&b2).any(|n| home(n) == 0),
        "no row of unit 0 claimed from its copy"
    );
    let so_far = a1.len() + b1.len() + a2.len() + b2.len();
    assert_eq!(progress(&b).consumed, so_far as u64);

    // A repair fills the newcomer of unit 0's rows (unit 2: their copies
    // were units 0 and 1), marks included; then unit 1 dies too, and
    // home 0's rows are claimed from the newcomer.
    let until = Instant::now() + Duration::from_secs(60);
    while a.repairs_pending() > 0 {
        a.repair(a.deadline()).unwrap();
        assert!(Instant::now() < until, "repairs still due");
    }
    p.kill9(1);
    // A client started now knows only the plane: it is told both died.
    let c = copies_client(&p);
    c.unit_gone(0);
    c.unit_gone(1);
    // One claim may take every row left: each unit's lease holds only
    // the rows of the homes it claims, never a copy of another's.
    let c3 = claim_rest(&c, "p", 1000);
    let (a3, b3) = (claim_rest(&a, "p", 10), claim_rest(&b, "p", 10));
    each_once(&all, &[&a1, &b1, &a2, &b2, &c3, &a3, &b3]);
    for cl in [&a, &b, &c] {
        let s = progress(cl);
        assert_eq!((s.consumed, s.leased), (96, 0), "{s:?}");
    }
}

#[test]
fn groups_with_copies_are_claimed_whole_once_across_a_killed_claimer() {
    let (mut p, _) = plane(UNITS, 32 * MIB, &[]);
    let (a, b) = (copies_client(&p), copies_client(&p));
    const GROUP: usize = 4;
    let all = names(0..64);
    a.register_tasks(
        "g",
        &[TASK.to_owned()],
        all.len() as u64,
        GROUP as u32,
        a.deadline(),
    )
    .unwrap();
    put(&a, "g", &all, GROUP);
    let a1 = claim(&a, "g", 8);
    let b1 = claim(&b, "g", 12);
    p.kill9(0);
    let a2 = claim_rest(&a, "g", 8);
    let b2 = claim_rest(&b, "g", 4);
    each_once(&all, &[&a1, &b1, &a2, &b2]);
    // Whole groups: rows i and i+1 of a group go to one claim together.
    for got in [&a1, &b1, &a2, &b2] {
        let mut per_group: BTreeMap<usize, usize> = BTreeMap::new();
        for n in got.iter() {
            let i: usize = n[1..].parse().unwrap();
            *per_group.entry(i / GROUP).or_default() += 1;
        }
        assert!(per_group.values().all(|&k| k == GROUP), "{got:?}");
    }
    assert_eq!(
        b.claim_status("g", TASK, b.deadline()).unwrap().consumed,
        64
    );
}

/// A claim of every row gets each once; its rows are listed as the
/// caller's rows, the consumption marks it writes hidden (also a late
/// mark of a row cleared meanwhile).
#[test]
fn one_claim_takes_each_row_once_and_its_marks_are_not_listed() {
    let (p, _) = plane(UNITS, 32 * MIB, &[]);
    let a = copies_client(&p);
    let all = names(0..40);
    a.register_tasks("p", &[TASK.to_owned()], 40, 1, a.deadline())
        .unwrap();
    put(&a, "p", &all, 1);
    // One claim of every row: each unit's lease holds its homes' rows
    // only, never another unit's copies.
    let got = claim(&a, "p", 1000);
    each_once(&all, &[&got]);
    let listed = a.list("p", a.deadline()).unwrap();
    assert_eq!(listed.len(), 40);
    assert!(
        listed.iter().all(|(_, f)| f == &["x".to_owned()]),
        "{listed:?}"
    );
    // Each unit holds marks: 2 copies of 40 rows, one mark each.
    let marks: usize = (0..UNITS)
        .map(|u| {
            let mut raw = Raw::hello(&p.units[u].uds, "test");
            match raw.call(&Request::List {
                partition: "p".into(),
            }) {
                Response::Listed { rows } => rows
                    .iter()
                    .flat_map(|(_, fields)| fields.iter())
                    .filter(|f| f.starts_with(stowage_wire::CONSUMED_FIELD_PREFIX))
                    .count(),
                other => panic!("{other:?}"),
            }
        })
        .sum();
    assert_eq!(marks, 80);
    // A mark that comes after its row was cleared (a claim's marks racing
    // a clear) is a row of its own on the units, never listed.
    let gone = RowKey::Name(all[0].clone()).row_id().unwrap();
    a.clear("p", &[RowKey::Name(all[0].clone())], None, a.deadline())
        .unwrap();
    let late = stowage_client::BlobPut {
        unit: a.unit_of(&all[0]),
        partition: "p",
        blob: stowage_client::new_blob_id(),
        segments: Vec::new(),
        entries: vec![stowage_wire::EntrySpec {
            key: stowage_wire::Key::new(gone, stowage_wire::consumed_field(0, TASK)),
            offset: 0,
            len: 0,
            meta: Vec::new(),
        }],
    };
    a.put_many(&[late], a.deadline()).unwrap();
    let listed = a.list("p", a.deadline()).unwrap();
    assert_eq!(listed.len(), 39, "{listed:?}");
    assert!(!listed.iter().any(|(k, _)| k == &RowKey::Index(gone)));
}

/// Four clients claim at once, each from its own thread, until no row is
/// left, while unit 2 is killed: each row goes to one of them, once (a
/// unit claims only its homes' rows, so two units never lease copies of
/// one row).
#[test]
fn concurrent_claimers_with_copies_never_share_a_row() {
    let (mut p, _) = plane(UNITS, 32 * MIB, &[]);
    let all = names(0..400);
    let first = copies_client(&p);
    first
        .register_tasks(
            "p",
            &[TASK.to_owned()],
            all.len() as u64,
            1,
            first.deadline(),
        )
        .unwrap();
    put(&first, "p", &all, 1);
    let clients: Vec<Client> = (0..4).map(|_| copies_client(&p)).collect();
    let go = std::sync::Barrier::new(clients.len() + 1);
    let got: Vec<Vec<String>> = std::thread::scope(|s| {
        let threads: Vec<_> = clients
            .iter()
            .map(|c| {
                let go = &go;
                s.spawn(move || {
                    go.wait();
                    claim_rest(c, "p", 3)
                })
            })
            .collect();
        go.wait();
        std::thread::sleep(Duration::from_millis(20));
        p.kill9(2);
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let views: Vec<&[String]> = got.iter().map(|g| &g[..]).collect();
    assert!(
        views.iter().filter(|g| !g.is_empty()).count() > 1,
        "one client took all"
    );
    each_once(&all, &views);
}

/// A blocking claim that waits while the unit claiming the rows it waits
/// for is killed asks that unit's copy instead, and returns once the rows
/// are ready there, long before its deadline.
#[test]
fn a_waiting_claim_whose_claimer_dies_is_answered_by_the_copy() {
    let (mut p, _) = plane(UNITS, 32 * MIB, &[]);
    let (a, writer) = (copies_client(&p), copies_client(&p));
    let all = names(0..16);
    writer
        .register_tasks("w", &[TASK.to_owned()], 16, 1, writer.deadline())
        .unwrap();
    put(&writer, "w", &all, 1);
    // Only the rows of unit 1 will get "y": only its claimer has any ready.
    let ones: Vec<String> = all
        .iter()
        .filter(|n| writer.unit_of(n) == 1)
        .cloned()
        .collect();
    assert!(!ones.is_empty(), "no row of unit 1 among {all:?}");
    let fields = ["x".to_owned(), "y".to_owned()];
    let started = Instant::now();
    let deadline = started + Duration::from_secs(60);
    let got = std::thread::scope(|s| {
        let waiting = s.spawn(|| a.claim("w", TASK, &fields, 100, true, deadline));
        std::thread::sleep(Duration::from_millis(500));
        p.kill9(1);
        std::thread::sleep(Duration::from_millis(500));
        put_field(&writer, "w", &ones, "y", 1);
        waiting.join().unwrap().unwrap()
    });
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the claim waited {:?}: it kept waiting on the dead unit's homes' old claimer",
        started.elapsed()
    );
    let mut got: Vec<String> = got
        .into_iter()
        .map(|k| match k {
            RowKey::Name(n) => n,
            other => panic!("{other:?}"),
        })
        .collect();
    got.sort();
    let mut want = ones.clone();
    want.sort();
    assert_eq!(got, want);
}
