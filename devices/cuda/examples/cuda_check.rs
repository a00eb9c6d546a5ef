//! Exercises a built `libferry_device_cuda.so` through the C ABI on a
//! machine with a GPU, the way the engine will: dlopen, entry symbol, probe,
//! init, then every device function, printing what the driver said and how
//! long it took. It also opens libcuda itself, only to check from outside
//! what the plugin must not disturb (the thread's current context, the
//! primary context's reference count) and to make memory of the kinds the
//! plugin must classify but does not allocate (managed, host-registered,
//! cuMemCreate+cuMemMap).
//!
//!     cargo build --release -p ferry-device-cuda --example cuda_check
//!     cuda_check target/release/libferry_device_cuda.so
//!
//! Exit status 0 when every check passed, 1 otherwise. Experiments whose
//! outcome is information, not a promise (DMA-BUF of small or VMM memory),
//! are printed as "info".

use ferry_plugins_abi::sys;
use libloading::os::unix::Library;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

static FAILURES: AtomicUsize = AtomicUsize::new(0);

fn check(ok: bool, what: &str) {
    println!("{} {what}", if ok { "PASS" } else { "FAIL" });
    if !ok {
        FAILURES.fetch_add(1, Ordering::Relaxed);
    }
}

fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the plugin hands out NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn ms(t: Instant) -> String {
    format!("{:.3} ms", t.elapsed().as_secs_f64() * 1e3)
}

// ------------------------------------------------------------------ host

unsafe extern "C" fn host_log(_ctx: *mut c_void, level: i32, msg: *const c_char) {
    println!("  [plugin log {level}] {}", text(msg));
}

unsafe extern "C" fn host_log_enabled(_ctx: *mut c_void, _level: i32) -> i32 {
    1
}

unsafe extern "C" fn host_config(
    _ctx: *mut c_void,
    key: *const c_char,
    buf: *mut c_char,
    cap: usize,
) -> i64 {
    // SAFETY: key is a C string for this call.
    let key = unsafe { CStr::from_ptr(key) }
        .to_string_lossy()
        .into_owned();
    let var = format!("FERRY_{}", key.to_ascii_uppercase().replace('.', "_"));
    let Ok(value) = std::env::var(var) else {
        return -1;
    };
    let n = value.len().min(cap.saturating_sub(1));
    // SAFETY: buf has room for cap bytes and n + 1 <= cap.
    unsafe {
        std::ptr::copy_nonoverlapping(value.as_ptr().cast::<c_char>(), buf, n);
        *buf.add(n) = 0;
    }
    value.len() as i64
}

/// The services table: logs to stdout, settings from FERRY_* variables.
fn host() -> &'static sys::ferry_host_services_t {
    Box::leak(Box::new(sys::ferry_host_services_t {
        hdr: sys::ferry_abi_header_t::for_table::<sys::ferry_host_services_t>(),
        ctx: std::ptr::null_mut(),
        log: Some(host_log),
        log_enabled: Some(host_log_enabled),
        config_get: Some(host_config),
        topo_nics: None,
        peer_request: None,
        count: None,
    }))
}

// ----------------------------------------------------------------- probe

unsafe extern "C" fn sink_caps(_ctx: *mut c_void, mem: u64, scopes: u32) {
    println!(
        "  capabilities: memory {:?} (bits {mem:#x}), scopes {scopes:#x}",
        ferry_plugins_abi::caps::mem_kind_names(mem)
    );
}

unsafe extern "C" fn sink_device(_ctx: *mut c_void, d: *const sys::ferry_probe_device_t) {
    // SAFETY: d is valid for the call.
    let d = unsafe { &*d };
    println!(
        "  device {} pci {} numa {} kinds {:?}\n    {}",
        text(d.name),
        text(d.pci_bus_id),
        d.numa_node,
        ferry_plugins_abi::caps::mem_kind_names(d.mem_kinds),
        text(d.detail)
    );
}

unsafe extern "C" fn sink_missing(_ctx: *mut c_void, cap: *const c_char, why: *const c_char) {
    println!("  missing {}: {}", text(cap), text(why));
}

unsafe extern "C" fn sink_note(_ctx: *mut c_void, key: *const c_char, value: *const c_char) {
    println!("  note {}: {}", text(key), text(value));
}

