//! Views: values read in place in this process's mapping of the units'
//! slabs, pinned on a connection of their own per unit until the view is
//! dropped.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use stowage_shm::Slab;
use stowage_wire::{Key, Request, RequestRef, Response};

use crate::classify::{name_keys, unexpected, unexpected_found};
use crate::failure::Failure;
use crate::row_meta::{collision, decode_meta, ownership, Ownership};
use crate::values::{DType, RowKey};
use crate::{lock, Client, Error, Result};

/// A view's value: read-only bytes in this process's mapping of a unit's
/// slab, valid while its [`View`] lives. A value the unit stored split
/// across pieces of its slab ([`ViewTensor::is_split`]) is not one range
/// of the mapping: it is read with [`View::read_into`] (a copy) instead.
#[derive(Clone, Debug)]
pub struct ViewTensor {
    pub dtype: DType,
    pub shape: Vec<u64>,
    unit: usize,
    offset: u64,
    len: usize,
    /// (slab offset, bytes) of each part of a split value, in order;
    /// empty for a value in one range.
    parts: Vec<(u64, u64)>,
}

impl ViewTensor {
    /// Whether the value lies in several ranges of its unit's slab (it
    /// was stored across pieces): no pointer can view it in place.
    pub fn is_split(&self) -> bool {
        !self.parts.is_empty()
    }

    /// The value's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
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
    pins: Vec<(usize, stowage_wire::PinId, Arc<Slab>, crate::pool::ViewConn)>,
    tensors: Vec<Vec<ViewTensor>>,
}

impl View {
    /// `[field][row]`, in the order of the call.
    pub fn tensors(&self) -> &[Vec<ViewTensor>] {
        &self.tensors
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
        let (_, _, slab, _) = self.pins.iter().find(|(u, ..)| *u == t.unit)?;
        slab.range_ptr(t.offset, t.len).ok().map(|p| (p, t.len))
    }

