//! The shared secret, end to end: real unit processes, real clients, and
//! raw protocol connections that leave out, get wrong, replay or reflect
//! the handshake on purpose.

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use stowage_client::{
    Client, ClientConfig, Column, DType, Error, Key, RowKey, Secret, Tensor, UnitAddr,
};
use stowage_local::{LocalOptions, LocalPlane};
use stowage_wire::{
    decode_frame, encode, Envelope, ErrorCode, Limits, Request, Response, PREFIX_LEN,
    PROTOCOL_VERSION,
};

const MIB: u64 = 1 << 20;
/// The units' secret. Distinctive, so that finding it anywhere is telling.
const SECRET: &str = "s3cret-Horse-battery-staple-4711";
const WRONG: &str = "not-the-secret-but-long-enough-0";

fn secret(s: &str) -> Secret {
    Secret::from_bytes(s.as_bytes()).unwrap()
}

/// A unit started by hand, its stderr (debug logs) kept in a file.
struct Unit {
    child: Child,
    sock: PathBuf,
    tcp: SocketAddr,
    ready: String,
    dir: tempfile::TempDir,
}

impl Unit {
    /// Start a unit with `secret` in an owner-only `--secret-file` (or
    /// none) and extra arguments.
    fn start(secret: Option<&str>, extra: &[&str]) -> Unit {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("u.sock");
        let mut cmd = Command::new(binary());
        cmd.args([
            "unit",
            "--memory",
            "16MiB",
            "--no-mlock",
            "--exit-with-stdin",
        ])
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .args(["--listen", "tcp:127.0.0.1:0"])
        // A unit without a secret serves TCP only when told to.
        .args(secret.is_none().then_some("--insecure"))
        .args(extra);
        if let Some(s) = secret {
            let path = dir.path().join("secret");
            write_owner_only(&path, &format!("{s}\n"));
            cmd.arg("--secret-file").arg(&path);
        }
        let log = File::create(dir.path().join("stderr.log")).unwrap();
        let mut child = cmd
            .env_remove("STOWAGE_SECRET")
            .env("RUST_LOG", "debug")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        let (ready, tcp) = await_ready(&mut child);
        Unit {
            child,
            sock,
            tcp,
            ready,
            dir,
        }
    }

    fn client(&self, kind: Kind, ns: &str, secret: Option<Secret>) -> Result<Client, Error> {
        let addr = match kind {
            Kind::Shm | Kind::Ring => UnitAddr::Unix(self.sock.clone()),
            Kind::Tcp | Kind::Nixl => UnitAddr::Tcp(self.tcp),
        };
        let mut cfg = ClientConfig::new(ns, vec![addr]);
        if kind == Kind::Nixl {
            cfg.nixl = Some(common::nixl_options());
        }
        cfg.timeout = Duration::from_secs(10);
        cfg.secret = secret;
        Client::connect(cfg)
    }

    /// A client as [`Unit::client`], after its first call (a stats
    /// request): connecting is lazy, so that call is where the unit is
    /// reached, or refused.
    fn first_call(&self, kind: Kind, ns: &str, secret: Option<Secret>) -> Result<Client, Error> {
        let c = self.client(kind, ns, secret)?;
        c.stats(c.deadline()).remove(0)?;
        Ok(c)
    }

    /// Stop the unit (by its pid) and return what it logged.
    fn stop_and_log(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap()
    }
}

impl Drop for Unit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write_owner_only(path: &Path, text: &str) {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

/// A raw protocol connection over any stream.
struct Wire<S> {
    s: S,
    next: u64,
    /// Every byte this side sent, to replay.
    sent: Vec<u8>,
    /// Bytes received and not yet taken as a frame.
    got: Vec<u8>,
}

impl<S: Read + Write> Wire<S> {
    fn new(s: S) -> Self {
        Wire {
            s,
            next: 1,
            sent: Vec::new(),
            got: Vec::new(),
        }
    }

