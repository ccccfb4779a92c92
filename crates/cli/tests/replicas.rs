//! Copies (`ClientConfig::replicas`, docs/replication.md) with real
//! processes: a 4-unit plane, every row on 2 units, 8 client processes
//! looping over put, get (checked byte for byte) and clear while one unit
//! is killed (SIGKILL) or paused (SIGSTOP, then continued). No row whose
//! put was acknowledged is lost, and no get returns bytes other than a
//! value the row may hold.
//!
//! Each client (`replica_child`, this test binary re-run) keeps a model of
//! its own rows: for each row, the values it may hold (a put or a clear
//! that failed may have reached some copies and not others, so the row
//! holds the old value or the new one). Every get must return one of
//! them, or a typed error; a row whose every put and clear was
//! acknowledged must be read back exactly at the end.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use common::netns::{hosts_or_skip, ip, netns_listed, start_unit, write_secret, UNIT_A, UNIT_B};
use common::*;
use stowage_client::{Client, ClientConfig, Column, DType, Error, RowKey, Tensor, UnitAddr};
use stowage_local::LocalPlane;

const MIB: u64 = 1 << 20;
const CLIENTS: usize = 8;
const UNITS: usize = 4;
/// Rows of one client: its rows are `client * ROWS ..`, so consecutive rows
/// go round the units and their copies.
const ROWS: u64 = 24;
const FIELDS: [&str; 2] = ["tokens", "logprobs"];

/// What a row may hold: a version of its values (`Some`), or nothing.
type May = BTreeSet<Option<u64>>;

/// The bytes of field `f` of `row` at `version`: 1 to 48 KiB, by both.
fn value(row: u64, version: u64, f: usize) -> Vec<u8> {
    let len = 1024 + ((row * 7 + version * 13 + f as u64 * 5) % 48) as usize * 1024;
    pattern(row, version * 2 + f as u64, len)
}

fn put_row(c: &Client, row: u64, version: u64, deadline: Instant) -> stowage_client::Result<()> {
    put_row_on(c, row, version, None, deadline)
}

