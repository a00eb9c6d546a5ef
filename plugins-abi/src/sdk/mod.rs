//! The SDK for plugins written in Rust.
//!
//! A Rust plugin implements [`TransportPlugin`] (or [`DevicePlugin`]) with
//! safe code and exports it with [`export_transport_plugin!`]
//! (or [`export_device_plugin!`]). The macro generates the C entry symbol and
//! a table of `extern "C"` trampolines; every trampoline runs the plugin's code
//! inside [`boundary`], which turns a returned [`PluginError`] into a status
//! code plus message and a panic into `FERRY_ERR_PANIC` plus the panic's
//! message. No unwinding ever crosses the ABI.
//!
//! ```ignore
//! struct Tcp;
//! impl ferry_plugins_abi::sdk::TransportPlugin for Tcp {
//!     const NAME: &'static CStr = c"tcp";
//!     const VERSION: &'static CStr = ferry_plugins_abi::c_version!();
//!     const DESCRIPTION: &'static CStr = c"TCP sockets";
//!     fn probe(host: &Host<'_>, report: &mut ProbeReport<'_>) -> PluginResult<()> { Ok(()) }
//! }
//! ferry_plugins_abi::export_transport_plugin!(Tcp);
//! ```

use crate::status::ErrorCode;
use crate::sys;
use std::any::Any;
use std::cell::{Cell, RefCell};
use std::ffi::{c_char, CString};
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;

pub mod auth;
pub mod deadline;
mod device;
pub mod net;
mod transport;
pub use device::*;
pub use transport::*;

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

/// Log levels, as `FERRY_LOG_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(i32)]
pub enum Level {
    Error = sys::FERRY_LOG_ERROR,
    Warn = sys::FERRY_LOG_WARN,
    Info = sys::FERRY_LOG_INFO,
    Debug = sys::FERRY_LOG_DEBUG,
    Trace = sys::FERRY_LOG_TRACE,
}

/// True when the struct behind `$ptr` (a `&$ty` of any struct that can grow:
/// see [`Versioned`](crate::versioned::Versioned)) is large enough to contain
/// `$field`: the Rust twin of `FERRY_HAS_FIELD`.
#[macro_export]
macro_rules! has_field {
    ($ptr:expr, $ty:ty, $field:ident) => {{
        let table: &$ty = $ptr;
        let end = ::std::mem::offset_of!($ty, $field) + ::std::mem::size_of_val(&table.$field);
        $crate::versioned::Versioned::struct_size(table) as usize >= end
    }};
}

/// The plugin's crate version as a `&'static CStr`, for `VERSION`.
#[macro_export]
macro_rules! c_version {
    () => {
        match ::std::ffi::CStr::from_bytes_with_nul(
            concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes(),
        ) {
            Ok(v) => v,
            Err(_) => panic!("CARGO_PKG_VERSION contains a NUL byte"),
        }
    };
}

/// A NIC as the host's topology describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nic {
    pub kind: u32,
    pub path_class: u32,
    pub name: String,
    pub netdev: String,
    pub pci_bus_id: String,
    pub numa_node: Option<u32>,
    pub port_state: u32,
    pub link_layer: u32,
    pub speed_mbps: u64,
}

/// Safe view of the host services table handed to the plugin.
#[derive(Clone, Copy)]
pub struct Host<'a> {
    raw: &'a sys::ferry_host_services_t,
}

// SAFETY: the services table is immutable and plugin.h requires every host
// service to be callable from any thread.
unsafe impl Send for Host<'_> {}
// SAFETY: as above.
unsafe impl Sync for Host<'_> {}

