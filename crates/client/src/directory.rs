//! The directory: who the units are, and — only after a failure — whether
//! a unit is dead, restarted or merely slow.

use std::sync::Arc;
use std::time::{Duration, Instant};

use stowage_wire::auth::Secret;

use crate::conn::{Conn, UnitAddr};
use crate::failure::Failure;

/// What the directory says of a unit after an operation on it failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// The same unit instance answers: its blobs are still there.
    Alive,
    /// A new instance answers at the address: the old one's memory is gone.
    Restarted,
    /// Nothing answers at the address: the unit and its blobs are gone.
    Dead,
    /// Something holds the address but does not answer in time (stopped,
    /// overloaded): its blobs may still be there.
    Unresponsive,
}

/// Answers liveness questions about units. Asked only after a failure,
/// never on the operation path.
pub trait Directory: Send + Sync {
    /// `instance`: the instance id the client knew for this unit.
    fn liveness(&self, unit: usize, addr: &UnitAddr, instance: u128, deadline: Instant)
        -> Liveness;

    /// Whether a word this directory has says `unit` is dead, asked after
    /// a call to the unit ran out of time (a unit that does not answer,
    /// whose address refuses nothing: a host lost, or cut off): a
    /// cluster manager's word (the Ray launcher's liveness check), never a
    /// probe of the unit. A client with copies then goes on without the
    /// unit, fencing it once it answers (docs/replication.md#fencing).
    /// Default: no such word (`false`).
    fn says_dead(&self, unit: usize) -> bool {
        let _ = unit;
        false
    }

    /// This directory, proving `secret` when it connects to units itself:
    /// [`crate::Client::connect`] asks it with the client's secret and
    /// uses what it returns. `None` (the default): keep this directory as
    /// it is (one that does not connect to units, or has a secret).
    fn with_secret(&self, secret: &Secret) -> Option<Arc<dyn Directory>> {
        let _ = secret;
        None
    }
}

/// A directory that asks the unit's address itself: a refused connection
/// means dead, a handshake with another instance id means restarted. Fits
/// units started by hand or by the local data plane; a cluster launcher
/// (Ray) supplies its own.
#[derive(Clone, Debug, Default)]
pub struct ProbeDirectory {
    /// Longest probe. Default 1 s.
    pub max_wait: Option<Duration>,
    /// The shared secret a probe proves (units with a secret answer no
    /// one else). [`crate::Client::connect`] gives a probe without one the
    /// client's ([`Directory::with_secret`]).
    pub secret: Option<Secret>,
}

/// How long a probe waits before asking again after an inconclusive try.
const PROBE_RETRY: Duration = Duration::from_millis(20);

impl Directory for ProbeDirectory {
    fn liveness(
        &self,
        _unit: usize,
        addr: &UnitAddr,
        instance: u128,
        deadline: Instant,
    ) -> Liveness {
        let max_wait = self.max_wait.unwrap_or(Duration::from_secs(1));
        // Even with the caller's deadline spent, a dead unit refuses at once;
        // give the probe a floor so that it can tell.
        let left = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(100), max_wait);
        let end = Instant::now() + left;
        loop {
            let probe = Conn::connect(
                addr,
                "",
                false,
                None,
                None,
                Duration::ZERO,
                self.secret.as_ref(),
                end,
            );
            match probe {
                Ok(c) if c.instance_id == instance => return Liveness::Alive,
                Ok(_) => return Liveness::Restarted,
                // Fenced: it serves nothing any more, and is exiting.
                Err(Failure::Refused(stowage_wire::ErrorCode::Fenced, _)) => return Liveness::Dead,
                // Nothing listens at the address (refused, or the socket
                // file is gone): dead.
                Err(Failure::Broken(e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
                    ) =>
                {
                    return Liveness::Dead
                }
                // Another breakage (a unit that is exiting resets the
                // connections its listener had queued): not proof either
                // way; ask again shortly, within the probe's time.
                Err(Failure::Broken(_)) if Instant::now() + PROBE_RETRY < end => {
                    std::thread::sleep(PROBE_RETRY)
                }
                // Anything else: it does not answer as a unit should.
                Err(_) => return Liveness::Unresponsive,
            }
        }
    }

    fn with_secret(&self, secret: &Secret) -> Option<Arc<dyn Directory>> {
        if self.secret.is_some() {
            return None;
        }
        Some(Arc::new(ProbeDirectory {
            max_wait: self.max_wait,
            secret: Some(secret.clone()),
        }))
    }
}
