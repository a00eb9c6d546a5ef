//! libferry: Ferry's C API (`include/ferry.h`, generated from this file by
//! cbindgen and checked in; a test fails when they drift).
//!
//! Conventions, after rustls-ffi:
//! - every fallible function returns a `ferry_status_t` (FERRY_OK or a
//!   negative FERRY_ERR_* code, the same codes as ferry/plugin.h) and, on
//!   failure, leaves a message for `ferry_last_error()` on the calling thread;
//! - every exported body runs inside [`ffi_boundary!`], so a panic becomes
//!   FERRY_ERR_PANIC instead of unwinding into C;
//! - null pointers are checked and reported, never dereferenced;
//! - opaque handles come in `_new` / `_free` pairs; `_free(NULL)` is a no-op.

#![allow(non_camel_case_types)]

use ferry_core::batch::RequestStatus;
use ferry_core::{Engine, EngineConfig, Error, ErrorCode, Op, Request};
use ferry_plugins_abi::sys;
use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

/// A status code: FERRY_OK (0) or a negative FERRY_ERR_* from ferry/plugin.h.
pub type ferry_status_t = i32;
/// An open remote segment.
pub type ferry_segment_id = u64;
/// A batch of requests.
pub type ferry_batch_id = u64;

/// Engine options being gathered before `ferry_engine_new`.
pub struct ferry_config {
    inner: EngineConfig,
}

/// An engine: registered memory, open segments, batches.
pub struct ferry_engine {
    inner: Engine,
}

/// One transfer. `op` is FERRY_OP_READ (remote to local) or FERRY_OP_WRITE.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ferry_request {
    pub op: u32,
    /// Must be 0.
    pub reserved: u32,
    pub local_addr: *mut c_void,
    pub segment: ferry_segment_id,
    pub remote_addr: u64,
    pub length: u64,
}

/// The state of a batch.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ferry_batch_summary {
    /// Requests submitted so far.
    pub total: u64,
    pub completed: u64,
    pub failed: u64,
    pub pending: u64,
    /// Index of the first failed request, or -1.
    pub first_failed: i64,
    /// Its error code, or FERRY_OK.
    pub first_error: ferry_status_t,
    /// The batch's notification: FERRY_NOTIFY_NONE, _PENDING, _DELIVERED
    /// or _FAILED.
    pub notify: u32,
    /// Why the notification failed, or FERRY_OK.
    pub notify_error: ferry_status_t,
}

/// The batch carries no notification.
pub const FERRY_NOTIFY_NONE: u32 = 0;
/// Its requests are in flight, or the message is on its way.
pub const FERRY_NOTIFY_PENDING: u32 = 1;
/// The peer has it queued.
pub const FERRY_NOTIFY_DELIVERED: u32 = 2;
/// Not delivered (a request failed, so it was not sent; or the peer was
/// unreachable or its queue full): see notify_error.
pub const FERRY_NOTIFY_FAILED: u32 = 3;
/// Longest notification name, in bytes.
pub const FERRY_NOTIFY_NAME_MAX: usize = 256;
/// Longest notification message, in bytes.
pub const FERRY_NOTIFY_MSG_MAX: usize = 4096;
/// Longest sender name a received notification carries, in bytes.
pub const FERRY_NOTIFY_PEER_MAX: usize = 512;

/// Room for a sender name and its NUL.
pub const FERRY_NOTIFY_PEER_BUF: usize = 513;
/// Room for a notification name and its NUL.
pub const FERRY_NOTIFY_NAME_BUF: usize = 257;

/// A notification a peer sent (see `ferry_notify_next`). Strings are
/// NUL-terminated.
#[repr(C)]
pub struct ferry_notification {
    /// The sender's segment name.
    pub peer: [c_char; FERRY_NOTIFY_PEER_BUF],
    pub name: [c_char; FERRY_NOTIFY_NAME_BUF],
    pub msg: [u8; FERRY_NOTIFY_MSG_MAX],
    pub msg_len: usize,
}

const _: () = assert!(FERRY_NOTIFY_PEER_BUF == FERRY_NOTIFY_PEER_MAX + 1);
const _: () = assert!(FERRY_NOTIFY_NAME_BUF == FERRY_NOTIFY_NAME_MAX + 1);
const _: () = assert!(FERRY_NOTIFY_NAME_MAX == ferry_core::notify::MAX_NOTIFY_NAME);
const _: () = assert!(FERRY_NOTIFY_MSG_MAX == ferry_core::notify::MAX_NOTIFY_MSG);
const _: () = assert!(FERRY_NOTIFY_PEER_MAX == ferry_core::notify::MAX_NOTIFY_SENDER);

