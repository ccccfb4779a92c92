//! Model-based test of [`UnitCore`].
//!
//! Random sequences of operations run against a small unit (64 KiB, leases of
//! a few milliseconds of virtual time) and, side by side, against a plain
//! model of what the unit should hold. A `Vec<u8>` stands in for the slab:
//! right after every successful alloc the test writes fresh bytes over the
//! reserved range, as a client would, and it keeps scribbling over reserved
//! and quarantined ranges later on (a client still copying, a writer that
//! outlived its lease). If the core ever hands out a range that is still in
//! use, a later check reads corrupted bytes.
//!
//! Properties checked after every operation (see [`Harness::check`]):
//!
//! 1. Space is never handed out twice: the regions of `core.regions()` are
//!    aligned, pairwise disjoint, inside the capacity, and exactly the blobs
//!    the model says the unit holds (no leak, no early free).
//! 2. Every key of the model resolves to the location where it was committed
//!    and the simulated slab still holds exactly the committed bytes there;
//!    keys not in the model (and every key of another namespace) resolve to
//!    `None` without a pin.
//! 3. Every pin the unit still holds (not unpinned, not reclaimed by a tick
//!    after its lease ended) still sees its snapshot in the simulated slab.
//! 4. The counters of `stats()` match the model.
//!
//! Each operation's answer is also checked against the model's prediction
//! (Reserved / AlreadyCommitted / Invalid / UnknownBlob, Full vs Busy and
//! their numbers, the count returned by release_rows, ...). In particular a
//! commit of a reservation whose lease ended and was reclaimed by a tick must
//! answer `UnknownBlob`.
//!
//! At the end every row is released and time runs past every lease and
//! quarantine: the unit must be empty again (used, pins, entries, blobs all
//! zero, no timer left) and able to hand out its whole capacity in one piece.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use stowage_core::{
    Allocated, BlobId, Committed, CoreConfig, CoreError, EntrySpec, Key, Location, PinId, Place,
    Stats, Time, UnitCore,
};

const CAP: u64 = 32 * 1024;
const ALIGN: u64 = 64;
const RESERVATION_LEASE_MS: u64 = 20;
const PIN_LEASE_MS: u64 = 15;
const QUARANTINE_MS: u64 = 5;
/// Blob ids come from a small pool so that ids get retried and reused.
const N_BLOBS: u8 = 24;
const ROWS: u64 = 8;
const FIELDS: [&str; 3] = ["a", "b", "c"];
const NS: &str = "ns";
const MAX_BLOB: u64 = 8 * 1024;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn rounded(nbytes: u64) -> u64 {
    nbytes.div_ceil(ALIGN).max(1) * ALIGN
}

fn blob_id(i: u8) -> BlobId {
    BlobId(u128::from(i % N_BLOBS) + 1)
}

fn key(row: u64, field: usize) -> Key {
    Key::new(row, FIELDS[field % FIELDS.len()])
}

fn all_keys() -> Vec<Key> {
    (0..ROWS)
        .flat_map(|r| (0..FIELDS.len()).map(move |f| key(r, f)))
        .collect()
}

