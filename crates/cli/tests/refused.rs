//! A unit that refuses to start tells its launcher why, at once: it prints
//! `FAILED <reason>` on stdout and exits, and the launcher (the local
//! plane, `stowage up`) fails with that reason instead of waiting out its
//! start timeout.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{binary, spawn_reaped, wait_for_line};
use stowage_local::{LocalOptions, LocalPlane};

/// A disk root owned by another user (nobody, 65534), in a fresh
/// temporary directory; `None` unless this process may chown (root).
fn root_of_another_user() -> Option<(tempfile::TempDir, PathBuf)> {
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: the root owned by another user is not tried");
        return None;
    }
    let base = tempfile::tempdir().unwrap();
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let theirs = base.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
    rustix::fs::chown(
        &theirs,
        Some(rustix::fs::Uid::from_raw(65534)),
        Some(rustix::fs::Gid::from_raw(65534)),
    )
    .unwrap();
    Some((base, theirs))
}

/// What the unit says of such a root: whose it is, and the fix.
fn assert_says_why(err: &str) {
    assert!(err.contains("owned by uid 65534"), "{err}");
    assert!(err.contains("chown"), "{err}");
}

#[test]
fn a_local_plane_fails_at_once_with_the_units_reason() {
    let Some((_base, theirs)) = root_of_another_user() else {
        return;
    };
    let mut opts = LocalOptions::new(2, 16 << 20);
    opts.command = vec![binary().into(), "unit".into()];
    opts.unit_args = vec!["--no-mlock".into(), "--disk".into(), disk_arg(&theirs)];
    let t0 = Instant::now();
    let err = match LocalPlane::start(&opts) {
        Ok(_) => panic!("a disk root of another user was accepted"),
        Err(e) => e,
    };
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(err.starts_with("unit 0 refused to start: "), "{err}");
    assert_says_why(&err);
}

#[test]
fn stowage_up_fails_at_once_with_the_units_reason() {
    let Some((base, theirs)) = root_of_another_user() else {
        return;
    };
    let config = base.path().join("stowage.toml");
    std::fs::write(
        &config,
        format!(
            "[units]\ncount = 2\nmemory = \"16MiB\"\n[units.disk]\nroot = {:?}\n",
            disk_arg(&theirs)
        ),
    )
    .unwrap();
    let t0 = Instant::now();
    let mut up = Command::new(binary());
    up.args(["up", "--config"]).arg(&config);
    let (mut up, lines) = spawn_reaped(up.stdout(Stdio::piped()).stderr(Stdio::null()));
    let failed = lines
        .recv_timeout(Duration::from_secs(2))
        .expect("stowage up said nothing within 2 s");
    assert!(
        failed.starts_with("FAILED unit 0 refused to start: "),
        "{failed}"
    );
    assert_says_why(&failed);
    assert!(!wait_for_line(&lines, "READY", Duration::from_millis(100)));
    assert!(common::eventually(Duration::from_secs(2), || matches!(
        up.0.try_wait(),
        Ok(Some(s)) if !s.success()
    )));
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
}

fn disk_arg(p: &Path) -> String {
    p.display().to_string()
}
