//! `--flood N`: connections that never prove anything, against a real
//! client's put and get.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use stowage_client::Client;
use stowage_local::LocalPlane;

use crate::foreground::foreground;
use crate::probe::{Children, Sampler, Status};
use crate::{
    client_config, header, one_line, put_get, spawn_piped, unit_addr, verdict, Opts, Res, VALUE,
};

/// Connections to `addr` that never send a byte; each one the unit closes
/// is opened again. Stops (closing them all) when dropped.
pub(crate) struct Flood {
    stop: Arc<AtomicBool>,
    pub(crate) open: Arc<AtomicUsize>,
    pub(crate) reopened: Arc<AtomicU64>,
    pub(crate) connect_errors: Arc<AtomicU64>,
    handle: Option<std::thread::JoinHandle<()>>,
    /// With `--flood-uid`: the child process that holds the connections.
    child: Option<Children>,
}

impl Flood {
    pub(crate) fn start(addr: std::net::SocketAddr, n: usize) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let open = Arc::new(AtomicUsize::new(0));
        let reopened = Arc::new(AtomicU64::new(0));
        let connect_errors = Arc::new(AtomicU64::new(0));
        let (s, op, re, ce) = (
            stop.clone(),
            open.clone(),
            reopened.clone(),
            connect_errors.clone(),
        );
        let handle = std::thread::spawn(move || {
            let connect = || {
                let c = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
                c.set_nonblocking(true).ok()?;
                Some(c)
            };
            let mut conns: Vec<Option<TcpStream>> = Vec::with_capacity(n);
            for _ in 0..n {
                if s.load(Ordering::Relaxed) {
                    return;
                }
                let c = connect();
                if c.is_none() {
                    ce.fetch_add(1, Ordering::Relaxed);
                }
                conns.push(c);
            }
            let mut buf = [0u8; 64];
            while !s.load(Ordering::Relaxed) {
                let mut live = 0;
                for slot in conns.iter_mut() {
                    let closed = match slot {
                        None => true,
                        Some(c) => match c.read(&mut buf) {
                            Ok(0) => true,
                            Ok(_) => false,
                            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                        },
                    };
                    if closed {
                        *slot = connect();
                        if slot.is_some() {
                            re.fetch_add(1, Ordering::Relaxed);
                        } else {
                            ce.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    live += usize::from(slot.is_some());
                    if s.load(Ordering::Relaxed) {
                        return;
                    }
                }
                op.store(live, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Flood {
            stop,
            open,
            reopened,
            connect_errors,
            handle: Some(handle),
            child: None,
        }
    }

    /// The flood from a child process running as user `uid` (through
    /// `setpriv`): another source than this process's clients, as an
    /// attacker on the machine is. Its counts come back on its stdout.
    pub(crate) fn start_as(addr: std::net::SocketAddr, n: usize, uid: u32) -> Res<Flood> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut c = Command::new("setpriv");
        c.args(["--reuid", &uid.to_string(), "--regid", &uid.to_string()])
            .args(["--clear-groups", "--"])
            .arg(&exe)
            .arg("--flood-child")
            .args(["--tcp", &addr.to_string(), "--conns", &n.to_string()]);
        let (c, stdout) = spawn_piped(&mut c, "setpriv (util-linux) for --flood-uid")?;
        let stop = Arc::new(AtomicBool::new(false));
        let open = Arc::new(AtomicUsize::new(0));
        let reopened = Arc::new(AtomicU64::new(0));
        let connect_errors = Arc::new(AtomicU64::new(0));
        let (op, re, ce) = (open.clone(), reopened.clone(), connect_errors.clone());
        // Ends when the child's stdout closes (it is stopped on drop).
        let handle = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(l) = line else { return };
                let field = |k: &str| {
                    l.split_whitespace()
                        .find_map(|w| w.strip_prefix(k))
                        .and_then(|v| v.parse::<u64>().ok())
                };
                if let (Some(o), Some(r), Some(e)) =
                    (field("open="), field("reopened="), field("failed="))
                {
                    op.store(o as usize, Ordering::Relaxed);
                    re.store(r, Ordering::Relaxed);
                    ce.store(e, Ordering::Relaxed);
                }
            }
        });
        Ok(Flood {
            stop,
            open,
            reopened,
            connect_errors,
            handle: Some(handle),
            child: Some(Children(vec![c])),
        })
    }

    pub(crate) fn show(&self) -> String {
        format!(
            "{} open, {} re-opened after the unit closed them, {} connects failed",
            self.open.load(Ordering::Relaxed),
            self.reopened.load(Ordering::Relaxed),
            self.connect_errors.load(Ordering::Relaxed)
        )
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(mut c) = self.child.take() {
            c.stop(Duration::from_secs(2));
        }
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

pub(crate) fn flood(o: &Opts, plane: &LocalPlane) -> Res<()> {
    let pid = header(o, plane);
    let addr = unit_addr(o, plane);
    let tcp = plane.units[0].tcp;
    let timeout = Duration::from_secs_f64(o.timeout);
    // The control: the same foreground loop, same unit, no flood.
    let mut control = {
        let c = Client::connect(client_config(
            std::slice::from_ref(&addr),
            plane.secret(),
            timeout,
        ))
        .map_err(|e| format!("the control client: {e}"))?;
        foreground(&c, o.secs)
    };
    println!(
        "  foreground client before the flood (control), 4 KiB put+get: {}",
        control.show()
    );
    std::thread::sleep(Duration::from_millis(300));
    let before = Status::read(pid).ok_or("the unit is gone")?;
    println!(
        "  flood: {} TCP connections to {tcp} that never send a byte, each re-opened when the unit closes it, from {}; the real client over {} with a {} s deadline",
        o.flood,
        o.flood_uid
            .map(|u| format!("a child process of uid {u}"))
            .unwrap_or_else(|| "this process (the real client's own user)".into()),
        o.transport,
        o.timeout
    );
    println!("  unit before: {}", before.show());
    let sampler = Sampler::start(pid);
    let flood = match o.flood_uid {
        Some(uid) => Flood::start_as(tcp, o.flood, uid)?,
        None => Flood::start(tcp, o.flood),
    };
    // Bounded: every connect has a 1 s timeout; wait for the whole flood
    // to be up (or 30 s), then one more second for the unit to take it in.
    let end = Instant::now() + Duration::from_secs(30);
    while flood.open.load(Ordering::Relaxed) < o.flood && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));
    let during = Status::read(pid).ok_or("the unit is gone")?;
    println!("  flood up: {}", flood.show());
    println!("  unit under the flood: {}", during.show());
    let value = vec![0x33u8; VALUE];
    let mut out = vec![0u8; VALUE];
    let t = Instant::now();
    let probe = Client::connect(client_config(
        std::slice::from_ref(&addr),
        plane.secret(),
        timeout,
    ))
    .map_err(|e| format!("connect: {e}"))
    .and_then(|c| put_get(&c, 1 << 40, &value, &mut out).map(|()| c));
    let took = t.elapsed();
    let ok = probe.is_ok();
    match &probe {
        Ok(_) => println!(
            "  real client: connect + 4 KiB put + get succeeded in {:.1} ms",
            took.as_secs_f64() * 1e3
        ),
        Err(e) => println!(
            "  real client: FAILED after {:.1} ms: {}",
            took.as_secs_f64() * 1e3,
            one_line(e)
        ),
    }
    let mut fg = probe.ok().map(|c| foreground(&c, o.secs));
    if let Some(fg) = fg.as_mut() {
        println!(
            "  foreground client under the flood, 4 KiB put+get: {}",
            fg.show()
        );
    }
    println!("  flood at the end: {}", flood.show());
    let after = Status::read(pid).ok_or("the unit is gone")?;
    let peak = sampler.peak();
    drop(sampler);
    drop(flood);
    println!("  unit at the end of the flood: {}", after.show());
    println!(
        "  unit peak (each field at its own moment): {}",
        peak.show()
    );
    let grow = |a: u64, b: u64| (a as f64 - b as f64) / 1024.0;
    // Over the slab: the slab's pages (RssShmem) are the unit's from its
    // start, whatever comes.
    let rss_growth = peak.over_mib() - before.over_mib();
    println!("targets:");
    println!(
        "  the real client's put succeeds within its {} s deadline: {} -> {}",
        o.timeout,
        if ok { "yes" } else { "no" },
        verdict(ok)
    );
    println!(
        "  unit RSS growth < 64 MiB: peak RSS over the slab - before = {rss_growth:.1} MiB (VmRSS: {:.1} MiB); threads {} -> peak {} (+{}) -> {}",
        grow(peak.vm_rss, before.vm_rss),
        before.threads,
        peak.threads,
        peak.threads.saturating_sub(before.threads),
        verdict(rss_growth < 64.0)
    );
    if let Some(fg) = fg.as_mut() {
        println!(
            "  (foreground put+get p99 under the flood: {:.3} ms, {} errors; {:.0} op/s; without it: {:.3} ms, {:.0} op/s)",
            fg.pair_p99_ms(),
            fg.errors,
            fg.ops as f64 / fg.secs,
            control.pair_p99_ms(),
            control.ops as f64 / control.secs
        );
    }
    Ok(())
}
