//! The plugin through its C table, as the engine sees it: probe without a
//! driver, with files that are not drivers, and with builds of the CUDA
//! emulator (tests/cuda-emulator/libcuda.c, a test-only libcuda.so.1
//! compiled here with the system C compiler) that check the plugin's
//! context and resource discipline.
//!
//! Every test names its driver through the host's `cuda.library` setting
//! (what FERRY_CUDA_LIBRARY feeds), and each emulator build has its
//! settings fixed at compile time (`-DFERRY_CUDA_EMU_...`, environment
//! ignored), so tests never touch the process environment and run in
//! parallel.

use ferry_plugins_abi::sys;
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

// ---------------------------------------------------------------- the host

struct TestHost {
    library: Option<CString>,
    /// cuda.copy, when set.
    copy: Option<CString>,
    logs: Mutex<Vec<String>>,
}

unsafe extern "C" fn host_log(ctx: *mut c_void, _level: i32, msg: *const c_char) {
    // SAFETY: ctx is the leaked TestHost; msg a C string for this call.
    let (host, msg) = unsafe { (&*(ctx as *const TestHost), CStr::from_ptr(msg)) };
    host.logs
        .lock()
        .unwrap()
        .push(msg.to_string_lossy().into_owned());
}

unsafe extern "C" fn host_log_enabled(_ctx: *mut c_void, _level: i32) -> i32 {
    1
}

unsafe extern "C" fn host_config(
    ctx: *mut c_void,
    key: *const c_char,
    buf: *mut c_char,
    cap: usize,
) -> i64 {
    // SAFETY: ctx is the leaked TestHost; key a C string for this call.
    let (host, key) = unsafe { (&*(ctx as *const TestHost), CStr::from_ptr(key)) };
    let value = match key {
        k if k == c"cuda.library" => host.library.as_ref(),
        k if k == c"cuda.copy" => host.copy.as_ref(),
        _ => None,
    };
    let Some(value) = value else {
        return -1;
    };
    let bytes = value.as_bytes();
    let n = bytes.len().min(cap.saturating_sub(1));
    // SAFETY: buf has room for cap bytes and n + 1 <= cap.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, n);
        *buf.add(n) = 0;
    }
    bytes.len() as i64
}

/// A services table whose `cuda.library` is `library`. Leaked: an instance
/// may keep it until fini, and tests are short.
fn host(library: Option<&Path>) -> &'static sys::ferry_host_services_t {
    host_copying(library, None)
}

/// The same, with `cuda.copy` set to `copy`.
fn host_copying(library: Option<&Path>, copy: Option<&str>) -> &'static sys::ferry_host_services_t {
    let state: &'static TestHost = Box::leak(Box::new(TestHost {
        library: library.map(|p| CString::new(p.to_str().unwrap()).unwrap()),
        copy: copy.map(|c| CString::new(c).unwrap()),
        logs: Mutex::new(Vec::new()),
    }));
    Box::leak(Box::new(sys::ferry_host_services_t {
        hdr: sys::ferry_abi_header_t::for_table::<sys::ferry_host_services_t>(),
        ctx: state as *const TestHost as *mut c_void,
        log: Some(host_log),
        log_enabled: Some(host_log_enabled),
        config_get: Some(host_config),
        topo_nics: None,
        peer_request: None,
        count: None,
    }))
}

fn logs(host: &sys::ferry_host_services_t) -> Vec<String> {
    // SAFETY: ctx is the leaked TestHost of this table.
    unsafe { &*(host.ctx as *const TestHost) }
        .logs
        .lock()
        .unwrap()
        .clone()
}

// ---------------------------------------------------------------- probe

#[derive(Default, Debug)]
struct Findings {
    capabilities: Option<(u64, u32)>,
    /// (name, pci, detail, mem kinds)
    devices: Vec<(String, String, String, u64)>,
    missing: Vec<(String, String)>,
    notes: Vec<(String, String)>,
}

fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the plugin passes C strings valid for the callback.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

unsafe extern "C" fn sink_caps(ctx: *mut c_void, mem: u64, scopes: u32) {
    // SAFETY: ctx is the Findings of this probe call.
    unsafe { &mut *(ctx as *mut Findings) }.capabilities = Some((mem, scopes));
}

unsafe extern "C" fn sink_device(ctx: *mut c_void, d: *const sys::ferry_probe_device_t) {
    // SAFETY: ctx is the Findings of this probe; d is valid for the call.
    let (f, d) = unsafe { (&mut *(ctx as *mut Findings), &*d) };
    f.devices.push((
        text(d.name),
        text(d.pci_bus_id),
        text(d.detail),
        d.mem_kinds,
    ));
}

unsafe extern "C" fn sink_missing(ctx: *mut c_void, cap: *const c_char, why: *const c_char) {
    // SAFETY: ctx is the Findings of this probe call.
    unsafe { &mut *(ctx as *mut Findings) }
        .missing
        .push((text(cap), text(why)));
}

unsafe extern "C" fn sink_note(ctx: *mut c_void, key: *const c_char, value: *const c_char) {
    // SAFETY: ctx is the Findings of this probe call.
    unsafe { &mut *(ctx as *mut Findings) }
        .notes
        .push((text(key), text(value)));
}

fn table() -> &'static sys::ferry_device_plugin_v1_t {
    // SAFETY: the entry point returns a pointer to a static table.
    unsafe { &*crate::ferry_device_plugin_v1() }
}

/// Runs probe through the C table: (status, error message, findings).
fn probe(host: &sys::ferry_host_services_t) -> (i32, String, Findings) {
    let mut findings = Findings::default();
    let sink = sys::ferry_probe_sink_t {
        hdr: sys::ferry_abi_header_t::for_table::<sys::ferry_probe_sink_t>(),
        ctx: (&mut findings as *mut Findings).cast(),
        set_capabilities: Some(sink_caps),
        add_device: Some(sink_device),
        add_missing: Some(sink_missing),
        add_note: Some(sink_note),
        add_memory_method: None,
    };
    let mut buf = [0 as c_char; 1024];
    let mut err = sys::ferry_errbuf_t {
        msg: buf.as_mut_ptr(),
        cap: buf.len(),
    };
    let probe = table().probe.expect("probe");
    // SAFETY: host, sink and err are valid for the call.
    let status = unsafe { probe(host, &sink, &mut err) };
    (status, text(buf.as_ptr()), findings)
}

// ---------------------------------------------------------------- emulator

/// What every build here fixes (the emulator's settings, see its header
/// comment): two devices, device 1 with hex letters in its PCI bus number
/// (the driver prints them in capitals), only device 0 with GPUDirect RDMA
/// and DMA-BUF, a CUDA 12.4 driver, and no setting from the environment.
const EMULATOR_BASE: &[&str] = &[
    "FERRY_CUDA_EMU_NO_ENV",
    "FERRY_CUDA_EMU_DEVICES=2",
    "FERRY_CUDA_EMU_PCI_BUS=18,AB",
    "FERRY_CUDA_EMU_GPU_DIRECT=1",
    "FERRY_CUDA_EMU_DRIVER_VERSION=12040",
];

