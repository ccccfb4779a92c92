//! Repair: when a unit goes down, the units that take its copies
//! (*newcomers*, `copies.rs`) hold only what was put since; a repair
//! copies the rest to them from a copy that holds every row
//! (docs/replication.md#repair).
//!
//! For each unit whose rows have a newcomer, and each newcomer: open a
//! repair window on the newcomer (`OpenRepair`; a window another client
//! holds for the same rows answers Busy, and this client leaves them to
//! it for now), list the source's partitions and, per partition, the
//! source's and the newcomer's fields of those rows; read what the
//! newcomer lacks from the source in batches and send each batch to the
//! newcomer (`RepairPut`) while the next is read. The newcomer stores a value only if it holds
//! none for the key and did not see the key's row or partition cleared
//! since the window opened. Because every clear reaches a newcomer again
//! after it reached every other copy (`Client::clear_newcomers_again`),
//! a value the repair read before a clear is refused by the newcomer,
//! and one it read after was not there to read: a repair never brings
//! back a cleared row, nor writes over a newer value.
//!
//! Repairs run in the background ([`repair_in_background`]) within
//! [`ClientConfig::repair_rate`], or one pass at a time
//! ([`Client::repair`]).

use std::collections::BTreeSet;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use stowage_wire::{EntrySpec, ErrorCode, Key, Request, Response};

use crate::classify::{unexpected, unit_error};
use crate::sink::{Sink, ValueAsk};
use crate::transport::SharedSink;
use crate::{fanout, metrics, new_blob_id, BlobPut, Client, Error, Result};

#[cfg(doc)]
use crate::ClientConfig;

/// Bytes read from the source and sent to the newcomer at a time.
const BATCH_BYTES: u64 = 32 << 20;
/// Most keys read at a time.
const BATCH_KEYS: usize = 1024;
/// Keys of a repair's first batch (values of unknown size: its sizes
/// set the next batches'), so that the buffers a repair holds stay near
/// [`BATCH_BYTES`] and one value, whatever the values' size.
const FIRST_BATCH_KEYS: usize = 1;
/// How often the background repairer looks for repairs due.
const LOOK_EVERY: Duration = Duration::from_millis(100);
/// How long it waits after a pass that left repairs due (another client
/// holds their window, or a unit did not answer).
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// The longest wait between passes that leave repairs due.
const RETRY_MAX: Duration = Duration::from_secs(30);
/// The longest pass of the background repairer.
const PASS_MAX: Duration = Duration::from_secs(3600);
/// The partition (of the client's namespace) where a newcomer keeps, for
/// each unit whose rows a repair gave it in full, a mark (row: the unit,
/// field [`MARK_FIELD`]): a newcomer goes on receiving every put and clear
/// of those rows, so the mark stays true while the unit lives (a unit that
/// restarts loses it with the rest). Other clients read it and skip the
/// lists of a pass (`stowage status` and `list` do not show it).
pub(crate) const MARKS: &str = "\0stowage:repaired";
const MARK_FIELD: &str = "whole";
/// Partitions of this prefix are the client's bookkeeping, not rows.
pub(crate) const RESERVED_PARTITIONS: &str = stowage_wire::RESERVED_PARTITION_PREFIX;
/// Value alignment in a repair's blobs (as a put lays them out).
const ALIGN: u64 = 64;

/// What a repair pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Repaired {
    /// Newcomers brought up to every row of a unit's (pairs of the unit
    /// and the newcomer).
    pub done: usize,
    /// Pairs still due: another client holds the newcomer's repair
    /// window, or a unit failed (`errors` says which).
    pub left: usize,
    /// Values stored on newcomers.
    pub values: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Values the newcomers refused: already there, or cleared since
    /// the repair read them.
    pub skipped: u64,
    /// Why pairs were left, one line each.
    pub errors: Vec<String>,
}

/// What a newcomer lacks of a unit's rows ([`Client::under_replicated`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// The unit whose rows (row `r` is unit `r % units`'s).
    pub unit: usize,
    /// The copy that holds them all.
    pub source: usize,
    /// The newcomer.
    pub target: usize,
    /// Rows the newcomer lacks a value of, and those values.
    pub rows: u64,
    pub values: u64,
}