impl<'a> Host<'a> {
    /// Wraps the table the host passed in, refusing one that is too small
    /// to be a v1 services table.
    ///
    /// # Safety
    /// `raw` must be null or point to a services table that stays valid for
    /// `'a`, as the host guarantees for the duration of a call.
    pub unsafe fn from_raw(raw: *const sys::ferry_host_services_t) -> PluginResult<Host<'a>> {
        // SAFETY: the caller promises raw is null or valid for 'a.
        let raw = unsafe { raw.as_ref() }.ok_or_else(|| {
            PluginError::new(ErrorCode::InvalidArgument, "host services table is null")
        })?;
        if raw.hdr.abi_major != sys::FERRY_PLUGIN_ABI_MAJOR {
            return Err(PluginError::new(
                ErrorCode::AbiMismatch,
                format!(
                    "host speaks plugin ABI {}.{}, this plugin {}.{}",
                    raw.hdr.abi_major,
                    raw.hdr.abi_minor,
                    sys::FERRY_PLUGIN_ABI_MAJOR,
                    sys::FERRY_PLUGIN_ABI_MINOR
                ),
            ));
        }
        Ok(Host { raw })
    }

    /// Sends a message to the host's log under this plugin's name.
    pub fn log(&self, level: Level, msg: &str) {
        if !has_field!(self.raw, sys::ferry_host_services_t, log) {
            return;
        }
        if let Some(log) = self.raw.log {
            let msg = to_cstring_lossy(msg);
            // SAFETY: the host promised a valid function for ctx; msg is a
            // NUL-terminated string that outlives the call.
            unsafe { log(self.raw.ctx, level as i32, msg.as_ptr()) }
        }
    }

    pub fn log_enabled(&self, level: Level) -> bool {
        if !has_field!(self.raw, sys::ferry_host_services_t, log_enabled) {
            return true;
        }
        match self.raw.log_enabled {
            // SAFETY: a host-provided function called with its own ctx.
            Some(f) => unsafe { f(self.raw.ctx, level as i32) != 0 },
            None => true,
        }
    }

    pub fn info(&self, msg: &str) {
        self.log(Level::Info, msg)
    }

    pub fn warn(&self, msg: &str) {
        self.log(Level::Warn, msg)
    }

    pub fn debug(&self, msg: &str) {
        if self.log_enabled(Level::Debug) {
            self.log(Level::Debug, msg)
        }
    }

    /// Looks up a setting (`"tcp.connections"`): engine configuration first,
    /// then `FERRY_TCP_CONNECTIONS`.
    pub fn config(&self, key: &str) -> Option<String> {
        if !has_field!(self.raw, sys::ferry_host_services_t, config_get) {
            return None;
        }
        let get = self.raw.config_get?;
        let key = CString::new(key).ok()?;
        let mut buf = vec![0u8; 256];
        loop {
            // SAFETY: buf is writable for buf.len() bytes, key is
            // NUL-terminated, and the host writes at most cap bytes.
            let n = unsafe {
                get(
                    self.raw.ctx,
                    key.as_ptr(),
                    buf.as_mut_ptr().cast::<c_char>(),
                    buf.len(),
                )
            };
            if n < 0 {
                return None;
            }
            let n = n as usize;
            if n < buf.len() {
                buf.truncate(n);
                return Some(String::from_utf8_lossy(&buf).into_owned());
            }
            buf.resize(n + 1, 0);
        }
    }

    /// NICs ranked from `location` ("cpu:0", "cuda:1"), best first, or every
    /// NIC when `location` is `None`.
    pub fn nics(&self, location: Option<&str>) -> PluginResult<Vec<Nic>> {
        if !has_field!(self.raw, sys::ferry_host_services_t, topo_nics) {
            return Err(PluginError::new(
                ErrorCode::Unsupported,
                "the host offers no topology service",
            ));
        }
        let Some(topo) = self.raw.topo_nics else {
            return Err(PluginError::new(
                ErrorCode::Unsupported,
                "the host offers no topology service",
            ));
        };
        let location = location
            .map(|l| {
                CString::new(l).map_err(|_| {
                    PluginError::new(ErrorCode::InvalidArgument, "location contains a NUL byte")
                })
            })
            .transpose()?;
        let loc_ptr = location.as_ref().map_or(std::ptr::null(), |l| l.as_ptr());
        let mut cap: u32 = 16;
        loop {
            let mut out: Vec<sys::ferry_nic_desc_t> = Vec::with_capacity(cap as usize);
            let mut count: u32 = 0;
            // SAFETY: out has room for cap elements of the size we pass; the
            // host writes at most that many and sets count.
            let status = unsafe {
                topo(
                    self.raw.ctx,
                    loc_ptr,
                    out.as_mut_ptr(),
                    std::mem::size_of::<sys::ferry_nic_desc_t>(),
                    cap,
                    &mut count,
                )
            };
            if status != sys::FERRY_OK {
                let code = ErrorCode::from_raw(status).unwrap_or(ErrorCode::Plugin);
                return Err(PluginError::new(code, "topology query failed"));
            }
            if count > cap {
                cap = count;
                continue;
            }
            // SAFETY: the host initialised the first `count` (<= cap) elements.
            unsafe { out.set_len(count as usize) };
            return Ok(out.iter().map(nic_from_raw).collect());
        }
    }
}

