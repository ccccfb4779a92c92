//! `stowage status` against real unit processes: live, stopped (SIGSTOP),
//! continued, killed and restarted units; and the units' logs at the
//! default level and as JSON.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{binary, client, plane, Kind};
use rustix::process::Signal;
use stowage_client::Key;

/// Run `stowage status --json` with `args` and parse its one report.
fn status(args: &[&str]) -> serde_json::Value {
    let out = Command::new(binary())
        .arg("status")
        .arg("--json")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("stowage status runs");
    assert!(
        out.status.success(),
        "status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let line = text.lines().next().expect("one report");
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

fn states(report: &serde_json::Value) -> Vec<String> {
    report["units"]
        .as_array()
        .expect("units")
        .iter()
        .map(|u| u["state"].as_str().expect("state").to_owned())
        .collect()
}

#[test]
fn status_reports_live_stopped_continued_killed_and_restarted_units() {
    let (mut p, opts) = plane(3, 16 << 20, &[]);
    let c = client(&p, Kind::Shm, Duration::from_secs(10));
    let values: Vec<(Key, Vec<u8>)> = (0..30u64)
        .map(|r| (Key::new(r, "x"), vec![r as u8; 4096]))
        .collect();
    let refs: Vec<(Key, &[u8])> = values.iter().map(|(k, v)| (k.clone(), &v[..])).collect();
    c.put_rows(&refs, c.deadline()).expect("put");
    let dir = tempfile::tempdir().expect("tempdir");
    let dir_file = dir.path().join("dir.json");
    // Owner-only: it carries the plane's secret.
    p.directory()
        .write_file(&dir_file)
        .expect("directory written");
    let dir_arg = dir_file.to_str().expect("utf-8");

    // All up, with what they hold.
    let r = status(&["--directory", dir_arg, "--interval", "200ms"]);
    assert_eq!(states(&r), ["up", "up", "up"], "{r}");
    assert_eq!(r["total"]["rows"], 30, "{r}");
    // The test units serve nixl exactly in a build with the feature.
    for u in r["units"].as_array().expect("units") {
        assert_eq!(u["serves_nixl"], cfg!(feature = "nixl"), "{r}");
        // The slab's page mode the unit picked (auto: whatever the host allows).
        assert!(
            ["4k", "thp", "hugetlb"].contains(&u["page_mode"].as_str().unwrap_or_default()),
            "{r}"
        );
    }
    assert_eq!(r["total"]["memory_capacity"], 3 * (16u64 << 20), "{r}");
    for u in r["units"].as_array().unwrap() {
        assert_eq!(u["rows"], 10, "{u}");
        assert!(u["memory_used"].as_u64().unwrap() >= 10 * 4096, "{u}");
        // Free memory and its largest range, beside what data uses; no
        // compaction in a unit nothing was cleared from.
        let (used, free, largest) = (
            u["memory_used"].as_u64().unwrap(),
            u["memory_free"].as_u64().unwrap(),
            u["largest_free"].as_u64().unwrap(),
        );
        assert!(
            used + free <= 16 << 20 && free > 0 && largest > 0 && largest <= free,
            "{u}"
        );
        assert_eq!(u["compaction_bytes"], 0, "{u}");
        // status's own stats requests are operations too.
        assert!(u["ops_per_s"].as_f64().unwrap() > 0.0, "{u}");
    }

    // A stopped unit: unreachable within the timeout, the others up. The
    // command returns (a hang would fail the test at its own timeout).
    p.units[1].signal(Signal::STOP).expect("SIGSTOP");
    let r = status(&[
        "--directory",
        dir_arg,
        "--interval",
        "200ms",
        "--timeout",
        "1s",
    ]);
    assert_eq!(states(&r), ["up", "unreachable", "up"], "{r}");
    assert_eq!(r["total"]["unreachable"], 1, "{r}");
    assert!(r["units"][1]["error"].is_string(), "{r}");

    // Continued, it is up again, with the same instance.
    p.units[1].signal(Signal::CONT).expect("SIGCONT");
    let r = status(&["--directory", dir_arg, "--interval", "200ms"]);
    assert_eq!(states(&r), ["up", "up", "up"], "{r}");

    // Killed: unreachable.
    p.kill9(2);
    let r = status(&[
        "--directory",
        dir_arg,
        "--interval",
        "200ms",
        "--timeout",
        "1s",
    ]);
    assert_eq!(states(&r), ["up", "up", "unreachable"], "{r}");

    // Restarted on the same socket: another instance than the directory's.
    p.restart(2, &opts).expect("restart");
    let r = status(&["--directory", dir_arg, "--interval", "200ms"]);
    assert_eq!(states(&r), ["up", "up", "restarted"], "{r}");
    assert_eq!(r["units"][2]["rows"], 0, "{r}");

    // Addresses instead of a directory; the table form has a total line.
    let addrs: Vec<String> = p.uds_addrs().iter().map(|a| a.to_string()).collect();
    let out = Command::new(binary())
        .arg("status")
        .args(&addrs)
        .args(["--interval", "100ms"])
        // By address, the plane's secret file is what proves it.
        .arg("--secret-file")
        .arg(p.private_dir().join("secret"))
        .output()
        .expect("status runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert_eq!(text.lines().count(), 1 + 3 + 1, "{text}");
    assert!(text.lines().last().unwrap().starts_with("total"), "{text}");
    p.stop();
}

/// Start one unit with `env`, run puts and gets against it, stop it, and
/// return what it logged on stderr.
fn unit_log(env: &[(&str, &str)], extra: &[&str]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("u.sock");
    let mut cmd = Command::new(binary());
    cmd.args([
        "unit",
        "--no-mlock",
        "--memory",
        "16MiB",
        "--exit-with-stdin",
    ])
    .arg("--listen")
    .arg(format!("unix:{}", sock.display()))
    .args(extra)
    .env_remove("RUST_LOG")
    .env_remove("STOWAGE_LOG_FORMAT")
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("unit starts");
    let mut stdout = child.stdout.take().unwrap();
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while stdout.read(&mut b).unwrap_or(0) == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    assert!(
        line.starts_with(b"READY"),
        "{}",
        String::from_utf8_lossy(&line)
    );
    {
        let mut cfg = stowage_client::ClientConfig::new(
            "logs",
            vec![stowage_client::UnitAddr::Unix(sock.clone())],
        );
        cfg.timeout = Duration::from_secs(10);
        let c = stowage_client::Client::connect(cfg).expect("connect");
        for i in 0..100u64 {
            let v = vec![i as u8; 1000];
            c.put_rows(&[(Key::new(i, "f"), &v[..])], c.deadline())
                .expect("put");
            assert_eq!(c.get_rows(&[Key::new(i, "f")], c.deadline()).unwrap()[0], v);
        }
        c.clear_rows(&(0..100).collect::<Vec<_>>(), c.deadline())
            .expect("clear");
    }
    // The unit notices the closed connections on its own threads: wait
    // (bounded) until only the watching session is connected, so that the
    // session's close is logged before the unit exits.
    {
        let mut cfg = stowage_client::ClientConfig::new(
            "watch",
            vec![stowage_client::UnitAddr::Unix(sock.clone())],
        );
        cfg.shm = false;
        let w = stowage_client::Client::connect(cfg).expect("connect");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let s = w.stats(w.deadline()).remove(0).expect("stats");
            if s.sessions.iter().filter(|x| x.connections > 0).count() <= 1 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the client's session stayed open"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    drop(child.stdin.take()); // the unit exits when its stdin closes
    let out = child.wait_with_output().expect("unit exits");
    String::from_utf8(out.stderr).expect("utf-8 log")
}

#[test]
fn the_default_log_has_lifecycle_lines_and_none_per_operation() {
    let log = unit_log(&[], &[]);
    assert!(log.contains("unit serving"), "{log}");
    assert!(log.contains("session opened"), "{log}");
    assert!(log.contains("session closed"), "{log}");
    assert!(log.contains("unit stopped"), "{log}");
    // 300 operations, and a handful of lines: none of them per operation.
    let lines = log.lines().count();
    assert!(lines < 20, "{lines} lines for 300 operations:\n{log}");
    assert!(!log.contains("DEBUG") && !log.contains("TRACE"), "{log}");
}

#[test]
fn json_logs_parse_and_carry_the_unit_and_session() {
    for (env, extra) in [
        (vec![("STOWAGE_LOG_FORMAT", "json")], vec![]),
        (vec![], vec!["--log-format", "json"]),
    ] {
        let log = unit_log(&env, &extra);
        let events: Vec<serde_json::Value> = log
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        let opened = events
            .iter()
            .find(|e| e["fields"]["message"] == "session opened")
            .unwrap_or_else(|| panic!("no session opened in {log}"));
        assert_eq!(opened["level"], "INFO", "{opened}");
        assert_eq!(opened["fields"]["unit"], "unit-0", "{opened}");
        assert!(opened["fields"]["session"].is_u64(), "{opened}");
        let closed = events
            .iter()
            .find(|e| e["fields"]["message"] == "session closed")
            .unwrap_or_else(|| panic!("no session closed in {log}"));
        assert_eq!(closed["fields"]["namespace"], "logs", "{closed}");
        assert!(events.len() < 20, "{log}");
    }
}

/// With 2 copies of every row (the directory says so), status says
/// whether they are on distinct hosts, and which units' rows are short of
/// a copy once a unit holding copies is killed.
#[test]
fn status_reports_copies_short_of_hosts_and_of_a_unit() {
    let (mut p, _) = plane(3, 16 << 20, &[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let dir_file = dir.path().join("dir.json");
    let mut d = p.directory();
    d.replicas = 2;
    d.write_file(&dir_file).expect("directory written");
    let dir_arg = dir_file.to_str().expect("utf-8");
    let r = status(&["--directory", dir_arg, "--interval", "100ms"]);
    // One host: every unit's copies share it.
    assert_eq!(r["copies"]["replicas"], 2, "{r}");
    assert_eq!(r["copies"]["short_of_hosts"], 3, "{r}");
    assert_eq!(r["copies"]["short_of_a_copy"], serde_json::json!([]), "{r}");

    // Hosts of their own for units 0 and 2, unit 1 beside unit 0: copies
    // go to the next unit on another host.
    for (u, h) in d.units.iter_mut().zip(["a", "a", "b"]) {
        u.host = Some(h.into());
    }
    d.write_file(&dir_file).expect("directory written");
    let r = status(&["--directory", dir_arg, "--interval", "100ms"]);
    assert_eq!(r["copies"]["short_of_hosts"], 0, "{r}");
    // 9 rows, 3 on each unit, 2 fields each, with 2 copies.
    let mut cfg = stowage_client::ClientConfig::new("default", p.uds_addrs());
    cfg.secret = p.secret().cloned();
    cfg.replicas = 2;
    cfg.hosts = d.units.iter().map(|u| u.host.clone()).collect();
    let c = stowage_client::Client::connect(cfg).expect("client");
    let keys: Vec<stowage_client::RowKey> = (0..9).map(stowage_client::RowKey::Index).collect();
    let col = |v: &'static [u8]| {
        let t = stowage_client::Tensor {
            dtype: stowage_client::DType::U8,
            shape: vec![v.len() as u64, 1],
            data: v,
        };
        stowage_client::Column::Dense(t)
    };
    let data: &'static [u8] = &[7; 9];
    c.put(
        "p",
        &keys,
        &[("a", col(data)), ("b", col(data))],
        None,
        c.deadline(),
    )
    .expect("put");

    // Unit 1 killed. The copies' units: unit 0's rows on {0, 2} (unit 1
    // shares unit 0's host), unit 1's on {1, 2}, unit 2's on {2, 0}: only
    // unit 1's rows are short of a copy.
    p.kill9(1);
    let r = status(&[
        "--directory",
        dir_arg,
        "--interval",
        "100ms",
        "--timeout",
        "1s",
    ]);
    assert_eq!(
        r["copies"]["short_of_a_copy"],
        serde_json::json!([1]),
        "{r}"
    );
    // Its 3 rows (6 values) lack their copy on unit 0, which took it.
    let lacking = &r["copies"]["lacking"];
    assert_eq!(
        (&lacking["rows"], &lacking["values"]),
        (&3.into(), &6.into()),
        "{r}"
    );
    assert_eq!(lacking["namespace"], "default", "{r}");
    // A client that takes unit 1 as gone repairs them: none lack it now.
    c.unit_gone(1);
    let repaired = c.repair(c.deadline()).expect("repair");
    assert_eq!((repaired.values, repaired.left), (6, 0), "{repaired:?}");
    let r = status(&[
        "--directory",
        dir_arg,
        "--interval",
        "100ms",
        "--timeout",
        "1s",
    ]);
    assert_eq!(r["copies"]["lacking"]["rows"], 0, "{r}");

    // The table says it in words.
    let out = Command::new(binary())
        .args(["status", "--directory", dir_arg, "--interval", "100ms"])
        .args(["--timeout", "1s"])
        .output()
        .expect("status runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("copies: 2 of every row")
            && text.contains("the rows of units 1 are short")
            && text.contains("0 rows (0 values) lack that copy"),
        "{text}"
    );
    p.stop();
}