// ---------------------------------------------------------------- plugin

struct Plugin {
    t: &'static sys::ferry_device_plugin_v1_t,
    inst: *mut c_void,
}
// SAFETY: the ABI lets any thread call a plugin instance.
unsafe impl Send for Plugin {}
// SAFETY: the ABI lets several threads call one plugin instance at once.
unsafe impl Sync for Plugin {}

fn call(f: impl FnOnce(*mut sys::ferry_errbuf_t) -> i32) -> Result<(), String> {
    let mut buf = [0 as c_char; 1024];
    let mut err = sys::ferry_errbuf_t {
        msg: buf.as_mut_ptr(),
        cap: buf.len(),
    };
    match f(&mut err) {
        sys::FERRY_OK => Ok(()),
        status => Err(format!("status {status}: {}", text(buf.as_ptr()))),
    }
}

fn kind_name(kind: u32) -> &'static str {
    match kind {
        sys::FERRY_PTR_HOST => "HOST",
        sys::FERRY_PTR_DEVICE => "DEVICE",
        sys::FERRY_PTR_HOST_PINNED => "HOST_PINNED",
        sys::FERRY_PTR_MANAGED => "MANAGED",
        _ => "?",
    }
}

// Every method below calls one function of the plugin's table with the
// instance from init, out-pointers to live locals and a live error buffer.
impl Plugin {
    fn query(&self, addr: u64) -> Result<sys::ferry_pointer_info_t, String> {
        let mut out = sys::ferry_pointer_info_t {
            struct_size: std::mem::size_of::<sys::ferry_pointer_info_t>() as u32,
            ..Default::default()
        };
        // SAFETY: query_pointer (required once init is set, plugin.h) gets init's live
        // instance (fini runs only at the end of main), `out` a live local whose struct_size
        // is our sizeof, and `e` call's live 1024-byte errbuf; `addr` is only classified.
        call(|e| unsafe { self.t.query_pointer.unwrap()(self.inst, addr, &mut out, e) })?;
        Ok(out)
    }

    fn show(&self, what: &str, addr: u64) -> Option<sys::ferry_pointer_info_t> {
        match self.query(addr) {
            Ok(p) => {
                println!(
                    "  query_pointer({what} {addr:#x}) = {} ordinal {} base {:#x} size {}",
                    kind_name(p.kind),
                    p.ordinal,
                    p.base,
                    p.size
                );
                Some(p)
            }
            Err(e) => {
                println!("  query_pointer({what} {addr:#x}) failed: {e}");
                None
            }
        }
    }

    fn alloc_device(&self, ordinal: i32, len: u64) -> Result<u64, String> {
        let mut p = 0;
        // SAFETY: alloc_device gets init's live instance (fini runs only at the end of main),
        // `&mut p` a live u64 local as its one out-pointer, and `e` call's live errbuf.
        call(|e| unsafe { self.t.alloc_device.unwrap()(self.inst, ordinal, len, &mut p, e) })?;
        Ok(p)
    }

    fn free_device(&self, p: u64) {
        // SAFETY: init's live instance; `p` is only a number to this plugin, which frees it
        // only if alloc_device made it and otherwise warns (instance.rs). main frees `small`,
        // and `dev` after the copies using it were synced, then `dev` again on purpose: plugin.h
        // says nothing of an unknown pointer, so that call tests this plugin's warning.
        unsafe { self.t.free_device.unwrap()(self.inst, p) }
    }

    fn alloc_pinned(&self, len: u64) -> Result<u64, String> {
        let mut p = std::ptr::null_mut();
        // SAFETY: alloc_pinned gets init's live instance (fini runs only at the end of main),
        // `&mut p` a live pointer-sized local as its out-pointer, and `e` call's live errbuf.
        call(|e| unsafe { self.t.alloc_pinned.unwrap()(self.inst, len, &mut p, e) })?;
        Ok(p as u64)
    }

    fn free_pinned(&self, p: u64) {
        // SAFETY: init's live instance; the plugin frees `p` only if alloc_pinned made it
        // (else warns). main frees `pinned` once, after its last copy was synced and after
        // its last use of the `pinned_bytes` slice over that memory.
        unsafe { self.t.free_pinned.unwrap()(self.inst, p as *mut c_void) }
    }