/// A request still in flight.
pub const FERRY_REQUEST_PENDING: u32 = 0;
/// A request that finished successfully.
pub const FERRY_REQUEST_COMPLETED: u32 = 1;
/// A request that failed; see its error code.
pub const FERRY_REQUEST_FAILED: u32 = 2;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// The report a ferry_info_json call could not fit, for the next call.
    static INFO_KEPT: RefCell<Option<String>> = const { RefCell::new(None) };
}

fn set_last_error(message: &str) {
    let c = ferry_plugins_abi::sdk::to_cstring_lossy(message);
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

fn fail(e: Error) -> ferry_status_t {
    set_last_error(&e.to_string());
    e.code.as_raw()
}

fn invalid(what: &str) -> Error {
    Error::new(ErrorCode::InvalidArgument, format!("{what} is NULL"))
}

/// Runs an exported function's body: clears the last error, turns `Err`
/// into its code (message kept for ferry_last_error) and a panic into
/// FERRY_ERR_PANIC. Every `extern "C"` function of this crate uses it.
macro_rules! ffi_boundary {
    ($body:expr) => {{
        LAST_ERROR.with(|l| *l.borrow_mut() = CString::default());
        let result: Result<(), Error> = match catch_unwind(AssertUnwindSafe(|| $body)) {
            Ok(r) => r,
            Err(_) => Err(Error::new(
                ErrorCode::Panic,
                "Ferry panicked inside this call (a bug; please report it)",
            )),
        };
        match result {
            Ok(()) => sys::FERRY_OK,
            Err(e) => fail(e),
        }
    }};
}

/// # Safety
/// `s` must be null or a NUL-terminated string.
unsafe fn str_arg<'a>(s: *const c_char, what: &str) -> Result<&'a str, Error> {
    if s.is_null() {
        return Err(invalid(what));
    }
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map_err(|_| Error::new(ErrorCode::InvalidArgument, format!("{what} is not UTF-8")))
}

/// # Safety
/// `p` must be null or point to a live `T`.
unsafe fn obj<'a, T>(p: *const T, what: &str) -> Result<&'a T, Error> {
    // SAFETY: null or live per the caller's contract.
    unsafe { p.as_ref() }.ok_or_else(|| invalid(what))
}

/// Copies `text` with a NUL into `buf` (`cap` bytes); `*len` gets its length
/// without the NUL. FERRY_ERR_NO_MEMORY when it does not fit (call again).
///
/// # Safety
/// `buf` null or writable for `cap` bytes; `len` null or valid.
unsafe fn copy_text(
    text: &str,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> Result<(), Error> {
    if !len.is_null() {
        // SAFETY: valid out-pointer per the contract.
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
        // SAFETY: per the contract.
        let config = unsafe { config.as_mut() }.ok_or_else(|| invalid("config"))?;
        // SAFETY: per the contract.
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
        // SAFETY: per the contract.
        let config = unsafe { obj(config, "config")? };
        // SAFETY: per the contract.
        let key = unsafe { str_arg(key, "key")? };
        let value = config.inner.get(key)?;
        // SAFETY: per the contract.
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

/// Starts an engine: loads plugins, starts transports and the control
/// listener. `config` may be NULL (defaults and environment).
///
/// # Safety
/// `config` NULL or from ferry_config_new (not consumed); `out` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_engine_new(
    config: *const ferry_config,
    out: *mut *mut ferry_engine,
) -> ferry_status_t {
    ffi_boundary!({
        ferry_core::init_logging();
        if out.is_null() {
            return Err(invalid("out"));
        }
        // SAFETY: null or valid per the contract.
        let config = match unsafe { config.as_ref() } {
            Some(c) => c.inner.clone(),
            None => EngineConfig::from_env()?,
        };
        let inner = Engine::new(config)?;
        // SAFETY: out checked non-null.
        unsafe { *out = Box::into_raw(Box::new(ferry_engine { inner })) };
        Ok(())
    })
}

/// Stops an engine; requests still in flight fail. NULL is ignored.
///
/// # Safety
/// `engine` from ferry_engine_new, not used afterwards by any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_engine_free(engine: *mut ferry_engine) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if !engine.is_null() {
            // SAFETY: created by Box::into_raw in ferry_engine_new.
            drop(unsafe { Box::from_raw(engine) });
        }
    }));
}

