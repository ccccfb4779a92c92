//! The values of the rows × fields API: element types ([`DType`]), row
//! names ([`RowKey`]) and typed, shaped tensors.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Rows whose ids have this bit set are named by strings.
pub(crate) const NAME_BIT: u64 = 1 << 63;

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
        check_len(dtype, &shape, data.len())?;
        Ok(Self { dtype, shape, data })
    }

    /// What [`Tensor::new`] checks, of a tensor built field by field.
    pub(crate) fn check(&self) -> Result<()> {
        check_len(self.dtype, &self.shape, self.data.len())
    }
}

fn check_len(dtype: DType, shape: &[u64], len: usize) -> Result<()> {
    let want = byte_len(dtype, shape)?;
    if want != len as u64 {
        return Err(Error::InvalidRequest(format!(
            "a {} tensor of shape {shape:?} has {want} bytes, not {len}",
            dtype.name(),
        )));
    }
    Ok(())
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

/// Bytes of a C-contiguous value of `dtype` and `shape`.
pub(crate) fn byte_len(dtype: DType, shape: &[u64]) -> Result<u64> {
    dtype
        .nbytes(shape)
        .ok_or_else(|| Error::InvalidRequest(format!("shape {shape:?} overflows")))
}
