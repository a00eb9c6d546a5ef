//! The types and constants C programs see (include/ferry.h).

use std::ffi::{c_char, c_void};

/// A status code: FERRY_OK (0) or a negative FERRY_ERR_* from ferry/plugin.h.
pub type ferry_status_t = i32;
/// An open remote segment.
pub type ferry_segment_id = u64;
/// A batch of requests.
pub type ferry_batch_id = u64;

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
