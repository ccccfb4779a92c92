//! numpy arrays and stowage tensors: dtypes, the bytes of caller arrays
//! (no copy), and new arrays over memory Rust owns or a unit's slab.
//!
//! The crate's `unsafe` is here — reading and writing array memory
//! through the pointers numpy reports, and numpy's C API to make arrays
//! over foreign memory — and in `client.rs`'s calls into it, each block
//! with a `// SAFETY:` comment.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{LazyLock, Mutex};

use memmap2::MmapMut;

use numpy::npyffi::{self, npy_intp, NpyTypes, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyString, PyTuple};
use stowage_client::DType;

use crate::errors::invalid;

/// The stowage dtype of a numpy dtype: booleans, integers and floats of
/// 1 to 8 bytes in native byte order, and `ml_dtypes.bfloat16`.
pub(crate) fn dtype_of(descr: &Bound<'_, PyArrayDescr>) -> Result<DType, String> {
    let unsupported = || {
        format!(
            "dtype {} is not supported (bool, int8..int64, uint8..uint64, float16, bfloat16, float32, float64)",
            descr
        )
    };
    if descr.has_fields() || descr.has_subarray() {
        return Err(unsupported());
    }
    if descr.is_native_byteorder() == Some(false) {
        return Err(format!(
            "dtype {descr} is not in native byte order; convert it first (a.astype(a.dtype.newbyteorder('=')))"
        ));
    }
    let size = descr.itemsize();
    let t = match (descr.kind(), size) {
        (b'b', 1) => DType::Bool,
        (b'i', 1) => DType::I8,
        (b'i', 2) => DType::I16,
        (b'i', 4) => DType::I32,
        (b'i', 8) => DType::I64,
        (b'u', 1) => DType::U8,
        (b'u', 2) => DType::U16,
        (b'u', 4) => DType::U32,
        (b'u', 8) => DType::U64,
        (b'f', 2) => DType::F16,
        (b'f', 4) => DType::F32,
        (b'f', 8) => DType::F64,
        (b'V', 2) if type_name(descr).as_deref() == Some("bfloat16") => DType::BF16,
        _ => return Err(unsupported()),
    };
    Ok(t)
}

fn type_name(descr: &Bound<'_, PyArrayDescr>) -> Option<String> {
    descr.typeobj().name().ok().map(|n| n.to_string())
}

static FLOAT16: PyOnceLock<Py<PyArrayDescr>> = PyOnceLock::new();
static BFLOAT16: PyOnceLock<Py<PyArrayDescr>> = PyOnceLock::new();
static RAW16: PyOnceLock<Py<PyArrayDescr>> = PyOnceLock::new();

/// The numpy dtype for `dtype`. bfloat16 is `ml_dtypes.bfloat16`, or with
/// `raw_bf16` a 2-byte void dtype (`V2`) that callers reinterpret (e.g. as
/// `torch.bfloat16`) without needing ml_dtypes.
pub(crate) fn descr_for<'py>(
    py: Python<'py>,
    dtype: DType,
    raw_bf16: bool,
) -> PyResult<Bound<'py, PyArrayDescr>> {
    let cached = |cell: &PyOnceLock<Py<PyArrayDescr>>,
                  make: &dyn Fn() -> PyResult<Py<PyArrayDescr>>| {
        cell.get_or_try_init(py, make).map(|d| d.bind(py).clone())
    };
    Ok(match dtype {
        DType::Bool => PyArrayDescr::of::<bool>(py),
        DType::I8 => PyArrayDescr::of::<i8>(py),
        DType::I16 => PyArrayDescr::of::<i16>(py),
        DType::I32 => PyArrayDescr::of::<i32>(py),
        DType::I64 => PyArrayDescr::of::<i64>(py),
        DType::U8 => PyArrayDescr::of::<u8>(py),
        DType::U16 => PyArrayDescr::of::<u16>(py),
        DType::U32 => PyArrayDescr::of::<u32>(py),
        DType::U64 => PyArrayDescr::of::<u64>(py),
        DType::F32 => PyArrayDescr::of::<f32>(py),
        DType::F64 => PyArrayDescr::of::<f64>(py),
        DType::F16 => cached(&FLOAT16, &|| Ok(PyArrayDescr::new(py, "float16")?.unbind()))?,
        DType::BF16 if raw_bf16 => cached(&RAW16, &|| Ok(PyArrayDescr::new(py, "V2")?.unbind()))?,
        DType::BF16 => cached(&BFLOAT16, &|| {
            let bf16 = py
                .import("ml_dtypes")
                .and_then(|m| m.getattr("bfloat16"))
                .map_err(|_| {
                    invalid(
                        "reading bfloat16 values into numpy needs the ml_dtypes package \
                         (pip install ml_dtypes), or as_='torch'",
                    )
                })?;
            Ok(PyArrayDescr::new(py, bf16)?.unbind())
        })?,
    })
}

