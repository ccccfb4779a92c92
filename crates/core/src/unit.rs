//! The unit's state: blobs, the key index and pins.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use crate::slab::{Region, SlabAllocator};
use crate::{Allocated, BlobId, CoreError, EntrySpec, Key, Location, PinId, Time};

/// How many freed committed blob ids a unit remembers, so that a retried
/// alloc or commit of a blob that was committed and has since been freed
/// still answers "already committed" instead of storing stale bytes again.
pub const REMEMBERED_COMMITS: usize = 1 << 16;

/// Settings of the core. Durations are measured on the driver's clock.
#[derive(Clone, Debug)]
pub struct CoreConfig {
    /// Slab bytes (rounded down to 64). At most [`crate::slab::MAX_CAPACITY`].
    pub capacity: u64,
    /// How long an uncommitted reservation lives. Default 30 s.
    pub reservation_lease: Duration,
    /// How long a pin lives unless unpinned. Default 30 s.
    pub pin_lease: Duration,
    /// How long a range stays unusable after an aborted in-flight transfer or
    /// an expired reservation, so a writer that is still copying cannot
    /// scribble over a new owner's bytes. Default 5 s.
    pub quarantine: Duration,
}

impl CoreConfig {
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            reservation_lease: Duration::from_secs(30),
            pin_lease: Duration::from_secs(30),
            quarantine: Duration::from_secs(5),
        }
    }
}

/// Counters of a unit, as reported by the stats request.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stats {
    pub capacity: u64,
    /// Bytes held by any blob (reserved, committed or quarantined).
    pub used: u64,
    pub reserved_bytes: u64,
    pub quarantined_bytes: u64,
    pub blobs: u64,
    pub entries: u64,
    pub rows: u64,
    pub pins: u64,
}

#[derive(Debug)]
enum State {
    Reserved {
        expires: Time,
        n_entries: u32,
    },
    Committed {
        /// Entries of the index that point into this blob.
        live: u32,
        /// Pins that hold this blob.
        pins: u32,
    },
    Quarantined {
        until: Time,
    },
}

#[derive(Debug)]
struct Blob {
    region: Region,
    nbytes: u64,
    state: State,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    blob: BlobId,
    location: Location,
    meta: Box<[u8]>,
}

struct Pin {
    blobs: Vec<BlobId>,
    /// `None`: held until unpinned (the server drops such pins when their
    /// connection ends).
    expires: Option<Time>,
}

type Rows = HashMap<u64, HashMap<String, Entry>>;

/// A found key: where its value is, and the metadata stored with it.
pub type Located = (Location, Vec<u8>);

/// The sans-I/O state machine of one storage unit. See the crate docs.
pub struct UnitCore {
    cfg: CoreConfig,
    slab: SlabAllocator,
    blobs: HashMap<BlobId, Blob>,
    /// namespace → row → field → entry.
    index: HashMap<String, Rows>,
    pins: HashMap<PinId, Pin>,
    next_pin: u64,
    /// Expiry times of reservations, pins and quarantines, so `tick` finds
    /// what is due without a scan. Entries may be stale (already resolved);
    /// `tick` checks the record before acting.
    timers: BTreeMap<(Time, u64), Timer>,
    timer_seq: u64,
    entries: u64,
    reserved_bytes: u64,
    quarantined_bytes: u64,
    /// Ids of committed blobs freed lately (at most [`REMEMBERED_COMMITS`]),
    /// oldest first.
    freed_commits: VecDeque<BlobId>,
    freed_commit_set: HashSet<BlobId>,
}

#[derive(Clone, Copy, Debug)]
enum Timer {
    Reservation(BlobId),
    Quarantine(BlobId),
    Pin(PinId),
}

impl UnitCore {
    /// A unit with an empty slab of `cfg.capacity` bytes.
    pub fn new(cfg: CoreConfig) -> Result<Self, CoreError> {
        if cfg.capacity > crate::slab::MAX_CAPACITY {
            return Err(CoreError::Invalid(format!(
                "capacity {} exceeds the maximum of {} bytes",
                cfg.capacity,
                crate::slab::MAX_CAPACITY
            )));
        }
        Ok(Self {
            slab: SlabAllocator::new(cfg.capacity),
            cfg,
            blobs: HashMap::new(),
            index: HashMap::new(),
            pins: HashMap::new(),
            next_pin: 1,
            timers: BTreeMap::new(),
            timer_seq: 0,
            entries: 0,
            reserved_bytes: 0,
            quarantined_bytes: 0,
            freed_commits: VecDeque::new(),
            freed_commit_set: HashSet::new(),
        })
    }

    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// Slab bytes under management.
    pub fn capacity(&self) -> u64 {
        self.slab.capacity()
    }

