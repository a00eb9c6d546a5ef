//! One plugin instance: devices, their primary contexts, pointer
//! classification, DMA-BUF export, memory and copy streams.
//!
//! Contexts. The plugin works in each device's primary context, the one the
//! CUDA runtime (and so PyTorch) uses, so pointers and streams are shared
//! with the application. A device's primary context is retained the first
//! time the instance needs it (not for every visible GPU at init: a context
//! costs hundreds of MiB of device memory, and a process that sees eight GPUs
//! usually uses one) and released when the instance and its last stream are
//! gone. The engine calls from many threads: every call that needs a context
//! makes the device's context current on the calling thread and puts back
//! whatever was current before when it returns, so the plugin never changes
//! which device an application thread is on.
//!
//! query_pointer needs no context on the fast path: cuPointerGetAttributes
//! answers for any pointer in the process's unified address space. Only if
//! the driver asks for a current context does it borrow one.

use crate::bounce::Scratch;
use ferry_cuda_driver::driver::*;
use ferry_cuda_driver::kernel::Kernel;
use ferry_cuda_driver::method::CopySetting;
use ferry_cuda_driver::PrimaryContext;
use ferry_plugins_abi::sdk::{
    DeviceInfo, DeviceInstance, Host, PluginError, PluginResult, PointerInfo, PointerKind,
};
use ferry_plugins_abi::ErrorCode;
use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

/// The setting that forces how lists of copies move (lists.rs).
pub(crate) const COPY_KEY: &str = "cuda.copy";

/// cuMemHostRegister: map the range into the devices' address space.
const CU_MEMHOSTREGISTER_DEVICEMAP: c_uint = 0x02;
/// CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: a mapped
/// registration is reached by kernels at its host address.
const CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: c_int = 91;

/// What probe and init learn about one device, without a context.
#[derive(Clone, Debug)]
pub struct DeviceFacts {
    pub info: DeviceInfo,
    pub handle: CUdevice,
    /// Compute capability (major, minor).
    pub compute: Option<(i32, i32)>,
}