/// Compiles the CUDA emulator (tests/cuda-emulator/libcuda.c) into
/// `dir/name.so` with [`EMULATOR_BASE`] and `defines` (build options and
/// settings, `NAME` or `NAME=value`; one here replaces the base's).
fn emulator(dir: &Path, name: &str, defines: &[&str]) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/cuda-emulator/libcuda.c");
    let key = |d: &str| d.split('=').next().unwrap_or_default().to_string();
    let overridden: Vec<String> = defines.iter().map(|d| key(d)).collect();
    let all = EMULATOR_BASE
        .iter()
        .filter(|d| !overridden.contains(&key(d)))
        .chain(defines);
    let out = dir.join(format!("{name}.so"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let output = Command::new(cc)
        .args([
            "-shared",
            "-fPIC",
            "-std=gnu11",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pthread",
            "-fvisibility=hidden",
            "-o",
        ])
        .arg(&out)
        .arg(&source)
        .args(all.map(|d| format!("-D{d}")))
        .output()
        .expect("run the C compiler (is cc installed?)");
    assert!(
        output.status.success(),
        "compiling the CUDA emulator failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    out
}

/// The emulator's own counters, through its ferry_cuda_emu_* hooks.
struct EmuView {
    lib: libloading::Library,
}

impl EmuView {
    fn open(path: &Path) -> EmuView {
        // SAFETY: the emulator is our own test library, already loaded by
        // the plugin; this only takes another reference to it.
        let lib = unsafe { libloading::Library::new(path) }.unwrap();
        EmuView { lib }
    }

    fn count(&self, name: &str) -> i32 {
        // SAFETY: every ferry_cuda_emu_* counter asked for here is
        // `int fn(void)`.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn() -> i32>(name.as_bytes())
                .unwrap();
            f()
        }
    }

    fn current_context(&self) -> *mut c_void {
        // SAFETY: ferry_cuda_emu_current_context is `void *fn(void)`.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn() -> *mut c_void>(b"ferry_cuda_emu_current_context")
                .unwrap();
            f()
        }
    }

    fn set_current(&self, device: i32) {
        // SAFETY: ferry_cuda_emu_set_current is `void fn(int)`.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(i32)>(b"ferry_cuda_emu_set_current")
                .unwrap();
            f(device)
        }
    }
}

// ---------------------------------------------------------------- tests

#[test]
fn without_a_driver_probe_is_cleanly_unavailable() {
    // SAFETY: only asks whether the system has a driver at all.
    let real_driver =
        unsafe { libloading::Library::new(ferry_cuda_driver::driver::DEFAULT_LIBRARY) }.is_ok();
    let (status, message, findings) = probe(host(None));
    if real_driver {
        eprintln!(
            "this host has {}; only checking that probe returns",
            ferry_cuda_driver::driver::DEFAULT_LIBRARY
        );
        assert!(
            status == sys::FERRY_OK || status == sys::FERRY_ERR_UNAVAILABLE,
            "{message}"
        );
        return;
    }
    assert_eq!(status, sys::FERRY_ERR_UNAVAILABLE, "{message}");
    assert_eq!(
        message,
        "libcuda.so.1 not found: no NVIDIA driver on this host"
    );
    assert!(findings.devices.is_empty());
    // init says the same, and leaves no instance behind.
    let mut instance: *mut c_void = std::ptr::null_mut();
    let mut buf = [0 as c_char; 256];
    let mut err = sys::ferry_errbuf_t {
        msg: buf.as_mut_ptr(),
        cap: buf.len(),
    };
    let init = table().init.expect("init");
    // SAFETY: valid host, out-pointer and error buffer.
    let status = unsafe { init(host(None), &mut instance, &mut err) };
    assert_eq!(status, sys::FERRY_ERR_UNAVAILABLE);
    assert!(instance.is_null());
    assert_eq!(text(buf.as_ptr()), message);
}

