//! The nixl transport's byte mover: one-sided NIXL WRITEs and READs
//! between a registered staging buffer and the unit's registered slab.
//!
//! A put copies its segments into the connection's staging buffer and
//! WRITEs them in one transfer (values of [`NixlOptions::zero_copy_min`]
//! and more go from the caller's memory, registered for the call); a get
//! READs every value of the unit in one transfer, either into memory it
//! then lends the caller ([`Lent`]: a buffer of the client's registered
//! receive pool, zero-copy) or into the staging buffer, then copies them
//! out (a get into the caller's own memory). The staging buffer is registered once
//! per connection (grown, and registered again, only when a call needs
//! more), never per call. Every transfer completes within the caller's
//! deadline or fails; one that may still be running when it fails keeps
//! the connection open — and with it the unit's reservation or pin of the
//! range — until it has ended (see [`crate::transport::Settle`]).

use std::collections::HashMap;
use std::ops::Range as Span;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use stowage_nixl::{Agent, NixlError, Op, Range, Staging, Transfer, WaitError};

use crate::failure::Failure;
use crate::lent::{Lent, RecvPool, LENT_ALIGN, RECV_POOL_MAX};
use crate::one_sided::{Mover, Settle};
use crate::pieces::{PieceWrite, Places};

/// Test failpoints, from `STOWAGE_FAILPOINTS` (comma-separated names).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Failpoints {
    /// `nixl-write-in-flight`: every nixl WRITE reports failure when it is
    /// waited on, as a transfer cut off while it may still be running, and
    /// is never counted as ended.
    pub nixl_write_in_flight: bool,
    /// `nixl-read-in-flight`: the same for every nixl READ.
    pub nixl_read_in_flight: bool,
    /// `repair-gate=N`: a repair, once it has read a batch from its
    /// source, creates `stowage-repair-gate-N.reached` in the temporary
    /// directory and waits (at most 60 s) until `stowage-repair-gate-N`
    /// is there before it sends the batch on: a test can clear rows in
    /// between.
    pub repair_gate: Option<u32>,
}

/// The smallest staging buffer a connection registers.
const STAGING_MIN: usize = 1 << 20;

/// What makes a client use nixl for units it does not reach over shm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NixlOptions {
    /// Refuse to run unless UCX is held to RDMA transports (`UCX_TLS`; see
    /// [`stowage_nixl::check_rdma`]). Default true. Off, nixl may run over
    /// UCX tcp (tests, hosts without RDMA NICs).
    pub require_rdma: bool,
    /// A put's values of at least this many bytes go out zero-copy: their
    /// memory is registered for the call and WRITten from where it is;
    /// smaller ones are copied into the connection's registered staging
    /// buffer first. Default [`ZERO_COPY_MIN`]. Gets never READ into the
    /// caller's memory: into a buffer of the client's registered receive
    /// pool that they lend the caller (zero-copy), or into the staging
    /// buffer and then copied (see docs/nixl.md).
    pub zero_copy_min: u64,
}

/// Default [`NixlOptions::zero_copy_min`]: 1 MiB. Registering (and
/// deregistering) a touched 1 MiB buffer cost 4–10 µs over UCX tcp+cma on
/// a 2-core VM, against about 100 µs to copy it; `stowage bench --nixl`
/// measures both. RDMA registration pins pages and costs more: measure it
/// there before lowering this.
pub const ZERO_COPY_MIN: u64 = 1 << 20;

impl Default for NixlOptions {
    fn default() -> Self {
        Self {
            require_rdma: true,
            zero_copy_min: ZERO_COPY_MIN,
        }
    }
}

/// A unit's agent as this client loaded it: its name, and a handle that
/// lives as long as a mover uses it.
type LoadedPeer = (String, Weak<String>);

