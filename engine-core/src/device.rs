//! One device plugin instance (CUDA, ...), wrapped so the engine calls safe
//! methods: classify pointers, describe devices, export DMA-BUF, allocate
//! pinned and device memory, and run copies on streams.

use crate::error::{Error, ErrorCode, Result};
use ferry_loader::{LoadedLibrary, Plugin};
use ferry_plugins_abi::has_field;
use ferry_plugins_abi::sys;
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A device as its plugin describes it (the SDK's type: one definition
/// on both sides of the ABI).
pub use ferry_plugins_abi::sdk::DeviceInfo;

/// What a pointer is, according to a device plugin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PointerKind {
    Host,
    Device(u32),
    HostPinned,
    Managed(Option<u32>),
}

pub struct Device {
    /// The plugin's name ("cuda"), for messages.
    pub name: String,
    /// Keeps the plugin loaded while `table` and `instance` are in use.
    _library: Arc<LoadedLibrary>,
    table: *const sys::ferry_device_plugin_v1_t,
    instance: *mut c_void,
    /// Whether copying a list one by one was logged (once).
    said_one_by_one: AtomicBool,
    /// The plugin answered stream_query with FERRY_ERR_UNSUPPORTED: streams
    /// are waited on instead.
    no_query: AtomicBool,
}

// SAFETY: the instance pointer is only handed back to the plugin, which must
// accept calls from any thread (plugin.h, "Threads"); the table is
// `library`'s immutable copy, held by this struct.
unsafe impl Send for Device {}
// SAFETY: shared access only reads the immutable table and hands the
// instance pointer to the plugin, which must accept concurrent calls
// (plugin.h, "Threads").
unsafe impl Sync for Device {}

/// A copy stream of one device; destroyed when dropped.
pub struct Stream {
    device: Arc<Device>,
    raw: *mut c_void,
}

// SAFETY: a stream handle is only passed back to its plugin, which accepts
// calls from any thread; one stream is used by one thread at a time (&mut).
unsafe impl Send for Stream {}

struct ErrBuf([u8; 1024]);

impl ErrBuf {
    fn new() -> ErrBuf {
        ErrBuf([0; 1024])
    }

    fn raw(&mut self) -> sys::ferry_errbuf_t {
        sys::ferry_errbuf_t {
            msg: self.0.as_mut_ptr().cast(),
            cap: self.0.len(),
        }
    }

    fn check(&mut self, plugin: &str, what: &str, status: sys::ferry_status_t) -> Result<()> {
        if status == sys::FERRY_OK {
            return Ok(());
        }
        if let Some(last) = self.0.last_mut() {
            *last = 0;
        }
        // A plugin's message is data: escaped before it can reach a terminal.
        let msg = CStr::from_bytes_until_nul(&self.0)
            .map(|c| ferry_loader::escape::for_terminal(&c.to_string_lossy()).into_owned())
            .unwrap_or_default();
        let code = ErrorCode::from_raw(status).unwrap_or(ErrorCode::Plugin);
        Err(Error::new(
            code,
            if msg.is_empty() {
                format!("{plugin}: {what} failed ({code})")
            } else {
                format!("{plugin}: {msg}")
            },
        ))
    }
}

macro_rules! call {
    ($self:expr, $field:ident, $what:literal, |$f:ident, $err:ident| $body:expr) => {{
        let table = $self.table();
        let $f = table.$field.ok_or_else(|| {
            Error::new(
                ErrorCode::Unsupported,
                format!("{}: no {}", $self.name, $what),
            )
        })?;
        let mut buf = ErrBuf::new();
        let mut $err = buf.raw();
        let status = $body;
        buf.check(&$self.name, $what, status)
    }};
}

