//! Rejoining (docs/replication.md#rejoining): a unit started again in a
//! dead or fenced one's place is another instance, empty. Taken back in,
//! its copies go there again, and a repair gives it the rows it lacks.
//!
//! Every client must switch to the new placement together: one still
//! placing copies around the unit and one placing them on it would each
//! read a row's copy the other did not write. So the plane has a *view*
//! ([`PlaneView`]): which instance serves each unit, numbered by epoch.
//! Every unit keeps one, and every connection speaks for one
//! (`Request::Epoch`, said when it opens): a unit serves row requests only
//! on connections of its own view's epoch, and refuses the others
//! `Stale`. A client refused so asks the unit for its view and takes it
//! (or, when the unit's is the older, hands it the newer), then asks
//! again; the placement it puts and reads by changes with the view.
//!
//! [`Client::rejoin`] moves the plane to a view that names the new
//! instance: the rejoining unit first, then every other unit up. From the
//! moment a unit moved, nothing of the old view is written or read there;
//! a unit not moved yet is moved by the first client of the new view that
//! meets it. Each set the unit joins keeps its copies left first (reads
//! ask a copy that holds every row before the newcomer), and a repair
//! copies to it what it lacks, as to any newcomer. A copy that left a set
//! (the unit that held the rows while this one was down) is no longer
//! kept up to date: the rejoin clears those rows there, so that it never
//! serves them again.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use stowage_wire::{ErrorCode, Member, PlaneView, Request, Response};

use crate::classify::unexpected;
use crate::conn::Conn;
use crate::failure::Failure;
use crate::repair::MARKS;
use crate::{lock, Client, Error, Result};

/// The longest a view's exchange with a unit outside an operation (a
/// refusal's, a rejoin's) waits for its answer.
const VIEW_WAIT: Duration = Duration::from_secs(2);
/// How many times a rejoin starts its round again when it meets another
/// view of the same or a later epoch (another rejoin at once).
const ROUNDS: usize = 8;

/// The view of the plane a client speaks for, and its epoch to check
/// connections against without a lock.
#[derive(Default)]
pub(crate) struct Plane {
    epoch: AtomicU64,
    view: Mutex<PlaneView>,
}

/// What [`Client::rejoin`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rejoined {
    /// The unit, and the instance that serves it now.
    pub unit: usize,
    pub instance: u128,
    /// The epoch of the plane's view that took it in.
    pub epoch: u64,
    /// Whether that instance was a member already (no view changed; the
    /// copies a rejoin cut short left are cleared all the same).
    pub already: bool,
    /// Units that took the view (the rejoining one among them).
    pub moved: usize,
    /// Units up that did not answer: moved by the first client of the new
    /// view that reaches them.
    pub unreached: Vec<usize>,
    /// Values cleared on copies that left a set when the unit came back.
    pub cleared: u64,
}

impl Client {
    /// The epoch of the view of the plane this client speaks for.
    pub(crate) fn plane_epoch(&self) -> u64 {
        self.plane.epoch.load(SeqCst)
    }

    /// The view of the plane this client speaks for (epoch 0 with no
    /// members: the directory's units, as the plane started).
    pub fn plane_view(&self) -> PlaneView {
        lock(&self.plane.view).clone()
    }

    /// Make `conn`, just opened to `unit`, speak for this client's view:
    /// a newer view the unit has is taken first, an older one is replaced
    /// with this client's. Skipped while a client with one copy knows of
    /// no view: its units refuse it `Stale` if they have one.
    pub(crate) fn speak_for_view(
        &self,
        unit: usize,
        conn: &mut Conn,
        deadline: Instant,
    ) -> std::result::Result<(), Failure> {
        if self.replicas() == 1 && self.plane_epoch() == 0 {
            return Ok(());
        }
        self.exchange_view(unit, conn, deadline)
    }

