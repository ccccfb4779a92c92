//! The owner's scrapes of a unit's metrics endpoint while a flood holds
//! it (issue 40, item 2): starts `stowage unit` (the binary given, else
//! the `stowage` built next to this example), floods its endpoint from 4
//! threads as `tests/common/flood.rs` does (the test runs the same flood
//! as another uid), and prints how many of 10 scrapes (5 s each, 100 ms
//! apart) got the unit's metrics text, and how many connects the flood
//! made meanwhile.
//!
//! `cargo run --example metrics_flood [-- PATH/TO/stowage]`

#[path = "../tests/common/flood.rs"]
mod flood;

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn main() {
    let binary = std::env::args().nth(1).map(Into::into).unwrap_or_else(|| {
        let exe = std::env::current_exe().unwrap();
        exe.parent().unwrap().parent().unwrap().join("stowage")
    });
    let dir = tempfile::tempdir().unwrap();
    let mut unit = Command::new(&binary)
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
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    std::io::BufReader::new(unit.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    let addr: std::net::SocketAddr = ready
        .split_whitespace()
        .find_map(|w| w.strip_prefix("metrics=http://"))
        .and_then(|a| a.strip_suffix("/metrics"))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no metrics endpoint in {ready:?}"));
    let connects = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    let (ok, failed, during) = std::thread::scope(|s| {
        s.spawn(|| {
            // Until the scrapes are done (at most 120 s).
            let until = Instant::now() + Duration::from_secs(120);
            flood::flood(addr, 4, until, &done, &connects, |_| {});
        });
        // The flood in full swing first.
        let start = Instant::now();
        while connects.load(Ordering::Relaxed) < 2000 && start.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let before = connects.load(Ordering::Relaxed);
        let (ok, failed) =
            flood::scrapes(addr, 10, Duration::from_secs(5), Duration::from_millis(100));
        let during = connects.load(Ordering::Relaxed) - before;
        done.store(true, Ordering::Relaxed);
        (ok, failed, during)
    });
    drop(unit.stdin.take());
    let end = Instant::now() + Duration::from_secs(10);
    while unit.try_wait().unwrap().is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = unit.kill();
    let _ = unit.wait();
    println!(
        "{}: owner's scrapes succeeded {ok}/10 under the flood ({during} connects meanwhile)",
        binary.display()
    );
    for f in failed.iter().take(3) {
        println!("  failed: {f}");
    }
}