impl Device {
    /// Starts an instance of an enabled device plugin; `None` for a
    /// probe-only one.
    pub fn init(plugin: &Plugin) -> Result<Option<Device>> {
        let Some(library) = plugin.library().cloned() else {
            return Ok(None);
        };
        let Some(table) = library.device_table() else {
            return Ok(None);
        };
        if !has_field!(table, sys::ferry_device_plugin_v1_t, stream_sync) {
            return Ok(None);
        }
        let Some(init) = table.init else {
            return Ok(None);
        };
        let name = plugin.report.name.clone();
        // The loader disables such a plugin when it loads it; this only
        // guards the calls below.
        let missing = ferry_loader::missing_device_functions(table);
        if !missing.is_empty() {
            return Err(Error::new(
                ErrorCode::AbiMismatch,
                format!(
                    "device plugin {name} has init but not {}",
                    missing.join(", ")
                ),
            ));
        }
        let mut instance: *mut c_void = std::ptr::null_mut();
        let mut buf = ErrBuf::new();
        let mut err = buf.raw();
        // SAFETY: the services table lives in `library` as long as the
        // instance; out-pointers are valid for the call.
        let status = unsafe { init(library.services(), &mut instance, &mut err) };
        buf.check(&name, "init", status)?;
        Ok(Some(Device {
            name,
            table: table as *const sys::ferry_device_plugin_v1_t,
            _library: library,
            instance,
            said_one_by_one: AtomicBool::new(false),
            no_query: AtomicBool::new(false),
        }))
    }

    fn table(&self) -> &sys::ferry_device_plugin_v1_t {
        // SAFETY: `library`'s own boxed, immutable copy of the table (the
        // loader's copy_table): its address is stable, and self holds
        // `library`.
        unsafe { &*self.table }
    }

    pub fn device_count(&self) -> Result<u32> {
        let mut n = 0u32;
        call!(self, device_count, "device_count", |f, err| {
            // SAFETY: valid instance and out-pointers.
            unsafe { f(self.instance, &mut n, &mut err) }
        })?;
        Ok(n)
    }

    pub fn device_info(&self, ordinal: u32) -> Result<DeviceInfo> {
        // SAFETY: an all-zero ferry_device_info_t is a valid value.
        let mut out: sys::ferry_device_info_t = unsafe { std::mem::zeroed() };
        out.struct_size = std::mem::size_of::<sys::ferry_device_info_t>() as u32;
        let ord = i32::try_from(ordinal)
            .map_err(|_| Error::new(ErrorCode::InvalidArgument, "ordinal out of range"))?;
        call!(self, device_info, "device_info", |f, err| {
            // SAFETY: valid instance and out-pointers.
            unsafe { f(self.instance, ord, &mut out, &mut err) }
        })?;
        out.ordinal = ord;
        DeviceInfo::from_raw(&out)
            .ok_or_else(|| Error::new(ErrorCode::Internal, "device_info: a negative ordinal"))
    }

    /// Classifies `addr`; also returns the allocation holding it, when known.
    pub fn query_pointer(&self, addr: u64) -> Result<(PointerKind, u64, u64)> {
        let mut out = sys::ferry_pointer_info_t {
            struct_size: std::mem::size_of::<sys::ferry_pointer_info_t>() as u32,
            ..Default::default()
        };
        call!(self, query_pointer, "query_pointer", |f, err| {
            // SAFETY: valid instance and out-pointers; addr is only a number.
            unsafe { f(self.instance, addr, &mut out, &mut err) }
        })?;
        let ordinal = u32::try_from(out.ordinal).ok();
        let kind = match out.kind {
            sys::FERRY_PTR_DEVICE => match ordinal {
                Some(o) => PointerKind::Device(o),
                None => {
                    return Err(Error::new(
                        ErrorCode::Plugin,
                        format!("{}: device memory without a device ordinal", self.name),
                    ))
                }
            },
            sys::FERRY_PTR_HOST_PINNED => PointerKind::HostPinned,
            sys::FERRY_PTR_MANAGED => PointerKind::Managed(ordinal),
            _ => PointerKind::Host,
        };
        Ok((kind, out.base, out.size))
    }

