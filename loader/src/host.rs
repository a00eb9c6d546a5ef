//! The host side of the services table: what a plugin may ask of Ferry.
//!
//! The loader does not know about topology or engine configuration (those
//! live above it, in engine-core); it asks for an implementation of
//! [`HostServices`] and exposes it to each plugin as a C table whose `ctx`
//! remembers which plugin is calling, so log lines carry the plugin's name.

use ferry_plugins_abi::sdk::Nic;
use ferry_plugins_abi::sys;
use ferry_plugins_abi::ErrorCode;
use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// What Ferry offers plugins. engine-core implements it with the engine's
/// configuration and topology; [`EnvHost`] is the minimal stand-alone one.
pub trait HostServices: Send + Sync {
    /// A plugin's log line. The default sends it to the `log` crate under
    /// the target `ferry::plugin::<name>`.
    fn log(&self, plugin: &str, level: log::Level, msg: &str) {
        let target = format!("ferry::plugin::{plugin}");
        log::log!(target: &target, level, "{msg}");
    }

    fn log_enabled(&self, plugin: &str, level: log::Level) -> bool {
        let target = format!("ferry::plugin::{plugin}");
        log::log_enabled!(target: &target, level)
    }

    /// A setting such as `"tcp.connections"`.
    fn config(&self, key: &str) -> Option<String>;

    /// NICs ranked from `location`, best first; all NICs for `None`.
    fn nics(&self, location: Option<&str>) -> Result<Vec<Nic>, ErrorCode>;

    /// Plugin messaging: `body` to the transport named `plugin` in the engine
    /// serving segment `peer`; its reply, or the error code and message.
    /// The default (no engine) cannot send.
    fn peer_request(
        &self,
        plugin: &str,
        peer: &str,
        body: &[u8],
    ) -> Result<Vec<u8>, (ErrorCode, String)> {
        let _ = (plugin, peer, body);
        Err((
            ErrorCode::Unsupported,
            "plugin messaging needs an engine (this host has none)".into(),
        ))
    }

    /// A plugin's counter: adds `delta` to counter `name` of `plugin`, for
    /// `device` (or none). `name` is already checked (`[a-z0-9_]`, at most
    /// 63 bytes). The default (no engine) keeps nothing.
    fn count(&self, plugin: &str, name: &str, device: Option<&str>, delta: u64) {
        let _ = (plugin, name, device, delta);
    }
}

/// The environment variable a config key maps to: `tcp.connections` ->
/// `FERRY_TCP_CONNECTIONS`.
pub fn config_env_var(key: &str) -> String {
    let mut var = String::from("FERRY_");
    for c in key.chars() {
        if c.is_ascii_alphanumeric() {
            var.push(c.to_ascii_uppercase());
        } else {
            var.push('_');
        }
    }
    var
}

/// Services from the environment only, with no topology: for tools that load
/// plugins without an engine.
#[derive(Clone, Copy, Debug, Default)]
pub struct EnvHost;

impl HostServices for EnvHost {
    fn config(&self, key: &str) -> Option<String> {
        std::env::var(config_env_var(key)).ok()
    }

    fn nics(&self, _location: Option<&str>) -> Result<Vec<Nic>, ErrorCode> {
        Ok(Vec::new())
    }
}

/// The per-plugin context behind `ferry_host_services_t.ctx`.
pub(crate) struct HostCtx {
    pub(crate) plugin: String,
    pub(crate) host: Arc<dyn HostServices>,
}

/// A services table and the context it points to, kept together so the
/// pointer in the table stays valid as long as the plugin may use it.
pub(crate) struct ServicesTable {
    // Boxed so their addresses do not move.
    table: Box<sys::ferry_host_services_t>,
    _ctx: Box<HostCtx>,
}

// SAFETY: the table is never mutated after construction, and HostCtx holds
// only Send + Sync data (a String and an Arc<dyn HostServices + Send + Sync>);
// the raw ctx pointer inside the table points at that HostCtx.
unsafe impl Send for ServicesTable {}
// SAFETY: shared references from several threads only ever read: the table
// is immutable after construction, and every service function takes the
// context by shared reference and reaches only Send + Sync data through it.
unsafe impl Sync for ServicesTable {}