impl Host<'_> {
    /// Plugin messaging: sends `body` to the transport of the same name in
    /// the engine serving segment `peer` and returns its reply (both at most
    /// [`sys::FERRY_PEER_MSG_MAX`] bytes). Blocks up to the engine's timeout.
    pub fn peer_request(&self, peer: &str, body: &[u8]) -> PluginResult<Vec<u8>> {
        let unsupported = || {
            PluginError::new(
                ErrorCode::Unsupported,
                "the host offers no plugin messaging (Ferry older than plugin ABI 1.1)",
            )
        };
        if !has_field!(self.raw, sys::ferry_host_services_t, peer_request) {
            return Err(unsupported());
        }
        let request = self.raw.peer_request.ok_or_else(unsupported)?;
        if body.len() > sys::FERRY_PEER_MSG_MAX {
            return Err(PluginError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "a plugin message of {} bytes exceeds the {}-byte limit",
                    body.len(),
                    sys::FERRY_PEER_MSG_MAX
                ),
            ));
        }
        let peer = CString::new(peer).map_err(|_| {
            PluginError::new(ErrorCode::InvalidArgument, "peer name contains a NUL byte")
        })?;
        let mut reply = vec![0u8; sys::FERRY_PEER_MSG_MAX];
        let mut reply_len = 0usize;
        let mut msg = [0 as c_char; 512];
        let mut err = sys::ferry_errbuf_t {
            msg: msg.as_mut_ptr(),
            cap: msg.len(),
        };
        // SAFETY: every pointer is valid for the call: peer is NUL-terminated,
        // body is readable for its length, reply writable for its capacity,
        // reply_len and err are live out-parameters.
        let status = unsafe {
            request(
                self.raw.ctx,
                peer.as_ptr(),
                body.as_ptr(),
                body.len(),
                reply.as_mut_ptr(),
                reply.len(),
                &mut reply_len,
                &mut err,
            )
        };
        if status != sys::FERRY_OK {
            let code = ErrorCode::from_raw(status).unwrap_or(ErrorCode::Plugin);
            let text = fixed_str(&msg);
            return Err(PluginError::new(
                code,
                if text.is_empty() {
                    format!(
                        "plugin message to {} failed ({code})",
                        peer.to_string_lossy()
                    )
                } else {
                    text
                },
            ));
        }
        if reply_len > reply.len() {
            return Err(PluginError::new(
                ErrorCode::Protocol,
                "the peer's reply exceeds the plugin message limit",
            ));
        }
        reply.truncate(reply_len);
        Ok(reply)
    }
}

