//! Checkpoint, restore and teardown with real unit processes.

mod common;

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{binary, eventually, pattern, plane};
use stowage_client::{Client, ClientConfig, Column, DType, Error, RowKey, Tensor};
use stowage_local::{LocalOptions, LocalPlane};

const MIB: u64 = 1 << 20;

fn disk_args(root: &Path) -> Vec<String> {
    [
        "--disk",
        root.to_str().unwrap(),
        "--disk-capacity",
        "256MiB",
        "--high-watermark",
        "0.5",
        "--low-watermark",
        "0.3",
    ]
    .map(String::from)
    .to_vec()
}

fn connect(p: &LocalPlane) -> Client {
    let mut cfg = ClientConfig::new("ns", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(60);
    Client::connect(cfg).unwrap()
}

fn value(row: u64, gen: u64) -> Vec<u8> {
    pattern(row, gen, 40_000 + (row as usize % 13) * 512)
}

fn put(c: &Client, row: u64, gen: u64) {
    let v = value(row, gen);
    let t = Tensor::new(DType::U8, vec![v.len() as u64], &v).unwrap();
    c.put(
        "step",
        &[RowKey::Index(row)],
        &[("x", Column::Jagged(vec![t]))],
        None,
        c.deadline(),
    )
    .unwrap();
}

#[test]
fn a_checkpoint_under_load_restores_into_fresh_units() {
    let root = tempfile::tempdir().unwrap();
    let ckpt = tempfile::tempdir().unwrap();
    let n = 400u64;
    let mut opts = LocalOptions::new(2, 8 * MIB);
    opts.command = vec![binary().into(), "unit".into()];
    opts.unit_args = disk_args(root.path());
    opts.unit_args.push("--no-mlock".into());
    opts.unit_args.push("--checkpoint-root".into());
    opts.unit_args.push(ckpt.path().display().to_string());
    let mut p = LocalPlane::start(&opts).unwrap();
    let c = connect(&p);
    for r in 0..n {
        put(&c, r, 0);
    }
    assert!(
        c.stats(c.deadline())
            .into_iter()
            .map(|s| s.unwrap().spilled_blobs)
            .sum::<u64>()
            > 0
    );
    // While the checkpoint runs: new rows, replaced rows, cleared rows.
    let stop = AtomicBool::new(false);
    let info = std::thread::scope(|s| {
        s.spawn(|| {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                put(&c, n + i, 0); // new
                put(&c, n / 2 + i % (n / 2), 1); // replaced
                c.clear("step", &[RowKey::Index(i % (n / 4))], None, c.deadline())
                    .unwrap(); // cleared
                i += 1;
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        let info = c.checkpoint(&ckpt.path().join("c1"), c.deadline());
        stop.store(true, Ordering::Relaxed);
        info
    })
    .unwrap();
    assert_eq!(info.len(), 2);
    let entries: u64 = info.iter().map(|i| i.entries).sum();
    assert!(entries >= n / 4, "{info:?}");
    assert!(info
        .iter()
        .all(|i| i.files.iter().any(|f| f.name == "index")));
    p.stop();

    // Fresh units (no disk tier even) serve exactly the checkpoint.
    let mut opts = LocalOptions::new(2, 64 * MIB);
    opts.command = vec![binary().into(), "unit".into()];
    opts.unit_args = vec!["--no-mlock".into()];
    opts.restore = Some(ckpt.path().join("c1"));
    let q = LocalPlane::start(&opts).unwrap();
    let c2 = connect(&q);
    let listed = c2.list("step", c2.deadline()).unwrap();
    assert_eq!(
        listed.len() as u64,
        info.iter().map(|i| i.rows).sum::<u64>()
    );
    let rows: Vec<RowKey> = listed.iter().map(|(k, _)| k.clone()).collect();
    let got = c2
        .get_tensors("step", &rows, &["x"], None, c2.deadline())
        .unwrap();
    let mut seen = HashMap::new();
    for (k, t) in rows.iter().zip(&got[0]) {
        let RowKey::Index(r) = k else { panic!("{k:?}") };
        let r = *r;
        let gen = if t.data == value(r, 0) {
            0
        } else if t.data == value(r, 1) {
            1
        } else {
            panic!("row {r}: restored bytes are neither the old nor the new value");
        };
        assert!(
            gen == 0 || (n / 2..n).contains(&r),
            "row {r} was never replaced"
        );
        seen.insert(r, gen);
    }
    // Rows nobody touched during the checkpoint are all there.
    for r in n / 4..n / 2 {
        assert_eq!(
            seen.get(&r),
            Some(&0),
            "row {r} missing from the checkpoint"
        );
    }
    // Rows replaced during the checkpoint are there, old or new.
    for r in n / 2..n {
        assert!(seen.contains_key(&r), "row {r} missing from the checkpoint");
    }
    // A checkpoint does not overwrite another.
    assert!(c2
        .checkpoint(&ckpt.path().join("c1"), c2.deadline())
        .is_err());
}

fn restore_fails(dir: &Path) -> String {
    let sock = tempfile::tempdir().unwrap();
    let mut child = Command::new(binary())
        .args(["unit", "--no-mlock", "--memory", "16MiB", "--listen"])
        .arg(format!("unix:{}", sock.path().join("u.sock").display()))
        .arg("--restore")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let end = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("a unit restoring a damaged checkpoint kept running");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(
        !status.success(),
        "restore of a damaged checkpoint succeeded"
    );
    err
}

#[test]
fn an_incomplete_checkpoint_is_refused() {
    let ckpt = tempfile::tempdir().unwrap();
    let root = ckpt.path().display().to_string();
    let (mut p, _) = plane(1, 16 * MIB, &["--checkpoint-root", &root]);
    let c = connect(&p);
    for r in 0..20 {
        put(&c, r, 0);
    }
    c.checkpoint(ckpt.path(), c.deadline()).unwrap();
    p.stop();
    let dir = ckpt.path().join("unit-0");
    let blob = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "blob"))
        .unwrap();
    // A truncated blob file.
    let bytes = std::fs::read(&blob).unwrap();
    std::fs::write(&blob, &bytes[..bytes.len() / 2]).unwrap();
    let err = restore_fails(&dir);
    assert!(err.contains("incomplete or damaged checkpoint"), "{err}");
    std::fs::write(&blob, &bytes).unwrap();
    // A crash before the manifest was written.
    std::fs::remove_file(dir.join("MANIFEST")).unwrap();
    let err = restore_fails(&dir);
    assert!(err.contains("no manifest"), "{err}");
}

#[test]
fn shutdown_is_bounded_removes_disk_directories_and_never_fails() {
    let root = tempfile::tempdir().unwrap();
    let args: Vec<String> = disk_args(root.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (mut p, _) = plane(2, 4 * MIB, &args);
    let c = connect(&p);
    for r in 0..200 {
        put(&c, r, 0);
    }
    assert!(eventually(Duration::from_secs(10), || {
        c.stats(c.deadline())
            .into_iter()
            .map(|s| s.unwrap().spilled_blobs)
            .sum::<u64>()
            > 0
    }));
    assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 2);
    p.kill9(1);
    let t = Instant::now();
    let report = c.shutdown(Duration::from_secs(3));
    assert!(
        t.elapsed() < Duration::from_secs(6),
        "shutdown took {:?}",
        t.elapsed()
    );
    assert_eq!(report, vec![Vec::<String>::new(), Vec::new()], "{report:?}");
    // Unit 0 exits by itself and removed its directory; unit 1's (killed)
    // directory is left for the next unit on this root to remove.
    assert!(eventually(Duration::from_secs(5), || {
        std::fs::read_dir(format!("/proc/{}", p.units[0].pid())).is_err()
            || std::fs::read_to_string(format!("/proc/{}/stat", p.units[0].pid()))
                .map(|s| s.contains(") Z"))
                .unwrap_or(true)
    }));
    let left: Vec<_> = std::fs::read_dir(root.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "only the killed unit's directory remains");
    // Asking again, with every unit gone, still does not fail.
    assert_eq!(c.shutdown(Duration::from_secs(1)).len(), 2);
    assert!(matches!(
        c.get_tensors("step", &[RowKey::Index(0)], &["x"], None, c.deadline()),
        Err(Error::LostKeys { .. })
    ));
}

/// The manifest's layout, to hand-craft one as an attacker could (its
/// checksum is no secret).
#[derive(serde::Serialize, serde::Deserialize)]
struct Manifest {
    version: u32,
    rows: u64,
    entries: u64,
    bytes: u64,
    files: Vec<stowage_wire::CheckpointFile>,
}

fn rewrite_manifest(dir: &Path, f: impl FnOnce(&mut Manifest)) {
    let raw = std::fs::read(dir.join("MANIFEST")).unwrap();
    let mut m: Manifest = postcard::from_bytes(&raw[..raw.len() - 8]).unwrap();
    f(&mut m);
    let mut body = postcard::to_allocvec(&m).unwrap();
    let sum = xxhash_rust::xxh3::xxh3_64(&body);
    body.extend_from_slice(&sum.to_le_bytes());
    std::fs::write(dir.join("MANIFEST"), body).unwrap();
}

fn file_entry(name: &str, path: &Path) -> stowage_wire::CheckpointFile {
    let bytes = std::fs::read(path).unwrap();
    stowage_wire::CheckpointFile {
        name: name.into(),
        size: bytes.len() as u64,
        xxh3: xxhash_rust::xxh3::xxh3_64(&bytes),
    }
}

/// A restore of `dir` serves (the unit starts and answers).
fn restore_serves(dir: &Path) {
    let sock = tempfile::tempdir().unwrap();
    let path = sock.path().join("u.sock");
    let mut child = Command::new(binary())
        .args(["unit", "--no-mlock", "--memory", "16MiB", "--listen"])
        .arg(format!("unix:{}", path.display()))
        .arg("--restore")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let serving = eventually(Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(&path).is_ok()
            || child.try_wait().unwrap().is_some()
    }) && child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert!(serving, "the untouched checkpoint did not restore");
}

