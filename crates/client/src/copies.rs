//! Copies of rows on several units ([`ClientConfig::replicas`]): which
//! units hold the copies of what a unit holds, and which failures of one
//! copy send a read on to the next. The put (`put.rs`), the get and the
//! clear (`blobs.rs`) and views (`views.rs`) ask here.
//!
//! Copy 0 of a row is on the row's own unit; copy `i` on the `i`-th unit
//! after it (wrapping round) whose host holds none of the copies before
//! it, or, when there are too few hosts, on the next unit not holding one.
//! Every client of a plane computes the same placement from the same
//! units and hosts.
//!
//! A read goes to the copies in order, except that a unit a read found
//! gone or not answering within [`SUSPECT_FOR`] is asked last: while a
//! unit is stopped, reads of its rows go straight to their next copy
//! instead of each waiting out its share of the deadline.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

#[cfg(doc)]
use crate::ClientConfig;
use crate::{lock, Client, Error};

/// How long a unit that a read found gone or not answering is asked
/// after the other copies.
pub(crate) const SUSPECT_FOR: Duration = Duration::from_secs(5);

/// The copies' units, in the order a read asks them.
pub(crate) type ReadOrder = SmallVec<[usize; 4]>;

/// Where the copies of each unit's rows go.
#[derive(Debug)]
pub(crate) struct Copies {
    replicas: usize,
    hosts: Vec<Option<String>>,
    /// `units[u]`: the units of the copies of what unit `u` holds, copy 0
    /// first (`u` while it is up); empty with one copy. Made again when a
    /// unit goes down.
    units: RwLock<Arc<Vec<Box<[usize]>>>>,
    /// `units` when the client connected: what every client of the plane
    /// starts from. A unit in a set now that is not in its first set is a
    /// *newcomer* to those rows: it holds only what was put since, until a
    /// repair copies the rest (`repair.rs`).
    first: Vec<Box<[usize]>>,
    /// (unit, newcomer) pairs this client repaired: the newcomer holds
    /// every row of the unit's that a copy it was repaired from held.
    repaired: Mutex<HashSet<(usize, usize)>>,
    /// Units whose copies share a host (too few distinct hosts), when
    /// the client connected.
    pub(crate) short_of_hosts: usize,
    /// Units found dead or restarted: no copy goes there any more.
    down: Box<[AtomicBool]>,
    /// Units that rejoined the plane as another instance
    /// (docs/replication.md#rejoining): empty when they came, so not a
    /// copy that holds every row of the first placement's, until repaired.
    rejoined: Mutex<HashSet<usize>>,
    /// Units taken as down on a word that is not proof, which did not
    /// answer when this client fenced them (`fence.rs`): asked again.
    pub(crate) fences: Mutex<Vec<usize>>,
    /// Counts the units gone down (a call that saw it change places again).
    pub(crate) epoch: AtomicU64,
    /// Per unit (with copies), until when (ms after `born`) reads ask it
    /// last; 0: not suspected.
    suspect: Box<[AtomicU64]>,
    born: Instant,
}

/// The copies' units of every unit's rows: for unit `u`, the first
/// `replicas` units up from `u` on, skipping units whose host holds an
/// earlier copy, then (too few hosts) any unit up not holding one; and how
/// many units' sets had to share a host.
fn place_all(
    n: usize,
    replicas: usize,
    hosts: &[Option<String>],
    down: &dyn Fn(usize) -> bool,
) -> (Vec<Box<[usize]>>, usize) {
    let host = |u: usize| hosts.get(u).and_then(Option::as_deref);
    let mut short = 0;
    let units = (0..n)
        .map(|u| {
            let mut set = Vec::with_capacity(replicas);
            let mut used: HashSet<&str> = HashSet::new();
            for v in (0..n).map(|j| (u + j) % n).filter(|&v| !down(v)) {
                if set.len() == replicas {
                    break;
                }
                match host(v) {
                    Some(h) if used.contains(h) => {}
                    Some(h) => {
                        used.insert(h);
                        set.push(v);
                    }
                    None => set.push(v),
                }
            }
            if set.len() < replicas {
                short += 1;
                for v in (0..n).map(|j| (u + j) % n).filter(|&v| !down(v)) {
                    if set.len() == replicas {
                        break;
                    }
                    if !set.contains(&v) {
                        set.push(v);
                    }
                }
            }
            set.into_boxed_slice()
        })
        .collect();
    (units, short)
}

