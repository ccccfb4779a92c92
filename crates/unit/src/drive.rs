//! How the unit drives its core: the one place (`Shared::drive`) where
//! what the core asks is carried out, and the threads whose outcomes come
//! back to it as inputs — the timer (the core's timeouts, the processes it
//! asked to watch), the spiller and the flusher (disk writes).
//!
//! Every input reaches the core through a [`CoreGuard`] (the locked core);
//! releasing the guard runs `Shared::drive`: it polls every action
//! ([`UnitCore::poll_action`]), tells the timer the core's next timeout
//! ([`UnitCore::poll_timeout`]), unlocks, and then removes files, hands
//! spill jobs to the spiller and adds processes to the timer's watch.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use stowage_core::{input, Action, UnitCore};

use crate::disk::DiskEngine;
use crate::metrics;
use crate::sessions::process_exited;
use crate::shared::Shared;
use crate::tier::{cut, COPY_CHUNK};

/// How often the timer thread looks at the processes it watches (whose
/// pidfds it polls; nothing of the core is ticked).
const WATCH_EVERY: Duration = Duration::from_millis(200);

/// The core, locked. On release it drives the core: it carries out what
/// the core asks ([`Shared::drive`]) — outside the lock.
pub(crate) struct CoreGuard<'a> {
    guard: Option<MutexGuard<'a, UnitCore>>,
    shared: &'a Shared,
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = UnitCore;
    fn deref(&self) -> &UnitCore {
        self.guard.as_deref().expect("the guard is held until drop")
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut UnitCore {
        self.guard
            .as_deref_mut()
            .expect("the guard is held until drop")
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        if let Some(g) = self.guard.take() {
            self.shared.drive(g);
        }
    }
}

/// Typed shorthands for the driver's own inputs, each one
/// [`UnitCore::handle`] call (and so driven on release); requests go
/// through [`crate::handler`].
impl CoreGuard<'_> {
    /// A blob's file was written (`ok`) or not.
    pub(crate) fn disk_written(&mut self, blob: stowage_core::BlobId, ok: bool, now: Duration) {
        let _ = self.handle(now, input::DiskWritten { blob, ok });
    }

    /// A connection ended: the holds released now.
    pub(crate) fn conn_ended(
        &mut self,
        owner: stowage_core::Owner,
        end: stowage_core::ConnEnd,
        now: Duration,
    ) -> u64 {
        self.handle(now, input::ConnEnded { owner, end })
            .unwrap_or(0)
    }
}