    fn exchange_view(
        &self,
        unit: usize,
        conn: &mut Conn,
        deadline: Instant,
    ) -> std::result::Result<(), Failure> {
        // Each turn takes a newer view, or hands the unit ours: a few
        // turns settle unless views keep changing meanwhile.
        for _ in 0..4 {
            let ours = self.plane_view();
            let mine = ours.epoch;
            let ask = Request::Epoch {
                epoch: mine,
                digest: ours.digest(),
            };
            let theirs = ask_view(conn, &ask, deadline)?;
            conn.epoch = mine;
            if theirs == ours {
                return Ok(());
            }
            if theirs.epoch == mine {
                // Two views of one epoch: rejoins at once. Their rounds
                // move every unit to a view of a later epoch that has
                // both; until then this unit serves this client nothing.
                return Err(Failure::Refused(
                    ErrorCode::Stale,
                    format!(
                        "unit {unit} has another view of the plane of the same epoch ({mine}): two rejoins run at once"
                    ),
                ));
            }
            if theirs.epoch > mine {
                self.take_view(theirs);
                continue;
            }
            let ours = self.plane_view();
            match ask_view(conn, &Request::SetView { view: ours }, deadline) {
                Ok(after) => {
                    self.take_view(after);
                }
                // Without the authority to move it, the unit stays behind,
                // and refuses this client's rows until another moves it.
                Err(Failure::Refused(ErrorCode::Unauthorized, why)) => {
                    tracing::warn!(
                        unit,
                        "unit {unit} has an older view of the plane than this client, which may not hand it the newer: {why}"
                    );
                    return Ok(());
                }
                Err(f) => return Err(f),
            }
        }
        Ok(())
    }

    /// Take `view` when it is newer than this client's: every unit it
    /// took in since the client's view is placed again as a newcomer.
    /// Whether it was taken.
    pub(crate) fn take_view(&self, view: PlaneView) -> bool {
        let mut cur = lock(&self.plane.view);
        if view.epoch <= cur.epoch {
            return false;
        }
        for (unit, m) in view.members.iter().enumerate().take(self.units.len()) {
            let Some(instance) = m.instance else { continue };
            let before = cur.members.get(unit).copied().unwrap_or_default();
            if m.since > 0 && before != *m {
                self.admit(unit, instance);
            } else if m.since == 0 {
                let mut i = lock(&self.units[unit].instance);
                if i.current.is_none() {
                    i.current = Some(instance);
                }
            }
        }
        tracing::info!(
            from = cur.epoch,
            to = view.epoch,
            "took the plane's new view"
        );
        self.plane.epoch.store(view.epoch, SeqCst);
        *cur = view;
        true
    }

    /// `unit` rejoined as `instance`: connections to the one before go,
    /// and with copies it is placed again, as a newcomer.
    fn admit(&self, unit: usize, instance: u128) {
        {
            let mut i = lock(&self.units[unit].instance);
            i.current = Some(instance);
            // Its rows are on the other copies: nothing was lost.
            i.lost = None;
        }
        self.forget_instance(unit, Some(instance));
        if self.replicas() > 1 {
            self.copies.went_down(unit);
            self.copies.came_up(unit);
            self.metrics.repairs_pending(self.repairs_due().len());
            tracing::warn!(
                "unit {unit} rejoined the plane as instance {instance:032x}: copies go there again; a repair gives it the rows put before"
            );
        }
    }

    /// `unit` refused a row request `Stale`: learn its view (or hand it
    /// this client's), so that the operation, asked again, goes where
    /// the copies are now.
    pub(crate) fn view_refused(&self, unit: usize, deadline: Instant) {
        let end = deadline.min(Instant::now() + VIEW_WAIT);
        let end = end.max(Instant::now() + Duration::from_millis(200));
        let r = self
            .control_conn(unit, end)
            .and_then(|mut c| self.exchange_view(unit, &mut c, end));
        if let Err(f) = r {
            tracing::debug!(unit, "could not learn the unit's view of the plane: {f:?}");
        }
        // The operation's loop asks again (it does when the placement
        // changed).
        self.copies.epoch.fetch_add(1, SeqCst);
    }

