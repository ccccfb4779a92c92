//! Claims: consumers ("tasks") take the rows of a partition once each
//! row has the fields they need, each row once per task, with no
//! controller — every unit keeps the claims of its own rows.
//!
//! A claim asks every unit at once. A unit *leases* up to the rows asked
//! for to the connection that asked (whole groups, when the partition has
//! groups); the client keeps as many leases as fit in what it asked for
//! and *settles* each lease on the connection that took it: the rows kept
//! are the task's for good, the others go back. A lease whose connection
//! ends (the client was killed) or that outlives the unit's claim lease
//! (the client was stopped) gives its rows back, so a row is never lost
//! to a task, and never claimed twice by it.
//!
//! When no unit has a row ready, a blocking claim waits on every unit at
//! once, one thread each: a unit answers as soon as a put makes a row
//! ready (no polling). The first answer with rows ends the wait; the
//! connections still waiting are cut, which gives back whatever their
//! units leased meanwhile.
//!
//! **With copies** every unit holds copies of other units' rows, so each
//! unit claims only the rows of the *homes* it is the source of (its own
//! while it is up; a dead unit's go to the first of their copies left),
//! and names each row's home in its lease. Once a lease is settled, the
//! client writes a consumption mark (an empty hidden field,
//! `stowage_wire::consumed_field`) to every copy of each row kept before
//! the claim returns: a unit that later claims those homes' rows (after
//! the claimer's death) takes them as consumed, and repairs and
//! checkpoints carry the marks with the rows. A claimer that dies between
//! the settle and the marks may have its rows served once more
//! (docs/replication.md#claims).

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use stowage_wire::{consumed_field, ClaimProgress, EntrySpec, Homes, Key, Request, Response};

use crate::classify::{unexpected, unit_error};
use crate::failure::Failure;
use crate::fanout;
use crate::pool::Lease;
use crate::row_meta::KEY_FIELD;
use crate::values::NAME_BIT;
use crate::{new_blob_id, BlobPut, Client, Error, Result, RowKey};

/// How much sooner than the caller's deadline a unit ends a claim's wait,
/// so that its answer (and the settle) still fit before it.
const WAIT_MARGIN: Duration = Duration::from_millis(20);

/// Once rows are leased, taking them (the settle, then the rows' names)
/// goes on this long past the caller's deadline if it must: a claim that
/// gave up between a settle and its answer would leave rows consumed that
/// no caller got.
const TAKE_GRACE: Duration = Duration::from_secs(10);

/// The deadline of taking leased rows: `deadline`, or [`TAKE_GRACE`] from
/// now when that is later.
fn take_deadline(deadline: Instant) -> Instant {
    deadline.max(Instant::now() + TAKE_GRACE)
}

/// One unit's lease of a claim: its rows (with copies, and their homes),
/// and the connection to settle it on.
struct Leased<'a> {
    unit: usize,
    conn: Lease<'a>,
    lease: u64,
    rows: Vec<u64>,
    homes: Vec<u32>,
}

/// A claim's request to one unit, for a wait in ms and the homes it
/// claims (with copies).
type Ask<'a> = dyn Fn(u32, Option<Homes>) -> Request + Sync + 'a;

impl Client {
    /// The unit a row named `name`, or the rows of the group `name`, live
    /// on.
    pub fn unit_of(&self, name: &str) -> usize {
        let id = RowKey::Name(name.to_owned())
            .row_id()
            .expect("a string key always has an id");
        self.unit_of_row(id)
    }

    /// The units a claim asks, and with copies the homes each claims:
    /// every unit up that is the source of some home
    /// (docs/replication.md#claims).
    fn claimers(&self, deadline: Instant) -> Vec<(usize, Option<Homes>)> {
        let n = self.units.len();
        if self.replicas() == 1 {
            return (0..n).map(|u| (u, None)).collect();
        }
        if (0..n).any(|h| self.copies.source_of(h).is_none()) {
            // A home with no whole copy this client knows of: a newcomer
            // another client repaired may be one.
            self.learn_marks(deadline);
        }
        let units = n as u32;
        self.copies
            .sources_up()
            .into_iter()
            .filter(|(_, of)| !of.is_empty())
            .map(|(u, of)| (u, Some(Homes { units, of })))
            .collect()
    }

