//! The blob API: get and clear, every unit's part at once
//! (`fanout::all_at_once`), and the raw-row conveniences over it (the put
//! is `put.rs`).

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use stowage_wire::{EntrySpec, ErrorCode, Key, Request, Response};

use crate::classify::{unexpected, unit_error};
use crate::copies::{next_copy_may_serve, ReadOrder};
use crate::failure::Failure;
use crate::sink::{Counting, ValueSink, VecSink};
use crate::transport::SharedSink;
use crate::DEFAULT_PARTITION;
use crate::{error, fanout, metrics, new_blob_id, BlobPut, Client, Error, GetSink, Result, Value};

impl Client {
    /// Run `f` as one operation of kind `op` (counted, timed from here to
    /// the last unit's answer). `f` gets the operation's timer, to record
    /// each unit's answer with.
    pub(crate) fn timed<T>(
        &self,
        op: metrics::ClientOp,
        f: impl FnOnce(&metrics::OpTimer) -> Result<T>,
    ) -> Result<T> {
        let timer = metrics::OpTimer::start();
        let r = f(&timer);
        self.metrics.op(op, r.is_ok(), timer.took());
        r
    }

    /// Read `keys` (each with its unit): one resolve and one read per unit,
    /// every unit at once. Every value is handed to `sink` under its index
    /// in `keys`. Keys that are not stored fail the call with
    /// [`Error::NotFound`] naming each of them.
    pub fn get_into(
        &self,
        partition: &str,
        keys: &[(usize, Key)],
        sink: &mut dyn GetSink,
        deadline: Instant,
    ) -> Result<()> {
        self.get_placed_into(partition, keys.to_vec(), sink, deadline)
    }

    /// [`Client::get_into`] of keys the caller gives up (each goes into
    /// its unit's request as it is: no copy per key).
    pub(crate) fn get_placed_into(
        &self,
        partition: &str,
        keys: Vec<(usize, Key)>,
        sink: &mut dyn GetSink,
        deadline: Instant,
    ) -> Result<()> {
        self.timed(metrics::ClientOp::Get, |timer| {
            let mut counting = Counting {
                inner: sink,
                bytes: 0,
            };
            self.get_from_units(partition, keys, &mut counting, deadline, timer)?;
            self.metrics.got_bytes(counting.bytes);
            Ok(())
        })
    }

    pub(crate) fn get_from_units(
        &self,
        partition: &str,
        keys: Vec<(usize, Key)>,
        sink: &mut dyn GetSink,
        deadline: Instant,
        timer: &metrics::OpTimer,
    ) -> Result<()> {
        if self.replicas() == 1 {
            return self.get_copies(partition, keys, sink, deadline, timer);
        }
        // A unit found gone during the get places its copies anew: a key
        // not found or lost is asked again where its copies are now.
        self.read_again_where_copies_are(deadline, || {
            self.get_copies(partition, keys.clone(), &mut *sink, deadline, timer)
        })
    }

    /// One pass of [`Client::get_from_units`]: copy after copy of where
    /// the copies are now.
    fn get_copies(
        &self,
        partition: &str,
        keys: Vec<(usize, Key)>,
        sink: &mut dyn GetSink,
        deadline: Instant,
        timer: &metrics::OpTimer,
    ) -> Result<()> {
        // By the unit of copy 0: its keys, and their indexes in `keys`.
        let mut by_unit: BTreeMap<usize, (Vec<Key>, Vec<usize>)> = BTreeMap::new();
        for (i, (unit, key)) in keys.into_iter().enumerate() {
            if unit >= self.units.len() {
                return Err(Error::InvalidRequest(format!("unit {unit} does not exist")));
            }
            let e = by_unit.entry(unit).or_default();
            e.0.push(key);
            e.1.push(i);
        }
        let sink: SharedSink<'_> = std::cell::RefCell::new(sink);
        let copies = self.replicas();
        let mut missing: Vec<Key> = Vec::new();
        // Copy after copy: what one copy could not give (its unit gone or
        // not answering, keys it does not hold) is asked of the next.
        // `answered`: a live copy said it does not hold these keys, so
        // they are not found (not lost) when the copies after it are gone.
        let mut asked: Vec<(ReadOrder, Vec<Key>, Vec<usize>, bool)> = by_unit
            .into_iter()
            .map(|(unit, (ks, idx))| (self.read_order(unit), ks, idx, false))
            .collect();
        for copy in 0..copies {
            let at = self.copy_deadline(deadline, copy);
            let results = fanout::all_at_once(asked.iter().map(|(order, ks, idx, _)| {
                self.get_unit(partition, order[copy], ks, idx, &sink, at, timer)
            }));
            let mut next = Vec::new();
            for ((order, ks, idx, answered), r) in asked.into_iter().zip(results) {
                // No copy after this one (fewer units up than copies, or
                // the last copy).
                let last = copy + 1 >= order.len();
                if copies > 1 {
                    match &r {
                        Err(e) if next_copy_may_serve(e) => self.suspect(order[copy]),
                        Err(_) => {}
                        Ok(_) => self.trust(order[copy]),
                    }
                }
                match r {
                    Ok(miss) if miss.is_empty() => {}
                    Ok(miss) if last => missing.extend(miss.into_iter().map(|m| ks[m].clone())),
                    Ok(miss) => {
                        let keys = miss.iter().map(|&m| ks[m].clone()).collect();
                        let idx = miss.iter().map(|&m| idx[m]).collect();
                        next.push((order, keys, idx, true));
                    }
                    Err(e) if next_copy_may_serve(&e) && !last => {
                        next.push((order, ks, idx, answered))
                    }
                    Err(e) if next_copy_may_serve(&e) && answered => missing.extend(ks),
                    Err(e) => return Err(e),
                }
            }
            asked = next;
            if asked.is_empty() {
                break;
            }
        }
        if !missing.is_empty() {
            return Err(Error::NotFound {
                named: error::names(&missing),
                keys: missing,
            });
        }
        Ok(())
    }