impl Copies {
    /// The placement of `replicas` copies over `n` units on `hosts`
    /// (`None`, or a list shorter than `n`: a host of its own).
    pub(crate) fn place(n: usize, replicas: usize, hosts: &[Option<String>]) -> Copies {
        let (units, short) = if replicas > 1 {
            place_all(n, replicas, hosts, &|_| false)
        } else {
            (Vec::new(), 0)
        };
        let per_unit = if replicas > 1 { n } else { 0 };
        Copies {
            replicas,
            hosts: hosts.to_vec(),
            first: units.clone(),
            repaired: Mutex::new(HashSet::new()),
            units: RwLock::new(Arc::new(units)),
            short_of_hosts: short,
            down: (0..per_unit).map(|_| AtomicBool::new(false)).collect(),
            rejoined: Mutex::new(HashSet::new()),
            fences: Mutex::new(Vec::new()),
            epoch: AtomicU64::new(0),
            suspect: (0..per_unit).map(|_| AtomicU64::new(0)).collect(),
            born: Instant::now(),
        }
    }

    /// The copies' units of `unit`'s rows now.
    fn set(&self, unit: usize) -> ReadOrder {
        let units = self.units.read().unwrap_or_else(|p| p.into_inner());
        match units.get(unit) {
            Some(set) => set.iter().copied().collect(),
            None => std::iter::once(unit).collect(),
        }
    }

    /// `unit` was found dead or restarted: place every set again without
    /// it. Whether it was up until now.
    pub(crate) fn went_down(&self, unit: usize) -> bool {
        let Some(d) = self.down.get(unit) else {
            return false;
        };
        if d.swap(true, Relaxed) {
            return false;
        }
        let down = |u: usize| self.down[u].load(Relaxed);
        let (placed, _) = place_all(self.down.len(), self.replicas, &self.hosts, &down);
        let mut units = self.units.write().unwrap_or_else(|p| p.into_inner());
        // The copies left first, in their order, then the newcomers: a
        // read asks a copy that holds every row before one that may still
        // be repaired, and a clear reaches the newcomers last.
        let now: Vec<Box<[usize]>> = units
            .iter()
            .zip(placed)
            .map(|(old, new)| {
                let left = old.iter().copied().filter(|u| new.contains(u));
                let came = new.iter().copied().filter(|u| !old.contains(u));
                left.chain(came).collect()
            })
            .collect();
        *units = Arc::new(now);
        drop(units);
        self.epoch.fetch_add(1, Relaxed);
        true
    }

    /// `unit` rejoined the plane as another instance, empty: copies go
    /// there again, after the copies left of each set it joins (a read
    /// asks a copy that holds every row first), and it holds none of the
    /// rows it had until a repair copies them. The (unit, copy) pairs
    /// that left a set: those copies are no longer kept up to date (what
    /// a rejoin clears there). Empty when `unit` was up already.
    pub(crate) fn came_up(&self, unit: usize) -> Vec<(usize, usize)> {
        let Some(d) = self.down.get(unit) else {
            return Vec::new();
        };
        if !d.swap(false, Relaxed) {
            return Vec::new();
        }
        lock(&self.rejoined).insert(unit);
        let down = |u: usize| self.down[u].load(Relaxed);
        let (placed, _) = place_all(self.down.len(), self.replicas, &self.hosts, &down);
        let mut units = self.units.write().unwrap_or_else(|p| p.into_inner());
        let mut left_sets = Vec::new();
        let now: Vec<Box<[usize]>> = units
            .iter()
            .zip(placed)
            .enumerate()
            .map(|(g, (old, new))| {
                left_sets.extend(old.iter().filter(|u| !new.contains(u)).map(|&u| (g, u)));
                let left = old.iter().copied().filter(|u| new.contains(u));
                let came = new.iter().copied().filter(|u| !old.contains(u));
                left.chain(came).collect()
            })
            .collect();
        *units = Arc::new(now);
        drop(units);
        let mut repaired = lock(&self.repaired);
        repaired.retain(|&(g, c)| c != unit && !left_sets.contains(&(g, c)));
        drop(repaired);
        self.epoch.fetch_add(1, Relaxed);
        left_sets
    }

    /// Every unit's copies' units (as sets: their order is the history's)
    /// were `unit` down too: where clients that take it as down place
    /// copies.
    pub(crate) fn members_without(&self, unit: usize) -> Vec<Box<[usize]>> {
        let down = |u: usize| u == unit || self.down.get(u).is_some_and(|d| d.load(Relaxed));
        place_all(self.down.len(), self.replicas, &self.hosts, &down).0
    }

