//! Views: values read in place in this process's mapping of the units'
//! slabs, pinned on a connection of their own per unit until the view is
//! dropped. A view's rows are resolved per unit in one request naming each
//! row and field once, answered in columns (`ResolveRows`,
//! `ResolvedRows`); `packed.rs` packs the same answers a field at a time.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;
use stowage_shm::Slab;
use stowage_wire::{Key, PinId, Request, RequestRef, Response, RowValue, RowsResolved};

use crate::classify::{name_keys, unexpected, unexpected_found};
use crate::copies::next_copy_may_serve;
use crate::failure::Failure;
use crate::pool::ViewConn;
use crate::row_meta::{check_field, collision, decode_meta_into, ownership, Ownership};
use crate::values::{DType, RowKey};
use crate::{lock, Client, Error, Result};

/// A value's dimensions: inline up to four (no allocation per value of a
/// view of thousands).
pub type Shape = SmallVec<[u64; 4]>;

/// A view's value: read-only bytes in this process's mapping of a unit's
/// slab, valid while its [`View`] lives. A value the unit stored split
/// across pieces of its slab ([`ViewTensor::is_split`]) is not one range
/// of the mapping: it is read with [`View::read_into`] (a copy) instead.
#[derive(Clone, Debug)]
pub struct ViewTensor {
    pub dtype: DType,
    /// Its dimensions; they make exactly [`ViewTensor::len`] bytes of
    /// `dtype` (the view checks).
    pub shape: Shape,
    unit: usize,
    offset: u64,
    len: usize,
    /// (slab offset, bytes) of each part of a split value, in order;
    /// `None` for a value in one range (boxed: a view holds thousands).
    parts: Option<Box<[(u64, u64)]>>,
}

impl ViewTensor {
    /// What a view's places hold until their values are in.
    const PLACEHOLDER: ViewTensor = ViewTensor {
        dtype: DType::U8,
        shape: SmallVec::new_const(),
        unit: 0,
        offset: 0,
        len: 0,
        parts: None,
    };

    /// Whether the value lies in several ranges of its unit's slab (it
    /// was stored across pieces): no pointer can view it in place.
    pub fn is_split(&self) -> bool {
        self.parts.is_some()
    }

    /// The value's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The unit that holds the value.
    pub fn unit(&self) -> usize {
        self.unit
    }
}

/// Zero-copy access to values in the units' slabs (same host only). The
/// values stay pinned — neither moved, freed nor overwritten, even if
/// their rows are cleared or replaced — until the view is dropped.
pub struct View {
    client: Arc<Client>,
    /// (unit, pin, slab, the connection that holds the pin) of every unit
    /// that pinned something. The view keeps that connection open for as
    /// long as it lives: the unit releases a connection's pins only when
    /// the connection ends, and nothing else can end it.
    pins: Vec<(usize, PinId, Arc<Slab>, ViewConn)>,
    /// Unit `u`'s place in `pins` (`usize::MAX`: none).
    slot_of: Vec<usize>,
    /// Field-major: field `f` of the call's row `r` is `tensors[f * rows + r]`.
    tensors: Vec<ViewTensor>,
    rows: usize,
    fields: usize,
}

impl View {
    /// How many fields the call asked for.
    pub fn fields(&self) -> usize {
        self.fields
    }

    /// How many keys the call asked for.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Field `f`'s values, in the order of the call's keys.
    pub fn field(&self, f: usize) -> &[ViewTensor] {
        let n = self.rows;
        self.tensors.get(f * n..(f + 1) * n).unwrap_or(&[])
    }

    pub(crate) fn slab(&self, unit: usize) -> Result<&Slab> {
        self.slot_of
            .get(unit)
            .and_then(|&slot| self.pins.get(slot))
            .map(|(_, _, slab, _)| &**slab)
            .ok_or_else(|| Error::InvalidRequest("the value's unit is not in this view".into()))
    }

    /// The address of a value of this view in this process's mapping of
    /// its unit's slab, and its length: valid (and unchanging) while the
    /// view lives. For zero-copy consumers (numpy arrays that keep the
    /// view alive); reading through it is the consumer's `unsafe`. `None`
    /// for a split value ([`ViewTensor::is_split`]: not one range; copy it
    /// with [`View::read_into`]).
    pub fn as_ptr(&self, t: &ViewTensor) -> Option<(*const u8, usize)> {
        if t.is_split() {
            return None;
        }
        let slab = self.slab(t.unit).ok()?;
        slab.range_ptr(t.offset, t.len).ok().map(|p| (p, t.len))
    }

