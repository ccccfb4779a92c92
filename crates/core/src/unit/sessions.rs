//! Sessions and their connections; how a hold outlives its connection.

use super::*;

/// Sessions, their connections, and the holds (pins here; reservations
/// are their blobs' state) with what ends them.
pub(super) struct Holds {
    pub(super) sessions: HashMap<SessionId, Session>,
    pub(super) pins: Map<PinId, Pin>,
    /// Counter under the pin-id function.
    pub(super) pin_counter: u64,
    /// Holds of fenced one-sided peers by the time they are released
    /// ([`Kept::Until`]); an entry whose hold has gone or was taken over
    /// is skipped.
    pub(super) fenced: BTreeMap<(Time, u64), (SessionId, Hold)>,
    pub(super) next_session: u64,
    pub(super) next_conn: u64,
}

impl Holds {
    /// The unit's own session ([`Owner::UNIT`]) and nothing else.
    pub(super) fn new() -> Self {
        let unit = Session {
            conns: HashMap::from([(Owner::UNIT.conn, Reach::default())]),
            reservations: HashSet::new(),
            pins: HashSet::new(),
        };
        Holds {
            sessions: HashMap::from([(Owner::UNIT.session, unit)]),
            pins: Map::default(),
            pin_counter: 0,
            fenced: BTreeMap::new(),
            next_session: 1,
            next_conn: 1,
        }
    }
}

impl UnitCore {
    /// A new session, with no connection yet.
    pub(super) fn open_session(&mut self) -> SessionId {
        let id = SessionId(self.holds.next_session);
        self.holds.next_session += 1;
        self.holds.sessions.insert(
            id,
            Session {
                conns: HashMap::new(),
                reservations: HashSet::new(),
                pins: HashSet::new(),
            },
        );
        id
    }

    /// Whether `session` exists (has a connection or holds something).
    pub fn has_session(&self, session: SessionId) -> bool {
        self.holds.sessions.contains_key(&session)
    }

    /// A new connection of `session`. `mapped`: its peer may map the slab
    /// and copy into or out of it (a Unix-socket peer). Busy when the
    /// session has [`CoreConfig::max_session_conns`] connections already.
    pub(super) fn attach(&mut self, session: SessionId, mapped: bool) -> Result<Owner, CoreError> {
        let max = self.cfg.max_session_conns;
        let Some(s) = self.holds.sessions.get_mut(&session) else {
            return Err(CoreError::Invalid(format!("no session {}", session.0)));
        };
        if s.conns.len() >= max {
            return Err(CoreError::Busy {
                needed: 0,
                reclaimable: 0,
            });
        }
        let conn = ConnId(self.holds.next_conn);
        self.holds.next_conn += 1;
        s.conns.insert(
            conn,
            Reach {
                maps: mapped,
                one_sided: false,
            },
        );
        Ok(Owner { session, conn })
    }

    /// The peer of `owner`'s connection touches the slab by itself from now
    /// on (it was told how to reach it for one-sided transfers): its holds
    /// follow the rules for mapped connections.
    pub(super) fn make_mapped(&mut self, owner: Owner) -> Result<(), CoreError> {
        self.reach_mut(owner).map(|r| r.maps = true)
    }

    /// The peer of `owner`'s connection moves bytes with one-sided
    /// transfers (nixl) from now on: the unit never sees them end, and a
    /// network can end the connection while the peer still runs. So
    /// whatever the connection holds when it ends, however it ends, stays
    /// with its session until the session's process is gone
    /// ([`input::ProcessExited`]), or until the driver has fenced the
    /// peer's endpoint ([`input::Fenced`]) and then
    /// [`CoreConfig::nixl_quarantine`] has passed.
    pub(super) fn make_one_sided(&mut self, owner: Owner) -> Result<(), CoreError> {
        self.reach_mut(owner).map(|r| r.one_sided = true)
    }

    pub(super) fn reach_mut(&mut self, owner: Owner) -> Result<&mut Reach, CoreError> {
        self.holds
            .sessions
            .get_mut(&owner.session)
            .and_then(|s| s.conns.get_mut(&owner.conn))
            .ok_or_else(|| CoreError::Invalid(format!("no connection {}", owner.conn.0)))
    }