    fn add_timer(&mut self, at: Time, t: Timer) {
        self.timer_seq += 1;
        self.timers.insert((at, self.timer_seq), t);
    }

    /// Reserve `nbytes` for `blob` under a lease.
    ///
    /// A retry of an alloc that already succeeded returns the same offset (and
    /// renews the lease); one whose blob was committed since answers
    /// [`Allocated::AlreadyCommitted`].
    pub fn alloc(
        &mut self,
        blob: BlobId,
        nbytes: u64,
        n_entries: u32,
        now: Time,
    ) -> Result<Allocated, CoreError> {
        let expires = now + self.cfg.reservation_lease;
        if let Some(b) = self.blobs.get_mut(&blob) {
            return match &mut b.state {
                State::Reserved {
                    expires: e,
                    n_entries: n,
                } if b.nbytes == nbytes && *n == n_entries => {
                    *e = expires;
                    let offset = b.region.offset;
                    self.add_timer(expires, Timer::Reservation(blob));
                    Ok(Allocated::Reserved { offset })
                }
                State::Reserved { .. } => Err(CoreError::Invalid(format!(
                    "blob {blob:?} is already reserved with another size or entry count"
                ))),
                State::Committed { .. } => Ok(Allocated::AlreadyCommitted),
                State::Quarantined { .. } => Err(CoreError::Invalid(format!(
                    "blob {blob:?} was aborted or expired; use a new blob id"
                ))),
            };
        }
        if self.freed_commit_set.contains(&blob) {
            return Ok(Allocated::AlreadyCommitted);
        }
        let capacity = self.slab.capacity();
        if SlabAllocator::rounded(nbytes) > capacity {
            return Err(CoreError::Full {
                needed: nbytes,
                free: capacity - self.slab.allocated(),
                capacity,
            });
        }
        match self.slab.allocate(nbytes) {
            Some(region) => {
                self.reserved_bytes += region.len;
                self.blobs.insert(
                    blob,
                    Blob {
                        region,
                        nbytes,
                        state: State::Reserved { expires, n_entries },
                    },
                );
                self.add_timer(expires, Timer::Reservation(blob));
                Ok(Allocated::Reserved {
                    offset: region.offset,
                })
            }
            None => {
                let free = capacity - self.slab.allocated();
                let reclaimable = self.reserved_bytes + self.quarantined_bytes;
                if free + reclaimable >= SlabAllocator::rounded(nbytes) && reclaimable > 0 {
                    Err(CoreError::Busy {
                        needed: nbytes,
                        reclaimable,
                    })
                } else {
                    Err(CoreError::Full {
                        needed: nbytes,
                        free,
                        capacity,
                    })
                }
            }
        }
    }

    /// Publish the entries of a reserved blob in namespace `ns`.
    ///
    /// Idempotent: committing a committed blob again succeeds without
    /// change. A key that already has a value is replaced atomically (the
    /// old value stays readable to whoever pinned it).
    pub fn commit(
        &mut self,
        ns: &str,
        blob: BlobId,
        entries: &[EntrySpec],
    ) -> Result<(), CoreError> {
        let Some(b) = self.blobs.get(&blob) else {
            return if self.freed_commit_set.contains(&blob) {
                Ok(())
            } else {
                Err(CoreError::UnknownBlob(blob))
            };
        };
        let (nbytes, base) = (b.nbytes, b.region.offset);
        match b.state {
            State::Committed { .. } => return Ok(()),
            State::Quarantined { .. } => return Err(CoreError::UnknownBlob(blob)),
            State::Reserved { n_entries, .. } => {
                if entries.len() != n_entries as usize {
                    return Err(CoreError::Invalid(format!(
                        "blob {blob:?} was reserved for {n_entries} entries, commit names {}",
                        entries.len()
                    )));
                }
            }
        }
        for e in entries {
            if e.offset.checked_add(e.len).is_none_or(|end| end > nbytes) {
                return Err(CoreError::Invalid(format!(
                    "entry {} at {}+{} lies outside blob of {nbytes} bytes",
                    e.key, e.offset, e.len
                )));
            }
        }
        let region_len = b.region.len;
        self.reserved_bytes -= region_len;
        if let Some(b) = self.blobs.get_mut(&blob) {
            b.state = State::Committed { live: 0, pins: 0 };
        }
        let rows = self.index.entry(ns.to_owned()).or_default();
        let mut replaced = Vec::new();
        let mut live = 0u32;
        for e in entries {
            let entry = Entry {
                blob,
                location: Location {
                    offset: base + e.offset,
                    len: e.len,
                },
                meta: e.meta.clone().into_boxed_slice(),
            };
            match rows
                .entry(e.key.row)
                .or_default()
                .insert(e.key.field.clone(), entry)
            {
                Some(old) if old.blob == blob => {} // a duplicate key in this blob: last wins
                Some(old) => {
                    replaced.push(old.blob);
                    live += 1;
                }
                None => {
                    live += 1;
                    self.entries += 1;
                }
            }
        }
        if let Some(Blob {
            state: State::Committed { live: l, .. },
            ..
        }) = self.blobs.get_mut(&blob)
        {
            *l = live;
        }
        for old in replaced {
            self.drop_entry_ref(old);
        }
        self.maybe_free(blob);
        Ok(())
    }

