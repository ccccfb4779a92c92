//! numpy arrays and stowage tensors: dtypes, the bytes of caller arrays
//! (no copy), and new arrays over memory Rust owns or a unit's slab.
//!
//! Everything `unsafe` in this crate is here: reading and writing array
//! memory through the pointers numpy reports, and numpy's C API to make
//! arrays over foreign memory.

use std::ffi::c_void;
use std::ptr::NonNull;

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
            // SAFETY: in bounds of the array's memory, per the assertion
            // callers make (offset + len <= self.len).
            ptr: if self.len == 0 {
                NonNull::dangling().as_ptr()
            } else {
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

/// A zeroed buffer of `len` bytes for a value to be read into. A large one
/// asks for transparent huge pages before its first touch: filling fresh
/// memory is otherwise bound by 4 KiB page faults (about 1.5 GB/s here,
/// against 10+ GB/s for the copy itself).
pub(crate) fn zeroed(len: usize) -> Vec<u8> {
    let v = vec![0u8; len];
    if len >= HUGE {
        let start = (v.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
        let end = (v.as_ptr() as usize + len) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            // SAFETY: the range lies within `v`'s allocation; the advice
            // changes how pages are backed, never their contents. Failure
            // (no THP support) only costs speed.
            let _ = unsafe {
                rustix::mm::madvise(
                    start as *mut c_void,
                    end - start,
                    rustix::mm::Advice::LinuxHugepage,
                )
            };
        }
    }
    v
}

/// Memory a numpy array made by [`array_over`] keeps alive: bytes the
/// client read (freed with the last array over them).
#[pyclass(module = "stowage._native", frozen)]
pub(crate) struct OwnedBytes {
    ptr: NonNull<[u8]>,
}

// SAFETY: the bytes are only touched through numpy arrays (under the GIL)
// and freed in Drop; the pointer itself may move between threads.
unsafe impl Send for OwnedBytes {}
// SAFETY: as above; the struct has no interior state to share.
unsafe impl Sync for OwnedBytes {}

impl OwnedBytes {
    pub fn new(data: Vec<u8>) -> Self {
        let b: Box<[u8]> = data.into_boxed_slice();
        Self {
            ptr: NonNull::from(Box::leak(b)),
        }
    }

    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr() as *mut u8
    }
}

impl Drop for OwnedBytes {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from Box::leak in `new`; this is its only
        // release.
        drop(unsafe { Box::from_raw(self.ptr.as_ptr()) });
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
    let mut dims = shape
        .iter()
        .map(|&d| npy_intp::try_from(d).map_err(|_| invalid(format!("dimension {d} too large"))))
        .collect::<PyResult<Vec<npy_intp>>>()?;
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
        // Steals the reference to `base`.
        if PY_ARRAY_API.PyArray_SetBaseObject(
            py,
            arr.as_ptr() as *mut npyffi::PyArrayObject,
            base.into_ptr(),
        ) < 0
        {
            return Err(PyErr::fetch(py));
        }
        PY_ARRAY_API.PyArray_UpdateFlags(
            py,
            arr.as_ptr() as *mut npyffi::PyArrayObject,
            npyffi::NPY_ARRAY_UPDATE_ALL,
        );
        Ok(arr)
    }
}
