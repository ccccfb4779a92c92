//! Where a get puts its values: new numpy arrays ([`AllocSink`]), the
//! caller's own arrays ([`OutSink`]), and the copies of a view's split
//! values; the pins a view's arrays keep ([`ViewPins`]).

use pyo3::prelude::*;
use stowage_client::Error as ClientError;
use stowage_client::{DType, Sink, TensorAsk, View};

use crate::arrays::{HostBuf, RawDest};

/// One value read into new memory.
pub(crate) struct ReadTensor {
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<u64>,
    pub(crate) data: ReadData,
}

/// Where a value read into new memory lies.
pub(crate) enum ReadData {
    /// Memory of its own (see [`HostBuf`]).
    Own(HostBuf),
    /// `len` bytes at `offset` of the sink's batch buffer `buf`: the
    /// values a unit handed over together share one buffer (one mapping
    /// from the read cache, instead of a zeroed allocation per value).
    Shared {
        buf: usize,
        offset: usize,
        len: usize,
    },
}

/// A sink allocating new memory per value, or per batch of values.
pub(crate) struct AllocSink {
    pub(crate) values: Vec<Vec<Option<ReadTensor>>>,
    pub(crate) batches: Vec<HostBuf>,
    /// The batch buffer small values read one by one go into, and how
    /// many of its bytes are taken.
    chunk: Option<(usize, usize)>,
}

/// Values of at most this many bytes read one by one share batch buffers
/// of [`CHUNK`] bytes: one allocation (and one Python object keeping it)
/// per chunk, not per value. An array kept alive keeps its chunk.
pub(crate) const SMALL: usize = 4096;
pub(crate) const CHUNK: usize = 64 << 10;

/// Values in a batch buffer start on multiples of this (numpy's alignment
/// for any dtype).
pub(crate) const VALUE_ALIGN: usize = 64;

impl AllocSink {
    pub(crate) fn new(fields: usize, rows: usize) -> Self {
        Self {
            values: (0..fields)
                .map(|_| (0..rows).map(|_| None).collect())
                .collect(),
            batches: Vec::new(),
            chunk: None,
        }
    }

    /// `len` bytes (at most [`SMALL`]) for `field` and `row` in the
    /// current chunk, or in a new one.
    fn small_slot(&mut self, ask: &TensorAsk<'_>, len: usize) -> Result<&mut [u8], String> {
        let (buf, offset) = match self.chunk {
            Some((buf, used)) if used.next_multiple_of(VALUE_ALIGN) + len <= CHUNK => {
                (buf, used.next_multiple_of(VALUE_ALIGN))
            }
            _ => {
                let mem =
                    HostBuf::new(CHUNK).map_err(|e| format!("cannot map {CHUNK} bytes: {e}"))?;
                self.batches.push(mem);
                (self.batches.len() - 1, 0)
            }
        };
        self.chunk = Some((buf, offset + len));
        *self.place(ask.field, ask.row)? = Some(ReadTensor {
            dtype: ask.dtype,
            shape: ask.shape.to_vec(),
            data: ReadData::Shared { buf, offset, len },
        });
        Ok(&mut self.batches[buf][offset..offset + len])
    }

    fn place(&mut self, field: usize, row: usize) -> Result<&mut Option<ReadTensor>, String> {
        self.values
            .get_mut(field)
            .and_then(|f| f.get_mut(row))
            .ok_or_else(|| "value index out of range".to_string())
    }