    /// Copy a value of this view into `dst` (exactly its length): a value
    /// in one range, or a split value's parts back to back.
    pub fn read_into(&self, t: &ViewTensor, dst: &mut [u8]) -> Result<()> {
        let (_, _, slab, _) = self
            .pins
            .iter()
            .find(|(u, ..)| *u == t.unit)
            .ok_or_else(|| Error::InvalidRequest("the value's unit is not in this view".into()))?;
        if dst.len() != t.len {
            return Err(Error::InvalidRequest(format!(
                "a buffer of {} bytes for a value of {}",
                dst.len(),
                t.len
            )));
        }
        let outside = |e: stowage_shm::OutOfBounds| {
            Error::InvalidRequest(format!("the value lies outside its unit's slab: {e}"))
        };
        if t.parts.is_empty() {
            return slab.read(t.offset, dst).map_err(outside);
        }
        let reads = crate::pieces::split_dst(dst, &t.parts).map_err(Error::InvalidRequest)?;
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

impl Drop for View {
    fn drop(&mut self) {
        let deadline = self.client.deadline();
        for (_, pin, _, conn) in self.pins.drain(..) {
            let req = Request::Unpin { pin, reply: false };
            // If the unit or the connection is gone, so is the pin (the
            // connection's end released it); nothing to report.
            let _ = lock(&conn).notify(&req, deadline);
        }
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
    fn forget_view_conn(&self, unit: usize, conn: &crate::pool::ViewConn, f: &Failure) {
        if f.is_connection() {
            let mut slot = lock(&self.units[unit].view_conn);
            if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                *slot = None;
            }
        }
    }

    /// Resolve-and-hold `by_unit`'s keys on every unit at once, each on
    /// its unit's view connection. The parts lock their connections in
    /// unit order (as every view does: views never wait on each other in
    /// a cycle) and hold them until their answer is in. In unit order.
    // The parts run on this thread (`fanout::all_at_once`): a connection's
    // lock held across a turn waits on no other part of the call.
    #[allow(clippy::type_complexity, clippy::await_holding_lock)]
    fn resolve_views(
        &self,
        partition: &str,
        by_unit: &BTreeMap<usize, (Vec<Key>, Vec<usize>)>,
        deadline: Instant,
    ) -> Vec<(
        usize,
        std::result::Result<(Response, Arc<Slab>, crate::pool::ViewConn), Failure>,
    )> {
        let parts = by_unit.iter().map(|(&u, (keys, _))| async move {
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
                        let req = RequestRef::Resolve {
                            partition,
                            keys,
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
            let placed = self.place(keys, fields, unit)?;
            let mut by_unit: BTreeMap<usize, (Vec<Key>, Vec<usize>)> = BTreeMap::new();
            for (i, (u, k)) in placed.into_iter().enumerate() {
                let e = by_unit.entry(u).or_default();
                e.0.push(k);
                e.1.push(i);
            }
            let mut view = View {
                client: self.clone(),
                pins: Vec::new(),
                tensors: Vec::new(),
            };
            let mut flat: Vec<Option<ViewTensor>> = vec![None; keys.len() * fields.len()];
            let mut missing = Vec::new();
            let mut unknown = BTreeSet::new();
            let resolved = self.resolve_views(partition, &by_unit, deadline);
            // Every pin taken is in `view.pins` before any error returns, so
            // that dropping `view` unpins them all.
            let mut answers = Vec::with_capacity(resolved.len());
            let mut failure = None;
            for (u, r) in resolved {
                match r {
                    Ok((resp, slab, conn)) => {
                        if let Response::Resolved { pin: Some(p), .. } = &resp {
                            view.pins.push((u, *p, slab.clone(), conn.clone()));
                        }
                        answers.push((u, resp, slab.len()));
                    }
                    Err(f) => {
                        failure.get_or_insert((u, f));
                    }
                }
            }
            if let Some((u, f)) = failure {
                let ks = by_unit[&u].0.clone();
                if f.is_busy() {
                    return Err(Error::Timeout {
                        unit: Some(u),
                        what: "unit busy".into(),
                    });
                }
                return Err(name_keys(self.classify(u, f, vec![], ks, deadline), keys));
            }
            for (u, resp, slab_len) in answers {
                let (ks, idx) = &by_unit[&u];
                let found = match resp {
                    Response::Resolved { found, corrupt, .. } if found.len() == ks.len() => {
                        if !corrupt.is_empty() {
                            let bad: Vec<Key> = corrupt
                                .iter()
                                .filter_map(|&i| ks.get(i as usize).cloned())
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
                        found
                    }
                    Response::Error { code, message } => {
                        return Err(crate::classify::unit_error(u, code, message, vec![]))
                    }
                    other => return Err(unexpected(u, other)),
                };
                for ((f, &i), k) in found.into_iter().zip(idx).zip(ks) {
                    match f {
                        None => missing.push(k.clone()),
                        Some(f) if f.on_disk => {
                            return Err(Error::TransferFailed {
                                unit: u,
                                blobs: vec![],
                                reason: format!(
                                    "{k} is in the unit's disk tier and its slab has no room to bring it back; \
                                     read it with a copying get"
                                ),
                                in_flight: false,
                            })
                        }
                        Some(f) => {
                            // `view` drops here and unpins what was pinned.
                            crate::pieces::check_found(&f, slab_len)
                                .map_err(|m| unexpected_found(u, m))?;
                            let (m, owner) = decode_meta(&f.meta).map_err(Error::InvalidRequest)?;
                            let row = i % keys.len();
                            match ownership(&keys[row], owner) {
                                Ownership::Mine => {}
                                Ownership::Unknown => {
                                    unknown.insert(row);
                                }
                                // `view` drops here and unpins what was pinned.
                                Ownership::Other(stored) => {
                                    return Err(collision(partition, &keys[row], stored))
                                }
                            }
                            let len = usize::try_from(f.len).map_err(|_| {
                                Error::InvalidRequest("value larger than memory".into())
                            })?;
                            flat[i] = Some(ViewTensor {
                                dtype: m.dtype,
                                shape: m.shape,
                                unit: u,
                                offset: f.offset,
                                len,
                                parts: f.parts,
                            });
                        }
                    }
                }
            }
            if !missing.is_empty() {
                // `view` drops here and unpins what was pinned.
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
            let mut it = flat.into_iter();
            view.tensors = (0..fields.len())
                .map(|_| {
                    it.by_ref()
                        .take(keys.len())
                        .map(|t| {
                            t.ok_or_else(|| {
                                Error::InvalidRequest("a unit did not answer for a key".into())
                            })
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<_>>()?;
            Ok(view)
        })
    }
}
