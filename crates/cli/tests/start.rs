//! A unit serves before its slab is faulted in; faulting it in (and
//! mlocking it) in the background never changes what clients wrote.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{binary, pattern};
use stowage_client::{Client, ClientConfig, Key, UnitAddr};

const MIB: u64 = 1 << 20;

/// Resident shared memory of `pid` (the faulted-in part of its slab).
fn rss_shmem(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("RssShmem:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[test]
fn data_put_while_the_slab_faults_in_stays_intact() {
    for mlock in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("u.sock");
        let memory = 512 * MIB;
        let mut cmd = Command::new(binary());
        cmd.args([
            "unit",
            "--memory",
            "512MiB",
            "--exit-with-stdin",
            "--listen",
        ])
        .arg(format!("unix:{}", sock.display()))
        .env("RUST_LOG", "info")
        .env_remove("STOWAGE_LOG_FORMAT")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        if !mlock {
            cmd.arg("--no-mlock");
        }
        let mut child = cmd.spawn().unwrap();
        let pid = child.id();
        // Log lines, read on a thread so that every wait below is bounded.
        let (tx, rx) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut ready = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut ready)
            .unwrap();
        assert!(ready.starts_with("READY"), "{ready}");

        // Put right away, over a quarter of the slab, while the unit
        // may still be faulting (and locking) its pages.
        let mut cfg = ClientConfig::new("start", vec![UnitAddr::Unix(sock.clone())]);
        cfg.timeout = Duration::from_secs(30);
        let c = Client::connect(cfg).unwrap();
        let rows: Vec<u64> = (0..16).collect();
        for &r in &rows {
            let v = pattern(r, 7, 8 << 20);
            c.put_rows(&[(Key::new(r, "v"), &v[..])], c.deadline())
                .unwrap();
        }

        // The unit says when its slab is in; by then all of it is resident.
        let deadline = Instant::now() + Duration::from_secs(120);
        let faulted = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l.contains("slab faulted in") => break l,
                Ok(_) => {}
                Err(e) => panic!("no `slab faulted in` line: {e}"),
            }
        };
        if mlock && rustix::process::geteuid().is_root() {
            // Root may lock (elsewhere the unit warns that it could not).
            assert!(faulted.contains("locked=true"), "{faulted}");
        } else if !mlock {
            assert!(faulted.contains("locked=false"), "{faulted}");
        }
        let resident = rss_shmem(pid);
        assert!(
            resident >= memory * 9 / 10,
            "{resident} bytes of a {memory}-byte slab resident after `{faulted}`"
        );
        // Nothing the client wrote was touched.
        for &r in &rows {
            let got = c.get_rows(&[Key::new(r, "v")], c.deadline()).unwrap();
            assert!(got[0] == pattern(r, 7, 8 << 20), "row {r} changed");
        }
        drop(c);
        drop(child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(30);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("unit {pid} did not exit when its stdin closed");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