/// The values a repair read, by key position: bytes and metadata, and
/// whether the key was found. Its buffers are used again batch after
/// batch (a repair touches fresh memory only for its first batch).
#[derive(Default)]
struct Taken {
    values: Vec<(Vec<u8>, Vec<u8>)>,
    found: Vec<bool>,
}

impl Taken {
    /// Ready for a batch of `n` keys.
    fn reset(&mut self, n: usize) {
        self.values
            .resize_with(n.max(self.values.len()), Default::default);
        self.found.clear();
        self.found.resize(n, false);
    }

    /// How many values were found, and their bytes.
    fn count(&self) -> u64 {
        self.iter().flatten().count() as u64
    }

    fn bytes(&self) -> u64 {
        self.iter().flatten().map(|(v, _)| v.len() as u64).sum()
    }

    /// The values found of the batch, by key position.
    fn iter(&self) -> impl Iterator<Item = Option<&(Vec<u8>, Vec<u8>)>> {
        self.found
            .iter()
            .zip(&self.values)
            .map(|(&f, v)| f.then_some(v))
    }
}

impl Sink<ValueAsk<'_>> for Taken {
    fn slot(&mut self, ask: ValueAsk<'_>) -> std::result::Result<&mut [u8], String> {
        let len = usize::try_from(ask.len).map_err(|_| "value larger than memory".to_string())?;
        let (Some(found), Some((bytes, meta))) = (
            self.found.get_mut(ask.index),
            self.values.get_mut(ask.index),
        ) else {
            return Err("key index out of range".into());
        };
        *found = true;
        meta.clear();
        meta.extend_from_slice(ask.meta);
        bytes.clear();
        bytes.resize(len, 0);
        Ok(bytes.as_mut_slice())
    }
}

/// One pair's repair failed: `busy` when another client holds its window
/// (or the window lost track of clears: start over).
struct PairFailed {
    busy: bool,
    error: Error,
}

impl From<Error> for PairFailed {
    fn from(error: Error) -> Self {
        PairFailed { busy: false, error }
    }
}

impl Client {
    /// Repairs this client knows to be due: pairs of a unit whose copies
    /// moved and a newcomer it has not repaired yet.
    pub fn repairs_pending(&self) -> usize {
        self.repairs_due().len()
    }

    /// One repair pass: every newcomer gets the values of the rows it
    /// took a copy of that it lacks, from a copy that holds them all,
    /// by `deadline` (each call within the client's timeout) and
    /// [`ClientConfig::repair_rate`].
    /// Safe to run from many clients at once, and alongside puts, gets
    /// and clears (module docs).
    pub fn repair(&self, deadline: Instant) -> Result<Repaired> {
        self.repair_pass(deadline, &|| false)
    }

    /// [`Client::repair`] that gives up between batches once `stop` says
    /// so.
    fn repair_pass(&self, deadline: Instant, stop: &dyn Fn() -> bool) -> Result<Repaired> {
        self.learn_marks(deadline);
        let out = self.repair_pairs(self.repairs_due(), deadline, stop, true);
        self.metrics.repairs_pending(self.repairs_pending());
        Ok(out)
    }

    /// Every row on every unit of its copies, from whichever copy holds
    /// it: for each unit's rows, each copy gets what another copy holds
    /// and it lacks. For a plane whose units were restarted from a
    /// checkpoint that kept one copy of each row (docs/replication.md#checkpoints):
    /// run it before the plane serves. Alongside other clients' clears of
    /// the same rows it could bring one back (they clear these copies only
    /// once, not again after the others, as they do a newcomer's).
    pub fn rebuild_copies(&self, deadline: Instant) -> Result<Repaired> {
        let pairs = (0..self.units.len())
            .flat_map(|u| {
                let set = self.copies_of(u);
                let pairs: Vec<(usize, usize, usize)> = set
                    .iter()
                    .flat_map(|&s| {
                        set.iter()
                            .filter(move |&&t| t != s)
                            .map(move |&t| (u, s, t))
                    })
                    .collect();
                pairs
            })
            .collect();
        Ok(self.repair_pairs(pairs, deadline, &|| false, false))
    }

