//! Helpers shared by the integration tests: local planes of real unit
//! processes, clients over either transport, and a raw wire connection for
//! misbehaving on purpose.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use stowage_client::{Client, ClientConfig};
use stowage_local::{LocalOptions, LocalPlane};
use stowage_wire::{
    decode_header, encode, Envelope, FramePrefix, Limits, Request, Response, PREFIX_LEN,
};

/// Helpers of the free-memory tests (values, client processes).
pub mod memory;
pub mod netns;

/// Slab bytes a unit holds for data: everything in use but the spares
/// same-host clients keep for their next puts (which stay theirs until
/// their connections close). Checks that a clear freed its memory compare
/// this with 0, and that the spares are all that is reserved.
#[allow(dead_code)] // not every test binary checks memory
pub fn data_bytes(s: &stowage_client::Stats) -> u64 {
    assert_eq!(
        s.reserved_bytes, s.spare_bytes,
        "reservations other than spares outlived their puts: {s:?}"
    );
    assert!(
        s.spare_bytes <= (stowage_client::SPARES as u64) * stowage_client::SPARE_MAX * 4,
        "more spares than a few connections hold: {s:?}"
    );
    assert!(
        s.spare_bytes <= s.spare_budget,
        "spares past the spare zone: {s:?}"
    );
    // Allocated for any reason (stored data, reservations, quarantine,
    // spills and moves under way) but spares.
    let held = s.capacity - s.free_bytes - s.spare_bytes;
    assert!(s.used <= held, "stored data past what is allocated: {s:?}");
    held
}