    fn export(&self, addr: u64, len: u64) -> Result<(i32, u64), String> {
        let (mut fd, mut off) = (-1, 0);
        // SAFETY: export_dmabuf (optional: unwrap panics, safely, if absent) gets init's live
        // instance, `&mut fd` and `&mut off` as live local out-pointers and `e` call's live
        // errbuf; `addr`/`len` are numbers the driver checks (host memory is refused).
        call(|e| unsafe {
            self.t.export_dmabuf.unwrap()(self.inst, addr, len, &mut fd, &mut off, e)
        })?;
        Ok((fd, off))
    }

    fn stream(&self, ordinal: i32) -> Result<*mut c_void, String> {
        let mut s = std::ptr::null_mut();
        // SAFETY: stream_create gets init's live instance (fini runs only at the end of
        // main), `&mut s` a live local as its out-pointer, and `e` call's live errbuf.
        call(|e| unsafe { self.t.stream_create.unwrap()(self.inst, ordinal, &mut s, e) })?;
        Ok(s)
    }

    fn copy(&self, s: *mut c_void, dst: u64, src: u64, len: u64) -> Result<(), String> {
        // SAFETY: init's live instance and call's live errbuf; the plugin takes `s` as its
        // own boxed stream, and the GPU reads `src` and writes `dst` until the next sync. This
        // fn is safe, so that rests on main: every call passes a stream from `stream` not yet
        // destroyed, and ranges of `dev`, `pinned` or a Vec it leaves alone until `sync`.
        call(|e| unsafe { self.t.copy_async.unwrap()(self.inst, s, dst, src, len, e) })
    }

    fn sync(&self, s: *mut c_void) -> Result<(), String> {
        // SAFETY: init's live instance and call's live errbuf; the plugin takes `s` as its
        // own boxed stream, and main only syncs streams from `stream` not yet destroyed.
        call(|e| unsafe { self.t.stream_sync.unwrap()(self.inst, s, e) })
    }

    fn destroy(&self, s: *mut c_void) {
        // SAFETY: init's live instance; the plugin frees `s` as its own boxed stream, and
        // main destroys each stream from `stream` once (its own, and each thread's), after
        // that stream's last sync.
        unsafe { self.t.stream_destroy.unwrap()(self.inst, s) }
    }
}

// ------------------------------------------- libcuda, seen from outside

type R = c_int;

/// The few driver calls the check makes itself, by their versioned exports.
struct Cuda {
    ctx_get_current: unsafe extern "C" fn(*mut *mut c_void) -> R,
    ctx_set_current: unsafe extern "C" fn(*mut c_void) -> R,
    primary_state: unsafe extern "C" fn(c_int, *mut c_uint, *mut c_int) -> R,
    primary_retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> R,
    primary_release: unsafe extern "C" fn(c_int) -> R,
    alloc_managed: unsafe extern "C" fn(*mut u64, usize, c_uint) -> R,
    free: unsafe extern "C" fn(u64) -> R,
    host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> R,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> R,
    granularity: unsafe extern "C" fn(*mut usize, *const AllocProp, c_int) -> R,
    create: unsafe extern "C" fn(*mut u64, usize, *const AllocProp, u64) -> R,
    release: unsafe extern "C" fn(u64) -> R,
    reserve: unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> R,
    address_free: unsafe extern "C" fn(u64, usize) -> R,
    map: unsafe extern "C" fn(u64, usize, usize, u64, u64) -> R,
    unmap: unsafe extern "C" fn(u64, usize) -> R,
    set_access: unsafe extern "C" fn(u64, usize, *const AccessDesc, usize) -> R,
    _lib: Library,
}

/// CUmemAllocationProp (cuda.h 12.x).
#[repr(C)]
struct AllocProp {
    kind: c_int,          // CU_MEM_ALLOCATION_TYPE_PINNED = 1
    handle_types: c_int,  // CU_MEM_HANDLE_TYPE_NONE = 0
    location_type: c_int, // CU_MEM_LOCATION_TYPE_DEVICE = 1
    location_id: c_int,
    win32: *mut c_void,
    compression: u8,
    gpu_direct_rdma_capable: u8,
    usage: u16,
    reserved: [u8; 4],
}

