//! The CUDA driver API as Ferry's CUDA plugins use it: libcuda is opened at run time
//! (never linked) and every function comes from a small table resolved one
//! symbol at a time, so an old driver that lacks an optional function loses
//! only that feature and a missing driver is a clean "unavailable".
//!
//! Resolution: `cuGetProcAddress_v2` (CUDA 12.0+) asked for each symbol's
//! ABI as of [`ABI_VERSION`], the version whose `cuda.h` signatures the table
//! is written against, so a newer driver never hands us a function whose
//! signature changed later; otherwise `dlsym` of the versioned export names
//! (`cuMemAlloc_v2`, ...), which older drivers have.
//!
//! A loaded driver is never unloaded: after cuInit libcuda runs threads of
//! its own, and unmapping its code under them would crash the process. Each
//! library path is opened once per process and kept.

use crate::elf_check;
use ferry_plugins_abi::sdk::{PluginError, PluginResult};
use ferry_plugins_abi::ErrorCode;
use libloading::os::unix::Library;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::Path;
use std::sync::{Mutex, PoisonError};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
/// `CUmemGenericAllocationHandle`: a VMM physical allocation.
pub type CUmemGenericAllocationHandle = u64;

/// `CUipcMemHandle`: 64 opaque bytes naming a cuMemAlloc allocation to
/// another process of the host.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CUipcMemHandle {
    pub reserved: [u8; 64],
}

impl Default for CUipcMemHandle {
    fn default() -> Self {
        CUipcMemHandle { reserved: [0; 64] }
    }
}

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUmemLocation {
    pub kind: c_int,
    pub id: c_int,
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: c_int,
}

/// `CUmemcpyAttributes` (CUDA 12.8): how cuMemcpyBatchAsync orders and
/// places a group of copies.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUmemcpyAttributes {
    pub src_access_order: c_int,
    pub src_loc_hint: CUmemLocation,
    pub dst_loc_hint: CUmemLocation,
    pub flags: c_uint,
}

/// Sources are read in stream order (after earlier work on the stream).
pub const CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: c_int = 1;

/// `CUuuid`: 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;

pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;
pub const CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED: c_int = 116;
pub const CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: c_int = 124;

pub const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_uint = 2;
pub const CU_POINTER_ATTRIBUTE_IS_MANAGED: c_uint = 8;
pub const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_uint = 9;
pub const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: c_uint = 11;
pub const CU_POINTER_ATTRIBUTE_RANGE_SIZE: c_uint = 12;

/// Whether cuIpcGetMemHandle can export the allocation (cuMemAlloc memory).
pub const CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: c_uint = 19;

pub const CU_MEMORYTYPE_HOST: u32 = 1;
pub const CU_MEMORYTYPE_DEVICE: u32 = 2;
pub const CU_MEMORYTYPE_ARRAY: u32 = 3;
pub const CU_MEMORYTYPE_UNIFIED: u32 = 4;

pub const CU_MEMHOSTALLOC_PORTABLE: c_uint = 0x01;
/// cuMemHostRegister: pinned for every context, not only the current one.
pub const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 0x01;
pub const CU_STREAM_NON_BLOCKING: c_uint = 0x01;
pub const CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int = 1;
/// cuIpcOpenMemHandle: enable peer access to the exporter's GPU on demand.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 0x1;
/// VMM shareable handle type: a POSIX file descriptor.
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;
pub const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;

const CU_GET_PROC_ADDRESS_DEFAULT: u64 = 0;
const CU_GET_PROC_ADDRESS_SUCCESS: c_int = 0;

/// The CUDA version whose `cuda.h` the signatures below follow. Asking
/// cuGetProcAddress for this version pins each function's ABI.
pub const ABI_VERSION: c_int = 12000;

/// The library opened when nothing else is configured.
pub const DEFAULT_LIBRARY: &str = "libcuda.so.1";

/// Whether the plugin works without a symbol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    Required,
    Optional,
}

/// One driver function: the name cuGetProcAddress knows it by and the
/// exports dlsym may find it under, best first.
#[derive(Debug)]
pub struct Symbol {
    pub query: &'static CStr,
    pub exports: &'static [&'static str],
    pub need: Need,
    /// The CUDA version whose ABI of it we call: [`ABI_VERSION`], or the
    /// release that introduced a newer function.
    pub since: c_int,
}

