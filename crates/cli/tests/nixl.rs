//! The nixl transport's own guarantees, with real processes (a build with
//! the `nixl` feature; UCX over tcp and cma here). The conformance,
//! fencing, rows and disk suites run over nixl too (their `nixl::` tests).
#![cfg(feature = "nixl")]

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::*;
use stowage_client::{Client, ClientConfig, Error, Key, UnitAddr};

const MIB: u64 = 1 << 20;

/// Not a test on its own: a nixl writer whose WRITE fails while it may
/// still be running (the `nixl-write-in-flight` failpoint, which also never
/// lets it count as ended). `STOWAGE_NIXL_CHILD=addr`: puts row 0 (8 MiB
/// of 0x33), prints `RESULT <error>` or `RESULT ok`, then stays alive
/// (at most 60 s) until it is killed.
#[test]
#[ignore = "a helper process of the nixl tests"]
fn in_flight_child() {
    let addr = std::env::var("STOWAGE_NIXL_CHILD").expect("run only by the nixl tests");
    // Read when the client is made; this process runs this one test only.
    std::env::set_var("STOWAGE_FAILPOINTS", "nixl-write-in-flight");
    let mut cfg = ClientConfig::new("nixl", vec![addr.parse::<UnitAddr>().unwrap()]);
    cfg.secret = common::child_secret();
    cfg.timeout = Duration::from_secs(20);
    cfg.nixl = Some(nixl_options());
    let c = Client::connect(cfg).unwrap();
    // Connecting is lazy: the transport is known once the unit is reached.
    c.check_units(c.deadline()).unwrap();
    assert_eq!(c.transport(0), Some("nixl"));
    let v = vec![0x33u8; 8 * MIB as usize];
    match c.put_rows(&[(Key::new(0, "a"), &v)], c.deadline()) {
        Ok(()) => println!("RESULT ok"),
        Err(e) => println!("RESULT {e:?}"),
    }
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

/// The `RESULT` line a helper child prints, within 30 s; a child that
/// prints none is killed and the test fails.
fn result_line(child: &mut std::process::Child, who: &str) -> String {
    let lines = stdout_lines(child);
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        match lines.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok(l) if l.contains("RESULT") => return l,
            Ok(_) => {}
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the {who} never printed its result ({e})");
            }
        }
    }
}