fn fixed_str(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn nic_from_raw(raw: &sys::ferry_nic_desc_t) -> Nic {
    Nic {
        kind: raw.kind,
        path_class: raw.path_class,
        name: fixed_str(&raw.name),
        netdev: fixed_str(&raw.netdev),
        pci_bus_id: fixed_str(&raw.pci_bus_id),
        numa_node: u32::try_from(raw.numa_node).ok(),
        port_state: raw.port_state,
        link_layer: raw.link_layer,
        speed_mbps: raw.speed_mbps,
    }
}

/// A device a plugin would use, for [`ProbeReport::add_device`].
#[derive(Clone, Debug, Default)]
pub struct ProbeDevice<'s> {
    pub name: &'s str,
    pub pci_bus_id: Option<&'s str>,
    pub numa_node: Option<u32>,
    pub detail: Option<&'s str>,
    pub mem_kinds: u64,
}

/// Safe view of the probe sink: where a probe reports what it found.
pub struct ProbeReport<'a> {
    raw: &'a sys::ferry_probe_sink_t,
}

impl<'a> ProbeReport<'a> {
    /// # Safety
    /// `raw` must be null or point to a sink valid for `'a`.
    pub unsafe fn from_raw(raw: *const sys::ferry_probe_sink_t) -> PluginResult<ProbeReport<'a>> {
        // SAFETY: the caller promises raw is null or valid for 'a.
        let raw = unsafe { raw.as_ref() }
            .ok_or_else(|| PluginError::new(ErrorCode::InvalidArgument, "probe sink is null"))?;
        Ok(ProbeReport { raw })
    }

    /// What the plugin can serve here: `FERRY_MEM_*` and `FERRY_SCOPE_*` bits.
    pub fn set_capabilities(&mut self, mem_kinds: u64, scopes: u32) {
        if let Some(f) = self.raw.set_capabilities {
            // SAFETY: host-provided function called with its own ctx.
            unsafe { f(self.raw.ctx, mem_kinds, scopes) }
        }
    }

    pub fn add_device(&mut self, device: &ProbeDevice<'_>) {
        let Some(f) = self.raw.add_device else { return };
        let name = to_cstring_lossy(device.name);
        let pci = device.pci_bus_id.map(to_cstring_lossy);
        let detail = device.detail.map(to_cstring_lossy);
        let raw = sys::ferry_probe_device_t {
            struct_size: std::mem::size_of::<sys::ferry_probe_device_t>() as u32,
            numa_node: device
                .numa_node
                .and_then(|n| i32::try_from(n).ok())
                .unwrap_or(-1),
            name: name.as_ptr(),
            pci_bus_id: pci.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
            detail: detail.as_ref().map_or(std::ptr::null(), |d| d.as_ptr()),
            mem_kinds: device.mem_kinds,
        };
        // SAFETY: every pointer in raw refers to a CString that lives until
        // after the call; the host copies what it keeps.
        unsafe { f(self.raw.ctx, &raw) }
    }

    /// A capability this host lacks, and why, in words an operator can act on.
    pub fn add_missing(&mut self, capability: &str, reason: &str) {
        let Some(f) = self.raw.add_missing else {
            return;
        };
        let cap = to_cstring_lossy(capability);
        let reason = to_cstring_lossy(reason);
        // SAFETY: both strings are NUL-terminated and outlive the call.
        unsafe { f(self.raw.ctx, cap.as_ptr(), reason.as_ptr()) }
    }

    pub fn add_note(&mut self, key: &str, value: &str) {
        let Some(f) = self.raw.add_note else { return };
        let key = to_cstring_lossy(key);
        let value = to_cstring_lossy(value);
        // SAFETY: both strings are NUL-terminated and outlive the call.
        unsafe { f(self.raw.ctx, key.as_ptr(), value.as_ptr()) }
    }
}

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
    // SAFETY: the caller promises err is null or valid.
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
            // SAFETY: forwarded from our caller's contract.
            unsafe { write_errbuf(err, &e.message) };
            e.code.as_raw()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

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
