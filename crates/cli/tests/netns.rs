//! Several hosts on one machine: network namespaces made by the test, a
//! unit in each of two, a client in a third, joined by veth pairs with
//! addresses private to the namespaces. Data goes over tcp with the shared
//! secret; a link brought down turns only its unit's operations into
//! Timeout or LostKeys, within the deadline, while a client keeping 2
//! copies of its rows (one per host) reads all of them from the host
//! left; a client with the wrong secret is refused. The namespaces are removed at the end, also when the test
//! fails (a guard's Drop). Skipped, saying why, where namespaces cannot be
//! made (not root, no `ip`).

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::netns::{
    hosts_or_skip, ip, netns_listed, start_unit, write_secret, SECRET, UNIT_A, UNIT_B,
};
use common::stdout_lines;
use stowage_client::{Client, ClientConfig, Error, Key, Secret};

#[test]
fn units_on_two_hosts_a_client_on_a_third() {
    let tag = format!("stw{}", std::process::id() % 1_000_000);
    let Some(mut hosts) = hosts_or_skip(&tag) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let secret_file = write_secret(dir.path());
    hosts
        .procs
        .push(start_unit(&format!("{tag}a"), UNIT_A, &secret_file));
    hosts
        .procs
        .push(start_unit(&format!("{tag}b"), UNIT_B, &secret_file));

    // The clients run in host c: this test binary again, as a helper.
    let mut client = Command::new("ip")
        .args(["netns", "exec", &format!("{tag}c")])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "netns_client",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("STOWAGE_NETNS_CLIENT", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the client starts");
    let lines = stdout_lines(&mut client);
    let mut stdin = client.stdin.take().unwrap();
    hosts.procs.push(client);
    let expect = |what: &str, within: Duration| {
        let end = Instant::now() + within;
        let mut seen = Vec::new();
        loop {
            match lines.recv_timeout(end.saturating_duration_since(Instant::now())) {
                Ok(l) if l.contains(what) => return l,
                Ok(l) => seen.push(l),
                Err(_) => panic!("the client never printed {what:?}; it printed {seen:?}"),
            }
        }
    };
    expect("WRONG-SECRET-REFUSED", Duration::from_secs(30));
    expect("BOTH-SERVE", Duration::from_secs(30));

    // Cut host a off: its end of the link goes down.
    ip(&[
        "-n",
        &format!("{tag}a"),
        "link",
        "set",
        &format!("{tag}ac"),
        "down",
    ])
    .unwrap();
    writeln!(stdin, "LINK-DOWN").unwrap();
    let line = expect("UNIT-A", Duration::from_secs(30));
    assert!(line.contains("UNIT-A FAILED-IN-TIME"), "{line}");
    let line = expect("UNIT-B", Duration::from_secs(30));
    assert!(line.contains("UNIT-B SERVES"), "{line}");
    let line = expect("COPIES", Duration::from_secs(30));
    assert!(line.contains("COPIES SERVE"), "{line}");

    let names = hosts.names.clone();
    drop(hosts);
    for n in names {
        assert!(!netns_listed(&n), "namespace {n} left behind");
    }
}

fn config(secret: &str, units: &[&str], timeout: Duration) -> ClientConfig {
    let mut cfg = ClientConfig::new(
        "netns",
        units
            .iter()
            .map(|a| format!("tcp:{a}").parse().unwrap())
            .collect(),
    );
    cfg.timeout = timeout;
    cfg.secret = Some(Secret::from_bytes(secret.as_bytes().to_vec()).unwrap());
    cfg
}

/// The client side, run in host c by the test above.
#[test]
#[ignore = "run by units_on_two_hosts_a_client_on_a_third in its own network namespace"]
fn netns_client() {
    if std::env::var_os("STOWAGE_NETNS_CLIENT").is_none() {
        return;
    }
    // A wrong secret is refused, and nothing is served to it (connecting
    // is lazy: its first call is refused).
    let wrong = Client::connect(config(
        "not-the-secret-at-all-0123",
        &[UNIT_A, UNIT_B],
        Duration::from_secs(5),
    ))
    .and_then(|c| c.get_rows(&[Key::new(0, "v")], c.deadline()));
    match wrong {
        Err(Error::Unauthorized(_)) => println!("WRONG-SECRET-REFUSED"),
        Err(e) => println!("WRONG-SECRET-UNEXPECTED {e}"),
        Ok(_) => println!("WRONG-SECRET-ACCEPTED"),
    }

    let deadline = Duration::from_secs(3);
    let c = Client::connect(config(SECRET, &[UNIT_A, UNIT_B], deadline)).expect("connects");
    let keys: Vec<Key> = (0..8).map(|r| Key::new(r, "f")).collect();
    let values: Vec<Vec<u8>> = (0..8).map(|r| common::pattern(r, 9, 100_000)).collect();
    let puts: Vec<(Key, &[u8])> = keys
        .iter()
        .cloned()
        .zip(values.iter().map(|v| v.as_slice()))
        .collect();
    c.put_rows(&puts, c.deadline()).expect("put over tcp");
    let got = c.get_rows(&keys, c.deadline()).expect("get over tcp");
    assert_eq!(got, values);
    // A client keeping 2 copies, each on its own host, of other rows.
    let mut cfg = config(SECRET, &[UNIT_A, UNIT_B], deadline);
    cfg.replicas = 2;
    cfg.hosts = vec![Some("a".into()), Some("b".into())];
    let copies = Client::connect(cfg).expect("connects");
    assert_eq!(copies.copies_short_of_hosts(), 0);
    let copy_keys: Vec<Key> = (100..108).map(|r| Key::new(r, "f")).collect();
    let copy_puts: Vec<(Key, &[u8])> = copy_keys
        .iter()
        .cloned()
        .zip(values.iter().map(|v| v.as_slice()))
        .collect();
    copies
        .put_rows(&copy_puts, copies.deadline())
        .expect("put of 2 copies over tcp");
    println!("BOTH-SERVE");

    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    // Unit a (even rows) is cut off: its operations fail within the
    // deadline, as Timeout or LostKeys; unit b (odd rows) keeps serving.
    let start = Instant::now();
    let r = c.get_rows(&keys[0..1], Instant::now() + deadline);
    let took = start.elapsed();
    match r {
        Err(Error::Timeout { .. }) | Err(Error::LostKeys { .. })
            if took <= deadline + Duration::from_secs(2) =>
        {
            println!("UNIT-A FAILED-IN-TIME {took:?}")
        }
        other => println!("UNIT-A UNEXPECTED {other:?} after {took:?}"),
    }
    let r = c.get_rows(
        &[keys[1].clone(), keys[3].clone()],
        Instant::now() + deadline,
    );
    match r {
        Ok(v) if v == vec![values[1].clone(), values[3].clone()] => {
            println!("UNIT-B SERVES")
        }
        other => println!("UNIT-B UNEXPECTED {other:?}"),
    }
    // Every row of the 2-copy client is read from host b, within the
    // deadline: copy 0 of the even rows is on the host cut off.
    let start = Instant::now();
    match copies.get_rows(&copy_keys, Instant::now() + deadline) {
        Ok(v) if v == values && start.elapsed() <= deadline + Duration::from_secs(2) => {
            println!("COPIES SERVE")
        }
        other => println!("COPIES UNEXPECTED {other:?} after {:?}", start.elapsed()),
    }
}
