//! A unit's nixl side: its NIXL agent and registered slab, and the client
//! agents of its nixl connections (how a nixl connection maps its session
//! and how its end fences it, docs/fencing.md: `conn/nixl.rs`).

use std::sync::{Arc, Mutex};

use stowage_shm::Slab;

use stowage_config::NixlConfig;

use crate::error::StartError;

/// A unit's NIXL side: its agent and registered slab, and the client
/// agents it knows.
pub(crate) struct NixlServe {
    pub(crate) metadata: Vec<u8>,
    pub(crate) slab_addr: u64,
    pub(crate) peers: Mutex<NixlPeers>,
    // Deregistered before the agent goes.
    _registration: stowage_nixl::SlabRegistration,
    pub(crate) agent: stowage_nixl::Agent,
}

/// The client agents of a unit's nixl connections.
#[derive(Default)]
pub(crate) struct NixlPeers {
    /// Each open connection that asked `NixlInfo`: its client's agent, if
    /// the unit knows it (loaded its metadata).
    pub(crate) conns: std::collections::HashMap<stowage_core::Owner, Option<String>>,
    /// Each known agent: the sessions its connections belonged to.
    pub(crate) agents:
        std::collections::HashMap<String, std::collections::HashSet<stowage_core::SessionId>>,
    /// Each session with a nixl connection: its agent (one per session).
    pub(crate) sessions: std::collections::HashMap<stowage_core::SessionId, Option<String>>,
}

/// Create the unit's NIXL agent and register its slab with it.
pub(crate) fn serve_nixl(
    name: &str,
    instance_id: u128,
    slab: &Arc<Slab>,
    cfg: NixlConfig,
) -> Result<NixlServe, StartError> {
    let refuse = |e: stowage_nixl::NixlError| StartError::Config(format!("--nixl: {e}"));
    if cfg.require_rdma {
        stowage_nixl::check_rdma(std::env::var("UCX_TLS").ok().as_deref()).map_err(refuse)?;
    }
    // Agent names must differ among the agents that meet: the unit's
    // instance id makes a restarted unit a new agent.
    let agent = stowage_nixl::Agent::new(
        &format!("stowage-unit-{name}-{instance_id:032x}"),
        Some(stowage_nixl::UNIT_PROGRESS),
    )
    .map_err(refuse)?;
    let registration = agent.register_slab(slab.clone()).map_err(refuse)?;
    let metadata = agent.metadata().map_err(refuse)?;
    tracing::info!(
        unit = name,
        agent = agent.name(),
        metadata_bytes = metadata.len(),
        require_rdma = cfg.require_rdma,
        "serving nixl"
    );
    Ok(NixlServe {
        metadata,
        slab_addr: slab.addr() as u64,
        peers: Mutex::new(NixlPeers::default()),
        _registration: registration,
        agent,
    })
}