    /// Copy a value of this view into `dst` (exactly its length): a value
    /// in one range, or a split value's parts back to back.
    pub fn read_into(&self, t: &ViewTensor, dst: &mut [u8]) -> Result<()> {
        let slab = self.slab(t.unit)?;
        if dst.len() != t.len {
            return Err(Error::InvalidRequest(format!(
                "a buffer of {} bytes for a value of {}",
                dst.len(),
                t.len
            )));
        }
        let Some(parts) = &t.parts else {
            return slab.read(t.offset, dst).map_err(outside);
        };
        let reads = crate::pieces::split_dst(dst, parts).map_err(Error::InvalidRequest)?;
        slab.read_scatter(reads).map_err(outside)
    }

    /// A copy of a value of this view (empty if it cannot be read).
    pub fn to_vec(&self, t: &ViewTensor) -> Vec<u8> {
        let mut out = vec![0u8; t.len];
        if self.read_into(t, &mut out).is_err() {
            out.clear();
        }
        out
    }
}

pub(crate) fn outside(e: stowage_shm::OutOfBounds) -> Error {
    Error::InvalidRequest(format!("the value lies outside its unit's slab: {e}"))
}

impl Drop for View {
    fn drop(&mut self) {
        let deadline = self.client.deadline();
        for (unit, pin, _, conn) in self.pins.drain(..) {
            if let Some(slot) = self.client.units.get(unit) {
                *lock(&slot.unpinned_on) = Some(Arc::downgrade(&conn));
            }
            let req = Request::Unpin { pin, reply: false };
            // If the unit or the connection is gone, so is the pin (the
            // connection's end released it); nothing to report.
            let _ = lock(&conn).notify(&req, deadline);
        }
    }
}

/// One unit's share of a view call: the row ids it holds and their
/// positions in the call's keys.
#[derive(Default)]
pub(crate) struct UnitRows {
    pub(crate) ids: Vec<u64>,
    pub(crate) at: Vec<usize>,
}

impl UnitRows {
    /// The wire keys of its `i`-th value of the unit's answer (field-major).
    pub(crate) fn key(&self, i: usize, fields: &[&str]) -> Key {
        let n = self.ids.len().max(1);
        Key::new(self.ids[i % n], fields[i / n])
    }

    fn keys(&self, fields: &[&str]) -> Vec<Key> {
        (0..self.ids.len() * fields.len())
            .map(|i| self.key(i, fields))
            .collect()
    }
}

/// A view's resolve, answered, pinned and checked: the view (its pins;
/// no values yet), and per unit that holds some of the keys (in unit
/// order) its rows and its answer, every value of which was found in
/// memory.
pub(crate) struct Resolution {
    pub(crate) view: View,
    pub(crate) parts: Vec<(usize, UnitRows, Box<RowsResolved>)>,
}

impl Client {
    /// Unit `unit`'s view connection (opened on first use): the one
    /// connection per unit whose held pins back [`View`]s, kept for the
    /// client's life so that those pins are not dropped with a pooled
    /// connection.
    fn view_conn(
        &self,
        unit: usize,
        deadline: Instant,
    ) -> std::result::Result<crate::pool::ViewConn, Failure> {
        let kept = lock(&self.units[unit].view_conn).clone();
        if let Some(c) = kept {
            // One of an older view of the plane is not used for later views
            // (those that pinned through it keep it). Its lock is taken
            // without the slot's, as a view's part takes them.
            if lock(&c).epoch() == self.plane_epoch() {
                return Ok(c);
            }
            let mut slot = lock(&self.units[unit].view_conn);
            if slot.as_ref().is_some_and(|s| Arc::ptr_eq(s, &c)) {
                *slot = None;
            }
        }
        // Opened without the slot's lock held: opening may meet a restarted
        // unit, which clears the slot.
        let fresh: crate::pool::ViewConn =
            Arc::new(std::sync::Mutex::new(self.open(unit, deadline)?));
        let mut slot = lock(&self.units[unit].view_conn);
        Ok(slot.get_or_insert(fresh).clone())
    }

