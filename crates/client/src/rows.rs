//! The rows × fields API: what RL frameworks call.
//!
//! A **partition** (e.g. one RL step) holds **rows**, each named by a
//! [`RowKey`] — an integer index or a user string such as `"uid_g3"` — and
//! each row holds **fields** (`input_ids`, `generation_logprobs`, …) whose
//! values are typed, shaped [`Tensor`]s of their own length.
//!
//! Mapping onto the blob API:
//!
//! * A row's id on the wire is its index, or for a string key the xxh3 hash
//!   of the string with the top bit set (indexes must stay below 2^63, so
//!   the two never meet). The row lives on unit `id % N` unless the caller
//!   names a unit (then it must name the same unit to read or clear it).
//! * A string key's text is stored once per put as the row's reserved field
//!   [`KEY_FIELD`], so that [`Client::list`] can give the names back.
//! * Each value's dtype and shape travel as the entry's metadata. A unit's
//!   blob holds its rows' values field by field: a field's values back to
//!   back in the order of the call, the first on a 64-byte boundary of the
//!   blob, each at a multiple of its dtype's size — so a zero-copy view of
//!   any dtype is aligned, and a packed view ([`Client::packed_view`](crate::Client::packed_view)) of those
//!   rows is one range of the slab per field (unless the unit stored the
//!   blob in pieces).
//! * One put sends one blob per unit, all units at once; writing a
//!   (key, field) again replaces it atomically (the unit swaps the index
//!   entry at commit; readers that pinned the old value keep it).
//!
//! # String keys whose hashes collide
//!
//! Two names with the same 63-bit hash share a row id. They are told apart,
//! never aliased: every value of a string-keyed row carries in its metadata
//! the name it was put under (a name longer than [`MAX_TAGGED_NAME`] bytes:
//! its 128-bit digest, seeded apart from the row id's hash). Every read —
//! [`Client::get_tensors_into`], [`Client::get_tensors`], [`Client::view`]
//! — compares each value's owner with the name asked for, and on a
//! mismatch fails with [`Error::KeyCollision`] before any of that value's
//! bytes reach the caller. Hence a get never returns another name's
//! values, and after a put of a name B that collides with A, A's values
//! never read back as B's (nor B's as A's): each read either returns the
//! asker's own values or fails naming both names.
//!
//! A put does not look before it writes: that would take a second round
//! trip per put (the budget is one per unit), and without a conditional
//! commit on the unit it would still race with another client's put. So a
//! colliding put succeeds and replaces the other name's values of the same
//! fields; the loss is reported, naming both, by the next read of them.
//! Two colliding names in one put are refused before anything is sent.
//! Not covered by the tags: [`Client::clear`] of either name clears the
//! shared row, and [`Client::list`] names it after the last name put.
//!
//! Values put before owners were recorded carry none. For those a read
//! compares the row's [`KEY_FIELD`] with the name asked for, in one more
//! read made only when such a value is met (the values may then already
//! be in the caller's buffers when the error is returned).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use stowage_wire::Key;
use stowage_wire::{Request, Response};

use crate::classify::{name_keys, unexpected};
pub use crate::packed::{PackedChunk, PackedField};
use crate::row_meta::UNIT_FIELD_PREFIX;
use crate::row_meta::{check_field, collision, decode_meta, ownership, Ownership, ValueMeta};
pub use crate::row_meta::{KEY_FIELD, MAX_TAGGED_NAME};
use crate::sink::{Sink, TensorAsk, TensorSink, ValueAsk};
use crate::values::{byte_len, NAME_BIT};
pub use crate::values::{Column, DType, OwnedTensor, RowKey, Tensor};
pub use crate::views::{Shape, View, ViewTensor};
use crate::{Client, Error, Result};

