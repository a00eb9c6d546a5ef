//! What this process has: the version, `ferry info --json`, the metrics.

use crate::boundary::{copy_text, obj};
use crate::engine::ferry_engine;
use crate::types::*;
use ferry_core::ErrorCode;
use std::cell::RefCell;
use std::ffi::{c_char, CStr};

thread_local! {
    /// The report a ferry_info_json call could not fit, for the next call.
    static INFO_KEPT: RefCell<Option<String>> = const { RefCell::new(None) };
}
/// Ferry's version, "0.1.0"; never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_version() -> *const c_char {
    static VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(v) => v,
            Err(_) => c"unknown",
        };
    VERSION.as_ptr()
}

/// `ferry info --json` for this process, from the same function as the CLI
/// and Python's `ferry.info()`: the settings in effect (FERRY_* variables),
/// the plugin search path, every plugin with its state and reason, GPUs and
/// how their memory is registered. A FERRY_* value that is rejected is the
/// error (FERRY_ERR_INVALID_ARGUMENT, the reason in ferry_last_error).
/// A call answered FERRY_ERR_NO_MEMORY (`buf` too small, `*len` set) keeps
/// its report for the next call on this thread, so the length it gave fits
/// (plugins may report differently a moment later).
///
/// # Safety
/// `buf` writable for `cap` bytes; `len` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_info_json(
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> ferry_status_t {
    ffi_boundary!({
        ferry_core::init_logging();
        let kept = INFO_KEPT.with(|k| k.borrow_mut().take());
        let text = match kept {
            Some(text) => text,
            None => ferry_core::info::report_from_env(false)?.to_json_text(false)?,
        };
        // SAFETY: the contract (ferry.h) makes the output buffer null or writable for its capacity,
        // and the length pointer null or valid: what copy_text needs.
        let copied = unsafe { copy_text(&text, buf, cap, len) };
        if copied
            .as_ref()
            .is_err_and(|e| e.code == ErrorCode::NoMemory)
        {
            INFO_KEPT.with(|k| *k.borrow_mut() = Some(text));
        }
        copied
    })
}

/// The engine's metrics as JSON: bytes and requests per transport, local
/// device, peer and op; failures by error code; latency histograms; staged
/// traffic; route changes; registered memory; plugins' counters (the same
/// data as the Prometheus endpoint, FERRY_METRICS_LISTEN). Like the other
/// text calls: `*len` gets the full length; FERRY_ERR_NO_MEMORY when `cap`
/// is too small. The counters are live, so the text can grow between a
/// call that asks for the length and the next: on FERRY_ERR_NO_MEMORY,
/// call again with the new `*len` (examples/c/initiator.c).
///
/// # Safety
/// `engine` valid; `buf` writable for `cap` bytes; `len` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_metrics_json(
    engine: *const ferry_engine,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: the contract (ferry.h) makes the output buffer null or writable for its capacity,
        // and the length pointer null or valid: what copy_text needs.
        unsafe { copy_text(&e.inner.metrics_json(), buf, cap, len) }
    })
}