    /// Give up a reservation. With `in_flight` (a transfer may still write
    /// into it) the range is quarantined before reuse. A committed or
    /// unknown blob is left alone: the client aborts after failures whose
    /// outcome it does not know.
    pub fn abort(&mut self, blob: BlobId, in_flight: bool, now: Time) {
        let Some(b) = self.blobs.get(&blob) else {
            return;
        };
        if let State::Reserved { .. } = b.state {
            self.reserved_bytes -= b.region.len;
            if in_flight {
                self.quarantine(blob, now);
            } else if let Some(b) = self.blobs.remove(&blob) {
                self.slab.free(b.region);
            }
        }
    }

    fn quarantine(&mut self, blob: BlobId, now: Time) {
        let until = now + self.cfg.quarantine;
        if let Some(b) = self.blobs.get_mut(&blob) {
            b.state = State::Quarantined { until };
            self.quarantined_bytes += b.region.len;
        }
        self.add_timer(until, Timer::Quarantine(blob));
    }

    /// Where `keys` of namespace `ns` live; pins the blobs holding the found
    /// ones under a lease. Missing keys are `None`. The pin is `None` when no
    /// key was found.
    pub fn resolve(
        &mut self,
        ns: &str,
        keys: &[Key],
        now: Time,
    ) -> (Option<PinId>, Vec<Option<Location>>) {
        let (pin, found) = self.resolve_with_meta(ns, keys, now, false);
        (pin, found.into_iter().map(|f| f.map(|(l, _)| l)).collect())
    }

    /// [`UnitCore::resolve`], with each found key's metadata. With `hold`
    /// the pin has no lease: it lasts until [`UnitCore::unpin`] (zero-copy
    /// views that live as long as the caller keeps them).
    pub fn resolve_with_meta(
        &mut self,
        ns: &str,
        keys: &[Key],
        now: Time,
        hold: bool,
    ) -> (Option<PinId>, Vec<Option<Located>>) {
        let rows = self.index.get(ns);
        let mut blobs = Vec::new();
        let found = keys
            .iter()
            .map(|k| {
                let e = rows?.get(&k.row)?.get(&k.field)?;
                blobs.push(e.blob);
                Some((e.location, e.meta.to_vec()))
            })
            .collect();
        if blobs.is_empty() {
            return (None, found);
        }
        blobs.sort_unstable();
        blobs.dedup();
        for id in &blobs {
            if let Some(Blob {
                state: State::Committed { pins, .. },
                ..
            }) = self.blobs.get_mut(id)
            {
                *pins += 1;
            }
        }
        let pin = PinId(self.next_pin);
        self.next_pin += 1;
        let expires = (!hold).then(|| now + self.cfg.pin_lease);
        self.pins.insert(pin, Pin { blobs, expires });
        if let Some(at) = expires {
            self.add_timer(at, Timer::Pin(pin));
        }
        (Some(pin), found)
    }

