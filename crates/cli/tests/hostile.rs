//! A unit survives misbehaving clients, keeps ownership, lets retries be
//! safe, and keeps other users and non-admins out: real unit processes,
//! raw protocol connections that misbehave on purpose.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use stowage_client::{Error, Key};
use stowage_wire::{
    encode, BlobId, EntrySpec, ErrorCode, Limits, Request, Response, PREFIX_LEN, PROTOCOL_VERSION,
};

const MIB: u64 = 1 << 20;

/// Hello on a Unix socket, joining `session` (or a new one); returns the
/// connection, its reply.
fn hello_in(path: &Path, session: Option<u128>) -> (Raw, Response) {
    let mut r = Raw::connect(path);
    let resp = r.call(&Request::Hello {
        version: PROTOCOL_VERSION,
        namespace: "ns".into(),
        want_fd: false,
        session,
    });
    (r, resp)
}

fn session_of(resp: &Response) -> u128 {
    match resp {
        Response::Hello { session, .. } => *session,
        other => panic!("expected Hello, got {other:?}"),
    }
}

fn alloc(r: &mut Raw, blob: u128, nbytes: u64, n: u32) -> Response {
    r.call(&Request::Alloc {
        blob: BlobId(blob),
        nbytes,
        n_entries: n,
    })
}

fn entry(row: u64, len: u64) -> EntrySpec {
    EntrySpec {
        key: Key::new(row, "f"),
        offset: 0,
        len,
        meta: vec![],
    }
}

fn commit(r: &mut Raw, blob: u128, entries: Vec<EntrySpec>) -> Response {
    r.call(&Request::Commit {
        blob: BlobId(blob),
        partition: String::new(),
        entries,
    })
}

fn is_error(r: &Response, code: ErrorCode) -> bool {
    matches!(r, Response::Error { code: c, .. } if *c == code)
}

#[test]
fn only_the_owning_session_may_commit_abort_or_unpin() {
    let (p, _) = plane(1, 16 * MIB, &[]);
    let sock = p.units[0].uds.clone();
    let (mut a, ha) = hello_in(&sock, None);
    let (mut b, _) = hello_in(&sock, None);
    assert!(matches!(
        alloc(&mut a, 1, 100, 1),
        Response::Allocated { .. }
    ));
    // Another session can neither take, commit nor abort the reservation.
    assert!(is_error(&alloc(&mut b, 1, 100, 1), ErrorCode::NotOwner));
    assert!(is_error(
        &commit(&mut b, 1, vec![entry(0, 100)]),
        ErrorCode::NotOwner
    ));
    assert!(is_error(
        &b.call(&Request::Abort {
            blob: BlobId(1),
            in_flight: false
        }),
        ErrorCode::NotOwner
    ));
    // Another connection of the same session waits while the first holds it.
    let (mut a2, h2) = hello_in(&sock, Some(session_of(&ha)));
    assert_eq!(session_of(&h2), session_of(&ha), "joined the session");
    assert!(is_error(&alloc(&mut a2, 1, 100, 1), ErrorCode::Busy));
    assert_eq!(commit(&mut a, 1, vec![entry(0, 100)]), Response::Done);
    let pin = match a.call(&Request::Resolve {
        partition: String::new(),
        keys: vec![Key::new(0, "f")],
        hold: false,
    }) {
        Response::Resolved { pin: Some(p), .. } => p,
        other => panic!("{other:?}"),
    };
    // Not someone else's to drop.
    assert!(is_error(
        &b.call(&Request::Unpin { pin, reply: true }),
        ErrorCode::NotOwner
    ));
    assert_eq!(stats(&mut b).pins, 1);
    assert_eq!(a.call(&Request::Unpin { pin, reply: true }), Response::Done);
    assert_eq!(stats(&mut b).pins, 0);
}

