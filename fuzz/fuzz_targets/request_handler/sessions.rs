//! Sessions and connections: attach, detach (closed or cut), process exits,
//! and mapped clients scribbling into their reservations.

use super::*;

impl H {
    pub(crate) fn attach(&mut self, slot: usize, mapped: bool, namespace: u8) {
        let namespace = NAMESPACES[namespace as usize % NAMESPACES.len()];
        let s = match self.slots[slot].session {
            Some(s) => s,
            None => {
                let s = match self.input(core_input::OpenSession) {
                    Ok(s) => s,
                    other => panic!("OpenSession answered {other:?}"),
                };
                self.slots[slot].session = Some(s);
                self.slots[slot].mapped = mapped;
                s
            }
        };
        let mapped = self.slots[slot].mapped;
        let full = self.slots[slot].conns.len() >= MAX_CONNS;
        match self.input(core_input::Attach { session: s, mapped }) {
            Ok(owner) => {
                assert!(!full, "attach past the session's connection cap succeeded");
                assert_eq!(owner.session, s);
                self.slots[slot].conns.push(Conn { owner, namespace });
            }
            Err(CoreError::Busy { .. }) => {
                assert!(
                    full,
                    "attach refused with {} connections",
                    self.slots[slot].conns.len()
                )
            }
            Err(e) => panic!("attach to live session {s:?} failed: {e}"),
        }
    }

    /// A connection ends; mirror what the core releases.
    pub(crate) fn detach(&mut self, slot: usize, i: usize, end: ConnEnd) {
        let c = self.slots[slot].conns.remove(i);
        let mapped = self.slots[slot].mapped;
        let keep = end == ConnEnd::Cut && mapped;
        let mine = |s: SessionId, conn: Option<stowage_core::ConnId>| {
            s == c.owner.session && conn == Some(c.owner.conn)
        };
        let held = self
            .res
            .values()
            .filter(|r| mine(r.session, r.conn))
            .count()
            + self
                .pins
                .values()
                .filter(|p| mine(p.session, p.conn))
                .count();
        let n = self.released(core_input::ConnEnded {
            owner: c.owner,
            end,
        });
        assert_eq!(
            n,
            if keep { 0 } else { held as u64 },
            "holds released by the {end:?} end of {:?}",
            c.owner
        );
        self.note(match (end, mapped) {
            (ConnEnd::Cut, true) => "detach_cut_mapped",
            (ConnEnd::Cut, false) => "detach_cut_tcp",
            _ => "detach_closed",
        });
        if keep {
            for r in self.res.values_mut().filter(|r| mine(r.session, r.conn)) {
                r.conn = None;
            }
            for p in self.pins.values_mut().filter(|p| mine(p.session, p.conn)) {
                p.conn = None;
            }
        } else {
            self.res.retain(|_, r| !mine(r.session, r.conn));
            self.pins.retain(|_, p| !mine(p.session, p.conn));
        }
        self.forget_if_gone(slot);
    }

    fn holds(&self, s: SessionId) -> bool {
        self.res.values().any(|r| r.session == s) || self.pins.values().any(|p| p.session == s)
    }

    /// The core forgets a session with no connection and no hold: so does
    /// the server's session table (a later Hello starts a new one).
    fn forget_if_gone(&mut self, slot: usize) {
        if let Some(s) = self.slots[slot].session {
            if self.slots[slot].conns.is_empty() && !self.holds(s) {
                assert!(
                    !self.core.has_session(s),
                    "session {s:?} with no connection and no hold is still known"
                );
                self.slots[slot].session = None;
            }
        }
    }

    /// The slot's process exits. The server reports it for a watched
    /// session (no connection open, something held); the core takes it
    /// in any state.
    pub(crate) fn process_exited(&mut self, slot: usize, close_first: bool) {
        let Some(s) = self.slots[slot].session else {
            return;
        };
        if close_first {
            while !self.slots[slot].conns.is_empty() {
                self.detach(slot, 0, ConnEnd::Closed);
            }
            // Nothing held: the core forgot it with its last connection.
            let Some(s) = self.slots[slot].session else {
                return;
            };
            assert!(
                self.watched.contains(&s),
                "{s:?} holds something with no connection, unwatched"
            );
        }
        self.note(if self.watched.contains(&s) {
            "process_exited_watched"
        } else {
            "process_exited"
        });
        let held = self.res.values().filter(|r| r.session == s).count()
            + self.pins.values().filter(|p| p.session == s).count();
        let n = self.released(core_input::ProcessExited(s));
        assert_eq!(n, held as u64, "holds released by the exit of {s:?}");
        self.res.retain(|_, r| r.session != s);
        self.pins.retain(|_, p| p.session != s);
        // Its sockets close too.
        for c in std::mem::take(&mut self.slots[slot].conns) {
            let n = self.released(core_input::ConnEnded {
                owner: c.owner,
                end: ConnEnd::Closed,
            });
            assert_eq!(n, 0, "a connection of exited {s:?} released holds");
        }
        assert!(
            !self.core.has_session(s),
            "session {s:?} outlived its process's exit"
        );
        assert!(
            !self.watched.contains(&s),
            "{s:?} still watched after its exit"
        );
        self.slots[slot].session = None;
    }

    /// A mapped client copies into its `which`-th reservation in the slab.
    pub(crate) fn scribble(&mut self, slot: usize, which: usize, partial: bool) {
        let Some(s) = self.slots[slot].session.filter(|_| self.slots[slot].mapped) else {
            return;
        };
        let mine: Vec<(Vec<(u64, u64)>, u64)> = self
            .res
            .values()
            .filter(|r| r.session == s)
            .filter_map(|r| Some((r.at.clone()?, r.nbytes)))
            .collect();
        if mine.is_empty() {
            return;
        }
        let (pieces, n) = &mine[which % mine.len()];
        self.write_pieces(pieces, if partial { n / 2 } else { *n });
        self.note("scribble");
        if self.slots[slot].conns.is_empty() {
            self.note("scribble_by_cut_session");
        }
    }
}
