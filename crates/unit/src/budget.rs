//! The unit's budget for the memory it holds outside its slab on behalf
//! of its connections (`--outside-slab-budget`): request headers being
//! read and read whole, reply headers being written, and every
//! per-connection buffer that grows (a connection's input buffer, its
//! replies the peer has not taken, its ring's entry and reply scratch).
//!
//! Each connection holds a [`Charge`]: its buffers' capacity, rounded up
//! to [`GRANULE`], counted in two parts. The first [`SMALL_HOLD`] bytes
//! of every connection come from the *headroom* (a quarter of the
//! budget); what a connection holds past them (a large frame, reserved
//! whole as soon as its prefix says how large it is) comes from the
//! budget itself. A read that would take a part past its bound is not
//! made: the connection waits (backpressure, [`Budget::waits`]) and is
//! tried again; a connection whose next frame is small reads from the
//! headroom, so large frames in progress never stall it. Memory already
//! taken (a reply encoded for a request that was read) is counted as it
//! is, past the bounds if it must be: its connection reads nothing more
//! until the peer takes it.
//!
//! When a connection has waited for [`GRACE`], the connection holding the
//! most *stalled* bytes (bytes held by a connection that has made no
//! progress, read or written, for [`STALLED`]) is cut, one every
//! [`CUT_SPACING`] at most ([`Budget::cuts`]). Nothing on the read path
//! takes a lock: a charge that changes is one atomic add per part; the
//! list of holders is locked when a connection starts and ends, and when
//! a cut is chosen.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Charges are counted in these (a connection whose buffers change size
/// within one granule touches no shared counter).
pub(crate) const GRANULE: usize = 64 << 10;
/// What each connection holds from the headroom: a frame of this size,
/// and its reply, never wait for large frames in progress.
pub(crate) const SMALL_HOLD: usize = 2 * GRANULE;
/// A connection made to wait this long makes the unit cut the holder of
/// the most stalled bytes.
pub(crate) const GRACE: Duration = Duration::from_secs(1);
/// Bytes of a connection that has neither read nor written for this long
/// are stalled (a cut may take them).
pub(crate) const STALLED: Duration = Duration::from_millis(250);
/// Cuts come at most this often (a cut connection's memory is given back
/// by its serving thread, a moment later).
pub(crate) const CUT_SPACING: Duration = Duration::from_millis(20);
/// How often a serving thread retries the connections that wait for the
/// budget.
pub(crate) const RETRY: Duration = Duration::from_millis(5);

/// A unit's budget for the bytes it holds outside its slab.
pub(crate) struct Budget {
    /// Bytes the large parts may take together.
    limit: usize,
    /// Bytes the small parts may take together.
    headroom: usize,
    large: AtomicUsize,
    small: AtomicUsize,
    waits: AtomicU64,
    cuts: AtomicU64,
    holders: Mutex<Holders>,
}

#[derive(Default)]
struct Holders {
    list: Vec<Option<Arc<Holder>>>,
    free: Vec<usize>,
    /// When the last cut was made (the unit's clock).
    last_cut: Option<Duration>,
}

/// What the budget knows of one connection (for choosing a cut).
pub(crate) struct Holder {
    held: AtomicUsize,
    /// Since when (ms on the unit's clock) it made no progress while
    /// holding bytes; `u64::MAX`: it is making progress, or holds none.
    quiet_since: AtomicU64,
    cut: AtomicBool,
    /// Its place in the list, once registered.
    index: AtomicUsize,
    /// Asks its serving thread to cut it.
    wake: OnceLock<Box<dyn Fn() + Send + Sync>>,
}

fn round_up(n: usize) -> usize {
    n.div_ceil(GRANULE) * GRANULE
}

fn split(bytes: usize) -> (usize, usize) {
    let b = round_up(bytes);
    let s = b.min(SMALL_HOLD);
    (s, b - s)
}

impl Budget {
    /// A budget of `limit` bytes for large frames (rounded up to a
    /// granule, and at least one frame of `max_frame`), with a quarter of
    /// it again as the headroom for small ones.
    pub(crate) fn new(limit: u64, max_frame: usize) -> Arc<Self> {
        let limit = round_up(
            usize::try_from(limit)
                .unwrap_or(usize::MAX / 2)
                .max(max_frame),
        );
        Arc::new(Self {
            limit,
            headroom: round_up((limit / 4).max(SMALL_HOLD)),
            large: AtomicUsize::new(0),
            small: AtomicUsize::new(0),
            waits: AtomicU64::new(0),
            cuts: AtomicU64::new(0),
            holders: Mutex::default(),
        })
    }

    /// Bytes held now.
    pub(crate) fn used(&self) -> u64 {
        (self.large.load(Relaxed) + self.small.load(Relaxed)) as u64
    }

    /// The most bytes held at once before reads wait: the budget and its
    /// headroom.
    pub(crate) fn limit(&self) -> u64 {
        (self.limit + self.headroom) as u64
    }

