//! A unit taken as down on a word that is not proof — its directory's
//! (Ray says its actor is dead), or its caller's (`Client::unit_gone`) —
//! while it may still serve (docs/replication.md#fencing), with real unit
//! processes: it is fenced before anything is written around it (it
//! refuses every request, and exits), or, paused, once it answers again;
//! no client reads from it after, so none reads a row as it was before
//! it was rewritten or cleared around it. A unit started again in its
//! place comes back only by rejoining (docs/replication.md#rejoining):
//! empty, in a new view of the plane that every client is moved to, and
//! filled by repair; no client reads a stale or cleared row from it.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use stowage_client::{Client, ClientConfig, Column, DType, Error, RowKey, Tensor, UnitAddr};
use stowage_local::LocalPlane;
use stowage_wire::{ErrorCode, Member, PlaneView, Request, Response};

const MIB: u64 = 1 << 20;
const ROWS: u64 = 30;

fn copies_client(p: &LocalPlane) -> Client {
    let mut cfg = ClientConfig::new("test", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(5);
    cfg.replicas = 2;
    Client::connect(cfg).unwrap()
}

fn value(row: u64, version: u64) -> Vec<u8> {
    pattern(row, version, 20_000 + row as usize * 64)
}

fn put_all(c: &Client, version: u64) {
    put_rows(c, 0..ROWS, version);
}

fn put_rows(c: &Client, rows: std::ops::Range<u64>, version: u64) {
    for row in rows {
        let v = value(row, version);
        let t = Tensor {
            dtype: DType::U8,
            shape: vec![v.len() as u64],
            data: &v,
        };
        c.put(
            "p",
            &[RowKey::Index(row)],
            &[("x", Column::Jagged(vec![t]))],
            None,
            c.deadline(),
        )
        .unwrap();
    }
}

/// Every row read with `c`: rows below `cleared_from` hold `version`,
/// the others are not found.
fn reads_back(c: &Client, version: u64, cleared_from: u64) {
    reads_as(c, &|row| (row < cleared_from).then_some(version));
}

/// Every row read with `c` holds the version `want` says, or is not found
/// (`None`).
fn reads_as(c: &Client, want: &dyn Fn(u64) -> Option<u64>) {
    for row in 0..ROWS {
        let got = c.get_tensors("p", &[RowKey::Index(row)], &["x"], None, c.deadline());
        if let Some(version) = want(row) {
            let got = got.unwrap_or_else(|e| panic!("row {row}: {e}"));
            assert!(
                got[0][0].data == value(row, version),
                "row {row}: not the bytes of version {version}"
            );
        } else {
            assert!(
                matches!(got, Err(Error::NotFound { .. })),
                "row {row} was cleared: {:?}",
                got.map(|_| "its bytes")
            );
        }
    }
}

/// Whether process `pid` is gone (exited, reaped or a zombie).
fn exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('Z')))
        .unwrap_or(true)
}

/// Unit `u` of `p`, paused and taken as down, has not exited; continued,
/// it is fenced (it exits) within 10 s.
fn continued_it_is_fenced(p: &LocalPlane, u: usize) {
    let pid = p.units[u].pid();
    assert!(!exited(pid), "a paused unit exited");
    p.units[u].signal(rustix::process::Signal::CONT).unwrap();
    assert!(
        eventually(Duration::from_secs(10), || exited(pid)),
        "the unit was not fenced once it answered"
    );
}

/// A raw connection to the unit at `path` that said Hello, and the
/// unit's instance.
fn hello_instance(path: &std::path::Path) -> (Raw, u128) {
    let mut r = Raw::connect(path);
    match r.call(&Request::Hello {
        version: stowage_wire::PROTOCOL_VERSION,
        namespace: "ns".into(),
        want_fd: false,
        session: None,
    }) {
        Response::Hello { instance_id, .. } => (r, instance_id),
        other => panic!("{other:?}"),
    }
}

fn socket(p: &LocalPlane, u: usize) -> PathBuf {
    match &p.uds_addrs()[u] {
        UnitAddr::Unix(path) => path.clone(),
        other => panic!("{other:?}"),
    }
}