    fn all_slots(&mut self, asks: &[TensorAsk<'_>]) -> Result<Vec<&mut [u8]>, String> {
        let mut total = 0usize;
        let mut spans = Vec::with_capacity(asks.len());
        for &TensorAsk { dtype, shape, .. } in asks {
            let len = nbytes(dtype, shape).ok_or("value larger than memory")?;
            let offset = total.next_multiple_of(VALUE_ALIGN);
            total = offset.checked_add(len).ok_or("values larger than memory")?;
            spans.push((offset, len));
        }
        let buf = self.batches.len();
        let mem = HostBuf::new(total).map_err(|e| format!("cannot map {total} bytes: {e}"))?;
        let mut seen = std::collections::HashSet::with_capacity(asks.len());
        for (ask, &(offset, len)) in asks.iter().zip(&spans) {
            asked_once(&mut seen, ask)?;
            *self.place(ask.field, ask.row)? = Some(ReadTensor {
                dtype: ask.dtype,
                shape: ask.shape.to_vec(),
                data: ReadData::Shared { buf, offset, len },
            });
        }
        // Small batches are zeroed heap memory, large ones may hold stale
        // bytes of this process: either way every value's bytes are
        // written by the get before anyone sees them.
        self.batches.push(mem);
        let mut rest: &mut [u8] = self.batches.last_mut().map_or(&mut [], |b| &mut b[..]);
        let mut at = 0usize;
        let mut out = Vec::with_capacity(spans.len());
        for &(offset, len) in &spans {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(offset - at);
            let (value, tail) = tail.split_at_mut(len);
            out.push(value);
            rest = tail;
            at = offset + len;
        }
        Ok(out)
    }
}

impl Sink<TensorAsk<'_>> for AllocSink {
    fn slot(&mut self, ask: TensorAsk<'_>) -> Result<&mut [u8], String> {
        let len = nbytes(ask.dtype, ask.shape).ok_or("value larger than memory")?;
        if len <= SMALL {
            return self.small_slot(&ask, len);
        }
        let data = HostBuf::new(len).map_err(|e| format!("cannot map {len} bytes: {e}"))?;
        let t = self.place(ask.field, ask.row)?.insert(ReadTensor {
            dtype: ask.dtype,
            shape: ask.shape.to_vec(),
            data: ReadData::Own(data),
        });
        match &mut t.data {
            ReadData::Own(d) => Ok(&mut d[..]),
            ReadData::Shared { .. } => Err("a value in a batch buffer".into()),
        }
    }