/// The first of `versions` (the symbol's own, else [`ABI_VERSION`]).
const fn since(versions: &[c_int]) -> c_int {
    versions[0]
}

impl Symbol {
    /// The name in messages: the versioned export, as in `cuMemAlloc_v2`.
    pub fn name(&self) -> &'static str {
        self.exports.first().copied().unwrap_or("?")
    }
}

macro_rules! driver_api {
    ($(
        $field:ident: $need:ident $query:literal [$($export:literal),+] $(since $since:literal)?
            fn($($arg:ty),* $(,)?);
    )*) => {
        /// The driver functions this plugin calls; `None` where libcuda has
        /// no such symbol.
        #[derive(Clone, Copy, Default)]
        pub struct Api {
            $( pub $field: Option<unsafe extern "C" fn($($arg),*) -> CUresult>, )*
        }

        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy)]
        enum Slot { $($field),* }

        /// Every symbol of [`Api`], in field order.
        pub const SYMBOLS: &[Symbol] = &[
            $( Symbol {
                query: $query,
                exports: &[$($export),+],
                need: Need::$need,
                since: since(&[$($since,)? ABI_VERSION]),
            } ),*
        ];

        impl Api {
            /// Fills the table through `find`, which returns a symbol's
            /// address or `None`.
            fn resolve(mut find: impl FnMut(&'static Symbol) -> Option<*mut c_void>) -> Api {
                Api {
                    $( $field: find(&SYMBOLS[Slot::$field as usize]).map(|address| {
                        // SAFETY: `address` is what libcuda returned for this
                        // symbol (cuGetProcAddress at ABI_VERSION, or the
                        // versioned export by dlsym); cuda.h declares it with
                        // exactly this C signature, and fn pointers and data
                        // pointers have the same size and representation on
                        // the platforms Ferry builds for.
                        unsafe {
                            std::mem::transmute::<
                                *mut c_void,
                                unsafe extern "C" fn($($arg),*) -> CUresult,
                            >(address)
                        }
                    }), )*
                }
            }

            /// The symbols libcuda did not provide.
            pub fn missing(&self) -> Vec<&'static Symbol> {
                let mut out = Vec::new();
                $( if self.$field.is_none() { out.push(&SYMBOLS[Slot::$field as usize]); } )*
                out
            }
        }
    };
}