impl Shared {
    /// The core. A thread that panicked while holding the lock cannot have
    /// left the core half-updated in a way later calls rely on less than on
    /// the unit staying up, so a poisoned lock is taken over.
    pub(crate) fn core(&self) -> CoreGuard<'_> {
        CoreGuard {
            guard: Some(self.driver.core.lock().unwrap_or_else(|p| p.into_inner())),
            shared: self,
        }
    }

    /// [`Shared::core`], when the returned closure is called: what the
    /// handler is handed, so that it locks the core only for the requests
    /// that need it, and the lock is taken here with no hop back to the
    /// caller.
    pub(crate) fn core_on_call<'a>(&'a self) -> impl FnOnce() -> CoreGuard<'a> + 'a {
        move || self.core()
    }

    /// The core's counters, with the server's disk I/O counters.
    pub(crate) fn stats(&self) -> stowage_wire::Stats {
        let now = self.now();
        let mut s = stowage_wire::Stats::from(self.core().stats_at(now));
        if let Some(d) = &self.disk {
            s.disk_write_bytes = d.io.write_bytes.load(Ordering::Relaxed);
            s.disk_write_micros = d.io.write_micros.load(Ordering::Relaxed);
            s.disk_read_bytes = d.io.read_bytes.load(Ordering::Relaxed);
            s.disk_read_micros = d.io.read_micros.load(Ordering::Relaxed);
        }
        if let Some(m) = &self.metrics {
            (s.ops, s.bytes_in, s.bytes_out) = m.traffic();
            s.busy = m.busy_total();
        }
        s.compaction_micros = self.driver.compaction_micros.load(Ordering::Relaxed);
        s.outside_slab_bytes = self.budget.used();
        s.outside_slab_limit = self.budget.limit();
        s.outside_slab_waits = self.budget.waits();
        s.outside_slab_cuts = self.budget.cuts();
        s.serves_nixl = self.nixl.is_some();
        s.page_mode = self.slab.page_mode().name().to_string();
        s
    }

    /// The one place the core is driven: after every input (each
    /// [`CoreGuard`]'s release) take every action the core asks for, tell
    /// the timer when the core next needs the time, release the lock, then
    /// carry the actions out: remove files, hand spill jobs to the
    /// spiller, watch processes. Their outcomes come back as inputs (the
    /// spiller's and the flusher's writes, the timer's process exits and
    /// timeouts), each through a [`CoreGuard`] and so through here.
    fn drive(&self, mut core: MutexGuard<'_, UnitCore>) {
        let mut actions = Vec::new();
        while let Some(a) = core.poll_action() {
            actions.push(a);
        }
        let deadline = core.poll_timeout();
        drop(core);
        self.driver.timer.schedule(deadline);
        let mut spills = Vec::new();
        let mut ended = Vec::new();
        for a in actions {
            match a {
                Action::DeleteFile(blob) => {
                    if let Some(d) = &self.disk {
                        if let Err(err) = d.engine.delete(blob) {
                            tracing::warn!(error = %err, ?blob, "could not remove a blob file");
                        }
                    }
                }
                Action::Spill(job) => spills.push(job),
                Action::Move(job) => {
                    let sent = self
                        .driver
                        .moves
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .send(job);
                    if let Err(std::sync::mpsc::SendError(job)) = sent {
                        // The compactor has stopped (so has the unit).
                        let _ = self.core().handle(
                            self.now(),
                            input::Moved {
                                blob: job.blob,
                                ok: false,
                            },
                        );
                    }
                }
                Action::CheckProcess(session) => {
                    let mut w = self.driver.timer.watched();
                    if w.insert(session) && w.len() == 1 {
                        drop(w);
                        self.driver.timer.wake();
                    }
                }
                Action::Claimed(reply) => self
                    .conns
                    .answers
                    .answer(reply.owner.conn, crate::handler::claimed(reply.lease)),
                Action::SessionEnded(session) => ended.push(session),
            }
        }
        if !ended.is_empty() && self.sessions.ended(ended) {
            // The registry is held (maybe by this thread, joining): the
            // timer drops the records.
            self.driver.timer.wake();
        }
        if let (false, Some(d)) = (spills.is_empty(), &self.disk) {
            let sent = d
                .spill
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .send(spills);
            if sent.is_err() {
                // The spiller has stopped (so has the unit): the blobs
                // stay in memory.
                tracing::debug!(unit = %self.settings.name, "spill jobs after the spiller stopped");
            }
        }
    }

    /// The timer thread: sleeps until the core's next timeout, or until
    /// woken (an earlier timeout, a process to watch, the unit stopping);
    /// while processes are watched, it looks at them every
    /// [`WATCH_EVERY`].
    pub(crate) fn run_timer(&self) {
        let mut watching = false;
        while !self.life.stop.load(Ordering::Relaxed) {
            let now = self.now();
            let at = self.driver.timer.wake_at.load(Ordering::SeqCst);
            if at != u64::MAX && u128::from(at) <= now.as_nanos() {
                self.driver.timer.wake_at.store(u64::MAX, Ordering::SeqCst);
                // Its release (drive) schedules the next timeout.
                let _ = self.core().handle(now, input::Timeout);
                continue;
            }
            let mut wait = if at == u64::MAX {
                // Nothing to wake for but an input, a watched process or
                // the stop (which wakes this thread).
                Duration::from_secs(1)
            } else {
                Duration::from_nanos(at).saturating_sub(now)
            };
            if watching {
                wait = wait.min(WATCH_EVERY);
            }
            {
                let (lock, woken) = &self.driver.timer.woken;
                let w = lock.lock().unwrap_or_else(|p| p.into_inner());
                let (mut w, _) = woken
                    .wait_timeout_while(w, wait, |woken| !*woken)
                    .unwrap_or_else(|p| p.into_inner());
                *w = false;
            }
            self.sessions.forget_ended();
            watching = self.reap_sessions();
        }
    }

    /// End the sessions the core asked to watch ([`Action::CheckProcess`])
    /// whose process has exited while none of their connections is open:
    /// nothing of them can touch the slab any more. Returns whether some
    /// are still watched.
    fn reap_sessions(&self) -> bool {
        let watched: Vec<stowage_core::SessionId> = {
            let w = self.driver.timer.watched();
            w.iter().copied().collect()
        };
        if watched.is_empty() {
            return false;
        }
        let (gone, forget): (Vec<_>, Vec<_>) = {
            let sessions = self
                .sessions
                .by_token
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let core = self.driver.core.lock().unwrap_or_else(|p| p.into_inner());
            let exited = |id: &stowage_core::SessionId| {
                sessions
                    .values()
                    .find(|r| r.id == *id)
                    .and_then(|r| r.pidfd.as_deref())
                    .is_some_and(process_exited)
            };
            // Watched while it holds something with no connection open;
            // forgotten once it no longer does (asked again if it is left
            // so again).
            let (orphaned, done): (Vec<_>, Vec<_>) =
                watched.into_iter().partition(|id| core.is_orphaned(*id));
            let gone = orphaned.into_iter().filter(exited).collect::<Vec<_>>();
            (gone, done)
        };
        {
            let mut w = self.driver.timer.watched();
            for id in gone.iter().chain(&forget) {
                w.remove(id);
            }
        }
        let now = self.now();
        for id in gone {
            let holds = self
                .core()
                .handle(now, input::ProcessExited(id))
                .unwrap_or(0);
            if let Some(m) = &self.metrics {
                m.reclaimed(metrics::Reclaim::ProcessExited, holds);
            }
            tracing::info!(
                unit = %self.settings.name,
                session = id.0,
                holds,
                "session closed: a cut session's process exited; released what it held"
            );
        }
        !self.driver.timer.watched().is_empty()
    }
}

