//! Registration: what memory a buffer is (host or a device's), and its
//! registration with every transport that can move it; device memory by
//! the GPU-direct ladder (DMA-BUF, then nvidia-peermem, else staged),
//! decided per GPU at start and proven by a trial registration.

use super::devices::Gpu;
use super::shared::Shared;
use crate::device::PointerKind;
use crate::error::{Error, ErrorCode, Result};
use crate::location::{host_location, Location};
use crate::memory::{LocalBuffer, TransportRegistration, Visibility};
use crate::topology::Topology;
use crate::transport::{RegionSpec, Transport};
use ferry_plugins_abi::sys;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Shared {
    pub(crate) fn register_memory(
        &self,
        addr: u64,
        len: u64,
        location: Option<Location>,
    ) -> Result<()> {
        self.register(addr, len, location, Visibility::Published)
            .map(|_| ())
    }

    /// What memory `[addr, addr + len)` is: asks every device plugin, and
    /// checks a location the caller gave against what the driver says.
    fn classify(
        &self,
        addr: u64,
        len: u64,
        given: Option<Location>,
    ) -> Result<(Location, u64, Option<usize>)> {
        for (i, d) in self.devices.iter().enumerate() {
            let (kind, base, size) = d.query_pointer(addr)?;
            let ordinal = match kind {
                PointerKind::Device(o) => o,
                // Pinned and managed memory are host-addressable: any host
                // transport can move them.
                PointerKind::Host | PointerKind::HostPinned | PointerKind::Managed(_) => continue,
            };
            if size > 0 && addr.saturating_add(len) > base.saturating_add(size) {
                return Err(Error::new(
                    ErrorCode::OutOfBounds,
                    format!(
                        "[{addr:#x}, +{len}) runs past the end of its {} allocation [{base:#x}, +{size})",
                        d.name
                    ),
                ));
            }
            let location = match d.name.as_str() {
                "rocm" => Location::Rocm(ordinal),
                _ => Location::Cuda(ordinal),
            };
            if let Some(g) = given {
                if g != location {
                    return Err(Error::new(
                        ErrorCode::InvalidArgument,
                        format!("the location given is {g}, but the {} driver says the memory is on {location}", d.name),
                    ));
                }
            }
            return Ok((location, sys::FERRY_MEM_CUDA_STAGED, Some(i)));
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

    /// Registers a buffer with every transport that can move its memory.
    pub(crate) fn register(
        &self,
        addr: u64,
        len: u64,
        location: Option<Location>,
        visibility: Visibility,
    ) -> Result<Arc<LocalBuffer>> {
        if addr == 0 || len == 0 {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!("cannot register [{addr:#x}, +{len}): null address or zero length"),
            ));
        }
        self.memory.check_free(addr, len)?;
        let (location, mem_kind, device) = self.classify(addr, len, location)?;
        let numa = match location {
            Location::Cpu(n) => Some(n),
            _ => None,
        };
        let location_s = location.to_string();
        let local_only = visibility == Visibility::LocalOnly;
        let mut registrations = Vec::new();
        for (i, t) in self.transports.iter().enumerate() {
            if let Some(plugin) = device {
                let spec = RegionSpec {
                    addr,
                    len,
                    mem_kind: 0,
                    location: &location_s,
                    numa_node: None,
                    device_ordinal: match location {
                        Location::Cuda(o) | Location::Rocm(o) => Some(o),
                        Location::Cpu(_) => None,
                    },
                    dmabuf: None,
                    local_only,
                };
                if let Some(r) = self.register_device(i, t, plugin, &spec) {
                    registrations.push(r);
                }
                continue;
            }
            if t.mem_kinds & mem_kind == 0 {
                continue;
            }
            let spec = RegionSpec {
                addr,
                len,
                mem_kind,
                location: &location_s,
                numa_node: numa,
                device_ordinal: None,
                dmabuf: None,
                local_only,
            };
            match t.register(&spec) {
                Ok((handle, key)) => registrations.push(TransportRegistration {
                    transport: i,
                    handle,
                    key,
                    mem_kind,
                }),
                Err(e) => log::warn!(
                    "{}: cannot register [{addr:#x}, +{len}) ({location_s}): {e}",
                    t.name
                ),
            }
        }
        // Device memory that no transport reaches directly is staged through
        // host memory; host memory must be reachable by some transport.
        if registrations.is_empty() && device.is_none() && !self.transports.is_empty() {
            return Err(Error::new(
                ErrorCode::Unsupported,
                format!("no transport can register {location_s} memory at {addr:#x}"),
            ));
        }
        log::debug!("registered [{addr:#x}, +{len}) at {location_s} ({visibility:?})");
        let published = visibility == Visibility::Published;
        let buffer = Arc::new(LocalBuffer {
            addr,
            len,
            location,
            mem_kind,
            device,
            visibility,
            registrations,
            inflight: Default::default(),
        });
        self.memory.insert(buffer.clone());
        if published {
            self.publish();
        }
        Ok(buffer)
    }

    /// Registers device memory directly with transport `t` (an RDMA NIC
    /// reading and writing GPU memory), by the methods the GPU-direct
    /// decision allows, best first: DMA-BUF, then nvidia-peermem. The trial
    /// registration is the ground truth: a method that fails falls back one
    /// step (and is not tried again for this device), and `None` means the
    /// memory is staged through host memory for this transport.
    fn register_device(
        &self,
        i: usize,
        t: &Transport,
        plugin: usize,
        spec: &RegionSpec<'_>,
    ) -> Option<TransportRegistration> {
        use crate::gpudirect::Method;
        let direct = sys::FERRY_MEM_CUDA_DMABUF | sys::FERRY_MEM_CUDA_PEERMEM;
        if t.mem_kinds & direct == 0 {
            return None;
        }
        let ladder = self.direct_methods(spec.location);
        let failed_before: Vec<Method> = self
            .direct_failures
            .lock()
            .iter()
            .filter(|(loc, ti, _)| loc == spec.location && *ti == i)
            .map(|(_, _, m)| *m)
            .collect();
        let mut first_try = true;
        for (n, method) in ladder.iter().enumerate() {
            let bit = match method {
                Method::DmaBuf => sys::FERRY_MEM_CUDA_DMABUF,
                Method::PeerMem => sys::FERRY_MEM_CUDA_PEERMEM,
                Method::Staged => continue,
            };
            let next = ladder
                .get(n + 1..)
                .unwrap_or_default()
                .iter()
                .find(|m| !failed_before.contains(m))
                .copied()
                .unwrap_or(Method::Staged);
            if failed_before.contains(method) {
                continue;
            }
            if t.mem_kinds & bit == 0 {
                first_try = false;
                let key = (spec.location.to_string(), i, *method);
                if self.direct_logged.lock().insert(key) {
                    log::info!(
                        "{}: does not register {} memory by {} on this host (`ferry info` says \
                         why); trying {}",
                        t.name,
                        spec.location,
                        method.as_str(),
                        next.as_str()
                    );
                }
                continue;
            }
            let exported = if *method == Method::DmaBuf {
                let why = match self.devices[plugin].export_dmabuf(spec.addr, spec.len) {
                    Ok((fd, offset)) if fd >= 0 => {
                        use std::os::fd::FromRawFd;
                        // SAFETY: the device plugin hands us a fresh fd we own.
                        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
                        Ok((fd, offset))
                    }
                    Ok(_) => Err("the device plugin exported no fd".to_string()),
                    Err(e) => Err(e.message),
                };
                match why {
                    Ok(pair) => Some(pair),
                    Err(why) => {
                        first_try = false;
                        log::info!(
                            "{}: cannot export {} memory at {:#x} as DMA-BUF ({why}); falling \
                             back to {}",
                            t.name,
                            spec.location,
                            spec.addr,
                            next.as_str()
                        );
                        continue;
                    }
                }
            } else {
                None
            };
            let attempt = RegionSpec {
                mem_kind: bit,
                dmabuf: exported.as_ref().map(|(fd, off)| {
                    use std::os::fd::AsRawFd;
                    (fd.as_raw_fd(), *off)
                }),
                ..*spec
            };
            // The fd is closed when `exported` drops: the NIC's registration
            // holds its own reference to the buffer.
            match t.register(&attempt) {
                Ok((handle, key)) => {
                    let newly =
                        self.direct_logged
                            .lock()
                            .insert((spec.location.to_string(), i, *method));
                    if newly {
                        log::info!(
                            "{}: {} memory is registered by {} (trial registration succeeded{})",
                            t.name,
                            spec.location,
                            method.as_str(),
                            if first_try {
                                String::new()
                            } else {
                                "; better methods failed, see above".to_string()
                            }
                        );
                    }
                    return Some(TransportRegistration {
                        transport: i,
                        handle,
                        key,
                        mem_kind: bit,
                    });
                }
                Err(e) => {
                    first_try = false;
                    log::info!(
                        "{}: registering {} memory by {} failed ({}); falling back to {}",
                        t.name,
                        spec.location,
                        method.as_str(),
                        e.message,
                        next.as_str()
                    );
                    self.direct_failures
                        .lock()
                        .push((spec.location.to_string(), i, *method));
                }
            }
        }
        None
    }

    /// The direct registration methods the GPU-direct decision allows for
    /// device memory at `location`, best first.
    fn direct_methods(&self, location: &str) -> Vec<crate::gpudirect::Method> {
        use crate::gpudirect::{Method, Policy};
        let Some(d) = self.gpu_direct.get(location) else {
            return Vec::new();
        };
        match d.method {
            Method::DmaBuf => {
                let mut m = vec![Method::DmaBuf];
                if self.gpu_direct_host.peermem.is_some()
                    && self.gpu_direct_policy != Policy::DmaBuf
                {
                    m.push(Method::PeerMem);
                }
                m
            }
            Method::PeerMem => vec![Method::PeerMem],
            Method::Staged => Vec::new(),
        }
    }

    pub(crate) fn unregister_memory(&self, addr: u64) -> Result<()> {
        let buffer = self.memory.remove(addr).ok_or_else(|| {
            Error::new(
                ErrorCode::NotFound,
                format!("no buffer registered at {addr:#x} (unregister takes the start address)"),
            )
        })?;
        // Let local transfers that use the buffer finish: every transport
        // completes or fails a request within its timeout.
        let deadline = Instant::now() + self.config.timeout * 2 + Duration::from_secs(1);
        while buffer.inflight.load(Ordering::SeqCst) != 0 {
            if Instant::now() > deadline {
                let n = buffer.inflight.load(Ordering::SeqCst);
                self.memory.insert(buffer);
                return Err(Error::new(
                    ErrorCode::Busy,
                    format!("{n} transfers using the buffer at {addr:#x} are still in flight"),
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let mut first_error = None;
        for r in &buffer.registrations {
            if let Err(e) = self.transports[r.transport].unregister(r.handle) {
                log::warn!("unregistering {addr:#x}: {e}");
                first_error.get_or_insert(e);
            }
        }
        if buffer.visibility == Visibility::Published {
            self.publish();
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// How each GPU's memory would be registered for RDMA (DESIGN.md's tiers,
/// judged against the GPU's closest RDMA NIC), logged once per GPU.
pub(crate) fn gpu_direct_decisions(
    gpus: &[Gpu],
    topology: &Topology,
    policy: crate::gpudirect::Policy,
    host: &crate::gpudirect::HostFacts,
) -> HashMap<String, crate::gpudirect::Decision> {
    use crate::gpudirect::{decide, GpuFacts, PairFacts};
    let mut out = HashMap::new();
    for g in gpus {
        let location = g.location.to_string();
        let topo_name = g.topology_name.clone().unwrap_or_else(|| location.clone());
        let pair = topology
            .preferred_nics(&topo_name)
            .unwrap_or_default()
            .iter()
            .find(|r| {
                r.usable
                    && topology
                        .nic(&r.name)
                        .is_some_and(|n| n.kind == crate::topology::NicKind::Rdma)
            })
            .map(|r| PairFacts {
                nic: r.name.clone(),
                class: r.class,
                nic_dmabuf: None,
            });
        let facts = GpuFacts {
            gpu_direct_rdma: g.info.gpu_direct_rdma,
            dmabuf: g.info.dmabuf,
            dmabuf_export: g.info.dmabuf_export,
        };
        let d = decide(policy, &facts, host, pair.as_ref());
        log::info!("{location} memory for RDMA: {}", d.explain());
        out.insert(location, d);
    }
    out
}
