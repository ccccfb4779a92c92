//! The one way to drive the core, in the shape of quinn-proto: every input
//! goes in through [`UnitCore::handle`], with the driver's clock; every
//! output comes out by polling — [`UnitCore::poll_action`] for the I/O the
//! driver does on the core's behalf, [`UnitCore::poll_timeout`] for the
//! next instant the core needs [`input::Timeout`]. Read-only queries
//! (stats, listings, sizes) are `&self` accessors.

use super::*;

/// I/O the driver does for the core, taken with [`UnitCore::poll_action`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Copy a blob from the slab to its disk file, then report
    /// [`input::DiskWritten`]. If the blob is freed meanwhile its range is
    /// kept until then (the driver reads it alone), and its file is deleted
    /// through an [`Action::DeleteFile`] after the report.
    Spill(SpillJob),
    /// The blob is gone: remove its disk file.
    DeleteFile(BlobId),
    /// Compaction: copy the blob's bytes to the range named (nobody can
    /// touch either while the copy runs), then report [`input::Moved`].
    /// One move is under way at a time; see the `compact` module for the
    /// fencing rule.
    Move(MoveJob),
    /// The session holds something although none of its connections is
    /// open: watch its process, and report [`input::ProcessExited`] once it
    /// has certainly exited. Asked again each time the session is left so.
    CheckProcess(SessionId),
    /// A claim that waited ([`op::Claim`] answered
    /// [`ClaimAnswer::Waiting`]) is answered: send `lease` to `owner`'s
    /// connection as the answer of the claim tagged `tag` (an empty lease
    /// when its `wait_until` came first).
    Claimed(ClaimReply),
    /// The core has forgotten the session (its last connection ended with
    /// nothing held, what it kept was released, or its process exited):
    /// [`UnitCore::has_session`] is false from now on, and whatever the
    /// driver keeps for it (its token, its process's pidfd) can go.
    SessionEnded(SessionId),
}

/// A request goes straight to the module that applies its op (see
/// `apply_op` in `input.rs`).
impl<O: Op> Input for Request<O> {
    type Answer = O::Answer;
    fn apply(
        self,
        core: &mut UnitCore,
        now: Time,
        t: input::sealed::Token,
    ) -> Result<O::Answer, CoreError> {
        self.op.apply(core, now, self.owner, t)
    }
}

impl UnitCore {
    /// Apply one input at `now` (the driver's clock, never going back):
    /// answers what that input answers ([`Input::Answer`]).
    pub fn handle<I: Input>(&mut self, now: Time, input: I) -> Result<I::Answer, CoreError> {
        // Any input may change what should spill.
        self.tier.spill_dirty = true;
        self.last_input = now;
        input.apply(self, now, input::sealed::Token)
    }

    /// The next thing the driver must do for the core, if any: the queue
    /// filled as the work was done, then what is due lazily, each behind a
    /// flag kept by its module — spills (worked out here, once per input,
    /// while the slab is past its high watermark) and compaction's next
    /// move (while free memory may have become scattered). When nothing is
    /// due it calls into no other module.
    pub fn poll_action(&mut self) -> Option<Action> {
        if let Some(a) = self.actions.pop_front() {
            return Some(a);
        }
        if std::mem::take(&mut self.tier.spill_dirty) && self.needs_spill() {
            for job in self.spill_jobs() {
                self.actions.push_back(Action::Spill(job));
            }
            if let Some(a) = self.actions.pop_front() {
                return Some(a);
            }
        }
        if !self.compactor.dirty || self.compactor.moving.is_some() {
            return None;
        }
        self.next_move().map(Action::Move)
    }

    /// The next instant the core needs [`input::Timeout`] (a quarantine or
    /// a fenced hold's nixl quarantine ends, a claim's lease expires or a
    /// waiting claim's `wait_until` comes), or none. No hold is ever
    /// reclaimed by time otherwise. With no timer at all it calls into no
    /// other module.
    pub fn poll_timeout(&self) -> Option<Time> {
        let claims = self.claims.next_deadline();
        if self.quarantined.ranges.is_empty() && self.holds.fenced.is_empty() {
            return claims;
        }
        match (self.next_expiry(), claims) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}