#[derive(Clone, Debug)]
enum Op {
    /// Alloc a blob of the pool (new, retried or reused id).
    Alloc {
        blob: u8,
        size: u64,
        n: u32,
    },
    /// Retry an alloc: same parameters for a reserved blob (renews the
    /// lease), any parameters for a committed one (AlreadyCommitted).
    Retry {
        pick: u8,
    },
    /// Commit a blob, preferably one the test reserved. `entries` are
    /// (row, field, offset seed, length seed); `fault` sometimes makes the
    /// commit invalid (wrong count, entry out of bounds).
    Commit {
        pick: u8,
        entries: Vec<(u64, usize, u16, u16)>,
        fault: u8,
    },
    Abort {
        pick: u8,
        in_flight: bool,
    },
    /// A client (or a writer that outlived its lease) writes again into a
    /// reserved or quarantined range.
    Scribble {
        pick: u8,
    },
    Resolve {
        keys: Vec<(u64, usize)>,
    },
    /// Unpin a live pin, or (`stale`) one already unpinned/expired or never
    /// handed out.
    Unpin {
        pick: usize,
        stale: bool,
    },
    ReleaseRows {
        rows: Vec<u64>,
    },
    /// Advance the virtual clock, then (mostly) tick. Without the tick,
    /// leases run out without being reclaimed yet, as when the driver ticks
    /// late: the unit must keep honouring them until it does.
    Advance {
        ms: u64,
        tick: bool,
    },
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let size = prop_oneof![3 => 0..=MAX_BLOB, 1 => 0u64..130];
    prop_oneof![
        4 => (0..N_BLOBS, size, 0u32..4).prop_map(|(blob, size, n)| Op::Alloc { blob, size, n }),
        2 => any::<u8>().prop_map(|pick| Op::Retry { pick }),
        5 => (
            any::<u8>(),
            prop::collection::vec((0..ROWS, 0..FIELDS.len(), any::<u16>(), any::<u16>()), 4),
            any::<u8>(),
        )
            .prop_map(|(pick, entries, fault)| Op::Commit { pick, entries, fault }),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(pick, in_flight)| Op::Abort { pick, in_flight }),
        1 => any::<u8>().prop_map(|pick| Op::Scribble { pick }),
        3 => prop::collection::vec((0..ROWS, 0..FIELDS.len()), 1..5)
            .prop_map(|keys| Op::Resolve { keys }),
        2 => (any::<usize>(), prop::bool::weighted(0.2))
            .prop_map(|(pick, stale)| Op::Unpin { pick, stale }),
        2 => prop::collection::vec(0..ROWS + 1, 0..4).prop_map(|rows| Op::ReleaseRows { rows }),
        3 => (0u64..25, prop::bool::weighted(0.75)).prop_map(|(ms, tick)| Op::Advance { ms, tick }),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MState {
    Reserved { expires: Time, nbytes: u64, n: u32 },
    Committed,
    Quarantined { until: Time },
}

#[derive(Clone, Copy, Debug)]
struct MBlob {
    offset: u64,
    len: u64,
    state: MState,
}

#[derive(Clone, Debug)]
struct MValue {
    blob: BlobId,
    loc: Location,
    bytes: Vec<u8>,
}

#[derive(Clone, Debug)]
struct MPin {
    blobs: BTreeSet<BlobId>,
    expires: Time,
    snapshots: Vec<(Location, Vec<u8>)>,
}

struct Harness {
    core: UnitCore,
    /// The simulated slab.
    slab: Vec<u8>,
    now: Time,
    rng: u64,
    /// Every blob the unit should hold, by state.
    blobs: BTreeMap<BlobId, MBlob>,
    /// Committed values of `NS`.
    values: BTreeMap<Key, MValue>,
    /// Pins the unit should still hold (not unpinned, not reclaimed by tick).
    pins: BTreeMap<PinId, MPin>,
    /// Pins unpinned or reclaimed: unpinning them again must change nothing.
    dead_pins: Vec<PinId>,
    /// Committed blobs since freed: the unit remembers them, so a retried
    /// alloc answers AlreadyCommitted and a retried commit succeeds.
    freed_commits: BTreeSet<BlobId>,
}

impl Harness {
    fn new(seed: u64) -> Self {
        let cfg = CoreConfig {
            capacity: CAP,
            reservation_lease: ms(RESERVATION_LEASE_MS),
            pin_lease: ms(PIN_LEASE_MS),
            quarantine: ms(QUARANTINE_MS),
            ..CoreConfig::new(CAP)
        };
        Self {
            core: UnitCore::new(cfg).expect("valid config"),
            slab: vec![0; CAP as usize],
            now: Duration::ZERO,
            rng: seed,
            blobs: BTreeMap::new(),
            values: BTreeMap::new(),
            pins: BTreeMap::new(),
            dead_pins: Vec::new(),
            freed_commits: BTreeSet::new(),
        }
    }

    /// A client writes fresh bytes (splitmix64 stream) over
    /// `[offset, offset + len)`.
    fn scribble(&mut self, offset: u64, len: u64) {
        let mut state = self.rng;
        for chunk in self.slab[offset as usize..(offset + len) as usize].chunks_mut(8) {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
        }
        self.rng = state;
    }

    fn read(&self, loc: Location) -> &[u8] {
        &self.slab[loc.offset as usize..(loc.offset + loc.len) as usize]
    }