/// Describes device `ordinal` from device queries alone (no context).
pub fn describe_device(driver: &Driver, ordinal: u32) -> PluginResult<DeviceFacts> {
    let handle = driver.device(ordinal)?;
    let flag = |attribute| driver.attribute(handle, attribute).map(|v| v != 0);
    let compute = driver
        .attribute(handle, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .zip(driver.attribute(handle, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR));
    Ok(DeviceFacts {
        info: DeviceInfo {
            ordinal,
            name: driver.device_name(handle)?,
            pci_bus_id: driver.pci_bus_id(handle)?,
            uuid: driver.uuid(handle).unwrap_or_default(),
            total_memory: driver.total_memory(handle)?,
            gpu_direct_rdma: flag(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED),
            dmabuf: flag(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED),
            dmabuf_export: driver.can_export_dmabuf(),
        },
        handle,
        compute,
    })
}

/// Every visible device; unavailable when there is none.
pub fn describe_all(driver: &Driver) -> PluginResult<Vec<DeviceFacts>> {
    let count = driver.device_count()?;
    if count == 0 {
        return Err(PluginError::unavailable(format!(
            "no CUDA device visible ({})",
            visible_devices()
        )));
    }
    (0..count).map(|o| describe_device(driver, o)).collect()
}

/// A stream on one device, non-blocking with respect to the legacy
/// default stream.
pub struct CudaStream {
    pub(crate) raw: CUstream,
    pub(crate) ordinal: u32,
    pub(crate) ctx: Arc<PrimaryContext>,
    /// Device memory for lists that bounce (bounce.rs); held across the
    /// whole enqueue of one list, so two lists never interleave in it.
    pub(crate) scratch: Mutex<Scratch>,
}

// SAFETY: a CUstream is a process-wide handle and the driver accepts work on
// it from any thread; the plugin makes its context current around each call.
unsafe impl Send for CudaStream {}
// SAFETY: shared access only passes the stream to the driver, which
// accepts work on it from any thread; the handle is never mutated.
unsafe impl Sync for CudaStream {}

impl Drop for CudaStream {
    fn drop(&mut self) {
        let d = self.ctx.driver();
        let Some(destroy) = d.api.cu_stream_destroy else {
            return;
        };
        let Ok(_current) = self.ctx.enter() else {
            return;
        };
        let scratch = self
            .scratch
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(sync) = d.api.cu_stream_synchronize {
            // SAFETY: raw is this context's live stream (destroyed below);
            // the context is current.
            if d.check("cuStreamSynchronize", unsafe { sync(self.raw) })
                .is_ok()
            {
                // SAFETY: the stream is idle, so no queued list uses the
                // scratch; its context is current.
                unsafe { scratch.release(d) };
            }
        }
        // SAFETY: raw came from cuStreamCreate in this context, which the
        // Arc keeps alive; it is destroyed once, here. Work still queued
        // completes first (the driver defers the release).
        let _ = unsafe { destroy(self.raw) };
    }
}

pub(crate) struct Device {
    facts: DeviceFacts,
    ctx: OnceLock<Arc<PrimaryContext>>,
    retaining: Mutex<()>,
    /// The copy kernel in this device's context, loaded by the first list
    /// (lists.rs), or why it cannot be.
    pub(crate) kernel: OnceLock<Result<Kernel, String>>,
}

#[derive(Clone, Copy)]
pub(crate) struct Allocation {
    ordinal: u32,
    pub(crate) len: u64,
    /// Mapped into the devices' address space at the same address (pinned
    /// by cuMemHostAlloc, or registered with DEVICEMAP), so the copy kernel
    /// may touch it.
    pub(crate) mapped: bool,
}

pub struct CudaInstance {
    pub(crate) driver: &'static Driver,
    pub(crate) host: Host<'static>,
    pub(crate) devices: Vec<Device>,
    device_memory: Mutex<HashMap<u64, Allocation>>,
    pub(crate) pinned_memory: Mutex<HashMap<u64, Allocation>>,
    /// Host memory pinned in place by pin_host.
    pub(crate) registered_memory: Mutex<HashMap<u64, Allocation>>,
    /// How lists of copies move (`cuda.copy`).
    pub(crate) copy: CopySetting,
    page_size: u64,
    said_pointer_needs_context: AtomicBool,
    /// Whether a list the kernel cannot reach was logged (once).
    pub(crate) said_list_fallback: AtomicBool,
}

fn invalid(msg: impl Into<String>) -> PluginError {
    PluginError::new(ErrorCode::InvalidArgument, msg)
}

fn host_page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n)
        .ok()
        .filter(|n| n.is_power_of_two())
        .unwrap_or(4096)
}

/// [addr, addr + len) widened to whole pages: (start, end).
pub fn page_span(addr: u64, len: u64, page: u64) -> Option<(u64, u64)> {
    let end = addr.checked_add(len)?;
    let start = addr & !(page - 1);
    let end = end.checked_add(page - 1)? & !(page - 1);
    Some((start, end))
}

/// The raw answers of cuPointerGetAttributes for one pointer.
#[derive(Clone, Copy, Debug, Default)]
struct Attributes {
    memory_type: u32,
    ordinal: i32,
    managed: bool,
    start: u64,
    size: u64,
}

impl Attributes {
    fn classify(self) -> PointerInfo {
        let kind = if self.managed {
            PointerKind::Managed
        } else {
            match self.memory_type {
                CU_MEMORYTYPE_DEVICE | CU_MEMORYTYPE_ARRAY => PointerKind::Device,
                CU_MEMORYTYPE_HOST => PointerKind::HostPinned,
                CU_MEMORYTYPE_UNIFIED => PointerKind::Managed,
                _ => return PointerInfo::HOST,
            }
        };
        let ordinal = match kind {
            PointerKind::Device | PointerKind::Managed => u32::try_from(self.ordinal).ok(),
            _ => None,
        };
        PointerInfo {
            kind,
            ordinal,
            base: self.start,
            size: self.size,
        }
    }
}