/// CUmemAccessDesc.
#[repr(C)]
struct AccessDesc {
    location_type: c_int,
    location_id: c_int,
    flags: c_int, // CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
}

impl Cuda {
    fn open() -> Result<Cuda, String> {
        // SAFETY: the system's driver library, already loaded by the plugin.
        let lib = unsafe { Library::open(Some("libcuda.so.1"), libc::RTLD_NOW) }
            .map_err(|e| format!("{e}: {:?}", std::error::Error::source(&e)))?;
        macro_rules! f {
            ($name:literal) => {
                // SAFETY: each field's type is the export's signature in cuda.h.
                unsafe {
                    *lib.get(concat!($name, "\0").as_bytes())
                        .map_err(|e| format!("{}: {e}", $name))?
                }
            };
        }
        Ok(Cuda {
            ctx_get_current: f!("cuCtxGetCurrent"),
            ctx_set_current: f!("cuCtxSetCurrent"),
            primary_state: f!("cuDevicePrimaryCtxGetState"),
            primary_retain: f!("cuDevicePrimaryCtxRetain"),
            primary_release: f!("cuDevicePrimaryCtxRelease_v2"),
            alloc_managed: f!("cuMemAllocManaged"),
            free: f!("cuMemFree_v2"),
            host_register: f!("cuMemHostRegister_v2"),
            host_unregister: f!("cuMemHostUnregister"),
            granularity: f!("cuMemGetAllocationGranularity"),
            create: f!("cuMemCreate"),
            release: f!("cuMemRelease"),
            reserve: f!("cuMemAddressReserve"),
            address_free: f!("cuMemAddressFree"),
            map: f!("cuMemMap"),
            unmap: f!("cuMemUnmap"),
            set_access: f!("cuMemSetAccess"),
            _lib: lib,
        })
    }

    fn current(&self) -> *mut c_void {
        let mut c = std::ptr::null_mut();
        // SAFETY: c is a valid out-pointer.
        unsafe { (self.ctx_get_current)(&mut c) };
        c
    }

    /// (flags, active) of device 0's primary context.
    fn primary_active(&self) -> (u32, i32) {
        let (mut flags, mut active) = (0, 0);
        // SAFETY: valid out-pointers; device 0 exists.
        unsafe { (self.primary_state)(0, &mut flags, &mut active) };
        (flags, active)
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
    })
}

fn describe_fd(fd: i32) -> String {
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .map(|p| p.display().to_string())
        .unwrap_or_else(|e| format!("readlink: {e}"));
    // SAFETY: fd is ours; lseek on a dma-buf reports its size.
    let size = unsafe { libc::lseek(fd, 0, libc::SEEK_END) };
    let exporter = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("exp_name"))
                .map(|l| l.trim().to_string())
        })
        .unwrap_or_else(|| "no exp_name in fdinfo".into());
    format!("{link}, size {size}, {exporter}")
}

fn try_export(p: &Plugin, what: &str, addr: u64, len: u64) -> Option<(i32, u64)> {
    match p.export(addr, len) {
        Ok((fd, off)) => {
            println!(
                "  export_dmabuf({what} {addr:#x}, {len}) = fd {fd} offset {off} ({})",
                describe_fd(fd)
            );
            // SAFETY: the fd is ours to close.
            unsafe { libc::close(fd) };
            Some((fd, off))
        }
        Err(e) => {
            println!("  export_dmabuf({what} {addr:#x}, {len}) failed: {e}");
            None
        }
    }
}

