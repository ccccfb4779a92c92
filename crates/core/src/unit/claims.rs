//! Claims: the consumer tasks of a partition (NeMo-RL's "train",
//! "reward", ...) take its rows once they are ready, each row at most once
//! per task, with no controller: a client asks every unit, and each unit
//! claims atomically from its own rows ([`op::RegisterTasks`],
//! [`op::Claim`], [`op::Settle`], [`op::ClaimStatus`] are applied here).
//!
//! Claims are two-phase. A claim *leases* rows to the asking connection;
//! the client *settles* the lease, keeping some rows (consumed by the task
//! for good) and giving the rest back. A lease whose connection ends, or
//! older than [`CoreConfig::claim_lease`], gives its rows back.
//!
//! **Order.** Rows are taken oldest first, by the arrival of the row's
//! first entry in the partition (rows already stored when the partition is
//! registered count as arrived then, rows ascending); a group by the
//! arrival of the first of its rows to name it. A lease lists its rows in
//! that order, a group's rows ascending and together.
//!
//! **Candidates.** Each task keeps, incrementally, the ordered set of its
//! *units* (a row; with groups, a group) whose rows are all neither
//! consumed nor leased under it: a claim walks that set from its oldest,
//! checks readiness (an entry for each field asked) in the index, and
//! stops once it has its rows — its cost never grows with rows consumed.
//! A publish into a partition that has no registered task costs one map
//! lookup.
//!
//! **Groups** (`group_size` g > 1): a row's group is named by its field
//! that begins with `"\0g:"` (the rest is the group's id); a row without
//! one is a group of its own, which never has g rows, so it is never
//! claimed. A group is claimable when it has exactly g rows, all ready and
//! free for the task; claims take whole groups only.
//!
//! **Waiting claims** are kept per partition in arrival order and tried,
//! oldest first, whenever rows may have become claimable (a publish into
//! the partition, a settle, an expired lease, a connection's end); one
//! satisfied is answered with [`Action::Claimed`]. At its `wait_until` it
//! is answered with an empty lease; when its connection ends it is dropped
//! unanswered.
//!
//! **Clearing.** [`op::ClearRows`] drops the rows from the consumed and
//! leased sets (a later settle does not return them; a row put again is
//! claimable again); `consumed` counts stay. [`op::ClearPartition`] drops
//! the partition's whole claims state: its registration, consumption and
//! leases; its waiting claims are answered with empty leases.

use std::collections::BTreeSet;

use super::input::apply_op;
use super::op::{Claim, ClaimStatus, RegisterTasks, Settle};
use super::*;
use crate::home::{consumed_of, Homes, GROUP_FIELD_PREFIX as GROUP_PREFIX};

mod snapshot;

/// Most tasks one partition may register.
pub(super) const MAX_TASKS: usize = 64;

type Set<T> = HashSet<T, foldhash::fast::RandomState>;

apply_op!(RegisterTasks => (), |op, core, _, owner| core.register_tasks(owner, op));
apply_op!(Claim => ClaimAnswer, |op, core, now, owner| core.claim(owner, op, now));
apply_op!(Settle => Vec<u64>, |Settle { lease, keep }, core, now, owner| {
    core.settle(owner, lease, &keep, now)
});
apply_op!(ClaimStatus => ClaimStatusAnswer, |ClaimStatus { partition, task, homes }, core, _, _| {
    Ok(core.claim_status(&partition, &task, homes.as_ref()))
});

/// The claims state of the unit: registered partitions, leases, waiting
/// claims, and the counters of [`Stats`].
#[derive(Default)]
pub(super) struct Claims {
    parts: Map<String, Part>,
    leases: Map<LeaseId, LeaseRec>,
    /// Leases by the time they expire.
    expiries: BTreeSet<(Time, LeaseId)>,
    /// Waiting claims by id (ids rise: arrival order).
    waiters: Map<u64, Waiter>,
    /// Waiting claims by their `wait_until`.
    deadlines: BTreeSet<(Time, u64)>,
    /// What each connection holds here, for its end.
    by_owner: HashMap<Owner, ByOwner>,
    next_lease: u64,
    next_wait: u64,
    /// Claims answered with rows (at once or after waiting).
    pub(super) claims: u64,
    /// Claims that waited.
    pub(super) claim_waits: u64,
    /// Leases that expired unsettled.
    pub(super) leases_expired: u64,
}

