//! An engine: started and freed, its memory, the segments it opens.

use crate::boundary::{copy_text, invalid, obj, str_arg};
use crate::config::ferry_config;
use crate::types::*;
use ferry_core::{Engine, EngineConfig};
use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// An engine: registered memory, open segments, batches.
pub struct ferry_engine {
    pub(crate) inner: Engine,
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
        // SAFETY: ferry.h (ferry_engine_new) makes `config` NULL, giving None and the defaults,
        // or a live ferry_config from ferry_config_new, not consumed: only cloned in this call.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: the contract (ferry.h) makes the output buffer null or writable for its capacity,
        // and the length pointer null or valid: what copy_text needs.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        let location = if location.is_null() {
            None
        } else {
            // SAFETY: `location` is non-null (checked above) and ferry.h (ferry_register_memory)
            // makes it a "cpu:N"/"cuda:N" C string, NUL-terminated as str_arg needs.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: the contract (ferry.h) makes `name` null (str_arg refuses it) or NUL-terminated.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        // Only compared against registered memory, never dereferenced.
        let route = e.inner.route(segment, local as u64, remote_addr, len)?;
        // SAFETY: the contract (ferry.h) makes the output buffer null or writable for its capacity,
        // and the length pointer null or valid: what copy_text needs.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        unsafe { obj(engine, "engine")? }
            .inner
            .close_segment(segment)
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
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