    fn send(&mut self, req: &Request) -> u64 {
        let id = self.next;
        self.next += 1;
        let mut buf = Vec::new();
        encode(id, req, 0, &mut buf).unwrap();
        self.write(&buf);
        id
    }

    fn write(&mut self, bytes: &[u8]) {
        self.sent.extend_from_slice(bytes);
        // The unit may have closed the connection already.
        let _ = self.s.write_all(bytes);
    }

    /// One frame; `None` when the connection ended first.
    fn recv(&mut self) -> Option<Envelope<Response>> {
        let mut chunk = [0u8; 4096];
        loop {
            if let Some((f, used)) =
                decode_frame::<Response>(&self.got, &Limits::default()).unwrap()
            {
                let env = f.envelope;
                self.got.drain(..used);
                return Some(env);
            }
            match self.s.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.got.extend_from_slice(&chunk[..n]),
            }
        }
    }

    fn call(&mut self, req: &Request) -> Response {
        self.send(req);
        self.recv().expect("a reply").body
    }

    /// Whether the unit closed the connection (EOF or reset), reading
    /// whatever else it sent meanwhile.
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 256];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
            }
        }
    }
}

fn unix(path: &Path) -> Wire<UnixStream> {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    Wire::new(s)
}

fn tcp(addr: SocketAddr) -> Wire<TcpStream> {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    Wire::new(s)
}

fn hello(want_fd: bool) -> Request {
    Request::Hello {
        version: PROTOCOL_VERSION,
        namespace: "ns".into(),
        want_fd,
        session: None,
    }
}

/// The Unauthorized error's message, or a panic.
fn unauthorized(r: &Response) -> String {
    match r {
        Response::Error {
            code: ErrorCode::Unauthorized,
            message,
        } => message.clone(),
        other => panic!("expected Unauthorized, got {other:?}"),
    }
}

/// Auth with `client_nonce`: the unit's nonce and proof.
fn challenge<S: Read + Write>(w: &mut Wire<S>, client_nonce: [u8; 32]) -> ([u8; 32], [u8; 32]) {
    match w.call(&Request::Auth { client_nonce }) {
        Response::Challenge {
            unit_nonce,
            unit_proof,
        } => (unit_nonce, unit_proof),
        other => panic!("expected a challenge, got {other:?}"),
    }
}

/// Put one row in namespace `ns`, partition `p`, and read it back.
fn put_row(c: &Client, p: &str, row: u64, len: usize) -> Vec<u8> {
    let v = pattern(row, 7, len);
    let t = Tensor::new(DType::U8, vec![1, len as u64], &v).unwrap();
    c.put(
        p,
        &[RowKey::Index(row)],
        &[("f", Column::Dense(t))],
        None,
        c.deadline(),
    )
    .unwrap();
    v
}

fn get_row(c: &Client, p: &str, row: u64) -> Result<Vec<u8>, Error> {
    c.get_tensors(p, &[RowKey::Index(row)], &["f"], None, c.deadline())
        .map(|mut t| t.remove(0).remove(0).data)
}

fn both_kinds() -> [Kind; 2] {
    [Kind::Shm, Kind::Tcp]
}

#[test]
fn the_right_secret_works_on_shm_and_tcp_and_the_unit_proves_it_too() {
    let u = Unit::start(Some(SECRET), &[]);
    for kind in both_kinds() {
        let c = u.client(kind, "ns", Some(secret(SECRET))).unwrap();
        let v = put_row(&c, "p", 1, 5000);
        assert_eq!(get_row(&c, "p", 1).unwrap(), v, "{kind:?}");
    }
    // Over the raw protocol: the unit's proof checks out under the
    // secret, and after a right proof the Hello hands over the slab.
    let s = secret(SECRET);
    let mut w = unix(&u.sock);
    let c = [5u8; 32];
    let (un, up) = challenge(&mut w, c);
    assert!(s.verify_unit_proof(&c, &un, &up));
    w.send(&Request::Prove {
        client_proof: s.client_proof(&c, &un),
    });
    w.send(&hello(true));
    let mut buf = vec![0u8; 4096];
    let (n, fd) = stowage_shm::recv_with_fd(&w.s, &mut buf).unwrap();
    assert!(n > 0);
    assert!(fd.is_some(), "the slab is handed over after the proof");
}

