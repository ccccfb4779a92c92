//! Another user on the same host (issue 21, items 1 and 7): played by uid
//! 65534 through `setpriv --reuid 65534 --regid 65534 --clear-groups`.
//! Every launcher's default listeners refuse it (TCP: no secret to prove;
//! Unix socket: a private directory and the unit's uid check), while the
//! job's own clients work; a socket another user bound first captures no
//! client (the client checks the unit's uid), and a slab fd that is not a
//! sealed memfd of the announced size is never mapped.
//!
//! The other user runs copies of the `stowage` binary and of this test
//! binary placed in a fresh directory it may read and execute, so what is
//! refused is the connection, never the exec.

mod common;
#[path = "common/flood.rs"]
mod flood;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use stowage_client::{Client, ClientConfig, Error, UnitAddr, UnitDirectory};
use stowage_local::{LocalOptions, LocalPlane};
use stowage_wire::{encode, Limits, Request, Response};

const OTHER_UID: u32 = 65534;
const MIB: u64 = 1 << 20;

/// Whether this host can run a command as another user (root and
/// `setpriv`); the tests say so and pass vacuously only where it cannot,
/// which CI's root container never is.
fn can_switch_user() -> bool {
    let root = rustix::process::geteuid().is_root();
    let setpriv = Command::new("setpriv")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !(root && setpriv) {
        eprintln!("SKIPPED: needs root and setpriv (util-linux) to play another user");
    }
    root && setpriv
}

/// A directory anyone may enter, holding copies of the `stowage` binary
/// and of this test binary that anyone may run.
struct Shared {
    dir: tempfile::TempDir,
}

impl Shared {
    fn new() -> Shared {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        for (from, name) in [
            (binary().to_path_buf(), "stowage"),
            (std::env::current_exe().unwrap(), "tests"),
        ] {
            let to = dir.path().join(name);
            std::fs::copy(&from, &to).unwrap();
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        Shared { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The copied `stowage` run as the other user, bounded.
    fn stowage_as_other(&self, args: &[&str]) -> Output {
        let mut child = as_other(&self.path("stowage"))
            .args(args)
            .env_remove("STOWAGE_SECRET")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_bounded(&mut child, Duration::from_secs(30));
        child.wait_with_output().unwrap()
    }
}

/// `program` run as uid/gid 65534 with no supplementary groups.
fn as_other(program: &Path) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        "--reuid",
        &OTHER_UID.to_string(),
        "--regid",
        &OTHER_UID.to_string(),
        "--clear-groups",
    ])
    .arg(program);
    c
}

