//! What a plugin sees of its host: log levels, the host services (logging,
//! configuration, topology, plugin messaging) behind a safe [`Host`], NICs
//! as the topology reports them, and the probe report a plugin fills.

use super::boundary::{to_cstring_lossy, PluginError, PluginResult};
use super::device_info::DeviceInfo;
use crate::status::ErrorCode;
use crate::sys;
use crate::versioned::read_plain;
use std::ffi::{c_char, CStr, CString};
use std::marker::PhantomData;

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
    /// Our copy of the host's table (versioned::read_plain): a table from
    /// an older host is shorter than this build's, and is never read past
    /// its end; its functions and ctx stay valid for 'a.
    raw: sys::ferry_host_services_t,
    valid: PhantomData<&'a sys::ferry_host_services_t>,
}

// SAFETY: the services table is immutable and plugin.h requires every host
// service to be callable from any thread.
unsafe impl Send for Host<'_> {}
// SAFETY: &Host only reads the immutable services table and calls its
// services, which plugin.h requires to accept concurrent calls.
unsafe impl Sync for Host<'_> {}

impl<'a> Host<'a> {
    /// Wraps the table the host passed in, refusing one that is too small
    /// to be a v1 services table.
    ///
    /// # Safety
    /// `raw` must be null or point to a services table that stays valid for
    /// `'a`, as the host guarantees for the duration of a call.
    pub unsafe fn from_raw(raw: *const sys::ferry_host_services_t) -> PluginResult<Host<'a>> {
        // SAFETY: by the `# Safety` section `raw` is null (None, refused
        // below) or points to a services table valid for 'a, readable for
        // its struct_size (plugin.h); the copy is read now, and its
        // functions and ctx stay valid for 'a. The trampolines meet it with
        // the host's table: for the call in probe, and until fini returns in
        // init (plugin.h, init), which is why init_trampoline may choose
        // 'static (fini drops the instance).
        let raw = unsafe { read_plain(raw) }.ok_or_else(|| {
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
        Ok(Host {
            raw,
            valid: PhantomData,
        })
    }

    /// Sends a message to the host's log under this plugin's name.
    pub fn log(&self, level: Level, msg: &str) {
        if !has_field!(&self.raw, sys::ferry_host_services_t, log) {
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
        if !has_field!(&self.raw, sys::ferry_host_services_t, log_enabled) {
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

    /// A setting parsed as `T` (a number, mostly), or `default` when it is
    /// unset or empty; a value that does not parse is an error naming it.
    pub fn setting<T: std::str::FromStr>(&self, key: &str, default: T) -> PluginResult<T> {
        match self.config(key) {
            None => Ok(default),
            Some(v) if v.trim().is_empty() => Ok(default),
            Some(v) => v.trim().parse().map_err(|_| {
                PluginError::new(
                    ErrorCode::InvalidArgument,
                    format!("setting {key} = {v:?} is not a valid number"),
                )
            }),
        }
    }

    /// Looks up a setting (`"tcp.connections"`): engine configuration first,
    /// then `FERRY_TCP_CONNECTIONS`.
    pub fn config(&self, key: &str) -> Option<String> {
        if !has_field!(&self.raw, sys::ferry_host_services_t, config_get) {
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
        if !has_field!(&self.raw, sys::ferry_host_services_t, topo_nics) {
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
    /// Adds `delta` to this plugin's counter `name` (`[a-z0-9_]`), for one
    /// of its devices or none. A no-op on hosts older than ABI 1.2.
    pub fn count(&self, name: &CStr, device: Option<&CStr>, delta: u64) {
        if !has_field!(&self.raw, sys::ferry_host_services_t, count) {
            return;
        }
        if let Some(count) = self.raw.count {
            // SAFETY: name and device are NUL-terminated and outlive the
            // call; the host copies what it keeps.
            unsafe {
                count(
                    self.raw.ctx,
                    name.as_ptr(),
                    device.map_or(std::ptr::null(), CStr::as_ptr),
                    delta,
                )
            }
        }
    }

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
        if !has_field!(&self.raw, sys::ferry_host_services_t, peer_request) {
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
    /// What this device sustains for one peer, in Mbit/s; 0: unknown.
    pub bandwidth_mbps: u64,
    /// A small request's completion time, in ns; 0: unknown.
    pub latency_ns: u32,
    /// A device plugin's device: what `device_info` would say of it (ABI
    /// 1.6), so that `ferry info` knows it without starting the plugin.
    pub gpu: Option<&'s DeviceInfo>,
}

/// Safe view of the probe sink: where a probe reports what it found.
pub struct ProbeReport<'a> {
    /// Our copy of the host's sink (versioned::read_plain), as for Host.
    raw: sys::ferry_probe_sink_t,
    valid: PhantomData<&'a sys::ferry_probe_sink_t>,
}

impl<'a> ProbeReport<'a> {
    /// # Safety
    /// `raw` must be null or point to a sink valid for `'a`.
    pub unsafe fn from_raw(raw: *const sys::ferry_probe_sink_t) -> PluginResult<ProbeReport<'a>> {
        // SAFETY: by the `# Safety` section `raw` is null (None, refused
        // below) or points to a sink valid for 'a, readable for its
        // struct_size (plugin.h); the probe trampolines pass the host's
        // ferry_probe_sink_t from the probe call and keep the ProbeReport
        // inside that call, so 'a ends with it.
        let raw = unsafe { read_plain(raw) }
            .ok_or_else(|| PluginError::new(ErrorCode::InvalidArgument, "probe sink is null"))?;
        Ok(ProbeReport {
            raw,
            valid: PhantomData,
        })
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
        let gpu = device.gpu.map(DeviceInfo::to_raw);
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
            bandwidth_mbps: device.bandwidth_mbps,
            latency_ns: device.latency_ns,
            reserved: 0,
            gpu: gpu.as_ref().map_or(std::ptr::null(), |g| g as *const _),
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

    /// One way this plugin registers `mem_kind` (one `FERRY_MEM_*` bit) and
    /// whether it works here: `Ok(how)` or `Err(why not)`. The host decides
    /// GPU-memory registration from these (ABI 1.5; an older host has no
    /// such entry, and the call does nothing).
    pub fn add_memory_method(&mut self, mem_kind: u64, state: Result<&str, &str>) {
        if !has_field!(&self.raw, sys::ferry_probe_sink_t, add_memory_method) {
            return;
        }
        let Some(f) = self.raw.add_memory_method else {
            return;
        };
        let (available, detail) = match state {
            Ok(how) => (1, how),
            Err(why) => (0, why),
        };
        let detail = to_cstring_lossy(detail);
        // SAFETY: the sink is large enough to hold this entry (checked
        // above); the string is NUL-terminated and outlives the call, and the
        // host copies it.
        unsafe { f(self.raw.ctx, mem_kind, available, detail.as_ptr()) }
    }

    pub fn add_note(&mut self, key: &str, value: &str) {
        let Some(f) = self.raw.add_note else { return };
        let key = to_cstring_lossy(key);
        let value = to_cstring_lossy(value);
        // SAFETY: both strings are NUL-terminated and outlive the call.
        unsafe { f(self.raw.ctx, key.as_ptr(), value.as_ptr()) }
    }
}