driver_api! {
    cu_init: Required c"cuInit" ["cuInit"] fn(c_uint);
    cu_driver_get_version: Required c"cuDriverGetVersion" ["cuDriverGetVersion"] fn(*mut c_int);
    cu_get_error_name: Required c"cuGetErrorName" ["cuGetErrorName"]
        fn(CUresult, *mut *const c_char);
    cu_get_error_string: Required c"cuGetErrorString" ["cuGetErrorString"]
        fn(CUresult, *mut *const c_char);
    cu_device_get_count: Required c"cuDeviceGetCount" ["cuDeviceGetCount"] fn(*mut c_int);
    cu_device_get: Required c"cuDeviceGet" ["cuDeviceGet"] fn(*mut CUdevice, c_int);
    cu_device_get_name: Required c"cuDeviceGetName" ["cuDeviceGetName"]
        fn(*mut c_char, c_int, CUdevice);
    cu_device_get_attribute: Required c"cuDeviceGetAttribute" ["cuDeviceGetAttribute"]
        fn(*mut c_int, c_int, CUdevice);
    cu_device_get_pci_bus_id: Required c"cuDeviceGetPCIBusId" ["cuDeviceGetPCIBusId"]
        fn(*mut c_char, c_int, CUdevice);
    cu_device_total_mem: Required c"cuDeviceTotalMem" ["cuDeviceTotalMem_v2"]
        fn(*mut usize, CUdevice);
    cu_device_get_uuid: Optional c"cuDeviceGetUuid" ["cuDeviceGetUuid_v2", "cuDeviceGetUuid"]
        fn(*mut CUuuid, CUdevice);
    cu_device_primary_ctx_retain: Required c"cuDevicePrimaryCtxRetain"
        ["cuDevicePrimaryCtxRetain"] fn(*mut CUcontext, CUdevice);
    cu_device_primary_ctx_release: Required c"cuDevicePrimaryCtxRelease"
        ["cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"] fn(CUdevice);
    cu_ctx_get_current: Required c"cuCtxGetCurrent" ["cuCtxGetCurrent"] fn(*mut CUcontext);
    cu_ctx_set_current: Required c"cuCtxSetCurrent" ["cuCtxSetCurrent"] fn(CUcontext);
    cu_pointer_get_attributes: Required c"cuPointerGetAttributes" ["cuPointerGetAttributes"]
        fn(c_uint, *mut c_uint, *mut *mut c_void, CUdeviceptr);
    cu_mem_alloc: Required c"cuMemAlloc" ["cuMemAlloc_v2"] fn(*mut CUdeviceptr, usize);
    cu_mem_free: Required c"cuMemFree" ["cuMemFree_v2"] fn(CUdeviceptr);
    cu_mem_host_alloc: Required c"cuMemHostAlloc" ["cuMemHostAlloc"]
        fn(*mut *mut c_void, usize, c_uint);
    cu_mem_free_host: Required c"cuMemFreeHost" ["cuMemFreeHost"] fn(*mut c_void);
    cu_stream_create: Required c"cuStreamCreate" ["cuStreamCreate"] fn(*mut CUstream, c_uint);
    cu_stream_destroy: Required c"cuStreamDestroy" ["cuStreamDestroy_v2"] fn(CUstream);
    cu_memcpy_async: Required c"cuMemcpyAsync" ["cuMemcpyAsync"]
        fn(CUdeviceptr, CUdeviceptr, usize, CUstream);
    cu_stream_synchronize: Required c"cuStreamSynchronize" ["cuStreamSynchronize"]
        fn(CUstream);
    cu_mem_host_register: Optional c"cuMemHostRegister" ["cuMemHostRegister_v2"]
        fn(*mut c_void, usize, c_uint);
    cu_mem_host_unregister: Optional c"cuMemHostUnregister" ["cuMemHostUnregister"]
        fn(*mut c_void);
    cu_mem_get_handle_for_address_range: Optional c"cuMemGetHandleForAddressRange"
        ["cuMemGetHandleForAddressRange"] fn(*mut c_void, CUdeviceptr, usize, c_int, u64);
    // Same-host sharing (the cuda-ipc transport): optional for the device
    // plugin; the transport checks for its own set.
    cu_mem_get_address_range: Optional c"cuMemGetAddressRange" ["cuMemGetAddressRange_v2"]
        fn(*mut CUdeviceptr, *mut usize, CUdeviceptr);
    cu_ipc_get_mem_handle: Optional c"cuIpcGetMemHandle" ["cuIpcGetMemHandle"]
        fn(*mut CUipcMemHandle, CUdeviceptr);
    cu_ipc_open_mem_handle: Optional c"cuIpcOpenMemHandle" ["cuIpcOpenMemHandle_v2"]
        fn(*mut CUdeviceptr, CUipcMemHandle, c_uint);
    cu_ipc_close_mem_handle: Optional c"cuIpcCloseMemHandle" ["cuIpcCloseMemHandle"]
        fn(CUdeviceptr);
    cu_mem_retain_allocation_handle: Optional c"cuMemRetainAllocationHandle"
        ["cuMemRetainAllocationHandle"] fn(*mut CUmemGenericAllocationHandle, *mut c_void);
    cu_mem_release: Optional c"cuMemRelease" ["cuMemRelease"] fn(CUmemGenericAllocationHandle);
    cu_mem_export_to_shareable_handle: Optional c"cuMemExportToShareableHandle"
        ["cuMemExportToShareableHandle"] fn(*mut c_void, CUmemGenericAllocationHandle, c_int, u64);
    cu_mem_import_from_shareable_handle: Optional c"cuMemImportFromShareableHandle"
        ["cuMemImportFromShareableHandle"]
        fn(*mut CUmemGenericAllocationHandle, *mut c_void, c_int);
    cu_mem_address_reserve: Optional c"cuMemAddressReserve" ["cuMemAddressReserve"]
        fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64);
    cu_mem_address_free: Optional c"cuMemAddressFree" ["cuMemAddressFree"]
        fn(CUdeviceptr, usize);
    cu_mem_map: Optional c"cuMemMap" ["cuMemMap"]
        fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64);
    cu_mem_unmap: Optional c"cuMemUnmap" ["cuMemUnmap"] fn(CUdeviceptr, usize);
    cu_mem_set_access: Optional c"cuMemSetAccess" ["cuMemSetAccess"]
        fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize);
    cu_event_create: Optional c"cuEventCreate" ["cuEventCreate"] fn(*mut CUevent, c_uint);
    cu_event_record: Optional c"cuEventRecord" ["cuEventRecord"] fn(CUevent, CUstream);
    cu_event_query: Optional c"cuEventQuery" ["cuEventQuery"] fn(CUevent);
    // Staging polls its copies (the device ABI's stream_query).
    cu_stream_query: Optional c"cuStreamQuery" ["cuStreamQuery"] fn(CUstream);
    cu_event_synchronize: Optional c"cuEventSynchronize" ["cuEventSynchronize"] fn(CUevent);
    cu_event_destroy: Optional c"cuEventDestroy" ["cuEventDestroy_v2"] fn(CUevent);
    cu_device_can_access_peer: Optional c"cuDeviceCanAccessPeer" ["cuDeviceCanAccessPeer"]
        fn(*mut c_int, CUdevice, CUdevice);
    // The cuda-ipc transport's list copies: its kernel (PTX loaded at run
    // time), the descriptors' upload, and the driver's batched copy where
    // the kernel cannot load. cuMemcpyBatchAsync is asked for at 12.8, the
    // ABI with failIdx (CUDA 13's default drops it).
    cu_module_load_data: Optional c"cuModuleLoadData" ["cuModuleLoadData"]
        fn(*mut CUmodule, *const c_void);
    cu_module_unload: Optional c"cuModuleUnload" ["cuModuleUnload"] fn(CUmodule);
    cu_module_get_function: Optional c"cuModuleGetFunction" ["cuModuleGetFunction"]
        fn(*mut CUfunction, CUmodule, *const c_char);
    cu_launch_kernel: Optional c"cuLaunchKernel" ["cuLaunchKernel"]
        fn(CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CUstream,
           *mut *mut c_void, *mut *mut c_void);
    cu_memcpy_htod_async: Optional c"cuMemcpyHtoDAsync" ["cuMemcpyHtoDAsync_v2"]
        fn(CUdeviceptr, *const c_void, usize, CUstream);
    cu_memcpy_batch_async: Optional c"cuMemcpyBatchAsync" ["cuMemcpyBatchAsync"] since 12080
        fn(*mut CUdeviceptr, *mut CUdeviceptr, *mut usize, usize, *mut CUmemcpyAttributes,
           *mut usize, usize, *mut usize, CUstream);
}

