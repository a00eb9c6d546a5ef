//! The ABI boundary every trampoline runs a plugin's code inside: the error
//! a plugin returns ([`PluginError`]), turned into a status code and a
//! message in the host's error buffer; a panic, caught, turned into
//! `FERRY_ERR_PANIC` and the panic's message.

use crate::status::ErrorCode;
use crate::sys;
use std::any::Any;
use std::cell::{Cell, RefCell};
use std::ffi::CString;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;

/// An error a plugin returns: a code from the shared list and a message for
/// the operator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginError {
    pub code: ErrorCode,
    pub message: String,
}

impl PluginError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        PluginError {
            code,
            message: message.into(),
        }
    }

    /// The plugin is cleanly not usable on this host (probe only).
    pub fn unavailable(message: impl Into<String>) -> Self {
        PluginError::new(ErrorCode::Unavailable, message)
    }
}

impl std::fmt::Display for PluginError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for PluginError {}

pub type PluginResult<T> = Result<T, PluginError>;

/// Converts to a C string, replacing interior NUL bytes so that a message is
/// never lost to a stray byte.
pub fn to_cstring_lossy(s: &str) -> CString {
    match CString::new(s) {
        Ok(c) => c,
        Err(_) => CString::new(s.replace('\0', "\u{FFFD}")).unwrap_or_default(),
    }
}

/// Writes `msg` into a caller's error buffer, truncated on a UTF-8 boundary
/// and NUL-terminated. Null buffers are ignored.
///
/// # Safety
/// `err` must be null or point to a `ferry_errbuf_t` whose `msg` is null or
/// writable for `cap` bytes.
pub unsafe fn write_errbuf(err: *mut sys::ferry_errbuf_t, msg: &str) {
    // SAFETY: by the `# Safety` section, `err` is null (as_mut gives None
    // and we return) or points to a ferry_errbuf_t, aligned and initialised;
    // plugin.h makes it caller-owned and written only by the callee, so the
    // `&mut` aliases nothing for the rest of this call.
    let Some(err) = (unsafe { err.as_mut() }) else {
        return;
    };
    if err.msg.is_null() || err.cap == 0 {
        return;
    }
    let mut n = msg.len().min(err.cap - 1);
    while !msg.is_char_boundary(n) {
        n -= 1;
    }
    // SAFETY: err.msg is writable for cap bytes and n + 1 <= cap.
    unsafe {
        std::ptr::copy_nonoverlapping(msg.as_ptr(), err.msg.cast::<u8>(), n);
        *err.msg.add(n) = 0;
    }
}

thread_local! {
    static BOUNDARY_DEPTH: Cell<u32> = const { Cell::new(0) };
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

static PANIC_HOOK: Once = Once::new();

/// Installs, once, a panic hook that records the message of a panic raised
/// inside [`boundary`] (to return it to the host) instead of printing it.
/// Panics outside a boundary go to the previous hook unchanged. A cdylib
/// plugin carries its own copy of std, so this touches only the plugin.
fn install_panic_hook() {
    PANIC_HOOK.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            let inside = BOUNDARY_DEPTH.with(|d| d.get() > 0);
            if inside {
                let msg = payload_message(info.payload());
                let text = match info.location() {
                    Some(loc) => format!("{msg} (at {}:{})", loc.file(), loc.line()),
                    None => msg,
                };
                LAST_PANIC.with(|p| *p.borrow_mut() = Some(text));
            } else {
                previous(info)
            }
        }));
    });
}

fn payload_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}

/// Runs `f` so that nothing unwinds out of it: its result is returned as is
/// and a panic becomes
/// `PluginError { code: Panic, .. }` carrying the panic's message.
pub fn catch<T>(f: impl FnOnce() -> PluginResult<T>) -> PluginResult<T> {
    install_panic_hook();
    BOUNDARY_DEPTH.with(|d| d.set(d.get() + 1));
    let result = panic::catch_unwind(AssertUnwindSafe(f));
    BOUNDARY_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    match result {
        Ok(r) => r,
        Err(payload) => {
            let recorded = LAST_PANIC.with(|p| p.borrow_mut().take());
            let msg = recorded.unwrap_or_else(|| payload_message(&*payload));
            // A payload whose Drop panics would abort; contain it too.
            let _ = panic::catch_unwind(AssertUnwindSafe(move || drop(payload)));
            Err(PluginError::new(
                ErrorCode::Panic,
                format!("plugin panicked: {msg}"),
            ))
        }
    }
}

/// The boundary every generated `extern "C"` entry runs inside: returns
/// `FERRY_OK`, or the error's code with its message written to `err`.
///
/// # Safety
/// `err` must be null or a valid error buffer (see [`write_errbuf`]).
pub unsafe fn boundary(
    err: *mut sys::ferry_errbuf_t,
    f: impl FnOnce() -> PluginResult<()>,
) -> sys::ferry_status_t {
    match catch(f) {
        Ok(()) => sys::FERRY_OK,
        Err(e) => {
            // SAFETY: write_errbuf needs `err` null or an errbuf whose `msg`
            // is null or writable for `cap` bytes: the one requirement of
            // boundary's own `# Safety`, met by every trampoline passing on
            // the `err` the host gave it (plugin.h: null or a caller-owned
            // ferry_errbuf_t, which ferry_error() also accepts as NULL).
            unsafe { write_errbuf(err, &e.message) };
            e.code.as_raw()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::{c_char, CStr};

    #[test]
    fn boundary_turns_panics_into_codes_with_the_message() {
        let mut buf = [0 as c_char; 128];
        let mut err = sys::ferry_errbuf_t {
            msg: buf.as_mut_ptr(),
            cap: buf.len(),
        };
        // SAFETY: err points to a live 128-byte buffer.
        let status = unsafe { boundary(&mut err, || panic!("disk on fire")) };
        assert_eq!(status, sys::FERRY_ERR_PANIC);
        // SAFETY: write_errbuf NUL-terminated the buffer.
        let msg = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
        assert!(msg.contains("plugin panicked: disk on fire"), "{msg}");
    }

    #[test]
    fn boundary_reports_errors_and_truncates_on_char_boundaries() {
        let mut buf = [0 as c_char; 6];
        let mut err = sys::ferry_errbuf_t {
            msg: buf.as_mut_ptr(),
            cap: buf.len(),
        };
        // SAFETY: err points to a live 6-byte buffer.
        let status = unsafe {
            boundary(&mut err, || {
                Err(PluginError::new(ErrorCode::NotFound, "ab\u{e9}\u{e9}zz"))
            })
        };
        assert_eq!(status, sys::FERRY_ERR_NOT_FOUND);
        // SAFETY: NUL-terminated by write_errbuf.
        let msg = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap();
        assert_eq!(msg, "ab\u{e9}");
    }

    #[test]
    fn null_error_buffer_is_ignored() {
        // SAFETY: a null buffer is allowed.
        let status = unsafe {
            boundary(std::ptr::null_mut(), || {
                Err(PluginError::new(ErrorCode::Io, "x"))
            })
        };
        assert_eq!(status, sys::FERRY_ERR_IO);
    }
}