/// A client's NIXL agent, made on first use and shared by its
/// connections; what it knows of each unit's agent.
pub(crate) struct NixlClient {
    options: NixlOptions,
    agent: Mutex<Option<Result<Agent, NixlError>>>,
    /// Loaded unit metadata: its bytes → the unit agent's name, while a
    /// mover uses it. A unit invalidates this agent once its last
    /// connection to the unit has ended (docs/nixl.md), so metadata no
    /// mover uses any more is loaded afresh for the next connection.
    peers: Mutex<HashMap<Vec<u8>, LoadedPeer>>,
    /// What a unit loads to reach this agent (its connection information),
    /// made once.
    introduction: Mutex<Option<(String, Vec<u8>)>>,
    failpoints: Failpoints,
    recv: Arc<RecvPool>,
}

impl NixlClient {
    pub(crate) fn new(options: NixlOptions, failpoints: Failpoints) -> Self {
        Self {
            options,
            agent: Mutex::new(None),
            peers: Mutex::new(HashMap::new()),
            introduction: Mutex::new(None),
            failpoints,
            recv: Arc::new(RecvPool::new(RECV_POOL_MAX)),
        }
    }

    pub(crate) fn agent(&self) -> Result<Agent, NixlError> {
        let mut a = crate::lock(&self.agent);
        if let Some(r) = a.as_ref() {
            return r.clone();
        }
        let made = (|| {
            if self.options.require_rdma {
                stowage_nixl::check_rdma(std::env::var("UCX_TLS").ok().as_deref())?;
            }
            let mut id = [0u8; 8];
            getrandom::fill(&mut id).map_err(|e| NixlError::Failed {
                what: "agent name",
                detail: e.to_string(),
            })?;
            // No progress thread: the client polls its own transfers.
            Agent::new(
                &format!(
                    "stowage-client-{}-{:016x}",
                    std::process::id(),
                    u64::from_le_bytes(id)
                ),
                None,
            )
        })();
        *a = Some(made.clone());
        made
    }

    /// This client's agent name and what a unit loads to reach it, told
    /// in `NixlInfo` so that the unit can invalidate this agent once its
    /// connections have ended.
    pub(crate) fn introduction(&self) -> Result<(String, Vec<u8>), NixlError> {
        let mut i = crate::lock(&self.introduction);
        if let Some(i) = i.as_ref() {
            return Ok(i.clone());
        }
        let agent = self.agent()?;
        let made = (agent.name().to_owned(), agent.connection_metadata()?);
        *i = Some(made.clone());
        Ok(made)
    }

    /// A mover for a connection to the unit that answered `NixlInfo` with
    /// `metadata` and `slab_addr`.
    pub(crate) fn mover(&self, metadata: &[u8], slab_addr: u64) -> Result<NixlMover, NixlError> {
        let agent = self.agent()?;
        let peer = {
            let mut peers = crate::lock(&self.peers);
            let live = peers.get(metadata).map(|(name, p)| (name, p.upgrade()));
            match live {
                Some((_, Some(p))) => p,
                known => {
                    if let Some((name, None)) = known {
                        // No connection to that unit was left, so the unit
                        // may have closed its side of ours: connect anew.
                        // (Forgotten only here, under the lock, so that no
                        // other connection loses a fresh load.)
                        agent.forget_remote(name);
                    }
                    let name = agent.load_remote(metadata)?;
                    let p = Arc::new(name.clone());
                    peers.insert(metadata.to_vec(), (name, Arc::downgrade(&p)));
                    p
                }
            }
        };
        Ok(NixlMover {
            agent,
            peer,
            slab_addr,
            staging: None,
            fetched: HashMap::new(),
            pending: None,
            failpoints: self.failpoints,
            zero_copy_min: usize::try_from(self.options.zero_copy_min).unwrap_or(usize::MAX),
            reading: None,
            recv: self.recv.clone(),
            lending: None,
        })
    }
}