type GetProcAddressV2 = unsafe extern "C" fn(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    symbol_status: *mut c_int,
) -> CUresult;

/// An opened libcuda with its function table. Lives for the whole process.
pub struct Driver {
    pub api: Api,
    /// What was opened: `libcuda.so.1` or the configured path.
    pub library: String,
    /// The file the dynamic loader mapped, when it can say.
    pub file: Option<String>,
    /// How many symbols came through cuGetProcAddress_v2 and through dlsym.
    pub by_proc_address: usize,
    pub by_dlsym: usize,
    _library: Library,
}

/// Drivers opened so far, by what was asked for. Never emptied (see the
/// module docs); one entry per distinct path, so one in production.
static OPENED: Mutex<Vec<(String, &'static Driver)>> = Mutex::new(Vec::new());

/// Opens libcuda (or `configured`, the FERRY_CUDA_LIBRARY path) and
/// resolves its symbols, or says in operator words why it cannot. Does not
/// call cuInit.
pub fn open(configured: Option<&str>) -> PluginResult<&'static Driver> {
    let key = configured.unwrap_or(DEFAULT_LIBRARY).to_string();
    {
        let opened = OPENED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, driver)) = opened.iter().find(|(k, _)| *k == key) {
            return Ok(driver);
        }
    }
    // Not under the lock: a dlopen that hangs must not hold up others.
    let driver: &'static Driver = Box::leak(Box::new(Driver::load(configured)?));
    let mut opened = OPENED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, earlier)) = opened.iter().find(|(k, _)| *k == key) {
        // Another thread won; ours stays leaked (a second dlopen reference).
        return Ok(earlier);
    }
    opened.push((key, driver));
    Ok(driver)
}

