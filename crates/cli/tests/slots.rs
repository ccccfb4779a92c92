//! Connections that proved nothing never take a proven client's slot:
//! another user re-opening idle connections, the handshake pool's caps and
//! deadline, clients that retry a refused connect, the unit's open-file
//! limit, and sizes that would overflow: real unit processes, raw
//! connections, and a helper process run as another user.

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use stowage_client::{Client, ClientConfig, Error, Key, Secret, UnitAddr};
use stowage_wire::{decode_frame, BlobId, EntrySpec, ErrorCode, Limits, Request, Response};

const SECRET: &str = "slots-secret-of-enough-bytes-0042";

fn secret() -> Secret {
    Secret::from_bytes(SECRET.as_bytes()).unwrap()
}

/// A unit started by hand (its socket in a directory other users may
/// enter), its stderr kept in a file.
struct Unit {
    child: Child,
    sock: PathBuf,
    tcp: SocketAddr,
    dir: tempfile::TempDir,
}

impl Unit {
    /// Start a unit with the test secret (or none) and extra arguments;
    /// `shell`: run it through `bash -c SHELL` first (e.g. a `ulimit`).
    fn start(with_secret: bool, extra: &[&str], shell: Option<&str>) -> Unit {
        Unit::start_logging(with_secret, extra, shell, "info")
    }