/// Wait for `child` at most `within`; kill it (by its pid) after that.
fn wait_bounded(child: &mut std::process::Child, within: Duration) {
    let end = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() >= end {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The other user is refused: the command failed, and not because it
/// could not run the binary.
fn assert_refused(o: &Output, what: &str, because: &[&str]) {
    let t = text(o);
    assert!(!o.status.success(), "{what}: another user was served: {t}");
    assert!(
        !t.contains("setpriv:"),
        "{what}: the other user could not even run the client: {t}"
    );
    assert!(
        because.iter().any(|b| t.contains(b)),
        "{what}: refused, but not for {because:?}: {t}"
    );
}

/// Refusals over TCP: the unit wants a proof the other user cannot give.
const NO_SECRET: &[&str] = &["unauthorized", "Unauthorized", "secret"];
/// Refusals on a Unix socket: its private directory, or the uid check.
const NO_ENTRY: &[&str] = &[
    "Permission denied",
    "permission denied",
    "uid",
    "unauthorized",
];

#[test]
fn a_local_plane_refuses_another_user_and_serves_its_own_clients() {
    if !can_switch_user() {
        return;
    }
    let shared = Shared::new();
    // `stowage local` (and `stowage.local`) start their units this way.
    let mut opts = LocalOptions::new(1, 16 * MIB);
    opts.command = vec![binary().into(), "unit".into()];
    opts.unit_args = vec!["--no-mlock".into()];
    let p = LocalPlane::start(&opts).unwrap();
    let secret = p.secret().expect("a plane has a secret by default");
    let mode = std::fs::metadata(p.private_dir().join("secret"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    let tcp = p.tcp_addrs()[0].to_string();
    let uds = p.uds_addrs()[0].to_string();
    assert_refused(
        &shared.stowage_as_other(&["stats", &tcp]),
        "loopback TCP",
        NO_SECRET,
    );
    assert_refused(
        &shared.stowage_as_other(&["stats", &uds]),
        "the Unix socket",
        NO_ENTRY,
    );
    // The plane's own clients, over either listener.
    for addrs in [p.tcp_addrs(), p.uds_addrs()] {
        let mut cfg = ClientConfig::new("own", addrs);
        cfg.secret = Some(secret.clone());
        let c = Client::connect(cfg).expect("the plane's own client connects");
        c.put_rows(&[(stowage_client::Key::new(1, "f"), b"mine")], c.deadline())
            .unwrap();
    }
    // A client without the plane's secret is refused too, even as root.
    // (Connecting is lazy: its first call is refused.)
    let none = Client::connect(ClientConfig::new("none", p.tcp_addrs())).unwrap();
    assert!(matches!(
        none.put_rows(
            &[(stowage_client::Key::new(1, "f"), b"theirs")],
            none.deadline()
        ),
        Err(Error::Unauthorized(_))
    ));

    // The control: the other user's client does reach a plane started
    // --insecure (what every plane was before), so the refusals above are
    // the secret's doing, not the harness's.
    opts.insecure = true;
    let open = LocalPlane::start(&opts).unwrap();
    assert!(open.secret().is_none());
    let o = shared.stowage_as_other(&["stats", &open.tcp_addrs()[0].to_string()]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("bytes used"), "{}", text(&o));
}

#[test]
fn stowage_local_runs_its_workload_with_a_generated_secret() {
    let out = Command::new(binary())
        .args([
            "local",
            "--units",
            "1",
            "--memory",
            "32MiB",
            "--steps",
            "1",
            "--rows",
            "4",
            "--min-tokens",
            "8",
            "--max-tokens",
            "16",
            "--transport",
            "tcp",
        ])
        .env_remove("STOWAGE_SECRET")
        .env(
            "STOWAGE_UNIT_COMMAND",
            format!("{} unit --no-mlock", binary().display()),
        )
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
}

/// `stowage up --config FILE --directory D` with a config that names no
/// secret; returns the child (reaped on drop) and the directory.
fn up(dir: &Path, args: &[&str]) -> (Reap, UnitDirectory, PathBuf) {
    let config = dir.join("stowage.toml");
    std::fs::write(&config, "[units]\ncount = 2\nmemory = \"16MiB\"\n").unwrap();
    let directory = dir.join("units.json");
    let (child, lines) = spawn_reaped(
        Command::new(binary())
            .args(["up", "--exit-with-stdin", "--config"])
            .arg(&config)
            .arg("--directory")
            .arg(&directory)
            .args(args)
            .env_remove("STOWAGE_SECRET")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    assert!(
        wait_for_line(&lines, "READY directory=", Duration::from_secs(60)),
        "stowage up never reported ready"
    );
    let d = UnitDirectory::from_file(&directory).unwrap();
    (child, d, directory)
}

#[test]
fn stowage_up_refuses_another_user_and_its_directory_serves_its_own() {
    if !can_switch_user() {
        return;
    }
    let shared = Shared::new();
    let dir = tempfile::tempdir().unwrap();
    let (_up, d, directory) = up(dir.path(), &[]);
    // The generated secret reached clients in an owner-only directory.
    assert!(
        d.secret().unwrap().is_some(),
        "the directory carries the secret"
    );
    let mode = std::fs::metadata(&directory).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);

    for u in &d.units {
        let tcp = u.tcp.clone().unwrap();
        let uds = u.uds.clone().unwrap();
        assert_refused(
            &shared.stowage_as_other(&["stats", &tcp]),
            "stowage up's TCP",
            NO_SECRET,
        );
        assert_refused(
            &shared.stowage_as_other(&["stats", &uds]),
            "stowage up's Unix socket",
            NO_ENTRY,
        );
    }
    // Even given a copy of the directory it may read, the other user has
    // no secret in it unless the file is owner-only... and a copy others
    // may read is refused by every client.
    let leaked = shared.path("leaked.json");
    std::fs::copy(&directory, &leaked).unwrap();
    std::fs::set_permissions(&leaked, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new(binary())
        .args(["stats", "--directory"])
        .arg(&leaked)
        .env_remove("STOWAGE_SECRET")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(text(&out).contains("chmod 600"), "{}", text(&out));
    // The job's own user: the directory (with its secret) is all it needs.
    let out = Command::new(binary())
        .args(["stats", "--directory"])
        .arg(&directory)
        .env_remove("STOWAGE_SECRET")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .matches("unix:")
            .count(),
        2
    );
    // Over TCP too.
    let mut cfg = ClientConfig::new(
        "own",
        d.addrs(stowage_client::TransportChoice::Tcp, "").unwrap(),
    );
    cfg.secret = d.secret().unwrap();
    Client::connect(cfg).expect("the job's own client over TCP");
}

#[test]
fn stowage_up_without_a_directory_prints_no_secret() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("stowage.toml");
    std::fs::write(&config, "[units]\ncount = 1\nmemory = \"16MiB\"\n").unwrap();
    let (_child, lines) = spawn_reaped(
        Command::new(binary())
            .args(["up", "--exit-with-stdin", "--config"])
            .arg(&config)
            .env_remove("STOWAGE_SECRET")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    let mut printed = String::new();
    let end = Instant::now() + Duration::from_secs(60);
    let path = loop {
        let l = lines
            .recv_timeout(end.saturating_duration_since(Instant::now()))
            .expect("stowage up reports ready");
        if let Some(p) = l.strip_prefix("READY directory=") {
            break PathBuf::from(p);
        }
        printed.push_str(&l);
    };
    assert!(printed.contains("\"units\""), "{printed}");
    assert!(
        !printed.contains("secret"),
        "the secret was printed: {printed}"
    );
    let d = UnitDirectory::from_file(&path).unwrap();
    assert!(d.secret().unwrap().is_some());
}

#[test]
fn a_unit_will_not_serve_tcp_without_a_secret_unless_insecure_loopback_included() {
    let out = Command::new(binary())
        .args(["unit", "--no-mlock", "--memory", "8MiB"])
        .args(["--listen", "tcp:127.0.0.1:0"])
        .env_remove("STOWAGE_SECRET")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    let t = text(&out);
    for want in [
        "--insecure",
        "STOWAGE_SECRET",
        "--secret-file",
        "every local user",
    ] {
        assert!(t.contains(want), "{want}: {t}");
    }
}

/// `stowage unit` with default flags, its temporary directory `tmp`.
fn default_unit(tmp: &Path, home: &Path) -> (Reap, String) {
    default_unit_in(tmp, Some(home))
}

/// `stowage unit` with default flags, its temporary directory `tmp`, no
/// XDG_RUNTIME_DIR, and `home` as HOME (none when `None`).
fn default_unit_in(tmp: &Path, home: Option<&Path>) -> (Reap, String) {
    let mut cmd = Command::new(binary());
    cmd.args([
        "unit",
        "--no-mlock",
        "--memory",
        "8MiB",
        "--exit-with-stdin",
    ])
    .env_remove("XDG_RUNTIME_DIR")
    .env("TMPDIR", tmp)
    .env_remove("HOME")
    .env_remove("STOWAGE_SECRET")
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    if let Some(h) = home {
        cmd.env("HOME", h);
    }
    let (child, lines) = spawn_reaped(&mut cmd);
    let line = lines
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_default();
    (child, line)
}

#[test]
fn stowage_unit_by_default_listens_in_a_private_directory_only() {
    if !can_switch_user() {
        return;
    }
    let shared = Shared::new();
    // The temporary directory is shared (1777), as /tmp is.
    let tmp = shared.path("tmp");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let (_unit, ready) = default_unit(&tmp, &shared.path("home"));
    let private = tmp.join(format!("stowage-{}", rustix::process::geteuid().as_raw()));
    let sock = private.join("unit-0.sock");
    assert!(
        ready.contains(&format!("uds={} tcp= ", sock.display())),
        "{ready}"
    );
    let mode = std::fs::symlink_metadata(&private)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o700);
    let addr = format!("unix:{}", sock.display());
    assert_refused(
        &shared.stowage_as_other(&["stats", &addr]),
        "stowage unit's default socket",
        NO_ENTRY,
    );
    let c = Client::connect(ClientConfig::new("own", vec![UnitAddr::Unix(sock)]))
        .expect("its own user connects");
    drop(c);
}

#[test]
fn a_runtime_directory_another_user_made_first_is_not_used() {
    if !can_switch_user() {
        return;
    }
    let shared = Shared::new();
    let tmp = shared.path("tmp");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let home = shared.path("home");
    std::fs::create_dir(&home).unwrap();
    let private = tmp.join(format!("stowage-{}", rustix::process::geteuid().as_raw()));
    let fallback = home.join(".stowage").join("run");
    // The other user takes the name first (open to all, so that a unit
    // could bind in it).
    let out = as_other(Path::new("/bin/mkdir"))
        .args(["-m", "777"])
        .arg(&private)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    // The unit still starts: in $HOME/.stowage/run, warning about the name.
    let (unit, ready) = default_unit(&tmp, &home);
    let sock = fallback.join("unit-0.sock");
    assert!(
        ready.contains(&format!("uds={} tcp= ", sock.display())),
        "{ready}"
    );
    let mode = std::fs::symlink_metadata(&fallback)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o700);
    let c = Client::connect(ClientConfig::new("own", vec![UnitAddr::Unix(sock.clone())]))
        .expect("its own user connects in the fallback");
    drop(c);
    assert_eq!(
        std::fs::read_dir(&private).unwrap().count(),
        0,
        "the unit created something in the directory another user made"
    );
    let err = stopped_stderr(unit);
    assert!(
        err.contains(&private.display().to_string()) && err.contains(&format!("uid {OTHER_UID}")),
        "{err}"
    );
    // A symbolic link in its place is not followed either.
    std::fs::remove_dir(&private).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    std::fs::set_permissions(elsewhere.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(elsewhere.path(), &private).unwrap();
    let (unit, ready) = default_unit(&tmp, &home);
    assert!(
        ready.contains(&format!("uds={} tcp= ", sock.display())),
        "{ready}"
    );
    assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
    let err = stopped_stderr(unit);
    assert!(err.contains("symbolic link"), "{err}");
}

#[test]
fn a_service_account_starts_in_a_private_directory_of_its_own() {
    // Neither HOME nor XDG_RUNTIME_DIR, and another user made
    // $TMPDIR/stowage-UID first: the unit makes a private directory of its
    // own, says where, and its clients find it.
    if !can_switch_user() {
        return;
    }
    let shared = Shared::new();
    let tmp = shared.path("tmp");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let uid = rustix::process::geteuid().as_raw();
    let taken = tmp.join(format!("stowage-{uid}"));
    let out = as_other(Path::new("/bin/mkdir"))
        .args(["-m", "777"])
        .arg(&taken)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let (unit, ready) = default_unit_in(&tmp, None);
    // READY uds=TMP/stowage-UID-XXXXXX/unit-0.sock tcp= ...
    let sock = ready
        .split(' ')
        .find_map(|w| w.strip_prefix("uds="))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("the service account's unit did not start: {ready}"));
    assert!(ready.starts_with("READY "), "{ready}");
    let dir = sock.parent().unwrap().to_path_buf();
    assert_eq!(sock.file_name().unwrap(), "unit-0.sock");
    assert_eq!(dir.parent(), Some(tmp.as_path()), "{ready}");
    let name = dir.file_name().unwrap().to_str().unwrap().to_string();
    let suffix = name
        .strip_prefix(&format!("stowage-{uid}-"))
        .unwrap_or_else(|| panic!("not a fallback of this user: {name}"));
    assert_eq!(suffix.len(), 6, "{name}");
    let st = std::fs::symlink_metadata(&dir).unwrap();
    assert!(st.is_dir());
    assert_eq!(st.permissions().mode() & 0o7777, 0o700);
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&st), uid);
    // Its own client puts and gets through it.
    let c = Client::connect(ClientConfig::new("own", vec![UnitAddr::Unix(sock.clone())]))
        .expect("its own user connects in the fallback");
    let key = stowage_client::Key::new(3, "f");
    c.put_rows(&[(key.clone(), b"service")], c.deadline())
        .unwrap();
    assert_eq!(
        c.get_rows(&[key], c.deadline()).unwrap(),
        vec![b"service".to_vec()]
    );
    drop(c);
    // A client that computes the default directory (`stowage status
    // --config` with no listen.unix_dir), in the same environment, finds
    // the same socket.
    let config = shared.path("stowage.toml");
    std::fs::write(&config, "[units]\ncount = 1\n").unwrap();
    let mut status = Command::new(binary())
        .args(["status", "--json", "--config"])
        .arg(&config)
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("HOME")
        .env("TMPDIR", &tmp)
        .env_remove("STOWAGE_SECRET")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_bounded(&mut status, Duration::from_secs(30));
    let o = status.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains(&sock.display().to_string()), "{t}");
    assert!(t.contains("\"up\""), "the unit was not found up: {t}");
    // Nothing was made in the directory the other user made, no other
    // fallback was made, and the log names both.
    assert_eq!(std::fs::read_dir(&taken).unwrap().count(), 0);
    let fallbacks = std::fs::read_dir(&tmp)
        .unwrap()
        .filter(|e| {
            let n = e.as_ref().unwrap().file_name();
            n.to_str().unwrap().starts_with(&format!("stowage-{uid}-"))
        })
        .count();
    assert_eq!(fallbacks, 1);
    let err = stopped_stderr(unit);
    assert!(
        err.contains(&taken.display().to_string()) && err.contains(&dir.display().to_string()),
        "{err}"
    );
    // Started again, it finds the same directory.
    let (unit, ready) = default_unit_in(&tmp, None);
    assert!(
        ready.contains(&format!("uds={} ", sock.display())),
        "{ready}"
    );
    drop(unit);
}

