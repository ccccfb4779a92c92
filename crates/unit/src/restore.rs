//! Restore units: checkpoints read back on the host that holds them.
//!
//! A client that loads a checkpoint whose parts lie on several hosts asks
//! each part's unit, over that unit's authenticated control path
//! ([`stowage_wire::Request::OpenRestore`]), to serve the part. The unit
//! finds the part's directory under its own checkpoint root (no `..`, no
//! link followed: [`checkpoint::find_dir`]) and starts a *restore unit* in
//! its own process, restored from that directory (every file checked
//! against the manifest, as `stowage unit --restore` does): listening
//! where the unit listens (its TCP host with port 0, a Unix socket beside
//! its own), with the unit's secret, memory sized from the part's files on
//! disk (never from what a client says). The client reads the rows from it
//! as from any unit, then closes it ([`stowage_wire::Request::CloseRestore`]).
//! A restore unit also stops once no connection has been open to it for
//! [`IDLE`], and with its unit (it lives in the unit's process, so it dies
//! with it too). A unit serves at most [`MAX_OPEN`] at once.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use stowage_wire::{ErrorCode, Response, RestoreReply, RestoreSource};

use crate::checkpoint::{self, Found};
use stowage_config::UnitConfig;

use crate::error::StartError;
use crate::shared::{RestoreUnit, Restores, Shared};

/// Most restore units one unit serves at once.
pub(crate) const MAX_OPEN: usize = 8;
/// A restore unit without a connection for this long stops.
pub(crate) const IDLE: Duration = Duration::from_secs(120);
/// The least memory of a restore unit.
const MIN_MEMORY: u64 = 64 << 20;
/// How often a restore unit's watcher looks at it.
const TICK: Duration = Duration::from_millis(250);

fn lock(m: &Mutex<Restores>) -> MutexGuard<'_, Restores> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn refuse(code: ErrorCode, message: String) -> Response {
    Response::Error { code, message }
}

/// The memory of a restore unit for a checkpoint whose files hold
/// `on_disk` bytes: room for its blobs, with a margin.
fn memory_for(on_disk: u64) -> u64 {
    on_disk
        .saturating_add(on_disk / 4)
        .saturating_add(32 << 20)
        .max(MIN_MEMORY)
        .checked_next_multiple_of(4096)
        .unwrap_or(u64::MAX - 4095)
}

/// Serve the checkpoint in `dir` (a checkpoint request, already allowed)
/// from a new restore unit; the reply says where, or what is missing.
pub(crate) fn open(shared: &Arc<Shared>, dir: &str) -> Response {
    if shared.life.stop.load(Ordering::SeqCst) {
        return refuse(ErrorCode::Internal, "the unit is shutting down".into());
    }
    let found = match checkpoint::find_dir(shared.settings.checkpoint_root.as_deref(), dir) {
        Ok(f) => f,
        Err(message) => return refuse(ErrorCode::Unauthorized, message),
    };
    let host = checkpoint::host_name();
    let (fd, path, stored) = match found {
        Found::Missing { path, missing } => {
            return Response::Restore(Box::new(RestoreReply {
                host,
                path: path.display().to_string(),
                opened: None,
                missing,
            }))
        }
        Found::Dir { fd, path, stored } => (fd, path, stored),
    };
    let Some(template) = shared.checkpoints.config.get() else {
        return refuse(ErrorCode::Busy, "the unit is still starting".into());
    };
    let on_disk = match checkpoint::files_bytes(fd.as_fd()) {
        Ok(n) => n,
        Err(e) => return refuse(ErrorCode::Internal, format!("{}: {e}", path.display())),
    };
    let id = {
        let mut r = lock(&shared.checkpoints.restores);
        if r.open.len() >= MAX_OPEN {
            return refuse(
                ErrorCode::Busy,
                format!(
                    "this unit serves {MAX_OPEN} restores already: close one, or wait until an \
                     idle one stops"
                ),
            );
        }
        r.next += 1;
        r.next
    };
    // Beside the unit's own socket; none when that name would be too long
    // for a socket address and the unit listens on TCP too.
    let uds = template
        .uds
        .as_ref()
        .map(|p| {
            let mut s = p.clone().into_os_string();
            s.push(format!(".restore-{id}"));
            std::path::PathBuf::from(s)
        })
        .filter(|p| p.as_os_str().len() < 100 || template.tcp.is_none());
    let cfg = UnitConfig {
        name: format!("{}-restore-{id}", template.name),
        memory: memory_for(on_disk),
        tcp: template.tcp.map(|a| SocketAddr::new(a.ip(), 0)),
        uds,
        restore: None,
        checkpoint_root: None,
        disk: None,
        failpoints: Vec::new(),
        metrics: false,
        metrics_listen: None,
        nixl: None,
        mlock: false,
        admin_tcp: false,
        huge_pages: Default::default(),
        threads: 1,
        io_threads: 2,
        ..template.clone()
    };
    let (handle, info) = match (shared.checkpoints.start)(cfg, fd, path.clone()) {
        Ok((h, Some(info))) => (h, info),
        Ok((h, None)) => {
            h.stop();
            return refuse(
                ErrorCode::Internal,
                "the restore unit restored nothing".into(),
            );
        }
        Err(StartError::Restore(m)) => return refuse(ErrorCode::InvalidRequest, m),
        Err(e) => {
            return refuse(
                ErrorCode::Internal,
                format!("starting a restore unit for {}: {e}", path.display()),
            )
        }
    };
    {
        let mut r = lock(&shared.checkpoints.restores);
        if shared.life.stop.load(Ordering::SeqCst) {
            drop(r);
            handle.stop();
            return refuse(ErrorCode::Internal, "the unit is shutting down".into());
        }
        r.open.insert(id, handle.clone());
    }
    let weak = Arc::downgrade(shared);
    let watched = Arc::downgrade(&handle);
    let spawned = std::thread::Builder::new()
        .name("restore-idle".into())
        .spawn(move || watch(weak, id, watched));
    if let Err(e) = spawned {
        close(shared, id);
        return refuse(ErrorCode::Internal, format!("starting a restore unit: {e}"));
    }
    tracing::info!(
        unit = %shared.settings.name,
        restore = id,
        dir = %path.display(),
        rows = info.rows,
        bytes = info.bytes,
        tcp = ?handle.tcp(),
        uds = ?handle.uds(),
        "restore unit serving a checkpoint"
    );
    Response::Restore(Box::new(RestoreReply {
        host,
        path: path.display().to_string(),
        opened: Some(RestoreSource {
            id,
            tcp: handle.tcp().map(|a| a.to_string()),
            uds: handle.uds().map(|p| p.display().to_string()),
            info: stowage_wire::CheckpointInfo { stored, ..info },
        }),
        missing: String::new(),
    }))
}