/// Unit 1 is taken as down while it serves (`unit_gone`): it is fenced
/// and exits, and then rows are rewritten and cleared around it. A client
/// that read every row from it before, and a new client, read the new
/// bytes, and the cleared rows are not found. (Without the fence, unit 1
/// went on serving the old bytes of its rows to both.)
#[test]
fn a_unit_taken_as_down_while_it_serves_is_fenced_before_rows_are_written_around_it() {
    let (p, _) = plane(3, 64 * MIB, &[]);
    let a = copies_client(&p);
    put_all(&a, 1);
    let stale = copies_client(&p);
    reads_back(&stale, 1, ROWS);
    let pid = p.units[1].pid();
    let took = Instant::now();
    a.unit_gone(1);
    assert!(
        took.elapsed() < Duration::from_secs(2),
        "unit_gone took {:?}",
        took.elapsed()
    );
    assert!(
        eventually(Duration::from_secs(10), || exited(pid)),
        "the fenced unit did not exit"
    );
    assert!(!a.copies_of(1).contains(&1), "unit 1 is not down");
    put_all(&a, 2);
    let rows: Vec<RowKey> = (20..ROWS).map(RowKey::Index).collect();
    a.clear("p", &rows, None, a.deadline()).unwrap();
    reads_back(&stale, 2, 20);
    reads_back(&copies_client(&p), 2, 20);
}

/// Unit 1 is taken as down while it is paused (SIGSTOP): the fence finds
/// no answer, rows are rewritten around it, and once it is continued the
/// background repairer fences it (it exits, within a few seconds); a new
/// client then reads the new bytes.
#[test]
fn a_unit_taken_as_down_while_paused_is_fenced_once_it_answers() {
    let (p, _) = plane(3, 64 * MIB, &[]);
    let a = Arc::new(copies_client(&p));
    stowage_client::repair_in_background(&a);
    put_all(&a, 1);
    let pid = p.units[1].pid();
    p.units[1].signal(rustix::process::Signal::STOP).unwrap();
    assert!(eventually(Duration::from_secs(5), || is_stopped(pid)));
    let took = Instant::now();
    a.unit_gone(1);
    assert!(
        took.elapsed() < Duration::from_secs(3),
        "unit_gone took {:?}",
        took.elapsed()
    );
    put_all(&a, 2);
    continued_it_is_fenced(&p, 1);
    reads_back(&copies_client(&p), 2, ROWS);
}

