//! The slab's page modes (`stowage unit --huge-pages`) with real unit
//! processes and the host's real settings: 4k, transparent huge pages
//! (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`) and hugetlb
//! (`/proc/sys/vm/nr_hugepages`). The test changes those settings, so it
//! needs root and restores them on every exit path ([`Setting`]'s Drop);
//! it skips, saying why, where it cannot. The cases run in sequence in
//! one test: they share the host's settings.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{binary, eventually, Reap};
use stowage_client::{Client, ClientConfig, Key, UnitAddr};

const SHMEM_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

/// A kernel setting this test changed, put back as it was on drop (a
/// failing assertion included).
struct Setting {
    path: &'static str,
    old: String,
}

impl Setting {
    /// The current value: for a `[selected]` list, the selected word.
    fn read(path: &str) -> Option<String> {
        let s = std::fs::read_to_string(path).ok()?;
        Some(
            s.split_whitespace()
                .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
                .unwrap_or(s.trim())
                .to_string(),
        )
    }

    /// Take `path` over, or say why not.
    fn take(path: &'static str) -> Result<Setting, String> {
        let old = Setting::read(path).ok_or_else(|| format!("{path} is not readable"))?;
        std::fs::write(path, &old).map_err(|e| format!("{path} is not writable: {e}"))?;
        Ok(Setting { path, old })
    }

    fn set(&self, value: &str) {
        std::fs::write(self.path, value)
            .unwrap_or_else(|e| panic!("writing {value} to {}: {e}", self.path));
    }
}

impl Drop for Setting {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(self.path, &self.old) {
            eprintln!("could not restore {} to {}: {e}", self.path, self.old);
        }
    }
}

/// Free, unreserved hugetlb pages.
fn free_huge_pages() -> u64 {
    let m = std::fs::read_to_string("/proc/meminfo").unwrap();
    let field = |name: &str| -> u64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    field("HugePages_Free:").saturating_sub(field("HugePages_Rsvd:"))
}

/// A unit started with `args`, listening on a Unix socket and on TCP.
struct Unit {
    child: Option<Reap>,
    sock: PathBuf,
    tcp: std::net::SocketAddr,
    metrics: String,
    _dir: tempfile::TempDir,
}

/// Start `stowage unit --memory <memory> <args>`: the unit, or what it
/// printed on stderr when it exited instead of reporting ready.
fn start(memory: &str, args: &[&str]) -> Result<Unit, String> {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("u.sock");
    let mut cmd = Command::new(binary());
    cmd.args(["unit", "--no-mlock", "--insecure", "--exit-with-stdin"])
        .args(["--memory", memory])
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .args(["--listen", "tcp:127.0.0.1:0"])
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("STOWAGE_LOG_FORMAT")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = Reap(cmd.spawn().expect("the unit starts"));
    let lines = common::stdout_lines(&mut child.0);
    match lines.recv_timeout(Duration::from_secs(30)) {
        Ok(ready) if ready.starts_with("READY") => {
            let word = |k: &str| {
                ready
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix(k))
                    .unwrap_or_default()
                    .to_string()
            };
            Ok(Unit {
                tcp: word("tcp=").parse().expect("a tcp address"),
                metrics: word("metrics=http://"),
                child: Some(child),
                sock,
                _dir: dir,
            })
        }
        _ => {
            // Exited (or hung: the Reap kills it); its stderr says why.
            let end = Instant::now() + Duration::from_secs(10);
            while matches!(child.0.try_wait(), Ok(None)) && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.0.kill();
            let mut err = String::new();
            if let Some(mut e) = child.0.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            Err(err)
        }
    }
}

impl Unit {
    fn client(&self, shm: bool) -> Client {
        let addr = if shm {
            UnitAddr::Unix(self.sock.clone())
        } else {
            UnitAddr::Tcp(self.tcp)
        };
        let mut cfg = ClientConfig::new("pages", vec![addr]);
        cfg.shm = shm;
        cfg.timeout = Duration::from_secs(10);
        Client::connect(cfg).expect("client connects")
    }

    /// Values of 1 KiB to 3 MiB round-trip over shm and over tcp; returns
    /// the unit's stats.
    fn round_trip(&self) -> stowage_client::Stats {
        for (shm, salt) in [(true, 1u64), (false, 2)] {
            let c = self.client(shm);
            let vals: Vec<Vec<u8>> = [1 << 10, 300 << 10, 3 << 20]
                .iter()
                .enumerate()
                .map(|(i, &n)| common::pattern(i as u64, salt, n))
                .collect();
            let keys: Vec<Key> = (0..vals.len() as u64).map(|i| Key::new(i, "f")).collect();
            let rows: Vec<(Key, &[u8])> = keys
                .iter()
                .cloned()
                .zip(vals.iter().map(Vec::as_slice))
                .collect();
            c.put_rows(&rows, c.deadline()).expect("put");
            let got = c.get_rows(&keys, c.deadline()).expect("get");
            for (g, v) in got.iter().zip(&vals) {
                assert!(g == v, "a value of {} bytes came back changed", v.len());
            }
            c.clear_rows(&[0, 1, 2], c.deadline()).expect("clear");
        }
        self.client(false)
            .stats(Instant::now() + Duration::from_secs(10))
            .remove(0)
            .expect("stats")
    }

