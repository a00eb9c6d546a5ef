//! Lists of 64-bit integers from Python, the one rule for every argument
//! that is a list of addresses, lengths or (later) block indices.
//!
//! `AddrList` extracts, as a `Vec<u64>`:
//!
//! - a `list` or `tuple` whose items are `int`s or objects with
//!   `__index__` (numpy integer scalars, 0-d integer arrays; pyo3 calls
//!   `PyNumber_Index`), checked one by one: an item that is no integer is a
//!   `TypeError` naming its position, a negative one or one over 2**64-1
//!   an `OverflowError`; a list of plain `int`s (what callers hold) is
//!   read in one pass through the C API, with no per-item PyO3 object;
//! - any other object exporting a C-contiguous, one-dimensional buffer of
//!   8-byte integers (numpy `int64`/`uint64` arrays, `array.array('q')`,
//!   memoryviews of them), copied in one pass with no Python per item;
//!   signed items must not be negative;
//! - a CPU torch tensor, through its `numpy()` view (no copy on torch's side).
//!
//! Anything else is a `TypeError` saying what is accepted, raised before
//! anything moves, so a caller can fall back to resolving buffer objects.
//! Floats are refused (no `__index__`): an address is never rounded.

use crate::buffer::{with_exported, RawBuffer, PYBUF_C_CONTIGUOUS, PYBUF_FORMAT};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use std::ffi::CStr;

/// A list of unsigned 64-bit integers (addresses, lengths, indices), from
/// any of the Python forms the module documentation lists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddrList(pub Vec<u64>);

/// How the items of a buffer of 8-byte integers read.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Signedness {
    Signed,
    Unsigned,
}

/// The struct-module format of a buffer's items, when they are native or
/// little-endian 8-byte integers (this module runs on little-endian hosts
/// only: x86_64 and aarch64).
fn integer_format(format: &str) -> Option<Signedness> {
    let code = format.strip_prefix(['@', '=', '<']).unwrap_or(format);
    match code {
        "q" | "l" => Some(Signedness::Signed),
        "Q" | "L" => Some(Signedness::Unsigned),
        _ => None,
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}

fn not_a_list(obj: &Bound<'_, PyAny>, why: &str) -> PyErr {
    PyTypeError::new_err(format!(
        "{} is not a list of integers ({why}): pass a list or tuple of ints, or a \
         C-contiguous 1-D array of 8-byte integers (numpy int64/uint64)",
        type_name(obj)
    ))
}

fn from_sequence(items: impl ExactSizeIterator<Item = PyResult<u64>>) -> PyResult<Vec<u64>> {
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        out.push(item?);
    }
    Ok(out)
}

fn item(i: usize, obj: Bound<'_, PyAny>) -> PyResult<u64> {
    obj.extract::<u64>().map_err(|e| {
        let py = obj.py();
        if e.is_instance_of::<PyOverflowError>(py) {
            PyOverflowError::new_err(format!(
                "item {i} ({}) is negative or above 2**64-1: not an address or a length",
                obj.repr()
                    .map(|r| r.to_string())
                    .unwrap_or_else(|_| "?".into())
            ))
        } else {
            PyTypeError::new_err(format!(
                "item {i} is a {}, not an integer (an int or an object with __index__)",
                type_name(&obj)
            ))
        }
    })
}

// `PyLong_AsUnsignedLong` returns all 64 bits on the hosts this module
// builds for (LP64: x86_64 and aarch64 Linux).
const _: () = assert!(std::mem::size_of::<std::os::raw::c_ulong>() == 8);

/// Which sequence [`exact_ints`] reads.
#[derive(Clone, Copy)]
enum Items {
    List,
    Tuple,
}

/// The items of a list or tuple in one pass through the C API, when every
/// one is an `int` from 0 to 2**64-1; `None` (no error set) at the first
/// that is not, for the checked path to convert and explain. No Python
/// code runs meanwhile (`PyLong_AsUnsignedLong` calls no `__index__`),
/// so the sequence cannot change under the pass. An item that is the same
/// object as the one before (`[4096] * n`) is not converted again.
fn exact_ints(seq: *mut ffi::PyObject, kind: Items) -> Option<Vec<u64>> {
    // SAFETY: `seq` is a live list or tuple (the caller cast it) and the
    // GIL is held for the whole pass; its size is read once and nothing
    // that runs here can change it.
    let len = unsafe {
        match kind {
            Items::List => ffi::PyList_Size(seq),
            Items::Tuple => ffi::PyTuple_Size(seq),
        }
    };
    let len = usize::try_from(len).ok()?;
    let mut out = spare(len);
    let (mut prev, mut prev_value): (*mut ffi::PyObject, u64) = (std::ptr::null_mut(), 0);
    for i in 0..len {
        // SAFETY: `i` is below the size read above, which no code run in
        // this loop changes (the GIL is held, no Python code runs); the
        // item is borrowed from the sequence, which holds it meanwhile.
        let item = unsafe {
            match kind {
                Items::List => ffi::PyList_GetItem(seq, i as ffi::Py_ssize_t),
                Items::Tuple => ffi::PyTuple_GetItem(seq, i as ffi::Py_ssize_t),
            }
        };
        if item.is_null() {
            // SAFETY: the GIL is held; the index error is dropped (the
            // checked path reads the sequence again).
            unsafe { ffi::PyErr_Clear() };
            return None;
        }
        if item == prev {
            out.push(prev_value);
            continue;
        }
        // SAFETY: `item` is a live object (borrowed above) and the GIL is
        // held. For an `int` this reads its value; for anything else it
        // sets a TypeError without calling into Python. (`unsigned long`,
        // 64 bits here (asserted below), rather than `unsigned long long`:
        // CPython before 3.13 converts the latter byte by byte.)
        let v: u64 = unsafe { ffi::PyLong_AsUnsignedLong(item) };
        // SAFETY: the GIL is held; (u64)-1 is also a valid value, so the
        // error indicator tells a failure apart, and is cleared.
        if v == u64::MAX && unsafe { !ffi::PyErr_Occurred().is_null() } {
            // SAFETY: the GIL is held.
            unsafe { ffi::PyErr_Clear() };
            return None;
        }
        out.push(v);
        (prev, prev_value) = (item, v);
    }
    Some(out)
}

