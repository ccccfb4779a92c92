//! Memory a get lends its caller ([`Lent`]): buffers of the client's
//! registered receive pool that a nixl READ filled, kept for the next gets
//! when given back; and the size classes they (and a connection's spares)
//! come in.

use std::collections::BTreeMap;
use std::sync::{Mutex, Weak};

use stowage_nixl::{Agent, NixlError, Staging};

use crate::lock;

/// The size class whose spares a put of `n` bytes uses: powers of two up
/// to 4 KiB, then eight classes per doubling (at most 1/8 of a spare goes
/// unused).
pub(crate) fn spare_class(n: u64) -> u64 {
    if n <= 4096 {
        return n.next_power_of_two().max(64);
    }
    let step = 1u64 << (63 - n.leading_zeros() - 3);
    n.div_ceil(step) * step
}

/// Values in a lent buffer start on multiples of this (numpy's alignment
/// for any dtype).
pub(crate) const LENT_ALIGN: usize = 64;

/// The smallest buffer of the receive pool.
const RECV_MIN: usize = 64 << 10;

/// How many bytes of free buffers the receive pool keeps registered for
/// the next gets; buffers given back past it are deregistered and unmapped.
pub const RECV_POOL_MAX: usize = 1 << 30;

/// Registered buffers that gets READ into and lend their callers
/// ([`Lent`]), kept when given back so that the next get of a similar size
/// neither registers nor faults in memory (an RL loop gets the same sizes
/// every step). Sizes are classes of eight per doubling.
pub(crate) struct RecvPool {
    free: Mutex<(BTreeMap<usize, Vec<Staging>>, usize)>,
    limit: usize,
}

impl RecvPool {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            free: Mutex::new((BTreeMap::new(), 0)),
            limit,
        }
    }

    /// A registered buffer of at least `len` bytes, for this caller alone.
    pub(crate) fn take(&self, agent: &Agent, len: usize) -> Result<Staging, NixlError> {
        let class = spare_class(len.max(RECV_MIN) as u64) as usize;
        {
            let mut free = lock(&self.free);
            if let Some(s) = free.0.get_mut(&class).and_then(Vec::pop) {
                free.1 -= s.len();
                return Ok(s);
            }
        }
        Staging::new(agent, class)
    }

    fn give_back(&self, s: Staging) {
        let mut free = lock(&self.free);
        if free.1 + s.len() <= self.limit {
            free.1 += s.len();
            free.0.entry(s.len()).or_default().push(s);
        }
    }
}

/// Memory a get lends its caller: a buffer of the client's registered
/// receive pool that a nixl READ filled, so the values were never copied.
/// It is the caller's alone (nothing else reads or writes it) and goes
/// back to the pool when dropped. A READ that failed while it may still be
/// running never lends its buffer: the buffer stays with the transfer
/// until it has ended.
pub struct Lent {
    staging: Option<Staging>,
    len: usize,
    pool: Weak<RecvPool>,
}

impl Lent {
    /// `len` bytes of `staging` lent, back to `pool` when dropped.
    pub(crate) fn new(staging: Staging, len: usize, pool: Weak<RecvPool>) -> Self {
        Lent {
            staging: Some(staging),
            len,
            pool,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lent({} bytes)", self.len)
    }
}

impl std::ops::Deref for Lent {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.staging
            .as_ref()
            .map_or(&[], |s| &s.as_slice()[..self.len])
    }
}

impl std::ops::DerefMut for Lent {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        self.staging
            .as_mut()
            .map_or(&mut [], |s| &mut s.as_mut_slice()[..len])
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let (Some(s), Some(pool)) = (self.staging.take(), self.pool.upgrade()) {
            pool.give_back(s);
        }
    }
}