    /// Repair each (unit whose rows, source, target) pair; `newcomers`:
    /// the targets are newcomers, repaired for good once done.
    fn repair_pairs(
        &self,
        pairs: Vec<(usize, usize, usize)>,
        deadline: Instant,
        stop: &dyn Fn() -> bool,
        newcomers: bool,
    ) -> Repaired {
        let mut out = Repaired::default();
        let started = Instant::now();
        for (unit, source, target) in pairs {
            let before = (out.values, out.bytes, out.skipped);
            if stop() {
                out.left += 1;
                continue;
            }
            let pair = (unit, source, target);
            match self.repair_pair(pair, deadline, started, stop, newcomers, &mut out) {
                Ok(()) => {
                    if newcomers {
                        self.repaired(unit, target);
                        self.metrics.repaired_pair();
                    }
                    out.done += 1;
                }
                Err(f) => {
                    out.left += 1;
                    out.errors.push(format!(
                        "unit {unit}'s rows from unit {source} to unit {target}: {}{}",
                        if f.busy { "busy: " } else { "" },
                        f.error
                    ));
                }
            }
            self.metrics.repaired(
                out.values - before.0,
                out.bytes - before.1,
                out.skipped - before.2,
            );
        }
        out
    }

    /// What each newcomer lacks now (lists only; nothing is copied).
    pub fn under_replicated(&self, deadline: Instant) -> Result<Vec<Shortfall>> {
        self.learn_marks(deadline);
        let mut out = Vec::new();
        for (unit, source, target) in self.repairs_due() {
            let (mut rows, mut values) = (0, 0);
            for partition in self.partitions_of(source, deadline)? {
                let lacks = self.lacks(&partition, unit, source, target, deadline)?;
                values += lacks.len() as u64;
                rows += lacks.iter().map(|k| k.row).collect::<BTreeSet<_>>().len() as u64;
            }
            out.push(Shortfall {
                unit,
                source,
                target,
                rows,
                values,
            });
        }
        Ok(out)
    }

    /// Repair one (unit whose rows, source, target) pair. `mark`: the
    /// target is a newcomer; once it holds every row it gets a mark that
    /// later repairers of the pair read instead of listing ([`MARKS`]).
    fn repair_pair(
        &self,
        (unit, source, target): (usize, usize, usize),
        deadline: Instant,
        started: Instant,
        stop: &dyn Fn() -> bool,
        mark: bool,
        out: &mut Repaired,
    ) -> std::result::Result<(), PairFailed> {
        if mark && self.marked(unit, target, deadline) {
            return Ok(());
        }
        let key = format!("rows of unit {unit} of {}", self.units.len());
        let window = match self.repair_call(target, Request::OpenRepair { key }, deadline)? {
            Response::RepairOpened { window } => window,
            other => return Err(unexpected(target, other).into()),
        };
        let mut r = self.fill(unit, source, target, window, deadline, started, stop, out);
        if r.is_ok() && mark {
            let mut whole = Taken::default();
            whole.reset(1);
            whole.found[0] = true;
            whole.values[0].0.push(1);
            let key = [Key::new(unit as u64, MARK_FIELD)];
            r = self
                .send_repair(MARKS, target, window, &key, &whole, deadline)
                .map(drop);
        }
        // The window closes with the session too; a failed close costs
        // the newcomer only its bookkeeping until then.
        let _ = self.repair_call(target, Request::CloseRepair { window }, deadline);
        r
    }

    /// The newcomers another client repaired (their mark) hold every row
    /// for this client too: after a second unit's death, the rows whose
    /// copies left are only such newcomers have a source again.
    pub(crate) fn learn_marks(&self, deadline: Instant) {
        for (unit, target) in self.unsettled() {
            if self.marked(unit, target, deadline) {
                self.repaired(unit, target);
            }
        }
    }

    /// Whether `target` holds the mark of having every row of `unit`'s.
    fn marked(&self, unit: usize, target: usize, deadline: Instant) -> bool {
        let mut taken = Taken::default();
        let key = [Key::new(unit as u64, MARK_FIELD)];
        self.take(MARKS, target, &key, &mut taken, deadline).is_ok()
            && taken.iter().next().flatten().is_some()
    }