#[derive(Default)]
struct ByOwner {
    leases: Set<LeaseId>,
    waits: Set<u64>,
}

/// A registered partition.
struct Part {
    samples: u64,
    /// As first registered (0 or 1: no groups).
    group_size: u32,
    tasks: Vec<Task>,
    /// Arrival counter of units.
    next_seq: u64,
    /// Every row of the partition on this unit.
    rows: Map<u64, RowInfo>,
    /// Units by arrival: their rows, ascending.
    units: Map<u64, Vec<u64>>,
    /// With groups: each group's unit.
    groups: Map<String, u64>,
    /// Waiting claims, oldest first.
    waiting: BTreeSet<u64>,
    leases: Set<LeaseId>,
}

struct RowInfo {
    /// Its unit; none for a row without a group when groups are on.
    unit: Option<u64>,
    group: Option<String>,
}

struct Task {
    name: String,
    /// Rows settled for the task (a cleared row leaves).
    consumed: Set<u64>,
    /// Rows leased under the task, and their lease.
    leased: Map<u64, LeaseId>,
    /// Units whose rows are all neither consumed nor leased, by arrival.
    cands: BTreeSet<u64>,
    /// Rows ever settled for the task (never lowered).
    consumed_total: u64,
    /// With copies: rows ever consumed by the task per home (settled here
    /// under a lease of [`Claim::homes`], or marked consumed), never
    /// lowered.
    by_home: Map<u32, u64>,
}

struct LeaseRec {
    partition: String,
    task: usize,
    owner: Owner,
    rows: Vec<u64>,
    /// With [`Claim::homes`]: each row's home (else empty).
    homes: Vec<u32>,
    expires: Time,
}

struct Waiter {
    partition: String,
    task: usize,
    fields: Vec<String>,
    want: u32,
    until: Time,
    owner: Owner,
    tag: u64,
    homes: Option<Homes>,
}

/// The empty answer of a waiting claim.
fn empty_reply(w: &Waiter) -> Action {
    Action::Claimed(ClaimReply {
        owner: w.owner,
        tag: w.tag,
        lease: Lease {
            id: LeaseId(0),
            rows: Vec::new(),
            homes: Vec::new(),
        },
    })
}

/// What a claim picked: the rows (claim order), their units of claiming,
/// and with [`Claim::homes`] each row's home.
#[derive(Default)]
struct Picked {
    rows: Vec<u64>,
    units: Vec<u64>,
    homes: Vec<u32>,
}

impl Part {
    fn new(group_size: u32) -> Self {
        Part {
            samples: 0,
            group_size,
            tasks: Vec::new(),
            next_seq: 0,
            rows: Map::default(),
            units: Map::default(),
            groups: Map::default(),
            waiting: BTreeSet::new(),
            leases: Set::default(),
        }
    }

    fn g(&self) -> usize {
        self.group_size.max(1) as usize
    }

    fn grouped(&self) -> bool {
        self.group_size > 1
    }