    /// The units in `unit`'s set now that were not in it at connect, or
    /// rejoined since.
    fn newcomers(&self, unit: usize) -> ReadOrder {
        let mut set = self.set(unit);
        set.retain(|u| !self.in_first(unit, *u));
        set
    }

    /// Whether `copy` is one of `unit`'s first placement's copies, as the
    /// instance it was then.
    fn in_first(&self, unit: usize, copy: usize) -> bool {
        let first = self.first.get(unit).map_or(&[][..], |f| &f[..]);
        first.contains(&copy) && !lock(&self.rejoined).contains(&copy)
    }

    /// The repairs `unit`'s rows wait for: (source, newcomer) pairs, the
    /// source a copy that holds every row (one of the first placement, or
    /// a newcomer this client repaired). None when no such copy is up.
    fn repairs_of(&self, unit: usize) -> Vec<(usize, usize)> {
        let set = self.set(unit);
        let Some(source) = self.source_in(unit, &set) else {
            return Vec::new();
        };
        set.iter()
            .filter(|&&u| !self.whole(unit, u))
            .map(|&t| (source, t))
            .collect()
    }

    /// Whether `copy` holds every row of `unit`'s: it is one of the first
    /// placement's copies, or a newcomer this client repaired.
    fn whole(&self, unit: usize, copy: usize) -> bool {
        self.in_first(unit, copy)
            || self
                .repaired
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&(unit, copy))
    }

    /// The first unit of `set` (`unit`'s copies now) that holds all of
    /// `unit`'s rows.
    fn source_in(&self, unit: usize, set: &[usize]) -> Option<usize> {
        set.iter().copied().find(|&u| self.whole(unit, u))
    }

    /// The *source* of `unit`'s rows: the first of its copies now that
    /// holds them all (what repairs copy from, and what a checkpoint
    /// writes them from); `None` when no such copy is up.
    pub(crate) fn source_of(&self, unit: usize) -> Option<usize> {
        self.source_in(unit, &self.set(unit))
    }

    /// Each unit up, and the homes it is the source of
    /// ([`Copies::source_of`]; none for some): what it checkpoints and
    /// claims with copies.
    pub(crate) fn sources_up(&self) -> Vec<(usize, Vec<u32>)> {
        let n = self.down.len();
        let mut homes = vec![Vec::new(); n];
        for g in 0..n {
            if let Some(s) = self.source_of(g) {
                homes[s].push(g as u32);
            }
        }
        homes
            .into_iter()
            .enumerate()
            .filter(|&(u, _)| !self.is_down(u))
            .collect()
    }

    /// Whether `unit` is known to be down (found dead or restarted, or
    /// declared gone).
    pub(crate) fn is_down(&self, unit: usize) -> bool {
        self.down.get(unit).is_some_and(|d| d.load(Relaxed))
    }

    fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    fn suspected(&self, unit: usize) -> bool {
        self.suspect
            .get(unit)
            .is_some_and(|s| s.load(Relaxed) > self.now_ms())
    }
}

/// Where the copies of each unit's rows go on a plane of `units` units on
/// `hosts` (as [`ClientConfig::hosts`]): for each unit, its copies' units,
/// copy 0 first; and how many units' copies share a host (too few hosts).
/// What every client of such a plane computes; for reports
/// (`stowage status`).
pub fn copy_sets(
    units: usize,
    replicas: usize,
    hosts: &[Option<String>],
) -> (Vec<Vec<usize>>, usize) {
    let c = Copies::place(units, replicas, hosts);
    let sets = (0..units).map(|u| c.set(u).to_vec()).collect();
    (sets, c.short_of_hosts)
}

impl Client {
    /// How many units hold a copy of each row ([`ClientConfig::replicas`]).
    pub fn replicas(&self) -> usize {
        self.cfg.replicas
    }

    /// The units holding the copies of what `unit` holds now, copy 0
    /// first: `replicas` of them, or fewer when fewer units are up.
    pub fn copies_of(&self, unit: usize) -> SmallVec<[usize; 4]> {
        self.copies.set(unit)
    }

    /// Tell the client that unit `unit` is gone for good (its process
    /// dead, as a cluster manager knows, e.g. Ray's actor state): with
    /// copies, no copy goes there any more, the rows it held a copy of
    /// are placed on the next unit up, and repairs give them their copy
    /// there. A unit that still answers is fenced first (it stops serving
    /// and exits: docs/replication.md#fencing); one that does not answer
    /// is fenced once it does, by the background repairer.
    pub fn unit_gone(&self, unit: usize) {
        self.take_down_on_word(unit, Instant::now());
    }

