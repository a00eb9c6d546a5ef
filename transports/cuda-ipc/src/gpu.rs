//! The only code of this transport that calls the CUDA driver: the GPUs
//! this process sees, their primary contexts, copy streams and events,
//! exporting device memory (cuIpcGetMemHandle, or cuMemExportToShareableHandle
//! per VMM chunk) and opening what a peer exported.
//!
//! Every call makes the right device's primary context current for its
//! length and puts back what was current (the application's threads keep
//! their device).

use crate::wire::{Piece, KIND_IPC, KIND_VMM};
use ferry_cuda_driver::driver::*;
use ferry_cuda_driver::kernel::Kernel;
use ferry_cuda_driver::method::CopySetting;
use ferry_cuda_driver::PrimaryContext;
use ferry_plugins_abi::sdk::{Host, PluginError, PluginResult};
use ferry_plugins_abi::ErrorCode;
use std::ffi::{c_int, c_void};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

/// Device memory bandwidth attributes (kHz, bits), for the declared speed.
const CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: c_int = 36;
const CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: c_int = 37;

/// The driver functions this transport cannot work without, by name.
pub fn missing_functions(d: &Driver) -> Vec<&'static str> {
    let a = &d.api;
    let mut out = Vec::new();
    let mut need = |present: bool, name: &'static str| {
        if !present {
            out.push(name);
        }
    };
    need(a.cu_ipc_get_mem_handle.is_some(), "cuIpcGetMemHandle");
    need(a.cu_ipc_open_mem_handle.is_some(), "cuIpcOpenMemHandle_v2");
    need(a.cu_ipc_close_mem_handle.is_some(), "cuIpcCloseMemHandle");
    need(
        a.cu_mem_get_address_range.is_some(),
        "cuMemGetAddressRange_v2",
    );
    need(a.cu_event_create.is_some(), "cuEventCreate");
    need(a.cu_event_record.is_some(), "cuEventRecord");
    need(a.cu_event_query.is_some(), "cuEventQuery");
    need(a.cu_event_synchronize.is_some(), "cuEventSynchronize");
    need(a.cu_event_destroy.is_some(), "cuEventDestroy_v2");
    need(
        a.cu_device_can_access_peer.is_some(),
        "cuDeviceCanAccessPeer",
    );
    out
}

/// Whether VMM (cuMemCreate) memory can be exported and imported.
pub fn has_vmm(d: &Driver) -> bool {
    let a = &d.api;
    a.cu_mem_retain_allocation_handle.is_some()
        && a.cu_mem_release.is_some()
        && a.cu_mem_export_to_shareable_handle.is_some()
        && a.cu_mem_import_from_shareable_handle.is_some()
        && a.cu_mem_address_reserve.is_some()
        && a.cu_mem_address_free.is_some()
        && a.cu_mem_map.is_some()
        && a.cu_mem_unmap.is_some()
        && a.cu_mem_set_access.is_some()
}

/// One visible GPU.
pub struct Gpu {
    pub ordinal: u32,
    pub handle: CUdevice,
    pub uuid: String,
    pub name: String,
    pub pci_bus_id: String,
    ctx: OnceLock<Arc<PrimaryContext>>,
    streams: OnceLock<Vec<Stream>>,
    next_stream: AtomicUsize,
    /// Events ready for reuse (they belong to this device's context).
    spare_events: Mutex<Vec<usize>>,
    /// The copy kernel in this GPU's context, loaded on first use, or why
    /// it cannot be.
    pub(crate) kernel: OnceLock<Result<Kernel, String>>,
}

pub(crate) struct Stream(pub(crate) CUstream);

// SAFETY: a CUstream is a process-wide handle; the driver takes work on it
// from any thread, and every use here makes its context current first.
unsafe impl Send for Stream {}
// SAFETY: shared references only pass the handle to the driver, which
// takes work on it from any thread; it is never changed after creation.
unsafe impl Sync for Stream {}