/// This engine's segment name ("host:port") for peers to open.
///
/// # Safety
/// `engine` valid; `buf` writable for `cap` bytes; `len` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_engine_segment_name(
    engine: *const ferry_engine,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: per the contract.
        unsafe { copy_text(e.inner.segment_name(), buf, cap, len) }
    })
}

/// Registers `[addr, addr + len)`. `location` is "cpu:N", "cuda:N", or NULL
/// to detect it.
///
/// # Safety
/// `engine` valid; the memory stays allocated until unregistered.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_register_memory(
    engine: *const ferry_engine,
    addr: *mut c_void,
    len: usize,
    location: *const c_char,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        let location = if location.is_null() {
            None
        } else {
            // SAFETY: non-null C string per the contract.
            Some(ferry_core::location::parse_location(unsafe {
                str_arg(location, "location")?
            })?)
        };
        e.inner.register_memory(addr as u64, len as u64, location)
    })
}

/// Allocates `len` bytes of host memory (on NUMA node `numa_node`, or -1
/// for any) and registers it. Same-host peers map such memory directly (shm),
/// which is the fastest way between processes of one host. Free it with
/// ferry_free_memory; what is left is freed with the engine.
///
/// # Safety
/// `engine` valid; `out` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_allocate_memory(
    engine: *const ferry_engine,
    len: usize,
    numa_node: i32,
    out: *mut *mut c_void,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        if out.is_null() {
            return Err(invalid("out"));
        }
        let addr = e
            .inner
            .allocate_memory(len as u64, u32::try_from(numa_node).ok())?;
        // SAFETY: checked non-null.
        unsafe { *out = addr as *mut c_void };
        Ok(())
    })
}

/// Unregisters and frees memory from ferry_allocate_memory.
///
/// # Safety
/// `engine` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_free_memory(
    engine: *const ferry_engine,
    addr: *mut c_void,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        unsafe { obj(engine, "engine")? }
            .inner
            .free_memory(addr as u64)
    })
}

/// Unregisters the buffer that starts at `addr` (after its transfers in
/// flight finish).
///
/// # Safety
/// `engine` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_unregister_memory(
    engine: *const ferry_engine,
    addr: *mut c_void,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        unsafe { obj(engine, "engine")? }
            .inner
            .unregister_memory(addr as u64)
    })
}

/// Opens a peer's segment by name ("host:port").
///
/// # Safety
/// `engine` valid; `name` a C string; `out` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_open_segment(
    engine: *const ferry_engine,
    name: *const c_char,
    out: *mut ferry_segment_id,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: per the contract.
        let name = unsafe { str_arg(name, "name")? };
        if out.is_null() {
            return Err(invalid("out"));
        }
        let id = e.inner.open_segment(name)?;
        // SAFETY: checked non-null.
        unsafe { *out = id };
        Ok(())
    })
}

/// Which transport would carry a request of `len` bytes from `local`
/// to `remote_addr` of segment `segment`, and why, as JSON: `transport`,
/// `scope`, `reason` (in words), `peer_detail`, `interface`, and
/// `estimate` (the cost model's `seconds`, `bandwidth_mbps`, `latency_ns`,
/// whether the figures were `declared`, the `device`, and the
/// `measured_bandwidth_mbps` / `measured_latency_ns` with their sample
/// counts, null when not measured).
///
/// # Safety
/// `engine` valid; `buf` writable for `cap` bytes; `out_len` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_route_json(
    engine: *const ferry_engine,
    segment: ferry_segment_id,
    local: *const c_void,
    remote_addr: u64,
    len: u64,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        // Only compared against registered memory, never dereferenced.
        let route = e.inner.route(segment, local as u64, remote_addr, len)?;
        // SAFETY: per the contract.
        unsafe { copy_text(&route.to_json(), buf, cap, out_len) }
    })
}

/// Closes a segment.
///
/// # Safety
/// `engine` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_close_segment(
    engine: *const ferry_engine,
    segment: ferry_segment_id,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        unsafe { obj(engine, "engine")? }
            .inner
            .close_segment(segment)
    })
}

