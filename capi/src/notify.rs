//! Notifications: sent after a batch's data or alone, and received.

use crate::batch::requests_arg;
use crate::boundary::{invalid, obj, str_arg};
use crate::engine::ferry_engine;
use crate::types::*;
use ferry_core::{Error, ErrorCode};
use std::ffi::c_char;

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
    // SAFETY: the contract (ferry.h) makes `name` null (str_arg refuses it) or NUL-terminated.
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
        // SAFETY: `msg` is non-null and msg_len in 1..=FERRY_NOTIFY_MSG_MAX (checked above); this
        // function's contract, forwarded from ferry.h ("`msg` valid for `msg_len` bytes"), makes
        // it readable, and Notify::new copies the bytes before this call returns.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: the contract (ferry.h) makes `requests` null with count 0, or valid for `count`
        // requests: what requests_arg needs.
        let reqs = unsafe { requests_arg(requests, count)? };
        // SAFETY: the contract (ferry.h) makes `name` null or NUL-terminated and `msg` valid for
        // `msg_len` bytes: what to_notify needs.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        // SAFETY: the contract (ferry.h) makes `name` null or NUL-terminated and `msg` valid for
        // `msg_len` bytes: what to_notify needs.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
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
        // SAFETY: `out` and `got` are checked non-null above, and ferry.h (ferry_notify_next)
        // makes them valid to write; `out` may be uninitialized, so write() stores it whole.
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
        // SAFETY: `engine` is null (obj refuses it) or a handle from ferry_engine_new not yet
        // destroyed: this function's contract in ferry.h.
        let e = unsafe { obj(engine, "engine")? };
        if out.is_null() {
            return Err(invalid("out"));
        }
        // SAFETY: checked non-null.
        unsafe { *out = e.inner.notifies_dropped() };
        Ok(())
    })
}
