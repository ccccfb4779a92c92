//! A shm client against a real unit that serves no request rings (today's
//! unit answers OpenRing with an error): the client asks once per
//! connection, falls back to the socket, and every put and get works.

use std::time::{Duration, Instant};

use stowage_client::{Client, ClientConfig, UnitAddr};
use stowage_config::UnitConfig;
use stowage_wire::Key;

/// The unit's count of `InvalidRequest` answers, from its metrics.
fn invalid_requests(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains("invalid_request"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

#[test]
fn a_unit_without_rings_serves_a_ring_client_over_its_socket() {
    let dir = std::env::temp_dir().join(format!("stowage-ring-e2e-{}", std::process::id()));
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
        drop(client);
    });
    let metrics = unit.metrics_text().unwrap_or_default();
    unit.stop();
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
    // One refusal per connection that asked, not one per request.
    let refused = invalid_requests(&metrics);
    assert!((1..=4).contains(&refused), "{refused} refusals:\n{metrics}");
}