    /// A DMA-BUF fd (owned by the caller) for the range, and addr's offset.
    pub fn export_dmabuf(&self, addr: u64, len: u64) -> Result<(i32, u64)> {
        let (mut fd, mut offset) = (-1i32, 0u64);
        call!(self, export_dmabuf, "export_dmabuf", |f, err| {
            // SAFETY: valid instance and out-pointers.
            unsafe { f(self.instance, addr, len, &mut fd, &mut offset, &mut err) }
        })?;
        Ok((fd, offset))
    }

    pub fn alloc_pinned(&self, len: u64) -> Result<u64> {
        let mut p: *mut c_void = std::ptr::null_mut();
        call!(self, alloc_pinned, "alloc_pinned", |f, err| {
            // SAFETY: valid instance and out-pointers.
            unsafe { f(self.instance, len, &mut p, &mut err) }
        })?;
        Ok(p as u64)
    }

    pub fn free_pinned(&self, ptr: u64) {
        if let Some(f) = self.table().free_pinned {
            // SAFETY: ptr came from alloc_pinned of this instance.
            unsafe { f(self.instance, ptr as *mut c_void) }
        }
    }

    pub fn alloc_device(&self, ordinal: u32, len: u64) -> Result<u64> {
        let mut p = 0u64;
        let ord = i32::try_from(ordinal)
            .map_err(|_| Error::new(ErrorCode::InvalidArgument, "ordinal out of range"))?;
        call!(self, alloc_device, "alloc_device", |f, err| {
            // SAFETY: valid instance and out-pointers.
            unsafe { f(self.instance, ord, len, &mut p, &mut err) }
        })?;
        Ok(p)
    }

    pub fn free_device(&self, ptr: u64) {
        if let Some(f) = self.table().free_device {
            // SAFETY: ptr came from alloc_device of this instance.
            unsafe { f(self.instance, ptr) }
        }
    }

    /// Pins host memory for fast copies (cuMemHostRegister).
    pub fn pin_host(&self, addr: u64, len: u64) -> Result<()> {
        let table = self.table();
        if !has_field!(table, sys::ferry_device_plugin_v1_t, unpin_host) {
            return Err(Error::new(
                ErrorCode::Unsupported,
                format!("{}: no pin_host", self.name),
            ));
        }
        call!(self, pin_host, "pin_host", |f, err| {
            // SAFETY: valid instance; the range is host memory the engine owns.
            unsafe { f(self.instance, addr, len, &mut err) }
        })
    }

    pub fn unpin_host(&self, addr: u64) {
        let table = self.table();
        if !has_field!(table, sys::ferry_device_plugin_v1_t, unpin_host) {
            return;
        }
        if let Some(f) = table.unpin_host {
            // SAFETY: addr was pinned by pin_host of this instance.
            unsafe { f(self.instance, addr) }
        }
    }

    /// Whether the plugin queues a list of copies as one operation (ABI
    /// 1.5 `copy_list_async`); without it staging copies one by one.
    pub fn has_copy_list(&self) -> bool {
        let table = self.table();
        has_field!(table, sys::ferry_device_plugin_v1_t, copy_list_async)
            && table.copy_list_async.is_some()
    }

    /// Whether the plugin tells a stream's progress without waiting (ABI
    /// 1.7 `stream_query`).
    fn can_query(&self) -> bool {
        let table = self.table();
        has_field!(table, sys::ferry_device_plugin_v1_t, stream_query)
            && table.stream_query.is_some()
            && !self.no_query.load(Ordering::Relaxed)
    }