impl Driver {
    fn load(configured: Option<&str>) -> PluginResult<Driver> {
        let library = match configured {
            None => {
                // SAFETY: libcuda.so.1 is the system's NVIDIA driver library;
                // its initialisers are what every CUDA program runs, and it
                // is never unloaded (Driver is leaked).
                unsafe { Library::open(Some(DEFAULT_LIBRARY), libc::RTLD_NOW | libc::RTLD_LOCAL) }
                    .map_err(|e| {
                    let text = dl_error(&e);
                    if text.contains("cannot open shared object file") {
                        PluginError::unavailable(format!(
                            "{DEFAULT_LIBRARY} not found: no NVIDIA driver on this host"
                        ))
                    } else {
                        PluginError::unavailable(format!("cannot load {DEFAULT_LIBRARY}: {text}"))
                    }
                })?
            }
            Some(name) if !name.contains('/') => {
                // A bare name: the dynamic loader searches for it as it does
                // for libcuda.so.1.
                // SAFETY: opening a library runs its constructors; the operator named
                // this one as the CUDA driver, which is what the plugin loads anyway.
                unsafe { Library::open(Some(name), libc::RTLD_NOW | libc::RTLD_LOCAL) }.map_err(
                    |e| {
                        PluginError::unavailable(format!(
                            "cannot load {name} (FERRY_CUDA_LIBRARY): {}",
                            dl_error(&e)
                        ))
                    },
                )?
            }
            Some(path) => {
                if !Path::new(path).exists() {
                    return Err(PluginError::unavailable(format!(
                        "FERRY_CUDA_LIBRARY={path}: no such file"
                    )));
                }
                elf_check::check_shared_object(Path::new(path)).map_err(|why| {
                    PluginError::unavailable(format!(
                        "FERRY_CUDA_LIBRARY={path} is not a loadable library: {why}"
                    ))
                })?;
                // SAFETY: an operator or a test chose this file to stand in
                // for libcuda; its headers were checked above so that the
                // dynamic loader cannot fault on a truncated file. It is never
                // unloaded.
                unsafe { Library::open(Some(path), libc::RTLD_NOW | libc::RTLD_LOCAL) }.map_err(
                    |e| {
                        PluginError::unavailable(format!(
                            "cannot load {path} (FERRY_CUDA_LIBRARY): {}",
                            dl_error(&e)
                        ))
                    },
                )?
            }
        };
        let name = configured.unwrap_or(DEFAULT_LIBRARY).to_string();

        // SAFETY: looking a symbol up runs no code; the address is only
        // used as the GetProcAddressV2 type below if it exists.
        let get_proc_address: Option<GetProcAddressV2> =
            unsafe { library.get::<*mut c_void>(c"cuGetProcAddress_v2") }
                .ok()
                .map(|s| s.into_raw())
                .filter(|p| !p.is_null())
                .map(|p| {
                    // SAFETY: cuGetProcAddress_v2 has this signature in every
                    // cuda.h since 12.0, the release that introduced it.
                    unsafe { std::mem::transmute::<*mut c_void, GetProcAddressV2>(p) }
                });
        let mut by_proc_address = 0;
        let mut by_dlsym = 0;
        let api = Api::resolve(|symbol| {
            if let Some(gpa) = get_proc_address {
                let mut address: *mut c_void = std::ptr::null_mut();
                let mut status: c_int = -1;
                // SAFETY: symbol.query is NUL-terminated; address and status
                // are valid out-pointers for the duration of the call.
                let r = unsafe {
                    gpa(
                        symbol.query.as_ptr(),
                        &mut address,
                        symbol.since,
                        CU_GET_PROC_ADDRESS_DEFAULT,
                        &mut status,
                    )
                };
                if r == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && !address.is_null()
                {
                    by_proc_address += 1;
                    return Some(address);
                }
            }
            for export in symbol.exports {
                // SAFETY: a lookup only; the address is typed by Api::resolve
                // with the signature cuda.h gives this export.
                if let Ok(found) = unsafe { library.get::<*mut c_void>(*export) } {
                    let address = found.into_raw();
                    if !address.is_null() {
                        by_dlsym += 1;
                        return Some(address);
                    }
                }
            }
            None
        });
        let Some(cu_init) = api.cu_init else {
            return Err(PluginError::unavailable(format!(
                "{name} does not export cuInit: it is not a CUDA driver library"
            )));
        };
        Ok(Driver {
            api,
            file: loaded_file(cu_init as *const c_void),
            library: name,
            by_proc_address,
            by_dlsym,
            _library: library,
        })
    }

