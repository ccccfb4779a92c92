//! A put, from the caller's rows to every unit's commit, in one file: the
//! rows × fields put ([`Client::put`]) checks its columns and lays them out,
//! one blob per unit ([`plan`], each value beside its metadata,
//! `row_meta.rs`); [`Client::put_many`] (the blob API's put, which
//! [`Client::put_rows`] uses too) runs each unit's part: a connection
//! checked out of the unit's pool, the transport's put
//! ([`Transport::put`](crate::Transport::put): with a spare, write → commit; else alloc → write →
//! commit), Busy (and, when asked, Full) waited out, the connection checked
//! back in. The parts of several units run at once
//! (`fanout::all_at_once`); a put to one unit runs its part straight on
//! the calling thread. With copies, each blob goes to every unit of its
//! copies, or, where all of them are reached over tcp, to the first,
//! which forwards it to the others ([`Forwards`]; a copy whose forward
//! failed is then written by the client).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::pin::pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use stowage_wire::{BlobId, EntrySpec, ErrorCode, FailedCopy, Hop, Key};

use crate::classify::name_keys;
use crate::conn::UnitAddr;
use crate::failure::Failure;
use crate::row_meta::{check_distinct_rows, check_field, encode_meta, PutName, KEY_FIELD};
use crate::values::{byte_len, Column, RowKey, Tensor};
use crate::{fanout, metrics, new_blob_id, BlobPut, Client, Error, Result};
use stowage_wire::GROUP_FIELD_PREFIX;

use crate::row_meta::UNIT_FIELD_PREFIX;

/// While a put waits for memory ([`ClientConfig::wait_for_memory`](crate::ClientConfig::wait_for_memory)),
/// the unit is asked again after this, doubling to [`FULL_RETRY_MAX`]: a
/// put goes in that soon after the memory is freed (views dropped, rows
/// cleared), at the cost of one small request per try.
const FULL_RETRY: Duration = Duration::from_millis(5);
const FULL_RETRY_MAX: Duration = Duration::from_millis(20);

/// A put answered Busy is asked again after this, doubling to
/// [`PUT_BUSY_RETRY_MAX`]: what a put's Busy waits for (puts under way at
/// its first refusal that commit or abort, reads of cleared values, a
/// quarantine, a compaction move) mostly ends within milliseconds, and a
/// unit whose memory those holds do not free answers Full then, which the
/// caller gets at once.
const PUT_BUSY_RETRY: Duration = Duration::from_millis(5);
/// The longest pause between a put's asks while its unit answers Busy:
/// the put hears Full (or goes in) at most this long after the holds it
/// waits for have ended. Doubling to the connection backoff's 2 s
/// ([`BUSY_RETRY_MAX`](crate::BUSY_RETRY_MAX)) made a put that met a few
/// Busy answers ask again hundreds of milliseconds after the hold ended
/// (issue 37: refusals that took 35-315 ms, nearly all of it backoff); the
/// unit keeps a put Busy only for holds that existed at its first refusal
/// (`stowage_core`'s `full.rs`), so the asks are few, one small request
/// every 20 ms at most while they last. Only where the ask is that small:
/// a put over tcp carries its bytes in the request, and the unit reads
/// and drops them when it answers Busy, so there the pause doubles to
/// [`BUSY_RETRY_MAX`](crate::BUSY_RETRY_MAX) as before (a put held Busy
/// by a silent client's reservation until its deadline would otherwise
/// send its blob again every 20 ms).
const PUT_BUSY_RETRY_MAX: Duration = Duration::from_millis(20);

/// What a unit's `UnitFull` says when the asking client's own views hold
/// memory (`stowage_core`'s `CoreError::Full` message).
const OWN_VIEWS: &str = "this client's own views";

/// Each field's values of a blob start at a multiple of this many bytes
/// within it (and each value at a multiple of its dtype's size).
const VALUE_ALIGN: u64 = 64;

static PADDING: [u8; VALUE_ALIGN as usize] = [0; VALUE_ALIGN as usize];

