//! A nixl connection's session: made one-sided when the connection asks
//! `NixlInfo`, and fenced when the last connection of its client's agent
//! ends (docs/fencing.md). The unit's NIXL side is [`NixlServe`](crate::nixl_serve::NixlServe)'s.

use stowage_core::input;

use crate::sessions::Peer;
use crate::shared::Shared;

/// Longest NIXL agent name a unit takes from a client.
const MAX_AGENT_NAME: usize = 256;
/// Most metadata bytes a unit loads of a client's agent (its connection
/// information takes a few KiB).
const MAX_AGENT_METADATA: usize = 1 << 20;

impl Shared {
    /// The peer of `owner`'s connection will touch the slab by itself with
    /// one-sided transfers (a nixl client, whose NIXL agent is `agent`
    /// with the metadata to reach it, when it told them): the connection
    /// and its session become one-sided ([`UnitCore::make_one_sided`]).
    /// The unit loads the agent's metadata, to invalidate it once the
    /// agent's last connection has ended ([`Shared::nixl_conn_ended`]).
    pub(crate) fn map_session(
        &self,
        owner: stowage_core::Owner,
        peer: Peer,
        agent: &str,
        agent_metadata: &[u8],
    ) -> Result<(), stowage_core::CoreError> {
        let invalid = stowage_core::CoreError::Invalid;
        let Some(n) = &self.nixl else {
            return Err(invalid("this unit does not serve nixl".into()));
        };
        let mut sessions = self
            .sessions
            .by_token
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let Some(rec) = sessions.values_mut().find(|r| r.id == owner.session) else {
            return Err(invalid("session vanished".into()));
        };
        let mut peers = n.peers.lock().unwrap_or_else(|p| p.into_inner());
        let mut told = (!agent.is_empty()).then(|| agent.to_owned());
        if agent.len() > MAX_AGENT_NAME || agent_metadata.len() > MAX_AGENT_METADATA {
            tracing::warn!(
                unit = %self.settings.name,
                name_bytes = agent.len(),
                metadata_bytes = agent_metadata.len(),
                "a nixl client's agent is past the unit's bounds: not loaded; what its \
                 connections hold when they end waits out the nixl quarantine alone"
            );
            told = None;
        }
        if peers.conns.contains_key(&owner) {
            // Asked again on the same connection: the same answer.
            return if peers.sessions.get(&owner.session) == Some(&told) {
                Ok(())
            } else {
                Err(invalid(
                    "this connection asked for nixl already, as another agent".into(),
                ))
            };
        }
        if let Some(had) = peers.sessions.get(&owner.session) {
            if *had != told {
                return Err(invalid(format!(
                    "a session's nixl connections come from one NIXL agent: this one \
                     was {had:?}, now {told:?} (open a new session for another agent)"
                )));
            }
        }
        let known = match &told {
            Some(name) if peers.agents.contains_key(name) => Some(name.clone()),
            Some(name) => match n.agent.load_remote(agent_metadata) {
                Ok(loaded) if loaded == *name => {
                    tracing::debug!(unit = %self.settings.name, agent = %loaded, metadata_bytes = agent_metadata.len(), "loaded a nixl client's agent");
                    Some(loaded)
                }
                Ok(loaded) => {
                    let _ = n.agent.invalidate_remote(&loaded);
                    return Err(invalid(format!(
                        "the NIXL metadata told is agent {loaded:?}'s, not {name:?}'s"
                    )));
                }
                Err(e) => {
                    tracing::warn!(
                        unit = %self.settings.name,
                        agent = %name,
                        error = %e,
                        "cannot load a nixl client's agent: what its connections hold when \
                         they end waits out the nixl quarantine without an invalidation"
                    );
                    None
                }
            },
            None => None,
        };
        if rec.pidfd.is_none() {
            rec.pidfd = peer.pid.and_then(|pid| self.sessions.pidfd_of(pid));
        }
        rec.one_sided = true;
        self.core().handle(self.now(), input::MakeOneSided(owner))?;
        if let Some(name) = &known {
            peers
                .agents
                .entry(name.clone())
                .or_default()
                .insert(owner.session);
        }
        peers.sessions.insert(owner.session, told);
        peers.conns.insert(owner, known);
        Ok(())
    }

    /// A connection ended (after the core's [`UnitCore::detach`]). When it
    /// was a nixl connection and the last open one of its client's agent,
    /// the unit invalidates that agent (so that, where UCX can, no further
    /// transfer of it lands) and fences the sessions it served: what their
    /// ended connections hold is released once the nixl quarantine has
    /// passed. A connection whose agent the unit does not know fences its
    /// session at once: its holds wait out the quarantine alone.
    pub(crate) fn nixl_conn_ended(&self, owner: stowage_core::Owner) {
        let Some(n) = &self.nixl else {
            return;
        };
        let (fence, agent) = {
            let mut peers = n.peers.lock().unwrap_or_else(|p| p.into_inner());
            let Some(agent) = peers.conns.remove(&owner) else {
                return;
            };
            if !peers.conns.keys().any(|o| o.session == owner.session) {
                peers.sessions.remove(&owner.session);
            }
            match agent {
                None => (vec![owner.session], None),
                Some(name) if peers.conns.values().any(|a| a.as_ref() == Some(&name)) => {
                    (Vec::new(), None)
                }
                Some(name) => {
                    // Under the lock: a connection of the same agent that
                    // asks NixlInfo meanwhile loads it afresh, after this.
                    let sessions = peers.agents.remove(&name).unwrap_or_default();
                    let invalidated = n.agent.invalidate_remote(&name);
                    if let Err(e) = &invalidated {
                        tracing::warn!(unit = %self.settings.name, agent = %name, error = %e, "cannot invalidate a nixl client's agent");
                    }
                    (sessions.into_iter().collect(), Some(name))
                }
            }
        };
        if fence.is_empty() {
            return;
        }
        let now = self.now();
        let held: u64 = {
            let mut core = self.core();
            fence
                .iter()
                .map(|s| core.handle(now, input::Fenced(*s)).unwrap_or(0))
                .sum()
        };
        if held > 0 {
            tracing::info!(
                unit = %self.settings.name,
                agent = agent.as_deref().unwrap_or("(not told)"),
                holds = held,
                quarantine_ms = self.core().config().nixl_quarantine.as_millis() as u64,
                "a nixl client's connections ended: its holds are released after the nixl quarantine"
            );
        }
    }
}
