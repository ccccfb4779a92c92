//! The unit's one session registry (beside the core's sessions): the
//! token each session was given at Hello, its client's pid and pidfd (one
//! per client process, shared by its sessions), whether it mapped the slab
//! or moves bytes with nixl, and the join logic that finds or opens a
//! session and attaches a connection to it. A record goes when the core
//! forgets its session ([`stowage_core::Action::SessionEnded`]), and a
//! client process's pidfd with its last session's record.

use std::collections::HashMap;
use std::ops::DerefMut;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use stowage_core::{input, UnitCore};

use crate::handler;
use crate::metrics::UnitMetrics;

/// Who is at the other end of a connection, as the kernel says
/// (SO_PEERCRED, Unix sockets only).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Peer {
    pub(crate) uid: Option<u32>,
    pub(crate) pid: Option<i32>,
}

/// Sessions by the token given at Hello, and their client processes.
#[derive(Default)]
pub(crate) struct Sessions {
    /// Sessions by the token given at Hello.
    pub(crate) by_token: Mutex<HashMap<u128, SessionRec>>,
    /// Client processes' pidfds, shared by their sessions.
    pidfds: Mutex<HashMap<i32, Weak<OwnedFd>>>,
    /// Sessions opened (to forget stale records now and then).
    joins: AtomicU64,
    /// Sessions the core has forgotten ([`Action::SessionEnded`]) whose
    /// records are still in `by_token`: taken out by whoever next holds
    /// it ([`Sessions::ended`], [`Sessions::forget_ended`]). Always the
    /// innermost lock.
    ///
    /// [`Action::SessionEnded`]: stowage_core::Action::SessionEnded
    ended: Mutex<Vec<stowage_core::SessionId>>,
}

/// What a join needs of the rest of the unit.
pub(crate) struct JoinCtx<'a> {
    pub(crate) max_sessions: usize,
    /// The unit's name, for logs.
    pub(crate) name: &'a str,
    pub(crate) metrics: Option<&'a UnitMetrics>,
    pub(crate) now: Duration,
}

/// A session as the server knows it: its id in the core and, for a
/// Unix-socket peer, its process (to learn when it is certainly gone).
pub(crate) struct SessionRec {
    pub(crate) id: stowage_core::SessionId,
    pub(crate) pid: Option<i32>,
    /// Its process's pidfd, shared by every session of that process
    /// ([`Shared::pidfd_of`]): one file descriptor per client process.
    pub(crate) pidfd: Option<Arc<std::os::fd::OwnedFd>>,
    /// The slab was handed to this session: its peer may copy by itself.
    pub(crate) mapped: bool,
    /// A connection of this session asked for nixl: its peer moves bytes
    /// with one-sided transfers, and so may its other connections.
    pub(crate) one_sided: bool,
}

impl Sessions {
    /// Join the session `token` names (when it still exists and, for a
    /// Unix-socket peer, belongs to the same process) or start a new one;
    /// attach a connection to it. Returns the session's token and the
    /// connection's owner id.
    pub(crate) fn join<G: DerefMut<Target = UnitCore>>(
        &self,
        core: impl FnOnce() -> G,
        ctx: &JoinCtx<'_>,
        token: Option<u128>,
        peer: Peer,
        maps: bool,
        namespace: &str,
    ) -> Result<(u128, stowage_core::Owner), stowage_wire::Response> {
        let refused = |e: stowage_core::CoreError| handler::error_response(&e);
        let mut sessions = self.by_token.lock().unwrap_or_else(|p| p.into_inner());
        let mut core = core();
        let joined = token.filter(|t| {
            sessions
                .get(t)
                .is_some_and(|r| r.pid == peer.pid && core.has_session(r.id))
        });
        let token = match joined {
            Some(t) => t,
            None => {
                // Forget sessions the core has forgotten (now and then:
                // a unit holds thousands).
                let joins = self.joins.fetch_add(1, Ordering::Relaxed);
                if sessions.len() >= ctx.max_sessions || joins.is_multiple_of(1024) {
                    sessions.retain(|_, r| core.has_session(r.id));
                }
                if sessions.len() >= ctx.max_sessions {
                    if let Some(m) = ctx.metrics {
                        m.turned_away();
                    }
                    return Err(stowage_wire::Response::Error {
                        code: stowage_wire::ErrorCode::Busy,
                        message: format!(
                            "the unit holds {} client sessions, its --max-sessions \
                             (units.max_sessions); try again later",
                            sessions.len()
                        ),
                    });
                }
                let mut b = [0u8; 16];
                getrandom::fill(&mut b)
                    .map_err(|e| refused(stowage_core::CoreError::Invalid(e.to_string())))?;
                let token = u128::from_le_bytes(b);
                let id = core.handle(ctx.now, input::OpenSession).map_err(refused)?;
                if let Some(m) = ctx.metrics {
                    m.session_opened();
                }
                tracing::info!(unit = %ctx.name, session = id.0, namespace, pid = ?peer.pid, maps, "session opened");
                sessions.insert(
                    token,
                    SessionRec {
                        id,
                        pid: peer.pid,
                        pidfd: None,
                        mapped: false,
                        one_sided: false,
                    },
                );
                token
            }
        };
        let Some(rec) = sessions.get_mut(&token) else {
            return Err(refused(stowage_core::CoreError::Invalid(
                "session vanished".into(),
            )));
        };
        if maps && rec.pidfd.is_none() {
            // Taken while the peer is connected, so the pid is its own.
            rec.pidfd = peer.pid.and_then(|pid| self.pidfd_of(pid));
            if rec.pidfd.is_none() {
                tracing::warn!(
                    pid = ?peer.pid,
                    "no pidfd for a client that maps the slab: if the unit cuts its connection, what it holds is kept until the unit stops"
                );
            }
        }
        rec.mapped |= maps;
        let now = ctx.now;
        let attach = input::Attach {
            session: rec.id,
            mapped: rec.mapped,
        };
        let owner = core.handle(now, attach).map_err(refused)?;
        if rec.one_sided {
            core.handle(now, input::MakeOneSided(owner))
                .map_err(refused)?;
        }
        Ok((token, owner))
    }