    pub fn stream(self: &Arc<Self>, ordinal: u32) -> Result<Stream> {
        let mut raw: *mut c_void = std::ptr::null_mut();
        let ord = i32::try_from(ordinal)
            .map_err(|_| Error::new(ErrorCode::InvalidArgument, "ordinal out of range"))?;
        call!(self, stream_create, "stream_create", |f, err| {
            // SAFETY: valid instance and out-pointers.
            unsafe { f(self.instance, ord, &mut raw, &mut err) }
        })?;
        Ok(Stream {
            device: self.clone(),
            raw,
        })
    }
}

impl Stream {
    /// Queues a copy of `len` bytes from `src` to `dst` (either may be
    /// device memory).
    pub fn copy(&mut self, dst: u64, src: u64, len: u64) -> Result<()> {
        let d = &self.device;
        call!(d, copy_async, "copy_async", |f, err| {
            // SAFETY: valid instance and stream; the pointers are numbers the
            // driver checks.
            unsafe { f(d.instance, self.raw, dst, src, len, &mut err) }
        })
    }

    /// Queues every copy of `copies` (each `(dst, src, len)` as [`copy`]):
    /// as one device operation where the plugin has list copies (ABI 1.5),
    /// else one copy each. The caller keeps every range alive and checked
    /// against its registrations until [`sync`].
    ///
    /// [`copy`]: Stream::copy
    /// [`sync`]: Stream::sync
    pub fn copy_list(&mut self, copies: &[sys::ferry_device_copy_t]) -> Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        if self.device.has_copy_list() {
            let d = &self.device;
            let listed = call!(d, copy_list_async, "copy_list_async", |f, err| {
                // SAFETY: valid instance and stream; `copies` is a live slice
                // of copies.len() entries for the call (the plugin copies
                // what it keeps); its ranges are numbers the plugin checks.
                unsafe {
                    f(
                        d.instance,
                        self.raw,
                        copies.as_ptr(),
                        copies.len(),
                        &mut err,
                    )
                }
            });
            match listed {
                Err(e) if e.code == ErrorCode::Unsupported => {}
                other => return other,
            }
        }
        if !self.device.said_one_by_one.swap(true, Ordering::Relaxed) {
            log::info!(
                "{}: the device plugin has no list copies (copy_list_async, ABI 1.5); staging \
                 gathers and scatters small blocks one copy each",
                self.device.name
            );
        }
        for c in copies {
            self.copy(c.dst, c.src, c.len)?;
        }
        Ok(())
    }

    /// Whether every copy queued on this stream has finished, without
    /// waiting where the plugin can tell (ABI 1.7 `stream_query`); a
    /// failed copy is an error, as from [`sync`]. Where the plugin cannot
    /// tell, this waits as [`sync`] does and answers true.
    ///
    /// [`sync`]: Stream::sync
    pub fn query(&mut self) -> Result<bool> {
        if self.device.can_query() {
            let d = &self.device;
            let mut done = 0u32;
            let asked = call!(d, stream_query, "stream_query", |f, err| {
                // SAFETY: valid instance and stream; `done` is a live u32
                // the plugin writes once during the call.
                unsafe { f(d.instance, self.raw, &mut done, &mut err) }
            });
            match asked {
                Ok(()) => return Ok(done != 0),
                Err(e) if e.code == ErrorCode::Unsupported => {
                    d.no_query.store(true, Ordering::Relaxed)
                }
                Err(e) => return Err(e),
            }
        }
        self.sync().map(|()| true)
    }

    /// Waits for every copy queued on this stream.
    pub fn sync(&mut self) -> Result<()> {
        let d = &self.device;
        call!(d, stream_sync, "stream_sync", |f, err| {
            // SAFETY: valid instance and stream.
            unsafe { f(d.instance, self.raw, &mut err) }
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Some(f) = self.device.table().stream_destroy {
            // SAFETY: raw came from stream_create and is destroyed once.
            unsafe { f(self.device.instance, self.raw) }
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if let Some(f) = self.table().fini {
            // SAFETY: the instance came from init; every Stream holds an
            // Arc<Device>, so none outlives it.
            unsafe { f(self.instance) }
        }
    }
}