    /// cuInit(0). Failing here means CUDA is cleanly unusable on this host
    /// (no device, a driver/kernel module mismatch, a stub library).
    pub fn init(&self) -> PluginResult<()> {
        let f = self.function(self.api.cu_init, "cuInit")?;
        // SAFETY: cuInit takes flags by value and must be 0.
        let r = unsafe { f(0) };
        if r == CUDA_SUCCESS {
            return Ok(());
        }
        let mut message = format!("cuInit failed: {}", self.describe(r));
        if r == CUDA_ERROR_NO_DEVICE {
            message.push_str(&format!(" ({})", visible_devices()));
        }
        Err(PluginError::unavailable(message))
    }

    /// Unavailable, naming them, when libcuda lacks a required symbol.
    pub fn require_all(&self) -> PluginResult<()> {
        let missing: Vec<&str> = self
            .api
            .missing()
            .into_iter()
            .filter(|s| s.need == Need::Required)
            .map(Symbol::name)
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let version = self
            .version()
            .map_or_else(|| "an unknown CUDA version".to_string(), cuda_version_text);
        Err(PluginError::unavailable(format!(
            "{} (CUDA {version}) lacks {}: the NVIDIA driver is too old or not a real driver",
            self.library,
            missing.join(", ")
        )))
    }

    /// The function, or an internal error naming it (require_all makes
    /// required ones present before any instance exists).
    pub fn function<F>(&self, f: Option<F>, name: &str) -> PluginResult<F> {
        f.ok_or_else(|| {
            PluginError::new(
                ErrorCode::Internal,
                format!("{name} is missing from {}", self.library),
            )
        })
    }

    /// cuDriverGetVersion, e.g. 13000 for CUDA 13.0.
    pub fn version(&self) -> Option<i32> {
        let f = self.api.cu_driver_get_version?;
        let mut v: c_int = 0;
        // SAFETY: v is a valid out-pointer.
        (unsafe { f(&mut v) } == CUDA_SUCCESS).then_some(v)
    }

    /// "CUDA_ERROR_OUT_OF_MEMORY: out of memory", from the driver's own
    /// tables when it has them.
    pub fn describe(&self, r: CUresult) -> String {
        let name = self
            .driver_text(self.api.cu_get_error_name, r)
            .or_else(|| fallback_error_name(r).map(str::to_string))
            .unwrap_or_else(|| format!("CUDA error {r}"));
        match self.driver_text(self.api.cu_get_error_string, r) {
            Some(text) => format!("{name}: {text}"),
            None => format!("{name} ({r})"),
        }
    }

    fn driver_text(
        &self,
        f: Option<unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult>,
        r: CUresult,
    ) -> Option<String> {
        let f = f?;
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: text is a valid out-pointer; the driver stores a pointer to
        // a static string or leaves it null.
        if unsafe { f(r, &mut text) } != CUDA_SUCCESS || text.is_null() {
            return None;
        }
        // SAFETY: non-null, and the driver's error strings are static and
        // NUL-terminated.
        Some(
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned(),
        )
    }

    /// The error for a failed call: "cuMemAlloc_v2 failed: CUDA_ERROR_...:
    /// ..." with a code that fits.
    pub fn error(&self, call: &str, r: CUresult) -> PluginError {
        PluginError::new(
            error_code(r),
            format!("{call} failed: {}", self.describe(r)),
        )
    }

