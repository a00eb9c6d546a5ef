//! Registration: local memory registered with every transport that can
//! move it (device memory by the GPU-direct ladder, or not at all when it
//! is staged), unregistered once nothing in flight uses it; and memory the
//! engine allocates for the application, registered on allocation.
//!
//! Reaches in Shared: `allocations`, `config`, `devices`, `gpu_direct`, `memory`, `transports`.

use super::allocations::Allocation;
use super::shared::Shared;
use crate::error::{Error, ErrorCode, Result};
use crate::location::Location;
use crate::memory::{LocalBuffer, TransportRegistration, Visibility};
use crate::transport::RegionSpec;
use std::os::fd::AsRawFd;
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
        let (location, mem_kind, device) = self.devices.classify(addr, len, location)?;
        let numa = match location {
            Location::Cpu(n) => Some(n),
            _ => None,
        };
        let location_s = location.to_string();
        let local_only = visibility == Visibility::LocalOnly;
        // Host memory the engine allocated: the file that holds it, for
        // transports that let same-host peers map it.
        let share = match device {
            None => self
                .allocations
                .lock()
                .values()
                .find_map(|a| a.share(addr, len)),
            Some(_) => None,
        };
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
                    share: None,
                };
                // Same-host peers first: a copy-engine transport shares the
                // memory itself; RDMA NICs register it by the GPU-direct ladder.
                let direct = self.gpu_direct.register_ipc(i, t, &spec).or_else(|| {
                    self.gpu_direct
                        .register(i, t, &self.devices.plugins[plugin], &spec)
                });
                if let Some(r) = direct {
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
                share: share.as_ref().map(|(fd, off)| (fd.as_raw_fd(), *off)),
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

    pub(crate) fn allocate_memory(&self, len: u64, numa_node: Option<u32>) -> Result<u64> {
        self.allocate(len, numa_node, Visibility::Published)
    }

    /// Allocates `len` bytes and registers them with `visibility`.
    pub(crate) fn allocate(
        &self,
        len: u64,
        numa_node: Option<u32>,
        visibility: Visibility,
    ) -> Result<u64> {
        let (addr, owner) =
            Allocation::obtain(&self.transports, len, numa_node, self.config.hugepages)?;
        let location = numa_node.map(Location::Cpu);
        // Known before it is registered, so registration finds its file.
        self.allocations.lock().insert(addr, owner);
        if let Err(e) = self.register(addr, len, location, visibility) {
            if let Some(owner) = self.allocations.lock().remove(&addr) {
                owner.release(addr, &self.transports);
            }
            return Err(e);
        }
        Ok(addr)
    }

    /// Unregisters and frees memory from `allocate`.
    pub(crate) fn free_memory(&self, addr: u64) -> Result<()> {
        if !self.allocations.lock().contains_key(&addr) {
            return Err(Error::new(
                ErrorCode::NotFound,
                format!("{addr:#x} was not returned by allocate_memory (or is freed already)"),
            ));
        }
        self.unregister_memory(addr)?;
        if let Some(owner) = self.allocations.lock().remove(&addr) {
            owner.release(addr, &self.transports);
        }
        Ok(())
    }
}