#[test]
fn a_put_retried_after_its_connection_dropped_succeeds() {
    let (p, _) = plane(1, 16 * MIB, &[]);
    let sock = p.units[0].uds.clone();
    let tcp = p.units[0].tcp;
    let mut watcher = Raw::hello(&sock, "ns");
    // A reservation whose connection dropped before commit: the retry on a
    // new connection reserves afresh and commits.
    let (mut a, ha) = hello_in(&sock, None);
    assert!(matches!(
        alloc(&mut a, 7, 100, 1),
        Response::Allocated { .. }
    ));
    drop(a);
    assert!(eventually(Duration::from_secs(5), || stats(&mut watcher)
        .reserved_bytes
        == 0));
    let (mut a, _) = hello_in(&sock, Some(session_of(&ha)));
    assert!(matches!(
        alloc(&mut a, 7, 100, 1),
        Response::Allocated { .. }
    ));
    assert_eq!(commit(&mut a, 7, vec![entry(0, 100)]), Response::Done);
    // Committed, then the connection dropped before the reply was read:
    // the retry hears that it is committed.
    assert_eq!(alloc(&mut a, 7, 100, 1), Response::AlreadyCommitted);
    assert_eq!(commit(&mut a, 7, vec![entry(0, 100)]), Response::Done);

    // Over tcp: a Put whose stream was cut halfway, then retried whole.
    let v: Vec<u8> = pattern(5, 5, 1 << 20);
    let put = |blob: u128, bytes: &[u8], read_reply: bool| -> Option<Response> {
        let mut t = RawTcp::hello_proving(tcp, p.secret());
        let mut buf = Vec::new();
        let req = Request::Put {
            blob: BlobId(blob),
            partition: String::new(),
            entries: vec![entry(1, v.len() as u64)],
            timeout_ms: 10_000,
        };
        encode(9, &req, v.len() as u64, &mut buf).unwrap();
        t.s.write_all(&buf).unwrap();
        t.s.write_all(bytes).unwrap();
        read_reply.then(|| t.recv().expect("a reply").body)
    };
    assert_eq!(put(8, &v[..v.len() / 2], false), None);
    assert!(eventually(Duration::from_secs(5), || stats(&mut watcher)
        .reserved_bytes
        == 0));
    assert_eq!(put(8, &v, true), Some(Response::Done));
    // And the same put again (its reply lost): committed already.
    assert_eq!(put(8, &v, true), Some(Response::Done));
    let c = client(&p, Kind::Tcp, Duration::from_secs(10));
    let mut cfg = stowage_client::ClientConfig::new("ns", p.tcp_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(10);
    let c2 = stowage_client::Client::connect(cfg).unwrap();
    drop(c);
    assert_eq!(
        c2.get_rows(&[Key::new(1, "f")], c2.deadline()).unwrap()[0],
        v
    );
    let s = stats(&mut watcher);
    assert_eq!((s.reserved_bytes, s.entries), (0, 2), "{s:?}");
}

fn vm_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn truncated_frames_time_out_and_cost_no_memory_up_front() {
    let (p, _) = plane(1, 16 * MIB, &["--frame-timeout", "500ms"]);
    let sock = p.units[0].uds.clone();
    let pid = p.units[0].pid();
    let before = vm_rss_kib(pid);
    // Prefixes that announce a 64 MiB header, then nothing.
    let mut stalled = Vec::new();
    for _ in 0..12 {
        let mut r = Raw::hello(&sock, "ns");
        let mut prefix = [0u8; PREFIX_LEN];
        prefix[..4].copy_from_slice(&(64u32 << 20).to_le_bytes());
        r.s.write_all(&prefix).unwrap();
        r.s.write_all(&[0u8; 10]).unwrap();
        stalled.push(r);
    }
    std::thread::sleep(Duration::from_millis(200));
    let grown = vm_rss_kib(pid).saturating_sub(before);
    assert!(
        grown < 64 * 1024,
        "12 stalled 64 MiB headers grew the unit by {grown} KiB"
    );
    // Half a prefix, then nothing: cut off after the frame timeout.
    let mut half = Raw::hello(&sock, "ns");
    half.s.write_all(&[1, 0, 0]).unwrap();
    for r in stalled.iter_mut().chain(std::iter::once(&mut half)) {
        assert!(r.closed(), "a truncated frame kept its connection");
    }
    // An idle connection (no frame begun) is never cut.
    let mut idle = Raw::hello(&sock, "ns");
    std::thread::sleep(Duration::from_millis(1200));
    assert!(matches!(idle.call(&Request::Stats), Response::Stats(_)));
}

/// 1,000 TCP connections that never send a byte (nobody needs a secret
/// to open one): the unit spends no thread and little memory on them, and
/// a real client is served within its deadline meanwhile.
#[test]
fn a_flood_of_silent_connections_costs_no_thread_and_keeps_clients_served() {
    assert!(raise_nofile() >= 1100, "this test needs 1,100 open files");
    let (p, _) = plane(1, 64 * MIB, &["--handshake-timeout", "10s"]);
    let pid = p.units[0].pid();
    let c = client(&p, Kind::Tcp, Duration::from_secs(5));
    c.put_rows(&[(Key::new(0, "f"), &[1u8; 4096])], c.deadline())
        .unwrap();
    let anon_before = proc_status(pid, "RssAnon");
    let stowage_client::UnitAddr::Tcp(addr) = p.tcp_addrs()[0] else {
        unreachable!("a tcp address")
    };
    let flood: Vec<TcpStream> = (0..1000)
        .map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let threads = proc_status(pid, "Threads");
    assert!(
        threads <= thread_bound(),
        "the unit runs {threads} threads with 1,000 silent connections open"
    );
    // A new client (its own connection, proving the secret) is served
    // within its 5 s deadline while the flood holds its connections.
    let fresh = client(&p, Kind::Tcp, Duration::from_secs(5));
    let v = vec![7u8; 4096];
    fresh
        .put_rows(&[(Key::new(1, "f"), &v)], fresh.deadline())
        .unwrap();
    assert_eq!(
        fresh
            .get_rows(&[Key::new(1, "f")], fresh.deadline())
            .unwrap(),
        vec![v]
    );
    // And so is the client that was connected before.
    assert_eq!(
        c.get_rows(&[Key::new(0, "f")], c.deadline()).unwrap(),
        vec![vec![1u8; 4096]]
    );
    let grown_kib = proc_status(pid, "RssAnon").saturating_sub(anon_before);
    assert!(
        grown_kib < 64 * 1024,
        "1,000 silent connections grew the unit by {grown_kib} KiB"
    );
    drop(flood);
}

/// Read one whole frame from `r`'s socket, with the descriptor that rode
/// on its first byte.
fn recv_frame_with_fd(r: &mut Raw) -> (Response, Option<std::os::fd::OwnedFd>) {
    let mut buf = vec![0u8; 4096];
    let (mut n, fd) = stowage_shm::recv_with_fd(&r.s, &mut buf).unwrap();
    loop {
        if let Ok(Some((f, used))) =
            stowage_wire::decode_frame::<Response>(&buf[..n], &Limits::default())
        {
            assert_eq!(used, n, "one frame");
            return (f.envelope.body, fd);
        }
        let got = r.s.read(&mut buf[n..]).unwrap();
        assert!(got > 0, "the unit closed the connection mid-frame");
        n += got;
    }
}

/// A same-host connection with a request ring: Hello with the slab, then
/// OpenRing.
fn ring_connection(sock: &Path) -> (Raw, stowage_shm::ring::Ring) {
    let mut r = Raw::connect(sock);
    r.send(&Request::Hello {
        version: PROTOCOL_VERSION,
        namespace: "ns".into(),
        want_fd: true,
        session: None,
    });
    let (hello, slab) = recv_frame_with_fd(&mut r);
    assert!(matches!(hello, Response::Hello { .. }), "{hello:?}");
    assert!(slab.is_some(), "the slab's fd rides on the Hello reply");
    let bytes = 16 << 10;
    r.send(&Request::OpenRing { bytes });
    let (reply, fd) = recv_frame_with_fd(&mut r);
    assert!(matches!(reply, Response::Ring { .. }), "{reply:?}");
    let ring = stowage_shm::ring::Ring::open(fd.expect("the ring's fd"), bytes as usize).unwrap();
    (r, ring)
}

/// One session floods its request ring with requests and never takes a
/// reply; another scribbles over its ring. Each is cut when it breaks
/// the ring's rules, the unit's threads stay bounded, and other clients
/// are served throughout.
#[test]
fn a_ring_flood_or_a_scribbled_ring_cuts_only_its_own_connection() {
    let (p, _) = plane(1, 16 * MIB, &[]);
    let sock = p.units[0].uds.clone();
    let pid = p.units[0].pid();
    let (mut flooder, ring) = ring_connection(&sock);
    let mut entry = Vec::new();
    let mut submitted = 0u64;
    let mut kicks = 0u64;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    // Submit until the unit has cut the connection (or the deadline).
    while !flooder_closed(&mut flooder) && std::time::Instant::now() < deadline {
        entry.clear();
        encode(
            1000 + submitted,
            &Request::List {
                partition: "p".into(),
            },
            0,
            &mut entry,
        )
        .unwrap();
        match ring.submit(&entry) {
            Ok(kick) => {
                submitted += 1;
                if kick {
                    kicks += 1;
                    kick_ring(&mut flooder);
                }
            }
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    assert!(
        submitted > 0 && kicks > 0,
        "{submitted} submitted, {kicks} kicks"
    );
    assert!(
        flooder_closed(&mut flooder),
        "a ring flooding past its reply room kept its connection ({submitted} requests)"
    );
    assert!(proc_status(pid, "Threads") <= thread_bound());
    let c = client(&p, Kind::Shm, Duration::from_secs(5));
    let v = vec![9u8; 4096];
    c.put_rows(&[(Key::new(3, "f"), &v)], c.deadline()).unwrap();
    assert_eq!(
        c.get_rows(&[Key::new(3, "f")], c.deadline()).unwrap(),
        vec![v.clone()]
    );
    // A ring whose entry is not a frame: cut, the unit stays up.
    let (mut scribbler, ring) = ring_connection(&sock);
    if ring.submit(&[0xff; 40]).unwrap() {
        kick_ring(&mut scribbler);
    }
    assert!(
        scribbler.closed(),
        "a garbage ring entry kept its connection"
    );
    assert_eq!(
        c.get_rows(&[Key::new(3, "f")], c.deadline()).unwrap(),
        vec![v]
    );
}

/// Kick a ring on its socket; the unit may have cut the connection
/// already (it may poll the ring before the kick comes).
fn kick_ring(r: &mut Raw) {
    let mut buf = Vec::new();
    encode(u64::MAX, &Request::RingKick, 0, &mut buf).unwrap();
    let _ = r.s.write_all(&buf);
}

/// Whether the unit closed `r` (checked without waiting).
fn flooder_closed(r: &mut Raw) -> bool {
    r.s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 4096];
    let closed = loop {
        match r.s.read(&mut b) {
            Ok(0) => break true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
            Err(_) => break true,
        }
    };
    r.s.set_nonblocking(false).unwrap();
    closed
}

#[test]
fn absurd_sizes_offsets_and_counts_are_refused_and_the_unit_stays_up() {
    let (p, _) = plane(1, 16 * MIB, &["--index-budget", "64KiB"]);
    let sock = p.units[0].uds.clone();
    // Sizes no unit could hold are refused before the core sees them, and
    // the connection that asked is closed.
    for n in [u64::MAX, u64::MAX - 63, 1 << 63] {
        let mut r = Raw::hello(&sock, "ns");
        assert!(
            is_error(&alloc(&mut r, 1, n, 1), ErrorCode::InvalidRequest),
            "alloc of {n}"
        );
        assert!(r.closed());
    }
    let mut r = Raw::hello(&sock, "ns");
    assert!(is_error(&alloc(&mut r, 1, 17 * MIB, 1), ErrorCode::Full));
    assert!(matches!(
        alloc(&mut r, 2, 100, 1),
        Response::Allocated { .. }
    ));
    // An entry past its blob: refused, the reservation stays.
    let past = EntrySpec {
        key: Key::new(0, "f"),
        offset: 50,
        len: 51,
        meta: vec![],
    };
    assert!(is_error(
        &commit(&mut r, 2, vec![past]),
        ErrorCode::InvalidRequest
    ));
    // An entry whose end overflows: refused before the core sees it.
    let mut o = Raw::hello(&sock, "ns");
    let overflow = EntrySpec {
        key: Key::new(0, "f"),
        offset: u64::MAX,
        len: 2,
        meta: vec![],
    };
    assert!(is_error(
        &commit(&mut o, 2, vec![overflow]),
        ErrorCode::InvalidRequest
    ));
    assert!(o.closed());
    assert_eq!(commit(&mut r, 2, vec![entry(0, 100)]), Response::Done);
    // The index's byte budget: a flood of tiny entries answers Full.
    let many: Vec<EntrySpec> = (0..2000).map(|i| entry(10 + i, 0)).collect();
    assert!(matches!(
        alloc(&mut r, 3, 0, 2000),
        Response::Allocated { .. }
    ));
    assert!(is_error(&commit(&mut r, 3, many), ErrorCode::Full));
    assert!(stats(&mut r).index_bytes <= 64 << 10);
    // A namespace may not contain the partition separator.
    let mut bad = Raw::connect(&sock);
    assert!(is_error(
        &bad.call(&Request::Hello {
            version: PROTOCOL_VERSION,
            namespace: "a\u{1f}b".into(),
            want_fd: false,
            session: None,
        }),
        ErrorCode::InvalidRequest
    ));
    // Still serving, data intact.
    let c = client(&p, Kind::Shm, Duration::from_secs(5));
    assert_eq!(c.unit_count(), 1);
    let mut cfg = stowage_client::ClientConfig::new("ns", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(5);
    let c = stowage_client::Client::connect(cfg).unwrap();
    assert_eq!(
        c.get_rows(&[Key::new(0, "f")], c.deadline()).unwrap()[0].len(),
        100
    );
}

#[test]
fn a_flooding_client_gets_busy_while_others_complete() {
    let (p, _) = plane(
        1,
        16 * MIB,
        &["--max-session-connections", "3", "--max-connections", "12"],
    );
    let sock = p.units[0].uds.clone();
    // One session opens connections as fast as it can.
    let (first, h) = hello_in(&sock, None);
    let token = session_of(&h);
    let mut flood = vec![first];
    let mut refused = 0;
    for _ in 0..6 {
        let (r, resp) = hello_in(&sock, Some(token));
        if is_error(&resp, ErrorCode::Busy) {
            refused += 1;
        } else {
            flood.push(r);
        }
    }
    assert_eq!((flood.len(), refused), (3, 4));
    // Others still complete.
    let c = client(&p, Kind::Shm, Duration::from_secs(5));
    let v = pattern(1, 2, 4096);
    c.put_rows(&[(Key::new(1, "x"), &v)], c.deadline()).unwrap();
    assert_eq!(c.get_rows(&[Key::new(1, "x")], c.deadline()).unwrap()[0], v);
    // The unit-wide cap: past it, new connections are turned away with
    // Busy, and the unit keeps serving the ones it has.
    let mut many = Vec::new();
    let mut turned_away = 0;
    for _ in 0..20 {
        let mut r = Raw::connect(&sock);
        // A connection turned away gets its answer (id 0) before any request.
        let mut buf = Vec::new();
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            namespace: "ns".into(),
            want_fd: false,
            session: None,
        };
        encode(1, &hello, 0, &mut buf).unwrap();
        let _ = r.s.write_all(&buf); // may find the connection closed already
        match r.recv().map(|e| e.body) {
            Some(Response::Hello { .. }) => many.push(r),
            Some(e) if is_error(&e, ErrorCode::Busy) => turned_away += 1,
            other => panic!("{other:?}"),
        }
    }
    assert!(turned_away > 0 && many.len() < 20, "{turned_away}");
    assert!(matches!(flood[0].call(&Request::Stats), Response::Stats(_)));
    drop(many);
    assert!(eventually(Duration::from_secs(5), || {
        c.get_rows(&[Key::new(1, "x")], c.deadline()).is_ok()
    }));
}

/// A unit started by hand with its socket in a directory other users can
/// enter (the local plane's socket directory is owner-only already).
struct HandUnit {
    child: Child,
    sock: PathBuf,
    tcp: String,
    _dir: tempfile::TempDir,
}

impl HandUnit {
    fn start(extra: &[&str]) -> HandUnit {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let sock = dir.path().join("u.sock");
        let mut child = Command::new(binary())
            .args([
                "unit",
                "--memory",
                "4MiB",
                "--no-mlock",
                "--exit-with-stdin",
            ])
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .args(["--listen", "tcp:127.0.0.1:0", "--insecure"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let rx = stdout_lines(&mut child);
        let ready = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the unit is ready");
        let tcp = ready
            .split_whitespace()
            .find_map(|w| w.strip_prefix("tcp="))
            .unwrap()
            .to_string();
        HandUnit {
            child,
            sock,
            tcp,
            _dir: dir,
        }
    }
}

impl Drop for HandUnit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Connect to `sock` as user `nobody` and print what the unit sends.
fn connect_as_nobody(sock: &Path) -> String {
    let script = "import socket,sys\n\
s=socket.socket(socket.AF_UNIX)\n\
s.settimeout(10)\n\
try:\n    s.connect(sys.argv[1])\nexcept OSError as e:\n    print('CONNECT', e.errno); sys.exit(0)\n\
s.settimeout(2)\n\
data=b''\n\
try:\n    while True:\n        b=s.recv(4096)\n        if not b: break\n        data+=b\nexcept socket.timeout:\n    print('OPEN', data); sys.exit(0)\n\
print('GOT', data)\n";
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(sock)
        .uid(65534)
        .gid(65534)
        .current_dir("/")
        .output()
        .expect("python3 runs");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn only_the_units_own_user_may_connect() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root to act as another user");
        return;
    }
    let u = HandUnit::start(&[]);
    // The socket file itself is owner-only.
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&u.sock).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    let out = connect_as_nobody(&u.sock);
    assert!(out.starts_with("CONNECT 13"), "{out}"); // EACCES
                                                     // Even with the file opened up, the unit checks the peer's uid.
    std::fs::set_permissions(&u.sock, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let out = connect_as_nobody(&u.sock);
    assert!(out.contains("accepts only its own user"), "{out}");
    // Told otherwise, it lets them in (they would then say Hello; this one
    // stays silent for 2 s, within a longer handshake timeout).
    let open = HandUnit::start(&["--allow-other-uids", "--handshake-timeout", "10s"]);
    let out = connect_as_nobody(&open.sock);
    assert!(out.starts_with("OPEN"), "{out}");
}

#[test]
fn admin_requests_need_a_same_user_unix_client_or_admin() {
    let u = HandUnit::start(&[]);
    let mut t = RawTcp::hello(&u.tcp);
    assert!(is_error(
        &t.call(&Request::Shutdown { timeout_ms: 1000 }),
        ErrorCode::Unauthorized
    ));
    assert!(is_error(
        &t.call(&Request::Checkpoint {
            dir: "/tmp/x".into()
        }),
        ErrorCode::Unauthorized
    ));
    // Over the Unix socket, as the same user: allowed (no checkpoint root,
    // so the checkpoint itself is refused).
    let mut r = Raw::hello(&u.sock, "ns");
    assert!(is_error(
        &r.call(&Request::Checkpoint {
            dir: "/tmp/x".into()
        }),
        ErrorCode::Unauthorized
    ));
    assert!(matches!(
        r.call(&Request::Shutdown { timeout_ms: 1000 }),
        Response::ShutDown { .. }
    ));
    // With --admin, over tcp too.
    let a = HandUnit::start(&["--admin"]);
    let mut t = RawTcp::hello(&a.tcp);
    assert!(matches!(
        t.call(&Request::Shutdown { timeout_ms: 1000 }),
        Response::ShutDown { .. }
    ));
}

/// The memfd inode of unit process `pid`'s slab.
fn slab_inode(pid: u32) -> u64 {
    use std::os::unix::fs::MetadataExt;
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let e = e.unwrap();
        if std::fs::read_link(e.path())
            .map(|l| l.to_string_lossy().contains("memfd:stowage"))
            .unwrap_or(false)
        {
            return std::fs::metadata(e.path()).unwrap().ino();
        }
    }
    panic!("no slab memfd in unit {pid}");
}

/// Whether this process maps the memfd with inode `ino`.
fn maps_inode(ino: u64) -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .any(|l| {
            l.contains("memfd:stowage") && l.split_whitespace().nth(4) == Some(&ino.to_string())
        })
}

#[test]
fn restarts_are_told_against_the_current_instance_and_dead_slabs_unmapped() {
    let (mut p, opts) = plane(1, 8 * MIB, &[]);
    let c = client(&p, Kind::Shm, Duration::from_secs(5));
    let v = pattern(1, 1, 1000);
    let first = slab_inode(p.units[0].pid());
    c.put_rows(&[(Key::new(0, "a"), &v)], c.deadline()).unwrap();
    assert!(maps_inode(first));
    p.restart(0, &opts).unwrap();
    // The first read after the restart: lost, not merely missing; once.
    assert!(matches!(
        c.get_rows(&[Key::new(0, "a")], c.deadline()),
        Err(Error::LostKeys { .. })
    ));
    assert!(
        !maps_inode(first),
        "the dead instance's slab is still mapped"
    );
    assert!(matches!(
        c.get_rows(&[Key::new(0, "a")], c.deadline()),
        Err(Error::NotFound { .. })
    ));
    // The new instance is the one that counts now.
    c.put_rows(&[(Key::new(1, "a"), &v)], c.deadline()).unwrap();
    assert_eq!(c.get_rows(&[Key::new(1, "a")], c.deadline()).unwrap()[0], v);
    assert!(matches!(
        c.get_rows(&[Key::new(9, "a")], c.deadline()),
        Err(Error::NotFound { .. })
    ));
    // A second restart is detected too.
    p.restart(0, &opts).unwrap();
    assert!(matches!(
        c.get_rows(&[Key::new(1, "a")], c.deadline()),
        Err(Error::LostKeys { .. })
    ));
    // A unit that dies for good: its slab is unmapped once the client
    // learns it.
    let last = slab_inode(p.units[0].pid());
    c.put_rows(&[(Key::new(2, "a"), &v)], c.deadline()).unwrap();
    assert!(maps_inode(last));
    p.kill9(0);
    assert!(matches!(
        c.get_rows(&[Key::new(2, "a")], c.deadline()),
        Err(Error::LostKeys { .. })
    ));
    assert!(!maps_inode(last), "a dead unit's slab is still mapped");
}

/// Not a test on its own: run by `a_cut_local_clients_holds_wait_for_its_process_to_exit`.
/// Reserves a range over the Unix socket, then starts a frame it never
/// finishes (the unit cuts the connection), and waits to be killed.
#[test]
#[ignore = "a helper process of a_cut_local_clients_holds_wait_for_its_process_to_exit"]
fn cut_holder_child() {
    let sock = std::env::var("STOWAGE_TEST_CUT_HOLDER").expect("run only by its test");
    // Asks for the slab (its fd arrives with the reply and is dropped
    // here): a peer that maps the slab.
    let mut r = Raw::connect(Path::new(&sock));
    let h = r.call(&Request::Hello {
        version: PROTOCOL_VERSION,
        namespace: "ns".into(),
        want_fd: true,
        session: None,
    });
    assert!(matches!(h, Response::Hello { .. }), "{h:?}");
    assert!(matches!(
        alloc(&mut r, 5, 4096, 1),
        Response::Allocated { .. }
    ));
    r.s.write_all(&[9, 0, 0]).unwrap();
    println!("HELD");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn a_cut_local_clients_holds_wait_for_its_process_to_exit() {
    let (p, _) = plane(1, 16 * MIB, &["--frame-timeout", "300ms"]);
    let sock = p.units[0].uds.clone();
    let sock_str = sock.display().to_string();
    let mut child = helper_child("cut_holder_child", ("STOWAGE_TEST_CUT_HOLDER", &sock_str));
    let lines = stdout_lines(&mut child);
    let held = wait_for_line(&lines, "HELD", Duration::from_secs(30));
    let mut watcher = Raw::hello(&sock, "ns");
    // The unit cuts the connection (frame timeout), but the process lives
    // and maps the slab: its reservation stays, shown as orphaned.
    let orphaned = eventually(Duration::from_secs(5), || {
        stats(&mut watcher).sessions.iter().any(|s| s.orphaned == 1)
    });
    std::thread::sleep(Duration::from_millis(700));
    let kept = stats(&mut watcher);
    let _ = child.kill();
    let _ = child.wait();
    assert!(held, "the child never reserved");
    assert!(orphaned, "{kept:?}");
    assert_eq!(kept.reserved_bytes, 4096, "{kept:?}");
    assert_eq!(kept.quarantined_bytes, 0);
    // Once the process is gone, what it held is released.
    assert!(
        eventually(Duration::from_secs(5), || {
            let s = stats(&mut watcher);
            s.reserved_bytes == 0 && s.used == 0
        }),
        "{:?}",
        stats(&mut watcher)
    );
}

#[test]
fn a_disk_reservation_takes_its_bytes_with_put_not_a_bare_commit() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().display().to_string();
    let (p, _) = plane(1, 4 * MIB, &["--disk", &dir, "--disk-capacity", "64MiB"]);
    let sock = p.units[0].uds.clone();
    let mut r = Raw::hello(&sock, "ns");
    assert_eq!(alloc(&mut r, 3, 8 * MIB, 1), Response::ToDisk);
    // A bare Commit would wait for a file nobody writes: refused.
    assert!(is_error(
        &commit(&mut r, 3, vec![entry(0, 8 * MIB)]),
        ErrorCode::InvalidRequest
    ));
    let mut watcher = Raw::hello(&sock, "ns");
    assert_eq!(stats(&mut watcher).disk_used, 8 * MIB);
    // The reservation goes with its connection, disk space included.
    drop(r);
    assert!(eventually(Duration::from_secs(5), || stats(&mut watcher)
        .disk_used
        == 0));
}

#[test]
fn a_trickling_put_stream_is_cut_at_its_deadline() {
    let (p, _) = plane(1, 16 * MIB, &["--quarantine", "100ms"]);
    let sock = p.units[0].uds.clone();
    let mut watcher = Raw::hello(&sock, "ns");
    let mut t = RawTcp::hello_proving(p.units[0].tcp, p.secret());
    let n = 64 << 10;
    let mut buf = Vec::new();
    let req = Request::Put {
        blob: BlobId(1),
        partition: String::new(),
        entries: vec![entry(0, n)],
        timeout_ms: 1000,
    };
    encode(2, &req, n, &mut buf).unwrap();
    t.s.write_all(&buf).unwrap();
    // One byte every 200 ms: each receive makes progress, the whole never
    // finishes within its 1 s.
    let start = std::time::Instant::now();
    let mut cut = false;
    for _ in 0..40 {
        if t.s.write_all(&[7]).is_err() {
            cut = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
        if stats(&mut watcher).reserved_bytes == 0 && start.elapsed() > Duration::from_millis(500) {
            cut = true;
            break;
        }
    }
    let took = start.elapsed();
    assert!(cut, "the trickling stream was never cut");
    assert!(took < Duration::from_secs(4), "cut only after {took:?}");
    assert!(eventually(Duration::from_secs(3), || {
        let s = stats(&mut watcher);
        s.reserved_bytes == 0 && s.quarantined_bytes == 0 && s.used == 0
    }));
}

#[test]
fn a_refused_commit_gives_its_reservation_back() {
    let (p, _) = plane(1, 16 * MIB, &["--index-budget", "4KiB"]);
    let sock = p.units[0].uds.clone();
    let mut watcher = Raw::hello(&sock, "ns");
    let c = client(&p, Kind::Shm, Duration::from_secs(5));
    let v = pattern(0, 0, 1000);
    let many: Vec<(Key, &[u8])> = (0..200).map(|r| (Key::new(r, "x"), &v[..10])).collect();
    assert!(matches!(
        c.put_rows(&many, c.deadline()),
        Err(Error::UnitFull { .. })
    ));
    let s = stats(&mut watcher);
    assert_eq!((s.reserved_bytes, s.used), (0, 0), "{s:?}");
}

#[test]
fn a_sessions_holds_are_capped() {
    let (p, _) = plane(1, 16 * MIB, &["--max-session-holds", "3"]);
    let sock = p.units[0].uds.clone();
    let c = client(&p, Kind::Shm, Duration::from_secs(5));
    c.put_rows(&[(Key::new(0, "f"), &[1u8; 64][..])], c.deadline())
        .unwrap();
    let mut r = Raw::hello(&sock, "test");
    let resolve = |r: &mut Raw| {
        r.call(&Request::Resolve {
            partition: String::new(),
            keys: vec![Key::new(0, "f")],
            hold: false,
        })
    };
    for _ in 0..3 {
        assert!(matches!(
            resolve(&mut r),
            Response::Resolved { pin: Some(_), .. }
        ));
    }
    assert!(is_error(&resolve(&mut r), ErrorCode::Busy));
    assert!(is_error(&alloc(&mut r, 9, 0, 0), ErrorCode::Busy));
    // Others are not affected.
    assert_eq!(
        c.get_rows(&[Key::new(0, "f")], c.deadline()).unwrap()[0],
        vec![1u8; 64]
    );
}

#[test]
fn the_first_call_after_an_unnoticed_restart_may_be_a_view() {
    use stowage_client::{Column, DType, RowKey, Tensor};
    let (mut p, opts) = plane(1, 8 * MIB, &[]);
    let c = std::sync::Arc::new(client(&p, Kind::Shm, Duration::from_secs(5)));
    let bytes = [3u8; 16];
    let col = Column::Dense(Tensor::new(DType::U8, vec![1, 16], &bytes).unwrap());
    c.put("p", &[RowKey::Index(0)], &[("v", col)], None, c.deadline())
        .unwrap();
    p.restart(0, &opts).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let c2 = c.clone();
    std::thread::spawn(move || {
        let r = c2.view("p", &[RowKey::Index(0)], &["v"], None, c2.deadline());
        let _ = tx.send(r.map(|_| ()));
    });
    let r = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("a view after a restart never returned");
    assert!(r.is_err(), "the restarted unit has no such value");
}

#[test]
fn connecting_to_a_stopped_unit_with_a_full_backlog_is_bounded() {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let (p, _) = plane(1, 4 * MIB, &[]);
    let sock = p.units[0].uds.clone();
    p.units[0].signal(rustix::process::Signal::STOP).unwrap();
    assert!(eventually(Duration::from_secs(5), || is_stopped(
        p.units[0].pid()
    )));
    // Fill the stopped unit's listen backlog.
    let addr = SocketAddrUnix::new(&sock).unwrap();
    let mut queued = Vec::new();
    // (The backlog is net.core.somaxconn deep, 4096 by default.)
    let mut out_of_fds = false;
    let full = (0..9000).any(|_| {
        let fd = match rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
            None,
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::MFILE) => {
                out_of_fds = true;
                return true;
            }
            Err(e) => panic!("{e}"),
        };
        match rustix::net::connect(&fd, &addr) {
            Ok(()) => {
                queued.push(fd);
                false
            }
            Err(rustix::io::Errno::AGAIN) => true,
            Err(e) => panic!("{e}"),
        }
    });
    if out_of_fds {
        p.units[0].signal(rustix::process::Signal::CONT).unwrap();
        eprintln!("skipped: too few file descriptors to fill the backlog (raise ulimit -n)");
        return;
    }
    let t = std::time::Instant::now();
    let mut cfg = stowage_client::ClientConfig::new("ns", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_millis(500);
    // Connecting is lazy: the first call is the one that connects.
    let c = stowage_client::Client::connect(cfg).unwrap();
    let r = c.get_rows(&[Key::new(0, "a")], c.deadline());
    let took = t.elapsed();
    p.units[0].signal(rustix::process::Signal::CONT).unwrap();
    assert!(full, "the backlog never filled");
    assert!(
        matches!(r, Err(Error::Timeout { unit: Some(0), .. })),
        "{r:?}"
    );
    assert!(took < Duration::from_secs(3), "connect took {took:?}");
}