/// A manifest naming a file outside the checkpoint (`../x`, an absolute
/// path), even with that file's right size and sum, is refused; so are
/// blob files moved under each other's names with a manifest made to
/// match (each file's header names its blob).
#[test]
fn a_manifest_cannot_name_files_outside_the_checkpoint() {
    let ckpt = tempfile::tempdir().unwrap();
    let root = ckpt.path().display().to_string();
    let (mut p, _) = plane(1, 16 * MIB, &["--checkpoint-root", &root]);
    let c = connect(&p);
    for r in 0..20 {
        put(&c, r, 0);
    }
    c.checkpoint(ckpt.path(), c.deadline()).unwrap();
    p.stop();
    let dir = ckpt.path().join("unit-0");
    let clean = std::fs::read(dir.join("MANIFEST")).unwrap();
    restore_serves(&dir);
    std::fs::write(ckpt.path().join("x"), b"outside the checkpoint").unwrap();
    for name in ["../x", "/etc/passwd"] {
        let target = dir.join(name);
        rewrite_manifest(&dir, |m| m.files.insert(0, file_entry(name, &target)));
        let err = restore_fails(&dir);
        assert!(err.contains("no file of a checkpoint"), "{name}: {err}");
        std::fs::write(dir.join("MANIFEST"), &clean).unwrap();
    }
    // Two blob files swapped, the manifest rewritten to match them.
    let mut blobs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "blob"))
        .collect();
    blobs.sort();
    let (a, b) = (&blobs[0], &blobs[1]);
    let tmp = dir.join("swap");
    std::fs::rename(a, &tmp).unwrap();
    std::fs::rename(b, a).unwrap();
    std::fs::rename(&tmp, b).unwrap();
    rewrite_manifest(&dir, |m| {
        for f in &mut m.files {
            *f = file_entry(&f.name.clone(), &dir.join(&f.name));
        }
    });
    let err = restore_fails(&dir);
    assert!(err.contains("not"), "{err}");
    assert!(err.contains("another blob's name"), "{err}");
}

