//! The config file read by the command line: `stowage up` starts the
//! units it describes and writes their directory; `stowage unit --config`
//! takes its settings from it, command-line options overriding; control
//! commands find units by directory.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{binary, eventually, spawn_reaped, wait_for_line};
use stowage_client::{Client, ClientConfig, Key, Secret, TransportChoice, UnitDirectory};

const SECRET: &str = "config-test-secret-0123456789";

fn write_secret(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("secret");
    std::fs::write(&path, SECRET).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    path
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, r)| !r.starts_with('Z')))
        .unwrap_or(false)
}

/// A port P with P .. P + n - 1 free on loopback, below the ephemeral
/// range (where no listener on port 0 lands while the test starts units).
fn free_ports_below_ephemeral(n: u16) -> u16 {
    let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let start = low.saturating_sub(12_000).max(1024);
    let seed = std::process::id() as u16;
    (0..2000u16)
        .map(|k| start + (seed.wrapping_add(k.wrapping_mul(7))) % (low - n - start))
        .find(|&p| {
            let held: Vec<_> = (0..n)
                .map_while(|i| std::net::TcpListener::bind(("127.0.0.1", p + i)).ok())
                .collect();
            held.len() == usize::from(n)
        })
        .expect("no free loopback ports below the ephemeral range")
}

/// `GET /metrics` of `addr` (`http://127.0.0.1:P/metrics`): the body.
fn scrape(url: &str) -> String {
    use std::io::{Read, Write};
    let addr = url
        .strip_prefix("http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .unwrap();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

#[test]
fn up_starts_the_configured_units_and_stops_them_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let secret = write_secret(dir.path());
    let disk = dir.path().join("disk");
    std::fs::create_dir(&disk).unwrap();
    let config = dir.path().join("stowage.toml");
    let metrics = free_ports_below_ephemeral(3);
    std::fs::write(
        &config,
        format!(
            "[units]\ncount = 3\nreplicas = 2\nmemory = \"40MiB\"\n[units.disk]\nroot = {:?}\ncapacity = \"64MiB\"\n\
             [auth]\nsecret_file = {:?}\n[timeouts]\nstop = \"10s\"\n\
             [metrics]\nlisten = \"127.0.0.1:{metrics}\"\n",
            disk.display().to_string(),
            secret.display().to_string()
        ),
    )
    .unwrap();
    let directory = dir.path().join("directory.json");
    let (up, lines) = spawn_reaped(
        Command::new(binary())
            .args(["up", "--config"])
            .arg(&config)
            .arg("--directory")
            .arg(&directory)
            .env_remove("STOWAGE_SECRET")
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    assert!(
        wait_for_line(&lines, "READY directory=", Duration::from_secs(60)),
        "stowage up never reported ready"
    );

    let d = UnitDirectory::from_file(&directory).unwrap();
    assert_eq!(d.units.len(), 3);
    // The file's copies of every row, for every client of the plane.
    assert_eq!(d.replicas, 2);
    let pids: Vec<u32> = d.units.iter().map(|u| u.pid.unwrap()).collect();
    assert!(pids.iter().all(|&p| alive(p)));
    // Every unit keeps a disk directory while it runs.
    assert_eq!(std::fs::read_dir(&disk).unwrap().count(), 3);
    // Unit i serves its metrics on the file's port + i.
    for (i, u) in d.units.iter().enumerate() {
        let url = format!("http://127.0.0.1:{}/metrics", metrics + i as u16);
        assert_eq!(
            u.extra.get("metrics").and_then(|m| m.as_str()),
            Some(url.as_str())
        );
        assert!(scrape(&url).contains(&format!("unit=\"unit-{i}\"")));
    }

    let addrs = d
        .addrs(TransportChoice::Auto, &stowage_client::host_id())
        .unwrap();
    assert!(addrs
        .iter()
        .all(|a| matches!(a, stowage_client::UnitAddr::Unix(_))));
    let mut cfg = ClientConfig::new("cfg", addrs);
    cfg.instances = d.instances();
    cfg.replicas = d.replicas;
    cfg.secret = Some(Secret::from_bytes(SECRET.as_bytes().to_vec()).unwrap());
    let c = Client::connect(cfg).unwrap();
    let keys: Vec<Key> = (0..6).map(|r| Key::new(r, "f")).collect();
    let vals: Vec<Vec<u8>> = (0..6).map(|r| common::pattern(r, 3, 4096)).collect();
    let puts: Vec<(Key, &[u8])> = keys
        .iter()
        .cloned()
        .zip(vals.iter().map(|v| v.as_slice()))
        .collect();
    c.put_rows(&puts, c.deadline()).unwrap();
    assert_eq!(c.get_rows(&keys, c.deadline()).unwrap(), vals);
    // The units took the file's memory.
    for s in c.stats(c.deadline()) {
        assert_eq!(s.unwrap().capacity, 40 << 20);
    }
    drop(c);

    // Without the secret the control commands are refused; with it,
    // `stats --directory` finds every unit.
    let out = Command::new(binary())
        .args(["stats", "--directory"])
        .arg(&directory)
        .env_remove("STOWAGE_SECRET")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let out = Command::new(binary())
        .args(["stats", "--directory"])
        .arg(&directory)
        .arg("--secret-file")
        .arg(&secret)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    assert_eq!(printed.matches("unix:").count(), 3);
    // Each unit took two 4 KiB rows of its own and copies of the two of
    // the unit before it, and served its own back once.
    assert_eq!(
        printed
            .matches("1 partitions, 0 bytes pinned, 0 spares (0 bytes); since start: ")
            .count(),
        3,
        "{printed}"
    );
    assert_eq!(
        printed
            .matches(" 16384 bytes in, 8192 bytes out, 0 busy answers")
            .count(),
        3,
        "{printed}"
    );

    // SIGTERM: the units stop with their teardown, nothing is left.
    let mut up = up;
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&up.0),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(20), || matches!(
            up.0.try_wait(),
            Ok(Some(_))
        )),
        "stowage up did not exit after SIGTERM"
    );
    assert!(up.0.try_wait().unwrap().unwrap().success());
    for p in pids {
        assert!(
            eventually(Duration::from_secs(5), || !alive(p)),
            "unit {p} outlived stowage up"
        );
    }
    assert!(!directory.exists(), "the directory file was left behind");
    assert_eq!(
        std::fs::read_dir(&disk).unwrap().count(),
        0,
        "disk directories were left behind"
    );
}

