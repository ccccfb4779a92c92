//! Copies of rows on several units ([`ClientConfig::replicas`]): which
//! units hold the copies of what a unit holds, and which failures of one
//! copy send a read on to the next. The put (`put.rs`), the get
//! (`blobs.rs`) and the clear (`blobs.rs`) ask here.

use std::time::Instant;

#[cfg(doc)]
use crate::ClientConfig;
use crate::{Client, Error};

impl Client {
    /// How many units hold a copy of each row ([`ClientConfig::replicas`]).
    pub fn replicas(&self) -> usize {
        self.cfg.replicas
    }

    /// The unit of copy `i` of what `unit` holds: copy 0 is `unit` itself,
    /// copy `i` the `i`-th unit after it (wrapping round).
    pub fn copy_unit(&self, unit: usize, i: usize) -> usize {
        (unit + i) % self.units.len()
    }

    /// The units holding the copies of what `unit` holds, copy 0 first.
    pub fn copies_of(&self, unit: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.cfg.replicas).map(move |i| self.copy_unit(unit, i))
    }

    /// The deadline of one try at copy `i`: an even share of what is left
    /// of `deadline` among the copies not yet tried, so that a copy that
    /// does not answer (a stopped unit) leaves the others time.
    pub(crate) fn copy_deadline(&self, deadline: Instant, i: usize) -> Instant {
        let left = self.cfg.replicas.saturating_sub(i).max(1) as u32;
        let now = Instant::now();
        now + deadline.saturating_duration_since(now) / left
    }
}

/// Whether a read that failed with `e` on one copy may read the next: the
/// copy is gone (its unit dead or restarted), its unit does not answer,
/// a transfer from it failed, or its stored bytes are corrupt. Not for
/// errors another copy would give alike (the caller's input, its
/// authorization, a key collision).
pub(crate) fn next_copy_may_serve(e: &Error) -> bool {
    matches!(
        e,
        Error::LostKeys { .. }
            | Error::Timeout { .. }
            | Error::TransferFailed { .. }
            | Error::Unreachable { .. }
            | Error::Corrupt { .. }
            | Error::Io(_)
    )
}