    /// Take unit `unit` back into the plane as whichever instance answers
    /// at its address now (a unit started again in a dead or fenced one's
    /// place, empty): move every unit up to a view that names it, then
    /// clear what the copies that leave a set held of its rows. Its
    /// copies go there from then on; a repair ([`Client::repair`], or the
    /// background repairer) copies to it the rows put before. Needs the
    /// authority of a checkpoint (the plane's secret, or an admin's
    /// connection). Run one rejoin at a time: one that meets another's
    /// view starts again from it.
    pub fn rejoin(&self, unit: usize, deadline: Instant) -> Result<Rejoined> {
        if unit >= self.units.len() {
            return Err(Error::InvalidRequest(format!(
                "no unit {unit}: the client has {}",
                self.units.len()
            )));
        }
        if self.replicas() == 1 {
            return Err(Error::InvalidRequest(
                "with one copy of each row there is nothing to rejoin: a unit started again is used as it is (its rows were lost with it)".into(),
            ));
        }
        // Who answers there now, and what it holds.
        let (instance, rows) = match self.control_conn(unit, deadline).and_then(|mut c| {
            let id = c.send(&Request::Stats, &mut [], deadline)?;
            match c.recv(id, deadline)? {
                Response::Stats(s) => Ok((c.instance_id, s.rows)),
                other => Err(Failure::unexpected(other)),
            }
        }) {
            Ok(found) => found,
            Err(f) => return Err(self.rejoin_failed(unit, f)),
        };
        let mut out = Rejoined {
            unit,
            instance,
            ..Rejoined::default()
        };
        // Asking every unit finds the dead and the restarted: the copies
        // that stand in for them are where other clients put rows, which
        // the copies that leave a set below are found from.
        let _ = self.stats(deadline);
        // Another rejoin's view of the epoch this one's round met: the next
        // view is made from it, so that one of a later epoch has both.
        let mut split: Option<PlaneView> = None;
        for _ in 0..ROUNDS {
            let (cur, settled) = match split.take() {
                Some(theirs) => (theirs, false),
                None => {
                    self.learn_view(unit, deadline);
                    (self.plane_view(), true)
                }
            };
            let member = cur.members.get(unit).copied().unwrap_or_default();
            // At the plane's first view, the directory's instance (a client
            // that met only the new one cannot tell it from the old).
            let first = self.cfg.instances.get(unit).copied().flatten();
            let known = self.instance_id(unit);
            // The sets as clients place them while the unit is down.
            let before = self.copies.members_without(unit);
            if settled
                && (member.instance == Some(instance)
                    || (cur.epoch == 0 && known == Some(instance) && first == Some(instance)))
                && !self.copies.is_down(unit)
            {
                out.already = true;
                out.epoch = cur.epoch;
                // A rejoin cut short (its process gone after the round)
                // left the copies that stood in for the unit uncleared:
                // cleared now. (Nothing there after a whole one.)
                if member.since > 0 {
                    out.cleared = self.clear_left(unit, &before, deadline)?;
                }
                return Ok(out);
            }
            // Taken in, it must be another instance than the one the plane
            // had there, and empty: it holds nothing of what was written
            // or cleared while it was down.
            // (Another rejoin's view that took it in already: no check.)
            let was = member
                .instance
                .or_else(|| self.cfg.instances.get(unit).copied().flatten());
            let theirs = !settled && member.instance == Some(instance);
            if was == Some(instance) && !theirs {
                return Err(Error::InvalidRequest(format!(
                    "unit {unit} answers as the instance the plane had there ({instance:032x}): a unit taken as down comes back only started again, empty"
                )));
            }
            if rows > 0 && !theirs {
                return Err(Error::InvalidRequest(format!(
                    "unit {unit} holds {rows} rows: a unit rejoins empty (started again without --restore)"
                )));
            }
            let next = self.next_view(&cur, unit, instance)?;
            match self.move_units(unit, &next, deadline, &mut out)? {
                Moved::All => {}
                Moved::Other(theirs) => {
                    // A later view is taken (the next round starts from
                    // it); one of the same epoch is another rejoin's.
                    if !self.take_view(theirs.clone()) && theirs.epoch >= next.epoch {
                        split = Some(theirs);
                    }
                    continue;
                }
            }
            self.take_view(next.clone());
            out.epoch = next.epoch;
            out.cleared = self.clear_left(unit, &before, deadline)?;
            return Ok(out);
        }
        Err(Error::TransferFailed {
            unit,
            blobs: Vec::new(),
            reason: format!(
                "the plane's view kept changing while unit {unit} rejoined ({ROUNDS} rounds): another rejoin runs at once"
            ),
            in_flight: false,
        })
    }

    /// Learn the newest view of the units up (but `except`).
    fn learn_view(&self, except: usize, deadline: Instant) {
        for u in (0..self.units.len()).filter(|&u| u != except && !self.copies.is_down(u)) {
            let end = deadline.min(Instant::now() + VIEW_WAIT);
            let mine = self.plane_epoch();
            let ask = Request::Epoch {
                epoch: mine,
                digest: 0,
            };
            if let Ok(v) = self
                .control_conn(u, end)
                .and_then(|mut c| ask_view(&mut c, &ask, end))
            {
                self.take_view(v);
            }
        }
    }

    /// The view after `cur` with `unit` served by `instance`. Refused when
    /// a unit up is of an instance not known (the first view names every
    /// unit's: a unit a view does not name serves no rows).
    fn next_view(&self, cur: &PlaneView, unit: usize, instance: u128) -> Result<PlaneView> {
        let epoch = cur.epoch + 1;
        let mut members = if cur.members.len() == self.units.len() {
            cur.members.clone()
        } else {
            (0..self.units.len())
                .map(|u| Member {
                    // The plane's first instance there: the directory's,
                    // else the one this client met (not when it found the
                    // unit down: that may be an instance started again).
                    instance: self.cfg.instances.get(u).copied().flatten().or_else(|| {
                        (!self.copies.is_down(u))
                            .then(|| self.instance_id(u))
                            .flatten()
                    }),
                    since: 0,
                })
                .collect()
        };
        members[unit] = Member {
            instance: Some(instance),
            since: epoch,
        };
        if let Some(u) =
            (0..members.len()).find(|&u| members[u].instance.is_none() && !self.copies.is_down(u))
        {
            return Err(Error::Unreachable {
                unit: u,
                addr: self.units[u].addr.to_string(),
                reason: "its instance is not known (it did not answer, and the directory names none): a view naming another would leave it serving nothing".into(),
            });
        }
        Ok(PlaneView { epoch, members })
    }