    /// After `f` failed on `conn`: a broken connection is not used for later
    /// views; views that pinned through it keep it (and their pins) alive.
    pub(crate) fn forget_view_conn(&self, unit: usize, conn: &crate::pool::ViewConn, f: &Failure) {
        if f.is_connection() {
            let mut slot = lock(&self.units[unit].view_conn);
            if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                *slot = None;
            }
        }
    }

    /// Resolve-and-hold every field of `by_unit`'s rows on every unit at
    /// once, each on its unit's view connection (a ResolveRows, answered
    /// in columns). The parts lock their connections in unit order (as
    /// every view does: views never wait on each other in a cycle) and
    /// hold them until their answer is in. In unit order.
    // The parts run on this thread (`fanout::all_at_once`): a connection's
    // lock held across a turn waits on no other part of the call.
    #[allow(clippy::type_complexity, clippy::await_holding_lock)]
    fn resolve_views(
        &self,
        partition: &str,
        by_unit: &BTreeMap<usize, UnitRows>,
        fields: &[&str],
        deadline: Instant,
    ) -> Vec<(
        usize,
        std::result::Result<(Response, Arc<Slab>, ViewConn), Failure>,
    )> {
        let parts = by_unit.iter().map(|(&u, rows)| async move {
            let conn = match self.view_conn(u, deadline) {
                Ok(c) => c,
                Err(f) => return (u, Err(f)),
            };
            let r = {
                let mut t = lock(&conn);
                match t.slab() {
                    None => Err(Failure::invalid(
                        "views need the shm transport (a unit on this host, reached by its Unix socket)",
                    )),
                    Some(slab) => {
                        let req = RequestRef::ResolveRows {
                            partition,
                            rows: &rows.ids,
                            fields,
                            hold: true,
                        };
                        t.call_ref(&req, deadline).await.map(|resp| (resp, slab))
                    }
                }
            };
            match r {
                Ok((resp, slab)) => (u, Ok((resp, slab, conn))),
                Err(f) => {
                    self.forget_view_conn(u, &conn, &f);
                    (u, Err(f))
                }
            }
        });
        crate::fanout::all_at_once(parts)
    }

    /// Pin `fields` of `keys` on the units that hold them and check their
    /// answers ([`Resolution`]): a value not found, corrupt, or only on
    /// disk fails the call (the view it made unpins as it drops). With
    /// copies ([`crate::ClientConfig::replicas`]) a view that one copy
    /// cannot give (its unit gone or not answering, a value it lacks)
    /// pins the next copy of every row instead: a view pins, and maps,
    /// one copy of each value.
    pub(crate) fn resolve_rows(
        self: &Arc<Self>,
        partition: &str,
        keys: &[RowKey],
        fields: &[&str],
        unit: Option<usize>,
        deadline: Instant,
    ) -> Result<Resolution> {
        if self.replicas() == 1 {
            return self.resolve_copy(partition, keys, fields, deadline, |_, id| {
                self.unit_of_key(id, unit)
            });
        }
        // A unit found gone during the call places its copies anew: rows
        // not found or lost are looked for where their copies are now.
        self.read_again_where_copies_are(deadline, || {
            self.resolve_copies(partition, keys, fields, unit, deadline)
        })
    }

    /// One pass of [`Client::resolve_rows`] with copies: each row on the
    /// first of its copies that gives it.
    fn resolve_copies(
        self: &Arc<Self>,
        partition: &str,
        keys: &[RowKey],
        fields: &[&str],
        unit: Option<usize>,
        deadline: Instant,
    ) -> Result<Resolution> {
        // The copy each row is asked of, in its read order: every row
        // starts at the first and goes on to the next when the unit it
        // was asked of is gone, does not answer, or lacks it.
        let orders = keys
            .iter()
            .map(|k| Ok(self.read_order(self.unit_of_key(k.row_id()?, unit)?)))
            .collect::<Result<Vec<_>>>()?;
        let mut copy_of = vec![0usize; keys.len()];
        let mut not_found = None;
        loop {
            let tried = copy_of.iter().copied().max().unwrap_or(0);
            let at = self.copy_deadline(deadline, tried);
            let asked = |i: usize, _| Ok(orders[i][copy_of[i]]);
            let e = match self.resolve_copy(partition, keys, fields, at, asked) {
                Ok(r) => return Ok(r),
                Err(e) => e,
            };
            // The rows the failure names: those not found, or those asked
            // of the unit that failed.
            let failed: Vec<usize> = match &e {
                Error::NotFound { keys: missing, .. } => {
                    let rows: BTreeSet<u64> = missing.iter().map(|k| k.row).collect();
                    (0..keys.len())
                        .filter(|&i| keys[i].row_id().is_ok_and(|id| rows.contains(&id)))
                        .collect()
                }
                e if next_copy_may_serve(e) => match e.unit() {
                    Some(u) => {
                        self.suspect(u);
                        (0..keys.len())
                            .filter(|&i| orders[i][copy_of[i]] == u)
                            .collect()
                    }
                    None => Vec::new(),
                },
                _ => Vec::new(),
            };
            let last = failed.iter().any(|&i| copy_of[i] + 1 >= orders[i].len());
            if failed.is_empty() || last {
                // No copy is left for some row: what the copies that
                // answered said (not found) stands over a lost unit.
                return Err(match (e, not_found) {
                    (e, Some(nf)) if next_copy_may_serve(&e) => nf,
                    (e, _) => e,
                });
            }
            if matches!(e, Error::NotFound { .. }) {
                not_found = Some(e);
            }
            for i in failed {
                copy_of[i] += 1;
            }
        }
    }

    /// [`Client::resolve_rows`] of each row `keys[i]` (row id `id`) on
    /// unit `unit_for(i, id)`.
    fn resolve_copy(
        self: &Arc<Self>,
        partition: &str,
        keys: &[RowKey],
        fields: &[&str],
        deadline: Instant,
        unit_for: impl Fn(usize, u64) -> Result<usize>,
    ) -> Result<Resolution> {
        for f in fields {
            check_field(f)?;
        }
        let mut by_unit: BTreeMap<usize, UnitRows> = BTreeMap::new();
        for (i, k) in keys.iter().enumerate() {
            let id = k.row_id()?;
            let e = by_unit.entry(unit_for(i, id)?).or_default();
            e.ids.push(id);
            e.at.push(i);
        }
        let mut view = View {
            client: self.clone(),
            pins: Vec::new(),
            slot_of: vec![usize::MAX; self.units.len()],
            tensors: Vec::new(),
            rows: keys.len(),
            fields: fields.len(),
        };
        // Every pin taken is in `view.pins` before any error returns, so
        // that dropping `view` unpins them all.
        let mut answers = Vec::with_capacity(by_unit.len());
        let mut failure = None;
        for (u, r) in self.resolve_views(partition, &by_unit, fields, deadline) {
            match r {
                Ok((resp, slab, conn)) => {
                    if let Response::ResolvedRows(r) = &resp {
                        if let Some(p) = r.pin {
                            view.slot_of[u] = view.pins.len();
                            view.pins.push((u, p, slab, conn));
                        }
                    }
                    answers.push((u, resp));
                }
                Err(f) => {
                    failure.get_or_insert((u, f));
                }
            }
        }
        if let Some((u, f)) = failure {
            if f.is_busy() {
                return Err(Error::Timeout {
                    unit: Some(u),
                    what: "unit busy".into(),
                });
            }
            let ks = by_unit[&u].keys(fields);
            return Err(name_keys(self.classify(u, f, vec![], ks, deadline), keys));
        }
        let mut missing = Vec::new();
        let mut parts = Vec::with_capacity(answers.len());
        for (u, resp) in answers {
            let rows = by_unit.remove(&u).unwrap_or_default();
            let r = match resp {
                Response::ResolvedRows(r) => r,
                Response::Error { code, message } => {
                    return Err(crate::classify::unit_error(u, code, message, vec![]))
                }
                other => return Err(unexpected(u, other)),
            };
            let n = rows.ids.len() * fields.len();
            if r.n as usize != n {
                return Err(unexpected_found(u, format!("{} values for {n} keys", r.n)));
            }
            if let Err(m) = r.values() {
                return Err(unexpected_found(u, m));
            }
            if !r.corrupt.is_empty() {
                let bad: Vec<Key> = r
                    .corrupt
                    .iter()
                    .map(|&i| rows.key(i as usize, fields))
                    .collect();
                let named = crate::error::names(&bad);
                return Err(name_keys(
                    Error::Corrupt {
                        unit: u,
                        keys: bad,
                        named,
                    },
                    keys,
                ));
            }
            if let Some(&i) = r.on_disk.first() {
                return Err(Error::TransferFailed {
                    unit: u,
                    blobs: vec![],
                    reason: format!(
                        "{} is in the unit's disk tier and its slab has no room to bring it back; \
                         read it with a copying get",
                        rows.key(i as usize, fields)
                    ),
                    in_flight: false,
                });
            }
            missing.extend(r.missing.iter().map(|&i| rows.key(i as usize, fields)));
            parts.push((u, rows, r));
        }
        if !missing.is_empty() {
            let named = crate::error::names(&missing);
            return Err(name_keys(
                Error::NotFound {
                    keys: missing,
                    named,
                },
                keys,
            ));
        }
        Ok(Resolution { view, parts })
    }

    /// Pin `fields` of `keys` and view them in place (shm transport only):
    /// no bytes are copied. See [`View`].
    pub fn view(
        self: &Arc<Self>,
        partition: &str,
        keys: &[RowKey],
        fields: &[&str],
        unit: Option<usize>,
        deadline: Instant,
    ) -> Result<View> {
        self.timed(crate::metrics::ClientOp::View, |_| {
            let Resolution { mut view, parts } =
                self.resolve_rows(partition, keys, fields, unit, deadline)?;
            let n = keys.len();
            let mut tensors = vec![ViewTensor::PLACEHOLDER; n * fields.len()];
            let mut unknown = BTreeSet::new();
            for (u, rows, r) in parts.iter().filter(|(_, _, r)| r.n > 0) {
                let slab_len = view.slab(*u)?.len();
                let split = r.split_parts();
                let per_field = rows.ids.len();
                // Checked by resolve_rows.
                let values = r.values().map_err(|m| unexpected_found(*u, m))?;
                for (i, v) in values.enumerate() {
                    let (f, row) = (i / per_field, rows.at[i % per_field]);
                    let parts = split.get(&(i as u32)).copied();
                    let t = &mut tensors[f * n + row];
                    if view_tensor(t, *u, v, parts, slab_len, partition, &keys[row])? {
                        unknown.insert(row);
                    }
                }
            }
            view.tensors = tensors;
            self.check_names(partition, keys, &unknown, unit, deadline)?;
            Ok(view)
        })
    }
}

