//! Several hosts on one machine, for the tests that need them: network
//! namespaces made by the test, joined by veth pairs with addresses
//! private to the namespaces, and removed when the test lets go of them
//! (also when it fails).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{binary, stdout_lines, wait_for_line};

/// Network namespaces and the processes in them; Drop kills the processes
/// (by pid) and then removes the namespaces.
pub struct Hosts {
    pub names: Vec<String>,
    pub procs: Vec<Child>,
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = p.kill();
            let _ = p.wait();
        }
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

pub fn netns_listed(name: &str) -> bool {
    Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(name))
        .unwrap_or(false)
}

pub const SECRET: &str = "netns-test-secret-0123456789abcdef";
pub const UNIT_A: &str = "10.77.1.2:7100";
pub const UNIT_B: &str = "10.77.2.2:7100";

/// Three "hosts": `a` and `b` each run a unit, `c` the clients; `c` has a
/// link to each of the others (`<tag>ca`–`<tag>ac`, `<tag>cb`–`<tag>bc`).
pub fn make_hosts(tag: &str, hosts: &mut Hosts) -> Result<(), String> {
    for h in ["a", "b", "c"] {
        let name = format!("{tag}{h}");
        ip(&["netns", "add", &name])?;
        hosts.names.push(name.clone());
        ip(&["-n", &name, "link", "set", "lo", "up"])?;
    }
    for (peer, net) in [("a", 1), ("b", 2)] {
        let (c_end, p_end) = (format!("{tag}c{peer}"), format!("{tag}{peer}c"));
        ip(&[
            "link",
            "add",
            &c_end,
            "netns",
            &format!("{tag}c"),
            "type",
            "veth",
            "peer",
            "name",
            &p_end,
            "netns",
            &format!("{tag}{peer}"),
        ])?;
        ip(&[
            "-n",
            &format!("{tag}c"),
            "addr",
            "add",
            &format!("10.77.{net}.1/24"),
            "dev",
            &c_end,
        ])?;
        ip(&[
            "-n",
            &format!("{tag}{peer}"),
            "addr",
            "add",
            &format!("10.77.{net}.2/24"),
            "dev",
            &p_end,
        ])?;
        ip(&["-n", &format!("{tag}c"), "link", "set", &c_end, "up"])?;
        ip(&["-n", &format!("{tag}{peer}"), "link", "set", &p_end, "up"])?;
    }
    Ok(())
}

/// Start a unit in namespace `ns` listening on `addr` with the secret in
/// `secret_file`; waits for its READY line.
pub fn start_unit(ns: &str, addr: &str, secret_file: &std::path::Path) -> Child {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(binary())
        .args(["unit", "--no-mlock", "--memory", "32MiB", "--name", ns])
        .args(["--listen", &format!("tcp:{addr}")])
        .arg("--secret-file")
        .arg(secret_file)
        .env_remove("STOWAGE_SECRET")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ip netns exec starts");
    let lines = stdout_lines(&mut child);
    assert!(
        wait_for_line(&lines, "READY", Duration::from_secs(30)),
        "the unit in {ns} never reported ready"
    );
    child
}

/// The units' secret ([`SECRET`]) in an owner-only file under `dir`.
pub fn write_secret(dir: &std::path::Path) -> std::path::PathBuf {
    let file = dir.join("secret");
    std::fs::write(&file, SECRET).unwrap();
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    file
}

/// The hosts of [`make_hosts`] under `tag`, or `None` (having said why
/// the test is skipped) where namespaces cannot be made (not root, no
/// `ip`).
pub fn hosts_or_skip(tag: &str) -> Option<Hosts> {
    let mut hosts = Hosts {
        names: Vec::new(),
        procs: Vec::new(),
    };
    match make_hosts(tag, &mut hosts) {
        Ok(()) => Some(hosts),
        Err(why) => {
            eprintln!(
                "SKIPPED: cannot create network namespaces here (needs root and iproute2): {why}"
            );
            None
        }
    }
}
