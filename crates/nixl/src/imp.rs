//! The nixl path, over nixl-sys (its `stub-api` build: libnixl_capi.so is
//! loaded at run time, so building needs no NIXL install).

use std::sync::Arc;

use nixl_sys as sys;
use stowage_shm::Slab;

use crate::{wait_until, NixlError, Op, Range, WaitError};

fn failed(what: &'static str) -> impl FnOnce(sys::NixlError) -> NixlError {
    move |e| NixlError::Failed {
        what,
        detail: e.to_string(),
    }
}

/// Memory this process maps, described for registration.
#[derive(Debug)]
struct Region {
    addr: usize,
    len: usize,
}

impl sys::MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl sys::NixlDescriptor for Region {
    fn mem_type(&self) -> sys::MemType {
        sys::MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

/// A NIXL agent with its UCX backend. Cheap to clone (shared state).
#[derive(Clone)]
pub struct Agent {
    inner: sys::Agent,
    backend: Arc<sys::Backend>,
    name: String,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("name", &self.name).finish()
    }
}

impl Agent {
    /// An agent named `name` (unique among the agents that meet) with a UCX
    /// backend in its default, peer-failure-detecting mode.
    ///
    /// `progress`: run NIXL's progress thread, sleeping this long between
    /// rounds (a unit's agent, which must answer peers it never calls);
    /// `None`: no thread, the agent progresses only when it is polled (a
    /// client's, which polls its own transfers). NIXL's default, a thread
    /// that never sleeps, takes a core for each agent.
    pub fn new(name: &str, progress: Option<std::time::Duration>) -> Result<Self, NixlError> {
        if sys::is_stub() {
            return Err(NixlError::NotLoaded);
        }
        let cfg = sys::AgentConfig {
            enable_prog_thread: progress.is_some(),
            pthr_delay_us: progress.map_or(0, |d| d.as_micros().max(1) as u64),
            ..sys::AgentConfig::default()
        };
        let inner = sys::Agent::new_configured(name, &cfg).map_err(failed("agent"))?;
        let (_mems, params) = inner.get_plugin_params("UCX").map_err(failed(
            "UCX plugin (set NIXL_PLUGIN_DIR to the wheel's plugins)",
        ))?;
        let backend = inner.create_backend("UCX", &params).map_err(failed(
            "UCX backend (UCX_TLS must allow a transport with peer error handling: \
             an RDMA transport, or tcp)",
        ))?;
        Ok(Self {
            inner,
            backend: Arc::new(backend),
            name: name.to_owned(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// What a peer loads to reach this agent's registered memory.
    pub fn metadata(&self) -> Result<Vec<u8>, NixlError> {
        self.inner.get_local_md().map_err(failed("metadata"))
    }

    /// Load a peer's metadata; returns the peer's agent name.
    pub fn load_remote(&self, metadata: &[u8]) -> Result<String, NixlError> {
        self.inner
            .load_remote_md(metadata)
            .map_err(failed("loading a peer's metadata"))
    }

    /// Drop what is known of a peer (its connection is torn down).
    pub fn forget_remote(&self, name: &str) {
        if let Err(e) = self.invalidate_remote(name) {
            tracing::debug!(peer = name, error = %e, "nixl: forgetting a peer");
        }
    }

    /// Invalidate what this agent loaded of `name` ([`Agent::load_remote`]):
    /// NIXL unloads its metadata and closes this agent's UCX endpoints to
    /// it. Where UCX wired the peer's own connection to this agent onto
    /// those endpoints (it pairs the two sides' endpoints when both
    /// connect), the peer's later transfers to this agent fail. It does not
    /// revoke the key of memory this agent registered: that is shared by
    /// every peer (docs/nixl.md).
    pub fn invalidate_remote(&self, name: &str) -> Result<(), NixlError> {
        self.inner
            .invalidate_remote_md(name)
            .map_err(failed("invalidating a peer's metadata"))
    }

    /// What a peer loads to connect to this agent, without the
    /// descriptors of its registered memory (a peer that never transfers to
    /// or from this agent's memory needs none). Falls back to the whole
    /// [`Agent::metadata`] where NIXL cannot give a part.
    pub fn connection_metadata(&self) -> Result<Vec<u8>, NixlError> {
        let partial = (|| {
            let descs = sys::RegDescList::new(sys::MemType::Dram).ok()?;
            let mut opt = sys::OptArgs::new().ok()?;
            opt.add_backend(&self.backend).ok()?;
            self.inner.get_local_partial_md(&descs, Some(&opt)).ok()
        })();
        match partial {
            Some(md) => Ok(md),
            None => self.metadata(),
        }
    }

    /// Register a unit's slab, once: peers then read and write its ranges
    /// by address ([`Slab::addr`] + offset). The registration keeps the
    /// mapping alive.
    pub fn register_slab(&self, slab: Arc<Slab>) -> Result<SlabRegistration, NixlError> {
        let handle =
            self.register_region(slab.addr(), slab.len() as usize, "registering the slab")?;
        Ok(SlabRegistration {
            _handle: handle,
            _slab: slab,
        })
    }

    /// Post one transfer of every range in `ranges` between `staging` and
    /// `peer`'s registered memory. Completes by [`Transfer::wait`].
    pub fn post(
        &self,
        op: Op,
        staging: &Arc<Staging>,
        ranges: &[Range],
        peer: &str,
    ) -> Result<Transfer, NixlError> {
        self.post_with(op, Some(staging), ranges, &[], peer)
    }

    /// Post one WRITE of `staged` ranges (from `staging`) and of `direct`
    /// ones (each a whole registered buffer of the caller's, to its remote
    /// address), to `peer`'s registered memory.
    ///
    /// Only WRITEs go from the caller's memory: a transfer that outlives
    /// its call (failed while it may still run) then only ever reads that
    /// memory, and once the caller's registration is gone it fails or sends
    /// bytes nobody publishes (the unit's range stays reserved). A READ
    /// into the caller's memory could land after the caller freed it.
    pub fn post_write(
        &self,
        staging: Option<&Arc<Staging>>,
        staged: &[Range],
        direct: &[(&Registered<'_>, u64)],
        peer: &str,
    ) -> Result<Transfer, NixlError> {
        self.post_with(Op::Write, staging, staged, direct, peer)
    }

    /// Register `buf` (the caller's memory) for transfers out of it, until
    /// the returned registration drops.
    pub fn register<'a>(&self, buf: &'a [u8]) -> Result<Registered<'a>, NixlError> {
        let (addr, len) = (buf.as_ptr() as usize, buf.len());
        let handle = self.register_region(addr, len, "registering memory")?;
        Ok(Registered {
            _handle: handle,
            addr,
            len,
            _buf: std::marker::PhantomData,
        })
    }

    /// Register `len` bytes at `addr`, memory of this process that the
    /// caller keeps mapped while the handle lives.
    fn register_region(
        &self,
        addr: usize,
        len: usize,
        what: &'static str,
    ) -> Result<sys::RegistrationHandle, NixlError> {
        self.inner
            .register_memory(&Region { addr, len }, None)
            .map_err(failed(what))
    }

    fn post_with(
        &self,
        op: Op,
        staging: Option<&Arc<Staging>>,
        ranges: &[Range],
        direct: &[(&Registered<'_>, u64)],
        peer: &str,
    ) -> Result<Transfer, NixlError> {
        let bad = |detail: String| NixlError::Failed {
            what: "transfer",
            detail,
        };
        let mut local =
            sys::XferDescList::new(sys::MemType::Dram).map_err(failed("descriptors"))?;
        let mut remote =
            sys::XferDescList::new(sys::MemType::Dram).map_err(failed("descriptors"))?;
        for (reg, to) in direct {
            let raddr = usize::try_from(*to).map_err(|_| bad(format!("address {to}")))?;
            local.add_desc(reg.addr, reg.len, 0);
            remote.add_desc(raddr, reg.len, 0);
        }
        if !ranges.is_empty() && staging.is_none() {
            return Err(bad("staged ranges without a staging buffer".into()));
        }
        let staging_len = staging.map_or(0, |s| s.len());
        let staging_addr = staging.map_or(0, |s| s.addr());
        for r in ranges {
            if r.local
                .checked_add(r.len)
                .is_none_or(|end| end > staging_len)
            {
                return Err(bad(format!(
                    "range {r:?} lies outside the {staging_len}-byte staging buffer"
                )));
            }
            let raddr = usize::try_from(r.remote).map_err(|_| bad(format!("address {r:?}")))?;
            local.add_desc(staging_addr + r.local, r.len, 0);
            remote.add_desc(raddr, r.len, 0);
        }
        let mut opt = sys::OptArgs::new().map_err(failed("options"))?;
        opt.add_backend(&self.backend).map_err(failed("options"))?;
        let op = match op {
            Op::Write => sys::XferOp::Write,
            Op::Read => sys::XferOp::Read,
        };
        let req = self
            .inner
            .create_xfer_req(op, &local, &remote, peer, Some(&opt))
            .map_err(failed("creating a transfer"))?;
        // Ok(false): done within the call (a cma copy); Ok(true): running.
        let running = self
            .inner
            .post_xfer_req(&req, Some(&opt))
            .map_err(failed("transfer"))?;
        Ok(Transfer {
            req: Some(req),
            agent: self.clone(),
            staging: staging.cloned(),
            done: !running,
        })
    }
}

/// The caller's memory, registered for WRITEs out of it
/// ([`Agent::register`]); deregistered when dropped.
pub struct Registered<'a> {
    _handle: sys::RegistrationHandle,
    addr: usize,
    len: usize,
    _buf: std::marker::PhantomData<&'a [u8]>,
}

/// A unit's registered slab (deregistered when dropped).
pub struct SlabRegistration {
    // Declared first: deregistered before the slab's mapping may go.
    _handle: sys::RegistrationHandle,
    _slab: Arc<Slab>,
}

/// A client connection's registered buffer: what a WRITE sends from and a
/// READ lands in.
pub struct Staging {
    // Declared first: deregistered before the mapping goes.
    _handle: sys::RegistrationHandle,
    map: memmap2::MmapMut,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Staging({} bytes)", self.map.len())
    }
}

impl Staging {
    /// A buffer of `len` bytes (anonymous memory), registered with `agent`.
    pub fn new(agent: &Agent, len: usize) -> Result<Self, NixlError> {
        let mut map = memmap2::MmapMut::map_anon(len.max(1)).map_err(|e| NixlError::Failed {
            what: "staging buffer",
            detail: e.to_string(),
        })?;
        // Touch every page now, so that neither a transfer nor its copy
        // takes the faults.
        for b in map.iter_mut().step_by(4096) {
            *b = 0;
        }
        let handle = agent.register_region(
            map.as_ptr() as usize,
            map.len(),
            "registering a staging buffer",
        )?;
        Ok(Self {
            _handle: handle,
            map,
        })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    fn addr(&self) -> usize {
        self.map.as_ptr() as usize
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.map
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

/// A posted transfer. Dropped before it is known to have ended, it keeps
/// its request and staging buffer for the rest of the process's life: the
/// engine may still be moving bytes in or out of them.
pub struct Transfer {
    req: Option<sys::XferRequest>,
    agent: Agent,
    staging: Option<Arc<Staging>>,
    done: bool,
}

impl Transfer {
    /// `Ok(true)` once complete; `Err`: it failed and is no longer running.
    pub fn poll(&mut self) -> Result<bool, NixlError> {
        if self.done {
            return Ok(true);
        }
        let Some(req) = &self.req else {
            return Ok(true);
        };
        match self.agent.inner.get_xfer_status(req) {
            Ok(sys::XferStatus::Success) => {
                self.done = true;
                Ok(true)
            }
            Ok(sys::XferStatus::InProgress) => Ok(false),
            Err(e) => {
                self.done = true;
                Err(failed("transfer")(e))
            }
        }
    }

    /// Whether the transfer is known to have ended (completed or failed).
    pub fn ended(&self) -> bool {
        self.done
    }

    /// Poll until complete, failed, or `deadline`.
    pub fn wait(&mut self, deadline: std::time::Instant) -> Result<(), WaitError> {
        wait_until(deadline, || self.poll())
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if !self.done {
            tracing::warn!(
                "nixl: a transfer still running was abandoned; its buffers are kept until the process exits"
            );
            std::mem::forget(self.req.take());
            std::mem::forget(self.staging.clone());
        }
    }
}