/// A WRITE that failed while it may still be running keeps its range out
/// of use: the put fails with `TransferFailed { in_flight: true }`, the
/// unit still holds the reservation while the writer lives, and a client
/// that fills the slab meanwhile never gets that range (its acknowledged
/// values read back exactly). Once the writer is killed, the range comes
/// back.
#[test]
fn an_in_flight_failure_keeps_its_region_out_of_use() {
    const SLAB_MIB: u64 = 32;
    let (p, _) = plane(1, SLAB_MIB * MIB, &[]);
    let mut watcher = Raw::hello(&p.units[0].uds, "watch");
    let addr = p.tcp_addrs()[0].to_string();
    let mut child = helper_child_of(&p, "in_flight_child", ("STOWAGE_NIXL_CHILD", &addr));
    let result = result_line(&mut child, "writer");
    assert!(
        result.contains("TransferFailed") && result.contains("in_flight: true"),
        "{result}"
    );
    // The writer is alive and its WRITE may still land: its reservation
    // stays, well past any lease.
    std::thread::sleep(Duration::from_millis(500));
    let s = stats(&mut watcher);
    assert_eq!(s.reserved_bytes, 8 * MIB, "{s:?}");
    assert_eq!(s.entries, 0, "the failed put was published: {s:?}");

    // Another nixl client fills the slab: it never gets that range.
    let mut cfg = ClientConfig::new("nixl", p.tcp_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(2);
    cfg.nixl = Some(nixl_options());
    cfg.spare_max = 0;
    let other = Client::connect(cfg).unwrap();
    let mut acked = Vec::new();
    for row in 10..10 + SLAB_MIB {
        let v = pattern(row, 9, MIB as usize);
        match other.put_rows(&[(Key::new(row, "b"), &v)], other.deadline()) {
            Ok(()) => acked.push(row),
            Err(Error::UnitFull { .. } | Error::Timeout { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        !acked.is_empty() && acked.len() as u64 <= SLAB_MIB - 8,
        "{acked:?}"
    );
    assert_eq!(stats(&mut watcher).reserved_bytes, 8 * MIB);
    for &row in &acked {
        let got = other
            .get_rows(&[Key::new(row, "b")], other.deadline())
            .unwrap();
        assert!(got[0] == pattern(row, 9, MIB as usize), "row {row} changed");
    }

    // The writer killed: its connection closes and, once the unit has
    // invalidated its agent and the nixl quarantine (5 s) has passed, the
    // range comes back.
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        eventually(Duration::from_secs(30), || stats(&mut watcher)
            .reserved_bytes
            == 0),
        "the killed writer's reservation was not released: {:?}",
        stats(&mut watcher)
    );
}

/// Not a test on its own: a nixl reader whose READ fails while it may
/// still be running (the `nixl-read-in-flight` failpoint, which also never
/// lets it count as ended). `STOWAGE_NIXL_READER=addr`: gets row 0 into
/// lent memory, prints `RESULT <error>` or `RESULT ok <bytes>`, then stays
/// alive (at most 60 s) until it is killed.
#[test]
#[ignore = "a helper process of the nixl tests"]
fn read_in_flight_child() {
    let addr = std::env::var("STOWAGE_NIXL_READER").expect("run only by the nixl tests");
    // Read when the client is made; this process runs this one test only.
    std::env::set_var("STOWAGE_FAILPOINTS", "nixl-read-in-flight");
    let mut cfg = ClientConfig::new("nixl", vec![addr.parse::<UnitAddr>().unwrap()]);
    cfg.secret = common::child_secret();
    cfg.timeout = Duration::from_secs(20);
    cfg.nixl = Some(nixl_options());
    let c = Client::connect(cfg).unwrap();
    // Connecting is lazy: the transport is known once the unit is reached.
    c.check_units(c.deadline()).unwrap();
    assert_eq!(c.transport(0), Some("nixl"));
    let keys = [(0, Key::new(0, "a"))];
    match c.get_values(stowage_client::DEFAULT_PARTITION, &keys, c.deadline()) {
        Ok(v) => println!("RESULT ok {}", v[0].len()),
        Err(e) => println!("RESULT {e:?}"),
    }
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

/// A READ that failed while it may still be running keeps what it reads
/// out of reuse: the get fails with `TransferFailed { in_flight: true }`
/// (its receive buffer is never lent), the unit keeps the pin while the
/// reader lives, well past the pin lease, even after the row is cleared,
/// and a client filling the slab meanwhile never gets that range. Once the
/// reader is killed, the pin goes and the memory comes back.
#[test]
fn an_in_flight_read_keeps_its_range_pinned() {
    const SLAB_MIB: u64 = 32;
    let (p, _) = plane(1, SLAB_MIB * MIB, &["--pin-lease", "200ms"]);
    let mut watcher = Raw::hello(&p.units[0].uds, "watch");
    let mut cfg = ClientConfig::new("nixl", p.tcp_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(2);
    cfg.nixl = Some(nixl_options());
    cfg.spare_max = 0;
    let other = Client::connect(cfg).unwrap();
    other
        .put_rows(
            &[(Key::new(0, "a"), &vec![0x44u8; 8 * MIB as usize])],
            other.deadline(),
        )
        .unwrap();

    let addr = p.tcp_addrs()[0].to_string();
    let mut child = helper_child_of(&p, "read_in_flight_child", ("STOWAGE_NIXL_READER", &addr));
    let result = result_line(&mut child, "reader");
    assert!(
        result.contains("TransferFailed") && result.contains("in_flight: true"),
        "{result}"
    );
    // Past the pin lease, and with the row cleared: the READ may still
    // read, so the pin and the value's memory stay.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(other.clear_rows(&[0], other.deadline()).unwrap(), 1);
    let s = stats(&mut watcher);
    assert_eq!((s.pins, s.entries), (1, 0), "{s:?}");
    assert!(
        s.used >= 8 * MIB,
        "the pinned value's memory was freed: {s:?}"
    );

    // Another client fills the slab: it never gets that range.
    let mut acked = Vec::new();
    for row in 10..10 + SLAB_MIB {
        let v = pattern(row, 7, MIB as usize);
        match other.put_rows(&[(Key::new(row, "b"), &v)], other.deadline()) {
            Ok(()) => acked.push(row),
            Err(Error::UnitFull { .. } | Error::Timeout { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        !acked.is_empty() && acked.len() as u64 <= SLAB_MIB - 8,
        "{acked:?}"
    );
    assert_eq!(stats(&mut watcher).pins, 1);
    for &row in &acked {
        let got = other
            .get_rows(&[Key::new(row, "b")], other.deadline())
            .unwrap();
        assert!(got[0] == pattern(row, 7, MIB as usize), "row {row} changed");
    }

    // The reader killed: its connection closes and, after the nixl
    // quarantine, the pin goes and the memory comes back.
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        eventually(Duration::from_secs(30), || stats(&mut watcher).pins == 0),
        "the killed reader's pin was not released: {:?}",
        stats(&mut watcher)
    );
    other
        .put_rows(
            &[(Key::new(100, "c"), &vec![0x55u8; 8 * MIB as usize])],
            other.deadline(),
        )
        .unwrap();
}

/// A TCP middlebox between clients and a unit, as the tests play it:
/// `cut` ends every connection it carries with a clean close (a FIN) to
/// the unit, while the clients go on running (their one-sided transfers
/// go to the unit directly, not through it).
struct Middlebox {
    addr: std::net::SocketAddr,
    unit_sides: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl Middlebox {
    fn new(unit: std::net::SocketAddr) -> Middlebox {
        use std::net::{Shutdown, TcpListener, TcpStream};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let unit_sides = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sides = unit_sides.clone();
        std::thread::spawn(move || {
            for client in l.incoming().map_while(Result::ok) {
                let Ok(to_unit) = TcpStream::connect(unit) else {
                    return;
                };
                sides.lock().unwrap().push(to_unit.try_clone().unwrap());
                let pipe = |mut from: TcpStream, mut to: TcpStream| {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(Shutdown::Write);
                    })
                };
                pipe(client.try_clone().unwrap(), to_unit.try_clone().unwrap());
                pipe(to_unit, client);
            }
        });
        Middlebox { addr, unit_sides }
    }

    fn unit_addr(&self) -> UnitAddr {
        UnitAddr::Tcp(self.addr)
    }

    /// Close every connection it carries, cleanly, on the unit's side.
    fn cut(&self) {
        for s in self.unit_sides.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A helper child killed (by its pid) when dropped.
struct Kid(std::process::Child);

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Three nixl clients that hold 8 MiB each while their transfers may
/// still run, their connections then ended: `writer` (a WRITE in flight)
/// reached through a middlebox that closes its connection cleanly while it
/// goes on running; `killed` (a WRITE in flight) and `reader` (a READ in
/// flight, of row 0, cleared since) killed with SIGKILL.
struct Ended {
    writer: Kid,
    other: Client,
    watcher: Raw,
}

const ENDED_SLAB_MIB: u64 = 48;

fn holders_whose_connections_end(p: &stowage_local::LocalPlane) -> Ended {
    let mut watcher = Raw::hello(&p.units[0].uds, "watch");
    let unit = p.units[0].tcp;
    let mbox = Middlebox::new(unit);
    let mut writer = Kid(helper_child_of(
        p,
        "in_flight_child",
        ("STOWAGE_NIXL_CHILD", &mbox.unit_addr().to_string()),
    ));
    let r = result_line(&mut writer.0, "writer");
    assert!(r.contains("in_flight: true"), "{r}");
    let mut killed = Kid(helper_child_of(
        p,
        "in_flight_child",
        ("STOWAGE_NIXL_CHILD", &UnitAddr::Tcp(unit).to_string()),
    ));
    let r = result_line(&mut killed.0, "killed writer");
    assert!(r.contains("in_flight: true"), "{r}");
    let mut cfg = ClientConfig::new("nixl", p.tcp_addrs());
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(2);
    cfg.nixl = Some(nixl_options());
    cfg.spare_max = 0;
    let other = Client::connect(cfg).unwrap();
    other
        .put_rows(
            &[(Key::new(0, "a"), &vec![0x44u8; 8 * MIB as usize])],
            other.deadline(),
        )
        .unwrap();
    let mut reader = Kid(helper_child_of(
        p,
        "read_in_flight_child",
        ("STOWAGE_NIXL_READER", &UnitAddr::Tcp(unit).to_string()),
    ));
    let r = result_line(&mut reader.0, "reader");
    assert!(r.contains("in_flight: true"), "{r}");
    assert_eq!(other.clear_rows(&[0], other.deadline()).unwrap(), 1);
    let s = stats(&mut watcher);
    assert_eq!(
        (s.reserved_bytes, s.pins, s.entries),
        (16 * MIB, 1, 0),
        "{s:?}"
    );

    // The ends: a clean close from the network, and two kills.
    mbox.cut();
    drop(killed);
    drop(reader);
    // The unit has seen all three (or, without the fence, released what
    // they held).
    let seen = eventually(Duration::from_secs(30), || {
        let s = stats(&mut watcher);
        let ended = s
            .sessions
            .iter()
            .filter(|x| x.connections == 0 && x.orphaned > 0)
            .count();
        ended == 3 || s.reserved_bytes < 16 * MIB || s.pins == 0
    });
    assert!(
        seen,
        "the unit never saw the connections end: {:?}",
        stats(&mut watcher)
    );
    Ended {
        writer,
        other,
        watcher,
    }
}

/// What a nixl client holds outlives its connection's end, a clean close
/// included (a middlebox, a FIN or RST from the network: the client may
/// still be running, and its one-sided WRITE or READ with it), until the
/// unit has invalidated its agent and the nixl quarantine has passed: here
/// an hour. A client filling the slab meanwhile never gets those ranges
/// and reads back exactly what it wrote.
#[test]
fn nixl_holds_outlive_a_connection_end() {
    let (p, _) = plane(1, ENDED_SLAB_MIB * MIB, &["--nixl-quarantine", "1h"]);
    let Ended {
        writer,
        other,
        mut watcher,
    } = holders_whose_connections_end(&p);
    let s = stats(&mut watcher);
    assert_eq!(
        (s.reserved_bytes, s.pins),
        (16 * MIB, 1),
        "released at the connection's end: {s:?}"
    );
    assert_eq!(
        s.sessions.iter().map(|x| x.orphaned).sum::<u32>(),
        3,
        "{s:?}"
    );
    assert!(
        s.capacity - s.free_bytes >= 24 * MIB,
        "held, not freed: {s:?}"
    );

    // Another client fills the slab: it never gets those ranges.
    let mut acked = Vec::new();
    for row in 10..10 + ENDED_SLAB_MIB {
        let v = pattern(row, 5, MIB as usize);
        match other.put_rows(&[(Key::new(row, "b"), &v)], other.deadline()) {
            Ok(()) => acked.push(row),
            Err(Error::UnitFull { .. } | Error::Timeout { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        !acked.is_empty() && acked.len() as u64 <= ENDED_SLAB_MIB - 24,
        "{acked:?}"
    );
    for &row in &acked {
        let got = other
            .get_rows(&[Key::new(row, "b")], other.deadline())
            .unwrap();
        assert!(got[0] == pattern(row, 5, MIB as usize), "row {row} changed");
    }
    let s = stats(&mut watcher);
    assert_eq!((s.reserved_bytes, s.pins), (16 * MIB, 1), "{s:?}");
    drop(writer);
}

/// Once the unit has invalidated the agents of those clients (their last
/// connections ended) and the nixl quarantine has passed, what they held
/// comes back, the client behind the middlebox still running: no leak.
/// A client whose connections the middlebox closed reconnects and goes on
/// over nixl (it loads the unit's metadata afresh; the unit its agent's).
#[test]
fn nixl_holds_come_back_after_the_quarantine() {
    let (p, _) = plane(1, ENDED_SLAB_MIB * MIB, &["--nixl-quarantine", "1s"]);
    let Ended {
        writer,
        other,
        mut watcher,
    } = holders_whose_connections_end(&p);
    assert!(
        eventually(Duration::from_secs(60), || {
            let s = stats(&mut watcher);
            (s.reserved_bytes, s.pins) == (0, 0) && s.sessions.iter().all(|x| x.orphaned == 0)
        }),
        "the ended connections' holds never came back: {:?}",
        stats(&mut watcher)
    );
    // The whole slab is there again.
    let mut acked = 0;
    for row in 10..10 + ENDED_SLAB_MIB {
        let v = pattern(row, 6, MIB as usize);
        match other.put_rows(&[(Key::new(row, "b"), &v)], other.deadline()) {
            Ok(()) => acked += 1,
            Err(Error::UnitFull { .. } | Error::Timeout { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(acked >= ENDED_SLAB_MIB - 2, "{acked} MiB went in");
    assert!(
        writer_alive(&writer),
        "the writer behind the middlebox exited"
    );
    drop(writer);
    other
        .clear_rows(
            &(10..10 + ENDED_SLAB_MIB).collect::<Vec<_>>(),
            other.deadline(),
        )
        .unwrap();

    // A client whose every connection the middlebox closed goes on.
    let mbox = Middlebox::new(p.units[0].tcp);
    let mut cfg = ClientConfig::new("nixl", vec![mbox.unit_addr()]);
    cfg.secret = p.secret().cloned();
    cfg.timeout = Duration::from_secs(10);
    cfg.nixl = Some(nixl_options());
    let c = Client::connect(cfg).unwrap();
    for round in 0..3u64 {
        let v = pattern(round, 8, MIB as usize);
        let key = Key::new(100 + round, "c");
        let mut tries = 0;
        loop {
            tries += 1;
            match c.put_rows(&[(key.clone(), &v)], c.deadline()) {
                Ok(()) => break,
                Err(e) if tries < 3 => eprintln!("round {round}: {e}, again"),
                Err(e) => panic!("round {round}: {e}"),
            }
        }
        assert_eq!(c.transport(0), Some("nixl"));
        let got = c.get_rows(&[key], c.deadline()).unwrap();
        assert!(got[0] == v, "round {round}: changed");
        mbox.cut();
        // The unit has seen them all end (and invalidated the agent): only
        // the watcher's and `other`'s sessions have connections.
        assert!(eventually(Duration::from_secs(30), || stats(&mut watcher)
            .sessions
            .iter()
            .filter(|x| x.connections > 0)
            .count()
            <= 2));
    }
}

fn writer_alive(k: &Kid) -> bool {
    std::path::Path::new(&format!("/proc/{}", k.0.id())).exists()
}

/// `stowage status` tells which units serve nixl, in its JSON and its
/// table; the units' stats say so too.
#[test]
fn status_tells_the_units_that_serve_nixl() {
    let (p, _) = plane(1, 16 * MIB, &[]);
    let addr = p.uds_addrs()[0].to_string();
    let run = |json: bool| {
        let mut cmd = std::process::Command::new(binary());
        cmd.args(["status", &addr, "--interval", "100ms"])
            .arg("--secret-file")
            .arg(p.private_dir().join("secret"));
        if json {
            cmd.arg("--json");
        }
        let out = cmd.stdin(std::process::Stdio::null()).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let json = run(true);
    let report: serde_json::Value =
        serde_json::from_str(json.lines().next().expect("one report")).unwrap();
    assert_eq!(report["units"][0]["serves_nixl"], true, "{report}");
    let table = run(false);
    let line = table.lines().nth(1).expect("unit 0's line");
    // The last two columns: what the unit serves, then its slab's pages.
    let cols: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(cols[cols.len() - 2], "nixl", "{table}");
    let mut watcher = Raw::hello(&p.units[0].uds, "watch");
    assert!(stats(&mut watcher).serves_nixl);
}

/// A unit started with --nixl but without --nixl-allow-tcp refuses to run
/// unless UCX_TLS holds UCX to RDMA transports, and says why.
#[test]
fn require_rdma_refuses_ucx_over_tcp() {
    let out = std::process::Command::new(binary())
        .args([
            "unit",
            "--memory",
            "16MiB",
            "--no-mlock",
            "--listen",
            "tcp:127.0.0.1:0",
            "--insecure",
            "--nixl",
        ])
        .env("UCX_TLS", "tcp,cma,self")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("require_rdma") && err.contains("\"tcp\""),
        "{err}"
    );
    // A client asking for RDMA fails at connect for the same reason.
    let (p, _) = plane(1, 16 * MIB, &[]);
    let mut cfg = ClientConfig::new("nixl", p.tcp_addrs());
    cfg.secret = p.secret().cloned();
    cfg.nixl = Some(stowage_client::NixlOptions {
        require_rdma: true,
        ..Default::default()
    });
    std::env::set_var("UCX_TLS", "tcp,cma,self");
    match Client::connect(cfg) {
        Err(Error::InvalidRequest(m)) => assert!(m.contains("require_rdma"), "{m}"),
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("a client that requires RDMA ran nixl over tcp"),
    }
}