#[test]
fn a_unit_takes_its_settings_from_the_file_and_options_override_them() {
    let dir = tempfile::tempdir().unwrap();
    let socks = dir.path().join("socks");
    std::fs::create_dir(&socks).unwrap();
    let config = dir.path().join("stowage.toml");
    let write_config = |base: u16| {
        std::fs::write(
            &config,
            format!(
                "[units]\nmemory = \"24MiB\"\npin_lease = \"9s\"\n[listen]\ntcp_port = {base}\nunix_dir = {:?}\n[auth]\ninsecure = true\n",
                socks.display().to_string()
            ),
        )
        .unwrap();
    };
    let start = |extra: &[&str]| {
        // No piped stdin: `Reap` kills it at once (it does not exit with stdin).
        let (child, lines) = spawn_reaped(
            Command::new(binary())
                .args(["unit", "--no-mlock", "--config"])
                .arg(&config)
                .args(["--index", "1"])
                .args(extra)
                .env_remove("STOWAGE_SECRET")
                .stdout(Stdio::piped())
                .stderr(Stdio::null()),
        );
        let ready = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("the unit reports ready");
        (child, ready)
    };
    // Unit 1 listens on base + 1. Between a free port found here and the
    // unit's bind, another test's connection can take an ephemeral port,
    // so bases come from below the ephemeral range, and a base that was
    // taken all the same is tried again with the next (10 at most).
    let mut found = None;
    for attempt in 0..10u16 {
        let base = free_port_pair_below_ephemeral(attempt);
        write_config(base);
        let (unit, ready) = start(&[]);
        if ready.contains("Address already in use") {
            continue;
        }
        found = Some((base, unit, ready));
        break;
    }
    let (base, unit, ready) = found.expect("a free port pair in 10 tries");
    let uds = socks.join("unit-1.sock");
    assert!(ready.contains(&format!("uds={}", uds.display())), "{ready}");
    assert!(
        ready.contains(&format!("tcp=127.0.0.1:{}", base + 1)),
        "{ready}"
    );
    let c = Client::connect(ClientConfig::new(
        "cfg",
        vec![stowage_client::UnitAddr::Unix(uds.clone())],
    ))
    .unwrap();
    assert_eq!(
        c.stats(c.deadline())[0].as_ref().unwrap().capacity,
        24 << 20
    );
    drop(c);
    drop(unit);

    // --memory on the command line wins over the file.
    let (unit, _) = start(&["--memory", "16MiB"]);
    let c = Client::connect(ClientConfig::new(
        "cfg",
        vec![stowage_client::UnitAddr::Unix(uds)],
    ))
    .unwrap();
    assert_eq!(
        c.stats(c.deadline())[0].as_ref().unwrap().capacity,
        16 << 20
    );
    drop(c);
    drop(unit);
}