    /// What happens to a connection's holds when it ends: `None`, released
    /// now; else kept until the [`Kept`] says. The one place this is
    /// decided.
    pub(super) fn keep_after(reach: Reach, end: ConnEnd) -> Option<Kept> {
        match (reach, end) {
            // A one-sided peer's transfers run without the unit, and a
            // connection's end (a clean close included: a FIN or RST from
            // the network) proves nothing of them. A peer that also maps
            // the slab may copy until its process is gone: never fenced.
            (
                Reach {
                    one_sided: true,
                    maps,
                },
                _,
            ) => Some(if maps {
                Kept::UntilGone
            } else {
                Kept::UntilFenced
            }),
            // The peer maps the slab and the unit cut it: it may still be
            // copying, until its process is gone.
            (Reach { maps: true, .. }, ConnEnd::Cut) => Some(Kept::UntilGone),
            // The peer closed it (it copies no more), or the unit's own
            // thread did the copying and has stopped.
            _ => None,
        }
    }

    /// A connection ended. What it holds is released when the peer closed
    /// it, or when the unit cut it and the peer does not map the slab
    /// (reservations then go through quarantine: a stream was cut). A
    /// mapped peer's holds stay with its session until
    /// [`input::ProcessExited`] when the unit cut it; a one-sided peer's
    /// however it ended, until [`input::ProcessExited`] or
    /// [`input::Fenced`] and its quarantine ([`input::MakeOneSided`]).
    ///
    /// Returns the holds (reservations and pins) released now.
    pub(super) fn detach(&mut self, owner: Owner, end: ConnEnd, now: Time) -> u64 {
        if owner == Owner::UNIT {
            return 0;
        }
        self.claims_conn_ended(owner, now);
        let Some(s) = self.holds.sessions.get_mut(&owner.session) else {
            return 0;
        };
        let Some(reach) = s.conns.remove(&owner.conn) else {
            return 0;
        };
        let held = |h: &Holder| h.conn == Some(owner.conn);
        let reservations: Vec<BlobId> = s
            .reservations
            .iter()
            .copied()
            .filter(|b| {
                matches!(self.blobs.get(b), Some(Blob { state: State::Reserved { holder, .. }, .. }) if held(holder))
            })
            .collect();
        let pins: Vec<PinId> = s
            .pins
            .iter()
            .copied()
            .filter(|p| self.holds.pins.get(p).is_some_and(|p| held(&p.holder)))
            .collect();
        let keep = Self::keep_after(reach, end);
        let released = if keep.is_some() {
            0
        } else {
            (reservations.len() + pins.len()) as u64
        };
        for blob in reservations {
            if let Some(kept) = keep {
                if let Some(Blob {
                    state: State::Reserved { holder, .. },
                    ..
                }) = self.blobs.get_mut(&blob)
                {
                    holder.conn = None;
                    holder.kept = kept;
                }
            } else {
                self.release_reservation(blob, end == ConnEnd::Cut, now);
            }
        }
        for pin in pins {
            if let Some(kept) = keep {
                if let Some(p) = self.holds.pins.get_mut(&pin) {
                    p.holder.conn = None;
                    p.holder.kept = kept;
                }
            } else {
                self.drop_pin(pin);
            }
        }
        self.maybe_forget_session(owner.session);
        if self.is_orphaned(owner.session) {
            // Only its process's end can release what it keeps now.
            self.actions.push_back(Action::CheckProcess(owner.session));
        }
        released
    }

    /// Whether `session` holds something although none of its
    /// connections is open (its connections were cut, or it is one-sided).
    pub fn is_orphaned(&self, session: SessionId) -> bool {
        session != Owner::UNIT.session
            && self.holds.sessions.get(&session).is_some_and(|s| {
                s.conns.is_empty() && (!s.reservations.is_empty() || !s.pins.is_empty())
            })
    }

    /// The session's process is certainly gone (its pid exited): release
    /// everything it holds. Returns the holds released.
    pub(super) fn session_gone(&mut self, session: SessionId, now: Time) -> u64 {
        if session == Owner::UNIT.session {
            return 0;
        }
        let Some(s) = self.holds.sessions.remove(&session) else {
            return 0;
        };
        self.actions.push_back(Action::SessionEnded(session));
        self.repair_session_ended(session);
        let released = (s.reservations.len() + s.pins.len()) as u64;
        for blob in s.reservations {
            // Only its own: nothing of the process runs any more, so no
            // quarantine is needed.
            let own = matches!(
                self.blobs.get(&blob),
                Some(Blob { state: State::Reserved { holder, .. }, .. }) if holder.session == session
            );
            if own {
                self.release_reservation_of(blob, false, now);
            }
        }
        for pin in s.pins {
            self.drop_pin(pin);
        }
        released
    }