#[test]
fn a_file_that_is_not_a_library_is_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let text_file = dir.path().join("libcuda.so.1");
    std::fs::write(&text_file, "#!/bin/sh\necho not a driver\n").unwrap();
    let (status, message, _) = probe(host(Some(&text_file)));
    assert_eq!(status, sys::FERRY_ERR_UNAVAILABLE);
    assert_eq!(
        message,
        format!(
            "FERRY_CUDA_LIBRARY={} is not a loadable library: not an ELF file",
            text_file.display()
        )
    );

    let missing = dir.path().join("nowhere/libcuda.so.1");
    let (status, message, _) = probe(host(Some(&missing)));
    assert_eq!(status, sys::FERRY_ERR_UNAVAILABLE);
    assert!(message.ends_with(": no such file"), "{message}");

    // A truncated copy of a real library would make dlopen fault; the
    // header check refuses it first.
    let whole = emulator(dir.path(), "whole", &[]);
    let bytes = std::fs::read(&whole).unwrap();
    let cut = dir.path().join("cut.so");
    std::fs::write(&cut, &bytes[..bytes.len() / 3]).unwrap();
    let (status, message, _) = probe(host(Some(&cut)));
    assert_eq!(status, sys::FERRY_ERR_UNAVAILABLE);
    assert!(message.contains("truncated ELF"), "{message}");

    // A valid library that is no driver.
    let other = dir.path().join("other.so");
    let out = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".to_string()))
        .args(["-shared", "-fPIC", "-x", "c", "-o"])
        .arg(&other)
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(b"int not_cuda(void) { return 1; }\n")?;
            child.wait()
        })
        .unwrap();
    assert!(out.success());
    let (status, message, _) = probe(host(Some(&other)));
    assert_eq!(status, sys::FERRY_ERR_UNAVAILABLE);
    assert!(
        message.ends_with("does not export cuInit: it is not a CUDA driver library"),
        "{message}"
    );
}

#[test]
fn cuinit_failures_name_the_code() {
    let dir = tempfile::tempdir().unwrap();
    // Only cuInit, so the plugin names the code from its own table.
    let minimal = emulator(
        dir.path(),
        "minimal",
        &["FERRY_CUDA_EMU_MINIMAL", "FERRY_CUDA_EMU_INIT_RESULT=100"],
    );
    let (status, message, _) = probe(host(Some(&minimal)));
    assert_eq!(status, sys::FERRY_ERR_UNAVAILABLE);
    assert!(
        message.starts_with("cuInit failed: CUDA_ERROR_NO_DEVICE (100) (CUDA_VISIBLE_DEVICES"),
        "{message}"
    );
    let odd = emulator(
        dir.path(),
        "odd",
        &["FERRY_CUDA_EMU_MINIMAL", "FERRY_CUDA_EMU_INIT_RESULT=12345"],
    );
    let (status, message, _) = probe(host(Some(&odd)));
    assert_eq!(status, sys::FERRY_ERR_UNAVAILABLE);
    assert_eq!(message, "cuInit failed: CUDA error 12345 (12345)");
    // A library with error strings gives the driver's words.
    let compat = emulator(dir.path(), "compat", &["FERRY_CUDA_EMU_INIT_RESULT=804"]);
    let (status, message, _) = probe(host(Some(&compat)));
    assert_eq!(status, sys::FERRY_ERR_UNAVAILABLE);
    assert_eq!(
        message,
        "cuInit failed: CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE: forward compatibility \
         was attempted on non supported HW"
    );
}

#[test]
fn no_visible_device_is_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    // cuInit succeeds and there is no device (without INIT_RESULT the
    // emulator's cuInit says CUDA_ERROR_NO_DEVICE, as CUDA_VISIBLE_DEVICES=""
    // makes the driver's).
    let none = emulator(
        dir.path(),
        "none",
        &["FERRY_CUDA_EMU_DEVICES=0", "FERRY_CUDA_EMU_INIT_RESULT=0"],
    );
    let (status, message, findings) = probe(host(Some(&none)));
    assert_eq!(status, sys::FERRY_ERR_UNAVAILABLE);
    assert!(
        message.starts_with("no CUDA device visible (CUDA_VISIBLE_DEVICES"),
        "{message}"
    );
    assert!(findings.devices.is_empty());
}