impl CudaInstance {
    pub fn new(
        host: Host<'static>,
        driver: &'static Driver,
        facts: Vec<DeviceFacts>,
    ) -> PluginResult<CudaInstance> {
        let copy = CopySetting::parse(COPY_KEY, host.config(COPY_KEY).as_deref())?;
        Ok(CudaInstance {
            driver,
            host,
            copy,
            devices: facts
                .into_iter()
                .map(|facts| Device {
                    facts,
                    ctx: OnceLock::new(),
                    retaining: Mutex::new(()),
                    kernel: OnceLock::new(),
                })
                .collect(),
            device_memory: Mutex::new(HashMap::new()),
            pinned_memory: Mutex::new(HashMap::new()),
            registered_memory: Mutex::new(HashMap::new()),
            page_size: host_page_size(),
            said_pointer_needs_context: AtomicBool::new(false),
            said_list_fallback: AtomicBool::new(false),
        })
    }

    fn device(&self, ordinal: u32) -> PluginResult<&Device> {
        self.devices.get(ordinal as usize).ok_or_else(|| {
            invalid(format!(
                "no CUDA device {ordinal}: {} visible ({})",
                self.devices.len(),
                visible_devices()
            ))
        })
    }

    /// The primary context of `ordinal`, retained on first use.
    pub(crate) fn context(&self, ordinal: u32) -> PluginResult<&Arc<PrimaryContext>> {
        let device = self.device(ordinal)?;
        if let Some(ctx) = device.ctx.get() {
            return Ok(ctx);
        }
        let _one_at_a_time = device
            .retaining
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if device.ctx.get().is_none() {
            let ctx = PrimaryContext::retain(self.driver, device.facts.handle)?;
            self.host.debug(&format!(
                "retained the primary context of cuda:{ordinal} ({})",
                device.facts.info.pci_bus_id
            ));
            // Cannot be set already: we hold `retaining`.
            let _ = device.ctx.set(Arc::new(ctx));
        }
        device
            .ctx
            .get()
            .ok_or_else(|| PluginError::new(ErrorCode::Internal, "primary context vanished"))
    }

    /// A context for work that any device can do (pinned host memory,
    /// pointer queries): the first one already retained, else device 0's.
    fn any_context(&self) -> PluginResult<(u32, &Arc<PrimaryContext>)> {
        for (i, d) in self.devices.iter().enumerate() {
            if let Some(ctx) = d.ctx.get() {
                return Ok((i as u32, ctx));
            }
        }
        Ok((0, self.context(0)?))
    }

    fn raw_attributes(&self, addr: u64, out: &mut Attributes) -> PluginResult<CUresult> {
        let d = self.driver;
        let f = d.function(d.api.cu_pointer_get_attributes, "cuPointerGetAttributes")?;
        let mut which: [c_uint; 5] = [
            CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            CU_POINTER_ATTRIBUTE_IS_MANAGED,
            CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ];
        // Each answer gets 8 zeroed bytes, wider than any of these
        // attributes (4-byte enum, int and bool-as-uint; 8-byte address and
        // size), so a driver writing fewer bytes still leaves a valid value.
        let mut data = [0u64; 5];
        let base = data.as_mut_ptr();
        let mut slots: [*mut c_void; 5] =
            std::array::from_fn(|i| base.wrapping_add(i).cast::<c_void>());
        // SAFETY: which and slots hold 5 entries each, every slot points to
        // 8 writable bytes that outlive the call.
        let r = unsafe { f(5, which.as_mut_ptr(), slots.as_mut_ptr(), addr) };
        *out = Attributes {
            memory_type: data[0] as u32,
            ordinal: data[1] as u32 as i32,
            managed: data[2] as u32 != 0,
            start: data[3],
            size: data[4],
        };
        Ok(r)
    }

    /// Device memory of `ordinal` (not managed) holding [addr, addr + len):
    /// its allocation's range, or None.
    pub(crate) fn device_range(&self, ordinal: u32, addr: u64, len: u64) -> Option<(u64, u64)> {
        let a = self.attributes(addr).ok()??;
        let end = addr.checked_add(len)?;
        let alloc_end = a.start.checked_add(a.size)?;
        let device = matches!(a.memory_type, CU_MEMORYTYPE_DEVICE) && !a.managed;
        (device
            && u32::try_from(a.ordinal).ok() == Some(ordinal)
            && a.start <= addr
            && end <= alloc_end)
            .then_some((a.start, alloc_end))
    }

