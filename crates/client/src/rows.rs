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
//! * Each value's dtype and shape travel as the entry's metadata; its bytes
//!   start on a 64-byte boundary of the blob, so a zero-copy view of any
//!   dtype is aligned.
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
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use stowage_shm::Slab;
use stowage_wire::{EntrySpec, Key};
use stowage_wire::{Request, Response};

use crate::failure::Failure;
use crate::sink::{Sink, TensorAsk, TensorSink, ValueAsk};
use crate::{lock, new_blob_id, BlobPut, Client, Error, Result};

/// The reserved field that holds a string row key's text.
pub const KEY_FIELD: &str = "\0key";

/// Rows whose ids have this bit set are named by strings.
const NAME_BIT: u64 = 1 << 63;

/// Names up to this many bytes are stored beside each of their row's
/// values; a longer name is stored there as a digest (see the module
/// docs), which keeps every value's metadata well under the unit's limit.
pub const MAX_TAGGED_NAME: usize = 512;

/// Seed of the digest of long names: apart from the row id's (seed 0).
const DIGEST_SEED: u64 = 0x0053_544f_5741_4745; // "STOWAGE"

/// Every value starts at a multiple of this many bytes within its blob.
const VALUE_ALIGN: u64 = 64;

static PADDING: [u8; VALUE_ALIGN as usize] = [0; VALUE_ALIGN as usize];

/// Element types of stored values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    Bool,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    F16,
    BF16,
    F32,
    F64,
}

impl DType {
    pub const ALL: [DType; 13] = [
        DType::Bool,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// The numpy / torch name: `"int64"`, `"bfloat16"`, ….
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }

    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }

    /// Bytes of a C-contiguous value of this dtype and `shape`, or `None`
    /// when that overflows.
    pub fn nbytes(self, shape: &[u64]) -> Option<u64> {
        shape
            .iter()
            .try_fold(self.itemsize() as u64, |acc, &d| acc.checked_mul(d))
    }

    /// Bytes per element.
    pub fn itemsize(self) -> usize {
        match self {
            DType::Bool | DType::I8 | DType::U8 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }
}

/// A row's name: an integer index (below 2^63) or a string.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RowKey {
    Index(u64),
    Name(String),
}

impl From<u64> for RowKey {
    fn from(i: u64) -> Self {
        RowKey::Index(i)
    }
}

impl From<&str> for RowKey {
    fn from(s: &str) -> Self {
        RowKey::Name(s.to_owned())
    }
}

impl std::fmt::Display for RowKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RowKey::Index(i) => write!(f, "{i}"),
            RowKey::Name(s) => write!(f, "{s}"),
        }
    }
}

impl RowKey {
    /// The row id on the wire.
    pub fn row_id(&self) -> Result<u64> {
        match self {
            RowKey::Index(i) if *i < NAME_BIT => Ok(*i),
            RowKey::Index(i) => Err(Error::InvalidRequest(format!(
                "row index {i} is not below 2^63"
            ))),
            RowKey::Name(s) => Ok(xxhash_rust::xxh3::xxh3_64(s.as_bytes()) | NAME_BIT),
        }
    }
}

/// A typed, shaped, C-contiguous value borrowed from the caller.
#[derive(Clone, Debug)]
pub struct Tensor<'a> {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub data: &'a [u8],
}

impl<'a> Tensor<'a> {
    /// A tensor over `data`, which must hold exactly the shape's bytes.
    pub fn new(dtype: DType, shape: Vec<u64>, data: &'a [u8]) -> Result<Self> {
        let want = byte_len(dtype, &shape)?;
        if want != data.len() as u64 {
            return Err(Error::InvalidRequest(format!(
                "a {} tensor of shape {shape:?} has {want} bytes, not {}",
                dtype.name(),
                data.len()
            )));
        }
        Ok(Self { dtype, shape, data })
    }
}

/// A value read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedTensor {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