#[test]
fn probe_reports_devices_kinds_and_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    // An older driver: dlsym only, and no DMA-BUF export.
    let old = emulator(dir.path(), "old", &[]);
    let h = host(Some(&old));
    let (status, message, f) = probe(h);
    assert_eq!(status, sys::FERRY_OK, "{message}");
    let staged = sys::FERRY_MEM_CUDA_STAGED;
    let peermem = sys::FERRY_MEM_CUDA_PEERMEM;
    assert_eq!(f.capabilities, Some((staged | peermem, 0)));
    assert_eq!(f.devices.len(), 2);
    assert_eq!(
        (
            f.devices[0].0.as_str(),
            f.devices[0].1.as_str(),
            f.devices[0].3
        ),
        ("cuda:0", "0000:18:00.0", staged | peermem)
    );
    assert_eq!(
        (
            f.devices[1].0.as_str(),
            f.devices[1].1.as_str(),
            f.devices[1].3
        ),
        ("cuda:1", "0000:ab:00.0", staged)
    );
    assert_eq!(
        f.devices[0].2,
        "Emulated GPU 0, 80.0 GiB, compute 9.0, GPUDirect RDMA (attribute 116): yes, DMA-BUF \
         (attribute 124): yes, driver CUDA 12.4, GPU-e0e1e2e3-e4e5-e6e7-e8e9-eaebecedeeef"
    );
    let missing: Vec<&str> = f.missing.iter().map(|(c, _)| c.as_str()).collect();
    assert_eq!(missing, ["cuda-dmabuf", "cuda-peermem"]);
    assert!(
        f.missing[0]
            .1
            .contains("has no cuMemGetHandleForAddressRange"),
        "{:?}",
        f.missing
    );
    assert!(
        f.missing[1].1.starts_with("cuda:1 reports no"),
        "{:?}",
        f.missing
    );
    let note = |k: &str| {
        f.notes
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    assert_eq!(note("driver"), "CUDA 12.4 (cuDriverGetVersion 12040)");
    assert!(
        note("library").ends_with("; 52 symbols through dlsym"),
        "{}",
        note("library")
    );

    // A current driver: cuGetProcAddress_v2 and DMA-BUF export.
    let new = emulator(
        dir.path(),
        "new",
        &["FERRY_CUDA_EMU_PROC_ADDRESS", "FERRY_CUDA_EMU_DMABUF"],
    );
    let (status, message, f) = probe(host(Some(&new)));
    assert_eq!(status, sys::FERRY_OK, "{message}");
    let dmabuf = sys::FERRY_MEM_CUDA_DMABUF;
    assert_eq!(f.capabilities, Some((staged | peermem | dmabuf, 0)));
    assert_eq!(f.devices[0].3, staged | peermem | dmabuf);
    assert_eq!(f.devices[1].3, staged);
    assert!(f.missing[0]
        .1
        .starts_with("cuda:1 reports no CU_DEVICE_ATTRIBUTE_DMA_BUF"));
    let library = f.notes.iter().find(|(k, _)| k == "library").unwrap();
    assert!(
        library
            .1
            .ends_with("; 53 symbols through cuGetProcAddress_v2"),
        "{library:?}"
    );
    assert!(EmuView::open(&new).count("ferry_cuda_emu_proc_address_calls") >= 53);
    let lists = f.notes.iter().find(|(k, _)| k == "staging lists").unwrap();
    assert!(
        lists
            .1
            .starts_with("the copy kernel, one launch per list of small pieces")
            && lists.1.ends_with("by cuMemcpyBatchAsync"),
        "{lists:?}"
    );
    // Probe created no context.
    assert_eq!(EmuView::open(&new).count("ferry_cuda_emu_live_retains"), 0);
}

/// An initialised instance of the plugin through the C table.
struct Instance {
    table: &'static sys::ferry_device_plugin_v1_t,
    raw: *mut c_void,
}

fn call(what: &str, f: impl FnOnce(*mut sys::ferry_errbuf_t) -> i32) -> Result<(), (i32, String)> {
    let mut buf = [0 as c_char; 1024];
    let mut err = sys::ferry_errbuf_t {
        msg: buf.as_mut_ptr(),
        cap: buf.len(),
    };
    let status = f(&mut err);
    if status == sys::FERRY_OK {
        Ok(())
    } else {
        let message = text(buf.as_ptr());
        eprintln!("{what}: {status} {message}");
        Err((status, message))
    }
}