#[test]
fn a_runtime_directory_of_this_user_open_to_others_is_refused() {
    // This user's own directory with a wrong mode is for the user to fix:
    // refused, not replaced.
    let t = tempfile::tempdir().unwrap();
    let tmp = t.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let home = t.path().join("home");
    std::fs::create_dir(&home).unwrap();
    let mine = tmp.join(format!("stowage-{}", rustix::process::geteuid().as_raw()));
    std::fs::create_dir(&mine).unwrap();
    std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (mut unit, ready) = default_unit(&tmp, &home);
    assert!(!ready.starts_with("READY"), "{ready}");
    wait_bounded(&mut unit.0, Duration::from_secs(10));
    let err = stopped_stderr(unit);
    assert!(err.contains("0755") && err.contains("chmod 700"), "{err}");
    assert!(!home.join(".stowage").exists());
}

/// What a unit wrote on stderr, once stopped (its stdin closed).
fn stopped_stderr(mut unit: Reap) -> String {
    drop(unit.0.stdin.take());
    wait_bounded(&mut unit.0, Duration::from_secs(10));
    let mut err = String::new();
    unit.0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    err
}

/// Not a test on its own: an impostor that binds `STOWAGE_TEST_SQUAT`
/// (a Unix socket path) and answers every Hello with a Hello of its own,
/// attaching a memfd of 1 MiB (sealed only if `STOWAGE_TEST_SEALED` is
/// set). Prints `LISTENING`; serves for at most 30 s.
#[test]
#[ignore = "a helper process of the impostor tests"]
fn squatter_child() {
    let path = std::env::var("STOWAGE_TEST_SQUAT").expect("run only by its test");
    squat(
        Path::new(&path),
        std::env::var_os("STOWAGE_TEST_SEALED").is_some(),
        Duration::from_secs(30),
        || {
            println!("LISTENING");
            std::io::stdout().flush().unwrap();
        },
    );
}