/// A blob stored in pieces (its value larger than any free range) is
/// checkpointed, spilled to the disk tier and read back, and restored into
/// a fresh unit, byte for byte.
#[test]
fn a_blob_in_pieces_checkpoints_spills_and_restores() {
    let root = tempfile::tempdir().unwrap();
    let ckpt = tempfile::tempdir().unwrap();
    let mut opts = LocalOptions::new(1, 32 * MIB);
    opts.command = vec![binary().into(), "unit".into()];
    opts.unit_args = [
        "--disk",
        root.path().to_str().unwrap(),
        "--disk-capacity",
        "256MiB",
        "--high-watermark",
        "0.9",
        "--low-watermark",
        "0.5",
        // Holes stay holes: no spare zone, no compaction.
        "--spare-budget",
        "0",
        "--compaction-ratio",
        "0",
        "--no-mlock",
        "--checkpoint-root",
        ckpt.path().to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    let mut p = LocalPlane::start(&opts).unwrap();
    let c = connect(&p);
    let put_one = |row: u64, v: &[u8]| {
        let t = Tensor::new(DType::U8, vec![v.len() as u64], v).unwrap();
        c.put(
            "step",
            &[RowKey::Index(row)],
            &[("x", Column::Jagged(vec![t]))],
            None,
            c.deadline(),
        )
        .unwrap();
    };
    let get_one = |c: &Client, row: u64| {
        c.get_tensors("step", &[RowKey::Index(row)], &["x"], None, c.deadline())
            .unwrap()[0][0]
            .data
            .clone()
    };
    for r in 0..24 {
        put_one(r, &pattern(r, 0, MIB as usize));
    }
    let odd: Vec<RowKey> = (0..24).filter(|r| r % 2 == 1).map(RowKey::Index).collect();
    c.clear("step", &odd, None, c.deadline()).unwrap();
    let big = pattern(100, 0, 10 * MIB as usize);
    let s = c.stats(c.deadline()).remove(0).unwrap();
    assert!(s.largest_free < big.len() as u64, "{s:?}");
    put_one(100, &big);
    let s = c.stats(c.deadline()).remove(0).unwrap();
    assert_eq!(s.split_blobs, 1, "the 10 MiB value went into pieces: {s:?}");
    assert!(get_one(&c, 100) == big);

    // A checkpoint copies the blob's pieces.
    c.checkpoint(&ckpt.path().join("c1"), c.deadline()).unwrap();

    // Past the high watermark the oldest blobs spill, the one in pieces
    // among them; it reads back exactly.
    for r in 200..208 {
        put_one(r, &pattern(r, 0, MIB as usize));
    }
    assert!(
        eventually(Duration::from_secs(30), || {
            let s = c.stats(c.deadline()).remove(0).unwrap();
            s.spilled_blobs >= 13 && s.split_blobs == 0
        }),
        "the blob in pieces was not spilled: {:?}",
        c.stats(c.deadline())
    );
    assert!(
        get_one(&c, 100) == big,
        "the spilled blob in pieces reads back"
    );
    for r in (0..24).step_by(2).chain(200..208) {
        assert!(get_one(&c, r) == pattern(r, 0, MIB as usize), "row {r}");
    }
    p.stop();

    // Restored into a fresh unit.
    let mut opts = LocalOptions::new(1, 64 * MIB);
    opts.command = vec![binary().into(), "unit".into()];
    opts.unit_args = vec!["--no-mlock".into()];
    opts.restore = Some(ckpt.path().join("c1"));
    let q = LocalPlane::start(&opts).unwrap();
    let c2 = connect(&q);
    assert!(get_one(&c2, 100) == big, "the restored blob in pieces");
    for r in (0..24).step_by(2) {
        assert!(get_one(&c2, r) == pattern(r, 0, MIB as usize), "row {r}");
    }
}

/// Checkpoints across hosts (issue 26), one host's share: over tcp, a
/// client that proved the units' shared secret checkpoints them (each
/// part's reply names its host and its place under the unit's root), and
/// has a unit serve a part from a restore unit that it starts on its own
/// host (sized from the part's files, with the same secret), reached at
/// the host the unit is reached at; a part that is not there is told as
/// missing, a path outside the root or through a link is refused, and a
/// closed restore unit takes no new connection. Units without a secret
/// take no checkpoint request over tcp.
#[test]
fn over_tcp_with_the_secret_units_checkpoint_and_serve_restores() {
    let ckpt = tempfile::tempdir().unwrap();
    let mut opts = LocalOptions::new(2, 8 * MIB);
    opts.command = vec![binary().into(), "unit".into()];
    opts.unit_args = vec![
        "--no-mlock".into(),
        "--checkpoint-root".into(),
        ckpt.path().display().to_string(),
    ];
    let p = LocalPlane::start(&opts).unwrap();
    let mut cfg = ClientConfig::new("ns", p.tcp_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(60);
    let c = Client::connect(cfg).unwrap();
    for r in 0..20 {
        put(&c, r, 0);
    }
    let infos = c.checkpoint(&ckpt.path().join("s1"), c.deadline()).unwrap();
    for (i, info) in infos.iter().enumerate() {
        assert_eq!(info.stored, format!("s1/unit-{i}"));
        assert!(!info.host.is_empty());
    }

    // Unit 1 serves unit 0's part (same host, same root here).
    let reply = c.open_restore(1, "s1/unit-0", c.deadline()).unwrap();
    let src = reply.opened.expect("the part is there");
    assert_eq!(src.info.manifest_xxh3, infos[0].manifest_xxh3);
    assert_eq!(src.info.rows, infos[0].rows);
    assert_eq!(src.info.stored, "s1/unit-0");
    let addr = c.restore_address(1, &src).unwrap();
    let stowage_client::UnitAddr::Tcp(a) = &addr else {
        panic!("a tcp client reaches the restore unit over tcp, not {addr:?}")
    };
    assert!(a.ip().is_loopback(), "{a}");
    let r = c.sibling(vec![addr.clone()], "ns").unwrap();
    let rows: Vec<RowKey> = (0..20).filter(|r| r % 2 == 0).map(RowKey::Index).collect();
    let got = r
        .get_tensors("step", &rows, &["x"], None, r.deadline())
        .unwrap();
    for (k, t) in rows.iter().zip(&got[0]) {
        let RowKey::Index(row) = k else {
            panic!("{k:?}")
        };
        assert_eq!(t.data, value(*row, 0), "row {row}");
    }
    // Without the secret, the restore unit refuses.
    let mut bare = ClientConfig::new("ns", vec![addr.clone()]);
    bare.timeout = Duration::from_secs(10);
    let bare = Client::connect(bare).unwrap();
    assert!(matches!(
        bare.check_units(bare.deadline()),
        Err(Error::Unauthorized(_))
    ));
    drop(r);
    c.close_restore(1, src.id, c.deadline()).unwrap();
    let again = c.sibling(vec![addr], "ns").unwrap();
    assert!(again.check_units(again.deadline()).is_err());

    // Missing, outside the root, through a link.
    let missing = c.open_restore(0, "s2/unit-0", c.deadline()).unwrap();
    assert!(missing.opened.is_none());
    assert!(
        missing.missing.contains("no directory"),
        "{}",
        missing.missing
    );
    assert!(missing.path.ends_with("s2/unit-0"), "{}", missing.path);
    let e = c.open_restore(0, "/etc", c.deadline()).unwrap_err();
    assert!(
        matches!(&e, Error::Unauthorized(m) if m.contains("outside this unit's checkpoint root")),
        "{e}"
    );
    std::os::unix::fs::symlink(ckpt.path().join("s1"), ckpt.path().join("link")).unwrap();
    let e = c.open_restore(0, "link/unit-0", c.deadline()).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");
    let e = c.open_restore(0, "../x", c.deadline()).unwrap_err();
    assert!(e.to_string().contains("'..'"), "{e}");

    // Units without a secret: no checkpoint request over tcp.
    let mut opts = LocalOptions::new(1, 8 * MIB);
    opts.command = vec![binary().into(), "unit".into()];
    opts.insecure = true;
    opts.unit_args = vec![
        "--no-mlock".into(),
        "--checkpoint-root".into(),
        ckpt.path().display().to_string(),
    ];
    let open = LocalPlane::start(&opts).unwrap();
    let c = Client::connect(ClientConfig::new("ns", open.tcp_addrs())).unwrap();
    for e in [
        c.checkpoint(&ckpt.path().join("s3"), c.deadline())
            .unwrap_err(),
        c.open_restore(0, "s1/unit-0", c.deadline()).unwrap_err(),
    ] {
        assert!(matches!(e, Error::Unauthorized(_)), "{e}");
    }
    assert!(!ckpt.path().join("s3").exists());
}

/// The rows of `keys` (index keys), as a set.
fn index_rows(keys: &[RowKey]) -> std::collections::BTreeSet<u64> {
    keys.iter()
        .map(|k| match k {
            RowKey::Index(r) => *r,
            other => panic!("{other:?}"),
        })
        .collect()
}

fn claim_all(c: &Client, task: &str) -> std::collections::BTreeSet<u64> {
    let keys = c
        .claim("step", task, &["x".into()], 1000, false, c.deadline())
        .unwrap();
    let rows = index_rows(&keys);
    assert_eq!(rows.len(), keys.len(), "a row twice in one claim");
    rows
}

/// A checkpoint keeps each partition's claims: restored into fresh units,
/// the tasks are registered as before, their consumed counts are kept, a
/// claim returns exactly the rows not consumed before the checkpoint, and
/// rows leased but not settled when it was taken are claimable again. A
/// checkpoint without its claims file (an older one) restores with none.
#[test]
fn a_checkpoint_keeps_the_claims_of_its_partitions() {
    let ckpt = tempfile::tempdir().unwrap();
    let root = ckpt.path().display().to_string();
    let (mut p, _) = plane(2, 16 * MIB, &["--checkpoint-root", &root]);
    let c = connect(&p);
    let n = 40u64;
    for r in 0..n {
        put(&c, r, 0);
    }
    let tasks = ["train".to_string(), "reward".to_string()];
    c.register_tasks("step", &tasks, n, 0, c.deadline())
        .unwrap();
    let train = index_rows(
        &c.claim("step", "train", &["x".into()], 7, false, c.deadline())
            .unwrap(),
    );
    let reward = index_rows(
        &c.claim("step", "reward", &["x".into()], 3, false, c.deadline())
            .unwrap(),
    );
    assert_eq!((train.len(), reward.len()), (7, 3));
    // A lease of unit 0 left unsettled while the checkpoint is taken.
    let mut raw = common::Raw::hello(&p.units[0].uds, "ns");
    let leased = match raw.call(&stowage_wire::Request::Claim {
        partition: "step".into(),
        task: "train".into(),
        fields: vec!["x".into()],
        want: 2,
        wait_ms: 0,
        homes: None,
    }) {
        stowage_wire::Response::Claimed { rows, .. } => rows,
        other => panic!("{other:?}"),
    };
    assert!(!leased.is_empty());
    assert!(leased.iter().all(|r| !train.contains(r)));
    let st = c.claim_status("step", "train", c.deadline()).unwrap();
    assert_eq!((st.consumed, st.leased), (7, leased.len() as u64));
    let infos = c.checkpoint(&ckpt.path().join("c1"), c.deadline()).unwrap();
    for i in &infos {
        assert!(i.files.iter().any(|f| f.name == "claims"), "{i:?}");
    }
    drop(raw);
    p.stop();

    let restore = |dir: &Path| {
        let mut opts = LocalOptions::new(2, 16 * MIB);
        opts.command = vec![binary().into(), "unit".into()];
        opts.unit_args = vec!["--no-mlock".into()];
        opts.restore = Some(dir.to_owned());
        LocalPlane::start(&opts).unwrap()
    };
    let all: std::collections::BTreeSet<u64> = (0..n).collect();
    let q = restore(&ckpt.path().join("c1"));
    let c2 = connect(&q);
    let st = c2.claim_status("step", "train", c2.deadline()).unwrap();
    assert!(st.registered);
    assert_eq!((st.samples, st.group_size), (n, 0));
    assert_eq!(
        (st.consumed, st.leased),
        (7, 0),
        "the lease is not consumed"
    );
    let st = c2.claim_status("step", "reward", c2.deadline()).unwrap();
    assert!(st.registered);
    assert_eq!(st.consumed, 3);
    // Each unit's claims state as restored, before anything is claimed.
    let states: Vec<Vec<u8>> = (0..2)
        .map(|u| c2.claims_state(u, c2.deadline()).unwrap())
        .collect();
    let again = claim_all(&c2, "train");
    assert_eq!(again, &all - &train, "train after the restore");
    assert!(leased.iter().all(|r| again.contains(r)));
    assert_eq!(claim_all(&c2, "reward"), &all - &reward);
    assert!(claim_all(&c2, "train").is_empty());
    assert_eq!(
        c2.claim_status("step", "train", c2.deadline())
            .unwrap()
            .consumed,
        n
    );
    drop(c2);
    drop(q);

    // The same checkpoint without its claims file: the data, no claims.
    for i in 0..2 {
        let dir = ckpt.path().join(format!("c1/unit-{i}"));
        rewrite_manifest(&dir, |m| m.files.retain(|f| f.name != "claims"));
        std::fs::remove_file(dir.join("claims")).unwrap();
    }
    let q = restore(&ckpt.path().join("c1"));
    let c3 = connect(&q);
    assert_eq!(c3.list("step", c3.deadline()).unwrap().len() as u64, n);
    let st = c3.claim_status("step", "train", c3.deadline()).unwrap();
    assert!(!st.registered);
    assert_eq!(st.consumed, 0);

    // Loaded into running units that hold the same rows, the claims
    // states read from the restored ones bring the consumption back; in
    // another namespace they name other partitions.
    let mut cfg = ClientConfig::new("other", q.uds_addrs());
    cfg.secret = q.secret().cloned();
    let other = Client::connect(cfg).unwrap();
    for (u, state) in states.iter().enumerate() {
        other.load_claims(u, state, other.deadline()).unwrap();
    }
    let st = c3.claim_status("step", "train", c3.deadline()).unwrap();
    assert!(!st.registered, "a namespace's claims stay in it");
    for (u, state) in states.iter().enumerate() {
        c3.load_claims(u, state, c3.deadline()).unwrap();
    }
    let st = c3.claim_status("step", "train", c3.deadline()).unwrap();
    assert!(st.registered);
    assert_eq!((st.samples, st.consumed), (n, 7));
    assert_eq!(claim_all(&c3, "train"), &all - &train);
    assert_eq!(claim_all(&c3, "reward"), &all - &reward);
    assert!(c3.load_claims(0, b"junk", c3.deadline()).is_err());
}