fn main() {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "target/release/libferry_device_cuda.so".into());
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    println!(
        "cuda_check: plugin {path}, CUDA_VISIBLE_DEVICES={:?}, host page size {page}",
        std::env::var("CUDA_VISIBLE_DEVICES").ok()
    );

    let t = Instant::now();
    // SAFETY: the plugin under test; it is loaded for the whole run.
    let lib = match unsafe { Library::open(Some(&path), libc::RTLD_NOW | libc::RTLD_LOCAL) } {
        Ok(lib) => lib,
        Err(e) => {
            println!("FAIL dlopen {path}: {e:?}");
            std::process::exit(1);
        }
    };
    // SAFETY: the entry symbol's type is fixed by plugin.h.
    let entry: sys::ferry_device_plugin_v1_entry_fn =
        unsafe { *lib.get(b"ferry_device_plugin_v1\0").expect("entry symbol") };
    // SAFETY: the entry function has no preconditions and returns a static table.
    let table: &'static sys::ferry_device_plugin_v1_t = unsafe { &*entry() };
    println!(
        "loaded {} {} ({}) in {}",
        text(table.name),
        text(table.version),
        text(table.description),
        ms(t)
    );

    let services = host();
    // Probe.
    let sink = sys::ferry_probe_sink_t {
        hdr: sys::ferry_abi_header_t::for_table::<sys::ferry_probe_sink_t>(),
        ctx: std::ptr::null_mut(),
        set_capabilities: Some(sink_caps),
        add_device: Some(sink_device),
        add_missing: Some(sink_missing),
        add_note: Some(sink_note),
        add_memory_method: None,
    };
    for round in ["first", "second"] {
        let t = Instant::now();
        // SAFETY: host and sink are valid for the call.
        let r = call(|e| unsafe { table.probe.unwrap()(services, &sink, e) });
        println!("probe ({round}) took {}: {r:?}", ms(t));
        if r.is_err() {
            check(false, "probe");
            std::process::exit(1);
        }
    }

    // Init.
    let t = Instant::now();
    let mut inst = std::ptr::null_mut();
    // SAFETY: valid host, out-pointer and error buffer.
    let r = call(|e| unsafe { table.init.unwrap()(services, &mut inst, e) });
    println!("init took {}: {r:?}", ms(t));
    if r.is_err() {
        check(false, "init");
        std::process::exit(1);
    }
    let p = Plugin { t: table, inst };
    let cuda = match Cuda::open() {
        Ok(c) => Some(c),
        Err(e) => {
            println!("  (cannot open libcuda for outside checks: {e})");
            None
        }
    };
    if let Some(c) = &cuda {
        println!(
            "  device 0 primary context after init: {:?} (flags, active)",
            c.primary_active()
        );
    }

    let mut n = 0;
    // SAFETY: the instance from init, live out-pointer and error buffer.
    let r = call(|e| unsafe { table.device_count.unwrap()(inst, &mut n, e) });
    println!("device_count = {n} {r:?}");
    for ordinal in 0..n as i32 {
        // SAFETY: zeroed is a valid ferry_device_info_t.
        let mut info: sys::ferry_device_info_t = unsafe { std::mem::zeroed() };
        info.struct_size = std::mem::size_of::<sys::ferry_device_info_t>() as u32;
        // SAFETY: `inst` is the live instance from init, `info` a writable
        // record of its declared size, `e` the error buffer call provides.
        let r = call(|e| unsafe { table.device_info.unwrap()(inst, ordinal, &mut info, e) });
        println!(
            "device_info({ordinal}) {r:?}: name {:?} pci {:?} uuid {:?} memory {} bytes, \
             gpu_direct_rdma(116) {} dmabuf(124) {} dmabuf_export {}",
            text(info.name.as_ptr()),
            text(info.pci_bus_id.as_ptr()),
            text(info.uuid.as_ptr()),
            info.total_memory,
            info.gpu_direct_rdma,
            info.dmabuf,
            info.dmabuf_export
        );
    }

    // Pointer classification before any context exists, from a thread
    // that has none.
    let host_vec = vec![1u8; 1 << 20];
    let host_addr = host_vec.as_ptr() as u64;
    std::thread::scope(|s| {
        s.spawn(|| {
            let q = p.show("malloc, fresh thread, no context yet", host_addr);
            check(
                q.is_some_and(|q| q.kind == sys::FERRY_PTR_HOST),
                "plain host memory is HOST",
            );
        });
    });
    if let Some(c) = &cuda {
        println!(
            "  device 0 primary context after a host query: {:?} (flags, active)",
            c.primary_active()
        );
    }
    let stack_word = 0u64;
    let q = p.show("stack", &stack_word as *const u64 as u64);
    check(
        q.is_some_and(|q| q.kind == sys::FERRY_PTR_HOST),
        "stack memory is HOST",
    );
    let q = p.show("null", 0);
    check(
        q.is_some_and(|q| q.kind == sys::FERRY_PTR_HOST),
        "address 0 is HOST",
    );

    // Device memory.
    const MIB64: u64 = 64 << 20;
    let before = cuda.as_ref().map(Cuda::current);
    let t = Instant::now();
    let dev = match p.alloc_device(0, MIB64) {
        Ok(d) => d,
        Err(e) => {
            check(false, &format!("alloc_device 64 MiB: {e}"));
            std::process::exit(1);
        }
    };
    println!("alloc_device(0, 64 MiB) = {dev:#x} in {}", ms(t));
    if let Some(c) = &cuda {
        check(
            Some(c.current()) == before,
            "the calling thread's current context is unchanged by alloc_device",
        );
        println!(
            "  device 0 primary context after alloc: {:?} (flags, active)",
            c.primary_active()
        );
    }
    let q = p.show("device+123", dev + 123);
    check(
        q.is_some_and(|q| {
            q.kind == sys::FERRY_PTR_DEVICE && q.ordinal == 0 && q.base == dev && q.size == MIB64
        }),
        "device memory is DEVICE, ordinal 0, with its allocation's base and size",
    );
    std::thread::scope(|s| {
        s.spawn(|| {
            let q = p.show("device, fresh thread", dev);
            check(
                q.is_some_and(|q| q.kind == sys::FERRY_PTR_DEVICE && q.ordinal == 0),
                "device memory is DEVICE from a thread without a context",
            );
            if let Some(c) = &cuda {
                check(
                    c.current().is_null(),
                    "a query leaves a fresh thread without a context",
                );
            }
        });
    });

    // Pinned memory.
    let t = Instant::now();
    let pinned = p.alloc_pinned(MIB64).expect("alloc_pinned");
    println!("alloc_pinned(64 MiB) = {pinned:#x} in {}", ms(t));
    let q = p.show("pinned", pinned + 5);
    check(
        q.is_some_and(|q| q.kind == sys::FERRY_PTR_HOST_PINNED),
        "cuMemHostAlloc memory is HOST_PINNED",
    );

    // Memory the plugin did not allocate.
    if let Some(c) = &cuda {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointer; balanced by the release below.
        unsafe { (c.primary_retain)(&mut ctx, 0) };
        // SAFETY: a retained context; restored to null below.
        unsafe { (c.ctx_set_current)(ctx) };
        let mut managed = 0u64;
        // SAFETY: valid out-pointer; 1 MiB, CU_MEM_ATTACH_GLOBAL.
        let r = unsafe { (c.alloc_managed)(&mut managed, 1 << 20, 1) };
        if r == 0 {
            let q = p.show("managed", managed + 8);
            check(
                q.is_some_and(|q| q.kind == sys::FERRY_PTR_MANAGED),
                "cuMemAllocManaged memory is MANAGED",
            );
            // SAFETY: ours, freed once.
            unsafe { (c.free)(managed) };
        } else {
            println!("  cuMemAllocManaged failed: {r}");
        }
        let layout = std::alloc::Layout::from_size_align(4 << 20, 4096).unwrap();
        // SAFETY: a non-zero size; freed below.
        let reg_ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<c_void>();
        // SAFETY: a live, page-aligned 4 MiB buffer, unregistered below
        // before it is freed.
        let r = unsafe { (c.host_register)(reg_ptr, layout.size(), 0) };
        if r == 0 {
            let q = p.show("host-registered", reg_ptr as u64 + 4096);
            check(
                q.is_some_and(|q| q.kind == sys::FERRY_PTR_HOST_PINNED),
                "cuMemHostRegister'ed memory is HOST_PINNED",
            );
            // SAFETY: registered above.
            unsafe { (c.host_unregister)(reg_ptr) };
        } else {
            println!("  cuMemHostRegister failed: {r}");
        }
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(reg_ptr.cast(), layout) };
        vmm_experiment(c, &p);
        // SAFETY: undo the set and retain above.
        unsafe { (c.ctx_set_current)(std::ptr::null_mut()) };
        // SAFETY: balances the retain above.
        unsafe { (c.primary_release)(0) };
    }

    // DMA-BUF.
    let whole = try_export(&p, "whole 64 MiB buffer", dev, MIB64);
    check(
        whole.is_some_and(|(fd, off)| fd >= 0 && off == 0),
        "export_dmabuf of the whole buffer",
    );
    let inner = try_export(&p, "device+100", dev + 100, 1000);
    check(
        inner.is_some_and(|(_, off)| off == 100),
        "export_dmabuf of an inner range reports the offset",
    );
    try_export(&p, "device+3MiB+5", dev + (3 << 20) + 5, 2 << 20);
    if let Ok(small) = p.alloc_device(0, 1000) {
        println!(
            "  small allocation: {small:#x} (page offset {})",
            small % 4096
        );
        try_export(&p, "small 1000-byte allocation", small, 1000);
        p.free_device(small);
    }
    let refused = p.export(pinned, 4096);
    println!("  export_dmabuf(pinned) = {refused:?}");
    check(refused.is_err(), "export_dmabuf refuses host memory");

    // Copies.
    let stream = p.stream(0).expect("stream_create");
    // SAFETY: pinned holds 64 MiB of host memory, ours until free_pinned.
    let pinned_bytes = unsafe { std::slice::from_raw_parts_mut(pinned as *mut u8, MIB64 as usize) };
    for (i, b) in pinned_bytes.iter_mut().enumerate() {
        *b = (i.wrapping_mul(2654435761) >> 13) as u8;
    }
    let sum_src = fnv1a(pinned_bytes);
    let mut back = vec![0u8; MIB64 as usize];
    let t = Instant::now();
    p.copy(stream, dev, pinned, MIB64).expect("copy h2d");
    p.copy(stream, back.as_mut_ptr() as u64, dev, MIB64)
        .expect("copy d2h");
    p.sync(stream).expect("sync");
    println!(
        "copy pinned->device->pageable 64 MiB each way + sync: {}",
        ms(t)
    );
    let sum_back = fnv1a(&back);
    println!("  checksum fnv1a64 source {sum_src:016x}, round trip {sum_back:016x}");
    check(
        sum_src == sum_back,
        "host -> device -> host round trip is exact",
    );

    // Bandwidth, pinned both ways, 8 x 64 MiB.
    let t = Instant::now();
    for _ in 0..8 {
        p.copy(stream, dev, pinned, MIB64).unwrap();
    }
    p.sync(stream).unwrap();
    let h2d = 8.0 * MIB64 as f64 / t.elapsed().as_secs_f64() / 1e9;
    let t = Instant::now();
    for _ in 0..8 {
        p.copy(stream, pinned, dev, MIB64).unwrap();
    }
    p.sync(stream).unwrap();
    let d2h = 8.0 * MIB64 as f64 / t.elapsed().as_secs_f64() / 1e9;
    println!("  pinned bandwidth: host->device {h2d:.1} GB/s, device->host {d2h:.1} GB/s");

    // Per-call costs.
    let iters = 100_000;
    let t = Instant::now();
    for _ in 0..iters {
        let _ = p.query(dev + 64);
    }
    let q_dev = t.elapsed().as_nanos() as f64 / iters as f64;
    let t = Instant::now();
    for _ in 0..iters {
        let _ = p.query(host_addr);
    }
    let q_host = t.elapsed().as_nanos() as f64 / iters as f64;
    println!(
        "  query_pointer: {q_dev:.0} ns/call on device memory, {q_host:.0} ns/call on host memory"
    );
    let small = 1000;
    let t = Instant::now();
    for _ in 0..small {
        p.copy(stream, dev, pinned, 4096).unwrap();
        p.sync(stream).unwrap();
    }
    let rt = t.elapsed().as_nanos() as f64 / small as f64 / 1e3;
    let t = Instant::now();
    for _ in 0..small {
        p.copy(stream, dev, pinned, 4096).unwrap();
    }
    let enqueue = t.elapsed().as_nanos() as f64 / small as f64 / 1e3;
    p.sync(stream).unwrap();
    println!(
        "  4 KiB copy_async+stream_sync: {rt:.1} us; copy_async enqueue alone: {enqueue:.2} us"
    );

    // Many threads, one stream each.
    let t = Instant::now();
    let ok = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for th in 0..8u64 {
            let (p, ok) = (&p, &ok);
            s.spawn(move || {
                let chunk = 1u64 << 20;
                let mine = dev + th * chunk;
                let stream = p.stream(0).unwrap();
                let src: Vec<u8> = (0..chunk).map(|i| (i ^ th) as u8).collect();
                let mut dst = vec![0u8; chunk as usize];
                for _ in 0..50 {
                    p.copy(stream, mine, src.as_ptr() as u64, chunk).unwrap();
                    p.copy(stream, dst.as_mut_ptr() as u64, mine, chunk)
                        .unwrap();
                    p.sync(stream).unwrap();
                }
                if dst == src {
                    ok.fetch_add(1, Ordering::Relaxed);
                }
                p.destroy(stream);
            });
        }
    });
    println!(
        "8 threads x 50 round trips of 1 MiB on their own streams: {}",
        ms(t)
    );
    check(
        ok.load(Ordering::Relaxed) == 8,
        "every thread got its bytes back",
    );

    p.destroy(stream);
    p.free_pinned(pinned);
    p.free_device(dev);
    p.free_device(dev); // a second free is a warning, not a crash
    let t = Instant::now();
    // SAFETY: the instance from init, not used again.
    unsafe { table.fini.unwrap()(inst) };
    println!("fini took {}", ms(t));
    if let Some(c) = &cuda {
        let state = c.primary_active();
        println!("  device 0 primary context after fini: {state:?} (flags, active)");
        check(state.1 == 0, "fini released the primary context");
    }

    let failures = FAILURES.load(Ordering::Relaxed);
    println!("cuda_check: {failures} failure(s)");
    std::process::exit(i32::from(failures != 0));
}

