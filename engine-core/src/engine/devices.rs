//! Devices (GPUs) as the engine knows them: each device plugin's devices,
//! placed in the topology by PCI bus id; what memory an address is; and
//! device and pinned memory handed out for tools and tests.

use crate::device::{Device, PointerKind};
use crate::error::{Error, ErrorCode, Result};
use crate::gpu::{place_gpu, Gpu};
use crate::location::{host_location, Location};
use ferry_plugins_abi::sys;
use ferry_topology::Topology;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// The device plugins that started, their devices, and the device memory
/// handed out through them.
pub(crate) struct Devices {
    /// Device plugin instances (cuda, ...), in load order.
    pub(crate) plugins: Vec<Arc<Device>>,
    /// Their devices, in the drivers' numbering.
    pub(crate) gpus: Vec<Gpu>,
    /// Device memory from `allocate`, by address: its device plugin.
    allocations: Mutex<HashMap<u64, usize>>,
}

impl Devices {
    /// The devices of `plugins`, placed in `topology`.
    pub(crate) fn new(plugins: Vec<Arc<Device>>, topology: &Topology) -> Devices {
        let gpus = discover_gpus(&plugins, topology);
        Devices {
            plugins,
            gpus,
            allocations: Mutex::new(HashMap::new()),
        }
    }

    /// The first device plugin, which serves pinned host memory.
    pub(crate) fn first(&self) -> Option<&Arc<Device>> {
        self.plugins.first()
    }

    /// The device plugin and ordinal serving a device location.
    pub(crate) fn device_of(&self, location: Location) -> Result<(usize, u32)> {
        self.gpus
            .iter()
            .find(|g| g.location == location)
            .map(|g| {
                let ordinal = match g.location {
                    Location::Cuda(o) | Location::Rocm(o) => o,
                    Location::Cpu(n) => n,
                };
                (g.plugin, ordinal)
            })
            .ok_or_else(|| {
                Error::new(
                    ErrorCode::NotFound,
                    format!("no device {location} (`ferry info` lists the devices)"),
                )
            })
    }

    /// What memory `[addr, addr + len)` is: asks every device plugin, and
    /// checks a location the caller gave against what the driver says.
    pub(crate) fn classify(
        &self,
        addr: u64,
        len: u64,
        given: Option<Location>,
    ) -> Result<(Location, u64, Option<usize>)> {
        for (i, d) in self.plugins.iter().enumerate() {
            let (kind, base, size) = d.query_pointer(addr)?;
            let ordinal = match kind {
                PointerKind::Device(o) => o,
                // Pinned and managed memory are host-addressable: any host
                // transport can move them.
                PointerKind::Host | PointerKind::HostPinned | PointerKind::Managed(_) => continue,
            };
            if size > 0
                && addr.saturating_add(len) > base.saturating_add(size)
                && !self.contiguous_device(d, ordinal, base + size, addr.saturating_add(len))?
            {
                return Err(Error::new(
                    ErrorCode::OutOfBounds,
                    format!(
                        "[{addr:#x}, +{len}) runs past the end of its {} allocation [{base:#x}, +{size})",
                        d.name
                    ),
                ));
            }
            let location = self
                .gpus
                .iter()
                .find(|g| g.plugin == i && g.info.ordinal == ordinal)
                .map_or(Location::Cuda(ordinal), |g| g.location);
            if let Some(g) = given {
                if g != location {
                    return Err(Error::new(
                        ErrorCode::InvalidArgument,
                        format!("the location given is {g}, but the {} driver says the memory is on {location}", d.name),
                    ));
                }
            }
            // Device memory has no host memory kind: it moves as each
            // transport registered it, or staged (`LocalBuffer::mem_kind`).
            return Ok((location, 0, Some(i)));
        }
        match given {
            Some(Location::Cpu(n)) => Ok((Location::Cpu(n), sys::FERRY_MEM_HOST, None)),
            Some(other) => Err(Error::new(
                ErrorCode::Unsupported,
                format!(
                    "registering {other} memory needs a device plugin that owns it, and none does \
                     (`ferry info` shows the device plugins)"
                ),
            )),
            None => Ok((host_location(addr), sys::FERRY_MEM_HOST, None)),
        }
    }

    /// Whether `[from, to)` is device memory of `ordinal` in allocations
    /// that follow one another with no gap: VMM memory is mapped in chunks
    /// (PyTorch's expandable segments), each its own allocation to the
    /// driver, and one tensor may span several.
    fn contiguous_device(&self, d: &Device, ordinal: u32, from: u64, to: u64) -> Result<bool> {
        let mut at = from;
        while at < to {
            match d.query_pointer(at)? {
                (PointerKind::Device(o), base, size) if o == ordinal && base == at && size > 0 => {
                    at = base.saturating_add(size);
                }
                _ => return Ok(false),
            }
        }
        Ok(true)
    }

    /// Allocates device memory on `location` (e.g. cuda:0) through its device
    /// plugin; register it to move it. For tools and tests: applications
    /// normally bring their own (framework) allocations.
    pub(crate) fn allocate(&self, location: Location, len: u64) -> Result<u64> {
        let (plugin, ordinal) = self.device_of(location)?;
        let addr = self.plugins[plugin].alloc_device(ordinal, len)?;
        self.allocations.lock().insert(addr, plugin);
        Ok(addr)
    }