impl Instance {
    fn init(host: &'static sys::ferry_host_services_t) -> Instance {
        let table = table();
        let mut raw = std::ptr::null_mut();
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        call("init", |e| unsafe {
            table.init.unwrap()(host, &mut raw, e)
        })
        .unwrap();
        Instance { table, raw }
    }

    fn count(&self) -> u32 {
        let mut n = 0;
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        call("device_count", |e| unsafe {
            self.table.device_count.unwrap()(self.raw, &mut n, e)
        })
        .unwrap();
        n
    }

    fn info(&self, ordinal: i32) -> sys::ferry_device_info_t {
        // SAFETY: an all-zero ferry_device_info_t is valid.
        let mut out: sys::ferry_device_info_t = unsafe { std::mem::zeroed() };
        out.struct_size = std::mem::size_of::<sys::ferry_device_info_t>() as u32;
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        call("device_info", |e| unsafe {
            self.table.device_info.unwrap()(self.raw, ordinal, &mut out, e)
        })
        .unwrap();
        out
    }

    fn query(&self, addr: u64) -> sys::ferry_pointer_info_t {
        let mut out = sys::ferry_pointer_info_t {
            struct_size: std::mem::size_of::<sys::ferry_pointer_info_t>() as u32,
            ..Default::default()
        };
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        call("query_pointer", |e| unsafe {
            self.table.query_pointer.unwrap()(self.raw, addr, &mut out, e)
        })
        .unwrap();
        out
    }

    fn alloc_device(&self, ordinal: i32, len: u64) -> Result<u64, (i32, String)> {
        let mut p = 0;
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        call("alloc_device", |e| unsafe {
            self.table.alloc_device.unwrap()(self.raw, ordinal, len, &mut p, e)
        })?;
        Ok(p)
    }

    fn free_device(&self, p: u64) {
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        unsafe { self.table.free_device.unwrap()(self.raw, p) }
    }

    fn alloc_pinned(&self, len: u64) -> u64 {
        let mut p = std::ptr::null_mut();
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        call("alloc_pinned", |e| unsafe {
            self.table.alloc_pinned.unwrap()(self.raw, len, &mut p, e)
        })
        .unwrap();
        p as u64
    }

    fn free_pinned(&self, p: u64) {
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        unsafe { self.table.free_pinned.unwrap()(self.raw, p as *mut c_void) }
    }

    fn export(&self, addr: u64, len: u64) -> Result<(i32, u64), (i32, String)> {
        let (mut fd, mut offset) = (-1, 0);
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        call("export_dmabuf", |e| unsafe {
            self.table.export_dmabuf.unwrap()(self.raw, addr, len, &mut fd, &mut offset, e)
        })?;
        Ok((fd, offset))
    }

    fn stream(&self, ordinal: i32) -> *mut c_void {
        let mut s = std::ptr::null_mut();
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        call("stream_create", |e| unsafe {
            self.table.stream_create.unwrap()(self.raw, ordinal, &mut s, e)
        })
        .unwrap();
        s
    }

    fn copy(&self, s: *mut c_void, dst: u64, src: u64, len: u64) {
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        call("copy_async", |e| unsafe {
            self.table.copy_async.unwrap()(self.raw, s, dst, src, len, e)
        })
        .unwrap()
    }

    fn sync(&self, s: *mut c_void) {
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        call("stream_sync", |e| unsafe {
            self.table.stream_sync.unwrap()(self.raw, s, e)
        })
        .unwrap()
    }

    fn destroy(&self, s: *mut c_void) {
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        unsafe { self.table.stream_destroy.unwrap()(self.raw, s) }
    }

    fn fini(self) {
        // SAFETY: the instance from init, out-pointers to live locals and a
        // live error buffer, as plugin.h requires.
        unsafe { self.table.fini.unwrap()(self.raw) }
    }
}