/// [`put_row`] on the unit named (`None`: the row's own).
fn put_row_on(
    c: &Client,
    row: u64,
    version: u64,
    unit: Option<usize>,
    deadline: Instant,
) -> stowage_client::Result<()> {
    let vals: Vec<Vec<u8>> = (0..FIELDS.len()).map(|f| value(row, version, f)).collect();
    let cols: Vec<(&str, Column<'_>)> = FIELDS
        .iter()
        .zip(&vals)
        .map(|(name, v)| {
            let t = Tensor {
                dtype: DType::U8,
                shape: vec![v.len() as u64],
                data: v,
            };
            (*name, Column::Jagged(vec![t]))
        })
        .collect();
    c.put("p", &[RowKey::Index(row)], &cols, unit, deadline)
}

/// What `row` holds now: `Ok(Some(version))` when its values are those of
/// a version in `may` (byte for byte), `Ok(None)` when it is not stored;
/// panics on bytes of no version it may hold.
fn get_row(
    c: &Client,
    row: u64,
    may: &May,
    deadline: Instant,
) -> stowage_client::Result<Option<u64>> {
    match c.get_tensors("p", &[RowKey::Index(row)], &FIELDS, None, deadline) {
        Ok(got) => {
            let version = may
                .iter()
                .flatten()
                .copied()
                .find(|&v| (0..FIELDS.len()).all(|f| got[f][0].data == value(row, v, f)));
            match version {
                Some(v) => Ok(Some(v)),
                None => panic!("row {row}: bytes of no version it may hold ({may:?})"),
            }
        }
        Err(Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Not a test on its own: a client of the tests below.
/// `STOWAGE_REPLICA_CHILD=index;transport;addr,addr,...`: loops over put,
/// get and clear of its own rows until its stdin closes, then reads every
/// row back and prints `DONE ops=… failed=… exact=…`.
#[test]
#[ignore = "a helper process of the replicas tests"]
fn replica_child() {
    let spec = std::env::var("STOWAGE_REPLICA_CHILD").expect("run only by the replicas tests");
    let mut parts = spec.split(';');
    let index: u64 = parts.next().unwrap().parse().unwrap();
    let shm = parts.next().unwrap() == "shm";
    let addrs: Vec<UnitAddr> = parts
        .next()
        .unwrap()
        .split(',')
        .map(|a| a.parse().unwrap())
        .collect();
    let mut cfg = ClientConfig::new("test", addrs);
    cfg.secret = child_secret();
    cfg.shm = shm;
    cfg.timeout = Duration::from_secs(4);
    cfg.replicas = 2;
    let c = std::sync::Arc::new(Client::connect(cfg).unwrap());
    // Repairs run while the loop puts, gets and clears.
    stowage_client::repair_in_background(&c);
    // Stdin closing is the word to stop.
    let (stop_tx, stop) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::stdin().lock().read_line(&mut line);
        let _ = stop_tx.send(());
    });
    let rows: Vec<u64> = (index * ROWS..(index + 1) * ROWS).collect();
    let mut may: BTreeMap<u64, May> = rows.iter().map(|&r| (r, May::from([None]))).collect();
    let (mut ops, mut failed) = (0u64, 0u64);
    // When each acknowledged put was made.
    let mut acked_at: Vec<Instant> = Vec::new();
    let mut version = 0u64;
    let mut x = index.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    println!("READY");
    std::io::stdout().flush().unwrap();
    while stop.try_recv().is_err() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let row = rows[(x % ROWS) as usize];
        let m = may.get_mut(&row).unwrap();
        let deadline = c.deadline();
        ops += 1;
        match (x >> 32) % 10 {
            0..=4 => {
                version += 1;
                match put_row(&c, row, version, deadline) {
                    Ok(()) => {
                        *m = May::from([Some(version)]);
                        acked_at.push(Instant::now());
                    }
                    Err(_) => {
                        failed += 1;
                        m.insert(Some(version));
                    }
                }
            }
            5..=7 => match get_row(&c, row, m, deadline) {
                // What it read, it holds; the other copy may differ only
                // where a put or clear failed, which `m` keeps.
                Ok(_) => {}
                Err(_) => failed += 1,
            },
            _ => match c.clear("p", &[RowKey::Index(row)], None, deadline) {
                Ok(_) => *m = May::from([None]),
                Err(_) => {
                    failed += 1;
                    m.insert(None);
                }
            },
        }
        assert!(
            Instant::now() < deadline + Duration::from_secs(2),
            "an operation ran 2 s past its deadline"
        );
    }
    // Puts acknowledged in the last second: after the fault, puts go in
    // again (the copies of a killed unit's rows go to the next unit up;
    // a paused one answers again).
    let stopped = Instant::now();
    let late = acked_at
        .iter()
        .filter(|&&t| stopped.duration_since(t) < Duration::from_secs(1))
        .count();
    // Every row read back: a row whose last put or clear was acknowledged
    // holds exactly that.
    let mut exact = 0;
    for &row in &rows {
        let m = &may[&row];
        let got = get_row(&c, row, m, c.deadline())
            .unwrap_or_else(|e| panic!("row {row} ({m:?}) could not be read: {e}"));
        if m.len() == 1 {
            assert_eq!(Some(&got), m.first(), "row {row}");
            exact += 1;
        }
    }
    let repaired = c.metrics().repaired_values;
    println!("DONE ops={ops} failed={failed} exact={exact} late={late} repaired={repaired}");
    std::io::stdout().flush().unwrap();
}

/// A shm client of `p` keeping `replicas` copies, 5 s deadlines.
fn copies_client(p: &LocalPlane, replicas: usize) -> Client {
    let mut cfg = ClientConfig::new("test", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(5);
    cfg.replicas = replicas;
    Client::connect(cfg).unwrap()
}

/// What a fault does to the unit it picks.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// SIGKILL: the unit and its copies are gone.
    Kill,
    /// SIGSTOP for longer than a client's deadline, then SIGCONT.
    Pause,
}

fn clients(p: &LocalPlane, transport: &str) -> Vec<(Reap, Receiver<String>)> {
    let addrs = if transport == "shm" {
        p.uds_addrs()
    } else {
        p.tcp_addrs()
    };
    let addrs: Vec<String> = addrs.iter().map(ToString::to_string).collect();
    (0..CLIENTS)
        .map(|i| {
            let spec = format!("{i};{transport};{}", addrs.join(","));
            spawn_reaped(
                helper_command(p, "replica_child", ("STOWAGE_REPLICA_CHILD", &spec))
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit()),
            )
        })
        .collect()
}

fn one_unit_fails_while_clients_loop(transport: &str, fault: Fault) {
    let (mut p, _) = plane(UNITS, 64 * MIB, &[]);
    let children = clients(&p, transport);
    await_clients(&children);
    std::thread::sleep(Duration::from_millis(1500));
    let victim = 1;
    match fault {
        Fault::Kill => p.kill9(victim),
        Fault::Pause => {
            let pid = p.units[victim].pid();
            p.units[victim]
                .signal(rustix::process::Signal::STOP)
                .unwrap();
            assert!(eventually(Duration::from_secs(5), || is_stopped(pid)));
            // Past every client's 4 s deadline.
            std::thread::sleep(Duration::from_secs(5));
            p.units[victim]
                .signal(rustix::process::Signal::CONT)
                .unwrap();
        }
    }
    std::thread::sleep(Duration::from_millis(2500));
    stop_and_check(children);
    if let Fault::Kill = fault {
        // After repair every row has its 2 copies, each on the units its
        // copies are placed on now.
        let c = copies_client(&p, 2);
        let rows: Vec<u64> = (0..CLIENTS as u64 * ROWS).collect();
        learn_down(&c, &rows);
        repair_all(&c);
        let checked = copies_are_where_they_belong(&p, &c, &[victim], &|r| c.unit_of_row(r));
        assert!(checked > 0, "no row left to check");
    }
}

/// Read `rows` with `c` (values not checked) so that it meets a dead unit
/// and places its copies anew.
fn learn_down(c: &Client, rows: &[u64]) {
    for &r in rows {
        let _ = c.get_tensors("p", &[RowKey::Index(r)], &FIELDS, None, c.deadline());
    }
    assert!(c.repairs_pending() > 0, "the client met no dead unit");
}

