//! Claims with real processes: consumers of one task over several units,
//! some killed (SIGKILL) and some paused (SIGSTOP, past the claim lease)
//! in the middle of their claims, while producers put rows. Every row is
//! claimed at most once per task, a group is never split, a lease whose
//! consumer died or stopped goes back to the others, and nothing is lost.
//!
//! The consumers are this test binary re-run as child processes
//! (`claim_child`, `lease_child`), using the client library, or the raw
//! protocol to hold a lease without settling it, as a user's process
//! would.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::*;
use stowage_client::{Client, ClientConfig, Column, DType, Error, RowKey, Tensor, UnitAddr};
use stowage_local::LocalPlane;
use stowage_wire::{Request, Response};

const MIB: u64 = 1 << 20;
/// Rows a claim leased and did not settle go back after this.
const LEASE: &[&str] = &["--claim-lease", "400ms"];
const TASK: &str = "train";
const GROUP: usize = 4;

fn client_of(p: &LocalPlane) -> Client {
    client(p, Kind::Shm, Duration::from_secs(10))
}

/// `rows` named `<g>_g<i>`, each in group `<g>`, field "x" = its number.
fn put_groups(c: &Client, partition: &str, groups: std::ops::Range<usize>) {
    let names: Vec<String> = groups
        .clone()
        .flat_map(|g| (0..GROUP).map(move |i| format!("{g}_g{i}")))
        .collect();
    let group_ids: Vec<String> = groups
        .flat_map(|g| std::iter::repeat_n(g.to_string(), GROUP))
        .collect();
    let keys: Vec<RowKey> = names.iter().map(|n| RowKey::Name(n.clone())).collect();
    let values: Vec<[u8; 8]> = names.iter().map(|n| value_of(n).to_le_bytes()).collect();
    let col: Vec<Tensor<'_>> = values
        .iter()
        .map(|v| Tensor {
            dtype: DType::U64,
            shape: vec![1],
            data: v,
        })
        .collect();
    c.put_grouped(
        partition,
        &keys,
        Some(&group_ids),
        &[("x", Column::Jagged(col))],
        None,
        c.deadline(),
    )
    .expect("put");
}

/// The value row `name` holds.
fn value_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn group_of(name: &str) -> &str {
    name.rsplit_once("_g").map_or(name, |(g, _)| g)
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} failed");
}

/// Not a test on its own: a consumer, run by the tests below.
/// `STOWAGE_CLAIM=addr,addr,...;partition;idle_ms;replicas`: claims up to 8 rows of
/// task "train" needing "x", waiting, and prints `CLAIM name,name,...`
/// for each claim; after `idle_ms` without a row it prints `DONE`.
#[test]
#[ignore = "a helper process of the claims tests"]
fn claim_child() {
    let spec = std::env::var("STOWAGE_CLAIM").expect("run only by the claims tests");
    let mut parts = spec.split(';');
    let addrs: Vec<UnitAddr> = parts
        .next()
        .unwrap()
        .split(',')
        .map(|a| a.parse().unwrap())
        .collect();
    let partition = parts.next().unwrap().to_owned();
    let idle = Duration::from_millis(parts.next().unwrap().parse().unwrap());
    let replicas = parts.next().unwrap().parse().unwrap();
    let mut cfg = ClientConfig::new("test", addrs);
    cfg.secret = child_secret();
    cfg.timeout = Duration::from_secs(30);
    cfg.replicas = replicas;
    let c = Client::connect(cfg).unwrap();
    println!("READY");
    std::io::stdout().flush().unwrap();
    let fields = vec!["x".to_owned()];
    loop {
        match c.claim(&partition, TASK, &fields, 8, true, Instant::now() + idle) {
            Ok(rows) => {
                let names: Vec<String> = rows
                    .iter()
                    .map(|r| match r {
                        RowKey::Name(n) => n.clone(),
                        RowKey::Index(i) => i.to_string(),
                    })
                    .collect();
                println!("CLAIM {}", names.join(","));
                std::io::stdout().flush().unwrap();
            }
            Err(Error::Timeout { .. }) => break,
            Err(e) => {
                println!("ERROR {e}");
                std::io::stdout().flush().unwrap();
                return;
            }
        }
    }
    println!("DONE");
    std::io::stdout().flush().unwrap();
}