// SAFETY: the plugin's instance is Send + Sync (the SDK requires it).
unsafe impl Send for Instance {}
// SAFETY: shared access only calls the plugin's table with its instance,
// which the SDK requires to be Sync.
unsafe impl Sync for Instance {}

#[test]
fn the_data_path_keeps_context_discipline_and_gives_everything_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = emulator(
        dir.path(),
        "full",
        &[
            "FERRY_CUDA_EMU_PROC_ADDRESS",
            "FERRY_CUDA_EMU_DMABUF",
            "FERRY_CUDA_EMU_POINTER_NEEDS_CTX=1",
        ],
    );
    let h = host(Some(&path));
    let inst = Instance::init(h);
    let emu = EmuView::open(&path);
    assert_eq!(
        emu.count("ferry_cuda_emu_live_retains"),
        0,
        "init retains no context"
    );

    assert_eq!(inst.count(), 2);
    let info = inst.info(1);
    assert_eq!(info.ordinal, 1);
    assert_eq!(text(info.name.as_ptr()), "Emulated GPU 1");
    assert_eq!(text(info.pci_bus_id.as_ptr()), "0000:ab:00.0");
    assert_eq!(
        (info.gpu_direct_rdma, info.dmabuf, info.dmabuf_export),
        (0, 0, 1)
    );
    assert_eq!(info.total_memory, 81 << 30);

    // Plain host memory and unknown addresses are HOST, not errors, even
    // before any context exists (this build wants one for pointer queries).
    let host_buf = vec![7u8; 4096];
    let p = inst.query(host_buf.as_ptr() as u64);
    assert_eq!((p.kind, p.ordinal), (sys::FERRY_PTR_HOST, -1));
    assert_eq!(inst.query(16).kind, sys::FERRY_PTR_HOST);
    assert!(logs(h)
        .iter()
        .any(|l| l.contains("asked for a current context")));

    // The application's own current context survives every call.
    emu.set_current(0);
    let app_ctx = emu.current_context();
    let dev = inst.alloc_device(1, 1 << 20).unwrap();
    assert_eq!(emu.current_context(), app_ctx);
    let d = inst.query(dev + 100);
    assert_eq!(
        (d.kind, d.ordinal, d.base, d.size),
        (sys::FERRY_PTR_DEVICE, 1, dev, 1 << 20)
    );
    emu.set_current(-1);

    let pinned = inst.alloc_pinned(1 << 16);
    let q = inst.query(pinned);
    assert_eq!((q.kind, q.ordinal), (sys::FERRY_PTR_HOST_PINNED, -1));

    // DMA-BUF: the range is widened to pages, the offset says where addr is.
    let (fd, offset) = inst.export(dev + 100, 1000).unwrap();
    assert!(fd >= 0);
    assert_eq!(offset, 100);
    // SAFETY: the plugin handed us this fd; we own and close it.
    unsafe { libc::close(fd) };
    let (status, message) = inst.export(host_buf.as_ptr() as u64, 64).unwrap_err();
    assert_eq!(status, sys::FERRY_ERR_INVALID_ARGUMENT);
    assert!(message.contains("is ordinary host memory"), "{message}");

    // Copies host -> device -> pinned through a stream of device 1, from
    // another thread than the one that allocated.
    std::thread::scope(|s| {
        s.spawn(|| {
            let stream = inst.stream(1);
            let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
            inst.copy(stream, dev, src.as_ptr() as u64, 4096);
            inst.copy(stream, pinned, dev, 4096);
            inst.sync(stream);
            // SAFETY: pinned holds 64 KiB; the copy above filled 4096 bytes.
            let back = unsafe { std::slice::from_raw_parts(pinned as *const u8, 4096) };
            assert_eq!(back, &src[..]);
            inst.destroy(stream);
            assert!(emu.current_context().is_null(), "thread left as found");
        });
    });

    // Errors carry the driver's name and words and a fitting code.
    let (status, message) = inst.alloc_device(0, 1 << 50).unwrap_err();
    assert_eq!(status, sys::FERRY_ERR_NO_MEMORY);
    assert_eq!(
        message,
        "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY: out of memory \
         (1125899906842624 bytes on cuda:0)"
    );
    let (status, _) = inst.alloc_device(7, 64).unwrap_err();
    assert_eq!(status, sys::FERRY_ERR_INVALID_ARGUMENT);

    // Freeing something twice is a warning, not a double free.
    inst.free_device(dev);
    inst.free_device(dev);
    assert!(logs(h).iter().any(|l| l.contains("already freed; ignored")));
    inst.free_pinned(pinned);

    // A stream outliving nothing, an allocation left behind: fini cleans up.
    let leaked = inst.alloc_device(0, 4096).unwrap();
    assert_ne!(leaked, 0);
    let stream = inst.stream(0);
    inst.destroy(stream);
    assert_eq!(emu.count("ferry_cuda_emu_live_retains"), 2);
    inst.fini();
    assert!(logs(h)
        .iter()
        .any(|l| l.contains("still live at fini; freed")));
    assert_eq!(emu.count("ferry_cuda_emu_live_allocations"), 0);
    assert_eq!(emu.count("ferry_cuda_emu_live_streams"), 0);
    assert_eq!(emu.count("ferry_cuda_emu_live_retains"), 0);
    assert_eq!(emu.count("ferry_cuda_emu_context_violations"), 0);
    assert!(emu.current_context().is_null());
}