impl ServicesTable {
    pub(crate) fn new(plugin: &str, host: Arc<dyn HostServices>) -> ServicesTable {
        let ctx = Box::new(HostCtx {
            plugin: plugin.to_string(),
            host,
        });
        let table = Box::new(sys::ferry_host_services_t {
            hdr: sys::ferry_abi_header_t::for_table::<sys::ferry_host_services_t>(),
            ctx: (&*ctx as *const HostCtx).cast_mut().cast::<c_void>(),
            log: Some(svc_log),
            log_enabled: Some(svc_log_enabled),
            config_get: Some(svc_config_get),
            topo_nics: Some(svc_topo_nics),
            peer_request: Some(svc_peer_request),
            count: Some(svc_count),
        });
        ServicesTable { table, _ctx: ctx }
    }

    pub(crate) fn as_ptr(&self) -> *const sys::ferry_host_services_t {
        &*self.table
    }
}

fn level_from_raw(level: i32) -> log::Level {
    match level {
        i32::MIN..=sys::FERRY_LOG_ERROR => log::Level::Error,
        sys::FERRY_LOG_WARN => log::Level::Warn,
        sys::FERRY_LOG_INFO => log::Level::Info,
        sys::FERRY_LOG_DEBUG => log::Level::Debug,
        _ => log::Level::Trace,
    }
}

/// # Safety
/// `ctx` must be the pointer this module put in the table (or null).
unsafe fn ctx_ref<'a>(ctx: *mut c_void) -> Option<&'a HostCtx> {
    // SAFETY: the caller passes back the ctx from our table, which points at
    // the boxed HostCtx that lives as long as the table.
    unsafe { ctx.cast::<HostCtx>().cast_const().as_ref() }
}

/// # Safety
/// `s` must be null or a NUL-terminated string.
unsafe fn str_arg<'a>(s: *const c_char) -> Option<std::borrow::Cow<'a, str>> {
    if s.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated per the ABI contract.
    Some(unsafe { CStr::from_ptr(s) }.to_string_lossy())
}

unsafe extern "C" fn svc_log(ctx: *mut c_void, level: i32, msg: *const c_char) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: ctx comes from our table; msg is a C string per the ABI.
        let (Some(ctx), Some(msg)) = (unsafe { ctx_ref(ctx) }, unsafe { str_arg(msg) }) else {
            return;
        };
        // A plugin's words are data: no escape sequence reaches a terminal.
        let msg = crate::escape::for_terminal(&msg);
        ctx.host.log(&ctx.plugin, level_from_raw(level), &msg);
    }));
}

unsafe extern "C" fn svc_log_enabled(ctx: *mut c_void, level: i32) -> i32 {
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: ctx comes from our table.
        match unsafe { ctx_ref(ctx) } {
            Some(ctx) => i32::from(ctx.host.log_enabled(&ctx.plugin, level_from_raw(level))),
            None => 0,
        }
    }))
    .unwrap_or(0)
}

unsafe extern "C" fn svc_config_get(
    ctx: *mut c_void,
    key: *const c_char,
    buf: *mut c_char,
    cap: usize,
) -> i64 {
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: ctx comes from our table; key is a C string per the ABI.
        let (Some(ctx), Some(key)) = (unsafe { ctx_ref(ctx) }, unsafe { str_arg(key) }) else {
            return -1;
        };
        let Some(value) = ctx.host.config(&key) else {
            return -1;
        };
        let bytes = value.as_bytes();
        if !buf.is_null() && cap > 0 {
            let n = bytes.len().min(cap - 1);
            // SAFETY: the plugin promised buf is writable for cap bytes and
            // we write n + 1 <= cap.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n);
                *buf.add(n) = 0;
            }
        }
        i64::try_from(bytes.len()).unwrap_or(i64::MAX)
    }))
    .unwrap_or(-1)
}

