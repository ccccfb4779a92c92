//! The disk tier on a host with other users and other processes: roots
//! another user could write are refused, nothing planted or swapped in the
//! disk directory leads the unit astray (a FIFO lock, a unit directory
//! swapped for a link, blob files swapped), teardown follows no link, a
//! full disk is `UnitFull`, a put lost after Pending says so, and a get of
//! spilled values stays within the unit's read budget.

mod common;

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{binary, client, eventually, pattern, plane, Kind};
use stowage_client::{Client, Error, Key};

const MIB: u64 = 1 << 20;

/// Whether this process may chown, mount and read any /proc (the tests
/// that play another user or mount a small disk need it).
fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// A `stowage unit` process, killed and reaped on drop.
struct Unit(Child);

impl Drop for Unit {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

enum Started {
    Serving(Unit),
    /// It exited; its stderr.
    Exited(String),
}

/// Start a unit on `sock` with `args` and wait (at most `within`) until it
/// answers on its socket or exits.
fn start_unit(sock: &Path, args: &[&str], within: Duration) -> Started {
    let mut child = Command::new(binary())
        .args(["unit", "--no-mlock", "--memory", "8MiB", "--listen"])
        .arg(format!("unix:{}", sock.display()))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the unit starts");
    let end = Instant::now() + within;
    loop {
        if let Some(_status) = child.try_wait().unwrap() {
            let mut err = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut err);
            return Started::Exited(err);
        }
        if std::os::unix::net::UnixStream::connect(sock).is_ok() {
            return Started::Serving(Unit(child));
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the unit neither served nor exited within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn refused(root: &Path, extra: &[&str]) -> String {
    let sock = tempfile::tempdir().unwrap();
    let mut args = vec!["--disk", root.to_str().unwrap()];
    args.extend_from_slice(extra);
    match start_unit(&sock.path().join("u.sock"), &args, Duration::from_secs(20)) {
        Started::Serving(_) => panic!("a unit started on the disk root {}", root.display()),
        Started::Exited(err) => err,
    }
}

fn disk_args(root: &Path) -> Vec<String> {
    [
        "--disk",
        root.to_str().expect("utf-8 temp path"),
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

fn spilled(c: &Client) -> u64 {
    c.stats(c.deadline())
        .into_iter()
        .map(|s| s.unwrap().spilled_blobs)
        .sum()
}

/// The unit directories (and anything else) in `root`.
fn entries(root: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().path())
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

/// A directory "of the job's own user" with files in it, and a check that
/// it still holds exactly them.
struct Victim {
    dir: tempfile::TempDir,
}

impl Victim {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("results.txt"), b"precious").unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/model.bin"), b"weights").unwrap();
        Victim { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn assert_untouched(&self) {
        let names: Vec<String> = entries(self.path())
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["results.txt", "sub"], "the directory changed");
        assert_eq!(
            std::fs::read(self.path().join("results.txt")).unwrap(),
            b"precious"
        );
        assert_eq!(
            std::fs::read(self.path().join("sub/model.bin")).unwrap(),
            b"weights"
        );
    }
}

/// A FIFO planted as a dead unit's lock file: a unit starting on the root
/// used to open it blocking and never start. Now it starts (the
/// directory is left alone), within a bounded wait.
#[test]
fn a_fifo_planted_as_a_lock_file_does_not_hang_a_start() {
    let root = tempfile::tempdir().unwrap();
    let dead = root.path().join("stowage-unit-x-1-00000001");
    std::fs::create_dir(&dead).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        dead.join("lock"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    // A temporary directory with a FIFO lock too.
    let new = root.path().join("stowage-new-x-1-00000002-0");
    std::fs::create_dir(&new).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        new.join("lock"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let sock = tempfile::tempdir().unwrap();
    let args = ["--disk", root.path().to_str().unwrap()];
    match start_unit(&sock.path().join("u.sock"), &args, Duration::from_secs(20)) {
        Started::Serving(_unit) => {}
        Started::Exited(err) => panic!("the unit refused to start: {err}"),
    }
}

/// A root another user could write, or owned by another user, or a
/// symbolic link, is refused at start with a message that says why and
/// how to fix it; so is such a checkpoint root.
#[test]
fn a_disk_root_others_could_write_is_refused_with_the_fix() {
    let base = tempfile::tempdir().unwrap();
    // Writable by others (as a shared scratch directory).
    let open = base.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let err = refused(&open, &[]);
    assert!(err.contains("writable by others"), "{err}");
    assert!(err.contains("chmod 700"), "{err}");
    // Writable by the group.
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o770)).unwrap();
    let err = refused(&open, &[]);
    assert!(err.contains("writable by its group"), "{err}");
    // A symbolic link to a directory of the job's own user: refused, and
    // nothing is created (or later removed) there.
    let victim = Victim::new();
    let link = base.path().join("link");
    std::os::unix::fs::symlink(victim.path(), &link).unwrap();
    let err = refused(&link, &[]);
    assert!(err.contains("symbolic link"), "{err}");
    victim.assert_untouched();
    // A checkpoint root writable by others.
    let own = base.path().join("own");
    std::fs::create_dir(&own).unwrap();
    std::fs::set_permissions(&own, std::fs::Permissions::from_mode(0o700)).unwrap();
    let err = refused(&own, &["--checkpoint-root", open.to_str().unwrap()]);
    assert!(err.contains("checkpoint root"), "{err}");
    if !is_root() {
        eprintln!("not root: the root owned by another user is not tried");
        return;
    }
    // Made first by another user (nobody) in a shared scratch directory,
    // private to that user: refused, though nobody else can write it.
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let scratch = base.path().join("scratch");
    std::fs::create_dir(&scratch).unwrap();
    std::fs::set_permissions(&scratch, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let theirs = scratch.join("stowage");
    let made = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .args(["mkdir", "-m", "700"])
        .arg(&theirs)
        .status()
        .is_ok_and(|s| s.success());
    if !made {
        // No setpriv (util-linux): the same directory, given away.
        std::fs::create_dir(&theirs).unwrap();
        rustix::fs::chown(
            &theirs,
            Some(rustix::fs::Uid::from_raw(65534)),
            Some(rustix::fs::Gid::from_raw(65534)),
        )
        .unwrap();
    }
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&theirs).unwrap()),
        65534
    );
    let err = refused(&theirs, &[]);
    assert!(err.contains("owned by uid 65534"), "{err}");
    assert!(err.contains("chown"), "{err}");
}

/// The unit's directory renamed away and replaced by a symbolic link to
/// another directory: the unit writes nothing there (its files go on in
/// its own directory, reached by descriptor), and its teardown deletes
/// nothing there either.
#[test]
fn a_unit_directory_swapped_for_a_link_leads_nothing_astray() {
    let root = tempfile::tempdir().unwrap();
    let args = disk_args(root.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (mut p, _) = plane(1, 4 * MIB, &args);
    let c = client(&p, Kind::Shm, Duration::from_secs(30));
    let value = |r: u64| pattern(r, 5, 256 * 1024);
    for r in 0..12 {
        c.put_rows(&[(Key::new(r, "v"), &value(r))], c.deadline())
            .unwrap();
    }
    assert!(eventually(Duration::from_secs(10), || spilled(&c) >= 2));
    let dirs = entries(root.path());
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    let dir = dirs[0].clone();
    let moved = root.path().join("moved-away");
    std::fs::rename(&dir, &moved).unwrap();
    let victim = Victim::new();
    std::os::unix::fs::symlink(victim.path(), &dir).unwrap();
    // More puts, more spills.
    let before = spilled(&c);
    for r in 12..40 {
        c.put_rows(&[(Key::new(r, "v"), &value(r))], c.deadline())
            .unwrap();
    }
    assert!(eventually(Duration::from_secs(10), || spilled(&c) > before));
    victim.assert_untouched();
    for r in 0..40 {
        let got = c.get_rows(&[Key::new(r, "v")], c.deadline()).unwrap();
        assert!(got[0] == value(r), "row {r} read back different bytes");
    }
    // Teardown: the link's target is left alone.
    let pid = p.units[0].pid();
    let report = c.shutdown(Duration::from_secs(5));
    assert_eq!(report.len(), 1);
    assert!(eventually(Duration::from_secs(10), || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.contains(") Z"))
            .unwrap_or(true)
    }));
    p.stop();
    victim.assert_untouched();
    // The unit emptied its own directory, wherever it was moved.
    assert!(blob_files(&moved).is_empty());
}

/// Two blob files of equal size swapped in the unit's directory: a get of
/// either row fails Corrupt (over the streamed read and over a promotion
/// into the slab), never returning the other row's bytes.
#[test]
fn swapped_blob_files_are_corrupt_never_another_rows_bytes() {
    let root = tempfile::tempdir().unwrap();
    let args = disk_args(root.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (p, _) = plane(1, 4 * MIB, &args);
    let shm = client(&p, Kind::Shm, Duration::from_secs(30));
    let tcp = client(&p, Kind::Tcp, Duration::from_secs(30));
    let value = |r: u64| pattern(r, 9, 512 * 1024);
    let rows = 16u64;
    for r in 0..rows {
        shm.put_rows(&[(Key::new(r, "v"), &value(r))], shm.deadline())
            .unwrap();
    }
    assert!(eventually(Duration::from_secs(10), || spilled(&shm) >= 4));
    let dir = &entries(root.path())[0];
    let files = blob_files(dir);
    assert!(files.len() >= 2, "{files:?}");
    let (a, b) = (&files[0], &files[1]);
    assert_eq!(
        std::fs::metadata(a).unwrap().len(),
        std::fs::metadata(b).unwrap().len()
    );
    let tmp = dir.join("swap.tmp");
    std::fs::rename(a, &tmp).unwrap();
    std::fs::rename(b, a).unwrap();
    std::fs::rename(&tmp, b).unwrap();
    for c in [&tcp, &shm] {
        let mut bad = Vec::new();
        for r in 0..rows {
            match c.get_rows(&[Key::new(r, "v")], c.deadline()) {
                Ok(got) => assert!(got[0] == value(r), "row {r}: another row's bytes"),
                Err(Error::Corrupt { keys, .. }) => {
                    assert_eq!(keys, vec![Key::new(r, "v")]);
                    bad.push(r);
                }
                Err(e) => panic!("row {r}: {e}"),
            }
        }
        assert_eq!(bad.len(), 2, "exactly the two swapped rows fail: {bad:?}");
    }
}

/// The peak resident memory of process `pid` (VmHWM), bytes.
fn peak_rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM in /proc/PID/status");
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap();
    kb * 1024
}

/// One get of 96 MiB of spilled values from a 16 MiB unit keeps the
/// unit's peak resident memory within what it held before the get plus
/// its disk-read budget (8 MiB by default, docs/config.md) and a margin
/// of 8 MiB. (It used to read every value into its heap first: +86 MB.)
#[test]
fn a_96_mib_get_of_spilled_values_stays_within_the_read_budget() {
    let root = tempfile::tempdir().unwrap();
    let args = disk_args(root.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (p, _) = plane(1, 16 * MIB, &args);
    let pid = p.units[0].pid();
    let c = client(&p, Kind::Tcp, Duration::from_secs(120));
    let value = |r: u64| pattern(r, 3, MIB as usize);
    let rows = 96u64;
    for r in 0..rows {
        c.put_rows(&[(Key::new(r, "v"), &value(r))], c.deadline())
            .unwrap();
    }
    // Most of it on disk (spilled, or put straight there).
    assert!(eventually(Duration::from_secs(30), || {
        c.stats(c.deadline())[0].as_ref().unwrap().disk_used >= 80 * MIB
    }));
    let keys: Vec<Key> = (0..rows).map(|r| Key::new(r, "v")).collect();
    let shm = client(&p, Kind::Shm, Duration::from_secs(120));
    for (name, c) in [("tcp", &c), ("shm", &shm)] {
        // Peak memory since now (writing 5 to clear_refs resets VmHWM).
        let reset = std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok();
        let before = peak_rss(pid);
        let got = c.get_rows(&keys, c.deadline()).unwrap();
        let after = peak_rss(pid);
        for (r, v) in got.iter().enumerate() {
            assert!(
                *v == value(r as u64),
                "{name}: row {r} read back different bytes"
            );
        }
        let grew = after.saturating_sub(before);
        eprintln!(
            "{name}: peak RSS {:.1} MiB before the get, {:.1} MiB after (reset: {reset})",
            before as f64 / MIB as f64,
            after as f64 / MIB as f64
        );
        assert!(
            grew <= 16 * MIB,
            "{name}: a 96 MiB get of spilled values grew the unit's peak RSS by {:.1} MiB",
            grew as f64 / MIB as f64
        );
    }
}

/// A small tmpfs mounted for a test, unmounted on drop.
struct Mount(tempfile::TempDir);

impl Mount {
    fn tmpfs(size: &str) -> Option<Mount> {
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Mount(dir))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0.path()).status();
    }
}