#[test]
fn no_secret_or_a_wrong_one_is_unauthorized_and_nothing_is_read_released_or_handed_over() {
    let u = Unit::start(Some(SECRET), &[]);
    let good = u.client(Kind::Shm, "ns", Some(secret(SECRET))).unwrap();
    let v = put_row(&good, "p", 3, 3000);
    let v0 = put_row(&good, "", 4, 100);
    let before = good.stats(good.deadline()).remove(0).unwrap();
    let mut messages = Vec::new();
    for kind in both_kinds() {
        for s in [None, Some(secret(WRONG))] {
            match u.first_call(kind, "ns", s) {
                Err(Error::Unauthorized(m)) => {
                    assert!(m.contains("shared secret"), "{m}");
                    messages.push(m);
                }
                Err(e) => panic!("{kind:?}: expected Unauthorized, got {e}"),
                Ok(_) => panic!("{kind:?}: connected without the secret"),
            }
        }
    }
    // A Hello that asks for the slab without a proof: an error frame with
    // no fd attached, then the end of the connection.
    let mut w = unix(&u.sock);
    w.send(&hello(true));
    let mut buf = vec![0u8; 4096];
    let (n, fd) = stowage_shm::recv_with_fd(&w.s, &mut buf).unwrap();
    assert!(
        fd.is_none(),
        "a slab fd went to a client without the secret"
    );
    let (f, _) = decode_frame::<Response>(&buf[..n], &Limits::default())
        .unwrap()
        .expect("the refusal fits one read");
    messages.push(unauthorized(&f.envelope.body));
    assert!(w.closed());
    // Requests that would read or clear, first thing on a connection, over
    // both listeners: refused, the connection closed.
    let clears = [
        Request::ClearRows {
            partition: "p".into(),
            rows: vec![3],
        },
        Request::ClearPartition {
            partition: "p".into(),
        },
        Request::ClearRows {
            partition: String::new(),
            rows: vec![4],
        },
        Request::Read {
            partition: "p".into(),
            keys: vec![Key::new(3, "f")],
            timeout_ms: 1000,
        },
        Request::List {
            partition: "p".into(),
        },
        Request::Stats,
    ];
    for req in &clears {
        let mut w = unix(&u.sock);
        messages.push(unauthorized(&w.call(req)));
        assert!(w.closed());
        let mut t = tcp(u.tcp);
        messages.push(unauthorized(&t.call(req)));
        assert!(t.closed());
    }
    // A wrong proof, then the same requests: refused at the proof.
    let wrong = secret(WRONG);
    for req in &clears {
        let mut w = tcp(u.tcp);
        let c = [1u8; 32];
        let (un, _) = challenge(&mut w, c);
        w.send(&Request::Prove {
            client_proof: wrong.client_proof(&c, &un),
        });
        w.send(&hello(false));
        w.send(req);
        messages.push(unauthorized(&w.recv().expect("a refusal").body));
        assert!(w.closed());
    }
    // Everything is still there, and no session was made for anyone else.
    assert_eq!(get_row(&good, "p", 3).unwrap(), v);
    assert_eq!(get_row(&good, "", 4).unwrap(), v0);
    let st = good.stats(good.deadline()).remove(0).unwrap();
    assert_eq!(
        (st.rows, st.entries, st.used, st.pins, st.reserved_bytes),
        (
            before.rows,
            before.entries,
            before.used,
            before.pins,
            before.reserved_bytes
        ),
        "{st:?}"
    );
    assert_eq!(st.rows, 2);
    assert_eq!(st.sessions.len(), 1, "{st:?}");
    for m in &messages {
        assert!(!m.contains(SECRET) && !m.contains(WRONG), "{m}");
    }
    let log = u.stop_and_log();
    assert!(
        log.contains("refused a connection before its Hello"),
        "{log}"
    );
    assert!(!log.contains(SECRET) && !log.contains(WRONG));
}