fn fill_fixed(dst: &mut [c_char], src: &str) {
    let n = src.len().min(dst.len().saturating_sub(1));
    for (d, s) in dst.iter_mut().zip(src.as_bytes()[..n].iter()) {
        *d = *s as c_char;
    }
    if let Some(end) = dst.get_mut(n) {
        *end = 0;
    }
}

pub(crate) fn nic_to_raw(nic: &Nic) -> sys::ferry_nic_desc_t {
    let mut raw = sys::ferry_nic_desc_t {
        kind: nic.kind,
        path_class: nic.path_class,
        name: [0; 64],
        netdev: [0; 32],
        pci_bus_id: [0; 32],
        numa_node: nic
            .numa_node
            .and_then(|n| i32::try_from(n).ok())
            .unwrap_or(-1),
        port_state: nic.port_state,
        link_layer: nic.link_layer,
        reserved: 0,
        speed_mbps: nic.speed_mbps,
    };
    fill_fixed(&mut raw.name, &nic.name);
    fill_fixed(&mut raw.netdev, &nic.netdev);
    fill_fixed(&mut raw.pci_bus_id, &nic.pci_bus_id);
    raw
}

unsafe extern "C" fn svc_topo_nics(
    ctx: *mut c_void,
    location: *const c_char,
    out: *mut sys::ferry_nic_desc_t,
    elem_size: usize,
    cap: u32,
    count: *mut u32,
) -> sys::ferry_status_t {
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: ctx comes from our table.
        let Some(ctx) = (unsafe { ctx_ref(ctx) }) else {
            return sys::FERRY_ERR_INVALID_ARGUMENT;
        };
        // SAFETY: location is null or a C string per the ABI.
        let location = unsafe { str_arg(location) };
        let nics = match ctx.host.nics(location.as_deref()) {
            Ok(n) => n,
            Err(code) => return code.as_raw(),
        };
        if !count.is_null() {
            // SAFETY: count is a valid u32 out-pointer per the ABI.
            unsafe { *count = u32::try_from(nics.len()).unwrap_or(u32::MAX) };
        }
        if out.is_null() || elem_size == 0 {
            return sys::FERRY_OK;
        }
        let write_size = elem_size.min(std::mem::size_of::<sys::ferry_nic_desc_t>());
        for (i, nic) in nics.iter().take(cap as usize).enumerate() {
            let raw = nic_to_raw(nic);
            // SAFETY: the plugin gave `cap` elements of `elem_size` bytes at
            // `out`; we write `write_size <= elem_size` bytes into element i < cap.
            unsafe {
                let dst = out.cast::<u8>().add(i * elem_size);
                std::ptr::copy_nonoverlapping(
                    (&raw as *const sys::ferry_nic_desc_t).cast::<u8>(),
                    dst,
                    write_size,
                );
            }
        }
        sys::FERRY_OK
    }))
    .unwrap_or(sys::FERRY_ERR_INTERNAL)
}