    /// Times a connection was made to wait for the budget.
    pub(crate) fn waits(&self) -> u64 {
        self.waits.load(Relaxed)
    }

    /// Connections cut to free the budget.
    pub(crate) fn cuts(&self) -> u64 {
        self.cuts.load(Relaxed)
    }

    pub(crate) fn waited(&self) {
        self.waits.fetch_add(1, Relaxed);
    }

    /// A new connection's charge (holding nothing).
    pub(crate) fn charge(self: &Arc<Self>) -> Charge {
        Charge {
            budget: self.clone(),
            small: 0,
            large: 0,
            holder: Arc::new(Holder {
                held: AtomicUsize::new(0),
                quiet_since: AtomicU64::new(u64::MAX),
                cut: AtomicBool::new(false),
                index: AtomicUsize::new(usize::MAX),
                wake: OnceLock::new(),
            }),
        }
    }

    /// Cut the connection holding the most stalled bytes (at `now`, the
    /// unit's clock), unless a cut was made within [`CUT_SPACING`];
    /// whether one was.
    pub(crate) fn cut_stalled(&self, now: Duration) -> bool {
        let mut h = self.holders.lock().unwrap_or_else(|p| p.into_inner());
        if h.last_cut.is_some_and(|t| now < t + CUT_SPACING) {
            return false;
        }
        let now_ms = now.as_millis() as u64;
        let stalled_ms = STALLED.as_millis() as u64;
        let victim = h
            .list
            .iter()
            .flatten()
            .filter(|x| {
                let q = x.quiet_since.load(Relaxed);
                !x.cut.load(Relaxed)
                    && x.held.load(Relaxed) > 0
                    && q != u64::MAX
                    && now_ms.saturating_sub(q) >= stalled_ms
                    && x.wake.get().is_some()
            })
            .max_by_key(|x| x.held.load(Relaxed))
            .cloned();
        let Some(v) = victim else {
            return false;
        };
        v.cut.store(true, Relaxed);
        h.last_cut = Some(now);
        drop(h);
        self.cuts.fetch_add(1, Relaxed);
        tracing::warn!(
            held = v.held.load(Relaxed),
            used = self.used(),
            limit = self.limit(),
            "the outside-slab budget is spent and a connection has waited for it: \
             the connection holding the most stalled bytes is cut"
        );
        if let Some(w) = v.wake.get() {
            w();
        }
        true
    }
}

/// One connection's share of the [`Budget`]; given back when dropped.
pub(crate) struct Charge {
    budget: Arc<Budget>,
    small: usize,
    large: usize,
    holder: Arc<Holder>,
}

impl Charge {
    /// Bytes it holds (whole granules).
    pub(crate) fn held(&self) -> usize {
        self.small + self.large
    }

    /// Hold `bytes` if the budget has room for what that adds; false (and
    /// nothing changed) when it has not.
    pub(crate) fn try_hold(&mut self, bytes: usize) -> bool {
        let (s, l) = split(bytes);
        let b = &self.budget;
        let grow_small = s.saturating_sub(self.small);
        if grow_small > 0 && b.small.fetch_add(grow_small, Relaxed) + grow_small > b.headroom {
            b.small.fetch_sub(grow_small, Relaxed);
            return false;
        }
        let grow_large = l.saturating_sub(self.large);
        if grow_large > 0 && b.large.fetch_add(grow_large, Relaxed) + grow_large > b.limit {
            b.large.fetch_sub(grow_large, Relaxed);
            if grow_small > 0 {
                b.small.fetch_sub(grow_small, Relaxed);
            }
            return false;
        }
        self.small += grow_small;
        self.large += grow_large;
        self.set(bytes);
        true
    }

    /// Hold `bytes`, within the bounds or not (memory taken already, or
    /// given back).
    pub(crate) fn set(&mut self, bytes: usize) {
        let (s, l) = split(bytes);
        let b = &self.budget;
        if s != self.small {
            if s > self.small {
                b.small.fetch_add(s - self.small, Relaxed);
            } else {
                b.small.fetch_sub(self.small - s, Relaxed);
            }
            self.small = s;
        }
        if l != self.large {
            if l > self.large {
                b.large.fetch_add(l - self.large, Relaxed);
            } else {
                b.large.fetch_sub(self.large - l, Relaxed);
            }
            self.large = l;
        }
        let held = s + l;
        if self.holder.held.load(Relaxed) != held {
            self.holder.held.store(held, Relaxed);
        }
    }

    /// It read or wrote: its bytes are not stalled.
    pub(crate) fn progressed(&self) {
        if self.holder.quiet_since.load(Relaxed) != u64::MAX {
            self.holder.quiet_since.store(u64::MAX, Relaxed);
        }
    }

    /// It waits (for its peer, or for the budget) at `now` (the unit's
    /// clock): its bytes are stalled from now unless it waited already.
    pub(crate) fn quiet(&self, now: impl FnOnce() -> Duration) {
        if self.held() > 0 && self.holder.quiet_since.load(Relaxed) == u64::MAX {
            self.holder
                .quiet_since
                .store(now().as_millis() as u64, Relaxed);
        }
    }