/// The metadata of a value unit `u` found (and pinned) in memory,
/// checked: the value inside the slab of `slab_len` bytes (as one range,
/// or as `parts`), its metadata readable and making exactly its bytes,
/// put under `key`. Its dtype (its dimensions into `shape`), and whether
/// it was put before owners were recorded (its name is then checked by
/// the caller).
pub(crate) fn value_meta(
    u: usize,
    v: RowValue<'_>,
    parts: Option<&[(u64, u64)]>,
    slab_len: u64,
    partition: &str,
    key: &RowKey,
    shape: &mut Shape,
) -> Result<(DType, bool)> {
    crate::pieces::check_place(false, v.offset, v.len, parts.unwrap_or(&[]), slab_len)
        .map_err(|m| unexpected_found(u, m))?;
    let (dtype, owner) = decode_meta_into(v.meta, shape).map_err(Error::InvalidRequest)?;
    let unknown = match ownership(key, owner) {
        Ownership::Mine => false,
        Ownership::Unknown => true,
        Ownership::Other(stored) => return Err(collision(partition, key, stored)),
    };
    if dtype.nbytes(shape) != Some(v.len) {
        return Err(unexpected_found(
            u,
            format!(
                "{} bytes do not make a {} {:?} value",
                v.len,
                dtype.name(),
                &shape[..]
            ),
        ));
    }
    Ok((dtype, unknown))
}

/// A found value made `t` (in place: nothing is moved per value), checked
/// ([`value_meta`]). Whether its name is to be checked.
fn view_tensor(
    t: &mut ViewTensor,
    u: usize,
    v: RowValue<'_>,
    parts: Option<&[(u64, u64)]>,
    slab_len: u64,
    partition: &str,
    key: &RowKey,
) -> Result<bool> {
    let (dtype, unknown) = value_meta(u, v, parts, slab_len, partition, key, &mut t.shape)?;
    t.len = usize::try_from(v.len)
        .map_err(|_| Error::InvalidRequest("value larger than memory".into()))?;
    t.dtype = dtype;
    t.unit = u;
    t.offset = v.offset;
    t.parts = parts.map(Box::from);
    Ok(unknown)
}