/// Serve the impostor on `path` until `within` passes.
fn squat(path: &Path, sealed: bool, within: Duration, ready: impl FnOnce()) {
    let l = UnixListener::bind(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777)).unwrap();
    l.set_nonblocking(true).unwrap();
    ready();
    let slab = 1u64 << 20;
    let end = Instant::now() + within;
    while Instant::now() < end {
        let Ok((mut s, _)) = l.accept() else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let fd = rustix::fs::memfd_create(
            "impostor",
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )
        .unwrap();
        rustix::fs::ftruncate(&fd, slab).unwrap();
        if sealed {
            rustix::fs::fcntl_add_seals(
                &fd,
                rustix::fs::SealFlags::SHRINK
                    | rustix::fs::SealFlags::GROW
                    | rustix::fs::SealFlags::SEAL,
            )
            .unwrap();
        }
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            match stowage_wire::decode_frame::<Request>(&buf, &Limits::default()) {
                Ok(Some((f, used))) => {
                    let id = f.envelope.id;
                    let hello = matches!(f.envelope.body, Request::Hello { .. });
                    buf.drain(..used);
                    let mut out = Vec::new();
                    let r = if hello {
                        Response::Hello {
                            version: stowage_wire::PROTOCOL_VERSION,
                            instance_id: 7,
                            slab_bytes: slab,
                            fd_attached: true,
                            session: 9,
                        }
                    } else {
                        Response::Error {
                            code: stowage_wire::ErrorCode::InvalidRequest,
                            message: "impostor".into(),
                        }
                    };
                    encode(id, &r, 0, &mut out).unwrap();
                    if hello {
                        let _ = stowage_shm::send_with_fd(&s, &out, std::os::fd::AsFd::as_fd(&fd));
                    } else {
                        let _ = s.write_all(&out);
                    }
                }
                Ok(None) => match s.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                },
                Err(_) => break,
            }
        }
    }
}

