//! Counters: what the unit holds and what each session holds.

use super::*;

/// What the core counts: its slab, index, holds and disk tier. The unit
/// server reports these, carried as is, with its own counters (disk I/O,
/// traffic) in the wire's stats message.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stats {
    pub capacity: u64,
    /// Slab bytes of stored data: committed blobs in memory (cleared ones
    /// that a reader still pins included). Reservations, spares and
    /// quarantined ranges are reported beside it.
    pub used: u64,
    pub reserved_bytes: u64,
    pub quarantined_bytes: u64,
    pub blobs: u64,
    pub entries: u64,
    pub rows: u64,
    pub pins: u64,
    /// Bytes of the disk tier (0: off).
    pub disk_capacity: u64,
    /// Disk bytes held: files written or being written.
    pub disk_used: u64,
    /// Blobs whose bytes are only on disk.
    pub spilled_blobs: u64,
    /// Bytes the key index takes (see [`CoreConfig::index_budget`]).
    pub index_bytes: u64,
    /// Bytes held by sessions: reserved ranges and pinned blobs.
    pub held_bytes: u64,
    /// Reservations and pins older than their lease (reported, never
    /// reclaimed while their holder may still touch them).
    pub overdue_holds: u64,
    /// Every session that holds something or has a connection.
    pub sessions: Vec<SessionStats>,
    /// Partitions that hold rows (over every connection namespace).
    pub partitions: u64,
    /// Bytes of pinned blobs (part of [`Stats::held_bytes`]).
    pub pinned_bytes: u64,
    /// Spares: reservations same-host clients hold for their next puts
    /// ([`op::ReserveSpare`]; not counted in `blobs`, never
    /// overdue), and their bytes (part of `reserved_bytes` and `used`).
    pub spares: u64,
    pub spare_bytes: u64,
    /// Free slab bytes (both zones), and the largest free range: a value
    /// larger than it is stored in pieces.
    pub free_bytes: u64,
    pub largest_free: u64,
    /// Bytes of the spare zone ([`crate::CoreConfig::spare_budget`]).
    pub spare_budget: u64,
    /// Compaction since start: blobs moved and their bytes.
    pub compaction_moves: u64,
    pub compaction_bytes: u64,
    /// Blobs stored in more than one piece.
    pub split_blobs: u64,
    /// Claims answered with rows ([`op::Claim`], at once or after
    /// waiting), claims that waited, and leases that expired unsettled.
    pub claims: u64,
    pub claim_waits: u64,
    pub leases_expired: u64,
}

/// What one session holds (carried as is in the wire's stats message).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SessionStats {
    pub session: u64,
    /// Open connections.
    pub connections: u32,
    pub reservations: u32,
    pub pins: u32,
    /// Reserved bytes plus the bytes of pinned blobs.
    pub held_bytes: u64,
    /// Age of its oldest reservation or pin, in milliseconds.
    pub oldest_hold_ms: u64,
    /// Holds whose connection the unit cut: kept until the session's
    /// process is gone.
    pub orphaned: u32,
    /// Of its reservations, the spares (held for its next puts; not in
    /// `oldest_hold_ms`).
    pub spares: u32,
}