/// Sync and publish blob files written by connections (puts that went to
/// disk), in order.
pub(crate) fn flusher(
    shared: Arc<Shared>,
    rx: std::sync::mpsc::Receiver<(stowage_core::BlobId, Box<dyn crate::disk::BlobWriter>)>,
) {
    while let Ok((blob, writer)) = rx.recv() {
        let Some(d) = &shared.disk else { return };
        let _busy = d.busy.lock().unwrap_or_else(|p| p.into_inner());
        let ok = match writer.finish() {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(error = %e, ?blob, "a put's blob file could not be made durable");
                d.put_failed(blob, &e);
                false
            }
        };
        let _ = shared
            .core()
            .handle(shared.now(), input::DiskWritten { blob, ok });
    }
}

/// Copy to disk the blobs the core hands out to spill (the slab is past
/// its high watermark), a batch at a time, and report each write.
pub(crate) fn spiller(
    shared: Arc<Shared>,
    rx: std::sync::mpsc::Receiver<Vec<stowage_core::SpillJob>>,
) {
    let Some(d) = &shared.disk else { return };
    let mut failing = false;
    // Every spill copies through this one buffer (the thread's, made at
    // its first spill), not an allocation of up to 1 MiB per piece.
    let mut buf = Vec::new();
    while !shared.life.stop.load(Ordering::Relaxed) {
        let jobs = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(jobs) => jobs,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let _busy = d.busy.lock().unwrap_or_else(|p| p.into_inner());
        if shared.life.stop.load(Ordering::SeqCst) {
            break;
        }
        let batch_start = Instant::now();
        let (n_jobs, mut spilled) = (jobs.len(), 0u64);
        for job in jobs {
            let t0 = Instant::now();
            // The core keeps the range allocated until the write is
            // reported, even if the blob is freed meanwhile: this thread
            // reads it alone.
            let written = d.engine.create(job.blob, job.nbytes).and_then(|mut w| {
                for (offset, len) in cut(&job.pieces, job.nbytes) {
                    if buf.len() < (len as usize).min(COPY_CHUNK) {
                        buf.resize((len as usize).min(COPY_CHUNK), 0);
                    }
                    shared
                        .slab
                        .copy_out_chunked(offset, len as usize, &mut buf, |c| w.write(c))
                        .map_err(std::io::Error::other)??;
                }
                w.finish()
            });
            match &written {
                Ok(_) => {
                    d.io.wrote(job.nbytes, t0);
                    spilled += job.nbytes;
                    if let Some(m) = &shared.metrics {
                        m.spilled_bytes.fetch_add(job.nbytes, Ordering::Relaxed);
                    }
                    failing = false
                }
                Err(e) if !failing => {
                    tracing::warn!(error = %e, "spilling to disk failed; data stays in memory");
                    failing = true;
                }
                Err(_) => {}
            }
            let report = input::DiskWritten {
                blob: job.blob,
                ok: written.is_ok(),
            };
            let _ = shared.core().handle(shared.now(), report);
        }
        if n_jobs > 0 {
            if let Some(m) = &shared.metrics {
                m.spill_batches.fetch_add(1, Ordering::Relaxed);
            }
            tracing::info!(
                unit = %shared.settings.name,
                blobs = n_jobs,
                bytes = spilled,
                seconds = batch_start.elapsed().as_secs_f64(),
                "spill batch"
            );
        }
        if failing {
            // Do not spin on a failing disk.
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Carry out compaction's moves, one at a time: copy the blob's pieces, in
/// order, into the one range the core reserved, and report. Nobody else
/// touches either range meanwhile (see the core's `compact` module); a
/// reader that pins the blob during the copy reads the old range, which the
/// core then keeps.
pub(crate) fn compactor(shared: Arc<Shared>, rx: std::sync::mpsc::Receiver<stowage_core::MoveJob>) {
    while !shared.life.stop.load(Ordering::Relaxed) {
        let job = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(job) => job,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let t0 = Instant::now();
        let mut to = job.to;
        let mut ok = true;
        for (from, len) in cut(&job.from, job.nbytes) {
            if let Err(e) = shared.slab.copy_within(from, to, len as usize) {
                tracing::error!(error = %e, blob = ?job.blob, "a compaction move is out of the slab");
                ok = false;
                break;
            }
            to += len;
        }
        shared
            .driver
            .compaction_micros
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        let _ = shared
            .core()
            .handle(shared.now(), input::Moved { blob: job.blob, ok });
    }
}
