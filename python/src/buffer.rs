//! The buffer protocol for objects such as numpy arrays, bytearray, mmap
//! and memoryview: their address and size, with the export held for as long
//! as the view lives, so the memory can neither move nor be freed (a
//! bytearray refuses to resize while exported) while Ferry may touch it.
//!
//! pyo3 offers the buffer protocol only under the limited API of 3.11+, and
//! this module is abi3 for 3.9+. `Py_buffer`, `PyObject_GetBuffer` and
//! `PyBuffer_Release` are exported by every CPython 3 with the layout below
//! (unchanged since 3.3, and frozen into the stable ABI as of 3.11), so they
//! are declared here.

use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use std::os::raw::{c_char, c_int, c_void};

/// CPython's `Py_buffer`.
#[repr(C)]
pub(crate) struct RawBuffer {
    pub(crate) buf: *mut c_void,
    pub(crate) obj: *mut ffi::PyObject,
    pub(crate) len: ffi::Py_ssize_t,
    pub(crate) itemsize: ffi::Py_ssize_t,
    pub(crate) readonly: c_int,
    pub(crate) ndim: c_int,
    pub(crate) format: *mut c_char,
    pub(crate) shape: *mut ffi::Py_ssize_t,
    pub(crate) strides: *mut ffi::Py_ssize_t,
    pub(crate) suboffsets: *mut ffi::Py_ssize_t,
    pub(crate) internal: *mut c_void,
}

const PYBUF_WRITABLE: c_int = 0x0001;
pub(crate) const PYBUF_FORMAT: c_int = 0x0004;
const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;
pub(crate) const PYBUF_C_CONTIGUOUS: c_int = 0x0020 | PYBUF_STRIDES;

// SAFETY: the signatures are CPython's (Include/pybuffer.h); the symbols
// are resolved from the interpreter that loads this module.
unsafe extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

fn empty_view() -> Box<RawBuffer> {
    Box::new(RawBuffer {
        buf: std::ptr::null_mut(),
        obj: std::ptr::null_mut(),
        len: 0,
        itemsize: 0,
        readonly: 0,
        ndim: 0,
        format: std::ptr::null_mut(),
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        suboffsets: std::ptr::null_mut(),
        internal: std::ptr::null_mut(),
    })
}

/// Exports `obj`'s buffer with `flags` (PYBUF_*), runs `f` on it while
/// attached, and releases the export before returning. `Err(None)` when
/// `obj` is not an exporter or refuses `flags` (Python's exception taken
/// and returned as the `Some` of the outer error's cause).
pub(crate) fn with_exported<R>(
    obj: &Bound<'_, PyAny>,
    flags: c_int,
    f: impl FnOnce(&RawBuffer) -> PyResult<R>,
) -> Result<PyResult<R>, Option<PyErr>> {
    let mut view = empty_view();
    // SAFETY: `obj` is a live object (borrowed for the call); `view` points
    // to writable memory laid out as Py_buffer; holding a `Bound` proves we
    // are attached to the interpreter.
    let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
    if rc != 0 {
        return Err(PyErr::take(obj.py()));
    }
    let result = f(&view);
    // SAFETY: `view` was filled by the successful PyObject_GetBuffer above
    // and is released exactly once, still attached.
    unsafe { PyBuffer_Release(&mut *view) };
    Ok(result)
}

/// An exported buffer, released exactly once.
struct Held(Box<RawBuffer>);

// SAFETY: the struct is plain data (pointers the exporter owns); it is only
// read or released while attached to the interpreter (release below), which
// serialises every access the exporter could observe.
unsafe impl Send for Held {}

impl Held {
    fn release(self) {
        let mut view = self.0;
        // During interpreter shutdown there is no one left to release to.
        Python::try_attach(|_py| {
            // SAFETY: `view` was filled by a successful PyObject_GetBuffer
            // and is released once (we own it by value); we are attached.
            unsafe { PyBuffer_Release(&mut *view) };
        });
    }
}

/// A C-contiguous buffer exported by `obj` (buffer protocol), held until
/// `release()` or until this view is collected.
#[pyclass(name = "BufferView", module = "ferry", frozen)]
pub struct BufferView {
    held: parking_lot::Mutex<Option<Held>>,
    #[pyo3(get)]
    addr: u64,
    #[pyo3(get)]
    nbytes: u64,
    #[pyo3(get)]
    readonly: bool,
    /// The exporting object, kept alive with the view.
    #[pyo3(get)]
    obj: Py<PyAny>,
}

#[pymethods]
impl BufferView {
    /// Exports `obj`'s buffer; `writable=True` refuses read-only buffers
    /// (anything Ferry will write into: a read's destination, registered
    /// memory peers write).
    #[new]
    #[pyo3(signature = (obj, writable = false))]
    fn new(py: Python<'_>, obj: Bound<'_, PyAny>, writable: bool) -> PyResult<Self> {
        let mut view = empty_view();
        let flags = PYBUF_C_CONTIGUOUS | if writable { PYBUF_WRITABLE } else { 0 };
        // SAFETY: `obj` is a live object (we hold a reference for the call);
        // `view` points to writable memory laid out as Py_buffer; we are
        // attached to the interpreter.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if rc != 0 {
            let cause = PyErr::take(py);
            // Not an exporter at all: a TypeError, as Python raises it.
            if let Some(c) = cause
                .as_ref()
                .filter(|c| c.is_instance_of::<PyTypeError>(py))
            {
                return Err(c.clone_ref(py));
            }
            let what = obj
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "object".into());
            let err = PyBufferError::new_err(format!(
                "{what} does not export a C-contiguous{} buffer",
                if writable { ", writable" } else { "" }
            ));
            err.set_cause(py, cause);
            return Err(err);
        }
        let (addr, len, readonly) = (view.buf as u64, view.len, view.readonly != 0);
        Ok(BufferView {
            held: parking_lot::Mutex::new(Some(Held(view))),
            addr,
            nbytes: u64::try_from(len).unwrap_or(0),
            readonly,
            obj: obj.unbind(),
        })
    }

    /// Releases the export now (idempotent); the address is not to be used
    /// afterwards.
    fn release(&self) {
        if let Some(h) = self.held.lock().take() {
            h.release();
        }
    }

    /// True until `release()`.
    #[getter]
    fn held(&self) -> bool {
        self.held.lock().is_some()
    }

    fn __repr__(&self) -> String {
        format!(
            "BufferView(addr={:#x}, nbytes={}, readonly={}, held={})",
            self.addr,
            self.nbytes,
            self.readonly,
            self.held()
        )
    }
}

impl Drop for BufferView {
    fn drop(&mut self) {
        if let Some(h) = self.held.get_mut().take() {
            h.release();
        }
    }
}
