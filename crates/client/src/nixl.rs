//! The nixl transport's byte mover: one-sided NIXL WRITEs and READs
//! between a registered staging buffer and the unit's registered slab.
//!
//! A put copies its segments into the connection's staging buffer and
//! WRITEs them in one transfer; a get READs every value of the unit in one
//! transfer, then copies them out. The staging buffer is registered once
//! per connection (grown, and registered again, only when a call needs
//! more), never per call. Every transfer completes within the caller's
//! deadline or fails; one that may still be running when it fails keeps
//! the connection open — and with it the unit's reservation or pin of the
//! range — until it has ended (see [`crate::transport::Settle`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use stowage_nixl::{Agent, NixlError, Op, Range, Staging, Transfer, WaitError};

use crate::conn::ConnError;
use crate::transport::{Mover, OpFailure, Settle};

/// The smallest staging buffer a connection registers.
const STAGING_MIN: usize = 1 << 20;

/// What makes a client use nixl for units it does not reach over shm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NixlOptions {
    /// Refuse to run unless UCX is held to RDMA transports (`UCX_TLS`; see
    /// [`stowage_nixl::check_rdma`]). Default true. Off, nixl may run over
    /// UCX tcp (tests, hosts without RDMA NICs).
    pub require_rdma: bool,
}

impl Default for NixlOptions {
    fn default() -> Self {
        Self { require_rdma: true }
    }
}

/// Test failpoints of the nixl path, from `STOWAGE_FAILPOINTS`
/// (comma-separated): `nixl-write-in-flight` makes every WRITE report
/// failure right after it is posted, as a transfer cut off while it may
/// still be running, and never counts it as ended.
#[derive(Clone, Copy, Debug, Default)]
struct Failpoints {
    write_in_flight: bool,
}

impl Failpoints {
    fn from_env() -> Self {
        let set = std::env::var("STOWAGE_FAILPOINTS").unwrap_or_default();
        Self {
            write_in_flight: set.split(',').any(|f| f.trim() == "nixl-write-in-flight"),
        }
    }
}

/// A client's NIXL agent, made on first use and shared by its
/// connections; what it knows of each unit's agent.
pub(crate) struct NixlClient {
    options: NixlOptions,
    agent: Mutex<Option<Result<Agent, NixlError>>>,
    /// Loaded unit metadata: its bytes → the unit agent's name.
    peers: Mutex<HashMap<Vec<u8>, String>>,
    failpoints: Failpoints,
}

impl NixlClient {
    pub(crate) fn new(options: NixlOptions) -> Self {
        Self {
            options,
            agent: Mutex::new(None),
            peers: Mutex::new(HashMap::new()),
            failpoints: Failpoints::from_env(),
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
            Agent::new(&format!(
                "stowage-client-{}-{:016x}",
                std::process::id(),
                u64::from_le_bytes(id)
            ))
        })();
        *a = Some(made.clone());
        made
    }

    /// A mover for a connection to the unit that answered `NixlInfo` with
    /// `metadata` and `slab_addr`.
    pub(crate) fn mover(&self, metadata: &[u8], slab_addr: u64) -> Result<NixlMover, NixlError> {
        let agent = self.agent()?;
        let peer = {
            let mut peers = crate::lock(&self.peers);
            match peers.get(metadata) {
                Some(p) => p.clone(),
                None => {
                    let p = agent.load_remote(metadata)?;
                    peers.insert(metadata.to_vec(), p.clone());
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
        })
    }
}

/// One connection's side of nixl: its staging buffer and the unit's slab.
pub(crate) struct NixlMover {
    agent: Agent,
    peer: String,
    slab_addr: u64,
    staging: Option<Arc<Staging>>,
    /// Where each value of the last fetch lies in the staging buffer.
    fetched: HashMap<u64, usize>,
    /// A transfer that failed while it may still be running.
    pending: Option<Pending>,
    failpoints: Failpoints,
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

fn failure(op: &str, e: NixlError, in_flight: bool) -> OpFailure {
    OpFailure::conn(
        ConnError::Broken(std::io::Error::other(format!("nixl {op}: {e}"))),
        in_flight,
    )
}

impl NixlMover {
    /// The staging buffer, at least `len` bytes, for this process alone
    /// (no transfer holds it).
    fn staging(&mut self, len: usize) -> Result<&mut Staging, OpFailure> {
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
            .ok_or_else(|| OpFailure::Unit {
                code: stowage_wire::ErrorCode::Internal,
                message: "the staging buffer is still in use".into(),
            })
    }

    /// Post `ranges` and wait for them, within `deadline`.
    fn transfer(&mut self, op: Op, ranges: &[Range], deadline: Instant) -> Result<(), OpFailure> {
        let what = match op {
            Op::Write => "WRITE",
            Op::Read => "READ",
        };
        let Some(staging) = &self.staging else {
            return Ok(());
        };
        let mut t = self
            .agent
            .post(op, staging, ranges, &self.peer)
            .map_err(|e| failure(what, e, false))?;
        if op == Op::Write && self.failpoints.write_in_flight {
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

impl Mover for NixlMover {
    fn name(&self) -> &'static str {
        "nixl"
    }

    fn write(
        &mut self,
        offset: u64,
        segments: &[&[u8]],
        deadline: Instant,
    ) -> Result<(), OpFailure> {
        let total: usize = segments.iter().map(|s| s.len()).sum();
        if total == 0 {
            return Ok(());
        }
        let range = Range {
            local: 0,
            remote: self.slab_addr + offset,
            len: total,
        };
        let staging = self.staging(total)?.as_mut_slice();
        let mut at = 0;
        for s in segments {
            staging[at..at + s.len()].copy_from_slice(s);
            at += s.len();
        }
        self.transfer(Op::Write, &[range], deadline)
    }

    fn fetch(&mut self, ranges: &[(u64, u64)], deadline: Instant) -> Result<(), OpFailure> {
        self.fetched.clear();
        let mut xfer = Vec::with_capacity(ranges.len());
        let mut at = 0usize;
        for &(offset, len) in ranges {
            if len == 0 || self.fetched.contains_key(&offset) {
                continue;
            }
            let len = usize::try_from(len).map_err(|_| OpFailure::Unit {
                code: stowage_wire::ErrorCode::InvalidRequest,
                message: "value larger than memory".into(),
            })?;
            self.fetched.insert(offset, at);
            xfer.push(Range {
                local: at,
                remote: self.slab_addr + offset,
                len,
            });
            at += len;
        }
        if xfer.is_empty() {
            return Ok(());
        }
        self.staging(at)?;
        self.transfer(Op::Read, &xfer, deadline)
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

    fn read_scatter(&self, reads: Vec<(u64, &mut [u8])>) -> Result<(), String> {
        reads.into_iter().try_for_each(|(o, d)| self.read(o, d))
    }

    fn batch(&self, _total: usize) -> bool {
        true
    }

    fn take_pending(&mut self) -> Option<Box<dyn Settle>> {
        self.pending.take().map(|p| Box::new(p) as Box<dyn Settle>)
    }
}