    /// The one-sided endpoint of `session`'s peer is fenced: the driver has
    /// done what it can so that no transfer of it can start any more (it
    /// invalidated the peer's NIXL agent, or could not and says so). Every
    /// hold of the session whose connection ended is released once
    /// [`CoreConfig::nixl_quarantine`] has passed from `now` (time for
    /// transfers already posted to drain), by [`input::Timeout`]; holds of
    /// open connections are untouched. Returns the holds that now wait.
    pub(super) fn fence(&mut self, session: SessionId, now: Time) -> u64 {
        let Some(s) = self.holds.sessions.get(&session) else {
            return 0;
        };
        let until = now + self.cfg.nixl_quarantine;
        let mut holds: Vec<Hold> = Vec::new();
        for blob in &s.reservations {
            if let Some(Blob {
                state: State::Reserved { holder, .. },
                ..
            }) = self.blobs.get_mut(blob)
            {
                if holder.kept == Kept::UntilFenced {
                    holder.kept = Kept::Until(until);
                    holds.push(Hold::Reservation(*blob));
                }
            }
        }
        for pin in &s.pins {
            if let Some(p) = self.holds.pins.get_mut(pin) {
                if p.holder.kept == Kept::UntilFenced {
                    p.holder.kept = Kept::Until(until);
                    holds.push(Hold::Pin(*pin));
                }
            }
        }
        let n = holds.len() as u64;
        for h in holds {
            self.quarantined.seq += 1;
            self.holds
                .fenced
                .insert((until, self.quarantined.seq), (session, h));
        }
        n
    }

    /// Whether a fenced hold still waits for `at` (it has not gone, nor
    /// been taken over, since).
    pub(super) fn fenced_until(&self, session: SessionId, hold: Hold, at: Time) -> bool {
        let due = |h: &Holder| h.session == session && h.kept == Kept::Until(at);
        match hold {
            Hold::Reservation(blob) => matches!(
                self.blobs.get(&blob),
                Some(Blob { state: State::Reserved { holder, .. }, .. }) if due(holder)
            ),
            Hold::Pin(pin) => self.holds.pins.get(&pin).is_some_and(|p| due(&p.holder)),
        }
    }

    /// Release a fenced hold whose quarantine ended at `at`, unless it has
    /// gone or was taken over since.
    pub(super) fn release_fenced(
        &mut self,
        session: SessionId,
        hold: Hold,
        at: Time,
        now: Time,
    ) -> bool {
        if !self.fenced_until(session, hold, at) {
            return false;
        }
        match hold {
            // Its quarantine has passed: nothing of it can land any more.
            Hold::Reservation(blob) => self.release_reservation(blob, false, now),
            Hold::Pin(pin) => self.drop_pin(pin),
        }
        true
    }

    pub(super) fn maybe_forget_session(&mut self, session: SessionId) {
        if session == Owner::UNIT.session {
            return;
        }
        if self
            .holds
            .sessions
            .get(&session)
            .is_some_and(|s| s.conns.is_empty() && s.reservations.is_empty() && s.pins.is_empty())
        {
            self.holds.sessions.remove(&session);
            self.actions.push_back(Action::SessionEnded(session));
            self.repair_session_ended(session);
        }
    }

    /// Busy when `session` holds as many reservations and pins as it may.
    pub(super) fn check_holds(&self, session: SessionId, needed: u64) -> Result<(), CoreError> {
        match self.holds.sessions.get(&session) {
            Some(s)
                if session != Owner::UNIT.session
                    && s.reservations.len() + s.pins.len() >= self.cfg.max_session_holds =>
            {
                Err(CoreError::Busy {
                    needed,
                    reclaimable: 0,
                })
            }
            _ => Ok(()),
        }
    }

    pub(super) fn check_owner(&self, owner: Owner) -> Result<(), CoreError> {
        match self.holds.sessions.get(&owner.session) {
            Some(s) if s.conns.contains_key(&owner.conn) => Ok(()),
            _ => Err(CoreError::NotOwner(format!(
                "connection {} of session {} is not attached",
                owner.conn.0, owner.session.0
            ))),
        }
    }
}