    fn used(&self) -> u64 {
        self.blobs.values().map(|b| b.len).sum()
    }

    fn reserved_bytes(&self) -> u64 {
        self.blobs
            .values()
            .filter(|b| matches!(b.state, MState::Reserved { .. }))
            .map(|b| b.len)
            .sum()
    }

    fn quarantined_bytes(&self) -> u64 {
        self.blobs
            .values()
            .filter(|b| matches!(b.state, MState::Quarantined { .. }))
            .map(|b| b.len)
            .sum()
    }

    /// The largest contiguous free range of the slab, per the model.
    fn largest_gap(&self) -> u64 {
        let mut regions: Vec<(u64, u64)> = self.blobs.values().map(|b| (b.offset, b.len)).collect();
        regions.sort_unstable();
        let mut at = 0;
        let mut best = 0;
        for (off, len) in regions {
            best = best.max(off.saturating_sub(at));
            at = at.max(off + len);
        }
        best.max(CAP - at)
    }

    /// Blobs in `state` (by a predicate), for picking targets.
    fn blobs_where(&self, f: impl Fn(&MState) -> bool) -> Vec<BlobId> {
        self.blobs
            .iter()
            .filter(|(_, b)| f(&b.state))
            .map(|(id, _)| *id)
            .collect()
    }

    /// A committed blob is freed once no value and no pin refers to it.
    fn gc(&mut self) {
        let mut held: BTreeSet<BlobId> = self.values.values().map(|v| v.blob).collect();
        for p in self.pins.values() {
            held.extend(p.blobs.iter().copied());
        }
        let freed = &mut self.freed_commits;
        self.blobs.retain(|id, b| {
            let keep = b.state != MState::Committed || held.contains(id);
            if !keep {
                freed.insert(*id);
            }
            keep
        });
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Alloc { blob, size, n } => self.alloc(blob_id(*blob), *size, *n),
            Op::Retry { pick } => {
                let reserved = self.blobs_where(|s| matches!(s, MState::Reserved { .. }));
                let committed = self.blobs_where(|s| *s == MState::Committed);
                if pick % 2 == 0 && !reserved.is_empty() {
                    let id = reserved[usize::from(*pick / 2) % reserved.len()];
                    let MState::Reserved { nbytes, n, .. } = self.blobs[&id].state else {
                        unreachable!()
                    };
                    self.alloc(id, nbytes, n)
                } else if !committed.is_empty() {
                    let id = committed[usize::from(*pick / 2) % committed.len()];
                    self.alloc(id, u64::from(*pick) * 7, u32::from(*pick % 4))
                } else {
                    self.alloc(blob_id(*pick), u64::from(*pick) * 7, 1)
                }
            }
            Op::Commit {
                pick,
                entries,
                fault,
            } => {
                let reserved = self.blobs_where(|s| matches!(s, MState::Reserved { .. }));
                // Mostly a blob the test reserved; sometimes any id of the
                // pool (committed, quarantined, expired, unknown).
                let id = if pick % 8 != 0 && !reserved.is_empty() {
                    reserved[usize::from(*pick / 8) % reserved.len()]
                } else {
                    blob_id(*pick / 8)
                };
                let (nbytes, n) = match self.blobs.get(&id).map(|b| b.state) {
                    Some(MState::Reserved { nbytes, n, .. }) => (nbytes, n as usize),
                    _ => (64, usize::from(fault % 4)),
                };
                let mut specs: Vec<EntrySpec> = entries
                    .iter()
                    .map(|&(row, field, o, l)| {
                        let offset = u64::from(o) % (nbytes + 1);
                        let len = u64::from(l) % (nbytes - offset + 1);
                        EntrySpec {
                            key: key(row, field),
                            offset,
                            len,
                            meta: vec![],
                        }
                    })
                    .collect();
                match fault % 16 {
                    0 => specs.truncate(n + 1), // one entry too many
                    1 if n > 0 => {
                        specs.truncate(n);
                        // The last entry ends one byte past the blob.
                        let last = &mut specs[n - 1];
                        last.len = last.len.max(1);
                        last.offset = nbytes + 1 - last.len;
                    }
                    _ => specs.truncate(n),
                }
                self.commit(id, &specs)
            }
            Op::Abort { pick, in_flight } => {
                let reserved = self.blobs_where(|s| matches!(s, MState::Reserved { .. }));
                let id = if pick % 4 != 0 && !reserved.is_empty() {
                    reserved[usize::from(*pick / 4) % reserved.len()]
                } else {
                    blob_id(*pick / 4)
                };
                self.core.abort(id, *in_flight, self.now);
                if let Some(b) = self.blobs.get_mut(&id) {
                    if let MState::Reserved { .. } = b.state {
                        if *in_flight {
                            b.state = MState::Quarantined {
                                until: self.now + ms(QUARANTINE_MS),
                            };
                        } else {
                            self.blobs.remove(&id);
                        }
                    }
                }
                Ok(())
            }
            Op::Scribble { pick } => {
                let writable = self.blobs_where(|s| !matches!(s, MState::Committed));
                if !writable.is_empty() {
                    let b = self.blobs[&writable[usize::from(*pick) % writable.len()]];
                    self.scribble(b.offset, b.len);
                }
                Ok(())
            }
            Op::Resolve { keys } => {
                let keys: Vec<Key> = keys.iter().map(|&(r, f)| key(r, f)).collect();
                self.resolve_and_pin(&keys)
            }
            Op::Unpin { pick, stale } => {
                if *stale || self.pins.is_empty() {
                    let pin = if self.dead_pins.is_empty() || pick % 4 == 0 {
                        PinId(u64::MAX - (*pick as u64 % 1000))
                    } else {
                        self.dead_pins[pick % self.dead_pins.len()]
                    };
                    prop_assert!(!self.pins.contains_key(&pin));
                    self.core.unpin(pin);
                } else {
                    let pin = *self.pins.keys().nth(pick % self.pins.len()).unwrap();
                    self.core.unpin(pin);
                    self.pins.remove(&pin);
                    self.dead_pins.push(pin);
                    self.gc();
                }
                Ok(())
            }
            Op::ReleaseRows { rows } => {
                let set: BTreeSet<u64> = rows.iter().copied().collect();
                let expected = self.values.keys().filter(|k| set.contains(&k.row)).count() as u64;
                let got = self.core.release_rows(NS, rows);
                prop_assert_eq!(got, expected, "release_rows({:?}) count", rows);
                self.values.retain(|k, _| !set.contains(&k.row));
                self.gc();
                Ok(())
            }
            Op::Advance { ms: d, tick } => {
                if *tick {
                    self.advance(ms(*d));
                } else {
                    self.now += ms(*d);
                }
                Ok(())
            }
        }
    }