    /// Frees memory from [`Devices::allocate`] (unregister it first).
    pub(crate) fn free(&self, addr: u64) -> Result<()> {
        let plugin = self.allocations.lock().remove(&addr).ok_or_else(|| {
            Error::new(
                ErrorCode::NotFound,
                format!("{addr:#x} was not returned by allocate_device"),
            )
        })?;
        self.plugins[plugin].free_device(addr);
        Ok(())
    }

    /// A DMA-BUF fd for `[addr, addr + len)` of device memory (for RDMA
    /// registration), and `addr`'s offset inside the exported range.
    pub(crate) fn export_dmabuf(&self, addr: u64, len: u64) -> Result<(std::os::fd::OwnedFd, u64)> {
        use std::os::fd::FromRawFd;
        for d in &self.plugins {
            if let Ok((PointerKind::Device(_), _, _)) = d.query_pointer(addr) {
                let (fd, offset) = d.export_dmabuf(addr, len)?;
                if fd < 0 {
                    return Err(Error::new(
                        ErrorCode::Plugin,
                        format!("{}: exported no fd", d.name),
                    ));
                }
                // SAFETY: the plugin hands ownership of a fresh fd to us.
                return Ok((unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }, offset));
            }
        }
        Err(Error::new(
            ErrorCode::InvalidArgument,
            format!("{addr:#x} is not device memory of any device plugin"),
        ))
    }

    /// Host memory the first device copies to and from fastest (pinned);
    /// free it with [`Devices::free_pinned`].
    pub(crate) fn allocate_pinned(&self, len: u64) -> Result<u64> {
        let d = self
            .plugins
            .first()
            .ok_or_else(|| Error::new(ErrorCode::Unsupported, "no device plugin is loaded"))?;
        d.alloc_pinned(len)
    }

    pub(crate) fn free_pinned(&self, addr: u64) {
        if let Some(d) = self.plugins.first() {
            d.free_pinned(addr);
        }
    }

    /// Queues `(dst, src, len)` copies on one stream of device `location`
    /// and waits for all of them: for measuring copy bandwidth.
    ///
    /// # Safety
    /// Every range must be valid memory of this process.
    pub(crate) unsafe fn copy_batch(
        &self,
        location: Location,
        copies: &[(u64, u64, u64)],
    ) -> Result<()> {
        let (plugin, ordinal) = self.device_of(location)?;
        let mut stream = self.plugins[plugin].stream(ordinal)?;
        for &(dst, src, len) in copies {
            stream.copy(dst, src, len)?;
        }
        stream.sync()
    }

    /// Copies `len` bytes from `src` to `dst`, either of which may be device
    /// memory (through its device plugin), and waits for the copy.
    ///
    /// # Safety
    /// Both ranges must be valid memory of this process for `len` bytes, and
    /// no transfer may be writing `dst` meanwhile.
    pub(crate) unsafe fn copy_memory(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        for d in &self.plugins {
            // A failed query is an error, never "host": a CPU copy of
            // device memory would crash the process.
            let on_device = |a: u64| -> Result<bool> {
                d.query_pointer(a)
                    .map(|(k, _, _)| matches!(k, PointerKind::Device(_)))
                    .map_err(|e| {
                        Error::new(
                            e.code,
                            format!("cannot tell whether {a:#x} is device memory: {e}"),
                        )
                    })
            };
            if on_device(dst)? || on_device(src)? {
                let mut stream = d.stream(0)?;
                stream.copy(dst, src, len)?;
                return stream.sync();
            }
        }
        // SAFETY: every loaded device plugin's query_pointer (above) answered, and none called
        // either address device memory (a failed query returned an error), so both are host memory,
        // and the `# Safety` section makes `src` readable and `dst` writable for `len` bytes
        // with no transfer writing `dst` meanwhile; u8 needs no alignment, `copy` allows overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
        Ok(())
    }
}

/// Every device the started device plugins report, placed ([`place_gpu`]).
fn discover_gpus(devices: &[Arc<Device>], topology: &Topology) -> Vec<Gpu> {
    let mut gpus = Vec::new();
    for (plugin, d) in devices.iter().enumerate() {
        let count = match d.device_count() {
            Ok(n) => n,
            Err(e) => {
                log::warn!("{}: cannot count devices: {e}", d.name);
                continue;
            }
        };
        for ordinal in 0..count {
            let info = match d.device_info(ordinal) {
                Ok(i) => i,
                Err(e) => {
                    log::warn!("{}: device {ordinal}: {e}", d.name);
                    continue;
                }
            };
            let gpu = place_gpu(plugin, info, topology);
            log::info!(
                "{} is {} at PCI {}{}",
                gpu.location,
                gpu.info.name,
                gpu.info.pci_bus_id,
                match &gpu.topology_name {
                    Some(t) if *t != gpu.location.to_string() =>
                        format!(" (the topology's {t}: the driver's numbering wins)"),
                    Some(_) => String::new(),
                    None => " (not found in the sysfs PCI tree)".to_string(),
                }
            );
            gpus.push(gpu);
        }
    }
    gpus
}
