//! Views packed a field at a time ([`Client::packed_view`]): per unit, each
//! field's values of its rows back to back along the first axis, in place
//! where a put laid them so in one range of the unit's slab (`put.rs`),
//! else gathered into one buffer ([`View::read_packed_into`]). Built
//! straight from the units' columns: nothing is kept per value but the
//! offsets.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use stowage_wire::RowsResolved;

use crate::classify::unexpected_found;
use crate::values::{DType, RowKey};
use crate::views::{outside, value_meta, Resolution, Shape, UnitRows, View};
use crate::{Client, Error, Result};

/// One unit's share of a [`Client::packed_view`]: the rows of the call
/// that live on `unit`, in the order of the call, and each field's values
/// of them packed along the first axis.
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
    /// The slab offset of the values when they lie back to back in one
    /// range of the unit's slab (a view in place); `None`: they must be
    /// copied ([`View::read_packed_into`]) from `ranges`.
    in_place: Option<u64>,
    /// (slab offset, bytes) of the values' bytes in order, when not in
    /// place.
    ranges: Vec<(u64, u64)>,
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
    /// The address of a packed field's values in place and their length
    /// (see [`View::as_ptr`]); `None` for values to be copied.
    pub fn packed_ptr(&self, chunk: &PackedChunk, p: &PackedField) -> Option<(*const u8, usize)> {
        let offset = p.in_place?;
        let slab = self.slab(chunk.unit).ok()?;
        slab.range_ptr(offset, p.len).ok().map(|ptr| (ptr, p.len))
    }

    /// Copy field `f` of `chunk` (from this view's [`Client::packed_view`])
    /// into `dst` (exactly its length): its values back to back.
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
        let slab = self.slab(chunk.unit)?;
        if let Some(offset) = p.in_place {
            return slab.read(offset, dst).map_err(outside);
        }
        let reads = crate::pieces::split_dst(dst, &p.ranges).map_err(Error::InvalidRequest)?;
        slab.read_scatter(reads).map_err(outside)
    }
}

impl Client {
    /// Pin `fields` of `keys` and view them packed a field at a time, per
    /// unit ([`PackedChunk`], in unit order): in place where a field's
    /// values of a unit's rows lie back to back in one range of its slab,
    /// in the order of the call (as a put of those rows lays them), else
    /// to be copied. Every value of a field must have the same dtype and
    /// the same dimensions past the first; a field that does not is
    /// refused (`InvalidRequest`, naming it). Fails as [`Client::view`]
    /// does otherwise. The values stay pinned while the [`View`] lives
    /// (it holds no [`View::field`] values: they are in the chunks).
    pub fn packed_view(
        self: &Arc<Self>,
        partition: &str,
        keys: &[RowKey],
        fields: &[&str],
        unit: Option<usize>,
        deadline: Instant,
    ) -> Result<(View, Vec<PackedChunk>)> {
        self.timed(crate::metrics::ClientOp::View, |_| {
            let Resolution { view, parts } =
                self.resolve_rows(partition, keys, fields, unit, deadline)?;
            let mut unknown = BTreeSet::new();
            let mut chunks = Vec::with_capacity(parts.len());
            for (u, rows, r) in &parts {
                let slab_len = match view.slab(*u) {
                    Ok(s) => s.len(),
                    // Nothing pinned: no fields asked for.
                    Err(_) if r.n == 0 => 0,
                    Err(e) => return Err(e),
                };
                let ask = Ask {
                    unit: *u,
                    rows,
                    partition,
                    keys,
                    fields,
                    slab_len,
                };
                chunks.push(ask.chunk(r, &mut unknown)?);
            }
            // One dtype and one inner shape per field, across units too.
            for (f, name) in fields.iter().enumerate() {
                let mut by = chunks.iter().map(|c| &c.fields[f]);
                if let Some(first) = by.next() {
                    if let Some(p) = by.find(|p| p.dtype != first.dtype || p.inner != first.inner) {
                        return Err(mixed(name, first.dtype, &first.inner, p.dtype, &p.inner));
                    }
                }
            }
            self.check_names(partition, keys, &unknown, unit, deadline)?;
            Ok((view, chunks))
        })
    }
}

