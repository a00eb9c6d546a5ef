//! Test-only device plugin that pretends to be "cuda" on machines without a
//! GPU. Its "device memory" is a memfd mapped twice: the address handed out
//! is mapped PROT_NONE, exactly as inaccessible to the CPU as real device
//! memory, so any code that touches a device pointer directly crashes the
//! test; the plugin's own copies go through a second, writable mapping.
//! DMA-BUF export hands out a dup of the memfd, which the verbs emulator can
//! map like a real dma-buf.
//!
//! Behaviour is steered by FERRY_FAKEGPU_DEVICES (default 1), and
//! FERRY_FAKEGPU_PCI (comma list of PCI bus ids, default 0000:1b:00.0,...);
//! FERRY_FAKEGPU_DEVICES=sysfs takes the GPUs of the (fake) sysfs tree
//! under FERRY_SYSFS_ROOT instead, NVIDIA display controllers in PCI bus
//! order, so the machine's fixture alone says which GPUs a host has (the
//! cluster simulation gives every host the same settings);
//! FERRY_FAKEGPU_GDR=0 and FERRY_FAKEGPU_DMABUF=0 make the GPUs report no
//! GPUDirect RDMA (attribute 116) or no DMA-BUF (attribute 124);
//! FERRY_FAKEGPU_DMABUF_FD=pipe exports a pipe instead of a dma-buf (which
//! an RDMA NIC refuses).

use ferry_plugins_abi::sdk::{
    DeviceInfo, DeviceInstance, DevicePlugin, Host, PluginError, PluginResult, PointerInfo,
    PointerKind, ProbeDevice, ProbeReport,
};
use ferry_plugins_abi::{sys, ErrorCode};
use std::collections::BTreeMap;
use std::ffi::CStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

pub struct FakeGpu;

/// What device_info and probe say of fake GPU `ordinal`.
fn info(ordinal: u32) -> DeviceInfo {
    DeviceInfo {
        ordinal,
        name: "Fake GPU".into(),
        pci_bus_id: pci(ordinal),
        uuid: format!("GPU-fake-{ordinal}"),
        total_memory: 1 << 34,
        gpu_direct_rdma: Some(attribute("FERRY_FAKEGPU_GDR")),
        dmabuf: Some(attribute("FERRY_FAKEGPU_DMABUF")),
        dmabuf_export: attribute("FERRY_FAKEGPU_DMABUF"),
    }
}

/// A device attribute the environment may switch off (default on).
fn attribute(var: &str) -> bool {
    std::env::var(var).map_or(true, |v| v != "0")
}

fn from_sysfs() -> bool {
    std::env::var("FERRY_FAKEGPU_DEVICES").is_ok_and(|v| v == "sysfs")
}

fn devices() -> u32 {
    if from_sysfs() {
        return sysfs_gpus().len() as u32;
    }
    std::env::var("FERRY_FAKEGPU_DEVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

fn pci(ordinal: u32) -> String {
    if from_sysfs() {
        return sysfs_gpus()
            .get(ordinal as usize)
            .cloned()
            .unwrap_or_default();
    }
    std::env::var("FERRY_FAKEGPU_PCI")
        .ok()
        .and_then(|v| v.split(',').nth(ordinal as usize).map(str::to_string))
        .unwrap_or_else(|| format!("0000:{:02x}:00.0", 0x1b + ordinal))
}

fn sysfs_root() -> String {
    std::env::var("FERRY_SYSFS_ROOT").unwrap_or_else(|_| "/sys".into())
}

/// PCI bus ids of the NVIDIA display controllers (vendor 0x10de, class
/// 0x03xxxx: NVSwitches are bridges) under FERRY_SYSFS_ROOT, in bus order,
/// read once.
fn sysfs_gpus() -> &'static [String] {
    static GPUS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    GPUS.get_or_init(|| {
        let dir = format!("{}/bus/pci/devices", sysfs_root());
        let read = |bdf: &str, file: &str| {
            std::fs::read_to_string(format!("{dir}/{bdf}/{file}"))
                .map(|s| s.trim().to_lowercase())
                .unwrap_or_default()
        };
        let mut gpus: Vec<String> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|bdf| read(bdf, "vendor") == "0x10de" && read(bdf, "class").starts_with("0x03"))
            .collect();
        gpus.sort();
        gpus
    })
}