/// Repair passes with `c` until it knows of no repair due (bounded).
fn repair_all(c: &Client) -> stowage_client::Repaired {
    let until = Instant::now() + Duration::from_secs(60);
    let mut all = stowage_client::Repaired::default();
    loop {
        let r = c.repair(c.deadline()).unwrap();
        all.values += r.values;
        all.bytes += r.bytes;
        all.skipped += r.skipped;
        all.done += r.done;
        if c.repairs_pending() == 0 {
            return all;
        }
        assert!(Instant::now() < until, "repairs still due: {:?}", r.errors);
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Wait for every client's `READY`.
fn await_clients(children: &[(Reap, Receiver<String>)]) {
    for (_, lines) in children {
        expect_line(lines, "READY", Duration::from_secs(30));
    }
}

/// Tell every client to stop, and check what each says: its rows read
/// back as their last acknowledged put or clear left them, a put went in
/// after the fault, and it exited cleanly.
fn stop_and_check(mut children: Vec<(Reap, Receiver<String>)>) {
    for (child, _) in &mut children {
        drop(child.0.stdin.take());
    }
    let mut acked = 0;
    for (i, (child, lines)) in children.iter_mut().enumerate() {
        let done = expect_line(lines, "DONE", Duration::from_secs(60));
        let exact: u64 = done
            .split_whitespace()
            .find_map(|w| w.strip_prefix("exact="))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("client {i}: {done}"));
        acked += exact;
        let late: u64 = done
            .split_whitespace()
            .find_map(|w| w.strip_prefix("late="))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert!(
            late > 0,
            "client {i}: no put went in after the fault: {done}"
        );
        let status = child.0.wait().unwrap();
        assert!(status.success(), "client {i} failed: {status}");
        eprintln!("client {i}: {done}");
    }
    // Rows whose put or clear was acknowledged are most rows: the check
    // above had something to check.
    assert!(
        acked >= (CLIENTS as u64 * ROWS) / 2,
        "only {acked} rows were checked exactly"
    );
}

#[test]
fn a_unit_killed_under_eight_clients_loses_no_acknowledged_row_shm() {
    one_unit_fails_while_clients_loop("shm", Fault::Kill);
}

#[test]
fn a_unit_killed_under_eight_clients_loses_no_acknowledged_row_tcp() {
    one_unit_fails_while_clients_loop("tcp", Fault::Kill);
}

#[test]
fn a_unit_paused_past_the_deadline_under_eight_clients_serves_nothing_wrong() {
    one_unit_fails_while_clients_loop("shm", Fault::Pause);
}

/// Two hosts (network namespaces, one unit each), 8 client processes on
/// a third looping over tcp with 2 copies of every row; one host's link
/// goes down past every deadline, then up again. Puts and clears of its
/// copies fail within their deadlines meanwhile (the unit is not known to
/// be dead, so nothing goes on without it), gets read the other host's
/// copy; after, no row is other than its last acknowledged put or clear
/// left it, and puts go in again.
#[test]
fn a_host_cut_off_under_eight_clients_serves_nothing_wrong() {
    let tag = format!("stwr{}", std::process::id() % 100_000);
    let Some(mut hosts) = hosts_or_skip(&tag) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let secret = write_secret(dir.path());
    for (h, addr) in [("a", UNIT_A), ("b", UNIT_B)] {
        let unit = start_unit(&format!("{tag}{h}"), addr, &secret);
        hosts.procs.push(unit);
    }
    let addrs = format!("tcp:{UNIT_A},tcp:{UNIT_B}");
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..CLIENTS)
        .map(|i| {
            spawn_reaped(
                Command::new("ip")
                    .args(["netns", "exec", &format!("{tag}c")])
                    .arg(&exe)
                    .args(["--exact", "replica_child", "--ignored", "--nocapture"])
                    .args(["--test-threads=1"])
                    .env("STOWAGE_REPLICA_CHILD", format!("{i};tcp;{addrs}"))
                    .env("STOWAGE_TEST_SECRET_FILE", &secret)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit()),
            )
        })
        .collect();
    await_clients(&children);
    std::thread::sleep(Duration::from_millis(1500));
    let link = format!("{tag}ac");
    let host_a = format!("{tag}a");
    ip(&["-n", &host_a, "link", "set", &link, "down"]).unwrap();
    // Past every client's 4 s deadline.
    std::thread::sleep(Duration::from_secs(5));
    ip(&["-n", &host_a, "link", "set", &link, "up"]).unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    stop_and_check(children);
    let names = hosts.names.clone();
    drop(hosts);
    for n in names {
        assert!(!netns_listed(&n), "namespace {n} left behind");
    }
}

