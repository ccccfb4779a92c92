//! A new process's first puts and gets, per slab page mode, against a
//! cold single-thread memcpy measured by the same process in the same run
//! (issue 23: "fresh processes at copy speed").
//!
//! For each page mode (`4k`, `thp`, `hugetlb`) it starts one unit with
//! `--huge-pages <mode>`, setting the host up for it first (as root:
//! `/sys/kernel/mm/transparent_hugepage/shmem_enabled` to `never` or
//! `advise`, `/proc/sys/vm/nr_hugepages` to hold the slab; both restored
//! at the end). Then, per value size and round, a new process (this
//! program again) connects over shm and
//!
//! 1. copies `--total` MiB in pieces of the size with libc memcpy between
//!    two pre-faulted, cold buffers (walking through them: nothing in the
//!    caches), on one thread: the limit;
//! 2. (a first new process) puts the same bytes, one value per put, from
//!    a pre-faulted buffer: its first touch of those slab ranges;
//! 3. (a second new process) gets them back, one value per get, into new
//!    arrays (`get_rows` allocates each value's buffer): `get new` drops
//!    each at once (the allocator hands the memory back for the next, as
//!    in a loop over steps), `get kept` then gets them all again and keeps
//!    them (every array fresh 4 KiB heap pages from the kernel, whatever
//!    the slab's pages).
//!
//! The memcpy column is the mean of the two processes' memcpy.
//!
//! ```text
//! cargo run --release -p stowage-cli --example fresh_process -- [--rounds 3] [--total 256] [--modes 4k,thp,hugetlb]
//! ```

use std::process::Command;
use std::time::{Duration, Instant};

use stowage_cli::bench::arg;
use stowage_client::{Client, ClientConfig, Key, UnitAddr};

const MIB: usize = 1 << 20;
const SHMEM_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

/// The selected word of a `[selected]` sysfs list, or the trimmed value.
fn setting(path: &str) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    s.split_whitespace()
        .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
        .unwrap_or(s.trim())
        .to_string()
}

fn set(path: &str, v: &str) {
    if let Err(e) = std::fs::write(path, v) {
        eprintln!("cannot write {v} to {path}: {e} (run as root)");
    }
}

/// A buffer of `n` bytes, every page written (pre-faulted), not all zero.
fn prefaulted(n: usize, salt: u8) -> Vec<u8> {
    let mut v = vec![0u8; n];
    for (i, b) in v.iter_mut().enumerate().step_by(4096) {
        *b = (i / 4096) as u8 ^ salt;
    }
    v
}