    /// [`Unit::start`], its log filtered by `rust_log` (RUST_LOG).
    fn start_logging(
        with_secret: bool,
        extra: &[&str],
        shell: Option<&str>,
        rust_log: &str,
    ) -> Unit {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let sock = dir.path().join("u.sock");
        let mut args: Vec<String> = [
            "unit",
            "--memory",
            "16MiB",
            "--no-mlock",
            "--exit-with-stdin",
            "--listen",
            "tcp:127.0.0.1:0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.push("--listen".into());
        args.push(format!("unix:{}", sock.display()));
        args.extend(extra.iter().map(|s| s.to_string()));
        if !with_secret {
            // TCP without a secret only when told so.
            args.push("--insecure".into());
        }
        if with_secret {
            let path = dir.path().join("secret");
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .unwrap();
            writeln!(f, "{SECRET}").unwrap();
            args.push("--secret-file".into());
            args.push(path.display().to_string());
        }
        let mut cmd = match shell {
            Some(s) => {
                let mut c = Command::new("bash");
                c.arg("-c")
                    .arg(format!("{s} && exec \"$0\" \"$@\""))
                    .arg(binary());
                c
            }
            None => Command::new(binary()),
        };
        let log = File::create(dir.path().join("stderr.log")).unwrap();
        let mut child = cmd
            .args(&args)
            .env_remove("STOWAGE_SECRET")
            .env("RUST_LOG", rust_log)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        let (_, tcp) = await_ready(&mut child);
        Unit {
            child,
            sock,
            tcp,
            dir,
        }
    }

    fn client(&self, addr: UnitAddr, timeout: Duration) -> Result<Client, Error> {
        let mut cfg = ClientConfig::new("ns", vec![addr]);
        cfg.timeout = timeout;
        cfg.secret = Some(secret());
        Client::connect(cfg)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default()
    }

    /// A unit process still running (not exited).
    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Unit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One frame from `s`, or `None` when the connection ended (or nothing
/// came within its read timeout) first.
fn recv_frame(s: &mut impl Read) -> Option<Response> {
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Ok(Some((f, _))) = decode_frame::<Response>(&got, &Limits::default()) {
            return Some(f.envelope.body);
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
}

/// The Busy answer's message a cut or refused connection gets, or a
/// panic.
fn busy(r: Option<Response>) -> String {
    match r {
        Some(Response::Error {
            code: ErrorCode::Busy,
            message,
        }) => message,
        other => panic!("expected Busy, got {other:?}"),
    }
}

/// Whether `s` is still open: nothing to read and no end within `wait`.
fn still_open(s: &mut impl ReadTimeout, wait: Duration) -> bool {
    s.set_timeout(wait);
    let mut b = [0u8; 64];
    matches!(s.read_some(&mut b), Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
}

trait ReadTimeout {
    fn set_timeout(&mut self, t: Duration);
    fn read_some(&mut self, b: &mut [u8]) -> std::io::Result<usize>;
}

impl ReadTimeout for UnixStream {
    fn set_timeout(&mut self, t: Duration) {
        self.set_read_timeout(Some(t)).unwrap();
    }
    fn read_some(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        self.read(b)
    }
}

impl ReadTimeout for TcpStream {
    fn set_timeout(&mut self, t: Duration) {
        self.set_read_timeout(Some(t)).unwrap();
    }
    fn read_some(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        self.read(b)
    }
}

/// Whether another user can be played here (root, and `setpriv`).
fn can_act_as_nobody() -> bool {
    rustix::process::geteuid().is_root()
        && Command::new("setpriv")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

/// Run this test binary's ignored helper `flood_child` as user nobody
/// (`setpriv`), told `spec` ("ADDR COUNT CHURN": hold COUNT idle
/// connections to ADDR, re-opening each that closes when CHURN is 1). It
/// stops when its stdin closes, or after 60 s.
fn flood_as_nobody(spec: &str) -> (Child, std::sync::mpsc::Receiver<String>) {
    let mut child = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "flood_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("STOWAGE_TEST_FLOOD", spec)
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("setpriv runs the helper");
    let lines = stdout_lines(&mut child);
    (child, lines)
}

/// The first line from `lines` that holds `prefix`, from there on, within
/// `within` (libtest prints its own words around a helper's).
fn line_starting(
    lines: &std::sync::mpsc::Receiver<String>,
    prefix: &str,
    within: Duration,
) -> Option<String> {
    let end = Instant::now() + within;
    loop {
        match lines.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok(l) => {
                if let Some(at) = l.find(prefix) {
                    return Some(l[at..].to_owned());
                }
            }
            Err(_) => return None,
        }
    }
}

/// Stop a helper: close its stdin, then wait for it (killed after 10 s).
fn stop_helper(mut child: Child) {
    drop(child.stdin.take());
    let end = Instant::now() + Duration::from_secs(10);
    while Instant::now() < end {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The helper: hold COUNT idle TCP connections to ADDR, each having sent
/// one byte; with CHURN 1, re-open each one the unit closes. Prints
/// `OPEN n` once all are open, then `DONE opens=N` at the end. Bounded:
/// 60 s, and 500,000 connections in all.
#[test]
#[ignore = "helper run by other tests, as another user"]
fn flood_child() {
    let Ok(spec) = std::env::var("STOWAGE_TEST_FLOOD") else {
        return;
    };
    let mut it = spec.split_whitespace();
    let addr: SocketAddr = it.next().unwrap().parse().unwrap();
    let count: usize = it.next().unwrap().parse().unwrap();
    let churn = it.next() == Some("1");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut b = [0u8; 1];
            let _ = std::io::stdin().read(&mut b);
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
        });
    }
    let open = || -> Option<TcpStream> {
        let s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
        let _ = (&s).write_all(&[9]);
        s.set_nonblocking(true).ok()?;
        Some(s)
    };
    let end = Instant::now() + Duration::from_secs(60);
    let mut opens = 0u64;
    let mut conns: Vec<Option<TcpStream>> = Vec::with_capacity(count);
    while conns.len() < count && Instant::now() < end {
        opens += 1;
        conns.push(open());
    }
    println!("OPEN {}", conns.iter().flatten().count());
    std::io::stdout().flush().unwrap();
    let mut buf = [0u8; 4096];
    let mut rounds = 0u64;
    while !stop.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < end {
        rounds += 1;
        for c in conns.iter_mut() {
            let closed = match c {
                None => true,
                Some(s) => loop {
                    match s.read(&mut buf) {
                        Ok(0) => break true,
                        Ok(_) => continue,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
                        Err(_) => break true,
                    }
                },
            };
            if closed && churn && opens < 500_000 {
                *c = open();
                opens += 1;
            } else if closed {
                *c = None;
            }
        }
        // Paced: at most one round of re-opens per 20 ms.
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("DONE opens={opens} rounds={rounds}");
    std::io::stdout().flush().unwrap();
}

/// Put one row through a fresh client (its own connect, its own handshake)
/// within `timeout`; the row reads back.
fn put_through_a_new_client(
    u: &Unit,
    addr: UnitAddr,
    row: u64,
    timeout: Duration,
) -> Result<(), Error> {
    let c = u.client(addr, timeout)?;
    let v = pattern(row, 3, 4096);
    c.put_rows(&[(Key::new(row, "x"), &v)], c.deadline())?;
    let got = c.get_rows(&[Key::new(row, "x")], c.deadline())?;
    assert_eq!(got[0], v);
    Ok(())
}

#[test]
fn another_user_reopening_idle_connections_leaves_a_proven_clients_puts_served() {
    if !can_act_as_nobody() {
        eprintln!("skipped: needs root and setpriv to act as another user");
        return;
    }
    // The unit logs each handshake it cuts, naming its source, at debug
    // (not each connection's end: stowage_unit::conn stays at info).
    let u = Unit::start_logging(
        true,
        &[],
        None,
        "info,stowage_unit=debug,stowage_unit::conn=info",
    );
    // Another user holds 1,100 idle unauthenticated connections (one byte
    // each), re-opening each one the unit closes.
    let (flood, lines) = flood_as_nobody(&format!("{} 1100 1", u.tcp));
    let opened = line_starting(&lines, "OPEN ", Duration::from_secs(60));
    assert!(opened.is_some(), "the flood did not start");
    // Meanwhile the job's own client connects anew, proves the secret and
    // puts, 20 times, each within its 5 s deadline.
    let mut failures = Vec::new();
    for i in 0..20u64 {
        let addr = if i % 4 == 3 {
            UnitAddr::Unix(u.sock.clone())
        } else {
            UnitAddr::Tcp(u.tcp)
        };
        if let Err(e) = put_through_a_new_client(&u, addr, i, Duration::from_secs(5)) {
            failures.push(format!("put {i}: {e}"));
        }
    }
    stop_helper(flood);
    let done = line_starting(&lines, "DONE", Duration::from_secs(10)).unwrap_or_default();
    eprintln!("the flood: {done}");
    assert!(
        failures.is_empty(),
        "{} of 20 puts failed under the flood ({done}): {failures:#?}",
        failures.len()
    );
    // The unit told whom it cut: the flooding user, by its uid, and never
    // the job's own user (it shares no source with the flood). The only
    // other source a cut may name is an address: a peer that had closed its
    // socket before the unit accepted it (the flood's, once it stopped),
    // whose owner the kernel no longer tells.
    let log = u.log();
    assert!(!log.contains("panicked"), "{log}");
    let cuts: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("cut a handshake to admit a new connection"))
        .collect();
    let tail = |n: usize| log.lines().rev().take(n).collect::<Vec<_>>().join("\n");
    assert!(
        cuts.iter().any(|l| l.contains("source=uid 65534 ")),
        "no cut of the flooding user (uid 65534) logged; the log ends:\n{}",
        tail(40)
    );
    let me = rustix::process::getuid().as_raw();
    let wrong: Vec<&&str> = cuts
        .iter()
        .filter(|l| l.contains("source=uid ") && !l.contains("source=uid 65534 "))
        .collect();
    assert!(
        wrong.is_empty(),
        "{} handshakes of another user than the flood's were cut (uid {me} is the job's): {:#?}",
        wrong.len(),
        &wrong[..wrong.len().min(10)]
    );
    assert!(
        !log.contains("cannot tell which local user owns"),
        "the unit could not name a loopback peer's user: {}",
        tail(40)
    );
}

#[test]
fn the_handshake_pool_has_its_caps_and_a_silent_connection_is_cut_at_its_deadline() {
    // Per source: this user's fourth and fifth silent connections cut its
    // first and second (the oldest), which are told why.
    let u = Unit::start(
        true,
        &[
            "--max-handshakes",
            "4",
            "--max-handshakes-per-source",
            "3",
            "--handshake-timeout",
            "30s",
        ],
        None,
    );
    let mut mine: Vec<UnixStream> = Vec::new();
    for _ in 0..5 {
        let s = UnixStream::connect(&u.sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        mine.push(s);
    }
    for s in &mut mine[..2] {
        let m = busy(recv_frame(s));
        assert!(m.contains("--max-handshakes-per-source"), "{m}");
        assert!(
            m.contains("uid 0") || !rustix::process::geteuid().is_root(),
            "{m}"
        );
    }
    for s in &mut mine[2..] {
        assert!(
            still_open(s, Duration::from_millis(200)),
            "a newer handshake was cut"
        );
    }
    // A proven client of the same user still gets in (its connection cuts
    // the oldest silent one) and is served.
    let c = u
        .client(UnitAddr::Unix(u.sock.clone()), Duration::from_secs(10))
        .expect("a proven client connects past its own user's silent connections");
    let v = pattern(1, 1, 100);
    c.put_rows(&[(Key::new(1, "x"), &v)], c.deadline()).unwrap();
    let m = busy(recv_frame(&mut mine[2]));
    assert!(m.contains("--max-handshakes-per-source"), "{m}");
    drop(c);

    // The whole pool: with this user at its share again (3 of 4), another
    // user's first connection fills it, and its second cuts the oldest of
    // the source holding the most: this user's.
    let s = UnixStream::connect(&u.sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    mine.push(s);
    if can_act_as_nobody() {
        let (flood, lines) = flood_as_nobody(&format!("{} 2 0", u.tcp));
        assert_eq!(
            line_starting(&lines, "OPEN", Duration::from_secs(30)).as_deref(),
            Some("OPEN 2"),
            "the other user's connections"
        );
        let m = busy(recv_frame(&mut mine[3]));
        assert!(
            m.contains("--max-handshakes)") || m.contains("--max-handshakes "),
            "{m}"
        );
        assert!(!m.contains("per-source"), "{m}");
        for s in &mut mine[4..] {
            assert!(still_open(s, Duration::from_millis(200)));
        }
        stop_helper(flood);
    }
    drop(mine);

    // The deadline: a unit with the default handshake timeout (1 s) cuts a
    // silent connection on either listener well before its frame timeout
    // (10 s) would.
    let d = Unit::start(true, &[], None);
    let t0 = Instant::now();
    let mut silent_tcp = TcpStream::connect(d.tcp).unwrap();
    silent_tcp
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut silent_uds = UnixStream::connect(&d.sock).unwrap();
    silent_uds
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // One byte of a frame, then nothing.
    silent_tcp.write_all(&[7]).unwrap();
    assert!(recv_frame(&mut silent_tcp).is_none());
    assert!(recv_frame(&mut silent_uds).is_none());
    assert!(
        t0.elapsed() < Duration::from_secs(8),
        "silent handshakes held for {:?}",
        t0.elapsed()
    );
}

#[test]
fn a_refused_connect_is_retried_within_the_deadline_and_the_error_names_the_cause() {
    let u = Unit::start(true, &["--max-connections", "1"], None);
    // One proven client takes the only slot.
    let holder = u
        .client(UnitAddr::Tcp(u.tcp), Duration::from_secs(10))
        .unwrap();
    holder
        .put_rows(&[(Key::new(1, "x"), &pattern(1, 1, 64))], holder.deadline())
        .unwrap();
    // Another is refused until its deadline: a Timeout that says why
    // (connecting is lazy: its first call is the one refused).
    let t0 = Instant::now();
    let other = u
        .client(UnitAddr::Tcp(u.tcp), Duration::from_millis(1500))
        .unwrap();
    let e = other
        .get_rows(&[Key::new(1, "x")], other.deadline())
        .expect_err("refused while the slot is taken");
    let took = t0.elapsed();
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("kept refusing connections") && text.contains("too many connections"),
        "{text}"
    );
    assert!(e.is_retryable());
    assert!(took >= Duration::from_millis(500), "not retried: {took:?}");
    // Freed while a client waits: that client gets in within its deadline.
    let (tx, rx) = std::sync::mpsc::channel();
    let addr = u.tcp;
    let waiter = std::thread::spawn(move || {
        let mut cfg = ClientConfig::new("ns", vec![UnitAddr::Tcp(addr)]);
        cfg.timeout = Duration::from_secs(20);
        cfg.secret = Some(secret());
        let first_call = |c: Client| c.get_rows(&[Key::new(1, "x")], c.deadline()).map(drop);
        let _ = tx.send(Client::connect(cfg).and_then(first_call));
    });
    std::thread::sleep(Duration::from_millis(300));
    drop(holder);
    let r = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the waiting client returns");
    waiter.join().unwrap();
    r.expect("a client waiting for a slot gets it within its deadline");
}

/// A Hello on a raw Unix connection (no secret, no fd).
fn raw_hello(path: &Path) -> Raw {
    Raw::hello(path, "ns")
}

#[test]
fn entry_lengths_that_add_past_2_64_are_invalid_and_the_connections_holds_are_released() {
    let mut u = Unit::start(false, &[], None);
    let mut r = raw_hello(&u.sock);
    let mut other = raw_hello(&u.sock);
    // A reservation the connection holds.
    let resp = r.call(&Request::Alloc {
        blob: BlobId(7),
        nbytes: 4096,
        n_entries: 2,
    });
    assert!(matches!(resp, Response::Allocated { .. }), "{resp:?}");
    assert!(stats(&mut other).reserved_bytes >= 4096);
    // Two entries of 2^63 bytes each: each fits in 64 bits, their sum does
    // not.
    let half = 1u64 << 63;
    let entry = |row| EntrySpec {
        key: Key::new(row, "f"),
        offset: 0,
        len: half,
        meta: vec![],
    };
    let id = r.send(&Request::Commit {
        blob: BlobId(7),
        partition: String::new(),
        entries: vec![entry(1), entry(2)],
    });
    let reply = r.recv().expect("an answer, not a dropped connection");
    assert_eq!(reply.id, id);
    assert!(
        matches!(
            &reply.body,
            Response::Error {
                code: ErrorCode::InvalidRequest,
                ..
            }
        ),
        "{:?}",
        reply.body
    );
    // The unit stays up, and what the connection held is released.
    assert!(u.alive());
    assert!(
        eventually(Duration::from_secs(5), || stats(&mut other).reserved_bytes
            == 0),
        "the connection's reservation outlived it: {:?}",
        stats(&mut other)
    );
    let log = u.log();
    assert!(!log.contains("panicked"), "{log}");
}

/// Soft and hard `Max open files` of process `pid`.
fn nofile(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a Max open files line");
    let mut f = line["Max open files".len()..].split_whitespace();
    (f.next().unwrap().to_owned(), f.next().unwrap().to_owned())
}

#[test]
fn the_unit_raises_its_open_file_limit_to_the_hard_limit() {
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    if hard.is_some_and(|h| h <= 256) {
        eprintln!("skipped: the hard open-file limit is 256 or less");
        return;
    }
    let u = Unit::start(false, &[], Some("ulimit -Sn 256"));
    let (soft, hard) = nofile(u.child.id());
    assert_eq!(soft, hard, "soft limit {soft}, hard {hard}");
    assert!(
        u.log().contains("raised the open-file limit"),
        "{}",
        u.log()
    );
    // It serves more connections than the old soft limit has fds for.
    let mut held = Vec::new();
    for _ in 0..200 {
        held.push(raw_hello(&u.sock));
    }
    for r in &mut held {
        assert!(matches!(r.call(&Request::Stats), Response::Stats(_)));
    }
}