/// Not a test on its own: a consumer that leases rows over the raw
/// protocol and settles them only when told. `STOWAGE_LEASE=socket;partition;go_file`:
/// claims up to 8 rows, prints `LEASED <lease> <rows>`, waits (at most
/// 60 s) for `go_file` to exist, settles every row it leased and prints
/// `SETTLED <rows kept>`.
#[test]
#[ignore = "a helper process of the claims tests"]
fn lease_child() {
    let spec = std::env::var("STOWAGE_LEASE").expect("run only by the claims tests");
    let mut parts = spec.split(';');
    let sock = std::path::PathBuf::from(parts.next().unwrap());
    let partition = parts.next().unwrap().to_owned();
    let go = std::path::PathBuf::from(parts.next().unwrap());
    let mut r = Raw::hello(&sock, "test");
    let (lease, rows) = match r.call(&Request::Claim {
        partition,
        task: TASK.into(),
        fields: vec!["x".into()],
        want: 8,
        wait_ms: 0,
        homes: None,
    }) {
        Response::Claimed { lease, rows, .. } => (lease, rows),
        other => panic!("{other:?}"),
    };
    println!("LEASED {lease} {rows:?}");
    std::io::stdout().flush().unwrap();
    let end = Instant::now() + Duration::from_secs(60);
    while !go.exists() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    match r.call(&Request::Settle { lease, keep: rows }) {
        Response::Settled { rows } => println!("SETTLED {rows:?}"),
        other => println!("SETTLED error {other:?}"),
    }
    std::io::stdout().flush().unwrap();
}

struct Child2 {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Child2 {
    fn expect_line(&self, prefix: &str, within: Duration) -> String {
        expect_line(&self.lines, prefix, within)
    }
}

impl Drop for Child2 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A consumer killed while it holds a lease gives its rows back at once;
/// one paused past the claim lease loses them to the others, and its
/// settle when it resumes keeps none of them.
#[test]
fn a_killed_or_paused_claimer_gives_its_lease_back_and_never_keeps_it_twice() {
    let (p, _) = plane(1, 16 * MIB, LEASE);
    let c = client_of(&p);
    let fields = vec!["x".to_owned()];
    c.register_tasks("p", &[TASK.into()], 8, GROUP as u32, c.deadline())
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let lease_child = |go: &std::path::Path| {
        let spec = format!("{};p;{}", p.units[0].uds.display(), go.display());
        let mut child = helper_child_of(&p, "lease_child", ("STOWAGE_LEASE", &spec));
        let lines = stdout_lines(&mut child);
        Child2 { child, lines }
    };

    // Killed with a lease: its rows come back, and a claim waiting for
    // them is woken by the unit (not by its own deadline).
    put_groups(&c, "p", 0..1);
    let killed = lease_child(&dir.path().join("never"));
    let leased = killed.expect_line("LEASED", Duration::from_secs(30));
    assert!(
        leased.ends_with("]") && leased.matches(',').count() == GROUP - 1,
        "{leased}"
    );
    assert!(c
        .claim("p", TASK, &fields, 8, false, c.deadline())
        .unwrap()
        .is_empty());
    signal(&killed.child, "-KILL");
    let t0 = Instant::now();
    let got = c
        .claim(
            "p",
            TASK,
            &fields,
            8,
            true,
            Instant::now() + Duration::from_secs(20),
        )
        .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10), "woken by the unit");
    let names: BTreeSet<String> = got.iter().map(|k| format!("{k:?}")).collect();
    assert_eq!(names.len(), GROUP, "the whole group came back: {got:?}");

    // Paused past the lease: the rows go to another consumer; resumed,
    // its settle keeps none.
    put_groups(&c, "p", 1..2);
    let go = dir.path().join("go");
    let paused = lease_child(&go);
    paused.expect_line("LEASED", Duration::from_secs(30));
    signal(&paused.child, "-STOP");
    assert!(eventually(Duration::from_secs(5), || is_stopped(
        paused.child.id()
    )));
    let got = c
        .claim(
            "p",
            TASK,
            &fields,
            8,
            true,
            Instant::now() + Duration::from_secs(20),
        )
        .unwrap();
    assert_eq!(
        got.len(),
        GROUP,
        "the paused consumer's lease went to another: {got:?}"
    );
    std::fs::write(&go, b"").unwrap();
    signal(&paused.child, "-CONT");
    let settled = paused.expect_line("SETTLED", Duration::from_secs(30));
    assert_eq!(
        settled, "SETTLED []",
        "a resumed consumer keeps nothing it lost"
    );

    // Each row once: 8 consumed, none left, none leased.
    let s = c.claim_status("p", TASK, c.deadline()).unwrap();
    assert_eq!((s.consumed, s.leased), (2 * GROUP as u64, 0), "{s:?}");
    assert!(c
        .claim("p", TASK, &fields, 8, false, c.deadline())
        .unwrap()
        .is_empty());
}