    fn attributes(&self, addr: u64) -> PluginResult<Option<Attributes>> {
        let mut attrs = Attributes::default();
        match self.raw_attributes(addr, &mut attrs)? {
            CUDA_SUCCESS => return Ok(Some(attrs)),
            // Memory the driver never saw.
            CUDA_ERROR_INVALID_VALUE => return Ok(None),
            CUDA_ERROR_INVALID_CONTEXT => {}
            r => return Err(self.driver.error("cuPointerGetAttributes", r)),
        }
        // The driver wants a current context on this thread; any will do
        // in a unified address space.
        let (ordinal, ctx) = self.any_context()?;
        if !self
            .said_pointer_needs_context
            .swap(true, Ordering::Relaxed)
        {
            self.host.debug(&format!(
                "cuPointerGetAttributes asked for a current context; pointer queries \
                 on threads without one borrow cuda:{ordinal}'s primary context"
            ));
        }
        let _current = ctx.enter()?;
        match self.raw_attributes(addr, &mut attrs)? {
            CUDA_SUCCESS => Ok(Some(attrs)),
            CUDA_ERROR_INVALID_VALUE | CUDA_ERROR_INVALID_CONTEXT => Ok(None),
            r => Err(self.driver.error("cuPointerGetAttributes", r)),
        }
    }