/// A disk that fills up under a put to the disk tier: the put fails with
/// `UnitFull` (was: `TransferFailed`), and what was stored stays.
#[test]
fn a_full_disk_is_unit_full() {
    if !is_root() {
        eprintln!("not root: cannot mount a small tmpfs; skipped");
        return;
    }
    let disk = Mount::tmpfs("3m")
        .expect("mount a 3 MiB tmpfs (root in a container may need CAP_SYS_ADMIN)");
    let root = disk.0.path();
    let err;
    {
        // Nothing spills (high watermark 1): puts fill memory, then go to
        // disk, whose capacity the tmpfs cannot hold.
        let args = [
            "--disk",
            root.to_str().unwrap(),
            "--disk-capacity",
            "64MiB",
            "--high-watermark",
            "1",
            "--low-watermark",
            "1",
        ];
        let (mut p, _) = plane(1, 4 * MIB, &args);
        let c = client(&p, Kind::Tcp, Duration::from_secs(20));
        let v = |r: u64| pattern(r, 4, MIB as usize);
        let mut stored = 0u64;
        err = loop {
            match c.put_rows(&[(Key::new(stored, "v"), &v(stored))], c.deadline()) {
                Ok(()) => stored += 1,
                Err(e) => break e,
            }
            assert!(stored < 16, "puts kept succeeding on a 3 MiB disk");
        };
        assert!(stored >= 4, "only {stored} values stored");
        for r in 0..stored {
            assert!(c.get_rows(&[Key::new(r, "v")], c.deadline()).unwrap()[0] == v(r));
        }
        p.stop();
    }
    assert!(matches!(err, Error::UnitFull { .. }), "{err:?}");
    assert!(err.to_string().contains("no space left"), "{err}");
}