/// A caller's array seen as bytes: `ob` is a numpy array, or a tuple
/// `(dtype_name, array)` that reinterprets an array of the same item size
/// (how torch bfloat16 tensors arrive: viewed as int16).
pub(crate) struct ArrayBytes<'py> {
    /// Keeps the array alive while its memory is in use.
    pub array: Bound<'py, PyUntypedArray>,
    pub dtype: DType,
    pub shape: Vec<u64>,
    ptr: *mut u8,
    len: usize,
}

impl<'py> ArrayBytes<'py> {
    /// Check `ob` and take its memory as it is: a non-contiguous array is
    /// an error, never silently copied. `what` names it in errors.
    pub fn new(ob: &Bound<'py, PyAny>, what: &dyn Fn() -> String) -> PyResult<Self> {
        let (array, tag) = if let Ok(t) = ob.cast::<PyTuple>() {
            if t.len() != 2 {
                return Err(invalid(format!(
                    "{}: expected an array or (dtype, array)",
                    what()
                )));
            }
            let name = t.get_item(0)?;
            let name = name
                .cast::<PyString>()
                .map_err(|_| invalid(format!("{}: a dtype tag must be a str", what())))?
                .to_string();
            let dtype = DType::from_name(&name)
                .ok_or_else(|| invalid(format!("{}: unknown dtype {name:?}", what())))?;
            (t.get_item(1)?, Some(dtype))
        } else {
            (ob.clone(), None)
        };
        let array = array.cast_into::<PyUntypedArray>().map_err(|e| {
            invalid(format!(
                "{}: expected a numpy array or a torch tensor, got {}",
                what(),
                e.into_inner()
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        let descr = array.dtype();
        let dtype = match tag {
            Some(t) => {
                if descr.itemsize() != t.itemsize() || descr.has_object() || descr.has_fields() {
                    return Err(invalid(format!(
                        "{}: cannot read a {} array as {}",
                        what(),
                        descr,
                        t.name()
                    )));
                }
                t
            }
            None => dtype_of(&descr).map_err(|m| invalid(format!("{}: {m}", what())))?,
        };
        if !array.is_c_contiguous() {
            return Err(invalid(format!(
                "{}: the array is not C-contiguous (strides {:?}); pass a contiguous copy \
                 (numpy.ascontiguousarray or tensor.contiguous()) explicitly",
                what(),
                array.strides()
            )));
        }
        let shape: Vec<u64> = array.shape().iter().map(|&d| d as u64).collect();
        let len = array.len() * descr.itemsize();
        // SAFETY: a numpy array object's `data` field points at its first
        // element; a C-contiguous array's elements are the `len` bytes from
        // there.
        let ptr =
            unsafe { (*npyffi::_PyArray_GET_ITEM_DATA(array.as_array_ptr())).data as *mut u8 };
        Ok(Self {
            array,
            dtype,
            shape,
            ptr,
            len,
        })
    }

    /// The array's bytes. Valid while `self` (which holds the array) lives;
    /// they are not copied, so the caller must not resize the array
    /// meanwhile (numpy refuses to while references exist).
    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` and `len` describe the array's memory (see `new`),
        // kept alive by `self.array`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether numpy allows writing to the array.
    pub fn writeable(&self) -> bool {
        // SAFETY: reading the flags field of a live array object.
        let flags = unsafe { (*npyffi::_PyArray_GET_ITEM_DATA(self.array.as_array_ptr())).flags };
        flags & npyffi::NPY_ARRAY_WRITEABLE != 0
    }

    /// The array's memory as a raw destination (see [`RawDest`]).
    pub fn dest(&self, offset: usize, len: usize) -> RawDest {
        debug_assert!(offset + len <= self.len);
        RawDest {
            ptr: if self.len == 0 {
                NonNull::dangling().as_ptr()
            } else {
                // SAFETY: in bounds of the array's memory, per the assertion
                // callers make (offset + len <= self.len).
                unsafe { self.ptr.add(offset) }
            },
            len,
        }
    }
}

/// Writable memory of a caller's array, handed to a transfer that runs
/// without the GIL. Taken with the GIL held from an array the caller keeps
/// alive for the transfer.
#[derive(Clone, Copy)]
pub(crate) struct RawDest {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a RawDest is plain memory of an array that outlives the transfer
// using it (see `ArrayBytes::dest`); moving the address between threads is
// fine.
unsafe impl Send for RawDest {}

impl RawDest {
    pub fn range(&self) -> (usize, usize) {
        (self.ptr as usize, self.ptr as usize + self.len)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The memory as a slice.
    ///
    /// # Safety
    /// The array must still be alive, and no other live slice may overlap
    /// this one (callers check that destinations are disjoint).
    pub unsafe fn slice<'a>(&self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: per the contract above.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Values this large get transparent huge pages.
const HUGE: usize = 4 << 20;
const HUGE_PAGE: usize = 2 << 20;
/// Read buffers this large come from, and go back to, the reuse cache.
const CACHE_MIN: usize = 1 << 20;
/// Bytes of freed read buffers kept for reuse unless `STOWAGE_HOST_CACHE`
/// says otherwise.
const CACHE_DEFAULT: usize = 1 << 30;

/// Freed large read buffers, kept mapped (pages resident) so that the next
/// get of a similar size fills warm memory instead of faulting in fresh
/// pages: on this class of VM, first touch runs at 1.5-3 GB/s against
/// 10+ GB/s for the copy itself, and an RL loop gets the same sizes every
/// step. Process-wide, bounded by `limit`; contents of a reused buffer
/// are stale bytes of this process until the get overwrites them.
struct HostCache {
    free: BTreeMap<usize, Vec<MmapMut>>,
    bytes: usize,
    limit: usize,
    hits: u64,
    misses: u64,
}

static CACHE: LazyLock<Mutex<HostCache>> = LazyLock::new(|| {
    let limit = std::env::var("STOWAGE_HOST_CACHE")
        .ok()
        .and_then(|v| stowage_cluster::config::parse_size(&v).ok())
        .map_or(CACHE_DEFAULT, |n| usize::try_from(n).unwrap_or(usize::MAX));
    Mutex::new(HostCache {
        free: BTreeMap::new(),
        bytes: 0,
        limit,
        hits: 0,
        misses: 0,
    })
});

fn cache() -> std::sync::MutexGuard<'static, HostCache> {
    // A panic while holding the lock leaves the lists consistent (every
    // change is one push or pop), so a poisoned lock is still usable.
    CACHE.lock().unwrap_or_else(|e| e.into_inner())
}

impl HostCache {
    /// A cached buffer of `cap` to `cap + cap/4` bytes, smallest first.
    fn take(&mut self, cap: usize) -> Option<MmapMut> {
        let (&size, list) = self.free.range_mut(cap..=cap + cap / 4).next()?;
        let m = list.pop()?;
        if list.is_empty() {
            self.free.remove(&size);
        }
        self.bytes -= size;
        Some(m)
    }

    fn put(&mut self, m: MmapMut) {
        if self.bytes + m.len() <= self.limit {
            self.bytes += m.len();
            self.free.entry(m.len()).or_default().push(m);
        }
    }

    /// Unmap cached buffers, largest first, until at most `limit` remain.
    fn trim(&mut self) {
        while self.bytes > self.limit {
            let Some(mut e) = self.free.last_entry() else {
                break;
            };
            let size = *e.key();
            e.get_mut().pop();
            if e.get().is_empty() {
                e.remove();
            }
            self.bytes -= size;
        }
    }
}

/// Memory for one value read into a new array: heap memory for small
/// values, a reusable anonymous mapping for large ones.
pub(crate) enum HostBuf {
    Heap(Vec<u8>),
    Mapped {
        map: Option<MmapMut>,
        len: usize,
    },
    /// Memory a nixl get lent (its values were READ into it, no copy);
    /// back to the client's receive pool when dropped.
    Lent(stowage_client::Lent),
}

impl HostBuf {
    /// `len` bytes to be filled completely by the caller. Small buffers are
    /// zeroed; large ones may hold stale bytes of an earlier read of this
    /// process (like `numpy.empty`).
    pub fn new(len: usize) -> std::io::Result<Self> {
        if len < CACHE_MIN {
            return Ok(Self::Heap(vec![0u8; len]));
        }
        let cap = len.next_multiple_of(HUGE_PAGE);
        let cached = {
            let mut c = cache();
            let m = c.take(cap);
            if m.is_some() {
                c.hits += 1;
            } else {
                c.misses += 1;
            }
            m
        };
        let map = match cached {
            Some(m) => m,
            None => {
                let m = MmapMut::map_anon(cap)?;
                if cap >= HUGE {
                    // Ask for transparent huge pages before the first touch:
                    // fewer faults. Failure (no THP) only costs speed.
                    let _ = m.advise(memmap2::Advice::HugePage);
                }
                m
            }
        };
        Ok(Self::Mapped {
            map: Some(map),
            len,
        })
    }
}

impl std::ops::Deref for HostBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Heap(v) => v,
            Self::Mapped { map, len } => map.as_deref().map_or(&[], |m| &m[..*len]),
            Self::Lent(l) => l,
        }
    }
}

impl std::ops::DerefMut for HostBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Self::Heap(v) => v,
            Self::Mapped { map, len } => map.as_deref_mut().map_or(&mut [], |m| &mut m[..*len]),
            Self::Lent(l) => l,
        }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        if let Self::Mapped { map, .. } = self {
            if let Some(m) = map.take() {
                cache().put(m);
            }
        }
    }
}

/// Memory a numpy array made by [`array_over`] keeps alive: bytes the
/// client read (freed, or returned to the read cache, with the last array
/// over them).
#[pyclass(module = "stowage._native", frozen)]
pub(crate) struct OwnedBytes {
    ptr: *mut u8,
    _buf: HostBuf,
}

// SAFETY: the bytes are only touched through numpy arrays (under the GIL)
// and released in Drop; the pointer itself may move between threads.
unsafe impl Send for OwnedBytes {}
// SAFETY: as above; the struct has no interior state to share.
unsafe impl Sync for OwnedBytes {}

impl OwnedBytes {
    pub fn new(mut buf: HostBuf) -> Self {
        // The heap block or mapping does not move when `buf` does.
        let ptr = buf.as_mut_ptr();
        Self { ptr, _buf: buf }
    }

    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

/// A new C-contiguous numpy array of `descr` and `shape` over `data`,
/// which `base` keeps alive (numpy holds a reference to it).
///
/// # Safety
/// `data` must point at `prod(shape) * itemsize` bytes that live as long as
/// `base` does (and, if `writeable`, that nothing else writes).
pub(crate) unsafe fn array_over<'py>(
    py: Python<'py>,
    descr: Bound<'py, PyArrayDescr>,
    shape: &[u64],
    data: *mut u8,
    writeable: bool,
    base: Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    // On the stack for the dimensions numpy allows (one array per value of
    // a get or a view: no allocation each).
    let mut on_stack = [0 as npy_intp; 64];
    let mut on_heap = Vec::new();
    let dims: &mut [npy_intp] = if shape.len() <= on_stack.len() {
        &mut on_stack[..shape.len()]
    } else {
        on_heap.resize(shape.len(), 0);
        &mut on_heap
    };
    for (out, &d) in dims.iter_mut().zip(shape) {
        *out = npy_intp::try_from(d).map_err(|_| invalid(format!("dimension {d} too large")))?;
    }
    let data = if data.is_null() {
        // numpy allocates when handed no memory; a zero-size array still
        // needs a pointer of its own.
        NonNull::<u64>::dangling().as_ptr() as *mut u8
    } else {
        data
    };
    let flags = npyffi::NPY_ARRAY_C_CONTIGUOUS
        | if writeable {
            npyffi::NPY_ARRAY_WRITEABLE
        } else {
            0
        };
    // SAFETY: numpy's C API with a descriptor reference it takes over
    // (`into_dtype_ptr`), dims of length nd, default strides and memory
    // valid per this function's contract.
    unsafe {
        let arr = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            npyffi::get_type_object(py, NpyTypes::PyArray_Type),
            descr.into_dtype_ptr(),
            dims.len() as std::ffi::c_int,
            dims.as_mut_ptr(),
            std::ptr::null_mut(),
            data as *mut c_void,
            flags,
            std::ptr::null_mut(),
        );
        if arr.is_null() {
            return Err(PyErr::fetch(py));
        }
        let arr = Bound::from_owned_ptr(py, arr);
        // Steals the reference to `base`. The flags need no update after:
        // numpy set the contiguity ones from the default strides, and the
        // aligned one from `data`, when it made the array.
        if PY_ARRAY_API.PyArray_SetBaseObject(
            py,
            arr.as_ptr() as *mut npyffi::PyArrayObject,
            base.into_ptr(),
        ) < 0
        {
            return Err(PyErr::fetch(py));
        }
        Ok(arr)
    }
}

/// A writable 1-d uint8 array of `nbytes` from the read cache (the memory
/// goes back to the cache when the last array over it is freed). Like
/// `numpy.empty`, it may hold stale bytes; fill it completely.
#[pyfunction]
pub(crate) fn host_empty(py: Python<'_>, nbytes: usize) -> PyResult<Bound<'_, PyAny>> {
    let buf = HostBuf::new(nbytes)
        .map_err(|e| pyo3::exceptions::PyMemoryError::new_err(format!("{nbytes} bytes: {e}")))?;
    let base = Bound::new(py, OwnedBytes::new(buf))?;
    let ptr = base.get().as_mut_ptr();
    let descr = descr_for(py, DType::U8, false)?;
    // SAFETY: `base` owns exactly `nbytes` bytes at `ptr` and lives as long
    // as the array; nothing else writes them.
    unsafe { array_over(py, descr, &[nbytes as u64], ptr, true, base.into_any()) }
}

/// The read cache: ``{"bytes", "limit", "hits", "misses"}``.
#[pyfunction]
pub(crate) fn host_cache_info(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    // Read under the lock, build the dict after: building it may run a
    // collection that frees a buffer, which takes the lock.
    let (bytes, limit, hits, misses) = {
        let c = cache();
        (c.bytes, c.limit, c.hits, c.misses)
    };
    let d = pyo3::types::PyDict::new(py);
    d.set_item("bytes", bytes)?;
    d.set_item("limit", limit)?;
    d.set_item("hits", hits)?;
    d.set_item("misses", misses)?;
    Ok(d)
}

/// Set how many bytes of freed read buffers are kept (0: none).
#[pyfunction]
pub(crate) fn set_host_cache(limit: usize) {
    let mut c = cache();
    c.limit = limit;
    c.trim();
}

/// `copy(dst, src, threads=None)`: copy the bytes of array `src` into array
/// `dst` (same byte size; `dst` writeable and C-contiguous) the way
/// stowage's own copies go (`threads`: the count; default: what stowage
/// uses for that size), without the GIL. The memcpy limit for benchmarks.
#[pyfunction]
#[pyo3(signature = (dst, src, threads = None))]
pub(crate) fn copy(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
    threads: Option<usize>,
) -> PyResult<()> {
    let d = ArrayBytes::new(dst, &|| "dst".into())?;
    let s = ArrayBytes::new(src, &|| "src".into())?;
    if !d.writeable() {
        return Err(crate::errors::invalid("dst is read-only"));
    }
    if d.len() != s.len() {
        return Err(crate::errors::invalid(format!(
            "dst has {} bytes, src {}",
            d.len(),
            s.len()
        )));
    }
    let (dr, sb) = (d.dest(0, d.len()), s.bytes());
    let (lo, hi) = dr.range();
    let (slo, shi) = (sb.as_ptr() as usize, sb.as_ptr() as usize + sb.len());
    if lo < shi && slo < hi {
        return Err(crate::errors::invalid("dst and src overlap"));
    }
    // SAFETY: `dst` is alive (borrowed for this call), writeable, and does
    // not overlap `src` (checked above); nothing else writes it meanwhile
    // (the caller's arrays are held by the call).
    let dslice = unsafe { dr.slice() };
    py.detach(|| stowage_shm::copy_split(dslice, sb, threads));
    Ok(())
}