/// Generate one test per transport from `fn name(kind: Kind)`: a `shm`
/// and a `tcp` module, each with a `#[test] fn name()`, and in a build
/// with the `nixl` feature a `nixl` module too.
#[allow(unused_macros)] // not every test binary has per-transport tests
macro_rules! both_transports {
    ($($name:ident),* $(,)?) => {
        mod shm {
            $( #[test] fn $name() { super::$name(super::Kind::Shm) } )*
        }
        mod tcp {
            $( #[test] fn $name() { super::$name(super::Kind::Tcp) } )*
        }
        #[cfg(feature = "nixl")]
        mod nixl {
            $( #[test] fn $name() { super::$name(super::Kind::Nixl) } )*
        }
    };
}

/// [`both_transports`], and a `ring` module: shm with request rings from
/// the first request (for the clients run as child processes).
#[allow(unused_macros)]
macro_rules! all_transports {
    ($($name:ident),* $(,)?) => {
        both_transports!($($name),*);
        mod ring {
            $( #[test] fn $name() { super::$name(super::Kind::Ring) } )*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use all_transports;
#[allow(unused_imports)]
pub(crate) use both_transports;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Shm,
    /// Shm whose helper child processes ask for a request ring before
    /// their first request (`STOWAGE_RING_AFTER=0`); the test's own
    /// clients are plain shm clients.
    Ring,
    Tcp,
    /// One-sided NIXL transfers (UCX over tcp and cma here), the units
    /// reached by their TCP address; tests of it exist only in a build with
    /// the `nixl` feature.
    Nixl,
}

pub fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_stowage"))
}

/// Unit arguments every plane gets: in a build with the `nixl` feature the
/// units serve nixl too, over whatever UCX finds (no RDMA here).
const BASE_ARGS: &[&str] = if cfg!(feature = "nixl") {
    &["--no-mlock", "--nixl", "--nixl-allow-tcp"]
} else {
    &["--no-mlock"]
};

/// A plane of `units` unit processes with `memory` bytes each (not
/// mlocked, to start fast) and extra unit arguments.
pub fn plane(units: usize, memory: u64, extra: &[&str]) -> (LocalPlane, LocalOptions) {
    let mut opts = LocalOptions::new(units, memory);
    opts.command = vec![binary().into(), "unit".into()];
    opts.unit_args = BASE_ARGS
        .iter()
        .copied()
        .chain(extra.iter().copied())
        .map(String::from)
        .collect();
    let p = LocalPlane::start(&opts).expect("local plane starts");
    (p, opts)
}

/// Nixl over whatever UCX finds here (tcp and cma: no RDMA NIC).
pub fn nixl_options() -> stowage_client::NixlOptions {
    stowage_client::NixlOptions {
        require_rdma: false,
        ..Default::default()
    }
}

pub fn client(p: &LocalPlane, kind: Kind, timeout: Duration) -> Client {
    let addrs = match kind {
        Kind::Shm | Kind::Ring => p.uds_addrs(),
        Kind::Tcp => p.tcp_addrs(),
        Kind::Nixl => p.tcp_addrs(),
    };
    let mut cfg = ClientConfig::new("test", addrs);
    cfg.timeout = timeout;
    // The plane's own (generated) secret, as its launcher's clients get it.
    cfg.secret = p.secret().cloned();
    if kind == Kind::Nixl {
        cfg.nixl = Some(nixl_options());
    }
    let c = Client::connect(cfg).expect("client connects");
    if kind == Kind::Nixl {
        // Connecting is lazy: a unit's transport is known once reached.
        c.check_units(c.deadline()).expect("every unit answers");
        for u in 0..c.unit_count() {
            assert_eq!(
                c.transport(u),
                Some("nixl"),
                "unit {u} is not reached over nixl"
            );
        }
    }
    c
}

/// Deterministic bytes for (row, field, len).
pub fn pattern(row: u64, salt: u64, len: usize) -> Vec<u8> {
    let mut x = row.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ salt.wrapping_mul(0xD1B5_4A32_D192_ED03)
        ^ len as u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A raw protocol connection over a unit's Unix socket.
pub struct Raw {
    pub s: UnixStream,
    next: u64,
    /// A frame read while proving the secret that was not the challenge
    /// (a unit turning the connection away): the next `recv` returns it.
    pending: Option<Envelope<Response>>,
}

impl Raw {
    /// A raw connection that proves the plane's secret when the socket
    /// belongs to a local plane with one (its `secret` file sits next to
    /// the socket), as every client of such a plane does.
    pub fn connect(path: &Path) -> Raw {
        let mut r = Raw::connect_unproven(path);
        let secret = path
            .parent()
            .map(|d| d.join("secret"))
            .filter(|f| f.exists())
            .map(|f| stowage_wire::auth::Secret::from_file(&f).expect("the plane's secret"));
        if let Some(secret) = secret {
            let client_nonce = stowage_wire::auth::fresh_nonce().unwrap();
            let _ = r.s.write_all(&{
                let mut buf = Vec::new();
                encode(r.next, &Request::Auth { client_nonce }, 0, &mut buf).unwrap();
                r.next += 1;
                buf
            });
            match r.recv() {
                Some(Envelope {
                    body:
                        Response::Challenge {
                            unit_nonce,
                            unit_proof,
                        },
                    ..
                }) => {
                    assert!(secret.verify_unit_proof(&client_nonce, &unit_nonce, &unit_proof));
                    let client_proof = secret.client_proof(&client_nonce, &unit_nonce);
                    let mut buf = Vec::new();
                    encode(r.next, &Request::Prove { client_proof }, 0, &mut buf).unwrap();
                    r.next += 1;
                    let _ = r.s.write_all(&buf);
                }
                // Turned away (or closed): what the test sees next.
                other => r.pending = other,
            }
        }
        r
    }

    /// A raw connection that proves nothing.
    pub fn connect_unproven(path: &Path) -> Raw {
        let s = UnixStream::connect(path).expect("raw connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Raw {
            s,
            next: 1,
            pending: None,
        }
    }

    pub fn hello(path: &Path, ns: &str) -> Raw {
        let mut r = Raw::connect(path);
        let resp = r.call(&Request::Hello {
            version: stowage_wire::PROTOCOL_VERSION,
            namespace: ns.into(),
            want_fd: false,
            session: None,
        });
        assert!(matches!(resp, Response::Hello { .. }), "{resp:?}");
        r
    }

    pub fn send(&mut self, req: &Request) -> u64 {
        let id = self.next;
        self.next += 1;
        let mut buf = Vec::new();
        encode(id, req, 0, &mut buf).unwrap();
        self.s.write_all(&buf).unwrap();
        id
    }

    /// Read one frame; `None` when the unit closed the connection.
    pub fn recv(&mut self) -> Option<Envelope<Response>> {
        if let Some(e) = self.pending.take() {
            return Some(e);
        }
        let mut p = [0u8; PREFIX_LEN];
        if self.s.read_exact(&mut p).is_err() {
            return None;
        }
        let prefix = FramePrefix::parse(&p, &Limits::default()).expect("unit frames parse");
        let mut h = vec![0u8; prefix.header_len as usize];
        self.s.read_exact(&mut h).ok()?;
        let mut payload = vec![0u8; prefix.payload_len as usize];
        self.s.read_exact(&mut payload).ok()?;
        Some(decode_header(&h).expect("unit headers decode"))
    }

    pub fn call(&mut self, req: &Request) -> Response {
        let id = self.send(req);
        let e = self.recv().expect("a reply");
        assert_eq!(e.id, id);
        e.body
    }

    /// Whether the unit has closed this connection (EOF within 5 s).
    pub fn closed(&mut self) -> bool {
        self.s
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        // The end of the stream, or a reset (the unit closed it with bytes
        // of ours unread: a reset may come first, or after one byte).
        let reset = |r: &std::io::Result<usize>| matches!(r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset);
        let mut b = [0u8; 1];
        let first = self.s.read(&mut b);
        matches!(first, Ok(0)) || reset(&first) || reset(&self.s.read(&mut b))
    }
}

/// A unit's counters, asked over a raw connection.
pub fn stats(r: &mut Raw) -> stowage_wire::Stats {
    match r.call(&Request::Stats) {
        Response::Stats(s) => *s,
        other => panic!("{other:?}"),
    }
}

/// Poll `f` every 20 ms until it returns true or `within` passes.
pub fn eventually(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + within;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether process `pid` is stopped (state T in /proc).
pub fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T')))
        .unwrap_or(false)
}

/// Re-run this test binary as a helper process running only the ignored
/// test `name`, with `env` set; its stdout is piped.
pub fn helper_child(name: &str, env: (&str, &str)) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(env.0, env.1)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("helper process starts")
}

/// [`helper_child`] for a client of plane `p`: the child finds the
/// plane's secret file in `STOWAGE_TEST_SECRET_FILE` ([`child_secret`]).
pub fn helper_child_of(p: &LocalPlane, name: &str, env: (&str, &str)) -> std::process::Child {
    helper_command(p, name, env)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("helper process starts")
}

/// The command that re-runs this test binary as the helper `name` (an
/// ignored test), with `env` and the plane's secret file set.
pub fn helper_command(p: &LocalPlane, name: &str, env: (&str, &str)) -> std::process::Command {
    let secret = p.private_dir().join("secret");
    let mut c = std::process::Command::new(std::env::current_exe().expect("test binary"));
    c.args([
        "--exact",
        name,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(env.0, env.1)
    .env("STOWAGE_TEST_SECRET_FILE", secret);
    c
}

/// In a helper child of [`helper_child_of`]: the plane's secret.
pub fn child_secret() -> Option<stowage_wire::auth::Secret> {
    std::env::var_os("STOWAGE_TEST_SECRET_FILE")
        .map(|f| stowage_wire::auth::Secret::from_file(Path::new(&f)).expect("the plane's secret"))
}

/// The lines a child prints on its (piped) stdout, as they come.
pub fn stdout_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let out = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// A raw protocol connection over TCP (bounded reads and writes).
pub struct RawTcp {
    pub s: std::net::TcpStream,
    pub next: u64,
}

impl RawTcp {
    /// Connect over TCP and say Hello.
    pub fn hello(addr: impl std::net::ToSocketAddrs) -> RawTcp {
        Self::hello_proving(addr, None)
    }

    /// Connect over TCP, prove `secret` (a plane's), and say Hello.
    pub fn hello_proving(
        addr: impl std::net::ToSocketAddrs,
        secret: Option<&stowage_wire::auth::Secret>,
    ) -> RawTcp {
        let addr = addr.to_socket_addrs().unwrap().next().expect("an address");
        let s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut t = RawTcp { s, next: 1 };
        if let Some(secret) = secret {
            let client_nonce = stowage_wire::auth::fresh_nonce().unwrap();
            let Response::Challenge {
                unit_nonce,
                unit_proof,
            } = t.call(&Request::Auth { client_nonce })
            else {
                panic!("no challenge");
            };
            assert!(secret.verify_unit_proof(&client_nonce, &unit_nonce, &unit_proof));
            let client_proof = secret.client_proof(&client_nonce, &unit_nonce);
            let mut buf = Vec::new();
            encode(t.next, &Request::Prove { client_proof }, 0, &mut buf).unwrap();
            t.next += 1;
            t.s.write_all(&buf).unwrap();
        }
        let h = t.call(&Request::Hello {
            version: stowage_wire::PROTOCOL_VERSION,
            namespace: "ns".into(),
            want_fd: false,
            session: None,
        });
        assert!(matches!(h, Response::Hello { .. }), "{h:?}");
        t
    }

    pub fn call(&mut self, req: &Request) -> Response {
        let id = self.next;
        self.next += 1;
        let mut buf = Vec::new();
        encode(id, req, 0, &mut buf).unwrap();
        self.s.write_all(&buf).unwrap();
        self.recv().expect("a reply").body
    }

    pub fn recv(&mut self) -> Option<Envelope<Response>> {
        let mut p = [0u8; PREFIX_LEN];
        self.s.read_exact(&mut p).ok()?;
        let prefix = FramePrefix::parse(&p, &Limits::default()).ok()?;
        let mut h = vec![0u8; prefix.header_len as usize];
        self.s.read_exact(&mut h).ok()?;
        let mut payload = vec![0u8; prefix.payload_len as usize];
        self.s.read_exact(&mut payload).ok()?;
        decode_header(&h).ok()
    }
}

/// A child process stopped by its pid when the test lets go of it (or
/// ends early): a child reading a piped stdin (`--exit-with-stdin`) first
/// sees it closed and gets 10 s to stop by itself; then it is killed and
/// reaped.
pub struct Reap(pub std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        if let Some(stdin) = self.0.stdin.take() {
            drop(stdin);
            let end = Instant::now() + Duration::from_secs(10);
            while matches!(self.0.try_wait(), Ok(None)) && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start `cmd` (its stdout piped) as a [`Reap`], with the lines it prints.
pub fn spawn_reaped(cmd: &mut std::process::Command) -> (Reap, std::sync::mpsc::Receiver<String>) {
    let mut child = cmd.spawn().expect("the child starts");
    let lines = stdout_lines(&mut child);
    (Reap(child), lines)
}

/// A unit child's `READY` line (its first line on stdout, within 30 s) and
/// the TCP address it names; a unit that does not report ready is killed,
/// reaped, and the test fails.
pub fn await_ready(child: &mut std::process::Child) -> (String, std::net::SocketAddr) {
    let lines = stdout_lines(child);
    let Ok(ready) = lines.recv_timeout(Duration::from_secs(30)) else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the unit did not report ready");
    };
    let tcp = ready
        .split_whitespace()
        .find_map(|w| w.strip_prefix("tcp="))
        .and_then(|a| a.parse().ok())
        .expect("a tcp address");
    (ready, tcp)
}

/// Whether a line containing `needle` comes from `lines` within `within`.
pub fn wait_for_line(
    lines: &std::sync::mpsc::Receiver<String>,
    needle: &str,
    within: Duration,
) -> bool {
    let end = Instant::now() + within;
    loop {
        match lines.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok(l) if l.contains(needle) => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
    }
}

/// A field of `/proc/PID/status` in its unit (kB for sizes).
pub fn proc_status(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// Raise this process's open-file limit to its hard limit (a test that
/// holds thousands of connections); returns the limit now.
pub fn raise_nofile() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut l = getrlimit(Resource::Nofile);
    if l.maximum.is_some() {
        l.current = l.maximum;
    }
    let _ = setrlimit(Resource::Nofile, l);
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// The most threads a unit may run: twice the cores, and 16.
pub fn thread_bound() -> u64 {
    2 * std::thread::available_parallelism().map_or(1, |n| n.get() as u64) + 16
}

/// A metric of unit `unit` of plane `p`, summed over its labels, scraped
/// from its metrics endpoint.
pub fn metric(p: &LocalPlane, unit: usize, name: &str) -> u64 {
    metric_with(p, unit, name, "")
}

/// [`metric`] over the lines whose labels contain `label` (e.g.
/// `op="get"`).
pub fn metric_with(p: &LocalPlane, unit: usize, name: &str, label: &str) -> u64 {
    let url = p.units[unit]
        .metrics
        .clone()
        .expect("the unit serves metrics");
    let host = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let mut s = std::net::TcpStream::connect(host).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#') && l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// The first line a child prints (on `lines`, from [`stdout_lines`]) that
/// contains `prefix`, from `prefix` on (libtest may print before it);
/// fails the test, naming what it did print, when none comes `within`.
pub fn expect_line(
    lines: &std::sync::mpsc::Receiver<String>,
    prefix: &str,
    within: Duration,
) -> String {
    let end = Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        let left = end.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(l) if l.contains(prefix) => return l[l.find(prefix).unwrap_or(0)..].to_string(),
            Ok(l) => seen.push(l),
            Err(e) => panic!("the child never printed {prefix:?} ({e}); it printed {seen:?}"),
        }
    }
}

/// A client of unit `u` of `p` alone (one copy): what that unit holds.
pub fn unit_alone(p: &LocalPlane, u: usize) -> Client {
    let mut cfg = ClientConfig::new("test", vec![p.uds_addrs()[u].clone()]);
    cfg.secret = p.secret().cloned();
    Client::connect(cfg).unwrap()
}

/// Check unit by unit (a one-unit client each) that every row of `p`
/// is held by exactly the units its copies are placed on now, with the
/// same fields on each; returns how many rows were checked.
pub fn copies_are_where_they_belong(
    p: &LocalPlane,
    c: &Client,
    dead: &[usize],
    home: &dyn Fn(u64) -> usize,
) -> usize {
    let mut holders: std::collections::BTreeMap<
        u64,
        std::collections::BTreeMap<usize, Vec<String>>,
    > = Default::default();
    for u in (0..p.uds_addrs().len()).filter(|u| !dead.contains(u)) {
        let one = unit_alone(p, u);
        for (key, fields) in one.list("p", one.deadline()).unwrap() {
            let stowage_client::RowKey::Index(row) = key else {
                panic!("unit {u}: a named row {key:?}")
            };
            holders.entry(row).or_default().insert(u, fields);
        }
    }
    for (row, on) in &holders {
        let want: std::collections::BTreeSet<usize> = c.copies_of(home(*row)).into_iter().collect();
        let got: std::collections::BTreeSet<usize> = on.keys().copied().collect();
        assert_eq!(got, want, "row {row}: held by {on:?}");
        let fields: std::collections::BTreeSet<&Vec<String>> = on.values().collect();
        assert_eq!(fields.len(), 1, "row {row}: fields differ by copy: {on:?}");
    }
    holders.len()
}