#[test]
fn many_threads_share_one_instance() {
    let dir = tempfile::tempdir().unwrap();
    let path = emulator(dir.path(), "threads", &["FERRY_CUDA_EMU_PROC_ADDRESS"]);
    let inst = Instance::init(host(Some(&path)));
    let emu = EmuView::open(&path);
    std::thread::scope(|s| {
        for t in 0..8 {
            let inst = &inst;
            s.spawn(move || {
                let ordinal = t % 2;
                for round in 0..50u64 {
                    let dev = inst.alloc_device(ordinal, 8192).unwrap();
                    let q = inst.query(dev);
                    assert_eq!((q.kind, q.ordinal), (sys::FERRY_PTR_DEVICE, ordinal));
                    let stream = inst.stream(ordinal);
                    let src = vec![(t as u64 * 1000 + round) as u8; 8192];
                    let mut dst = vec![0u8; 8192];
                    inst.copy(stream, dev, src.as_ptr() as u64, 8192);
                    inst.copy(stream, dst.as_mut_ptr() as u64, dev, 8192);
                    inst.sync(stream);
                    assert_eq!(dst, src);
                    inst.destroy(stream);
                    inst.free_device(dev);
                }
            });
        }
    });
    // Each device's primary context was retained once, however many threads.
    assert_eq!(emu.count("ferry_cuda_emu_live_retains"), 2);
    inst.fini();
    assert_eq!(emu.count("ferry_cuda_emu_live_retains"), 0);
    assert_eq!(emu.count("ferry_cuda_emu_live_allocations"), 0);
    assert_eq!(emu.count("ferry_cuda_emu_context_violations"), 0);
}

#[test]
fn without_the_export_symbol_dmabuf_is_unsupported() {
    let dir = tempfile::tempdir().unwrap();
    let path = emulator(dir.path(), "noexport", &[]);
    let inst = Instance::init(host(Some(&path)));
    assert_eq!(inst.info(0).dmabuf_export, 0);
    let dev = inst.alloc_device(0, 1 << 16).unwrap();
    let (status, message) = inst.export(dev, 4096).unwrap_err();
    assert_eq!(status, sys::FERRY_ERR_UNSUPPORTED);
    assert_eq!(message, "this driver cannot export DMA-BUF");
    inst.free_device(dev);
    inst.fini();
}

mod lists;