impl UnitCore {
    /// Counters, with what each session holds at `now`.
    pub fn stats_at(&self, now: Time) -> Stats {
        let mut s = self.stats();
        let mut overdue = 0u64;
        let mut held_total = 0u64;
        let mut pinned_total = 0u64;
        let mut sessions: Vec<SessionStats> = Vec::new();
        for (id, sess) in &self.holds.sessions {
            if sess.reservations.is_empty() && sess.pins.is_empty() && sess.conns.is_empty() {
                continue;
            }
            if *id == Owner::UNIT.session && sess.pins.is_empty() {
                continue;
            }
            let mut st = SessionStats {
                session: id.0,
                connections: if *id == Owner::UNIT.session {
                    0
                } else {
                    sess.conns.len() as u32
                },
                ..SessionStats::default()
            };
            let mut oldest: Option<Time> = None;
            let mut note = |h: &Holder, lease: Duration, st: &mut SessionStats| {
                oldest = Some(oldest.map_or(h.since, |o| o.min(h.since)));
                if now.saturating_sub(h.since) > lease {
                    overdue += 1;
                }
                if h.conn.is_none() {
                    st.orphaned += 1;
                }
            };
            for blob in &sess.reservations {
                if let Some(Blob {
                    state: State::Reserved { holder, n_entries },
                    region,
                    ..
                }) = self.blobs.get(blob)
                {
                    st.reservations += 1;
                    st.held_bytes += region.as_ref().map_or(0, |r| r.len);
                    if n_entries.is_none() {
                        // Held on purpose, for as long as its connection.
                        st.spares += 1;
                    } else {
                        note(holder, self.cfg.reservation_lease, &mut st);
                    }
                }
            }
            for pin in &sess.pins {
                if let Some(p) = self.holds.pins.get(pin) {
                    st.pins += 1;
                    let bytes = p
                        .blobs
                        .iter()
                        .filter_map(|b| self.blobs.get(b))
                        .map(|b| b.nbytes)
                        .sum::<u64>();
                    st.held_bytes += bytes;
                    pinned_total += bytes;
                    note(&p.holder, self.cfg.pin_lease, &mut st);
                }
            }
            st.oldest_hold_ms = oldest.map_or(0, |o| now.saturating_sub(o).as_millis() as u64);
            held_total += st.held_bytes;
            sessions.push(st);
        }
        sessions.sort_by_key(|s| s.session);
        s.held_bytes = held_total;
        s.pinned_bytes = pinned_total;
        s.overdue_holds = overdue;
        s.sessions = sessions;
        s
    }

    /// How many spares are held, and their slab bytes.
    pub(super) fn spares(&self) -> (u64, u64) {
        self.blobs
            .values()
            .filter(|b| {
                matches!(
                    b.state,
                    State::Reserved {
                        n_entries: None,
                        ..
                    }
                )
            })
            .fold((0, 0), |(n, bytes), b| {
                (n + 1, bytes + b.region.as_ref().map_or(0, |r| r.len))
            })
    }

    pub fn stats(&self) -> Stats {
        let (spares, spare_bytes) = self.spares();
        let (used, split_blobs) = self
            .blobs
            .values()
            .filter(|b| matches!(b.state, State::Committed { .. }))
            .filter_map(|b| b.region.as_ref())
            .fold((0, 0), |(bytes, split), r| {
                (bytes + r.len, split + u64::from(!r.is_contiguous()))
            });
        Stats {
            capacity: self.slab.capacity(),
            used,
            free_bytes: self.slab.free_bytes(),
            largest_free: self.slab.largest_free(),
            spare_budget: self.slab.spare_budget(),
            compaction_moves: self.compactor.moves,
            compaction_bytes: self.compactor.bytes,
            split_blobs,
            claims: self.claims.claims,
            claim_waits: self.claims.claim_waits,
            leases_expired: self.claims.leases_expired,
            reserved_bytes: self.reserved_bytes,
            quarantined_bytes: self.quarantined.bytes,
            blobs: self.blobs.len() as u64 - spares,
            spares,
            spare_bytes,
            entries: self.index.entries,
            rows: self.index.parts.values().map(|r| r.len() as u64).sum(),
            pins: self.holds.pins.len() as u64,
            disk_capacity: self.cfg.disk_capacity,
            disk_used: self.tier.disk_used,
            spilled_blobs: self
                .blobs
                .values()
                .filter(|b| b.region.is_none() && b.disk == Disk::Durable)
                .count() as u64,
            index_bytes: self.index.bytes,
            partitions: self.index.parts.values().filter(|r| !r.is_empty()).count() as u64,
            ..Stats::default()
        }
    }
}