/// The unit's side: a fence naming another instance is refused, naming
/// the unit's; one naming it is answered Done, and from then on a request
/// on another connection is refused `Fenced` (the connection closed), or
/// finds the unit gone, and the unit exits.
#[test]
fn a_fenced_unit_refuses_every_request_and_exits() {
    let (p, _) = plane(1, 16 * MIB, &[]);
    let path = socket(&p, 0);
    let mut other = Raw::hello(&path, "ns");
    let (mut r, instance) = hello_instance(&path);
    match r.call(&Request::Fence {
        instance: instance ^ 1,
    }) {
        Response::Error {
            code: ErrorCode::InvalidRequest,
            message,
        } => assert!(message.contains(&format!("{instance:032x}")), "{message}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(r.call(&Request::Fence { instance }), Response::Done);
    // Refused `Fenced`, or the unit is gone already: never served.
    other.send(&Request::Stats);
    match other.recv().map(|e| e.body) {
        None => {}
        Some(Response::Error {
            code: ErrorCode::Fenced,
            ..
        }) => assert!(other.closed()),
        Some(served) => panic!("a fenced unit answered {served:?}"),
    }
    let pid = p.units[0].pid();
    assert!(
        eventually(Duration::from_secs(10), || exited(pid)),
        "the fenced unit did not exit"
    );
}

/// A unit that runs inside another process (as in a Ray actor, where it
/// does not exit) stays fenced: a new connection's Hello is refused
/// `Fenced`, and a client's liveness probe takes it as dead.
#[test]
fn a_fenced_unit_in_a_process_that_lives_on_stays_fenced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("unit.sock");
    let mut cfg = stowage_config::UnitConfig::new("in-process", 16 * MIB);
    cfg.mlock = false;
    cfg.metrics_listen = None;
    cfg.insecure = true;
    cfg.uds = Some(path.clone());
    let unit = stowage_unit::start(cfg).unwrap();
    let instance = unit.instance_id();
    // Same user, over the Unix socket: an admin, who may fence.
    let mut r = Raw::hello(&path, "ns");
    assert_eq!(r.call(&Request::Fence { instance }), Response::Done);
    for _ in 0..2 {
        let mut again = Raw::connect(&path);
        match again.call(&Request::Hello {
            version: stowage_wire::PROTOCOL_VERSION,
            namespace: "ns".into(),
            want_fd: false,
            session: None,
        }) {
            Response::Error {
                code: ErrorCode::Fenced,
                ..
            } => {}
            other => panic!("a fenced unit answered Hello: {other:?}"),
        }
    }
    let probe = stowage_client::ProbeDirectory::default();
    let said = stowage_client::Directory::liveness(
        &probe,
        0,
        &UnitAddr::Unix(path.clone()),
        instance,
        Instant::now() + Duration::from_secs(2),
    );
    assert_eq!(said, stowage_client::Liveness::Dead);
    unit.stop();
}

/// What a cluster manager says (as the Ray launcher's liveness check
/// does): unit `dead` is dead once `said` is set; otherwise the address
/// is probed.
struct ClusterSays {
    dead: usize,
    said: Arc<std::sync::atomic::AtomicBool>,
    probe: stowage_client::ProbeDirectory,
}

impl stowage_client::Directory for ClusterSays {
    fn liveness(
        &self,
        unit: usize,
        addr: &UnitAddr,
        instance: u128,
        deadline: Instant,
    ) -> stowage_client::Liveness {
        if self.says_dead(unit) {
            return stowage_client::Liveness::Dead;
        }
        self.probe.liveness(unit, addr, instance, deadline)
    }

    fn says_dead(&self, unit: usize) -> bool {
        unit == self.dead && self.said.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A unit stops answering (SIGSTOP: a host lost or cut off, whose address
/// refuses nothing) and the cluster manager says it is dead: a call that
/// runs out of time on it asks, and the client goes on without it — the
/// next puts of its rows go to the units up — and fences it once it
/// answers again (it exits). A new client then reads every row as last
/// put. (Without asking after a timeout, every put of a row with a copy
/// there failed `Timeout` for as long as the unit did not answer.)
#[test]
fn a_silent_unit_the_cluster_says_is_dead_is_gone_around_and_fenced_once_it_answers() {
    let (p, _) = plane(3, 64 * MIB, &[]);
    let said = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut cfg = ClientConfig::new("test", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(2);
    cfg.replicas = 2;
    cfg.directory = Arc::new(ClusterSays {
        dead: 1,
        said: said.clone(),
        probe: stowage_client::ProbeDirectory {
            max_wait: None,
            secret: p.secret().cloned(),
        },
    });
    let a = Arc::new(Client::connect(cfg).unwrap());
    stowage_client::repair_in_background(&a);
    put_all(&a, 1);
    let pid = p.units[1].pid();
    p.units[1].signal(rustix::process::Signal::STOP).unwrap();
    assert!(eventually(Duration::from_secs(5), || is_stopped(pid)));
    said.store(true, std::sync::atomic::Ordering::SeqCst);
    // The put that meets the silent unit spends its deadline on it and
    // fails; the unit is down from then on, and every put goes in.
    let mut failed = 0;
    for row in 0..ROWS {
        let v = value(row, 2);
        let t = Tensor {
            dtype: DType::U8,
            shape: vec![v.len() as u64],
            data: &v,
        };
        let put = |c: &Client| {
            c.put(
                "p",
                &[RowKey::Index(row)],
                &[("x", Column::Jagged(vec![t.clone()]))],
                None,
                c.deadline(),
            )
        };
        if put(&a).is_err() {
            failed += 1;
            put(&a).unwrap_or_else(|e| panic!("row {row}, asked again: {e}"));
        }
    }
    assert!(
        failed <= 1,
        "{failed} puts failed after the unit was taken as down"
    );
    assert!(!a.copies_of(1).contains(&1), "unit 1 is not down");
    continued_it_is_fenced(&p, 1);
    reads_back(&copies_client(&p), 2, ROWS);
}

/// How unit 1 went down in a rejoin test.
#[derive(Clone, Copy, Debug)]
enum Down {
    /// Killed (SIGKILL).
    Killed,
    /// Paused (SIGSTOP) past the liveness check, declared dead
    /// (`unit_gone`), then continued: fenced, it exits.
    PausedAndDeclared,
}

/// Repair passes with `c` until it knows of no repair due (bounded).
fn repair_all(c: &Client) {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let r = c.repair(c.deadline()).unwrap();
        if c.repairs_pending() == 0 {
            return;
        }
        assert!(Instant::now() < until, "repairs still due: {:?}", r.errors);
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Unit 1 of 3 (2 copies of each row) goes down (`down`); rows are
/// rewritten and some cleared around it; a unit started again in its
/// place (empty, another instance) is taken back in with `rejoin`. A
/// client that knew the plane before (its view the old one) is refused by
/// the units moved to the new view, takes it, and reads every row as last
/// put; its puts go to the new placement. Once repaired, each row is on
/// exactly the units of its copies (the copies that stood in for unit 1
/// were cleared), and with the first copy of unit 1's rows killed, the
/// rejoined unit serves them alone: the bytes last put, and nothing of a
/// row cleared while it was down.
fn a_unit_comes_back_by_rejoining(down: Down) {
    let (mut p, opts) = plane(3, 64 * MIB, &[]);
    // Its background repairer fences a paused unit once it answers.
    let a = Arc::new(copies_client(&p));
    stowage_client::repair_in_background(&a);
    put_all(&a, 1);
    let old = copies_client(&p);
    reads_back(&old, 1, ROWS);
    match down {
        Down::Killed => p.kill9(1),
        Down::PausedAndDeclared => {
            let pid = p.units[1].pid();
            p.units[1].signal(rustix::process::Signal::STOP).unwrap();
            assert!(eventually(Duration::from_secs(5), || is_stopped(pid)));
            a.unit_gone(1);
        }
    }
    put_all(&a, 2);
    let cleared: Vec<RowKey> = (20..ROWS).map(RowKey::Index).collect();
    a.clear("p", &cleared, None, a.deadline()).unwrap();
    if let Down::PausedAndDeclared = down {
        continued_it_is_fenced(&p, 1);
    }
    assert!(!a.copies_of(1).contains(&1), "unit 1 is not down");
    p.restart(1, &opts).expect("unit 1 starts again");
    let r = a.rejoin(1, a.deadline()).unwrap();
    assert!(!r.already, "{r:?}");
    assert_eq!((r.epoch, r.moved), (1, 3), "{r:?}");
    assert!(r.unreached.is_empty(), "{r:?}");
    // Units 0's and 1's rows below 20 had a copy standing in for unit 1.
    assert!(
        r.cleared > 0,
        "nothing was cleared where copies left: {r:?}"
    );
    assert_eq!(a.plane_view().epoch, 1);
    for g in 0..3 {
        assert!(
            g == 2 || a.copies_of(g).contains(&1),
            "unit 1 holds no copy of unit {g}'s rows: {:?}",
            a.copies_of(g)
        );
    }
    // The rejoined unit holds nothing yet; the copies left serve.
    reads_back(&old, 2, 20);
    assert_eq!(
        old.plane_view().epoch,
        1,
        "the old client did not take the new view"
    );
    for g in 0..3 {
        assert_eq!(old.copies_of(g), a.copies_of(g), "unit {g}'s copies");
    }
    reads_back(&copies_client(&p), 2, 20);
    put_rows(&old, 0..10, 3);
    repair_all(&a);
    let home = |row: u64| a.unit_of_row(row);
    assert_eq!(copies_are_where_they_belong(&p, &a, &[], &home), 20);
    let want = |row: u64| match row {
        0..10 => Some(3),
        10..20 => Some(2),
        _ => None,
    };
    // Unit 1's rows: copies on 2, then 1 (the copy left first).
    assert_eq!(&a.copies_of(1)[..], &[2, 1]);
    p.kill9(2);
    reads_as(&a, &want);
    reads_as(&copies_client(&p), &want);
    let again = a.rejoin(1, a.deadline()).unwrap();
    assert!(again.already, "{again:?}");
}

#[test]
fn a_killed_unit_started_again_rejoins_empty_and_serves_nothing_stale() {
    a_unit_comes_back_by_rejoining(Down::Killed);
}

#[test]
fn a_unit_paused_past_the_liveness_check_comes_back_only_by_rejoining() {
    a_unit_comes_back_by_rejoining(Down::PausedAndDeclared);
}

/// The unit's side: it serves row requests only on connections that
/// speak for its view of the plane (`Epoch`: its epoch and digest, so
/// that another view of the same epoch is refused); it takes a newer view and
/// keeps its own against an older one or another of the same epoch; a
/// view that does not name its instance leaves it serving no rows.
#[test]
fn a_unit_serves_rows_only_to_connections_of_its_view() {
    let (p, _) = plane(1, 16 * MIB, &[]);
    let path = socket(&p, 0);
    let (mut r, instance) = hello_instance(&path);
    let rows = |r: &mut Raw| r.call(&Request::ListPartitions);
    assert!(matches!(rows(&mut r), Response::Partitions { .. }));
    let view = |epoch, instance| PlaneView {
        epoch,
        members: vec![Member {
            instance: Some(instance),
            since: 0,
        }],
    };
    let stale = |resp: Response| {
        assert!(
            matches!(
                resp,
                Response::Error {
                    code: ErrorCode::Stale,
                    ..
                }
            ),
            "{resp:?}"
        )
    };
    let answer = r.call(&Request::SetView {
        view: view(1, instance),
    });
    assert_eq!(
        answer,
        Response::View {
            view: view(1, instance)
        }
    );
    // This connection still speaks for view 0.
    stale(rows(&mut r));
    assert!(matches!(r.call(&Request::Stats), Response::Stats(_)));
    // Another view of the same epoch (another rejoin's): refused too.
    r.call(&Request::Epoch {
        epoch: 1,
        digest: view(1, instance ^ 1).digest(),
    });
    stale(rows(&mut r));
    assert_eq!(
        r.call(&Request::Epoch {
            epoch: 1,
            digest: view(1, instance).digest()
        }),
        Response::View {
            view: view(1, instance)
        }
    );
    assert!(matches!(rows(&mut r), Response::Partitions { .. }));
    // An older view, or another of the same epoch: the unit's stays.
    for offered in [view(0, instance), view(1, instance ^ 1)] {
        assert_eq!(
            r.call(&Request::SetView { view: offered }),
            Response::View {
                view: view(1, instance)
            }
        );
    }
    assert!(matches!(rows(&mut r), Response::Partitions { .. }));
    // A view naming another instance in its place: no rows for anyone.
    assert_eq!(
        r.call(&Request::SetView {
            view: view(2, instance ^ 1)
        }),
        Response::View {
            view: view(2, instance ^ 1)
        }
    );
    r.call(&Request::Epoch {
        epoch: 2,
        digest: view(2, instance ^ 1).digest(),
    });
    stale(rows(&mut r));
}

/// A put made while a rejoin's round is under way — the rejoining unit
/// and one other moved to the new view, the first copy's unit not yet —
/// by a client of the old view: the first copy's unit (old view) takes
/// its copy, and the copy it makes on the moved unit is refused `Stale`.
/// The client learns the new view and puts again where the copies are in
/// it: no copy is left on a unit outside the row's set (writing the
/// refused copy itself instead, on a connection it opened in the new view,
/// it left one on unit 1: run so, and it failed), and the row reads back.
#[test]
fn a_put_made_while_a_rejoin_moves_the_units_leaves_no_copy_outside_the_new_sets() {
    let (mut p, opts) = plane(3, 64 * MIB, &[]);
    put_all(&copies_client(&p), 1);
    p.kill9(2);
    // A client that finds unit 2 dead reading unit 2's rows (from unit 0:
    // their copies are on 0 and 1 now), and holds no connection to unit 1.
    let a = copies_client(&p);
    let unit_2s: Vec<u64> = (0..ROWS).filter(|&r| a.unit_of_row(r) == 2).collect();
    for &r in &unit_2s {
        a.get_tensors("p", &[RowKey::Index(r)], &["x"], None, a.deadline())
            .unwrap();
    }
    assert_eq!(&a.copies_of(2)[..], &[0, 1]);
    p.restart(2, &opts).expect("unit 2 starts again");
    // The round, part way: the rejoining unit and unit 1 take the view
    // that names unit 2's new instance; unit 0 not yet.
    let instance = |u: usize| hello_instance(&socket(&p, u)).1;
    let next = PlaneView {
        epoch: 1,
        members: vec![
            Member {
                instance: Some(instance(0)),
                since: 0,
            },
            Member {
                instance: Some(instance(1)),
                since: 0,
            },
            Member {
                instance: Some(instance(2)),
                since: 1,
            },
        ],
    };
    for u in [2, 1] {
        let (mut r, _) = hello_instance(&socket(&p, u));
        assert_eq!(
            r.call(&Request::SetView { view: next.clone() }),
            Response::View { view: next.clone() }
        );
    }
    // A new row of unit 2's: its first copy's unit (0) is still in the
    // old view, and copies it to unit 1, which refuses.
    let row = (100..200).find(|&r| a.unit_of_row(r) == 2).unwrap();
    put_rows(&a, row..row + 1, 3);
    assert_eq!(
        a.plane_view().epoch,
        1,
        "the client did not take the new view"
    );
    assert_eq!(&a.copies_of(2)[..], &[0, 2]);
    let key = [RowKey::Index(row)];
    // Each unit read alone (a one-copy client: its first row request,
    // a list, takes the unit's view).
    let alone = |u: usize| {
        let one = unit_alone(&p, u);
        one.list("p", one.deadline()).unwrap();
        one
    };
    for u in [0, 2] {
        let one = alone(u);
        let got = one.get_tensors("p", &key, &["x"], None, one.deadline());
        let got = got.unwrap_or_else(|e| panic!("unit {u}: {e}"));
        assert!(got[0][0].data == value(row, 3), "unit {u}: other bytes");
    }
    let one = alone(1);
    let stray = one.get_tensors("p", &key, &["x"], None, one.deadline());
    assert!(
        matches!(stray, Err(Error::NotFound { .. })),
        "unit 1, outside the row's set, holds a copy: {:?}",
        stray.map(|_| "its bytes")
    );
}

/// A rejoin cut short — its process gone after every unit took the view
/// naming the new instance, before it cleared the copies that stood in
/// for the unit — is finished by running it again: the unit is a member
/// already, and the stand-ins are cleared of its rows; after a repair every
/// row is on exactly the units of its copies (run again without that
/// clear, the stand-ins kept the rows: run so, and failed).
#[test]
fn a_rejoin_cut_short_is_finished_by_running_it_again() {
    let (mut p, opts) = plane(3, 64 * MIB, &[]);
    let a = copies_client(&p);
    put_all(&a, 1);
    p.kill9(1);
    put_all(&a, 2);
    p.restart(1, &opts).expect("unit 1 starts again");
    let instance = |u: usize| hello_instance(&socket(&p, u)).1;
    let member = |u: usize, since| Member {
        instance: Some(instance(u)),
        since,
    };
    let view = PlaneView {
        epoch: 1,
        members: vec![member(0, 0), member(1, 1), member(2, 0)],
    };
    for u in [1, 0, 2] {
        let (mut r, _) = hello_instance(&socket(&p, u));
        assert_eq!(
            r.call(&Request::SetView { view: view.clone() }),
            Response::View { view: view.clone() }
        );
    }
    let b = copies_client(&p);
    let r = b.rejoin(1, b.deadline()).unwrap();
    assert!(r.already && r.epoch == 1, "{r:?}");
    assert!(r.cleared > 0, "the stand-ins were not cleared: {r:?}");
    repair_all(&b);
    let home = |row: u64| b.unit_of_row(row);
    assert_eq!(
        copies_are_where_they_belong(&p, &b, &[], &home),
        ROWS as usize
    );
    reads_back(&b, 2, ROWS);
}

/// A rejoin takes in only an empty unit of another instance than the one
/// the plane had there: a live unit that holds rows is refused (a client
/// that cannot tell it from one started again, knowing no instance from a
/// directory), and one the directory names as it answers is a member
/// already.
#[test]
fn a_rejoin_refuses_a_unit_that_holds_rows() {
    let (p, _) = plane(3, 64 * MIB, &[]);
    let a = copies_client(&p);
    put_all(&a, 1);
    let r = a.rejoin(0, a.deadline());
    assert!(
        matches!(&r, Err(Error::InvalidRequest(m)) if m.contains("holds") && m.contains("rows")),
        "{r:?}"
    );
    let mut cfg = ClientConfig::new("test", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.replicas = 2;
    cfg.instances = p.directory().instances();
    let known = Client::connect(cfg).unwrap();
    let r = known.rejoin(0, known.deadline()).unwrap();
    assert!(r.already && r.epoch == 0, "{r:?}");
    reads_back(&a, 1, ROWS);
}

/// Two rejoins at once, of two units started again (4 units, 2 copies):
/// both end with every unit at one view that names both new instances
/// (a round that met the other's view made the next from it), and a
/// client that repairs reads every row as last put.
#[test]
fn two_rejoins_at_once_end_in_one_view_with_both() {
    let (mut p, opts) = plane(4, 64 * MIB, &[]);
    // Clients of the plane's directory from its start: they tell a unit
    // started again from the one it replaced.
    let first = p.directory().instances();
    let (addrs, secret) = (p.uds_addrs(), p.secret().cloned());
    let client = || {
        let mut cfg = ClientConfig::new("test", addrs.clone());
        cfg.secret = secret.clone();
        cfg.timeout = Duration::from_secs(5);
        cfg.replicas = 2;
        cfg.instances = first.clone();
        Client::connect(cfg).unwrap()
    };
    let a = client();
    put_all(&a, 1);
    p.kill9(1);
    p.kill9(3);
    put_all(&a, 2);
    p.restart(1, &opts).expect("unit 1 starts again");
    p.restart(3, &opts).expect("unit 3 starts again");
    let b = client();
    reads_back(&b, 2, ROWS);
    let (one, three) = std::thread::scope(|s| {
        let one = s.spawn(|| a.rejoin(1, a.deadline()));
        let three = s.spawn(|| b.rejoin(3, b.deadline()));
        (one.join().unwrap(), three.join().unwrap())
    });
    let (one, three) = (one.unwrap(), three.unwrap());
    let views: Vec<PlaneView> = (0..4)
        .map(|u| {
            let (mut r, _) = hello_instance(&socket(&p, u));
            match r.call(&Request::Epoch {
                epoch: 0,
                digest: 0,
            }) {
                Response::View { view } => view,
                other => panic!("unit {u}: {other:?}"),
            }
        })
        .collect();
    assert!(views.iter().all(|v| *v == views[0]), "{views:?}");
    let last = &views[0];
    assert!(last.epoch >= 2, "{last:?}");
    assert_eq!(last.members[1].instance, Some(one.instance));
    assert_eq!(last.members[3].instance, Some(three.instance));
    let c = client();
    repair_all(&c);
    reads_back(&c, 2, ROWS);
    reads_back(&a, 2, ROWS);
}