fn err(msg: impl Into<String>) -> PluginError {
    PluginError::new(ErrorCode::Plugin, msg)
}

impl DevicePlugin for FakeGpu {
    const NAME: &'static CStr = c"cuda";
    const VERSION: &'static CStr = c"0.0.0-fake";
    const DESCRIPTION: &'static CStr = c"TEST ONLY: fake CUDA devices backed by host memory";
    type Instance = Instance;

    fn probe(_host: &Host<'_>, report: &mut ProbeReport<'_>) -> PluginResult<()> {
        if from_sysfs() && sysfs_gpus().is_empty() {
            return Err(PluginError::unavailable(format!(
                "no NVIDIA GPU in the sysfs tree at {}",
                sysfs_root()
            )));
        }
        report.set_capabilities(sys::FERRY_MEM_CUDA_STAGED | sys::FERRY_MEM_CUDA_DMABUF, 0);
        for i in 0..devices() {
            let name = format!("cuda:{i}");
            let p = pci(i);
            let gpu = info(i);
            report.add_device(&ProbeDevice {
                name: &name,
                pci_bus_id: Some(&p),
                detail: Some("fake GPU for tests"),
                mem_kinds: sys::FERRY_MEM_CUDA_STAGED,
                gpu: Some(&gpu),
                ..Default::default()
            });
        }
        Ok(())
    }

    fn init(_host: Host<'static>) -> PluginResult<Instance> {
        // For tests that check who starts the plugin (`ferry info` must not).
        if let Ok(mark) = std::env::var("FERRY_FAKEGPU_INIT_MARK") {
            let _ = std::fs::write(mark, b"started");
        }
        Ok(Instance::default())
    }
}

ferry_plugins_abi::export_device_plugin!(FakeGpu);

struct Alloc {
    ordinal: u32,
    len: u64,
    /// Where the CPU may touch it (the plugin's own view).
    shadow: u64,
    fd: OwnedFd,
}

#[derive(Default)]
pub struct Instance {
    /// Device allocations by their PROT_NONE address.
    device: Mutex<BTreeMap<u64, Alloc>>,
    pinned: Mutex<BTreeMap<u64, u64>>,
}

fn map(fd: i32, len: u64, prot: i32) -> PluginResult<u64> {
    // SAFETY: a shared mapping of our own memfd; the result is checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            prot,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(err(format!("mmap: {}", std::io::Error::last_os_error())));
    }
    Ok(p as u64)
}

impl Instance {
    /// The CPU-visible address of device memory at `addr`, if it is ours.
    fn shadow_of(&self, addr: u64, len: u64) -> Option<u64> {
        let map = self.device.lock().unwrap_or_else(|p| p.into_inner());
        let (base, a) = map.range(..=addr).next_back()?;
        (addr + len <= base + a.len).then(|| a.shadow + (addr - base))
    }
}

impl DeviceInstance for Instance {
    type Stream = ();

    fn device_count(&self) -> PluginResult<u32> {
        Ok(devices())
    }

    fn device_info(&self, ordinal: u32) -> PluginResult<DeviceInfo> {
        if ordinal >= devices() {
            return Err(PluginError::new(ErrorCode::NotFound, "no such fake GPU"));
        }
        Ok(info(ordinal))
    }

    fn query_pointer(&self, addr: u64) -> PluginResult<PointerInfo> {
        let map = self.device.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((base, a)) = map.range(..=addr).next_back() {
            if addr < base + a.len {
                return Ok(PointerInfo {
                    kind: PointerKind::Device,
                    ordinal: Some(a.ordinal),
                    base: *base,
                    size: a.len,
                });
            }
        }
        drop(map);
        let pinned = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((base, len)) = pinned.range(..=addr).next_back() {
            if addr < base + len {
                return Ok(PointerInfo {
                    kind: PointerKind::HostPinned,
                    ordinal: None,
                    base: *base,
                    size: *len,
                });
            }
        }
        Ok(PointerInfo::HOST)
    }