/// Eight consumers of one task over four units while rows arrive: two
/// killed and two paused past the claim lease mid-run. Every row reported
/// is reported once, every claim holds whole groups, every row is
/// consumed exactly once by the units' count, and every value reads back.
#[test]
fn eight_consumers_over_four_units_killed_and_paused_claim_each_row_once() {
    consumers_killed_and_paused_claim_each_row_once(1);
}

/// The same with two copies of every row (docs/replication.md#claims),
/// and a unit killed too, half-way: its rows are claimed from their copies,
/// still each once.
#[test]
fn with_two_copies_and_a_unit_killed_eight_consumers_claim_each_row_once() {
    consumers_killed_and_paused_claim_each_row_once(2);
}

fn consumers_killed_and_paused_claim_each_row_once(replicas: usize) {
    const GROUPS: usize = 96;
    let (mut p, _) = plane(4, 16 * MIB, LEASE);
    let c = {
        let mut cfg = ClientConfig::new("test", p.uds_addrs());
        cfg.secret = p.secret().cloned();
        cfg.timeout = Duration::from_secs(10);
        cfg.replicas = replicas;
        Client::connect(cfg).unwrap()
    };
    let fields = vec!["x".to_owned()];
    c.register_tasks(
        "p",
        &[TASK.into()],
        (GROUPS * GROUP) as u64,
        GROUP as u32,
        c.deadline(),
    )
    .unwrap();
    let addrs: Vec<String> = p.uds_addrs().iter().map(|a| a.to_string()).collect();
    let spec = format!("{};p;3000;{replicas}", addrs.join(","));
    let consumers: Vec<Child2> = (0..8)
        .map(|_| {
            let mut child = helper_child_of(&p, "claim_child", ("STOWAGE_CLAIM", &spec));
            let lines = stdout_lines(&mut child);
            Child2 { child, lines }
        })
        .collect();
    for k in &consumers {
        k.expect_line("READY", Duration::from_secs(30));
    }
    // Producers: two groups a put, a little apart.
    let mut lines: Vec<Vec<String>> = vec![Vec::new(); consumers.len()];
    let drain = |lines: &mut Vec<Vec<String>>| {
        for (i, k) in consumers.iter().enumerate() {
            while let Ok(l) = k.lines.try_recv() {
                lines[i].push(l);
            }
        }
    };
    for g in (0..GROUPS).step_by(2) {
        put_groups(&c, "p", g..g + 2);
        std::thread::sleep(Duration::from_millis(3));
        if g == GROUPS / 3 {
            signal(&consumers[0].child, "-KILL");
            signal(&consumers[1].child, "-KILL");
            signal(&consumers[2].child, "-STOP");
            signal(&consumers[3].child, "-STOP");
        }
        if g == GROUPS / 2 && replicas > 1 {
            p.kill9(1);
        }
        if g == 2 * GROUPS / 3 {
            std::thread::sleep(Duration::from_millis(600)); // past the lease
            signal(&consumers[2].child, "-CONT");
            signal(&consumers[3].child, "-CONT");
        }
        drain(&mut lines);
    }
    // The live consumers stop 3 s after the last row.
    let end = Instant::now() + Duration::from_secs(60);
    while Instant::now() < end {
        drain(&mut lines);
        let done = (2..8).all(|i| {
            lines[i]
                .iter()
                .any(|l| l.contains("DONE") || l.contains("ERROR"))
        });
        if done {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drain(&mut lines);
    let mut claimed: BTreeMap<String, usize> = BTreeMap::new();
    for (i, ls) in lines.iter().enumerate() {
        if i >= 2 {
            assert!(
                ls.iter().any(|l| l.contains("DONE")),
                "consumer {i}: {ls:?}"
            );
        }
        for l in ls {
            assert!(!l.contains("ERROR"), "consumer {i}: {l}");
            let Some(rest) = l.find("CLAIM ").map(|at| &l[at + 6..]) else {
                continue;
            };
            let names: Vec<&str> = rest.split(',').collect();
            // Whole groups only.
            let mut per_group: BTreeMap<&str, usize> = BTreeMap::new();
            for n in &names {
                *per_group.entry(group_of(n)).or_default() += 1;
                assert!(
                    claimed.insert(n.to_string(), i).is_none(),
                    "row {n} claimed twice (consumer {i}, and consumer {:?})",
                    claimed.get(*n)
                );
            }
            assert!(
                per_group.values().all(|&n| n == GROUP),
                "a split group: {l}"
            );
        }
    }
    // The units consumed every row once; the rows no survivor reported
    // were taken by a killed consumer's last claims (one each at most, of
    // 8 rows), in whole groups.
    let s = c.claim_status("p", TASK, c.deadline()).unwrap();
    assert_eq!(s.consumed, (GROUPS * GROUP) as u64, "{s:?}");
    assert_eq!(s.leased, 0, "{s:?}");
    let unreported = GROUPS * GROUP - claimed.len();
    assert!(unreported <= 2 * 8, "{unreported} rows unreported");
    assert!(unreported.is_multiple_of(GROUP));
    assert!(c
        .claim("p", TASK, &fields, 8, false, c.deadline())
        .unwrap()
        .is_empty());
    // Nothing lost: every value reads back from its group's unit.
    for g in 0..GROUPS {
        let keys: Vec<RowKey> = (0..GROUP)
            .map(|i| RowKey::Name(format!("{g}_g{i}")))
            .collect();
        let got = c
            .get_tensors(
                "p",
                &keys,
                &["x"],
                Some(c.unit_of(&g.to_string())),
                c.deadline(),
            )
            .unwrap();
        for (k, v) in keys.iter().zip(&got) {
            let RowKey::Name(n) = k else { unreachable!() };
            assert_eq!(v[0].data, value_of(n).to_le_bytes(), "{n}");
        }
    }
    // The paused consumers did go on after they resumed.
    assert!(lines[2]
        .iter()
        .chain(&lines[3])
        .any(|l| l.contains("CLAIM") || l.contains("DONE")));
}

/// A claim whose deadline passes while it takes the rows it leased (the
/// settle, the names) still returns them: every row the units count as
/// consumed was returned to a caller, once, however short the deadlines.
#[test]
fn claims_that_run_out_of_time_never_lose_a_row() {
    const GROUPS: usize = 64;
    let (p, _) = plane(2, 16 * MIB, &[]);
    let c = client_of(&p);
    let fields = vec!["x".to_owned()];
    let rows = (GROUPS * GROUP) as u64;
    c.register_tasks("p", &[TASK.into()], rows, 0, c.deadline())
        .unwrap();
    put_groups(&c, "p", 0..GROUPS);
    let mut got: BTreeMap<String, usize> = BTreeMap::new();
    let mut timeouts = 0;
    for i in 0..20_000 {
        let deadline = Instant::now() + Duration::from_micros(50 + (i % 7) * 100);
        match c.claim("p", TASK, &fields, 16, true, deadline) {
            Ok(keys) => {
                for k in keys {
                    *got.entry(format!("{k:?}")).or_default() += 1;
                }
            }
            Err(Error::Timeout { .. }) => timeouts += 1,
            Err(e) => panic!("{e}"),
        }
        if c.claim_status("p", TASK, c.deadline()).unwrap().consumed == rows {
            break;
        }
    }
    let s = c.claim_status("p", TASK, c.deadline()).unwrap();
    assert_eq!(s.consumed, rows, "{s:?} after {timeouts} timeouts");
    assert!(got.values().all(|&n| n == 1), "a row returned twice");
    assert_eq!(
        got.len() as u64,
        rows,
        "rows consumed that no claim returned ({timeouts} claims timed out)"
    );
}

/// A consumer stopped (SIGSTOP) and continued while its claim waits on the
/// units gets the rows put afterwards: the reads its wait was blocked in
/// (which the kernel fails with EINTR after a stop, timeouts being set)
/// are read again, not reported as a failed transfer.
#[test]
fn a_waiting_claimer_stopped_and_continued_still_gets_its_rows() {
    let (p, _) = plane(2, 16 * MIB, &[]);
    let c = client_of(&p);
    c.register_tasks("p", &[TASK.into()], 8, GROUP as u32, c.deadline())
        .unwrap();
    let addrs: Vec<String> = p.uds_addrs().iter().map(|a| a.to_string()).collect();
    let spec = format!("{};p;20000;1", addrs.join(","));
    let mut child = helper_child_of(&p, "claim_child", ("STOWAGE_CLAIM", &spec));
    let lines = stdout_lines(&mut child);
    let k = Child2 { child, lines };
    k.expect_line("READY", Duration::from_secs(30));
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(200)); // waiting in its claim
        signal(&k.child, "-STOP");
        assert!(eventually(Duration::from_secs(5), || is_stopped(
            k.child.id()
        )));
        std::thread::sleep(Duration::from_millis(100));
        signal(&k.child, "-CONT");
    }
    std::thread::sleep(Duration::from_millis(100));
    put_groups(&c, "p", 0..1);
    let got = k.expect_line("CLAIM", Duration::from_secs(15));
    assert_eq!(got.matches(',').count(), GROUP - 1, "{got}");
}