/// The GPUs of this process and the driver.
pub struct Gpus {
    pub driver: &'static Driver,
    pub list: Vec<Gpu>,
    pub vmm: bool,
    streams_per_gpu: usize,
    /// How lists of copies move (`cuda_ipc.copy`).
    pub copy: CopySetting,
    /// Where the one-time decisions per GPU are logged (none in the probe).
    pub log: Option<Host<'static>>,
}

/// A copy in flight: query it until it is done.
#[derive(Clone, Copy, Debug)]
pub struct Event {
    pub gpu: usize,
    raw: usize,
}

pub enum Poll {
    Done,
    Pending,
    Failed(PluginError),
}

fn invalid(msg: impl Into<String>) -> PluginError {
    PluginError::new(ErrorCode::InvalidArgument, msg)
}

impl Gpus {
    pub fn new(driver: &'static Driver, streams_per_gpu: usize) -> PluginResult<Gpus> {
        let count = driver.device_count()?;
        let mut list = Vec::new();
        for ordinal in 0..count {
            let handle = driver.device(ordinal)?;
            list.push(Gpu {
                ordinal,
                handle,
                uuid: driver
                    .uuid(handle)
                    .unwrap_or_else(|| format!("GPU-{ordinal:08x}")),
                name: driver.device_name(handle).unwrap_or_default(),
                pci_bus_id: driver.pci_bus_id(handle).unwrap_or_default(),
                ctx: OnceLock::new(),
                streams: OnceLock::new(),
                next_stream: AtomicUsize::new(0),
                spare_events: Mutex::new(Vec::new()),
                kernel: OnceLock::new(),
            });
        }
        Ok(Gpus {
            driver,
            list,
            vmm: has_vmm(driver),
            streams_per_gpu: streams_per_gpu.clamp(1, 64),
            copy: CopySetting::default(),
            log: None,
        })
    }

    pub fn by_uuid(&self, uuid: &str) -> Option<usize> {
        self.list.iter().position(|g| g.uuid == uuid)
    }

    pub fn by_ordinal(&self, ordinal: u32) -> Option<usize> {
        self.list.iter().position(|g| g.ordinal == ordinal)
    }

    /// Whether GPU `a` can read and write GPU `b`'s memory (true for a == b).
    pub fn can_access_peer(&self, a: usize, b: usize) -> bool {
        if a == b {
            return true;
        }
        let Some(f) = self.driver.api.cu_device_can_access_peer else {
            return false;
        };
        let mut yes: c_int = 0;
        // SAFETY: yes is a valid out-pointer; both handles came from cuDeviceGet.
        let r = unsafe { f(&mut yes, self.list[a].handle, self.list[b].handle) };
        r == CUDA_SUCCESS && yes != 0
    }

    /// Copy bandwidth within one GPU's memory, in Mbit/s (half the memory's
    /// peak: a copy reads and writes), or 0 when the driver cannot say.
    pub fn copy_bandwidth_mbps(&self, gpu: usize) -> u64 {
        let h = self.list[gpu].handle;
        let clock_khz = self
            .driver
            .attribute(h, CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE);
        let bus_bits = self
            .driver
            .attribute(h, CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH);
        match (clock_khz, bus_bits) {
            (Some(k), Some(b)) if k > 0 && b > 0 => {
                // DDR: two transfers per clock; bits per second / 1e6, halved.
                (k as u64 * 1000 * 2 * b as u64) / 1_000_000 / 2
            }
            _ => 0,
        }
    }

    pub(crate) fn context(&self, gpu: usize) -> PluginResult<&Arc<PrimaryContext>> {
        let g = &self.list[gpu];
        if let Some(c) = g.ctx.get() {
            return Ok(c);
        }
        let c = Arc::new(PrimaryContext::retain(self.driver, g.handle)?);
        Ok(g.ctx.get_or_init(|| c))
    }