/// Writes `msg` into an error buffer (NUL-terminated, truncated).
///
/// # Safety
/// `err` must be null or a valid error buffer.
unsafe fn write_err(err: *mut sys::ferry_errbuf_t, msg: &str) {
    // SAFETY: write_errbuf needs `err` null or an errbuf whose `msg` is null or
    // writable for `cap` bytes: this function's `# Safety` requirement, which the
    // service callbacks meet by passing on the `err` a plugin gave them (plugin.h:
    // a caller-owned ferry_errbuf_t, e.g. peer_request's).
    unsafe { ferry_plugins_abi::sdk::write_errbuf(err, msg) }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn svc_peer_request(
    ctx: *mut c_void,
    peer: *const c_char,
    body: *const u8,
    body_len: usize,
    reply: *mut u8,
    reply_cap: usize,
    reply_len: *mut usize,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: ctx comes from our table; peer is a C string per the ABI.
        let (Some(ctx), Some(peer)) = (unsafe { ctx_ref(ctx) }, unsafe { str_arg(peer) }) else {
            // SAFETY: err is null or valid per the ABI.
            unsafe { write_err(err, "peer_request: null context or peer name") };
            return sys::FERRY_ERR_INVALID_ARGUMENT;
        };
        if body_len > sys::FERRY_PEER_MSG_MAX || (body.is_null() && body_len > 0) {
            // SAFETY: `err` is null or a valid error buffer, as the ABI requires
            // of every service's caller; write_err checks for null.
            unsafe {
                write_err(
                    err,
                    &format!(
                        "a plugin message of {body_len} bytes exceeds the {}-byte limit",
                        sys::FERRY_PEER_MSG_MAX
                    ),
                )
            };
            return sys::FERRY_ERR_INVALID_ARGUMENT;
        }
        let body = if body_len == 0 {
            &[][..]
        } else {
            // SAFETY: the plugin promised body is readable for body_len bytes.
            unsafe { std::slice::from_raw_parts(body, body_len) }
        };
        match ctx.host.peer_request(&ctx.plugin, &peer, body) {
            Ok(data) => {
                if !reply_len.is_null() {
                    // SAFETY: reply_len is a valid out-pointer per the ABI.
                    unsafe { *reply_len = data.len() };
                }
                if data.len() > reply_cap || (reply.is_null() && !data.is_empty()) {
                    // SAFETY: `err` is null or a valid error buffer, as the ABI requires
                    // of every service's caller; write_err checks for null.
                    unsafe {
                        write_err(
                            err,
                            &format!(
                                "the reply of {} bytes does not fit the {reply_cap}-byte buffer",
                                data.len()
                            ),
                        )
                    };
                    return sys::FERRY_ERR_PROTOCOL;
                }
                if !data.is_empty() {
                    // SAFETY: reply is writable for reply_cap >= data.len() bytes.
                    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), reply, data.len()) };
                }
                sys::FERRY_OK
            }
            Err((code, msg)) => {
                // SAFETY: `err` is null or a valid error buffer, as the ABI requires
                // of every service's caller; write_err checks for null.
                unsafe { write_err(err, &msg) };
                code.as_raw()
            }
        }
    }))
    .unwrap_or(sys::FERRY_ERR_INTERNAL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_keys_map_to_env_vars() {
        assert_eq!(config_env_var("tcp.connections"), "FERRY_TCP_CONNECTIONS");
        assert_eq!(config_env_var("rdma.gid-index"), "FERRY_RDMA_GID_INDEX");
    }

    #[test]
    fn fixed_strings_truncate_and_terminate() {
        let mut buf = [1 as c_char; 4];
        fill_fixed(&mut buf, "abcdef");
        assert_eq!(buf, [b'a' as c_char, b'b' as c_char, b'c' as c_char, 0]);
    }
}

/// Whether `name` is a counter name plugins may use: `[a-z0-9_]`, 1 to 63 bytes.
fn valid_counter_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

unsafe extern "C" fn svc_count(
    ctx: *mut c_void,
    name: *const c_char,
    device: *const c_char,
    delta: u64,
) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: ctx is the HostCtx this table was built with (or null).
        let Some(ctx) = (unsafe { ctx.cast::<HostCtx>().as_ref() }) else {
            return;
        };
        if name.is_null() {
            return;
        }
        // SAFETY: name is a NUL-terminated string per the ABI.
        let Ok(name) = unsafe { CStr::from_ptr(name) }.to_str() else {
            return;
        };
        if !valid_counter_name(name) {
            return;
        }
        let device = if device.is_null() {
            None
        } else {
            // SAFETY: device is a NUL-terminated string per the ABI.
            match unsafe { CStr::from_ptr(device) }.to_str() {
                Ok(d) if d.len() <= 63 && !d.bytes().any(|b| b.is_ascii_control()) => Some(d),
                _ => return,
            }
        };
        ctx.host.count(&ctx.plugin, name, device, delta);
    }));
}

#[cfg(test)]
mod counter_name_tests {
    use super::valid_counter_name;

    #[test]
    fn counter_names_are_checked() {
        assert!(valid_counter_name("nic_pauses"));
        assert!(valid_counter_name("retries2"));
        assert!(!valid_counter_name(""));
        assert!(!valid_counter_name("Pauses"));
        assert!(!valid_counter_name("a b"));
        assert!(!valid_counter_name(&"x".repeat(64)));
    }
}