/// One field's values for the rows of a put.
#[derive(Clone, Debug)]
pub enum Column<'a> {
    /// One value per row, each of its own shape.
    Jagged(Vec<Tensor<'a>>),
    /// One array whose first axis runs over the rows.
    Dense(Tensor<'a>),
}

/// What the unit keeps beside each value. For a value of a string-keyed
/// row a [`PutName`] follows it in the same metadata bytes (index rows'
/// metadata is this alone, as it was before owners were recorded).
#[derive(Serialize, Deserialize)]
struct ValueMeta {
    dtype: DType,
    shape: Vec<u64>,
}

/// The name a value of a string-keyed row was put under.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
enum PutName<'a> {
    Name(&'a str),
    /// A name longer than [`MAX_TAGGED_NAME`], by its digest.
    Digest(u128),
}

impl PutName<'_> {
    fn of(name: &str) -> PutName<'_> {
        if name.len() <= MAX_TAGGED_NAME {
            PutName::Name(name)
        } else {
            PutName::Digest(digest(name))
        }
    }
}

fn digest(name: &str) -> u128 {
    xxhash_rust::xxh3::xxh3_128_with_seed(name.as_bytes(), DIGEST_SEED)
}

/// Whether a value may be handed out as `key`'s.
#[derive(Debug, PartialEq, Eq)]
enum Ownership {
    Mine,
    /// Put before owners were recorded: check the row's [`KEY_FIELD`].
    Unknown,
    /// Another name's (`None`: known by digest only).
    Other(Option<String>),
}

fn ownership(key: &RowKey, owner: Option<PutName>) -> Ownership {
    // Index rows and string rows never share ids (NAME_BIT).
    let RowKey::Name(name) = key else {
        return Ownership::Mine;
    };
    match owner {
        None => Ownership::Unknown,
        Some(PutName::Name(n)) if n == *name => Ownership::Mine,
        Some(PutName::Name(n)) => Ownership::Other(Some(n.to_owned())),
        Some(PutName::Digest(d)) if name.len() > MAX_TAGGED_NAME && d == digest(name) => {
            Ownership::Mine
        }
        Some(PutName::Digest(_)) => Ownership::Other(None),
    }
}

fn collision(partition: &str, requested: &RowKey, stored: Option<String>) -> Error {
    Error::KeyCollision {
        partition: partition.to_owned(),
        requested: requested.to_string(),
        stored,
    }
}

/// The metadata of a value of `dtype` and `shape` in a row named `owner`.
fn encode_meta(dtype: DType, shape: &[u64], owner: Option<&[u8]>) -> Result<Vec<u8>> {
    let mut meta = postcard::to_allocvec(&ValueMeta {
        dtype,
        shape: shape.to_vec(),
    })
    .map_err(|e| Error::InvalidRequest(format!("value metadata: {e}")))?;
    meta.extend_from_slice(owner.unwrap_or_default());
    Ok(meta)
}

fn byte_len(dtype: DType, shape: &[u64]) -> Result<u64> {
    dtype
        .nbytes(shape)
        .ok_or_else(|| Error::InvalidRequest(format!("shape {shape:?} overflows")))
}

fn decode_meta(meta: &[u8]) -> std::result::Result<(ValueMeta, Option<PutName<'_>>), String> {
    let bad =
        |e: postcard::Error| format!("value metadata unreadable ({e}): not put by the rows API?");
    let (m, rest) = postcard::take_from_bytes::<ValueMeta>(meta).map_err(bad)?;
    if rest.is_empty() {
        return Ok((m, None));
    }
    let (owner, rest) = postcard::take_from_bytes::<PutName>(rest).map_err(bad)?;
    if !rest.is_empty() {
        return Err("value metadata has trailing bytes: not put by the rows API?".into());
    }
    Ok((m, Some(owner)))
}

/// Refuse two different names of one call that share a row id (a put of
/// both would leave one row holding both).
fn check_distinct_rows(
    partition: &str,
    keys: &[RowKey],
    row_id: impl Fn(&RowKey) -> Result<u64>,
) -> Result<()> {
    let mut names: HashMap<u64, &str> = HashMap::new();
    for key in keys {
        if let RowKey::Name(n) = key {
            match names.insert(row_id(key)?, n) {
                Some(other) if other != n => {
                    return Err(collision(partition, key, Some(other.to_owned())))
                }
                _ => {}
            }
        }
    }
    Ok(())
}

