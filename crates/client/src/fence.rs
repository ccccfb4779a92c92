//! Fencing (docs/replication.md#fencing): a unit this client takes as
//! down on a directory's word (the Ray launcher's liveness check says its
//! actor is dead) or its caller's ([`Client::unit_gone`]), rather than on
//! proof of its own (a refused connection, another instance), may still
//! serve: a client that never met a failure would read from it rows that
//! were rewritten or cleared around it meanwhile. So before this client
//! goes on without it, it fences it: it asks the unit, if it answers as
//! the instance it knew, to stop serving ([`Request::Fence`]: from before
//! its answer, the unit refuses every request, and it exits). A unit that
//! does not answer is fenced later: the background repairer asks again
//! every second until it is fenced, or found gone.

use std::time::{Duration, Instant};

use stowage_wire::{ErrorCode, Request, Response};

use crate::conn::Conn;
use crate::failure::Failure;
use crate::{lock, Client};

/// The longest a fence waits for its unit to answer.
const FENCE_WAIT: Duration = Duration::from_secs(1);
/// Even with the caller's deadline spent, a fence gets this long (a unit
/// that answers does within it).
const FENCE_FLOOR: Duration = Duration::from_millis(200);

/// What a fence found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Fenced {
    /// The unit answered as the instance known, and stopped serving.
    Stopped,
    /// Nothing listens at the address, another instance answers, or the
    /// unit was fenced already: the instance known serves nothing.
    Gone,
    /// No answer in time: it may serve later.
    Unreached,
    /// The unit refused the fence (this client may not fence it).
    Refused(String),
}

impl Client {
    /// Take `unit` as down on a word that is not proof (a directory's, the
    /// caller's): with copies, fence it first, so that nothing goes on
    /// without it while it still serves (see the module's docs).
    pub(crate) fn take_down_on_word(&self, unit: usize, deadline: Instant) {
        if self.replicas() > 1 && !self.copies.is_down(unit) {
            match self.fence(unit, deadline) {
                Fenced::Stopped => {
                    tracing::warn!("unit {unit} was taken as down while it answered: fenced (it serves nothing any more)");
                }
                Fenced::Gone => {}
                Fenced::Unreached => {
                    tracing::warn!("unit {unit} is taken as down but does not answer: it is fenced once it does (the background repairer asks every second)");
                    let mut due = lock(&self.copies.fences);
                    if !due.contains(&unit) {
                        due.push(unit);
                    }
                }
                Fenced::Refused(why) => {
                    tracing::warn!("unit {unit} is taken as down but refused to be fenced: {why}");
                }
            }
        }
        self.unit_down(unit);
    }

    /// Fence the units taken as down that did not answer then; those that
    /// are fenced or gone now are done. Returns how many are left.
    pub(crate) fn fence_due(&self) -> usize {
        let due: Vec<usize> = lock(&self.copies.fences).clone();
        for unit in due {
            let f = self.fence(unit, Instant::now() + FENCE_WAIT);
            if f != Fenced::Unreached {
                if f == Fenced::Stopped {
                    tracing::warn!("unit {unit}, taken as down earlier, answered again: fenced (it serves nothing any more)");
                }
                lock(&self.copies.fences).retain(|&u| u != unit);
            }
        }
        lock(&self.copies.fences).len()
    }

    /// Whether units taken as down wait to be fenced.
    pub(crate) fn fences_due(&self) -> bool {
        !lock(&self.copies.fences).is_empty()
    }

    /// A connection to `unit` for a request outside any session's state
    /// (a fence, a view's exchange, a rejoin): no namespace, no slab.
    pub(crate) fn control_conn(
        &self,
        unit: usize,
        deadline: Instant,
    ) -> std::result::Result<Conn, Failure> {
        Conn::connect(
            &self.units[unit].addr,
            "",
            false,
            None,
            None,
            Duration::ZERO,
            self.cfg.secret.as_ref(),
            deadline,
        )
    }

    /// Ask `unit` to stop serving, if it answers as the instance this
    /// client knew (or, knowing none, whichever answers), within
    /// [`FENCE_WAIT`] of now or `deadline` (at least [`FENCE_FLOOR`]).
    pub(crate) fn fence(&self, unit: usize, deadline: Instant) -> Fenced {
        let known = lock(&self.units[unit].instance)
            .current
            .or_else(|| self.cfg.instances.get(unit).copied().flatten());
        let left = deadline
            .saturating_duration_since(Instant::now())
            .clamp(FENCE_FLOOR, FENCE_WAIT);
        let end = Instant::now() + left;
        let mut c = match self.control_conn(unit, end) {
            Ok(c) => c,
            Err(f) => return unreached(f),
        };
        if known.is_some_and(|k| k != c.instance_id) {
            return Fenced::Gone;
        }
        let ask = Request::Fence {
            instance: c.instance_id,
        };
        let answer = c.send(&ask, &mut [], end).and_then(|id| c.recv(id, end));
        match answer {
            Ok(Response::Done) => Fenced::Stopped,
            Ok(Response::Error {
                code: ErrorCode::Fenced,
                ..
            }) => Fenced::Gone,
            Ok(Response::Error { message, .. }) => Fenced::Refused(message),
            Ok(_) => Fenced::Refused("an unexpected answer to Fence".into()),
            // No answer (the connection closed or timed out): asked again
            // later, when a refused connection or the unit's refusal tells.
            Err(_) => Fenced::Unreached,
        }
    }
}

/// A fence whose connection could not be made.
fn unreached(f: Failure) -> Fenced {
    match f {
        Failure::Refused(ErrorCode::Fenced, _) => Fenced::Gone,
        Failure::Broken(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            ) =>
        {
            Fenced::Gone
        }
        Failure::Refused(_, why) | Failure::Distrust(why) => Fenced::Refused(why),
        _ => Fenced::Unreached,
    }
}
