//! The one error code list shared by plugins, the engine and the C API.

use crate::sys;
use std::fmt;

/// A Ferry status code. The numeric values are the `FERRY_ERR_*` constants of
/// `ferry/plugin.h` and never change once released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ErrorCode {
    InvalidArgument = sys::FERRY_ERR_INVALID_ARGUMENT,
    Unsupported = sys::FERRY_ERR_UNSUPPORTED,
    Unavailable = sys::FERRY_ERR_UNAVAILABLE,
    NotFound = sys::FERRY_ERR_NOT_FOUND,
    /// Outside registered memory; from a transport, a remote range its peer
    /// does not serve (unregistered, or a revoked key): the engine re-reads
    /// the peer's descriptor and retries the request once.
    OutOfBounds = sys::FERRY_ERR_OUT_OF_BOUNDS,
    Timeout = sys::FERRY_ERR_TIMEOUT,
    Connection = sys::FERRY_ERR_CONNECTION,
    Protocol = sys::FERRY_ERR_PROTOCOL,
    NoMemory = sys::FERRY_ERR_NO_MEMORY,
    Busy = sys::FERRY_ERR_BUSY,
    AbiMismatch = sys::FERRY_ERR_ABI_MISMATCH,
    Plugin = sys::FERRY_ERR_PLUGIN,
    Panic = sys::FERRY_ERR_PANIC,
    Permission = sys::FERRY_ERR_PERMISSION,
    Cancelled = sys::FERRY_ERR_CANCELLED,
    Io = sys::FERRY_ERR_IO,
    Internal = sys::FERRY_ERR_INTERNAL,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 17] = [
        ErrorCode::InvalidArgument,
        ErrorCode::Unsupported,
        ErrorCode::Unavailable,
        ErrorCode::NotFound,
        ErrorCode::OutOfBounds,
        ErrorCode::Timeout,
        ErrorCode::Connection,
        ErrorCode::Protocol,
        ErrorCode::NoMemory,
        ErrorCode::Busy,
        ErrorCode::AbiMismatch,
        ErrorCode::Plugin,
        ErrorCode::Panic,
        ErrorCode::Permission,
        ErrorCode::Cancelled,
        ErrorCode::Io,
        ErrorCode::Internal,
    ];

    /// The raw status value.
    pub const fn as_raw(self) -> sys::ferry_status_t {
        self as i32
    }

    /// Maps a raw status back to a code. `FERRY_OK` and unknown values
    /// (from a newer plugin) are `None`; callers treat unknown as `Plugin`.
    pub fn from_raw(raw: sys::ferry_status_t) -> Option<ErrorCode> {
        ErrorCode::ALL.iter().copied().find(|c| c.as_raw() == raw)
    }

    /// The stable name, as spelled in the headers without the prefix.
    pub const fn name(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "INVALID_ARGUMENT",
            ErrorCode::Unsupported => "UNSUPPORTED",
            ErrorCode::Unavailable => "UNAVAILABLE",
            ErrorCode::NotFound => "NOT_FOUND",
            ErrorCode::OutOfBounds => "OUT_OF_BOUNDS",
            ErrorCode::Timeout => "TIMEOUT",
            ErrorCode::Connection => "CONNECTION",
            ErrorCode::Protocol => "PROTOCOL",
            ErrorCode::NoMemory => "NO_MEMORY",
            ErrorCode::Busy => "BUSY",
            ErrorCode::AbiMismatch => "ABI_MISMATCH",
            ErrorCode::Plugin => "PLUGIN",
            ErrorCode::Panic => "PANIC",
            ErrorCode::Permission => "PERMISSION",
            ErrorCode::Cancelled => "CANCELLED",
            ErrorCode::Io => "IO",
            ErrorCode::Internal => "INTERNAL",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FERRY_ERR_{} ({})", self.name(), self.as_raw())
    }
}