/// A new batch with room for `capacity` requests.
///
/// # Safety
/// `engine` valid; `out` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_batch_new(
    engine: *const ferry_engine,
    capacity: usize,
    out: *mut ferry_batch_id,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        if out.is_null() {
            return Err(invalid("out"));
        }
        let id = e.inner.allocate_batch(capacity)?;
        // SAFETY: checked non-null.
        unsafe { *out = id };
        Ok(())
    })
}

fn to_requests(raw: &[ferry_request]) -> Result<Vec<Request>, Error> {
    raw.iter()
        .enumerate()
        .map(|(i, r)| {
            let op = match r.op {
                sys::FERRY_OP_READ => Op::Read,
                sys::FERRY_OP_WRITE => Op::Write,
                other => {
                    return Err(Error::new(
                        ErrorCode::InvalidArgument,
                        format!(
                            "request {i}: op {other} is neither FERRY_OP_READ nor FERRY_OP_WRITE"
                        ),
                    ))
                }
            };
            if r.reserved != 0 {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!("request {i}: reserved must be 0"),
                ));
            }
            Ok(Request::new(
                op,
                r.local_addr as u64,
                r.segment,
                r.remote_addr,
                r.length,
            ))
        })
        .collect()
}

/// # Safety
/// `requests` null (with count 0) or valid for `count` elements.
unsafe fn request_slice<'a>(
    requests: *const ferry_request,
    count: usize,
) -> Result<&'a [ferry_request], Error> {
    if count == 0 {
        return Ok(&[]);
    }
    if requests.is_null() {
        return Err(invalid("requests"));
    }
    // SAFETY: non-null and valid for count elements per the contract.
    Ok(unsafe { std::slice::from_raw_parts(requests, count) })
}

/// Adds requests to a batch and starts them. If any request is invalid,
/// nothing is submitted and the error names it.
///
/// # Safety
/// `engine` valid; `requests` valid for `count` elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_batch_submit(
    engine: *const ferry_engine,
    batch: ferry_batch_id,
    requests: *const ferry_request,
    count: usize,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: per the contract.
        let reqs = to_requests(unsafe { request_slice(requests, count)? })?;
        e.inner.submit(batch, &reqs)
    })
}

fn fill_status(s: &ferry_core::BatchStatus, out: Option<&mut ferry_batch_summary>) {
    use ferry_core::NotifyStatus;
    if let Some(out) = out {
        let (notify, notify_error) = match &s.notify {
            None => (FERRY_NOTIFY_NONE, sys::FERRY_OK),
            Some(NotifyStatus::Pending) => (FERRY_NOTIFY_PENDING, sys::FERRY_OK),
            Some(NotifyStatus::Delivered) => (FERRY_NOTIFY_DELIVERED, sys::FERRY_OK),
            Some(NotifyStatus::Failed(e)) => (FERRY_NOTIFY_FAILED, e.code.as_raw()),
        };
        *out = ferry_batch_summary {
            total: s.total as u64,
            completed: s.completed as u64,
            failed: s.failed as u64,
            pending: s.pending as u64,
            first_failed: s.first_error.as_ref().map_or(-1, |(i, _)| *i as i64),
            first_error: s
                .first_error
                .as_ref()
                .map_or(sys::FERRY_OK, |(_, e)| e.code.as_raw()),
            notify,
            notify_error,
        };
    }
}

fn status_result(s: &ferry_core::BatchStatus) -> Result<(), Error> {
    match (&s.first_error, &s.notify) {
        (Some((i, e)), _) => Err(Error::new(e.code, format!("request {i}: {}", e.message))),
        (None, Some(ferry_core::NotifyStatus::Failed(e))) => Err(e.clone()),
        _ => Ok(()),
    }
}

/// The batch's state now. Returns FERRY_OK even when requests failed: look
/// at `out`.
///
/// # Safety
/// `engine` valid; `out` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_batch_status(
    engine: *const ferry_engine,
    batch: ferry_batch_id,
    out: *mut ferry_batch_summary,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: null or valid per the contract.
        let out = unsafe { out.as_mut() }.ok_or_else(|| invalid("out"))?;
        fill_status(&e.inner.batch_status(batch)?, Some(out));
        Ok(())
    })
}