    fn alloc(&mut self, id: BlobId, nbytes: u64, n: u32) -> Result<(), TestCaseError> {
        let got = self.core.alloc(id, nbytes, n, self.now);
        match self.blobs.get(&id).copied() {
            Some(MBlob {
                offset,
                len,
                state:
                    MState::Reserved {
                        nbytes: nb, n: nn, ..
                    },
            }) if nb == nbytes && nn == n => {
                // A retry: same range, lease renewed.
                prop_assert_eq!(
                    got,
                    Ok(Allocated::Reserved { offset }),
                    "retried alloc of {:?}",
                    id
                );
                self.blobs.get_mut(&id).unwrap().state = MState::Reserved {
                    expires: self.now + ms(RESERVATION_LEASE_MS),
                    nbytes,
                    n,
                };
                self.scribble(offset, len);
            }
            Some(MBlob {
                state: MState::Reserved { .. } | MState::Quarantined { .. },
                ..
            }) => {
                prop_assert!(
                    matches!(got, Err(CoreError::Invalid(_))),
                    "alloc of reserved-with-other-params or quarantined {:?}: {:?}",
                    id,
                    got
                );
            }
            Some(MBlob {
                state: MState::Committed,
                ..
            }) => {
                prop_assert_eq!(
                    got,
                    Ok(Allocated::AlreadyCommitted),
                    "alloc of committed {:?}",
                    id
                );
            }
            None if self.freed_commits.contains(&id) => {
                prop_assert_eq!(
                    got,
                    Ok(Allocated::AlreadyCommitted),
                    "alloc of committed-then-freed {:?}",
                    id
                );
            }
            None => {
                let len = rounded(nbytes);
                let free = CAP - self.used();
                let reclaimable = self.reserved_bytes() + self.quarantined_bytes();
                match got {
                    Ok(Allocated::Reserved { offset }) => {
                        prop_assert!(
                            len <= free,
                            "alloc of {} bytes with only {} free",
                            len,
                            free
                        );
                        prop_assert!(
                            offset % ALIGN == 0 && offset + len <= CAP,
                            "region {}+{} misaligned or outside the slab",
                            offset,
                            len
                        );
                        for (other, b) in &self.blobs {
                            prop_assert!(
                                offset + len <= b.offset || b.offset + b.len <= offset,
                                "alloc of {:?} got {}+{}, overlapping {:?} at {}+{} ({:?})",
                                id,
                                offset,
                                len,
                                other,
                                b.offset,
                                b.len,
                                b.state
                            );
                        }
                        self.blobs.insert(
                            id,
                            MBlob {
                                offset,
                                len,
                                state: MState::Reserved {
                                    expires: self.now + ms(RESERVATION_LEASE_MS),
                                    nbytes,
                                    n,
                                },
                            },
                        );
                        // The client writes its bytes right away.
                        self.scribble(offset, len);
                    }
                    Ok(Allocated::AlreadyCommitted) => {
                        prop_assert!(false, "AlreadyCommitted for unknown blob {:?}", id);
                    }
                    Ok(Allocated::ToDisk) => {
                        prop_assert!(false, "ToDisk without a disk tier for {:?}", id);
                    }
                    Err(e) => {
                        let expected = if len <= CAP && free + reclaimable >= len && reclaimable > 0
                        {
                            CoreError::Busy {
                                needed: nbytes,
                                reclaimable,
                            }
                        } else {
                            CoreError::Full {
                                needed: nbytes,
                                free,
                                capacity: CAP,
                            }
                        };
                        prop_assert_eq!(&e, &expected, "refused alloc of {} bytes", nbytes);
                        // No spurious refusal: a free range of twice the size
                        // always fits (segregated fit rounds a request up by
                        // less than one bin, i.e. < 2x).
                        let gap = self.largest_gap();
                        prop_assert!(
                            gap < 2 * len,
                            "alloc of {} bytes refused ({:?}) with a free range of {} bytes",
                            len,
                            e,
                            gap
                        );
                    }
                }
            }
        }
        Ok(())
    }