    /// The rows of namespace `ns` and the fields of each, rows ascending,
    /// fields sorted.
    pub fn list(&self, ns: &str) -> Vec<(u64, Vec<String>)> {
        let mut rows: Vec<(u64, Vec<String>)> = self
            .index
            .get(ns)
            .map(|r| {
                r.iter()
                    .map(|(row, fields)| {
                        let mut f: Vec<String> = fields.keys().cloned().collect();
                        f.sort();
                        (*row, f)
                    })
                    .collect()
            })
            .unwrap_or_default();
        rows.sort_by_key(|(r, _)| *r);
        rows
    }

    /// Namespaces that hold entries and start with `prefix`, sorted.
    pub fn namespaces(&self, prefix: &str) -> Vec<String> {
        let mut n: Vec<String> = self
            .index
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect();
        n.sort();
        n
    }

    /// Drop a pin early. Unknown pins (already expired) are ignored.
    pub fn unpin(&mut self, pin: PinId) {
        if let Some(p) = self.pins.remove(&pin) {
            for blob in p.blobs {
                if let Some(Blob {
                    state: State::Committed { pins, .. },
                    ..
                }) = self.blobs.get_mut(&blob)
                {
                    *pins -= 1;
                }
                self.maybe_free(blob);
            }
        }
    }

    /// Remove every entry of the given rows of `ns`; returns how many.
    pub fn release_rows(&mut self, ns: &str, rows: &[u64]) -> u64 {
        let Some(index) = self.index.get_mut(ns) else {
            return 0;
        };
        let mut dropped = Vec::new();
        for row in rows {
            if let Some(fields) = index.remove(row) {
                dropped.extend(fields.into_values().map(|e| e.blob));
            }
        }
        if index.is_empty() {
            self.index.remove(ns);
        }
        self.entries -= dropped.len() as u64;
        let n = dropped.len() as u64;
        for blob in dropped {
            self.drop_entry_ref(blob);
        }
        n
    }

    /// Remove every entry of `ns`; returns how many.
    pub fn drop_namespace(&mut self, ns: &str) -> u64 {
        let rows: Vec<u64> = self
            .index
            .get(ns)
            .map(|r| r.keys().copied().collect())
            .unwrap_or_default();
        self.release_rows(ns, &rows)
    }

    fn drop_entry_ref(&mut self, blob: BlobId) {
        if let Some(Blob {
            state: State::Committed { live, .. },
            ..
        }) = self.blobs.get_mut(&blob)
        {
            *live -= 1;
        }
        self.maybe_free(blob);
    }

    fn maybe_free(&mut self, blob: BlobId) {
        if let Some(Blob {
            state: State::Committed { live: 0, pins: 0 },
            ..
        }) = self.blobs.get(&blob)
        {
            if let Some(b) = self.blobs.remove(&blob) {
                self.slab.free(b.region);
                self.remember_commit(blob);
            }
        }
    }

    fn remember_commit(&mut self, blob: BlobId) {
        if self.freed_commits.len() >= REMEMBERED_COMMITS {
            if let Some(old) = self.freed_commits.pop_front() {
                self.freed_commit_set.remove(&old);
            }
        }
        self.freed_commits.push_back(blob);
        self.freed_commit_set.insert(blob);
    }

    /// Reclaim what is due at `now`: expired reservations (into quarantine),
    /// expired pins and ended quarantines.
    pub fn tick(&mut self, now: Time) {
        while let Some((&(at, seq), &timer)) = self.timers.first_key_value() {
            if at > now {
                break;
            }
            self.timers.remove(&(at, seq));
            match timer {
                Timer::Reservation(blob) => {
                    let due = matches!(
                        self.blobs.get(&blob),
                        Some(Blob { state: State::Reserved { expires, .. }, .. }) if *expires <= now
                    );
                    if due {
                        if let Some(b) = self.blobs.get(&blob) {
                            self.reserved_bytes -= b.region.len;
                        }
                        self.quarantine(blob, now);
                    }
                }
                Timer::Quarantine(blob) => {
                    let due = matches!(
                        self.blobs.get(&blob),
                        Some(Blob { state: State::Quarantined { until }, .. }) if *until <= now
                    );
                    if due {
                        if let Some(b) = self.blobs.remove(&blob) {
                            self.quarantined_bytes -= b.region.len;
                            self.slab.free(b.region);
                        }
                    }
                }
                Timer::Pin(pin) => {
                    if self
                        .pins
                        .get(&pin)
                        .is_some_and(|p| p.expires.is_some_and(|e| e <= now))
                    {
                        self.unpin(pin);
                    }
                }
            }
        }
    }