    /// Exports device memory `[addr, addr + len)` of GPU `gpu` for a peer:
    /// one IPC handle for cuMemAlloc memory, else one POSIX fd per VMM chunk
    /// (memory from cuMemCreate with that handle type requested).
    pub fn export(
        &self,
        gpu: usize,
        addr: u64,
        len: u64,
    ) -> PluginResult<(u32, Vec<Piece>, Vec<OwnedFd>)> {
        let d = self.driver;
        let _current = self.context(gpu)?.enter()?;
        let (base, size) = self.address_range(addr)?;
        let get = d.function(d.api.cu_ipc_get_mem_handle, "cuIpcGetMemHandle")?;
        let mut handle = CUipcMemHandle::default();
        // SAFETY: handle is a valid 64-byte out-parameter; addr is device
        // memory of this context's device (the engine classified it).
        let r = unsafe { get(&mut handle, base) };
        if r == CUDA_SUCCESS {
            let piece = Piece {
                start: base,
                len: size,
                fd_offset: 0,
                has_fd: false,
                handle: handle.reserved,
            };
            return Ok((KIND_IPC, vec![piece], Vec::new()));
        }
        let ipc_error = d.describe(r);
        if !self.vmm {
            return Err(PluginError::unavailable(format!(
                "cuIpcGetMemHandle refused the memory ({ipc_error}) and this driver has no \
                 VMM export (cuMemExportToShareableHandle)"
            )));
        }
        self.export_vmm(addr, len).map_err(|e| {
            PluginError::unavailable(format!(
                "neither a CUDA IPC handle ({ipc_error}) nor a VMM shareable fd ({}): \
                 memory from cuMemCreate needs CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR \
                 requested",
                e.message
            ))
        })
    }

    fn address_range(&self, addr: u64) -> PluginResult<(u64, u64)> {
        let d = self.driver;
        let f = d.function(d.api.cu_mem_get_address_range, "cuMemGetAddressRange_v2")?;
        let mut base: CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: base and size are valid out-pointers.
        d.check("cuMemGetAddressRange_v2", unsafe {
            f(&mut base, &mut size, addr)
        })?;
        if size == 0 || addr < base || addr - base >= size as u64 {
            return Err(PluginError::new(
                ErrorCode::Plugin,
                format!("the driver gave {addr:#x} an allocation that does not hold it"),
            ));
        }
        Ok((base, size as u64))
    }