impl Client {
    /// Read `fields` of `keys` from `partition` into the buffers `sink`
    /// hands out. A missing (key, field) fails the call with
    /// [`Error::NotFound`] naming every missing pair.
    pub fn get_tensors_into(
        &self,
        partition: &str,
        keys: &[RowKey],
        fields: &[&str],
        unit: Option<usize>,
        sink: &mut dyn TensorSink,
        deadline: Instant,
    ) -> Result<()> {
        let placed = self.place(keys, fields, unit)?;
        struct Adapter<'s> {
            sink: &'s mut dyn TensorSink,
            keys: &'s [RowKey],
            /// The first value found to be another name's: (row, its name).
            collision: Option<(usize, Option<String>)>,
            /// Rows with values of unknown owner.
            unknown: BTreeSet<usize>,
        }
        impl Adapter<'_> {
            /// The value's dtype and shape, once its size and owner check out.
            fn check(
                &mut self,
                ask: ValueAsk<'_>,
            ) -> std::result::Result<(usize, usize, ValueMeta), String> {
                let ValueAsk { index, len, meta } = ask;
                let (m, owner) = decode_meta(meta)?;
                let want = byte_len(m.dtype, &m.shape).map_err(|e| e.to_string())?;
                if want != len {
                    return Err(format!(
                        "stored value has {len} bytes but its shape {:?} of {} needs {want}",
                        m.shape,
                        m.dtype.name()
                    ));
                }
                let (field, row) = (index / self.keys.len(), index % self.keys.len());
                match ownership(&self.keys[row], owner) {
                    Ownership::Mine => {}
                    Ownership::Unknown => {
                        self.unknown.insert(row);
                    }
                    Ownership::Other(stored) => {
                        // Refused before its bytes are copied anywhere.
                        self.collision.get_or_insert((row, stored));
                        return Err("row key hash collision".into());
                    }
                }
                Ok((field, row, m))
            }
        }
        impl Sink<ValueAsk<'_>> for Adapter<'_> {
            fn slot(&mut self, ask: ValueAsk<'_>) -> std::result::Result<&mut [u8], String> {
                let (field, row, m) = self.check(ask)?;
                self.sink.slot(TensorAsk {
                    field,
                    row,
                    dtype: m.dtype,
                    shape: &m.shape,
                })
            }

            fn slots(
                &mut self,
                asks: &[ValueAsk<'_>],
            ) -> Option<std::result::Result<Vec<&mut [u8]>, String>> {
                let checked = match self.check_all(asks) {
                    Ok(c) => c,
                    Err(e) => return Some(Err(e)),
                };
                self.sink.slots(&tasks(&checked))
            }

            fn accept_lent(
                &mut self,
                asks: &[ValueAsk<'_>],
            ) -> Option<std::result::Result<(), String>> {
                let checked = match self.check_all(asks) {
                    Ok(c) => c,
                    Err(e) => return Some(Err(e)),
                };
                self.sink.accept_lent(&tasks(&checked))
            }

            fn lent(
                &mut self,
                asks: &[ValueAsk<'_>],
                buf: crate::Lent,
                spans: &[std::ops::Range<usize>],
            ) -> std::result::Result<(), String> {
                let checked = self.check_all(asks)?;
                self.sink.lent(&tasks(&checked), buf, spans)
            }
        }
        impl Adapter<'_> {
            fn check_all(
                &mut self,
                asks: &[ValueAsk<'_>],
            ) -> std::result::Result<Vec<(usize, usize, ValueMeta)>, String> {
                asks.iter().map(|&ask| self.check(ask)).collect()
            }
        }
        fn tasks(checked: &[(usize, usize, ValueMeta)]) -> Vec<TensorAsk<'_>> {
            checked
                .iter()
                .map(|(field, row, m)| TensorAsk {
                    field: *field,
                    row: *row,
                    dtype: m.dtype,
                    shape: m.shape.as_slice(),
                })
                .collect()
        }
        let mut adapter = Adapter {
            sink,
            keys,
            collision: None,
            unknown: BTreeSet::new(),
        };
        let got = self.get_placed_into(partition, placed, &mut adapter, deadline);
        if let Some((row, stored)) = adapter.collision {
            return Err(collision(partition, &keys[row], stored));
        }
        got.map_err(|e| name_keys(e, keys))?;
        self.check_names(partition, keys, &adapter.unknown, unit, deadline)
    }

    /// Compare the stored names of `rows` (indexes into `keys`) with the
    /// names asked for: the check for values that carry no owner.
    pub(crate) fn check_names(
        &self,
        partition: &str,
        keys: &[RowKey],
        rows: &BTreeSet<usize>,
        unit: Option<usize>,
        deadline: Instant,
    ) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let placed = rows
            .iter()
            .map(|&r| {
                let id = keys[r].row_id()?;
                Ok((self.unit_of_key(id, unit)?, Key::new(id, KEY_FIELD)))
            })
            .collect::<Result<Vec<_>>>()?;
        let stored = self
            .get(partition, &placed, deadline)
            .map_err(|e| name_keys(e, keys))?;
        for (&r, name) in rows.iter().zip(stored) {
            if let RowKey::Name(n) = &keys[r] {
                if name != n.as_bytes() {
                    let name = String::from_utf8_lossy(&name).into_owned();
                    return Err(collision(partition, &keys[r], Some(name)));
                }
            }
        }
        Ok(())
    }

    /// Read `fields` of `keys` into fresh tensors, `[field][row]`.
    pub fn get_tensors(
        &self,
        partition: &str,
        keys: &[RowKey],
        fields: &[&str],
        unit: Option<usize>,
        deadline: Instant,
    ) -> Result<Vec<Vec<OwnedTensor>>> {
        struct Collect(Vec<Vec<Option<OwnedTensor>>>);
        impl Sink<TensorAsk<'_>> for Collect {
            fn slot(&mut self, ask: TensorAsk<'_>) -> std::result::Result<&mut [u8], String> {
                let len = byte_len(ask.dtype, ask.shape).map_err(|e| e.to_string())?;
                let len =
                    usize::try_from(len).map_err(|_| "value larger than memory".to_string())?;
                let t = self.0[ask.field][ask.row].insert(OwnedTensor {
                    dtype: ask.dtype,
                    shape: ask.shape.to_vec(),
                    data: vec![0; len],
                });
                Ok(&mut t.data)
            }
        }
        let mut c = Collect(vec![vec![None; keys.len()]; fields.len()]);
        self.get_tensors_into(partition, keys, fields, unit, &mut c, deadline)?;
        c.0.into_iter()
            .map(|f| {
                f.into_iter()
                    .map(|t| {
                        t.ok_or_else(|| Error::TransferFailed {
                            unit: 0,
                            blobs: vec![],
                            reason: "a value was not delivered".into(),
                            in_flight: false,
                        })
                    })
                    .collect()
            })
            .collect()
    }

    /// (unit, wire row) of every key.
    fn place_rows(&self, keys: &[RowKey], unit: Option<usize>) -> Result<Vec<(usize, u64)>> {
        keys.iter()
            .map(|k| {
                let r = k.row_id()?;
                Ok((self.unit_of_key(r, unit)?, r))
            })
            .collect()
    }

    /// (unit, wire key) of every (field, key), field-major.
    pub(crate) fn place(
        &self,
        keys: &[RowKey],
        fields: &[&str],
        unit: Option<usize>,
    ) -> Result<Vec<(usize, Key)>> {
        let rows = self.place_rows(keys, unit)?;
        let mut placed = Vec::with_capacity(keys.len() * fields.len());
        for f in fields {
            check_field(f)?;
            for &(u, r) in &rows {
                placed.push((u, Key::new(r, *f)));
            }
        }
        Ok(placed)
    }

    /// Clear whole rows of `partition`; returns the entries removed.
    pub fn clear(
        &self,
        partition: &str,
        keys: &[RowKey],
        unit: Option<usize>,
        deadline: Instant,
    ) -> Result<u64> {
        let rows = self.place_rows(keys, unit)?;
        self.clear_placed_rows(partition, &rows, deadline)
    }

    /// Clear every row of `partition` on every unit; returns the entries
    /// removed. Units that are dead hold nothing any more and are skipped.
    pub fn clear_partition(&self, partition: &str, deadline: Instant) -> Result<u64> {
        self.timed(crate::metrics::ClientOp::Clear, |_| {
            self.drop_partition(partition, deadline)
        })
    }

    fn drop_partition(&self, partition: &str, deadline: Instant) -> Result<u64> {
        let reqs = (0..self.units.len())
            .map(|u| {
                (
                    u,
                    Request::ClearPartition {
                        partition: partition.to_owned(),
                    },
                )
            })
            .collect();
        let mut removed = 0;
        for (unit, r) in self.call_units(reqs, deadline) {
            match r {
                Ok(Response::Cleared { entries }) => removed += entries,
                Ok(other) => return Err(unexpected(unit, other)),
                Err(Error::LostKeys { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        // Again on the units that took copies after a unit went down, as
        // a clear of rows does (`Client::clear_newcomers_again`).
        let again = self
            .newcomers()
            .into_iter()
            .map(|u| {
                let partition = partition.to_owned();
                (u, Request::ClearPartition { partition })
            })
            .collect();
        for (unit, r) in self.call_units(again, deadline) {
            match r {
                Ok(Response::Cleared { .. }) | Err(Error::LostKeys { .. }) => {}
                Ok(other) => return Err(unexpected(unit, other)),
                Err(e) => return Err(e),
            }
        }
        Ok(removed)
    }

    /// The rows of `partition` and their fields (sorted by row key).
    pub fn list(&self, partition: &str, deadline: Instant) -> Result<Vec<(RowKey, Vec<String>)>> {
        let reqs = (0..self.units.len())
            .map(|u| {
                (
                    u,
                    Request::List {
                        partition: partition.to_owned(),
                    },
                )
            })
            .collect();
        let mut listed: Vec<(usize, u64, Vec<String>)> = Vec::new();
        for (unit, r) in self.call_units(reqs, deadline) {
            match r {
                Ok(Response::Listed { rows }) => {
                    listed.extend(rows.into_iter().map(|(row, fields)| (unit, row, fields)))
                }
                Ok(other) => return Err(unexpected(unit, other)),
                // With copies, a dead unit's rows are listed from the
                // copies left.
                Err(Error::LostKeys { .. }) if self.replicas() > 1 => {}
                Err(e) => return Err(e),
            }
        }
        if self.replicas() > 1 {
            // Each row once, with the fields of all its copies.
            let mut by_row: BTreeMap<u64, (usize, BTreeSet<String>)> = BTreeMap::new();
            for (unit, row, fields) in listed {
                by_row
                    .entry(row)
                    .or_insert((unit, BTreeSet::new()))
                    .1
                    .extend(fields);
            }
            listed = by_row
                .into_iter()
                .map(|(row, (unit, fields))| (unit, row, fields.into_iter().collect()))
                .collect();
        }
        // String rows: fetch their names (one read per unit).
        let named: Vec<(usize, Key)> = listed
            .iter()
            .filter(|(_, row, fields)| {
                *row & NAME_BIT != 0 && fields.iter().any(|f| f == KEY_FIELD)
            })
            .map(|(u, row, _)| (*u, Key::new(*row, KEY_FIELD)))
            .collect();
        let names: HashMap<u64, String> = if named.is_empty() {
            HashMap::new()
        } else {
            let raw = self.get(partition, &named, deadline)?;
            named
                .iter()
                .zip(raw)
                .map(|((_, k), v)| (k.row, String::from_utf8_lossy(&v).into_owned()))
                .collect()
        };
        let mark = |f: &String| f.starts_with(stowage_wire::CONSUMED_FIELD_PREFIX);
        let mut out: Vec<(RowKey, Vec<String>)> = listed
            .into_iter()
            // A claim's consumption mark that came after its row was
            // cleared is a row of marks alone: not the caller's.
            .filter(|(_, _, fields)| !fields.iter().all(|f| mark(f) || f == KEY_FIELD))
            .map(|(_, row, fields)| {
                let key = match names.get(&row) {
                    Some(n) => RowKey::Name(n.clone()),
                    None => RowKey::Index(row),
                };
                let shown =
                    |f: &String| f != KEY_FIELD && !f.starts_with(UNIT_FIELD_PREFIX) && !mark(f);
                (key, fields.into_iter().filter(shown).collect())
            })
            .collect();
        out.sort();
        Ok(out)
    }

    /// The partitions of this client's namespace that hold data.
    pub fn partitions(&self, deadline: Instant) -> Result<Vec<String>> {
        let reqs = (0..self.units.len())
            .map(|u| (u, Request::ListPartitions))
            .collect();
        let mut all = std::collections::BTreeSet::new();
        for (unit, r) in self.call_units(reqs, deadline) {
            match r {
                Ok(Response::Partitions { names }) => all.extend(
                    names
                        .into_iter()
                        .filter(|n| !n.starts_with(crate::repair::RESERVED_PARTITIONS)),
                ),
                Ok(other) => return Err(unexpected(unit, other)),
                // With copies, a dead unit's partitions are on the copies.
                Err(Error::LostKeys { .. }) if self.replicas() > 1 => {}
                Err(e) => return Err(e),
            }
        }
        Ok(all.into_iter().collect())
    }
}