    fn export_dmabuf(&self, addr: u64, len: u64) -> Option<PluginResult<(i32, u64)>> {
        let map = self.device.lock().unwrap_or_else(|p| p.into_inner());
        let found = map
            .range(..=addr)
            .next_back()
            .filter(|(b, a)| addr + len <= *b + a.len);
        Some(match found {
            // An fd that is no dma-buf, for tests of a refused registration.
            Some((base, _))
                if std::env::var("FERRY_FAKEGPU_DMABUF_FD").is_ok_and(|v| v == "pipe") =>
            {
                let mut fds = [0i32; 2];
                // SAFETY: fds has room for the two descriptors pipe writes.
                if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
                    return Some(Err(err("pipe2 failed")));
                }
                // SAFETY: closing the write end we own; the read end goes out.
                unsafe { libc::close(fds[1]) };
                Ok((fds[0], addr - base))
            }
            // SAFETY: dup of our own valid fd; the caller owns the copy.
            Some((base, a)) => Ok((unsafe { libc::dup(a.fd.as_raw_fd()) }, addr - base)),
            None => Err(PluginError::new(
                ErrorCode::InvalidArgument,
                "not fake device memory",
            )),
        })
    }

    fn alloc_pinned(&self, len: u64) -> PluginResult<u64> {
        // SAFETY: an anonymous private mapping; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(err("cannot allocate pinned memory"));
        }
        let p = p as u64;
        self.pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(p, len);
        Ok(p)
    }

    fn free_pinned(&self, ptr: u64) {
        if let Some(len) = self
            .pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ptr)
        {
            // SAFETY: unmapping a mapping alloc_pinned made.
            unsafe { libc::munmap(ptr as *mut libc::c_void, len as usize) };
        }
    }

    fn alloc_device(&self, ordinal: u32, len: u64) -> PluginResult<u64> {
        // SAFETY: a new memfd; checked.
        let fd = unsafe { libc::memfd_create(c"fakegpu".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(err("memfd_create failed"));
        }
        // SAFETY: fd is ours.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sizing our memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(err("ftruncate failed"));
        }
        let device = map(fd.as_raw_fd(), len, libc::PROT_NONE)?;
        let shadow = map(fd.as_raw_fd(), len, libc::PROT_READ | libc::PROT_WRITE)?;
        self.device
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                device,
                Alloc {
                    ordinal,
                    len,
                    shadow,
                    fd,
                },
            );
        Ok(device)
    }

    fn free_device(&self, ptr: u64) {
        if let Some(a) = self
            .device
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ptr)
        {
            // SAFETY: unmapping both views alloc_device made.
            unsafe {
                libc::munmap(ptr as *mut libc::c_void, a.len as usize);
                libc::munmap(a.shadow as *mut libc::c_void, a.len as usize);
            }
        }
    }

    fn stream_create(&self, _ordinal: u32) -> PluginResult<()> {
        Ok(())
    }

    fn copy_async(&self, _stream: &(), dst: u64, src: u64, len: u64) -> PluginResult<()> {
        let d = self.shadow_of(dst, len).unwrap_or(dst);
        let s = self.shadow_of(src, len).unwrap_or(src);
        // SAFETY: device addresses were translated to their writable shadow;
        // host addresses are the caller's (the engine copies only within
        // buffers it registered).
        unsafe { std::ptr::copy(s as *const u8, d as *mut u8, len as usize) };
        Ok(())
    }

    fn stream_sync(&self, _stream: &()) -> PluginResult<()> {
        Ok(())
    }

    fn pin_host(&self, addr: u64, len: u64) -> Option<PluginResult<()>> {
        self.pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(addr, len);
        Some(Ok(()))
    }

    fn unpin_host(&self, addr: u64) {
        self.pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&addr);
    }
}