#[test]
fn a_recorded_handshake_replayed_or_a_reflected_proof_is_refused() {
    let u = Unit::start(Some(SECRET), &[]);
    let s = secret(SECRET);
    let c = [42u8; 32];
    // A client's handshake, recorded byte for byte.
    let mut first = tcp(u.tcp);
    let (u1, _) = challenge(&mut first, c);
    first.send(&Request::Prove {
        client_proof: s.client_proof(&c, &u1),
    });
    assert!(matches!(first.call(&hello(false)), Response::Hello { .. }));
    let recorded = first.sent.clone();
    // Replayed on a new connection, over either listener: a fresh
    // challenge, and the recorded proof fails it.
    let mut replay = tcp(u.tcp);
    replay.write(&recorded);
    let (u2, _) = match replay.recv().expect("a challenge").body {
        Response::Challenge {
            unit_nonce,
            unit_proof,
        } => (unit_nonce, unit_proof),
        other => panic!("{other:?}"),
    };
    assert_ne!(u1, u2, "the unit's nonce is fresh");
    let m = unauthorized(&replay.recv().expect("a refusal").body);
    assert!(m.contains("shared secret"), "{m}");
    assert!(replay.closed());
    let mut replay = unix(&u.sock);
    replay.write(&recorded);
    assert!(matches!(
        replay.recv().map(|e| e.body),
        Some(Response::Challenge { .. })
    ));
    unauthorized(&replay.recv().expect("a refusal").body);
    assert!(replay.closed());
    // The unit's own proof sent back as the client's.
    let mut reflect = tcp(u.tcp);
    let (_, up) = challenge(&mut reflect, c);
    reflect.send(&Request::Prove { client_proof: up });
    reflect.send(&hello(false));
    unauthorized(&reflect.recv().expect("a refusal").body);
    assert!(reflect.closed());
    // A proof before any challenge.
    let mut early = tcp(u.tcp);
    unauthorized(&early.call(&Request::Prove {
        client_proof: s.client_proof(&c, &u1),
    }));
    assert!(early.closed());
}

#[test]
fn garbage_or_silence_before_the_handshake_is_cut_off_and_others_are_served() {
    let u = Unit::start(Some(SECRET), &["--frame-timeout", "500ms"]);
    let good = u.client(Kind::Tcp, "ns", Some(secret(SECRET))).unwrap();
    let v = put_row(&good, "", 9, 1000);
    // Random bytes.
    let mut w = tcp(u.tcp);
    w.write(&pattern(1, 2, 300));
    unauthorized(&w.recv().expect("a refusal").body);
    assert!(w.closed());
    // A prefix that announces a 1 MiB header: refused before reading it.
    let mut w = unix(&u.sock);
    let mut prefix = [0u8; PREFIX_LEN];
    prefix[..4].copy_from_slice(&(1u32 << 20).to_le_bytes());
    w.write(&prefix);
    unauthorized(&w.recv().expect("a refusal").body);
    assert!(w.closed());
    // A put with its payload, before the handshake: refused, the payload
    // never read.
    let mut w = tcp(u.tcp);
    let mut f = Vec::new();
    let put = Request::Put {
        blob: stowage_wire::BlobId(7),
        partition: String::new(),
        entries: vec![stowage_wire::EntrySpec {
            key: Key::new(9, "f"),
            offset: 0,
            len: 64,
            meta: vec![],
        }],
        timeout_ms: 1000,
    };
    encode(1, &put, 64, &mut f).unwrap();
    f.extend_from_slice(&[0xee; 64]);
    w.write(&f);
    unauthorized(&w.recv().expect("a refusal").body);
    assert!(w.closed());
    // Half a handshake, then nothing: cut at the frame timeout.
    let mut half = tcp(u.tcp);
    half.write(&[9, 0, 0]);
    // Nothing at all: cut too (a connection that proved nothing holds no
    // slot for long).
    let mut silent = unix(&u.sock);
    let t0 = Instant::now();
    assert!(half.closed() && silent.closed());
    assert!(t0.elapsed() < Duration::from_secs(10));
    // Others are served throughout; the data is intact.
    assert_eq!(get_row(&good, "", 9).unwrap(), v);
    let again = u.client(Kind::Shm, "ns", Some(secret(SECRET))).unwrap();
    assert_eq!(get_row(&again, "", 9).unwrap(), v);
}

