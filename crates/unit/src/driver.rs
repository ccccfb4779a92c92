//! The core's owner: the core behind its lock, and the timer side of
//! what drives it (when the core next needs [`stowage_core::input::Timeout`], the
//! processes it asked to watch). Driving it (carrying out its actions,
//! running the timer) is `drive.rs`'s.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use stowage_core::UnitCore;

/// The timer side of the driver: when the core next needs
/// [`stowage_core::input::Timeout`], and the processes it asked the unit to watch.
pub(crate) struct Timer {
    /// The core's [`UnitCore::poll_timeout`], in nanoseconds of
    /// `Shared::now` (`u64::MAX`: none).
    pub(crate) wake_at: AtomicU64,
    /// Set, and the condition notified, to wake the timer thread early.
    pub(crate) woken: (Mutex<bool>, std::sync::Condvar),
    /// Sessions whose process the core asked to watch
    /// ([`stowage_core::Action::CheckProcess`]).
    watched: Mutex<std::collections::HashSet<stowage_core::SessionId>>,
}

impl Timer {
    pub(crate) fn new() -> Self {
        Self {
            wake_at: AtomicU64::new(u64::MAX),
            woken: (Mutex::new(false), std::sync::Condvar::new()),
            watched: Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// Wake the timer thread by `at` (or at once when `at` is earlier than
    /// what it sleeps until).
    pub(crate) fn schedule(&self, at: Option<Duration>) {
        let Some(at) = at else { return };
        let at = u64::try_from(at.as_nanos()).unwrap_or(u64::MAX - 1);
        if self.wake_at.fetch_min(at, Ordering::SeqCst) > at {
            self.wake();
        }
    }

    /// The sessions whose process is watched, locked.
    pub(crate) fn watched(
        &self,
    ) -> MutexGuard<'_, std::collections::HashSet<stowage_core::SessionId>> {
        self.watched.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn wake(&self) {
        let mut w = self.woken.0.lock().unwrap_or_else(|p| p.into_inner());
        *w = true;
        self.woken.1.notify_one();
    }
}

/// The core and what drives it: the timer that wakes it, the compactor's
/// channel and its time spent copying.
pub(crate) struct Driver {
    pub(crate) core: Mutex<UnitCore>,
    /// When to wake the core, and which processes to watch.
    pub(crate) timer: Timer,
    /// Compaction's moves, for the compactor thread.
    pub(crate) moves: Mutex<std::sync::mpsc::Sender<stowage_core::MoveJob>>,
    /// Time the compactor spent copying, in microseconds.
    pub(crate) compaction_micros: AtomicU64,
}

impl Driver {
    /// A driver of `core`, sending compaction's moves to `moves`.
    pub(crate) fn new(
        core: UnitCore,
        moves: std::sync::mpsc::Sender<stowage_core::MoveJob>,
    ) -> Self {
        Self {
            core: Mutex::new(core),
            timer: Timer::new(),
            moves: Mutex::new(moves),
            compaction_micros: AtomicU64::new(0),
        }
    }
}