    /// The units up (with copies, a dead unit's part is on its copies).
    fn units_up(&self) -> Vec<usize> {
        (0..self.units.len())
            .filter(|&u| self.replicas() == 1 || !self.copies.is_down(u))
            .collect()
    }

    /// Declare the consumer `tasks` of `partition` on every unit:
    /// `samples` rows expected over all units, `group_size` above 1 for
    /// rows claimed in whole groups ([`Client::put_grouped`]).
    /// Idempotent; tasks add up; a different group size than registered
    /// is an [`Error::InvalidRequest`].
    pub fn register_tasks(
        &self,
        partition: &str,
        tasks: &[String],
        samples: u64,
        group_size: u32,
        deadline: Instant,
    ) -> Result<()> {
        if tasks.is_empty() {
            return Err(Error::InvalidRequest("no task to register".into()));
        }
        let req = Request::RegisterTasks {
            partition: partition.to_owned(),
            tasks: tasks.to_vec(),
            samples,
            group_size,
        };
        let reqs = self
            .units_up()
            .into_iter()
            .map(|u| (u, req.clone()))
            .collect();
        for (unit, r) in self.call_units(reqs, deadline) {
            match r {
                Ok(Response::Done) => {}
                Ok(other) => return Err(unexpected(unit, other)),
                // With copies, a unit found dead claims nothing any more.
                Err(Error::LostKeys { .. }) if self.replicas() > 1 => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Claim for `task` up to `want` rows of `partition` that have every
    /// one of `fields`, over all units: each row at most once per task,
    /// across every client. Returns the rows' keys (none when nothing is
    /// ready and `wait` is false). With `wait`, waits until a unit has a
    /// row ready, and fails with [`Error::Timeout`] at `deadline`. A claim
    /// that has leased rows when `deadline` comes finishes taking them (up
    /// to 10 s more) rather than leave them consumed with no caller.
    pub fn claim(
        &self,
        partition: &str,
        task: &str,
        fields: &[String],
        want: u32,
        wait: bool,
        deadline: Instant,
    ) -> Result<Vec<RowKey>> {
        if want == 0 {
            return Err(Error::InvalidRequest("a claim of 0 rows".into()));
        }
        let ask = |wait_ms: u32, homes: Option<Homes>| Request::Claim {
            partition: partition.to_owned(),
            task: task.to_owned(),
            fields: fields.to_vec(),
            want,
            wait_ms,
            homes,
        };
        loop {
            let epoch = self.copies_epoch();
            let (rows, leased_any) = match self.claim_once(&ask, want, wait, deadline) {
                // A unit found down meanwhile: its homes are claimed by
                // their copies now; ask again.
                Err(_)
                    if self.replicas() > 1
                        && self.copies_epoch() != epoch
                        && Instant::now() < deadline =>
                {
                    continue
                }
                r => r?,
            };
            if !rows.is_empty() {
                self.mark_consumed(partition, task, &rows, take_deadline(deadline));
                return self.row_keys(partition, rows, take_deadline(deadline));
            }
            // Rows leased, but none kept: the leases ran out before their
            // settle (this client was paused). Claim again while there is
            // time.
            if !wait || !leased_any || Instant::now() >= deadline {
                break;
            }
        }
        if wait {
            return Err(Error::Timeout {
                unit: None,
                what: format!("claim of {partition:?} for task {task:?}: no row was ready"),
            });
        }
        Ok(Vec::new())
    }

    /// With copies: write the consumption of `rows` (home, row) by `task`
    /// to every copy of each (docs/replication.md#claims). They are the
    /// caller's already (settled on their claimer): marks that fail are
    /// logged and counted (`stowage_client_claim_marks_failed_total`), and
    /// leave their rows claimable again only if their claimer dies.
    fn mark_consumed(&self, partition: &str, task: &str, rows: &[(usize, u64)], deadline: Instant) {
        if self.replicas() == 1 {
            return;
        }
        let mut by_home: std::collections::BTreeMap<usize, Vec<EntrySpec>> = Default::default();
        for &(home, row) in rows {
            by_home.entry(home).or_default().push(EntrySpec {
                key: Key::new(row, consumed_field(home as u32, task)),
                offset: 0,
                len: 0,
                meta: Vec::new(),
            });
        }
        let blobs: Vec<BlobPut<'_>> = by_home
            .into_iter()
            .map(|(unit, entries)| BlobPut {
                unit,
                partition,
                blob: new_blob_id(),
                segments: Vec::new(),
                entries,
            })
            .collect();
        if let Err(e) = self.put_many(&blobs, deadline) {
            self.metrics.marks_failed(rows.len());
            tracing::warn!(
                error = %e, partition, task, rows = rows.len(),
                "claimed rows' consumption marks were not written to every copy"
            );
        }
    }

    /// One try of [`Client::claim`]: the (unit, row) of the rows kept
    /// (with copies, the row's home instead of its claimer), and whether
    /// any unit leased rows.
    fn claim_once(
        &self,
        ask: &Ask<'_>,
        want: u32,
        wait: bool,
        deadline: Instant,
    ) -> Result<(Vec<(usize, u64)>, bool)> {
        // Every claimer at once, answered at once.
        let claimers = self.claimers(deadline);
        let units: Vec<usize> = claimers.iter().map(|(u, _)| *u).collect();
        let mut conns = self.checkout_units(&units, deadline)?;
        let reqs: Vec<Request> = claimers.into_iter().map(|(_, h)| ask(0, h)).collect();
        let answers = fanout::all_at_once(
            conns
                .iter_mut()
                .zip(&reqs)
                .map(|((_, c), req)| c.call(req, deadline)),
        );
        let mut leased = Vec::new();
        let mut first_err = None;
        for ((unit, conn), answer) in conns.into_iter().zip(answers) {
            match self.leased(unit, conn, answer, deadline) {
                Ok(Some(l)) => leased.push(l),
                Ok(None) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            // Whatever was leased goes back when its settle keeps nothing.
            self.settle(leased, 0, take_deadline(deadline))?;
            return Err(e);
        }
        if leased.iter().all(|l| l.rows.is_empty()) && wait {
            for l in leased {
                self.checkin(l.unit, l.conn);
            }
            leased = self.wait_for_rows(ask, deadline)?;
        }
        let leased_any = leased.iter().any(|l| !l.rows.is_empty());
        let rows = self.settle(leased, want as usize, take_deadline(deadline))?;
        Ok((rows, leased_any))
    }

    /// `task`'s progress through `partition`, summed over the units.
    pub fn claim_status(
        &self,
        partition: &str,
        task: &str,
        deadline: Instant,
    ) -> Result<ClaimProgress> {
        let reqs = self
            .claimers(deadline)
            .into_iter()
            .map(|(u, homes)| {
                let req = Request::ClaimStatus {
                    partition: partition.to_owned(),
                    task: task.to_owned(),
                    homes,
                };
                (u, req)
            })
            .collect();
        let mut sum = ClaimProgress::default();
        for (unit, r) in self.call_units(reqs, deadline) {
            match r? {
                Response::ClaimStatus(p) => {
                    sum.registered |= p.registered;
                    sum.samples = sum.samples.max(p.samples);
                    sum.group_size = sum.group_size.max(p.group_size);
                    sum.consumed += p.consumed;
                    sum.leased += p.leased;
                }
                other => return Err(unexpected(unit, other)),
            }
        }
        Ok(sum)
    }

    /// The claims state of this namespace on `unit` (each registered
    /// partition's tasks, rows' order and consumption), in a checkpoint's
    /// `claims` format: what [`Client::load_claims`] puts back on a unit
    /// that holds the same rows (a checkpoint's load reads it from the
    /// unit that restored a part).
    pub fn claims_state(&self, unit: usize, deadline: Instant) -> Result<Vec<u8>> {
        match self.call_one(unit, Request::ClaimsState, deadline)? {
            Response::ClaimsState { state } => Ok(state),
            other => Err(unexpected(unit, other)),
        }
    }

    /// Put back on `unit` a claims state [`Client::claims_state`]
    /// answered, over the rows `unit` holds now: each partition it names
    /// takes the saved registration and consumption there (its leases and
    /// waiting claims end).
    pub fn load_claims(&self, unit: usize, state: &[u8], deadline: Instant) -> Result<()> {
        let req = Request::LoadClaims {
            state: state.to_vec(),
        };
        match self.call_one(unit, req, deadline)? {
            Response::Done => Ok(()),
            other => Err(unexpected(unit, other)),
        }
    }

    /// A connection to each of `units`, checked out at once.
    fn checkout_units(
        &self,
        units: &[usize],
        deadline: Instant,
    ) -> Result<Vec<(usize, Lease<'_>)>> {
        let got = fanout::all_at_once(units.iter().map(|&u| self.checkout(u, deadline)));
        let mut conns = Vec::with_capacity(got.len());
        for (&unit, c) in units.iter().zip(got) {
            match c {
                Ok(c) => conns.push((unit, c)),
                Err(f) => {
                    for (u, c) in conns {
                        self.checkin(u, c);
                    }
                    return Err(self.failed_get(unit, f, &[], deadline));
                }
            }
        }
        Ok(conns)
    }

    /// A unit's answer to a claim: its lease (none if the unit has nothing
    /// leased), or its error. A broken connection is dropped (closed),
    /// which gives back anything it had leased.
    fn leased<'a>(
        &'a self,
        unit: usize,
        conn: Lease<'a>,
        answer: std::result::Result<Response, Failure>,
        deadline: Instant,
    ) -> Result<Option<Leased<'a>>> {
        match answer {
            Ok(Response::Claimed { lease, rows, homes }) => Ok(Some(Leased {
                unit,
                conn,
                lease,
                rows,
                homes,
            })),
            Ok(Response::Error { code, message }) => {
                self.checkin(unit, conn);
                Err(unit_error(unit, code, message, vec![]))
            }
            Ok(other) => Err(unexpected(unit, other)),
            Err(f) => {
                drop(conn);
                Err(self.failed_get(unit, f, &[], deadline))
            }
        }
    }

    /// Nothing was ready anywhere: wait on every unit at once, one thread
    /// each, until one answers with rows (or, with copies, one is found
    /// down); then cut the others.
    fn wait_for_rows<'a>(&'a self, ask: &Ask<'_>, deadline: Instant) -> Result<Vec<Leased<'a>>> {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .saturating_sub(WAIT_MARGIN);
        if wait.is_zero() {
            return Ok(Vec::new());
        }
        let wait_ms = u32::try_from(wait.as_millis()).unwrap_or(u32::MAX).max(1);
        let epoch = self.copies_epoch();
        let claimers = self.claimers(deadline);
        let units: Vec<usize> = claimers.iter().map(|(u, _)| *u).collect();
        let reqs: Vec<Request> = claimers.into_iter().map(|(_, h)| ask(wait_ms, h)).collect();
        let conns = self.checkout_units(&units, deadline)?;
        let cuts: Vec<_> = conns.iter().map(|(_, c)| c.interrupter()).collect();
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|s| {
            for (i, ((unit, mut conn), req)) in conns.into_iter().zip(&reqs).enumerate() {
                let tx = tx.clone();
                s.spawn(move || {
                    let answer = fanout::all_at_once([conn.call(req, deadline)]).pop();
                    let answer = answer.expect("one part, one answer");
                    let _ = tx.send((i, unit, conn, answer));
                });
            }
            drop(tx);
            let mut leased = Vec::new();
            let mut first_err = None;
            let mut cut = false;
            // Every thread sends once; the scope joins them.
            for (i, unit, conn, answer) in rx.iter() {
                if cut {
                    // Cut by us (its answer may have come first, but its
                    // socket is shut): closed, which gives back whatever
                    // its unit leased.
                    drop(conn);
                    continue;
                }
                let got_rows =
                    matches!(&answer, Ok(Response::Claimed { rows, .. }) if !rows.is_empty());
                match self.leased(unit, conn, answer, deadline) {
                    Ok(Some(l)) => leased.push(l),
                    Ok(None) => {}
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
                // With copies, a unit found down while the others wait:
                // its homes are claimed by their copies now, which the
                // waits do not ask for; end them (the claim asks again).
                let went_down = self.replicas() > 1 && self.copies_epoch() != epoch;
                if got_rows || went_down {
                    cut = true;
                    for (j, c) in cuts.iter().enumerate() {
                        if j != i {
                            if let Some(c) = c {
                                let _ = c.shutdown();
                            }
                        }
                    }
                }
            }
            match first_err {
                Some(e) if leased.iter().all(|l| l.rows.is_empty()) => {
                    for l in leased {
                        self.checkin(l.unit, l.conn);
                    }
                    Err(e)
                }
                _ => Ok(leased),
            }
        })
    }

    /// Settle every lease: keep whole leases while they fit in `want`
    /// rows (a lease is whole groups: never split), give the rest back.
    /// Returns the (unit, row) of the rows kept.
    fn settle(
        &self,
        leased: Vec<Leased<'_>>,
        want: usize,
        deadline: Instant,
    ) -> Result<Vec<(usize, u64)>> {
        let mut room = want;
        let mut plans = Vec::new();
        for l in leased {
            if l.lease == 0 {
                self.checkin(l.unit, l.conn);
                continue;
            }
            let keep = if l.rows.len() <= room {
                room -= l.rows.len();
                l.rows.clone()
            } else {
                Vec::new()
            };
            plans.push((l, keep));
        }
        let answers = fanout::all_at_once(plans.iter_mut().map(|(l, keep)| {
            let req = Request::Settle {
                lease: l.lease,
                keep: std::mem::take(keep),
            };
            let conn = &mut l.conn;
            async move { conn.call(&req, deadline).await }
        }));
        let mut kept = Vec::new();
        let mut first_err = None;
        for ((l, _), answer) in plans.into_iter().zip(answers) {
            match answer {
                Ok(Response::Settled { rows }) => {
                    // With copies a row is read, and marked, by its home.
                    let homes: HashMap<u64, u32> = l
                        .rows
                        .iter()
                        .copied()
                        .zip(l.homes.iter().copied())
                        .collect();
                    let home = |r: u64| homes.get(&r).map_or(l.unit, |&h| h as usize);
                    kept.extend(rows.into_iter().map(|r| (home(r), r)));
                    self.checkin(l.unit, l.conn);
                }
                Ok(Response::Error { code, message }) => {
                    self.checkin(l.unit, l.conn);
                    first_err.get_or_insert(unit_error(l.unit, code, message, vec![]));
                }
                Ok(other) => {
                    first_err.get_or_insert(unexpected(l.unit, other));
                }
                Err(f) => {
                    let unit = l.unit;
                    drop(l.conn);
                    first_err.get_or_insert(self.failed_get(unit, f, &[], deadline));
                }
            }
        }
        match first_err {
            Some(e) if kept.is_empty() => Err(e),
            _ => Ok(kept),
        }
    }

    /// The keys of claimed rows: a string row's name read from its
    /// [`KEY_FIELD`] (one read per unit).
    fn row_keys(
        &self,
        partition: &str,
        rows: Vec<(usize, u64)>,
        deadline: Instant,
    ) -> Result<Vec<RowKey>> {
        let named: Vec<(usize, Key)> = rows
            .iter()
            .filter(|(_, r)| r & NAME_BIT != 0)
            .map(|(u, r)| (*u, Key::new(*r, KEY_FIELD)))
            .collect();
        let mut names: HashMap<(usize, u64), String> = HashMap::new();
        let mut named = named;
        // A row cleared since it was claimed has no name to read: it is
        // left out (its values are gone), and the others' names read again.
        let mut cleared: std::collections::HashSet<(usize, u64)> = Default::default();
        while !named.is_empty() {
            match self.get(partition, &named, deadline) {
                Ok(raw) => {
                    for ((u, k), v) in named.iter().zip(raw) {
                        names.insert((*u, k.row), String::from_utf8_lossy(&v).into_owned());
                    }
                    break;
                }
                Err(Error::NotFound { keys, .. }) if !keys.is_empty() => {
                    let gone: std::collections::HashSet<u64> = keys.iter().map(|k| k.row).collect();
                    let before = named.len();
                    named.retain(|(u, k)| {
                        let keep = !gone.contains(&k.row);
                        if !keep {
                            cleared.insert((*u, k.row));
                        }
                        keep
                    });
                    if named.len() == before {
                        return Err(Error::NotFound {
                            keys,
                            named: vec![],
                        });
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(rows
            .into_iter()
            .filter(|ur| !cleared.contains(ur))
            .map(|(u, r)| match names.remove(&(u, r)) {
                Some(n) => RowKey::Name(n),
                None => RowKey::Index(r),
            })
            .collect())
    }
}