    fn new_unit(&mut self, rows: Vec<u64>) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.units.insert(seq, rows);
        seq
    }

    /// Decide again whether unit `seq` is a candidate of task `t`.
    fn refresh(&mut self, t: usize, seq: u64) {
        let task = &mut self.tasks[t];
        match self.units.get(&seq) {
            Some(rows)
                if !rows.is_empty()
                    && rows
                        .iter()
                        .all(|r| !task.consumed.contains(r) && !task.leased.contains_key(r)) =>
            {
                task.cands.insert(seq);
            }
            _ => {
                task.cands.remove(&seq);
            }
        }
    }

    fn refresh_all(&mut self, seq: u64) {
        for t in 0..self.tasks.len() {
            self.refresh(t, seq);
        }
    }

    /// An entry of `row` arrived; `group`: the id it names, if it is the
    /// group field.
    fn add_row(&mut self, row: u64, group: Option<&str>) {
        let known = self.rows.contains_key(&row);
        if !self.grouped() {
            if !known {
                let seq = self.new_unit(vec![row]);
                self.rows.insert(
                    row,
                    RowInfo {
                        unit: Some(seq),
                        group: None,
                    },
                );
                self.refresh_all(seq);
            }
            return;
        }
        if !known {
            self.rows.insert(
                row,
                RowInfo {
                    unit: None,
                    group: None,
                },
            );
        }
        let Some(group) = group else { return };
        let info = self.rows.get_mut(&row).expect("inserted above");
        if info.group.as_deref() == Some(group) {
            return;
        }
        let old = info.unit.take().zip(info.group.take());
        if let Some((seq, name)) = old {
            self.leave(seq, row, &name);
        }
        let seq = match self.groups.get(group) {
            Some(&seq) => seq,
            None => {
                let seq = self.new_unit(Vec::new());
                self.groups.insert(group.to_owned(), seq);
                seq
            }
        };
        let rows = self.units.get_mut(&seq).expect("a group's unit");
        if let Err(at) = rows.binary_search(&row) {
            rows.insert(at, row);
        }
        let info = self.rows.get_mut(&row).expect("inserted above");
        info.unit = Some(seq);
        info.group = Some(group.to_owned());
        self.refresh_all(seq);
    }

    /// `row` leaves unit `seq` (of group `group`, if any).
    fn leave(&mut self, seq: u64, row: u64, group: &str) {
        if let Some(rows) = self.units.get_mut(&seq) {
            rows.retain(|r| *r != row);
            if rows.is_empty() {
                self.units.remove(&seq);
                if self.groups.get(group) == Some(&seq) {
                    self.groups.remove(group);
                }
            }
        }
        self.refresh_all(seq);
    }

    /// `row` was cleared: it leaves every set (also a consumed row a
    /// restore knew of and the index did not hold).
    fn remove_row(&mut self, row: u64) {
        for task in &mut self.tasks {
            task.consumed.remove(&row);
            task.leased.remove(&row);
        }
        let Some(info) = self.rows.remove(&row) else {
            return;
        };
        if let Some(seq) = info.unit {
            self.leave(seq, row, info.group.as_deref().unwrap_or(""));
        }
    }

    /// Task `t` consumed `row` of home `home`: marked so by the claimer of
    /// another copy ([`crate::home::CONSUMED_FIELD_PREFIX`]). A lease of it here keeps
    /// it no more (its claimer settled it elsewhere first).
    fn mark_consumed(&mut self, t: usize, row: u64, home: u32) {
        let task = &mut self.tasks[t];
        if !task.consumed.insert(row) {
            return;
        }
        task.leased.remove(&row);
        *task.by_home.entry(home).or_default() += 1;
        if let Some(seq) = self.rows.get(&row).and_then(|i| i.unit) {
            self.refresh(t, seq);
        }
    }

    /// The rows of `index` marked consumed by task `t` are consumed.
    fn learn_marks(&mut self, t: usize, index: Option<&Rows>) {
        let Some(index) = index else { return };
        let name = self.tasks[t].name.clone();
        let marked: Vec<(u64, u32)> = index
            .iter()
            .flat_map(|(row, fields)| {
                fields
                    .keys()
                    .filter_map(|f| consumed_of(f))
                    .filter(|(_, task)| *task == name)
                    .map(move |(home, _)| (*row, home))
            })
            .collect();
        for (row, home) in marked {
            self.mark_consumed(t, row, home);
        }
    }

    /// The oldest claimable units of task `t` for `fields`, as many whole
    /// ones as fit in `want` rows; with `homes`, of those homes only.
    fn pick(
        &self,
        t: usize,
        fields: &[String],
        want: u32,
        index: Option<&Rows>,
        homes: Option<&Homes>,
    ) -> Picked {
        let mut picked = Picked::default();
        let Some(index) = index else {
            return picked;
        };
        let g = self.g();
        let want = want as usize;
        for seq in &self.tasks[t].cands {
            if picked.rows.len() + g > want {
                break;
            }
            let Some(unit) = self.units.get(seq) else {
                continue;
            };
            if unit.len() != g {
                continue;
            }
            let ready = unit.iter().all(|r| {
                index
                    .get(r)
                    .is_some_and(|f| fields.iter().all(|n| f.contains_key(n)))
            });
            if !ready {
                continue;
            }
            // A unit of claiming is one home's: a group's rows share
            // their group's unit.
            if let Some(h) = homes {
                let first = unit[0];
                let fields = index[&first].keys().map(String::as_str);
                let Some(home) = h.home_of(first, fields) else {
                    continue;
                };
                picked.homes.extend(std::iter::repeat_n(home, unit.len()));
            }
            picked.rows.extend_from_slice(unit);
            picked.units.push(*seq);
        }
        picked
    }
}

