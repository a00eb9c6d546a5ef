//! Batches: requests checked and submitted, their state, waiting, freeing,
//! and the one-call synchronous transfer.

use crate::boundary::{invalid, obj, set_last_error};
use crate::engine::ferry_engine;
use crate::types::*;
use ferry_core::batch::RequestStatus;
use ferry_core::{Error, ErrorCode};
use ferry_core::{Op, Request};
use ferry_plugins_abi::sys;
use std::time::Duration;

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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
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

/// The engine's requests for the `count` C requests at `requests`, each
/// checked.
///
/// # Safety
/// `requests` null (with count 0) or valid for `count` elements.
pub(crate) unsafe fn requests_arg(
    requests: *const ferry_request,
    count: usize,
) -> Result<Vec<Request>, Error> {
    if count == 0 {
        return Ok(Vec::new());
    }
    if requests.is_null() {
        return Err(invalid("requests"));
    }
    // SAFETY: count > 0 and `requests` is non-null (both checked above), so the `# Safety`
    // section makes it valid for `count` ferry_request reads (aligned, as a C `const struct
    // ferry_request *` is): its callers ferry_batch_submit, ferry_transfer_sync and
    // ferry_batch_submit_with_notify pass the array ferry.h declares "valid for `count`
    // elements", and to_requests copies out of the slice before we return.
    to_requests(unsafe { std::slice::from_raw_parts(requests, count) })
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: the contract (ferry.h) makes `requests` null with count 0, or valid for `count`
        // requests: what requests_arg needs.
        let reqs = unsafe { requests_arg(requests, count)? };
        e.inner.submit(batch, &reqs)
    })
}

/// The C view of a batch's state. Callers store it with `ptr::write`: the
/// caller's struct may be uninitialised, which a `&mut` must never point at.
fn summary(s: &ferry_core::BatchStatus) -> ferry_batch_summary {
    use ferry_core::NotifyStatus;
    let (notify, notify_error) = match &s.notify {
        None => (FERRY_NOTIFY_NONE, sys::FERRY_OK),
        Some(NotifyStatus::Pending) => (FERRY_NOTIFY_PENDING, sys::FERRY_OK),
        Some(NotifyStatus::Delivered) => (FERRY_NOTIFY_DELIVERED, sys::FERRY_OK),
        Some(NotifyStatus::Failed(e)) => (FERRY_NOTIFY_FAILED, e.code.as_raw()),
    };
    ferry_batch_summary {
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        if out.is_null() {
            return Err(invalid("out"));
        }
        let s = summary(&e.inner.batch_status(batch)?);
        // SAFETY: `out` is non-null (checked above) and ferry.h's ferry_batch_status makes it
        // writable for one ferry_batch_summary; `write` neither reads nor drops what was there,
        // so an uninitialised struct is fine.
        unsafe { out.write(s) };
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        let timeout = if timeout_ms < 0 {
            e.inner.config().timeout * 2
        } else {
            Duration::from_millis(timeout_ms as u64)
        };
        let s = e.inner.wait(batch, timeout)?;
        if !out.is_null() {
            // SAFETY: non-null, so ferry.h (ferry_batch_wait) makes `out` writable for one
            // ferry_batch_summary; `write` neither reads nor drops what was there.
            unsafe { out.write(summary(&s)) };
        }
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: the contract (ferry.h) makes `requests` null with count 0, or valid for `count`
        // requests: what requests_arg needs.
        let reqs = unsafe { requests_arg(requests, count)? };
        e.inner.transfer_sync(&reqs)
    })
}