    fn export(
        &self,
        get_handle: unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize, c_int, u64) -> CUresult,
        addr: u64,
        len: u64,
    ) -> PluginResult<(i32, u64)> {
        if len == 0 {
            return Err(invalid("export_dmabuf: empty range"));
        }
        let info = self.query_pointer(addr)?;
        if info.kind != PointerKind::Device {
            let kind = match info.kind {
                PointerKind::HostPinned => "pinned host",
                PointerKind::Managed => "managed",
                _ => "ordinary host",
            };
            return Err(invalid(format!(
                "export_dmabuf: {addr:#x} is {kind} memory; only device memory (cuMemAlloc, \
                 cudaMalloc, cuMemCreate+cuMemMap) can be exported as DMA-BUF"
            )));
        }
        let (start, end) = page_span(addr, len, self.page_size).ok_or_else(|| {
            PluginError::new(ErrorCode::OutOfBounds, "export_dmabuf: range overflows")
        })?;
        let ordinal = info.ordinal.unwrap_or(0);
        let ctx = self.context(ordinal)?;
        let _current = ctx.enter()?;
        let mut fd: c_int = -1;
        // SAFETY: fd is a valid out-parameter of the size the DMA_BUF_FD
        // handle type writes (an int); start and end are page-aligned as the
        // driver requires.
        let r = unsafe {
            get_handle(
                (&mut fd as *mut c_int).cast::<c_void>(),
                start,
                (end - start) as usize,
                CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        if r != CUDA_SUCCESS {
            let mut e = self.driver.error("cuMemGetHandleForAddressRange", r);
            e.message.push_str(&format!(
                " (range {start:#x}..{end:#x}, widened to {} KiB pages from {addr:#x}+{len}, \
                 in the allocation {:#x}+{} on cuda:{ordinal})",
                self.page_size / 1024,
                info.base,
                info.size
            ));
            return Err(e);
        }
        if fd < 0 {
            return Err(PluginError::new(
                ErrorCode::Plugin,
                "cuMemGetHandleForAddressRange succeeded but returned no fd",
            ));
        }
        Ok((fd, addr - start))
    }
}

impl DeviceInstance for CudaInstance {
    type Stream = CudaStream;

    fn device_count(&self) -> PluginResult<u32> {
        Ok(self.devices.len() as u32)
    }

    fn device_info(&self, ordinal: u32) -> PluginResult<DeviceInfo> {
        Ok(self.device(ordinal)?.facts.info.clone())
    }

    fn query_pointer(&self, addr: u64) -> PluginResult<PointerInfo> {
        Ok(self
            .attributes(addr)?
            .map_or(PointerInfo::HOST, Attributes::classify))
    }

    fn export_dmabuf(&self, addr: u64, len: u64) -> Option<PluginResult<(i32, u64)>> {
        let get_handle = self.driver.api.cu_mem_get_handle_for_address_range?;
        Some(self.export(get_handle, addr, len))
    }

    fn alloc_pinned(&self, len: u64) -> PluginResult<u64> {
        if len == 0 {
            return Err(invalid("alloc_pinned: zero bytes"));
        }
        let bytes = usize::try_from(len).map_err(|_| invalid("alloc_pinned: too large"))?;
        let d = self.driver;
        let f = d.function(d.api.cu_mem_host_alloc, "cuMemHostAlloc")?;
        let (ordinal, ctx) = self.any_context()?;
        let _current = ctx.enter()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: p is a valid out-pointer; PORTABLE makes the memory pinned
        // for every context, not only the current one.
        let r = unsafe { f(&mut p, bytes, CU_MEMHOSTALLOC_PORTABLE) };
        d.check("cuMemHostAlloc", r).map_err(|mut e| {
            e.message.push_str(&format!(" ({len} bytes)"));
            e
        })?;
        self.pinned_memory
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                p as u64,
                Allocation {
                    ordinal,
                    len,
                    // cuMemHostAlloc memory is mapped at its host address
                    // wherever addressing is unified (every 64-bit driver).
                    mapped: true,
                },
            );
        Ok(p as u64)
    }

    fn free_pinned(&self, ptr: u64) {
        let found = self
            .pinned_memory
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&ptr);
        let Some(a) = found else {
            self.host.warn(&format!(
                "free_pinned({ptr:#x}): not allocated by alloc_pinned or already freed; ignored"
            ));
            return;
        };
        if let Err(e) = self.release_pinned(ptr, a) {
            self.host.warn(&e.message);
        }
    }

    fn pin_host(&self, addr: u64, len: u64) -> Option<PluginResult<()>> {
        let d = self.driver;
        let f = d.api.cu_mem_host_register?;
        Some((|| {
            let bytes = usize::try_from(len).map_err(|_| invalid("pin_host: too large"))?;
            if addr == 0 || len == 0 {
                return Err(invalid("pin_host: empty range"));
            }
            let (ordinal, ctx) = self.any_context()?;
            let _current = ctx.enter()?;
            // Mapped into the devices too where the driver allows, so the
            // copy kernel reaches it at its host address (attribute 91).
            let same_address = self.devices.iter().all(|dev| {
                d.attribute(dev.facts.handle, CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM) == Some(1)
            });
            let mut mapped = same_address;
            let mut r = CUDA_ERROR_INVALID_VALUE;
            if mapped {
                let flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP;
                // SAFETY: the engine pins only host memory it allocated and
                // keeps mapped until unpin_host; the driver checks the range.
                r = unsafe { f(addr as *mut c_void, bytes, flags) };
            }
            if r != CUDA_SUCCESS {
                mapped = false;
                // SAFETY: as the engine's contract for pin_host says (its
                // own host memory, mapped until unpin_host); the driver
                // checks the range. Pinned only, not mapped, this time.
                r = unsafe { f(addr as *mut c_void, bytes, CU_MEMHOSTREGISTER_PORTABLE) };
            }
            d.check("cuMemHostRegister", r).map_err(|mut e| {
                e.message.push_str(&format!(" ({len} bytes at {addr:#x})"));
                e
            })?;
            self.registered_memory
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(
                    addr,
                    Allocation {
                        ordinal,
                        len,
                        mapped,
                    },
                );
            Ok(())
        })())
    }

    fn unpin_host(&self, addr: u64) {
        let found = self
            .registered_memory
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&addr);
        let (Some(a), Some(f)) = (found, self.driver.api.cu_mem_host_unregister) else {
            return;
        };
        let unpinned = self.context(a.ordinal).and_then(|ctx| {
            let _current = ctx.enter()?;
            // SAFETY: addr was registered by pin_host and just removed from
            // the table, so it is unregistered once.
            self.driver
                .check("cuMemHostUnregister", unsafe { f(addr as *mut c_void) })
        });
        if let Err(e) = unpinned {
            self.host.warn(&e.message);
        }
    }

    fn alloc_device(&self, ordinal: u32, len: u64) -> PluginResult<u64> {
        if len == 0 {
            return Err(invalid("alloc_device: zero bytes"));
        }
        let bytes = usize::try_from(len).map_err(|_| invalid("alloc_device: too large"))?;
        let d = self.driver;
        let f = d.function(d.api.cu_mem_alloc, "cuMemAlloc_v2")?;
        let ctx = self.context(ordinal)?;
        let _current = ctx.enter()?;
        let mut p: CUdeviceptr = 0;
        // SAFETY: p is a valid out-pointer; the device's context is current.
        let r = unsafe { f(&mut p, bytes) };
        d.check("cuMemAlloc_v2", r).map_err(|mut e| {
            e.message
                .push_str(&format!(" ({len} bytes on cuda:{ordinal})"));
            e
        })?;
        self.device_memory
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                p,
                Allocation {
                    ordinal,
                    len,
                    mapped: false,
                },
            );
        Ok(p)
    }

    fn free_device(&self, ptr: u64) {
        let found = self
            .device_memory
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&ptr);
        let Some(a) = found else {
            self.host.warn(&format!(
                "free_device({ptr:#x}): not allocated by alloc_device or already freed; ignored"
            ));
            return;
        };
        if let Err(e) = self.release_device(ptr, a) {
            self.host.warn(&e.message);
        }
    }

    fn stream_create(&self, ordinal: u32) -> PluginResult<CudaStream> {
        let d = self.driver;
        let f = d.function(d.api.cu_stream_create, "cuStreamCreate")?;
        let ctx = self.context(ordinal)?;
        let _current = ctx.enter()?;
        let mut raw: CUstream = std::ptr::null_mut();
        // SAFETY: raw is a valid out-pointer; the device's context is current.
        d.check("cuStreamCreate", unsafe {
            f(&mut raw, CU_STREAM_NON_BLOCKING)
        })?;
        Ok(CudaStream {
            raw,
            ordinal,
            ctx: Arc::clone(ctx),
            scratch: Mutex::new(Scratch::default()),
        })
    }

    fn copy_async(&self, stream: &CudaStream, dst: u64, src: u64, len: u64) -> PluginResult<()> {
        if len == 0 {
            return Ok(());
        }
        let bytes = usize::try_from(len).map_err(|_| invalid("copy_async: too large"))?;
        let d = self.driver;
        let f = d.function(d.api.cu_memcpy_async, "cuMemcpyAsync")?;
        let _current = stream.ctx.enter()?;
        // SAFETY: the stream is alive (borrowed) and its context current;
        // the driver validates both addresses (unified addressing tells it
        // the direction) and fails the call rather than touching bad memory
        // it knows about. The caller keeps both buffers alive until
        // stream_sync, as the ABI requires.
        let r = unsafe { f(dst, src, bytes, stream.raw) };
        d.check("cuMemcpyAsync", r).map_err(|mut e| {
            e.message.push_str(&format!(
                " ({len} bytes {src:#x} -> {dst:#x} on a cuda:{} stream)",
                stream.ordinal
            ));
            e
        })
    }

    fn copy_list_async(
        &self,
        stream: &CudaStream,
        copies: &[ferry_plugins_abi::sys::ferry_device_copy_t],
    ) -> Option<PluginResult<()>> {
        Some(self.copy_list(stream, copies))
    }

    fn stream_sync(&self, stream: &CudaStream) -> PluginResult<()> {
        let d = self.driver;
        let f = d.function(d.api.cu_stream_synchronize, "cuStreamSynchronize")?;
        let _current = stream.ctx.enter()?;
        // SAFETY: the stream is alive (borrowed) and its context current.
        d.check("cuStreamSynchronize", unsafe { f(stream.raw) })
    }

    fn stream_query(&self, stream: &CudaStream) -> Option<PluginResult<bool>> {
        let d = self.driver;
        let f = d.api.cu_stream_query?;
        Some((|| {
            let _current = stream.ctx.enter()?;
            // SAFETY: the stream is alive (borrowed) and its context is
            // current (entered above); cuStreamQuery only reads its state.
            match unsafe { f(stream.raw) } {
                CUDA_ERROR_NOT_READY => Ok(false),
                status => d.check("cuStreamQuery", status).map(|()| true),
            }
        })())
    }
}