    fn commit(&mut self, id: BlobId, specs: &[EntrySpec]) -> Result<(), TestCaseError> {
        let got = self.core.commit(NS, id, specs);
        if !self.blobs.contains_key(&id) && self.freed_commits.contains(&id) {
            prop_assert_eq!(
                got,
                Ok(Committed::Done),
                "commit retry of committed-then-freed {:?}",
                id
            );
            return Ok(());
        }
        match self.blobs.get(&id).copied() {
            // Never allocated, or a reservation whose lease ended and
            // was reclaimed by a tick (quarantined, or already freed).
            None
            | Some(MBlob {
                state: MState::Quarantined { .. },
                ..
            }) => {
                prop_assert_eq!(got, Err(CoreError::UnknownBlob(id)), "commit of {:?}", id);
            }
            Some(MBlob {
                state: MState::Committed,
                ..
            }) => {
                prop_assert_eq!(got, Ok(Committed::Done), "idempotent commit of {:?}", id);
            }
            Some(MBlob {
                offset: base,
                state: MState::Reserved { nbytes, n, .. },
                ..
            }) => {
                let valid = specs.len() == n as usize
                    && specs
                        .iter()
                        .all(|e| e.offset.checked_add(e.len).is_some_and(|end| end <= nbytes));
                if !valid {
                    prop_assert!(
                        matches!(got, Err(CoreError::Invalid(_))),
                        "invalid commit of {:?} ({} bytes, {} entries) {:?}: {:?}",
                        id,
                        nbytes,
                        n,
                        specs,
                        got
                    );
                    return Ok(());
                }
                prop_assert_eq!(got, Ok(Committed::Done), "commit of reserved {:?}", id);
                self.blobs.get_mut(&id).unwrap().state = MState::Committed;
                // In entry order: a later entry of the same key wins.
                for e in specs {
                    let loc = Location {
                        offset: base + e.offset,
                        len: e.len,
                    };
                    let bytes = self.read(loc).to_vec();
                    self.values.insert(
                        e.key.clone(),
                        MValue {
                            blob: id,
                            loc,
                            bytes,
                        },
                    );
                }
                self.gc();
            }
        }
        Ok(())
    }