fn check_field(f: &str) -> Result<()> {
    if f.is_empty() || f.starts_with('\0') {
        return Err(Error::InvalidRequest(format!(
            "field name {f:?} is empty or reserved (starts with NUL)"
        )));
    }
    Ok(())
}

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
    fn unit_of_key(&self, row_id: u64, unit: Option<usize>) -> Result<usize> {
        match unit {
            Some(u) if u < self.units.len() => Ok(u),
            Some(u) => Err(Error::InvalidRequest(format!(
                "unit {u} does not exist ({} units)",
                self.units.len()
            ))),
            None => Ok(self.unit_of_row(row_id)),
        }
    }

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
        let n = keys.len();
        let mut seen = std::collections::HashSet::new();
        let mut per_column: Vec<(&str, Vec<Tensor<'_>>)> = Vec::with_capacity(columns.len());
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
                            "field {field:?} has {} values for {n} keys",
                            v.len()
                        )));
                    }
                    for t in v {
                        Tensor::new(t.dtype, t.shape.clone(), t.data)?;
                    }
                    v.clone()
                }
                Column::Dense(t) => {
                    let t = Tensor::new(t.dtype, t.shape.clone(), t.data)?;
                    if t.shape.first().copied() != Some(n as u64) {
                        return Err(Error::InvalidRequest(format!(
                            "field {field:?}: a dense array's first axis ({:?}) must match the {n} keys",
                            t.shape.first()
                        )));
                    }
                    let row_shape = t.shape[1..].to_vec();
                    let row_bytes = byte_len(t.dtype, &row_shape)? as usize;
                    (0..n)
                        .map(|i| Tensor {
                            dtype: t.dtype,
                            shape: row_shape.clone(),
                            data: &t.data[i * row_bytes..(i + 1) * row_bytes],
                        })
                        .collect()
                }
            };
            per_column.push((field, values));
        }
        if n == 0 {
            return Ok(());
        }
        check_distinct_rows(partition, keys, RowKey::row_id)?;
        struct Building<'a> {
            segments: Vec<&'a [u8]>,
            entries: Vec<EntrySpec>,
            size: u64,
        }
        impl<'a> Building<'a> {
            fn push(&mut self, key: Key, data: &'a [u8], meta: Vec<u8>) {
                let pad = self.size.next_multiple_of(VALUE_ALIGN) - self.size;
                if pad > 0 {
                    self.segments.push(&PADDING[..pad as usize]);
                    self.size += pad;
                }
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
        let mut by_unit: BTreeMap<usize, Building<'_>> = BTreeMap::new();
        for (r, key) in keys.iter().enumerate() {
            let row = key.row_id()?;
            let u = self.unit_of_key(row, unit)?;
            let b = by_unit.entry(u).or_insert_with(|| Building {
                segments: Vec::new(),
                entries: Vec::new(),
                size: 0,
            });
            let owner = match key {
                RowKey::Name(name) => {
                    b.push(Key::new(row, KEY_FIELD), name.as_bytes(), Vec::new());
                    Some(
                        postcard::to_allocvec(&PutName::of(name))
                            .map_err(|e| Error::InvalidRequest(format!("row name: {e}")))?,
                    )
                }
                RowKey::Index(_) => None,
            };
            for (field, values) in &per_column {
                let t = &values[r];
                let meta = encode_meta(t.dtype, &t.shape, owner.as_deref())?;
                b.push(Key::new(row, *field), t.data, meta);
            }
        }
        let blobs: Vec<BlobPut<'_>> = by_unit
            .into_iter()
            .map(|(u, b)| BlobPut {
                unit: u,
                partition,
                blob: new_blob_id(),
                segments: b.segments,
                entries: b.entries,
            })
            .collect();
        self.put_many(&blobs, deadline)
            .map_err(|e| name_keys(e, keys))
    }

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
        let got = self.get_into(partition, &placed, &mut adapter, deadline);
        if let Some((row, stored)) = adapter.collision {
            return Err(collision(partition, &keys[row], stored));
        }
        got.map_err(|e| name_keys(e, keys))?;
        self.check_names(partition, keys, &adapter.unknown, unit, deadline)
    }

    /// Compare the stored names of `rows` (indexes into `keys`) with the
    /// names asked for: the check for values that carry no owner.
    fn check_names(
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
                let TensorAsk {
                    field,
                    row,
                    dtype,
                    shape,
                } = ask;
                let len = byte_len(dtype, shape).map_err(|e| e.to_string())?;
                let len =
                    usize::try_from(len).map_err(|_| "value larger than memory".to_string())?;
                let t = self.0[field][row].insert(OwnedTensor {
                    dtype,
                    shape: shape.to_vec(),
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
    fn place(
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
            match r? {
                Response::Listed { rows } => {
                    listed.extend(rows.into_iter().map(|(row, fields)| (unit, row, fields)))
                }
                other => return Err(unexpected(unit, other)),
            }
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
        let mut out: Vec<(RowKey, Vec<String>)> = listed
            .into_iter()
            .map(|(_, row, fields)| {
                let key = match names.get(&row) {
                    Some(n) => RowKey::Name(n.clone()),
                    None => RowKey::Index(row),
                };
                (key, fields.into_iter().filter(|f| f != KEY_FIELD).collect())
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
            match r? {
                Response::Partitions { names } => all.extend(names),
                other => return Err(unexpected(unit, other)),
            }
        }
        Ok(all.into_iter().collect())
    }

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
                        let req = Request::Resolve {
                            partition: partition.to_owned(),
                            keys: keys.clone(),
                            hold: true,
                        };
                        t.call(&req, deadline).await.map(|resp| (resp, slab))
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
            self.make_view(partition, keys, fields, unit, deadline)
        })
    }

    fn make_view(
        self: &Arc<Self>,
        partition: &str,
        keys: &[RowKey],
        fields: &[&str],
        unit: Option<usize>,
        deadline: Instant,
    ) -> Result<View> {
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
                    return Err(crate::failure::unit_error(u, code, message, vec![]))
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
    }
}

