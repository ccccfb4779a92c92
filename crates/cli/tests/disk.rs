//! The disk tier with real unit processes: spilling, reading back, full
//! disks, failing disks, corrupt files, dead units' directories.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{client, data_bytes, eventually, pattern, plane, Kind};
use stowage_client::{Client, ClientConfig, Error, Key};
use stowage_local::LocalPlane;

const MIB: u64 = 1 << 20;

common::both_transports!(
    three_times_memory_reads_back_exactly_while_readers_run,
    a_corrupt_file_fails_exactly_its_keys,
    a_failing_disk_fails_puts_retryably_and_loses_nothing,
);

fn disk_plane(
    units: usize,
    memory: u64,
    root: &Path,
    capacity: &str,
    extra: &[&str],
) -> LocalPlane {
    let mut args = vec![
        "--disk",
        root.to_str().expect("utf-8 temp path"),
        "--disk-capacity",
        capacity,
        "--high-watermark",
        "0.6",
        "--low-watermark",
        "0.4",
    ];
    args.extend_from_slice(extra);
    plane(units, memory, &args).0
}

fn spilled(c: &Client) -> u64 {
    c.stats(c.deadline())
        .into_iter()
        .map(|s| s.unwrap().spilled_blobs)
        .sum()
}

fn unit_dirs(root: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    v.sort();
    v
}

fn blob_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "blob"))
        .collect();
    v.sort();
    v
}

fn three_times_memory_reads_back_exactly_while_readers_run(kind: Kind) {
    let root = tempfile::tempdir().unwrap();
    let p = disk_plane(2, 8 * MIB, root.path(), "256MiB", &[]);
    let c = client(&p, kind, Duration::from_secs(60));
    let value = |r: u64| pattern(r, 7, 256 * 1024 + (r as usize % 7) * 1000);
    let rows: u64 = 2 * 3 * 8 * 4; // 3x the memory of 2 units, in 256 KiB values
    let done = AtomicBool::new(false);
    let stored = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        // Readers re-read what is stored while spilling goes on.
        for _ in 0..2 {
            s.spawn(|| {
                let mut checks = 0u64;
                while !done.load(Ordering::Relaxed) {
                    let n = stored.load(Ordering::Acquire);
                    if n == 0 {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                    let r = checks * 7919 % n;
                    let got = c.get_rows(&[Key::new(r, "v")], c.deadline()).unwrap();
                    assert!(got[0] == value(r), "row {r} read back different bytes");
                    checks += 1;
                }
            });
        }
        for r in 0..rows {
            c.put_rows(&[(Key::new(r, "v"), &value(r))], c.deadline())
                .unwrap();
            stored.store(r + 1, Ordering::Release);
        }
        done.store(true, Ordering::Relaxed);
    });
    assert!(spilled(&c) > 0, "nothing spilled");
    let keys: Vec<Key> = (0..rows).map(|r| Key::new(r, "v")).collect();
    for chunk in keys.chunks(16) {
        let got = c.get_rows(chunk, c.deadline()).unwrap();
        for (k, v) in chunk.iter().zip(got) {
            assert!(v == value(k.row), "{k} read back different bytes");
        }
    }
    // Clearing removes every file: no orphans.
    c.clear_rows(&(0..rows).collect::<Vec<_>>(), c.deadline())
        .unwrap();
    assert!(eventually(Duration::from_secs(10), || {
        unit_dirs(root.path())
            .iter()
            .all(|d| blob_files(d).is_empty())
    }));
    assert!(c.stats(c.deadline()).into_iter().all(|s| {
        let s = s.unwrap();
        data_bytes(&s) == 0 && s.disk_used == 0
    }));
}

fn a_corrupt_file_fails_exactly_its_keys(kind: Kind) {
    let root = tempfile::tempdir().unwrap();
    let p = disk_plane(1, 4 * MIB, root.path(), "64MiB", &[]);
    let c = client(&p, kind, Duration::from_secs(30));
    let value = |r: u64| pattern(r, 9, 512 * 1024);
    for r in 0..16 {
        c.put_rows(&[(Key::new(r, "v"), &value(r))], c.deadline())
            .unwrap();
    }
    assert!(eventually(Duration::from_secs(10), || spilled(&c) >= 4));
    let dir = &unit_dirs(root.path())[0];
    let files = blob_files(dir);
    assert!(!files.is_empty());
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&files[0], &bytes).unwrap();
    let mut bad = Vec::new();
    for r in 0..16 {
        match c.get_rows(&[Key::new(r, "v")], c.deadline()) {
            Ok(got) => assert!(got[0] == value(r), "row {r}: wrong bytes"),
            Err(Error::Corrupt { keys, .. }) => {
                assert_eq!(keys, vec![Key::new(r, "v")]);
                bad.push(r);
            }
            Err(e) => panic!("row {r}: {e}"),
        }
    }
    assert_eq!(
        bad.len(),
        1,
        "exactly the corrupt blob's key fails: {bad:?}"
    );
    // Truncation is caught the same way.
    std::fs::write(&files[0], &bytes[..100]).unwrap();
    assert!(matches!(
        c.get_rows(&[Key::new(bad[0], "v")], c.deadline()),
        Err(Error::Corrupt { .. })
    ));
}