    /// Resolve `keys`, check the answer, and keep the pin.
    fn resolve_and_pin(&mut self, keys: &[Key]) -> Result<(), TestCaseError> {
        let (pin, locs) = self.core.resolve(NS, keys, self.now);
        prop_assert_eq!(locs.len(), keys.len());
        let mut blobs = BTreeSet::new();
        let mut snapshots = Vec::new();
        for (k, loc) in keys.iter().zip(&locs) {
            match self.values.get(k) {
                None => prop_assert_eq!(*loc, None, "key {} not committed", k),
                Some(v) => {
                    prop_assert_eq!(*loc, Some(Place::Memory(v.loc)), "location of {}", k);
                    prop_assert_eq!(self.read(v.loc), &v.bytes[..], "bytes of {}", k);
                    blobs.insert(v.blob);
                    snapshots.push((v.loc, self.read(v.loc).to_vec()));
                }
            }
        }
        if blobs.is_empty() {
            prop_assert_eq!(pin, None, "pin without a found key");
        } else {
            let Some(pin) = pin else {
                return Err(TestCaseError::fail("no pin although keys were found"));
            };
            prop_assert!(
                !self.pins.contains_key(&pin) && !self.dead_pins.contains(&pin),
                "pin id {:?} handed out twice",
                pin
            );
            self.pins.insert(
                pin,
                MPin {
                    blobs,
                    expires: self.now + ms(PIN_LEASE_MS),
                    snapshots,
                },
            );
        }
        Ok(())
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
        let now = self.now;
        self.core.tick(now);
        let quarantine = ms(QUARANTINE_MS);
        self.blobs.retain(|_, b| match b.state {
            MState::Reserved { expires, .. } if expires <= now => {
                // Quarantined from the tick that noticed, not from expiry.
                b.state = MState::Quarantined {
                    until: now + quarantine,
                };
                true
            }
            MState::Quarantined { until } => until > now,
            _ => true,
        });
        let expired: Vec<PinId> = self
            .pins
            .iter()
            .filter(|(_, p)| p.expires <= now)
            .map(|(id, _)| *id)
            .collect();
        for pin in expired {
            self.pins.remove(&pin);
            self.dead_pins.push(pin);
        }
        self.gc();
    }