    /// When `tick` next has something to do.
    pub fn next_deadline(&self) -> Option<Time> {
        self.timers.keys().next().map(|(t, _)| *t)
    }

    pub fn stats(&self) -> Stats {
        Stats {
            capacity: self.slab.capacity(),
            used: self.slab.allocated(),
            reserved_bytes: self.reserved_bytes,
            quarantined_bytes: self.quarantined_bytes,
            blobs: self.blobs.len() as u64,
            entries: self.entries,
            rows: self.index.values().map(|r| r.len() as u64).sum(),
            pins: self.pins.len() as u64,
        }
    }

    /// Every blob's slab range, for invariant checks in tests.
    pub fn regions(&self) -> impl Iterator<Item = (BlobId, u64, u64)> + '_ {
        self.blobs
            .iter()
            .map(|(id, b)| (*id, b.region.offset, b.region.len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn core(cap: u64) -> UnitCore {
        UnitCore::new(CoreConfig::new(cap)).unwrap()
    }

    fn t(ms: u64) -> Time {
        Duration::from_millis(ms)
    }

    fn entry(row: u64, field: &str, offset: u64, len: u64) -> EntrySpec {
        EntrySpec {
            key: Key::new(row, field),
            offset,
            len,
            meta: vec![row as u8],
        }
    }

    #[test]
    fn alloc_is_idempotent_and_commit_publishes() {
        let mut c = core(1 << 20);
        let b = BlobId(7);
        let Allocated::Reserved { offset } = c.alloc(b, 100, 2, t(0)).unwrap() else {
            panic!("expected a reservation");
        };
        assert_eq!(
            c.alloc(b, 100, 2, t(1)).unwrap(),
            Allocated::Reserved { offset }
        );
        c.commit("ns", b, &[entry(1, "a", 0, 40), entry(1, "b", 40, 60)])
            .unwrap();
        c.commit("ns", b, &[]).unwrap(); // idempotent, whatever it names
        assert_eq!(
            c.alloc(b, 100, 2, t(2)).unwrap(),
            Allocated::AlreadyCommitted
        );
        let (pin, locs) = c.resolve("ns", &[Key::new(1, "b"), Key::new(2, "a")], t(3));
        assert_eq!(
            locs[0],
            Some(Location {
                offset: offset + 40,
                len: 60
            })
        );
        assert_eq!(locs[1], None);
        c.unpin(pin.unwrap());
        assert_eq!(c.stats().entries, 2);
        assert_eq!(c.release_rows("ns", &[1]), 2);
        assert_eq!(c.stats().used, 0);
        assert_eq!(
            c.alloc(b, 100, 2, t(4)).unwrap(),
            Allocated::AlreadyCommitted
        );
        c.commit("ns", b, &[entry(9, "a", 0, 1)]).unwrap();
        assert_eq!(
            c.stats().entries,
            0,
            "a late commit retry publishes nothing"
        );
    }

    #[test]
    fn metadata_listing_and_held_pins() {
        let mut c = core(1 << 20);
        c.alloc(BlobId(1), 16, 3, t(0)).unwrap();
        c.commit(
            "p",
            BlobId(1),
            &[
                entry(5, "b", 0, 8),
                entry(5, "a", 8, 8),
                entry(2, "a", 0, 0),
            ],
        )
        .unwrap();
        assert_eq!(
            c.list("p"),
            vec![
                (2, vec!["a".to_string()]),
                (5, vec!["a".to_string(), "b".to_string()])
            ]
        );
        assert_eq!(c.namespaces(""), vec!["p".to_string()]);
        let (pin, found) = c.resolve_with_meta("p", &[Key::new(5, "a")], t(0), true);
        assert_eq!(found[0].as_ref().map(|(_, m)| m.clone()), Some(vec![5]));
        c.release_rows("p", &[5, 2]);
        // A held pin outlives any lease, and keeps the blob.
        c.tick(t(3_600_000));
        assert_eq!(c.stats().pins, 1);
        assert_eq!(c.stats().blobs, 1);
        c.unpin(pin.unwrap());
        assert_eq!(c.stats().used, 0);
    }

    #[test]
    fn namespaces_are_isolated() {
        let mut c = core(1 << 20);
        c.alloc(BlobId(1), 8, 1, t(0)).unwrap();
        c.commit("a", BlobId(1), &[entry(0, "x", 0, 8)]).unwrap();
        assert_eq!(c.resolve("b", &[Key::new(0, "x")], t(0)).1, vec![None]);
        assert_eq!(c.release_rows("b", &[0]), 0);
        assert_eq!(c.stats().entries, 1);
    }

    #[test]
    fn full_and_busy_are_answers() {
        let mut c = core(4096);
        assert!(matches!(
            c.alloc(BlobId(1), 8192, 0, t(0)),
            Err(CoreError::Full { .. })
        ));
        c.alloc(BlobId(2), 4096, 0, t(0)).unwrap();
        // The reservation will expire: retrying makes sense.
        assert!(matches!(
            c.alloc(BlobId(3), 64, 0, t(0)),
            Err(CoreError::Busy { .. })
        ));
        c.commit("ns", BlobId(2), &[]).unwrap(); // no entries: freed at once
        c.alloc(BlobId(3), 4096, 1, t(0)).unwrap();
        c.commit("ns", BlobId(3), &[entry(0, "f", 0, 4096)])
            .unwrap();
        assert!(matches!(
            c.alloc(BlobId(4), 64, 0, t(0)),
            Err(CoreError::Full { .. })
        ));
    }

    #[test]
    fn replace_keeps_pinned_old_value_until_unpinned() {
        let mut c = core(1 << 20);
        c.alloc(BlobId(1), 8, 1, t(0)).unwrap();
        c.commit("ns", BlobId(1), &[entry(0, "f", 0, 8)]).unwrap();
        let (pin, old) = c.resolve("ns", &[Key::new(0, "f")], t(0));
        c.alloc(BlobId(2), 8, 1, t(0)).unwrap();
        c.commit("ns", BlobId(2), &[entry(0, "f", 0, 8)]).unwrap();
        assert_eq!(c.stats().entries, 1);
        assert_eq!(c.stats().blobs, 2, "old blob still pinned");
        let (_, new) = c.resolve("ns", &[Key::new(0, "f")], t(0));
        assert_ne!(old, new);
        c.unpin(pin.unwrap());
        assert!(c.regions().all(|(id, _, _)| id != BlobId(1)));
    }

    #[test]
    fn leases_reclaim_reservations_and_pins() {
        let mut c = core(1 << 20);
        c.alloc(BlobId(1), 100, 1, t(0)).unwrap();
        c.alloc(BlobId(2), 100, 1, t(0)).unwrap();
        c.commit("ns", BlobId(2), &[entry(0, "f", 0, 100)]).unwrap();
        c.resolve("ns", &[Key::new(0, "f")], t(0));
        c.release_rows("ns", &[0]);
        assert_eq!(c.stats().pins, 1);
        assert_eq!(c.stats().blobs, 2);
        c.tick(t(30_000));
        let s = c.stats();
        assert_eq!(s.pins, 0);
        assert_eq!(
            s.quarantined_bytes, 128,
            "expired reservation is quarantined"
        );
        assert_eq!(
            c.commit("ns", BlobId(1), &[entry(0, "f", 0, 1)]),
            Err(CoreError::UnknownBlob(BlobId(1)))
        );
        c.tick(t(35_000));
        assert_eq!(c.stats().used, 0);
        assert_eq!(c.next_deadline(), None);
    }

    #[test]
    fn abort_in_flight_quarantines() {
        let mut c = core(1 << 20);
        c.alloc(BlobId(1), 100, 0, t(0)).unwrap();
        c.abort(BlobId(1), true, t(0));
        assert_eq!(c.stats().quarantined_bytes, 128);
        c.alloc(BlobId(2), 100, 0, t(0)).unwrap();
        c.abort(BlobId(2), false, t(0));
        assert_eq!(c.stats().used, 128);
        c.tick(t(5_000));
        assert_eq!(c.stats().used, 0);
    }

    #[test]
    fn bad_commits_are_invalid() {
        let mut c = core(1 << 20);
        c.alloc(BlobId(1), 10, 1, t(0)).unwrap();
        assert!(matches!(
            c.commit("ns", BlobId(1), &[entry(0, "f", 5, 6)]),
            Err(CoreError::Invalid(_))
        ));
        assert!(matches!(
            c.commit("ns", BlobId(1), &[]),
            Err(CoreError::Invalid(_))
        ));
        assert!(matches!(
            c.commit("ns", BlobId(9), &[]),
            Err(CoreError::UnknownBlob(_))
        ));
        c.commit("ns", BlobId(1), &[entry(0, "f", 0, 10)]).unwrap();
    }
}