fn a_failing_disk_fails_puts_retryably_and_loses_nothing(kind: Kind) {
    let root = tempfile::tempdir().unwrap();
    let p = disk_plane(
        1,
        4 * MIB,
        root.path(),
        "64MiB",
        &["--failpoint", "disk-write"],
    );
    let c = client(&p, kind, Duration::from_secs(10));
    let value = |r: u64| pattern(r, 11, 512 * 1024);
    let mut stored = 0;
    let err = loop {
        match c.put_rows(&[(Key::new(stored, "v"), &value(stored))], c.deadline()) {
            Ok(()) => stored += 1,
            Err(e) => break e,
        }
        assert!(stored < 64, "puts kept succeeding with a failing disk");
    };
    assert!(err.is_retryable(), "{err:?}");
    assert!(matches!(err, Error::TransferFailed { .. }), "{err:?}");
    assert!(stored >= 4, "memory took only {stored} values");
    // Everything already stored is still there (spills failed, memory kept).
    for r in 0..stored {
        assert!(c.get_rows(&[Key::new(r, "v")], c.deadline()).unwrap()[0] == value(r));
    }
    assert!(blob_files(&unit_dirs(root.path())[0]).is_empty());
}

#[test]
fn full_memory_and_disk_refuse_puts_until_a_clear() {
    let root = tempfile::tempdir().unwrap();
    // Nothing spills (high watermark 1): puts fill memory, then go to
    // disk. A spill still running when the clear lands would rightly
    // answer the waiting put Busy (its memory comes back shortly), a race
    // this test of Full waits is not about.
    let args = [
        "--disk",
        root.path().to_str().expect("utf-8 temp path"),
        "--disk-capacity",
        "4MiB",
        "--high-watermark",
        "1",
        "--low-watermark",
        "1",
    ];
    let p = plane(1, 4 * MIB, &args).0;
    let c = client(&p, Kind::Shm, Duration::from_secs(10));
    let v = pattern(1, 1, 1024 * 1024);
    let mut stored = 0u64;
    let err = loop {
        match c.put_rows(&[(Key::new(stored, "v"), &v)], c.deadline()) {
            Ok(()) => stored += 1,
            Err(e) => break e,
        }
        assert!(stored <= 8, "8 MiB of memory and disk took more than 8 MiB");
    };
    assert!(matches!(err, Error::UnitFull { unit: 0, .. }), "{err:?}");
    assert!(
        stored >= 5,
        "only {stored} MiB fit in 4 MiB memory + 4 MiB disk"
    );
    // Nothing stored was evicted.
    for r in 0..stored {
        assert!(c.get_rows(&[Key::new(r, "v")], c.deadline()).unwrap()[0] == v);
    }
    // A put that may wait for memory succeeds once a clear makes room.
    let mut cfg = ClientConfig::new("test", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.wait_for_memory = Some(Duration::from_secs(20));
    cfg.timeout = Duration::from_secs(30);
    let waiting = Client::connect(cfg).unwrap();
    std::thread::scope(|s| {
        let h = s.spawn(|| waiting.put_rows(&[(Key::new(100, "v"), &v)], waiting.deadline()));
        std::thread::sleep(Duration::from_millis(500));
        if h.is_finished() {
            panic!("the put did not wait: {:?}", h.join());
        }
        c.clear_rows(&[0, 1], c.deadline()).unwrap();
        h.join().unwrap().unwrap();
    });
    assert!(c.get_rows(&[Key::new(100, "v")], c.deadline()).unwrap()[0] == v);
    // The waiting client's metrics show the wait (at least the 500 ms
    // before the clear), not as Busy retries.
    let m = waiting.metrics();
    assert!(m.memory_waits >= 1, "{m:?}");
    assert!(m.memory_wait_seconds >= 0.4, "{m:?}");
    assert_eq!(m.busy_retries, 0, "{m:?}");
}

#[test]
fn a_new_unit_removes_dead_units_directories_and_spares_live_ones() {
    let root = tempfile::tempdir().unwrap();
    let (mut p, opts) = {
        let args = [
            "--disk",
            root.path().to_str().unwrap(),
            "--disk-capacity",
            "64MiB",
            "--high-watermark",
            "0.5",
            "--low-watermark",
            "0.3",
        ];
        plane(2, 4 * MIB, &args)
    };
    let c = client(&p, Kind::Shm, Duration::from_secs(30));
    for r in 0..24u64 {
        c.put_rows(
            &[(Key::new(r, "v"), &pattern(r, 2, 300 * 1024))],
            c.deadline(),
        )
        .unwrap();
    }
    assert!(eventually(Duration::from_secs(10), || spilled(&c) >= 2));
    let before = unit_dirs(root.path());
    assert_eq!(before.len(), 2);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&before[0]).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o700, "unit directories are owner-only");
    let dead_dir = before
        .iter()
        .find(|d| {
            d.to_string_lossy()
                .contains(&format!("-{}-", p.units[0].pid()))
        })
        .cloned()
        .expect("unit 0's directory");
    p.kill9(0);
    assert!(dead_dir.exists(), "a killed unit cannot clean up");
    p.restart(0, &opts).unwrap();
    let after = unit_dirs(root.path());
    assert!(
        !dead_dir.exists(),
        "the dead unit's directory was not removed"
    );
    assert_eq!(after.len(), 2);
    // The live unit's directory and data are untouched.
    let live: Vec<&PathBuf> = before.iter().filter(|d| **d != dead_dir).collect();
    assert!(live[0].exists());
    for r in (1..24u64).step_by(2) {
        assert!(
            c.get_rows(&[Key::new(r, "v")], c.deadline()).unwrap()[0] == pattern(r, 2, 300 * 1024)
        );
    }
    assert!(matches!(
        c.get_rows(&[Key::new(0, "v")], c.deadline()),
        Err(Error::LostKeys { unit: 0, .. })
    ));
}
