//! Device plugins in Rust (memory owners such as CUDA): the safe traits and
//! the trampolines that the export macro puts in the C table.

use super::boundary::{boundary, catch, PluginError, PluginResult};
use super::device_info::DeviceInfo;
use super::host::{Host, ProbeReport};
use crate::status::ErrorCode;
use crate::sys;
use std::ffi::{c_void, CStr};

/// A device plugin written in Rust.
pub trait DevicePlugin: 'static {
    /// The file must be `libferry_device_<NAME>.so`.
    const NAME: &'static CStr;
    const VERSION: &'static CStr;
    const DESCRIPTION: &'static CStr;

    /// One instance per engine. Probe-only plugins use [`NoDevices`].
    type Instance: DeviceInstance;

    /// What this plugin could do on this host, without side effects.
    fn probe(host: &Host<'_>, report: &mut ProbeReport<'_>) -> PluginResult<()>;

    /// Creates the instance; `host` stays valid until it is dropped.
    fn init(_host: Host<'static>) -> PluginResult<Self::Instance> {
        Err(PluginError::new(
            ErrorCode::Unsupported,
            "this plugin has no device interface",
        ))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PointerKind {
    /// Not the driver's: ordinary host memory.
    Host,
    Device,
    HostPinned,
    Managed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PointerInfo {
    pub kind: PointerKind,
    pub ordinal: Option<u32>,
    /// The allocation holding the pointer, when known.
    pub base: u64,
    pub size: u64,
}

impl PointerInfo {
    pub const HOST: PointerInfo = PointerInfo {
        kind: PointerKind::Host,
        ordinal: None,
        base: 0,
        size: 0,
    };
}

/// One device plugin instance: what an engine talks to.
pub trait DeviceInstance: Send + Sync + 'static {
    type Stream: Send + Sync + 'static;

    fn device_count(&self) -> PluginResult<u32>;
    fn device_info(&self, ordinal: u32) -> PluginResult<DeviceInfo>;
    fn query_pointer(&self, addr: u64) -> PluginResult<PointerInfo>;
    /// A DMA-BUF fd (owned by the caller) and the address's offset in it;
    /// `None` when the driver cannot export.
    fn export_dmabuf(&self, _addr: u64, _len: u64) -> Option<PluginResult<(i32, u64)>> {
        None
    }
    fn alloc_pinned(&self, len: u64) -> PluginResult<u64>;
    fn free_pinned(&self, ptr: u64);
    fn alloc_device(&self, ordinal: u32, len: u64) -> PluginResult<u64>;
    fn free_device(&self, ptr: u64);
    fn stream_create(&self, ordinal: u32) -> PluginResult<Self::Stream>;
    /// Queues a copy; direction follows from the pointers.
    fn copy_async(&self, stream: &Self::Stream, dst: u64, src: u64, len: u64) -> PluginResult<()>;
    fn stream_sync(&self, stream: &Self::Stream) -> PluginResult<()>;
    /// Pins existing host memory for fast copies; `None` when unsupported.
    fn pin_host(&self, _addr: u64, _len: u64) -> Option<PluginResult<()>> {
        None
    }
    fn unpin_host(&self, _addr: u64) {}
    /// Queues every copy of a list on `stream`, as one device operation
    /// where the device can (ABI 1.5); `None` when unsupported, and the
    /// engine then queues one [`DeviceInstance::copy_async`] per copy.
    fn copy_list_async(
        &self,
        _stream: &Self::Stream,
        _copies: &[sys::ferry_device_copy_t],
    ) -> Option<PluginResult<()>> {
        None
    }
    /// Whether everything queued on `stream` has finished, without
    /// waiting (ABI 1.7); `None` when unsupported, and the engine then
    /// waits with [`DeviceInstance::stream_sync`].
    fn stream_query(&self, _stream: &Self::Stream) -> Option<PluginResult<bool>> {
        None
    }
}

/// The instance type of a probe-only device plugin; export it with
/// `export_device_plugin!(P, probe_only)`.
pub enum NoDevices {}

impl DeviceInstance for NoDevices {
    type Stream = ();
    fn device_count(&self) -> PluginResult<u32> {
        match *self {}
    }
    fn device_info(&self, _: u32) -> PluginResult<DeviceInfo> {
        match *self {}
    }
    fn query_pointer(&self, _: u64) -> PluginResult<PointerInfo> {
        match *self {}
    }
    fn alloc_pinned(&self, _: u64) -> PluginResult<u64> {
        match *self {}
    }
    fn free_pinned(&self, _: u64) {
        match *self {}
    }
    fn alloc_device(&self, _: u32, _: u64) -> PluginResult<u64> {
        match *self {}
    }
    fn free_device(&self, _: u64) {
        match *self {}
    }
    fn stream_create(&self, _: u32) -> PluginResult<()> {
        match *self {}
    }
    fn copy_async(&self, _: &(), _: u64, _: u64, _: u64) -> PluginResult<()> {
        match *self {}
    }
    fn stream_sync(&self, _: &()) -> PluginResult<()> {
        match *self {}
    }
}

fn invalid(what: &str) -> PluginError {
    PluginError::new(ErrorCode::InvalidArgument, format!("{what} is null"))
}

/// # Safety
/// `instance` must come from `device_init_trampoline::<P>`.
unsafe fn instance<'a, P: DevicePlugin>(instance: *mut c_void) -> PluginResult<&'a P::Instance> {
    // SAFETY: init boxed a P::Instance behind this pointer; it lives until fini.
    unsafe { instance.cast::<P::Instance>().cast_const().as_ref() }
        .ok_or_else(|| invalid("instance"))
}

type StreamOf<P> = <<P as DevicePlugin>::Instance as DeviceInstance>::Stream;

/// # Safety
/// `stream` must come from stream_create of the same instance.
unsafe fn stream<'a, P: DevicePlugin>(stream: *mut c_void) -> PluginResult<&'a StreamOf<P>> {
    // SAFETY: stream_create boxed a Stream behind this pointer.
    unsafe { stream.cast::<StreamOf<P>>().cast_const().as_ref() }.ok_or_else(|| invalid("stream"))
}

/// # Safety
/// Called by the host through the table with the contract of plugin.h.
pub unsafe extern "C" fn device_probe_trampoline<P: DevicePlugin>(
    host: *const sys::ferry_host_services_t,
    sink: *const sys::ferry_probe_sink_t,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: the host passes pointers valid for this call.
    unsafe {
        boundary(err, || {
            let host = Host::from_raw(host)?;
            let mut report = ProbeReport::from_raw(sink)?;
            P::probe(&host, &mut report)
        })
    }
}

/// # Safety
/// As [`device_probe_trampoline`]; `host` stays valid until fini.
pub unsafe extern "C" fn device_init_trampoline<P: DevicePlugin>(
    host: *const sys::ferry_host_services_t,
    out: *mut *mut c_void,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `host` is null-checked by Host::from_raw and stays valid until fini (this
    // function's # Safety), which drops the instance holding Host<'static>; `out` is checked
    // non-null before the write (init's out-pointer); `err` is null or a live errbuf.
    unsafe {
        boundary(err, || {
            let host: Host<'static> = Host::from_raw(host)?;
            if out.is_null() {
                return Err(invalid("instance out-pointer"));
            }
            let inst = P::init(host)?;
            *out = Box::into_raw(Box::new(inst)).cast::<c_void>();
            Ok(())
        })
    }
}

/// # Safety
/// `inst` came from init and is not used again.
pub unsafe extern "C" fn device_fini_trampoline<P: DevicePlugin>(inst: *mut c_void) {
    let _ = catch(|| {
        if !inst.is_null() {
            // SAFETY: init produced this Box; fini runs once.
            drop(unsafe { Box::from_raw(inst.cast::<P::Instance>()) });
        }
        Ok(())
    });
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn device_count_trampoline<P: DevicePlugin>(
    inst: *mut c_void,
    count: *mut u32,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `count` is null-checked (as_mut), else device_count's out-pointer (plugin.h);
    // `inst` is null (instance refuses it) or the live instance init returned (plugin.h: init
    // makes it, fini frees it); `err` is null or a live errbuf, which `boundary` handles.
    unsafe {
        boundary(err, || {
            let n = instance::<P>(inst)?.device_count()?;
            *count.as_mut().ok_or_else(|| invalid("count"))? = n;
            Ok(())
        })
    }
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn device_info_trampoline<P: DevicePlugin>(
    inst: *mut c_void,
    ordinal: i32,
    out: *mut sys::ferry_device_info_t,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `out` is null-checked and is the caller's ferry_device_info_t (plugin.h,
    // device_info): only its struct_size is read through the raw pointer until that size
    // covers this plugin's struct, then it is borrowed and written whole; `inst` is null
    // (refused) or init's live instance; `err` null or a live errbuf.
    unsafe {
        boundary(err, || {
            if out.is_null() {
                return Err(invalid("out"));
            }
            let size = std::ptr::addr_of!((*out).struct_size).read_unaligned();
            if (size as usize) < std::mem::size_of::<sys::ferry_device_info_t>() {
                return Err(PluginError::new(
                    ErrorCode::AbiMismatch,
                    "device_info: the caller's struct is older than this plugin's",
                ));
            }
            let ordinal = u32::try_from(ordinal)
                .map_err(|_| PluginError::new(ErrorCode::InvalidArgument, "negative ordinal"))?;
            instance::<P>(inst)?
                .device_info(ordinal)?
                .write_raw(&mut *out);
            Ok(())
        })
    }
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn query_pointer_trampoline<P: DevicePlugin>(
    inst: *mut c_void,
    addr: u64,
    out: *mut sys::ferry_pointer_info_t,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `out` is null-checked and is the caller's ferry_pointer_info_t (plugin.h,
    // query_pointer); only its v1.0 fields kind, ordinal, base and size are written; `inst` is
    // null (refused) or init's live instance; `err` null or a live errbuf.
    unsafe {
        boundary(err, || {
            let out = out.as_mut().ok_or_else(|| invalid("out"))?;
            let p = instance::<P>(inst)?.query_pointer(addr)?;
            out.kind = match p.kind {
                PointerKind::Host => sys::FERRY_PTR_HOST,
                PointerKind::Device => sys::FERRY_PTR_DEVICE,
                PointerKind::HostPinned => sys::FERRY_PTR_HOST_PINNED,
                PointerKind::Managed => sys::FERRY_PTR_MANAGED,
            };
            out.ordinal = p.ordinal.and_then(|o| i32::try_from(o).ok()).unwrap_or(-1);
            out.base = p.base;
            out.size = p.size;
            Ok(())
        })
    }
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn export_dmabuf_trampoline<P: DevicePlugin>(
    inst: *mut c_void,
    addr: u64,
    len: u64,
    fd: *mut i32,
    offset: *mut u64,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `fd` and `offset` are checked non-null before the writes and are export_dmabuf's
    // out-pointers (plugin.h); `inst` is null (instance refuses it) or the live instance init
    // returned (init makes it, fini frees it); `err` is null or a live errbuf for `boundary`.
    unsafe {
        boundary(err, || {
            if fd.is_null() || offset.is_null() {
                return Err(invalid("fd or offset"));
            }
            let (f, off) = instance::<P>(inst)?
                .export_dmabuf(addr, len)
                .unwrap_or_else(|| {
                    Err(PluginError::new(
                        ErrorCode::Unsupported,
                        "this driver cannot export DMA-BUF",
                    ))
                })?;
            *fd = f;
            *offset = off;
            Ok(())
        })
    }
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn alloc_pinned_trampoline<P: DevicePlugin>(
    inst: *mut c_void,
    len: u64,
    out: *mut *mut c_void,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `out` is null-checked (as_mut), else alloc_pinned's out-pointer (plugin.h); `inst`
    // is null (instance refuses it) or the live instance init returned (plugin.h: init makes it,
    // fini frees it); `err` is null or a live errbuf, which `boundary` handles.
    unsafe {
        boundary(err, || {
            let p = instance::<P>(inst)?.alloc_pinned(len)?;
            *out.as_mut().ok_or_else(|| invalid("out"))? = p as *mut c_void;
            Ok(())
        })
    }
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn free_pinned_trampoline<P: DevicePlugin>(
    inst: *mut c_void,
    ptr: *mut c_void,
) {
    let _ = catch(|| {
        // SAFETY: `inst` is null (instance refuses it) or the live instance
        // this plugin's init returned: the ABI's contract for every call.
        unsafe { instance::<P>(inst) }?.free_pinned(ptr as u64);
        Ok(())
    });
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn alloc_device_trampoline<P: DevicePlugin>(
    inst: *mut c_void,
    ordinal: i32,
    len: u64,
    out: *mut u64,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `out` is null-checked (as_mut), else alloc_device's out-pointer (plugin.h); `inst`
    // is null (instance refuses it) or the live instance init returned (plugin.h: init makes it,
    // fini frees it); `err` is null or a live errbuf, which `boundary` handles.
    unsafe {
        boundary(err, || {
            let ordinal = u32::try_from(ordinal)
                .map_err(|_| PluginError::new(ErrorCode::InvalidArgument, "negative ordinal"))?;
            let p = instance::<P>(inst)?.alloc_device(ordinal, len)?;
            *out.as_mut().ok_or_else(|| invalid("out"))? = p;
            Ok(())
        })
    }
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn free_device_trampoline<P: DevicePlugin>(inst: *mut c_void, ptr: u64) {
    let _ = catch(|| {
        // SAFETY: `inst` is null (instance refuses it) or the live instance
        // this plugin's init returned: the ABI's contract for every call.
        unsafe { instance::<P>(inst) }?.free_device(ptr);
        Ok(())
    });
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn stream_create_trampoline<P: DevicePlugin>(
    inst: *mut c_void,
    ordinal: i32,
    out: *mut *mut c_void,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `out` is null-checked (as_mut), else stream_create's out-pointer (plugin.h); `inst`
    // is null (instance refuses it) or the live instance init returned (plugin.h: init makes it,
    // fini frees it); `err` is null or a live errbuf, which `boundary` handles.
    unsafe {
        boundary(err, || {
            let ordinal = u32::try_from(ordinal)
                .map_err(|_| PluginError::new(ErrorCode::InvalidArgument, "negative ordinal"))?;
            let s = instance::<P>(inst)?.stream_create(ordinal)?;
            *out.as_mut().ok_or_else(|| invalid("out"))? =
                Box::into_raw(Box::new(s)).cast::<c_void>();
            Ok(())
        })
    }
}

/// # Safety
/// `s` came from stream_create and is not used again.
pub unsafe extern "C" fn stream_destroy_trampoline<P: DevicePlugin>(
    _inst: *mut c_void,
    s: *mut c_void,
) {
    let _ = catch(|| {
        if !s.is_null() {
            // SAFETY: stream_create produced this Box; destroyed once.
            drop(unsafe { Box::from_raw(s.cast::<StreamOf<P>>()) });
        }
        Ok(())
    });
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn copy_async_trampoline<P: DevicePlugin>(
    inst: *mut c_void,
    s: *mut c_void,
    dst: u64,
    src: u64,
    len: u64,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `s` is null (stream refuses it) or a live stream from this instance's stream_create
    // (plugin.h: freed only by stream_destroy); `inst` is null (refused) or init's live instance;
    // `dst`/`src` are numbers, not dereferenced here; `err` null or a live errbuf.
    unsafe {
        boundary(err, || {
            instance::<P>(inst)?.copy_async(stream::<P>(s)?, dst, src, len)
        })
    }
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn stream_sync_trampoline<P: DevicePlugin>(
    inst: *mut c_void,
    s: *mut c_void,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `s` is null (stream refuses it) or a live stream from this instance's stream_create
    // (plugin.h: freed only by stream_destroy); `inst` is null (refused) or init's live instance;
    // `err` is null or a live errbuf, which `boundary` handles.
    unsafe { boundary(err, || instance::<P>(inst)?.stream_sync(stream::<P>(s)?)) }
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn pin_host_trampoline<P: DevicePlugin>(
    inst: *mut c_void,
    addr: u64,
    len: u64,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `inst` is null (instance refuses it) or the live instance init returned (plugin.h:
    // init makes it, fini frees it); `addr` and `len` are numbers, not dereferenced here; `err`
    // is null or a live errbuf, which `boundary` handles.
    unsafe {
        boundary(err, || {
            instance::<P>(inst)?.pin_host(addr, len).unwrap_or_else(|| {
                Err(PluginError::new(
                    ErrorCode::Unsupported,
                    "this driver cannot pin host memory",
                ))
            })
        })
    }
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn unpin_host_trampoline<P: DevicePlugin>(inst: *mut c_void, addr: u64) {
    let _ = catch(|| {
        // SAFETY: `inst` is null (instance refuses it) or the live instance
        // this plugin's init returned: the ABI's contract for every call.
        unsafe { instance::<P>(inst) }?.unpin_host(addr);
        Ok(())
    });
}

/// # Safety
/// As [`device_probe_trampoline`]; `copies` holds `count` entries for the
/// call.
pub unsafe extern "C" fn copy_list_async_trampoline<P: DevicePlugin>(
    inst: *mut c_void,
    s: *mut c_void,
    copies: *const sys::ferry_device_copy_t,
    count: usize,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `inst` and `s` are this plugin's (the ABI's contract), `err`
    // is the caller's buffer; `copies` is checked non-null below and holds
    // `count` entries for the call, as plugin.h requires of the host, and
    // the count is bounded so the slice's size fits an isize.
    unsafe {
        boundary(err, || {
            if count == 0 {
                return Ok(());
            }
            if copies.is_null() {
                return Err(invalid("copies"));
            }
            if count > isize::MAX as usize / std::mem::size_of::<sys::ferry_device_copy_t>() {
                return Err(PluginError::new(
                    ErrorCode::InvalidArgument,
                    "copy_list_async: count too large",
                ));
            }
            let list = std::slice::from_raw_parts(copies, count);
            instance::<P>(inst)?
                .copy_list_async(stream::<P>(s)?, list)
                .unwrap_or_else(|| {
                    Err(PluginError::new(
                        ErrorCode::Unsupported,
                        "this device plugin has no list copies",
                    ))
                })
        })
    }
}

/// # Safety
/// As [`device_probe_trampoline`].
pub unsafe extern "C" fn stream_query_trampoline<P: DevicePlugin>(
    inst: *mut c_void,
    s: *mut c_void,
    done: *mut u32,
    err: *mut sys::ferry_errbuf_t,
) -> sys::ferry_status_t {
    // SAFETY: `s` is null (stream refuses it) or a live stream from this instance's stream_create
    // (plugin.h: freed only by stream_destroy); `inst` is null (refused) or init's live instance;
    // `done` is checked non-null before the one write below and is the caller's u32 for the
    // call (plugin.h); `err` is null or a live errbuf, which `boundary` handles.
    unsafe {
        boundary(err, || {
            if done.is_null() {
                return Err(invalid("done"));
            }
            let finished = instance::<P>(inst)?
                .stream_query(stream::<P>(s)?)
                .unwrap_or_else(|| {
                    Err(PluginError::new(
                        ErrorCode::Unsupported,
                        "this device plugin cannot query a stream",
                    ))
                })?;
            done.write(u32::from(finished));
            Ok(())
        })
    }
}

/// The v1 table for a Rust device plugin with a device interface.
pub const fn device_table_v1<P: DevicePlugin>() -> sys::ferry_device_plugin_v1_t {
    sys::ferry_device_plugin_v1_t {
        hdr: sys::ferry_abi_header_t::for_table::<sys::ferry_device_plugin_v1_t>(),
        name: P::NAME.as_ptr(),
        version: P::VERSION.as_ptr(),
        description: P::DESCRIPTION.as_ptr(),
        probe: Some(device_probe_trampoline::<P>),
        init: Some(device_init_trampoline::<P>),
        fini: Some(device_fini_trampoline::<P>),
        device_count: Some(device_count_trampoline::<P>),
        device_info: Some(device_info_trampoline::<P>),
        query_pointer: Some(query_pointer_trampoline::<P>),
        export_dmabuf: Some(export_dmabuf_trampoline::<P>),
        alloc_pinned: Some(alloc_pinned_trampoline::<P>),
        free_pinned: Some(free_pinned_trampoline::<P>),
        alloc_device: Some(alloc_device_trampoline::<P>),
        free_device: Some(free_device_trampoline::<P>),
        stream_create: Some(stream_create_trampoline::<P>),
        stream_destroy: Some(stream_destroy_trampoline::<P>),
        copy_async: Some(copy_async_trampoline::<P>),
        stream_sync: Some(stream_sync_trampoline::<P>),
        pin_host: Some(pin_host_trampoline::<P>),
        unpin_host: Some(unpin_host_trampoline::<P>),
        copy_list_async: Some(copy_list_async_trampoline::<P>),
        stream_query: Some(stream_query_trampoline::<P>),
    }
}

/// The v1 table for a probe-only Rust device plugin.
pub const fn device_table_v1_probe_only<P: DevicePlugin>() -> sys::ferry_device_plugin_v1_t {
    sys::ferry_device_plugin_v1_t {
        init: None,
        fini: None,
        device_count: None,
        device_info: None,
        query_pointer: None,
        export_dmabuf: None,
        alloc_pinned: None,
        free_pinned: None,
        alloc_device: None,
        free_device: None,
        stream_create: None,
        stream_destroy: None,
        copy_async: None,
        stream_sync: None,
        pin_host: None,
        unpin_host: None,
        copy_list_async: None,
        stream_query: None,
        ..device_table_v1::<P>()
    }
}

/// Exports a [`DevicePlugin`] as `ferry_device_plugin_v1`. With
/// `probe_only`, the table carries no device interface.
#[macro_export]
macro_rules! export_device_plugin {
    ($plugin:ty) => {
        $crate::export_device_plugin!(@table $plugin, device_table_v1);
    };
    ($plugin:ty, probe_only) => {
        $crate::export_device_plugin!(@table $plugin, device_table_v1_probe_only);
    };
    (@table $plugin:ty, $table:ident) => {
        /// Entry point of this Ferry device plugin (ABI v1).
        #[unsafe(no_mangle)]
        pub extern "C" fn ferry_device_plugin_v1() -> *const $crate::sys::ferry_device_plugin_v1_t {
            static TABLE: $crate::sys::ferry_device_plugin_v1_t =
                $crate::sdk::$table::<$plugin>();
            &TABLE
        }
    };
}