/// A child: measure memcpy, then (`put`) put the values or (`get`) get
/// them twice into new arrays, dropping each at once (the allocator reuses
/// the memory, as a loop over steps does) and keeping them all (fresh heap
/// pages every time); print its GB/s on one line.
fn child(role: &str, sock: &str, size: usize, total: usize, salt: u64) {
    let n = total / size;
    let src = prefaulted(total, salt as u8);
    // memcpy 1 thread, cold: source and destination walk through buffers
    // of `total` bytes, far larger than the caches.
    let mut dst = prefaulted(total, 2);
    let t = Instant::now();
    for i in 0..n {
        dst[i * size..(i + 1) * size].copy_from_slice(&src[i * size..(i + 1) * size]);
        std::hint::black_box(&mut dst);
    }
    let memcpy = total as f64 / t.elapsed().as_secs_f64() / 1e9;
    drop(dst);

    let mut cfg = ClientConfig::new("fresh", vec![UnitAddr::Unix(sock.into())]);
    cfg.timeout = Duration::from_secs(60);
    let c = Client::connect(cfg).expect("connect");
    // Connecting is lazy: reach the unit before the clock starts, as the
    // figures always have.
    c.check_units(c.deadline()).expect("the unit answers");
    let keys: Vec<Key> = (0..n as u64)
        .map(|i| Key::new(salt * 1_000_000 + i, "v"))
        .collect();
    let gbps = |t: Instant| total as f64 / t.elapsed().as_secs_f64() / 1e9;
    if role == "put" {
        let t = Instant::now();
        for (i, k) in keys.iter().enumerate() {
            c.put_rows(&[(k.clone(), &src[i * size..(i + 1) * size])], c.deadline())
                .expect("put");
        }
        println!("{memcpy} {}", gbps(t));
        return;
    }
    // Gets into new arrays, each dropped after a check of its ends.
    let t = Instant::now();
    for (i, k) in keys.iter().enumerate() {
        let v = c
            .get_rows(std::slice::from_ref(k), c.deadline())
            .expect("get")
            .remove(0);
        assert!(v.len() == size && v[0] == src[i * size] && v[size - 1] == src[(i + 1) * size - 1]);
    }
    let dropped = gbps(t);
    // And all kept: every array is fresh memory from the kernel.
    let mut got = Vec::with_capacity(n);
    let t = Instant::now();
    for k in &keys {
        got.push(
            c.get_rows(std::slice::from_ref(k), c.deadline())
                .expect("get")
                .remove(0),
        );
    }
    let kept = gbps(t);
    for (i, g) in got.iter().enumerate() {
        assert!(
            g[..] == src[i * size..(i + 1) * size],
            "value {i} came back changed"
        );
    }
    drop(got);
    let rows: Vec<u64> = (0..n as u64).map(|i| salt * 1_000_000 + i).collect();
    c.clear_rows(&rows, c.deadline()).expect("clear");
    println!("{memcpy} {dropped} {kept}");
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("child") {
        child(
            &args[2],
            &args[3],
            args[4].parse().unwrap(),
            args[5].parse().unwrap(),
            args[6].parse().unwrap(),
        );
        return;
    }
    let rounds: usize = arg(&args, "--rounds", "3").parse().unwrap();
    let total = arg(&args, "--total", "256").parse::<usize>().unwrap() * MIB;
    let modes = arg(&args, "--modes", "4k,thp,hugetlb");
    let stowage = std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("stowage"))
        .expect("the stowage binary beside target/<profile>/examples");
    let (old_thp, old_huge) = (setting(SHMEM_ENABLED), setting(NR_HUGEPAGES));
    let memory = total + 64 * MIB;
    println!(
        "a new process's first {} MiB of puts and gets (new arrays) per value size, one unit over shm, median of {rounds} (GB/s; ratio to 1-thread cold memcpy in the same process)",
        total / MIB
    );
    println!(
        "{:>8} {:>5} | {:>9} | {:>12} | {:>12} | {:>12}",
        "pages", "size", "memcpy 1t", "put", "get new", "get kept"
    );
    for mode in modes.split(',') {
        match mode {
            "thp" => {
                set(SHMEM_ENABLED, "advise");
                set(NR_HUGEPAGES, "0");
            }
            "hugetlb" => {
                set(SHMEM_ENABLED, "never");
                set(NR_HUGEPAGES, &(memory / (2 * MIB) + 8).to_string());
            }
            _ => {
                set(SHMEM_ENABLED, "never");
                set(NR_HUGEPAGES, "0");
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("u.sock");
        let mut unit = Command::new(&stowage)
            .args(["unit", "--name", "fresh", "--huge-pages", mode])
            .args(["--memory", &memory.to_string()])
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("unit starts");
        let mut ready = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(unit.stdout.as_mut().unwrap()),
            &mut ready,
        )
        .unwrap();
        assert!(ready.starts_with("READY"), "unit did not start: {ready}");
        // Let the unit fault its slab in, as a unit that has been up a while.
        std::thread::sleep(Duration::from_secs(3));
        for size in [MIB, 16 * MIB] {
            let mut runs: [Vec<f64>; 5] = Default::default();
            for r in 0..rounds {
                let mut got = vec![];
                for role in ["put", "get"] {
                    let out = Command::new(std::env::current_exe().unwrap())
                        .args(["child", role])
                        .arg(&sock)
                        .args([size.to_string(), total.to_string(), (r + 1).to_string()])
                        .output()
                        .expect("child runs");
                    assert!(
                        out.status.success(),
                        "{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    let line = String::from_utf8(out.stdout).unwrap();
                    got.extend(line.split_whitespace().map(|x| x.parse::<f64>().unwrap()));
                }
                // put child: memcpy, put; get child: memcpy, get, get kept.
                let memcpy = (got[0] + got[2]) / 2.0;
                for (i, v) in [memcpy, got[1], got[3], got[4], 0.0]
                    .into_iter()
                    .enumerate()
                {
                    runs[i].push(v);
                }
            }
            let [m, p, g, k, _] = runs.map(median);
            println!(
                "{:>8} {:>4}M | {m:>9.2} | {p:>6.2} {:>4.2}x | {g:>6.2} {:>4.2}x | {k:>6.2} {:>4.2}x",
                mode,
                size / MIB,
                p / m,
                g / m,
                k / m
            );
        }
        let _ = unit.kill();
        let _ = unit.wait();
    }
    set(SHMEM_ENABLED, &old_thp);
    set(NR_HUGEPAGES, &old_huge);
}