    /// One fd per VMM chunk mapped over `[addr, addr + len)`, in order.
    fn export_vmm(&self, addr: u64, len: u64) -> PluginResult<(u32, Vec<Piece>, Vec<OwnedFd>)> {
        let d = self.driver;
        let retain = d.function(
            d.api.cu_mem_retain_allocation_handle,
            "cuMemRetainAllocationHandle",
        )?;
        let release = d.function(d.api.cu_mem_release, "cuMemRelease")?;
        let export = d.function(
            d.api.cu_mem_export_to_shareable_handle,
            "cuMemExportToShareableHandle",
        )?;
        let end = addr
            .checked_add(len)
            .ok_or_else(|| invalid("range overflows"))?;
        let mut pieces = Vec::new();
        let mut fds = Vec::new();
        let mut at = addr;
        while at < end {
            if pieces.len() as u32 >= crate::wire::MAX_PIECES {
                return Err(invalid("the buffer is mapped in too many VMM chunks"));
            }
            let (base, size) = self.address_range(at)?;
            let mut h: CUmemGenericAllocationHandle = 0;
            // SAFETY: h is a valid out-pointer; base is mapped VMM memory.
            d.check("cuMemRetainAllocationHandle", unsafe {
                retain(&mut h, base as *mut c_void)
            })?;
            let mut fd: c_int = -1;
            // SAFETY: the POSIX fd handle type writes an int into fd.
            let r = unsafe {
                export(
                    (&mut fd as *mut c_int).cast(),
                    h,
                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            };
            // SAFETY: balances the retain above; the mapping keeps its own
            // reference.
            unsafe { release(h) };
            d.check("cuMemExportToShareableHandle", r)?;
            if fd < 0 {
                return Err(PluginError::new(
                    ErrorCode::Plugin,
                    "cuMemExportToShareableHandle returned no descriptor",
                ));
            }
            // SAFETY: a fresh descriptor the driver created for us.
            fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            pieces.push(Piece {
                start: base,
                len: size,
                fd_offset: 0,
                has_fd: true,
                handle: [0; 64],
            });
            at = base + size;
        }
        Ok((KIND_VMM, pieces, fds))
    }

    /// Opens a peer's cuMemAlloc allocation on GPU `gpu`; returns its address.
    pub fn open_ipc(&self, gpu: usize, handle: &[u8; 64]) -> PluginResult<u64> {
        let d = self.driver;
        let f = d.function(d.api.cu_ipc_open_mem_handle, "cuIpcOpenMemHandle_v2")?;
        let _current = self.context(gpu)?.enter()?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: ptr is a valid out-pointer; the handle is 64 bytes by value.
        d.check("cuIpcOpenMemHandle", unsafe {
            f(
                &mut ptr,
                CUipcMemHandle { reserved: *handle },
                CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
            )
        })?;
        Ok(ptr)
    }

    pub fn close_ipc(&self, gpu: usize, ptr: u64) -> PluginResult<()> {
        let d = self.driver;
        let f = d.function(d.api.cu_ipc_close_mem_handle, "cuIpcCloseMemHandle")?;
        let _current = self.context(gpu)?.enter()?;
        // SAFETY: ptr came from cuIpcOpenMemHandle and is closed once.
        d.check("cuIpcCloseMemHandle", unsafe { f(ptr) })
    }

    /// Maps a peer's VMM chunks contiguously, readable and writable by
    /// `gpu` and every GPU that can reach it; returns (address, length).
    pub fn map_vmm(
        &self,
        gpu: usize,
        pieces: &[Piece],
        fds: &[OwnedFd],
    ) -> PluginResult<(u64, u64)> {
        use std::os::fd::AsRawFd;
        let d = self.driver;
        let a = &d.api;
        let import = d.function(
            a.cu_mem_import_from_shareable_handle,
            "cuMemImportFromShareableHandle",
        )?;
        let reserve = d.function(a.cu_mem_address_reserve, "cuMemAddressReserve")?;
        let map = d.function(a.cu_mem_map, "cuMemMap")?;
        let release = d.function(a.cu_mem_release, "cuMemRelease")?;
        let set_access = d.function(a.cu_mem_set_access, "cuMemSetAccess")?;
        let (Some(first), Some(last)) = (pieces.first(), pieces.last()) else {
            return Err(invalid("nothing to map"));
        };
        if pieces.len() != fds.len() {
            return Err(PluginError::new(
                ErrorCode::Protocol,
                "the peer sent a different number of descriptors than chunks",
            ));
        }
        let total = last.start + last.len - first.start;
        let _current = self.context(gpu)?.enter()?;
        let mut va: CUdeviceptr = 0;
        // SAFETY: va is a valid out-pointer; no fixed address is asked for.
        d.check("cuMemAddressReserve", unsafe {
            reserve(&mut va, total as usize, 0, 0, 0)
        })?;
        let mapped = Vmm {
            gpus: self,
            gpu,
            va,
            total,
            mapped: Vec::new(),
        };
        let mut mapped = mapped;
        for (p, fd) in pieces.iter().zip(fds) {
            let mut h: CUmemGenericAllocationHandle = 0;
            // SAFETY: the POSIX fd handle type takes the descriptor as the
            // pointer-sized value; the driver dups what it keeps.
            d.check("cuMemImportFromShareableHandle", unsafe {
                import(
                    &mut h,
                    fd.as_raw_fd() as isize as *mut c_void,
                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            })?;
            let at = va + (p.start - first.start);
            // SAFETY: [at, at + len) lies inside the reservation above.
            let r = unsafe { map(at, p.len as usize, p.fd_offset as usize, h, 0) };
            // SAFETY: the mapping holds its own reference to the allocation.
            unsafe { release(h) };
            d.check("cuMemMap", r)?;
            mapped.mapped.push((at, p.len));
        }
        let access: Vec<CUmemAccessDesc> = (0..self.list.len())
            .filter(|&g| self.can_access_peer(g, gpu))
            .map(|g| CUmemAccessDesc {
                location: CUmemLocation {
                    kind: CU_MEM_LOCATION_TYPE_DEVICE,
                    id: self.list[g].ordinal as c_int,
                },
                flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        // SAFETY: the whole reservation is mapped; access has access.len()
        // valid descriptors.
        d.check("cuMemSetAccess", unsafe {
            set_access(va, total as usize, access.as_ptr(), access.len())
        })?;
        let out = (mapped.va, mapped.total);
        std::mem::forget(mapped);
        Ok(out)
    }

    /// Undoes `map_vmm`.
    pub fn unmap_vmm(&self, gpu: usize, va: u64, total: u64) -> PluginResult<()> {
        let d = self.driver;
        let unmap = d.function(d.api.cu_mem_unmap, "cuMemUnmap")?;
        let free = d.function(d.api.cu_mem_address_free, "cuMemAddressFree")?;
        let _current = self.context(gpu)?.enter()?;
        // SAFETY: [va, va + total) is a reservation map_vmm mapped whole.
        d.check("cuMemUnmap", unsafe { unmap(va, total as usize) })?;
        // SAFETY: [va, va + total) is the reservation map_vmm made, unmapped
        // just above, so nothing maps it any more.
        d.check("cuMemAddressFree", unsafe { free(va, total as usize) })
    }

    /// Pins mapped host memory for copies (cuMemHostRegister, portable).
    pub fn pin(&self, gpu: usize, addr: u64, len: u64) -> PluginResult<()> {
        let d = self.driver;
        let f = d.function(d.api.cu_mem_host_register, "cuMemHostRegister_v2")?;
        let _current = self.context(gpu)?.enter()?;
        // SAFETY: [addr, addr + len) is a live mapping owned by the caller,
        // unpinned before it is unmapped.
        d.check("cuMemHostRegister", unsafe {
            f(
                addr as *mut c_void,
                len as usize,
                CU_MEMHOSTREGISTER_PORTABLE,
            )
        })
    }

    pub fn unpin(&self, gpu: usize, addr: u64) -> PluginResult<()> {
        let d = self.driver;
        let f = d.function(d.api.cu_mem_host_unregister, "cuMemHostUnregister")?;
        let _current = self.context(gpu)?.enter()?;
        // SAFETY: addr was pinned by `pin` and is unpinned once.
        d.check("cuMemHostUnregister", unsafe { f(addr as *mut c_void) })
    }

    pub(crate) fn streams(&self, gpu: usize) -> PluginResult<&[Stream]> {
        let g = &self.list[gpu];
        if let Some(s) = g.streams.get() {
            return Ok(s);
        }
        let d = self.driver;
        let create = d.function(d.api.cu_stream_create, "cuStreamCreate")?;
        let _current = self.context(gpu)?.enter()?;
        let mut made = Vec::new();
        for _ in 0..self.streams_per_gpu {
            let mut s: CUstream = std::ptr::null_mut();
            // SAFETY: s is a valid out-pointer.
            d.check("cuStreamCreate", unsafe {
                create(&mut s, CU_STREAM_NON_BLOCKING)
            })?;
            made.push(Stream(s));
        }
        if g.streams.set(made).is_err() {
            // Another thread made them first; ours are leaked until exit
            // (a handful of streams, once).
        }
        Ok(g.streams.get().map(Vec::as_slice).unwrap_or_default())
    }

    /// The next of GPU `gpu`'s copy streams, round robin (so the lists of
    /// a batch overlap).
    pub(crate) fn next_stream(&self, gpu: usize) -> PluginResult<CUstream> {
        let streams = self.streams(gpu)?;
        let g = &self.list[gpu];
        Ok(streams[g.next_stream.fetch_add(1, Ordering::Relaxed) % streams.len()].0)
    }

    /// Records `event` on `stream` (both of GPU `gpu`'s context, current);
    /// when that fails the work before it cannot be waited for, so this
    /// waits for it here and says so.
    pub(crate) fn record(&self, gpu: usize, event: Event, stream: CUstream) -> PluginResult<()> {
        let d = self.driver;
        let record = d.function(d.api.cu_event_record, "cuEventRecord")?;
        // SAFETY: event and stream belong to this context.
        let r = unsafe { record(event.raw as CUevent, stream) };
        if r != CUDA_SUCCESS {
            let _ = self.sync_streams(gpu);
            return Err(d.error("cuEventRecord", r));
        }
        Ok(())
    }

    pub(crate) fn event(&self, gpu: usize) -> PluginResult<Event> {
        if let Some(raw) = self.list[gpu]
            .spare_events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
        {
            return Ok(Event { gpu, raw });
        }
        let d = self.driver;
        let create = d.function(d.api.cu_event_create, "cuEventCreate")?;
        let mut e: CUevent = std::ptr::null_mut();
        // SAFETY: e is a valid out-pointer; the caller made the context current.
        d.check("cuEventCreate", unsafe {
            create(&mut e, CU_EVENT_DISABLE_TIMING)
        })?;
        Ok(Event {
            gpu,
            raw: e as usize,
        })
    }

    /// Puts a finished event back for reuse.
    pub fn recycle(&self, event: Event) {
        self.list[event.gpu]
            .spare_events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(event.raw);
    }

    /// Whether the copy before `event` finished, without blocking.
    pub fn poll(&self, event: Event) -> Poll {
        let Some(query) = self.driver.api.cu_event_query else {
            return Poll::Failed(PluginError::new(ErrorCode::Internal, "no cuEventQuery"));
        };
        // SAFETY: the event came from cuEventCreate and is not destroyed
        // while queued (recycled only after it is done).
        match unsafe { query(event.raw as CUevent) } {
            CUDA_SUCCESS => Poll::Done,
            CUDA_ERROR_NOT_READY => Poll::Pending,
            r => Poll::Failed(self.driver.error("cuMemcpyAsync (completion)", r)),
        }
    }

    /// Waits for everything queued on GPU `gpu`'s streams.
    pub fn sync_streams(&self, gpu: usize) -> PluginResult<()> {
        let Some(streams) = self.list[gpu].streams.get() else {
            return Ok(());
        };
        let d = self.driver;
        let sync = d.function(d.api.cu_stream_synchronize, "cuStreamSynchronize")?;
        let _current = self.context(gpu)?.enter()?;
        for s in streams {
            // SAFETY: a stream of this context.
            d.check("cuStreamSynchronize", unsafe { sync(s.0) })?;
        }
        Ok(())
    }

    /// Waits for every stream of every GPU (before a mapping goes away).
    pub fn sync_all(&self) {
        for g in 0..self.list.len() {
            let _ = self.sync_streams(g);
        }
    }
}

impl Drop for Gpus {
    fn drop(&mut self) {
        let d = self.driver;
        for (i, g) in self.list.iter().enumerate() {
            let Some(ctx) = g.ctx.get() else { continue };
            let Ok(_current) = ctx.enter() else { continue };
            if let (Some(streams), Some(destroy)) = (g.streams.get(), d.api.cu_stream_destroy) {
                let _ = self.sync_streams(i);
                for s in streams {
                    // SAFETY: created in this context, destroyed once.
                    unsafe { destroy(s.0) };
                }
            }
            if let Some(Ok(k)) = g.kernel.get() {
                k.free(d);
            }
            if let Some(destroy) = d.api.cu_event_destroy {
                for e in g
                    .spare_events
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .drain(..)
                {
                    // SAFETY: an idle event of this context, destroyed once.
                    unsafe { destroy(e as CUevent) };
                }
            }
        }
    }
}

/// A VMM reservation being mapped: undone if mapping fails half way.
struct Vmm<'a> {
    gpus: &'a Gpus,
    gpu: usize,
    va: u64,
    total: u64,
    mapped: Vec<(u64, u64)>,
}

impl Drop for Vmm<'_> {
    fn drop(&mut self) {
        let d = self.gpus.driver;
        let _current = self.gpus.context(self.gpu).and_then(|c| c.enter());
        if let Some(unmap) = d.api.cu_mem_unmap {
            for (at, len) in &self.mapped {
                // SAFETY: mapped by map_vmm a moment ago, unmapped once.
                unsafe { unmap(*at, *len as usize) };
            }
        }
        if let Some(free) = d.api.cu_mem_address_free {
            // SAFETY: the reservation map_vmm made, now empty.
            unsafe { free(self.va, self.total as usize) };
        }
    }
}
