//! Watching processes: the children (stopped by their pids) and the
//! unit's `/proc/PID/status`, sampled for its peak.

use std::io::Write;
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::procs::reap;

/// Children stopped by their pids when dropped (every path out).
pub(crate) struct Children(pub(crate) Vec<Child>);

impl Children {
    /// Ask each to stop (stdin), give them `grace` in all, then SIGKILL
    /// whatever is left by its pid and reap it.
    pub(crate) fn stop(&mut self, grace: Duration) {
        for c in &mut self.0 {
            if let Some(mut s) = c.stdin.take() {
                let _ = s.write_all(b"stop\n");
            }
        }
        let end = Instant::now() + grace;
        for mut c in self.0.drain(..) {
            reap(&mut c, end, Duration::from_millis(10));
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// Fields of /proc/PID/status, in KiB (threads: a count).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Status {
    pub(crate) threads: u64,
    pub(crate) vm_rss: u64,
    pub(crate) anon: u64,
    pub(crate) file: u64,
    pub(crate) shmem: u64,
}

impl Status {
    pub(crate) fn read(pid: u32) -> Option<Status> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let mut s = Status::default();
        for l in text.lines() {
            let mut w = l.split_whitespace();
            let (Some(k), Some(v)) = (w.next(), w.next()) else {
                continue;
            };
            let v: u64 = v.parse().unwrap_or(0);
            match k {
                "Threads:" => s.threads = v,
                "VmRSS:" => s.vm_rss = v,
                "RssAnon:" => s.anon = v,
                "RssFile:" => s.file = v,
                "RssShmem:" => s.shmem = v,
                _ => {}
            }
        }
        Some(s)
    }

    /// RSS over the slab (RssAnon + RssFile), MiB.
    pub(crate) fn over_mib(&self) -> f64 {
        (self.anon + self.file) as f64 / 1024.0
    }

    pub(crate) fn show(&self) -> String {
        format!(
            "threads {}, VmRSS {:.0} MiB (RssAnon {:.0} + RssFile {:.0} = {:.0} MiB over the slab; RssShmem {:.0} MiB)",
            self.threads,
            self.vm_rss as f64 / 1024.0,
            self.anon as f64 / 1024.0,
            self.file as f64 / 1024.0,
            self.over_mib(),
            self.shmem as f64 / 1024.0
        )
    }
}

/// Samples a process's status every 100 ms until dropped: the peak of
/// threads and of RSS over the slab (each at its own moment).
pub(crate) struct Sampler {
    stop: Arc<AtomicBool>,
    peak: Arc<Mutex<Status>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    pub(crate) fn start(pid: u32) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(Mutex::new(Status::read(pid).unwrap_or_default()));
        let (s, p) = (stop.clone(), peak.clone());
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(now) = Status::read(pid) {
                    let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
                    p.threads = p.threads.max(now.threads);
                    if now.anon + now.file > p.anon + p.file {
                        (p.anon, p.file) = (now.anon, now.file);
                    }
                    p.vm_rss = p.vm_rss.max(now.vm_rss);
                    p.shmem = p.shmem.max(now.shmem);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Sampler {
            stop,
            peak,
            handle: Some(handle),
        }
    }

    pub(crate) fn peak(&self) -> Status {
        *self.peak.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