    #[allow(clippy::too_many_arguments)]
    fn fill(
        &self,
        unit: usize,
        source: usize,
        target: usize,
        window: u64,
        deadline: Instant,
        started: Instant,
        stop: &dyn Fn() -> bool,
        out: &mut Repaired,
    ) -> std::result::Result<(), PairFailed> {
        // Few keys first: their sizes set the next batches'. Each batch
        // is sent to the newcomer while the next is read from the source
        // (two buffers, one each way).
        let mut per_key = FIRST_BATCH_KEYS;
        let (mut read, mut send) = (Taken::default(), Taken::default());
        for partition in self.partitions_of(source, deadline)? {
            let lacks = self.lacks(&partition, unit, source, target, deadline)?;
            let mut rest = &lacks[..];
            // The batch read and not yet sent.
            let mut held: &[Key] = &[];
            while !rest.is_empty() || !held.is_empty() {
                if stop() {
                    return Err(Error::InvalidRequest("the client is closing".into()).into());
                }
                let (batch, after) = rest.split_at(per_key.min(rest.len()));
                rest = after;
                std::mem::swap(&mut read, &mut send);
                let sending = held;
                let (took, sent) = std::thread::scope(|s| {
                    let sent = (!sending.is_empty()).then(|| {
                        let send = &send;
                        let partition = &partition;
                        s.spawn(move || {
                            self.send_repair(partition, target, window, sending, send, deadline)
                        })
                    });
                    let took = (!batch.is_empty())
                        .then(|| self.take_batch(&partition, source, batch, &mut read, deadline));
                    let sent = sent.map(|h| h.join().expect("a repair's send panicked"));
                    (took, sent)
                });
                if let Some(sent) = sent {
                    let (stored, skipped) = sent?;
                    let bytes = send.bytes();
                    out.values += stored;
                    out.skipped += skipped;
                    out.bytes += bytes;
                    self.pace(out.bytes, started, deadline);
                }
                if let Some(took) = took {
                    let (values, bytes) = took?;
                    if values > 0 {
                        per_key =
                            ((BATCH_BYTES * values / bytes.max(1)) as usize).clamp(1, BATCH_KEYS);
                    }
                }
                held = batch;
            }
        }
        Ok(())
    }

    /// Read a batch for [`Self::fill`] (then wait at the `repair-gate`
    /// failpoint): the values found and their bytes.
    fn take_batch(
        &self,
        partition: &str,
        source: usize,
        batch: &[Key],
        taken: &mut Taken,
        deadline: Instant,
    ) -> Result<(u64, u64)> {
        self.take(partition, source, batch, taken, deadline)?;
        if let Some(gate) = self.cfg.failpoints.repair_gate {
            wait_at_gate(gate);
        }
        Ok((taken.count(), taken.bytes()))
    }

    /// Sleep as long as `bytes` since `started` are ahead of the repair
    /// rate (never past `deadline`).
    fn pace(&self, bytes: u64, started: Instant, deadline: Instant) {
        let rate = self.cfg.repair_rate;
        if rate == 0 {
            return;
        }
        let due = started + Duration::from_secs_f64(bytes as f64 / rate as f64);
        let until = due.min(deadline);
        if let Some(wait) = until.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }

    /// The deadline of one call of a pass that ends by `pass`: the
    /// client's timeout from now.
    pub(crate) fn per_call(&self, pass: Instant) -> Instant {
        (Instant::now() + self.cfg.timeout).min(pass)
    }

    pub(crate) fn partitions_of(&self, unit: usize, deadline: Instant) -> Result<Vec<String>> {
        let deadline = self.per_call(deadline);
        match self.call_one(unit, Request::ListPartitions, deadline)? {
            Response::Partitions { names } => Ok(names
                .into_iter()
                .filter(|n| !n.starts_with(RESERVED_PARTITIONS))
                .collect()),
            other => Err(unexpected(unit, other)),
        }
    }

    /// `partition`'s (row, field) of `unit`'s rows on `on`.
    pub(crate) fn listed(
        &self,
        partition: &str,
        unit: usize,
        on: usize,
        deadline: Instant,
    ) -> Result<BTreeSet<(u64, String)>> {
        let deadline = self.per_call(deadline);
        let req = Request::List {
            partition: partition.to_owned(),
        };
        match self.call_one(on, req, deadline)? {
            Response::Listed { rows } => Ok(rows
                .into_iter()
                .filter(|(row, fields)| self.home_of(*row, fields) == unit)
                .flat_map(|(row, fields)| fields.into_iter().map(move |f| (row, f)))
                .collect()),
            other => Err(unexpected(on, other)),
        }
    }