impl Claims {
    /// When [`UnitCore::claims_expire`] next has something to do.
    pub(super) fn next_deadline(&self) -> Option<Time> {
        let lease = self.expiries.first().map(|(t, _)| *t);
        let wait = self.deadlines.first().map(|(t, _)| *t);
        match (lease, wait) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn forget(&mut self, owner: Owner, f: impl FnOnce(&mut ByOwner)) {
        if let Some(o) = self.by_owner.get_mut(&owner) {
            f(o);
            if o.leases.is_empty() && o.waits.is_empty() {
                self.by_owner.remove(&owner);
            }
        }
    }

    /// Lease `rows` (units `units`) of task `t` to `owner`.
    fn lease(
        &mut self,
        partition: &str,
        t: usize,
        owner: Owner,
        Picked { rows, units, homes }: Picked,
        expires: Time,
    ) -> Lease {
        self.next_lease += 1;
        let id = LeaseId(self.next_lease);
        let part = self
            .parts
            .get_mut(partition)
            .expect("a registered partition");
        let task = &mut part.tasks[t];
        for r in &rows {
            task.leased.insert(*r, id);
        }
        for u in units {
            task.cands.remove(&u);
        }
        part.leases.insert(id);
        self.leases.insert(
            id,
            LeaseRec {
                partition: partition.to_owned(),
                task: t,
                owner,
                rows: rows.clone(),
                homes: homes.clone(),
                expires,
            },
        );
        self.expiries.insert((expires, id));
        self.by_owner.entry(owner).or_default().leases.insert(id);
        self.claims += 1;
        Lease { id, rows, homes }
    }

    /// End lease `id`: the rows of `keep` still leased under it are
    /// consumed (returned, in `keep`'s order), the others given back.
    /// Answers its partition too; none for an unknown lease.
    fn end_lease(&mut self, id: LeaseId, keep: &[u64]) -> Option<(String, Vec<u64>)> {
        let rec = self.leases.remove(&id)?;
        self.expiries.remove(&(rec.expires, id));
        self.forget(rec.owner, |o| {
            o.leases.remove(&id);
        });
        let part = self.parts.get_mut(&rec.partition)?;
        part.leases.remove(&id);
        let task = &mut part.tasks[rec.task];
        let mut kept = Vec::new();
        // With homes: each row's, looked up once per row kept.
        let homes: Map<u64, u32> = rec
            .rows
            .iter()
            .copied()
            .zip(rec.homes.iter().copied())
            .collect();
        for &r in keep {
            if task.leased.get(&r) == Some(&id) {
                task.leased.remove(&r);
                task.consumed.insert(r);
                task.consumed_total += 1;
                if let Some(&home) = homes.get(&r) {
                    *task.by_home.entry(home).or_default() += 1;
                }
                kept.push(r);
            }
        }
        for &r in &rec.rows {
            if part.tasks[rec.task].leased.get(&r) == Some(&id) {
                part.tasks[rec.task].leased.remove(&r);
                if let Some(seq) = part.rows.get(&r).and_then(|i| i.unit) {
                    part.refresh(rec.task, seq);
                }
            }
        }
        Some((rec.partition, kept))
    }

    fn remove_waiter(&mut self, w: u64) -> Option<Waiter> {
        let waiter = self.waiters.remove(&w)?;
        self.deadlines.remove(&(waiter.until, w));
        self.forget(waiter.owner, |o| {
            o.waits.remove(&w);
        });
        if let Some(p) = self.parts.get_mut(&waiter.partition) {
            p.waiting.remove(&w);
        }
        Some(waiter)
    }

    /// Try the waiting claims of `partition`, oldest first; answer each
    /// one satisfied (and each whose `wait_until` has come, empty).
    fn wake(
        &mut self,
        partition: &str,
        index: Option<&Rows>,
        now: Time,
        lease_time: Duration,
        actions: &mut VecDeque<Action>,
    ) {
        let Some(part) = self.parts.get(partition) else {
            return;
        };
        if part.waiting.is_empty() {
            return;
        }
        let ids: Vec<u64> = part.waiting.iter().copied().collect();
        for w in ids {
            let Some(waiter) = self.waiters.get(&w) else {
                continue;
            };
            if waiter.until <= now {
                let waiter = self.remove_waiter(w).expect("present");
                actions.push_back(empty_reply(&waiter));
                continue;
            }
            let picked = self.parts[partition].pick(
                waiter.task,
                &waiter.fields,
                waiter.want,
                index,
                waiter.homes.as_ref(),
            );
            if picked.rows.is_empty() {
                continue;
            }
            let waiter = self.remove_waiter(w).expect("present");
            let lease = self.lease(
                partition,
                waiter.task,
                waiter.owner,
                picked,
                now + lease_time,
            );
            actions.push_back(Action::Claimed(ClaimReply {
                owner: waiter.owner,
                tag: waiter.tag,
                lease,
            }));
        }
    }
}

impl UnitCore {
    fn wake_claims(&mut self, partitions: &mut Vec<String>, now: Time) {
        partitions.sort();
        partitions.dedup();
        for p in partitions.iter() {
            self.claims.wake(
                p,
                self.index.parts.get(p),
                now,
                self.cfg.claim_lease,
                &mut self.actions,
            );
        }
    }