/// What packing one unit's answer needs to know of the call.
struct Ask<'a> {
    unit: usize,
    rows: &'a UnitRows,
    partition: &'a str,
    keys: &'a [RowKey],
    fields: &'a [&'a str],
    slab_len: u64,
}

impl Ask<'_> {
    /// The unit's chunk from its answer `r` (checked by `resolve_rows`):
    /// each value's metadata checked as a view's; positions of values put
    /// before owners were recorded go to `unknown`.
    fn chunk(&self, r: &RowsResolved, unknown: &mut BTreeSet<usize>) -> Result<PackedChunk> {
        let u = self.unit;
        let per_field = self.rows.ids.len();
        let split = r.split_parts();
        let mut values = r.values().map_err(|m| unexpected_found(u, m))?;
        let mut shape = Shape::new();
        let mut fields = Vec::with_capacity(self.fields.len());
        for (f, name) in self.fields.iter().enumerate() {
            let mut offsets = Vec::with_capacity(per_field + 1);
            offsets.push(0u64);
            let (mut at, mut len) = (0u64, 0u64);
            let mut first: Option<(DType, Shape, u64)> = None;
            // Back to back in one range while each value starts where the
            // one before it ends; the ranges to copy once they do not.
            let mut next = None;
            let mut ranges = Vec::new();
            for j in 0..per_field {
                let i = f * per_field + j;
                let v = values
                    .next()
                    .ok_or_else(|| unexpected_found(u, "fewer values than keys".into()))?;
                let row = self.rows.at[j];
                let parts = split.get(&(i as u32)).copied();
                let (dtype, unknown_name) = value_meta(
                    u,
                    v,
                    parts,
                    self.slab_len,
                    self.partition,
                    &self.keys[row],
                    &mut shape,
                )?;
                if unknown_name {
                    unknown.insert(row);
                }
                let inner = shape.get(1..).unwrap_or(&[]);
                match &first {
                    None => first = Some((dtype, inner.into(), v.offset)),
                    Some((d, s, _)) if *d != dtype || s[..] != *inner => {
                        return Err(mixed(name, *d, s, dtype, inner));
                    }
                    Some(_) => {}
                }
                at = shape
                    .first()
                    .copied()
                    .unwrap_or(1)
                    .checked_add(at)
                    .ok_or_else(|| {
                        Error::InvalidRequest(format!(
                            "field {name:?} cannot be packed: its values' leading dimensions add up past 2^64"
                        ))
                    })?;
                offsets.push(at);
                let start = first.as_ref().map_or(v.offset, |(_, _, o)| *o);
                if j == 0 {
                    next = parts.is_none().then_some(v.offset);
                }
                match next {
                    Some(o) if parts.is_none() && v.offset == o => {
                        next = Some(o + v.len);
                    }
                    _ => {
                        if let Some(o) = next.take() {
                            // The values so far were one range.
                            if o > start {
                                ranges.push((start, o - start));
                            }
                        }
                        match parts {
                            Some(p) => ranges.extend_from_slice(p),
                            None => ranges.push((v.offset, v.len)),
                        }
                    }
                }
                len += v.len;
            }
            let (dtype, inner, start) = first.unwrap_or((DType::U8, Shape::new(), 0));
            fields.push(PackedField {
                dtype,
                inner,
                offsets,
                len: usize::try_from(len)
                    .map_err(|_| Error::InvalidRequest("values larger than memory".into()))?,
                in_place: next.map(|_| start),
                ranges,
            });
        }
        Ok(PackedChunk {
            unit: u,
            rows: self.rows.at.clone(),
            fields,
        })
    }
}

/// The refusal of a field whose values differ in dtype or in their
/// dimensions past the first.
fn mixed(name: &str, a: DType, a_inner: &[u64], b: DType, b_inner: &[u64]) -> Error {
    Error::InvalidRequest(format!(
        "field {name:?} cannot be packed: it holds {} values of dimensions {a_inner:?} past the first \
         and {} values of {b_inner:?} (read it with get_view)",
        a.name(),
        b.name()
    ))
}