    /// Which unit's rows `row` is, from its fields: the unit its put
    /// named, else its group's unit, else its own (as the put placed it;
    /// the rule is [`stowage_wire::home_unit`], which units share).
    fn home_of(&self, row: u64, fields: &[String]) -> usize {
        stowage_wire::home_unit(row, fields.iter().map(String::as_str), self.units.len())
    }

    /// The keys of `unit`'s rows in `partition` that `source` holds and
    /// `target` does not.
    fn lacks(
        &self,
        partition: &str,
        unit: usize,
        source: usize,
        target: usize,
        deadline: Instant,
    ) -> Result<Vec<Key>> {
        let has = self.listed(partition, unit, target, deadline)?;
        Ok(self
            .listed(partition, unit, source, deadline)?
            .into_iter()
            .filter(|k| !has.contains(k))
            .map(|(row, field)| Key::new(row, field))
            .collect())
    }

    /// Read `keys` from `source` (a key cleared since it was listed is
    /// `None`).
    fn take(
        &self,
        partition: &str,
        source: usize,
        keys: &[Key],
        taken: &mut Taken,
        deadline: Instant,
    ) -> Result<()> {
        let deadline = self.per_call(deadline);
        taken.reset(keys.len());
        let idx: Vec<usize> = (0..keys.len()).collect();
        let timer = metrics::OpTimer::start();
        let sink: SharedSink<'_> = std::cell::RefCell::new(taken);
        let part = self.get_unit(partition, source, keys, &idx, &sink, deadline, &timer);
        fanout::all_at_once([part])
            .pop()
            .unwrap_or_else(|| Err(Error::Io("no reply".into())))?;
        Ok(())
    }

    /// Send the values taken to `target` in one RepairPut: (stored,
    /// skipped).
    fn send_repair(
        &self,
        partition: &str,
        target: usize,
        window: u64,
        keys: &[Key],
        taken: &Taken,
        deadline: Instant,
    ) -> std::result::Result<(u64, u64), PairFailed> {
        let deadline = self.per_call(deadline);
        const PAD: [u8; ALIGN as usize] = [0; ALIGN as usize];
        let mut put = BlobPut {
            unit: target,
            partition,
            blob: new_blob_id(),
            segments: Vec::new(),
            entries: Vec::new(),
        };
        let mut size = 0u64;
        for (key, value) in keys.iter().zip(taken.iter()) {
            let Some((bytes, meta)) = value else { continue };
            let pad = size.next_multiple_of(ALIGN) - size;
            if pad > 0 {
                put.segments.push(&PAD[..pad as usize]);
                size += pad;
            }
            put.entries.push(EntrySpec {
                key: key.clone(),
                offset: size,
                len: bytes.len() as u64,
                meta: meta.clone(),
            });
            if !bytes.is_empty() {
                put.segments.push(bytes);
            }
            size += bytes.len() as u64;
        }
        if put.entries.is_empty() {
            return Ok((0, 0));
        }
        let part = async {
            let mut t = self
                .checkout(target, deadline)
                .await
                .map_err(|f| self.failed_get(target, f, &[], deadline))?;
            let r = t.repair_put(window, &put, deadline).await;
            match r {
                Ok(reply) => {
                    self.checkin(target, t);
                    Ok(reply)
                }
                Err(f) => {
                    if f.keeps_connection() {
                        self.checkin(target, t);
                    }
                    Err(self.failed_get(target, f, &[], deadline))
                }
            }
        };
        let reply = fanout::all_at_once([part])
            .pop()
            .unwrap_or_else(|| Err(Error::Io("no reply".into())))?;
        match reply {
            Response::Repaired { stored, skipped } => Ok((stored.into(), skipped.into())),
            other => Err(refusal(target, other)),
        }
    }

    /// A control call of the repair: a Busy answer is told apart (another
    /// client's window).
    fn repair_call(
        &self,
        unit: usize,
        req: Request,
        deadline: Instant,
    ) -> std::result::Result<Response, PairFailed> {
        let deadline = self.per_call(deadline);
        let reply = fanout::all_at_once([self.call_unit_answer(unit, &req, deadline)])
            .pop()
            .unwrap_or_else(|| Err(Error::Io("no reply".into())))?;
        match reply {
            Response::Error { .. } => Err(refusal(unit, reply)),
            r => Ok(r),
        }
    }
}