/// The items of an exported buffer, checked to be a 1-D run of 8-byte
/// integers.
fn from_buffer(obj: &Bound<'_, PyAny>, view: &RawBuffer) -> PyResult<Vec<u64>> {
    let format = if view.format.is_null() {
        "B".to_string() // the buffer protocol's default: unsigned bytes
    } else {
        // SAFETY: a non-null format is a NUL-terminated string the exporter
        // keeps alive until the buffer is released (after this function).
        unsafe { CStr::from_ptr(view.format) }
            .to_string_lossy()
            .into_owned()
    };
    let sign = integer_format(&format)
        .filter(|_| view.itemsize == 8)
        .ok_or_else(|| not_a_list(obj, &format!("its items are {format:?}")))?;
    if view.ndim != 1 {
        return Err(not_a_list(
            obj,
            &format!(
                "it has {} dimensions; a list is one{}",
                view.ndim,
                if view.ndim == 0 {
                    " (a 0-d array is one number: pass it alone, or wrap it in a list)"
                } else {
                    ""
                }
            ),
        ));
    }
    let count = usize::try_from(view.len).unwrap_or(0) / 8;
    if count == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the exporter guarantees `len` readable bytes at `buf`, C
    // contiguous (requested with PYBUF_C_CONTIGUOUS), alive until the
    // release after this function; they are read as bytes (no alignment
    // needed) and copied out before the release.
    let bytes = unsafe { std::slice::from_raw_parts(view.buf as *const u8, count * 8) };
    let mut out = spare(count);
    // SAFETY: `out` has room for `count` items (spare reserved them) and
    // holds none, so its buffer takes `count * 8` bytes; `bytes` is that
    // long, and `out`'s buffer is this thread's own allocation, never the
    // exporter's.
    // Every bit pattern is a u64, so the items are initialized by the copy.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr() as *mut u8, count * 8);
        out.set_len(count);
    }
    // One pass for the sign bits (no branch per item), then the first
    // negative one for the message.
    if sign == Signedness::Signed && out.iter().fold(0, |a, v| a | v) >> 63 != 0 {
        let (i, v) = out
            .iter()
            .enumerate()
            .find(|(_, v)| (**v as i64) < 0)
            .map_or((0, 0), |(i, v)| (i, *v as i64));
        recycle(out);
        return Err(PyOverflowError::new_err(format!(
            "item {i} ({v}) is negative: not an address or a length"
        )));
    }
    Ok(out)
}

thread_local! {
    /// Lists' memory, kept for the thread's next extraction: two index
    /// arrays of 65,536 blocks are 1 MiB, which the allocator gave back
    /// to the system and faulted in afresh on every call (a third of the
    /// call's time on a development machine).
    static SPARE: std::cell::RefCell<Vec<Vec<u64>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Lists kept per thread (a call extracts up to three).
const SPARES: usize = 4;

/// Most items a kept list holds (128 MiB).
const SPARE_MAX: usize = 1 << 24;

/// An empty list with room for `n` items, reusing a kept one.
fn spare(n: usize) -> Vec<u64> {
    let mut v = SPARE
        .try_with(|s| s.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default();
    v.clear();
    v.reserve(n);
    v
}

/// Keeps a list's memory for this thread's next extraction.
pub fn recycle(v: Vec<u64>) {
    if v.capacity() == 0 || v.capacity() > SPARE_MAX {
        return;
    }
    let _ = SPARE.try_with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < SPARES {
            s.push(v);
        }
    });
}

impl<'py> FromPyObject<'_, 'py> for AddrList {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(list) = obj.cast::<PyList>() {
            if let Some(values) = exact_ints(obj.as_ptr(), Items::List) {
                return Ok(AddrList(values));
            }
            // A snapshot: items the list gains or loses meanwhile are not seen.
            let items: Vec<_> = list.iter().collect();
            return from_sequence(items.into_iter().enumerate().map(|(i, o)| item(i, o)))
                .map(AddrList);
        }
        if let Ok(tuple) = obj.cast::<PyTuple>() {
            if let Some(values) = exact_ints(obj.as_ptr(), Items::Tuple) {
                return Ok(AddrList(values));
            }
            return from_sequence(tuple.iter().enumerate().map(|(i, o)| item(i, o))).map(AddrList);
        }
        let obj = obj.to_owned();
        match with_exported(&obj, PYBUF_C_CONTIGUOUS | PYBUF_FORMAT, |v| {
            from_buffer(&obj, v)
        }) {
            Ok(result) => result.map(AddrList),
            Err(cause) => {
                // A CPU torch tensor exports no buffer; its numpy() view does
                // (and raises for GPU tensors, which hold no host list).
                if obj.hasattr("data_ptr")? && obj.hasattr("numpy")? {
                    let array = obj.call_method0("numpy").map_err(|e| {
                        let err = not_a_list(&obj, "a tensor that has no numpy() view");
                        err.set_cause(obj.py(), Some(e));
                        err
                    })?;
                    return array.extract::<AddrList>();
                }
                let err = not_a_list(&obj, "not a list, tuple or buffer");
                err.set_cause(obj.py(), cause);
                Err(err)
            }
        }
    }
}
