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

    // The writer killed: its connection closes and the range comes back.
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || stats(&mut watcher)
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

    // The reader killed: its connection closes, the pin goes, and the
    // memory comes back.
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || stats(&mut watcher).pins == 0),
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
    assert!(line.trim_end().ends_with("nixl"), "{table}");
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