    pub fn check(&self, call: &str, r: CUresult) -> PluginResult<()> {
        if r == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(self.error(call, r))
        }
    }

    pub fn device_count(&self) -> PluginResult<u32> {
        let f = self.function(self.api.cu_device_get_count, "cuDeviceGetCount")?;
        let mut n: c_int = 0;
        // SAFETY: n is a valid out-pointer.
        self.check("cuDeviceGetCount", unsafe { f(&mut n) })?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    pub fn device(&self, ordinal: u32) -> PluginResult<CUdevice> {
        let f = self.function(self.api.cu_device_get, "cuDeviceGet")?;
        let ordinal = c_int::try_from(ordinal)
            .map_err(|_| PluginError::new(ErrorCode::InvalidArgument, "ordinal out of range"))?;
        let mut dev: CUdevice = 0;
        // SAFETY: dev is a valid out-pointer.
        self.check("cuDeviceGet", unsafe { f(&mut dev, ordinal) })?;
        Ok(dev)
    }

    pub fn device_name(&self, dev: CUdevice) -> PluginResult<String> {
        let f = self.function(self.api.cu_device_get_name, "cuDeviceGetName")?;
        let mut buf = [0 as c_char; 256];
        // SAFETY: the driver writes at most len bytes, NUL included.
        self.check("cuDeviceGetName", unsafe {
            f(buf.as_mut_ptr(), buf.len() as c_int, dev)
        })?;
        Ok(c_buf_text(&buf))
    }

    /// The PCI address, normalised to "0000:18:00.0".
    pub fn pci_bus_id(&self, dev: CUdevice) -> PluginResult<String> {
        let f = self.function(self.api.cu_device_get_pci_bus_id, "cuDeviceGetPCIBusId")?;
        let mut buf = [0 as c_char; 64];
        // SAFETY: the driver writes at most len bytes, NUL included.
        self.check("cuDeviceGetPCIBusId", unsafe {
            f(buf.as_mut_ptr(), buf.len() as c_int, dev)
        })?;
        Ok(normalize_pci_bus_id(&c_buf_text(&buf)))
    }

    pub fn total_memory(&self, dev: CUdevice) -> PluginResult<u64> {
        let f = self.function(self.api.cu_device_total_mem, "cuDeviceTotalMem_v2")?;
        let mut bytes: usize = 0;
        // SAFETY: bytes is a valid out-pointer.
        self.check("cuDeviceTotalMem_v2", unsafe { f(&mut bytes, dev) })?;
        Ok(bytes as u64)
    }

    /// "GPU-8c6f...", or `None` when the driver cannot say.
    pub fn uuid(&self, dev: CUdevice) -> Option<String> {
        let f = self.api.cu_device_get_uuid?;
        let mut uuid = CUuuid::default();
        // SAFETY: uuid is a valid 16-byte out-parameter.
        if unsafe { f(&mut uuid, dev) } != CUDA_SUCCESS {
            return None;
        }
        Some(format_uuid(&uuid.bytes))
    }

    /// A device attribute, or `None` when this driver does not know it
    /// (older drivers answer CUDA_ERROR_INVALID_VALUE for newer attributes).
    pub fn attribute(&self, dev: CUdevice, attribute: c_int) -> Option<i32> {
        let f = self.api.cu_device_get_attribute?;
        let mut v: c_int = 0;
        // SAFETY: v is a valid out-pointer.
        (unsafe { f(&mut v, attribute, dev) } == CUDA_SUCCESS).then_some(v)
    }

    /// Whether cuMemGetHandleForAddressRange resolved.
    pub fn can_export_dmabuf(&self) -> bool {
        self.api.cu_mem_get_handle_for_address_range.is_some()
    }

    /// "libcuda.so.1 -> /usr/lib/.../libcuda.so.580.95.05; 25 symbols
    /// through cuGetProcAddress_v2".
    pub fn describe_library(&self) -> String {
        let mut s = self.library.clone();
        if let Some(file) = &self.file {
            if *file != self.library {
                s.push_str(&format!(" -> {file}"));
            }
        }
        match (self.by_proc_address, self.by_dlsym) {
            (0, d) => s.push_str(&format!("; {d} symbols through dlsym")),
            (p, 0) => s.push_str(&format!("; {p} symbols through cuGetProcAddress_v2")),
            (p, d) => s.push_str(&format!(
                "; {p} symbols through cuGetProcAddress_v2, {d} through dlsym"
            )),
        }
        s
    }
}

/// dlerror's words ("libcuda.so.1: cannot open shared object file: No such
/// file or directory"), which libloading keeps as the error's source.
fn dl_error(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(source) => source.to_string(),
        None => e.to_string(),
    }
}

/// The file that holds `address`, through dladdr.
fn loaded_file(address: *const c_void) -> Option<String> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only reads the address and fills info.
    let found = unsafe { libc::dladdr(address, info.as_mut_ptr()) };
    if found == 0 {
        return None;
    }
    // SAFETY: dladdr returned nonzero, so it filled info.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname points to the loader's NUL-terminated file name,
    // valid while the object stays loaded (forever, here).
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    let name = name.to_string_lossy().into_owned();
    Some(std::fs::canonicalize(&name).map_or(name, |p| p.display().to_string()))
}

/// What CUDA_VISIBLE_DEVICES says, for messages.
pub fn visible_devices() -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) => format!("CUDA_VISIBLE_DEVICES={v:?}"),
        Err(_) => "CUDA_VISIBLE_DEVICES is unset".to_string(),
    }
}

