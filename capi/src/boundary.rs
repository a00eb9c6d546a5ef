//! The call boundary: the last error of each thread, the status codes,
//! and the checks every exported function makes on what C hands it.

use crate::types::ferry_status_t;
use ferry_core::{Error, ErrorCode};
use ferry_plugins_abi::sys;
use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub(crate) fn set_last_error(message: &str) {
    let c = ferry_plugins_abi::sdk::to_cstring_lossy(message);
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

pub(crate) fn fail(e: Error) -> ferry_status_t {
    set_last_error(&e.to_string());
    e.code.as_raw()
}

pub(crate) fn invalid(what: &str) -> Error {
    Error::new(ErrorCode::InvalidArgument, format!("{what} is NULL"))
}

/// Runs an exported function's body: clears the last error, turns `Err`
/// into its code (message kept for ferry_last_error) and a panic into
/// FERRY_ERR_PANIC. Every `extern "C"` function of this crate uses it.
macro_rules! ffi_boundary {
    ($body:expr) => {{
        $crate::boundary::clear_last_error();
        $crate::boundary::status(::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(
            || $body,
        )))
    }};
}

pub(crate) fn clear_last_error() {
    LAST_ERROR.with(|l| *l.borrow_mut() = CString::default());
}

/// The status of a body `ffi_boundary!` ran: FERRY_OK, its error's code, or
/// FERRY_ERR_PANIC.
pub(crate) fn status(ran: std::thread::Result<Result<(), Error>>) -> ferry_status_t {
    match ran {
        Ok(Ok(())) => sys::FERRY_OK,
        Ok(Err(e)) => fail(e),
        Err(_) => fail(Error::new(
            ErrorCode::Panic,
            "Ferry panicked inside this call (a bug; please report it)",
        )),
    }
}

/// # Safety
/// `s` must be null or a NUL-terminated string.
pub(crate) unsafe fn str_arg<'a>(s: *const c_char, what: &str) -> Result<&'a str, Error> {
    if s.is_null() {
        return Err(invalid(what));
    }
    // SAFETY: `s` is non-null (checked above), so the `# Safety` section makes it a
    // NUL-terminated string, readable through its NUL: what ferry.h asks of every `const char *`
    // argument (ferry_config_set's key and value, ferry_open_segment's name, ...). Every caller
    // drops the `&'a str` before its exported function returns, while the string still lives.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map_err(|_| Error::new(ErrorCode::InvalidArgument, format!("{what} is not UTF-8")))
}

/// # Safety
/// `p` must be null or point to a live `T`.
pub(crate) unsafe fn obj<'a, T>(p: *const T, what: &str) -> Result<&'a T, Error> {
    // SAFETY: the `# Safety` section makes `p` null (as_ref gives None: refused) or a live,
    // aligned `T`: a handle from ferry_engine_new or ferry_config_new not yet freed, as ferry.h
    // requires of every `engine`/`config` argument. Callers use the `&'a T` only inside their
    // exported call, and ferry_engine_free/ferry_config_free demand the handle be "not used
    // afterwards" (ferry.h), so it outlives that use.
    unsafe { p.as_ref() }.ok_or_else(|| invalid(what))
}

/// Copies `text` with a NUL into `buf` (`cap` bytes); `*len` gets its length
/// without the NUL. FERRY_ERR_NO_MEMORY when it does not fit (call again).
///
/// # Safety
/// `buf` null or writable for `cap` bytes; `len` null or valid.
pub(crate) unsafe fn copy_text(
    text: &str,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> Result<(), Error> {
    if !len.is_null() {
        // SAFETY: `len` is non-null (checked just above), and the `# Safety` section's second
        // requirement ("`len` null or valid") makes it an aligned, writable size_t: callers pass
        // the `len`/`out_len` that ferry.h's ferry_*_json, ferry_config_get and
        // ferry_engine_segment_name declare "NULL or valid".
        unsafe { *len = text.len() };
    }
    if buf.is_null() || cap <= text.len() {
        return Err(Error::new(
            ErrorCode::NoMemory,
            format!("the buffer needs {} bytes (with the NUL)", text.len() + 1),
        ));
    }
    // SAFETY: buf holds at least text.len() + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
        *buf.add(text.len()) = 0;
    }
    Ok(())
}

/// The message of the most recent call on this thread that failed (empty
/// after a call that succeeded). Valid until the next Ferry call on this
/// thread; never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_last_error() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// "FERRY_OK", "FERRY_ERR_TIMEOUT", ... for a status code; never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_status_name(status: ferry_status_t) -> *const c_char {
    // Built once from the one table of names (ErrorCode::name, shared with
    // Python's error_codes() and every message), so they cannot drift.
    static NAMES: std::sync::OnceLock<Vec<(ferry_status_t, CString)>> = std::sync::OnceLock::new();
    let names = NAMES.get_or_init(|| {
        std::iter::once((sys::FERRY_OK, c"FERRY_OK".to_owned()))
            .chain(ErrorCode::ALL.iter().map(|c| {
                (
                    c.as_raw(),
                    ferry_plugins_abi::sdk::to_cstring_lossy(&format!("FERRY_ERR_{}", c.name())),
                )
            }))
            .collect()
    });
    names
        .iter()
        .find(|(code, _)| *code == status)
        .map_or(c"FERRY_ERR_UNKNOWN".as_ptr(), |(_, name)| name.as_ptr())
}
