//! A worker's request rings: each polled ring is served a quantum per
//! turn while its client is busy, and parked (the client then kicks it)
//! once idle for its linger.

use std::time::{Duration, Instant};

use super::{Worker, QUANTUM};
use crate::conn::{Ended, RingStep};

/// The longest a polled request ring stays polled with no request before
/// it is parked: a ring lingers for `--spin`, or for four of its client's
/// recent gaps between requests when that is longer (a client that
/// alternates between units comes back to each after the others' round
/// trips, and a parked ring costs it a kick and a wake-up), never longer
/// than this.
const RING_LINGER_MAX: Duration = Duration::from_micros(500);

/// How long an idle polled ring of `slot` is still polled: `spin`, or
/// four of its recent gaps between requests when that is longer, at most
/// [`RING_LINGER_MAX`]; zero when `spin` is zero (adaptive polling off).
fn ring_linger(spin: Duration, gap: Duration) -> Duration {
    if spin.is_zero() {
        return Duration::ZERO;
    }
    spin.max(gap.saturating_mul(4))
        .min(RING_LINGER_MAX.max(spin))
}

impl Worker {
    /// Serve every polled ring a quantum; park those idle for their
    /// linger ([`ring_linger`] of `idle`, the `--spin`).
    /// Whether any request was served.
    pub(super) fn poll_rings(&mut self, idle: Duration) -> bool {
        let mut worked = false;
        let mut i = 0;
        while i < self.rings.len() {
            let idx = self.rings[i];
            let Some(Some(s)) = self.slots.get_mut(idx) else {
                self.rings.swap_remove(i);
                continue;
            };
            if s.away {
                i += 1;
                continue;
            }
            let Some(mut conn) = s.conn.take() else {
                i += 1;
                continue;
            };
            let gen = s.gen;
            let ran =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| conn.pump_ring(QUANTUM)));
            let step = match ran {
                Ok(step) => step,
                Err(panic) => {
                    self.end(idx, conn, Ended::panicked(panic));
                    continue;
                }
            };
            match step {
                RingStep::Served(n) => {
                    let now = Instant::now();
                    let mut parked = false;
                    if n > 0 {
                        worked = true;
                        s.ring_idle = None;
                        if let Some(last) = s.ring_last {
                            let gap = now.duration_since(last);
                            if gap < RING_LINGER_MAX {
                                s.ring_gap = (s.ring_gap * 3 + gap) / 4;
                            }
                        }
                        s.ring_last = Some(now);
                    } else {
                        let since = *s.ring_idle.get_or_insert(now);
                        if now.duration_since(since) >= ring_linger(idle, s.ring_gap)
                            && conn.park_ring()
                        {
                            parked = true;
                        }
                    }
                    s.conn = Some(conn);
                    if parked {
                        s.polled = false;
                        s.ring_idle = None;
                        self.rings.swap_remove(i);
                        continue;
                    }
                    i += 1;
                }
                RingStep::Pool => {
                    worked = true;
                    s.ring_idle = None;
                    self.send_to_pool(idx, gen, conn);
                    i += 1;
                }
                RingStep::End(e) => {
                    tracing::warn!(error = %e, "a request ring broke the protocol; its connection is cut");
                    self.end(idx, conn, Ended::Ran(Err(e)));
                }
            }
        }
        worked
    }

    /// Poll the ring of `idx` (its client kicked it, or it was just made).
    pub(super) fn poll_ring(&mut self, idx: usize) {
        if let Some(Some(s)) = self.slots.get_mut(idx) {
            if !s.polled {
                s.polled = true;
                s.ring_idle = None;
                self.rings.push(idx);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_lingers_for_its_clients_gap_within_bounds() {
        let us = Duration::from_micros;
        // No gap seen yet: --spin.
        assert_eq!(ring_linger(us(50), Duration::ZERO), us(50));
        // A client that comes back every 40 us keeps its ring for 160 us.
        assert_eq!(ring_linger(us(50), us(40)), us(160));
        // Never past the bound, never under --spin.
        assert_eq!(ring_linger(us(50), us(400)), RING_LINGER_MAX);
        assert_eq!(ring_linger(us(800), us(400)), us(800));
        // --spin 0 turns adaptive polling off: rings park at once.
        assert_eq!(ring_linger(Duration::ZERO, us(40)), Duration::ZERO);
    }
}