/// One request's state (FERRY_REQUEST_PENDING / _COMPLETED / _FAILED) and,
/// when failed, its error code (else FERRY_OK). The message of a failed
/// request is available from ferry_last_error() after this call.
///
/// # Safety
/// `engine` valid; `state` and `error` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_batch_request_status(
    engine: *const ferry_engine,
    batch: ferry_batch_id,
    index: usize,
    state: *mut u32,
    error: *mut ferry_status_t,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        if state.is_null() || error.is_null() {
            return Err(invalid("state or error"));
        }
        let (st, code) = match e.inner.request_status(batch, index)? {
            RequestStatus::Pending => (FERRY_REQUEST_PENDING, sys::FERRY_OK),
            RequestStatus::Completed => (FERRY_REQUEST_COMPLETED, sys::FERRY_OK),
            RequestStatus::Failed(err) => {
                set_last_error(&err.to_string());
                (FERRY_REQUEST_FAILED, err.code.as_raw())
            }
        };
        // SAFETY: both checked non-null.
        unsafe {
            *state = st;
            *error = code;
        }
        Ok(())
    })
}

/// Waits up to `timeout_ms` (-1: the engine's timeout) for the batch.
/// Returns FERRY_OK when every request succeeded, FERRY_ERR_TIMEOUT when some
/// are still pending, else the first failed request's code (its message in
/// ferry_last_error). `out` (may be NULL) gets the state either way.
///
/// # Safety
/// `engine` valid; `out` NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_batch_wait(
    engine: *const ferry_engine,
    batch: ferry_batch_id,
    timeout_ms: i64,
    out: *mut ferry_batch_summary,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        let timeout = if timeout_ms < 0 {
            e.inner.config().timeout * 2
        } else {
            Duration::from_millis(timeout_ms as u64)
        };
        let s = e.inner.wait(batch, timeout)?;
        // SAFETY: null or valid per the contract.
        fill_status(&s, unsafe { out.as_mut() });
        if !s.is_done() {
            return Err(Error::new(
                ErrorCode::Timeout,
                match s.pending {
                    0 => "the batch's notification is still on its way".to_string(),
                    n => format!("{n} of {} requests still pending", s.total),
                },
            ));
        }
        status_result(&s)
    })
}

/// The notification `name` (NUL-terminated, at most FERRY_NOTIFY_NAME_MAX
/// bytes) with `msg_len` bytes of `msg` (at most FERRY_NOTIFY_MSG_MAX;
/// `msg` may be NULL when msg_len is 0).
///
/// # Safety
/// `name` NULL or NUL-terminated; `msg` valid for `msg_len` bytes.
unsafe fn to_notify(
    name: *const c_char,
    msg: *const u8,
    msg_len: usize,
) -> Result<ferry_core::Notify, Error> {
    // SAFETY: per the contract.
    let name = unsafe { str_arg(name, "name")? };
    let msg: &[u8] = if msg_len == 0 {
        &[]
    } else if msg.is_null() {
        return Err(invalid("msg"));
    } else {
        if msg_len > FERRY_NOTIFY_MSG_MAX {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!(
                    "a notification's message is at most {FERRY_NOTIFY_MSG_MAX} bytes, not \
                     {msg_len}"
                ),
            ));
        }
        // SAFETY: non-null and valid for msg_len bytes per the contract.
        unsafe { std::slice::from_raw_parts(msg, msg_len) }
    };
    ferry_core::Notify::new(name, msg)
}

/// Like ferry_batch_submit, and attaches a notification: the requests' peer
/// (they must all name one segment) receives it once every request of the
/// batch has finished with its data in the peer's memory, never before. The
/// batch then takes no more requests and stays pending until the message
/// was delivered or failed (`notify` in ferry_batch_summary); if a request
/// fails, the message is not sent. The peer takes it with
/// ferry_notify_next.
///
/// # Safety
/// `engine` valid; `requests` valid for `count` elements; `name`
/// NUL-terminated; `msg` valid for `msg_len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_batch_submit_with_notify(
    engine: *const ferry_engine,
    batch: ferry_batch_id,
    requests: *const ferry_request,
    count: usize,
    name: *const c_char,
    msg: *const u8,
    msg_len: usize,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: per the contract.
        let reqs = to_requests(unsafe { request_slice(requests, count)? })?;
        // SAFETY: per the contract.
        let notify = unsafe { to_notify(name, msg, msg_len)? };
        e.inner.submit_with_notify(batch, &reqs, notify)
    })
}