    fn slots(&mut self, asks: &[TensorAsk<'_>]) -> Option<Result<Vec<&mut [u8]>, String>> {
        Some(self.all_slots(asks))
    }

    fn accept_lent(&mut self, asks: &[TensorAsk<'_>]) -> Option<Result<(), String>> {
        let mut seen = std::collections::HashSet::with_capacity(asks.len());
        for ask in asks {
            if let Err(e) = asked_once(&mut seen, ask).and_then(|()| self.place(ask.field, ask.row))
            {
                return Some(Err(e));
            }
            if nbytes(ask.dtype, ask.shape).is_none() {
                return Some(Err("value larger than memory".into()));
            }
        }
        Some(Ok(()))
    }

    /// The values share the lent buffer as they share a batch buffer.
    fn lent(
        &mut self,
        asks: &[TensorAsk<'_>],
        lent: stowage_client::Lent,
        spans: &[std::ops::Range<usize>],
    ) -> Result<(), String> {
        let buf = self.batches.len();
        for (
            &TensorAsk {
                field,
                row,
                dtype,
                shape,
            },
            span,
        ) in asks.iter().zip(spans)
        {
            *self.place(field, row)? = Some(ReadTensor {
                dtype,
                shape: shape.to_vec(),
                data: ReadData::Shared {
                    buf,
                    offset: span.start,
                    len: span.len(),
                },
            });
        }
        self.batches.push(HostBuf::Lent(lent));
        Ok(())
    }
}

/// Where the values of one field go in `get(..., out=...)`.
pub(crate) struct Dest {
    pub(crate) dtype: DType,
    /// One per row.
    pub(crate) rows: Vec<RawDest>,
}

/// A sink writing into caller arrays, checking dtype and size. The first
/// mismatch is remembered: it is the caller's error, whatever the client
/// makes of the refusal.
pub(crate) struct OutSink {
    pub(crate) dests: Vec<Dest>,
    pub(crate) fields: Vec<String>,
    pub(crate) error: Option<String>,
}

impl Sink<TensorAsk<'_>> for OutSink {
    fn slot(&mut self, ask: TensorAsk<'_>) -> Result<&mut [u8], String> {
        match self.check(&ask) {
            Ok(d) => {
                // SAFETY: the destinations are disjoint (checked before the
                // call) and their arrays are held by the caller until the
                // call returns.
                Ok(unsafe { d.slice() })
            }
            Err(m) => {
                self.error.get_or_insert(m.clone());
                Err(m)
            }
        }
    }

    fn slots(&mut self, asks: &[TensorAsk<'_>]) -> Option<Result<Vec<&mut [u8]>, String>> {
        let mut dests = Vec::with_capacity(asks.len());
        let mut seen = std::collections::HashSet::with_capacity(asks.len());
        for ask in asks {
            match self.check(ask) {
                Ok(d) => {
                    if let Err(m) = asked_once(&mut seen, ask) {
                        return Some(Err(m));
                    }
                    dests.push(d)
                }
                Err(m) => {
                    self.error.get_or_insert(m.clone());
                    return Some(Err(m));
                }
            }
        }
        // SAFETY: the destinations of different values are disjoint
        // (checked before the call), each is handed out once (above), and
        // their arrays are held by the caller until the call returns.
        Some(Ok(dests.iter().map(|d| unsafe { d.slice() }).collect()))
    }
}

impl OutSink {
    pub(crate) fn check(&self, ask: &TensorAsk<'_>) -> Result<RawDest, String> {
        let (field, row, dtype, shape) = (ask.field, ask.row, ask.dtype, ask.shape);
        let d = self
            .dests
            .get(field)
            .and_then(|f| f.rows.get(row).map(|r| (f.dtype, *r)))
            .ok_or_else(|| format!("no destination for field {field} row {row}"))?;
        let name = &self.fields[field];
        if d.0 != dtype {
            return Err(format!(
                "out[{name:?}] row {row}: the value is {} but the array is {}",
                dtype.name(),
                d.0.name()
            ));
        }
        let bytes = nbytes(dtype, shape).ok_or("value size overflows")?;
        if bytes != d.1.len() {
            return Err(format!(
                "out[{name:?}] row {row}: the value is {} {shape:?} ({bytes} bytes), the array has {} bytes",
                dtype.name(),
                d.1.len()
            ));
        }
        Ok(d.1)
    }
}

/// Refuse a value asked for twice in one call (`seen`: the values asked
/// for so far).
fn asked_once(
    seen: &mut std::collections::HashSet<(usize, usize)>,
    ask: &TensorAsk<'_>,
) -> Result<(), String> {
    if seen.insert((ask.field, ask.row)) {
        Ok(())
    } else {
        Err(format!("value {}/{} asked twice", ask.field, ask.row))
    }
}

pub(crate) fn nbytes(dtype: DType, shape: &[u64]) -> Option<usize> {
    dtype.nbytes(shape).and_then(|n| usize::try_from(n).ok())
}

/// Copies of the split values of `view` (those not in one range of their
/// unit's slab), by (field, row); none for values viewed in place.
pub(crate) fn split_copies(
    view: &View,
) -> Result<std::collections::BTreeMap<(usize, usize), HostBuf>, ClientError> {
    let mut copies = std::collections::BTreeMap::new();
    for f in 0..view.fields() {
        for (r, t) in view.field(f).iter().enumerate() {
            if !t.is_split() {
                continue;
            }
            let mut buf = HostBuf::new(t.len()).map_err(|e| {
                ClientError::InvalidRequest(format!("cannot map {} bytes: {e}", t.len()))
            })?;
            view.read_into(t, &mut buf)?;
            copies.insert((f, r), buf);
        }
    }
    Ok(copies)
}

/// The pins of one `get_view` call, released when the last array over
/// them is garbage-collected.
#[pyclass(module = "stowage._native", frozen)]
pub(crate) struct ViewPins {
    /// Always `Some` until dropped.
    pub(crate) view: Option<View>,
}

impl Drop for ViewPins {
    fn drop(&mut self) {
        // Releasing the pins talks to the units (and may have to reconnect
        // to one): never with the GIL held.
        if let Some(view) = self.view.take() {
            Python::attach(|py| py.detach(move || drop(view)));
        }
    }
}