    /// The core has forgotten `ids` ([`stowage_core::Action::SessionEnded`]):
    /// drop their records, and with the last session of a client process
    /// its pidfd, now if `by_token` is free. Returns whether some are left
    /// for [`Sessions::forget_ended`] (it is held, maybe by this very
    /// thread, which may be driving the core inside a join).
    pub(crate) fn ended(&self, ids: impl IntoIterator<Item = stowage_core::SessionId>) -> bool {
        self.ended
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(ids);
        match self.by_token.try_lock() {
            Ok(mut sessions) => self.forget(&mut sessions),
            Err(std::sync::TryLockError::Poisoned(p)) => self.forget(&mut p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => return true,
        }
        false
    }

    /// Drop the records of the sessions [`Sessions::ended`] left (waits
    /// for `by_token`; never call it while holding it).
    pub(crate) fn forget_ended(&self) {
        if self
            .ended
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
        {
            return;
        }
        let mut sessions = self.by_token.lock().unwrap_or_else(|p| p.into_inner());
        self.forget(&mut sessions);
    }

    /// Drop the records of the ended sessions from `sessions` (the locked
    /// `by_token`): their pidfds close with the last session of their
    /// process, and that process leaves `pidfds`.
    fn forget(&self, sessions: &mut HashMap<u128, SessionRec>) {
        let ended = std::mem::take(&mut *self.ended.lock().unwrap_or_else(|p| p.into_inner()));
        if ended.is_empty() {
            return;
        }
        let ended: std::collections::HashSet<_> = ended.into_iter().collect();
        let mut pids = Vec::new();
        sessions.retain(|_, r| {
            let keep = !ended.contains(&r.id);
            if !keep {
                pids.extend(r.pid);
            }
            keep
        });
        if !pids.is_empty() {
            let mut known = self.pidfds.lock().unwrap_or_else(|p| p.into_inner());
            for pid in pids {
                if known.get(&pid).is_some_and(|w| w.strong_count() == 0) {
                    known.remove(&pid);
                }
            }
        }
    }

    /// A pidfd of process `pid`, taken while one of its connections is
    /// open (so the pid is its own): the one its other sessions hold when
    /// that process is still running, so a client process with many
    /// sessions costs one file descriptor. A cached pidfd whose process
    /// has exited is never handed out: the pid may be another process's
    /// now.
    pub(crate) fn pidfd_of(&self, pid: i32) -> Option<Arc<std::os::fd::OwnedFd>> {
        let mut known = self.pidfds.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(fd) = known.get(&pid).and_then(std::sync::Weak::upgrade) {
            if !process_exited(&fd) {
                return Some(fd);
            }
        }
        let raw = rustix::process::Pid::from_raw(pid)?;
        let fd =
            Arc::new(rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()).ok()?);
        if known.len() >= 64 && known.len().is_power_of_two() {
            known.retain(|_, w| w.strong_count() > 0);
        }
        known.insert(pid, Arc::downgrade(&fd));
        Some(fd)
    }
}

/// Whether the process of a pidfd has exited (the pidfd is readable).
pub(crate) fn process_exited(fd: &std::os::fd::OwnedFd) -> bool {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(fd, PollFlags::IN)];
    matches!(poll(&mut fds, Some(&rustix::event::Timespec::default())), Ok(n) if n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_core::SessionId;

    /// An ended session's record goes, and its process's pidfd with the
    /// last of that process's sessions; while the registry is held (a
    /// join driving the core) they wait for `forget_ended`.
    #[test]
    fn an_ended_sessions_record_and_pidfd_go_even_while_the_registry_is_held() {
        let s = Sessions::default();
        let pid = i32::try_from(std::process::id()).unwrap();
        let fd = s.pidfd_of(pid).expect("a pidfd of this process");
        let closed = Arc::downgrade(&fd);
        let rec = |id, fd| SessionRec {
            id: SessionId(id),
            pid: Some(pid),
            pidfd: Some(fd),
            mapped: true,
            one_sided: false,
        };
        {
            let mut by_token = s.by_token.lock().unwrap();
            by_token.insert(10, rec(1, fd.clone()));
            by_token.insert(20, rec(2, fd));
        }
        let tokens = |s: &Sessions| {
            let mut t: Vec<u128> = s.by_token.lock().unwrap().keys().copied().collect();
            t.sort_unstable();
            t
        };
        {
            let _joining = s.by_token.lock().unwrap();
            assert!(s.ended([SessionId(1)]), "taken while the registry is held");
        }
        assert_eq!(tokens(&s), [10, 20]);
        s.forget_ended();
        assert_eq!(tokens(&s), [20]);
        assert!(
            closed.upgrade().is_some(),
            "its process's other session holds it"
        );
        assert!(!s.ended([SessionId(2)]));
        assert!(tokens(&s).is_empty());
        assert!(
            closed.upgrade().is_none(),
            "the pidfd outlived its sessions"
        );
        assert!(s.pidfds.lock().unwrap().is_empty());
    }
}