/// Sends a notification alone to an open segment and waits until the peer
/// has it queued (or it failed).
///
/// # Safety
/// `engine` valid; `name` NUL-terminated; `msg` valid for `msg_len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_notify_send(
    engine: *const ferry_engine,
    segment: ferry_segment_id,
    name: *const c_char,
    msg: *const u8,
    msg_len: usize,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: per the contract.
        let notify = unsafe { to_notify(name, msg, msg_len)? };
        e.inner.send_notify(segment, notify)
    })
}

/// Takes the oldest notification peers sent: `*got` is 1 and `out` filled,
/// or 0 when none waits. At most 1024 wait; past that a peer's new one is
/// refused (its batch reports FERRY_ERR_BUSY) and counted
/// (ferry_notifies_dropped).
///
/// # Safety
/// `engine` valid; `out` and `got` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_notify_next(
    engine: *const ferry_engine,
    out: *mut ferry_notification,
    got: *mut u32,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        if out.is_null() || got.is_null() {
            return Err(invalid("out or got"));
        }
        let Some(n) = e.inner.take_notify() else {
            // SAFETY: checked non-null.
            unsafe { *got = 0 };
            return Ok(());
        };
        let mut filled = ferry_notification {
            peer: [0; FERRY_NOTIFY_PEER_BUF],
            name: [0; FERRY_NOTIFY_NAME_BUF],
            msg: [0; FERRY_NOTIFY_MSG_MAX],
            msg_len: 0,
        };
        fill_c_string(&mut filled.peer, &n.peer);
        fill_c_string(&mut filled.name, &n.name);
        let len = n.msg.len().min(FERRY_NOTIFY_MSG_MAX);
        filled.msg[..len].copy_from_slice(&n.msg[..len]);
        filled.msg_len = len;
        // SAFETY: both checked non-null and valid per the contract; the
        // caller's struct may be uninitialized, so it is written whole.
        unsafe {
            out.write(filled);
            *got = 1;
        }
        Ok(())
    })
}

/// Copies `text` into `buf` with a NUL, cut to fit.
fn fill_c_string(buf: &mut [c_char], text: &str) {
    let n = text.len().min(buf.len().saturating_sub(1));
    for (d, s) in buf.iter_mut().zip(&text.as_bytes()[..n]) {
        *d = *s as c_char;
    }
    if let Some(end) = buf.get_mut(n) {
        *end = 0;
    }
}

/// How many notifications peers sent that this engine refused because its
/// queue was full, since it started.
///
/// # Safety
/// `engine` valid; `out` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_notifies_dropped(
    engine: *const ferry_engine,
    out: *mut u64,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        if out.is_null() {
            return Err(invalid("out"));
        }
        // SAFETY: checked non-null.
        unsafe { *out = e.inner.notifies_dropped() };
        Ok(())
    })
}

/// The buffer an open segment registered first (of those it publishes; by
/// registration order, not address): `*addr` and `*len`, or 0 and 0 when it
/// publishes none.
///
/// # Safety
/// `engine` valid; `addr` and `len` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_segment_first_buffer(
    engine: *const ferry_engine,
    segment: ferry_segment_id,
    addr: *mut u64,
    len: *mut u64,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        if addr.is_null() || len.is_null() {
            return Err(invalid("addr or len"));
        }
        let (a, l) = e.inner.first_buffer(segment)?.unwrap_or((0, 0));
        // SAFETY: both checked non-null.
        unsafe {
            *addr = a;
            *len = l;
        }
        Ok(())
    })
}

/// Frees a batch whose requests have all finished (FERRY_ERR_BUSY if not).
///
/// # Safety
/// `engine` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_batch_free(
    engine: *const ferry_engine,
    batch: ferry_batch_id,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        unsafe { obj(engine, "engine")? }.inner.free_batch(batch)
    })
}

/// Submits `requests` as one batch and waits for them; the first failure
/// is the result.
///
/// # Safety
/// `engine` valid; `requests` valid for `count` elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_transfer_sync(
    engine: *const ferry_engine,
    requests: *const ferry_request,
    count: usize,
) -> ferry_status_t {
    ffi_boundary!({
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: per the contract.
        let reqs = to_requests(unsafe { request_slice(requests, count)? })?;
        e.inner.transfer_sync(&reqs)
    })
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
        // SAFETY: per the contract.
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
        // SAFETY: per the contract.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: per the contract.
        unsafe { copy_text(&e.inner.metrics_json(), buf, cap, len) }
    })
}