/// The `repair-gate` failpoint ([`crate::Failpoints::repair_gate`]).
fn wait_at_gate(gate: u32) {
    let dir = std::env::temp_dir();
    let open = dir.join(format!("stowage-repair-gate-{gate}"));
    let _ = std::fs::write(dir.join(format!("stowage-repair-gate-{gate}.reached")), b"");
    let until = Instant::now() + Duration::from_secs(60);
    while !open.exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A unit's refusal of a repair call, Busy told apart.
fn refusal(unit: usize, reply: Response) -> PairFailed {
    match reply {
        Response::Error { code, message } => PairFailed {
            busy: code == ErrorCode::Busy,
            error: unit_error(unit, code, message, vec![]),
        },
        other => unexpected(unit, other).into(),
    }
}

/// How often the background repairer fences the units taken as down
/// that did not answer (`fence.rs`).
const FENCE_EVERY: Duration = Duration::from_secs(1);

/// Repair `client`'s newcomers in the background while it lives: a
/// thread that looks for repairs due every 100 ms (and fences, every
/// second, the units taken as down that did not answer then) and runs passes
/// ([`Client::repair`]) until none is left, 1 s apart while some are left
/// (another client holds their window, or a unit failed), doubling to
/// 30 s while passes keep leaving some. It
/// holds the client only during a pass, and ends once the client is
/// dropped. Nothing to do with one copy: no thread is started.
pub fn repair_in_background(client: &Arc<Client>) {
    if client.replicas() == 1 {
        return;
    }
    let weak: Weak<Client> = Arc::downgrade(client);
    let spawned = std::thread::Builder::new()
        .name("stowage-repair".into())
        .spawn(move || repair_loop(&weak));
    if let Err(e) = spawned {
        tracing::warn!("no repair thread: {e}");
    }
}

/// The background repairer's thread ([`repair_in_background`]).
fn repair_loop(weak: &Weak<Client>) {
    // The copies' epoch at which nothing was left due: nothing is due
    // until a unit goes down again.
    let mut settled = Some(0);
    // After a pass that left repairs due: 1 s, doubling to 30 s while
    // passes keep leaving some (a newcomer without room, a unit that does
    // not answer), so that a stuck repair neither spins nor floods the log.
    let mut backoff = RETRY_AFTER;
    // When units taken as down that did not answer were last fenced.
    let mut fenced_at: Option<Instant> = None;
    loop {
        std::thread::sleep(LOOK_EVERY);
        let Some(client) = weak.upgrade() else { return };
        if client.fences_due() && fenced_at.is_none_or(|t| t.elapsed() >= FENCE_EVERY) {
            client.fence_due();
            fenced_at = Some(Instant::now());
        }
        let epoch = client.copies_epoch();
        if settled == Some(epoch) {
            continue;
        }
        if client.unsettled().is_empty() {
            settled = Some(epoch);
            continue;
        }
        settled = None;
        // A pass may take long; each of its calls has the client's
        // timeout. It stops once nothing but this thread holds the client
        // (it was closed).
        let pass = Instant::now() + PASS_MAX;
        let closed = || Arc::strong_count(&client) == 1;
        let left = match client.repair_pass(pass, &closed) {
            // Copies with nothing to repair them from (every whole copy
            // gone) stay unsettled: looked at again after the backoff.
            Ok(_) if !client.unsettled().is_empty() && client.repairs_pending() == 0 => true,
            Ok(r) if r.left == 0 => {
                tracing::info!(
                    done = r.done,
                    values = r.values,
                    bytes = r.bytes,
                    refused = r.skipped,
                    "repaired the newcomers' copies"
                );
                false
            }
            Ok(r) => {
                tracing::warn!("repair left {} pairs: {}", r.left, r.errors.join("; "));
                true
            }
            Err(e) => {
                tracing::warn!("repair failed: {e}");
                true
            }
        };
        drop(client);
        if left {
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(RETRY_MAX);
        } else {
            backoff = RETRY_AFTER;
        }
    }
}