    /// A unit found dead, or restarted with empty memory: with copies,
    /// nothing goes there any more, and the rows it held a copy of are
    /// placed on the next unit up (docs/replication.md).
    pub(crate) fn unit_down(&self, unit: usize) {
        if self.copies.went_down(unit) {
            self.metrics.unit_down();
            self.metrics.repairs_pending(self.repairs_due().len());
            tracing::warn!(
                "unit {unit} is gone (dead, or restarted empty): the copies it held go to the next unit up from now on; rows put before get their copy there by repair"
            );
        }
    }

    /// The units holding copies of `unit`'s rows now that did not at
    /// connect (they hold what was put since; repairs copy the rest).
    pub(crate) fn newcomers_of(&self, unit: usize) -> ReadOrder {
        self.copies.newcomers(unit)
    }

    /// Every unit that is a newcomer to some unit's rows (see
    /// [`Client::newcomers_of`]), ascending.
    pub(crate) fn newcomers(&self) -> Vec<usize> {
        let mut all: Vec<usize> = (0..self.copies.first.len())
            .flat_map(|u| self.copies.newcomers(u))
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// The repairs this client knows to be due: (unit whose rows, source
    /// copy, newcomer) for every unit whose copies moved.
    pub(crate) fn repairs_due(&self) -> Vec<(usize, usize, usize)> {
        (0..self.copies.first.len())
            .flat_map(|u| {
                self.copies
                    .repairs_of(u)
                    .into_iter()
                    .map(move |(s, t)| (u, s, t))
            })
            .collect()
    }

    /// Every (unit, copy) of a set now whose copy this client does not
    /// know to hold all the unit's rows (a newcomer it has not repaired,
    /// nor read the mark of), with or without a source to repair it from.
    pub(crate) fn unsettled(&self) -> Vec<(usize, usize)> {
        (0..self.copies.first.len())
            .flat_map(|u| {
                self.copies
                    .set(u)
                    .into_iter()
                    .filter(move |&t| !self.copies.whole(u, t))
                    .map(move |t| (u, t))
            })
            .collect()
    }

    /// `target` now holds every row of `unit`'s its source held.
    pub(crate) fn repaired(&self, unit: usize, target: usize) {
        self.copies
            .repaired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((unit, target));
    }

    /// How many times units went down since the client connected (a call
    /// that saw it change places its copies again).
    pub(crate) fn copies_epoch(&self) -> u64 {
        self.copies.epoch.load(Relaxed)
    }

    /// Run a read `call` again where the copies are now when a unit went
    /// down while it ran and it failed for want of a copy (not found, or
    /// a copy gone): at most once per unit, within `deadline`.
    pub(crate) fn read_again_where_copies_are<T>(
        &self,
        deadline: Instant,
        mut call: impl FnMut() -> crate::Result<T>,
    ) -> crate::Result<T> {
        let mut tries = 0;
        loop {
            let epoch = self.copies_epoch();
            match call() {
                Err(e)
                    if (matches!(e, Error::NotFound { .. }) || next_copy_may_serve(&e))
                        && self.copies_epoch() != epoch
                        && tries < self.units.len()
                        && Instant::now() < deadline =>
                {
                    tries += 1
                }
                r => return r,
            }
        }
    }

    /// The units of `unit`'s copies in the order a read asks them: copy 0
    /// first, units suspected of being gone last (see the module docs).
    pub(crate) fn read_order(&self, unit: usize) -> ReadOrder {
        let mut order = self.copies_of(unit);
        order.sort_by_key(|&u| self.copies.suspected(u));
        order
    }

    /// A read found `unit` gone or not answering: reads ask it last for
    /// [`SUSPECT_FOR`].
    pub(crate) fn suspect(&self, unit: usize) {
        if let Some(s) = self.copies.suspect.get(unit) {
            let until = self.copies.now_ms() + SUSPECT_FOR.as_millis() as u64;
            s.store(until, Relaxed);
        }
    }

    /// `unit` answered: reads ask it in its turn again.
    pub(crate) fn trust(&self, unit: usize) {
        if let Some(s) = self.copies.suspect.get(unit) {
            if s.load(Relaxed) != 0 {
                s.store(0, Relaxed);
            }
        }
    }

    /// How many units' copies share a host with another copy of the same
    /// rows (the plane has fewer hosts than copies): 0 when every row's
    /// copies are on distinct hosts, or the hosts are not known.
    pub fn copies_short_of_hosts(&self) -> usize {
        self.copies.short_of_hosts
    }

    /// The deadline of one try at copy `i`: an even share of what is left
    /// of `deadline` among the copies not yet tried, so that a copy that
    /// does not answer (a stopped unit) leaves the others time.
    pub(crate) fn copy_deadline(&self, deadline: Instant, i: usize) -> Instant {
        let left = self.cfg.replicas.saturating_sub(i).max(1) as u32;
        let now = Instant::now();
        now + deadline.saturating_duration_since(now) / left
    }
}

/// Whether a read that failed with `e` on one copy may read the next: the
/// copy is gone (its unit dead or restarted), its unit does not answer,
/// a transfer from it failed, or its stored bytes are corrupt. Not for
/// errors another copy would give alike (the caller's input, its
/// authorization, a key collision).
pub(crate) fn next_copy_may_serve(e: &Error) -> bool {
    matches!(
        e,
        Error::LostKeys { .. }
            | Error::Timeout { .. }
            | Error::TransferFailed { .. }
            | Error::Unreachable { .. }
            | Error::Corrupt { .. }
            | Error::Io(_)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(h: &[&str]) -> Vec<Option<String>> {
        h.iter().map(|h| Some(h.to_string())).collect()
    }

    fn sets(c: &Copies) -> Vec<Vec<usize>> {
        (0..c.hosts.len().max(c.down.len()))
            .map(|u| c.set(u).to_vec())
            .collect()
    }

    #[test]
    fn without_hosts_the_copies_are_the_next_units() {
        let c = Copies::place(4, 2, &[]);
        assert_eq!(sets(&c), [[0, 1], [1, 2], [2, 3], [3, 0]]);
        assert_eq!(c.short_of_hosts, 0);
    }

    #[test]
    fn copies_skip_units_of_a_host_that_holds_one() {
        // Two units per host: a unit's neighbour shares its host.
        let c = Copies::place(6, 2, &hosts(&["a", "a", "b", "b", "c", "c"]));
        assert_eq!(sets(&c), [[0, 2], [1, 2], [2, 4], [3, 4], [4, 0], [5, 0]]);
        assert_eq!(c.short_of_hosts, 0);
        let c = Copies::place(6, 3, &hosts(&["a", "a", "b", "b", "c", "c"]));
        assert_eq!(&c.set(1)[..], &[1, 2, 4]);
    }

    #[test]
    fn too_few_hosts_are_counted_and_still_give_every_copy_a_unit() {
        let c = Copies::place(4, 3, &hosts(&["a", "a", "b", "b"]));
        for (u, set) in sets(&c).iter().enumerate() {
            assert_eq!(set.len(), 3, "unit {u}");
            assert_eq!(set[0], u);
            let distinct: HashSet<_> = set.iter().collect();
            assert_eq!(distinct.len(), 3, "unit {u}: {set:?}");
        }
        assert_eq!(c.short_of_hosts, 4);
    }

    #[test]
    fn a_unit_gone_down_is_skipped_and_the_copies_left_keep_their_places() {
        let c = Copies::place(4, 2, &[]);
        assert!(c.went_down(1));
        assert!(!c.went_down(1), "once");
        assert_eq!(c.epoch.load(Relaxed), 1);
        // Every unit up that held a copy still does: a read of the set
        // finds what was put before.
        assert_eq!(sets(&c), [[0, 2], [2, 3], [2, 3], [3, 0]]);
        assert!(c.went_down(2));
        assert_eq!(sets(&c), [[0, 3], [3, 0], [3, 0], [3, 0]]);
        // Fewer units up than copies: the sets are short.
        assert!(c.went_down(3));
        assert_eq!(sets(&c), [[0], [0], [0], [0]]);
    }

    #[test]
    fn newcomers_come_after_the_copies_left_and_are_what_repair_fills() {
        let c = Copies::place(4, 2, &hosts(&["a", "b", "b", "c"]));
        assert_eq!(sets(&c), [[0, 1], [1, 3], [2, 3], [3, 0]]);
        assert!(c.went_down(1));
        // The walk from 1 meets 2 before 3; 3, the copy left, stays first.
        assert_eq!(sets(&c), [[0, 2], [3, 2], [2, 3], [3, 0]]);
        assert_eq!(&c.newcomers(0)[..], &[2]);
        assert_eq!(&c.newcomers(1)[..], &[2]);
        assert!(c.newcomers(2).is_empty());
        assert_eq!(c.repairs_of(0), [(0, 2)]);
        // Unit 1's own rows: the copy left (3) is the source.
        assert_eq!(c.repairs_of(1), [(3, 2)]);
        assert!(c.repairs_of(2).is_empty());
        // The sources a checkpoint writes each unit's rows from.
        let sources = |c: &Copies| (0..4).map(|u| c.source_of(u)).collect::<Vec<_>>();
        assert_eq!(sources(&c), [Some(0), Some(3), Some(2), Some(3)]);
        assert!(c.is_down(1) && !c.is_down(0));
        c.repaired.lock().unwrap().insert((1, 2));
        assert!(c.repairs_of(1).is_empty());
        // The repaired newcomer is a source once the first copy is gone
        // too.
        assert!(c.went_down(3));
        assert_eq!(&c.set(1)[..], &[2, 0]);
        assert_eq!(c.repairs_of(1), [(2, 0)]);
        assert_eq!(c.repairs_of(3), [(0, 2)]);
        assert_eq!(sources(&c), [Some(0), Some(2), Some(2), Some(0)]);
        // No whole copy left: nothing to repair from, nor to write.
        let c = Copies::place(3, 2, &[]);
        assert!(c.went_down(0));
        assert!(c.went_down(1));
        assert!(c.repairs_of(0).is_empty());
        assert_eq!(c.source_of(0), None);
        assert_eq!(c.source_of(2), Some(2));
    }

    #[test]
    fn a_unit_that_rejoins_comes_after_the_copies_left_and_is_repaired_like_a_newcomer() {
        let c = Copies::place(3, 2, &[]);
        assert!(c.went_down(1));
        assert_eq!(sets(&c), [[0, 2], [2, 0], [2, 0]]);
        // Unit 2 stood in for 1 in 0's set and was repaired there.
        c.repaired.lock().unwrap().insert((0, 2));
        c.repaired.lock().unwrap().insert((1, 0));
        let epoch = c.epoch.load(Relaxed);
        let mut left = c.came_up(1);
        left.sort_unstable();
        // The copies that left a set: 2 of 0's rows, 0 of 1's.
        assert_eq!(left, [(0, 2), (1, 0)]);
        assert!(c.came_up(1).is_empty(), "once");
        assert_eq!(c.epoch.load(Relaxed), epoch + 1);
        // Back in its sets, after the copies left: a read asks a copy
        // that holds every row first.
        assert_eq!(sets(&c), [[0, 1], [2, 1], [2, 0]]);
        assert!(!c.is_down(1));
        // Empty when it came: not whole for the rows it held at connect,
        // and the repairs of the copies that left are forgotten.
        assert_eq!(c.repairs_of(0), [(0, 1)]);
        assert_eq!(c.repairs_of(1), [(2, 1)]);
        assert!(c.repaired.lock().unwrap().is_empty());
        assert_eq!(&c.newcomers(0)[..], &[1]);
        assert_eq!(c.source_of(1), Some(2));
        c.repaired.lock().unwrap().insert((1, 1));
        assert!(c.repairs_of(1).is_empty());
        // A unit never down does not come up.
        assert!(c.came_up(0).is_empty());
    }

    #[test]
    fn a_suspected_unit_is_read_last_until_it_answers() {
        let cfg = crate::ClientConfig::new(
            "t",
            (0..3)
                .map(|i| crate::UnitAddr::Unix(format!("/nonexistent/{i}").into()))
                .collect(),
        );
        let mut cfg = cfg;
        cfg.replicas = 3;
        let c = Client::connect(cfg).unwrap();
        assert_eq!(&c.read_order(1)[..], &[1, 2, 0]);
        c.suspect(1);
        assert_eq!(&c.read_order(1)[..], &[2, 0, 1]);
        assert_eq!(&c.read_order(0)[..], &[0, 2, 1]);
        c.trust(1);
        assert_eq!(&c.read_order(1)[..], &[1, 2, 0]);
    }

    #[test]
    fn one_copy_places_nothing() {
        let c = Copies::place(3, 1, &hosts(&["a", "b", "c"]));
        assert_eq!(sets(&c), [[0], [1], [2]]);
        assert!(!c.went_down(1), "with one copy nothing is placed again");
    }
}