impl Client {
    /// Write `columns` for `keys` in `partition`: all of one unit's values
    /// go out as one blob, all units at once. A put may add fields to
    /// rows that exist; writing an existing (key, field) replaces it.
    pub fn put(
        &self,
        partition: &str,
        keys: &[RowKey],
        columns: &[(&str, Column<'_>)],
        unit: Option<usize>,
        deadline: Instant,
    ) -> Result<()> {
        self.put_grouped(partition, keys, None, columns, unit, deadline)
    }

    /// [`Client::put`], each row in the group `groups[i]` (its claims
    /// take whole groups: [`Client::register_tasks`]). A grouped row
    /// lives on its group's unit ([`Client::unit_of`]) unless `unit` is
    /// given: read and clear it with that unit.
    pub fn put_grouped(
        &self,
        partition: &str,
        keys: &[RowKey],
        groups: Option<&[String]>,
        columns: &[(&str, Column<'_>)],
        unit: Option<usize>,
        deadline: Instant,
    ) -> Result<()> {
        if let Some(g) = groups {
            if g.len() != keys.len() {
                return Err(Error::InvalidRequest(format!(
                    "{} groups for {} keys",
                    g.len(),
                    keys.len()
                )));
            }
            if let Some(bad) = g.iter().find(|g| g.is_empty()) {
                return Err(Error::InvalidRequest(format!("group id {bad:?} is empty")));
            }
        }
        let place = |r: usize, row| match (groups, unit) {
            (Some(g), None) => Ok(self.unit_of(&g[r])),
            _ => self.unit_of_key(row, unit),
        };
        // With copies, a row put on a unit the caller named says so, for
        // repairs to find its copies (`repair.rs`).
        let named_unit = |r: usize, row, u| {
            self.replicas() > 1
                && u != groups.map_or_else(|| self.unit_of_row(row), |g| self.unit_of(&g[r]))
        };
        let blobs = plan(partition, keys, groups, columns, place, named_unit)?;
        if blobs.is_empty() {
            return Ok(());
        }
        self.put_many(&blobs, deadline)
            .map_err(|e| name_keys(e, keys))
    }

    /// Write blobs: each unit's blobs one after another, every unit at
    /// once. Returns once every blob is committed, or with the first
    /// unit's error (in unit order) (blobs committed on other
    /// units stay committed; retrying with the same ids is idempotent).
    pub fn put_many(&self, blobs: &[BlobPut<'_>], deadline: Instant) -> Result<()> {
        // Timed here rather than through `Client::timed`: the put runs
        // straight down from this file.
        let timer = metrics::OpTimer::start();
        let r = self.put_units(blobs, deadline, &timer);
        if r.is_ok() {
            let bytes = blobs
                .iter()
                .flat_map(|b| b.segments.iter())
                .map(|s| s.len() as u64)
                .sum();
            self.metrics.put_bytes(bytes);
        }
        self.metrics
            .op(metrics::ClientOp::Put, r.is_ok(), timer.took());
        r
    }

    pub(crate) fn put_units(
        &self,
        blobs: &[BlobPut<'_>],
        deadline: Instant,
        timer: &metrics::OpTimer,
    ) -> Result<()> {
        for b in blobs {
            if b.unit >= self.units.len() {
                return Err(Error::InvalidRequest(format!(
                    "unit {} does not exist ({} units)",
                    b.unit,
                    self.units.len()
                )));
            }
        }
        if self.replicas() == 1 {
            return self.put_placed(blobs, deadline, timer, &Forwards::default());
        }
        // A unit found gone during the put places its copies anew: put
        // again, to the units up (at most once per unit, within the
        // deadline). Also when the put went in: a unit found restarted
        // as the put met it may hold a copy no client reads any more.
        let mut tries = 0;
        loop {
            let epoch = self.copies_epoch();
            let (with_copies, forwards) = self.with_copies(blobs)?;
            let r = self
                .put_placed(&with_copies, deadline, timer, &forwards)
                .and_then(|()| self.put_unforwarded(&with_copies, &forwards, deadline, timer));
            if self.copies_epoch() == epoch
                || tries >= self.units.len()
                || Instant::now() >= deadline
            {
                return r;
            }
            tries += 1;
        }
    }

    /// Every blob and a blob of each copy after the first: the same bytes
    /// on each unit of the copies (docs/replication.md); a blob whose
    /// copies are all reached over tcp goes to its first copy only, which
    /// forwards it to the others ([`Forwards`]). Fails when fewer units
    /// are up than copies: a put never keeps fewer than asked.
    fn with_copies<'a>(&self, blobs: &[BlobPut<'a>]) -> Result<(Vec<BlobPut<'a>>, Forwards)> {
        let mut out = Vec::with_capacity(blobs.len() * self.replicas());
        let mut forwards = Forwards::default();
        for b in blobs {
            let set = self.copies_of(b.unit);
            if set.len() < self.replicas() {
                return Err(Error::TransferFailed {
                    unit: b.unit,
                    blobs: vec![b.blob],
                    reason: format!(
                        "{} copies of every row, but only {} units are up to hold them",
                        self.replicas(),
                        set.len()
                    ),
                    in_flight: false,
                });
            }
            if let Some(to) = self.forward_to(&set) {
                forwards.hops.insert(b.blob, to);
                out.push(BlobPut {
                    unit: set[0],
                    partition: b.partition,
                    blob: b.blob,
                    segments: b.segments.clone(),
                    entries: b.entries.clone(),
                });
                continue;
            }
            for (i, &unit) in set.iter().enumerate() {
                out.push(BlobPut {
                    unit,
                    partition: b.partition,
                    blob: if i == 0 { b.blob } else { new_blob_id() },
                    segments: b.segments.clone(),
                    entries: b.entries.clone(),
                });
            }
        }
        Ok((out, forwards))
    }

    /// The copies after the first of `set`, as its first unit forwards to
    /// them: over tcp down a chain, over shm (every copy's unit on this
    /// host, reached at its Unix socket) by copying from its slab into
    /// theirs. `None` where the client writes every copy itself
    /// (forwarding off, nixl, no secret, more copies than a chain holds,
    /// over tcp the first copy's unit on this client's host, or copies
    /// reached in different ways).
    fn forward_to(&self, set: &[usize]) -> Option<Vec<Hop>> {
        // Units forward only with the plane's secret (they prove it to the
        // next unit), and a chain of at most MAX_HOPS.
        if !self.cfg.forward
            || self.cfg.nixl.is_some()
            || self.cfg.secret.is_none()
            || set.len() > stowage_wire::MAX_HOPS + 1
        {
            return None;
        }
        let first = *set.first()?;
        let instance = |u: usize| {
            // The instance this client knows there: the unit forwarding
            // checks it, as this client's own put would.
            crate::lock(&self.units[u].instance)
                .current
                .or_else(|| self.cfg.instances.get(u).copied().flatten())
        };
        if let UnitAddr::Unix(_) = &self.cfg.units[first] {
            // Over shm, the first copy's unit copies its slab's bytes into
            // the other copies' slabs on this host.
            let path = |u: usize| match &self.cfg.units[u] {
                UnitAddr::Unix(p) if p.is_absolute() => p.to_str().map(str::to_owned),
                _ => None,
            };
            if !self.cfg.shm {
                return None;
            }
            return set[1..]
                .iter()
                .map(|&u| {
                    Some(Hop {
                        unit: u32::try_from(u).ok()?,
                        addr: path(u)?,
                        instance: instance(u),
                    })
                })
                .collect();
        }
        // The first copy's unit on this host: forwarding would send the
        // bytes out of this host all the same, one local hop later.
        if self.host.is_some()
            && self.cfg.hosts.get(first).and_then(Option::as_ref) == self.host.as_ref()
        {
            return None;
        }
        let tcp = |u: usize| match &self.cfg.units[u] {
            UnitAddr::Tcp(a) => Some(*a),
            UnitAddr::Unix(_) => None,
        };
        tcp(first)?;
        set[1..]
            .iter()
            .map(|&u| {
                Some(Hop {
                    unit: u32::try_from(u).ok()?,
                    addr: tcp(u)?.to_string(),
                    instance: instance(u),
                })
            })
            .collect()
    }

    /// The copies whose forward failed, written by this client to their
    /// units (`placed`: the blobs sent, whose bytes they are).
    fn put_unforwarded(
        &self,
        placed: &[BlobPut<'_>],
        forwards: &Forwards,
        deadline: Instant,
        timer: &metrics::OpTimer,
    ) -> Result<()> {
        let failed = std::mem::take(&mut *crate::lock(&forwards.failed));
        if failed.is_empty() {
            return Ok(());
        }
        // A copy refused `Stale`: the plane's view changed (a rejoin moves
        // the units), and the copies may be elsewhere in the new one. Not
        // written here (it would be a copy no client reads): the view is
        // learned, and the put made again where the copies are now.
        if let Some((blob, f)) = failed.iter().find(|(_, f)| f.code == ErrorCode::Stale) {
            self.view_refused(f.unit as usize, deadline);
            return Err(Error::TransferFailed {
                unit: f.unit as usize,
                blobs: vec![*blob],
                reason: f.message.clone(),
                in_flight: false,
            });
        }
        let by_blob: HashMap<BlobId, &BlobPut<'_>> = placed.iter().map(|b| (b.blob, b)).collect();
        let again: Vec<BlobPut<'_>> = failed
            .iter()
            .filter_map(|(blob, f)| {
                // Only a copy the blob was forwarded to (a unit's answer
                // names no other).
                let to = forwards.hops.get(blob)?;
                if !to.iter().any(|h| h.unit == f.unit) {
                    return None;
                }
                tracing::debug!(unit = f.unit, code = ?f.code, message = %f.message, "a forwarded copy failed; the client writes it");
                let b = by_blob.get(blob)?;
                Some(BlobPut {
                    unit: f.unit as usize,
                    partition: b.partition,
                    blob: new_blob_id(),
                    segments: b.segments.clone(),
                    entries: b.entries.clone(),
                })
            })
            .collect();
        self.put_placed(&again, deadline, timer, &Forwards::default())
    }

    /// [`Client::put_units`] of blobs placed already, copies and all.
    fn put_placed(
        &self,
        blobs: &[BlobPut<'_>],
        deadline: Instant,
        timer: &metrics::OpTimer,
        forwards: &Forwards,
    ) -> Result<()> {
        let wait_until = self
            .cfg
            .wait_for_memory
            .map(|w| (Instant::now() + w).min(deadline));
        // Every blob to one unit: its part runs alone, on this thread,
        // without the fan-out.
        if let Some(first) = blobs.first() {
            if fanout::alone() && blobs.iter().all(|b| b.unit == first.unit) {
                let part = self.put_unit(first.unit, blobs, deadline, wait_until, timer, forwards);
                return run_alone(part);
            }
        }
        let mut queues: BTreeMap<usize, Vec<&BlobPut<'_>>> = BTreeMap::new();
        for b in blobs {
            queues.entry(b.unit).or_default().push(b);
        }
        let results = fanout::all_at_once(queues.iter().map(|(&unit, queue)| {
            self.put_unit(
                unit,
                queue.iter().copied(),
                deadline,
                wait_until,
                timer,
                forwards,
            )
        }));
        // The first unit's error (in unit order); what other units
        // committed stays committed.
        results.into_iter().collect::<Result<Vec<()>>>().map(drop)
    }

    /// One unit's part of a put: its blobs one after another, each
    /// written and committed ([`Transport::put`](crate::Transport::put)). A unit that answers
    /// Busy is asked again after [`PUT_BUSY_RETRY`], doubling to
    /// [`PUT_BUSY_RETRY_MAX`], within the deadline; a full one fails the put
    /// with [`Error::UnitFull`] at once or, with
    /// [`ClientConfig::wait_for_memory`](crate::ClientConfig::wait_for_memory), is asked again after
    /// [`FULL_RETRY`], doubling to [`FULL_RETRY_MAX`], until that wait ends
    /// (then its UnitFull stands).
    pub(crate) async fn put_unit<'b, 'c: 'b>(
        &self,
        unit: usize,
        queue: impl IntoIterator<Item = &'b BlobPut<'c>>,
        deadline: Instant,
        wait_until: Option<Instant>,
        timer: &metrics::OpTimer,
        forwards: &Forwards,
    ) -> Result<()> {
        let mut backoff: Option<Duration> = None;
        for put in queue {
            // Whether this put has waited for its own views' unpins.
            let mut synced = false;
            loop {
                let failure = match self.put_one(unit, put, deadline, forwards).await {
                    Ok(()) => {
                        timer.unit_done(&self.metrics, unit);
                        backoff = None;
                        break;
                    }
                    Err(f) => f,
                };
                // Busy is waited out; a full unit too, when asked to
                // (`wait_for_memory`), and only that long.
                let full = !failure.is_busy();
                let mut waiting_for_memory = None;
                if full {
                    let keys = put.entries.iter().map(|e| e.key.clone()).collect();
                    let e = self.classify(unit, failure, vec![put.blob], keys, deadline);
                    // Views dropped just before this put unpin on their own
                    // connection, without an answer: the unit may not have
                    // read those unpins yet. Once per put, a round trip on
                    // that connection (read after them) and ask again.
                    if matches!(&e, Error::UnitFull { message, .. } if message.contains(OWN_VIEWS))
                        && !std::mem::replace(&mut synced, true)
                        && self.views_settled(unit, deadline).await
                    {
                        continue;
                    }
                    match e {
                        e @ Error::UnitFull { .. }
                            if wait_until.is_some_and(|w| Instant::now() < w) =>
                        {
                            waiting_for_memory = wait_until.map(|w| (w, e));
                        }
                        e => return Err(e),
                    }
                }
                // Whether asking again sends the blob's bytes again.
                let resends = *crate::lock(&self.units[unit].transport) == Some("tcp");
                let step = retry_pause(backoff, full, resends);
                let mut at = Instant::now() + step;
                if let Some((w, e)) = waiting_for_memory {
                    // The last try is at the end of the wait; past the
                    // deadline, the unit's answer stands.
                    at = at.min(w);
                    if at >= deadline {
                        return Err(e);
                    }
                }
                if at >= deadline {
                    return Err(Error::Timeout {
                        unit: Some(unit),
                        what: "the unit kept answering Busy".into(),
                    });
                }
                backoff = Some(step);
                // The time waited as it passed (a pause of a few
                // milliseconds may overshoot by as much).
                let paused = Instant::now();
                fanout::pause_until(at).await;
                self.metrics.retry(full, paused.elapsed());
            }
        }
        Ok(())
    }

    /// Wait until `unit` has read the unpins this client's last dropped
    /// view sent it (a round trip on their connection, which the unit
    /// answers after them). `false` when there is no such connection or the call
    /// failed.
    // The lock is the view connection's, held for one round trip: this
    // part waits on no other part of the call meanwhile (each part holds
    // at most its own unit's), and a view call on another thread waits
    // for it as for another view.
    #[allow(clippy::await_holding_lock)]
    async fn views_settled(&self, unit: usize, deadline: Instant) -> bool {
        let dropped = crate::lock(&self.units[unit].unpinned_on).clone();
        let Some(weak) = dropped else {
            return false;
        };
        let Some(conn) = weak.upgrade() else {
            // That view held the connection's last handle: closing it
            // released its pins, which the unit sees when it reads the
            // end. No round trip can follow that: give it a moment.
            fanout::pause_until(Instant::now() + PUT_BUSY_RETRY_MAX).await;
            return true;
        };
        let r = {
            let mut t = crate::lock(&conn);
            t.call(&stowage_wire::Request::Stats, deadline).await
        };
        match r {
            Ok(_) => true,
            Err(f) => {
                self.forget_view_conn(unit, &conn, &f);
                false
            }
        }
    }

    /// Write one blob on a pooled connection to its unit: checked out,
    /// the transport's put, checked back in (unless the failure leaves the
    /// connection unknown).
    pub(crate) async fn put_one(
        &self,
        unit: usize,
        put: &BlobPut<'_>,
        deadline: Instant,
        forwards: &Forwards,
    ) -> std::result::Result<(), Failure> {
        let mut t = self.checkout(unit, deadline).await?;
        let r = match forwards.hops.get(&put.blob) {
            Some(to) => t
                .forward_put(put, to, deadline)
                .await
                .map(|failed| forwards.record(put.blob, failed)),
            None => t.put(put, deadline).await,
        };
        match r {
            Ok(()) => {
                self.checkin(unit, t);
                Ok(())
            }
            Err(f) => {
                if f.keeps_connection() {
                    self.checkin(unit, t);
                }
                Err(f)
            }
        }
    }
}

/// The blobs of a put that the unit of their first copy forwards to the
/// others (docs/replication.md#forwarding): by blob id, the copies; and
/// the copies whose forward failed, which the client then writes itself.
#[derive(Default)]
pub(crate) struct Forwards {
    hops: HashMap<BlobId, Vec<Hop>>,
    failed: Mutex<Vec<(BlobId, FailedCopy)>>,
}

impl Forwards {
    fn record(&self, blob: BlobId, failed: Vec<FailedCopy>) {
        if !failed.is_empty() {
            crate::lock(&self.failed).extend(failed.into_iter().map(|f| (blob, f)));
        }
    }
}

/// How long a put pauses before it asks its unit again, after `previous`
/// (none: this is its first refusal): Busy from [`PUT_BUSY_RETRY`], a
/// full unit it waits for (`full`) from [`FULL_RETRY`], doubling to
/// [`PUT_BUSY_RETRY_MAX`] or [`FULL_RETRY_MAX`]; Busy where each ask
/// sends the blob again (`resends`: tcp) doubling to
/// [`BUSY_RETRY_MAX`](crate::BUSY_RETRY_MAX).
fn retry_pause(previous: Option<Duration>, full: bool, resends: bool) -> Duration {
    let (first, most) = match (full, resends) {
        (true, _) => (FULL_RETRY, FULL_RETRY_MAX),
        (false, false) => (PUT_BUSY_RETRY, PUT_BUSY_RETRY_MAX),
        (false, true) => (PUT_BUSY_RETRY, crate::BUSY_RETRY_MAX),
    };
    previous.map_or(first, |d| (d * 2).min(most))
}

/// Run one unit's part of a call to its end on this thread, where it runs
/// alone ([`fanout::alone`]): it never waits on another part then
/// ([`fanout::turn`] passes at once, [`fanout::pause_until`] sleeps), so
/// its first poll ends it.
fn run_alone<F: Future>(part: F) -> F::Output {
    let mut part = pin!(part);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = part.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

/// The blobs of a put of `columns` for `keys` in `partition`, one per unit
/// (`unit_of`: a row id's unit): every column checked first — its field
/// name, its values against the keys (the one place column lengths are
/// checked, for every caller) — then each unit's values laid out with
/// their metadata field by field: a field's values of the unit's rows
/// back to back in the order of the call, each at a multiple of its
/// dtype's size, the first on a [`VALUE_ALIGN`] boundary. None when
/// there are no keys.
pub(crate) fn plan<'a>(
    partition: &'a str,
    keys: &'a [RowKey],
    groups: Option<&'a [String]>,
    columns: &[(&'a str, Column<'a>)],
    unit_of: impl Fn(usize, u64) -> Result<usize>,
    named_unit: impl Fn(usize, u64, usize) -> bool,
) -> Result<Vec<BlobPut<'a>>> {
    let n = keys.len();
    let mut seen = HashSet::new();
    // A jagged column's values as they are (checked, not copied); a dense
    // one's cut into rows.
    let mut per_column: Vec<(&str, Cow<'_, [Tensor<'_>]>)> = Vec::with_capacity(columns.len());
    for (field, col) in columns {
        check_field(field)?;
        if !seen.insert(*field) {
            return Err(Error::InvalidRequest(format!(
                "field {field:?} given twice"
            )));
        }
        let values = match col {
            Column::Jagged(v) => {
                if v.len() != n {
                    return Err(Error::InvalidRequest(format!(
                        "column {field:?} has {} values for {n} keys",
                        v.len()
                    )));
                }
                for t in v {
                    t.check()?;
                }
                Cow::Borrowed(v.as_slice())
            }
            Column::Dense(t) => {
                t.check()?;
                match t.shape.first() {
                    Some(&rows) if rows == n as u64 => {}
                    Some(&rows) => {
                        return Err(Error::InvalidRequest(format!(
                            "column {field:?}: a dense array has {rows} rows (its first axis) for {n} keys; \
                             pass a list of arrays for values of different shapes"
                        )))
                    }
                    None => {
                        return Err(Error::InvalidRequest(format!(
                            "column {field:?}: a 0-d array cannot be split into rows"
                        )))
                    }
                }
                let row_shape = t.shape[1..].to_vec();
                let row_bytes = byte_len(t.dtype, &row_shape)? as usize;
                Cow::Owned(
                    (0..n)
                        .map(|i| Tensor {
                            dtype: t.dtype,
                            shape: row_shape.clone(),
                            data: &t.data[i * row_bytes..(i + 1) * row_bytes],
                        })
                        .collect(),
                )
            }
        };
        per_column.push((field, values));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    check_distinct_rows(partition, keys, RowKey::row_id)?;
    #[derive(Default)]
    struct Building<'a> {
        segments: Vec<&'a [u8]>,
        entries: Vec<EntrySpec>,
        size: u64,
    }
    impl<'a> Building<'a> {
        /// Pad to a multiple of `align` (at most [`VALUE_ALIGN`]).
        fn align(&mut self, align: u64) {
            let pad = self.size.next_multiple_of(align) - self.size;
            if pad > 0 {
                self.segments.push(&PADDING[..pad as usize]);
                self.size += pad;
            }
        }

        /// The value at the next multiple of `align`.
        fn push(&mut self, key: Key, data: &'a [u8], meta: Vec<u8>, align: u64) {
            self.align(align);
            self.entries.push(EntrySpec {
                key,
                offset: self.size,
                len: data.len() as u64,
                meta,
            });
            if !data.is_empty() {
                self.segments.push(data);
            }
            self.size += data.len() as u64;
        }
    }
    /// A unit's row: its place in the call, its id, the name it is put
    /// under (encoded, for its values' metadata).
    type UnitRow = (usize, u64, Option<Vec<u8>>);
    let mut rows_of: BTreeMap<usize, Vec<UnitRow>> = BTreeMap::new();
    for (r, key) in keys.iter().enumerate() {
        let row = key.row_id()?;
        let owner = match key {
            RowKey::Name(name) => Some(
                postcard::to_allocvec(&PutName::of(name))
                    .map_err(|e| Error::InvalidRequest(format!("row name: {e}")))?,
            ),
            RowKey::Index(_) => None,
        };
        rows_of
            .entry(unit_of(r, row)?)
            .or_default()
            .push((r, row, owner));
    }
    let mut by_unit: BTreeMap<usize, Building<'_>> = BTreeMap::new();
    for (u, rows) in rows_of {
        let b = by_unit.entry(u).or_default();
        // The rows' names and groups first, then each field's values of
        // the unit's rows back to back in the order of the call (each at
        // a multiple of its dtype's size, the first on a VALUE_ALIGN
        // boundary): what a view packs in place (`views.rs`).
        for &(r, row, _) in &rows {
            if let RowKey::Name(name) = &keys[r] {
                b.push(Key::new(row, KEY_FIELD), name.as_bytes(), Vec::new(), 1);
            }
            if let Some(g) = groups {
                b.push(
                    Key::new(row, format!("{GROUP_FIELD_PREFIX}{}", g[r])),
                    &[],
                    Vec::new(),
                    1,
                );
            }
            if named_unit(r, row, u) {
                b.push(
                    Key::new(row, format!("{UNIT_FIELD_PREFIX}{u}")),
                    &[],
                    Vec::new(),
                    1,
                );
            }
        }
        for (field, values) in &per_column {
            b.align(VALUE_ALIGN);
            for (r, row, owner) in &rows {
                let t = &values[*r];
                let meta = encode_meta(t.dtype, &t.shape, owner.as_deref())?;
                b.push(
                    Key::new(*row, *field),
                    t.data,
                    meta,
                    t.dtype.itemsize() as u64,
                );
            }
        }
    }
    let blobs: Vec<BlobPut<'a>> = by_unit
        .into_iter()
        .map(|(u, b)| BlobPut {
            unit: u,
            partition,
            blob: new_blob_id(),
            segments: b.segments,
            entries: b.entries,
        })
        .collect();
    Ok(blobs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A put that meets many Busy answers asks again every 20 ms at most:
    /// it hears Full (or goes in) at most that long after the holds it
    /// waits for end (doubling to the connection backoff's 2 s, a put
    /// asked again up to as long after as it had waited, issue 37). So
    /// does one waiting for memory.
    #[test]
    fn a_put_answered_busy_asks_again_within_20_ms() {
        for full in [false, true] {
            let mut pauses = vec![];
            let mut previous = None;
            for _ in 0..12 {
                let p = retry_pause(previous, full, false);
                pauses.push(p.as_millis());
                previous = Some(p);
            }
            assert_eq!(pauses[..4], [5, 10, 20, 20], "full: {full}");
            assert!(pauses.iter().all(|&p| p <= 20), "full: {full}: {pauses:?}");
        }
    }

    /// Over tcp each ask carries the blob: Busy backs off to 2 s there.
    #[test]
    fn a_put_that_resends_its_bytes_backs_off_to_2_s_while_busy() {
        let mut previous = None;
        let mut pauses = vec![];
        for _ in 0..12 {
            let p = retry_pause(previous, false, true);
            pauses.push(p.as_millis());
            previous = Some(p);
        }
        assert_eq!(pauses[..4], [5, 10, 20, 40]);
        assert_eq!(*pauses.last().unwrap(), 2000);
        // A full unit waited for (wait_for_memory) keeps its own pacing.
        assert_eq!(
            retry_pause(Some(Duration::from_millis(20)), true, true).as_millis(),
            20
        );
    }
}