    pub(super) fn register_tasks(
        &mut self,
        owner: Owner,
        op: RegisterTasks,
    ) -> Result<(), CoreError> {
        self.check_owner(owner)?;
        let RegisterTasks {
            partition,
            tasks,
            samples,
            group_size,
        } = op;
        if tasks.iter().any(|t| t.is_empty()) {
            return Err(CoreError::Invalid("a task's name is empty".into()));
        }
        let mut new: Vec<&String> = Vec::new();
        let existing = self.claims.parts.get(&partition);
        for t in &tasks {
            let known = existing.is_some_and(|p| p.tasks.iter().any(|k| &k.name == t));
            if !known && !new.contains(&t) {
                new.push(t);
            }
        }
        let had = existing.map_or(0, |p| p.tasks.len());
        if had + new.len() > MAX_TASKS {
            return Err(CoreError::Invalid(format!(
                "partition {partition:?} would have {} tasks, more than {MAX_TASKS}",
                had + new.len()
            )));
        }
        if let Some(p) = existing {
            if group_size != 0 && group_size.max(1) != p.group_size.max(1) {
                return Err(CoreError::Invalid(format!(
                    "partition {partition:?} is registered with groups of {}, not {group_size}",
                    p.group_size
                )));
            }
        }
        let new: Vec<String> = new.into_iter().cloned().collect();
        let part = match self.claims.parts.entry(partition.clone()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let part = e.insert(Part::new(group_size));
                // The rows stored already arrive now, ascending.
                if let Some(rows) = self.index.parts.get(&partition) {
                    let mut ids: Vec<u64> = rows.keys().copied().collect();
                    ids.sort_unstable();
                    for row in ids {
                        let group = rows[&row]
                            .keys()
                            .filter_map(|f| f.strip_prefix(GROUP_PREFIX))
                            .min();
                        part.add_row(row, group);
                    }
                }
                part
            }
        };
        if samples != 0 {
            part.samples = samples;
        }
        for name in new {
            part.tasks.push(Task {
                name,
                consumed: Set::default(),
                leased: Map::default(),
                cands: BTreeSet::new(),
                consumed_total: 0,
                by_home: Map::default(),
            });
            let t = part.tasks.len() - 1;
            let seqs: Vec<u64> = part.units.keys().copied().collect();
            for seq in seqs {
                part.refresh(t, seq);
            }
            part.learn_marks(t, self.index.parts.get(&partition));
        }
        Ok(())
    }