impl CudaInstance {
    fn release_device(&self, ptr: u64, a: Allocation) -> PluginResult<()> {
        let d = self.driver;
        let f = d.function(d.api.cu_mem_free, "cuMemFree_v2")?;
        let ctx = self.context(a.ordinal)?;
        let _current = ctx.enter()?;
        // SAFETY: ptr came from cuMemAlloc_v2 in this context and was just
        // removed from the table, so it is freed once.
        d.check("cuMemFree_v2", unsafe { f(ptr) })
    }

    fn release_pinned(&self, ptr: u64, a: Allocation) -> PluginResult<()> {
        let d = self.driver;
        let f = d.function(d.api.cu_mem_free_host, "cuMemFreeHost")?;
        let ctx = self.context(a.ordinal)?;
        let _current = ctx.enter()?;
        // SAFETY: ptr came from cuMemHostAlloc and was just removed from the
        // table, so it is freed once.
        d.check("cuMemFreeHost", unsafe { f(ptr as *mut c_void) })
    }
}

impl Drop for CudaInstance {
    fn drop(&mut self) {
        // The kernels go first, in their contexts: every stream the engine
        // made is gone (each holds the instance), its work synced by then.
        for device in &self.devices {
            if let (Some(ctx), Some(Ok(k))) = (device.ctx.get(), device.kernel.get()) {
                if let Ok(_current) = ctx.enter() {
                    k.free(self.driver);
                }
            }
        }
        // Free what the engine left behind while our contexts still hold;
        // the contexts themselves are released as the devices drop (or with
        // the last stream that still refers to one).
        let device: Vec<(u64, Allocation)> = self
            .device_memory
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .collect();
        let pinned: Vec<(u64, Allocation)> = self
            .pinned_memory
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .collect();
        if !device.is_empty() || !pinned.is_empty() {
            let bytes: u64 = device.iter().chain(&pinned).map(|(_, a)| a.len).sum();
            self.host.warn(&format!(
                "{} device and {} pinned allocations ({bytes} bytes) were still live at fini; freed",
                device.len(),
                pinned.len()
            ));
        }
        for (ptr, a) in device {
            let _ = self.release_device(ptr, a);
        }
        for (ptr, a) in pinned {
            let _ = self.release_pinned(ptr, a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_widen_to_whole_pages() {
        assert_eq!(page_span(0x10000, 0x1000, 4096), Some((0x10000, 0x11000)));
        assert_eq!(page_span(0x10064, 1000, 4096), Some((0x10000, 0x11000)));
        assert_eq!(page_span(0x10fff, 2, 4096), Some((0x10000, 0x12000)));
        assert_eq!(page_span(0x12345, 1, 65536), Some((0x10000, 0x20000)));
        assert_eq!(page_span(u64::MAX - 10, 100, 4096), None);
    }

    #[test]
    fn attributes_classify_every_kind() {
        let a = |memory_type, managed| Attributes {
            memory_type,
            ordinal: 3,
            managed,
            start: 0x1000,
            size: 0x2000,
        };
        assert_eq!(a(0, false).classify(), PointerInfo::HOST);
        let dev = a(CU_MEMORYTYPE_DEVICE, false).classify();
        assert_eq!((dev.kind, dev.ordinal), (PointerKind::Device, Some(3)));
        assert_eq!((dev.base, dev.size), (0x1000, 0x2000));
        let pinned = a(CU_MEMORYTYPE_HOST, false).classify();
        assert_eq!(
            (pinned.kind, pinned.ordinal),
            (PointerKind::HostPinned, None)
        );
        let managed = a(CU_MEMORYTYPE_DEVICE, true).classify();
        assert_eq!(
            (managed.kind, managed.ordinal),
            (PointerKind::Managed, Some(3))
        );
        assert_eq!(
            a(CU_MEMORYTYPE_UNIFIED, false).classify().kind,
            PointerKind::Managed
        );
    }
}
