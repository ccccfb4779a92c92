//! Views: values read in place in this process's mapping of the units'
//! slabs, pinned on a connection of their own per unit until the view is
//! dropped; and the same values packed a field at a time ([`View::packed`]):
//! the values of one unit's rows back to back, as one range of its slab
//! where a put laid them so (`put.rs`), else copied into one buffer.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;
use stowage_shm::Slab;
use stowage_wire::{Key, PinId, PlacedRef, Request, RequestRef, ResolvedHead, Response, Streamed};

use crate::classify::{name_keys, unexpected, unexpected_found};
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

    /// Elements along the first axis (a 0-d value counts as one).
    fn rows(&self) -> u64 {
        self.shape.first().copied().unwrap_or(1)
    }

    /// Its dimensions past the first.
    fn inner(&self) -> &[u64] {
        self.shape.get(1..).unwrap_or(&[])
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

/// One unit's share of a view's rows ([`View::packed`]): the rows of the
/// call that live on `unit`, in the order of the call, and each field's
/// values of them packed along the first axis.
#[derive(Clone, Debug)]
pub struct PackedChunk {
    pub unit: usize,
    /// Positions in the call's keys.
    pub rows: Vec<usize>,
    /// In the order of the call's fields.
    pub fields: Vec<PackedField>,
}

/// One field's values of a [`PackedChunk`]'s rows, back to back along the
/// first axis: an array of `dtype` and shape `[offsets.last(), inner..]`
/// whose rows `offsets[i]..offsets[i + 1]` are the value of the chunk's
/// row `i` (a 0-d value is one element).
#[derive(Clone, Debug)]
pub struct PackedField {
    pub dtype: DType,
    /// The values' dimensions past the first (the same for every value).
    pub inner: Shape,
    /// `rows + 1` positions along the first axis, from 0.
    pub offsets: Vec<u64>,
    /// Bytes of the packed values.
    pub len: usize,
    /// The unit and slab offset of the values when they lie back to back
    /// in one range of the unit's slab (a view in place); `None`: they
    /// must be copied ([`View::read_packed_into`]).
    in_place: Option<(usize, u64)>,
}

impl PackedField {
    /// Whether the values lie back to back in one range of the unit's
    /// slab ([`View::packed_ptr`] points at them).
    pub fn in_place(&self) -> bool {
        self.in_place.is_some()
    }

    /// The packed array's dimensions.
    pub fn shape(&self) -> Shape {
        let mut s = Shape::new();
        s.push(self.offsets.last().copied().unwrap_or(0));
        s.extend_from_slice(&self.inner);
        s
    }
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

    fn slab(&self, unit: usize) -> Result<&Slab> {
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

    /// The view's rows grouped by the unit that holds them (in unit
    /// order), each field's values of a group packed along the first axis
    /// ([`PackedChunk`]): in place where they lie back to back in one
    /// range of the unit's slab, in the order of the call (as a put of
    /// those rows lays them), else to be copied. Every value of a field
    /// must have the same dtype and the same dimensions past the first;
    /// a field that does not is refused (`InvalidRequest`, naming it).
    /// `names`: the fields' names, for that error.
    pub fn packed(&self, names: &[&str]) -> Result<Vec<PackedChunk>> {
        let nf = self.fields();
        let mut by_unit: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        if nf > 0 {
            for (r, t) in self.field(0).iter().enumerate() {
                by_unit.entry(t.unit).or_default().push(r);
            }
        }
        for f in 0..nf {
            let values = self.field(f);
            if let Some(first) = values.first() {
                if let Some(t) = values
                    .iter()
                    .find(|t| t.dtype != first.dtype || t.inner() != first.inner())
                {
                    let name = names.get(f).copied().unwrap_or("?");
                    return Err(Error::InvalidRequest(format!(
                        "field {name:?} cannot be packed: it holds {} values of dimensions {:?} past the first \
                         and {} values of {:?} (read it with get_view)",
                        first.dtype.name(),
                        first.inner(),
                        t.dtype.name(),
                        t.inner()
                    )));
                }
                // Offsets count rows in a u64 (below, unchecked).
                if values
                    .iter()
                    .try_fold(0u64, |n, t| n.checked_add(t.rows()))
                    .is_none()
                {
                    let name = names.get(f).copied().unwrap_or("?");
                    return Err(Error::InvalidRequest(format!(
                        "field {name:?} cannot be packed: its values' leading dimensions add up past 2^64"
                    )));
                }
            }
        }
        Ok(by_unit
            .into_iter()
            .map(|(unit, rows)| {
                let fields = (0..nf)
                    .map(|f| {
                        let values = self.field(f);
                        let first = &values[rows[0]];
                        let mut offsets = Vec::with_capacity(rows.len() + 1);
                        offsets.push(0u64);
                        let mut at = 0u64;
                        let mut len = 0usize;
                        // Back to back in one range: each value starts where
                        // the one before it ends.
                        let mut next = (!first.is_split()).then_some(first.offset);
                        for &r in &rows {
                            let t = &values[r];
                            at += t.rows();
                            offsets.push(at);
                            len += t.len;
                            next = match next {
                                Some(o)
                                    if !t.is_split() && t.offset == o && t.unit == first.unit =>
                                {
                                    Some(o + t.len as u64)
                                }
                                _ => None,
                            };
                        }
                        PackedField {
                            dtype: first.dtype,
                            inner: first.inner().into(),
                            offsets,
                            len,
                            in_place: next.map(|_| (first.unit, first.offset)),
                        }
                    })
                    .collect();
                PackedChunk { unit, rows, fields }
            })
            .collect())
    }

    /// The address of a packed field's values in place and their length
    /// (see [`View::as_ptr`]); `None` for values to be copied.
    pub fn packed_ptr(&self, p: &PackedField) -> Option<(*const u8, usize)> {
        let (unit, offset) = p.in_place?;
        let slab = self.slab(unit).ok()?;
        slab.range_ptr(offset, p.len).ok().map(|ptr| (ptr, p.len))
    }

    /// Copy field `f` of `chunk` (from this view's [`View::packed`]) into
    /// `dst` (exactly its length): its values back to back.
    pub fn read_packed_into(&self, chunk: &PackedChunk, f: usize, dst: &mut [u8]) -> Result<()> {
        let p = chunk
            .fields
            .get(f)
            .ok_or_else(|| Error::InvalidRequest(format!("no field {f} in the chunk")))?;
        if dst.len() != p.len {
            return Err(Error::InvalidRequest(format!(
                "a buffer of {} bytes for packed values of {}",
                dst.len(),
                p.len
            )));
        }
        let values = self.field(f);
        let mut rest = dst;
        // Gathered per slab: every value of a chunk is on its unit.
        let mut reads: Vec<(u64, &mut [u8])> = Vec::with_capacity(chunk.rows.len());
        let mut unit = None;
        for &r in &chunk.rows {
            let t = values
                .get(r)
                .ok_or_else(|| Error::InvalidRequest(format!("no row {r} in the view")))?;
            if unit.is_some_and(|u| u != t.unit) {
                return Err(Error::InvalidRequest(
                    "a chunk's values on two units".into(),
                ));
            }
            unit = Some(t.unit);
            if t.len > rest.len() {
                // A chunk of another view: its rows do not add up to `p.len`.
                return Err(Error::InvalidRequest(
                    "a chunk whose rows are not this view's".into(),
                ));
            }
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(t.len);
            rest = tail;
            match &t.parts {
                None => reads.push((t.offset, head)),
                Some(parts) => reads
                    .extend(crate::pieces::split_dst(head, parts).map_err(Error::InvalidRequest)?),
            }
        }
        match unit {
            Some(u) => self.slab(u)?.read_scatter(reads).map_err(outside),
            None => Ok(()),
        }
    }
}

fn outside(e: stowage_shm::OutOfBounds) -> Error {
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
struct UnitRows {
    ids: Vec<u64>,
    at: Vec<usize>,
}

impl UnitRows {
    /// The wire keys of its `i`-th value of the unit's answer (field-major).
    fn key(&self, i: usize, fields: &[&str]) -> Key {
        let n = self.ids.len().max(1);
        Key::new(self.ids[i % n], fields[i / n])
    }

    fn keys(&self, fields: &[&str]) -> Vec<Key> {
        (0..self.ids.len() * fields.len())
            .map(|i| self.key(i, fields))
            .collect()
    }
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
        if let Some(c) = lock(&self.units[unit].view_conn).clone() {
            return Ok(c);
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
    /// once, each on its unit's view connection, each found value made a
    /// [`ViewTensor`] in its place of `tensors` (`n`: the call's keys) as
    /// the reply is decoded. The parts lock their connections in unit
    /// order (as every view does: views never wait on each other in a
    /// cycle) and hold them until their answer is in. In unit order.
    // The parts run on this thread (`fanout::all_at_once`): a connection's
    // lock held across a turn waits on no other part of the call, and
    // `tensors` is borrowed by one part at a time, for one value.
    #[allow(
        clippy::type_complexity,
        clippy::await_holding_lock,
        clippy::too_many_arguments
    )]
    fn resolve_views(
        &self,
        partition: &str,
        keys: &[RowKey],
        by_unit: &BTreeMap<usize, UnitRows>,
        fields: &[&str],
        tensors: &RefCell<Vec<ViewTensor>>,
        deadline: Instant,
    ) -> Vec<(
        usize,
        std::result::Result<(Streamed, Arc<Slab>, ViewConn), Failure>,
        Answer,
    )> {
        let n = keys.len();
        let parts = by_unit.iter().map(|(&u, rows)| async move {
            let mut answer = Answer::default();
            let conn = match self.view_conn(u, deadline) {
                Ok(c) => c,
                Err(f) => return (u, Err(f), answer),
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
                        let slab_len = slab.len();
                        let per_field = rows.ids.len();
                        let mut each = |i: usize, v: Option<PlacedRef<'_>>| {
                            if answer.error.is_some() {
                                return;
                            }
                            if i >= per_field * fields.len() {
                                answer.error =
                                    Some(unexpected_found(u, "more values than keys".into()));
                                return;
                            }
                            let (field, j) = (i / per_field, i % per_field);
                            let row = rows.at[j];
                            let Some(p) = v else {
                                answer.missing.push(rows.key(i, fields));
                                return;
                            };
                            if p.on_disk {
                                answer.error = Some(Error::TransferFailed {
                                    unit: u,
                                    blobs: vec![],
                                    reason: format!(
                                        "{} is in the unit's disk tier and its slab has no room to bring it back; \
                                         read it with a copying get",
                                        rows.key(i, fields)
                                    ),
                                    in_flight: false,
                                });
                                return;
                            }
                            let mut tensors = tensors.borrow_mut();
                            let t = &mut tensors[field * n + row];
                            match view_tensor(t, u, p, slab_len, partition, &keys[row]) {
                                Ok(true) => answer.unknown.push(row),
                                Ok(false) => {}
                                Err(e) => answer.error = Some(e),
                            }
                        };
                        t.call_ref_streamed(&req, deadline, &mut each)
                            .await
                            .map(|resp| (resp, slab))
                    }
                }
            };
            match r {
                Ok((resp, slab)) => (u, Ok((resp, slab, conn)), answer),
                Err(f) => {
                    self.forget_view_conn(u, &conn, &f);
                    (u, Err(f), answer)
                }
            }
        });
        crate::fanout::all_at_once(parts)
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
            for f in fields {
                check_field(f)?;
            }
            let mut by_unit: BTreeMap<usize, UnitRows> = BTreeMap::new();
            for (i, k) in keys.iter().enumerate() {
                let id = k.row_id()?;
                let e = by_unit.entry(self.unit_of_key(id, unit)?).or_default();
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
            // Every place is filled as the replies are read: the units'
            // shares of the keys cover them once each, and each share's
            // answer is checked below to hold a value (or a miss) per field
            // of every key.
            let tensors = RefCell::new(vec![ViewTensor::PLACEHOLDER; keys.len() * fields.len()]);
            let resolved =
                self.resolve_views(partition, keys, &by_unit, fields, &tensors, deadline);
            view.tensors = tensors.into_inner();
            // Every pin taken is in `view.pins` before any error returns, so
            // that dropping `view` unpins them all.
            let mut answers = Vec::with_capacity(resolved.len());
            let mut failure = None;
            for (u, r, answer) in resolved {
                match r {
                    Ok((resp, slab, conn)) => {
                        if let Streamed::Resolved(ResolvedHead { pin: Some(p), .. }) = &resp {
                            view.slot_of[u] = view.pins.len();
                            view.pins.push((u, *p, slab, conn));
                        }
                        answers.push((u, resp, answer));
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
            let mut unknown = BTreeSet::new();
            for (u, resp, answer) in answers {
                let rows = &by_unit[&u];
                match resp {
                    Streamed::Resolved(h) if h.found == rows.ids.len() * fields.len() => {
                        if !h.corrupt.is_empty() {
                            let bad: Vec<Key> = h
                                .corrupt
                                .iter()
                                .filter(|&&i| (i as usize) < h.found)
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
                    }
                    Streamed::Resolved(h) => {
                        return Err(unexpected_found(
                            u,
                            format!(
                                "{} values for {} keys",
                                h.found,
                                rows.ids.len() * fields.len()
                            ),
                        ))
                    }
                    Streamed::Other(Response::Error { code, message }) => {
                        return Err(crate::classify::unit_error(u, code, message, vec![]))
                    }
                    Streamed::Other(other) => return Err(unexpected(u, other)),
                }
                // `view` drops on every error return and unpins what was
                // pinned.
                if let Some(e) = answer.error {
                    return Err(e);
                }
                missing.extend(answer.missing);
                unknown.extend(answer.unknown);
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
            self.check_names(partition, keys, &unknown, unit, deadline)?;
            Ok(view)
        })
    }
}

/// What a unit's answer to a view's resolve left besides its values.
#[derive(Default)]
struct Answer {
    /// Keys it does not hold.
    missing: Vec<Key>,
    /// Positions in the call's keys of values put before owners were
    /// recorded (their names are checked after).
    unknown: Vec<usize>,
    /// The first value that cannot be viewed.
    error: Option<Error>,
}

/// A value in memory unit `u` found (and pinned) made `t` (in place:
/// nothing is moved per value), checked: inside the slab of `slab_len`
/// bytes, its metadata readable and making exactly its bytes, put under
/// `key`. Whether it was put before owners were recorded (its name is
/// then checked by the caller).
fn view_tensor(
    t: &mut ViewTensor,
    u: usize,
    f: PlacedRef<'_>,
    slab_len: u64,
    partition: &str,
    key: &RowKey,
) -> Result<bool> {
    crate::pieces::check_place(f.on_disk, f.offset, f.len, &f.parts, slab_len)
        .map_err(|m| unexpected_found(u, m))?;
    let (dtype, owner) = decode_meta_into(f.meta, &mut t.shape).map_err(Error::InvalidRequest)?;
    let unknown = match ownership(key, owner) {
        Ownership::Mine => false,
        Ownership::Unknown => true,
        Ownership::Other(stored) => return Err(collision(partition, key, stored)),
    };
    t.len = usize::try_from(f.len)
        .map_err(|_| Error::InvalidRequest("value larger than memory".into()))?;
    if dtype.nbytes(&t.shape) != Some(f.len) {
        return Err(unexpected_found(
            u,
            format!(
                "{} bytes do not make a {} {:?} value",
                f.len,
                dtype.name(),
                &t.shape[..]
            ),
        ));
    }
    t.dtype = dtype;
    t.unit = u;
    t.offset = f.offset;
    t.parts = (!f.parts.is_empty()).then(|| f.parts.into_boxed_slice());
    Ok(unknown)
}