#[test]
fn a_client_with_a_secret_refuses_a_unit_without_one_or_with_another() {
    // A unit without a secret: it says so, and the client refuses it.
    let open = Unit::start(None, &[]);
    for kind in both_kinds() {
        match open.first_call(kind, "ns", Some(secret(SECRET))) {
            Err(Error::Unauthorized(m)) => assert!(m.contains("without a secret"), "{m}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a client with a secret talked to a unit without one"),
        }
        // Clients without a secret are served as ever.
        let c = open.client(kind, "ns", None).unwrap();
        let v = put_row(&c, "p", 2, 10);
        assert_eq!(get_row(&c, "p", 2).unwrap(), v);
    }
    // A unit with another secret: its proof does not check out, and the
    // client sends no proof of its own.
    let other = Unit::start(Some(WRONG), &[]);
    match other.first_call(Kind::Tcp, "ns", Some(secret(SECRET))) {
        Err(Error::Unauthorized(m)) => {
            assert!(m.contains("did not prove the shared secret"), "{m}");
            assert!(!m.contains(SECRET) && !m.contains(WRONG), "{m}");
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("connected to a unit with another secret"),
    }
    let log = other.stop_and_log();
    assert!(!log.contains(SECRET) && !log.contains(WRONG));
}

/// Run the `stowage` command with `args` and `env` (STOWAGE_SECRET unset
/// unless given), bounded.
fn stowage(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(binary());
    cmd.args(args)
        .env_remove("STOWAGE_SECRET")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let end = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > end {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn control_commands_take_the_secret_from_a_file_or_the_environment_and_never_print_it() {
    let u = Unit::start(Some(SECRET), &["--admin"]);
    let sock = format!("unix:{}", u.sock.display());
    let tcp_addr = format!("tcp:{}", u.tcp);
    assert!(!u.ready.contains(SECRET));
    // stats, from the environment and from a file.
    let o = stowage(&["stats", &sock, &tcp_addr], &[("STOWAGE_SECRET", SECRET)]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("bytes used"), "{}", text(&o));
    assert!(!text(&o).contains(SECRET));
    let file = u.dir.path().join("client-secret");
    write_owner_only(&file, SECRET);
    let f = file.display().to_string();
    let o = stowage(&["stats", &tcp_addr, "--secret-file", &f], &[]);
    assert!(o.status.success(), "{}", text(&o));
    // The flag wins over the environment.
    let o = stowage(
        &["stats", &tcp_addr, "--secret-file", &f],
        &[("STOWAGE_SECRET", WRONG)],
    );
    assert!(o.status.success(), "{}", text(&o));
    // Without it, or with another: refused, and neither secret printed.
    for env in [&[][..], &[("STOWAGE_SECRET", WRONG)][..]] {
        let o = stowage(&["stats", &sock], env);
        assert!(!o.status.success());
        let t = text(&o);
        assert!(
            t.contains("unauthorized") && t.contains("shared secret"),
            "{t}"
        );
        assert!(!t.contains(SECRET) && !t.contains(WRONG), "{t}");
    }
    // A secret file other users may read is refused, naming the fix.
    let loose = u.dir.path().join("loose");
    std::fs::write(&loose, SECRET).unwrap();
    std::fs::set_permissions(&loose, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let o = stowage(
        &[
            "stats",
            &sock,
            "--secret-file",
            &loose.display().to_string(),
        ],
        &[],
    );
    assert!(!o.status.success());
    assert!(text(&o).contains("chmod 600"), "{}", text(&o));
    assert!(!text(&o).contains(SECRET));
    // shutdown over tcp (the unit has --admin), proving the secret.
    let o = stowage(
        &["shutdown", &tcp_addr, "--timeout", "5s"],
        &[("STOWAGE_SECRET", SECRET)],
    );
    assert!(text(&o).contains("unit 0: stopped"), "{}", text(&o));
    let log = u.stop_and_log();
    assert!(!log.contains(SECRET) && !log.contains(WRONG));
}

#[test]
fn a_unit_beyond_loopback_without_a_secret_needs_insecure() {
    let o = stowage(
        &[
            "unit",
            "--memory",
            "4MiB",
            "--no-mlock",
            "--listen",
            "tcp:0.0.0.0:0",
        ],
        &[],
    );
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("--insecure"), "{}", text(&o));
    // With a secret, or with --insecure, it starts.
    for (extra, env) in [
        (&[][..], &[("STOWAGE_SECRET", SECRET)][..]),
        (&["--insecure"][..], &[][..]),
    ] {
        let mut cmd = Command::new(binary());
        cmd.args([
            "unit",
            "--memory",
            "4MiB",
            "--no-mlock",
            "--exit-with-stdin",
        ])
        .args(["--listen", "tcp:0.0.0.0:0"])
        .args(extra)
        .env_remove("STOWAGE_SECRET")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let lines = stdout_lines(&mut child);
        let ready = lines.recv_timeout(Duration::from_secs(30));
        let _ = child.kill();
        let _ = child.wait();
        let ready = ready.expect("the unit started");
        assert!(
            ready.starts_with("READY ") && ready.contains("tcp=0.0.0.0:"),
            "{ready}"
        );
    }
}

#[test]
fn a_local_plane_hands_its_units_the_secret_off_the_command_line() {
    let mut opts = LocalOptions::new(2, 8 * MIB);
    opts.command = vec![binary().into(), "unit".into()];
    opts.unit_args = vec!["--no-mlock".into()];
    opts.secret = Some(secret(SECRET));
    let p = LocalPlane::start(&opts).unwrap();
    for u in &p.units {
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", u.pid())).unwrap();
        let environ = std::fs::read(format!("/proc/{}/environ", u.pid())).unwrap();
        let has = |hay: &[u8]| hay.windows(SECRET.len()).any(|w| w == SECRET.as_bytes());
        assert!(!has(&cmdline) && !has(&environ));
        assert!(String::from_utf8_lossy(&cmdline).contains("--secret-file"));
    }
    for addrs in [p.uds_addrs(), p.tcp_addrs()] {
        let mut cfg = ClientConfig::new("ns", addrs.clone());
        cfg.timeout = Duration::from_secs(10);
        // Connecting is lazy: the first call on the units is refused.
        let refused = Client::connect(cfg.clone()).unwrap();
        assert!(matches!(
            refused.get_rows(&[Key::new(0, "a"), Key::new(1, "a")], refused.deadline()),
            Err(Error::Unauthorized(_))
        ));
        cfg.secret = Some(secret(SECRET));
        let c = Client::connect(cfg).unwrap();
        let v = pattern(1, 1, 777);
        c.put_rows(
            &[(Key::new(0, "a"), &v), (Key::new(1, "a"), &v)],
            c.deadline(),
        )
        .unwrap();
        assert_eq!(c.get_rows(&[Key::new(1, "a")], c.deadline()).unwrap()[0], v);
    }
    // `stowage local` with the secret in the environment runs its workload.
    let o = stowage(
        &[
            "local",
            "--units",
            "1",
            "--memory",
            "16MiB",
            "--steps",
            "1",
            "--rows",
            "8",
            "--min-tokens",
            "8",
            "--max-tokens",
            "32",
        ],
        &[("STOWAGE_SECRET", SECRET)],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains(SECRET));
}

#[test]
fn a_probe_proves_the_secret_so_a_restart_is_told_apart() {
    let mut opts = LocalOptions::new(1, 8 * MIB);
    opts.command = vec![binary().into(), "unit".into()];
    opts.unit_args = vec!["--no-mlock".into()];
    opts.secret = Some(secret(SECRET));
    let mut p = LocalPlane::start(&opts).unwrap();
    let mut cfg = ClientConfig::new("ns", p.uds_addrs());
    cfg.timeout = Duration::from_secs(10);
    cfg.secret = Some(secret(SECRET));
    let c = Client::connect(cfg).unwrap();
    let v = pattern(2, 2, 100);
    c.put_rows(&[(Key::new(0, "a"), &v)], c.deadline()).unwrap();
    p.restart(0, &opts).unwrap();
    // The directory's probe reaches the new instance only with the secret:
    // lost, not a timeout.
    assert!(matches!(
        c.get_rows(&[Key::new(0, "a")], c.deadline()),
        Err(Error::LostKeys { .. })
    ));
}

#[test]
fn a_client_of_another_namespace_never_sees_or_releases_a_row() {
    let u = Unit::start(Some(SECRET), &[]);
    for kind in both_kinds() {
        let a = u.client(kind, "run-a", Some(secret(SECRET))).unwrap();
        let b = u.client(kind, "run-b", Some(secret(SECRET))).unwrap();
        let va = put_row(&a, "p", 1, 2048);
        let va0 = put_row(&a, "", 2, 64);
        // B sees nothing of A's.
        assert!(matches!(get_row(&b, "p", 1), Err(Error::NotFound { .. })));
        assert!(matches!(get_row(&b, "", 2), Err(Error::NotFound { .. })));
        assert!(b.list("p", b.deadline()).unwrap().is_empty());
        assert!(b.list("", b.deadline()).unwrap().is_empty());
        assert!(b.partitions(b.deadline()).unwrap().is_empty());
        assert!(matches!(
            b.get_rows(&[Key::new(2, "f")], b.deadline()),
            Err(Error::NotFound { .. })
        ));
        // B releases nothing of A's.
        assert_eq!(
            b.clear("p", &[RowKey::Index(1)], None, b.deadline())
                .unwrap(),
            0
        );
        assert_eq!(b.clear_partition("p", b.deadline()).unwrap(), 0);
        assert_eq!(b.clear_partition("", b.deadline()).unwrap(), 0);
        assert_eq!(b.clear_rows(&[1, 2], b.deadline()).unwrap(), 0);
        // B's own row of the same key is its own.
        let vb = put_row(&b, "p", 1, 10);
        assert_eq!(get_row(&b, "p", 1).unwrap(), vb);
        assert_eq!(
            b.clear("p", &[RowKey::Index(1)], None, b.deadline())
                .unwrap(),
            1
        );
        // A's rows are intact.
        assert_eq!(get_row(&a, "p", 1).unwrap(), va, "{kind:?}");
        assert_eq!(get_row(&a, "", 2).unwrap(), va0, "{kind:?}");
        assert_eq!(a.list("p", a.deadline()).unwrap().len(), 1);
        assert_eq!(a.clear_partition("p", a.deadline()).unwrap(), 1);
        assert_eq!(a.clear_partition("", a.deadline()).unwrap(), 1);
    }
}