/// A unit named a value this client will not read (outside its slab, or
/// parts that are not the value).
fn unexpected_found(unit: usize, message: String) -> Error {
    Error::TransferFailed {
        unit,
        blobs: vec![],
        reason: format!("protocol error: Resolved: {message}"),
        in_flight: false,
    }
}

fn unexpected(unit: usize, r: Response) -> Error {
    match r {
        Response::Error { code, message } => {
            crate::failure::unit_error(unit, code, message, vec![])
        }
        other => Error::TransferFailed {
            unit,
            blobs: vec![],
            reason: format!("unexpected reply {other:?}"),
            in_flight: false,
        },
    }
}

/// Rename wire keys in an error to the caller's row keys.
fn name_keys(e: Error, keys: &[RowKey]) -> Error {
    let names: HashMap<u64, &RowKey> = keys
        .iter()
        .filter_map(|k| k.row_id().ok().map(|r| (r, k)))
        .collect();
    let rename = |ks: &[Key]| -> Vec<String> {
        ks.iter()
            .map(|k| match names.get(&k.row) {
                Some(rk) => format!("{rk}@{}", k.field),
                None => k.to_string(),
            })
            .collect()
    };
    match e {
        Error::NotFound { keys: ks, .. } => Error::NotFound {
            named: rename(&ks),
            keys: ks,
        },
        Error::LostKeys {
            unit,
            blobs,
            keys: ks,
            ..
        } => Error::LostKeys {
            unit,
            blobs,
            named: rename(&ks),
            keys: ks,
        },
        Error::Corrupt { unit, keys: ks, .. } => Error::Corrupt {
            unit,
            named: rename(&ks),
            keys: ks,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str) -> Vec<u8> {
        postcard::to_allocvec(&PutName::of(name)).unwrap()
    }

    #[test]
    fn index_rows_keep_the_metadata_they_always_had() {
        let meta = encode_meta(DType::F32, &[3, 4], None).unwrap();
        let before = postcard::to_allocvec(&ValueMeta {
            dtype: DType::F32,
            shape: vec![3, 4],
        })
        .unwrap();
        assert_eq!(meta, before);
        let (m, owner) = decode_meta(&meta).unwrap();
        assert_eq!((m.dtype, m.shape, owner), (DType::F32, vec![3, 4], None));
    }

    #[test]
    fn values_of_string_rows_carry_their_name() {
        let meta = encode_meta(DType::I64, &[7], Some(&named("uid_g3"))).unwrap();
        let (m, owner) = decode_meta(&meta).unwrap();
        assert_eq!((m.dtype, m.shape), (DType::I64, vec![7]));
        assert_eq!(owner, Some(PutName::Name("uid_g3")));
        let long = "x".repeat(MAX_TAGGED_NAME + 1);
        let meta = encode_meta(DType::I64, &[7], Some(&named(&long))).unwrap();
        assert_eq!(
            decode_meta(&meta).unwrap().1,
            Some(PutName::Digest(digest(&long)))
        );
        // Trailing garbage is not taken for an owner.
        let mut bad = meta.clone();
        bad.push(0);
        assert!(decode_meta(&bad).is_err());
    }

    #[test]
    fn the_longest_tagged_name_fits_the_units_metadata_limit() {
        let name = "n".repeat(MAX_TAGGED_NAME);
        let shape = [u64::MAX; 32];
        let meta = encode_meta(DType::F64, &shape, Some(&named(&name))).unwrap();
        assert!(meta.len() <= stowage_wire::Limits::default().max_meta);
    }

    #[test]
    fn only_the_owner_gets_a_value() {
        let a = RowKey::Name("a".into());
        fn own(n: &str) -> Option<PutName<'_>> {
            Some(PutName::of(n))
        }
        assert_eq!(ownership(&a, own("a")), Ownership::Mine);
        assert_eq!(ownership(&a, own("b")), Ownership::Other(Some("b".into())));
        assert_eq!(ownership(&a, None), Ownership::Unknown);
        // Index rows never share ids with string rows.
        assert_eq!(ownership(&RowKey::Index(3), None), Ownership::Mine);
        // Long names by digest, both ways.
        let (l1, l2) = ("p".repeat(600), "q".repeat(600));
        let k1 = RowKey::Name(l1.clone());
        assert_eq!(ownership(&k1, own(&l1)), Ownership::Mine);
        assert_eq!(ownership(&k1, own(&l2)), Ownership::Other(None));
        assert_eq!(ownership(&k1, own("a")), Ownership::Other(Some("a".into())));
        assert_eq!(ownership(&a, own(&l1)), Ownership::Other(None));
        // A digest never matches a short name, not even its own digest.
        let digest_of_a = Some(PutName::Digest(digest("a")));
        assert_eq!(ownership(&a, digest_of_a), Ownership::Other(None));
    }

    #[test]
    fn one_put_naming_two_colliding_names_is_refused() {
        // Every name hashes alike here.
        let same = |k: &RowKey| match k {
            RowKey::Name(_) => Ok(NAME_BIT | 1),
            RowKey::Index(i) => Ok(*i),
        };
        let keys = [
            RowKey::Index(1),
            RowKey::Name("a".into()),
            RowKey::Name("a".into()),
        ];
        check_distinct_rows("p", &keys, same).unwrap();
        let keys = [RowKey::Name("a".into()), RowKey::Name("b".into())];
        assert_eq!(
            check_distinct_rows("p", &keys, same),
            Err(Error::KeyCollision {
                partition: "p".into(),
                requested: "b".into(),
                stored: Some("a".into()),
            })
        );
        check_distinct_rows("p", &keys, RowKey::row_id).unwrap();
    }
}