    fn check(&mut self) -> Result<(), TestCaseError> {
        // 1. Regions: aligned, inside the slab, pairwise disjoint, and
        //    exactly the blobs of the model.
        let mut regions: Vec<(BlobId, u64, u64)> = self.core.regions().collect();
        regions.sort_unstable_by_key(|&(_, off, _)| off);
        for &(id, off, len) in &regions {
            prop_assert!(
                off % ALIGN == 0 && len > 0 && off + len <= CAP,
                "region of {:?} at {}+{} is misaligned or outside the slab",
                id,
                off,
                len
            );
        }
        for w in regions.windows(2) {
            prop_assert!(
                w[0].1 + w[0].2 <= w[1].1,
                "regions overlap: {:?} and {:?}",
                w[0],
                w[1]
            );
        }
        let core_regions: BTreeMap<BlobId, (u64, u64)> = regions
            .iter()
            .map(|&(id, off, len)| (id, (off, len)))
            .collect();
        let model_regions: BTreeMap<BlobId, (u64, u64)> = self
            .blobs
            .iter()
            .map(|(id, b)| (*id, (b.offset, b.len)))
            .collect();
        prop_assert_eq!(
            &core_regions,
            &model_regions,
            "blobs held by the core vs the model ({:?})",
            self.blobs
        );

        // 4. Counters.
        let rows: BTreeSet<u64> = self.values.keys().map(|k| k.row).collect();
        let expected = Stats {
            capacity: CAP,
            used: self.used(),
            reserved_bytes: self.reserved_bytes(),
            quarantined_bytes: self.quarantined_bytes(),
            blobs: self.blobs.len() as u64,
            entries: self.values.len() as u64,
            rows: rows.len() as u64,
            pins: self.pins.len() as u64,
            ..Stats::default()
        };
        prop_assert_eq!(self.core.stats(), expected, "stats");

        // 2. Every committed key reads back exactly; others are absent.
        let keys = all_keys();
        let (pin, locs) = self.core.resolve(NS, &keys, self.now);
        for (k, loc) in keys.iter().zip(&locs) {
            match self.values.get(k) {
                None => prop_assert_eq!(
                    *loc,
                    None,
                    "key {} resolves but was never committed or was released",
                    k
                ),
                Some(v) => {
                    prop_assert_eq!(*loc, Some(Place::Memory(v.loc)), "location of {}", k);
                    prop_assert_eq!(
                        self.read(v.loc),
                        &v.bytes[..],
                        "bytes of {} at {:?} changed since commit",
                        k,
                        v.loc
                    );
                }
            }
        }
        prop_assert_eq!(
            pin.is_some(),
            !self.values.is_empty(),
            "pin of the check resolve"
        );
        if let Some(pin) = pin {
            prop_assert!(!self.pins.contains_key(&pin) && !self.dead_pins.contains(&pin));
            self.core.unpin(pin);
            self.dead_pins.push(pin);
        }
        let (pin, locs) = self.core.resolve("other", &keys, self.now);
        prop_assert!(
            pin.is_none() && locs.iter().all(Option::is_none),
            "namespaces leak"
        );
        prop_assert_eq!(
            self.core.stats().pins,
            self.pins.len() as u64,
            "pins after check resolve"
        );

        // 3. Pinned bytes neither move nor change while the unit holds the pin.
        for (id, p) in &self.pins {
            for (loc, snap) in &p.snapshots {
                prop_assert_eq!(
                    self.read(*loc),
                    &snap[..],
                    "pinned bytes at {:?} of {:?} changed",
                    loc,
                    id
                );
            }
        }
        Ok(())
    }

    /// Release everything, let every lease and quarantine end: the unit must
    /// be empty and whole again.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        let rows: Vec<u64> = (0..ROWS).collect();
        let expected = self.values.len() as u64;
        prop_assert_eq!(self.core.release_rows(NS, &rows), expected, "final release");
        self.values.clear();
        self.gc();
        self.check()?;
        // Past every reservation and pin lease: reservations are quarantined
        // (from now), pins and their blobs reclaimed.
        self.advance(ms(RESERVATION_LEASE_MS.max(PIN_LEASE_MS)));
        self.check()?;
        // Past every quarantine.
        self.advance(ms(QUARANTINE_MS));
        self.check()?;
        let s = self.core.stats();
        prop_assert_eq!(s.used, 0, "bytes leaked: {:?}", s);
        prop_assert_eq!(s.pins, 0, "pins leaked: {:?}", s);
        prop_assert_eq!(s.entries, 0, "entries leaked: {:?}", s);
        prop_assert_eq!(s.blobs, 0, "blobs leaked: {:?}", s);
        prop_assert_eq!(s.rows, 0);
        prop_assert_eq!(s.reserved_bytes, 0);
        prop_assert_eq!(s.quarantined_bytes, 0);
        prop_assert_eq!(self.core.regions().count(), 0);
        prop_assert_eq!(self.core.next_deadline(), None, "timers left");
        // The freed ranges coalesced: the whole slab fits in one piece.
        let whole = BlobId(u128::MAX);
        prop_assert_eq!(
            self.core.alloc(whole, CAP, 0, self.now),
            Ok(Allocated::Reserved { offset: 0 }),
            "whole slab after everything was freed"
        );
        self.core.abort(whole, false, self.now);
        prop_assert_eq!(self.core.stats().used, 0);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        // Keep this test a single file: no regression files next to it.
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn unit_core_matches_model(
        seed in any::<u64>(),
        ops in prop::collection::vec(op_strategy(), 1..200),
    ) {
        let mut h = Harness::new(seed);
        h.check()?;
        for (i, op) in ops.iter().enumerate() {
            h.apply(op).map_err(|e| TestCaseError::fail(format!("op #{i} {op:?}: {e}")))?;
            h.check().map_err(|e| TestCaseError::fail(format!("after op #{i} {op:?} at {:?}: {e}", h.now)))?;
        }
        h.finish()?;
    }
}
