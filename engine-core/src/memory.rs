//! Memory registered with an engine: where each buffer is, and what every
//! transport returned when it was registered there.

use crate::error::{Error, ErrorCode, Result};
use crate::location::Location;
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// One transport's registration of a buffer.
#[derive(Clone, Debug)]
pub struct TransportRegistration {
    /// Index into the engine's transport list.
    pub transport: usize,
    pub handle: u64,
    pub key: Vec<u8>,
    /// How the transport registered it: one `FERRY_MEM_*` bit (for device
    /// memory, DMA-BUF or nvidia-peermem).
    pub mem_kind: u64,
}

/// Who may see a registered buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Visibility {
    /// In the segment descriptor: any peer may read and write it.
    Published,
    /// Reachable by peers, but only announced to one (staging buffers).
    Hidden,
    /// A local source or destination only; no peer reaches it.
    LocalOnly,
    /// Not registered at all: the application's memory, standing in one
    /// submission for the transports that move local memory without
    /// registering it (`FERRY_TRANSPORT_LOCAL_UNREGISTERED`). Never in the
    /// registry, never reachable by peers.
    Unregistered,
}

#[derive(Debug)]
pub struct LocalBuffer {
    pub addr: u64,
    pub len: u64,
    pub location: Location,
    /// One `FERRY_MEM_*` bit for host memory; 0 for device memory, which
    /// moves as each transport registered it (`registrations`) or staged.
    pub mem_kind: u64,
    /// The device plugin owning the memory (index), for device memory.
    pub device: Option<usize>,
    pub visibility: Visibility,
    pub registrations: Vec<TransportRegistration>,
    /// Requests in flight that read or write this buffer locally.
    pub inflight: AtomicUsize,
}

impl LocalBuffer {
    pub fn end(&self) -> u64 {
        self.addr + self.len
    }

    pub fn registration(&self, transport: usize) -> Option<&TransportRegistration> {
        self.registrations.iter().find(|r| r.transport == transport)
    }
}

/// Registered buffers by start address; they never overlap. Each keeps its
/// place in registration order (peers ask for "the first buffer
/// registered", Mooncake's `get_first_buffer_address`).
#[derive(Default)]
pub struct MemoryRegistry {
    /// Start address -> (registration number, buffer).
    buffers: RwLock<BTreeMap<u64, (u64, Arc<LocalBuffer>)>>,
    registered: AtomicU64,
}

impl MemoryRegistry {
    /// The buffer containing all of `[addr, addr + len)`.
    pub fn find(&self, addr: u64, len: u64) -> Option<Arc<LocalBuffer>> {
        let end = addr.checked_add(len)?;
        let map = self.buffers.read();
        let (_, (_, b)) = map.range(..=addr).next_back()?;
        (end <= b.end()).then(|| b.clone())
    }

    /// Fails when `[addr, addr + len)` overlaps a registered buffer.
    pub fn check_free(&self, addr: u64, len: u64) -> Result<()> {
        let end = addr.checked_add(len).ok_or_else(|| {
            Error::new(
                ErrorCode::InvalidArgument,
                "the buffer wraps around the address space",
            )
        })?;
        let map = self.buffers.read();
        if let Some((_, (_, b))) = map.range(..end).next_back() {
            if b.end() > addr {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!(
                        "[{addr:#x}, {end:#x}) overlaps the registered buffer [{:#x}, {:#x})",
                        b.addr,
                        b.end()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Adds a buffer; it is numbered after every buffer added before.
    pub fn insert(&self, buffer: Arc<LocalBuffer>) {
        let n = self.registered.fetch_add(1, Ordering::Relaxed) + 1;
        self.buffers.write().insert(buffer.addr, (n, buffer));
    }

    pub fn remove(&self, addr: u64) -> Option<Arc<LocalBuffer>> {
        self.buffers.write().remove(&addr).map(|(_, b)| b)
    }

    /// Every buffer, by address.
    pub fn all(&self) -> Vec<Arc<LocalBuffer>> {
        self.buffers
            .read()
            .values()
            .map(|(_, b)| b.clone())
            .collect()
    }

    /// Every buffer by address, each with its registration number (1 for
    /// the first registered, increasing; never reused).
    pub fn all_numbered(&self) -> Vec<(u64, Arc<LocalBuffer>)> {
        self.buffers.read().values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buffer(addr: u64) -> Arc<LocalBuffer> {
        Arc::new(LocalBuffer {
            addr,
            len: 16,
            location: Location::Cpu(0),
            mem_kind: 1,
            device: None,
            visibility: Visibility::Published,
            registrations: Vec::new(),
            inflight: AtomicUsize::new(0),
        })
    }

    #[test]
    fn registration_order_is_kept_beside_address_order() {
        let m = MemoryRegistry::default();
        for addr in [0x3000, 0x1000, 0x2000] {
            m.insert(buffer(addr));
        }
        m.remove(0x3000);
        m.insert(buffer(0x4000));
        let got: Vec<(u64, u64)> = m.all_numbered().iter().map(|(n, b)| (b.addr, *n)).collect();
        assert_eq!(got, [(0x1000, 2), (0x2000, 3), (0x4000, 4)]);
    }
}