/// A put answered Pending whose blob file then cannot be made durable is
/// reported as that on its next Commit, not as "unknown blob".
#[test]
fn a_disk_put_lost_after_pending_says_what_happened() {
    let root = tempfile::tempdir().unwrap();
    let args = [
        "--disk",
        root.path().to_str().unwrap(),
        "--disk-capacity",
        "64MiB",
        "--high-watermark",
        "1",
        "--low-watermark",
        "1",
        "--failpoint",
        "disk-sync",
    ];
    let (p, _) = plane(1, 4 * MIB, &args);
    let c = client(&p, Kind::Tcp, Duration::from_secs(20));
    let v = pattern(1, 1, MIB as usize);
    let mut stored = 0u64;
    let err = loop {
        match c.put_rows(&[(Key::new(stored, "v"), &v)], c.deadline()) {
            Ok(()) => stored += 1,
            Err(e) => break e,
        }
        assert!(stored < 16, "puts to a disk that never syncs succeeded");
    };
    let msg = err.to_string();
    assert!(msg.contains("answered Pending"), "{msg}");
    assert!(msg.contains("could not be made durable"), "{msg}");
    assert!(!msg.contains("never allocated"), "{msg}");
    assert!(err.is_retryable(), "{err:?}");
}

/// Readers that stop taking their replies cannot push a unit's memory past
/// its read budget: with a budget of one buffer, a reader stalled mid-way
/// through a spilled value holds it, and another reader's get of a spilled
/// value fails within its deadline (the unit answers Busy) rather than
/// taking more memory or hanging; once the stalled reader goes, gets
/// succeed again.
#[test]
fn stalled_readers_hold_the_read_budget_not_more_memory() {
    let root = tempfile::tempdir().unwrap();
    let mut args = disk_args(root.path());
    args.extend(["--disk-read-budget".into(), "64KiB".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (p, _) = plane(1, 8 * MIB, &args);
    let c = client(&p, Kind::Tcp, Duration::from_secs(30));
    let value = |r: u64| pattern(r, 6, 4 * MIB as usize);
    for r in 0..8 {
        c.put_rows(&[(Key::new(r, "v"), &value(r))], c.deadline())
            .unwrap();
    }
    assert!(eventually(Duration::from_secs(20), || {
        c.stats(c.deadline())[0].as_ref().unwrap().disk_used >= 16 * MIB
    }));
    // Which rows are on disk only: a Resolve says (on_disk).
    let uds = match &p.uds_addrs()[0] {
        stowage_client::UnitAddr::Unix(path) => path.clone(),
        other => panic!("{other:?}"),
    };
    let mut probe = common::Raw::hello(&uds, "test");
    let keys: Vec<Key> = (0..8).map(|r| Key::new(r, "v")).collect();
    let on_disk: Vec<Key> = match probe.call(&stowage_wire::Request::Resolve {
        partition: String::new(),
        keys: keys.clone(),
        hold: false,
    }) {
        stowage_wire::Response::Resolved { found, .. } => keys
            .iter()
            .zip(found)
            .filter(|(_, f)| f.as_ref().is_some_and(|f| f.on_disk))
            .map(|(k, _)| k.clone())
            .collect(),
        other => panic!("{other:?}"),
    };
    drop(probe);
    assert!(on_disk.len() >= 2, "{on_disk:?}");
    // A reader that asks for a spilled value and takes none of the reply.
    let mut stalled = common::Raw::hello(&uds, "test");
    stalled.send(&stowage_wire::Request::Read {
        partition: String::new(),
        keys: vec![on_disk[0].clone()],
        timeout_ms: 60_000,
    });
    std::thread::sleep(Duration::from_millis(300));
    let mut cfg = stowage_client::ClientConfig::new("test", p.tcp_addrs());
    cfg.timeout = Duration::from_secs(2);
    let other = Client::connect(cfg).unwrap();
    // Bounded by its 2 s deadline.
    let got = other.get_rows(&[on_disk[1].clone()], other.deadline());
    assert!(got.is_err(), "a get went past the read budget");
    assert!(got.unwrap_err().is_retryable());
    drop(stalled);
    assert!(eventually(Duration::from_secs(20), || {
        other
            .get_rows(&[on_disk[1].clone()], other.deadline())
            .is_ok_and(|v| v[0] == value(on_disk[1].row))
    }));
}