/// One connection's side of nixl: its staging buffer and the unit's slab.
pub(crate) struct NixlMover {
    agent: Agent,
    /// The unit's agent name, shared by the movers of its connections.
    peer: Arc<String>,
    slab_addr: u64,
    staging: Option<Arc<Staging>>,
    /// Where each value of the last fetch lies in the staging buffer.
    fetched: HashMap<u64, usize>,
    /// A transfer that failed while it may still be running.
    pending: Option<Pending>,
    failpoints: Failpoints,
    zero_copy_min: usize,
    /// A READ left under way by `start_fetch`.
    reading: Option<Transfer>,
    recv: Arc<RecvPool>,
    /// The receive buffer the last fetch READ into (to lend), and where
    /// each of its values lies in it.
    lending: Option<(Arc<Staging>, Vec<Span<usize>>, usize)>,
}

struct Pending {
    transfer: Transfer,
    /// A failpoint's: never counted as ended.
    stuck: bool,
}

impl Settle for Pending {
    fn settled(&mut self) -> bool {
        !self.stuck && !matches!(self.transfer.poll(), Ok(false))
    }
}

fn failure(op: &str, e: NixlError, in_flight: bool) -> Failure {
    let f = Failure::Broken(std::io::Error::other(format!("nixl {op}: {e}")));
    if in_flight {
        f.in_flight()
    } else {
        f
    }
}

impl NixlMover {
    /// The staging buffer, at least `len` bytes, for this process alone
    /// (no transfer holds it).
    fn staging(&mut self, len: usize) -> Result<&mut Staging, Failure> {
        let fits = self
            .staging
            .as_ref()
            .is_some_and(|s| s.len() >= len && Arc::strong_count(s) == 1);
        if !fits {
            let size = len.max(STAGING_MIN).next_power_of_two();
            let s = Staging::new(&self.agent, size).map_err(|e| failure("staging", e, false))?;
            self.staging = Some(Arc::new(s));
        }
        self.staging
            .as_mut()
            .and_then(Arc::get_mut)
            .ok_or_else(|| Failure::Busy("the staging buffer is still in use".into()))
    }

    /// Post one READ of `places` (see [`Mover::start_fetch`]): `Ok(true)`
    /// when it is still under way (in `self.reading`), `Ok(false)` when it
    /// is done (or there was nothing to do). Into the staging buffer,
    /// every range (a split value's parts too) where [`Mover::read`] finds
    /// it by its slab offset.
    fn post_fetch(&mut self, places: &Places, lend: bool) -> Result<bool, Failure> {
        self.fetched.clear();
        self.lending = None;
        if lend {
            return self.start_lent_fetch(places);
        }
        let ranges = places.ranges();
        let mut xfer = Vec::with_capacity(ranges.len());
        let mut at = 0usize;
        for &(offset, len) in ranges {
            if len == 0 || self.fetched.contains_key(&offset) {
                continue;
            }
            let len =
                usize::try_from(len).map_err(|_| Failure::invalid("value larger than memory"))?;
            self.fetched.insert(offset, at);
            xfer.push(Range {
                local: at,
                remote: self.slab_addr + offset,
                len,
            });
            at += len;
        }
        if xfer.is_empty() {
            return Ok(false);
        }
        self.staging(at)?;
        let Some(staging) = &self.staging else {
            return Ok(false);
        };
        let t = self
            .agent
            .post(Op::Read, staging, &xfer, &self.peer)
            .map_err(|e| failure("READ", e, false))?;
        if t.ended() && !self.failpoints.nixl_read_in_flight {
            // Done within the post (a cma copy).
            return Ok(false);
        }
        self.reading = Some(t);
        Ok(true)
    }

    /// Start one READ of every range into a buffer of the receive pool,
    /// each value at its own 64-byte-aligned place (a split value's parts
    /// back to back there, so that it is one span), to be lent to the
    /// caller ([`Mover::take_lent`]) once it has ended.
    fn start_lent_fetch(&mut self, places: &Places) -> Result<bool, Failure> {
        let (spans, xfer, at) = lent_layout(places, self.slab_addr)?;
        let buf = Arc::new(
            self.recv
                .take(&self.agent, at)
                .map_err(|e| failure("receive buffer", e, false))?,
        );
        let running = if xfer.is_empty() {
            false
        } else {
            let t = self
                .agent
                .post(Op::Read, &buf, &xfer, &self.peer)
                .map_err(|e| failure("READ", e, false))?;
            let running = !t.ended() || self.failpoints.nixl_read_in_flight;
            if running {
                self.reading = Some(t);
            }
            running
        };
        self.lending = Some((buf, spans, at));
        Ok(running)
    }

