//! The README's first command, `cargo run --release -- local`, runs as
//! written: the arguments after `--` go to the `stowage` binary (this
//! build's; `cargo run` only builds it first), nothing added, in the
//! environment the README gives it (none: no `STOWAGE_SECRET`), within a
//! bounded time. Its units are its children and stop with it.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::binary;

/// The README's first line of shell: `cargo run --release -- ARGS  # ...`.
fn readme_first_command() -> Vec<String> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("README.md");
    let block = readme
        .split("```bash\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a bash block in README.md");
    let line = block.lines().next().expect("a first command");
    let command = line.split('#').next().unwrap().trim();
    let args = command
        .strip_prefix("cargo run --release -- ")
        .unwrap_or_else(|| {
            panic!("the README's first command is not `cargo run --release -- …`: {line}")
        });
    args.split_whitespace().map(str::to_owned).collect()
}

/// Whether `pid` has exited (gone from /proc, or a zombie).
fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('Z')))
        .unwrap_or(true)
}

/// The children of `pid` (its units), from /proc.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|s| s.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(p);
        }
    }
    out
}

#[test]
fn the_readmes_first_command_runs_as_written() {
    let args = readme_first_command();
    assert_eq!(
        args,
        ["local"],
        "the test knows what `stowage local` prints; update it"
    );
    let mut child = Command::new(binary())
        .args(&args)
        .env_remove("STOWAGE_SECRET")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("stowage starts");
    let pid = child.id();
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    // A debug build on a loaded 2-core machine: generous, but bounded.
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut units = Vec::new();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        for u in children_of(pid) {
            if !units.contains(&u) {
                units.push(u);
            }
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = reader.join().unwrap();
    let stderr = err_reader.join().unwrap();
    // Its units stopped with it (each by pid; a bounded wait).
    let end = Instant::now() + Duration::from_secs(30);
    while !units.iter().all(|&u| gone(u)) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    let outlived: Vec<u32> = units.iter().copied().filter(|&u| !gone(u)).collect();
    for &u in &outlived {
        // Stopped by pid, so that a failure leaves nothing running.
        let _ = Command::new("kill").args(["-9", &u.to_string()]).status();
    }
    let status = status.unwrap_or_else(|| {
        panic!("`stowage local` did not finish within 600 s\n{stdout}\n{stderr}")
    });
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("starting a local data plane: 2 units x 256.0 MiB"),
        "{stdout}"
    );
    assert!(stdout.contains("GB/s"), "{stdout}");
    assert_eq!(stdout.matches("after the run:").count(), 2, "{stdout}");
    assert!(
        outlived.is_empty(),
        "units outlived `stowage local`: {outlived:?}"
    );
}

/// A network namespace and a scratch directory; Drop kills what runs in
/// the namespace (each pid `ip netns pids` names) and removes both.
struct Host {
    name: String,
    dir: tempfile::TempDir,
}

impl Drop for Host {
    fn drop(&mut self) {
        if let Ok(o) = Command::new("ip")
            .args(["netns", "pids", &self.name])
            .output()
        {
            for pid in String::from_utf8_lossy(&o.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// The Authentication section's shell block, line by line, as written, on
/// the host it names: a network namespace made by the test where
/// 10.0.0.5 is the host's address, whose /etc is an overlay of this
/// machine's (so `/etc/stowage` is the namespace's own and the machine's
/// /etc is not touched), with the `stowage` of this build on PATH. The unit
/// line runs as a server (in the background, until its READY line), then
/// the stats line must prove the secret and show the unit's counters.
/// Skipped, saying why, where namespaces cannot be made (not root, no
/// `ip`, no overlayfs).
#[test]
fn the_readmes_authentication_commands_run_as_written() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("README.md");
    let section = readme
        .split("### Authentication")
        .nth(1)
        .expect("an Authentication section");
    let block = section
        .split("```bash\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a bash block under Authentication");
    let lines: Vec<&str> = block.lines().collect();
    assert_eq!(lines.len(), 3, "secret, unit, stats: {block}");
    assert!(lines[1].starts_with("stowage unit ") && lines[1].contains("tcp:10.0.0.5:7000"));
    assert!(lines[2].contains("stowage stats tcp:10.0.0.5:7000"));

    let host = Host {
        name: format!("stxauth{}", std::process::id() % 1_000_000),
        dir: tempfile::tempdir().unwrap(),
    };
    if let Err(why) = Command::new("ip")
        .args(["netns", "add", &host.name])
        .output()
        .map_err(|e| e.to_string())
        .and_then(|o| {
            if o.status.success() {
                Ok(())
            } else {
                Err(String::from_utf8_lossy(&o.stderr).into_owned())
            }
        })
    {
        eprintln!(
            "SKIPPED: cannot create a network namespace here (needs root and iproute2): {why}"
        );
        return;
    }
    let d = host.dir.path();
    for sub in ["upper", "work"] {
        std::fs::create_dir(d.join(sub)).unwrap();
    }
    let script = format!(
        "set -e\n\
         mount -t overlay overlay -o lowerdir=/etc,upperdir={d}/upper,workdir={d}/work /etc \
           || {{ echo 'SKIPPED: no overlayfs'; exit 0; }}\n\
         ip link set lo up\n\
         ip addr add 10.0.0.5/32 dev lo\n\
         {secret}\n\
         {unit} > {d}/unit.out 2>&1 &\n\
         unit=$!\n\
         i=0; until grep -q READY {d}/unit.out; do \
           i=$((i+1)); [ $i -lt 600 ] || {{ cat {d}/unit.out; exit 1; }}; sleep 0.1; done\n\
         {stats}\n\
         kill $unit; wait $unit || true\n\
         echo DONE\n",
        d = d.display(),
        secret = lines[0],
        unit = lines[1],
        stats = lines[2],
    );
    let bin_dir = binary().parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut child = Command::new("ip")
        .args(["netns", "exec", &host.name, "sh", "-c", &script])
        .env("PATH", path)
        .env_remove("STOWAGE_SECRET")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ip netns exec starts");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(host); // the unit, if it is still there, and the namespace
    let stdout = reader.join().unwrap();
    let stderr = err_reader.join().unwrap();
    if stdout.contains("SKIPPED") {
        eprintln!("{stdout}");
        return;
    }
    let status = status
        .unwrap_or_else(|| panic!("the commands did not finish within 120 s\n{stdout}\n{stderr}"));
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    assert!(stdout.contains("bytes used"), "{stdout}\n{stderr}");
    assert!(stdout.contains("DONE"), "{stdout}\n{stderr}");
}