/// PyTorch's expandable segments map several cuMemCreate chunks into one
/// reserved range; can such a range be classified and exported?
fn vmm_experiment(c: &Cuda, p: &Plugin) {
    let prop = AllocProp {
        kind: 1,
        handle_types: 0,
        location_type: 1,
        location_id: 0,
        win32: std::ptr::null_mut(),
        compression: 0,
        gpu_direct_rdma_capable: 0,
        usage: 0,
        reserved: [0; 4],
    };
    let mut gran = 0usize;
    // SAFETY: valid prop and out-pointer.
    let r = unsafe { (c.granularity)(&mut gran, &prop, 0) };
    if r != 0 || gran == 0 {
        println!("  info: VMM granularity query failed: {r}");
        return;
    }
    let size = 2 * gran;
    let mut va = 0u64;
    // SAFETY: valid out-pointer; freed below.
    let r = unsafe { (c.reserve)(&mut va, size, 0, 0, 0) };
    if r != 0 {
        println!("  info: cuMemAddressReserve failed: {r}");
        return;
    }
    let mut handles = [0u64; 2];
    let mut mapped = 0;
    for (i, h) in handles.iter_mut().enumerate() {
        // SAFETY: valid prop and out-pointer; released below.
        let r = unsafe { (c.create)(h, gran, &prop, 0) };
        if r != 0 {
            println!("  info: cuMemCreate failed: {r}");
            break;
        }
        // SAFETY: maps a whole handle into our reservation.
        let r = unsafe { (c.map)(va + (i * gran) as u64, gran, 0, *h, 0) };
        if r != 0 {
            println!("  info: cuMemMap failed: {r}");
            break;
        }
        mapped += 1;
    }
    if mapped == 2 {
        let access = AccessDesc {
            location_type: 1,
            location_id: 0,
            flags: 3,
        };
        // SAFETY: the range is mapped; one access descriptor.
        let r = unsafe { (c.set_access)(va, size, &access, 1) };
        println!("  VMM range {va:#x}+{size} (two {gran}-byte chunks), cuMemSetAccess {r}");
        p.show("VMM", va + 100);
        try_export(p, "VMM first chunk", va, gran as u64);
        try_export(p, "VMM across both chunks", va + 4096, (gran + 4096) as u64);
    }
    for (i, h) in handles.iter().enumerate() {
        if i < mapped {
            // SAFETY: mapped above.
            unsafe { (c.unmap)(va + (i * gran) as u64, gran) };
        }
        if *h != 0 {
            // SAFETY: created above.
            unsafe { (c.release)(*h) };
        }
    }
    // SAFETY: reserved above.
    unsafe { (c.address_free)(va, size) };
}