    /// Wait for the posted transfer `t` within `deadline`; one still
    /// running then is kept (see [`Mover::take_pending`]).
    fn finish(&mut self, op: Op, mut t: Transfer, deadline: Instant) -> Result<(), Failure> {
        let what = match op {
            Op::Write => "WRITE",
            Op::Read => "READ",
        };
        let stuck = match op {
            Op::Write => self.failpoints.nixl_write_in_flight,
            Op::Read => self.failpoints.nixl_read_in_flight,
        };
        if stuck {
            self.pending = Some(Pending {
                transfer: t,
                stuck: true,
            });
            return Err(failure(
                what,
                NixlError::Failed {
                    what: "failpoint",
                    detail: "nixl-write-in-flight".into(),
                },
                true,
            ));
        }
        match t.wait(deadline) {
            Ok(()) => Ok(()),
            Err(WaitError::Failed(e)) => Err(failure(what, e, false)),
            Err(WaitError::Deadline) => {
                self.pending = Some(Pending {
                    transfer: t,
                    stuck: false,
                });
                Err(failure(
                    what,
                    NixlError::Failed {
                        what: "transfer",
                        detail: "still running at the deadline".into(),
                    },
                    true,
                ))
            }
        }
    }
}

/// A lending fetch's layout: each value's span in the buffer, the
/// transfer's ranges, the buffer's length.
type LentLayout = (Vec<Span<usize>>, Vec<Range>, usize);

/// Where a lending fetch READs `places` in its buffer: one span per value
/// (64-byte aligned), a split value's parts back to back within its span;
/// the transfer's ranges (empty ones left out) against the unit's slab at
/// `slab_addr`; the buffer's length.
fn lent_layout(places: &Places, slab_addr: u64) -> Result<LentLayout, Failure> {
    let mut spans = Vec::with_capacity(places.len());
    let mut xfer = Vec::with_capacity(places.ranges().len());
    let mut at = 0usize;
    for parts in places.values() {
        at = at.next_multiple_of(LENT_ALIGN);
        let start = at;
        for &(offset, len) in parts {
            let len =
                usize::try_from(len).map_err(|_| Failure::invalid("value larger than memory"))?;
            if len > 0 {
                xfer.push(Range {
                    local: at,
                    remote: slab_addr + offset,
                    len,
                });
            }
            at += len;
        }
        spans.push(start..at);
    }
    Ok((spans, xfer, at))
}