#[test]
fn a_socket_another_user_bound_first_does_not_capture_a_client() {
    if !can_switch_user() {
        return;
    }
    let shared = Shared::new();
    // A shared directory where the other user got to the name first.
    let path = shared.path("stowage-unit-0.sock");
    let (child, lines) = spawn_reaped(
        as_other(&shared.path("tests"))
            .args([
                "--exact",
                "squatter_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("STOWAGE_TEST_SQUAT", &path)
            .env("STOWAGE_TEST_SEALED", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    assert!(
        wait_for_line(&lines, "LISTENING", Duration::from_secs(30)),
        "the impostor never listened"
    );
    // A client with no secret (nothing else proves who answers) and the
    // shm transport, which would map what the impostor hands it.
    let mut cfg = ClientConfig::new("victim", vec![UnitAddr::Unix(path.clone())]);
    cfg.timeout = Duration::from_secs(10);
    // Connecting is lazy: the first call reaches the socket, and refuses it.
    let c = Client::connect(cfg).unwrap();
    match c.get_rows(&[stowage_client::Key::new(0, "v")], c.deadline()) {
        Err(Error::Unauthorized(m)) => {
            assert!(m.contains(&format!("uid {OTHER_UID}")), "{m}");
        }
        Err(e) => panic!("refused, but not for the impostor's uid: {e}"),
        Ok(_) => panic!("a client was captured by another user's socket"),
    }
    let mut child = child;
    let _ = child.0.kill();
}

#[test]
fn a_slab_fd_that_could_shrink_is_never_mapped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("impostor.sock");
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.clone();
    // Ends by itself within 15 s; not waited for.
    std::thread::spawn(move || {
        squat(&p, false, Duration::from_secs(15), || {
            let _ = tx.send(());
        })
    });
    rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let mut cfg = ClientConfig::new("victim", vec![UnitAddr::Unix(path)]);
    cfg.timeout = Duration::from_secs(5);
    // Connecting is lazy: the first call reaches the socket, and refuses it.
    let c = Client::connect(cfg).unwrap();
    match c.get_rows(&[stowage_client::Key::new(0, "v")], c.deadline()) {
        Err(Error::Unauthorized(m)) => {
            assert!(m.contains("SHRINK | GROW | SEAL"), "{m}");
        }
        Err(e) => panic!("refused, but not for the fd's seals: {e}"),
        Ok(_) => panic!("a client mapped an unsealed fd"),
    }
}

/// Not a test on its own: floods the metrics endpoint at
/// `STOWAGE_TEST_FLOOD` (an address) as `flood::flood` does, from 4
/// threads, printing `FLOODING` once started and `CONNECTS <n>` about
/// every 500 ms; stops by itself after 60 s.
#[test]
#[ignore = "a helper process of the metrics flood test"]
fn metrics_flood_child() {
    let addr: std::net::SocketAddr = std::env::var("STOWAGE_TEST_FLOOD")
        .expect("run only by its test")
        .parse()
        .unwrap();
    println!("FLOODING");
    std::io::stdout().flush().unwrap();
    let connects = std::sync::atomic::AtomicU64::new(0);
    flood::flood(
        addr,
        4,
        Instant::now() + Duration::from_secs(60),
        &std::sync::atomic::AtomicBool::new(false),
        &connects,
        |n| {
            println!("CONNECTS {n}");
            let _ = std::io::stdout().flush();
        },
    );
}

/// The latest `CONNECTS <n>` the flood child printed on `lines` within
/// `within`, once it is at least `at_least` (else the latest seen).
fn flood_connects(
    lines: &std::sync::mpsc::Receiver<String>,
    at_least: u64,
    within: Duration,
) -> u64 {
    let end = Instant::now() + within;
    let mut latest = 0;
    while latest < at_least {
        let Ok(l) = lines.recv_timeout(end.saturating_duration_since(Instant::now())) else {
            break;
        };
        if let Some(n) = l.trim().strip_prefix("CONNECTS ") {
            latest = n.parse().unwrap_or(latest);
        }
    }
    latest
}

#[test]
fn the_owners_scrapes_get_through_while_another_user_floods_the_metrics_endpoint() {
    if !can_switch_user() {
        return;
    }
    let shared = Shared::new();
    let dir = tempfile::tempdir().unwrap();
    let (mut unit, lines) = spawn_reaped(
        Command::new(binary())
            .args([
                "unit",
                "--no-mlock",
                "--memory",
                "16MiB",
                "--exit-with-stdin",
            ])
            .arg("--listen")
            .arg(format!("unix:{}", dir.path().join("u.sock").display()))
            .env_remove("STOWAGE_SECRET")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    let ready = expect_line(&lines, "READY ", Duration::from_secs(30));
    let addr: std::net::SocketAddr = ready
        .split(' ')
        .find_map(|w| w.strip_prefix("metrics=http://"))
        .and_then(|a| a.strip_suffix("/metrics"))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no metrics endpoint in {ready}"));
    flood::scrape(addr, Duration::from_secs(5)).expect("a scrape before the flood");
    // The other user holds the endpoint: connects, re-opens what is cut,
    // sends partial heads.
    let (mut hostile, flooding) = spawn_reaped(
        as_other(&shared.path("tests"))
            .args([
                "--exact",
                "metrics_flood_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("STOWAGE_TEST_FLOOD", addr.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    assert!(
        wait_for_line(&flooding, "FLOODING", Duration::from_secs(30)),
        "the flood never started"
    );
    // In full swing: far more connects than the endpoint has places.
    let before = flood_connects(&flooding, 2000, Duration::from_secs(20));
    assert!(before >= 2000, "the flood made only {before} connects");
    let (ok, failed) = flood::scrapes(addr, 10, Duration::from_secs(5), Duration::from_millis(100));
    // Still flooding while the owner scraped.
    let after = flood_connects(&flooding, before + 1, Duration::from_secs(5));
    assert!(
        hostile.0.try_wait().unwrap().is_none(),
        "the flood ended before the scrapes did"
    );
    let _ = hostile.0.kill(); // by its pid; reaped on drop
    eprintln!(
        "owner's scrapes: {ok}/10 under a flood of {} connects; failures: {failed:?}",
        after - before
    );
    assert!(
        after > before,
        "the flood was not running during the scrapes ({before} then {after} connects)"
    );
    assert!(
        ok >= 9,
        "the owner's scrapes succeeded {ok}/10 while another user held the endpoint: {failed:?}"
    );
    // The unit served throughout and still answers.
    flood::scrape(addr, Duration::from_secs(5)).expect("a scrape after the flood");
    drop(hostile);
    drop(unit.0.stdin.take());
    wait_bounded(&mut unit.0, Duration::from_secs(10));
}
