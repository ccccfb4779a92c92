//! A shm client against a real unit: after 16 round trips a connection
//! asks for a request ring, and from then on its requests and replies go
//! through shared memory; every put and get returns exactly its bytes.
//! With `STOWAGE_RINGS=0` (the child run) the client never asks.

use std::time::{Duration, Instant};

use stowage_client::{Client, ClientConfig, UnitAddr};
use stowage_config::UnitConfig;
use stowage_wire::Key;

/// A counter of the unit's metrics text.
fn counter(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#') && l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// Put and get 60 rows through one client of a fresh in-process unit;
/// the unit's metrics text after.
fn run_against_a_unit(tag: &str) -> String {
    let dir = std::env::temp_dir().join(format!("stowage-ring-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("unit.sock");
    let mut cfg = UnitConfig::new("ring-e2e", 16 << 20);
    cfg.uds = Some(sock.clone());
    cfg.mlock = false;
    cfg.metrics_listen = None;
    let unit = stowage_unit::start(cfg).unwrap();
    let result = std::panic::catch_unwind(|| {
        let client =
            Client::connect(ClientConfig::new("ns", vec![UnitAddr::Unix(sock.clone())])).unwrap();
        // Well past the 16 round trips after which a connection asks.
        for i in 0..60u64 {
            let deadline = Instant::now() + Duration::from_secs(10);
            let value: Vec<u8> = (0..4096u64).map(|j| (i * 7 + j) as u8).collect();
            let key = Key::new(i, "f");
            client
                .put_rows(&[(key.clone(), value.as_slice())], deadline)
                .unwrap();
            let got = client.get_rows(&[key], deadline).unwrap();
            assert_eq!(got, vec![value], "row {i}");
        }
        assert_eq!(
            client
                .clear_rows(&(0..60).collect::<Vec<_>>(), client.deadline())
                .unwrap(),
            60
        );
        drop(client);
    });
    let metrics = unit.metrics_text().unwrap_or_default();
    unit.stop();
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
    metrics
}

#[test]
fn a_shm_connection_moves_its_requests_to_a_ring() {
    let metrics = run_against_a_unit("on");
    let rings = counter(&metrics, "stowage_rings_opened_total");
    let served = counter(&metrics, "stowage_ring_requests_total");
    assert!((1..=4).contains(&rings), "{rings} rings:\n{metrics}");
    // 120 round trips, the first 16 of a connection on its socket.
    assert!(served >= 60, "{served} requests through rings:\n{metrics}");
    assert_eq!(counter(&metrics, "stowage_errors_total"), 0, "{metrics}");
}

/// Run by the test below with STOWAGE_RINGS=0.
#[test]
#[ignore]
fn child_without_rings() {
    let metrics = run_against_a_unit("off");
    assert_eq!(
        counter(&metrics, "stowage_rings_opened_total"),
        0,
        "{metrics}"
    );
    assert_eq!(
        counter(&metrics, "stowage_ring_requests_total"),
        0,
        "{metrics}"
    );
}

#[test]
fn with_stowage_rings_0_a_client_never_asks_for_one() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_without_rings", "--nocapture"])
        .env("STOWAGE_RINGS", "0")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
}