/// 13000 -> "13.0", 12040 -> "12.4".
pub fn cuda_version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// "00000000:18:00.0" (cuDeviceGetPCIBusId) -> "0000:18:00.0": a 4-digit
/// domain when it fits, lower case, as sysfs names devices.
pub fn normalize_pci_bus_id(raw: &str) -> String {
    let raw = raw.trim();
    if let Some((domain, rest)) = raw.split_once(':') {
        if rest.contains(':') {
            if let Ok(d) = u32::from_str_radix(domain, 16) {
                return format!("{d:04x}:{}", rest.to_ascii_lowercase());
            }
        }
    }
    raw.to_ascii_lowercase()
}

/// As nvidia-smi prints it: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
pub fn format_uuid(b: &[u8; 16]) -> String {
    let hex =
        |r: std::ops::Range<usize>| -> String { b[r].iter().map(|x| format!("{x:02x}")).collect() };
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

fn c_buf_text(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The Ferry code for a CUresult.
pub fn error_code(r: CUresult) -> ErrorCode {
    match r {
        // INVALID_VALUE, INVALID_DEVICE, INVALID_CONTEXT, INVALID_HANDLE
        1 | 101 | 201 | 400 => ErrorCode::InvalidArgument,
        2 => ErrorCode::NoMemory,
        // NOT_INITIALIZED, DEINITIALIZED, STUB_LIBRARY, DEVICE_UNAVAILABLE,
        // NO_DEVICE, SYSTEM_NOT_READY, SYSTEM_DRIVER_MISMATCH,
        // COMPAT_NOT_SUPPORTED_ON_DEVICE
        3 | 4 | 34 | 46 | 100 | 802 | 803 | 804 => ErrorCode::Unavailable,
        304 => ErrorCode::Io,
        500 => ErrorCode::NotFound,
        600 => ErrorCode::Busy,
        800 => ErrorCode::Permission,
        801 => ErrorCode::Unsupported,
        _ => ErrorCode::Plugin,
    }
}

/// Names for the codes this plugin meets, for when the driver cannot name
/// them (a library without cuGetErrorName).
fn fallback_error_name(r: CUresult) -> Option<&'static str> {
    Some(match r {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        804 => "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_bus_ids_are_normalised_like_sysfs() {
        assert_eq!(normalize_pci_bus_id("00000000:18:00.0"), "0000:18:00.0");
        assert_eq!(normalize_pci_bus_id("00000000:AB:00.0\n"), "0000:ab:00.0");
        assert_eq!(normalize_pci_bus_id("00010000:AB:00.0"), "10000:ab:00.0");
        assert_eq!(normalize_pci_bus_id("0000:c1:00.0"), "0000:c1:00.0");
        assert_eq!(normalize_pci_bus_id("garbage"), "garbage");
    }

    #[test]
    fn uuids_print_like_nvidia_smi() {
        let b: [u8; 16] = std::array::from_fn(|i| i as u8 * 17);
        assert_eq!(format_uuid(&b), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }

    #[test]
    fn versions_and_codes() {
        assert_eq!(cuda_version_text(13000), "13.0");
        assert_eq!(cuda_version_text(12040), "12.4");
        assert_eq!(error_code(2), ErrorCode::NoMemory);
        assert_eq!(error_code(100), ErrorCode::Unavailable);
        assert_eq!(error_code(801), ErrorCode::Unsupported);
        assert_eq!(error_code(700), ErrorCode::Plugin);
    }

    #[test]
    fn every_symbol_has_a_versioned_export_name() {
        for s in SYMBOLS {
            assert!(!s.exports.is_empty());
            assert!(s.name().starts_with("cu"), "{s:?}");
            assert!(
                s.name()
                    .starts_with(s.query.to_str().expect("ASCII symbol name")),
                "{s:?}"
            );
        }
        let optional: Vec<&str> = SYMBOLS
            .iter()
            .filter(|s| s.need == Need::Optional)
            .map(Symbol::name)
            .collect();
        assert_eq!(
            &optional[..4],
            [
                "cuDeviceGetUuid_v2",
                "cuMemHostRegister_v2",
                "cuMemHostUnregister",
                "cuMemGetHandleForAddressRange"
            ]
        );
        // What only the cuda-ipc transport needs is optional too.
        assert!(optional.contains(&"cuIpcOpenMemHandle_v2"));
        assert!(optional.contains(&"cuMemExportToShareableHandle"));
    }
}