/// Stop restore unit `id` (nothing when it is gone already).
pub(crate) fn close(shared: &Shared, id: u64) {
    let handle = lock(&shared.checkpoints.restores).open.remove(&id);
    if let Some(h) = handle {
        h.stop();
        tracing::info!(unit = %shared.settings.name, restore = id, "restore unit stopped");
    }
}

/// Stop every restore unit (the unit is stopping).
pub(crate) fn stop_all(shared: &Shared) {
    let all: Vec<_> = lock(&shared.checkpoints.restores).open.drain().collect();
    for (_, h) in all {
        h.stop();
    }
}

/// Stop restore unit `id` once it has had no connection for [`IDLE`]; end
/// when it was closed, or its unit stopped or is gone.
fn watch(unit: Weak<Shared>, id: u64, handle: Weak<dyn RestoreUnit>) {
    let mut busy = Instant::now();
    loop {
        std::thread::sleep(TICK);
        let Some(sh) = unit.upgrade() else {
            if let Some(h) = handle.upgrade() {
                h.stop();
            }
            return;
        };
        if sh.life.stop.load(Ordering::SeqCst) {
            return;
        }
        let Some(h) = handle.upgrade() else { return };
        if !lock(&sh.checkpoints.restores).open.contains_key(&id) {
            return;
        }
        if h.connections() > 0 {
            busy = Instant::now();
        } else if busy.elapsed() >= IDLE {
            drop(h);
            close(&sh, id);
            tracing::info!(unit = %sh.settings.name, restore = id, "restore unit idle: stopped");
            return;
        }
    }
}

impl Shared {
    /// Stop within `timeout`: refuse new work, let a checkpoint in progress
    /// finish or abandon it, remove the disk directory. Returns what could
    /// not be done.
    pub(crate) fn shut_down(&self, timeout: Duration) -> Vec<String> {
        let mut problems = Vec::new();
        self.life.stop.store(true, Ordering::SeqCst);
        self.driver.timer.wake();
        stop_all(self);
        let end = Instant::now() + timeout;
        while self.checkpoints.writing.load(Ordering::SeqCst) > 0 {
            if Instant::now() >= end {
                problems.push("a checkpoint was still being written at the deadline".into());
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Some(d) = &self.disk {
            // Wait for the spiller and the flusher to put their pens down.
            let idle = loop {
                match d.busy.try_lock() {
                    Ok(g) => break Some(g),
                    Err(std::sync::TryLockError::Poisoned(p)) => break Some(p.into_inner()),
                    Err(std::sync::TryLockError::WouldBlock) if Instant::now() < end => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Err(std::sync::TryLockError::WouldBlock) => break None,
                }
            };
            if idle.is_none() {
                problems.push("a disk write was still running at the deadline".into());
            }
            let mut last = None;
            for _ in 0..5 {
                match d.dir.remove() {
                    Ok(()) => {
                        last = None;
                        break;
                    }
                    // A connection may have just created a file: try again.
                    Err(e) => {
                        last = Some(e);
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            if let Some(e) = last {
                problems.push(format!("could not remove {}: {e}", d.dir.path.display()));
            }
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restore_memory_is_sized_from_the_files_with_a_floor() {
        assert_eq!(memory_for(0), MIN_MEMORY);
        let m = memory_for(1 << 30);
        assert!(m >= (1 << 30) + (1 << 28) && m.is_multiple_of(4096));
        assert!(memory_for(u64::MAX).is_multiple_of(4096));
    }
}