    /// Whether the budget chose to cut it.
    pub(crate) fn is_cut(&self) -> bool {
        self.holder.cut.load(Relaxed)
    }

    /// It was chosen while its serving thread could not cut it: it may be
    /// chosen again.
    pub(crate) fn spare(&self) {
        self.holder.cut.store(false, Relaxed);
    }

    /// Make it a candidate for cuts: `wake` asks its serving thread to
    /// cut it.
    pub(crate) fn register(&self, wake: Box<dyn Fn() + Send + Sync>) {
        if self.holder.wake.set(wake).is_err() {
            return;
        }
        let mut h = self
            .budget
            .holders
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let i = match h.free.pop() {
            Some(i) => {
                h.list[i] = Some(self.holder.clone());
                i
            }
            None => {
                h.list.push(Some(self.holder.clone()));
                h.list.len() - 1
            }
        };
        self.holder.index.store(i, Relaxed);
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.set(0);
        let i = self.holder.index.load(Relaxed);
        if i != usize::MAX {
            let mut h = self
                .budget
                .holders
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if let Some(slot) = h.list.get_mut(i) {
                *slot = None;
                h.free.push(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn small_frames_read_from_the_headroom_while_large_ones_wait() {
        let b = Budget::new(64 << 20, 0);
        let mut big = b.charge();
        assert!(big.try_hold(64 * MIB));
        let mut other_big = b.charge();
        assert!(!other_big.try_hold(2 * MIB), "the budget is spent");
        assert_eq!(other_big.held(), 0, "a refused charge holds nothing");
        let mut small = b.charge();
        assert!(
            small.try_hold(4096),
            "a small frame reads from the headroom"
        );
        assert_eq!(b.used() as usize, 64 * MIB + GRANULE);
        drop(big);
        assert!(other_big.try_hold(2 * MIB), "the budget came back");
        drop(other_big);
        drop(small);
        assert_eq!(b.used(), 0, "every charge is given back");
    }

    #[test]
    fn the_headroom_is_bounded_too() {
        let b = Budget::new(64 << 20, 0);
        let headroom = (16 * MIB) / SMALL_HOLD;
        let mut held: Vec<Charge> = (0..headroom).map(|_| b.charge()).collect();
        for c in &mut held {
            assert!(c.try_hold(SMALL_HOLD));
        }
        let mut one_more = b.charge();
        assert!(!one_more.try_hold(1));
        held.pop();
        assert!(one_more.try_hold(1));
    }

    #[test]
    fn memory_taken_already_is_counted_past_the_bounds() {
        let b = Budget::new(64 << 20, 0);
        let mut c = b.charge();
        c.set(100 * MIB);
        assert_eq!(b.used() as usize, 100 * MIB);
        let mut d = b.charge();
        assert!(!d.try_hold(1 << 20));
        c.set(0);
        assert!(d.try_hold(1 << 20));
    }

    #[test]
    fn a_budget_holds_one_largest_frame_at_least() {
        let b = Budget::new(1 << 20, 64 << 20);
        let mut c = b.charge();
        assert!(c.try_hold((64 << 20) + 12));
    }

    #[test]
    fn the_cut_takes_the_holder_of_the_most_stalled_bytes() {
        let b = Budget::new(64 << 20, 0);
        let cut = Arc::new(Mutex::new(Vec::new()));
        let mut charges = Vec::new();
        for (i, bytes) in [
            (0usize, 8 * MIB),
            (1, 32 * MIB),
            (2, 16 * MIB),
            (3, 40 * MIB),
        ] {
            let mut c = b.charge();
            c.set(bytes);
            let cut = cut.clone();
            c.register(Box::new(move || cut.lock().unwrap().push(i)));
            charges.push(c);
        }
        let t0 = Duration::from_secs(10);
        for (i, c) in charges.iter().enumerate() {
            c.quiet(|| t0);
            if i == 3 {
                // The largest holder is making progress: not stalled.
                c.progressed();
            }
        }
        // Nobody stalled long enough yet.
        assert!(!b.cut_stalled(t0 + STALLED / 2));
        let t = t0 + STALLED;
        assert!(b.cut_stalled(t));
        assert_eq!(*cut.lock().unwrap(), vec![1]);
        assert!(!b.cut_stalled(t), "cuts are spaced");
        assert!(b.cut_stalled(t + CUT_SPACING));
        assert!(b.cut_stalled(t + 2 * CUT_SPACING));
        assert!(
            !b.cut_stalled(t + 3 * CUT_SPACING),
            "the one progressing stays"
        );
        assert_eq!(*cut.lock().unwrap(), vec![1, 2, 0]);
        assert_eq!(b.cuts(), 3);
        drop(charges);
        assert_eq!(b.used(), 0);
    }
}