    pub(super) fn claim(
        &mut self,
        owner: Owner,
        op: Claim,
        now: Time,
    ) -> Result<ClaimAnswer, CoreError> {
        self.check_owner(owner)?;
        let Claim {
            partition,
            task,
            fields,
            want,
            wait_until,
            tag,
            homes,
        } = op;
        if want == 0 {
            return Err(CoreError::Invalid("a claim wants no row".into()));
        }
        if fields.is_empty() {
            return Err(CoreError::Invalid("a claim names no field".into()));
        }
        let part = self.claims.parts.get(&partition);
        let Some((part, t)) =
            part.and_then(|p| p.tasks.iter().position(|k| k.name == task).map(|t| (p, t)))
        else {
            return Err(CoreError::Invalid(format!(
                "task {task:?} is not registered for partition {partition:?}"
            )));
        };
        if part.grouped() && (want as usize) < part.g() {
            return Err(CoreError::Invalid(format!(
                "a claim of {want} rows cannot take a whole group of {}",
                part.g()
            )));
        }
        let picked = part.pick(
            t,
            &fields,
            want,
            self.index.parts.get(&partition),
            homes.as_ref(),
        );
        if !picked.rows.is_empty() {
            let expires = now + self.cfg.claim_lease;
            let lease = self.claims.lease(&partition, t, owner, picked, expires);
            return Ok(ClaimAnswer::Leased(lease));
        }
        match wait_until {
            Some(until) if until > now => {
                let c = &mut self.claims;
                c.next_wait += 1;
                let w = c.next_wait;
                c.parts
                    .get_mut(&partition)
                    .expect("registered")
                    .waiting
                    .insert(w);
                c.deadlines.insert((until, w));
                c.by_owner.entry(owner).or_default().waits.insert(w);
                c.waiters.insert(
                    w,
                    Waiter {
                        partition,
                        task: t,
                        fields,
                        want,
                        until,
                        owner,
                        tag,
                        homes,
                    },
                );
                c.claim_waits += 1;
                Ok(ClaimAnswer::Waiting)
            }
            _ => Ok(ClaimAnswer::Leased(Lease {
                id: LeaseId(0),
                rows: Vec::new(),
                homes: Vec::new(),
            })),
        }
    }

    pub(super) fn settle(
        &mut self,
        owner: Owner,
        id: LeaseId,
        keep: &[u64],
        now: Time,
    ) -> Result<Vec<u64>, CoreError> {
        self.check_owner(owner)?;
        let Some(rec) = self.claims.leases.get(&id) else {
            return Ok(Vec::new());
        };
        if rec.owner != owner {
            return Err(CoreError::NotOwner(format!(
                "lease {} belongs to another connection",
                id.0
            )));
        }
        let expired = rec.expires <= now;
        let keep = if expired { &[][..] } else { keep };
        let Some((partition, kept)) = self.claims.end_lease(id, keep) else {
            return Ok(Vec::new());
        };
        if expired {
            self.claims.leases_expired += 1;
        }
        self.wake_claims(&mut vec![partition], now);
        Ok(kept)
    }

    pub(super) fn claim_status(
        &self,
        partition: &str,
        task: &str,
        homes: Option<&Homes>,
    ) -> ClaimStatusAnswer {
        let rows = self
            .index
            .parts
            .get(partition)
            .map_or(0, |r| r.len() as u64);
        let Some(part) = self.claims.parts.get(partition) else {
            return ClaimStatusAnswer {
                rows,
                ..ClaimStatusAnswer::default()
            };
        };
        let t = part.tasks.iter().find(|k| k.name == task);
        ClaimStatusAnswer {
            registered: t.is_some(),
            samples: part.samples,
            group_size: part.group_size,
            consumed: t.map_or(0, |t| match homes {
                None => t.consumed_total,
                Some(h) => h.of.iter().filter_map(|home| t.by_home.get(home)).sum(),
            }),
            leased: t.map_or(0, |t| t.leased.len() as u64),
            rows,
        }
    }

    /// Whether entries published into `partition` concern the claims
    /// state (a task is registered there): [`Self::claims_published`].
    pub(super) fn claims_track(&self, partition: &str) -> bool {
        self.claims.parts.contains_key(partition)
    }

    /// Entries were published into `partition`: its rows join the claims
    /// state (one map lookup when no task is registered), and its waiting
    /// claims are tried.
    pub(super) fn claims_published(&mut self, partition: &str, entries: &[EntrySpec]) {
        let Some(part) = self.claims.parts.get_mut(partition) else {
            return;
        };
        for e in entries {
            part.add_row(e.key.row, e.key.field.strip_prefix(GROUP_PREFIX));
        }
        for e in entries {
            let Some((home, task)) = consumed_of(&e.key.field) else {
                continue;
            };
            if let Some(t) = part.tasks.iter().position(|k| k.name == task) {
                part.mark_consumed(t, e.key.row, home);
            }
        }
        if !part.waiting.is_empty() {
            let now = self.last_input;
            self.wake_claims(&mut vec![partition.to_owned()], now);
        }
    }