    /// Hand `next` to `unit`, then to every other unit up. Stops at a
    /// unit with another view of the same or a later epoch.
    fn move_units(
        &self,
        unit: usize,
        next: &PlaneView,
        deadline: Instant,
        out: &mut Rejoined,
    ) -> Result<Moved> {
        out.moved = 0;
        out.unreached.clear();
        let others = (0..self.units.len()).filter(|&u| u != unit && !self.copies.is_down(u));
        for u in std::iter::once(unit).chain(others) {
            let end = deadline.min(Instant::now() + VIEW_WAIT);
            let ask = Request::SetView { view: next.clone() };
            let answer = self
                .control_conn(u, end)
                .and_then(|mut c| ask_view(&mut c, &ask, end));
            match answer {
                Ok(v) if v == *next => out.moved += 1,
                Ok(v) => return Ok(Moved::Other(v)),
                Err(f) if u == unit => return Err(self.rejoin_failed(unit, f)),
                Err(Failure::Refused(ErrorCode::Unauthorized, why)) => {
                    return Err(Error::Unauthorized(format!(
                        "unit {u} refused the plane's new view: {why}"
                    )))
                }
                Err(f) => {
                    tracing::warn!(
                        "unit {u} did not take the plane's new view ({f:?}): the first client of the new view that reaches it hands it over"
                    );
                    out.unreached.push(u);
                }
            }
        }
        Ok(Moved::All)
    }

    /// Clear, on each copy that left a set when `unit` came back (sets
    /// `before`), the rows of that set's unit it held, and its mark of
    /// holding them all: no longer kept up to date, they must never be
    /// served again (a later placement may make it a copy of them once
    /// more, which a repair then fills). The values cleared.
    fn clear_left(&self, unit: usize, before: &[Box<[usize]>], deadline: Instant) -> Result<u64> {
        let mut cleared = 0;
        for (g, old) in before.iter().enumerate() {
            let now = self.copies_of(g);
            for &d in old.iter().filter(|&&d| d != unit && !now.contains(&d)) {
                if self.copies.is_down(d) {
                    continue;
                }
                let clear = |partition: &str, rows: Vec<u64>| {
                    self.call_one(
                        d,
                        Request::ClearRows {
                            partition: partition.to_owned(),
                            rows,
                        },
                        self.per_call(deadline),
                    )
                };
                // The mark first: no client skips listing this pair from
                // here on.
                clear(MARKS, vec![g as u64])?;
                for partition in self.partitions_of(d, deadline)? {
                    let listed = self.listed(&partition, g, d, deadline)?;
                    cleared += listed.len() as u64;
                    let mut rows: Vec<u64> = listed.into_iter().map(|(row, _)| row).collect();
                    rows.dedup();
                    if !rows.is_empty() {
                        clear(&partition, rows)?;
                    }
                }
            }
        }
        Ok(cleared)
    }

    fn rejoin_failed(&self, unit: usize, f: Failure) -> Error {
        match f {
            Failure::Refused(ErrorCode::Unauthorized, why) | Failure::Distrust(why) => {
                Error::Unauthorized(why)
            }
            other => Error::Unreachable {
                unit,
                addr: self.units[unit].addr.to_string(),
                reason: format!("{other:?}"),
            },
        }
    }
}

/// How a rejoin's round ended.
enum Moved {
    /// Every unit that answered took the view.
    All,
    /// A unit has this other view, of the same or a later epoch.
    Other(PlaneView),
}

/// Send `ask` (Epoch or SetView) on `conn`; the unit's view.
fn ask_view(
    conn: &mut Conn,
    ask: &Request,
    deadline: Instant,
) -> std::result::Result<PlaneView, Failure> {
    let id = conn.send(ask, &mut [], deadline)?;
    match conn.recv(id, deadline)? {
        Response::View { view } => Ok(view),
        Response::Error { code, message } => Err(Failure::Refused(code, message)),
        other => Err(Failure::Protocol(format!(
            "unexpected reply to a view's exchange: {}",
            unexpected(0, other)
        ))),
    }
}