    /// The unit's `stowage_slab_page_mode` gauges, as `mode=value` lines.
    fn page_mode_metric(&self) -> String {
        let mut s = std::net::TcpStream::connect(self.metrics.trim_end_matches("/metrics"))
            .expect("metrics endpoint");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.lines()
            .filter(|l| l.starts_with("stowage_slab_page_mode{"))
            .map(|l| {
                let mode = l.split("mode=\"").nth(1).and_then(|m| m.split('"').next());
                let v: f64 = l.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap();
                format!("{}={v}", mode.expect("a mode label"))
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Stop the unit; what it logged on stderr.
    fn stop(mut self) -> String {
        let mut child = self.child.take().unwrap();
        drop(child.0.stdin.take());
        let end = Instant::now() + Duration::from_secs(10);
        while matches!(child.0.try_wait(), Ok(None)) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.0.kill();
        let mut log = String::new();
        if let Some(mut e) = child.0.stderr.take() {
            let _ = e.read_to_string(&mut log);
        }
        log
    }
}

/// The unit's slab pages mapped as huge pages (`ShmemPmdMapped`), KiB.
fn shmem_pmd_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("ShmemPmdMapped:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn units_run_in_each_page_mode_the_host_allows_and_say_which() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIPPED: changing {SHMEM_ENABLED} and {NR_HUGEPAGES} needs root");
        return;
    }
    let (thp, huge) = match (Setting::take(SHMEM_ENABLED), Setting::take(NR_HUGEPAGES)) {
        (Ok(t), Ok(h)) => (t, h),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("SKIPPED: {e}");
            return;
        }
    };
    assert!(Path::new(SHMEM_ENABLED).exists());

    // Neither: auto starts on 4 KiB pages and says why; explicit modes
    // refuse to start, naming the setting to change.
    thp.set("never");
    huge.set("0");
    let u = start("16MiB", &[]).expect("auto starts without huge pages");
    let st = u.round_trip();
    assert_eq!(st.page_mode, "4k");
    assert_eq!(u.page_mode_metric(), "4k=1 thp=0 hugetlb=0");
    let log = u.stop();
    let line = log
        .lines()
        .find(|l| l.contains("slab pages:"))
        .unwrap_or_else(|| panic!("no page-mode line in:\n{log}"));
    assert!(
        line.contains("4 KiB pages")
            && line.contains("nr_hugepages")
            && line.contains("shmem_enabled"),
        "{line}"
    );
    assert_eq!(log.matches("slab pages:").count(), 1, "{log}");
    let e = start("16MiB", &["--huge-pages", "hugetlb"])
        .err()
        .expect("hugetlb without free huge pages must not start");
    assert!(
        e.contains("huge pages mode hugetlb is unavailable") && e.contains(NR_HUGEPAGES),
        "{e}"
    );
    let e = start("16MiB", &["--huge-pages", "thp"])
        .err()
        .expect("thp with shmem_enabled never must not start");
    assert!(e.contains(SHMEM_ENABLED) && e.contains("advise"), "{e}");

    // Transparent huge pages: asked for, and what auto picks without
    // hugetlb pages. The unit's own mapping of its slab is huge-page mapped
    // once it faulted the slab in.
    thp.set("advise");
    let u = start("16MiB", &["--huge-pages", "thp"]).expect("thp starts");
    let pid = u.child.as_ref().unwrap().0.id();
    let st = u.round_trip();
    assert_eq!(st.page_mode, "thp");
    assert_eq!(u.page_mode_metric(), "4k=0 thp=1 hugetlb=0");
    assert!(
        eventually(Duration::from_secs(20), || shmem_pmd_kib(pid) >= 2048),
        "the thp unit maps no huge pages: {} KiB",
        shmem_pmd_kib(pid)
    );
    u.stop();
    let u = start("16MiB", &[]).expect("auto starts");
    assert_eq!(u.round_trip().page_mode, "thp");
    assert!(u.stop().contains("slab pages: transparent huge pages"));
    thp.set("never");

    // Hugetlb: 5 MiB rounds up to three 2 MiB pages, all the unit's.
    huge.set("8");
    if free_huge_pages() < 3 {
        eprintln!(
            "SKIPPED the hugetlb cases: the kernel gave {} free huge pages",
            free_huge_pages()
        );
        return;
    }
    let u = start("5MiB", &["--huge-pages", "hugetlb"]).expect("hugetlb starts");
    let st = u.round_trip();
    assert_eq!(st.page_mode, "hugetlb");
    assert_eq!(
        st.capacity,
        6 << 20,
        "the slab rounds up to whole huge pages"
    );
    assert_eq!(u.page_mode_metric(), "4k=0 thp=0 hugetlb=1");
    let log = u.stop();
    assert!(log.contains("rounds up from 5242880 to 6291456"), "{log}");
    let u = start("5MiB", &[]).expect("auto starts");
    assert_eq!(u.round_trip().page_mode, "hugetlb");
    assert!(u.stop().contains("slab pages: hugetlb pages"));
    // More than the free huge pages hold: auto falls back, hugetlb refuses.
    let u = start("64MiB", &[]).expect("auto starts");
    assert_eq!(u.round_trip().page_mode, "4k");
    u.stop();
    assert!(start("64MiB", &["--huge-pages", "hugetlb"]).is_err());
}