    /// Rows of `partition` were cleared.
    pub(super) fn claims_cleared(&mut self, partition: &str, rows: &[u64]) {
        if let Some(part) = self.claims.parts.get_mut(partition) {
            for &r in rows {
                part.remove_row(r);
            }
        }
    }

    /// `partition` was cleared whole: its claims state goes; its waiting
    /// claims are answered with empty leases.
    pub(super) fn claims_drop_partition(&mut self, partition: &str) {
        let Some(part) = self.claims.parts.get(partition) else {
            return;
        };
        let waiting: Vec<u64> = part.waiting.iter().copied().collect();
        let leases: Vec<LeaseId> = part.leases.iter().copied().collect();
        for w in waiting {
            if let Some(waiter) = self.claims.remove_waiter(w) {
                self.actions.push_back(empty_reply(&waiter));
            }
        }
        for id in leases {
            if let Some(rec) = self.claims.leases.remove(&id) {
                self.claims.expiries.remove(&(rec.expires, id));
                self.claims.forget(rec.owner, |o| {
                    o.leases.remove(&id);
                });
            }
        }
        self.claims.parts.remove(partition);
    }

    /// `owner`'s connection ended: its waiting claims are dropped
    /// unanswered, its leases give their rows back.
    pub(super) fn claims_conn_ended(&mut self, owner: Owner, now: Time) {
        let Some(o) = self.claims.by_owner.remove(&owner) else {
            return;
        };
        for w in o.waits {
            self.claims.remove_waiter(w);
        }
        let mut parts = Vec::new();
        for id in o.leases {
            if let Some((p, _)) = self.claims.end_lease(id, &[]) {
                parts.push(p);
            }
        }
        self.wake_claims(&mut parts, now);
    }

    /// The time has come: waiting claims whose `wait_until` came are
    /// answered empty; expired leases give their rows back.
    pub(super) fn claims_expire(&mut self, now: Time) {
        while let Some(&(at, w)) = self.claims.deadlines.first() {
            if at > now {
                break;
            }
            self.claims.deadlines.pop_first();
            if let Some(waiter) = self.claims.remove_waiter(w) {
                self.actions.push_back(empty_reply(&waiter));
            }
        }
        let mut parts = Vec::new();
        while let Some(&(at, id)) = self.claims.expiries.first() {
            if at > now {
                break;
            }
            self.claims.expiries.pop_first();
            if let Some((p, _)) = self.claims.end_lease(id, &[]) {
                self.claims.leases_expired += 1;
                parts.push(p);
            }
        }
        self.wake_claims(&mut parts, now);
    }

    /// Test-only: the claims state agrees with itself and the index
    /// (every task's candidates are exactly its units with every row
    /// free; the rows known are the index's; every lease's rows are
    /// leased under it or gone).
    #[cfg(any(test, feature = "testing"))]
    pub fn check_claims(&self) -> Result<(), String> {
        for (name, part) in &self.claims.parts {
            let index_rows: HashSet<u64> = self
                .index
                .parts
                .get(name)
                .map(|r| r.keys().copied().collect())
                .unwrap_or_default();
            let known: HashSet<u64> = part.rows.keys().copied().collect();
            if index_rows != known {
                return Err(format!(
                    "{name:?}: rows {known:?} but the index has {index_rows:?}"
                ));
            }
            for task in &part.tasks {
                for (seq, rows) in &part.units {
                    let free = !rows.is_empty()
                        && rows
                            .iter()
                            .all(|r| !task.consumed.contains(r) && !task.leased.contains_key(r));
                    if free != task.cands.contains(seq) {
                        return Err(format!(
                            "{name:?} task {:?}: unit {seq} {rows:?} free {free} but candidate {}",
                            task.name,
                            task.cands.contains(seq)
                        ));
                    }
                }
                for (row, id) in &task.leased {
                    if task.consumed.contains(row) {
                        return Err(format!("row {row} both leased and consumed"));
                    }
                    match self.claims.leases.get(id) {
                        Some(l) if l.rows.contains(row) && &l.partition == name => {}
                        _ => return Err(format!("row {row} leased under a lease without it")),
                    }
                }
            }
        }
        Ok(())
    }
}