impl Mover for NixlMover {
    fn name(&self) -> &'static str {
        "nixl"
    }

    fn write(&mut self, writes: &[PieceWrite<'_>], deadline: Instant) -> Result<(), Failure> {
        let total: usize = writes
            .iter()
            .flat_map(|(_, segs)| segs.iter().map(|s| s.len()))
            .sum();
        if total == 0 {
            return Ok(());
        }
        // Large values go from where they are (registered for this call);
        // the rest is gathered into the staging buffer. One WRITE for all
        // the blob's pieces (a value cut at a piece's end is two ranges).
        let agent = self.agent.clone();
        let mut direct = Vec::new();
        let mut staged_segs = Vec::new();
        for (offset, segments) in writes {
            let mut at = self.slab_addr + offset;
            for s in segments.iter().filter(|s| !s.is_empty()) {
                let reg = (s.len() >= self.zero_copy_min)
                    .then(|| agent.register(s))
                    .and_then(|r| {
                        r.map_err(|e| tracing::debug!(error = %e, "nixl: staging a value that did not register"))
                            .ok()
                    });
                match reg {
                    Some(r) => direct.push((r, at)),
                    None => staged_segs.push((*s, at)),
                }
                at += s.len() as u64;
            }
        }
        let staged_len: usize = staged_segs.iter().map(|(s, _)| s.len()).sum();
        let mut staged = Vec::with_capacity(staged_segs.len());
        if staged_len > 0 {
            let buf = self.staging(staged_len)?.as_mut_slice();
            let mut local = 0;
            for (s, remote) in &staged_segs {
                buf[local..local + s.len()].copy_from_slice(s);
                staged.push(Range {
                    local,
                    remote: *remote,
                    len: s.len(),
                });
                local += s.len();
            }
        }
        let direct: Vec<(&stowage_nixl::Registered<'_>, u64)> =
            direct.iter().map(|(r, at)| (r, *at)).collect();
        let staging = if staged.is_empty() {
            None
        } else {
            self.staging.as_ref()
        };
        let t = self
            .agent
            .post_write(staging, &staged, &direct, &self.peer)
            .map_err(|e| failure("WRITE", e, false))?;
        // The registrations go when this returns: a WRITE still running
        // then can only fail or send bytes into the unit's reserved range,
        // which nothing publishes (stowage_nixl::Agent::post_write).
        self.finish(Op::Write, t, deadline)
    }

    fn start_fetch(&mut self, places: &Places, lend: bool) -> Result<bool, Failure> {
        self.post_fetch(places, lend)
    }

    fn finish_fetch(&mut self, deadline: Instant) -> Result<(), Failure> {
        match self.reading.take() {
            Some(t) => self.finish(Op::Read, t, deadline),
            None => Ok(()),
        }
    }

    fn lends(&self) -> bool {
        true
    }

    fn take_lent(&mut self) -> Option<(Lent, Vec<Span<usize>>)> {
        let (staging, spans, len) = self.lending.take()?;
        // The READ has ended (its transfer, which held the other reference,
        // is gone): the buffer is this call's alone.
        let staging = Arc::try_unwrap(staging).ok()?;
        Some((Lent::new(staging, len, Arc::downgrade(&self.recv)), spans))
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
        if dst.is_empty() {
            return Ok(());
        }
        let (Some(&at), Some(s)) = (self.fetched.get(&offset), &self.staging) else {
            return Err(format!("value at {offset} was not read"));
        };
        let src = s
            .as_slice()
            .get(at..at + dst.len())
            .ok_or_else(|| format!("value at {offset} lies outside what was read"))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn take_pending(&mut self) -> Option<Box<dyn Settle>> {
        // A READ left under way when the call gave up (another unit failed
        // first) may still be running, as one that missed its deadline.
        if let Some(transfer) = self.reading.take() {
            if !transfer.ended() {
                return Some(Box::new(Pending {
                    transfer,
                    stuck: false,
                }));
            }
        }
        self.pending.take().map(|p| Box::new(p) as Box<dyn Settle>)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_wire::Placed;

    fn found(offset: u64, len: u64, parts: Vec<(u64, u64)>) -> Placed {
        Placed {
            offset,
            len,
            meta: Default::default(),
            on_disk: false,
            parts,
        }
    }

    /// A lending fetch gives each value one aligned span; a split value's
    /// parts are READ back to back into its span.
    #[test]
    fn lent_layout_puts_a_split_values_parts_together() {
        let mut places = Places::default();
        places.push(&found(4096, 10, vec![]));
        places.push(&found(64, 100, vec![(64, 36), (8192, 64)]));
        places.push(&found(128, 0, vec![]));
        places.push(&found(1 << 20, 5, vec![]));
        let (spans, xfer, len) = lent_layout(&places, 1 << 40).unwrap();
        assert_eq!(spans, vec![0..10, 64..164, 192..192, 192..197]);
        assert_eq!(
            xfer,
            vec![
                Range {
                    local: 0,
                    remote: (1 << 40) + 4096,
                    len: 10
                },
                Range {
                    local: 64,
                    remote: (1 << 40) + 64,
                    len: 36
                },
                Range {
                    local: 100,
                    remote: (1 << 40) + 8192,
                    len: 64
                },
                Range {
                    local: 192,
                    remote: (1 << 40) + (1 << 20),
                    len: 5
                },
            ]
        );
        assert_eq!(len, 197);
    }
}
