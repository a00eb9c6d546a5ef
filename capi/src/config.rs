//! Engine options: gathered, read back and freed before an engine starts.

use crate::boundary::{copy_text, invalid, obj, str_arg};
use crate::types::*;
use ferry_core::EngineConfig;
use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Engine options being gathered before `ferry_engine_new`.
pub struct ferry_config {
    pub(crate) inner: EngineConfig,
}

/// New options with the defaults and the FERRY_* environment applied. A
/// FERRY_* value that a setting does not accept is the error
/// (FERRY_ERR_INVALID_ARGUMENT; ferry_last_error names the variable and
/// why), never replaced by the default.
///
/// # Safety
/// `out` must be a valid pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_config_new(out: *mut *mut ferry_config) -> ferry_status_t {
    ffi_boundary!({
        ferry_core::init_logging();
        if out.is_null() {
            return Err(invalid("out"));
        }
        let inner = EngineConfig::from_env()?;
        // SAFETY: out is a valid pointer (checked non-null above).
        unsafe { *out = Box::into_raw(Box::new(ferry_config { inner })) };
        Ok(())
    })
}

/// Sets an option by its key (docs/configuration.md lists them; each is
/// also a FERRY_* variable): `listen` ("0.0.0.0:7000"), `timeout_ms`,
/// `gpu_direct` ("auto", "dmabuf", "peermem", "off"), `staging_chunk`
/// ("4M"), `transports` ("tcp,shm" or "^rdma"), ..., or a plugin setting
/// such as `tcp.connections`. A value the key does not accept is rejected
/// with FERRY_ERR_INVALID_ARGUMENT and the reason (ferry_last_error), and
/// the options are left as they were.
///
/// # Safety
/// `config` from ferry_config_new; `key` and `value` NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_config_set(
    config: *mut ferry_config,
    key: *const c_char,
    value: *const c_char,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: `config` is null (refused below) or a handle from ferry_config_new not yet freed,
        // used by one thread at a time: this function's contract in ferry.h.
        let config = unsafe { config.as_mut() }.ok_or_else(|| invalid("config"))?;
        // SAFETY: the contract (ferry.h) makes `key` and `value` null (refused) or NUL-terminated.
        let (key, value) = unsafe { (str_arg(key, "key")?, str_arg(value, "value")?) };
        config.inner.set(key, value)
    })
}

/// An option's value as text, in the form ferry_config_set accepts
/// (secrets such as `auth_token` read "(set)"; unset options are empty).
/// FERRY_ERR_NOT_FOUND for an unknown key; FERRY_ERR_NO_MEMORY when `buf`
/// is too small (`*len` has the length; call again).
///
/// # Safety
/// `config` from ferry_config_new; `key` a NUL-terminated string; `buf`
/// writable for `cap` bytes; `len` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_config_get(
    config: *const ferry_config,
    key: *const c_char,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: `config` is null (obj refuses it) or a handle from ferry_config_new not yet
        // freed: this function's contract in ferry.h.
        let config = unsafe { obj(config, "config")? };
        // SAFETY: the contract (ferry.h) makes `key` null (str_arg refuses it) or NUL-terminated.
        let key = unsafe { str_arg(key, "key")? };
        let value = config.inner.get(key)?;
        // SAFETY: the contract (ferry.h) makes the output buffer null or writable for its capacity,
        // and the length pointer null or valid: what copy_text needs.
        unsafe { copy_text(&value, buf, cap, len) }
    })
}

/// Frees options; NULL is ignored.
///
/// # Safety
/// `config` from ferry_config_new, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_config_free(config: *mut ferry_config) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if !config.is_null() {
            // SAFETY: created by Box::into_raw in ferry_config_new.
            drop(unsafe { Box::from_raw(config) });
        }
    }));
}