/// More copies than units is refused at connect, naming both numbers.
#[test]
fn more_copies_than_units_is_refused() {
    let (p, _) = plane(2, 16 * MIB, &[]);
    let mut cfg = ClientConfig::new("test", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.replicas = 3;
    match Client::connect(cfg) {
        Err(Error::InvalidRequest(m)) => assert!(m.contains("replicas = 3 for 2 units"), "{m}"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("3 copies on 2 units was accepted"),
    }
}

/// With 2 copies a get reads the other copy of a killed unit's rows, and
/// a clear of them succeeds on the copy left; with 1 copy the same kill
/// loses them (the test above would catch a plane that kept only one).
#[test]
fn the_second_copy_serves_a_killed_units_rows_and_one_copy_does_not() {
    for replicas in [1, 2] {
        let (mut p, _) = plane(UNITS, 16 * MIB, &[]);
        let c = copies_client(&p, replicas);
        let rows: Vec<u64> = (0..16).collect();
        for &r in &rows {
            put_row(&c, r, 1, c.deadline()).unwrap();
        }
        // Each copy is on its own unit: unit 1 holds rows 1, 5, 9, 13 and,
        // with 2 copies, rows 0, 4, 8, 12 as their second copy.
        let held = c.stats(c.deadline());
        let rows_of = |u: usize| held[u].as_ref().unwrap().rows;
        assert_eq!(rows_of(1), 4 * replicas as u64, "rows of unit 1");
        p.kill9(1);
        let one = May::from([Some(1)]);
        for &r in &rows {
            let got = get_row(&c, r, &one, c.deadline());
            if replicas == 2 || r % UNITS as u64 != 1 {
                assert_eq!(got, Ok(Some(1)), "row {r}, {replicas} copies");
            } else {
                assert!(
                    matches!(got, Err(Error::LostKeys { unit: 1, .. })),
                    "row {r}, 1 copy: {got:?}"
                );
            }
        }
        if replicas == 2 {
            c.clear("p", &[RowKey::Index(5)], None, c.deadline())
                .unwrap();
            assert_eq!(get_row(&c, 5, &one, c.deadline()), Ok(None));
            // The killed unit's rows are placed on the next units up: a
            // put of row 1 goes to units 2 (which held its other copy)
            // and 3, 2 copies again; row 16's (unit 0's) to units 0 and 2.
            let before = c.stats(c.deadline());
            let rows_of = |s: &[stowage_client::Result<stowage_client::Stats>], u: usize| {
                s[u].as_ref().unwrap().rows
            };
            put_row(&c, 1, 2, c.deadline()).unwrap();
            put_row(&c, 16, 2, c.deadline()).unwrap();
            let after = c.stats(c.deadline());
            assert_eq!(
                rows_of(&after, 0),
                rows_of(&before, 0) + 1,
                "row 16 on unit 0"
            );
            assert_eq!(
                rows_of(&after, 2),
                rows_of(&before, 2) + 1,
                "row 16 on unit 2"
            );
            assert_eq!(
                rows_of(&after, 3),
                rows_of(&before, 3) + 1,
                "row 1 on unit 3"
            );
            let two = May::from([Some(2)]);
            assert_eq!(get_row(&c, 1, &two, c.deadline()), Ok(Some(2)));
            // Another client, which has not met the dead unit yet, reads
            // and clears where the copies are now.
            let other = copies_client(&p, 2);
            assert_eq!(get_row(&other, 1, &two, other.deadline()), Ok(Some(2)));
            other
                .clear("p", &[RowKey::Index(1)], None, other.deadline())
                .unwrap();
            assert_eq!(get_row(&c, 1, &two, c.deadline()), Ok(None));
            assert_eq!(get_row(&other, 1, &two, other.deadline()), Ok(None));
        }
    }
}

/// After a unit is killed, a repair gives its rows, and the rows it held
/// a second copy of, their 2 copies again on the units placed now (rows
/// put on the unit a caller named too): what a client that has not
/// repaired sees missing (`under_replicated`) is copied, exact to the
/// byte, and a row cleared after the kill is not brought back. Another
/// client's pass finds nothing left to copy.
#[test]
fn a_repair_gives_every_row_its_copies_again_and_brings_back_no_cleared_row() {
    let (mut p, _) = plane(UNITS, 16 * MIB, &[]);
    let c = copies_client(&p, 2);
    let rows: Vec<u64> = (0..68).collect();
    // Rows 64..68 on unit 1, which the caller names.
    let home = |r: u64| if r >= 64 { 1 } else { c.unit_of_row(r) };
    for &r in &rows {
        let named = (r >= 64).then_some(1);
        put_row_on(&c, r, 1, named, c.deadline()).unwrap();
    }
    p.kill9(1);
    learn_down(&c, &rows[..64]);
    // Unit 0's rows (second copy was on 1) and unit 1's (first on 1).
    assert_eq!(c.repairs_pending(), 2);
    let cleared: Vec<u64> = (0..16).collect();
    let keys: Vec<RowKey> = cleared.iter().map(|&r| RowKey::Index(r)).collect();
    c.clear("p", &keys, None, c.deadline()).unwrap();
    let mut short = c.under_replicated(c.deadline()).unwrap();
    short.sort_by_key(|s| s.unit);
    // 12 rows of each of units 0 and 1 are left of the 16 each had, 2
    // values each; and unit 1's 4 named rows, 3 values each (the third
    // records the unit named) but row 65, whose own unit is 1 anyway.
    let found: Vec<_> = short
        .iter()
        .map(|s| (s.unit, s.source, s.target, s.rows, s.values))
        .collect();
    assert_eq!(found, [(0, 0, 2, 12, 24), (1, 2, 3, 16, 35)], "{short:?}");
    let r = repair_all(&c);
    assert_eq!((r.done, r.values, r.skipped), (2, 59, 0), "{r:?}");
    let m = c.metrics();
    assert_eq!((m.repaired_values, m.repairs_pending), (59, 0));
    assert_eq!(copies_are_where_they_belong(&p, &c, &[1], &home), 52);
    // Every copy reads back exact: each unit's alone.
    let one = May::from([Some(1)]);
    let mut read = 0;
    for u in [0, 2, 3] {
        let alone = unit_alone(&p, u);
        for &r in &rows[16..] {
            if c.copies_of(home(r)).contains(&u) {
                let got = get_row(&alone, r, &one, alone.deadline());
                assert_eq!(got, Ok(Some(1)), "row {r} on unit {u}");
                read += 1;
            }
        }
        for &r in &cleared {
            let got = get_row(&alone, r, &one, alone.deadline());
            assert_eq!(got, Ok(None), "cleared row {r} on unit {u}");
        }
    }
    assert_eq!(read, 2 * 52);
    // Another client, which has not repaired: its pass reads the marks
    // the newcomers got and lists nothing, and it finds nothing missing.
    let other = copies_client(&p, 2);
    learn_down(&other, &rows[..64]);
    let lists = || -> u64 {
        [0, 2, 3]
            .iter()
            .map(|&u| metric_with(&p, u, "stowage_operations_total", "op=\"list\""))
            .sum()
    };
    let before = lists();
    let again = repair_all(&other);
    // Both pairs settled by their marks: none repaired by this pass.
    assert_eq!(
        (again.done, again.left, again.values),
        (0, 0, 0),
        "{again:?}"
    );
    assert_eq!(other.repairs_pending(), 0);
    assert_eq!(lists(), before, "a marked pair was listed");
    let short = other.under_replicated(other.deadline()).unwrap();
    assert!(short.iter().all(|s| s.values == 0), "{short:?}");
    // The marks are not a partition of the client's.
    assert_eq!(other.partitions(other.deadline()).unwrap(), ["p"]);
}

/// A repair that read a row's value from the copy left, and a clear of
/// the row that lands before the repair sends the value on: the newcomer
/// refuses the value (its repair window saw the row cleared), so the row
/// is gone from every unit; a row not cleared gets its copy. And a clear
/// reaches the newcomer again after the other copies (counted on each
/// unit): the order the repair window's guarantee rests on.
#[test]
fn a_row_cleared_while_a_repair_holds_its_value_is_not_brought_back() {
    let (mut p, _) = plane(UNITS, 16 * MIB, &[]);
    let c = copies_client(&p, 2);
    // Rows 0 and 4: unit 0's, copies on 0 and 1; row 2: unit 2's.
    for r in [0, 2, 4] {
        put_row(&c, r, 1, c.deadline()).unwrap();
    }
    p.kill9(1);
    // A read of unit 1's row 1 meets the dead unit.
    learn_down(&c, &[1]);
    assert_eq!(&c.copies_of(0)[..], &[0, 2], "unit 2 is the newcomer");
    let clears = |u: usize| metric_with(&p, u, "stowage_operations_total", "op=\"release_rows\"");
    let before: Vec<u64> = [0, 2, 3].iter().map(|&u| clears(u)).collect();
    // A row of a newcomer's: units 0 and 2 once, then unit 2 again; a row
    // of unit 2's (copies on 2 and 3, neither new): each once.
    c.clear("p", &[RowKey::Index(8)], None, c.deadline())
        .unwrap();
    c.clear("p", &[RowKey::Index(6)], None, c.deadline())
        .unwrap();
    let after: Vec<u64> = [0, 2, 3].iter().map(|&u| clears(u)).collect();
    let sent: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert_eq!(sent, [1, 3, 1], "ClearRows answered by units 0, 2, 3");

    // The repairer stops after reading unit 0's rows from unit 0.
    let gate = std::process::id() ^ 0x5eed;
    let dir = std::env::temp_dir();
    let open = dir.join(format!("stowage-repair-gate-{gate}"));
    let reached = dir.join(format!("stowage-repair-gate-{gate}.reached"));
    let _ = std::fs::remove_file(&open);
    let _ = std::fs::remove_file(&reached);
    let mut cfg = ClientConfig::new("test", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.replicas = 2;
    cfg.failpoints.repair_gate = Some(gate);
    let r = Client::connect(cfg).unwrap();
    r.unit_gone(1);
    let repairer = std::thread::spawn(move || {
        let done = r.repair(Instant::now() + Duration::from_secs(60));
        (done, r)
    });
    assert!(
        eventually(Duration::from_secs(30), || reached.exists()),
        "the repair never read its batch"
    );
    c.clear("p", &[RowKey::Index(0)], None, c.deadline())
        .unwrap();
    std::fs::write(&open, b"").unwrap();
    let (done, r) = repairer.join().unwrap();
    let done = done.unwrap();
    let _ = std::fs::remove_file(&open);
    let _ = std::fs::remove_file(&reached);
    // Unit 0's pair: row 4's 2 values stored; of row 0, what the repair
    // had read before the clear refused (its first batch: at least one
    // value), the rest not found at the source any more. Unit 1's pair:
    // nothing (rows 1, 5... were never put).
    assert_eq!((done.left, done.values), (0, 2), "{done:?}");
    assert!(done.skipped >= 1, "nothing refused: {done:?}");
    assert_eq!(r.repairs_pending(), 0);
    let one = May::from([Some(1)]);
    for u in [0, 2, 3] {
        let alone = unit_alone(&p, u);
        assert_eq!(
            get_row(&alone, 0, &one, alone.deadline()),
            Ok(None),
            "row 0 on unit {u}"
        );
    }
    let home = |row: u64| c.unit_of_row(row);
    assert_eq!(
        copies_are_where_they_belong(&p, &c, &[1], &home),
        2,
        "rows 2 and 4"
    );
}

/// Rows left with one copy each (what units restarted from a checkpoint
/// that kept one copy hold) get their second copy back from
/// `rebuild_copies`, every row on the units its copies are placed on; a
/// second rebuild copies nothing.
#[test]
fn rebuild_copies_gives_rows_left_with_one_copy_their_copies_again() {
    let (p, _) = plane(UNITS, 16 * MIB, &[]);
    let c = copies_client(&p, 2);
    let rows: Vec<u64> = (0..32).collect();
    for &r in &rows {
        put_row(&c, r, 1, c.deadline()).unwrap();
    }
    // Each unit keeps its own rows only.
    for u in 0..UNITS {
        let alone = unit_alone(&p, u);
        let others: Vec<RowKey> = rows
            .iter()
            .filter(|&&r| c.unit_of_row(r) != u)
            .map(|&r| RowKey::Index(r))
            .collect();
        // The 8 rows it held a second copy of, 2 values each.
        assert_eq!(
            alone.clear("p", &others, None, alone.deadline()).unwrap(),
            8 * 2
        );
    }
    let r = c.rebuild_copies(c.deadline()).unwrap();
    // 4 units' rows, each from its first copy to its second and back.
    assert_eq!(
        (r.done, r.left, r.values, r.skipped),
        (8, 0, 64, 0),
        "{r:?}"
    );
    let home = |row: u64| c.unit_of_row(row);
    assert_eq!(copies_are_where_they_belong(&p, &c, &[], &home), 32);
    let again = c.rebuild_copies(c.deadline()).unwrap();
    assert_eq!((again.done, again.values), (8, 0), "{again:?}");
    let one = May::from([Some(1)]);
    for &r in &rows {
        assert_eq!(get_row(&c, r, &one, c.deadline()), Ok(Some(1)), "row {r}");
    }
}

/// `stowage repair --directory FILE` finds a killed unit dead and gives
/// its rows, and the rows it held a copy of, their copies on the units up;
/// a second run has nothing left to copy.
#[test]
fn stowage_repair_gives_a_killed_units_rows_their_copies_again() {
    let (mut p, _) = plane(UNITS, 16 * MIB, &[]);
    let c = copies_client(&p, 2);
    for r in 0..32 {
        put_row(&c, r, 1, c.deadline()).unwrap();
    }
    p.kill9(1);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dir.json");
    let mut d = p.directory();
    d.replicas = 2;
    d.write_file(&file).unwrap();
    let repair = || stowage_repair(&file, &[]);
    // Units 0's and 1's rows: 8 rows each, 2 values a row.
    let text = repair();
    assert!(
        text.contains("repaired 2 pairs") && text.contains(": 32 values"),
        "{text}"
    );
    c.unit_gone(1);
    let home = |row: u64| c.unit_of_row(row);
    assert_eq!(copies_are_where_they_belong(&p, &c, &[1], &home), 32);
    let text = repair();
    assert!(text.contains(": 0 values"), "{text}");
}

/// `stowage repair --directory FILE` in namespace `test` with `extra`
/// arguments, within 60 s: what it printed (it must succeed).
fn stowage_repair(file: &std::path::Path, extra: &[&str]) -> String {
    let out = Command::new(binary())
        .args(["repair", "--directory", file.to_str().unwrap()])
        .args(["--namespace", "test", "--within", "60s"])
        .args(extra)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// `stowage repair --rejoin 1` (docs/replication.md#rejoining) with a
/// plane's directory file: unit 1, killed and started again at its
/// address, is taken back in and filled; a client of the old view then
/// finds every row on exactly the units of its copies, unit 1 among them,
/// and reads each as put. Run again, it finds unit 1 a member already.
#[test]
fn stowage_repair_rejoin_takes_a_unit_started_again_back_in() {
    let (mut p, opts) = plane(UNITS, 16 * MIB, &[]);
    let c = copies_client(&p, 2);
    for r in 0..32 {
        put_row(&c, r, 1, c.deadline()).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dir.json");
    let mut d = p.directory();
    d.replicas = 2;
    d.write_file(&file).unwrap();
    p.kill9(1);
    p.restart(1, &opts).expect("unit 1 starts again");
    let rejoin = || stowage_repair(&file, &["--rejoin", "1"]);
    let text = rejoin();
    assert!(
        text.contains("unit 1 rejoined as instance")
            && text.contains("the plane's view 1 (4 units moved)"),
        "{text}"
    );
    // Units 0's and 1's rows on unit 1 again: 8 rows each, 2 values a row.
    assert!(
        text.contains("repaired 2 pairs") && text.contains(": 32 values"),
        "{text}"
    );
    let one = May::from([Some(1)]);
    for r in 0..32 {
        assert_eq!(get_row(&c, r, &one, c.deadline()), Ok(Some(1)), "row {r}");
    }
    assert_eq!(c.plane_view().epoch, 1);
    assert!(c.copies_of(0).contains(&1) && c.copies_of(1).contains(&1));
    let home = |row: u64| c.unit_of_row(row);
    assert_eq!(copies_are_where_they_belong(&p, &c, &[], &home), 32);
    let text = rejoin();
    assert!(text.contains("unit 1 is a member already"), "{text}");
}

/// Not a test on its own: a repairer of the test below.
/// `STOWAGE_REPAIR_CHILD=dead_unit;addr,addr,...` (with the `repair-gate`
/// failpoint set): takes the unit as gone, runs one repair pass and
/// prints `DONE done=… left=… values=…`.
#[test]
#[ignore = "a helper process of the replicas tests"]
fn repair_child() {
    let spec = std::env::var("STOWAGE_REPAIR_CHILD").expect("run only by the replicas tests");
    let (dead, addrs) = spec.split_once(';').unwrap();
    let addrs: Vec<UnitAddr> = addrs.split(',').map(|a| a.parse().unwrap()).collect();
    let mut cfg = ClientConfig::new("test", addrs);
    cfg.secret = child_secret();
    cfg.replicas = 2;
    cfg.timeout = Duration::from_secs(10);
    assert!(cfg.failpoints.repair_gate.is_some(), "the gate is set");
    let c = Client::connect(cfg).unwrap();
    c.unit_gone(dead.parse().unwrap());
    let r = c.repair(Instant::now() + Duration::from_secs(60)).unwrap();
    println!("DONE done={} left={} values={}", r.done, r.left, r.values);
    std::io::stdout().flush().unwrap();
}

/// A repairer stopped (SIGSTOP) in the middle of a repair, its window open
/// on the newcomer, past the units' repair window lease: another client
/// takes the window over and repairs, and once the first continues, the
/// values it had read are refused (its window lost) — nothing it held is
/// stored, every row ends on its 2 copies, exact.
#[test]
fn a_repairer_stopped_mid_repair_is_taken_over_and_stores_nothing_after() {
    let (mut p, _) = plane(UNITS, 16 * MIB, &["--repair-window-lease", "2s"]);
    let c = copies_client(&p, 2);
    for r in 0..32 {
        put_row(&c, r, 1, c.deadline()).unwrap();
    }
    p.kill9(1);
    let gate = std::process::id() ^ 0x57_0a;
    let dir = std::env::temp_dir();
    let open = dir.join(format!("stowage-repair-gate-{gate}"));
    let reached = dir.join(format!("stowage-repair-gate-{gate}.reached"));
    let _ = std::fs::remove_file(&open);
    let _ = std::fs::remove_file(&reached);
    let addrs: Vec<String> = p.uds_addrs().iter().map(ToString::to_string).collect();
    let spec = format!("1;{}", addrs.join(","));
    let (mut child, lines) = spawn_reaped(
        helper_command(&p, "repair_child", ("STOWAGE_REPAIR_CHILD", &spec))
            .env("STOWAGE_FAILPOINTS", format!("repair-gate={gate}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit()),
    );
    assert!(
        eventually(Duration::from_secs(30), || reached.exists()),
        "the repairer never read its first batch"
    );
    let pid = child.0.id();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::STOP,
    )
    .unwrap();
    assert!(eventually(Duration::from_secs(5), || is_stopped(pid)));
    std::fs::write(&open, b"").unwrap();
    // Past the lease (2 s), another client repairs everything.
    std::thread::sleep(Duration::from_millis(2500));
    let other = copies_client(&p, 2);
    other.unit_gone(1);
    let r = repair_all(&other);
    assert_eq!((r.done, r.values), (2, 32), "{r:?}");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::CONT,
    )
    .unwrap();
    let done = expect_line(&lines, "DONE", Duration::from_secs(60));
    // Its first pair's window was taken over: nothing of it stored; its
    // second pair it found marked.
    assert_eq!(done, "DONE done=1 left=1 values=0", "{done}");
    assert!(child.0.wait().unwrap().success());
    let _ = std::fs::remove_file(&open);
    let _ = std::fs::remove_file(&reached);
    c.unit_gone(1);
    let home = |row: u64| c.unit_of_row(row);
    assert_eq!(copies_are_where_they_belong(&p, &c, &[1], &home), 32);
    let one = May::from([Some(1)]);
    for r in 0..32 {
        assert_eq!(get_row(&c, r, &one, c.deadline()), Ok(Some(1)), "row {r}");
    }
}

/// Two deaths one after the other: after the first, one client repairs
/// (its newcomers get their marks) and goes away; after the second, the
/// copies left of some rows are only those newcomers. A client that never
/// repaired reads their marks, takes them as whole, and repairs from them
/// (and a checkpoint writes those rows from them): every row ends on 2 of
/// the 2 units left, exact.
#[test]
fn after_a_second_death_a_client_repairs_from_newcomers_another_client_filled() {
    let ckpt = tempfile::tempdir().unwrap();
    let root = ckpt.path().display().to_string();
    let (mut p, _) = plane(UNITS, 16 * MIB, &["--checkpoint-root", &root]);
    let rows: Vec<u64> = (0..32).collect();
    {
        let first = copies_client(&p, 2);
        for &r in &rows {
            put_row(&first, r, 1, first.deadline()).unwrap();
        }
        p.kill9(1);
        first.unit_gone(1);
        repair_all(&first);
        // Unit 0's rows: on 0 and 2 (the newcomer, marked).
        assert_eq!(&first.copies_of(0)[..], &[0, 2]);
    }
    p.kill9(0);
    // A checkpoint by a client that never repaired: the marked newcomer
    // is the source of unit 0's rows, so each row is written once.
    let ck = copies_client(&p, 2);
    ck.unit_gone(1);
    ck.unit_gone(0);
    let info = ck
        .checkpoint(&ckpt.path().join("c1"), ck.deadline())
        .unwrap();
    let written: u64 = info.iter().map(|i| i.rows).sum();
    assert_eq!(written, rows.len() as u64, "{info:?}");
    let c = copies_client(&p, 2);
    c.unit_gone(1);
    c.unit_gone(0);
    // Unit 0's rows: left on 2 only (not of its first placement); the
    // newcomer is 3.
    assert_eq!(&c.copies_of(0)[..], &[2, 3]);
    let r = repair_all(&c);
    assert_eq!(r.left, 0, "{r:?}");
    let home = |row: u64| c.unit_of_row(row);
    assert_eq!(copies_are_where_they_belong(&p, &c, &[0, 1], &home), 32);
    let one = May::from([Some(1)]);
    for &r in &rows {
        assert_eq!(get_row(&c, r, &one, c.deadline()), Ok(Some(1)), "row {r}");
    }
}

/// A view of rows whose unit was killed pins and maps their other copy;
/// with 1 copy the same view fails naming the lost unit.
#[test]
fn a_view_maps_the_other_copy_of_a_killed_units_rows() {
    for replicas in [1, 2] {
        let (mut p, _) = plane(UNITS, 16 * MIB, &[]);
        let c = std::sync::Arc::new(copies_client(&p, replicas));
        let rows: Vec<u64> = (0..8).collect();
        for &r in &rows {
            put_row(&c, r, 3, c.deadline()).unwrap();
        }
        p.kill9(1);
        let keys: Vec<RowKey> = rows.iter().map(|&r| RowKey::Index(r)).collect();
        let view = c.view("p", &keys, &FIELDS, None, c.deadline());
        if replicas == 1 {
            assert!(
                matches!(view, Err(Error::LostKeys { unit: 1, .. })),
                "1 copy: {:?}",
                view.err()
            );
            continue;
        }
        let view = view.expect("2 copies: the view maps the copies left");
        for (f, _) in FIELDS.iter().enumerate() {
            for (i, &r) in rows.iter().enumerate() {
                assert_eq!(view.to_vec(&view.field(f)[i]), value(r, 3, f), "row {r}");
            }
        }
    }
}

/// A unit restarted empty at the same address is another instance: the
/// client reads its rows from their other copies, takes it as down, and
/// puts no copy there any more.
#[test]
fn a_restarted_unit_is_read_around_and_takes_no_copy() {
    let (mut p, opts) = plane(UNITS, 16 * MIB, &[]);
    let c = copies_client(&p, 2);
    let rows: Vec<u64> = (0..8).collect();
    for &r in &rows {
        put_row(&c, r, 1, c.deadline()).unwrap();
    }
    p.restart(1, &opts).expect("unit 1 restarts");
    let one = May::from([Some(1)]);
    for &r in &rows {
        assert_eq!(get_row(&c, r, &one, c.deadline()), Ok(Some(1)), "row {r}");
    }
    for &r in &rows {
        put_row(&c, r, 2, c.deadline()).unwrap();
    }
    let stats = c.stats(c.deadline());
    assert_eq!(
        stats[1].as_ref().unwrap().rows,
        0,
        "the restarted unit took a copy"
    );
    // 8 rows, 2 copies each, on the 3 units left.
    let held: u64 = [0, 2, 3]
        .iter()
        .map(|&u| stats[u].as_ref().unwrap().rows)
        .sum();
    assert_eq!(held, 16);
    // The client's metrics say so.
    let mut registry = prometheus_client::registry::Registry::default();
    c.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for line in [
        "stowage_client_copies 2",
        "stowage_client_units_down 1",
        "stowage_client_copies_short_of_hosts 0",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in {text}");
    }
}

/// With 2 copies, a list names each row once (with its fields), also
/// after a unit holding copies is killed; the partition is still listed.
#[test]
fn a_list_names_each_row_once_and_survives_a_killed_unit() {
    let (mut p, _) = plane(3, 16 * MIB, &[]);
    let c = copies_client(&p, 2);
    let names: Vec<RowKey> = (0..6).map(|i| RowKey::Name(format!("r{i}"))).collect();
    let v = [7u8; 16];
    let t = || Tensor {
        dtype: DType::U8,
        shape: vec![16],
        data: &v,
    };
    c.put(
        "p",
        &names,
        &[("x", Column::Jagged((0..6).map(|_| t()).collect()))],
        None,
        c.deadline(),
    )
    .unwrap();
    let want: Vec<(RowKey, Vec<String>)> = {
        let mut w: Vec<_> = names
            .iter()
            .map(|k| (k.clone(), vec!["x".to_owned()]))
            .collect();
        w.sort();
        w
    };
    assert_eq!(c.list("p", c.deadline()).unwrap(), want);
    p.kill9(1);
    assert_eq!(c.list("p", c.deadline()).unwrap(), want);
    assert_eq!(c.partitions(c.deadline()).unwrap(), vec!["p".to_owned()]);
}