    /// One unit's part of a get ([`Transport::get`]): the positions in
    /// `keys` of those it does not have.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn get_unit(
        &self,
        partition: &str,
        unit: usize,
        keys: &[Key],
        index_of: &[usize],
        sink: &SharedSink<'_>,
        deadline: Instant,
        timer: &metrics::OpTimer,
    ) -> Result<Vec<usize>> {
        let mut t = match self.checkout(unit, deadline).await {
            Ok(t) => t,
            Err(f) => return Err(self.failed_get(unit, f, keys, deadline)),
        };
        match t.get(partition, keys, index_of, sink, deadline).await {
            Ok(miss) => {
                timer.unit_done(&self.metrics, unit);
                let restarted = !miss.is_empty() && self.take_restart(unit);
                self.checkin(unit, t);
                if restarted {
                    let miss: Vec<Key> = miss.into_iter().map(|i| keys[i].clone()).collect();
                    return Err(Error::LostKeys {
                        unit,
                        blobs: vec![],
                        named: error::names(&miss),
                        keys: miss,
                    });
                }
                Ok(miss)
            }
            Err(f) => {
                if f.keeps_connection() {
                    self.checkin(unit, t);
                }
                Err(self.failed_get(unit, f, keys, deadline))
            }
        }
    }

    pub(crate) fn failed_get(
        &self,
        unit: usize,
        f: Failure,
        keys: &[Key],
        deadline: Instant,
    ) -> Error {
        if f.is_busy() {
            return Error::TransferFailed {
                unit,
                blobs: vec![],
                reason: "unit busy".into(),
                in_flight: false,
            };
        }
        self.classify(unit, f, vec![], keys.to_vec(), deadline)
    }

    /// Read `keys` into fresh vectors, in order.
    pub fn get(
        &self,
        partition: &str,
        keys: &[(usize, Key)],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>> {
        let mut sink = VecSink(vec![None; keys.len()]);
        self.get_into(partition, keys, &mut sink, deadline)?;
        Ok(sink.0.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// Read `keys` into [`Value`]s, in order: over nixl each unit's values
    /// land, without a copy, in one buffer of the client's registered
    /// receive pool that the values share ([`Value::Lent`]); over shm and
    /// tcp each is a vector of its own.
    pub fn get_values(
        &self,
        partition: &str,
        keys: &[(usize, Key)],
        deadline: Instant,
    ) -> Result<Vec<Value>> {
        let mut sink = ValueSink((0..keys.len()).map(|_| None).collect());
        self.get_into(partition, keys, &mut sink, deadline)?;
        Ok(sink
            .0
            .into_iter()
            .map(|v| v.unwrap_or(Value::Owned(Vec::new())))
            .collect())
    }

    /// Clear whole rows (each with its unit): one awaited ClearRows per
    /// unit, all units at once. Rows on a dead unit are already gone, so
    /// clearing them succeeds; a live unit that does not answer fails the
    /// call (retryable). Returns the number of entries removed.
    pub fn clear_placed_rows(
        &self,
        partition: &str,
        rows: &[(usize, u64)],
        deadline: Instant,
    ) -> Result<u64> {
        self.timed(metrics::ClientOp::Clear, |_| {
            self.clear_rows_of_units(partition, rows, deadline)
        })
    }

    pub(crate) fn clear_rows_of_units(
        &self,
        partition: &str,
        rows: &[(usize, u64)],
        deadline: Instant,
    ) -> Result<u64> {
        // A unit found gone during the clear places its copies anew (on a
        // unit another client may have put them on already): clear the
        // rows' copies where they are now too.
        let mut removed = 0;
        for _ in 0..=self.units.len() {
            let epoch = self.copies_epoch();
            removed = removed.max(self.clear_copies(partition, rows, deadline)?);
            if self.copies_epoch() == epoch {
                break;
            }
        }
        Ok(removed)
    }

    /// One pass of [`Client::clear_rows_of_units`]: every copy of each row
    /// where the copies are now.
    fn clear_copies(
        &self,
        partition: &str,
        rows: &[(usize, u64)],
        deadline: Instant,
    ) -> Result<u64> {
        // By copy and unit: every copy of each row is cleared
        // (docs/replication.md), each copy's count apart.
        let mut by_unit: BTreeMap<(usize, usize), Vec<u64>> = BTreeMap::new();
        for &(unit, row) in rows {
            if unit >= self.units.len() {
                return Err(Error::InvalidRequest(format!("unit {unit} does not exist")));
            }
            for (copy, u) in self.copies_of(unit).into_iter().enumerate() {
                by_unit.entry((copy, u)).or_default().push(row);
            }
        }
        let copies: Vec<usize> = by_unit.keys().map(|&(c, _)| c).collect();
        let replies = self.call_units(
            by_unit
                .into_iter()
                .map(|((_, u), rows)| {
                    (
                        u,
                        Request::ClearRows {
                            partition: partition.to_owned(),
                            rows,
                        },
                    )
                })
                .collect(),
            deadline,
        );
        // The entries removed: the most any one copy of the rows held (a
        // copy on a dead unit counts none).
        let mut removed = vec![0; self.replicas()];
        for (copy, (unit, r)) in copies.into_iter().zip(replies) {
            match r {
                Ok(Response::Cleared { entries }) => removed[copy] += entries,
                Ok(other) => return Err(unexpected(unit, other)),
                Err(Error::LostKeys { .. }) => {} // a dead unit's rows are gone already
                Err(e) => return Err(e),
            }
        }
        let removed = removed.into_iter().max().unwrap_or(0);
        self.clear_newcomers_again(partition, rows, deadline)?;
        Ok(removed)
    }

    /// Clear the rows again on their newcomers (units that took a copy
    /// after a unit went down), now that every copy was cleared once: a
    /// repair copies a row to a newcomer only while the newcomer has not
    /// seen it cleared since the repair read it, so each clear must reach
    /// the newcomer after the copy the repair reads from
    /// (docs/replication.md#repair).
    fn clear_newcomers_again(
        &self,
        partition: &str,
        rows: &[(usize, u64)],
        deadline: Instant,
    ) -> Result<()> {
        if self.replicas() == 1 {
            return Ok(());
        }
        let mut by_unit: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
        for &(unit, row) in rows {
            for u in self.newcomers_of(unit) {
                by_unit.entry(u).or_default().push(row);
            }
        }
        let reqs = by_unit
            .into_iter()
            .map(|(u, rows)| {
                let partition = partition.to_owned();
                (u, Request::ClearRows { partition, rows })
            })
            .collect();
        for (unit, r) in self.call_units(reqs, deadline) {
            match r {
                Ok(Response::Cleared { .. }) | Err(Error::LostKeys { .. }) => {}
                Ok(other) => return Err(unexpected(unit, other)),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Put raw values by key in the default partition, one blob per unit
    /// (row `r` on unit `r % N`), all units at once.
    pub fn put_rows(&self, values: &[(Key, &[u8])], deadline: Instant) -> Result<()> {
        let mut by_unit: BTreeMap<usize, BlobPut<'_>> = BTreeMap::new();
        let mut sizes: HashMap<usize, u64> = HashMap::new();
        for (key, bytes) in values {
            let unit = self.unit_of_row(key.row);
            let b = by_unit.entry(unit).or_insert_with(|| BlobPut {
                unit,
                partition: DEFAULT_PARTITION,
                blob: new_blob_id(),
                segments: Vec::new(),
                entries: Vec::new(),
            });
            let off = sizes.entry(unit).or_insert(0);
            b.entries.push(EntrySpec {
                key: key.clone(),
                offset: *off,
                len: bytes.len() as u64,
                meta: Vec::new(),
            });
            b.segments.push(bytes);
            *off += bytes.len() as u64;
        }
        let blobs: Vec<BlobPut<'_>> = by_unit.into_values().collect();
        self.put_many(&blobs, deadline)
    }

    /// Get raw values by key from the default partition (row `r` on unit
    /// `r % N`), in order.
    pub fn get_rows(&self, keys: &[Key], deadline: Instant) -> Result<Vec<Vec<u8>>> {
        let placed: Vec<(usize, Key)> = keys
            .iter()
            .map(|k| (self.unit_of_row(k.row), k.clone()))
            .collect();
        self.get(DEFAULT_PARTITION, &placed, deadline)
    }

    /// Clear rows of the default partition (row `r` on unit `r % N`),
    /// named as [`Client::put_rows`] and [`Client::get_rows`] name them, by
    /// their keys, or by their ids ([`RowOf`]). A key clears its whole row,
    /// every field of it.
    pub fn clear_rows<R: RowOf>(&self, rows: &[R], deadline: Instant) -> Result<u64> {
        let placed: Vec<(usize, u64)> = rows
            .iter()
            .map(|r| (self.unit_of_row(r.row()), r.row()))
            .collect();
        self.clear_placed_rows(DEFAULT_PARTITION, &placed, deadline)
    }

    /// One control request to unit `unit`.
    pub(crate) fn call_one(
        &self,
        unit: usize,
        req: Request,
        deadline: Instant,
    ) -> Result<Response> {
        if unit >= self.units.len() {
            return Err(Error::InvalidRequest(format!(
                "no unit {unit}: the client has {}",
                self.units.len()
            )));
        }
        let timer = metrics::OpTimer::start();
        let r = self
            .call_units(vec![(unit, req)], deadline)
            .pop()
            .map(|(_, r)| r)
            .unwrap_or_else(|| Err(Error::Io("no reply".into())));
        self.metrics
            .op(metrics::ClientOp::Control, r.is_ok(), timer.took());
        r
    }

    /// Send one control request per unit and await its reply, all units
    /// at once. The replies in unit order (as `reqs`).
    pub(crate) fn call_units(
        &self,
        reqs: Vec<(usize, Request)>,
        deadline: Instant,
    ) -> Vec<(usize, Result<Response>)> {
        let results = fanout::all_at_once(
            reqs.iter()
                .map(|(unit, req)| self.call_unit(*unit, req, deadline)),
        );
        reqs.iter().map(|(unit, _)| *unit).zip(results).collect()
    }

    /// One unit's part of a control call.
    pub(crate) async fn call_unit(
        &self,
        unit: usize,
        req: &Request,
        deadline: Instant,
    ) -> Result<Response> {
        match self.call_unit_answer(unit, req, deadline).await? {
            Response::Error { code, message } => Err(unit_error(unit, code, message, vec![])),
            r => Ok(r),
        }
    }

    /// [`Client::call_unit`] that gives a unit's refusal back as it came
    /// (`Response::Error`), for a caller that tells its codes apart.
    pub(crate) async fn call_unit_answer(
        &self,
        unit: usize,
        req: &Request,
        deadline: Instant,
    ) -> Result<Response> {
        // Asked again once after a `Stale` refusal, in the view learned.
        let mut stale = false;
        loop {
            let mut t = match self.checkout(unit, deadline).await {
                Ok(t) => t,
                Err(Failure::Refused(ErrorCode::Stale, _)) if !stale => {
                    // The view changed as the connection opened.
                    stale = true;
                    continue;
                }
                Err(f) => return Err(self.failed_get(unit, f, &[], deadline)),
            };
            match t.call(req, deadline).await {
                Ok(Response::Error {
                    code: ErrorCode::Stale,
                    ..
                }) if !stale => {
                    stale = true;
                    self.checkin(unit, t);
                    self.view_refused(unit, deadline);
                }
                Ok(r) => {
                    self.checkin(unit, t);
                    return Ok(r);
                }
                Err(f) => return Err(self.failed_get(unit, f, &[], deadline)),
            }
        }
    }
}

/// A row of the default partition as [`Client::clear_rows`] takes it: its
/// id, or a key of it (the keys [`Client::put_rows`] and
/// [`Client::get_rows`] take; the key's field is not looked at).
pub trait RowOf {
    /// The row's id.
    fn row(&self) -> u64;
}

impl RowOf for u64 {
    fn row(&self) -> u64 {
        *self
    }
}

impl RowOf for Key {
    fn row(&self) -> u64 {
        self.row
    }
}