/// A port `p`, with `p + 1` free too, below the kernel's ephemeral range
/// (where the ports of other tests' connections come from); `salt` picks
/// a different one on each try.
fn free_port_pair_below_ephemeral(salt: u16) -> u16 {
    let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let (first, last) = (10_000u16, low.saturating_sub(2).max(10_002));
    let span = u32::from(last - first);
    let seed =
        std::process::id().wrapping_mul(2_654_435_761) ^ u32::from(salt).wrapping_mul(40_503);
    for step in 0..span {
        let port = first + ((seed.wrapping_add(step * 7)) % span) as u16;
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 1) {
            return port;
        }
    }
    panic!("no free port pair between {first} and {last}");
}

#[test]
fn a_config_that_listens_beyond_loopback_without_a_secret_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("stowage.toml");
    std::fs::write(&config, "[listen]\nhost = \"0.0.0.0\"\n").unwrap();
    let out = Command::new(binary())
        .args(["unit", "--no-mlock", "--memory", "8MiB", "--config"])
        .arg(&config)
        .args(["--listen", "tcp:0.0.0.0:0"])
        .env_remove("STOWAGE_SECRET")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--insecure"), "{err}");
    // A typo in the file is an error naming the key.
    std::fs::write(&config, "[units]\nmemroy = \"1GiB\"\n").unwrap();
    let out = Command::new(binary())
        .args(["unit", "--config"])
        .arg(&config)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("memroy"), "{err}");
}

/// `stowage up` for fewer units than the file's copies of every row:
/// refused before any unit starts, naming both numbers.
#[test]
fn up_refuses_fewer_units_than_replicas() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("stowage.toml");
    std::fs::write(&config, "[units]\nreplicas = 3\nmemory = \"8MiB\"\n").unwrap();
    let out = Command::new(binary())
        .args(["up", "--units", "2", "--config"])
        .arg(&config)
        .env("STOWAGE_SECRET", SECRET)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("units.replicas = 3 needs at least 3 units, but the plane has 2"),
        "{text}"
    );
    assert!(!text.contains("READY"), "{text}");
}

#[test]
fn control_commands_say_what_is_wrong_in_plain_words() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nothing.sock");
    let out = Command::new(binary())
        .arg("stats")
        .arg(format!("unix:{}", missing.display()))
        .env_remove("STOWAGE_SECRET")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "cannot reach unit 0 at unix:{}",
            missing.display()
        )),
        "{err}"
    );
    assert!(err.contains("No such file or directory"), "{err}");
    for debug in ["Broken(", "Some(", "BlobId(", "Io("] {
        assert!(!err.contains(debug), "Rust debug formatting in {err}");
    }
}
