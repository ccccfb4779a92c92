//! Checkpoints of a plane with copies (docs/replication.md#checkpoints),
//! with real unit processes: each unit writes one copy of the rows it is
//! the source of, so the parts hold every row once; units restarted from
//! the parts and a `rebuild_copies` give every row its copies again, byte
//! for byte. Rows of every kind of home: plain, string-named, grouped,
//! and put on a unit the caller named.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use common::{binary, pattern, plane};
use stowage_client::{CheckpointInfo, Client, ClientConfig, Column, DType, RowKey, Tensor};
use stowage_local::{LocalOptions, LocalPlane};

const MIB: u64 = 1 << 20;
const UNITS: usize = 4;
const FIELDS: [&str; 2] = ["a", "b"];

/// A row put by [`put_all`]: its key, its home (the unit whose rows it
/// is), and the seed of its values.
#[derive(Clone, Debug)]
struct Row {
    key: RowKey,
    home: usize,
    seed: u64,
}

fn value(seed: u64, f: usize) -> Vec<u8> {
    pattern(seed, f as u64, 3000 + (seed as usize % 7) * 1000 + f * 64)
}

fn put(c: &Client, keys: &[RowKey], seeds: &[u64], groups: Option<&[String]>, unit: Option<usize>) {
    let vals: Vec<Vec<Vec<u8>>> = (0..FIELDS.len())
        .map(|f| seeds.iter().map(|&s| value(s, f)).collect())
        .collect();
    let cols: Vec<(&str, Column<'_>)> = FIELDS
        .iter()
        .zip(&vals)
        .map(|(name, vs)| {
            let ts = vs
                .iter()
                .map(|v| Tensor::new(DType::U8, vec![v.len() as u64], v).unwrap())
                .collect();
            (*name, Column::Jagged(ts))
        })
        .collect();
    c.put_grouped("p", keys, groups, &cols, unit, c.deadline())
        .unwrap();
}

/// Put rows of every kind with `c` (2 copies): 16 plain rows in one put
/// (so each unit's blob holds rows of two homes), 8 string-named rows,
/// 12 rows in 3 groups, and 4 rows each put on the unit after its own.
fn put_all(c: &Client) -> Vec<Row> {
    let mut rows = Vec::new();
    let plain: Vec<u64> = (0..16).collect();
    let keys: Vec<RowKey> = plain.iter().map(|&r| RowKey::Index(r)).collect();
    put(c, &keys, &plain, None, None);
    rows.extend(plain.iter().map(|&r| Row {
        key: RowKey::Index(r),
        home: c.unit_of_row(r),
        seed: r,
    }));

    let names: Vec<String> = (0..8).map(|i| format!("name-{i}")).collect();
    let keys: Vec<RowKey> = names.iter().map(|n| RowKey::Name(n.clone())).collect();
    let seeds: Vec<u64> = (1000..1008).collect();
    put(c, &keys, &seeds, None, None);
    for ((n, k), s) in names.iter().zip(keys).zip(seeds) {
        rows.push(Row {
            key: k,
            home: c.unit_of(n),
            seed: s,
        });
    }

    let grouped: Vec<u64> = (100..112).collect();
    let groups: Vec<String> = grouped
        .iter()
        .map(|r| format!("g-{}", (r - 100) / 4))
        .collect();
    let keys: Vec<RowKey> = grouped.iter().map(|&r| RowKey::Index(r)).collect();
    put(c, &keys, &grouped, Some(&groups), None);
    for (&r, g) in grouped.iter().zip(&groups) {
        rows.push(Row {
            key: RowKey::Index(r),
            home: c.unit_of(g),
            seed: r,
        });
    }

    for r in 200..204u64 {
        let on = (c.unit_of_row(r) + 1) % UNITS;
        put(c, &[RowKey::Index(r)], &[r], None, Some(on));
        rows.push(Row {
            key: RowKey::Index(r),
            home: on,
            seed: r,
        });
    }
    // Every unit is the home of some rows.
    let homes: BTreeSet<usize> = rows.iter().map(|r| r.home).collect();
    assert_eq!(homes.len(), UNITS, "{rows:?}");
    rows
}

/// A shm client of `p` keeping `replicas` copies.
fn copies_client(p: &LocalPlane, replicas: usize) -> Client {
    let mut cfg = ClientConfig::new("test", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(20);
    cfg.replicas = replicas;
    Client::connect(cfg).unwrap()
}

/// Check unit by unit (a one-unit client each) that row `r` of `rows` is
/// held by exactly the units `want(r)`, each copy with every field byte
/// for byte, and that no unit holds anything else.
fn check_units(p: &LocalPlane, rows: &[Row], want: &dyn Fn(&Row) -> BTreeSet<usize>) {
    let by_key: BTreeMap<&RowKey, &Row> = rows.iter().map(|r| (&r.key, r)).collect();
    let mut held: BTreeMap<RowKey, BTreeSet<usize>> = BTreeMap::new();
    for (u, addr) in p.uds_addrs().into_iter().enumerate() {
        let mut cfg = ClientConfig::new("test", vec![addr]);
        cfg.secret = p.secret().cloned();
        cfg.timeout = Duration::from_secs(20);
        let one = Client::connect(cfg).unwrap();
        let listed = one.list("p", one.deadline()).unwrap();
        let keys: Vec<RowKey> = listed.iter().map(|(k, _)| k.clone()).collect();
        if keys.is_empty() {
            continue;
        }
        let got = one
            .get_tensors("p", &keys, &FIELDS, None, one.deadline())
            .unwrap();
        for (i, k) in keys.iter().enumerate() {
            let row = by_key
                .get(k)
                .unwrap_or_else(|| panic!("unit {u} holds {k:?}, never put"));
            for f in 0..FIELDS.len() {
                assert!(
                    got[f][i].data == value(row.seed, f),
                    "unit {u}: {k:?} field {} differs",
                    FIELDS[f]
                );
            }
            held.entry(k.clone()).or_default().insert(u);
        }
    }
    for r in rows {
        let on = held.get(&r.key).cloned().unwrap_or_default();
        assert_eq!(
            on,
            want(r),
            "{:?} (home {}) is held by {on:?}",
            r.key,
            r.home
        );
    }
}

/// Every row read back through `c` (2 copies), byte for byte, each
/// with its home named (a grouped row, or one put on a named unit, is
/// read with that unit).
fn read_all(c: &Client, rows: &[Row]) {
    for r in rows {
        let got = c
            .get_tensors(
                "p",
                std::slice::from_ref(&r.key),
                &FIELDS,
                Some(r.home),
                c.deadline(),
            )
            .unwrap();
        for (f, values) in got.iter().enumerate() {
            assert!(values[0].data == value(r.seed, f), "{:?} differs", r.key);
        }
    }
}

/// 4 units started from the parts in `dir`, but `empty` (a unit that was
/// down at the checkpoint, which wrote no part), which starts empty.
fn restored(dir: &Path, empty: Option<usize>) -> LocalPlane {
    let mut opts = LocalOptions::new(UNITS, 32 * MIB);
    opts.command = vec![binary().into(), "unit".into()];
    opts.unit_args = vec!["--no-mlock".into()];
    let Some(empty) = empty else {
        opts.restore = Some(dir.to_owned());
        return LocalPlane::start(&opts).unwrap();
    };
    let mut q = LocalPlane::start(&opts).unwrap();
    opts.restore = Some(dir.to_owned());
    for u in (0..UNITS).filter(|&u| u != empty) {
        q.restart(u, &opts).unwrap();
    }
    q
}

fn rows_of(rows: &[Row], homes: &[usize]) -> u64 {
    rows.iter().filter(|r| homes.contains(&r.home)).count() as u64
}

fn checked_parts(info: &[CheckpointInfo], rows: &[Row], homes_of: &[&[usize]]) {
    assert_eq!(info.len(), UNITS);
    let total: u64 = info.iter().map(|i| i.rows).sum();
    assert_eq!(total, rows.len() as u64, "one copy of each row: {info:?}");
    for (u, homes) in homes_of.iter().enumerate() {
        assert_eq!(
            info[u].rows,
            rows_of(rows, homes),
            "unit {u}: {:?}",
            info[u]
        );
        assert_eq!(
            info[u].entries,
            2 * info[u].rows + extra_fields(rows, homes)
        );
    }
}

/// The hidden fields of the rows of `homes` beside their 2 values: a
/// string row's name, and the unit a row put on a named unit records.
fn extra_fields(rows: &[Row], homes: &[usize]) -> u64 {
    rows.iter()
        .filter(|r| homes.contains(&r.home))
        .map(|r| match r.key {
            RowKey::Name(_) => 1,
            RowKey::Index(i) if (200..204).contains(&i) => 1,
            RowKey::Index(i) if (100..112).contains(&i) => 1,
            RowKey::Index(_) => 0,
        })
        .sum()
}

/// 4 units, 2 copies: the checkpoint's parts hold each row once, each
/// part its own unit's rows; units restored from them hold just those,
/// and after `rebuild_copies` every row is on the units of its copies,
/// byte for byte.
#[test]
fn a_checkpoint_with_copies_keeps_one_copy_and_a_rebuild_makes_the_others() {
    let ckpt = tempfile::tempdir().unwrap();
    let root = ckpt.path().display().to_string();
    let (mut p, _) = plane(UNITS, 32 * MIB, &["--checkpoint-root", &root]);
    let c = copies_client(&p, 2);
    let rows = put_all(&c);
    check_units(&p, &rows, &|r| c.copies_of(r.home).into_iter().collect());
    let dir = ckpt.path().join("c1");
    let info = c.checkpoint(&dir, c.deadline()).unwrap();
    checked_parts(&info, &rows, &[&[0], &[1], &[2], &[3]]);
    assert!(info.iter().all(|i| !i.host.is_empty()), "{info:?}");
    drop(c);
    p.stop();

    let q = restored(&dir, None);
    // Each unit holds its own rows, once.
    check_units(&q, &rows, &|r| BTreeSet::from([r.home]));
    let c = copies_client(&q, 2);
    let r = c.rebuild_copies(c.deadline()).unwrap();
    assert_eq!((r.left, r.skipped), (0, 0), "{r:?}");
    check_units(&q, &rows, &|r| c.copies_of(r.home).into_iter().collect());
    read_all(&c, &rows);
}

/// A unit killed before the checkpoint, after a repair: its rows are
/// written by their source (the copy left), its own place gets no part
/// (an empty info), and units restored from the others' parts (it
/// starting empty) lose nothing once `rebuild_copies` ran.
#[test]
fn a_unit_down_at_the_checkpoint_writes_nothing_and_loses_nothing() {
    let ckpt = tempfile::tempdir().unwrap();
    let root = ckpt.path().display().to_string();
    let (mut p, _) = plane(UNITS, 32 * MIB, &["--checkpoint-root", &root]);
    let c = copies_client(&p, 2);
    let rows = put_all(&c);
    p.kill9(1);
    c.unit_gone(1);
    let until = Instant::now() + Duration::from_secs(60);
    while c.repairs_pending() > 0 {
        let r = c.repair(c.deadline()).unwrap();
        assert!(Instant::now() < until, "repairs still due: {r:?}");
    }
    // Unit 1's rows: on 2 (copy left, the source) and 3 (the newcomer).
    assert_eq!(&c.copies_of(1)[..], &[2, 3]);
    let dir = ckpt.path().join("c1");
    let info = c.checkpoint(&dir, c.deadline()).unwrap();
    checked_parts(&info, &rows, &[&[0], &[], &[1, 2], &[3]]);
    let down = &info[1];
    assert!(
        down.files.is_empty() && down.host.is_empty() && down.stored.is_empty(),
        "{down:?}"
    );
    assert!(!dir.join("unit-1").exists());
    assert!(dir.join("unit-2/MANIFEST").exists());
    drop(c);
    p.stop();

    let q = restored(&dir, Some(1));
    let source = [0, 2, 2, 3];
    check_units(&q, &rows, &|r| BTreeSet::from([source[r.home]]));
    let c = copies_client(&q, 2);
    let r = c.rebuild_copies(c.deadline()).unwrap();
    assert_eq!((r.left, r.skipped), (0, 0), "{r:?}");
    check_units(&q, &rows, &|r| c.copies_of(r.home).into_iter().collect());
    read_all(&c, &rows);
}

/// A blob holding rows of several homes (here 8 rows put in one blob by
/// a one-unit client) is written compacted to the rows of the homes
/// asked for: a unit restored from it serves those rows byte for byte,
/// and none of the others.
#[test]
fn a_blob_of_several_homes_is_written_compacted_and_restores_exact() {
    let ckpt = tempfile::tempdir().unwrap();
    let root = ckpt.path().display().to_string();
    let (mut p, _) = plane(1, 32 * MIB, &["--checkpoint-root", &root]);
    let c = copies_client(&p, 1);
    let seeds: Vec<u64> = (0..8).collect();
    let keys: Vec<RowKey> = seeds.iter().map(|&r| RowKey::Index(r)).collect();
    put(&c, &keys, &seeds, None, None);
    assert_eq!(c.stats(c.deadline())[0].as_ref().unwrap().core.blobs, 1);
    let mut raw = common::Raw::hello(&p.units[0].uds, "test");
    // Homes 1 and 2 of 3 units: rows 1, 2, 4, 5, 7.
    let req = stowage_wire::Request::CheckpointHomes {
        dir: "c1/unit-0".into(),
        units: 3,
        homes: vec![1, 2],
    };
    let stowage_wire::Response::Checkpointed(info) = raw.call(&req) else {
        panic!("no checkpoint");
    };
    let kept: Vec<u64> = seeds.iter().copied().filter(|r| r % 3 != 0).collect();
    assert_eq!((info.rows, info.entries), (5, 10), "{info:?}");
    let all: u64 = seeds
        .iter()
        .map(|&s| (0..2).map(|f| value(s, f).len() as u64).sum::<u64>())
        .sum();
    assert!(info.bytes < all, "{} bytes written of {all}", info.bytes);
    drop((raw, c));
    p.stop();

    let mut opts = LocalOptions::new(1, 32 * MIB);
    opts.command = vec![binary().into(), "unit".into()];
    opts.unit_args = vec!["--no-mlock".into()];
    opts.restore = Some(ckpt.path().join("c1"));
    let q = LocalPlane::start(&opts).unwrap();
    let c = copies_client(&q, 1);
    let rows: Vec<Row> = kept
        .iter()
        .map(|&r| Row {
            key: RowKey::Index(r),
            home: 0,
            seed: r,
        })
        .collect();
    read_all(&c, &rows);
    let listed: Vec<RowKey> = c
        .list("p", c.deadline())
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    let want: Vec<RowKey> = kept.iter().map(|&r| RowKey::Index(r)).collect();
    assert_eq!(listed, want);
}

/// The command line, by the plane's directory (which says 2 copies):
/// `stowage checkpoint DIR --directory FILE` writes one copy of each row,
/// and after a restore `stowage repair --rebuild --directory FILE` gives
/// every row its copies again.
#[test]
fn the_commands_checkpoint_one_copy_and_rebuild_the_others() {
    let ckpt = tempfile::tempdir().unwrap();
    let root = ckpt.path().display().to_string();
    let (mut p, _) = plane(UNITS, 32 * MIB, &["--checkpoint-root", &root]);
    let c = copies_client(&p, 2);
    let rows = put_all(&c);
    drop(c);
    let with_copies = |p: &LocalPlane, name: &str| {
        let file = ckpt.path().join(name);
        let mut d = p.directory();
        d.replicas = 2;
        d.write_file(&file).unwrap();
        file
    };
    let run = |args: &[&str]| {
        let out = std::process::Command::new(binary())
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{args:?}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let file = with_copies(&p, "dir.json");
    let dir = ckpt.path().join("c1");
    let text = run(&[
        "checkpoint",
        dir.to_str().unwrap(),
        "--directory",
        file.to_str().unwrap(),
    ]);
    // "unit i: N rows, ...": the parts add up to one copy of each row.
    let written: u64 = text
        .lines()
        .filter_map(|l| l.split(": ").nth(1)?.split(' ').next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(written, rows.len() as u64, "{text}");
    p.stop();

    let q = restored(&dir, None);
    let file = with_copies(&q, "restored.json");
    let text = run(&[
        "repair",
        "--rebuild",
        "--directory",
        file.to_str().unwrap(),
        "--namespace",
        "test",
    ]);
    assert!(text.starts_with("rebuilt 8 pairs"), "{text}");
    let c = copies_client(&q, 2);
    check_units(&q, &rows, &|r| c.copies_of(r.home).into_iter().collect());
    read_all(&c, &rows);
}

/// Claims across a checkpoint with copies (docs/replication.md#claims):
/// rows claimed before it stay consumed after a restore and
/// `rebuild_copies` (their marks come back with them), the consumption
/// counts add up once, also after a unit's death once restored, and
/// every row left is claimed exactly once.
#[test]
fn claims_survive_a_checkpoint_with_copies_and_count_once() {
    let ckpt = tempfile::tempdir().unwrap();
    let root = ckpt.path().display().to_string();
    let (mut p, _) = plane(UNITS, 32 * MIB, &["--checkpoint-root", &root]);
    let c = copies_client(&p, 2);
    let task = "train".to_owned();
    let keys: Vec<RowKey> = (0..40).map(|i| RowKey::Name(format!("s{i}"))).collect();
    let seeds: Vec<u64> = (0..40).collect();
    c.register_tasks("p", std::slice::from_ref(&task), 40, 1, c.deadline())
        .unwrap();
    put(&c, &keys, &seeds, None, None);
    let fields = vec!["a".to_owned()];
    let before = c
        .claim("p", &task, &fields, 1000, false, c.deadline())
        .unwrap();
    let consumed = c.claim_status("p", &task, c.deadline()).unwrap().consumed;
    assert_eq!(consumed, before.len() as u64);
    assert_eq!(consumed, 40, "one claim of every row took them all");
    // Clear some claimed rows, put them again: claimable again.
    c.clear("p", &keys[..5], None, c.deadline()).unwrap();
    put(&c, &keys[..5], &seeds[..5], None, None);
    let dir = ckpt.path().join("c1");
    c.checkpoint(&dir, c.deadline()).unwrap();
    drop(c);
    p.stop();

    let q = restored(&dir, None);
    let c = copies_client(&q, 2);
    let r = c.rebuild_copies(c.deadline()).unwrap();
    assert_eq!(r.left, 0, "{r:?}");
    let s = c.claim_status("p", &task, c.deadline()).unwrap();
    assert_eq!((s.registered, s.consumed), (true, 40), "{s:?}");
    let after = c
        .claim("p", &task, &fields, 1000, false, c.deadline())
        .unwrap();
    let mut names: Vec<String> = after.iter().map(|k| format!("{k:?}")).collect();
    names.sort();
    let mut want: Vec<String> = keys[..5].iter().map(|k| format!("{k:?}")).collect();
    want.sort();
    assert_eq!(names, want, "only the rows put again after their claim");
    assert_eq!(
        c.claim_status("p", &task, c.deadline()).unwrap().consumed,
        45
    );
    // A unit's death after the restore: its homes' rows are claimed and
    // counted by their copy now, whose counts came from its own part.
    let mut q = q;
    q.kill9(1);
    c.unit_gone(1);
    assert_eq!(
        c.claim_status("p", &task, c.deadline()).unwrap().consumed,
        45
    );
    assert!(c
        .claim("p", &task, &fields, 1000, false, c.deadline())
        .unwrap()
        .is_empty());
}
